"""A bf16 actor's logits reach the loss hook in bf16 (no hidden fp32 copy of ``[tokens, vocab / TP]``), with the
same log-probs as megatron-core's default fp32 output (``tests/training/logits_dtype_worker.py``, one process)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import run_torchrun

WORKER = Path(__file__).with_name("logits_dtype_worker.py")


def test_bf16_logits_stay_bf16(tmp_path):
    out = tmp_path / "report.json"
    run_torchrun(WORKER, nproc=1, args=["--out", str(out)], port=29888, timeout=300)
    report = json.loads(out.read_text())
    assert report["logits_dtypes"] == ["torch.bfloat16"]
    assert report["tokens"] > 0 and report["max_diff_vs_fp32_output"] == 0.0
