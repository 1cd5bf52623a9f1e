"""What a run does when something goes wrong: stop requests (SIGTERM/SIGINT), the first failure's root cause, and
the check that every rank reached the failure handler before a collective emergency save.

Ranks coordinate through the rendezvous store that torchrun (or ``init_process_group``) created: it lives outside
the process groups, so it still answers when a peer has died or a collective is broken. Under torchrun the store
is served by the launcher's agent and survives any worker.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import psutil
import torch.distributed as dist

from megatron_dapo import liveness

log = logging.getLogger("megatron_dapo.failure")

_FIRST_FAILURE_KEY = "megatron_dapo/first_failure"
_HANDLER_KEY = "megatron_dapo/in_failure_handler"


class NonFiniteUpdateError(RuntimeError):
    """Too many consecutive updates were skipped because the loss, the gradient norm or the loss inputs were not
    finite. The run stops without saving: the last checkpoint written before stays ``latest``."""


class PeerFailure(RuntimeError):
    """This rank stopped because another rank failed first; the message carries that rank's error."""


def _store() -> Optional[dist.Store]:
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):  # no store behind this group (e.g. a file:// init)
        return None


def record_failure(rank: int, exc: BaseException, cause: Optional[str] = None) -> str:
    """Register this rank's failure (``cause``: what this rank found behind it, e.g. ``dead_peer_report``'s line);
    returns the first failure of the run (this one when it came first)."""
    message = cause or f"rank {rank}: {type(exc).__name__}: {exc}"
    store = _store()
    if store is None:
        return message
    try:
        first = store.compare_set(_FIRST_FAILURE_KEY, "", message)
        return first.decode() if isinstance(first, bytes) else str(first)
    except Exception:  # noqa: BLE001 - the store itself may be gone with the launcher
        return message


def dead_peer_report(checkpoint_dir: str) -> Optional[str]:
    """When this rank's failure is a consequence of a peer's death (``liveness.Liveness.dead_peers``): the line a
    user reads first, naming the dead rank, its role and place, how it ended as far as is known, and how to resume;
    None when every peer is alive."""
    alive = liveness.current()
    dead = alive.dead_peers() if alive is not None else []
    if not dead:
        return None
    who = "; ".join(f"rank {d.rank} ({d.role}{', ' + d.place if d.place else ''}) died: {d.how}" for d in dead)
    return (
        f"{who}, without reporting an error (a signal such as SIGKILL, the out-of-memory killer, or a crash in native"
        f" code). {resume_hint(checkpoint_dir)}"
    )


def resume_hint(checkpoint_dir: str) -> str:
    """How to go on from the newest published checkpoint under ``checkpoint_dir`` (its ``latest``)."""
    latest = Path(checkpoint_dir) / "latest"
    step = latest.read_text().strip() if latest.is_file() else None
    again = "run the same command again (trainer.resume_mode=auto)"
    restart = "or launch with MAX_RESTARTS=N (launch/run_node.sh) to restart on its own"
    if step is None:
        return f"No checkpoint was published yet: {again} starts over, {restart}."
    return f"To resume from {Path(checkpoint_dir) / step}: {again}, {restart}."


def all_ranks_in_handler(world_size: int, timeout_s: float) -> bool:
    """Announce that this rank is in the failure handler and wait (bounded) until every rank is.

    Only then are all ranks out of their collectives, so that a collective save cannot be matched against a peer's
    unfinished collective. A failure on some ranks only (the others are blocked in a collective) returns False.
    """
    store = _store()
    if store is None:
        return world_size == 1
    try:
        arrived = store.add(_HANDLER_KEY, 1)
        deadline = time.monotonic() + timeout_s
        while arrived < world_size and time.monotonic() < deadline:
            time.sleep(0.2)
            arrived = store.add(_HANDLER_KEY, 0)
        return arrived >= world_size
    except Exception:  # noqa: BLE001
        return False


class StopRequest:
    """Turns SIGTERM/SIGINT into a flag read at step boundaries (schedulers send SIGTERM before preemption or at a
    time limit). The first signal asks for a clean stop; the handlers are then restored, so a second one acts as
    usual (e.g. a second Ctrl-C interrupts at once)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, peer_death: Optional[Callable[[], Optional[str]]] = None) -> None:
        self.signal_name: Optional[str] = None
        self._previous: dict[int, object] = {}
        # ``dead_peer_report`` for the run's checkpoints: torchrun stops the survivors with SIGTERM when a rank dies,
        # which can reach a survivor before any collective fails, so the death is named here first.
        self.peer_death = peer_death

    def install(self) -> None:
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: leave signal handling to the caller
                return

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:  # noqa: ANN001
        self.signal_name = signal.Signals(signum).name
        death = self.peer_death() if self.peer_death is not None else None
        if death is not None:
            log.error("%s", death)
        log.warning("received %s: the run saves a checkpoint at the end of this step and exits", self.signal_name)
        self.restore()

    @property
    def requested(self) -> bool:
        return self.signal_name is not None


def _is_resource_tracker(proc: psutil.Process) -> bool:
    """multiprocessing's resource tracker: it ignores SIGTERM by design (a terminate would cost the whole grace
    period) and exits by itself once this process is gone, after unlinking what a child leaked."""
    try:
        return any("multiprocessing.resource_tracker" in part for part in proc.cmdline())
    except psutil.Error:
        return False


def reap_children(grace_s: float = 5.0) -> list[int]:
    """Terminate (then kill) every process still descending from this one: vLLM, reward and checkpoint helpers
    left by a failure must not outlive the run. Returns the pids that had to be stopped."""
    try:
        children = [c for c in psutil.Process().children(recursive=True) if not _is_resource_tracker(c)]
    except psutil.Error:
        return []
    for child in children:
        try:
            child.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass
    return [c.pid for c in children]
