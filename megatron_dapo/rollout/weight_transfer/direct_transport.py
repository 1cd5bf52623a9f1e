"""The ``direct`` transport: each rank's rollout shard written straight into its colocated engine's layers.

Planned (``config/plan.weight_transport``) for a colocated engine without LoRA on a platform where this path has run
(``Platform.direct_weight_sync``). Each rank cuts its rollout shard from its own Megatron TP shard or a full tensor (a
local re-layout, no communication) and ``rollout/vllm_direct.VllmDirectWriter`` writes it into the engine's layer,
one vLLM layer at a time: no HF tensor, no ``reload_weights`` bookkeeping. Whether every tensor fits its vLLM
parameter is known only from the live engine; ``rollout/sync.WeightSync`` checks that at its first sync and falls
back to ``reload`` where one does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from megatron_dapo.models.families import ModelArch, ParamMapping
from megatron_dapo.rollout.expert_exchange import Source
from megatron_dapo.rollout.vllm_direct import VllmDirectWriter, vllm_target
from megatron_dapo.rollout.weight_transfer.transport import SyncEntry, numel
from megatron_dapo.weights.layout import hf_shapes


class DirectTransport:
    """Each rank's rollout shard written straight into its colocated engine's layers (``rollout/vllm_direct.py``),
    one vLLM layer at a time."""

    name = "direct"

    def __init__(self, writer: VllmDirectWriter, arch: ModelArch, dtype: torch.dtype) -> None:
        self.writer, self.arch, self.dtype = writer, arch, dtype

    def holds(self, mapping: ParamMapping) -> bool:
        """Whether this rank's engine holds ``mapping``'s tensor (not a routed expert on another rank under vLLM's
        expert parallelism)."""
        return not mapping.is_expert or self.writer.engine_expert(mapping) is not None

    def send(self, entries: Sequence[SyncEntry], tensors: list[Optional[Source]]) -> tuple[list[str], int]:
        """``tensors[i]`` is None, or ignored, for a routed expert this rank's engine does not hold."""
        self.writer.engine.ensure_writable("load_weights")
        names: list[str] = []
        nbytes = 0
        module: list[tuple[ParamMapping, torch.Tensor]] = []
        for i, (entry, src) in enumerate(zip(entries, tensors)):
            if self.holds(entry.mapping):
                if not src.written:  # received straight into the engine (``ExpertExchange``)
                    module.append((entry.mapping, self.writer.rollout_shard(entry.mapping, src.tensor, src.is_shard)))
                names.extend(entry.mapping.hf)
                nbytes += sum(numel(s) for s in hf_shapes(entry.mapping, self.arch)) * self.dtype.itemsize
            last = (
                i + 1 == len(entries) or vllm_target(entries[i + 1].mapping).module != vllm_target(entry.mapping).module
            )
            if last and module:
                self.writer.write_module(module)
                module = []
        return names, nbytes
