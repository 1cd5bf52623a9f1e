"""Supported model families: HF ``config.json`` → architecture facts, and the HF⇄Megatron parameter name map.

The config mapping and the name map sit together so that adding a family touches one table. Tensor *layout*
transforms (QKV interleave, gate/up fuse, vocab padding, TP split) live in ``megatron_dapo.weights.layout``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union


class UnsupportedModelError(ValueError):
    """The HF config describes an architecture we do not map."""


@dataclass(frozen=True)
class FamilySpec:
    name: str
    hf_architecture: str
    qkv_bias: bool  # Qwen2: q/k/v projections carry a bias
    qk_layernorm: bool  # Qwen3: RMSNorm on each head's q and k
    moe: bool = False  # Mixture-of-Experts MLPs (router + routed experts) on the layers the config selects
    # Qwen3-Next / Qwen3.5 hybrids: Gated DeltaNet layers between gated full-attention layers, zero-centred (1 + w)
    # RMSNorms, partial rotary (docs/qwen35.md). MoE families of this kind may still be dense (num_experts = 0).
    linear_attention: bool = False


FAMILIES: dict[str, FamilySpec] = {
    "qwen2": FamilySpec("qwen2", "Qwen2ForCausalLM", qkv_bias=True, qk_layernorm=False),
    "qwen3": FamilySpec("qwen3", "Qwen3ForCausalLM", qkv_bias=False, qk_layernorm=True),
    "llama": FamilySpec("llama", "LlamaForCausalLM", qkv_bias=False, qk_layernorm=False),
    "qwen3_moe": FamilySpec("qwen3_moe", "Qwen3MoeForCausalLM", qkv_bias=False, qk_layernorm=True, moe=True),
    # Qwen2-MoE: Qwen2 attention (q/k/v bias) + routed experts + one shared expert behind a sigmoid gate.
    "qwen2_moe": FamilySpec("qwen2_moe", "Qwen2MoeForCausalLM", qkv_bias=True, qk_layernorm=False, moe=True),
    "qwen3_next": FamilySpec(
        "qwen3_next", "Qwen3NextForCausalLM", qkv_bias=False, qk_layernorm=True, moe=True, linear_attention=True
    ),
    # Qwen3.5 checkpoints are VLMs (``model.language_model.*`` + ``model.visual.*``): the text model is mapped.
    "qwen3_5": FamilySpec(
        "qwen3_5", "Qwen3_5ForConditionalGeneration", qkv_bias=False, qk_layernorm=True, linear_attention=True
    ),
    "qwen3_5_moe": FamilySpec(
        "qwen3_5_moe",
        "Qwen3_5MoeForConditionalGeneration",
        qkv_bias=False,
        qk_layernorm=True,
        moe=True,
        linear_attention=True,
    ),
}
# Text-only configs (``Qwen3_5ForCausalLM``: decoder under ``model.``) of the VLM families.
TEXT_MODEL_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
TEXT_ARCHITECTURES = {"Qwen3_5ForCausalLM": "qwen3_5", "Qwen3_5MoeForCausalLM": "qwen3_5_moe"}
# Where a VLM's text decoder sits in its HF names, and what else such a checkpoint holds that the map ignores.
VLM_TEXT_PREFIX = "model.language_model."
VLM_IGNORED_PREFIXES = ("model.visual.", "mtp.")


@dataclass(frozen=True)
class GatedDeltaNetArch:
    """The Gated DeltaNet (linear attention) layers of a hybrid model: which layers, and megatron-core's
    ``linear_*`` sizes. ``grouped_in_proj``: Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba``, grouped per key head;
    otherwise Qwen3.5's separate ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``."""

    linear_layers: tuple[int, ...]
    conv_kernel_dim: int
    key_head_dim: int
    value_head_dim: int
    num_key_heads: int
    num_value_heads: int
    grouped_in_proj: bool

    @property
    def qk_dim(self) -> int:
        return self.key_head_dim * self.num_key_heads

    @property
    def v_dim(self) -> int:
        return self.value_head_dim * self.num_value_heads

    @property
    def in_proj_sections(self) -> tuple[int, ...]:
        """megatron-core's ``in_proj`` rows: q, k, v, z (output gate), beta, alpha; each split over TP."""
        nv = self.num_value_heads
        return (self.qk_dim, self.qk_dim, self.v_dim, self.v_dim, nv, nv)

    @property
    def conv_sections(self) -> tuple[int, ...]:
        """``conv1d`` channels: q, k, v; each split over TP."""
        return (self.qk_dim, self.qk_dim, self.v_dim)


@dataclass(frozen=True)
class ModelArch:
    """Everything about the architecture that the Megatron model and the layout transforms need."""

    family: FamilySpec
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_layernorm: bool
    # llama3 rope scaling: {factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}
    llama3_rope_scaling: Optional[dict] = None
    hf_config: Optional[dict] = None
    # ---- Mixture of Experts (num_experts == 0: a dense model; the fields below are then unused)
    num_experts: int = 0  # routed experts per MoE layer (HF num_experts)
    moe_router_topk: int = 0  # experts per token (HF num_experts_per_tok)
    moe_ffn_hidden_size: Optional[int] = None  # one expert's intermediate size (HF moe_intermediate_size)
    # True: softmax over all experts -> top-k -> renormalise over the k (megatron: moe_router_pre_softmax=False);
    # False: softmax -> top-k, no renormalisation (moe_router_pre_softmax=True).
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()  # global indices of the MoE layers; the others have the dense MLP
    # HF's router_aux_loss_coef, for reference only: HF's load-balancing loss is top-k x megatron-core's per layer
    # and is computed over all layers' tokens at once, so it does not carry over 1:1 (see docs/checkpoints.md).
    router_aux_loss_coef: float = 0.0
    # Qwen2-MoE's shared expert (every token, output scaled by sigmoid(gate · x)); None: no shared expert.
    moe_shared_expert_ffn_hidden_size: Optional[int] = None
    # ---- hybrid linear attention (Qwen3-Next / Qwen3.5; docs/qwen35.md)
    hf_prefix: str = "model."  # the decoder's prefix in HF names (a Qwen3.5 VLM: ``model.language_model.``)
    rotary_percent: float = 1.0  # HF partial_rotary_factor: the first head_dim x this dims are rotated
    attention_output_gate: bool = False  # q_proj also yields a per-head sigmoid gate on the attention output
    zero_centered_norms: bool = False  # RMSNorms scale by (1 + w) (megatron-core: layernorm_zero_centered_gamma)
    gated_delta_net: Optional[GatedDeltaNetArch] = None

    @property
    def multimodal_checkpoint(self) -> bool:
        """The HF checkpoint is a VLM's (Qwen3.5): the text decoder is this model, the vision tower is carried."""
        return self.hf_prefix == VLM_TEXT_PREFIX

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def is_linear_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` is a Gated DeltaNet layer (else full attention)."""
        return self.gated_delta_net is not None and layer in self.gated_delta_net.linear_layers

    @property
    def linear_attention_freq(self) -> Optional[list[int]]:
        """megatron-core's ``linear_attention_freq`` as a per-layer 0/1 list (1 = Gated DeltaNet); None: no GDN."""
        if self.gated_delta_net is None:
            return None
        return [int(self.is_linear_layer(i)) for i in range(self.num_layers)]

    @property
    def moe_layer_freq(self) -> list[int]:
        """megatron-core's ``moe_layer_freq`` as a per-layer 0/1 list (1 = MoE layer)."""
        return [int(i in self.moe_layers) for i in range(self.num_layers)]


def load_hf_config(source: Union[str, Path, dict]) -> dict:
    """Read ``config.json`` from a directory or file (a dict passes through)."""
    if isinstance(source, dict):
        return source
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"HF config not found: {path} (expected a model directory containing config.json)")
    with open(path) as f:
        return json.load(f)


def _rope_params(cfg: dict) -> dict:
    # transformers >= 5 writes "rope_parameters"; older configs have rope_theta + rope_scaling at the top level.
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    if "rope_theta" not in params:
        params["rope_theta"] = cfg.get("rope_theta", 10000.0)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    params.setdefault("rope_type", "default")
    return params


def _family_of(cfg: dict) -> tuple[FamilySpec, dict, str]:
    """(family, the text model's config, the decoder's HF prefix) of an HF config: a Qwen3.5 VLM config carries its
    text model under ``text_config`` and its decoder under ``model.language_model.``."""
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    text_family = TEXT_MODEL_TYPES.get(model_type)
    text_family = text_family or next((TEXT_ARCHITECTURES[a] for a in archs if a in TEXT_ARCHITECTURES), None)
    if text_family is not None:
        return FAMILIES[text_family], cfg, "model."
    family = FAMILIES.get(model_type)
    if family is None:
        by_arch = [f for f in FAMILIES.values() if f.hf_architecture in archs]
        family = by_arch[0] if by_arch else None
    if family is None:
        supported = ", ".join(f"{f.name} ({f.hf_architecture})" for f in FAMILIES.values())
        raise UnsupportedModelError(
            f"unsupported architecture model_type={model_type!r} architectures={archs}; supported: {supported}"
        )
    if family.hf_architecture.endswith("ForConditionalGeneration"):
        text = dict(cfg.get("text_config") or {})
        if not text:
            raise UnsupportedModelError(f"{family.name}: the VLM config has no text_config")
        # transformers ties a VLM's lm_head to its text embedding by the top-level flag.
        text["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        return family, text, VLM_TEXT_PREFIX
    return family, cfg, "model."


def model_arch_from_hf(source: Union[str, Path, dict]) -> ModelArch:
    """Parse an HF config into ``ModelArch``; unsupported architectures/features raise with what is supported."""
    family, cfg, prefix = _family_of(load_hf_config(source))
    rope = _rope_params(cfg)
    llama3 = None
    if rope["rope_type"] == "llama3":
        llama3 = {
            "factor": float(rope.get("factor", 8.0)),
            "low_freq_factor": float(rope.get("low_freq_factor", 1.0)),
            "high_freq_factor": float(rope.get("high_freq_factor", 4.0)),
            "original_max_position_embeddings": int(rope.get("original_max_position_embeddings", 8192)),
        }
    elif rope["rope_type"] != "default":
        raise UnsupportedModelError(
            f"rope type {rope['rope_type']!r} is not supported (supported: default, llama3) in {family.name} config"
        )
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError(f"{family.name}: mlp_bias=true is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{family.name}: hidden_act={cfg.get('hidden_act')!r} is not supported (silu)")
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelError(f"{family.name}: use_sliding_window=true is not supported")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    qkv_bias = family.qkv_bias or bool(cfg.get("attention_bias", False))
    moe = _moe_fields(cfg, family) if family.moe and _num_experts(cfg) > 0 else {}
    hybrid = _linear_attention_fields(cfg, family, rope, prefix) if family.linear_attention else {}
    return ModelArch(
        family=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        # Qwen3.5-MoE has no dense MLP (every layer is MoE) and no intermediate_size.
        ffn_hidden_size=int(cfg.get("intermediate_size") or cfg.get("moe_intermediate_size") or 0),
        num_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_query_groups=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope["rope_theta"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_layernorm=family.qk_layernorm,
        llama3_rope_scaling=llama3,
        hf_config=cfg,
        **moe,
        **hybrid,
    )


def _num_experts(cfg: dict) -> int:
    # config.json says num_experts; transformers 5's to_dict() says num_local_experts.
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def _linear_attention_fields(cfg: dict, family: FamilySpec, rope: dict, prefix: str) -> dict:
    """``ModelArch`` fields of a Qwen3-Next / Qwen3.5 hybrid: which layers are Gated DeltaNet (HF ``layer_types``,
    else every ``full_attention_interval``-th layer is full attention, as the HF configs derive it), the GDN sizes,
    partial rotary, the attention output gate and the zero-centred norms (docs/qwen35.md)."""
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval") or 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    unknown = sorted({t for t in types} - {"linear_attention", "full_attention"})
    if len(types) != layers or unknown:
        raise UnsupportedModelError(
            f"{family.name}: layer_types must name each of the {layers} layers linear_attention or full_attention "
            f"(got {len(types)} entries{', unknown ' + str(unknown) if unknown else ''})"
        )
    if cfg.get("attention_bias"):
        raise UnsupportedModelError(f"{family.name}: attention_bias=true is not supported (no Qwen3.5 model has it)")
    nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    if nv % nk:
        raise UnsupportedModelError(
            f"{family.name}: linear_num_value_heads={nv} is not a multiple of linear_num_key_heads={nk} "
            "(megatron-core's GatedDeltaNet repeats each key head over a block of value heads)"
        )
    gdn = GatedDeltaNetArch(
        linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim") or 4),
        key_head_dim=int(cfg["linear_key_head_dim"]),
        value_head_dim=int(cfg["linear_value_head_dim"]),
        num_key_heads=nk,
        num_value_heads=nv,
        grouped_in_proj=family.name == "qwen3_next",
    )
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    return {
        "hf_prefix": prefix,
        "rotary_percent": float(partial),
        "attention_output_gate": True,
        "zero_centered_norms": True,
        "gated_delta_net": gdn,
    }


def _moe_fields(cfg: dict, family: FamilySpec) -> dict:
    """``ModelArch`` MoE fields from a Qwen3-MoE config. The MoE layers follow HF's rule (``Qwen3MoeDecoderLayer``;
    vLLM uses the same): layer i is MoE unless it is in ``mlp_only_layers``, and only if
    ``(i + 1) % decoder_sparse_step == 0``."""
    layers = int(cfg["num_hidden_layers"])
    experts = _num_experts(cfg)
    topk = int(cfg.get("num_experts_per_tok") or 0)
    if experts < 1 or not 1 <= topk <= experts:
        raise UnsupportedModelError(
            f"{family.name}: num_experts={experts}, num_experts_per_tok={topk}: need num_experts >= 1 and "
            "1 <= num_experts_per_tok <= num_experts"
        )
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) or None
    if shared is not None and family.name not in ("qwen2_moe", "qwen3_next", "qwen3_5_moe"):
        raise UnsupportedModelError(f"{family.name}: shared experts are not supported")
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    moe_layers = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return {
        "num_experts": experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": int(cfg["moe_intermediate_size"]),
        # Qwen3.5-MoE always renormalises the top-k (its config has no norm_topk_prob); Qwen3-Next defaults to it.
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", family.linear_attention)),
        "moe_layers": moe_layers,
        "router_aux_loss_coef": float(cfg.get("router_aux_loss_coef") or 0.0),
        "moe_shared_expert_ffn_hidden_size": shared,
    }


# ------------------------------------------------------------------------------------------- name map

# qkv_gated: Qwen3-Next's q_proj (per head q then its output gate) + k + v → megatron-core's gated linear_qkv;
# gdn_in / gdn_conv: a Gated DeltaNet's in_proj / conv1d, split over TP section by section (``sections``);
# norm_offset: the GDN output norm, plain (w) in HF and zero-centred (stored w - 1) in megatron-core.
ParamKind = Literal["copy", "qkv", "gate_up", "vocab", "qkv_gated", "gdn_in", "gdn_conv", "norm_offset"]


@dataclass(frozen=True)
class ParamMapping:
    """One Megatron parameter and the HF tensor(s) it is made from.

    ``mcore`` uses the global layer index (``decoder.layers.{i}.``); ``tp_dim`` is the dimension split across
    tensor-parallel ranks (None: replicated). ``kind`` names the layout transform.
    """

    mcore: str
    hf: tuple[str, ...]
    kind: ParamKind
    tp_dim: Optional[int]
    layer: Optional[int] = None
    # Routed-expert weights: the global expert id. ``mcore`` then names the expert as an EP=1 model does
    # (``...mlp.experts.local_experts.{expert}...``); EP rank r holds experts [r*E/EP, (r+1)*E/EP) under local
    # indices 0..E/EP-1 (``expert_local_index``), and ``tp_dim`` is split over the *expert* TP group (ETP).
    expert: Optional[int] = None
    # Section-wise TP split (gdn_in, gdn_conv): the full tensor is these row blocks along ``tp_dim``, each split over
    # TP on its own, and a rank holds its slice of every block, in order (megatron-core's GatedDeltaNet layout).
    sections: Optional[tuple[int, ...]] = None

    @property
    def is_expert(self) -> bool:
        return self.expert is not None


def layer_param_mappings(arch: ModelArch, layer: int) -> list[ParamMapping]:
    """Megatron (local/MindSpeed-style module names) ⇄ HF names for one decoder layer."""
    m = f"decoder.layers.{layer}."
    h = f"{arch.hf_prefix}layers.{layer}."
    out = [ParamMapping(m + "input_layernorm.weight", (h + "input_layernorm.weight",), "copy", None, layer)]
    if arch.is_linear_layer(layer):
        out += gated_delta_net_param_mappings(arch, layer)
    else:
        out += attention_param_mappings(arch, layer)
    out.append(
        ParamMapping(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "copy", None, layer)
    )
    if arch.is_moe_layer(layer):
        return out + moe_mlp_param_mappings(arch, layer)
    out += [
        ParamMapping(
            m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "gate_up", 0, layer
        ),
        ParamMapping(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "copy", 1, layer),
    ]
    return out


def attention_param_mappings(arch: ModelArch, layer: int) -> list[ParamMapping]:
    """A full-attention layer's q/k/v (+ Qwen3-Next's output gate inside q_proj), QK norms and output projection."""
    m = f"decoder.layers.{layer}.self_attention."
    h = f"{arch.hf_prefix}layers.{layer}.self_attn."
    qkv_kind = "qkv_gated" if arch.attention_output_gate else "qkv"
    out = [ParamMapping(m + "linear_qkv.weight", tuple(h + f"{p}_proj.weight" for p in "qkv"), qkv_kind, 0, layer)]
    if arch.qkv_bias:
        out.append(ParamMapping(m + "linear_qkv.bias", tuple(h + f"{p}_proj.bias" for p in "qkv"), qkv_kind, 0, layer))
    if arch.qk_layernorm:
        out.append(ParamMapping(m + "q_layernorm.weight", (h + "q_norm.weight",), "copy", None, layer))
        out.append(ParamMapping(m + "k_layernorm.weight", (h + "k_norm.weight",), "copy", None, layer))
    out.append(ParamMapping(m + "linear_proj.weight", (h + "o_proj.weight",), "copy", 1, layer))
    return out


def gated_delta_net_param_mappings(arch: ModelArch, layer: int) -> list[ParamMapping]:
    """A Gated DeltaNet layer (megatron-core's ``GatedDeltaNet`` as ``self_attention``) ⇄ HF ``linear_attn``.

    ``in_proj`` = [q, k, v, z, beta, alpha] rows (from Qwen3.5's in_proj_qkv/z/b/a, or Qwen3-Next's per-key-head
    grouped in_proj_qkvz/ba); ``conv1d`` over [q, k, v] channels; A_log and dt_bias per value head (TP-split);
    ``out_norm`` zero-centred in megatron-core (stored w - 1, as Megatron-Bridge stores it)."""
    gdn = arch.gated_delta_net
    assert gdn is not None
    m = f"decoder.layers.{layer}.self_attention."
    h = f"{arch.hf_prefix}layers.{layer}.linear_attn."
    parts = (
        ("in_proj_qkvz", "in_proj_ba")
        if gdn.grouped_in_proj
        else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    )
    return [
        ParamMapping(
            m + "in_proj.weight",
            tuple(f"{h}{p}.weight" for p in parts),
            "gdn_in",
            0,
            layer,
            sections=gdn.in_proj_sections,
        ),
        ParamMapping(m + "conv1d.weight", (h + "conv1d.weight",), "gdn_conv", 0, layer, sections=gdn.conv_sections),
        ParamMapping(m + "A_log", (h + "A_log",), "copy", 0, layer),
        ParamMapping(m + "dt_bias", (h + "dt_bias",), "copy", 0, layer),
        ParamMapping(m + "out_norm.weight", (h + "norm.weight",), "norm_offset", None, layer),
        ParamMapping(m + "out_proj.weight", (h + "out_proj.weight",), "copy", 1, layer),
    ]


EXPERT_PREFIX = "mlp.experts.local_experts."


def moe_mlp_param_mappings(arch: ModelArch, layer: int) -> list[ParamMapping]:
    """Router (+ Qwen2-MoE's shared expert and its gate) + every routed expert of one MoE layer (megatron-core's
    SequentialMLP, local or TE spec).

    The router ``[E, H]`` is replicated over TP; expert e's ``linear_fc1`` is ``cat(gate_e, up_e)`` (split over ETP
    like the dense ``linear_fc1``) and ``linear_fc2`` is ``down_e`` (split along dim 1)."""
    m = f"decoder.layers.{layer}."
    h = f"{arch.hf_prefix}layers.{layer}.mlp."
    out = [ParamMapping(m + "mlp.router.weight", (h + "gate.weight",), "copy", None, layer)]
    if arch.moe_shared_expert_ffn_hidden_size:
        s = m + "mlp.shared_experts."
        out += [
            ParamMapping(
                s + "linear_fc1.weight",
                (h + "shared_expert.gate_proj.weight", h + "shared_expert.up_proj.weight"),
                "gate_up",
                0,
                layer,
            ),
            ParamMapping(s + "linear_fc2.weight", (h + "shared_expert.down_proj.weight",), "copy", 1, layer),
            ParamMapping(s + "gate_weight", (h + "shared_expert_gate.weight",), "copy", None, layer),
        ]
    for e in range(arch.num_experts):
        x = f"{m}{EXPERT_PREFIX}{e}."
        hx = f"{h}experts.{e}."
        out.append(
            ParamMapping(
                x + "linear_fc1.weight", (hx + "gate_proj.weight", hx + "up_proj.weight"), "gate_up", 0, layer, e
            )
        )
        out.append(ParamMapping(x + "linear_fc2.weight", (hx + "down_proj.weight",), "copy", 1, layer, e))
    return out


def experts_per_rank(arch: ModelArch, ep_size: int) -> int:
    if arch.num_experts % ep_size:
        raise ValueError(f"num_experts={arch.num_experts} is not divisible by expert_model_parallel_size={ep_size}")
    return arch.num_experts // ep_size


def expert_ep_rank(arch: ModelArch, expert: int, ep_size: int) -> int:
    """The EP rank that holds global expert ``expert`` (megatron-core: contiguous blocks of E/EP experts)."""
    return expert // experts_per_rank(arch, ep_size)


def expert_name_shift(name: str, delta: int) -> str:
    """``...mlp.experts.local_experts.{j}.rest`` → ``...local_experts.{j + delta}.rest`` (other names unchanged):
    local ⇄ global expert index, ``delta = ±ep_rank × E/EP``."""
    i = name.find(EXPERT_PREFIX)
    if i < 0 or delta == 0:
        return name
    start = i + len(EXPERT_PREFIX)
    idx, rest = name[start:].split(".", 1)
    return f"{name[:start]}{int(idx) + delta}.{rest}"


# Tied embeddings (``tie_word_embeddings``): the output layer *is* the input embedding. The map has no output layer
# for a tied model; what follows from that is decided here and nowhere else.
EMBEDDING_NAME = "embedding.word_embeddings.weight"
OUTPUT_LAYER_NAME = "output_layer.weight"
HF_OUTPUT_NAME = "lm_head.weight"


def tied_output_source(arch: ModelArch, mcore_name: str) -> Optional[str]:
    """The global Megatron name whose tensor ``mcore_name`` is a copy of, or None when it is no copy.

    With tied embeddings megatron-core keeps an ``output_layer.weight`` on a last pipeline stage that is not also the
    first: a copy of the embedding (kept equal by its gradient all-reduce). Loaders fill it from the embedding; the
    checkpoint writer, the exporter and the weight sync skip it (the embedding is sent once)."""
    return EMBEDDING_NAME if arch.tie_word_embeddings and mcore_name == OUTPUT_LAYER_NAME else None


def ignorable_hf_names(arch: ModelArch) -> frozenset[str]:
    """HF tensors a checkpoint of ``arch`` may carry that the map has no place for: a tied model may still store
    ``lm_head.weight`` (transformers ties it to the embedding on load, and so do we)."""
    return frozenset({HF_OUTPUT_NAME}) if arch.tie_word_embeddings else frozenset()


def is_ignorable_hf_name(arch: ModelArch, name: str) -> bool:
    """``ignorable_hf_names``, and for the Qwen3.5 / Qwen3-Next families what else their checkpoints hold: a VLM's
    vision tower (``model.visual.*``) and the multi-token-prediction head (``mtp.*``), which RL does not train."""
    if name in ignorable_hf_names(arch):
        return True
    return arch.family.linear_attention and name.startswith(VLM_IGNORED_PREFIXES)


def param_mappings(arch: ModelArch) -> list[ParamMapping]:
    """The whole model's map, in HF order (embedding, layers, final norm, output head unless tied)."""
    out = [ParamMapping(EMBEDDING_NAME, (arch.hf_prefix + "embed_tokens.weight",), "vocab", 0)]
    for layer in range(arch.num_layers):
        out += layer_param_mappings(arch, layer)
    out.append(ParamMapping("decoder.final_layernorm.weight", (arch.hf_prefix + "norm.weight",), "copy", None))
    if not arch.tie_word_embeddings:
        out.append(ParamMapping(OUTPUT_LAYER_NAME, (HF_OUTPUT_NAME,), "vocab", 0))
    return out


# TransformerEngine's spec fuses the pre-attention / pre-MLP norms into the following linear layer. Checkpoints use
# the TE names (megatron-core's local spec declares this same map as its ``sharded_state_dict_keys_map``); the
# converter, the loaders and the weight sync translate through this one table.
TE_NAME_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def to_te_name(name: str, arch: Optional[ModelArch] = None) -> str:
    """Local-spec parameter name → the TransformerEngine spec's name for the same tensor.

    In an MoE layer the pre-MLP norm stays a module of its own (no ``linear_fc1`` to fuse into), also in the TE spec:
    pass ``arch`` so that such names keep ``pre_mlp_layernorm.weight``. A Gated DeltaNet layer's input norm fuses
    into its ``in_proj`` (megatron-core's hybrid TE spec): ``self_attention.in_proj.layer_norm_weight``."""
    layer = _layer_of(name)
    if arch is not None and layer is not None and arch.is_linear_layer(layer) and name.endswith(_GDN_NORM[0]):
        return name[: -len(_GDN_NORM[0])] + _GDN_NORM[1]
    for local, te in TE_NAME_ALIASES.items():
        if name.endswith(local):
            if arch is not None and arch.is_moe and local.startswith("pre_mlp") and _moe_layer_of(name, arch):
                return name
            return name[: -len(local)] + te
    return name


# A Gated DeltaNet layer's input norm: (local spec, TE spec) names.
_GDN_NORM = ("input_layernorm.weight", "self_attention.in_proj.layer_norm_weight")


def _layer_of(name: str) -> Optional[int]:
    prefix = "decoder.layers."
    if not name.startswith(prefix):
        return None
    return int(name[len(prefix) :].split(".", 1)[0])


def _moe_layer_of(name: str, arch: ModelArch) -> bool:
    prefix = "decoder.layers."
    if not name.startswith(prefix):
        return False
    return arch.is_moe_layer(int(name[len(prefix) :].split(".", 1)[0]))


# TransformerEngine's grouped-GEMM experts (``TEGroupedMLP``, ``moe_grouped_gemm=True``) hold local expert j's weight as
# ``mlp.experts.linear_fc{1,2}.weight{j}``; SequentialMLP as ``mlp.experts.local_experts.{j}.linear_fc{1,2}.weight``.
# Their checkpoint keys are the same (megatron-core makes them interchangeable), so only in-memory names differ.
_GROUPED_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12])\.weight(\d+)$")


def from_te_name(name: str) -> str:
    """A parameter name of the TE spec (fused norms, grouped-GEMM experts) → the local spec's name."""
    grouped = _GROUPED_EXPERT.match(name)
    if grouped:
        head, linear, j = grouped.groups()
        return f"{head}local_experts.{j}.{linear}.weight"
    if name.endswith(_GDN_NORM[1]):
        return name[: -len(_GDN_NORM[1])] + _GDN_NORM[0]
    for local, te in TE_NAME_ALIASES.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


# ------------------------------------------------------------------------------------------- layout rules


def layout_problems(
    arch: ModelArch,
    tensor_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    packed_sequences: Optional[bool] = False,
) -> list[str]:
    """What megatron-core 0.16.1 cannot shard or feed for ``arch`` under these sizes, one message per piece (empty for
    a model without Gated DeltaNet layers). ``packed_sequences``: ``actor.use_remove_padding`` (None, the automatic
    choice, is not refused here). The run's rules (``config/plan.py``) report these with the others."""
    gdn = arch.gated_delta_net
    if gdn is None:
        return []
    what = f"{arch.family.name}'s Gated DeltaNet layers (megatron-core 0.16.1 GatedDeltaNet)"
    problems = []
    if context_parallel_size > 1:
        problems.append(
            f"parallel.context_parallel_size={context_parallel_size}: {what} have no context parallelism "
            "(GatedDeltaNetContextParallel is a TODO in megatron/core/ssm/gated_delta_net.py); set it to 1"
        )
    if packed_sequences:
        problems.append(
            f"actor.use_remove_padding=true: {what} take no packed (THD) sequences (the recurrent state is not reset "
            "per sequence); set actor.use_remove_padding=false"
        )
    for key, heads in (("linear_num_key_heads", gdn.num_key_heads), ("linear_num_value_heads", gdn.num_value_heads)):
        if heads % tensor_model_parallel_size:
            problems.append(
                f"parallel.tensor_model_parallel_size={tensor_model_parallel_size} does not divide {key}={heads}: "
                f"{what} are split over TP by heads; use a TP size that divides {heads}"
            )
    return problems
