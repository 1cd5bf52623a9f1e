"""One tool worker process: the child side of :class:`~megatron_dapo.agent.host.ToolHost`'s pool.

A worker builds every tool of the tool YAML, then serves requests from its pipe, each as an asyncio task on one event
loop (so async tools keep one loop for their clients and locks); synchronous tool methods run in threads, each
bounded by ``timeout_s`` (``agent/tools.ToolRunner``). What it tells the parent, besides the replies:

* ``("started", req_id)`` when a request's task begins: a request that never started (queued behind a call that
  blocks the loop) is sent again to the replacement worker if this one is killed; one that started is lost with it.
  A ``ping`` request (the parent's, while a call runs long) is answered as it begins: the loop is not blocked;
* ``(req_id, reply, lingering)``: ``lingering`` when a synchronous method of the request still runs in its thread
  (the call was answered as timed out); ``("finished", req_id)`` when that thread ends;
* ``("withdrawn", req_ids)``, answering the parent's ``("withdraw", req_ids)`` from the reader thread (the loop may
  be blocked): which of them had not begun; those never will here (the parent sends them to another worker);
* a call may carry ``recreate`` kwargs: its instance was lost with an earlier worker, so the worker creates it first
  (verl's ``tools_kwargs``), says ``started`` again, then runs the call, in the same task.

A reply's text longer than ``max_reply_chars`` is cut to its first and last halves (the chat's own truncation,
``agent/chat.truncate_text``, reads only those), so a tool that answers gigabytes cannot fill the trainer's memory.
The worker ignores SIGINT (Ctrl-C is the trainer's), caps its address space (``RLIMIT_AS``) at ``memory_mb`` MiB
more than it holds when it starts, and imports no torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import importlib
import inspect
import numbers
import os
import resource
import signal
import sys
import threading
import types
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from megatron_dapo.agent.hermes import ToolCall

__all__ = ["worker_main"]

_REQUEST: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("tool_worker_request", default=None)


def worker_main(
    conn: Any, specs: list, timeout_s: float, max_concurrency: int, memory_mb: Optional[int], max_reply_chars: int
) -> None:
    """The tool process: build the tools, say ready (or why not), serve requests until told to stop or the pipe
    closes, then exit at once (a hung tool thread must not hold the process)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if memory_mb:  # on top of what it holds now (the template's imports, the trainer's main module)
        _few_malloc_arenas()
        limit = _address_space() + int(memory_mb) * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        tools_module = importlib.import_module("megatron_dapo.agent.tools")
        server = _Server(conn, tools_module, timeout_s, max_reply_chars)
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
    """The worker's side: the runner, the requests as asyncio tasks, and which synchronous tool methods still run
    (so that the parent learns of a timed-out call whose thread goes on, and of its end)."""

    def __init__(self, conn: Any, tools_module: types.ModuleType, timeout_s: float, max_reply_chars: int) -> None:
        self.conn, self.tools_module, self.timeout_s = conn, tools_module, timeout_s
        self.max_reply_chars = int(max_reply_chars)
        self.lock = threading.Lock()
        self.running: Counter = Counter()  # request -> synchronous tool methods running for it
        self.answered: set[int] = set()  # requests answered while one of their methods still ran
        self.begun: set[int] = set()  # requests begun and not answered yet
        self.withdrawn: set[int] = set()  # requests the parent took back before they began
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
                if message[0] == "withdraw":  # answered here, not by the loop, which may be blocked
                    self.withdraw(message[1])
                    continue
                loop.call_soon_threadsafe(on_message, message)

        threading.Thread(target=read, name="tool-worker-requests", daemon=True).start()
        return stopped

    async def handle(self, req_id: int, op: str, instance_id: str, payload: Any) -> None:
        _REQUEST.set(req_id)  # this task's own context; tool threads inherit it (asyncio.to_thread copies it)
        with self.lock:
            if req_id in self.withdrawn:  # the parent sent it to another worker
                self.withdrawn.discard(req_id)
                return
            self.begun.add(req_id)
            self._send(("started", req_id))
            if op == "ping":  # the loop runs: that is the answer
                self.begun.discard(req_id)
                self._send((req_id, None, False))
                return
        try:
            if op == "call":
                reply: Any = await self.call(instance_id, *payload)
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

    async def call(
        self, instance_id: str, name: str, arguments: dict, error: Optional[str], recreate: Optional[dict]
    ) -> tuple:
        """One call as a plain tuple; with ``recreate``, the instance (lost with an earlier worker) is created first."""
        if recreate is not None:
            errors = await self.each_tool("create", instance_id, recreate)
            if errors:
                text = f"error: the tool instance was lost with its worker and could not be created again: {errors[0]}"
                return (text, 0.0, "error", 0.0, {})
            with self.lock:  # the call itself begins now: its own timeout_s runs from here
                self._send(("started", _REQUEST.get()))
        result = await self.runner.call(instance_id, ToolCall(name, arguments, error))
        text = _cut(str(result.text), self.max_reply_chars)
        return (text, result.reward, result.status, result.latency_s, _plain(result.metrics))

    async def each_tool(self, op: str, instance_id: str, tools_kwargs: dict) -> list[str]:
        """``create`` (with each tool's ``create_kwargs``, stopping at the first failure, as ``ToolRunner.create``)
        or ``release`` (all of them) for one sample; the failures, each naming its tool."""
        errors = []
        for name, tool in self.runner.tools.items():
            kwargs = ((tools_kwargs.get(name) or {}).get("create_kwargs") or {}) if op == "create" else {}
            try:
                async with asyncio.timeout(self.timeout_s):  # in this task (agent/tools.ToolRunner.call says why)
                    await self.tools_module._run(getattr(tool, op), instance_id, **kwargs)
            except TimeoutError:
                errors.append(f"{name}.{op} timed out after {self.timeout_s:g} s")
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                errors.append(f"{name}.{op} failed: {type(exc).__name__}: {exc}")
            if errors and op == "create":
                break
        return errors

    def withdraw(self, req_ids: list[int]) -> None:
        """The parent takes back requests that have not begun (this worker's loop is blocked): those that have not,
        never will here; the parent learns which."""
        with self.lock:
            taken = [i for i in req_ids if i not in self.begun]
            self.withdrawn.update(taken)
            self._send(("withdrawn", taken))

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
            self.begun.discard(req_id)  # answered: the parent no longer withdraws it (its reply comes first)
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


def _few_malloc_arenas() -> None:
    """glibc reserves 64 MiB of address space for each thread's own malloc arena: under ``RLIMIT_AS`` a handful of
    tool threads would use up the cap. Two arenas, shared by every thread (elsewhere, nothing to do)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).mallopt(-8, 2)  # M_ARENA_MAX


def _address_space() -> int:
    """This process's virtual size in bytes (Linux ``/proc``; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _cut(text: str, max_chars: int) -> str:
    """``text`` cut to its first and last ``max_chars // 2`` characters when longer (module docstring)."""
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return text[:half] + text[len(text) - (max_chars - half) :]


def _plain(metrics: dict) -> dict:
    """A tool's metrics as builtins (numbers as floats), which the parent can always unpickle."""
    return {str(k): float(v) if isinstance(v, numbers.Real) else str(v) for k, v in (metrics or {}).items()}
