"""A frozen megatron-core ``GPTModel`` reward model: built, loaded, and run on left-aligned token rows.

The model is the family's decoder (``models/builder.build_gpt_chunks``, the actor's own builder) with
``rm/score_head.ScoreHead`` in ``GPTModel.output_layer``'s slot, so megatron-core's forward runs embedding, decoder,
final norm and head as for a causal LM and returns ``[B, S, num_labels]`` scores. It lives in the actor's
megatron-core parallel state: tensor-parallel like the actor, one pipeline stage (no pipeline schedule for a frozen
scorer), no sequence parallelism (the head needs whole hidden states on every TP rank).

``load_reward_model`` reads either our converted checkpoint (``weights/convert.convert_hf_to_mcore`` of an HF
classifier: megatron-core's ``dist_checkpointing``, any TP it is loaded at) or the HF directory itself (each rank
reads its TP slice through ``weights/layout.py``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional, Union

import torch

from megatron_dapo.config import ActorConfig, ModelConfig, ParallelConfig
from megatron_dapo.models.builder import build_gpt_chunks, freeze
from megatron_dapo.models.families import ModelArch
from megatron_dapo.platform import get_platform
from megatron_dapo.rm.score_head import ScoreHead, ScoreHeadSpec, body_mappings, reward_head
from megatron_dapo.weights.checkpoint_errors import CheckpointError
from megatron_dapo.weights.convert import check_hf_tensors
from megatron_dapo.weights.dist_format import find_checkpoint
from megatron_dapo.weights.layout import hf_to_mcore, tp_shard
from megatron_dapo.weights.loading import arch_mismatches, checkpoint_arch, load_mcore_checkpoint
from megatron_dapo.weights.model_io import global_named_parameters
from megatron_dapo.weights.safetensors_io import SafetensorsDir

PathLike = Union[str, Path]


def classifier_head(arch: ModelArch, where: str) -> ScoreHeadSpec:
    """``arch``'s score head, or a ``CheckpointError`` saying that ``where`` holds no sequence classifier."""
    head = reward_head(arch)
    if head is None:
        archs = (arch.hf_config or {}).get("architectures")
        raise CheckpointError(
            f"{where}: config.json architectures={archs} is not a *ForSequenceClassification reward model"
            " (e.g. Qwen2ForSequenceClassification, LlamaForSequenceClassification with num_labels=1)"
        )
    if arch.is_moe or arch.gated_delta_net is not None:
        raise CheckpointError(f"{where}: a {arch.family.name} reward model is not supported (dense qwen2/qwen3/llama)")
    return head


def reward_model_arch(load_dir: PathLike) -> tuple[ModelArch, ScoreHeadSpec]:
    """The reward model's architecture and head from ``load_dir`` (HF directory or converted checkpoint)."""
    source = find_checkpoint(load_dir)
    arch = checkpoint_arch(source)
    if arch is None:
        raise CheckpointError(
            f"reward.reward_model.load_dir={load_dir}: {source.description} carries no hf_config/config.json; convert"
            " the HF classifier with `megatron-dapo convert hf-to-mcore`, which keeps its config"
        )
    return arch, classifier_head(arch, f"reward.reward_model.load_dir={load_dir}")


def build_reward_model(
    arch: ModelArch,
    model_cfg: ModelConfig,
    parallel: ParallelConfig,
    transformer_impl: Optional[str] = None,
):
    """The frozen reward ``GPTModel`` on this rank, in the current megatron-core parallel state (TP as
    ``parallel``; its pipeline must be one stage). Built as a tied model so no vocabulary-sized LM head is ever
    allocated, then given its ``ScoreHead``."""
    head = classifier_head(arch, "reward model")
    if parallel.pipeline_model_parallel_size != 1 or parallel.context_parallel_size != 1:
        raise ValueError(
            f"reward model: parallel.pipeline_model_parallel_size={parallel.pipeline_model_parallel_size}, "
            f"context_parallel_size={parallel.context_parallel_size}: the reward model runs on one pipeline stage "
            "without context parallelism; set both to 1"
        )
    layout = dataclasses.replace(parallel, sequence_parallel=False, virtual_pipeline_model_parallel_size=None)
    tied = dataclasses.replace(arch, tie_word_embeddings=True)
    (model,) = build_gpt_chunks(tied, model_cfg, layout, ActorConfig(), transformer_impl)
    weight = model.embedding.word_embeddings.weight
    model.output_layer = ScoreHead(head.shape[0], head.shape[1], weight.dtype, weight.device)
    # The head is the model's own, untied weight: GPTModel must neither pass it the embedding nor save it as one.
    model.share_embeddings_and_output_weights = False
    return freeze([model])[0]


@torch.no_grad()
def load_hf_reward_model(model, arch: ModelArch, hf_dir: PathLike) -> None:
    """Fill the reward ``model``'s TP slices from an HF ``*ForSequenceClassification`` directory (headers checked
    first: every tensor present with its shape, nothing unexpected). Not collective."""
    from megatron.core import parallel_state as ps  # heavy: megatron-core, once the platform has patched it

    head = classifier_head(arch, str(hf_dir))
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    by_name = {m.mcore: m for m in body_mappings(arch)}
    with SafetensorsDir(hf_dir) as reader:
        check_hf_tensors(reader, arch, list(by_name.values()), extra={head.hf: head.shape})
        for _, local, name, param in global_named_parameters([model], arch):
            if name == head.mcore:
                full, shard = reader.get(head.hf), None
            else:
                m = by_name.get(name)
                if m is None:
                    raise CheckpointError(f"{hf_dir}: reward model parameter {local!r} ({name}) has no HF mapping")
                full = hf_to_mcore(m, [reader.get(n) for n in m.hf], arch, param.shape[0] * tp)
                shard = tp_shard(full, m.kind, m.tp_dim, tp, tp_rank, m.sections)
            shard = full if shard is None else shard
            if tuple(shard.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{hf_dir}: {name} gets shape {tuple(shard.shape)}, the reward model holds {tuple(param.shape)}"
                )
            param.copy_(shard)


def load_reward_model(model, arch: ModelArch, load_dir: PathLike) -> dict[str, Any]:
    """Fill the reward ``model`` from ``load_dir``: an HF classifier directory or its converted Megatron checkpoint
    (collective then: every rank calls it). The checkpoint's config must describe ``arch``."""
    source = find_checkpoint(load_dir)
    stored = checkpoint_arch(source)
    where = f"reward.reward_model.load_dir={load_dir}"
    if stored is None:
        raise CheckpointError(f"{where}: {source.description} carries no config.json (hf_config/ for Megatron)")
    classifier_head(stored, where)
    diffs = arch_mismatches(stored, arch)
    if diffs:
        raise CheckpointError(f"{where}: its config.json describes another model: {'; '.join(diffs)}")
    if source.kind == "hf":
        load_hf_reward_model(model, arch, source.path)
        return {"kind": "hf", "path": str(source.path), "description": source.description, "common": {}}
    return load_mcore_checkpoint([model], arch, load_dir)


@torch.no_grad()
def forward_scores(model, tokens: torch.Tensor, explicit_causal_mask: bool = True) -> torch.Tensor:
    """All positions' scores ``[B, S, num_labels]`` (fp32) of left-aligned ``tokens`` ``[B, S]`` (real tokens
    first, padding after: causal attention keeps the padding out of every real position)."""
    device = get_platform().device()
    tokens = tokens.to(device)
    b, s = tokens.shape
    position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    mask = None
    if explicit_causal_mask:
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)[None, None]
    return model(tokens, position_ids, mask).float()
