"""The tool host (``agent/host.py``): user tools in a real child process, every way a tool can fail (raise, time
out, exit, exhaust memory, hang holding the GIL) ending as a message and a count, and the host serving on.

The tests wait for what they need to have happened (a file the tool writes when it runs, a condition polled with a
bound), never for a fixed time; where the outcome depends on which deadlines have passed, the host's clock is the
test's (``HostClock``)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from megatron_dapo.agent import host as host_module
from megatron_dapo.agent import pool as pool_module
from megatron_dapo.agent.hermes import ToolCall
from megatron_dapo.agent.host import ToolHost
from megatron_dapo.agent.tools import ToolSpec

USER_TOOLS = '''
import os, re, resource, sys, time

class Secret:
    """Holds a per-sample secret (create_kwargs); a verl-style class: (config, tool_schema)."""
    def __init__(self, config, tool_schema):
        self.offset, self.secrets = config["offset"], {}
    def create(self, instance_id, secret=0):
        self.secrets[instance_id] = secret
    def execute(self, instance_id, arguments):
        if "started" in arguments:  # tells the test that the call runs in this process
            open(arguments["started"], "w").close()
        time.sleep(arguments.get("sleep", 0))
        return str(self.secrets[instance_id] + arguments["x"] + self.offset), 0.5, {"looked_up": 1}
    def release(self, instance_id):
        self.secrets.pop(instance_id)

class Misbehave:
    """Fails as the call says."""
    def __init__(self, config, tool_schema): pass
    def create(self, instance_id): pass
    def release(self, instance_id): pass
    def execute(self, instance_id, arguments):
        how = arguments["how"]
        if how == "probe":  # where it runs, what it imported, its memory limit above its size now
            limit = resource.getrlimit(resource.RLIMIT_AS)[0]
            size = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            return f"{os.getpid()} {'torch' in sys.modules} {limit - size if limit >= 0 else limit}"
        if how == "raise":
            raise KeyError("boom")
        if how == "sysexit":
            sys.exit(4)
        if how == "sleep":
            time.sleep(arguments["s"])
        if how == "exit":
            os._exit(3)
        if how == "hog":
            return str(len(bytearray(arguments["mb"] * 2**20)))
        if how == "spin":
            while True:
                pass
        if how == "regex":  # catastrophic backtracking: C code that holds the GIL for ages
            open(arguments["holding"], "w").close()  # tells the test: from the next line on, the GIL is held
            re.match(r"(a+)+$", "a" * 40 + "!")
        if how == "huge":
            return "<" + "x" * arguments["n"] + ">"
        return how

class AsyncLookup:
    """The user's kind of tool: async methods, no base class; ``block`` blocks the worker's event loop."""
    def __init__(self, config, tool_schema):
        self.secrets = {}
    async def create(self, instance_id, secret=0):
        self.secrets[instance_id] = secret
    async def execute(self, instance_id, arguments):
        if arguments.get("block"):
            time.sleep(arguments["block"])  # not await asyncio.sleep: nothing else on this worker's loop runs
        if arguments.get("exit"):
            os._exit(5)
        return str(self.secrets[instance_id] + arguments.get("x", 0))
    async def release(self, instance_id):
        self.secrets.pop(instance_id, None)
'''


def specs(tmp_path) -> list[ToolSpec]:
    (tmp_path / "user_tools.py").write_text(USER_TOOLS)
    schema = lambda name: {"type": "function", "function": {"name": name, "parameters": {}}}  # noqa: E731
    return [
        ToolSpec(f"{tmp_path / 'user_tools.py'}:Secret", {"offset": 100}, schema("secret")),
        ToolSpec(f"{tmp_path / 'user_tools.py'}:Misbehave", {}, schema("misbehave")),
        ToolSpec(f"{tmp_path / 'user_tools.py'}:AsyncLookup", {}, schema("alookup")),
    ]


def counts(host: ToolHost) -> dict[str, float]:
    return {k: v for k, v in host.metrics().items() if not k.startswith("tool/latency")}


def expect(calls=0, errors=0, timeouts=0, unknown_tool=0, bad_call=0, crashes=0, resent=0) -> dict[str, float]:
    out = dict(calls=calls, errors=errors, timeouts=timeouts, unknown_tool=unknown_tool, bad_call=bad_call)
    return {f"tool/{k}": float(v) for k, v in {**out, "crashes": crashes, "resent": resent}.items()}


def probe(host: ToolHost, instance: str = "p") -> tuple[int, str, int]:
    """The pid of the worker that ``instance`` is pinned to, whether it imported torch, how much address space it
    may still take (-1: no limit)."""
    pid, torch, limit = host.call(instance, ToolCall("misbehave", {"how": "probe"})).result(timeout=30).text.split()
    return int(pid), torch, int(limit)


def misbehave(host: ToolHost, how: str, instance: str = "m", **arguments):
    return host.call(instance, ToolCall("misbehave", {"how": how, **arguments}))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def secret_kwargs(secret: int) -> dict:
    return {"secret": {"create_kwargs": {"secret": secret}}, "alookup": {"create_kwargs": {"secret": secret}}}


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Return as soon as ``condition()`` holds (polled every 5 ms); fail naming ``what`` after ``timeout_s``, a bound
    that only a broken host reaches."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.005)


class HostClock:
    """Stands in for ``agent.host``'s ``time`` module: ``monotonic()`` reads ``now``, which only the test moves, so
    which request deadlines have passed when the watchdog looks is the test's choice, not the scheduler's. ``sent``
    counts the reads of the host's sender thread, one per request it sends (its ``sent`` time)."""

    def __init__(self) -> None:
        self.now, self.sent = 0.0, 0

    def monotonic(self) -> float:
        if threading.current_thread().name.startswith("tool-host-sender"):
            self.sent += 1
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)  # the rest of the module is the real one


def test_user_tool_from_a_file_serves_many_instances_concurrently(tmp_path):
    with ToolHost(specs(tmp_path), timeout_s=5, max_concurrency=4) as host:
        host.start()
        pid, torch, _ = probe(host)
        assert pid != os.getpid() and torch == "False"  # a child that imported no torch
        created = [host.create(f"s{i}", {"secret": {"create_kwargs": {"secret": 10 * i}}}) for i in range(8)]
        assert [f.result(timeout=30) for f in created] == [None] * 8
        started = time.perf_counter()
        futures = [host.call(f"s{i}", ToolCall("secret", {"x": i, "sleep": 0.3})) for i in range(8)]
        results = [f.result(timeout=30) for f in futures]
        elapsed = time.perf_counter() - started
        assert [r.text for r in results] == [str(100 + 11 * i) for i in range(8)]  # each sample's own secret
        assert {(r.status, r.reward, tuple(r.metrics.items())) for r in results} == {("ok", 0.5, (("looked_up", 1.0),))}
        assert 0.55 < elapsed < 2.0  # 8 calls of 0.3 s, 4 at a time: two waves, not one, not eight
        assert [host.release(f"s{i}").result(timeout=30) for i in range(8)] == [None] * 8
        assert counts(host) == expect(calls=9)
        assert 0.3 <= host.metrics()["tool/latency_max_s"] < 2.0
        host.reset_metrics()
        assert counts(host) == expect() and host.metrics()["tool/latency_max_s"] == 0.0


def test_failures_become_messages_and_the_host_serves_on(tmp_path):
    with ToolHost(specs(tmp_path), timeout_s=0.4, grace_s=10) as host:
        host.create("m").result(timeout=30)
        pid = probe(host, "m")[0]
        raised, exited = misbehave(host, "raise").result(30), misbehave(host, "sysexit").result(30)
        assert (raised.status, raised.text) == ("error", "error: misbehave failed: KeyError: 'boom'")
        assert (exited.status, exited.text) == ("error", "error: misbehave failed: SystemExit: 4")
        unknown = host.call("m", ToolCall("nope", {})).result(30)
        assert unknown.status == "unknown_tool" and unknown.text.startswith("error: no tool named 'nope'")
        bad = host.call("m", ToolCall(error="the tool call is not valid JSON")).result(30)
        assert (bad.status, bad.text) == ("bad_call", "error: the tool call is not valid JSON")
        unsendable = misbehave(host, lambda: 0).result(30)  # cannot be pickled
        assert unsendable.status == "bad_call" and unsendable.text.startswith("error: the request cannot be sent")
        slow = misbehave(host, "sleep", s=3).result(30)  # a sync tool: its thread sleeps on
        assert (slow.status, slow.text) == ("timeout", "error: misbehave timed out after 0.4 s")
        started = time.perf_counter()
        assert misbehave(host, "fine").result(30).text == "fine"
        assert time.perf_counter() - started < 1.0 and probe(host, "m")[0] == pid  # at once, by the same worker
        assert counts(host) == expect(calls=9, errors=2, timeouts=1, unknown_tool=1, bad_call=2)


def test_a_tool_that_exits_costs_its_worker_only_and_its_instances_are_created_again(tmp_path):
    """Four workers, eight samples pinned two to a worker (s0..s3, then s4..s7, least loaded first). s0's tool calls
    ``os._exit`` while s1..s3 each have a call running on their own workers: only the calls on s0's worker fail;
    s4, pinned to the same worker, is created again from its ``tools_kwargs`` on its next call and answers with its
    own secret, as does s0."""
    with ToolHost(specs(tmp_path), timeout_s=10, workers=4) as host:
        created = [host.create(f"s{i}", secret_kwargs(10 * i)) for i in range(8)]
        assert [f.result(timeout=30) for f in created] == [None] * 8
        pids = [probe(host, f"s{i}")[0] for i in range(8)]
        assert len(set(pids)) == 4 and pids[:4] == pids[4:]  # pinned: s_i and s_(i+4) share a worker
        # In flight when s0's worker dies: on s0's worker (it says it runs), and on each other worker.
        started = [tmp_path / f"started{i}" for i in range(4)]
        other = host.call("s0", ToolCall("secret", {"x": 1, "sleep": 30, "started": str(started[0])}))
        calls = [ToolCall("secret", {"x": 1, "sleep": 0.5, "started": str(started[i])}) for i in (1, 2, 3)]
        bystanders = [host.call(f"s{i}", call) for i, call in zip((1, 2, 3), calls)]
        wait_until(lambda: all(p.exists() for p in started), "a call runs on every worker")
        exited = misbehave(host, "exit", "s0").result(timeout=30)
        assert (exited.status, exited.text) == ("crashed", "error: the tool worker died (exit code 3) during the call")
        assert other.result(timeout=30).status == "crashed" and "exit code 3" in other.result().text
        assert [b.result(timeout=30).text for b in bystanders] == [str(100 + 10 * i + 1) for i in (1, 2, 3)]
        assert counts(host) == expect(calls=13, crashes=1)
        again = [host.call(f"s{i}", ToolCall("secret", {"x": 2})) for i in (4, 0)]  # created again, then called
        assert [f.result(timeout=30).text for f in again] == ["142", "102"]
        assert probe(host, "s4")[0] not in pids and probe(host, "s1")[0] == pids[1]
        assert [host.release(f"s{i}").result(timeout=30) for i in range(8)] == [None] * 8
        assert counts(host) == expect(calls=17, crashes=1)


@pytest.mark.parametrize("max_concurrency", [16, 2])  # 2: one call in flight per worker, found blocked by a ping
def test_an_async_tool_blocking_its_loop_ends_at_timeout_plus_grace_and_costs_only_its_call(tmp_path, max_concurrency):
    """The user's case: an async tool that blocks its worker's event loop (``time.sleep`` in ``async def``). It is
    answered as timed out at ``timeout_s + grace_s`` (its worker killed); the calls of the other workers go on
    meanwhile; a call queued behind it on the same worker, which never began, is taken back after ``stall_s`` and
    answered by a fresh worker (its instance created again there) long before the blocked call ends; and the
    blocked sample's next call answers too."""
    timeout_s, grace_s = 2.0, 0.5
    limits = dict(timeout_s=timeout_s, grace_s=grace_s, max_concurrency=max_concurrency, stall_s=0.2)
    with ToolHost(specs(tmp_path), workers=2, **limits) as host:
        assert [host.create(f"s{i}", secret_kwargs(i)).result(timeout=30) for i in range(4)] == [None] * 4
        pids = [probe(host, f"s{i}")[0] for i in range(4)]
        assert pids[0] == pids[2] != pids[1] == pids[3]  # s0, s2 on one worker; s1, s3 on the other
        sent = time.monotonic()
        hung = host.call("s0", ToolCall("alookup", {"block": 60}))
        behind = host.call("s2", ToolCall("alookup", {"x": 10}))  # same worker, after the blocking call
        assert (behind.result(timeout=30).status, behind.result().text) == ("ok", "12")
        assert not hung.done()  # answered elsewhere while the loop it was sent to is still blocked
        others = []  # the other worker answers call after call while s0's worker is blocked
        while not hung.done():
            others.append(host.call("s1", ToolCall("alookup", {"x": len(others)})).result(timeout=30))
        elapsed = time.monotonic() - sent
        result = hung.result()
        assert (result.status, result.text) == (
            "timeout",
            f"error: alookup did not return within {timeout_s + grace_s:g} s; its worker was killed",
        )
        assert 1.0 <= elapsed / (timeout_s + grace_s) < 2.0  # bounded by timeout + grace, not by the 60 s sleep
        assert len(others) >= 2 and [r.text for r in others] == [str(1 + k) for k in range(len(others))]
        assert host.call("s0", ToolCall("alookup", {"x": 5})).result(timeout=30).text == "5"
        assert probe(host, "s0")[0] not in pids and probe(host, "s1")[0] == pids[1]
        resent = int(max_concurrency > 2)  # "behind" was sent to the blocked worker, or waited in its slot's queue
        assert counts(host) == expect(calls=len(others) + 9, timeouts=1, crashes=1, resent=resent)


def test_memory_limit_turns_a_huge_allocation_into_an_error(tmp_path):
    with ToolHost(specs(tmp_path), timeout_s=10, memory_mb=256, workers=2) as host:
        pid, _, room = probe(host, "m")
        # 256 MiB above its size at start, of which its threads took a part (their stacks, one malloc arena)
        assert 100 * 2**20 < room <= 256 * 2**20
        assert probe(host, "p")[0] != pid  # each worker has its own limit
        assert misbehave(host, "hog", mb=64).result(timeout=30).text == str(64 * 2**20)  # under the limit: fine
        started = tmp_path / "started"  # a call of another worker, running while the allocation fails
        bystander = host.call("p", ToolCall("secret", {"x": 1, "sleep": 0.5, "started": str(started)}))
        wait_until(started.exists, "the bystander runs")
        hog = misbehave(host, "hog", mb=4096).result(timeout=30)
        assert (hog.status, hog.text) == ("error", "error: misbehave failed: MemoryError: ")
        assert bystander.result(timeout=30).status == "error"  # "p" was never created: the tool's own KeyError
        assert probe(host, "m")[0] == pid  # the same worker goes on
        assert counts(host) == expect(calls=6, errors=2)


def test_a_huge_answer_keeps_its_first_and_last_characters(tmp_path):
    with ToolHost(specs(tmp_path), timeout_s=10, workers=1, max_reply_chars=1000) as host:
        text = misbehave(host, "huge", n=200_000).result(timeout=30).text
        assert text == "<" + "x" * 998 + ">"
        assert misbehave(host, "huge", n=998).result(timeout=30).text == "<" + "x" * 998 + ">"  # 1000: as is


def test_a_timed_out_sync_tool_that_spins_on_retires_its_worker(tmp_path):
    """A synchronous call answered as timed out whose thread still runs at ``timeout_s + grace_s`` retires its worker:
    a call beside it on that worker is answered meanwhile; the retired worker, which holds no request, is stopped
    (not a crash); the sample's next call reaches a fresh worker, its instance created again."""
    with ToolHost(specs(tmp_path), timeout_s=0.3, grace_s=0.4, workers=1, max_concurrency=2) as host:
        host.create("m", secret_kwargs(4)).result(timeout=30)
        pid = probe(host, "m")[0]
        started = tmp_path / "started"
        beside = host.call("m", ToolCall("secret", {"x": 1, "sleep": 0.1, "started": str(started)}))
        wait_until(started.exists, "the call beside runs")
        spin = misbehave(host, "spin").result(timeout=30)
        assert (spin.status, spin.text) == ("timeout", "error: misbehave timed out after 0.3 s")
        assert beside.result(timeout=30).text == "105"
        wait_until(lambda: not alive(pid), "the retired worker is stopped", timeout_s=10)
        assert host.call("m", ToolCall("secret", {"x": 2})).result(timeout=30).text == "106"
        assert probe(host, "m")[0] != pid  # a fresh worker answers
        assert counts(host) == expect(calls=5, timeouts=1)


def test_watchdog_kills_a_tool_that_holds_the_gil(tmp_path, monkeypatch):
    """A call stuck in C code holding its worker's GIL: killed at ``timeout_s + grace_s`` after it began; the call
    sent behind it on that worker never began, so it goes to the replacement worker and answers there."""
    clock = HostClock()  # the deadlines below are on it; the worker's own timeouts are on the real clock
    monkeypatch.setattr(host_module, "time", clock)
    monkeypatch.setattr(pool_module, "time", clock)
    with ToolHost(specs(tmp_path), timeout_s=0.3, grace_s=0.4, workers=1) as host:
        pid = probe(host)[0]
        host.create("a", {"secret": {"create_kwargs": {"secret": 1}}}).result(timeout=30)
        holding, sent_at = tmp_path / "holding", time.monotonic()
        stuck = misbehave(host, "regex", holding=str(holding))  # begun at 0: its deadline is 0.7
        wait_until(holding.exists, "the stuck call holds the worker's GIL")
        # The worker's event loop cannot run: its own timeout (timeout_s, real time) passes without an answer.
        wait_until(lambda: time.monotonic() - sent_at > 0.3, "timeout_s passes")
        clock.now, before = 0.5, clock.sent
        bystander = host.call("a", ToolCall("secret", {"x": 1}))
        wait_until(lambda: clock.sent > before, "the bystander is sent")  # at 0.5; it cannot begin
        clock.now = 0.8  # the stuck call is overdue: the watchdog kills the worker
        assert (stuck.result(timeout=30).status, stuck.result().text) == (
            "timeout",
            "error: misbehave did not return within 0.7 s; its worker was killed",
        )
        assert (bystander.result(timeout=30).status, bystander.result().text) == ("ok", "102")  # "a" created again
        assert counts(host) == expect(calls=3, timeouts=1, crashes=1, resent=1)
        assert probe(host)[0] != pid


def test_a_tool_class_that_cannot_be_imported_is_a_config_error(tmp_path):
    broken = [*specs(tmp_path), ToolSpec("no_such_module_xyz.Tool", {}, {"function": {"name": "ghost"}})]
    with ToolHost(broken) as host, pytest.raises(RuntimeError) as err:
        host.start()
    assert str(err.value) == (
        "the tools could not be built: tool class 'no_such_module_xyz.Tool' (tool 'ghost'): "
        "ModuleNotFoundError: No module named 'no_such_module_xyz'"
    )
    with ToolHost(broken) as lazy:  # not started: the requests say why
        result = lazy.call("a", ToolCall("secret", {"x": 1})).result(timeout=30)
        assert result.status == "crashed" and result.text.startswith("error: the tool process could not start: ")
        assert "no_such_module_xyz.Tool" in result.text
        assert "no_such_module_xyz.Tool" in lazy.create("a").result(timeout=30)
        assert counts(lazy) == expect(calls=1)


def test_close_stops_the_child_and_is_idempotent(tmp_path):
    host = ToolHost(specs(tmp_path))
    with host:
        pid = probe(host)[0]
        os.kill(pid, 0)  # alive
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped and reaped
    host.close()
    with pytest.raises(RuntimeError, match="closed"):
        host.call("a", ToolCall("secret", {"x": 1}))


def test_workers_die_with_their_zygote_and_the_host_starts_another(tmp_path):
    """The template process the workers are forked from (``agent/zygote.py``) killed: its workers die with it (not
    left behind, whatever they run), the calls they held end as ``crashed``, and the next call is answered by a
    worker of a fresh template, its instance created again."""
    with ToolHost(specs(tmp_path), timeout_s=30, workers=1) as host:
        host.create("a", secret_kwargs(3)).result(timeout=30)
        pid = probe(host, "a")[0]
        started = tmp_path / "started"
        running = host.call("a", ToolCall("secret", {"x": 1, "sleep": 60, "started": str(started)}))
        wait_until(started.exists, "the call runs")
        os.kill(host._pool._zygote.process.pid, signal.SIGKILL)
        wait_until(lambda: not alive(pid), "the worker dies with its zygote", timeout_s=10)
        assert running.result(timeout=30).status == "crashed"
        assert host.call("a", ToolCall("secret", {"x": 2})).result(timeout=30).text == "105"
        assert probe(host, "a")[0] != pid
