"""``megatron-dapo eval`` end to end on the tiny demo model: the same numbers as the trainer's validation.

One short training run (2 processes, rollout DP 2) validates its final weights with *sampled* validation (n = 4,
temperature 1) and saves a checkpoint. Then, on that checkpoint:

* ``megatron-dapo eval`` in one process (the training checkpoint is exported to HF on the fly, the config saved
  with it supplies the sampling settings, tokenizer and reward function) reports exactly the trainer's
  ``val-core/arithmetic/acc/mean@4``, and its samples file recomputes to its summary;
* the same under ``torchrun`` with 2 processes (rollout DP 2; rank 0 exports, rank 1 waits for it), given the step
  directory, gives the identical summary and samples: per-request seeds make samples independent of the layout;
* ``megatron-dapo export`` of the checkpoint, evaluated with no ``--config`` from another working directory, gives
  the identical summary and samples too: the export carries the run's settings (``megatron_dapo_eval.json``) and
  tokenizer;
* an HF model without recorded settings (the demo's, ``max_position_embeddings`` 64) runs with defaults fitted to
  it, and one console line names them.

The converter-output path (``mcore`` → HF) is checked without an engine in ``test_eval_metrics.py``.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_torchrun

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny_cpu.yaml"
WORKER = Path(__file__).with_name("eval_worker.py")
# 29970-29979: tests/eval
TRAIN_PORT, EVAL_PORT = 29970, 29971


def run(cmd: list[str], env: dict | None = None, timeout: float = 400, cwd: Path = REPO) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        full_env.pop(key, None)
    full_env.update(env or {})
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return proc


@pytest.fixture(scope="module")
def trained(demo_small, tmp_path_factory) -> dict:
    demo = demo_small  # tests/conftest.py: prepare(root, seed=0, train_rows=64), converted; read only
    root = tmp_path_factory.mktemp("eval")
    out = root / "run"
    overrides = {
        "model.hf_config_dir": demo["hf_model"],
        "model.tokenizer_dir": demo["tokenizer"],
        "checkpoint.load_dir": demo["mcore"],
        "data.train_files": f"[{demo['train']}]",
        "data.val_files": f"[{demo['val']}]",
        "trainer.output_dir": str(out),
        "trainer.total_training_steps": 1,
        "trainer.val_before_train": "false",
        "trainer.test_freq": 1,
        "data.train_batch_size": 4,
        "data.gen_batch_size": 4,
        "actor.ppo_mini_batch_size": 4,
        "rollout.n": 4,
        "reward.custom_function.name": "compute_score",  # lenient first-number scorer: mixed outcomes
        "algorithm.filter_groups.enable": "false",
        "actor.optim.lr": 1e-3,
        "actor.optim.lr_warmup_steps": 0,
        "rollout.val_kwargs.n": 4,
        "rollout.val_kwargs.temperature": 1.0,
        "rollout.val_kwargs.do_sample": "true",
    }
    run(
        ["bash", str(REPO / "launch" / "run_local.sh"), str(CONFIG), *[f"{k}={v}" for k, v in overrides.items()]],
        env={"NPROC_PER_NODE": "2", "MASTER_PORT": str(TRAIN_PORT)},
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"demo": demo, "root": root, "checkpoints": out / "checkpoints", "metrics": rows[-1]}


def read_samples(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def single_eval(trained) -> dict:
    out = Path(trained["root"]) / "eval1"
    stdout = run(
        [sys.executable, "-m", "megatron_dapo.cli", "eval", "--model", str(trained["checkpoints"])]
        + ["--data", trained["demo"]["val"], "--output-dir", str(out)]
    ).stdout
    return {"out": out, "stdout": stdout}


def test_eval_matches_trainer_validation(trained, single_eval):
    val = trained["metrics"]["val-core/arithmetic/acc/mean@4"]
    out, stdout = single_eval["out"], single_eval["stdout"]
    summary = json.loads((out / "summary.json").read_text())
    got = summary["arithmetic"]
    assert got["mean@4"] == pytest.approx(val, abs=1e-12), (got, val)
    assert 0.0 < val < 1.0  # a non-trivial number to agree on
    assert f'"mean@4": {got["mean@4"]}' in stdout

    # the report recomputes from the samples file (25 prompts x 4 responses, in prompt/sample order)
    samples = read_samples(out / "samples.jsonl")
    assert len(samples) == 100 and got["num_prompts"] == 25
    assert [(s["prompt_index"], s["sample_index"]) for s in samples] == [(i, j) for i in range(25) for j in range(4)]
    for s in samples:
        # the scorer's verdict: the first number of the response equals the answer
        assert s["acc"] == float(s["pred"] is not None and s["pred"] == s["ground_truth"]), s
        assert s["prompt"].endswith("=<|im_end|>\n<|im_start|>assistant\n")
    assert got["mean@4"] == sum(s["acc"] for s in samples) / 100
    for k in (1, 2, 4):
        brute = 0.0
        for i in range(25):
            outcomes = [s["acc"] > 0 for s in samples[4 * i : 4 * i + 4]]
            subsets = list(itertools.combinations(outcomes, k))
            brute += sum(any(sub) for sub in subsets) / len(subsets)
        assert got[f"pass@{k}"] == pytest.approx(brute / 25, abs=1e-12)
    assert got["response_length/mean"] == sum(s["response_length"] for s in samples) / 100
    assert got["truncation_rate"] == sum(s["truncated"] for s in samples) / 100
    assert {"maj@2", "maj@4"} <= set(got)
    assert not (out / ".eval_hf_model").exists()  # the temporary export is removed


def test_eval_under_torchrun_on_a_step_directory(trained, single_eval, tmp_path):
    out = tmp_path / "eval2"
    step = trained["checkpoints"] / "global_step_1"
    run_torchrun(
        WORKER,
        nproc=2,
        args=["eval", "--model", str(step), "--data", trained["demo"]["val"], "--output-dir", str(out)],
        port=EVAL_PORT,
        timeout=400,
    )
    single = single_eval["out"]
    assert json.loads((out / "summary.json").read_text()) == json.loads((single / "summary.json").read_text())
    assert read_samples(out / "samples.jsonl") == read_samples(single / "samples.jsonl")
    assert not (out / ".eval_hf_model").exists()


def eval_lines(stderr: str) -> list[str]:
    """The eval's own console lines about its settings."""
    return [line for line in stderr.splitlines() if line.startswith("eval: ")]


def test_eval_on_an_export_without_config_matches_the_training_config(trained, single_eval, tmp_path):
    export = tmp_path / "hf_export"
    cli = [sys.executable, "-m", "megatron_dapo.cli"]
    run(cli + ["export", "--checkpoint", str(trained["checkpoints"]), "--save-dir", str(export)])
    assert (export / "megatron_dapo_eval.json").is_file() and (export / "tokenizer" / "tokenizer.json").is_file()
    out = tmp_path / "eval_export"
    # Another working directory: nothing may rely on the run's relative paths (tokenizer, reward file).
    proc = run(
        cli + ["eval", "--model", str(export), "--data", trained["demo"]["val"], "--output-dir", str(out)], cwd=tmp_path
    )
    single = single_eval["out"]  # the eval with the training run's own config
    got = json.loads((out / "summary.json").read_text())
    assert got == json.loads((single / "summary.json").read_text())
    assert got["arithmetic"]["mean@4"] == trained["metrics"]["val-core/arithmetic/acc/mean@4"]
    assert read_samples(out / "samples.jsonl") == read_samples(single / "samples.jsonl")
    lines = eval_lines(proc.stderr)
    assert len(lines) == 1 and "using the settings recorded with the model" in lines[0], lines
    assert "rollout.val_kwargs n=4, temperature=1.0" in lines[0] and "compute_score" in lines[0]


def test_eval_on_an_hf_model_without_settings_fits_its_defaults(trained, tmp_path):
    demo = trained["demo"]
    out = tmp_path / "eval_hf"
    reward = f"reward.custom_function.path={REPO / 'megatron_dapo' / 'tasks' / 'arithmetic.py'}"
    proc = run(
        [sys.executable, "-m", "megatron_dapo.cli", "eval", "--model", demo["hf_model"], "--data", demo["val"]]
        + ["--output-dir", str(out), "--tokenizer", demo["tokenizer"], reward]
    )
    lines = eval_lines(proc.stderr)
    assert len(lines) == 1, lines
    assert "has no recorded settings" in lines[0] and "max_position_embeddings=64" in lines[0]
    assert "data.max_prompt_length=32, data.max_response_length=32" in lines[0] and "n=1, greedy" in lines[0]
    got = json.loads((out / "summary.json").read_text())["arithmetic"]
    assert got["num_prompts"] == 25 and got["num_responses"] == 25
    samples = read_samples(out / "samples.jsonl")
    assert got["mean@1"] == sum(s["acc"] for s in samples) / 25
    assert all(s["response_length"] <= 32 for s in samples)
