"""Issue #42 at the pool's level: conversations call a misbehaving user tool (``tests/agent/faulty_tool.py``, loaded
from a verl-style tool YAML) with mixed faults at stated rates — 10% each of raise, hang (blocking the event loop),
huge answer, ``os._exit`` and a 6 GiB allocation under ``tool_memory_mb`` — through the real ``ToolHost`` pool. The
failed calls are exactly the injected ones (no cascade): every well-behaved call answers its own sample's digit,
including those whose instance was created again after its worker was lost. Then the same tool in the real
multi-turn loop: only the faulty conversation waits for its call. The whole run with the quickstart's training is
``benchmarks/tool_faults.py``."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path

import pytest

from megatron_dapo.agent.chat import ToolTurns
from megatron_dapo.agent.hermes import ToolCall
from megatron_dapo.agent.host import ToolHost
from megatron_dapo.agent.tools import read_tool_config
from megatron_dapo.config.schema import MultiTurnConfig
from megatron_dapo.rollout.multi_turn import MultiTurnRollout
from megatron_dapo.testing.tokenizer import EOS_TOKEN, build_tiny_tokenizer
from tests.agent.faulty_tool import FAULTS, HUGE_CHARS
from tests.rollout.test_multi_turn import ScriptedEngine, sampling

FAULTY_TOOL = Path(__file__).with_name("faulty_tool.py")
RATE = 0.1  # of each fault
SAMPLES, CALLS = 24, 5  # conversations, and the calls each makes one after the other
EXPECTED = {None: "ok", "raise": "error", "hang": "timeout", "huge": "ok", "exit": "crashed", "memory": "error"}


def tool_yaml(tmp_path: Path) -> str:
    text = (
        "tools:\n"
        f"  - class_name: {FAULTY_TOOL}:FaultyLookup\n"
        "    config: {hang_s: 60}\n"
        "    tool_schema: {type: function, function: {name: lookup, description: d, parameters: {}}}\n"
    )
    (tmp_path / "tools.yaml").write_text(text)
    return str(tmp_path / "tools.yaml")


def draw(rng: random.Random) -> str | None:
    u = rng.random()
    return FAULTS[int(u / RATE)] if u < RATE * len(FAULTS) else None


def converse(host: ToolHost, plan: list[list[str | None]]) -> list[list]:
    """Every sample's calls, each sent when the sample's previous one is answered (as the rollout does)."""
    results: list[list] = [[] for _ in plan]
    in_flight: dict[Future, int] = {}

    def send(i: int) -> None:
        k = len(results[i])
        in_flight[host.call(f"s{i}", ToolCall("lookup", {"box": "ab"[k % 2], "fault": plan[i][k]}))] = i

    for i in range(len(plan)):
        send(i)
    while in_flight:
        done, _ = wait(list(in_flight), timeout=120, return_when=FIRST_COMPLETED)
        assert done, "no call answered within 120 s"
        for future in done:
            i = in_flight.pop(future)
            results[i].append(future.result())
            if len(results[i]) < len(plan[i]):
                send(i)
    return results


def test_mixed_faults_fail_only_their_own_calls(tmp_path):
    rng = random.Random(0)
    plan = [[draw(rng) for _ in range(CALLS)] for _ in range(SAMPLES)]
    injected = {f: sum(row.count(f) for row in plan) for f in FAULTS}
    assert all(injected.values())  # every fault occurs
    boxes = [{"a": i % 5, "b": (i * 3 + 1) % 5} for i in range(SAMPLES)]
    specs = read_tool_config(tool_yaml(tmp_path))
    with ToolHost(specs, timeout_s=0.5, grace_s=0.5, memory_mb=1024, workers=4, max_concurrency=16) as host:
        created = [host.create(f"s{i}", {"lookup": {"create_kwargs": {"boxes": boxes[i]}}}) for i in range(SAMPLES)]
        assert [f.result(timeout=60) for f in created] == [None] * SAMPLES
        results = converse(host, plan)
        metrics = host.metrics()
    statuses = [[r.status for r in row] for row in results]
    wrong = [
        (i, k, fault, result.status, result.text[:200])
        for i, row in enumerate(results)
        for k, (fault, result) in enumerate(zip(plan[i], row))
        if result.status != EXPECTED[fault]
    ]
    assert statuses == [[EXPECTED[f] for f in row] for row in plan], wrong
    for i, row in enumerate(results):
        for k, (fault, result) in enumerate(zip(plan[i], row)):
            digit = str(boxes[i]["ab"[k % 2]])
            if fault is None:  # its own sample's digit, also after its worker was lost and its instance made again
                assert result.text == digit, (i, k, result.text)
            elif fault == "huge":
                assert result.text == digit * HUGE_CHARS
    failed = sum(s != "ok" for row in statuses for s in row)
    failing = sum(injected[f] for f in ("raise", "hang", "exit", "memory"))  # "huge" answers (cut by the chat)
    assert failed == failing  # no cascade
    lost = injected["hang"] + injected["exit"]  # one worker per hang (killed) and per exit
    assert metrics["tool/crashes"] == lost and metrics["tool/timeouts"] == injected["hang"]
    print(
        f"calls={SAMPLES * CALLS} injected_failures={failing} failed={failed} "
        f"workers_lost={lost} resent={metrics['tool/resent']:g}"
    )


@pytest.mark.parametrize(("timeout_s", "abandon_after_s"), [(1.0, None), (2.0, 1.0)], ids=["waits", "abandons"])
def test_a_rollout_with_the_faulty_tool_holds_back_only_the_faulty_conversation(
    tmp_path, caplog, timeout_s, abandon_after_s
):
    """The real multi-turn loop (``rollout/multi_turn.MultiTurnRollout``, on the scripted engine of
    ``tests/rollout/test_multi_turn.py``) with the faulty tool in a real ``ToolHost``: one conversation per fault.
    Each conversation reads its own call's outcome only, and every other conversation's next turn is queued before
    the hung call is answered, at ``timeout_s + grace_s`` — or, with ``tool_abandon_after_s``, before its own
    timeout: its conversation reads the call as abandoned and answers, while the call runs on in its worker."""
    tok = build_tiny_tokenizer(tmp_path / "tok", extra_texts=[])
    faults = ["hang", "exit", "raise", "memory", "huge", None]
    call = '<tool_call>{{"name": "lookup", "arguments": {{"box": "a", "fault": {}}}}}</tool_call>'
    script = {(i, 0): [call.format(json.dumps(f)) + EOS_TOKEN, "7" + EOS_TOKEN] for i, f in enumerate(faults)}
    rows = []
    for i in range(len(faults)):
        messages = [{"role": "user", "content": f"open {i}"}]
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        kwargs = {"lookup": {"create_kwargs": {"boxes": {"a": i}}}}
        extra = {"tools_kwargs": kwargs}
        rows.append({"input_ids": tok.encode(prompt), "prompt_messages": messages, "extra_info": extra})
    grace_s = 0.5
    specs = read_tool_config(tool_yaml(tmp_path))
    with ToolHost(specs, timeout_s=timeout_s, grace_s=grace_s, memory_mb=1024, workers=2) as host:
        engine = ScriptedEngine(tok, script)
        cfg = MultiTurnConfig(
            enable=True, tool_config_path="unused", max_tool_response_length=64, tool_abandon_after_s=abandon_after_s
        )
        rollout = MultiTurnRollout(engine, host, ToolTurns(tok, 64), tok, cfg, 200)
        started = time.perf_counter()
        batch = rollout.generate(rows, sampling(n=1))
    expected = {**EXPECTED, "hang": "timeout" if abandon_after_s is None else "abandoned"}
    assert [info["tool_status"] for info in batch.turns] == [[expected[f]] for f in faults]
    tool_texts = [info["messages"][2]["content"] for info in batch.turns]
    assert tool_texts[5] == "5" and tool_texts[4] == "4" * 32 + "..." + "4" * 32  # the huge answer, cut by the chat
    assert all(text.startswith("error: ") for text in tool_texts[:4])
    assert all(info["num_turns"] == 2 for info in batch.turns)  # every conversation went on to its answer
    second = {rid.split("-")[0]: t - started for t, what, rid in engine.events if what == "add" and rid.endswith("-1")}
    assert max(second[str(i)] for i in range(1, 6)) < second["0"]  # nobody waited for the hung call
    hints = [r for r in caplog.records if "tool_abandon_after_s" in r.getMessage()]
    if abandon_after_s is None:
        assert second["0"] / (timeout_s + grace_s) >= 1.0  # which was answered at its bound
        assert len(hints) == 1 and hints[0].levelname == "WARNING"  # the console says what would cut that wait
    else:  # which its conversation stopped waiting for before the call's own timeout
        assert abandon_after_s <= second["0"] < timeout_s, second
        assert hints == []
