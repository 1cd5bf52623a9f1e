"""Converted checkpoints under torchrun: megatron-core logits vs HF, reshard on load, save from a live model."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from megatron_dapo.weights.convert import convert_hf_to_mcore, convert_mcore_to_hf
from megatron_dapo.weights.mcore_checkpoint import rank_file
from tests.helpers import run_torchrun
from tests.weights.conftest import assert_same_tensors, load_hf_tensors

REPO = Path(__file__).resolve().parents[2]
VERIFY = REPO / "tools" / "checkpoint_convert" / "verify.py"
WORKER = Path(__file__).with_name("reshard_save_worker.py")
TOL = 1e-4


def _diff(stdout: str) -> float:
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("max_abs_logits_diff="), f"output does not end with the diff line:\n{stdout}"
    return float(lines[-1].split("=", 1)[1])


def _load_report(stdout: str) -> list[dict]:
    line = next(ln for ln in stdout.splitlines() if ln.startswith("load_report="))
    return json.loads(line.split("=", 1)[1])


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,tie,sp,port", [("qwen2", True, True, 29701), ("qwen3", False, False, 29702), ("llama", False, True, 29703)]
)
def test_verify_tp2_pp2(tiny_hf, tmp_path, family, tie, sp, port):
    hf = tiny_hf(family, tie)
    convert_hf_to_mcore(hf, tmp_path / "m", tp=2, pp=2)
    args = ["--hf-dir", hf, "--mcore-dir", tmp_path / "m", "--tp", "2", "--pp", "2", "--tol", str(TOL)]
    out = run_torchrun(VERIFY, 4, args + (["--sp"] if sp else []), port=port, timeout=400)
    diff = _diff(out)
    assert 0.0 <= diff <= TOL
    # Same layout: every rank read its own file and nothing else (ranks: tp fastest, then pp).
    report = _load_report(out)
    assert [r["files"] for r in report] == [[str(Path(rank_file("", t, p)))] for p in (0, 1) for t in (0, 1)]
    assert all(r["same_layout"] for r in report)


@pytest.mark.slow
def test_reshard_on_load_with_virtual_stages_then_save(tiny_hf, tmp_path):
    """Converted at TP=2 PP=1, run at TP=1 PP=2 VPP=2 (vocabulary re-padded 256 → 128, tied output layer built from
    the embedding), then saved from that layout and converted back to HF: bit-exact with the source."""
    hf = tiny_hf("qwen2", True)
    convert_hf_to_mcore(hf, tmp_path / "m", tp=2, pp=1)
    (tmp_path / "out").mkdir()
    run_torchrun(
        WORKER, 2,
        ["--out", tmp_path / "out", "--save-dir", tmp_path / "saved", "--hf-dir", hf, "--mcore-dir", tmp_path / "m",
         "--tp", "1", "--pp", "2", "--vpp", "2"],
        port=29704, timeout=400,
    )
    results = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(0.0 <= r["max_abs_logits_diff"] <= TOL for r in results)
    assert not any(r["same_layout"] for r in results)
    # Each TP=1 rank merged the two old TP shards: it read both files.
    assert all(len(r["files"]) == 2 for r in results)

    saved = tmp_path / "saved"
    meta = json.loads((saved / "mcore_meta.json").read_text())
    assert (meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"]) == (1, 2)
    assert (meta["virtual_pipeline_model_parallel_size"], meta["padded_vocab_size"]) == (2, 128)
    # With VPP=2 pipeline rank 0 holds layers 0 and 2, rank 1 layers 1 and 3 (global names in the files).
    layers = [{n.split(".")[2] for n in load_file(str(rank_file(saved, 0, p))) if n.startswith("decoder.layers.")}
              for p in (0, 1)]
    assert layers == [{"0", "2"}, {"1", "3"}]
    assert "output_layer.weight" in load_file(str(rank_file(saved, 0, 1)))
    assert (saved / "hf_config" / "config.json").is_file()
    back = convert_mcore_to_hf(saved, tmp_path / "hf2")
    assert_same_tensors(load_hf_tensors(hf), load_hf_tensors(back.save_dir))


def test_verify_fails_on_a_wrong_checkpoint(tiny_hf, tmp_path):
    """Exit status 1 and a large diff when the checkpoint is not the HF model's (another seed, same shapes)."""
    convert_hf_to_mcore(tiny_hf("llama", seed=1), tmp_path / "m")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--master-port=29705", str(VERIFY),
           "--hf-dir", str(tiny_hf("llama")), "--mcore-dir", str(tmp_path / "m"), "--batch-size", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    assert _diff(out.stdout) > 0.1
    assert re.search(r"checkpoint .*: same layout", out.stdout)
