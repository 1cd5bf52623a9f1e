"""End-to-end DAPO training under torchrun on CPU (vLLM rollout + megatron-core update), through the launch scripts.

* a short run produces verl-named metrics, a checkpoint, an HF export and a plot;
* two "nodes" on one machine (two ``launch/run_node.sh`` invocations, NNODES=2) train together;
* a run stopped after step 2 and resumed to step 4 ends with the same weights as an uninterrupted 4-step run
  (step counter, data position, optimizer state and RNG all continue rather than restart).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.tasks.demo import prepare
from megatron_dapo.training.trainer import check_config
from megatron_dapo.weights.convert import convert_hf_to_mcore

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny_cpu.yaml"

REQUIRED_METRICS = [
    "critic/score/mean",
    "critic/score/max",
    "critic/score/min",
    "critic/rewards/mean",
    "critic/advantages/mean",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "actor/lr",
    "response_length/mean",
    "response_length/max",
    "response_length/min",
    "response_length/clip_ratio",
    "prompt_length/mean",
    "timing_s/gen",
    "timing_s/reward",
    "timing_s/old_log_prob",
    "timing_s/adv",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "timing_s/step",
    "timing_per_token_ms/gen",
    "perf/total_num_tokens",
    "perf/time_per_step",
    "perf/throughput",
    "perf/max_memory_allocated_gb",
    "perf/cpu_memory_used_gb",
    "train/num_gen_batches",
    "rollout/logprob_diff_mean",
    "rollout/logprob_diff_max",
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("demo")
    info = prepare(root, seed=0, train_rows=256)  # default format warm-start: mixed rewards from step 1
    convert_hf_to_mcore(info["hf_model"], root / "mcore", tp=1, pp=1)
    info["mcore"] = str(root / "mcore")
    info["root"] = root
    return info


def overrides(demo: dict, out: Path, steps: int, **extra) -> list[str]:
    items = {
        "model.hf_config_dir": demo["hf_model"],
        "model.tokenizer_dir": demo["tokenizer"],
        "checkpoint.load_dir": demo["mcore"],
        "data.train_files": f"[{demo['train']}]",
        "data.val_files": f"[{demo['val']}]",
        "trainer.output_dir": str(out),
        "trainer.total_training_steps": steps,
        "trainer.test_freq": 2,
        "data.train_batch_size": 4,
        "data.gen_batch_size": 6,
        "actor.ppo_mini_batch_size": 2,
        # Plumbing, not learning (the demo's tuning must not decide whether these pass): the lenient first-number
        # scorer gives mixed rewards from the start, and dynamic sampling (tested on its own in tests/algo) is off
        # so that a run can never stall on groups with equal rewards.
        "rollout.n": 8,
        "reward.custom_function.name": "compute_score",
        "algorithm.filter_groups.enable": "false",
        "actor.optim.lr": 1e-3,
        "actor.optim.lr_warmup_steps": 1,
    }
    items.update(extra)
    return [f"{k}={v}" for k, v in items.items()]


def launch(script: str, args: list[str], env: dict, timeout: float = 600) -> subprocess.Popen:
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable, **env)
    return subprocess.Popen(
        ["bash", str(REPO / "launch" / script), str(CONFIG), *args],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_ok(proc: subprocess.Popen, timeout: float = 600) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"training timed out\n{out[-6000:]}")
    assert proc.returncode == 0, out[-6000:]
    return out


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def export(checkpoints: Path, dest: Path) -> dict[str, torch.Tensor]:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_dapo.cli",
            "export",
            "--checkpoint",
            str(checkpoints),
            "--save-dir",
            str(dest),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        env=dict(os.environ),
    )
    return load_file(str(dest / "model.safetensors"))


def test_short_run_metrics_checkpoint_export_plot(demo, tmp_path):
    out = tmp_path / "run"
    wait_ok(launch("run_local.sh", overrides(demo, out, steps=3), {"NPROC_PER_NODE": "2", "MASTER_PORT": "29960"}))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # step 0: validation before training
    assert "val-core/arithmetic/acc/mean@1" in rows[0]
    for r in rows[1:]:
        missing = [k for k in REQUIRED_METRICS if k not in r]
        assert not missing, f"step {r['step']} lacks {missing}"
        assert r["rollout/logprob_diff_max"] < 1e-3  # vLLM and Megatron score the same weights
        assert 0.0 <= r["critic/score/mean"] <= 1.0
    assert "val-core/arithmetic/acc/mean@1" in rows[2] and "val-core/arithmetic/acc/mean@1" in rows[3]
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step_3"

    tensors = export(out / "checkpoints", tmp_path / "hf")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    initial = load_file(str(Path(demo["hf_model"]) / "model.safetensors"))
    assert set(tensors) == set(initial)
    assert any(not torch.equal(tensors[k], initial[k]) for k in initial), "training changed no weight"
    assert model.config.vocab_size == 104

    png = tmp_path / "curves.png"
    subprocess.run(
        [sys.executable, str(REPO / "tools" / "plot_metrics.py"), str(out / "metrics.jsonl"), "-o", str(png)],
        check=True,
        capture_output=True,
    )
    assert png.stat().st_size > 10_000


def test_two_nodes_on_one_machine(demo, tmp_path):
    out = tmp_path / "run"
    common = {"NNODES": "2", "NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29961"}
    args = overrides(demo, out, steps=2, **{"trainer.val_before_train": "false"})
    nodes = [launch("run_node.sh", args, dict(common, NODE_RANK=str(r))) for r in (0, 1)]
    for p in nodes:
        wait_ok(p)  # both nodes exit 0 only after the collective run completed on both
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["perf/throughput"] > 0 and r["rollout/logprob_diff_max"] < 1e-3 for r in rows)


def test_resume_continues_where_it_stopped(demo, tmp_path):
    straight = tmp_path / "straight"
    wait_ok(
        launch(
            "run_local.sh",
            overrides(demo, straight, steps=4, **{"checkpoint.save_freq": 2}),
            {"NPROC_PER_NODE": "2", "MASTER_PORT": "29962"},
        )
    )
    resumed = tmp_path / "resumed"
    wait_ok(launch("run_local.sh", overrides(demo, resumed, steps=2), {"NPROC_PER_NODE": "2", "MASTER_PORT": "29962"}))
    wait_ok(
        launch(
            "run_local.sh",
            overrides(demo, resumed, steps=4, **{"trainer.val_before_train": "false"}),
            {"NPROC_PER_NODE": "2", "MASTER_PORT": "29962"},
        )
    )
    rows = read_metrics(resumed)
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2, 3, 4]  # continued at 3, not restarted at 1
    first = {r["step"]: r for r in read_metrics(straight)}
    second = {r["step"]: r for r in rows}
    for step in (3, 4):  # same data, same samples, same optimizer state ⇒ same numbers after resuming
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/lr", "train/num_gen_batches"):
            assert second[step][key] == pytest.approx(first[step][key], rel=1e-5, abs=1e-7), (step, key)
    a = export(straight / "checkpoints", tmp_path / "hf_a")
    b = export(resumed / "checkpoints", tmp_path / "hf_b")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


def test_trainer_config_checks_name_the_field():
    cfg = load_config(CONFIG, ["actor.ppo_mini_batch_size=5"])
    with pytest.raises(ConfigError, match="actor.ppo_mini_batch_size=5 must divide data.train_batch_size=16"):
        check_config(cfg)
    cfg = load_config(CONFIG, ["checkpoint.load_dir=null"])
    with pytest.raises(ConfigError, match="checkpoint.load_dir is required"):
        check_config(cfg)
    cfg = load_config(CONFIG, ["algorithm.filter_groups.enable=true", "rollout.n=1"])
    with pytest.raises(ConfigError, match="rollout.n >= 2"):
        check_config(cfg)


def test_bad_data_row_fails_before_training_with_file_row_field(demo, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": [{"role": "user", "content": "1+1="}], "data_source": "arithmetic", "reward_model": {}})
        + "\n"
    )
    out = tmp_path / "run"
    proc = launch(
        "run_local.sh",
        overrides(demo, out, steps=1, **{"data.train_files": f"[{bad}]"}),
        {"NPROC_PER_NODE": "1", "MASTER_PORT": "29963"},
    )
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert str(bad) in log and "row 0" in log and "ground_truth" in log
