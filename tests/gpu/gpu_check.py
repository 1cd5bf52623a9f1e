"""GPU check, run by hand on one NVIDIA GPU (``bash tests/gpu/run.sh``); not part of the pytest suite (pytest only
collects ``test_*.py``) and never run in CI, which has no GPU. ``--platform cpu --tiny`` runs every phase on a CPU
box as a smoke test of this script (its numbers mean nothing there).

Megatron-core side only (no vLLM, no TransformerEngine needed: ``model.transformer_impl=local``), world size 1,
bf16, Qwen2-shaped models with random weights: about 0.63B parameters (Qwen2.5-0.5B's shape, untied output layer)
and Qwen2.5-3B's shape; one small Qwen3.5-MoE (``gdn_fla``). Every phase runs even when an earlier one failed (a
phase that raises is a failed check with its traceback in the JSON), every number is written to ``--out`` as soon as
its phase ends, and the run ends with one ``PASS``/``FAIL`` line per check. Phases:

1. ``init``: the platform's mixed default group (``cpu:gloo,cuda:nccl``): an all-reduce of a CUDA tensor and of a
   CPU tensor on the default group; whether ``parallel.control_group()`` was still created.
2. ``recompute``: the same DAPO-loss gradients with ``actor.recompute=none`` and ``full``, and each one's peak.
3. ``update``: ``MegatronActor.update`` (forward/backward with the DAPO loss hook + optimizer step) on a batch of
   prompt 512 + response 1536 tokens; tokens/s.
4. ``handoff``: ``handoff.offload.MemoryHandoff`` with every component offloaded (params too) around a stand-in
   engine that holds real device memory (no vLLM here), through start-up, a step and a save, the reference built
   after the engine as the trainer builds it. After every hand-off call: the CUDA runtime's last error
   (``cudaPeekAtLastError``, not cleared) and, at each boundary, the allocator's bytes against the ledger's
   accounting of the same objects (``testing/device_ledger.state_holders``). Bit-exactness of every parameter, grad
   buffer and optimizer tensor after the round trip; the pinned host buffers. Then ``update_after_handoff``.
5. ``fusions``: bf16 forward/backward tokens/s with the platform's fused kernels and with none.
6. ``logprob_graph``: ``compute_log_probs`` (8 rows, micro-batch 2) as it is and with autograd on, as it was before
   forward-only passes ran under ``no_grad`` (``actor.FORWARD_ONLY_GRAD_MODE``): peak above the resident state,
   time, and the same log-probs.
7. ``logprobs_8k``: ``compute_log_probs`` on 8192-token responses, and ``response_log_probs`` forward+backward on
   [8704, 151936] bf16 logits against a float32 ``log_softmax`` reference.
8. ``dense_3b``: Qwen2.5-3B's shape with ``recompute=full``: update and log-prob tokens/s and model FLOP
   utilisation against the H200's 989 dense bf16 TFLOP/s, and ``megatron-dapo check``'s plan for this shape
   (``config/memory.memory_model``: the ``update`` and ``old_log_prob`` phases, the engine's terms left out)
   predicted against the measured peak.
9. ``gdn_fla``: a small Qwen3.5-MoE (``GDN_SHAPE``, transformers' ``Qwen3_5MoeTextConfig`` through the project's
   builder: Gated DeltaNet at 3 of every 4 layers, gated attention, MoE with a shared expert, every token to all 8
   experts so that no top-k choice flips), bf16, one DAPO-loss
   ``compute_gradients`` on 4 rows of prompt 512 + response 1536, the same weights and batch twice: with fla's Triton
   kernels (``chunk_gated_delta_rule``, ``l2norm``) and with megatron-core's torch fallback
   (``torch_chunk_gated_delta_rule``), bound into megatron-core's module in turn and counted. Per parameter group
   the max |Δgrad| / max |grad| against the fallback, row 0's logits the same way, within ``GDN_RTOL`` (1e-1); each
   path's tokens/s; a negative control (the fallback with half the decay) must exceed the tolerance. On the CPU
   (``--platform cpu``; Triton needs a GPU) the first path is transformers' own torch rule instead (the output
   names the comparison that ran).
10. ``trainer_standin``: the real ``DAPOTrainer`` with the stand-in rollout engine (``testing/standin_engine.py``:
   vLLM's wheel cannot travel to the lent machine) on the demo's task, made locally in a temporary directory (its
   tokenizer and data; a Qwen2 model of 12 layers at Qwen2.5-0.5B's width, the demo's own with ``--tiny``): 2 steps
   with validation and a save, then a resume to step 3. The run's end and resume step, the last weight sync complete,
   and each hand-off phase's peak (``perf/peak_memory_gb/*``) against ``megatron-dapo check``'s plan for the same run
   (``config/memory.memory_model`` of the trainer's plan, the stand-in's weights and KV cache sized as vLLM's):
   within 15% (informational with ``--tiny``). It ends with the default group closed (the trainer's teardown).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

SHAPE = dict(
    vocab_size=151936,
    hidden_size=896,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    intermediate_size=4864,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
)
SHAPE_3B = dict(  # Qwen2.5-3B
    vocab_size=151936,
    hidden_size=2048,
    num_layers=36,
    num_heads=16,
    num_kv_heads=2,
    intermediate_size=11008,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
)
# trainer_standin's model (the demo's tokenizer and data): Qwen2.5-0.5B's width, 12 layers (about 0.2B parameters,
# enough for the plan's terms to dwarf the CUDA libraries' workspaces); --tiny: the demo's own shape.
STANDIN_SHAPE = dict(
    hidden_size=896,
    num_layers=12,
    num_heads=14,
    num_kv_heads=2,
    intermediate_size=4864,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
PROMPT, RESPONSE, BATCH = 512, 1536, 8
LONG_RESPONSE = 8192
H200_BF16_TFLOPS = 989.0  # dense bf16, the datasheet figure


def log(phase: str, **numbers) -> None:
    print(f"[gpu_check] {phase:<12} " + " ".join(f"{k}={v}" for k, v in numbers.items()), flush=True)


def make_batch(arch, batch: int, prompt: int, response: int, seed: int):
    from megatron_dapo.batch import TrainBatch
    from megatron_dapo.rollout.types import build_rollout_batch

    g = torch.Generator().manual_seed(seed)
    # Lengths vary by row (up to half shorter), as rollouts do.
    p_len = [prompt - (prompt // (2 * batch)) * i for i in range(batch)]
    r_len = [response - (response // (2 * batch)) * i for i in range(batch)]
    prompts = [torch.randint(10, arch.vocab_size, (n,), generator=g).tolist() for n in p_len]
    responses = [torch.randint(10, arch.vocab_size, (n,), generator=g).tolist() for n in r_len]
    rb = build_rollout_batch(
        prompts,
        responses=responses,
        log_probs=[[-1.0] * len(r) for r in responses],
        truncated=[False] * batch,
        prompt_index=list(range(batch)),
        pad_token_id=0,
    )
    return TrainBatch(
        prompts=rb.prompts,
        prompt_mask=rb.prompt_mask,
        responses=rb.responses,
        response_mask=rb.response_mask,
        rollout_log_probs=rb.rollout_log_probs,
        advantages=torch.randn(rb.responses.shape, generator=g) * rb.response_mask,
    )


def build(cfg, arch, platform):
    """The actor (chunks, optimizer) the trainer's way."""
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.optimizer import build_optimizer
    from megatron_dapo.models.builder import build_gpt_chunks, wrap_for_training

    platform.seed(1)
    chunks = wrap_for_training(build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor), cfg.parallel)
    optimizer, _ = build_optimizer(chunks, cfg.actor.optim, total_steps=100)
    return MegatronActor(chunks, arch.vocab_size, cfg.actor, optimizer)


def release(ctx, *names: str) -> None:
    """Drop models from ``ctx`` and give their memory back: megatron-core's config holds bound methods of the chunks
    (``no_sync_func``, ...), a reference cycle that only a collection frees."""
    for name in names:
        ctx.pop(name, None)
    gc.collect()
    ctx["platform"].empty_cache()


def phase_peak(platform, fn):
    platform.synchronize()
    platform.empty_cache()
    platform.reset_peak_memory()
    t = time.perf_counter()
    result = fn()
    platform.synchronize()
    return result, time.perf_counter() - t, round(platform.peak_memory_gb(), 3)


class StandInEngine:
    """No vLLM on the lent machine: an engine that holds ``nbytes`` of real device memory while awake (half for its
    weights, half for its KV cache) and frees it when it sleeps, as vLLM's sleep level 2 does."""

    def __init__(self, nbytes: int, device) -> None:
        self.nbytes, self.device = nbytes, device
        self.held: dict[str, torch.Tensor] = {}
        self.calls: list = []

    def wake_up(self, tags=None):
        self.calls.append(("wake", tuple(tags or ())))
        for tag in tags or ("weights", "kv_cache"):
            self.held.setdefault(tag, torch.empty(self.nbytes // 2, dtype=torch.uint8, device=self.device))

    def sleep(self, level=1):
        self.calls.append(("sleep", level))
        self.held.clear()

    def held_bytes(self) -> int:
        return sum(t.numel() for t in self.held.values())


def cuda_last_error() -> tuple[int, str]:
    """The CUDA runtime's last error, peeked (not cleared: a launch check would still see it), from the libcudart
    torch loaded; (0, "no CUDA") without one."""
    import ctypes

    if not torch.cuda.is_available():
        return 0, "no CUDA"
    path = next((line.split()[-1] for line in open("/proc/self/maps") if "libcudart" in line), None)
    if path is None:
        return -1, "libcudart not found in this process"
    lib = ctypes.CDLL(path)
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    code = int(lib.cudaPeekAtLastError())
    return code, lib.cudaGetErrorString(code).decode()


def handoff_sequence(res, check, ctx) -> None:
    """Start-up, one step's phase boundaries and a save with the CUDA plan (grads, optimizer and reference
    offloaded) plus params, around a stand-in engine that holds real device memory. After every call the runtime's
    last error is logged; at every boundary the device's allocated bytes must equal the ledger's accounting of the
    same objects (``testing/device_ledger.state_holders`` + the engine) up to a constant rest (the batch, RNG
    states). Every tensor must be bit-identical after the round trip, and each offloaded component's pinned host
    buffer must be exactly its storages' size."""
    from dataclasses import replace

    from megatron_dapo.config.plan import resolve_handoff_plan
    from megatron_dapo.handoff.offload import MemoryHandoff, grad_tensors, optimizer_tensors, param_tensors
    from megatron_dapo.models.builder import build_gpt_chunks, freeze
    from megatron_dapo.testing.device_ledger import state_holders

    cfg, platform, actor = ctx["cfg"], ctx["platform"], ctx["actor"]

    def host_state():
        tensors = param_tensors(actor.chunks) + grad_tensors(actor.chunks, actor.optimizer)
        tensors += optimizer_tensors(actor.optimizer, exclude=param_tensors(actor.chunks))
        return [t.detach().cpu().clone() for t in tensors]

    planned = resolve_handoff_plan(cfg.actor, cfg.ref, cfg.rollout, cfg.trainer, platform)
    plan = replace(planned, params=True, keep_grad_values=True)
    handoff = MemoryHandoff(platform, plan, actor.chunks, actor.optimizer)
    engine = StandInEngine(2**20 if ctx["tiny"] else 8 * 2**30, platform.device())
    before = host_state()
    rows: dict = {}
    errors: list = []

    def call(name: str, fn, *args):
        out = fn(*args)
        platform.synchronize()
        code, text = cuda_last_error()
        errors.append({"call": name, "code": code, "error": text})
        log(f"handoff.{name}", cuda_last_error=code, text=repr(text))
        return out

    def boundary(name: str) -> None:
        platform.synchronize()
        predicted = sum(state_holders(handoff).values()) + engine.held_bytes()
        real = torch.cuda.memory_allocated() if torch.cuda.is_available() else predicted
        rows[name] = {"real_gb": real / 2**30, "ledger_gb": predicted / 2**30, "rest_mb": (real - predicted) / 2**20}
        rows[name]["peak_gb"] = platform.peak_memory_gb()
        platform.reset_peak_memory()

    platform.reset_peak_memory()
    boundary("built")
    call("before_engine_start", handoff.before_engine_start)
    boundary("startup")
    call("engine.wake_up", engine.wake_up)
    boundary("engine_start")
    call("after_engine_start", handoff.after_engine_start, engine)
    # after the engine, as the trainer builds it
    ref = freeze(build_gpt_chunks(ctx["arch"], cfg.model, cfg.parallel, cfg.actor))
    call("attach_reference", handoff.attach_reference, ref)
    boundary("reference_built")
    call("before_rollout", handoff.before_rollout, engine, lambda: boundary("weight_sync"))
    boundary("rollout")
    call("after_rollout", handoff.after_rollout, engine)
    boundary("old_log_probs")
    call("before_reference", handoff.before_reference)
    boundary("reference")
    call("after_reference", handoff.after_reference)
    call("before_update", handoff.before_update)
    boundary("update")
    call("before_save", handoff.before_save, engine)
    boundary("save")
    call("after_save", handoff.after_save)
    rest = [r["rest_mb"] for r in rows.values()]
    res["handoff"] = {
        "boundaries": rows,
        "cuda_errors": errors,
        "moved_gb": {k: v / 2**30 for k, v in handoff.offloader.stats.bytes.items()},
    }
    for name, r in rows.items():
        log(f"handoff:{name}", **{k: round(v, 3) for k, v in r.items()})
    check("ledger_matches_allocator", max(rest) - min(rest) <= 64, f"rest varies by {max(rest) - min(rest):.1f} MiB")
    check("handoff_bit_exact", all(torch.equal(a, b) for a, b in zip(before, host_state())), "a tensor changed")
    check("handoff_no_cuda_error", all(e["code"] == 0 for e in errors), str([e for e in errors if e["code"]]))
    pinned_buffers(res, check, handoff)
    handoff.close()


def pinned_buffers(res, check, handoff) -> None:
    """One exactly sized pinned buffer per component, against what the caching host allocator reserves for one
    pinned buffer per storage of the same sizes (its power-of-two rounding)."""
    buffers = handoff.offloader.host_buffers()
    exact = sum(b.numel() for b in buffers.values())
    res["pinned"] = {"exact_bytes": exact, "per_component": {k: b.numel() for k, b in buffers.items()}}
    if not torch.cuda.is_available():
        return
    check("pinned_buffers_are_pinned", all(b.is_pinned() for b in buffers.values()), "a host buffer is not pinned")
    sizes = [h.nbytes for held in handoff.offloader._held.values() for h in held.values() if h.host is not None]
    stats0 = torch.cuda.host_memory_stats().get("reserved_bytes.current", 0)
    caching = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]
    reserved = torch.cuda.host_memory_stats().get("reserved_bytes.current", 0) - stats0
    res["pinned"].update(caching_allocator_bytes=reserved, caching_vs_exact=round(reserved / max(exact, 1), 3))
    ratio = res["pinned"]["caching_vs_exact"]
    log("pinned", exact_gb=round(exact / 2**30, 3), caching_gb=round(reserved / 2**30, 3), caching_vs_exact=ratio)
    del caching


def fusion_speed(res, check, base, arch, platform, batch, tokens) -> None:
    """bf16 forward/backward tokens/s with the platform's fused kernels and with every fusion off."""
    from megatron_dapo.config import load_config

    own = platform.transformer_config_overrides
    off = {k: False for k in ("bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion")}
    speeds = {}
    for name, overrides in (("fused", own), ("unfused", lambda impl="local": {**own(impl), **off})):
        platform.transformer_config_overrides = overrides
        cfg = load_config(None, base + ["actor.recompute=none"])
        actor = build(cfg, arch, platform)
        times = []
        for _ in range(3):  # the first includes torch.compile of the fused functions
            _, secs, peak = phase_peak(platform, lambda a=actor: a.compute_gradients(batch, temperature=1.0))
            times.append(secs)
        speeds[name] = {"tokens_per_s": round(tokens / min(times[1:]), 1), "peak_gb": peak, "first_s": times[0]}
        log(f"bf16_{name}", **speeds[name])
        del actor
        gc.collect()
        platform.empty_cache()
    platform.transformer_config_overrides = own
    res["fusions"] = speeds
    res["fusions"]["fused_vs_unfused"] = round(speeds["fused"]["tokens_per_s"] / speeds["unfused"]["tokens_per_s"], 3)
    check("fused_not_slower", speeds["fused"]["tokens_per_s"] >= 0.9 * speeds["unfused"]["tokens_per_s"], str(speeds))


# ------------------------------------------------------------------------------------------------ the phases


def phase_init(res, check, ctx) -> None:
    from megatron_dapo.parallel import control_group, init_distributed, init_model_parallel

    _, platform = init_distributed(ctx["cfg"].parallel)
    init_model_parallel(ctx["cfg"].parallel, seed=1)
    ctx["platform"] = platform
    res["backend"] = str(dist.get_backend())
    res["control_group_created"] = control_group() is not None
    x_gpu = torch.ones(4, device=platform.device())
    x_cpu = torch.ones(4)
    dist.all_reduce(x_gpu)
    dist.all_reduce(x_cpu)  # a gloo-only or nccl-only default group would refuse one of the two
    check("mixed_backend", float(x_gpu.sum()) == 4.0 and float(x_cpu.sum()) == 4.0, res["backend"])
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    log("init", backend=res["backend"], control_group_created=res["control_group_created"], device=device)


def phase_recompute(res, check, ctx) -> None:
    """The same gradients with recompute none and full, less memory with full; keeps the full actor for later."""
    from megatron_dapo.config import load_config

    grads = {}
    for mode in ("none", "full"):
        release(ctx, "actor")
        cfg = load_config(None, ctx["base"] + [f"actor.recompute={mode}", "actor.recompute_num_layers=1"])
        actor = build(cfg, ctx["arch"], ctx["platform"])
        res["params"] = sum(p.numel() for c in actor.chunks for p in c.parameters())
        _, secs, peak = phase_peak(ctx["platform"], lambda a=actor: a.compute_gradients(ctx["batch"], temperature=1.0))
        grads[mode] = [p.main_grad.detach().float().cpu() for c in actor.chunks for p in c.parameters()]
        res[f"recompute_{mode}"] = {"peak_gb": peak, "tokens_per_s": round(ctx["tokens"] / secs, 1)}
        log(f"recompute={mode}", peak_gb=peak, tokens_per_s=round(ctx["tokens"] / secs, 1))
        ctx.update(actor=actor, cfg=cfg)
        del actor
    diff = max(float((a - b).abs().max()) for a, b in zip(grads["none"], grads["full"]))
    scale = max(float(a.abs().max()) for a in grads["none"])
    res["recompute_grad_max_diff"], res["grad_max_abs"] = diff, scale
    check("recompute_same_grads", diff <= 1e-2 * scale, f"max diff {diff} vs max |grad| {scale}")
    full, none = res["recompute_full"], res["recompute_none"]
    check("recompute_saves_memory", ctx["tiny"] or full["peak_gb"] < none["peak_gb"], str((full, none)))
    check("params_at_least_0.5B", ctx["tiny"] or res["params"] >= 5e8, str(res["params"]))


def phase_update(res, check, ctx) -> None:
    times = []
    for step in range(3):
        result, secs, peak = phase_peak(ctx["platform"], lambda: ctx["actor"].update(ctx["batch"], temperature=1.0))
        times.append(secs)
        check(f"update_{step}_applied", not result.nonfinite, str(result.nonfinite))
    res["update"] = {"peak_gb": peak, "tokens_per_s": round(ctx["tokens"] / min(times), 1), "seconds": times}
    log("update", peak_gb=peak, tokens_per_s=res["update"]["tokens_per_s"], params=res.get("params"))


def phase_update_after_handoff(res, check, ctx) -> None:
    result, _, _ = phase_peak(ctx["platform"], lambda: ctx["actor"].update(ctx["batch"], temperature=1.0))
    check("update_after_handoff", not result.nonfinite, str(result.nonfinite))
    release(ctx, "actor")


def phase_fusions(res, check, ctx) -> None:
    fusion_speed(res, check, ctx["base"], ctx["arch"], ctx["platform"], ctx["batch"], ctx["tokens"])


def phase_logprob_graph(res, check, ctx) -> None:
    """Item 1 of the first GPU run: the old-log-prob pass with autograd on (as it was) and under no_grad (as now)."""
    import megatron_dapo.actor.actor as actor_module
    from megatron_dapo.config import load_config

    platform = ctx["platform"]
    cfg = load_config(None, ctx["base"] + ["actor.recompute=none", "actor.log_prob_micro_batch_size_per_gpu=2"])
    actor = build(cfg, ctx["arch"], platform)
    out, passes = {}, {}
    for name, mode in (("with_graph", contextlib.nullcontext), ("no_grad", torch.no_grad)):
        actor_module.FORWARD_ONLY_GRAD_MODE = mode
        try:
            platform.synchronize()
            resident = platform.memory_allocated_gb()
            lp, secs, peak = phase_peak(platform, lambda a=actor: a.compute_log_probs(ctx["batch"], temperature=1.0))
        finally:
            actor_module.FORWARD_ONLY_GRAD_MODE = torch.no_grad
        out[name] = lp["log_probs"]
        passes[name] = {"peak_gb": peak, "above_resident_gb": round(peak - resident, 3), "seconds": round(secs, 3)}
        log(f"logprob_{name}", **passes[name])
    res["logprob_graph"] = passes
    check("logprob_graph_same_values", torch.equal(out["with_graph"], out["no_grad"]), "log-probs differ")
    check(
        "logprob_graph_no_grad_smaller",
        ctx["tiny"] or passes["no_grad"]["peak_gb"] < passes["with_graph"]["peak_gb"],
        str(passes),
    )
    del actor
    release(ctx)


def phase_logprobs_8k(res, check, ctx) -> None:
    from megatron_dapo.algo.logprobs import response_log_probs
    from megatron_dapo.config import load_config

    platform, arch = ctx["platform"], ctx["arch"]
    cfg = load_config(None, ctx["base"] + ["actor.recompute=full", "actor.recompute_num_layers=1"])
    actor = build(cfg, arch, platform)
    long_batch = make_batch(arch, 1, PROMPT, LONG_RESPONSE, seed=1)
    out, secs, peak = phase_peak(platform, lambda a=actor: a.compute_log_probs(long_batch, temperature=1.0))
    lp = out["log_probs"]
    check("logprobs_8k_finite", bool(torch.isfinite(lp[long_batch.response_mask.bool()]).all()), "non-finite")
    res["logprobs_8k"] = {"peak_gb": peak, "tokens_per_s": round((PROMPT + LONG_RESPONSE) / secs, 1)}
    log("logprobs_8k", peak_gb=peak, tokens_per_s=res["logprobs_8k"]["tokens_per_s"])
    del actor
    release(ctx)

    seq, dev = PROMPT + LONG_RESPONSE, platform.device()
    g = torch.Generator(device=dev).manual_seed(2)
    logits = torch.randn(1, seq, arch.vocab_size, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    index = (PROMPT - 1 + torch.arange(LONG_RESPONSE, device=dev)).unsqueeze(0)
    toks = torch.randint(0, arch.vocab_size, (1, LONG_RESPONSE), device=dev, generator=g)

    def chunked():
        lp_c, _ = response_log_probs(logits, index, toks, arch.vocab_size, with_entropy=False)
        lp_c.sum().backward()
        return lp_c.detach()

    lp_c, _, peak_c = phase_peak(platform, chunked)
    with torch.no_grad():
        ref_lp = torch.log_softmax(logits[0, index[0]].float(), -1).gather(-1, toks[0].unsqueeze(-1)).squeeze(-1)
    diff = float((lp_c[0].float() - ref_lp).abs().max())
    res["chunked_logprobs"] = {"peak_gb": peak_c, "max_diff_vs_fp32": diff, "logits_gb": logits.numel() * 2 / 2**30}
    check("chunked_logprobs_match", diff < 1e-3, f"max diff {diff}")
    log("chunked_lp", peak_gb=peak_c, logits_gb=round(logits.numel() * 2 / 2**30, 2), max_diff=diff)


def model_flops_per_token(arch, seq_len: int, training: bool) -> float:
    """Model FLOPs per token (recomputation not counted): 2 per matmul weight per token forward (the input
    embedding is a lookup, a tied output layer is counted once as the output's matmul) plus causal attention's
    QK^T and AV, 2 x seq x h per layer; x3 for forward + backward."""
    h, layers = arch.hidden_size, arch.num_layers
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * arch.ffn_hidden_size
    forward = 2 * (layers * per_layer + h * arch.vocab_size) + layers * 2 * seq_len * h
    return forward * (3 if training else 1)


def planned_phases(ctx, cfg, arch) -> dict:
    """``megatron-dapo check``'s plan for this run on this device: the update's and old log-prob's device bytes
    without the engine's terms (no engine here) and without the reference (none built)."""
    from dataclasses import replace

    from megatron_dapo.config.memory import memory_model
    from megatron_dapo.config.plan import resolve

    platform = ctx["platform"]
    capacity = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    # A training run's required inputs, named only for the planning rules (nothing is read).
    cfg = replace(
        cfg,
        checkpoint=replace(cfg.checkpoint, load_dir="planned-only"),
        data=replace(cfg.data, train_files=["planned-only.parquet"]),
    )
    model = memory_model(resolve(cfg, arch, 1, platform, total_steps=100, probe_imports=False), arch, cfg, capacity)
    keep = lambda k: not k.startswith("vLLM") and k != "reference"  # noqa: E731
    return {
        name: sum(v for k, v in model.phase(name).device.items() if keep(k)) / 2**30
        for name in ("update", "old_log_prob")
    }


def phase_dense_3b(res, check, ctx) -> None:
    from megatron_dapo.config import load_config
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.testing.tiny_models import tiny_hf_config

    platform = ctx["platform"]
    shape = ctx["shape_3b"]
    arch = model_arch_from_hf(tiny_hf_config("qwen2", **shape).to_dict())
    cfg = load_config(None, ctx["base"] + ["actor.recompute=full", "actor.recompute_num_layers=1"])
    actor = build(cfg, arch, platform)
    batch = make_batch(arch, BATCH, PROMPT, RESPONSE, seed=3)
    lengths = batch.sequence_lengths.tolist()
    tokens = sum(lengths)
    flops_train = sum(n * model_flops_per_token(arch, n, True) for n in lengths)
    flops_lp = sum(n * model_flops_per_token(arch, n, False) for n in lengths)
    measured, times = {}, []
    for _ in range(2):  # the first includes the kernels' warm-up
        result, secs, measured["update"] = phase_peak(platform, lambda a=actor: a.update(batch, temperature=1.0))
        times.append(secs)
    check("dense_3b_update_applied", not result.nonfinite, str(result.nonfinite))
    _, lp_secs, measured["old_log_prob"] = phase_peak(platform, lambda a=actor: a.compute_log_probs(batch, 1.0))
    peak_flops = H200_BF16_TFLOPS * 1e12
    out = {
        "params": sum(p.numel() for c in actor.chunks for p in c.parameters()),
        "update_tokens_per_s": round(tokens / times[-1], 1),
        "update_mfu": round(flops_train / times[-1] / peak_flops, 4),
        "log_prob_tokens_per_s": round(tokens / lp_secs, 1),
        "log_prob_mfu": round(flops_lp / lp_secs / peak_flops, 4),
    }
    res["dense_3b"] = out
    log("dense_3b", **out)
    del actor
    release(ctx)
    planned = planned_phases(ctx, cfg, arch)
    res["dense_3b"]["plan_vs_measured_gb"] = {k: {"planned": planned[k], "measured": measured[k]} for k in planned}
    for name in planned:
        log(f"plan:{name}", planned_gb=round(planned[name], 3), measured_gb=measured[name])
    check(
        "dense_3b_plan_covers_measured",
        ctx["tiny"] or all(measured[k] <= 1.1 * planned[k] for k in planned),
        str(res["dense_3b"]["plan_vs_measured_gb"]),
    )


PLAN_MARGIN = 1.15


def standin_task(root: Path, tiny: bool) -> dict:
    """The demo's tokenizer and arithmetic data, and a random Qwen2 model (the demo's shape with ``tiny``, else
    ``STANDIN_SHAPE``), written under ``root``: nothing is downloaded."""
    from megatron_dapo.tasks.arithmetic import make_rows, make_table_rows, write_dataset
    from megatron_dapo.tasks.demo import MODEL_SHAPE
    from megatron_dapo.testing.tiny_models import make_tiny_hf_model
    from megatron_dapo.testing.tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(root / "tokenizer")
    write_dataset(root / "train.parquet", make_rows(64, seed=0, max_operand=4, split="train"))
    write_dataset(root / "val.parquet", make_table_rows(max_operand=4, split="val"))
    shape = MODEL_SHAPE if tiny else STANDIN_SHAPE
    model = make_tiny_hf_model("qwen2", seed=0, dtype=torch.bfloat16, vocab_size=len(tokenizer), **shape)
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(root / "hf_model", safe_serialization=True)
    return {"tokenizer": root / "tokenizer", "hf_model": root / "hf_model", "root": root}


def standin_config(ctx, task: dict, steps: int, resume: bool):
    """configs/tiny_cpu.yaml with test_train_e2e's plumbing overrides, on this platform in bf16, the checkpoint the
    HF directory itself; ``resume``: no validation before the first step (the run continues at ``steps``)."""
    from megatron_dapo.config import load_config

    items = {
        "model.hf_config_dir": task["hf_model"],
        "model.tokenizer_dir": task["tokenizer"],
        "checkpoint.load_dir": task["hf_model"],
        "data.train_files": f"[{task['root'] / 'train.parquet'}]",
        "data.val_files": f"[{task['root'] / 'val.parquet'}]",
        "trainer.output_dir": task["root"] / "run",
        "trainer.total_training_steps": steps,
        "trainer.test_freq": 2,
        "trainer.val_before_train": str(not resume).lower(),
        "trainer.progress_bar": "false",
        "data.train_batch_size": 4,
        "data.gen_batch_size": 6,
        "actor.ppo_mini_batch_size": 2,
        "rollout.n": 8,
        "reward.custom_function.name": "compute_score",
        "algorithm.filter_groups.enable": "false",
        "actor.optim.lr_warmup_steps": 1,
    }
    config = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
    return load_config(str(config), ctx["base"] + [f"{k}={v}" for k, v in items.items()])


def run_standin_trainer(ctx, cfg) -> dict:
    """``DAPOTrainer`` with the stand-in engine to its end: the step it resumed from and ended at, whether the last
    weight sync delivered every rollout tensor, and ``check``'s plan of this run's phases (GiB)."""
    from megatron_dapo.config.memory import memory_model
    from megatron_dapo.testing.standin_engine import StandInEngine
    from megatron_dapo.training.trainer import DAPOTrainer

    platform = ctx["platform"]
    resident = platform.memory_allocated_gb()
    trainer = DAPOTrainer(cfg, engine_factory=StandInEngine)
    resumed: list = []
    resume = trainer.checkpoints.resume
    trainer.checkpoints.resume = lambda *args: resumed.append(resume(*args)) or resumed[-1]
    try:
        trainer.fit()
        engine = trainer.engine
        expected = {n: int(torch.Size(s).numel()) * engine.dtype.itemsize for n, s in engine.shapes.items()}
        capacity = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
        model = memory_model(trainer.plan, trainer.arch, cfg, capacity)
        return {
            "resident_before_gb": round(resident, 3),
            "resumed_at": resumed[0] if resumed else None,
            "global_step": trainer.global_step,
            "weight_updates": engine.weight_updates,
            "sync_complete": engine.last_update == expected,
            "kv_cache_gb": round(engine.kv_cache_bytes / 2**30, 3),
            "plan_gb": {ph.name: ph.device_total / 2**30 for ph in model.phases if ph.runs},
        }
    finally:
        trainer.close()
        # The trainer froze the heap for its engine (rollout/engine.freeze_heap_before_engine); this process builds
        # another trainer: what the first one held must be collectable again.
        gc.unfreeze()
        gc.collect()
        platform.empty_cache()


def phase_trainer_standin(res, check, ctx) -> None:
    from megatron_dapo.handoff.offload import PLAN_PHASE_OF

    release(ctx, "actor")
    with tempfile.TemporaryDirectory(prefix="trainer_standin_") as tmp:
        task = standin_task(Path(tmp), ctx["tiny"])
        runs = [run_standin_trainer(ctx, standin_config(ctx, task, steps, steps > 2)) for steps in (2, 3)]
        rows = [json.loads(line) for line in (task["root"] / "run" / "metrics.jsonl").read_text().splitlines()]
    measured: dict = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith("perf/peak_memory_gb/"):
                name = key.rsplit("/", 1)[1]
                measured[name] = max(measured.get(name, 0.0), value)
    plan = runs[0]["plan_gb"]
    table = {
        name: {"measured_gb": round(gb, 3), "planned_gb": round(plan[PLAN_PHASE_OF[name]], 3)}
        for name, gb in measured.items()
        if PLAN_PHASE_OF.get(name) in plan
    }
    for name, row in table.items():
        row["ratio"] = round(row["measured_gb"] / max(row["planned_gb"], 1e-9), 3)
        log(f"standin:{name}", **row)
    trained = [r["step"] for r in rows if "actor/pg_loss" in r]
    res["trainer_standin"] = {"runs": runs, "phases": table, "trained_steps": trained}
    log("standin", **{k: v for k, v in runs[1].items() if k != "plan_gb"})
    ends = [r["global_step"] for r in runs]
    check("trainer_standin_finished", ends == [2, 3] and trained == [1, 2, 3], f"ended at {ends}, trained {trained}")
    check("trainer_standin_resumed_at_2", runs[1]["resumed_at"] == 2, str(runs[1]["resumed_at"]))
    check("trainer_standin_sync_complete", all(r["sync_complete"] for r in runs), "a rollout tensor was not synced")
    over = {k: v for k, v in table.items() if v["ratio"] > PLAN_MARGIN}
    check("trainer_standin_peaks_within_plan", ctx["tiny"] or (bool(table) and not over), str(over or table))


# ------------------------------------------------------------------------------------------------ gdn_fla

# A small Qwen3.5-MoE (transformers' Qwen3_5MoeTextConfig): Gated DeltaNet at 3 of every 4 layers, gated attention,
# MoE FFNs with a gated shared expert; the GDN's head sizes are the real model's (128). Every token goes to all 8
# experts: a top-k choice is a discontinuity that turns a bf16 difference into another expert (on the CPU, with top-2
# of 8, a bf16 rule moved the router and embedding gradients by 0.25; with all 8 by 0.044), hiding the kernel's own.
GDN_SHAPE = dict(
    vocab_size=32768,
    hidden_size=1024,
    num_hidden_layers=8,
    full_attention_interval=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=8,
    linear_num_value_heads=16,
    num_experts=8,
    num_experts_per_tok=8,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=512,
    router_aux_loss_coef=0.0,
    max_position_embeddings=8192,
)
GDN_ROWS = 4
# Max |a - b| over max |b| per parameter group (b: megatron-core's torch rule), and the same for row 0's logits.
# The torch rule computes in fp32 and rounds its output to bf16 once; fla stores its chunk intermediates (A, w, u,
# v_new, the states h) in bf16 (unit roundoff 2^-9), with fp32 accumulators. A torch rule rounding the same tensors
# to bf16 moved a model of this kind (8 layers, GDN heads of 128, 512 tokens, all experts) by at most 4.4e-2 per group
# and 1.9e-2 on the logits (CPU, once); 1e-1 is about twice that. A wrong kernel moves them by O(1), and the
# negative control (half the decay) must exceed it.
GDN_RTOL = 1e-1


def gdn_group(arch, name: str) -> str:
    """A parameter's group for the comparison, from its megatron-core name."""
    import re

    layer = re.search(r"layers\.(\d+)\.", name)
    if "shared_experts" in name:
        return "shared_expert"
    if "experts" in name:
        return "experts"
    if "router" in name:
        return "router"
    if ".self_attention." in name and "layernorm" not in name:
        return "gated_deltanet" if layer and arch.is_linear_layer(int(layer.group(1))) else "gated_attention"
    if "embedding" in name:
        return "embedding"
    return "output_layer" if "output_layer" in name else "norms"


def gdn_kernel_paths(platform_name: str) -> tuple[str, dict]:
    """The two implementations of the chunked gated delta rule (and q/k L2 norm) that megatron-core's ``GatedDeltaNet``
    looks up in its module at every forward (``chunk_gated_delta_rule``, ``l2norm``): on CUDA fla's Triton kernels
    against megatron-core's torch fallback (``torch_chunk_gated_delta_rule``, the project's torch L2 norm); on the
    CPU, where Triton cannot run, transformers' own torch rule against the same fallback. The last path is the
    reference."""
    from megatron.core.ssm import gated_delta_net as gdn

    from megatron_dapo.platform.cpu_shims import _l2norm

    fallback = {"rule": gdn.torch_chunk_gated_delta_rule, "l2norm": _l2norm}
    if platform_name == "cuda":
        from fla.modules.l2norm import l2norm
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        return "fla_vs_megatron_torch", {"fla": {"rule": chunk_gated_delta_rule, "l2norm": l2norm}, "torch": fallback}
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

    # Both paths share the torch L2 norm here: the rule is what differs.
    paths = {"transformers": {"rule": hf.torch_chunk_gated_delta_rule, "l2norm": _l2norm}, "torch": fallback}
    return "transformers_torch_vs_megatron_torch", paths


def gdn_run_path(actor, batch, kernels: dict, platform) -> dict:
    """With ``kernels`` bound into megatron-core's GDN module: the DAPO loss's gradients (``compute_gradients``, after
    a warm-up for Triton's autotuning and the norm's compile), row 0's logits (``compute_log_probs``), the timed
    forward/backward's tokens/s, and how often each kernel was called (wrapped with counters)."""
    from megatron.core.ssm import gated_delta_net as gdn

    calls = {"rule": 0, "l2norm": 0}

    def counted(key):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return kernels[key](*args, **kwargs)

        return wrapper

    saved = gdn.chunk_gated_delta_rule, gdn.l2norm
    gdn.chunk_gated_delta_rule, gdn.l2norm = counted("rule"), counted("l2norm")
    logits: list = []
    try:
        actor.compute_gradients(batch, temperature=1.0)
        warm = calls["rule"]
        _, seconds, peak = phase_peak(platform, lambda: actor.compute_gradients(batch, temperature=1.0))
        rule_calls = calls["rule"] - warm
        grads = gdn_grads(actor)
        head = next(m for n, m in actor.chunks[-1].named_modules() if n.endswith("output_layer"))
        n_valid = int(batch.sequence_lengths[0])  # row 0 is the longest: no padding

        def keep_first(_module, _inputs, out):
            if not logits:
                logits.append(out[0][:n_valid, 0].detach().to("cpu", torch.float32, copy=True))

        hook = head.register_forward_hook(keep_first)
        try:
            actor.compute_log_probs(batch, temperature=1.0)
        finally:
            hook.remove()
    finally:
        gdn.chunk_gated_delta_rule, gdn.l2norm = saved
    tokens = int(batch.sequence_lengths.sum())
    return {
        "grads": grads,
        "logits": logits[0],
        "tokens_per_s": round(tokens / seconds, 1),
        "peak_gb": peak,
        "rule_calls_per_update": rule_calls,
        "calls": dict(calls),
    }


def gdn_control_grads(actor, batch, rule) -> dict:
    """The negative control: gradients with ``rule`` given half the decay (``g``), a plausible mapping bug. Its
    difference from the reference must exceed the tolerance, or the comparison could not see a wrong kernel."""
    from megatron.core.ssm import gated_delta_net as gdn

    saved = gdn.chunk_gated_delta_rule
    gdn.chunk_gated_delta_rule = lambda *args, g, **kwargs: rule(*args, g=0.5 * g, **kwargs)
    try:
        actor.compute_gradients(batch, temperature=1.0)
    finally:
        gdn.chunk_gated_delta_rule = saved
    return gdn_grads(actor)


def gdn_grads(actor) -> dict:
    """Copies of the grad buffers (on the CPU ``.float().cpu()`` of an fp32 buffer is the buffer itself, which the
    next ``compute_gradients`` zeroes)."""
    return {n: p.main_grad.to("cpu", torch.float32, copy=True) for c in actor.chunks for n, p in c.named_parameters()}


def gdn_compare(arch, got: dict, ref: dict) -> dict:
    """Per parameter group: ``max_rel`` = max |Δ| / max |ref| over the group's tensors together (the checked number:
    a small tensor such as A_log, a sum over every token of one head, is measured against its group's scale rather
    than its own), ‖Δ‖ / ‖ref‖ over the group, and the tensor whose own max |Δ| / max |ref| is largest."""
    groups: dict = {}
    for name, g_ref in ref.items():
        row = groups.setdefault(gdn_group(arch, name), {"delta": 0.0, "ref": 0.0, "d2": 0.0, "r2": 0.0, "worst": {}})
        delta = (got[name] - g_ref).abs()
        own = float(delta.max()) / max(float(g_ref.abs().max()), 1e-30)
        if own >= row["worst"].get("rel", -1.0):
            row["worst"] = {"tensor": name.replace("module.", ""), "rel": own}
        row["delta"] = max(row["delta"], float(delta.max()))
        row["ref"] = max(row["ref"], float(g_ref.abs().max()))
        row["d2"] += float(delta.pow(2).sum())
        row["r2"] += float(g_ref.pow(2).sum())
    return {
        k: {
            "max_rel": v["delta"] / max(v["ref"], 1e-30),
            "frobenius_rel": (v["d2"] / max(v["r2"], 1e-30)) ** 0.5,
            "ref_max_abs": v["ref"],
            "worst_tensor": v["worst"],
        }
        for k, v in sorted(groups.items())
    }


def phase_gdn_fla(res, check, ctx) -> None:
    """One Qwen3.5-MoE-shaped update's gradients and logits with the two GDN kernel paths on the same weights and
    batch (``gdn_kernel_paths``), within ``GDN_RTOL``; each path's kernels actually called."""
    from transformers import Qwen3_5MoeTextConfig

    from megatron_dapo.config import load_config
    from megatron_dapo.models.families import model_arch_from_hf

    platform = ctx["platform"]
    arch = model_arch_from_hf(Qwen3_5MoeTextConfig(**ctx["gdn_shape"]).to_dict())
    comparison, paths = gdn_kernel_paths(platform.name)
    log("gdn_fla", comparison=comparison, linear_layers=list(arch.gated_delta_net.linear_layers))
    cfg = load_config(None, ctx["base"] + ["actor.recompute=none"])
    actor = build(cfg, arch, platform)
    batch = make_batch(arch, GDN_ROWS, ctx["gdn_prompt"], ctx["gdn_response"], seed=5)
    micro = -(-GDN_ROWS // cfg.actor.ppo_micro_batch_size_per_gpu)
    expected_calls = len(arch.gated_delta_net.linear_layers) * micro
    runs = {name: gdn_run_path(actor, batch, kernels, platform) for name, kernels in paths.items()}
    got_name, ref_name = list(paths)
    got, ref = runs[got_name], runs[ref_name]
    control = gdn_compare(arch, gdn_control_grads(actor, batch, paths[ref_name]["rule"]), ref["grads"])
    del actor
    release(ctx)
    groups = gdn_compare(arch, got["grads"], ref["grads"])
    control_rel = max(v["max_rel"] for v in control.values())
    logit_delta = float((got["logits"] - ref["logits"]).abs().max()) / float(ref["logits"].abs().max())
    out = {
        "comparison": comparison,
        "tolerance_rel": GDN_RTOL,
        "tokens": int(batch.sequence_lengths.sum()),
        "grad_groups": groups,
        "logits_max_rel": logit_delta,
        "logits_shape": list(ref["logits"].shape),  # [row 0's tokens, vocab]
        "speed_vs_reference": round(got["tokens_per_s"] / ref["tokens_per_s"], 3),
        "control_half_decay_max_rel": control_rel,
        "expected_rule_calls_per_update": expected_calls,
        "paths": {k: {m: v for m, v in r.items() if m not in ("grads", "logits")} for k, r in runs.items()},
    }
    res["gdn_fla"] = out
    for name, r in out["paths"].items():
        log(f"gdn:{name}", tokens_per_s=r["tokens_per_s"], peak_gb=r["peak_gb"], rule_calls=r["rule_calls_per_update"])
    for name, row in groups.items():
        nums = {k: f"{v:.3e}" for k, v in row.items() if k != "worst_tensor"}
        log(f"gdn:{name}", **nums, worst=f"{row['worst_tensor']['tensor']}:{row['worst_tensor']['rel']:.3e}")
    log("gdn:logits", comparison=comparison, max_rel=f"{logit_delta:.3e}", shape=out["logits_shape"], tol=GDN_RTOL)
    log("gdn:speed", **{f"{got_name}_vs_{ref_name}": out["speed_vs_reference"]})
    log(
        "gdn:control",
        half_decay_max_rel=f"{control_rel:.3e}",
        per_group={k: f"{v['max_rel']:.2e}" for k, v in control.items()},
    )
    check("gdn_control_exceeds_tolerance", control_rel > GDN_RTOL, f"half the decay moved grads by {control_rel}")
    for name, r in out["paths"].items():
        ok = r["rule_calls_per_update"] == expected_calls and r["calls"]["l2norm"] > 0
        check(f"gdn_{name}_kernels_called", ok, f"{r['calls']}, rule per update {r['rule_calls_per_update']}")
    bad = {k: v for k, v in groups.items() if not v["max_rel"] <= GDN_RTOL}
    check(f"gdn_{comparison}_grads", not bad and "gated_deltanet" in groups, str(bad or groups))
    check(f"gdn_{comparison}_logits", logit_delta <= GDN_RTOL, f"max rel {logit_delta}")


PHASES = (
    ("init", phase_init),
    ("recompute", phase_recompute),
    ("update", phase_update),
    ("handoff", handoff_sequence),
    ("update_after_handoff", phase_update_after_handoff),
    ("fusions", phase_fusions),
    ("logprob_graph", phase_logprob_graph),
    ("logprobs_8k", phase_logprobs_8k),
    ("dense_3b", phase_dense_3b),
    ("gdn_fla", phase_gdn_fla),
    ("trainer_standin", phase_trainer_standin),
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_check.json")
    # --platform cpu --tiny: a smoke run of this script's code paths on a CPU box (no numbers worth reporting).
    ap.add_argument("--platform", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--phases", default=",".join(name for name, _ in PHASES), help="comma-separated subset")
    args = ap.parse_args()
    global PROMPT, RESPONSE, BATCH, LONG_RESPONSE
    shape_3b, gdn_shape, gdn_prompt, gdn_response = dict(SHAPE_3B), dict(GDN_SHAPE), PROMPT, RESPONSE
    if args.tiny:
        gdn_shape.update(
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            head_dim=16,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=4,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        )
        gdn_prompt, gdn_response = 32, 112  # rows of up to 144 tokens: three of the rule's 64-token chunks
        SHAPE.update(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=96)
        shape_3b.update(vocab_size=512, hidden_size=128, num_layers=3, num_heads=4, intermediate_size=256)
        PROMPT, RESPONSE, BATCH, LONG_RESPONSE = 16, 24, 4, 64
    from megatron_dapo.config import load_config
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.testing.tiny_models import tiny_hf_config

    res: dict = {"failures": [], "checks": {}, "phase_seconds": {}}
    out = Path(args.out)

    def check(name: str, ok: bool, detail: str = "") -> None:
        res["checks"][name] = {"ok": bool(ok), "detail": "" if ok else detail}
        if not ok:
            res["failures"].append(f"{name}: {detail}")
            print(f"[gpu_check] FAILED {name}: {detail}", flush=True)

    base = [
        f"parallel.platform={args.platform}",
        "model.params_dtype=bf16",
        "model.transformer_impl=local",
        "parallel.use_distributed_optimizer=true",
        "actor.ppo_micro_batch_size_per_gpu=2",
        "actor.log_prob_micro_batch_size_per_gpu=1",
        "actor.use_dynamic_bsz=false",
        "actor.optim.lr=1e-6",
    ]
    arch = model_arch_from_hf(tiny_hf_config("qwen2", **SHAPE).to_dict())
    batch = make_batch(arch, BATCH, PROMPT, RESPONSE, seed=0)
    ctx = {
        "cfg": load_config(None, base + ["actor.recompute=none"]),
        "base": base,
        "arch": arch,
        "batch": batch,
        "tokens": int(batch.sequence_lengths.sum()),
        "tiny": args.tiny,
        "shape_3b": shape_3b,
        "gdn_shape": gdn_shape,
        "gdn_prompt": gdn_prompt,
        "gdn_response": gdn_response,
    }
    wanted = set(args.phases.split(","))
    for name, fn in PHASES:
        if name not in wanted and name != "init":
            continue
        started = time.perf_counter()
        try:
            fn(res, check, ctx)
        except Exception as exc:  # noqa: BLE001 - a failed phase is a failed check; the next phase still runs
            check(f"phase_{name}_ran", False, f"{type(exc).__name__}: {exc}")
            res.setdefault("tracebacks", {})[name] = traceback.format_exc()
            print(traceback.format_exc(), flush=True)
            if name == "init":
                break
        res["phase_seconds"][name] = round(time.perf_counter() - started, 1)
        out.write_text(json.dumps(res, indent=1, default=str))  # every number so far, whatever comes next
    for name, c in res["checks"].items():
        print(f"[gpu_check] {'PASS' if c['ok'] else 'FAIL'} {name}{': ' + c['detail'] if c['detail'] else ''}")
    print(f"[gpu_check] wrote {out}; {len(res['checks'])} checks, {len(res['failures'])} failed", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
