"""``liveness.Liveness``: a survivor names the peer that died without a word, from the job's store.

Real processes and a real ``TCPStore``: this test's process is rank 0 and hosts the store; rank 1 is a child that
announces itself (role, place), beats its heartbeat and is then SIGKILLed. On the same host the dead peer is found by
its pid at once; a peer that says it runs on another host is found by its heartbeat going quiet.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from megatron_dapo.liveness import STALE_BEATS, Liveness

PEER = """
import socket, sys, time
import torch.distributed as dist
from megatron_dapo import liveness
port, host = int(sys.argv[1]), sys.argv[2]
if host != "-":
    socket.gethostname = lambda: host  # a peer on another machine, as its entry says
store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=__import__("datetime").timedelta(seconds=30))
alive = liveness.Liveness(store, 1, 2, "rollout", interval_s=0.2)
alive.announce_place("rollout rank 0 of 1")
print("announced", flush=True)
time.sleep(600)
"""


def _store(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)


def _peer(port: int, host: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen([sys.executable, "-c", PEER, str(port), host], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "announced"  # the entry is in the store: an event, not a sleep
    return proc


@pytest.mark.parametrize("host, port", [("-", 29941), ("other-host", 29942)], ids=["same-host", "other-host"])
def test_a_killed_peer_is_named_with_its_role_and_place(host, port):
    store = _store(port)
    me = Liveness(store, 0, 2, "training", interval_s=0.2)
    peer = _peer(port, host)
    try:
        if host != "-":  # its heartbeat moves while it lives
            before = store.add("megatron_dapo/ranks/1/beat", 0)
            deadline = time.monotonic() + 10
            while store.add("megatron_dapo/ranks/1/beat", 0) == before:
                assert time.monotonic() < deadline, "the peer's heartbeat never moved"
                time.sleep(0.05)
        assert me.dead_peers() == []  # alive: nobody is named
        os.kill(peer.pid, signal.SIGKILL)
        peer.wait(timeout=30)
        started = time.monotonic()
        (dead,) = me.dead_peers()
        waited = time.monotonic() - started
        assert (dead.rank, dead.role, dead.place) == (1, "rollout", "rollout rank 0 of 1")
        if host == "-":
            assert dead.how == f"its process (pid {peer.pid}) is gone" and waited < STALE_BEATS * 0.2
        else:
            assert dead.how == f"no heartbeat from other-host for {STALE_BEATS * 0.2:g} s"
            assert waited >= STALE_BEATS * 0.2  # it waited the stated intervals before judging
    finally:
        me.close()
        if peer.poll() is None:
            peer.kill()
