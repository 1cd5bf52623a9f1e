"""Run a worker script under ``torchrun`` (``python -m torch.distributed.run``) from a test.

Multi-process behaviour is tested with real processes: the test launches a worker script, the worker writes its
measurements (JSON files, printed lines) and the test asserts on them. On a failure the test fails with the tail of
the workers' output, which is where the traceback is.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import psutil
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
_TAIL_CHARS = 6000


def _tail(text: str, limit: int = _TAIL_CHARS) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


def _kill_tree(pid: int) -> None:
    """Kill torchrun and its ranks. The ranks run in sessions of their own (torch elastic starts them with
    ``start_new_session``), so killing torchrun's process group would leave them holding our output pipes."""
    try:
        parent = psutil.Process(pid)
        procs = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=10)


def run_torchrun(
    script: str | Path,
    nproc: int,
    args: Sequence[str] = (),
    port: int = 29800,
    timeout: float = 300.0,
    env: Optional[dict[str, str]] = None,
) -> str:
    """Run ``script`` on ``nproc`` local processes and return its stdout (all ranks interleaved).

    ``port`` is the rendezvous port: each test uses its own (the suite's engineers share one machine, so ranges
    are assigned per test area). ``OMP_NUM_THREADS=1`` keeps the ranks from oversubscribing the few cores.
    ``env`` adds to (and overrides) the inherited environment. A non-zero exit or a timeout fails the calling
    test with the tail of stdout and stderr; on a timeout torchrun and every rank are killed, so none lingers.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        str(script),
        *[str(a) for a in args],
    ]
    run_env = dict(os.environ)
    run_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    # The workers import the package and the tests' helpers from the checkout, wherever pytest runs from.
    run_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), run_env.get("PYTHONPATH", "")]))
    if env:
        run_env.update(env)
    proc = subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        env=run_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        stdout, stderr = proc.communicate(timeout=30)
        pytest.fail(
            f"torchrun {Path(script).name} (nproc={nproc}, port={port}) timed out after {timeout:.0f}s\n"
            f"--- stdout tail ---\n{_tail(stdout)}\n--- stderr tail ---\n{_tail(stderr)}"
        )
    if proc.returncode != 0:
        pytest.fail(
            f"torchrun {Path(script).name} {' '.join(map(str, args))} (nproc={nproc}, port={port}) exited with "
            f"{proc.returncode}\n--- stdout tail ---\n{_tail(stdout)}\n--- stderr tail ---\n{_tail(stderr)}"
        )
    return stdout
