"""The plan as ``megatron-dapo check`` prints it: sizes and batch arithmetic from the ``RunPlan``, then the memory
model (``config.memory.MemoryModel``) term by term and phase by phase. Text only: every number comes from the plan
or the model."""

from __future__ import annotations

from megatron_dapo.config.memory import GIB, LP_LAYER, MIB, MemoryModel, phase_unit, terms_text
from megatron_dapo.config.plan import RunPlan
from megatron_dapo.config.schema import ActorConfig, AlgorithmConfig, DataConfig, ParallelConfig, RolloutConfig
from megatron_dapo.models.families import ModelArch

YES_NO = {True: "yes", False: "no"}


def gib(x: float) -> str:
    """Bytes right-aligned in GiB, or MiB below 1 GiB (the plan's columns)."""
    return f"{x / GIB:9.2f} GiB" if x >= GIB else f"{x / MIB:9.2f} MiB"


def human(count: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.2f}{unit}"
    return str(count)


# ----------------------------------------------------------------------------------------------- sizes and batches


def plan_lines(
    plan: RunPlan,
    p: ParallelConfig,
    a: ActorConfig,
    r: RolloutConfig,
    d: DataConfig,
    al: AlgorithmConfig,
    nnodes: int,
    nproc_per_node: int,
) -> list[str]:
    """The layout and each step's batch arithmetic (``RunPlan.batches``)."""
    bt = plan.batches
    rtp, rdp, n, seq = plan.rollout.tp_size, plan.rollout.dp_size, r.n, plan.max_model_len
    out = [
        f"  world size {plan.world_size} = {nnodes} node(s) x {nproc_per_node} process(es) per node",
        f"  actor: TP {plan.tp} x PP {plan.pp} (VPP {plan.vpp or '-'}) x DP {plan.dp_size}; sequence parallel "
        f"{'on' if p.sequence_parallel else 'off'}; distributed optimizer "
        f"{'on' if p.use_distributed_optimizer else 'off'}",
        f"  rollout: TP {rtp} x DP {rdp} ({rdp} vLLM replica(s) of {rtp} rank(s))",
        f"  weight sync: {plan.weight_transport} transport ({plan.weight_transport_reason})",
    ]
    micro, lp_micro = bt.micro_batches_per_mini_batch, bt.log_prob_micro_batches
    if a.use_dynamic_bsz:
        each = f"at most {{}} (dynamic: <= {a.ppo_max_token_len_per_gpu} tokens each; fewer for shorter sequences)"
        mbs, lp_mbs = each.format(micro), each.format(lp_micro)
    else:
        mbs = f"{micro} (of {a.ppo_micro_batch_size_per_gpu} sequences)"
        lp_mbs = f"{lp_micro} (of {a.log_prob_micro_batch_size_per_gpu} sequences)"
    fg = al.filter_groups
    gens = (
        f"1 to {fg.max_num_gen_batches or 'one pass over the data of'} generation batches (dynamic sampling)"
        if fg.enable
        else "1 generation batch"
    )
    gen, traj, minis = bt.gen_batch_size, bt.trajectories_per_step, bt.mini_batches_per_step
    return out + [
        f"  per step: {gens} of {gen} prompts x {n} = {gen * n} sequences, {-(-gen * n // rdp)} per replica "
        f"(rollout.max_num_seqs={r.max_num_seqs})",
        f"  per step: {traj} trajectories ({d.train_batch_size} prompts x {n}), at most {traj * seq} tokens "
        f"({seq} per sequence = {d.max_prompt_length} prompt + {d.max_response_length} response)",
        f"  per step: {minis} mini-batch(es) of {a.ppo_mini_batch_size * n} sequences x {a.ppo_epochs} epoch(s) = "
        f"{bt.optimizer_steps_per_step} optimizer step(s)",
        f"  per mini-batch per rank: {bt.sequences_per_mini_batch_per_rank} sequences in {mbs} micro-batches",
        f"  log-probs per step per rank (old policy{' and reference' if plan.uses_reference else ''}): "
        f"{bt.log_prob_sequences_per_rank} sequences in {lp_mbs} micro-batches",
    ]


# ----------------------------------------------------------------------------------------------- the memory plan


def memory_lines(
    m: MemoryModel,
    arch: ModelArch,
    a: ActorConfig,
    p: ParallelConfig,
    r: RolloutConfig,
    d: DataConfig,
    hf_dir: str,
    nproc_per_node: int,
) -> list[str]:
    """The memory plan: parameters, the hand-off, each term's formula, each phase's terms, the peak and the pinned
    host memory."""
    return (
        param_lines(m, arch, hf_dir)
        + handoff_lines(m, r)
        + term_lines(m, arch, a, p, r, d)
        + ["  per phase, per rank (device: allocated on the device; host: offloaded values in pinned host memory):"]
        + phase_lines(m)
        + peak_lines(m, nproc_per_node)
    )


def param_lines(m: MemoryModel, arch: ModelArch, hf_dir: str) -> list[str]:
    plan, counts, rank = m.plan, m.params.counts, m.params
    moe = bool(counts.moe_layers)
    if moe:
        layers_text = (
            f"{counts.moe_layers} MoE layers x {counts.moe_layer:,} (attention + shared expert "
            f"{counts.moe_layer_split:,}, norms + router {counts.moe_layer_replicated:,}, routed experts "
            f"{counts.expert_layer:,} = {arch.num_experts} x 3 x h x f_e {arch.moe_ffn_hidden_size})"
            + (f" + {counts.dense_layers} dense layers x {counts.layer:,}" if counts.dense_layers else "")
        )
    else:
        layers_text = f"{arch.num_layers} layers x {counts.layer:,}"
    total = counts.total
    out = [
        f"  parameters (from {hf_dir}/config.json): {total:,} = {human(total)} (embedding "
        f"{counts.embedding:,}, output layer {counts.output_layer:,}{' (tied)' if arch.tie_word_embeddings else ''}"
        f", {layers_text}, final norm {counts.final_norm:,})",
    ]
    if moe:
        ep, etp = plan.ep, plan.etp
        out += [
            f"  MoE: routed experts {counts.experts:,} = {human(counts.experts)}, the rest (embeddings, "
            f"attention, norms, router, shared expert) {counts.non_expert:,} = {human(counts.non_expert)}; "
            f"active per token {counts.active:,} = {human(counts.active)} (top-{arch.moe_router_topk} of "
            f"{arch.num_experts} experts per MoE layer)",
            f"  experts: EP {ep} x ETP {etp} ({arch.num_experts // ep} experts per rank, each expert's FFN / ETP)"
            f" x expert DP {plan.expert_dp_size} (= world / (ETP x EP x PP)); alltoall token dispatcher",
        ]
    split = (
        f" (non-expert {rank.dense:,} / TP {plan.tp}, routed experts {rank.expert:,} / (EP {plan.ep} x ETP {plan.etp}))"
    )
    out.append(
        f"  actor parameters per rank (largest stage, vocabulary padded to {plan.padded_vocab_size}): {rank.actor:,}"
        + (split if moe else "")
        + f"; rollout per rank (rollout TP {plan.rollout.tp_size}): {rank.rollout:,}"
    )
    return out


def handoff_lines(m: MemoryModel, r: RolloutConfig) -> list[str]:
    """Where the hand-off keeps what (the platform's defaults with the config's choices) and how vLLM sleeps."""
    plan = m.plan
    handoff = plan.handoff
    grads = YES_NO[handoff.grads] + (
        " (values discarded, re-zeroed on onload)" if handoff.grads and not handoff.keep_grad_values else ""
    )
    if plan.rollout.sleeps:
        freed = (
            "weights to pinned host memory, KV cache freed"
            if handoff.sleep_level == 1
            else "weights and KV cache freed"
        )
        sleep = f"vLLM sleeps at level {handoff.sleep_level} after generation ({freed})"
    else:
        why = (
            "rollout.free_cache_engine=false"
            if not r.free_cache_engine
            else f"no vLLM sleep mode on {plan.platform_name}"
        )
        sleep = f"vLLM never sleeps ({why}): its weights and KV cache stay on the device"
    reference = YES_NO[handoff.reference] if plan.uses_reference else "- (none)"
    return [
        f"  memory per rank, estimate ({plan.params_dtype} actor, {plan.rollout.dtype} rollout; GiB = 2^30 bytes):",
        f"    hand-off ({plan.platform_name} defaults + config; handoff/offload.py): offload actor params "
        f"{YES_NO[handoff.params]}, grads {grads}, optimizer {YES_NO[handoff.optimizer]}, reference "
        f"{reference}; {sleep}",
    ]


def _optimizer_text(m: MemoryModel, moe: bool, distributed: bool) -> str:
    b, shards = m.plan.param_bytes, m.optimizer_shards
    text = f"params/rank x {m.optimizer_bytes_per_param} B (Adam: 2 fp32 moments" + (
        " + fp32 master weights" if b < 4 else ""
    )
    if shards > 1 and not moe:
        return text + f") / DP {shards} (distributed optimizer)"
    if moe and distributed:
        return (
            text + f"): non-expert / DP {shards}, routed experts / expert DP {m.expert_optimizer_shards} "
            "(distributed optimizer)"
        )
    return text + ")"


def term_lines(
    m: MemoryModel, arch: ModelArch, a: ActorConfig, p: ParallelConfig, r: RolloutConfig, d: DataConfig
) -> list[str]:
    """Each term's bytes and how they are made up (docs/check.md, "Terms")."""
    plan, act = m.plan, m.act
    b, br, rtp, seq = plan.param_bytes, plan.rollout_bytes, plan.rollout.tp_size, plan.max_model_len
    vshard, rows, moe = plan.padded_vocab_size // plan.tp, act.logit_rows, bool(m.params.counts.moe_layers)
    all_experts = (
        " (every replica holds all experts, each expert's FFN / rollout TP: vLLM without expert "
        "parallelism; router replicated)"
    )
    stage = f" ({'first' if act.update_stage == 0 else 'last'} pipeline stage)" if plan.pp > 1 else ""
    rows_per_rank, resp = plan.batches.log_prob_sequences_per_rank, d.max_response_length
    lora = m.adapter_params
    trained = f"LoRA adapter params/rank {lora:,}" if lora else "params/rank"
    reference = "0 (no KL term)"
    if lora and plan.uses_reference:
        reference = "0 (KL term on: the actor with its LoRA adapters off, no copy)"
    return [
        "    terms (bytes while on the device):",
        f"    actor weights      {gib(m.weights)}  = params/rank"
        + (f" + LoRA adapters {lora:,}" if lora else "")
        + f" x {b} B",
        f"    actor grads        {gib(m.grads)}  = {trained} x 4 B (fp32 main grads in the DDP buffers, "
        "grad_reduce_in_fp32)",
        f"    optimizer state    {gib(m.optimizer)}  = "
        + (f"{trained}: " if lora else "")
        + _optimizer_text(m, moe, p.use_distributed_optimizer),
        f"    reference weights  {gib(m.reference)}  = "
        + (f"params/rank x {b} B (KL term on)" if plan.uses_reference and not lora else reference),
        f"    vLLM weights       {gib(m.vllm_weights)}  = full model / rollout TP {rtp} x {br} B"
        + (all_experts if moe else ""),
        f"    vLLM KV cache      {gib(m.kv.size)}  = {m.kv.formula}; {m.kv.tokens:,} tokens = {m.kv.tokens // seq} "
        "full sequences"
        + (
            f", each with {m.kv.state_bytes_per_seq:,} B of Gated DeltaNet conv + recurrent state"
            if m.kv.state_bytes_per_seq
            else ""
        ),
        f"    update activations {gib(act.update_bytes)}  = {activation_text(m, arch, a, p)}"
        + (f"; / CP {plan.cp}" if plan.cp > 1 else "")
        + stage,
        f"    training logits    {gib(act.training_logits)}  = tokens {act.update_tokens} x padded vocab/TP "
        f"{vshard} x {b} B (their gradient is written into them)",
        f"    log-prob forward   {gib(act.log_prob_terms[LP_LAYER])}  = one layer's "
        f"activations, {act.log_prob_tokens} tok x {act.log_prob_layer.total:,.0f} B (forward only: nothing kept for "
        "backward)",
        f"    log-prob logits    {gib(act.log_prob_terms['logits'])}  = tokens {act.log_prob_tokens} x padded "
        f"vocab/TP {vshard} x {b} B",
        f"    logit chunks       {gib(act.logit_chunks)}  = {rows} rows x padded vocab/TP {vshard} x "
        f"({b} + 4 + 4 + {b}) B in the update's backward; x ({b} + 8) B = "
        f"{gib(act.log_prob_terms['logit chunks']).strip()} forward only",
        f"    log-prob results   {gib(m.log_prob_results)}  = 8 B (fp32 log-prob + entropy) x "
        f"{rows_per_rank} rows/rank x response {resp}; their DP all-gather afterwards "
        f"{gib(m.log_prob_gathered).strip()} (all {plan.batches.trajectories_per_step} rows + this rank's copy, "
        "once the forward is done)",
        f"    sync buckets       {gib(m.sync_buckets)}  = max(rollout.weight_sync_bucket_mb="
        f"{r.weight_sync_bucket_mb}, largest module {gib(m.largest_module).strip()}) of full tensors x "
        f"(1 + vLLM staging copy {br}/{b})",
    ]


def activation_text(m: MemoryModel, arch: ModelArch, a: ActorConfig, p: ParallelConfig) -> str:
    """How the update's activations are made up: what one layer keeps per token, recompute and chunks in flight."""
    plan, act = m.plan, m.act
    full, b, tp, h = act.full_layer, plan.param_bytes, plan.tp, arch.hidden_size
    head = (
        "QKV output, rotated Q and K, "
        + ("QK-norm input, " if arch.qk_layernorm else "")
        + f"attention output, fc1 and SwiGLU outputs {full.split:,.0f} B/tok"
        + f" + norms {full.replicated:,.0f} B/tok"
    )
    if m.params.counts.moe_layers and full.moe:
        k, fe, sp = arch.moe_router_topk, arch.moe_ffn_hidden_size, p.sequence_parallel
        shared = "shared expert's fc1 and SwiGLU outputs" if arch.moe_shared_expert_ffn_hidden_size else ""
        head = head.replace(", fc1 and SwiGLU outputs", f", {shared}" if shared else "") + (
            f" + routed experts {full.moe:,.0f} B/tok (alltoall dispatch, balanced routing: router scores "
            f"E {arch.num_experts} x 4 B + top-{k} x (ETP {plan.etp} x h {h} + 4 x f_e {fe}) x {b} B dispatched"
            f"{f', / TP {tp} (SP)' if sp and tp > 1 else ''})"
        )
    if act.flash:
        core = f"softmax stats {full.core:,.0f} B/tok (flash attention)"
    else:
        core = f"attention probabilities {full.core:,.0f} B/tok (a x s x B / TP, local spec)"
    t, chunk_layers, group = act.update_tokens, act.chunk_layers, act.group
    if a.recompute == "full":
        return (
            f"[recompute full, groups of {group}] layer inputs {t} tok x {act.layer_input:,.0f} B x "
            f"{-(-chunk_layers // group)} group(s)/chunk x {act.chunks_in_flight} chunk(s) in "
            f"flight + one group recomputed: {min(group, chunk_layers)} layer(s) x {t} tok x "
            f"{full.total:,.0f} B ({head} + {core})"
        )
    sel = a.recompute == "selective"
    return (
        f"[recompute {a.recompute}] {t} tok x {act.kept_layer.total:,.0f} B/tok/layer ({head}"
        + ("; core attention recomputed, not kept" if sel else f" + {core}")
        + f") x {chunk_layers} layers/chunk x {act.chunks_in_flight} chunk(s) in flight"
    )


def phase_lines(m: MemoryModel) -> list[str]:
    """One line per phase: device and host totals, the terms, ``OVER`` when it does not fit, its note."""
    out = []
    for ph in m.phases:
        unit, unit_name = phase_unit(ph.device_total)
        parts, host_parts = terms_text(ph.device, unit), terms_text(ph.host, unit)
        over = f"  OVER --device-memory-gb {m.capacity / GIB:g}" if ph.runs and ph.fits is False else ""
        line = (
            f"    {ph.name:<12} {gib(ph.device_total)} device {gib(ph.host_total)} host  "
            f"({unit_name}: {parts}{'; host: ' + host_parts if host_parts else ''}){over}"
        )
        out.append(line + (f"  [{ph.note}]" if ph.note else ""))
    return out


def peak_lines(m: MemoryModel, nproc_per_node: int) -> list[str]:
    peak, capacity = m.peak, m.capacity
    verdict = ""
    if capacity is not None:
        spare = capacity - peak.device_total
        verdict = (
            f": fits --device-memory-gb {capacity / GIB:g} with {gib(spare).strip()} "
            f"({100 * spare / capacity:.0f}%) left for what the estimate leaves out (allocator fragmentation, "
            "CUDA/HCCL context, communication buffers)"
            if spare >= 0
            else f": OVER --device-memory-gb {capacity / GIB:g} by {gib(-spare).strip()}"
        )
    level_1 = f" + vLLM weights {gib(m.vllm_host_copy).strip()} while asleep (level 1)" if m.vllm_host_copy else ""
    rollout = []
    if m.rollout_rank is not None:  # trainer.mode=async: the engine is on the rollout ranks only
        over = ""
        if capacity is not None:
            over = " (fits)" if m.rollout_rank <= capacity else f" (OVER --device-memory-gb {capacity / GIB:g})"
        rollout = [
            f"  async: the phases above are a training rank's; each of the {m.plan.rollout_world} rollout ranks holds "
            f"{gib(m.rollout_rank).strip()} = vLLM weights + KV cache + a received bucket and vLLM's staging copy"
            + over
        ]
    return rollout + [
        f"  peak per rank: {peak.name} {gib(peak.device_total).strip()}{verdict}",
        f"  pinned host memory per rank: hand-off buffers {gib(m.pinned_buffers).strip()} (kept between steps)"
        + level_1
        + f" = {gib(m.pinned_host).strip()} at most; x {nproc_per_node} per node = "
        f"{gib(nproc_per_node * m.pinned_host).strip()}",
    ]
