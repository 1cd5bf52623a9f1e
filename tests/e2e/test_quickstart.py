"""The README's main command: ``bash launch/quickstart.sh`` makes the demo, converts it, trains DAPO (40 of its 60
steps) on 2 CPU processes, exports and plots — and the model learns the addition table, with no warning and no
traceback on the console.

The learning claim is checked twice: by the trainer's own validation (vLLM greedy, in metrics.jsonl and the script's
last line) and independently, by HF transformers greedy decoding with the exported checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_dapo.data import load_rows

REPO = Path(__file__).resolve().parents[2]
LAST_LINE = re.compile(r"first_val_acc=([0-9.]+) final_val_acc=([0-9.]+) steps=(\d+) wall_s=(\d+)")
# A console line that raises an alarm: a logged warning, a C++ one ("[W... file.cpp:N] Warning: ..."), a Python
# warning ("UserWarning: ..."), a traceback. Known-benign library messages are kept off the console
# (megatron_dapo/log_filters.py, BENIGN_MESSAGES); a healthy run shows none.
ALARM = re.compile(r"\bWARNING\b|\bWarning:|\w+Warning\b|Traceback \(most recent call last\)")
STEPS = 40


@pytest.mark.slow
def test_quickstart_learns_the_table(tmp_path: Path) -> None:
    out = tmp_path / "quickstart"
    env = dict(os.environ, QUICKSTART_DIR=str(out), MASTER_PORT="29964")
    # The README's command with 40 of its 60 steps (extra arguments are config overrides): validation is >= 0.9 from
    # step 40 on, and the last 20 steps add no check.
    proc = subprocess.run(
        ["bash", "launch/quickstart.sh", f"trainer.total_training_steps={STEPS}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    alarms = [line for line in log.splitlines() if ALARM.search(line)]
    assert not alarms, f"{len(alarms)} warning/traceback line(s) on a healthy run's console:\n" + "\n".join(alarms[:40])
    last = proc.stdout.strip().splitlines()[-1]
    match = LAST_LINE.fullmatch(last)
    assert match, f"last line {last!r}"
    first_acc, final_acc, steps = float(match[1]), float(match[2]), int(match[3])
    assert steps == STEPS
    assert first_acc <= 0.3  # about chance (1/9) before training
    assert final_acc >= 0.9

    # metrics.jsonl: one JSON object per step, the validation curve matching the last line
    run = out / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    val = [r["val-core/arithmetic/acc/mean@1"] for r in rows if "val-core/arithmetic/acc/mean@1" in r]
    assert len(val) == STEPS // 5 + 1 and val[0] == first_acc and val[-1] == final_acc  # step 0, then every 5 steps
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "checkpoints" / "latest").read_text().strip() == f"global_step_{STEPS}"

    # the exported model, decoded greedily by HF transformers on the whole table
    tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer")
    model = AutoModelForCausalLM.from_pretrained(run / "hf_export").eval()
    table = load_rows([out / "data" / "val.parquet"])
    correct = 0
    for row in table:
        text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=4, do_sample=False)
        answer = tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True).strip()
        correct += answer == row["reward_model"]["ground_truth"]
    assert correct / len(table) >= 0.9, f"HF greedy accuracy {correct}/{len(table)}"
