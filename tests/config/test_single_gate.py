"""``train``'s start-up runs its config rules once: ``load_config`` parses only, ``config/plan.resolve`` (the only gate,
``training/startup.start_run``) runs every rule exactly once and reports every problem in one ``ConfigError``; each
rule takes the config sections it reads, not the whole ``ExperimentConfig``."""

from __future__ import annotations

import collections
import functools
import inspect
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from megatron_dapo.config import ConfigError, ExperimentConfig, load_config, rules, run_rules
from megatron_dapo.config import plan as plan_module
from megatron_dapo.config.plan import resolve
from megatron_dapo.config.run_rules import config_platform
from megatron_dapo.models.families import model_arch_from_hf
from tests.config.test_run_validation import TINY_HF

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_cpu.yaml"
RULE_MODULES = (rules, run_rules, plan_module)
ASSEMBLERS = {"config_problems", "plan_problems"}  # the passes that hand each rule its sections
NOT_ON_THIS_PATH = {
    "eval_option_problems": "eval's own options",
    "_rollout_expert_problems": "a mixture-of-experts model's rollout layout (the tiny model is dense)",
}


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # tiny_cpu.yaml names its reward function relative to the repository root


def is_rule(name: str, fn: Any) -> bool:
    """A rule returns its problem lines (``*_problems``, ``*_ranges``); a helper that appends to a rule's list (its
    first parameter is ``out``) is part of that rule, not one of its own."""
    if not inspect.isfunction(fn) or not name.endswith(("_problems", "_ranges")):
        return False
    params = list(inspect.signature(fn).parameters)
    return not (params and params[0] == "out")


def counted_rules(monkeypatch: pytest.MonkeyPatch) -> tuple[collections.Counter, dict[str, list[str]], set[str]]:
    """Wrap every rule the gate can reach, wherever it is looked up from (the rule modules' names and the rule
    tables), by one counter per function; also note any rule handed a whole ``ExperimentConfig``."""
    calls: collections.Counter = collections.Counter()
    whole_config: dict[str, list[str]] = collections.defaultdict(list)
    wrappers: dict[Callable, Callable] = {}

    def key_of(fn: Callable) -> str:
        return f"{fn.__module__}.{fn.__qualname__}"

    def wrapped(fn: Callable) -> Callable:
        if fn not in wrappers:

            @functools.wraps(fn)
            def counting(*args: Any, **kwargs: Any) -> Any:
                calls[key_of(fn)] += 1
                if fn.__name__ not in ASSEMBLERS and any(isinstance(a, ExperimentConfig) for a in args):
                    whole_config[key_of(fn)].append("ExperimentConfig")
                return fn(*args, **kwargs)

            wrappers[fn] = counting
        return wrappers[fn]

    everything: set[str] = set()
    for module in RULE_MODULES:
        for name, fn in list(vars(module).items()):
            if is_rule(name, fn):
                everything.add(key_of(fn))
                monkeypatch.setattr(module, name, wrapped(fn))
    for table in ("RANGE_RULES", "CROSS_RULES"):
        entries = getattr(rules, table)
        for rule in entries:
            everything.add(key_of(rule.check))
        monkeypatch.setattr(rules, table, tuple(replace(rule, check=wrapped(rule.check)) for rule in entries))
    return calls, whole_config, everything


@pytest.mark.parametrize(
    "overrides, total_steps",
    [
        ([], 6),  # tiny_cpu.yaml sets trainer.total_training_steps: the lr schedule is checked over it
        (["trainer.total_training_steps=null"], 40),  # the steps the data gives (the trainer counts them)
    ],
)
def test_train_start_up_runs_each_rule_exactly_once(monkeypatch, overrides, total_steps):
    calls, whole_config, everything = counted_rules(monkeypatch)
    cfg = load_config(TINY, overrides)  # what cli.py's train reads, before the run starts
    assert sum(calls.values()) == 0, f"load_config ran rules: {dict(calls)}"
    plan = resolve(cfg, model_arch_from_hf(TINY_HF), 2, config_platform(cfg.parallel), total_steps=total_steps)
    assert plan.total_steps in (total_steps, cfg.trainer.total_training_steps)

    skipped = {k for k in everything if k.rsplit(".", 1)[-1] in NOT_ON_THIS_PATH}
    assert len(skipped) == len(NOT_ON_THIS_PATH), skipped  # every exception names a rule that exists
    ran = {k: calls[k] for k in sorted(everything - skipped)}
    assert {k: n for k, n in ran.items() if n != 1} == {}, "rules not run exactly once on train's start-up"
    assert {k: calls[k] for k in skipped} == dict.fromkeys(skipped, 0)
    assert len(ran) >= 30  # the range and cross-field tables, the run's layouts, rewards, attention, the model family
    assert dict(whole_config) == {}, "rules take the sections they read, not the whole config"


def test_range_cross_field_and_layout_problems_come_in_one_error():
    cfg = load_config(
        TINY,
        [
            "trainer.console_every=0",  # a range error (trainer)
            "rollout.temperature=0",  # a cross-field error: greedy groups with dynamic sampling (tiny_cpu.yaml's)
            "rollout.tensor_model_parallel_size=4",  # a layout error: rollout TP against a world of 2
        ],
    )
    with pytest.raises(ConfigError) as err:
        resolve(cfg, model_arch_from_hf(TINY_HF), 2, config_platform(cfg.parallel), total_steps=6)
    found = err.value.problems
    # in the order the rules ran: ranges, cross-field (greedy sampling trips two of them), the layouts
    starts = [
        "trainer.console_every=0: expected an integer >= 1",
        "algorithm.filter_groups.enable=true with rollout.temperature=0: greedy sampling gives all rollout.n",
        "rollout.n=32 with rollout.temperature=0: the n greedy responses of a prompt are identical",
        "rollout.tensor_model_parallel_size=4 must be >= 1 and divide the world size 2",
    ]
    assert [p[: len(s)] for p, s in zip(found, starts)] == starts, found
    assert len(found) == 4, found
    assert str(err.value).startswith("4 config problems:\n  - trainer.console_every=0")
