"""A discriminative reward model's scalar head: HF ``*ForSequenceClassification`` ⇄ megatron-core ``GPTModel``.

An HF sequence classifier (``Qwen2/Qwen3/LlamaForSequenceClassification``; transformers' generic
``GenericForSequenceClassification`` in ``modeling_layers.py``) is the decoder ``model.*`` of its family plus
``score = Linear(hidden, num_labels, bias=False)`` applied to the final (normed) hidden states; its output is the
score at the rightmost token that is not ``pad_token_id``. On the megatron-core side the decoder is the family's
(``models/families.param_mappings`` without the LM head) and ``ScoreHead`` takes the ``output_layer`` slot of
``GPTModel`` under the name ``output_layer.weight``: megatron-core runs it after the final norm as it would the LM
head, and saves and loads it as a replicated tensor. The converter (``weights/convert.py``) asks ``reward_head``
whether a checkpoint is a classifier and plans its head from ``ScoreHeadSpec``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_dapo.models.families import OUTPUT_LAYER_NAME, ModelArch, ParamMapping, param_mappings

SCORE_HF_NAME = "score.weight"
CLASSIFIER_SUFFIX = "ForSequenceClassification"


def is_sequence_classifier(hf_config: Optional[dict]) -> bool:
    """Whether an HF ``config.json`` describes a ``*ForSequenceClassification`` model."""
    archs = (hf_config or {}).get("architectures") or []
    return any(str(a).endswith(CLASSIFIER_SUFFIX) for a in archs)


def num_labels(hf_config: dict) -> int:
    """transformers' ``num_labels``: ``len(id2label)`` as ``save_pretrained`` writes it, else ``num_labels``, else 2
    (``PretrainedConfig``'s default)."""
    if hf_config.get("id2label"):
        return len(hf_config["id2label"])
    return int(hf_config.get("num_labels") or 2)


@dataclass(frozen=True)
class ScoreHeadSpec:
    """Where a classifier's head lives in HF (``hf``) and Megatron (``mcore``) names, and its shape
    ``(num_labels, hidden)``; replicated over tensor-parallel ranks."""

    hf: str
    mcore: str
    shape: tuple[int, int]
    pad_token_id: Optional[int]


def reward_head(arch: ModelArch) -> Optional[ScoreHeadSpec]:
    """The score head of ``arch`` when its HF config is a sequence classifier; None for a causal LM."""
    cfg = arch.hf_config or {}
    if not is_sequence_classifier(cfg):
        return None
    pad = cfg.get("pad_token_id")
    return ScoreHeadSpec(SCORE_HF_NAME, OUTPUT_LAYER_NAME, (num_labels(cfg), arch.hidden_size), pad)


def body_mappings(arch: ModelArch) -> list[ParamMapping]:
    """The decoder's name map (embedding, layers, final norm) without any LM head: what a classifier shares with
    its family's causal LM."""
    return [m for m in param_mappings(arch) if m.mcore != OUTPUT_LAYER_NAME]


class ScoreHead(torch.nn.Module):
    """``GPTModel.output_layer``'s replacement for a reward model: ``hidden @ weight.T`` (no bias), called the way
    ``GPTModel._postprocess`` calls its output layer, ``(hidden, weight=, runtime_gather_output=) -> (out, bias)``.

    It is replicated over tensor-parallel ranks: without sequence parallelism the final hidden states are whole on
    every TP rank, so each computes the same scores and no collective is needed."""

    def __init__(self, num_labels: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(num_labels, hidden_size, dtype=dtype, device=device))

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None) -> tuple[torch.Tensor, None]:
        # ``weight`` is the tied embedding GPTModel would hand a shared LM head; a score head is never tied.
        return torch.nn.functional.linear(hidden, self.weight), None


def score_positions(tokens: torch.Tensor, lengths: torch.Tensor, pad_token_id: Optional[int]) -> torch.Tensor:
    """Per row of left-aligned ``tokens`` [B, S] (``lengths`` real tokens each), the position HF scores: the rightmost
    real token that is not ``pad_token_id`` (a trailing token equal to it is skipped, as HF skips it), 0 when every
    token is ``pad_token_id`` (HF's argmax of zeros); the last real token when the config has no pad id."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    real = positions[None, :] < lengths[:, None]
    if pad_token_id is None:
        return (lengths - 1).clamp(min=0)
    keep = real & (tokens != pad_token_id)
    return (positions[None, :] * keep).argmax(-1)
