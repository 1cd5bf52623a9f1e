"""``training/failure.reap_children``: at the end of a run every helper still descending from the rank is stopped,
except multiprocessing's resource tracker, which ignores SIGTERM by design (terminating it would wait out the whole
grace period on every run) and exits by itself, after its clean-up, once its parent is gone.

The scenario runs in a fresh interpreter, so that the reaping only ever sees the children made for it."""

from __future__ import annotations

import json
import subprocess
import sys

GRACE_S = 30.0  # long enough that waiting it out cannot pass for stopping at once on a loaded machine
SCENARIO = f"""
import json, subprocess, sys, time
from multiprocessing import resource_tracker

import psutil

from megatron_dapo.training.failure import reap_children

resource_tracker.ensure_running()  # a child of this process, as a spawn-context Manager leaves one
tracker = resource_tracker._resource_tracker._pid
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a helper a failure left behind
started = time.perf_counter()
reaped = reap_children(grace_s={GRACE_S})
print(json.dumps({{
    "elapsed": time.perf_counter() - started,
    "reaped": reaped,
    "helper": helper.pid,
    "helper_alive": helper.poll() is None,
    "tracker": tracker,
    "tracker_alive": psutil.pid_exists(tracker) and psutil.Process(tracker).status() != psutil.STATUS_ZOMBIE,
}}))
"""


def test_helpers_are_stopped_at_once_and_the_resource_tracker_is_left_to_exit_by_itself():
    proc = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["reaped"] == [out["helper"]] and not out["helper_alive"]
    assert out["tracker_alive"]  # not terminated: it unlinks what a child leaked once this process exits
    assert out["elapsed"] < GRACE_S / 3, out  # the helper stops on SIGTERM: the grace period is not waited out
