"""launch/ray_launch.py on a real local Ray cluster (head bound to this machine, 4 CPUs, no dashboard).

* a 1-node job with 2 processes and a 2-"node" job (two bundles on this one node, ``--allow-same-node``, NODE_RANK
  0/1, one process each) train the tiny config for 2 steps; node 0's output is streamed;
* a bad override makes the nodes' torchruns exit non-zero: the launcher exits 1 naming the node and showing the
  error, and no torchrun is left behind;
* STRICT_SPREAD over 2 nodes cannot be placed on a 1-node cluster: a clear error naming ``--allow-same-node``.

The Ray head is started by the fixture and stopped at the end (its process tree, by pid).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "launch" / "ray_launch.py"
CONFIG = REPO / "configs" / "tiny_cpu.yaml"
RAY = Path(sys.executable).with_name("ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    root.terminate()  # ray start --block stops the processes it started
    psutil.wait_procs([root], timeout=30)
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def processes_mentioning(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in p.info["cmdline"] or []):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


@pytest.fixture(scope="module")
def ray_cluster():
    temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    port = free_port()
    log = open(Path(temp_dir) / "head.log", "w")
    cmd = [str(RAY), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}"]
    cmd += ["--num-cpus=4", "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}"]
    head = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ))
    try:
        deadline = time.time() + 120
        while "block forever" not in (Path(temp_dir) / "head.log").read_text():
            assert head.poll() is None, (Path(temp_dir) / "head.log").read_text()[-3000:]
            assert time.time() < deadline, "ray head did not start in 120 s"
            time.sleep(1)
        yield f"127.0.0.1:{port}"
    finally:
        kill_tree(head.pid)
        log.close()
        leftover = processes_mentioning(temp_dir)
        for p in leftover:
            p.kill()
        assert not leftover, f"Ray processes left behind: {[p.pid for p in leftover]}"


@pytest.fixture(scope="module")
def demo(demo_small) -> dict:
    """tests/conftest.py's demo of 64 training rows (``prepare(root, seed=0, train_rows=64)``, converted)."""
    return demo_small


def overrides(demo: dict, out: Path, **extra) -> list[str]:
    items = {
        "model.hf_config_dir": demo["hf_model"],
        "model.tokenizer_dir": demo["tokenizer"],
        "checkpoint.load_dir": demo["mcore"],
        "data.train_files": f"[{demo['train']}]",
        "data.val_files": f"[{demo['val']}]",
        "trainer.output_dir": str(out),
        "trainer.total_training_steps": 2,
        "trainer.val_before_train": "false",
        "trainer.test_freq": -1,
        "data.train_batch_size": 4,
        "data.gen_batch_size": 4,
        "actor.ppo_mini_batch_size": 4,
        "rollout.n": 4,
        "reward.custom_function.name": "compute_score",
        "algorithm.filter_groups.enable": "false",
        "actor.optim.lr_warmup_steps": 0,
    }
    items.update(extra)
    return [f"{k}={v}" for k, v in items.items()]


def launch(address: str, args: list[str], timeout: float = 420) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "RAY_ADDRESS"):
        env.pop(key, None)
    return subprocess.run(
        [sys.executable, str(LAUNCHER), str(CONFIG), "--address", address, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    ("nnodes", "nproc", "extra"), [(1, 2, []), (2, 1, ["--allow-same-node"])], ids=["1node-2proc", "2nodes-1proc"]
)
def test_train_two_steps(ray_cluster, demo, tmp_path, nnodes, nproc, extra):
    out = tmp_path / "run"
    proc = launch(ray_cluster, ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc), *extra, *overrides(demo, out)])
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    assert f"ray_launch: {nnodes} node(s)" in text and f"{nproc} process(es) each" in text
    # rank 0's console row of the last step ("2/2 ..."), streamed through node 0's actor
    assert any(line.split()[:1] == ["2/2"] for line in proc.stdout.splitlines())
    assert f"ray_launch: all {nnodes} node(s) finished" in proc.stdout
    assert steps(out) == [1, 2]
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step_2"
    assert not processes_mentioning(str(out)), "a torchrun of this job outlived it"


def test_failed_node_stops_the_job_and_is_named(ray_cluster, demo, tmp_path):
    out = tmp_path / "run"
    bad = overrides(demo, out, **{"actor.optim.lr_warmup_steps": 5})  # more warm-up than steps: a config error
    proc = launch(ray_cluster, ["--nnodes", "2", "--nproc-per-node", "1", "--allow-same-node", *bad])
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-6000:]
    # The config error is refused by the node's preflight, before its torchrun starts (exit code 2).
    assert "failed: run_node.sh exited with status 2; stopping the other nodes" in proc.stdout
    assert "ray_launch: node 0 (" in proc.stdout or "ray_launch: node 1 (" in proc.stdout
    assert "actor.optim.lr_warmup_steps=5" in proc.stdout  # the failing node's own error, from its output tail
    assert not processes_mentioning(str(out)), "a torchrun of this job outlived it"


def test_strict_spread_that_cannot_be_placed_says_why(ray_cluster, demo, tmp_path):
    proc = launch(
        ray_cluster,
        ["--nnodes", "2", "--nproc-per-node", "1", "--placement-timeout", "5", *overrides(demo, tmp_path / "r")],
        timeout=120,
    )
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-4000:]
    assert "error: could not reserve 2 bundles" in proc.stderr and "STRICT_SPREAD" in proc.stderr
    assert "1 alive node(s)" in proc.stderr and "--allow-same-node" in proc.stderr
