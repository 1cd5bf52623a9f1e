"""Tools (``agent/tools.py``, ``agent/builtin.py``): the verl-style tool YAML with a user class from a file, the
runner's concurrency and timeout, and every failure mode ending as a message the model sees, never an exception."""

from __future__ import annotations

import asyncio
import time

import pytest

from megatron_dapo.agent.builtin import CalculatorTool, PythonTool, evaluate_arithmetic
from megatron_dapo.agent.hermes import ToolCall
from megatron_dapo.agent.tools import ToolRunner, build_tools, read_tool_config
from megatron_dapo.config import ConfigError

USER_TOOLS = '''
import asyncio, time

class Secret:
    """Holds a per-sample secret (create_kwargs), answers lookups; a verl-style class: (config, tool_schema)."""
    def __init__(self, config, tool_schema):
        self.offset, self.secrets = config.get("offset", 0), {}
    def create(self, instance_id, secret=0):
        self.secrets[instance_id] = secret
    def execute(self, instance_id, arguments):
        return str(self.secrets[instance_id] + arguments["x"] + self.offset), 0.5, {"looked_up": 1}
    def release(self, instance_id):
        self.secrets.pop(instance_id)

class Slow:
    def __init__(self, config, tool_schema):
        self.delay = config["delay"]
    async def execute(self, instance_id, arguments):
        await asyncio.sleep(self.delay)
        return "done"
    def create(self, instance_id): pass
    def release(self, instance_id): pass

class Broken:
    def __init__(self, config, tool_schema): pass
    def create(self, instance_id): pass
    def execute(self, instance_id, arguments):
        raise KeyError("boom")
    def release(self, instance_id): pass
'''


def schema(name: str) -> str:
    return f"    tool_schema: {{type: function, function: {{name: {name}, description: d, parameters: {{}}}}}}\n"


def write_config(tmp_path, delay: float = 0.05):
    (tmp_path / "user_tools.py").write_text(USER_TOOLS)
    text = "tools:\n"
    text += f"  - class_name: {tmp_path / 'user_tools.py'}:Secret\n    config: {{offset: 100}}\n" + schema("secret")
    text += f"  - class_name: {tmp_path / 'user_tools.py'}:Slow\n    config: {{delay: {delay}}}\n" + schema("slow")
    text += f"  - class_name: {tmp_path / 'user_tools.py'}:Broken\n" + schema("broken")
    text += "  - class_name: megatron_dapo.agent.builtin.CalculatorTool\n" + schema("calculator")
    (tmp_path / "tools.yaml").write_text(text)
    return str(tmp_path / "tools.yaml")


def test_verl_style_yaml_with_a_user_class_from_a_file(tmp_path):
    specs = read_tool_config(write_config(tmp_path))
    assert [s.name for s in specs] == ["secret", "slow", "broken", "calculator"]
    runner = ToolRunner(build_tools(specs), timeout_s=2)

    async def sample(instance_id: str, secret: int) -> str:
        await runner.create(instance_id, {"secret": {"create_kwargs": {"secret": secret}}})
        result = await runner.call(instance_id, ToolCall("secret", {"x": 1}))
        await runner.release(instance_id)
        assert (result.reward, result.status, result.metrics) == (0.5, "ok", {"looked_up": 1})
        return result.text

    async def both():
        return await asyncio.gather(sample("a", 10), sample("b", 20))

    assert asyncio.run(both()) == ["111", "121"]  # per-sample state from tools_kwargs


def test_failures_become_messages_and_are_counted(tmp_path):
    runner = ToolRunner(build_tools(read_tool_config(write_config(tmp_path, delay=5))), timeout_s=0.3)

    async def calls():
        await runner.create("s")
        return [
            await runner.call("s", ToolCall("slow", {})),
            await runner.call("s", ToolCall("broken", {})),
            await runner.call("s", ToolCall("nope", {})),
            await runner.call("s", ToolCall(error="the tool call is not valid JSON")),
            await runner.call("s", ToolCall("calculator", {"expression": "1/0"})),
        ]

    started = time.perf_counter()
    timeout, broken, unknown, bad, divide = asyncio.run(calls())
    assert time.perf_counter() - started < 3  # the 5 s tool was cut at 0.3 s
    assert timeout.status == "timeout" and "timed out after 0.3 s" in timeout.text
    assert broken.status == "error" and broken.text == "error: broken failed: KeyError: 'boom'"
    assert unknown.status == "unknown_tool" and "no tool named 'nope'" in unknown.text and "calculator" in unknown.text
    assert bad.status == "bad_call" and bad.text.startswith("error: the tool call is not valid JSON")
    assert divide.status == "ok" and divide.text.startswith("error: ")  # the tool's own answer to a bad input
    m = runner.metrics()
    assert (m["tool/calls"], m["tool/timeouts"], m["tool/errors"], m["tool/unknown_tool"], m["tool/bad_call"]) == (
        5.0,
        1.0,
        1.0,
        1.0,
        1.0,
    )


def test_calls_run_concurrently_up_to_the_limit(tmp_path):
    runner = ToolRunner(build_tools(read_tool_config(write_config(tmp_path, delay=0.4))), max_concurrency=4)

    async def many():
        await runner.create("s")
        return await asyncio.gather(*[runner.call("s", ToolCall("slow", {})) for _ in range(8)])

    started = time.perf_counter()
    results = asyncio.run(many())
    elapsed = time.perf_counter() - started
    assert all(r.text == "done" for r in results)
    assert 0.75 < elapsed < 1.6  # 8 calls of 0.4 s, 4 at a time: two waves, not eight


def test_tool_yaml_errors_name_the_entry(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("tools:\n  - class_name: x.Y\n    tool_schema: {type: function}\n  - {config: {}}\n")
    with pytest.raises(ConfigError) as err:
        read_tool_config(str(path))
    assert "tools[0].tool_schema" in str(err.value) and "tools[1]: expected a mapping with a 'class_name'" in str(
        err.value
    )
    with pytest.raises(ConfigError, match="no such file"):
        read_tool_config(str(tmp_path / "missing.yaml"))


def test_calculator():
    assert evaluate_arithmetic("3 * (4 + 5) - 2 ** 3") == 19
    assert CalculatorTool().execute("i", {"expression": "7 / 2"})[0] == "3.5"
    assert CalculatorTool().execute("i", {"expression": "6 / 2"})[0] == "3"
    for bad in ("__import__('os')", "2 ** 100000", "x + 1", "1 +"):
        text, _, _ = CalculatorTool().execute("i", {"expression": bad})
        assert text.startswith("error: "), (bad, text)


def test_python_tool_runs_code_with_limits_and_no_secrets(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "secret-token")
    tool = PythonTool({"wall_time_s": 5, "cpu_time_s": 2, "memory_mb": 256, "max_output_chars": 200})
    assert tool.execute("i", {"code": "print(6 * 7)"})[0] == "42\n"
    env, _, _ = tool.execute("i", {"code": "import os; print(sorted(os.environ))"})
    assert "HF_TOKEN" not in env and "secret-token" not in env
    crash, _, metrics = tool.execute("i", {"code": "raise SystemExit('bye')"})
    assert "error (exit status 1): bye" in crash and metrics["returncode"] == 1.0
    memory, _, _ = tool.execute("i", {"code": "x = bytearray(1024 * 2**20)"})
    assert "MemoryError" in memory  # RLIMIT_AS: 1 GiB is refused under 256 MiB
    spin, _, _ = tool.execute("i", {"code": "while True: pass"})
    assert "killed by signal" in spin or "ran longer than" in spin  # RLIMIT_CPU (2 s) or the wall clock
    long, _, _ = tool.execute("i", {"code": "print('x' * 1000)"})
    assert len(long) < 260 and long.endswith("characters cut]")
