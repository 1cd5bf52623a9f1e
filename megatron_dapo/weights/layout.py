"""The one layout module: HF tensors ⇄ Megatron tensors, tensor-parallel split/merge and pipeline layer ranges.

Used by the checkpoint converter (``tools/checkpoint_convert``) and by the rollout weight sync, so the QKV,
gate/up and vocabulary-padding logic exists once.

Conventions. A *full* Megatron tensor is the TP=1 tensor, independent of the TP size:
  * ``linear_qkv`` is grouped per query group: for each of the g groups ``[q_1 .. q_{h/g}, k, v]`` (head_dim rows
    each). TP splits it by groups, i.e. into contiguous chunks along dim 0.
  * ``linear_fc1`` is ``cat(gate, up)``; TP rank r holds ``cat(gate_r, up_r)`` (each half split separately).
  * embedding / output layer are padded to ``padded_vocab_size`` rows (zeros) and split along dim 0.
  * Qwen3-Next / Qwen3.5 (docs/qwen35.md): the gated ``linear_qkv`` is ``[q_1 .. q_{h/g}, gate_1 .. gate_{h/g}, k, v]``
    per group; a Gated DeltaNet's ``in_proj`` is ``[q, k, v, z, beta, alpha]`` and its ``conv1d`` ``[q, k, v]``, and TP
    rank r holds its slice of each of those blocks (``ParamMapping.sections``); its ``out_norm`` is stored w - 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch

from megatron_dapo.models.families import ModelArch, ParamMapping


def padded_vocab_size(vocab_size: int, make_divisible_by: int, tp_size: int) -> int:
    """Megatron's padded vocabulary: a multiple of ``make_divisible_by × tp_size``."""
    multiple = make_divisible_by * tp_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def pad_vocab(tensor: torch.Tensor, padded_size: int) -> torch.Tensor:
    if tensor.shape[0] > padded_size:
        raise ValueError(f"vocabulary rows {tensor.shape[0]} exceed padded size {padded_size}")
    if tensor.shape[0] == padded_size:
        return tensor
    pad = tensor.new_zeros((padded_size - tensor.shape[0],) + tuple(tensor.shape[1:]))
    return torch.cat([tensor, pad], dim=0)


def unpad_vocab(tensor: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return tensor[:vocab_size]


# ------------------------------------------------------------------------------------------------ QKV


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int, head_dim: int) -> torch.Tensor:
    """HF q/k/v (weights ``[heads*hd, hidden]`` or biases ``[heads*hd]``) → Megatron's per-group fused layout."""
    rest = tuple(q.shape[1:])
    heads_per_group = q.shape[0] // (num_query_groups * head_dim)
    qg = q.reshape((num_query_groups, heads_per_group * head_dim) + rest)
    kg = k.reshape((num_query_groups, head_dim) + rest)
    vg = v.reshape((num_query_groups, head_dim) + rest)
    return torch.cat([qg, kg, vg], dim=1).reshape((-1,) + rest)


def split_qkv(
    fused: torch.Tensor, num_query_groups: int, head_dim: int, heads_per_group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``fuse_qkv``; ``num_query_groups`` may be the groups of one TP shard."""
    rest = tuple(fused.shape[1:])
    grouped = fused.reshape((num_query_groups, (heads_per_group + 2) * head_dim) + rest)
    q, k, v = torch.split(grouped, [heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape((-1,) + rest),
        k.reshape((-1,) + rest),
        v.reshape((-1,) + rest),
    )


# ---------------------------------------------------------------------------------------- HF ⇄ full


def hf_to_mcore(
    mapping: ParamMapping, hf_tensors: Sequence[torch.Tensor], arch: ModelArch, padded_vocab: int
) -> torch.Tensor:
    """Build the full (TP=1) Megatron tensor for ``mapping`` from its HF tensors (in ``mapping.hf`` order)."""
    if mapping.kind == "copy":
        return hf_tensors[0]
    if mapping.kind == "vocab":
        return pad_vocab(hf_tensors[0], padded_vocab)
    if mapping.kind == "qkv":
        q, k, v = hf_tensors
        return fuse_qkv(q, k, v, arch.num_query_groups, arch.head_dim)
    if mapping.kind == "gate_up":
        gate, up = hf_tensors
        return torch.cat([gate, up], dim=0)
    if mapping.kind == "qkv_gated":
        q, gate = _unzip_gated_q(hf_tensors[0], arch)
        q_then_gate = torch.cat([q, gate], dim=1).reshape((-1,) + tuple(q.shape[2:]))
        return fuse_qkv(q_then_gate, hf_tensors[1], hf_tensors[2], arch.num_query_groups, arch.head_dim)
    if mapping.kind == "gdn_in":
        return torch.cat(_gdn_in_blocks(hf_tensors, arch), dim=0)
    if mapping.kind == "norm_offset":
        return hf_tensors[0] - 1.0
    if mapping.kind == "gdn_conv":
        return hf_tensors[0]
    raise ValueError(f"unknown layout kind {mapping.kind!r}")


def _unzip_gated_q(q_proj: torch.Tensor, arch: ModelArch) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's gated q_proj (per head: head_dim query rows, then head_dim gate rows) → (q, gate), each grouped per query
    group as ``[groups, heads_per_group * head_dim, ...]``."""
    rest = tuple(q_proj.shape[1:])
    per_head = q_proj.reshape((arch.num_query_groups, arch.heads_per_group, 2, arch.head_dim) + rest)
    q, gate = per_head[:, :, 0], per_head[:, :, 1]
    shape = (arch.num_query_groups, arch.heads_per_group * arch.head_dim) + rest
    return q.reshape(shape), gate.reshape(shape)


def _gdn_in_blocks(hf_tensors: Sequence[torch.Tensor], arch: ModelArch) -> list[torch.Tensor]:
    """The blocks q, k, v, z, beta, alpha of a Gated DeltaNet's in_proj from Qwen3.5's (in_proj_qkv, z, b, a) or
    Qwen3-Next's (in_proj_qkvz, in_proj_ba), which interleave them per key head: for each key head, its q, k, then
    the v and z of its value heads; and its b, then its a."""
    gdn = arch.gated_delta_net
    if len(hf_tensors) == 4:
        qkv, z, b, a = hf_tensors
        return [*torch.split(qkv, list(gdn.conv_sections), dim=0), z, b, a]
    qkvz, ba = hf_tensors
    rest = tuple(qkvz.shape[1:])
    nk, dk, r = gdn.num_key_heads, gdn.key_head_dim, gdn.num_value_heads // gdn.num_key_heads
    grouped = qkvz.reshape((nk, 2 * dk + 2 * r * gdn.value_head_dim) + rest)
    q, k, v, z = torch.split(grouped, [dk, dk, r * gdn.value_head_dim, r * gdn.value_head_dim], dim=1)
    b, a = torch.split(ba.reshape((nk, 2 * r) + rest), [r, r], dim=1)
    return [t.reshape((-1,) + rest) for t in (q, k, v, z, b, a)]


def _gdn_in_to_hf(full: torch.Tensor, arch: ModelArch) -> list[torch.Tensor]:
    """Inverse of ``_gdn_in_blocks`` + concatenation, in ``mapping.hf`` order."""
    gdn = arch.gated_delta_net
    q, k, v, z, b, a = torch.split(full, list(gdn.in_proj_sections), dim=0)
    if not gdn.grouped_in_proj:
        return [torch.cat([q, k, v], dim=0), z, b, a]
    rest = tuple(full.shape[1:])
    nk = gdn.num_key_heads
    qkvz = torch.cat([t.reshape((nk, -1) + rest) for t in (q, k, v, z)], dim=1).reshape((-1,) + rest)
    ba = torch.cat([t.reshape((nk, -1) + rest) for t in (b, a)], dim=1).reshape((-1,) + rest)
    return [qkvz, ba]


def mcore_to_hf(mapping: ParamMapping, full: torch.Tensor, arch: ModelArch) -> list[torch.Tensor]:
    """Full Megatron tensor → its HF tensors (in ``mapping.hf`` order)."""
    if mapping.kind == "copy":
        return [full]
    if mapping.kind == "vocab":
        return [unpad_vocab(full, arch.vocab_size)]
    if mapping.kind == "qkv":
        return list(split_qkv(full, arch.num_query_groups, arch.head_dim, arch.heads_per_group))
    if mapping.kind == "gate_up":
        return list(torch.chunk(full, 2, dim=0))
    if mapping.kind == "qkv_gated":
        hpg, hd, rest = arch.heads_per_group, arch.head_dim, tuple(full.shape[1:])
        qg, k, v = split_qkv(full, arch.num_query_groups, hd, 2 * hpg)
        q, gate = torch.split(qg.reshape((arch.num_query_groups, 2, hpg, hd) + rest), 1, dim=1)
        q_proj = torch.cat([q.reshape((-1, 1, hd) + rest), gate.reshape((-1, 1, hd) + rest)], dim=1)
        return [q_proj.reshape((-1,) + rest), k, v]
    if mapping.kind == "gdn_in":
        return _gdn_in_to_hf(full, arch)
    if mapping.kind == "norm_offset":
        return [full + 1.0]
    if mapping.kind == "gdn_conv":
        return [full]
    raise ValueError(f"unknown layout kind {mapping.kind!r}")


def hf_shapes(mapping: ParamMapping, arch: ModelArch) -> list[tuple[int, ...]]:
    """Expected HF shapes for ``mapping`` (for error messages before any tensor is read)."""
    h, hd = arch.hidden_size, arch.head_dim
    name = mapping.mcore
    ffn = arch.moe_ffn_hidden_size if mapping.is_expert else arch.ffn_hidden_size
    if ".shared_experts." in name:
        ffn = arch.moe_shared_expert_ffn_hidden_size
        if name.endswith("gate_weight"):
            return [(1, h)]
    if mapping.kind == "vocab":
        return [(arch.vocab_size, h)]
    if mapping.layer is not None and arch.is_linear_layer(mapping.layer) and ".self_attention." in name:
        return _gdn_hf_shapes(mapping, arch)
    if mapping.kind == "qkv_gated":
        q_rows, kv_rows = 2 * arch.num_attention_heads * hd, arch.num_query_groups * hd
        return [(q_rows, h), (kv_rows, h), (kv_rows, h)]
    if mapping.kind == "qkv":
        q_rows, kv_rows = arch.num_attention_heads * hd, arch.num_query_groups * hd
        if name.endswith("bias"):
            return [(q_rows,), (kv_rows,), (kv_rows,)]
        return [(q_rows, h), (kv_rows, h), (kv_rows, h)]
    if mapping.kind == "gate_up":
        return [(ffn, h)] * 2
    if name.endswith("linear_proj.weight"):
        return [(h, arch.num_attention_heads * hd)]
    if name.endswith("linear_fc2.weight"):
        return [(h, ffn)]
    if name.endswith("mlp.router.weight"):
        return [(arch.num_experts, h)]
    if name.endswith("q_layernorm.weight") or name.endswith("k_layernorm.weight"):
        return [(hd,)]
    return [(h,)]  # norms


def _gdn_hf_shapes(mapping: ParamMapping, arch: ModelArch) -> list[tuple[int, ...]]:
    gdn, h = arch.gated_delta_net, arch.hidden_size
    if mapping.kind == "gdn_in":
        if gdn.grouped_in_proj:
            return [(2 * gdn.qk_dim + 2 * gdn.v_dim, h), (2 * gdn.num_value_heads, h)]
        nv = gdn.num_value_heads
        return [(2 * gdn.qk_dim + gdn.v_dim, h), (gdn.v_dim, h), (nv, h), (nv, h)]
    if mapping.kind == "gdn_conv":
        return [(2 * gdn.qk_dim + gdn.v_dim, 1, gdn.conv_kernel_dim)]
    if mapping.kind == "norm_offset":
        return [(gdn.value_head_dim,)]
    if mapping.mcore.endswith("out_proj.weight"):
        return [(h, gdn.v_dim)]
    return [(gdn.num_value_heads,)]  # A_log, dt_bias


# megatron-core's GatedDeltaNet.sharded_state_dict stores its in_proj and conv1d in pieces, one key per block
# (``<key>.query`` ...), each TP-sharded on its own.
CHECKPOINT_PIECES = {
    "gdn_in": ("query", "key", "value", "z", "beta", "alpha"),
    "gdn_conv": ("query", "key", "value"),
}


def checkpoint_pieces(mapping: ParamMapping) -> list[tuple[str, int, int]]:
    """(key suffix, first row, rows) of each piece a Megatron checkpoint stores ``mapping``'s full tensor as; [] for
    a tensor stored whole."""
    names = CHECKPOINT_PIECES.get(mapping.kind, ())
    out, row = [], 0
    for name, rows in zip(names, mapping.sections or ()):
        out.append((name, row, rows))
        row += rows
    return out


# ------------------------------------------------------------------------------------- TP split / merge


def tp_shard(
    full: torch.Tensor,
    kind: str,
    tp_dim: Optional[int],
    tp_size: int,
    tp_rank: int,
    sections: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """The slice of a full Megatron tensor that TP rank ``tp_rank`` holds (a view where possible). ``sections``
    (``ParamMapping.sections``): the row blocks split over TP one by one (a Gated DeltaNet's in_proj / conv1d)."""
    if tp_dim is None or tp_size == 1:
        return full
    if sections is not None:
        blocks = torch.split(full, list(sections), dim=tp_dim)
        return torch.cat([tp_shard(b, "copy", tp_dim, tp_size, tp_rank) for b in blocks], dim=tp_dim)
    if kind in ("gdn_in", "gdn_conv"):
        raise ValueError(f"a {kind} tensor is split over TP block by block: pass the mapping's sections")
    if kind == "gate_up":
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp_size, 0)[tp_rank], torch.chunk(up, tp_size, 0)[tp_rank]], dim=0)
    if full.shape[tp_dim] % tp_size != 0:
        raise ValueError(f"dimension {tp_dim} of shape {tuple(full.shape)} is not divisible by TP size {tp_size}")
    return torch.chunk(full, tp_size, dim=tp_dim)[tp_rank]


def tp_merge(
    shards: Sequence[torch.Tensor], kind: str, tp_dim: Optional[int], sections: Optional[Sequence[int]] = None
) -> torch.Tensor:
    """Inverse of ``tp_shard`` over all ranks' shards (rank order)."""
    if tp_dim is None or len(shards) == 1:
        return shards[0]
    if sections is not None:
        local = [n // len(shards) for n in sections]
        per_rank = [torch.split(s, local, dim=tp_dim) for s in shards]
        return torch.cat([r[i] for i in range(len(local)) for r in per_rank], dim=tp_dim)
    if kind in ("gdn_in", "gdn_conv"):
        raise ValueError(f"a {kind} tensor is merged over TP block by block: pass the mapping's sections")
    if kind == "gate_up":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(shards), dim=tp_dim)


def mcore_shard_shape(full_shape: Sequence[int], tp_dim: Optional[int], tp_size: int) -> tuple[int, ...]:
    shape = list(full_shape)
    if tp_dim is not None:
        shape[tp_dim] //= tp_size
    return tuple(shape)


# ------------------------------------------------------------------------------------------ PP ranges


def pp_layer_range(
    num_layers: int, pp_size: int, pp_rank: int, vpp_size: Optional[int] = None, vpp_rank: int = 0
) -> range:
    """Global indices of the decoder layers held by (pipeline rank, virtual stage); uniform split as megatron-core."""
    chunks = pp_size * (vpp_size or 1)
    if num_layers % chunks != 0:
        raise ValueError(f"num_layers={num_layers} is not divisible by pipeline stages {pp_size}×{vpp_size or 1}")
    per_chunk = num_layers // chunks
    start = vpp_rank * (num_layers // (vpp_size or 1)) + pp_rank * per_chunk
    return range(start, start + per_chunk)


def global_to_local_name(name: str, layer_offset: int) -> str:
    """``decoder.layers.{global}.x`` → ``decoder.layers.{global - offset}.x`` (names inside one model chunk)."""
    return _shift_layer(name, -layer_offset)


def local_to_global_name(name: str, layer_offset: int) -> str:
    return _shift_layer(name, layer_offset)


def _shift_layer(name: str, delta: int) -> str:
    prefix = "decoder.layers."
    if not name.startswith(prefix) or delta == 0:
        return name
    idx, rest = name[len(prefix) :].split(".", 1)
    return f"{prefix}{int(idx) + delta}.{rest}"


def layer_of(name: str) -> Optional[int]:
    prefix = "decoder.layers."
    if not name.startswith(prefix):
        return None
    return int(name[len(prefix) :].split(".", 1)[0])


# --------------------------------------------------------------------------------------- MoE (HF side)


def unfuse_hf_experts(state: dict) -> dict:
    """An HF state dict with per-expert names (the checkpoint format: ``mlp.experts.{e}.{gate,up,down}_proj.weight``).

    transformers 5 keeps a Qwen3-MoE layer's experts fused in memory (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
    gate rows first, and ``mlp.experts.down_proj`` ``[E, H, I]``) and splits them only when saving; the name map
    uses the checkpoint names. Other entries pass through (views, no copies)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(tensor.shape[0]):
                gate, up = torch.chunk(tensor[e], 2, dim=0)
                out[f"{base}{e}.gate_proj.weight"] = gate
                out[f"{base}{e}.up_proj.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out
