"""A launch that no rank can run stops before any process group exists (issue: a bad async placement hung with no
output; a config error came out as every rank's traceback, interleaved).

``launch/run_node.sh`` (so ``launch/run_local.sh``) runs ``megatron-dapo preflight`` with the job's world size before
torchrun: the run's rules (``config/plan.resolve``) print their problem list once and the launch exits 2 in seconds.
Under a torchrun started some other way, ``megatron-dapo train`` prints a config error on rank 0 only, with no
traceback, and every rank exits 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from subprocess import PIPE

import pytest

from tests.e2e.test_train_e2e import CONFIG, REPO, launch, overrides


def refused(demo: dict, tmp_path, **extra) -> tuple[int, list[str], float]:
    started = time.perf_counter()
    proc = launch("run_local.sh", overrides(demo, tmp_path / "run", 2, **extra), {"NPROC_PER_NODE": "2"})
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the launch did not stop by itself:\n{proc.communicate()[0][-4000:]}")
    return proc.returncode, [line for line in out.splitlines() if line.strip()], time.perf_counter() - started


def test_bad_async_placement_stops_in_seconds_with_one_line(demo, tmp_path):
    rc, lines, seconds = refused(demo, tmp_path, **{"trainer.mode": "async", "placement.rollout_ranks": 2})
    assert rc == 2 and lines == [
        "error: placement.rollout_ranks=2 with a job of 2 ranks: async mode needs at least one rank on each side; "
        "use 1 to 1 rollout ranks, or launch more processes"
    ], lines
    assert seconds < 60  # measured ~3 s: no rank was started
    assert not (tmp_path / "run").exists()  # nothing was written


def test_rule_error_prints_its_problem_list_once_without_traceback(demo, tmp_path):
    # Two problems only the full rules see together (the layout against the world size, the LoRA module names).
    rc, lines, _ = refused(
        demo,
        tmp_path,
        **{"parallel.tensor_model_parallel_size": 3, "actor.lora.rank": 8, "actor.lora.target_modules": "[linear_qvk]"},
    )
    assert rc == 2 and lines[0].startswith("error: "), lines
    assert not any("Traceback" in line or "ChildFailedError" in line for line in lines), lines
    assert sum("actor.lora.target_modules" in line for line in lines) == 1, lines


def test_train_prints_a_config_error_on_rank_0_only(demo, tmp_path):
    # The demo's model, tokenizer and data (on a fresh clone the config's own paths do not exist yet)
    bad = [*overrides(demo, tmp_path / "run", 2), "actor.lora.rank=8", "actor.lora.target_modules=[linear_qvk]"]
    cmd = [sys.executable, "-m", "megatron_dapo.cli", "train", str(CONFIG), *bad]
    started = {  # as torchrun starts the ranks: together, each its own process with RANK set
        rank: subprocess.Popen(
            cmd, cwd=REPO, env=dict(os.environ, RANK=rank, OMP_NUM_THREADS="1"), stdout=PIPE, stderr=PIPE, text=True
        )
        for rank in ("0", "1")
    }
    said = {}
    try:
        for rank, proc in started.items():
            stdout, stderr = proc.communicate(timeout=120)
            said[rank] = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
            assert said[rank].returncode == 2, said[rank].stderr[-3000:]
    finally:
        for proc in started.values():  # none outlives a failure
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert said["1"].stdout == said["1"].stderr == ""  # the other ranks exit quietly with the same code
    err = said["0"].stderr
    assert err.startswith("error: actor.lora.target_modules=['linear_qvk']") and said["0"].stdout == ""
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_train_names_a_missing_model_with_the_other_problems(tmp_path):
    missing = tmp_path / "no_model"
    bad = [f"model.hf_config_dir={missing}", "actor.lora.rank=8", "actor.lora.target_modules=[linear_qvk]"]
    env = dict(os.environ, RANK="0", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "megatron_dapo.cli", "train", str(CONFIG), *bad]
    said = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert said.returncode == 2 and "Traceback" not in said.stderr, said.stderr[-3000:]
    assert "actor.lora.target_modules=['linear_qvk']" in said.stderr  # the rules' problems, and the missing model
    assert f"HF config not found: {missing}" in said.stderr
