"""The trainer's end of one tool worker (``agent/worker.py``): starting it, its pipe and the requests it holds,
stopping it, and how a request's future is resolved and counted. ``agent/host.ToolHost`` runs a pool of these."""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_dapo.agent.tools import ToolResult
from megatron_dapo.agent.zygote import Zygote

__all__ = ["Child", "Instance", "Request", "Stats", "fail", "resolve", "spawn_child", "stop_child"]

logger = logging.getLogger(__name__)

_COUNTS = ("calls", "errors", "timeouts", "unknown_tool", "bad_call", "crashes", "resent")
_STATUS_COUNT = {"error": "errors", "timeout": "timeouts", "unknown_tool": "unknown_tool", "bad_call": "bad_call"}


@dataclass(eq=False)
class Instance:
    """A sample's tool instance: the worker slot it is pinned to, the worker it lives in (``None``: in none yet),
    and the ``tools_kwargs`` it was created with (``None``: never created, so never created again)."""

    slot: int
    kwargs: Optional[dict] = None
    child: Optional[Child] = None


@dataclass(eq=False)
class Request:
    """One request to a worker and the future that answers it."""

    req_id: int
    op: str  # "create", "call", "release", or "ping" (the watchdog's: is the worker's loop running?)
    instance_id: str
    instance: Instance
    payload: Any
    future: Future
    name: str = ""  # the called tool's name, for messages
    sent: float = 0.0
    budget_s: float = 0.0  # the worker's own time limit for it (timeout_s per tool method it runs)
    started: bool = False  # the worker began it (else it waits behind a call that blocks the worker's loop)
    begun: float = 0.0  # when the worker said it began
    deadline: float = math.inf  # started + budget_s + grace_s: past it, the worker is killed
    resends: int = 0  # times sent again, to the replacement of a worker that had not begun it


@dataclass(eq=False)
class Child:
    """One worker process, its end of the pipe, and the requests it was sent and has not answered."""

    process: Any
    conn: Any
    slot: int
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    pending: dict[int, Request] = field(default_factory=dict)
    lingering: dict[int, float] = field(default_factory=dict)  # answered as timed out, thread still running: deadline
    calls: int = 0  # calls among ``pending``
    pinged: float = -math.inf  # when the watchdog last asked whether its loop runs
    detached: bool = False  # no longer the host's; its requests were resolved or sent again
    retired: bool = False  # gets no new requests (a timed-out thread runs on); stopped once its requests are done

    def exit_note(self) -> str:
        code = self.process.exitcode
        if code is None:
            return "exit code unknown"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"


def spawn_child(slot: int, zygote: Zygote, start_timeout_s: float) -> Child:
    """A started worker, forked by ``zygote``, with its tools built; or ``RuntimeError`` saying why not."""
    process, conn = zygote.fork(start_timeout_s)
    message: Any = None
    with contextlib.suppress(EOFError, OSError):
        if conn.poll(start_timeout_s):
            message = conn.recv()
    if isinstance(message, tuple) and message[0] == "ready":
        return Child(process, conn, slot)
    process.join(1.0)
    process.kill()
    process.join(5.0)
    conn.close()
    if isinstance(message, tuple) and message[0] == "init_error":
        raise RuntimeError(f"the tools could not be built: {message[1]}")
    if message is None and process.exitcode is not None and process.exitcode >= 0:
        note = Child(process, None, slot).exit_note()
        raise RuntimeError(f"the tool process exited while starting ({note}); see its output above")
    raise RuntimeError(f"the tool process did not start within {start_timeout_s:g} s")


def stop_child(child: Child, grace_s: float, ask: bool = True) -> None:
    """Ask the worker to stop (``ask``), kill it if it has not after ``grace_s``, and reap it."""
    if ask and child.send_lock.acquire(timeout=1.0):
        try:
            child.conn.send(("stop",))
        except Exception:  # noqa: BLE001 - the worker is gone already
            pass
        finally:
            child.send_lock.release()
    child.process.join(grace_s if ask else 0.0)
    if child.process.is_alive():
        child.process.kill()
        child.process.join(5.0)


def resolve(request: Request, reply: Any, stats: Stats) -> None:
    """A request answered by its worker: counted, then its future set."""
    if request.op == "call":
        text, reward, status, latency, metrics = reply
        stats.status(status, time.monotonic() - request.sent)
        _set(request.future, ToolResult(text, reward, status, latency, metrics))
    elif request.op == "create":
        if reply is not None:
            stats.status("error")
        _set(request.future, reply)
    elif request.op == "release":
        for message in reply:
            stats.status("error")
            logger.warning("tool host: release of %r: %s", request.instance_id, message)
        _set(request.future, None)


def fail(stats: Stats, request: Request, status: str, message: str) -> None:
    """A request that no worker answered: ``status`` is counted (``crashed`` is counted per worker death)."""
    if request.op == "call":
        stats.status(status, time.monotonic() - request.sent if request.sent else None)
        _set(request.future, ToolResult(f"error: {message}", 0.0, status, 0.0, {}))
    elif request.op == "create":
        stats.status(status)
        _set(request.future, message)
    else:
        _set(request.future, None)


class Stats:
    """The ``tool/*`` counts and call latencies, kept in the trainer's process (they survive the workers)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._counts: dict[str, int] = dict.fromkeys(_COUNTS, 0)
            self._latency = [0, 0.0, 0.0]  # calls, sum, max: a run that never resets keeps three numbers

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def status(self, status: str, latency: Optional[float] = None) -> None:
        with self._lock:
            if status in _STATUS_COUNT:
                self._counts[_STATUS_COUNT[status]] += 1
            if latency is not None:
                n, total, top = self._latency
                self._latency = [n + 1, total + latency, max(top, latency)]

    def metrics(self) -> dict[str, float]:
        with self._lock:
            out = {f"tool/{k}": float(v) for k, v in self._counts.items()}
            n, total, top = self._latency
        out["tool/latency_mean_s"] = total / n if n else 0.0
        out["tool/latency_max_s"] = top
        return out


def _set(future: Future, value: Any) -> None:
    with contextlib.suppress(InvalidStateError):  # cancelled by the caller
        future.set_result(value)
