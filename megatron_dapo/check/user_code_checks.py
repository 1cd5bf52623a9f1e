"""The user's code a run will call, as ``megatron-dapo check`` tries it: each reward function, called once per data
source on that source's first row (its ground truth as the response), and a multi-turn run's tools, built and
created once in their own process (``agent/host.py``). Beside ``inputs.InputChecker``, whose data check finds the
first row of each data source."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from megatron_dapo.agent.host import ToolHost
from megatron_dapo.agent.tools import read_tool_config
from megatron_dapo.config import ConfigError, extra_function_spec
from megatron_dapo.config.schema import MultiTurnConfig, RewardConfig
from megatron_dapo.reward import custom, math_dapo
from megatron_dapo.reward.scoring import MATH_DAPO_SOURCES, route_data_source


class UserCodeChecks:
    """Tries the reward functions and tools the ``reward`` and ``multi_turn`` sections name on the first row of each
    data source (``data_sources``: data_source -> (where, row)); appends to ``problems`` and the report's ``lines``."""

    def __init__(
        self,
        reward: RewardConfig,
        multi_turn: MultiTurnConfig,
        data_sources: dict[str, tuple[str, dict]],
        problems: list[str],
        lines: list[str],
    ) -> None:
        self.reward, self.multi_turn, self.data_sources = reward, multi_turn, data_sources
        self.problems, self.lines = problems, lines

    # ----------------------------------------------------------------------------------------- rewards

    def check_rewards(self) -> None:
        """Import the reward functions, then call the one each data source routes to on its first row, with the
        row's ground truth as the response."""
        specs, functions = self._load_reward_functions()
        loaded_all = len(functions) == len(specs)
        for source, (where, row) in sorted(self.data_sources.items()):
            truth = row["reward_model"]["ground_truth"]
            response = str(truth[0] if isinstance(truth, (list, tuple)) and truth else truth)
            extra = row.get("extra_info")
            if route_data_source(source) == "math_dapo":
                calls = [("the built-in scorer", custom.MATH_DAPO_LABEL, _bind_math(response, truth))]
            elif not specs:
                self.problems.append(
                    f"{where}: no reward function for data_source {source!r}: the built-in scorer handles "
                    f"{', '.join(MATH_DAPO_SOURCES)} and aime*; set reward.custom_function.path (and .name) to a "
                    "Python file defining compute_score(data_source, solution_str, ground_truth, extra_info)"
                )
                continue
            elif not loaded_all:
                continue  # its import problem is listed already
            else:
                calls = [
                    (key, custom.function_label(fn), _bind(fn, source, response, truth, extra)) for key, fn in functions
                ]
            for key, label, call in calls:
                self._call_reward(key, label, call, source, where, response)

    def _load_reward_functions(self) -> tuple[list[tuple[str, str, str]], list[tuple[str, Any]]]:
        """((config key, path, name) of each function the config names, (config key, function) of those that
        import)."""
        rw = self.reward
        specs: list[tuple[str, str, str]] = []
        if rw.custom_function.path:
            specs.append(("reward.custom_function", rw.custom_function.path, rw.custom_function.name))
        for i, item in enumerate(rw.extra_functions):
            key = f"reward.extra_functions[{i}]"
            spec = extra_function_spec(item, key)[0]  # a malformed entry is the reward rule's problem (config/rules.py)
            if spec is not None:
                specs.append((key, spec[0], spec[1]))
        functions: list[tuple[str, Any]] = []
        for key, path, name in specs:
            try:
                functions.append((key, custom.load_reward_function(path, name)))
            except (FileNotFoundError, ImportError, AttributeError, TypeError) as exc:
                self.problems.append(f"{key} (path={path}, name={name}): {exc}")
        return specs, functions

    def _call_reward(
        self, key: str, label: str, call: Callable[[], Any], source: str, where: str, response: str
    ) -> None:
        timeout = self.reward.timeout_s
        context = (
            f"reward function {label} ({key}) on data_source {source!r} ({where}, response "
            f"{custom.short_repr(response)} = the row's ground truth)"
        )
        try:
            result = custom.call_with_timeout(call, timeout)
            custom.finite_score(result, label)
        except custom.ScorerTimeout:
            self.problems.append(f"{context}: ran past reward.timeout_s={timeout:g} s; speed it up or raise the limit")
        except custom.InvalidRewardError as exc:
            self.problems.append(f"{context}: {exc}")
        except Exception as exc:  # noqa: BLE001 - the user's function may raise anything
            self.problems.append(
                f"{context}: raised {type(exc).__name__}: {exc}; fix the function (the trainer would score every "
                f"such response reward.error_score={self.reward.error_score:g})"
            )

    # ----------------------------------------------------------------------------------------- tools

    def check_tools(self) -> None:
        """A multi-turn run's tool YAML: read, every class imported and built in the tool process, ``create`` and
        ``release`` called once (with the ``tools_kwargs`` of the first data row that has them), and every tool that
        a checked row's ``extra_info.tools_kwargs`` names defined."""
        mt = self.multi_turn
        if not mt.enable or not mt.tool_config_path:
            return  # a missing path is a config rule's problem
        path = mt.tool_config_path
        try:
            specs = read_tool_config(path)
        except ConfigError as exc:
            self.problems.append(str(exc))
            return
        names = {s.name for s in specs}
        first_kwargs: Optional[dict] = None
        for where, row in (self.data_sources[k] for k in sorted(self.data_sources)):
            kwargs = (row.get("extra_info") or {}).get("tools_kwargs")
            unknown = sorted(set(kwargs or {}) - names)
            if unknown:
                self.problems.append(
                    f"{where}: extra_info.tools_kwargs names {unknown}, which {path} does not define "
                    f"(tools: {sorted(names)})"
                )
            first_kwargs = first_kwargs if first_kwargs is not None else kwargs
        problem = _try_tools(specs, first_kwargs, mt.tool_timeout_s)
        if problem:
            self.problems.append(f"rollout.multi_turn.tool_config_path={path}: {problem}")
            return
        tools = ", ".join(sorted(names))
        self.lines.append(f"  rollout.multi_turn.tool_config_path: {path}: {tools} (built, create/release ok)")


def _try_tools(specs: list, tools_kwargs: Optional[dict], timeout_s: float) -> Optional[str]:
    """Build the tools in their own process, as the rollout does, and create and release one instance."""
    with ToolHost(specs, timeout_s) as host:
        try:
            host.start()
        except RuntimeError as exc:
            return str(exc)
        try:
            created = host.create("check-0", tools_kwargs).result(timeout=timeout_s + 10)
            host.release("check-0").result(timeout=timeout_s + 10)
        except TimeoutError:
            return f"create/release did not return within {timeout_s:g} s (rollout.multi_turn.tool_timeout_s)"
        return f"create failed: {created}" if isinstance(created, str) else None


def _bind(fn: Any, source: str, response: str, truth: Any, extra: Any) -> Callable[[], Any]:
    return lambda: fn(data_source=source, solution_str=response, ground_truth=truth, extra_info=extra)


def _bind_math(response: str, truth: Any) -> Callable[[], Any]:
    return lambda: math_dapo.compute_score(response, truth)
