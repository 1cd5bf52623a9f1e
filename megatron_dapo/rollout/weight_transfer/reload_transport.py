"""The ``reload`` transport: full HF tensors through vLLM's layer-wise ``reload_weights``.

``weights.layout.mcore_to_hf`` turns a bucket's full Megatron tensors into HF names + tensors (vocab unpadded, q/k/v
and gate/up split), cast to the engine dtype (``transport.engine_dtype``), and the target's ``load_weights`` loads
them (``RolloutEngine``: ``collective_rpc("reload_weights", weights_iterator=[...])``; each vLLM TP rank slices its
own shard). Any target takes it: a colocated engine, and the async bridge (``rollout/remote.BridgeSender``), whose
receiving side hands the same HF tensors to the rollout ranks' engines. Partial reloads, one per bucket, are why
buckets hold whole vLLM layers (``rollout/sync.py``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Optional

import torch

from megatron_dapo.models.families import ModelArch
from megatron_dapo.rollout.expert_exchange import Source
from megatron_dapo.rollout.weight_transfer.transport import SyncEntry, WeightTarget, engine_dtype
from megatron_dapo.weights.layout import mcore_to_hf

# vLLM warns for every layer a partial reload did not touch; with buckets that is expected, and the sync checks
# completeness itself (every HF tensor sent exactly once).
_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)


class ReloadTransport:
    """Full HF tensors through vLLM's layer-wise ``reload_weights`` (``WeightTarget.load_weights``): any target,
    the async bridge included; vLLM's weight loaders cut each rank's shard."""

    name = "reload"

    def __init__(self, target: WeightTarget, arch: ModelArch, dtype: torch.dtype) -> None:
        self.target, self.arch, self.dtype = target, arch, dtype

    def send(self, entries: Sequence[SyncEntry], tensors: list[Optional[Source]]) -> tuple[list[str], int]:
        """``tensors[i]`` is None for a routed expert this rank's engine holds elsewhere (not sent)."""
        hf: list[tuple[str, torch.Tensor]] = []
        for entry, src in zip(entries, tensors):
            if src is None:
                continue
            if src.is_shard:
                raise RuntimeError(f"weight sync: the reload transport needs full tensors, got a shard of {entry}")
            for name, tensor in zip(entry.mapping.hf, mcore_to_hf(entry.mapping, src.tensor, self.arch)):
                hf.append((name, tensor.to(engine_dtype(name, self.dtype))))
        self.target.load_weights(hf)
        return [n for n, _ in hf], sum(t.numel() * t.element_size() for _, t in hf)


@contextlib.contextmanager
def quiet_loggers(names: tuple[str, ...]) -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def quiet_partial_reload_logs() -> contextlib.AbstractContextManager:
    """vLLM's per-layer warnings of a reload that sends part of the model (expected with buckets; the sender checks
    that every tensor is sent once)."""
    return quiet_loggers(_RELOAD_LOGGERS)
