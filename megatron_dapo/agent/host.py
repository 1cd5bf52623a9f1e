"""Tools run in a child process (:class:`ToolHost`), so that no tool can take the trainer down with it.

Tools are user code and can fail in any way: raise, hang, exit (``sys.exit``, ``os._exit``), exhaust memory, crash
the interpreter. In threads of the trainer, ``os._exit`` or an OOM kill would end the run and a hung synchronous tool
would leak a thread forever. So every tool of a tool YAML, and the :class:`~megatron_dapo.agent.tools.ToolRunner`
that calls them, live in ONE child process (``forkserver`` start method where available, else ``spawn``; never
``fork``, since the trainer holds threads), and the trainer talks to it over a pipe:

* every request returns a ``concurrent.futures.Future`` at once (thread-safe, never blocks the caller); a sender
  thread starts the child when needed and sends at most ``max_concurrency`` calls at a time (the rest wait in order,
  so that the child never queues a call past its deadline); a reader thread resolves the futures from the replies;
* a call's future never holds an exception: every failure is a ``ToolResult`` whose text starts with ``error: ``,
  with status ``error`` (the tool raised, ``sys.exit`` included), ``timeout``, ``unknown_tool``, ``bad_call`` or
  ``crashed`` (the child died during the call: ``os._exit``, a segfault, the OOM killer; or it was killed because
  another call hung);
* a watchdog thread kills the child (SIGKILL) when a request is not answered within ``timeout_s + grace_s`` (a tool
  stuck in C code holding the GIL, an async tool blocking the event loop), or when a synchronous tool that was
  answered as timed out at ``timeout_s`` still runs at that deadline (its thread cannot be stopped otherwise);
* a dead or killed child is started again on the next request. Tool *instances* created in the old one are lost:
  later calls for them reach fresh tool objects and get whatever those answer (typically an ``error:`` about an
  unknown instance), and their samples go on;
* ``memory_mb`` caps the child's address space (``RLIMIT_AS``), so that a tool that allocates too much gets a
  ``MemoryError`` (an ``error`` result) rather than the OOM killer's visit. The cap covers the whole child: about
  50 MiB for the interpreter, plus the thread stacks of the concurrent synchronous calls (8 MiB each by default);
* ``tool/*`` metrics are counted in the trainer's process, so they survive restarts of the child.

The child imports only light modules (:mod:`megatron_dapo.agent.tools`, the tools' own modules; no torch) — plus,
as any ``spawn``/``forkserver`` child, the main module of the trainer's process, which must therefore be import-safe
(work under ``if __name__ == "__main__"``) and light at the top (the ``megatron-dapo`` CLI is). It ignores SIGINT
(Ctrl-C is the trainer's to handle; it closes the host). It is a daemon process, so a tool cannot start
``multiprocessing`` children of its own (``subprocess`` works, as the built-in ``python`` tool does).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib
import inspect
import itertools
import logging
import math
import multiprocessing
import numbers
import os
import resource
import signal
import sys
import threading
import time
import types
from collections import Counter, deque
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any, Optional

from megatron_dapo.agent.hermes import ToolCall
from megatron_dapo.agent.tools import ToolResult, ToolSpec

__all__ = ["ToolHost"]

logger = logging.getLogger(__name__)

_COUNTS = ("calls", "errors", "timeouts", "unknown_tool", "bad_call", "crashes")
_STATUS_COUNT = {"error": "errors", "timeout": "timeouts", "unknown_tool": "unknown_tool", "bad_call": "bad_call"}


@dataclass
class _Request:
    """One request to the child and the future that answers it."""

    req_id: int
    op: str  # "create", "call" or "release"
    instance_id: str
    payload: Any
    future: Future
    name: str = ""  # the called tool's name, for messages
    sent: float = 0.0
    deadline: float = math.inf


@dataclass
class _Child:
    """One tool process, its end of the pipe, and the requests it was sent and has not answered."""

    process: Any
    conn: Any
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    pending: dict[int, _Request] = field(default_factory=dict)
    lingering: dict[int, float] = field(default_factory=dict)  # answered as timed out, thread still running: deadline
    calls: int = 0  # calls among ``pending``
    detached: bool = False  # no longer the host's child; its requests were resolved
    closing: bool = False  # stopped on purpose: not a crash

    def exit_note(self) -> str:
        code = self.process.exitcode
        if code is None:
            return "exit code unknown"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"


class ToolHost:
    """The tools of a tool YAML in one child process, with futures for the trainer (module docstring).

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
        grace_s: float = 5.0,
        memory_mb: Optional[int] = None,
        start_timeout_s: float = 120.0,
    ) -> None:
        self.specs, self.timeout_s, self.grace_s = list(specs), float(timeout_s), float(grace_s)
        self.max_concurrency, self.memory_mb, self.start_timeout_s = int(max_concurrency), memory_mb, start_timeout_s
        self._lock = threading.Condition()
        self._spawn_lock = threading.Lock()
        self._queue: deque[_Request] = deque()
        self._child: Optional[_Child] = None
        self._start_error: Optional[str] = None
        self._closed, self._stopped = False, threading.Event()
        self._threads: list[threading.Thread] = []
        self._ids = itertools.count()
        self._stats = _Stats()

    # ------------------------------------------------------------------------------------------- public API

    def start(self) -> None:
        """Start the child and build the tools now (else on first use), so that a config error — a tool class that
        cannot be imported or built — raises here: ``RuntimeError`` naming the class and the error."""
        self._check_open()
        self._ensure_threads()
        self._ensure_child()

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
        """``tool/*`` since the last ``reset_metrics()``: calls, failures by kind, child deaths and kills
        (``tool/crashes``), call latency as the caller waited for it once sent (mean, max)."""
        return self._stats.metrics()

    def reset_metrics(self) -> None:
        """Start counting afresh (the trainer reports the metrics of each step)."""
        self._stats.reset()

    def close(self) -> None:
        """Stop the child (asked, then killed after ``grace_s``); unanswered requests resolve as ``crashed``
        (not counted). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            child, queued = self._child, list(self._queue)
            self._queue.clear()
            pending = self._detach(child, closing=True) if child is not None else []
            self._lock.notify_all()
        self._stopped.set()
        if child is not None:
            _stop_child(child, self.grace_s)
        for request in pending + queued:
            _fail(self._stats, request, "crashed", "the tool host was closed")

    def __enter__(self) -> ToolHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- requests

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ToolHost is closed")

    def _submit(self, op: str, instance_id: str, payload: Any, name: str = "") -> Future:
        future: Future = Future()
        request = _Request(next(self._ids), op, instance_id, payload, future, name)
        with self._lock:
            self._check_open()
            if op == "call":
                self._stats.add("calls")
            error = self._start_error
            if error is None:
                self._queue.append(request)
                self._lock.notify_all()
        if error is not None:
            _fail(self._stats, request, "crashed", f"the tool process could not start: {error}")
        else:
            self._ensure_threads()
        return future

    def _ensure_threads(self) -> None:
        with self._lock:
            if self._threads:
                return
            self._threads = [
                threading.Thread(target=self._send_loop, name="tool-host-sender", daemon=True),
                threading.Thread(target=self._watch, name="tool-host-watchdog", daemon=True),
            ]
            for thread in self._threads:
                thread.start()

    def _next_request(self) -> Optional[_Request]:
        """The oldest request, once it may be sent (calls: fewer than ``max_concurrency`` in flight); ``None`` once
        closed. Strict order, so that a sample's create, calls and release reach the child in the order made."""
        with self._lock:
            while not self._closed:
                if self._queue:
                    head, child = self._queue[0], self._child
                    if head.op != "call" or child is None or child.calls < self.max_concurrency:
                        return self._queue.popleft()
                self._lock.wait()
        return None

    def _send_loop(self) -> None:
        while (request := self._next_request()) is not None:
            try:
                child = self._ensure_child()
            except RuntimeError as exc:
                with self._lock:
                    failed = [request, *self._queue]
                    self._queue.clear()
                for r in failed:
                    _fail(self._stats, r, "crashed", f"the tool process could not start: {exc}")
                continue
            self._send(child, request)

    def _send(self, child: _Child, request: _Request) -> None:
        try:  # pickled first, so that a payload that cannot be is told apart from a dead child
            data = ForkingPickler.dumps((request.req_id, request.op, request.instance_id, request.payload))
        except Exception as exc:  # noqa: BLE001 - this request fails, alone
            status = "bad_call" if request.op == "call" else "error"
            _fail(self._stats, request, status, f"the request cannot be sent to the tool process: {exc!r}")
            return
        with self._lock:
            closed = self._closed
            if child.detached and not closed:  # it died since: a fresh child gets the request
                self._queue.appendleft(request)
                self._lock.notify_all()
                return
            if not closed:
                budget = self.timeout_s * (1 if request.op == "call" else max(1, len(self.specs)))
                request.sent = time.monotonic()
                request.deadline = request.sent + budget + self.grace_s
                child.pending[request.req_id] = request
                child.calls += request.op == "call"
        if closed:
            _fail(self._stats, request, "crashed", "the tool host was closed")
            return
        try:
            with child.send_lock:
                child.conn.send_bytes(data)
        except (OSError, ValueError):
            pass  # the child died: the reader resolves the request with the others

    # ------------------------------------------------------------------------------------------- the child

    def _ensure_child(self) -> _Child:
        with self._spawn_lock:
            with self._lock:
                if self._start_error is not None:
                    raise RuntimeError(self._start_error)
                if self._child is not None:
                    return self._child
            try:
                child = _spawn_child(self)
            except RuntimeError as exc:
                with self._lock:
                    self._start_error = str(exc)
                logger.error("tool host: %s", exc)
                raise
            with self._lock:
                closed = self._closed
                if not closed:
                    self._child = child
            if closed:
                child.process.kill()
                child.process.join(5.0)
                raise RuntimeError("ToolHost is closed")
            threading.Thread(target=self._read, args=(child,), name="tool-host-reader", daemon=True).start()
            return child

    def _read(self, child: _Child) -> None:
        """The replies of one child, until it dies or is stopped; then its unanswered requests crash."""
        while True:
            try:
                message = child.conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # noqa: BLE001 - an unreadable reply: its request ends at the watchdog
                logger.exception("tool host: unreadable reply from the tool process")
                continue
            self._on_message(child, message)
        child.process.join(5.0)
        if child.process.is_alive():
            child.process.kill()
            child.process.join(5.0)
        with self._lock:
            died = not child.detached  # else killed by the watchdog or stopped by close(): handled there
            pending = self._detach(child) if died else []
            if died:
                self._stats.add("crashes")
        note = child.exit_note()
        if died:
            logger.warning("tool host: the tool process died (%s); it restarts on the next request", note)
        for request in pending:
            _fail(self._stats, request, "crashed", f"the tool process died ({note}) during the {request.op}")
        child.conn.close()

    def _on_message(self, child: _Child, message: Any) -> None:
        if message[0] == "finished":  # a timed-out synchronous call's thread ended
            with self._lock:
                child.lingering.pop(message[1], None)
            return
        req_id, reply, lingering = message
        with self._lock:
            request = child.pending.pop(req_id, None)
            if request is None:
                return
            if request.op == "call":
                child.calls -= 1
                self._lock.notify_all()
            if lingering:
                child.lingering[req_id] = request.deadline
        _resolve(request, reply, self._stats)

    def _detach(self, child: _Child, closing: bool = False) -> list[_Request]:
        """Under the lock: ``child`` is no longer the host's; its unanswered requests, to be resolved by the caller."""
        child.detached, child.closing = True, child.closing or closing
        if self._child is child:
            self._child = None
        pending = list(child.pending.values())
        child.pending.clear()
        child.lingering.clear()
        child.calls = 0
        self._lock.notify_all()
        return pending

    def _watch(self) -> None:
        """Kill the child when a request is overdue (module docstring); its requests resolve here."""
        tick = max(0.01, min(0.1, self.grace_s / 4))
        while not self._stopped.wait(tick):
            now = time.monotonic()
            with self._lock:
                child = self._child
                if child is None:
                    continue
                overdue = {i for i, r in child.pending.items() if r.deadline < now}
                hung = [i for i, deadline in child.lingering.items() if deadline < now]
                if not overdue and not hung:
                    continue
                pending = self._detach(child)
                self._stats.add("crashes")
            child.process.kill()
            logger.warning("tool host: a tool call hung past %g s; the tool process was killed", self._limit_s())
            for request in pending:
                if request.req_id in overdue:
                    what = request.name if request.op == "call" else f"{request.op} of the tools"
                    _fail(
                        self._stats,
                        request,
                        "timeout",
                        f"{what} did not return within {self._limit_s(request):g} s; the tool process was killed",
                    )
                else:
                    _fail(
                        self._stats,
                        request,
                        "crashed",
                        f"the tool process was killed during the {request.op} (another call hung)",
                    )

    def _limit_s(self, request: Optional[_Request] = None) -> float:
        return round(request.deadline - request.sent if request else self.timeout_s + self.grace_s, 3)


def _spawn_child(host: ToolHost) -> _Child:
    """A started tool process with its tools built, or ``RuntimeError`` saying why not."""
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    ours, theirs = ctx.Pipe()
    plain = [(s.class_name, s.config, s.schema) for s in host.specs]  # no tools-module classes in the args
    args = (theirs, plain, host.timeout_s, host.max_concurrency, host.memory_mb)
    process = ctx.Process(target=_child_main, args=args, name="tool-host", daemon=True)
    process.start()
    theirs.close()
    message: Any = None
    with contextlib.suppress(EOFError, OSError):
        if ours.poll(host.start_timeout_s):
            message = ours.recv()
    if isinstance(message, tuple) and message[0] == "ready":
        return _Child(process, ours)
    process.join(1.0)
    if process.is_alive():
        process.kill()
        process.join(5.0)
    ours.close()
    if isinstance(message, tuple) and message[0] == "init_error":
        raise RuntimeError(f"the tools could not be built: {message[1]}")
    if message is None and process.exitcode is not None and process.exitcode >= 0:
        note = _Child(process, None).exit_note()
        raise RuntimeError(f"the tool process exited while starting ({note}); see its output above")
    raise RuntimeError(f"the tool process did not start within {host.start_timeout_s:g} s")


def _stop_child(child: _Child, grace_s: float) -> None:
    """Ask the child to stop; kill it after ``grace_s``."""
    if child.send_lock.acquire(timeout=1.0):
        try:
            child.conn.send(("stop",))
        except Exception:  # noqa: BLE001 - the child is gone already
            pass
        finally:
            child.send_lock.release()
    child.process.join(grace_s)
    if child.process.is_alive():
        child.process.kill()
        child.process.join(5.0)


def _resolve(request: _Request, reply: Any, stats: _Stats) -> None:
    """A request answered by the child: counted, then its future set."""
    if request.op == "call":
        text, reward, status, latency, metrics = reply
        stats.status(status, time.monotonic() - request.sent)
        _set(request.future, ToolResult(text, reward, status, latency, metrics))
    elif request.op == "create":
        if reply is not None:
            stats.status("error")
        _set(request.future, reply)
    else:
        for message in reply:
            stats.status("error")
            logger.warning("tool host: release of %r: %s", request.instance_id, message)
        _set(request.future, None)


def _fail(stats: _Stats, request: _Request, status: str, message: str) -> None:
    """A request that the child did not answer: ``status`` is counted (``crashed`` is counted per death)."""
    if request.op == "call":
        stats.status(status, time.monotonic() - request.sent if request.sent else None)
        _set(request.future, ToolResult(f"error: {message}", 0.0, status, 0.0, {}))
    elif request.op == "create":
        stats.status(status)
        _set(request.future, message)
    else:
        _set(request.future, None)


class _Stats:
    """The ``tool/*`` counts and call latencies, kept in the parent (they survive a restart of the child)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._counts: dict[str, int] = dict.fromkeys(_COUNTS, 0)
            self._latencies: list[float] = []

    def add(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1

    def status(self, status: str, latency: Optional[float] = None) -> None:
        with self._lock:
            if status in _STATUS_COUNT:
                self._counts[_STATUS_COUNT[status]] += 1
            if latency is not None:
                self._latencies.append(latency)

    def metrics(self) -> dict[str, float]:
        with self._lock:
            out = {f"tool/{k}": float(v) for k, v in self._counts.items()}
            lat = list(self._latencies)
        out["tool/latency_mean_s"] = sum(lat) / len(lat) if lat else 0.0
        out["tool/latency_max_s"] = max(lat) if lat else 0.0
        return out


def _set(future: Future, value: Any) -> None:
    with contextlib.suppress(InvalidStateError):  # cancelled by the caller
        future.set_result(value)


# ----------------------------------------------------------------------------------------------- in the child

_REQUEST: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("tool_host_request", default=None)


def _child_main(conn: Any, specs: list, timeout_s: float, max_concurrency: int, memory_mb: Optional[int]) -> None:
    """The tool process: build the tools, say ready (or why not), serve requests until told to stop or the pipe
    closes, then exit at once (a hung tool thread must not hold the process)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if memory_mb:
        limit = int(memory_mb) * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        tools_module = importlib.import_module("megatron_dapo.agent.tools")
        server = _Server(conn, tools_module, timeout_s)
        server.build(specs, max_concurrency)
    except BaseException as exc:  # noqa: BLE001 - a config error, reported to start()
        conn.send(("init_error", str(exc) if isinstance(exc, _InitError) else f"{type(exc).__name__}: {exc}"))
        return
    loop = asyncio.new_event_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=max_concurrency + 16, thread_name_prefix="tool"))
    try:
        stopped = server.start_reading(loop)
    except BaseException as exc:  # noqa: BLE001 - e.g. no thread under memory_mb: a config error too
        conn.send(("init_error", f"the tool process cannot serve: {type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    main = loop.create_task(stopped.wait())
    while not main.done():
        try:
            loop.run_until_complete(main)
        except (SystemExit, KeyboardInterrupt):  # an async tool's sys.exit: its call fails, the process goes on
            continue
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


class _InitError(Exception):
    """A tool class that cannot be imported or built; the message names it."""


class _Server:
    """The child's side: the runner, the requests as asyncio tasks, and which synchronous tool methods still run
    (so that the parent learns of a timed-out call whose thread goes on, and of its end)."""

    def __init__(self, conn: Any, tools_module: types.ModuleType, timeout_s: float) -> None:
        self.conn, self.tools_module, self.timeout_s = conn, tools_module, timeout_s
        self.lock = threading.Lock()
        self.running: Counter = Counter()  # request -> synchronous tool methods running for it
        self.answered: set[int] = set()  # requests answered while one of their methods still ran
        self.runner: Any = None

    def build(self, specs: list, max_concurrency: int) -> None:
        tools = {}
        for class_name, config, schema in specs:
            spec = self.tools_module.ToolSpec(class_name, config, schema)
            try:
                tools.update(self.tools_module.build_tools([spec]))
            except BaseException as exc:  # noqa: BLE001 - SystemExit at import too
                what = f"tool class {class_name!r} (tool {spec.name!r})"
                raise _InitError(f"{what}: {type(exc).__name__}: {exc}") from exc
        tracked = {name: _Tracked(tool, self) for name, tool in tools.items()}
        self.runner = self.tools_module.ToolRunner(tracked, self.timeout_s, max_concurrency)

    def start_reading(self, loop: asyncio.AbstractEventLoop) -> asyncio.Event:
        """A thread that reads requests and starts a task for each on ``loop``; the event is set at stop or EOF."""
        stopped, tasks = asyncio.Event(), set()

        def on_message(message: Any) -> None:
            if message is None:
                stopped.set()
                return
            task = loop.create_task(self.handle(*message))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        def read() -> None:
            while True:
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):
                    message = None
                if message is None or message[0] == "stop":
                    loop.call_soon_threadsafe(on_message, None)
                    return
                loop.call_soon_threadsafe(on_message, message)

        threading.Thread(target=read, name="tool-host-requests", daemon=True).start()
        return stopped

    async def handle(self, req_id: int, op: str, instance_id: str, payload: Any) -> None:
        _REQUEST.set(req_id)  # this task's own context; tool threads inherit it (asyncio.to_thread copies it)
        try:
            if op == "call":
                result = await self.runner.call(instance_id, ToolCall(*payload))
                reply: Any = (result.text, result.reward, result.status, result.latency_s, _plain(result.metrics))
            else:
                reply = await self.each_tool(op, instance_id, payload or {})
                reply = (reply[0] if reply else None) if op == "create" else reply
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - a tool's sys.exit (or worse) fails its request only
            what = f"{payload[0]} failed" if op == "call" else f"{op} failed"
            text = f"{what}: {type(exc).__name__}: {exc}"
            reply = (f"error: {text}", 0.0, "error", 0.0, {}) if op == "call" else ([text] if op == "release" else text)
        self.reply(req_id, reply)

    async def each_tool(self, op: str, instance_id: str, tools_kwargs: dict) -> list[str]:
        """``create`` (with each tool's ``create_kwargs``, stopping at the first failure, as ``ToolRunner.create``)
        or ``release`` (all of them) for one sample; the failures, each naming its tool."""
        errors = []
        for name, tool in self.runner.tools.items():
            kwargs = ((tools_kwargs.get(name) or {}).get("create_kwargs") or {}) if op == "create" else {}
            try:
                await asyncio.wait_for(self.tools_module._run(getattr(tool, op), instance_id, **kwargs), self.timeout_s)
            except asyncio.TimeoutError:
                errors.append(f"{name}.{op} timed out after {self.timeout_s:g} s")
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                errors.append(f"{name}.{op} failed: {type(exc).__name__}: {exc}")
            if errors and op == "create":
                break
        return errors

    def enter(self, req_id: Optional[int]) -> None:
        with self.lock:
            self.running[req_id] += 1

    def leave(self, req_id: Optional[int]) -> None:
        with self.lock:
            self.running[req_id] -= 1
            if self.running[req_id] <= 0:
                del self.running[req_id]
                if req_id in self.answered:
                    self.answered.discard(req_id)
                    self._send(("finished", req_id))

    def reply(self, req_id: int, reply: Any) -> None:
        with self.lock:
            lingering = self.running[req_id] > 0
            if lingering:
                self.answered.add(req_id)
            try:
                self._send((req_id, reply, lingering))
            except Exception as exc:  # noqa: BLE001 - an unpicklable reply (or no memory): say so instead
                text = f"the tool's answer cannot be sent: {type(exc).__name__}: {exc}"
                fallback = (f"error: {text}", 0.0, "error", 0.0, {}) if isinstance(reply, tuple) else [text]
                self._send((req_id, text if isinstance(reply, str) else fallback, lingering))

    def _send(self, message: Any) -> None:
        with contextlib.suppress(OSError):  # the parent is gone: the process ends with the pipe
            self.conn.send(message)


class _Tracked:
    """A tool whose synchronous ``create``/``execute``/``release`` tell the server while they run (they still run
    in the runner's threads); async methods and every other attribute are the tool's own."""

    def __init__(self, tool: Any, server: _Server) -> None:
        self._tool = tool
        for method in ("create", "execute", "release"):
            fn = getattr(tool, method, None)
            if fn is not None and not inspect.iscoroutinefunction(fn):
                setattr(self, method, _tracking(fn, server))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tool, name)


def _tracking(fn: Any, server: _Server) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        req_id = _REQUEST.get()
        server.enter(req_id)
        try:
            return fn(*args, **kwargs)
        finally:
            server.leave(req_id)

    return run


def _plain(metrics: dict) -> dict:
    """A tool's metrics as builtins (numbers as floats), which the parent can always unpickle."""
    return {str(k): float(v) if isinstance(v, numbers.Real) else str(v) for k, v in (metrics or {}).items()}
