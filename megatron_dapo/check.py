"""``megatron-dapo check CONFIG [overrides]``: everything a launch would trip over, found in one plain process.

Run it before ``torchrun``. It needs no process group, builds no model and reads no tensor:

* the config (``megatron_dapo/config.py``: ``from_dict`` + ``validate_config``: required keys, ranges, cross-field);
* model-dependent checks from the HF ``config.json`` (``model.hf_config_dir``, else ``<checkpoint.load_dir>/hf_config``
  as ``DAPOTrainer.__init__`` in ``megatron_dapo/training/trainer.py`` does): the family is supported, and the
  trainer's own checks from ``megatron_dapo/config_checks.py`` (``validate_run``'s parts): the actor layout against
  the world size and the model (heads / KV heads / FFN ÷ TP, layers ÷ PP × VPP), the rollout layout (plus the
  divisibility vLLM needs), the sequence budget against ``max_position_embeddings`` and
  ``rollout.max_num_batched_tokens``, mini-batches against the data-parallel size;
* every data file (``read_records`` + ``validate_row`` on every row; the chat template and tokenizer on the first
  ``sample_rows`` rows, reporting prompts over ``data.max_prompt_length`` under ``truncation=error``);
* the reward functions: imported, and called once per data source found, on that source's first row, with its
  ground truth as the response;
* the checkpoint at ``checkpoint.load_dir``: a Megatron checkpoint or HF directory whose architecture matches the
  HF config (``find_checkpoint``: what it is, its HF config, the manifest's sizes and the tensor index; no tensor data);
* a plan: sizes, batch arithmetic and a per-rank memory plan by phase: ``startup`` (the vLLM engine built with the
  actor resident), the phases of a training step (``sync``, ``gen``, ``old_log_prob``, ``ref``, ``update``) and
  ``save`` (a checkpoint save): device and pinned-host bytes of every term under the memory hand-off the trainer
  applies (``training/offload.py``: what is offloaded, the vLLM sleep level, both resolved against the platform's
  defaults), activations under ``actor.recompute`` and the pipeline schedule, vLLM's start-up rule, the peak phase and
  whether it fits ``--device-memory-gb`` (formulas in ``docs/check.md`` and in the output itself).

All problems are collected and reported together; the exit status is 1 when there is any, 0 (and ``OK``) otherwise.
Memory estimates over ``--device-memory-gb`` are warnings (marked ``OVER`` in the plan), not problems: they are
rough and do not fail the check. The exception is vLLM's start-up rule (free device memory when the engine is built
>= ``rollout.gpu_memory_utilization`` x the device memory): vLLM raises when it does not hold, so it is a problem.
``--json PATH`` (``-``: stdout, the text then goes to stderr) also writes the report as JSON (``CheckReport.to_json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from megatron_dapo.config import (
    ConfigError,
    ExperimentConfig,
    apply_override,
    from_dict,
    validate_config,
)

GIB = 2**30
MIB = 2**20
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MAX_ROWS_LISTED = 5  # bad rows listed per file and kind of problem; the rest are counted
DEFAULT_SAMPLE_ROWS = 1000


@dataclass
class CheckReport:
    """What ``run_check`` found: ``problems`` (each names the key/file/row and the fix), ``warnings`` and the plan."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    plan: str = ""
    # The plan's numbers by name (world_size, dp, rollout_dp, params, actor_params_per_rank, micro_batches, ...,
    # memory_<term>_bytes, memory_phase_<phase>_bytes / _host_bytes, memory_peak_bytes, memory_pinned_host_bytes);
    # empty where the plan could not be computed.
    numbers: dict[str, float] = field(default_factory=dict)
    # The memory plan by phase (startup, sync, gen, old_log_prob, ref, update, save: device and host bytes by term)
    # and the name of the phase with the highest device estimate among those that run; empty where not computed.
    phases: list[PhaseMemory] = field(default_factory=list)
    peak_phase: str = ""
    capacity_gib: Optional[float] = None  # --device-memory-gb
    world_size: int = 0
    config: Optional[str] = None
    overrides: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def render(self) -> str:
        parts = [self.plan.rstrip()] if self.plan else []
        if self.warnings:
            parts.append(f"warnings ({len(self.warnings)}):\n" + "\n".join(f"  - {w}" for w in self.warnings))
        if self.problems:
            parts.append(f"problems ({len(self.problems)}):\n" + "\n".join(f"  - {p}" for p in self.problems))
            parts.append(f"FAILED: {len(self.problems)} problem(s)")
        else:
            parts.append("OK")
        return "\n\n".join(parts) + "\n"

    @property
    def fits(self) -> Optional[bool]:
        """Every phase that runs fits ``--device-memory-gb`` (vLLM's start-up rule for ``startup``); None without
        a capacity or a memory plan."""
        if self.capacity_gib is None or not self.phases:
            return None
        return all(bool(ph.fits) for ph in self.phases if ph.runs)

    def to_json(self) -> dict[str, Any]:
        """The report as ``megatron-dapo check --json`` writes it (GiB = 2^30 bytes; ``numbers`` in their own units,
        bytes for ``memory_*``)."""
        return {
            "config": self.config,
            "overrides": list(self.overrides),
            "capacity_gib": self.capacity_gib,
            "world_size": self.world_size,
            "ok": self.ok,
            "phases": {ph.name: ph.to_json() for ph in self.phases},
            "peak_phase": self.peak_phase or None,
            "fits": self.fits,
            "problems": list(self.problems),
            "warnings": list(self.warnings),
            "numbers": dict(self.numbers),
        }


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


def param_counts(arch: Any) -> ParamCounts:
    """Count the parameters of ``arch`` (embedding, attention, MLP, norms; tied embeddings counted once; for an MoE
    model the router, the shared expert and the routed experts of its MoE layers)."""
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    qkv = h * (q + 2 * kv) + ((q + 2 * kv) if arch.qkv_bias else 0)
    attn_out = q * h
    mlp = 3 * h * f  # gate, up, down
    norms = 2 * h + (2 * d if arch.qk_layernorm else 0)
    vh = arch.vocab_size * h
    moe: dict[str, int] = {}
    if getattr(arch, "is_moe", False):
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
        embedding=vh,
        output_layer=0 if arch.tie_word_embeddings else vh,
        layer_split=qkv + attn_out + mlp,
        layer_replicated=norms,
        final_norm=h,
        num_layers=arch.num_layers,
        **moe,
    )


def stage_layers(num_layers: int, pp: int, vpp: Optional[int], stage: int) -> list[list[int]]:
    """The global layer indices of each model chunk pipeline rank ``stage`` holds (megatron-core: chunk v of rank
    p holds layers [(v x PP + p) x c, (v x PP + p + 1) x c), c = L / (PP x VPP))."""
    c = num_layers // (pp * (vpp or 1))
    return [list(range((v * pp + stage) * c, (v * pp + stage + 1) * c)) for v in range(vpp or 1)]


def actor_params_per_rank(
    arch: Any,
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
    arch: Any,
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
    n = (len(layers) - n_moe) * (counts.layer_split // tp + counts.layer_replicated)
    n += n_moe * (counts.moe_layer_split // tp + counts.moe_layer_replicated)
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
    )
    replicated = counts.dense_layers * counts.layer_replicated + counts.moe_layers * counts.moe_layer_replicated
    return split // rollout_tp + replicated + counts.final_norm


# --------------------------------------------------------------------------------------------- the memory model
# What one rank holds on its device in each phase of a training step, following the memory hand-off of
# ``megatron_dapo/training/offload.py`` (``MemoryHandoff``) and the trainer's step order. Formulas: docs/check.md.

PHASES = ("startup", "sync", "gen", "old_log_prob", "ref", "update", "save")
STEP_PHASES = PHASES[1:-1]  # one training step; startup is once per run, save every checkpoint.save_freq steps
LP_LAYER = "one layer's activations"  # the forward-only log-prob phases' activations term
LOGIT_CHUNK_ROWS_DEFAULT = 64  # response_log_probs(chunk_tokens=...) as the actor calls it


def logit_chunk_rows() -> int:
    """Logit rows ``response_log_probs`` scores at once (its ``chunk_tokens`` default; the actor passes none)."""
    import inspect

    try:
        from megatron_dapo.algo.logprobs import response_log_probs

        return int(inspect.signature(response_log_probs).parameters["chunk_tokens"].default)
    except (ImportError, KeyError, TypeError, ValueError):
        return LOGIT_CHUNK_ROWS_DEFAULT


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


def moe_activations(arch: Any, b: int, tp: int, sequence_parallel: bool, etp: Optional[int] = None) -> float:
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
    arch: Any,
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


@dataclass
class PhaseMemory:
    """One phase: the device bytes by term, the host (pinned) bytes by term, and whether the step runs it."""

    name: str
    device: dict[str, float]
    host: dict[str, float]
    runs: bool = True
    note: str = ""
    fits: Optional[bool] = None  # within --device-memory-gb (startup: vLLM's start-up rule); None without it

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
            f"vLLM start-up: free {_size(self.free)} {'>=' if self.fits else '<'} "
            f"rollout.gpu_memory_utilization {self.utilization:g} x {cap:g} GiB = {_size(self.asked)}"
            + ("" if self.fits else ": vLLM would refuse to start")
        )

    def problem(self, terms: dict[str, float], not_offloaded: Sequence[str]) -> str:
        """The problem when it does not fit: the rule, resident / free / asked GiB and what to change."""
        cap = self.capacity / GIB
        what = " + ".join(f"{k} {_size(v)}" for k, v in terms.items() if v)
        offload = f"offload more before the engine is built ({', '.join(not_offloaded)}), " if not_offloaded else ""
        at_most = max(0, math.floor(100 * self.free / self.capacity)) / 100  # the highest that would fit
        return (
            "vLLM start-up (free device memory when the engine is built must be >= rollout.gpu_memory_utilization "
            f"x capacity, vllm/v1/worker/utils.py request_memory): {_size(self.resident)} per rank resident "
            f"({what}) leaves {_size(self.free)} of --device-memory-gb {cap:g} free, less than the "
            f"{self.utilization:g} x {cap:g} GiB = {_size(self.asked)} vLLM asks for; vLLM would refuse to "
            f"start: lower rollout.gpu_memory_utilization to at most {at_most:.2f}, "
            f"{offload}or split the actor over more ranks (tensor / pipeline / expert parallelism)"
        )


def _size(x: float) -> str:
    """Bytes as GiB (2 decimals), or MiB below 1 GiB."""
    return f"{x / GIB:.2f} GiB" if abs(x) >= GIB else f"{x / MIB:.2f} MiB"


def edge_phase_terms(name: str, terms: dict[str, float], handoff: Any, sleeps: bool) -> tuple[dict, dict]:
    """(device, host) bytes by term of the two rows outside a training step, from the plan's terms (``actor
    weights``, ``grads``, ``optimizer``, ``reference`` (0 without a KL term), ``vLLM weights``, ``vLLM KV cache``),
    the resolved hand-off plan (``training/offload.HandoffPlan``) and whether vLLM sleeps:

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
    if name == "startup" or not sleeps:
        dev["vLLM weights"] = terms["vLLM weights"]
        dev["vLLM KV cache"] = terms["vLLM KV cache"]
    elif handoff.sleep_level == 1:
        host["vLLM weights"] = terms["vLLM weights"]
    return dev, host


# --------------------------------------------------------------------------------------------- the check


def _sizes_usable(cfg: ExperimentConfig) -> bool:
    """The sizes the layout, batch and memory arithmetic divide by are in range (else those checks are skipped;
    ``validate_config`` has reported the bad values)."""
    p, a, r, d = cfg.parallel, cfg.actor, cfg.rollout, cfg.data
    positive = [
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        r.tensor_model_parallel_size,
        r.n,
        d.max_prompt_length,
        d.max_response_length,
        d.train_batch_size,
        a.ppo_mini_batch_size,
        a.ppo_micro_batch_size_per_gpu,
        a.log_prob_micro_batch_size_per_gpu,
        a.ppo_max_token_len_per_gpu,
        a.ppo_epochs,
        r.kv_cache_memory_mb,
    ]
    optional = [p.virtual_pipeline_model_parallel_size, d.gen_batch_size]
    return (
        all(v >= 1 for v in positive)
        and all(v is None or v >= 1 for v in optional)
        and 0 < r.gpu_memory_utilization <= 1
        and d.train_batch_size % a.ppo_mini_batch_size == 0
    )


class _Checker:
    def __init__(
        self,
        config_path: Optional[str],
        overrides: Sequence[str],
        nnodes: int,
        nproc_per_node: Optional[int],
        device_memory_gb: Optional[float],
        sample_rows: int,
    ) -> None:
        self.config_path = config_path
        self.overrides = list(overrides)
        self.nnodes = nnodes
        self.nproc_per_node = nproc_per_node
        self.device_memory_gb = device_memory_gb
        self.sample_rows = sample_rows
        self.problems: list[str] = []
        self.warnings: list[str] = []
        self.plan: list[str] = []
        self.cfg: Optional[ExperimentConfig] = None
        self.arch: Any = None
        self.hf_dir: Optional[str] = None
        self.hf_key = "model.hf_config_dir"
        self.range_ok = False
        self.layout_ok = False
        self.rollout_ok = False
        self.dp = 0
        self.rollout_dp = 0
        self.world_size = 0
        self.tokenizer: Any = None
        self.tokenizer_tried = False
        self.data_sources: dict[str, tuple[str, dict]] = {}  # data_source -> (where, row), first row seen
        self.train_rows = 0
        self.numbers: dict[str, float] = {}
        self.phases: list[PhaseMemory] = []
        self.peak_phase = ""

    # ----------------------------------------------------------------------------------------- config

    def load(self) -> bool:
        raw: dict = {}
        if self.config_path is not None:
            path = Path(self.config_path)
            if not path.is_file():
                self.problems.append(f"config file {path} does not exist; pass the path of an experiment YAML")
                return False
            try:
                loaded = yaml.safe_load(path.read_text())
            except yaml.YAMLError as exc:
                self.problems.append(f"config file {path}: not valid YAML: {exc}")
                return False
            if loaded is not None and not isinstance(loaded, dict):
                self.problems.append(
                    f"config file {path}: expected a mapping at the top level, got {type(loaded).__name__}"
                )
                return False
            raw = loaded or {}
        for item in self.overrides:
            try:
                apply_override(raw, item)
            except ConfigError as exc:
                self.problems.extend(exc.problems)
        if self.problems:
            return False
        try:
            self.cfg = from_dict(ExperimentConfig, raw)
        except ConfigError as exc:  # unknown key or wrong type: nothing else can be checked reliably
            self.problems.extend(exc.problems)
            return False
        try:
            validate_config(self.cfg)
            self.range_ok = True
        except ConfigError as exc:
            self.problems.extend(exc.problems)
            self.range_ok = _sizes_usable(self.cfg)
        if self.nproc_per_node is None:
            self.nproc_per_node = 8 if self.cfg.parallel.platform in ("cuda", "npu") else 2
        if self.nnodes < 1 or self.nproc_per_node < 1:
            self.problems.append(f"--nnodes={self.nnodes} and --nproc-per-node={self.nproc_per_node} must both be >= 1")
            self.range_ok = False
        self.world_size = self.nnodes * self.nproc_per_node
        return True

    # ----------------------------------------------------------------------------------------- model

    def load_model(self) -> None:
        from megatron_dapo.models.families import UnsupportedModelError, model_arch_from_hf

        cfg = self.cfg
        if cfg.model.hf_config_dir:
            self.hf_dir = cfg.model.hf_config_dir
        elif cfg.checkpoint.load_dir:
            from megatron_dapo.weights.dist_format import hf_config_dir_of
            from megatron_dapo.weights.errors import CheckpointError

            self.hf_key = "checkpoint.load_dir (its HF config, since model.hf_config_dir is not set)"
            try:
                self.hf_dir = str(hf_config_dir_of(cfg.checkpoint.load_dir))
            except CheckpointError as exc:
                self.problems.append(f"checkpoint.load_dir={cfg.checkpoint.load_dir}: {exc}")
                return
        else:
            self.problems.append(
                "model.hf_config_dir is not set and checkpoint.load_dir is missing: no HF config.json to read the "
                "architecture from; set model.hf_config_dir to the HF model directory"
            )
            return
        try:
            self.arch = model_arch_from_hf(self.hf_dir)
        except FileNotFoundError as exc:
            self.problems.append(f"{self.hf_key}={self.hf_dir}: {exc}")
        except UnsupportedModelError as exc:
            self.problems.append(
                f"{self.hf_key}={self.hf_dir}: {exc}; use a model of a supported family "
                "(megatron_dapo/models/families.py)"
            )
        except (KeyError, ValueError, TypeError) as exc:  # a config.json missing a field or not JSON
            self.problems.append(
                f"{self.hf_key}={self.hf_dir}: config.json cannot be read as an HF model config: "
                f"{type(exc).__name__}: {exc}"
            )

    def check_layout(self) -> None:
        """Actor and rollout layouts against the world size and the model, and mini-batches against data
        parallelism: the trainer's own checks (``megatron_dapo/config_checks.py``); every problem, not the first."""
        from megatron_dapo.config.run_rules import parallel_layout_problems, rollout_layout_problems

        cfg, arch, world = self.cfg, self.arch, self.world_size
        p, rtp = cfg.parallel, cfg.rollout.tensor_model_parallel_size
        where = f" = {self.nnodes} node(s) x {self.nproc_per_node} process(es) per node"
        found = parallel_layout_problems(
            p,
            world,
            arch.num_layers,
            arch.num_attention_heads,
            arch.num_query_groups,
            arch.ffn_hidden_size,
            world_desc=where,
            num_experts=arch.num_experts,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        )
        self.problems.extend(found)
        self.layout_ok = not found
        if self.layout_ok:
            self.dp = world // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
        rfound = rollout_layout_problems(cfg, world, arch.max_position_embeddings, arch, world_desc=where)
        self.problems.extend(rfound)
        self.rollout_ok = not rfound
        if self.rollout_ok:
            self.rollout_dp = world // rtp
        if self.layout_ok:
            self._check_batches()

    def _check_batches(self) -> None:
        from megatron_dapo.config.run_rules import batch_layout_problems

        cfg = self.cfg
        found = batch_layout_problems(cfg, self.dp)
        self.problems.extend(found)
        if not found and cfg.parallel.virtual_pipeline_model_parallel_size is not None and cfg.actor.use_dynamic_bsz:
            self.warnings.append(
                "parallel.virtual_pipeline_model_parallel_size with actor.use_dynamic_bsz=true: megatron-core's "
                "interleaved schedule needs the number of micro-batches to be a multiple of PP="
                f"{cfg.parallel.pipeline_model_parallel_size}, which dynamic batching does not guarantee"
            )

    # ----------------------------------------------------------------------------------------- checkpoint

    def check_checkpoint(self) -> None:
        cfg = self.cfg
        dirs = [("checkpoint.load_dir", cfg.checkpoint.load_dir)]
        if (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and cfg.checkpoint.ref_load_dir:
            dirs.append(("checkpoint.ref_load_dir", cfg.checkpoint.ref_load_dir))
        for key, directory in dirs:
            if not directory:
                continue  # validate_config reported it
            self._check_one_checkpoint(key, directory)
        mode = cfg.checkpoint.resume_mode
        if mode not in ("auto", "disable") and not Path(mode).is_dir():
            self.problems.append(
                f"checkpoint.resume_mode={mode!r}: no such step directory; use auto, disable or the path of a "
                "global_step_<n> directory"
            )

    def _check_one_checkpoint(self, key: str, directory: str) -> None:
        from megatron_dapo.weights.dist_format import find_checkpoint
        from megatron_dapo.weights.dist_reader import DistCheckpointReader
        from megatron_dapo.weights.errors import CheckpointError
        from megatron_dapo.weights.integrity import read_manifest, verify_files
        from megatron_dapo.weights.loading import arch_mismatches, checkpoint_arch

        tp, pp = self.cfg.parallel.tensor_model_parallel_size, self.cfg.parallel.pipeline_model_parallel_size
        fix = (
            "point it at an HF model directory or a Megatron checkpoint (make one with `megatron-dapo convert "
            f"hf-to-mcore --hf-dir <HF model> --save-dir {directory}`)"
        )
        if not Path(directory).is_dir():
            self.problems.append(f"{key}={directory}: no such directory; {fix}")
            return
        try:
            # What it is, its HF config, the manifest's file sizes and the tensor index; no tensor data is read.
            source = find_checkpoint(directory)
            stored = checkpoint_arch(source)
            if source.kind == "megatron":
                DistCheckpointReader(source.path)
                records = read_manifest(source.root)
                damaged = verify_files(source.root, records.values(), checksum=False) if records else None
                if damaged is not None:
                    raise CheckpointError(f"checkpoint {source.root} is damaged: {damaged}")
            diffs = arch_mismatches(stored, self.arch) if stored is not None and self.arch is not None else []
        except CheckpointError as exc:
            self.problems.append(f"{key}={directory}: {exc}")
            return
        except (OSError, ValueError, KeyError) as exc:
            self.problems.append(f"{key}={directory}: cannot read the checkpoint: {type(exc).__name__}: {exc}; {fix}")
            return
        if diffs:
            self.problems.append(
                f"{key}={directory}: the checkpoint's architecture differs from {self.hf_key}={self.hf_dir} "
                f"(checkpoint vs HF config): {'; '.join(diffs)}; convert the checkpoint again from that model, or "
                "point model.hf_config_dir at the model it was converted from"
            )
        self.plan.append(f"  {key}: {source.description}, loaded at TP {tp} PP {pp}")

    # ----------------------------------------------------------------------------------------- data

    def _load_tokenizer(self) -> Any:
        if self.tokenizer_tried:
            return self.tokenizer
        self.tokenizer_tried = True
        cfg = self.cfg
        source = cfg.model.tokenizer_dir or self.hf_dir
        key = "model.tokenizer_dir" if cfg.model.tokenizer_dir else self.hf_key
        if not source:
            return None
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers raises many types for a missing/broken tokenizer
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self.problems.append(
                f"{key}={source}: no tokenizer can be loaded ({type(exc).__name__}: {first}); point "
                "model.tokenizer_dir at a directory with the tokenizer files"
            )
        return self.tokenizer

    def check_data(self) -> None:
        cfg = self.cfg
        for key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
            total = 0
            for i, file in enumerate(files):
                total += self._check_file(f"{key}[{i}]", file)
            if key == "data.train_files":
                self.train_rows = total
        gen = cfg.data.gen_batch_size or cfg.data.train_batch_size
        if self.train_rows and gen > self.train_rows:
            self.problems.append(
                f"data.gen_batch_size (or data.train_batch_size)={gen} is larger than the {self.train_rows} rows of "
                "data.train_files: no generation batch can be formed; lower it or add data"
            )

    def _check_file(self, key: str, file: str) -> int:
        from megatron_dapo.data.prompts import prompt_text, truncate_prompt
        from megatron_dapo.data.rows import DataError, read_records, validate_row

        d = self.cfg.data
        try:
            records = read_records(file)
        except DataError as exc:
            self.problems.append(f"{key}: {exc}; fix the path in {key.split('[')[0]}")
            return 0
        if not records:
            self.problems.append(f"{key}: {file} has no rows")
            return 0
        bad: list[str] = []
        valid: list[tuple[int, dict]] = []
        for r, row in enumerate(records):
            try:
                validate_row(row, f"{file}: row {r}", d.prompt_key)
                valid.append((r, row))
            except DataError as exc:
                bad.append(str(exc))
        self._list_rows(bad, file, "rows not in verl format (see megatron_dapo/data/rows.py)")
        for r, row in valid:
            self.data_sources.setdefault(row["data_source"], (f"{file}: row {r}", row))
        sample = valid[: self.sample_rows] if self.sample_rows > 0 else valid
        tokenizer = self._load_tokenizer() if sample else None
        if tokenizer is None:
            self.plan.append(f"  {key}: {file}: {len(records)} rows, {len(bad)} invalid (prompts not tokenized)")
            return len(valid)
        overlong: list[str] = []
        templ: list[str] = []
        lengths: list[int] = []
        for r, row in sample:
            where = f"{file}: row {r}"
            try:
                text = prompt_text(row[d.prompt_key], tokenizer, d.apply_chat_template, where)
            except DataError as exc:
                templ.append(str(exc))
                continue
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            lengths.append(len(ids))
            if not ids:
                templ.append(f"{where}: the prompt tokenizes to no tokens; drop the row")
            elif len(ids) > d.max_prompt_length and not d.filter_overlong_prompts:
                try:
                    truncate_prompt(ids, d.max_prompt_length, d.truncation, where)
                except DataError as exc:
                    overlong.append(str(exc))
        self._list_rows(templ, file, "prompts the chat template/tokenizer rejects")
        self._list_rows(overlong, file, f"prompts longer than data.max_prompt_length={d.max_prompt_length}")
        n_over = sum(n > d.max_prompt_length for n in lengths)
        if d.filter_overlong_prompts and lengths and n_over == len(lengths):
            self.problems.append(
                f"{key}: all {len(lengths)} sampled prompts of {file} are longer than data.max_prompt_length="
                f"{d.max_prompt_length} and would be filtered out (data.filter_overlong_prompts=true); raise it"
            )
        longest = max(lengths) if lengths else 0
        fate = "" if not n_over else (" (filtered out)" if d.filter_overlong_prompts else f" ({d.truncation})")
        self.plan.append(
            f"  {key}: {file}: {len(records)} rows, {len(bad)} invalid; first {len(sample)} tokenized: longest "
            f"prompt {longest} tokens, {n_over} over data.max_prompt_length={d.max_prompt_length}{fate}"
        )
        return len(valid)

    def _list_rows(self, messages: list[str], file: str, what: str) -> None:
        self.problems.extend(messages[:MAX_ROWS_LISTED])
        if len(messages) > MAX_ROWS_LISTED:
            self.problems.append(
                f"{file}: {len(messages) - MAX_ROWS_LISTED} more {what} (first {MAX_ROWS_LISTED} above)"
            )

    # ----------------------------------------------------------------------------------------- rewards

    def check_rewards(self) -> None:
        from megatron_dapo.reward import custom
        from megatron_dapo.reward.manager import MATH_DAPO_SOURCES, route_data_source

        rw = self.cfg.reward
        specs: list[tuple[str, str, str]] = []  # (config key, path, name)
        if rw.custom_function.path:
            specs.append(("reward.custom_function", rw.custom_function.path, rw.custom_function.name))
        for i, item in enumerate(rw.extra_functions):
            key = f"reward.extra_functions[{i}]"
            if not isinstance(item, dict) or set(item) - {"path", "name", "weight"} or not item.get("path"):
                self.problems.append(f"{key}={item!r}: expected a mapping with keys path (required), name, weight")
                continue
            specs.append((key, str(item["path"]), str(item.get("name", "compute_score"))))
        functions: list[tuple[str, Any]] = []
        for key, path, name in specs:
            try:
                functions.append((key, custom.load_reward_function(path, name)))
            except (FileNotFoundError, ImportError, AttributeError, TypeError) as exc:
                self.problems.append(f"{key} (path={path}, name={name}): {exc}")
        loaded_all = len(functions) == len(specs)
        for source, (where, row) in sorted(self.data_sources.items()):
            truth = row["reward_model"]["ground_truth"]
            response = str(truth[0] if isinstance(truth, (list, tuple)) and truth else truth)
            extra = row.get("extra_info")
            if route_data_source(source) == "math_dapo":
                from megatron_dapo.reward import math_dapo

                calls = [("the built-in scorer", custom.MATH_DAPO_LABEL, _bind_math(math_dapo, response, truth))]
            elif not specs:
                self.problems.append(
                    f"{where}: no reward function for data_source {source!r}: the built-in scorer handles "
                    f"{', '.join(MATH_DAPO_SOURCES)} and aime*; set reward.custom_function.path (and .name) to a "
                    "Python file defining compute_score(data_source, solution_str, ground_truth, extra_info)"
                )
                continue
            else:
                if not loaded_all:
                    continue  # its import problem is listed already
                calls = [
                    (key, custom.function_label(fn), self._bind(fn, source, response, truth, extra))
                    for key, fn in functions
                ]
            for key, label, call in calls:
                self._call_reward(key, label, call, source, where, response)

    @staticmethod
    def _bind(fn: Any, source: str, response: str, truth: Any, extra: Any) -> Any:
        return lambda: fn(data_source=source, solution_str=response, ground_truth=truth, extra_info=extra)

    def _call_reward(self, key: str, label: str, call: Any, source: str, where: str, response: str) -> None:
        from megatron_dapo.reward import custom

        timeout = self.cfg.reward.timeout_s
        context = (
            f"reward function {label} ({key}) on data_source {source!r} ({where}, response "
            f"{custom.short_repr(response)} = the row's ground truth)"
        )
        try:
            result = custom.call_with_timeout(call, timeout)
            custom.finite_score(result, label)
        except custom.ScorerTimeout:
            self.problems.append(f"{context}: ran past reward.timeout_s={timeout:g} s; speed it up or raise the limit")
        except custom.InvalidRewardError as exc:
            self.problems.append(f"{context}: {exc}")
        except Exception as exc:  # noqa: BLE001 - the user's function may raise anything
            self.problems.append(
                f"{context}: raised {type(exc).__name__}: {exc}; fix the function (the trainer would score every "
                f"such response reward.error_score={self.cfg.reward.error_score:g})"
            )

    # ----------------------------------------------------------------------------------------- plan

    def make_plan(self) -> list[str]:
        cfg = self.cfg
        p, a, r, d = cfg.parallel, cfg.actor, cfg.rollout, cfg.data
        tp, pp, vpp = (
            p.tensor_model_parallel_size,
            p.pipeline_model_parallel_size,
            p.virtual_pipeline_model_parallel_size,
        )
        dp, rtp, rdp = self.dp, r.tensor_model_parallel_size, self.rollout_dp
        n, seq = r.n, d.max_prompt_length + d.max_response_length
        out = [
            f"  world size {self.world_size} = {self.nnodes} node(s) x {self.nproc_per_node} process(es) per node",
            f"  actor: TP {tp} x PP {pp} (VPP {vpp or '-'}) x DP {dp}; sequence parallel "
            f"{'on' if p.sequence_parallel else 'off'}; distributed optimizer "
            f"{'on' if p.use_distributed_optimizer else 'off'}",
            f"  rollout: TP {rtp} x DP {rdp} ({rdp} vLLM replica(s) of {rtp} rank(s))",
        ]
        gen = d.gen_batch_size or d.train_batch_size
        traj = d.train_batch_size * n
        mini_rows = a.ppo_mini_batch_size * n
        per_rank = mini_rows // dp
        minis = d.train_batch_size // a.ppo_mini_batch_size
        step_rows = traj // dp
        if a.use_dynamic_bsz:
            rows_per_mb = max(1, a.ppo_max_token_len_per_gpu // seq)
            micro = -(-per_rank // rows_per_mb)
            lp_micro = -(-step_rows // rows_per_mb)
            each = f"at most {{}} (dynamic: <= {a.ppo_max_token_len_per_gpu} tokens each; fewer for shorter sequences)"
            mbs, lp_mbs = each.format(micro), each.format(lp_micro)
        else:
            micro = -(-per_rank // a.ppo_micro_batch_size_per_gpu)
            lp_micro = -(-step_rows // a.log_prob_micro_batch_size_per_gpu)
            mbs = f"{micro} (of {a.ppo_micro_batch_size_per_gpu} sequences)"
            lp_mbs = f"{lp_micro} (of {a.log_prob_micro_batch_size_per_gpu} sequences)"
        self.numbers.update(
            world_size=self.world_size,
            tp=tp,
            pp=pp,
            dp=dp,
            rollout_tp=rtp,
            rollout_dp=rdp,
            trajectories_per_step=traj,
            max_tokens_per_step=traj * seq,
            mini_batches_per_step=minis,
            optimizer_steps_per_step=minis * a.ppo_epochs,
            sequences_per_mini_batch_per_rank=per_rank,
            micro_batches_per_mini_batch=micro,
            log_prob_micro_batches_per_step=lp_micro,
        )
        fg = cfg.algorithm.filter_groups
        gens = (
            f"1 to {fg.max_num_gen_batches or 'one pass over the data of'} generation batches (dynamic sampling)"
            if fg.enable
            else "1 generation batch"
        )
        out += [
            f"  per step: {gens} of {gen} prompts x {n} = {gen * n} sequences, {-(-gen * n // rdp)} per replica "
            f"(rollout.max_num_seqs={r.max_num_seqs})",
            f"  per step: {traj} trajectories ({d.train_batch_size} prompts x {n}), at most {traj * seq} tokens "
            f"({seq} per sequence = {d.max_prompt_length} prompt + {d.max_response_length} response)",
            f"  per step: {minis} mini-batch(es) of {mini_rows} sequences x {a.ppo_epochs} epoch(s) = "
            f"{minis * a.ppo_epochs} optimizer step(s)",
            f"  per mini-batch per rank: {per_rank} sequences in {mbs} micro-batches",
            f"  log-probs per step per rank (old policy{' and reference' if self._kl() else ''}): {step_rows} "
            f"sequences in {lp_mbs} micro-batches",
        ]
        return out

    def _kl(self) -> bool:
        return self.cfg.actor.use_kl_loss or self.cfg.algorithm.use_kl_in_reward

    def _handoff(self, on_device: bool) -> tuple[str, Any, bool]:
        """The platform whose defaults apply, the resolved hand-off plan (``resolve_handoff_plan``, as the trainer
        resolves it) and whether vLLM sleeps between rollouts (its sleep mode and ``rollout.free_cache_engine``)."""
        from megatron_dapo.config.plan import resolve_handoff_plan
        from megatron_dapo.platform import make_platform

        p = self.cfg.parallel
        name = p.platform if p.platform != "auto" else ("cuda" if on_device else "cpu")
        platform = make_platform(name)  # no setup(): only its defaults are read
        plan = resolve_handoff_plan(self.cfg, platform)
        return name, plan, bool(platform.supports_vllm_sleep() and self.cfg.rollout.free_cache_engine)

    def _on_policy_update(self) -> bool:
        """The trainer skips the old-policy forward (``DAPOTrainer.on_policy_update``)."""
        a, cfg = self.cfg.actor, self.cfg
        return (
            a.old_log_prob_forward == "auto"
            and a.ppo_epochs == 1
            and a.ppo_mini_batch_size == cfg.data.train_batch_size
            and not cfg.algorithm.use_kl_in_reward
        )

    def _startup_row(
        self, ph: PhaseMemory, handoff: Any, sleeps: bool, capacity: Optional[float]
    ) -> Optional[StartupFit]:
        """Note the ``startup`` row and, on a device with ``--device-memory-gb`` (``capacity``, bytes), apply vLLM's
        start-up rule to what is resident before the engine is built: a problem when it does not fit."""
        after = "then it sleeps" if sleeps else "it never sleeps"
        ph.note = f"vLLM built with the actor resident, {after}; the reference is built after it"
        if capacity is None:
            return None
        resident = {k: v for k, v in ph.device.items() if not k.startswith("vLLM")}
        fit = StartupFit(sum(resident.values()), capacity, self.cfg.rollout.gpu_memory_utilization)
        ph.fits = fit.fits
        ph.note = f"{fit.note()}; {ph.note}"
        self.numbers.update(
            memory_startup_resident_bytes=fit.resident,
            memory_startup_free_bytes=fit.free,
            memory_startup_asked_bytes=fit.asked,
        )
        if not fit.fits:
            kept = [f"actor.offload_{k}=true" for k in ("grads", "optimizer") if not getattr(handoff, k)]
            self.problems.append(fit.problem(resident, kept))
        return fit

    def _save_note(self, handoff: Any, sleeps: bool) -> str:
        if not sleeps:
            vllm = "vLLM never sleeps: its weights and KV cache stay"
        elif handoff.sleep_level == 1:
            vllm = "vLLM asleep first (level 1: its weights in pinned host memory)"
        else:
            vllm = "vLLM asleep first (level 2: nothing of it on the device)"
        return f"checkpoint save: {vllm}; params, grads and optimizer state on the device"

    def memory_plan(self) -> list[str]:
        from megatron_dapo.config.plan import rollout_dtype
        from megatron_dapo.weights.layout import padded_vocab_size

        cfg, arch = self.cfg, self.arch
        p, a, r, d = cfg.parallel, cfg.actor, cfg.rollout, cfg.data
        tp, pp, vpp = (
            p.tensor_model_parallel_size,
            p.pipeline_model_parallel_size,
            p.virtual_pipeline_model_parallel_size,
        )
        cp, sp = max(1, p.context_parallel_size), p.sequence_parallel
        counts = param_counts(arch)
        vp = padded_vocab_size(arch.vocab_size, cfg.model.make_vocab_size_divisible_by, tp)
        vshard = vp // tp
        # Expert layout (MoE): E / EP experts per rank, each expert's FFN ÷ ETP (default TP); expert parameters'
        # gradients and distributed-optimizer shards live on the expert data-parallel group, W / (ETP x EP x PP).
        ep = p.expert_model_parallel_size if counts.moe_layers else 1
        etp = (p.expert_tensor_parallel_size or tp) if counts.moe_layers else tp
        edp = self.world_size // (etp * ep * pp)
        stage_params = [actor_stage_params(arch, counts, tp, pp, vp, ep, etp, vpp, s) for s in range(pp)]
        p_dense, p_expert = max(stage_params, key=sum)
        p_rank = p_dense + p_expert  # = actor_params_per_rank(...)
        rtp = r.tensor_model_parallel_size
        p_vllm = rollout_params_per_rank(counts, rtp)
        b = DTYPE_BYTES[cfg.model.params_dtype]
        rdt = rollout_dtype(cfg)
        br = DTYPE_BYTES[rdt]
        dist_div = self.dp if p.use_distributed_optimizer else 1
        expert_div = edp if p.use_distributed_optimizer else 1
        kl = self._kl()
        h, L = arch.hidden_size, arch.num_layers
        seq = d.max_prompt_length + d.max_response_length

        weights = p_rank * b
        grads = p_rank * 4
        opt_per_param = 8 + (4 if b < 4 else 0)
        # The distributed optimizer shards non-expert state over DP and expert state over the expert DP group.
        optim = p_dense * opt_per_param / dist_div + p_expert * opt_per_param / expert_div
        ref = weights if kl else 0
        vllm_w = p_vllm * br
        mem = self.device_memory_gb * GIB if self.device_memory_gb else None
        on_device = p.platform in ("cuda", "npu") or (p.platform == "auto" and mem is not None)
        platform_name, handoff, sleeps = self._handoff(on_device)
        if on_device and mem is not None:
            budget = r.gpu_memory_utilization * mem
            kv = max(0.0, budget - vllm_w)
            kv_formula = (
                f"rollout.gpu_memory_utilization {r.gpu_memory_utilization:g} x {self.device_memory_gb:g} GiB - "
                "vLLM weights"
            )
            if budget <= vllm_w:
                self.problems.append(
                    f"rollout.gpu_memory_utilization={r.gpu_memory_utilization:g} of {self.device_memory_gb:g} GiB = "
                    f"{budget / GIB:.1f} GiB does not even hold the rollout weights ({vllm_w / GIB:.1f} GiB per rank "
                    f"at rollout TP {rtp}); raise it or rollout.tensor_model_parallel_size"
                )
        else:
            kv = r.kv_cache_memory_mb * MIB
            kv_formula = f"rollout.kv_cache_memory_mb={r.kv_cache_memory_mb}"
        # KV cache capacity: K and V per token per layer, KV heads split across rollout TP (replicated when fewer).
        kv_heads = max(1, arch.num_query_groups // rtp)
        kv_per_token = 2 * L * kv_heads * arch.head_dim * br
        kv_tokens = int(kv // kv_per_token) if kv_per_token else 0
        if kv_tokens < seq:
            self.problems.append(
                f"the rollout KV cache ({kv_formula} = {kv / MIB:.0f} MiB per rank) holds {kv_tokens} tokens at "
                f"{kv_per_token} bytes per token, fewer than one sequence of data.max_prompt_length + "
                f"data.max_response_length = {seq}; vLLM would refuse to start: give the KV cache more memory"
            )

        # Micro-batches: tokens of one training / log-prob micro-batch (the longest: every sequence full length).
        tokens = max(a.ppo_max_token_len_per_gpu, seq) if a.use_dynamic_bsz else a.ppo_micro_batch_size_per_gpu * seq
        lp_tokens = (
            max(a.ppo_max_token_len_per_gpu, seq) if a.use_dynamic_bsz else a.log_prob_micro_batch_size_per_gpu * seq
        )
        mini_rows = a.ppo_mini_batch_size * cfg.rollout.n // max(self.dp, 1)
        if a.use_dynamic_bsz:
            n_micro = -(-mini_rows // max(1, a.ppo_max_token_len_per_gpu // seq))
        else:
            n_micro = -(-mini_rows // a.ppo_micro_batch_size_per_gpu)
        # TransformerEngine / MindSpeed spec (fused attention: no s x s probabilities kept) unless local is asked for.
        flash = on_device and cfg.model.transformer_impl != "local"
        t_upd, t_lp = -(-tokens // cp), -(-lp_tokens // cp)  # tokens per rank: CP splits the sequence
        s_upd, s_lp = min(seq, tokens), min(seq, lp_tokens)
        full_layer = layer_activations(arch, b, tp, sp, flash, s_upd)
        kept_layer = layer_activations(arch, b, tp, sp, flash, s_upd, selective=a.recompute == "selective")
        chunk_layers = L // (pp * (vpp or 1))
        moe_arch = bool(counts.moe_layers)
        if moe_arch:
            # MoE layers keep their routed experts' tensors (moe_activations) instead of the dense MLP's; the
            # one-layer terms take the larger kind of layer, the kept activations sum each chunk's own layers.
            sel = a.recompute == "selective"
            dense_full, dense_kept = full_layer, kept_layer
            moe_full = layer_activations(arch, b, tp, sp, flash, s_upd, moe=True, etp=etp)
            moe_kept = layer_activations(arch, b, tp, sp, flash, s_upd, selective=sel, moe=True, etp=etp)
            kinds = [moe_full] + ([dense_full] if counts.dense_layers else [])
            full_layer = max(kinds, key=lambda x: x.total)
            kept_layer = moe_kept if full_layer is moe_full else dense_kept

            def chunk_bytes(stage: int) -> float:
                """Per-token bytes the largest model chunk of ``stage`` keeps (recompute none or selective)."""
                return max(
                    sum((moe_kept if arch.is_moe_layer(i) else dense_kept).total for i in chunk)
                    for chunk in stage_layers(L, pp, vpp, stage)
                )

        group = a.recompute_num_layers
        layer_input = h * b / (tp if sp else 1)  # per token: what full recompute keeps of a group of layers

        def stage_update(stage: int) -> dict[str, float]:
            chunks = held_chunks(pp, vpp, n_micro, stage)
            terms: dict[str, float] = {}
            if a.recompute == "full":
                terms["layer inputs"] = chunks * -(-chunk_layers // group) * t_upd * layer_input
                terms["recomputed group"] = min(group, chunk_layers) * t_upd * full_layer.total
            elif moe_arch:
                terms["activations"] = chunks * t_upd * chunk_bytes(stage)
            else:
                terms["activations"] = chunks * chunk_layers * t_upd * kept_layer.total
            if stage == pp - 1:
                terms["logits"] = t_upd * vshard * b
                terms["logit chunks"] = rows * vshard * (2 * b + 8)
            return terms

        rows = logit_chunk_rows()
        stages = {0: stage_update(0), pp - 1: stage_update(pp - 1)}
        upd_stage = max(stages, key=lambda s: sum(stages[s].values()))
        upd_terms = stages[upd_stage]
        act_upd = sum(v for k, v in upd_terms.items() if k in ("activations", "layer inputs", "recomputed group"))
        lp_layer = layer_activations(arch, b, tp, sp, flash, s_lp)
        if moe_arch:
            lp_moe = layer_activations(arch, b, tp, sp, flash, s_lp, moe=True, etp=etp)
            lp_layer = max([lp_moe] + ([lp_layer] if counts.dense_layers else []), key=lambda x: x.total)
        lp_terms = {
            LP_LAYER: t_lp * lp_layer.total,
            "logits": t_lp * vshard * b,
            "logit chunks": rows * vshard * (b + 8),
        }
        # Weight sync: one bucket of full (TP-gathered) tensors, at least the largest module (a module is never split:
        # the padded embedding or output layer, or fc1), plus vLLM's staging copy of it in the rollout dtype.
        q_dim, kv_dim = arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
        modules = [vp * h, (q_dim + 2 * kv_dim) * h]
        if counts.dense_layers:
            modules.append(2 * arch.ffn_hidden_size * h)
        if moe_arch:
            # vLLM loads all routed experts of a layer at once (FusedMoE): one module of E x 3 x f_e x h, gathered
            # over ETP and all-gathered over EP (rollout/sync.py); a shared expert's fc1 is 2 x s x h.
            modules += [counts.expert_layer, 2 * (arch.moe_shared_expert_ffn_hidden_size or 0) * h]
        largest_module = max(modules) * b
        bucket_full = max(r.weight_sync_bucket_mb * MIB, largest_module)
        bucket = bucket_full + bucket_full * br // b
        # Log-prob results (compute_log_probs): log-prob and entropy in fp32 for this rank's rows while the forward
        # runs, then the DP all-gather of every row's (plus this rank's copy), after the forward's tensors are freed.
        step_rows = d.train_batch_size * r.n
        own_results = 8 * (step_rows // max(self.dp, 1)) * d.max_response_length
        gathered_results = 8 * step_rows * d.max_response_length + own_results

        on_policy = self._on_policy_update()
        phases: list[PhaseMemory] = []
        edge_terms = {
            "actor weights": weights,
            "grads": grads,
            "optimizer": optim,
            "reference": ref,
            "vLLM weights": vllm_w,
            "vLLM KV cache": kv,
        }
        for name in PHASES:
            if name not in STEP_PHASES:  # startup and save: outside the step
                phases.append(PhaseMemory(name, *edge_phase_terms(name, edge_terms, handoff, sleeps)))
                continue
            dev: dict[str, float] = {}
            host: dict[str, float] = {}
            training = name in ("old_log_prob", "ref", "update")  # after_rollout: the engine sleeps
            if name == "gen" and handoff.params:
                host["actor weights"] = weights
            else:
                dev["actor weights"] = weights
            for key, value, offloaded in (("grads", grads, handoff.grads), ("optimizer", optim, handoff.optimizer)):
                if offloaded and name != "update":
                    if key != "grads" or handoff.keep_grad_values:
                        host[key] = value
                else:
                    dev[key] = value
            if kl:
                (host if handoff.reference and name != "ref" else dev)["reference"] = ref
            if not sleeps or not training:
                dev["vLLM weights"] = vllm_w
                if not sleeps or name == "gen":
                    dev["vLLM KV cache"] = kv
            elif handoff.sleep_level == 1:
                host["vLLM weights"] = vllm_w
            if name == "sync":
                dev["sync buckets"] = bucket
            elif name in ("old_log_prob", "ref"):
                dev["log-prob results"] = own_results
                if sum(lp_terms.values()) >= gathered_results:
                    dev.update(lp_terms)
                else:
                    dev["DP all-gather of results"] = gathered_results
            elif name == "update":
                dev.update(upd_terms)
            runs, note = True, ""
            if name == "old_log_prob" and on_policy:
                runs = False
                note = (
                    "not run: actor.old_log_prob_forward=auto with one epoch and one mini-batch per step uses the "
                    "update's own forward"
                )
            if name == "ref" and not kl:
                runs, note = False, "not run: no KL term, no reference"
            if name == "update" and pp > 1:
                note = f"pipeline stage {upd_stage} of {pp}: " + (
                    "the first holds the most micro-batches in flight" if upd_stage == 0 else "the last has the logits"
                )
            phases.append(PhaseMemory(name, dev, host, runs, note))
        startup = self._startup_row(phases[0], handoff, sleeps, mem if on_device else None)
        phases[-1].note = self._save_note(handoff, sleeps)
        running = [ph for ph in phases if ph.runs]
        peak = max(running, key=lambda ph: (ph.device_total, ph.name in STEP_PHASES))  # ties: the step's phase
        pinned_kept = sum(
            v
            for v, on in (
                (weights, handoff.params),
                (grads, handoff.grads and handoff.keep_grad_values),
                (optim, handoff.optimizer),
                (ref, handoff.reference and kl),
            )
            if on
        )
        vllm_backup = vllm_w if sleeps and handoff.sleep_level == 1 else 0.0

        def gib(x: float) -> str:
            return f"{x / GIB:9.2f} GiB" if x >= GIB else f"{x / MIB:9.2f} MiB"

        yes_no = {True: "yes", False: "no"}
        grads_text = yes_no[handoff.grads] + (
            " (values discarded, re-zeroed on onload)" if handoff.grads and not handoff.keep_grad_values else ""
        )
        if sleeps:
            sleep_text = (
                f"vLLM sleeps at level {handoff.sleep_level} after generation ("
                + (
                    "weights to pinned host memory, KV cache freed"
                    if handoff.sleep_level == 1
                    else "weights and KV cache freed"
                )
                + ")"
            )
        else:
            why = (
                "rollout.free_cache_engine=false"
                if not r.free_cache_engine
                else f"no vLLM sleep mode on {platform_name}"
            )
            sleep_text = f"vLLM never sleeps ({why}): its weights and KV cache stay on the device"
        total = counts.total
        head_note = (
            "QKV output, rotated Q and K, "
            + ("QK-norm input, " if arch.qk_layernorm else "")
            + f"attention output, fc1 and SwiGLU outputs {full_layer.split:,.0f} B/tok"
            + f" + norms {full_layer.replicated:,.0f} B/tok"
        )
        if moe_arch and full_layer.moe:
            k, fe = arch.moe_router_topk, arch.moe_ffn_hidden_size
            shared_text = "shared expert's fc1 and SwiGLU outputs" if arch.moe_shared_expert_ffn_hidden_size else ""
            head_note = head_note.replace(", fc1 and SwiGLU outputs", f", {shared_text}" if shared_text else "") + (
                f" + routed experts {full_layer.moe:,.0f} B/tok (alltoall dispatch, balanced routing: router scores "
                f"E {arch.num_experts} x 4 B + top-{k} x (ETP {etp} x h {h} + 4 x f_e {fe}) x {b} B dispatched"
                f"{f', / TP {tp} (SP)' if sp and tp > 1 else ''})"
            )
        if flash:
            core_text = f"softmax stats {full_layer.core:,.0f} B/tok (flash attention)"
        else:
            core_text = f"attention probabilities {full_layer.core:,.0f} B/tok (a x s x B / TP, local spec)"
        if a.recompute == "full":
            act_text = (
                f"[recompute full, groups of {group}] layer inputs {t_upd} tok x {layer_input:,.0f} B x "
                f"{-(-chunk_layers // group)} group(s)/chunk x {held_chunks(pp, vpp, n_micro, upd_stage)} chunk(s) in "
                f"flight + one group recomputed: {min(group, chunk_layers)} layer(s) x {t_upd} tok x "
                f"{full_layer.total:,.0f} B ({head_note} + {core_text})"
            )
        else:
            sel = a.recompute == "selective"
            act_text = (
                f"[recompute {a.recompute}] {t_upd} tok x {kept_layer.total:,.0f} B/tok/layer ({head_note}"
                + ("; core attention recomputed, not kept" if sel else f" + {core_text}")
                + f") x {chunk_layers} layers/chunk x {held_chunks(pp, vpp, n_micro, upd_stage)} chunk(s) in flight"
            )
        if moe_arch:
            layers_text = (
                f"{counts.moe_layers} MoE layers x {counts.moe_layer:,} (attention + shared expert "
                f"{counts.moe_layer_split:,}, norms + router {counts.moe_layer_replicated:,}, routed experts "
                f"{counts.expert_layer:,} = {arch.num_experts} x 3 x h x f_e {arch.moe_ffn_hidden_size})"
                + (f" + {counts.dense_layers} dense layers x {counts.layer:,}" if counts.dense_layers else "")
            )
        else:
            layers_text = f"{L} layers x {counts.layer:,}"
        out = [
            f"  parameters (from {self.hf_dir}/config.json): {total:,} = {_human(total)} (embedding "
            f"{counts.embedding:,}, output layer {counts.output_layer:,}{' (tied)' if arch.tie_word_embeddings else ''}"
            f", {layers_text}, final norm {counts.final_norm:,})",
        ]
        if moe_arch:
            out += [
                f"  MoE: routed experts {counts.experts:,} = {_human(counts.experts)}, the rest (embeddings, "
                f"attention, norms, router, shared expert) {counts.non_expert:,} = {_human(counts.non_expert)}; "
                f"active per token {counts.active:,} = {_human(counts.active)} (top-{arch.moe_router_topk} of "
                f"{arch.num_experts} experts per MoE layer)",
                f"  experts: EP {ep} x ETP {etp} ({arch.num_experts // ep} experts per rank, each expert's FFN / ETP)"
                f" x expert DP {edp} (= world / (ETP x EP x PP)); alltoall token dispatcher",
            ]
        out += [
            f"  actor parameters per rank (largest stage, vocabulary padded to {vp}): {p_rank:,}"
            + (
                f" (non-expert {p_dense:,} / TP {tp}, routed experts {p_expert:,} / (EP {ep} x ETP {etp}))"
                if moe_arch
                else ""
            )
            + f"; rollout per rank (rollout TP {rtp}): {p_vllm:,}",
            f"  memory per rank, estimate ({cfg.model.params_dtype} actor, {rdt} rollout; GiB = 2^30 bytes):",
            f"    hand-off ({platform_name} defaults + config; training/offload.py): offload actor params "
            f"{yes_no[handoff.params]}, grads {grads_text}, optimizer {yes_no[handoff.optimizer]}, reference "
            f"{yes_no[handoff.reference] if kl else '- (none)'}; {sleep_text}",
            "    terms (bytes while on the device):",
            f"    actor weights      {gib(weights)}  = params/rank x {b} B",
            f"    actor grads        {gib(grads)}  = params/rank x 4 B (fp32 main grads in the DDP buffers, "
            "grad_reduce_in_fp32)",
            f"    optimizer state    {gib(optim)}  = params/rank x {opt_per_param} B (Adam: 2 fp32 moments"
            + (" + fp32 master weights" if b < 4 else "")
            + (
                f") / DP {dist_div} (distributed optimizer)"
                if dist_div > 1 and not moe_arch
                else (
                    f"): non-expert / DP {dist_div}, routed experts / expert DP {expert_div} (distributed optimizer)"
                    if moe_arch and p.use_distributed_optimizer
                    else ")"
                )
            ),
            f"    reference weights  {gib(ref)}  = "
            + (f"params/rank x {b} B (KL term on)" if kl else "0 (no KL term)"),
            f"    vLLM weights       {gib(vllm_w)}  = full model / rollout TP {rtp} x {br} B"
            + (
                " (every replica holds all experts, each expert's FFN / rollout TP: vLLM without expert "
                "parallelism; router replicated)"
                if moe_arch
                else ""
            ),
            f"    vLLM KV cache      {gib(kv)}  = {kv_formula}; {kv_tokens:,} tokens = {kv_tokens // seq} full "
            "sequences",
            f"    update activations {gib(act_upd)}  = {act_text}"
            + (f"; / CP {cp}" if cp > 1 else "")
            + (f" ({'first' if upd_stage == 0 else 'last'} pipeline stage)" if pp > 1 else ""),
            f"    training logits    {gib(t_upd * vshard * b)}  = tokens {t_upd} x padded vocab/TP {vshard} x {b} B "
            "(their gradient is written into them)",
            f"    log-prob forward   {gib(lp_terms[LP_LAYER])}  = one layer's "
            f"activations, {t_lp} tok x {lp_layer.total:,.0f} B (forward only: nothing kept for backward)",
            f"    log-prob logits    {gib(lp_terms['logits'])}  = tokens {t_lp} x padded vocab/TP {vshard} x {b} B",
            f"    logit chunks       {gib(rows * vshard * (2 * b + 8))}  = {rows} rows x padded vocab/TP {vshard} x "
            f"({b} + 4 + 4 + {b}) B in the update's backward; x ({b} + 8) B = {gib(rows * vshard * (b + 8)).strip()} "
            "forward only",
            f"    log-prob results   {gib(own_results)}  = 8 B (fp32 log-prob + entropy) x "
            f"{step_rows // max(self.dp, 1)} rows/rank x response {d.max_response_length}; their DP all-gather "
            f"afterwards {gib(gathered_results).strip()} (all {step_rows} rows + this rank's copy, once the forward "
            "is done)",
            f"    sync buckets       {gib(bucket)}  = max(rollout.weight_sync_bucket_mb={r.weight_sync_bucket_mb}, "
            f"largest module {gib(largest_module).strip()}) of full tensors x (1 + vLLM staging copy {br}/{b})",
            "  per phase, per rank (device: allocated on the device; host: offloaded values in pinned host memory):",
        ]
        for ph in phases:
            dev_total, host_total = ph.device_total, ph.host_total
            unit, unit_name = (GIB, "GiB") if dev_total >= GIB else (MIB, "MiB")
            parts = " + ".join(f"{k} {v / unit:.2f}" for k, v in ph.device.items() if v)
            host_parts = " + ".join(f"{k} {v / unit:.2f}" for k, v in ph.host.items() if v)
            flag = ""
            if mem is not None and ph.fits is None:
                ph.fits = dev_total <= mem
            if ph.runs and ph.fits is False:
                flag = f"  OVER --device-memory-gb {self.device_memory_gb:g}"
            if flag and not (ph is phases[0] and startup is not None):  # vLLM's start-up rule: a problem instead
                self.warnings.append(
                    f"memory estimate of phase {ph.name!r} is {dev_total / GIB:.1f} GiB per rank, over "
                    f"--device-memory-gb {self.device_memory_gb:g} ({unit_name}: {parts}); see the plan above for "
                    "the terms"
                )
            line = (
                f"    {ph.name:<12} {gib(dev_total)} device {gib(host_total)} host  "
                f"({unit_name}: {parts}{'; host: ' + host_parts if host_parts else ''}){flag}"
            )
            if ph.note:
                line += f"  [{ph.note}]"
            out.append(line)
        verdict = ""
        if mem is not None:
            spare = mem - peak.device_total
            verdict = (
                f": fits --device-memory-gb {self.device_memory_gb:g} with {gib(spare).strip()} "
                f"({100 * spare / mem:.0f}%) left for what the estimate leaves out (allocator fragmentation, "
                "CUDA/HCCL context, communication buffers)"
                if spare >= 0
                else f": OVER --device-memory-gb {self.device_memory_gb:g} by {gib(-spare).strip()}"
            )
        out.append(f"  peak per rank: {peak.name} {gib(peak.device_total).strip()}{verdict}")
        nproc = self.nproc_per_node or 1
        out.append(
            f"  pinned host memory per rank: hand-off buffers {gib(pinned_kept).strip()} (kept between steps)"
            + (f" + vLLM weights {gib(vllm_backup).strip()} while asleep (level 1)" if vllm_backup else "")
            + f" = {gib(pinned_kept + vllm_backup).strip()} at most; x {nproc} per node = "
            f"{gib(nproc * (pinned_kept + vllm_backup)).strip()}"
        )
        self.phases = phases
        self.peak_phase = peak.name
        self.numbers.update(
            params=total,
            params_active=counts.active,
            params_experts=counts.experts,
            params_non_expert=counts.non_expert,
            actor_expert_params_per_rank=p_expert,
            ep=ep,
            etp=etp,
            expert_dp=edp,
            actor_params_per_rank=p_rank,
            rollout_params_per_rank=p_vllm,
            padded_vocab=vp,
            kv_cache_tokens=kv_tokens,
            micro_batch_tokens=tokens,
            log_prob_micro_batch_tokens=lp_tokens,
            update_pipeline_stage=upd_stage,
            **{
                f"memory_{k}_bytes": v
                for k, v in (
                    ("actor_weights", weights),
                    ("grads", grads),
                    ("optimizer", optim),
                    ("reference", ref),
                    ("vllm_weights", vllm_w),
                    ("kv_cache", kv),
                    ("activations", act_upd),
                    ("logits", t_upd * vshard * b),
                    ("log_prob_activations", lp_terms[LP_LAYER]),
                    ("log_prob_logits", lp_terms["logits"]),
                    ("logit_chunks", rows * vshard * (2 * b + 8)),
                    ("sync_buckets", bucket),
                    ("log_prob_results", own_results),
                    ("log_prob_gathered", gathered_results),
                    ("pinned_host", pinned_kept + vllm_backup),
                    ("peak", peak.device_total),
                )
            },
            **{f"memory_phase_{ph.name}_bytes": ph.device_total for ph in phases},
            **{f"memory_phase_{ph.name}_host_bytes": ph.host_total for ph in phases},
        )
        return out

    # ----------------------------------------------------------------------------------------- driver

    def report(self, plan: str) -> CheckReport:
        return CheckReport(
            self.problems,
            self.warnings,
            plan,
            self.numbers,
            self.phases,
            self.peak_phase,
            capacity_gib=self.device_memory_gb,
            world_size=self.world_size,
            config=self.config_path,
            overrides=self.overrides,
        )

    def run(self) -> CheckReport:
        if not self.load():
            return self.report("")
        self.load_model()
        if self.arch is not None and self.range_ok:
            self.check_layout()
        self.check_checkpoint()
        if self.range_ok:
            self.check_data()
        self.check_rewards()
        lines = [f"megatron-dapo check {self.config_path or '(defaults)'} {' '.join(self.overrides)}".rstrip()]
        if self.arch is not None and self.layout_ok and self.rollout_ok:
            lines += ["plan:"] + self.make_plan() + self.memory_plan()
        else:
            lines.append("plan: not computed (needs a readable HF config and a valid parallel layout; see problems)")
        lines.append("inputs:")
        lines += self.plan or ["  (none readable)"]
        return self.report("\n".join(lines))


def _human(count: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.2f}{unit}"
    return str(count)


def _bind_math(math_dapo: Any, response: str, truth: Any) -> Any:
    return lambda: math_dapo.compute_score(response, truth)


def run_check(
    config_path: Optional[str],
    overrides: Optional[Sequence[str]] = None,
    nnodes: int = 1,
    nproc_per_node: Optional[int] = None,
    device_memory_gb: Optional[float] = None,
    sample_rows: int = DEFAULT_SAMPLE_ROWS,
) -> CheckReport:
    """Check a config, its model, data, reward functions and checkpoint for a launch of ``nnodes`` x
    ``nproc_per_node`` processes (default per node: 8 for platform cuda/npu, else 2); see the module docstring."""
    return _Checker(config_path, overrides or [], nnodes, nproc_per_node, device_memory_gb, sample_rows).run()


def build_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    """The ``check`` arguments (on ``parser`` when given, e.g. a ``megatron-dapo`` subcommand parser)."""
    parser = parser or argparse.ArgumentParser(prog="megatron-dapo check", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="experiment YAML (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor_model_parallel_size=2")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes of the planned launch (default 1)")
    parser.add_argument(
        "--nproc-per-node", type=int, default=None, help="processes per node (default: 8 on cuda/npu, else 2)"
    )
    parser.add_argument(
        "--device-memory-gb",
        type=float,
        default=None,
        help="memory per device in GiB: sizes the vLLM KV cache (gpu_memory_utilization x it), checks vLLM's "
        "start-up rule, marks phases estimated above it and says whether the peak phase fits",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="also write the report as JSON (memory plan by phase, problems, warnings, numbers) to PATH; '-' = "
        "stdout, the text report then goes to stderr",
    )
    parser.add_argument(
        "--sample-rows",
        type=int,
        default=DEFAULT_SAMPLE_ROWS,
        help=f"rows per data file to template and tokenize (default {DEFAULT_SAMPLE_ROWS}; 0 = all); every row's "
        "fields are validated",
    )
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``megatron-dapo check``: print the report; exit status 0 when there is no problem, 1 otherwise. Overrides may
    come before or after the options. With ``--json -`` stdout carries only the JSON (the text goes to stderr)."""
    args = build_parser().parse_intermixed_args(argv)
    to_stdout = args.json == "-"
    with _stdout_to_stderr() if to_stdout else contextlib.nullcontext():
        report = run_check(
            args.config, args.overrides, args.nnodes, args.nproc_per_node, args.device_memory_gb, args.sample_rows
        )
    (sys.stderr if to_stdout else sys.stdout).write(report.render())
    if args.json:
        text = json.dumps(report.to_json(), indent=2) + "\n"
        if to_stdout:
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            try:
                Path(args.json).write_text(text)
            except OSError as exc:
                sys.stderr.write(f"megatron-dapo check: cannot write --json {args.json}: {exc}\n")
                return 2
    return 0 if report.ok else 1


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Whatever the check's imports and the user's reward functions print goes to stderr (Python's ``sys.stdout``
    and file descriptor 1), so that stdout carries only the JSON."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


if __name__ == "__main__":
    raise SystemExit(main())
