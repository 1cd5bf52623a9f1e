"""Tool workers forked from a template process, so that replacing one costs milliseconds, not an interpreter start.

A tool that hangs or exits costs its worker, and a faulty tool may do so on many calls of a step; a fresh
``forkserver`` child costs about half a second of CPU (the interpreter's imports, the trainer's main module, the
tool modules). So each :class:`~megatron_dapo.agent.host.ToolHost` starts one *zygote* (``forkserver`` where available,
else ``spawn``; never ``fork``, since the trainer holds threads) that imports the worker's modules and the tool
classes — without building any tool — and then, single-threaded, forks a worker on request
(``agent/worker.worker_main``), hands the trainer its end of the worker's pipe (``SCM_RIGHTS``), and reports each
worker's exit status (it is their parent, so it reaps them). A worker builds its tools after the fork. The zygote
ignores SIGINT; when it is told to stop or the trainer's end of its pipe closes, it kills its workers and exits; if
it dies otherwise, its workers die with it (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import threading
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any, Optional

from megatron_dapo.agent import tools as tools_module
from megatron_dapo.agent.worker import worker_main

__all__ = ["ForkedProcess", "Zygote"]


class ForkedProcess:
    """A worker forked by the zygote, with the part of ``multiprocessing.Process`` the host uses."""

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid, self._zygote = pid, zygote

    @property
    def exitcode(self) -> Optional[int]:
        return self._zygote.exit_codes.get(self.pid)

    def is_alive(self) -> bool:
        return self.exitcode is None and self._zygote.alive()

    def join(self, timeout: Optional[float] = None) -> None:
        with self._zygote.exited:
            self._zygote.exited.wait_for(lambda: not self.is_alive(), timeout)

    def kill(self) -> None:
        if self.is_alive():  # not reaped yet, so the pid is still this worker's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


class Zygote:
    """The trainer's end of the template process: ``fork()`` gives a new worker's process and pipe."""

    def __init__(self, specs: list, limits: tuple, start_timeout_s: float) -> None:
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        ours, theirs = ctx.Pipe()
        self.process = ctx.Process(target=zygote_main, args=(theirs, specs, limits), name="tool-zygote", daemon=True)
        self.process.start()
        theirs.close()
        self.conn, self.exit_codes, self.exited = ours, {}, threading.Condition()
        self._forks: list = []  # (pid, fd) handed over, in order
        message: Any = None
        with contextlib.suppress(EOFError, OSError):
            if ours.poll(start_timeout_s):
                message = ours.recv()
        if not (isinstance(message, tuple) and message[0] == "ready"):
            self.close()
            if isinstance(message, tuple) and message[0] == "init_error":
                raise RuntimeError(f"the tools could not be built: {message[1]}")
            raise RuntimeError(f"the tool process did not start within {start_timeout_s:g} s")
        self._lock = threading.Lock()  # one fork at a time: the handle follows its message
        threading.Thread(target=self._read, name="tool-zygote-reader", daemon=True).start()

    def alive(self) -> bool:
        return self.process.is_alive()

    def fork(self, timeout_s: float) -> tuple[ForkedProcess, Connection]:
        """A new worker (not ready yet: it builds its tools and then says so on its pipe)."""
        with self._lock, self.exited:
            try:
                self.conn.send(("fork",))
            except OSError as exc:
                raise RuntimeError(f"the tool zygote is gone: {exc}") from exc
            if not self.exited.wait_for(lambda: self._forks or not self.alive(), timeout_s) or not self._forks:
                raise RuntimeError("the tool zygote did not fork a worker")
            pid, fd = self._forks.pop(0)
        return ForkedProcess(pid, self), Connection(fd)

    def close(self) -> None:
        """Its workers are killed and it exits. Asked, not by closing the pipe: the reader thread's pending read
        would keep the pipe open."""
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(("stop",))
        self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        with contextlib.suppress(OSError):
            self.conn.close()

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
                fd = recv_handle(self.conn) if message[0] == "forked" else None
            except (EOFError, OSError):
                break
            with self.exited:
                if message[0] == "forked":
                    self._forks.append((message[1], fd))
                else:  # ("exited", pid, code)
                    self.exit_codes[message[1]] = message[2]
                self.exited.notify_all()
        self.process.join(5.0)
        with self.exited:  # every worker is gone with the zygote (it kills them when it exits)
            self.exited.notify_all()


def zygote_main(conn: Any, specs: list, limits: tuple) -> None:
    """The template process: import the tool classes, say ready (or why not), then fork workers on request and
    report their exits, until told to stop or the trainer's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for class_name, config, schema in specs:
        try:
            tools_module.import_tool_class(class_name)
        except BaseException as exc:  # noqa: BLE001 - a config error, reported to start(); SystemExit at import too
            name = tools_module.ToolSpec(class_name, config, schema).name
            conn.send(("init_error", f"tool class {class_name!r} (tool {name!r}): {type(exc).__name__}: {exc}"))
            return
    conn.send(("ready", None))
    children: set[int] = set()
    while True:
        try:
            message = conn.recv() if conn.poll(0.05) else None
        except (EOFError, OSError):
            break
        if message is not None and message[0] == "stop":
            break
        if message is not None and message[0] == "fork":
            children.add(_fork_worker(conn, specs, limits))
        _reap(conn, children, block=False)
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _reap(None, children, block=True)
    os._exit(0)


def _fork_worker(conn: Any, specs: list, limits: tuple) -> int:
    ours, theirs = multiprocessing.Pipe()
    pid = os.fork()
    if pid == 0:  # the worker: only its own end of its own pipe stays open
        try:
            _die_with_parent(zygote=os.getppid())
            conn.close()
            ours.close()
            worker_main(theirs, specs, *limits)  # exits by itself once it has served; returns if it cannot start
        finally:
            os._exit(1)
    theirs.close()
    conn.send(("forked", pid))
    send_handle(conn, ours.fileno(), 0)
    ours.close()
    return pid


def _die_with_parent(zygote: int) -> None:
    """Linux: the worker is killed when the zygote dies, however it dies (a worker stuck in a tool would otherwise
    outlive the run)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != zygote:  # it died before the call above
        os._exit(1)


def _reap(conn: Any, children: set[int], block: bool) -> None:
    """Collect the workers that exited and report their exit codes (negative: the signal that killed them)."""
    while children:
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send(("exited", pid, os.waitstatus_to_exitcode(status)))
