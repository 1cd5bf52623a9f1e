"""The weight transports' seam: what a transport is given and what it must do, and what a sync is to its caller.

``rollout/sync.WeightSync`` plans buckets of whole vLLM layers and brings each bucket's tensors to every rank (TP
gather, PP broadcast, the expert exchange); a ``WeightTransport`` then delivers one bucket to the target. Which one a
run uses is decided once, in ``config/plan.weight_transport`` (``RunPlan.weight_transport`` and its reason), and
``weight_transfer/factory.build_weight_sync`` builds the sync from it:

* ``direct`` (``direct_transport.DirectTransport``): each rank's rollout shard written into its colocated engine's
  layers;
* ``reload`` (``reload_transport.ReloadTransport``): HF names and full tensors through vLLM's ``reload_weights``, the
  colocated engine's or, over the async bridge (``rollout/remote.BridgeSender``), the rollout ranks' engines';
* ``lora_adapters`` (``lora_transport.LoraAdapterSync``): a LoRA actor's base once through ``reload``, then its
  adapters alone into vLLM's LoRA layers. It wraps a ``WeightSync`` rather than sending buckets, so it is an
  ``ActorWeightSync``, not a ``WeightTransport``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from megatron_dapo.models.families import EXPERT_PREFIX, ParamMapping
from megatron_dapo.rollout.expert_exchange import Source


@dataclass(frozen=True)
class SyncEntry:
    """One Megatron tensor of a sync's plan: its mapping, the pipeline stage that owns it, its full shape."""

    mapping: ParamMapping
    stage: int  # pipeline rank that owns the parameter
    shape: tuple[int, ...]  # full (TP-gathered) Megatron shape
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return numel(self.shape)

    @property
    def module(self) -> str:
        """The vLLM layer this tensor loads into: its Megatron module, except that all routed experts of a layer are
        one vLLM layer (``FusedMoE``: ``w13_weight [E, 2I, H]``, ``w2_weight [E, H, I]``)."""
        name = self.mapping.mcore
        if self.mapping.is_expert:
            return name[: name.index(EXPERT_PREFIX) + len("mlp.experts")]
        return name.rpartition(".")[0]


class WeightTarget(Protocol):
    """Where a sync's buckets of HF tensors go: the colocated ``RolloutEngine``, or ``rollout.remote.BridgeSender``
    (trainer.mode=async) that carries them to the rollout ranks' engines."""

    rollout_plan: Any  # the engine's RolloutPlan (its dtype)
    platform: Any

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None: ...

    def after_weight_update(self) -> None: ...


class WeightTransport(Protocol):
    """Delivers one bucket (whole vLLM layers) to the target. ``tensors[i]`` is ``entries[i]``'s tensor on this rank
    (its rollout-rank TP shard or the full Megatron tensor), or None for a routed expert this rank's engine holds
    elsewhere. Returns the HF names delivered and their bytes (the sync checks every name arrives exactly once)."""

    name: str  # RunPlan.weight_transport's name for it

    def send(self, entries: Sequence[SyncEntry], tensors: list[Optional[Source]]) -> tuple[list[str], int]: ...


class ActorWeightSync(Protocol):
    """What the trainer holds (``factory.build_weight_sync``): one call pushes the actor's current weights into the
    engines. Collective over all ranks of the actor; returns timings, bytes and counters."""

    def sync(self, actor_chunks: list) -> dict[str, float]: ...


def engine_dtype(hf_name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``hf_name`` travels in to an engine running in ``dtype``: fp32 for the tensors vLLM keeps in fp32
    whatever the model's dtype (its Gated DeltaNet's ``A_log``: ``vllm/model_executor/layers/mamba/gdn/
    qwen_gdn_linear_attn.py``), which would otherwise arrive rounded to ``dtype`` (measured: log-probs off by 0.8
    on the tiny Qwen3-Next in bf16, ``tests/rollout/test_gdn_sync.py``)."""
    return torch.float32 if hf_name.endswith(".A_log") else dtype


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
