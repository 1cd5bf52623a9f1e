"""Both rollout phases implement the trainer's declared seam (``training/rollout_source.RolloutSource``): every
member of the Protocol exists on ``RolloutPhase`` and ``RemoteRolloutPhase`` with the same parameters (names, kinds,
defaults, annotations) and return annotation, and the trainer's ``rollout`` member is typed with the Protocol."""

from __future__ import annotations

import inspect
import typing

import pytest

from megatron_dapo.training.async_phase import RemoteRolloutPhase
from megatron_dapo.training.rollout_phase import RolloutPhase
from megatron_dapo.training.rollout_source import RolloutSource
from megatron_dapo.training.trainer import DAPOTrainer

MEMBERS = (
    "collect",
    "validate",
    "prepare_engine",
    "engine_released",
    "checkpoint_states",
    "before_save",
    "stop_requested",
    "close",
    "epoch",
)


def protocol_members() -> list[str]:
    """The members the Protocol declares (its own namespace, less what every class has)."""
    return sorted(n for n in vars(RolloutSource) if not n.startswith("_"))


def shape(sig: inspect.Signature) -> tuple:
    """What a caller relies on: each parameter after ``self`` (name, kind, default, annotation) and the return."""
    params = list(sig.parameters.values())[1:]
    return tuple((p.name, p.kind, p.default, p.annotation) for p in params), sig.return_annotation


def test_the_protocol_declares_the_trainer_s_members():
    assert protocol_members() == sorted(MEMBERS)


@pytest.mark.parametrize("impl", [RolloutPhase, RemoteRolloutPhase])
def test_each_phase_implements_every_member_with_its_signature(impl):
    for name in MEMBERS:
        declared = vars(RolloutSource)[name]
        got = inspect.getattr_static(impl, name, None)
        assert got is not None, f"{impl.__name__} has no {name}"
        if isinstance(declared, property):
            assert isinstance(got, property), f"{impl.__name__}.{name} is not a property"
            assert shape(inspect.signature(got.fget)) == shape(inspect.signature(declared.fget)), name
            continue
        assert inspect.isfunction(got), f"{impl.__name__}.{name} is not a method"
        assert shape(inspect.signature(got)) == shape(inspect.signature(declared)), (
            f"{impl.__name__}.{name}{inspect.signature(got)} differs from the Protocol's "
            f"{inspect.signature(declared)}"
        )


def test_the_signature_check_catches_a_mismatch():
    """The comparison above fails for a method whose parameters differ (a renamed or missing default)."""

    class Drifted:
        def prepare_engine(self, step: int, timings: dict) -> None: ...

    assert shape(inspect.signature(Drifted.prepare_engine)) != shape(
        inspect.signature(vars(RolloutSource)["prepare_engine"])
    )


def test_the_trainer_types_its_rollout_with_the_protocol():
    assert typing.get_type_hints(DAPOTrainer)["rollout"] is RolloutSource
    built = typing.get_type_hints(DAPOTrainer._build_rollout)["return"]
    assert typing.get_args(built)[1] is RolloutSource
