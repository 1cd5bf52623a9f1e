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

from megatron_dapo.checkpointing.export import export_step
from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.config.plan import resolve
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.platform import make_platform

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


def launch(script: str, args: list[str], env: dict, config: Path = CONFIG) -> subprocess.Popen:
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable, **env)
    return subprocess.Popen(
        ["bash", str(REPO / "launch" / script), str(config), *args],
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


def leftover_processes(marker: Path) -> list[str]:
    """Processes still alive whose command line or environment names ``marker`` (a run's own directory)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(str(marker) in part for part in p.info["cmdline"] or []):
                found.append(f"{p.info['pid']}: {' '.join(p.info['cmdline'])[:200]}")
        except (psutil.Error, TypeError):
            continue
    return found


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def export(checkpoints: Path, dest: Path, step: int | None = None, cli: bool = False) -> dict[str, torch.Tensor]:
    """The HF tensors of a run's checkpoint: through ``megatron-dapo export`` (``cli``), else the function it calls,
    in this process (a comparison needs the tensors, not another interpreter's start-up)."""
    if cli:
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
                *(["--step", str(step)] if step is not None else []),
            ],
            cwd=REPO,
            check=True,
            capture_output=True,
            env=dict(os.environ),
        )
    else:
        export_step(checkpoints, dest, step=step)
    return load_file(str(dest / "model.safetensors"))


def test_short_run_metrics_checkpoint_export_plot(demo, tmp_path):
    out = tmp_path / "run"
    # Rewards scored in a worker process while vLLM generates (reward.overlap_generation, on by default): 24 requests
    # per replica, at most 8 running, so the first ones end while the others still generate.
    scored_early = {"reward.num_workers": 1, "rollout.max_num_seqs": 8}
    args = overrides(demo, out, steps=3, **scored_early)
    wait_ok(launch("run_local.sh", args, {"NPROC_PER_NODE": "2", "MASTER_PORT": "29960"}))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # step 0: validation before training
    assert "val-core/arithmetic/acc/mean@1" in rows[0]
    for r in rows[1:]:
        missing = [k for k in REQUIRED_METRICS if k not in r]
        assert not missing, f"step {r['step']} lacks {missing}"
        assert r["rollout/logprob_diff_max"] < 1e-3  # vLLM and Megatron score the same weights
        assert 0.0 <= r["critic/score/mean"] <= 1.0
        assert r["reward/scored_during_gen"] > 0, r["reward/scored_during_gen"]
    assert "val-core/arithmetic/acc/mean@1" in rows[2] and "val-core/arithmetic/acc/mean@1" in rows[3]
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step_3"

    tensors = export(out / "checkpoints", tmp_path / "hf", cli=True)
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
    # The DP gradient all-reduce overlapped with the backward, bucket by bucket (parallel.overlap_grad_reduce).
    overlap = {"parallel.overlap_grad_reduce": "true", "parallel.ddp_bucket_size": 200_000}
    args = overrides(demo, out, steps=2, **{"trainer.val_before_train": "false", **overlap})
    nodes = [launch("run_node.sh", args, dict(common, NODE_RANK=str(r))) for r in (0, 1)]
    for p in nodes:
        wait_ok(p)  # both nodes exit 0 only after the collective run completed on both
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["perf/throughput"] > 0 and r["rollout/logprob_diff_max"] < 1e-3 for r in rows)
    assert all(r["actor/update_ok"] == 1.0 for r in rows)  # the overlapped reduction's gradients were applied


STRAIGHT_STEPS = 4
COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/lr", "train/num_gen_batches")


@pytest.fixture(scope="module")
def straight(demo, tmp_path_factory) -> Path:
    """An uninterrupted 4-step run (checkpoints at steps 2 and 4): the reference for every interrupted run."""
    out = tmp_path_factory.mktemp("straight")
    wait_ok(
        launch(
            "run_local.sh",
            overrides(demo, out, steps=STRAIGHT_STEPS, **{"checkpoint.save_freq": 2}),
            {"NPROC_PER_NODE": "2", "MASTER_PORT": "29962"},
        )
    )
    return out


def assert_same_as_straight(straight: Path, resumed: Path, steps: tuple[int, ...], tmp_path: Path) -> None:
    first = {r["step"]: r for r in read_metrics(straight)}
    second = {r["step"]: r for r in read_metrics(resumed)}
    for step in steps:  # same data, same samples, same optimizer state ⇒ same numbers after resuming
        for key in COMPARED:
            assert second[step][key] == pytest.approx(first[step][key], rel=1e-5, abs=1e-7), (step, key)
    a = export(straight / "checkpoints", tmp_path / "hf_a")
    b = export(resumed / "checkpoints", tmp_path / "hf_b")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


def test_resume_continues_where_it_stopped(demo, straight, tmp_path):
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
    assert_same_as_straight(straight, resumed, (3, 4), tmp_path)


def test_resuming_a_finished_run_does_nothing(demo, straight):
    before = (straight / "metrics.jsonl").read_text()
    out = wait_ok(
        launch(
            "run_local.sh",
            overrides(demo, straight, steps=STRAIGHT_STEPS, **{"checkpoint.save_freq": 2}),
            {"NPROC_PER_NODE": "2", "MASTER_PORT": "29962"},
        )
    )
    assert "nothing to do: the run is complete (resumed at step 4, trainer.total_training_steps=4)" in out
    assert (straight / "metrics.jsonl").read_text() == before  # no step row logged again
    assert (straight / "checkpoints" / "latest").read_text().strip() == "global_step_4"


# A reward function file that scores like the demo's lenient scorer and, at a chosen call on a chosen rank, does
# what a real run meets: a SIGTERM from the scheduler, or a crash that escapes the reward manager. Scoring is
# in-process (reward.num_workers=0) and shared: rank r scores rows r, r + 2, ... of every batch.
SCORER = """
import os, signal
from megatron_dapo.tasks.arithmetic import compute_score as _score

class RewardCrash(BaseException):  # not an Exception: the reward manager does not catch it
    pass

_calls = 0

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    global _calls
    _calls += 1
    if _calls == {call} and os.environ.get("RANK") in {ranks}:
        {action}
    return _score(data_source, solution_str, ground_truth, extra_info)
"""
# Per rank: validation before training (25-row table: 13 rows on rank 0, 12 on rank 1), 24 of each step's 48
# rollouts, validation again at step 2. Rank 1's calls 37-60 score step 2's rollouts; rank 0's 75-98 step 3's.
CALL_IN_STEP_2, CALL_IN_STEP_3 = 45, 80


def scorer_file(tmp_path: Path, call: int, ranks: tuple[str, ...], action: str) -> str:
    path = tmp_path / "scorer.py"
    path.write_text(SCORER.format(call=call, ranks=ranks, action=action))
    return str(path)


def test_sigterm_mid_step_saves_at_the_boundary_and_resume_matches(demo, straight, tmp_path):
    """SIGTERM reaches rank 1 only, in the middle of step 2: both ranks finish step 2, agree to stop, exit 0 with
    step 2 saved; resuming to step 4 ends identical to the uninterrupted run."""
    run = tmp_path / "run"
    scorer = scorer_file(tmp_path, CALL_IN_STEP_2, ("1",), "os.kill(os.getpid(), signal.SIGTERM)")
    extra = {"checkpoint.save_freq": 2, "reward.custom_function.path": scorer}
    out = wait_ok(
        launch(
            "run_local.sh",
            overrides(demo, run, steps=STRAIGHT_STEPS, **extra),
            {"NPROC_PER_NODE": "2", "MASTER_PORT": "29964"},
        )
    )
    assert "stopping after step 2 of 4" in out  # rank 0's console
    assert "received SIGTERM" in (run / "logs" / "rank1.log").read_text()  # the signalled rank's own log
    assert [r["step"] for r in read_metrics(run) if "actor/pg_loss" in r] == [1, 2]
    assert (run / "checkpoints" / "latest").read_text().strip() == "global_step_2"
    # resume with the plain scorer (the same scores) to the end
    wait_ok(
        launch(
            "run_local.sh",
            overrides(
                demo, run, steps=STRAIGHT_STEPS, **{"checkpoint.save_freq": 2, "trainer.val_before_train": "false"}
            ),
            {"NPROC_PER_NODE": "2", "MASTER_PORT": "29964"},
        )
    )
    assert [r["step"] for r in read_metrics(run) if "actor/pg_loss" in r] == [1, 2, 3, 4]
    assert_same_as_straight(straight, run, (3, 4), tmp_path)


def test_exception_mid_run_saves_the_last_completed_step(demo, straight, tmp_path):
    """A crash escaping the reward manager on rank 0 in step 3 (save_freq=-1: nothing saved yet) stops every rank
    with that error, leaves a loadable checkpoint of step 2 equal to the uninterrupted run's step 2, and a non-zero
    exit naming the error."""
    run = tmp_path / "run"
    scorer = scorer_file(tmp_path, CALL_IN_STEP_3, ("0",), "raise RewardCrash('scorer blew up')")
    proc = launch(
        "run_local.sh",
        overrides(demo, run, steps=STRAIGHT_STEPS, **{"reward.custom_function.path": scorer}),
        {"NPROC_PER_NODE": "2", "MASTER_PORT": "29965"},
    )
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0
    assert "RewardCrash" in out and "scorer blew up" in out
    assert "reward scoring failed on rank 0: RewardCrash: scorer blew up" in out  # what rank 1 reports
    assert "saved its last completed step 2" in out
    assert not leftover_processes(run), "a failed run left processes behind"
    assert (run / "checkpoints" / "latest").read_text().strip() == "global_step_2"
    a = export(straight / "checkpoints", tmp_path / "hf_straight", step=2)
    b = export(run / "checkpoints", tmp_path / "hf_failed")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


def test_trainer_config_checks_name_the_field():
    # train's gate (config/plan.resolve, run by training/startup.py before any process group)
    def gate(overrides: list[str]) -> None:
        hf = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256,
              "vocab_size": 32, "max_position_embeddings": 64}  # fmt: skip
        cfg = load_config(CONFIG, [*overrides, "reward.custom_function.path=null"])  # no reward file is imported
        resolve(cfg, model_arch_from_hf(hf), 2, make_platform("cpu"), probe_imports=False)

    with pytest.raises(ConfigError, match="actor.ppo_mini_batch_size=5 must divide data.train_batch_size=16"):
        gate(["actor.ppo_mini_batch_size=5"])
    with pytest.raises(ConfigError, match="checkpoint.load_dir is required"):
        gate(["checkpoint.load_dir=null"])
    with pytest.raises(ConfigError, match="rollout.n >= 2"):
        gate(["algorithm.filter_groups.enable=true", "rollout.n=1"])


def test_bad_data_row_fails_before_training_with_file_row_field(demo, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": [{"role": "user", "content": "1+1="}], "data_source": "arithmetic", "reward_model": {}})
        + "\n"
    )
    out = tmp_path / "run"
    proc = launch(
        "run_local.sh",
        overrides(demo, out, steps=2, **{"data.train_files": f"[{bad}]"}),
        {"NPROC_PER_NODE": "1", "MASTER_PORT": "29963"},
    )
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert str(bad) in log and "row 0" in log and "ground_truth" in log


def test_a_killed_rank_restarts_the_job_which_finishes_from_its_newest_checkpoint(demo, straight, tmp_path):
    """SIGKILL of rank 1 in the middle of step 3 (save_freq=2), once: with MAX_RESTARTS=1 torchrun restarts both
    ranks, they resume from step 2 (the newest intact checkpoint) and finish step 4 with rc 0; no completed step is
    lost, and the result is the uninterrupted run's."""
    run = tmp_path / "run"
    mark = tmp_path / "killed_once"  # the kill happens in the first attempt only
    kill = f"(open({str(mark)!r}, 'x').close(), os.kill(os.getpid(), signal.SIGKILL))"
    action = f"{kill} if not os.path.exists({str(mark)!r}) else None"
    scorer = scorer_file(tmp_path, CALL_IN_STEP_3, ("1",), action)
    extra = {"checkpoint.save_freq": 2, "reward.custom_function.path": scorer}
    out = wait_ok(
        launch(
            "run_local.sh",
            overrides(demo, run, steps=STRAIGHT_STEPS, **extra),
            {"NPROC_PER_NODE": "2", "MASTER_PORT": "29991", "MAX_RESTARTS": "1"},
        )
    )
    assert mark.exists(), out[-4000:]  # rank 1 was killed
    # What the user reads first is the dead rank, its role and place, and how to resume: no gloo text before it.
    first_error = next(line for line in out.splitlines() if "error" in line.lower() or "died" in line)
    assert "rank 1 (training, TP 0, PP 0, DP 1) died: its process (pid " in first_error, out[-4000:]
    assert f"To resume from {run / 'checkpoints' / 'global_step_2'}: run the same command again" in first_error
    rank0_log = (run / "logs" / "rank0.log").read_text()  # both attempts append to it
    assert "rank 0 stops: RuntimeError" in rank0_log and "resumed from" in rank0_log  # attempt 1 failed, 2 resumed
    resumed = rank0_log.split("resumed from", 1)[1].split("\n", 1)[0]
    assert resumed.endswith("global_step_2 at step 2"), rank0_log[-3000:]
    steps = [r["step"] for r in read_metrics(run) if "actor/pg_loss" in r]
    assert steps == [1, 2, 3, 4], steps  # step 3 died before it was logged; nothing completed is logged twice
    assert (run / "checkpoints" / "latest").read_text().strip() == "global_step_4"
    assert not leftover_processes(run), "the restarted run left processes behind"
    assert_same_as_straight(straight, run, (3, 4), tmp_path)
