"""Core attention of megatron-core's local layer spec through ``torch.nn.functional.scaled_dot_product_attention``.

``SDPAttention`` is megatron-core's ``DotProductAttention`` (same constructor, forward signature, scale, dropout and
checkpoint keys: it subclasses it) with the ``[b, heads, s, s]`` score matrix left to torch's fused kernels: flash
or memory-efficient attention on CUDA/NPU, the fused flash kernel on CPU. ``models/builder.py`` puts it in the
local spec's ``self_attention.submodules.core_attention`` when ``model.attention_backend=sdpa`` (the default);
TransformerEngine's spec keeps its own attention.

* Masks. megatron-core's masks are boolean with True = masked; SDPA's boolean mask is True = keep. A mask equal to
  the plain causal one (what the actor passes, checked once per mask tensor) or no mask on a causal layer becomes
  ``is_causal=True`` (no mask in memory). Any other ``[b|1, 1|heads, sq, sk]`` mask is passed inverted. A query row
  with every key masked gets what DotProductAttention gives it (its -10000 fill makes the softmax uniform over all
  keys): its query is zeroed and all keys kept, so the row is finite on every backend and exactly equal.
* GQA: ``enable_gqa=True`` (no copies of K and V).
* Packed THD sequences (``packed_seq_params.qkv_format="thd"``) are supported: one SDPA call per sequence, over
  ``[cu_seqlens_q_padded[i], + its length from cu_seqlens_q)``, causal inside each sequence; the pad tokens of a
  padded slot get zeros (as TransformerEngine writes them). megatron-core's DotProductAttention refuses packed
  sequences. (``config/plan.py`` still refuses ``actor.use_remove_padding`` with the local spec.)
* Context parallelism: none, as in DotProductAttention (its constructor refuses CP > 1; the platform refuses CP
  without TransformerEngine or MindSpeed before that).
* Falls back to DotProductAttention's own forward for what SDPA cannot express or megatron-core computes
  differently: a softmax offset (``softmax_type`` off-by-one/learnable), sliding-window layers, an attention bias
  (which DotProductAttention refuses too), a non-boolean or non-4-D mask, a maskless causal layer with
  ``1 < sq != sk``, and packed formats other than THD.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

# (weakref to a tensor, its version counter) -> a value derived from it. Every layer of a forward sees the same mask
# and cu_seqlens tensors: derive once (a causal check over s x s entries, a device-to-host copy) instead of per layer.
_DERIVED: dict[tuple[int, str], tuple[weakref.ref, int, Any]] = {}
_DERIVED_MAX = 16


def _derived(tensor: torch.Tensor, what: str, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``fn(tensor)``, memoised on this very tensor object while it is alive and unmodified."""
    key = (id(tensor), what)
    hit = _DERIVED.get(key)
    if hit is not None and hit[0]() is tensor and hit[1] == tensor._version:
        return hit[2]
    value = fn(tensor)
    if len(_DERIVED) >= _DERIVED_MAX:
        _DERIVED.clear()
    _DERIVED[key] = (weakref.ref(tensor), tensor._version, value)
    return value


def _plain_causal(mask: torch.Tensor) -> bool:
    """Whether a ``[1.., sq, sq]`` boolean mask is exactly megatron's causal mask (True above the diagonal)."""
    s = mask.shape[-1]
    if mask.shape[-2] != s or any(n != 1 for n in mask.shape[:-2]):
        return False
    upper = torch.ones(s, s, dtype=torch.bool, device=mask.device).triu_(1)
    return bool(torch.equal(mask.reshape(s, s), upper))


def _host_list(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.tolist()]


class SDPAttention(DotProductAttention):
    """megatron-core's ``DotProductAttention`` computed by ``F.scaled_dot_product_attention`` (module docstring)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(
            config, layer_number, attn_mask_type, attention_type, attention_dropout, softmax_scale, cp_comm_type,
            pg_collection,
        )  # fmt: skip
        # DotProductAttention divides its scale by the layer number and its softmax multiplies it back.
        coeff = self.layer_number if config.apply_query_key_layer_scaling else 1
        self.sdpa_scale = self.softmax_scale * coeff
        # What SDPA cannot express: a per-head softmax offset (an extra logit) and sliding windows.
        self.uses_fallback = self.softmax_offset is not None or self.scale_mask_softmax.window_size is not None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        """``[sq, b, heads, dim]`` query, ``[sk, b, groups, dim]`` key/value → ``[sq, b, heads * dim]``; THD:
        ``[t, heads, dim]`` → ``[t, heads * dim]``."""
        args = (query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        if self.uses_fallback or attention_bias is not None:
            return super().forward(*args)
        dropout_p = self.attention_dropout.p if self.training else 0.0
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                return super().forward(*args)
            if attention_mask is not None:
                raise ValueError("SDPAttention: packed (THD) sequences are masked by cu_seqlens, not attention_mask")
            return self._packed(query, key, value, packed_seq_params, dropout_p)
        sq, b, heads, dim = query.shape
        masking = self._mask_args(attention_mask, sq, key.shape[0])
        if masking is None:
            return super().forward(*args)
        keep, dead, is_causal = masking
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        if dead is not None:
            q = q.masked_fill(dead, 0.0)
        out = self._sdpa(q, k, v, keep, is_causal, dropout_p)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * dim)

    def _mask_args(
        self, mask: Optional[torch.Tensor], sq: int, sk: int
    ) -> Optional[tuple[Optional[torch.Tensor], Optional[torch.Tensor], bool]]:
        """(SDPA's keep-mask, the fully masked query rows, is_causal) as DotProductAttention would mask, or None where
        only DotProductAttention's own forward does what it does."""
        if mask is None:
            # DotProductAttention's softmax builds a [sq, sq] causal mask for a causal layer, none for sq == 1.
            if self.attn_mask_type != AttnMaskType.causal or sq == 1:
                return None, None, False
            return (None, None, True) if sq == sk else None
        if mask.dtype != torch.bool or mask.dim() != 4:
            return None
        if sq == sk and _derived(mask, "plain_causal", _plain_causal):
            return None, None, True
        dead = mask.all(dim=-1, keepdim=True)  # rows DotProductAttention spreads uniformly over every key
        return ~mask | dead, dead, False

    def _sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        keep: Optional[torch.Tensor],
        is_causal: bool,
        dropout_p: float,
    ) -> torch.Tensor:
        """SDPA on ``[..., heads, s, dim]`` (K/V with fewer heads: GQA); dropout on the tensor-parallel RNG stream,
        as DotProductAttention draws it (each TP rank holds other heads)."""
        rng = contextlib.nullcontext()
        if dropout_p > 0 and not self.config.sequence_parallel:
            rng = tensor_parallel.get_cuda_rng_tracker().fork()
        with rng:
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=keep,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=self.sdpa_scale,
                enable_gqa=q.shape[-3] != k.shape[-3],
            )

    def _packed(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: PackedSeqParams, dropout_p: float
    ) -> torch.Tensor:
        """THD: one SDPA call per packed sequence (``[t, heads, dim]`` → ``[t, heads * dim]``); pad tokens → 0."""
        causal = self.attn_mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        cu_q = _derived(params.cu_seqlens_q, "host", _host_list)
        cu_kv = _derived(params.cu_seqlens_kv, "host", _host_list)
        padded_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        padded_kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
        start_q, start_kv = _derived(padded_q, "host", _host_list), _derived(padded_kv, "host", _host_list)
        out = query.new_zeros(query.shape)
        for i in range(len(cu_q) - 1):
            a, n = start_q[i], cu_q[i + 1] - cu_q[i]
            ak, nk = start_kv[i], cu_kv[i + 1] - cu_kv[i]
            if causal and n != nk:
                raise ValueError(f"SDPAttention: packed sequence {i} has {n} queries and {nk} keys under a causal mask")
            q, k, v = (t.transpose(0, 1) for t in (query[a : a + n], key[ak : ak + nk], value[ak : ak + nk]))
            out[a : a + n] = self._sdpa(q, k, v, None, causal, dropout_p).transpose(0, 1)
        return out.reshape(out.shape[0], -1)
