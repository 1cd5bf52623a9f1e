"""Moving tensors in and out of this rank's megatron-core model chunks, by global parameter name.

``local_param_table`` says which full tensors this rank needs (and which TP slice of each); loaders and the weight
sync iterate it so that every rank reads or gathers only what it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_dapo.models.families import ModelArch, ParamMapping, from_te_name, param_mappings
from megatron_dapo.weights.layout import local_to_global_name, pp_layer_range, tp_merge, tp_shard


@dataclass(frozen=True)
class LocalParam:
    chunk: int  # virtual-pipeline chunk index on this rank
    local_name: str  # name inside the chunk's GPTModel state dict
    mapping: ParamMapping  # global name + HF names + layout kind
    param: torch.Tensor


def chunk_layer_offset(arch: ModelArch, pp_size: int, pp_rank: int, vpp_size: Optional[int], vpp_rank: int) -> int:
    return pp_layer_range(arch.num_layers, pp_size, pp_rank, vpp_size, vpp_rank).start


def _gpt(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def local_param_table(chunks: list, arch: ModelArch) -> list[LocalParam]:
    """Every parameter of this rank's chunks with its global mapping (tied output weights included)."""
    from megatron.core import parallel_state as ps

    by_name = {m.mcore: m for m in param_mappings(arch)}
    pp_size, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    table = []
    for ci, chunk in enumerate(chunks):
        offset = chunk_layer_offset(arch, pp_size, pp_rank, vpp, ci)
        for local_name, param in _gpt(chunk).named_parameters():
            global_name = local_to_global_name(from_te_name(local_name), offset)
            mapping = by_name.get(global_name)
            if mapping is None and global_name == "output_layer.weight" and arch.tie_word_embeddings:
                # Tied embeddings on a last stage that is not also the first: a copy of the embedding.
                mapping = by_name["embedding.word_embeddings.weight"]
            if mapping is None:
                raise KeyError(
                    f"parameter {local_name!r} (global {global_name!r}) has no HF mapping for {arch.family.name}"
                )
            table.append(LocalParam(ci, local_name, mapping, param))
    return table


@torch.no_grad()
def load_full_tensors(chunks: list, arch: ModelArch, get_full: Callable[[ParamMapping], torch.Tensor]) -> None:
    """Fill this rank's parameters: ``get_full(mapping)`` returns the full Megatron tensor; we keep our TP slice."""
    from megatron.core import parallel_state as ps

    tp_size, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for lp in local_param_table(chunks, arch):
        full = get_full(lp.mapping)
        shard = tp_shard(full, lp.mapping.kind, lp.mapping.tp_dim, tp_size, tp_rank)
        if tuple(shard.shape) != tuple(lp.param.shape):
            raise ValueError(
                f"{lp.mapping.mcore}: expected shard shape {tuple(lp.param.shape)}, got {tuple(shard.shape)}"
                f" from full shape {tuple(full.shape)}"
            )
        lp.param.copy_(shard)


@torch.no_grad()
def gather_full_tensor(lp: LocalParam) -> torch.Tensor:
    """All-gather ``lp``'s TP shards into the full Megatron tensor (collective over the TP group)."""
    from megatron.core import parallel_state as ps

    tp_size = ps.get_tensor_model_parallel_world_size()
    local = lp.param.detach()
    if lp.mapping.tp_dim is None or tp_size == 1:
        return local
    shards = [torch.empty_like(local) for _ in range(tp_size)]
    dist.all_gather(shards, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return tp_merge(shards, lp.mapping.kind, lp.mapping.tp_dim)


def iter_full_tensors(chunks: list, arch: ModelArch) -> Iterator[tuple[ParamMapping, torch.Tensor]]:
    """This pipeline stage's full tensors (TP-gathered), skipping the tied output copy. Collective over TP."""
    seen = set()
    for lp in local_param_table(chunks, arch):
        if lp.mapping.mcore in seen:
            continue
        seen.add(lp.mapping.mcore)
        yield lp.mapping, gather_full_tensor(lp)
