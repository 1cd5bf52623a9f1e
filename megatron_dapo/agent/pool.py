"""The worker processes of a :class:`~megatron_dapo.agent.host.ToolHost`, by slot: starting one, reading its
replies, settling what it held when it dies or is killed, and the watchdog (``agent/host.py``'s docstring says when
a worker is killed, retired or replaced). The pool and the host share one lock and the slots' request queues."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Optional

from megatron_dapo.agent.channel import Child, Instance, Request, Stats, fail, resolve, spawn_child, stop_child
from megatron_dapo.agent.tools import ToolSpec
from megatron_dapo.agent.zygote import Zygote

__all__ = ["WorkerPool"]

logger = logging.getLogger(__name__)

# A request no worker began is sent again at most this often (a worker that dies outside any call, again and again,
# must not hold it forever).
MAX_RESENDS = 3


class WorkerPool:
    """``workers`` slots, each with a request queue (filled and drained by the host) and at most one current worker;
    retired workers finish their requests aside. ``stats`` counts worker losses (``crashes``) and requests sent
    again (``resent``)."""

    def __init__(
        self,
        specs: list[ToolSpec],
        workers: int,
        limits: tuple[float, int, Optional[int], int],
        grace_s: float,
        start_timeout_s: float,
        stall_s: float,
    ) -> None:
        self.specs, self.limits, self.grace_s, self.start_timeout_s = specs, limits, grace_s, start_timeout_s
        self.stall_s = stall_s
        self.timeout_s = limits[0]
        self.lock = threading.Condition()
        self.queues: list[deque[Request]] = [deque() for _ in range(workers)]
        self.children: list[Optional[Child]] = [None] * workers  # each slot's current worker
        self.retired: list[Child] = []
        self.start_error: Optional[str] = None  # the first worker could not start: every request fails with it
        self.closed, self.stopped = False, threading.Event()
        self.stats = Stats()
        self._spawn_locks = [threading.Lock() for _ in range(workers)]
        self._zygote: Optional[Zygote] = None  # forks the workers (agent/zygote.py)
        self._zygote_lock = threading.Lock()
        self._ever_started, self._warned = False, False
        self._pings = itertools.count(-1, -1)  # ping ids: negative, never a host's request id

    def _template(self) -> Zygote:
        """The zygote that forks the workers, started (again, if it died) when needed."""
        with self._zygote_lock:
            if self.closed:
                raise RuntimeError("ToolHost is closed")
            if self._zygote is None or not self._zygote.alive():
                if self._zygote is not None:
                    self._zygote.close()
                plain = [(s.class_name, s.config, s.schema) for s in self.specs]  # no tools-module classes in args
                self._zygote = Zygote(plain, self.limits, self.start_timeout_s)
            return self._zygote

    def close_template(self) -> None:
        """After ``close()`` and the workers' stop: the zygote exits."""
        with self._zygote_lock:
            zygote, self._zygote = self._zygote, None
        if zygote is not None:
            zygote.close()

    def close(self) -> tuple[list[Child], list[Request]]:
        """Under the lock: closed; every worker detached; the workers and the requests to fail."""
        self.closed = True
        children = [c for c in [*self.children, *self.retired] if c is not None]
        queued = [r for q in self.queues for r in q]
        for q in self.queues:
            q.clear()
        pending = [r for c in children for r in self.detach(c)]
        self.lock.notify_all()
        return children, pending + queued

    def ensure_child(self, slot: int) -> Child:
        with self._spawn_locks[slot]:
            with self.lock:
                if self.start_error is not None:
                    raise RuntimeError(self.start_error)
                if self.children[slot] is not None:
                    return self.children[slot]
            try:
                child = spawn_child(slot, self._template(), self.start_timeout_s)
            except RuntimeError as exc:
                with self.lock:  # a worker that never started is a config error; a later one fails its slot
                    if not self._ever_started:
                        self.start_error = str(exc)
                logger.error("tool host: %s", exc)
                raise
            with self.lock:
                closed = self.closed
                if not closed:
                    self.children[slot], self._ever_started = child, True
                    self.lock.notify_all()
            if closed:
                stop_child(child, 0.0, ask=False)
                raise RuntimeError("ToolHost is closed")
            threading.Thread(target=self._read, args=(child,), name=f"tool-host-reader-{slot}", daemon=True).start()
            return child

    def _read(self, child: Child) -> None:
        """The replies of one worker, until it dies or is stopped; then what it had not answered is settled."""
        while True:
            try:
                message = child.conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # noqa: BLE001 - an unreadable reply: its request ends at the watchdog
                logger.exception("tool host: unreadable reply from a tool worker")
                continue
            self._on_message(child, message)
        child.process.join(5.0)  # it is exiting (or was killed): reaped, or killed if it lingers
        stop_child(child, 0.0, ask=False)
        with self.lock:
            died = not child.detached  # else killed by the watchdog or stopped by close(): settled there
            pending = self.detach(child) if died else []
            if died:
                self.stats.add("crashes")
        if died:
            self._log_loss(f"a tool worker died ({child.exit_note()})")
        self._settle(pending, set(), f"the tool worker died ({child.exit_note()}) during the {{op}}")
        child.conn.close()

    def _on_message(self, child: Child, message: Any) -> None:
        if message[0] == "withdrawn":  # requests taken back from a blocked worker: to its replacement
            with self.lock:
                taken = [child.pending.pop(i) for i in message[1] if i in child.pending]
                child.calls -= sum(r.op == "call" for r in taken)
            self._settle(taken, set(), "", confirmed=True)
            return
        if message[0] in ("started", "finished"):  # a request began; a timed-out synchronous call's thread ended
            with self.lock:
                request = child.pending.get(message[1])
                if message[0] == "finished":
                    child.lingering.pop(message[1], None)
                elif request is not None:
                    if request.started:  # again: its instance was created again, the call itself begins now
                        request.budget_s = self.timeout_s
                    request.started, request.begun = True, time.monotonic()
                    request.deadline = request.begun + request.budget_s + self.grace_s
            return
        req_id, reply, lingering = message
        with self.lock:
            request = child.pending.pop(req_id, None)
            if request is None:
                return
            if request.op == "call":
                child.calls -= 1
                self.lock.notify_all()
            if lingering:
                child.lingering[req_id] = request.sent + request.budget_s + self.grace_s
        resolve(request, reply, self.stats)

    def detach(self, child: Child) -> list[Request]:
        """Under the lock: ``child`` is no longer the host's; its unanswered requests, to be settled by the caller."""
        child.detached = True
        if self.children[child.slot] is child:
            self.children[child.slot] = None
        if child in self.retired:
            self.retired.remove(child)
        pending = sorted(child.pending.values(), key=lambda r: r.req_id)
        child.pending.clear()
        child.lingering.clear()
        child.calls = 0
        self.lock.notify_all()
        return pending

    def _settle(self, pending: list[Request], overdue: set[int], note: str, confirmed: bool = False) -> None:
        """The requests of a worker that died, was killed or gave them back (``confirmed``: it said they never
        began): those it never began go to its replacement (after a death, ``MAX_RESENDS`` times at most); the
        overdue ones time out; the others crash (``note`` names the ``{op}``)."""
        pending = [r for r in pending if r.op != "ping"]  # asked for this worker only
        again = [r for r in pending if not r.started and (confirmed or r.resends < MAX_RESENDS) and not self.closed]
        with self.lock:
            for request in reversed(again):
                request.resends += not confirmed
                self.queues[request.instance.slot].appendleft(request)
            self.stats.add("resent", len(again))
            self.lock.notify_all()
        for request in pending:
            if request in again:
                continue
            if request.req_id in overdue:
                what = request.name if request.op == "call" else f"{request.op} of the tools"
                limit = f"{request.budget_s + self.grace_s:g}"
                fail(self.stats, request, "timeout", f"{what} did not return within {limit} s; its worker was killed")
            else:
                fail(self.stats, request, "crashed", note.format(op=request.op))

    def watch(self) -> None:
        """Kill a worker when a request it began is overdue; take the requests that wait behind a blocked loop back
        from it and retire it; retire one whose timed-out thread runs on past its deadline; stop a retired one once
        its requests are answered (``agent/host.py``'s docstring)."""
        tick = max(0.01, min(0.05, self.grace_s / 4, self.stall_s / 4))
        while not self.stopped.wait(tick):
            now, killed, stopped, stalled, pings = time.monotonic(), [], [], [], []
            with self.lock:
                for child in [c for c in [*self.children, *self.retired] if c is not None]:
                    action, ids = self._verdict(child, now)
                    if action == "kill":
                        killed.append((child, ids, self.detach(child)))
                        self.stats.add("crashes")
                    elif action == "stop":
                        self.detach(child)
                        stopped.append(child)
                    elif action == "ping":
                        pings.append((child, self._ping(child, now)))
                    elif action in ("stall", "retire"):
                        child.retired = True  # its slot starts a fresh worker on the next request
                        self.children[child.slot] = None
                        self.retired.append(child)
                        self.lock.notify_all()
                        stalled += [(child, ids)] if action == "stall" else []
            for child in stopped:
                stop_child(child, 0.0, ask=False)
            for child, ids in stalled:
                with child.send_lock, contextlib.suppress(OSError, ValueError):
                    child.conn.send(("withdraw", sorted(ids)))
            for child, ping in pings:
                with child.send_lock, contextlib.suppress(OSError, ValueError):
                    child.conn.send((ping.req_id, "ping", "", None))
            for child, overdue, pending in killed:
                child.process.kill()
                self._log_loss(f"a tool call hung past {self.timeout_s + self.grace_s:g} s; its worker was killed")
                self._settle(pending, overdue, "the tool worker was killed during the {op} (another call on it hung)")

    def _verdict(self, child: Child, now: float) -> tuple[str, set[int]]:
        """Under the lock: what the watchdog does with ``child`` now, and the requests concerned."""
        overdue = {i for i, r in child.pending.items() if r.deadline < now}
        late = now - 2 * self.grace_s  # a request never begun long after it was sent: stuck outside any call
        if overdue or any(not r.started and r.sent + r.budget_s < late for r in child.pending.values()):
            return "kill", overdue
        if child.retired:
            return ("stop" if not child.pending else ""), set()
        waiting = {i for i, r in child.pending.items() if not r.started}
        if any(child.pending[i].sent < now - self.stall_s for i in waiting):
            return "stall", waiting
        if any(d < now for d in child.lingering.values()):
            return "retire", set()
        long = any(r.started and r.begun < now - self.stall_s / 2 for r in child.pending.values())
        if long and not waiting and child.pinged < now - self.stall_s / 2:
            return "ping", set()  # a call runs long: is it blocking the loop? (a ping that waits is a stall)
        return "", set()

    def _ping(self, child: Child, now: float) -> Request:
        """Under the lock: a ping request, pending on ``child`` (sent by the caller)."""
        ping = Request(next(self._pings), "ping", "", Instance(child.slot), None, Future())
        ping.sent, ping.budget_s, child.pinged = now, self.timeout_s, now
        child.pending[ping.req_id] = ping
        return ping

    def _log_loss(self, what: str) -> None:
        """The first worker lost is logged; later ones are counted (``tool/crashed``, ``tool/timeout``) only."""
        if not self._warned:
            self._warned = True
            logger.warning("tool host: %s; it is replaced (later losses are counted in tool/* only)", what)
