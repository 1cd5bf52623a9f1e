"""Tools run in a pool of worker processes (:class:`ToolHost`), so that a tool can take down neither the trainer nor
the other samples' calls.

Tools are user code and can fail in any way: raise, hang (in Python, in C code holding the GIL, or by blocking an
async tool's event loop), exit (``sys.exit``, ``os._exit``), exhaust memory, crash the interpreter. In threads of the
trainer, ``os._exit`` or an OOM kill would end the run and a hung synchronous tool would leak a thread forever. So
the tools run in ``workers`` child processes (``agent/worker.py``), forked from a template process that has imported
them (``agent/zygote.py``: a replacement costs milliseconds), and:

* **each sample's tool instance is pinned to one worker** (the one with the fewest instances when it is created), so
  a hang or a crash costs one worker and the calls that had begun on it, nothing else;
* every request returns a ``concurrent.futures.Future`` at once (thread-safe, never blocks the caller); each worker
  slot has a sender thread that starts a worker when needed (a replacement included) and sends it its share of
  ``max_concurrency`` calls at a time (``workers`` is at most ``max_concurrency``), in order; each worker has a
  reader thread that resolves the futures;
* a call's future never holds an exception: every failure is a ``ToolResult`` whose text starts with ``error: ``,
  with status ``error`` (the tool raised, ``sys.exit`` and ``MemoryError`` included), ``timeout``,
  ``unknown_tool``, ``bad_call`` or ``crashed`` (its worker died during the call: ``os._exit``, a segfault, the OOM
  killer; or it was killed because another call that had begun on it hung);
* **bounds.** The worker answers a call that runs past ``timeout_s`` as timed out (a synchronous tool runs in a
  thread, an async one under ``asyncio.timeout``). When it cannot (a tool stuck in C code holding the GIL, an async
  tool blocking the event loop), a watchdog thread kills it ``timeout_s + grace_s`` after the call began, and the
  call ends then, as ``timeout``. ``grace_s`` (0.5 s by default) is the worker's slack to answer on its own; a call
  whose instance is created again first gets ``timeout_s`` for that, then ``timeout_s`` of its own;
* **a blocked loop stalls nobody else.** A request that has not begun ``stall_s`` (0.25 s) after it was sent means
  the worker's event loop is blocked (while a call runs longer than ``stall_s / 2``, the watchdog sends the worker a
  ``ping`` request to find out): the watchdog takes back the requests that wait there (the worker's reader thread
  confirms which had not begun, so none runs twice), retires the worker (no new requests) and sends them to a fresh
  worker in its slot. A retired worker is stopped once the calls it holds are answered, or killed at their bound. A
  synchronous call answered as timed out whose thread still runs at ``timeout_s + grace_s`` retires its worker too
  (its thread cannot be stopped otherwise);
* **lost instances are made again.** Requests a dead or killed worker had not begun go to its replacement
  (``pool.MAX_RESENDS`` times at most). The instances that lived in a lost or retired worker are created again in
  the slot's new worker, from their ``tools_kwargs``, just before their next call (their state is what ``create``
  makes of it, as after a resume); a failed re-creation is that call's ``error:``. A release of a lost instance does
  nothing. Parallel calls of one instance that straddle a retirement may reach two workers;
* ``memory_mb`` caps each worker's address space (``RLIMIT_AS``), so that a tool that allocates too much gets a
  ``MemoryError`` (an ``error`` result) rather than the OOM killer's visit. The cap covers the whole worker: about
  50 MiB for the interpreter, plus the thread stacks of its concurrent synchronous calls (8 MiB each by default);
* an answer longer than ``max_reply_chars`` keeps its first and last halves (``agent/worker.py``);
* ``tool/*`` metrics are counted in the trainer's process (``tool/crashes``: workers that died or were killed,
  ``tool/resent``: requests sent to another worker), so they survive the workers; the first worker lost is logged.

The template and the workers import only light modules (:mod:`megatron_dapo.agent.tools`, the tools' own modules; no
torch) — plus, as any ``spawn``/``forkserver`` child, the main module of the trainer's process, which must therefore
be import-safe (work under ``if __name__ == "__main__"``) and light at the top (the ``megatron-dapo`` CLI is). They
ignore SIGINT (Ctrl-C is the trainer's to handle; it closes the host). A tool cannot start ``multiprocessing``
children of its own (``subprocess`` works, as the built-in ``python`` tool does).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future
from multiprocessing.reduction import ForkingPickler
from typing import Any, Optional

from megatron_dapo.agent.channel import Child, Instance, Request, fail, stop_child
from megatron_dapo.agent.hermes import ToolCall
from megatron_dapo.agent.pool import WorkerPool
from megatron_dapo.agent.tools import ToolSpec

__all__ = ["ToolHost"]

logger = logging.getLogger(__name__)


class ToolHost:
    """The tools of a tool YAML in a pool of worker processes, with futures for the trainer (module docstring).

    ``create`` resolves to ``None``, or to an error message (a str) when a tool's ``create`` failed: the sample goes
    on and its calls get the tool's own answers. ``call`` resolves to a ``ToolResult``, never to an exception.
    ``release`` resolves to ``None``; its failures are counted in ``tool/errors``. After ``close()`` requests raise
    ``RuntimeError`` (a programming error, not a tool failure).
    """

    def __init__(
        self,
        specs: list[ToolSpec],
        timeout_s: float = 30.0,
        max_concurrency: int = 16,
        grace_s: float = 0.5,
        memory_mb: Optional[int] = None,
        start_timeout_s: float = 120.0,
        workers: int = 8,
        max_reply_chars: int = 2**20,
        stall_s: float = 0.25,
    ) -> None:
        self.specs, self.timeout_s, self.grace_s = list(specs), float(timeout_s), float(grace_s)
        self.max_concurrency, self.memory_mb, self.start_timeout_s = int(max_concurrency), memory_mb, start_timeout_s
        self.workers = max(1, min(int(workers), self.max_concurrency))  # each worker runs a call at least
        # calls in flight on each worker: max_concurrency in all
        self.caps = [
            self.max_concurrency // self.workers + (k < self.max_concurrency % self.workers)
            for k in range(self.workers)
        ]
        limits = (self.timeout_s, max(self.caps), memory_mb, int(max_reply_chars))
        self._pool = WorkerPool(self.specs, self.workers, limits, self.grace_s, start_timeout_s, float(stall_s))
        self._lock, self._queues, self._stats = self._pool.lock, self._pool.queues, self._pool.stats
        self._instances: dict[str, Instance] = {}
        self._load = [0] * self.workers  # instances pinned to each slot
        self._threads: list[threading.Thread] = []
        self._ids = itertools.count()

    # ------------------------------------------------------------------------------------------- public API

    def start(self) -> None:
        """Start the first worker and build the tools now (the others start on first use), so that a config error —
        a tool class that cannot be imported or built — raises here: ``RuntimeError`` naming the class and the
        error."""
        self._check_open()
        self._ensure_threads()
        self._pool.ensure_child(0)

    def create(self, instance_id: str, tools_kwargs: Optional[dict] = None) -> Future:
        """Every tool's instance for a sample; ``tools_kwargs`` as verl's ``{name: {"create_kwargs": {...}}}``.
        Resolves to ``None``, or to an error message (str) if a tool's create failed."""
        return self._submit("create", instance_id, dict(tools_kwargs or {}))

    def call(self, instance_id: str, call: ToolCall) -> Future:
        """One tool call; resolves to a ``ToolResult`` (every failure is an ``error: ...`` result, see above)."""
        return self._submit("call", instance_id, (call.name, dict(call.arguments), call.error), call.name or "tool")

    def release(self, instance_id: str) -> Future:
        """Every tool's ``release`` for a sample; resolves to ``None`` (failures are counted, never raised)."""
        return self._submit("release", instance_id, None)

    def metrics(self) -> dict[str, float]:
        """``tool/*`` since the last ``reset_metrics()``: calls, failures by kind, worker deaths and kills
        (``tool/crashes``), requests sent again (``tool/resent``), call latency as the caller waited for it once
        sent (mean, max)."""
        return self._stats.metrics()

    def reset_metrics(self) -> None:
        """Start counting afresh (the trainer reports the metrics of each step)."""
        self._stats.reset()

    def close(self) -> None:
        """Stop the workers (asked, then killed after ``grace_s``); unanswered requests resolve as ``crashed``
        (not counted). Idempotent."""
        with self._lock:
            if self._pool.closed:
                return
            children, unanswered = self._pool.close()
        self._pool.stopped.set()
        for child in children:
            stop_child(child, self.grace_s)
        self._pool.close_template()
        for request in unanswered:
            fail(self._stats, request, "crashed", "the tool host was closed")

    def __enter__(self) -> ToolHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- requests

    def _check_open(self) -> None:
        if self._pool.closed:
            raise RuntimeError("ToolHost is closed")

    def _submit(self, op: str, instance_id: str, payload: Any, name: str = "") -> Future:
        future: Future = Future()
        with self._lock:
            self._check_open()
            instance = self._instance(op, instance_id, payload)
            request = Request(next(self._ids), op, instance_id, instance, payload, future, name)
            if op == "call":
                self._stats.add("calls")
            error = self._pool.start_error
            if error is None:
                self._queues[instance.slot].append(request)
                self._lock.notify_all()
        if error is not None:
            fail(self._stats, request, "crashed", f"the tool process could not start: {error}")
        else:
            self._ensure_threads()
        return future

    def _instance(self, op: str, instance_id: str, payload: Any) -> Instance:
        """Under the lock: the instance a request is for, pinned to the least loaded slot when new; a release
        forgets it (its request keeps it)."""
        instance = self._instances.get(instance_id)
        if instance is None:
            instance = Instance(min(range(self.workers), key=self._load.__getitem__))
            if op != "release":
                self._instances[instance_id] = instance
                self._load[instance.slot] += 1
        if op == "create":
            instance.kwargs = payload
        elif op == "release" and self._instances.pop(instance_id, None) is not None:
            self._load[instance.slot] -= 1
        return instance

    def _ensure_threads(self) -> None:
        with self._lock:
            if self._threads:
                return
            self._threads = [
                threading.Thread(target=self._send_loop, args=(k,), name=f"tool-host-sender-{k}", daemon=True)
                for k in range(self.workers)
            ]
            self._threads.append(threading.Thread(target=self._pool.watch, name="tool-host-watchdog", daemon=True))
            for thread in self._threads:
                thread.start()

    def _next_request(self, slot: int) -> Optional[Request]:
        """The slot's oldest request, once it may be sent (calls: fewer than its cap in flight); ``None`` once
        closed. Strict order, so that a sample's create, calls and release reach its worker in the order made."""
        with self._lock:
            queue = self._queues[slot]
            while not self._pool.closed:
                if queue:
                    child = self._pool.children[slot]
                    if queue[0].op != "call" or child is None or child.calls < self.caps[slot]:
                        return queue.popleft()
                self._lock.wait()
        return None

    def _send_loop(self, slot: int) -> None:
        while (request := self._next_request(slot)) is not None:
            lost = request.instance.child
            if request.op == "release" and (lost is None or lost.detached or lost.retired):
                fail(self._stats, request, "", "")  # its instance died with its worker: None, nothing to release
                continue
            try:
                child = self._pool.ensure_child(slot)
            except RuntimeError as exc:
                with self._lock:
                    failed = [request, *self._queues[slot]]
                    self._queues[slot].clear()
                for r in failed:
                    fail(self._stats, r, "crashed", f"the tool process could not start: {exc}")
                continue
            self._send(child, request)

    def _send(self, child: Child, request: Request) -> None:
        instance = request.instance
        payload = request.payload
        recreate = None
        if request.op == "call":  # an instance lost with an earlier worker is created again first
            recreate = instance.kwargs if instance.kwargs is not None and instance.child is not child else None
            payload = (*payload, recreate)
        try:  # pickled first, so that a payload that cannot be is told apart from a dead worker
            data = ForkingPickler.dumps((request.req_id, request.op, request.instance_id, payload))
        except Exception as exc:  # noqa: BLE001 - this request fails, alone
            status = "bad_call" if request.op == "call" else "error"
            fail(self._stats, request, status, f"the request cannot be sent to the tool process: {exc!r}")
            return
        with self._lock:
            closed = self._pool.closed
            if (child.detached or child.retired) and not closed:  # replaced since: the next worker gets it
                self._queues[child.slot].appendleft(request)
                self._lock.notify_all()
                return
            if not closed:
                methods = (1 if request.op == "call" else len(self.specs)) + (len(self.specs) if recreate else 0)
                request.budget_s = self.timeout_s * max(1, methods)  # the worker's limit: timeout_s per method
                request.sent, request.started = time.monotonic(), False
                child.pending[request.req_id] = request
                child.calls += request.op == "call"
                if request.op != "release":
                    instance.child = child
        if closed:
            fail(self._stats, request, "crashed", "the tool host was closed")
            return
        try:
            with child.send_lock:
                child.conn.send_bytes(data)
        except (OSError, ValueError):
            pass  # the worker died: its reader resolves the request with the others
