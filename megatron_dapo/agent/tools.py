"""Tools for multi-turn rollouts: the interface, verl's tool YAML, and the runner that executes calls.

The interface (verl's ``BaseTool``, sync or async methods alike): a tool is built as ``cls(config, tool_schema)``
from one entry of a tool YAML::

    tools:
      - class_name: my_tools.py:Lookup          # a module path (pkg.mod.Class) or file.py:Class
        config: {timeout_s: 5}
        tool_schema:                             # OpenAI function schema; its name is the tool's name
          type: function
          function: {name: lookup, description: ..., parameters: {type: object, properties: {...}}}

and then, per sample, ``create(instance_id, **create_kwargs)`` (``create_kwargs`` from the sample's
``extra_info.tools_kwargs[<name>]``, as verl passes them), any number of ``execute(instance_id, arguments)`` →
``(text, step_reward, metrics)`` (text may be an object with a ``text`` attribute, as verl's ``ToolResponse``),
optionally ``calc_reward(instance_id)``, and ``release(instance_id)``.

``ToolRunner`` runs calls of many samples concurrently (an asyncio semaphore bounds them), each under a timeout. Every
failure — an unknown tool, a malformed call, an exception, a timeout — becomes a result whose text the model sees
(``error: ...``) and is counted in ``tool/*`` metrics; none reaches the caller. A synchronous tool runs in a thread:
a call past its timeout is answered with a timeout message, but its thread cannot be stopped (tools that run user
code should do so in a subprocess with its own limits, as the built-in ``python`` tool does).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from megatron_dapo.agent.hermes import ToolCall
from megatron_dapo.errors import ConfigError
from megatron_dapo.user_code import load_python_file

__all__ = ["BaseTool", "ToolResult", "ToolRunner", "ToolSpec", "build_tools", "read_tool_config"]


class BaseTool:
    """A convenient base: keeps ``config`` and ``tool_schema``; ``create``/``release`` do nothing and
    ``calc_reward`` is 0. Subclasses implement ``execute``."""

    def __init__(self, config: Optional[dict] = None, tool_schema: Optional[dict] = None) -> None:
        self.config, self.tool_schema = dict(config or {}), dict(tool_schema or {})

    def create(self, instance_id: str, **create_kwargs: Any) -> str:
        return instance_id

    def execute(self, instance_id: str, arguments: dict) -> tuple[str, float, dict]:
        raise NotImplementedError

    def calc_reward(self, instance_id: str) -> float:
        return 0.0

    def release(self, instance_id: str) -> None:
        return None


@dataclass(frozen=True)
class ToolSpec:
    """One entry of a tool YAML."""

    class_name: str
    config: dict
    schema: dict

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


def read_tool_config(path: str) -> list[ToolSpec]:
    """The entries of a verl-style tool YAML; ``ConfigError`` naming the file, the entry and the field."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"rollout.multi_turn.tool_config_path={path!r}: no such file")
    raw = yaml.safe_load(file.read_text()) or {}
    entries = raw.get("tools") if isinstance(raw, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path}: expected a top-level 'tools:' list with at least one tool")
    specs, problems = [], []
    for i, entry in enumerate(entries):
        where = f"{path}: tools[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            problems.append(f"{where}: expected a mapping with a 'class_name' string")
            continue
        schema = entry.get("tool_schema")
        function = schema.get("function") if isinstance(schema, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            problems.append(f"{where}.tool_schema: expected {{type: function, function: {{name: ..., ...}}}}")
            continue
        specs.append(ToolSpec(entry["class_name"], dict(entry.get("config") or {}), schema))
    names = [s.name for s in specs]
    problems += [f"{path}: tool name {n!r} is defined twice" for n in sorted({n for n in names if names.count(n) > 1})]
    if problems:
        raise ConfigError.of(problems)
    return specs


def import_tool_class(class_name: str) -> type:
    """``file.py:Class`` (imported like a reward file) or ``package.module.Class``."""
    if ":" in class_name:
        file, _, name = class_name.rpartition(":")
        module: Any = load_python_file(file, "tool class file")
    else:
        module_name, _, name = class_name.rpartition(".")
        if not module_name:
            raise ImportError(f"tool class_name {class_name!r}: expected package.module.Class or file.py:Class")
        module = importlib.import_module(module_name)
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise ImportError(f"tool class_name {class_name!r}: {name!r} is not a class in that module")
    return cls


def build_tools(specs: list[ToolSpec]) -> dict[str, Any]:
    """Each tool by name, built as ``cls(config=..., tool_schema=...)``."""
    return {s.name: import_tool_class(s.class_name)(config=s.config, tool_schema=s.schema) for s in specs}


@dataclass(frozen=True)
class ToolResult:
    """What a call gives the model (``text``), its step reward, and how it went: ``ok``, ``error`` (the tool
    raised), ``timeout``, ``unknown_tool`` or ``bad_call`` (malformed)."""

    text: str
    reward: float = 0.0
    status: str = "ok"
    latency_s: float = 0.0
    metrics: dict = field(default_factory=dict)


async def _run(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """A tool method, sync (in a thread) or async."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    result = await asyncio.to_thread(fn, *args, **kwargs)
    return await result if inspect.isawaitable(result) else result


class ToolRunner:
    """Calls of many samples, concurrently, each under ``timeout_s``; failures become messages (module docstring)."""

    def __init__(self, tools: Mapping[str, Any], timeout_s: float = 30.0, max_concurrency: int = 16) -> None:
        self.tools, self.timeout_s = dict(tools), float(timeout_s)
        self._slots = asyncio.Semaphore(max_concurrency)
        self.counts = {"calls": 0, "errors": 0, "timeouts": 0, "unknown_tool": 0, "bad_call": 0}
        self.latencies: list[float] = []

    async def create(self, instance_id: str, tools_kwargs: Optional[Mapping[str, Any]] = None) -> None:
        """Every tool's instance for one sample; ``tools_kwargs[<name>]["create_kwargs"]`` as verl passes them."""
        for name, tool in self.tools.items():
            kwargs = ((tools_kwargs or {}).get(name) or {}).get("create_kwargs") or {}
            await asyncio.wait_for(_run(tool.create, instance_id, **kwargs), self.timeout_s)

    async def call(self, instance_id: str, call: ToolCall) -> ToolResult:
        self.counts["calls"] += 1
        if call.error is not None:
            self.counts["bad_call"] += 1
            return ToolResult(f"error: {call.error}", status="bad_call")
        tool = self.tools.get(call.name)
        if tool is None:
            self.counts["unknown_tool"] += 1
            known = ", ".join(sorted(self.tools))
            return ToolResult(f"error: no tool named {call.name!r} (tools: {known})", status="unknown_tool")
        started = time.perf_counter()
        async with self._slots:
            try:
                # asyncio.timeout, not wait_for: no task of its own, so an async tool that does not await runs
                # and answers in one step of the loop (a tool blocking the loop later cannot hold its answer)
                async with asyncio.timeout(self.timeout_s):
                    out = await _run(tool.execute, instance_id, call.arguments)
            except TimeoutError:
                self.counts["timeouts"] += 1
                return ToolResult(f"error: {call.name} timed out after {self.timeout_s:g} s", status="timeout")
            except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's message, never the run's
                self.counts["errors"] += 1
                return ToolResult(f"error: {call.name} failed: {type(exc).__name__}: {exc}", status="error")
            finally:
                self.latencies.append(time.perf_counter() - started)
        return _result(out, time.perf_counter() - started)

    async def release(self, instance_id: str) -> None:
        for tool in self.tools.values():
            try:
                await asyncio.wait_for(_run(tool.release, instance_id), self.timeout_s)
            except Exception:  # noqa: BLE001 - releasing must not fail a sample
                self.counts["errors"] += 1

    def metrics(self) -> dict[str, float]:
        """``tool/*``: calls, failures by kind, latency (mean, max) since the runner was made."""
        out = {f"tool/{k}": float(v) for k, v in self.counts.items()}
        if self.latencies:
            out["tool/latency_mean_s"] = sum(self.latencies) / len(self.latencies)
            out["tool/latency_max_s"] = max(self.latencies)
        return out


def _result(out: Any, latency: float) -> ToolResult:
    """A tool's ``(text, reward, metrics)`` (or just text); the text may be an object with ``.text``."""
    text, reward, metrics = _triple(out)
    return ToolResult(str(getattr(text, "text", text)), float(reward or 0.0), "ok", latency, dict(metrics or {}))


def _triple(out: Any) -> tuple[Any, Any, Any]:
    """``(text, reward, metrics)`` from a bare text or a shorter tuple."""
    if not isinstance(out, tuple):
        return out, 0.0, {}
    padded = tuple(out) + (None, 0.0, {})[len(out) :]
    return padded[0], padded[1], padded[2]
