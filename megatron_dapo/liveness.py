"""Which rank died: every rank's entry in the job's store (pid, host, role, place in the layout) and a heartbeat.

When a peer dies (a signal, the out-of-memory killer, a crash in native code), the survivors only see a broken
collective ("Connection closed by peer", a timeout). The store outlives the workers (torchrun's agent serves it), so
each rank writes there who it is and a daemon thread bumps its heartbeat counter every ``interval_s``; a survivor
whose collective broke asks ``Liveness.dead_peers``: a peer on the same host is dead when its process is gone
(exact, at once), a peer on another host when its counter stopped moving for ``STALE_BEATS`` intervals.
``training/failure.py`` turns the answer into the first error line a user reads.
"""

from __future__ import annotations

import atexit
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import psutil

log = logging.getLogger("megatron_dapo.liveness")

_PREFIX = "megatron_dapo/ranks/"
STALE_BEATS = 3  # intervals without a heartbeat before a peer on another host counts as dead


@dataclass(frozen=True)
class DeadRank:
    rank: int
    role: str  # "training" or "rollout"
    place: str  # e.g. "TP 0, PP 1, DP 0", or "rollout rank 1 of 2"
    how: str  # what is known of its end


class Liveness:
    """This rank's entry and heartbeat in the job's ``store`` (keys under ``megatron_dapo/ranks/``), and the check of
    its peers' (ranks are the job's: in async mode both sides share the store)."""

    def __init__(self, store: Any, rank: int, world_size: int, role: str, interval_s: float = 1.0) -> None:
        self.store, self.rank, self.world_size, self.interval_s = store, rank, world_size, interval_s
        self._facts = {"pid": psutil.Process().pid, "host": socket.gethostname(), "role": role, "place": ""}
        self._publish()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="megatron_dapo-heartbeat", daemon=True)
        self._thread.start()

    def announce_place(self, place: str) -> None:
        """This rank's place in the parallel layout, once the groups exist (``parallel.init_model_parallel``)."""
        self._facts["place"] = place
        self._publish()

    def _publish(self) -> None:
        self.store.set(f"{_PREFIX}{self.rank}", json.dumps(self._facts))

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.store.add(f"{_PREFIX}{self.rank}/beat", 1)
            except Exception:  # noqa: BLE001 - the store went with the launcher: nobody is left to tell
                return

    def close(self) -> None:
        """Stop the heartbeat and wait for its thread, before the store's connection goes (``parallel.teardown``):
        a thread still inside a store call when the process group is destroyed or the interpreter exits takes the
        process down ("terminate called without an active exception"). The entry is marked done, so that a peer
        failing later does not take this rank's quiet heartbeat for a death."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=10 * self.interval_s)
        try:
            self.store.set(f"{_PREFIX}{self.rank}/done", "1")
        except Exception:  # noqa: BLE001 - the store may be gone already: nothing to mark
            pass

    def dead_peers(self) -> list[DeadRank]:
        """The peers that are gone. Costs a stat per peer on this host, and ``STALE_BEATS`` heartbeat intervals when
        a peer runs on another host (its counter is read before and after)."""
        entries, beats = {}, {}
        for peer in range(self.world_size):
            if peer == self.rank or self.store.check([f"{_PREFIX}{peer}/done"]):  # it ended its run normally
                continue
            try:
                entries[peer] = json.loads(self.store.get(f"{_PREFIX}{peer}"))
                beats[peer] = self.store.add(f"{_PREFIX}{peer}/beat", 0)
            except Exception:  # noqa: BLE001 - a peer that never announced itself is not judged here
                continue
        host = socket.gethostname()
        remote = [p for p, e in entries.items() if e["host"] != host]
        if remote:
            time.sleep(STALE_BEATS * self.interval_s)
        dead = []
        for peer, entry in sorted(entries.items()):
            if entry["host"] == host:
                gone = not _process_alive(entry["pid"])
                how = f"its process (pid {entry['pid']}) is gone" if gone else ""
            else:
                gone = self.store.add(f"{_PREFIX}{peer}/beat", 0) == beats[peer]
                how = f"no heartbeat from {entry['host']} for {STALE_BEATS * self.interval_s:g} s" if gone else ""
            if gone:
                dead.append(DeadRank(peer, entry["role"], entry["place"], how))
        return dead


def _process_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


_LIVENESS: Optional[Liveness] = None


def start(store: Any, rank: int, world_size: int, role: str) -> Liveness:
    """This process's ``Liveness`` (one per process: a second call returns the first); stopped by ``stop`` or, at the
    latest, when the interpreter exits."""
    global _LIVENESS
    if _LIVENESS is None:
        _LIVENESS = Liveness(store, rank, world_size, role)
        atexit.register(stop)
    return _LIVENESS


def stop() -> None:
    """Stop this process's heartbeat (``Liveness.close``); a later ``start`` begins a new one."""
    global _LIVENESS
    if _LIVENESS is not None:
        _LIVENESS.close()
        _LIVENESS = None


def current() -> Optional[Liveness]:
    return _LIVENESS
