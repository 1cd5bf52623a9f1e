"""What the trainer needs of its colocated rollout engine: the seam between ``training/`` and
``rollout/engine.RolloutEngine``.

``DAPOTrainer(cfg, engine_factory=...)`` builds its engine through an ``EngineFactory`` (by default ``RolloutEngine``
itself, whose constructor has this signature); every component of a synchronous step then reaches the engine
through ``ColocatedEngine``:

* the memory hand-off (``handoff/offload.MemoryHandoff``): ``sleep``/``wake_up`` around each phase, ``asleep``, and
  ``sleep_supported`` (no sleep mode: nothing is released);
* the weight sync (``rollout/sync.WeightSync``, a ``WeightTarget``): ``rollout_plan`` (its dtype), ``platform``
  (device, synchronisation), ``load_weights`` of HF-named full tensors (the reload transport) and
  ``after_weight_update``; ``tp_rank``/``tp_size`` for the agreement on which shards a rank sends;
* single-turn rollout and validation (``rollout/multi_turn.SingleTurn``): ``generate``; the scorer that overlaps
  generation needs ``tp_rank``/``tp_size``;
* the end of the run (``parallel.teardown``): ``shutdown``.

Capabilities beyond this protocol are optional and detected where they are used, so an engine that lacks one must
refuse the option that needs it when it is built: ``generate_segments`` (``rollout.partial_rollout``), the
request-level API of ``rollout/multi_turn.RequestEngine`` (``rollout.multi_turn``), ``local_model`` (the sync's direct
transport into vLLM's layers: without it the sync takes the reload transport), vLLM's LoRA support
(``lora_enabled``, ``load_lora_adapter``: ``actor.lora``) and ``routing_arch`` (``actor.router_replay=rollout``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Protocol

import torch

from megatron_dapo.config import ActorConfig, DataConfig, ModelConfig, RolloutConfig, TrainerConfig
from megatron_dapo.config.plan import RolloutPlan, RunPlan
from megatron_dapo.platform import Platform
from megatron_dapo.rollout.types import FinishedSink, RolloutBatch, SamplingSpec


class ColocatedEngine(Protocol):
    """This rank's member of the rollout engine, beside its slice of the actor (module docstring)."""

    platform: Platform
    rollout_plan: RolloutPlan
    pad_token_id: int
    tp_rank: int
    tp_size: int
    sleep_supported: bool

    @property
    def asleep(self) -> bool: ...

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingSpec,
        seed_offset: int = 0,
        on_step: Optional[FinishedSink] = None,
    ) -> RolloutBatch:
        """``sampling.n`` responses per prompt, the whole batch on every rank in prompt order; collective."""
        ...

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Full HF-named tensors in the rollout dtype into this rank's engine (part of one weight update)."""
        ...

    def after_weight_update(self) -> None:
        """Once after the last ``load_weights`` of an update."""
        ...

    def sleep(self, level: Optional[int] = None) -> None:
        """Release device memory (level 1: weights to host memory, level 2: weights dropped; the KV cache always)."""
        ...

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Re-allocate what ``sleep`` released: ``["weights"]``, then ``["kv_cache"]``; None = both."""
        ...

    def shutdown(self) -> None: ...


class EngineFactory(Protocol):
    """Builds the colocated engine (``RolloutEngine``'s constructor): the config sections an engine reads, the
    model's HF directory, the platform, the tokenizer's pad and stop ids and the trainer's resolved run."""

    def __call__(
        self,
        rollout: RolloutConfig,
        data: DataConfig,
        model: ModelConfig,
        actor: ActorConfig,
        trainer: TrainerConfig,
        hf_dir: str,
        platform: Platform,
        *,
        pad_token_id: int,
        eos_token_ids: Optional[Sequence[int]] = None,
        plan: Optional[RunPlan] = None,
    ) -> ColocatedEngine: ...
