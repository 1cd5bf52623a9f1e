"""GPU check, run by hand on one NVIDIA GPU (``bash tests/gpu/run.sh``); not part of the pytest suite (pytest only
collects ``test_*.py``) and never run in CI, which has no GPU.

Megatron-core side only (no vLLM, no TransformerEngine needed: ``model.transformer_impl=local``), world size 1,
bf16, a Qwen2-shaped model with random weights of about 0.63B parameters (Qwen2.5-0.5B's shape, untied output
layer). It checks, and prints a line per phase with tokens/s and the allocator's peak memory:

1. ``init``: the platform's mixed default group (``cpu:gloo,cuda:nccl``): an all-reduce of a CUDA tensor and of a
   CPU tensor on the default group; whether ``parallel.control_group()`` was still created.
2. ``recompute``: the same DAPO-loss gradients with ``actor.recompute=none`` and ``full`` (max |diff| printed,
   bf16 so tolerance 0 is not required), and the update-phase peak memory of each.
3. ``update``: ``MegatronActor.update`` (forward/backward with the DAPO loss hook + optimizer step) on a batch of
   prompt 512 + response 1536 tokens; tokens/s.
4. ``handoff``: ``training.offload.MemoryHandoff`` with every component offloaded (params too) around a stand-in
   engine that holds real device memory (no vLLM here), through start-up, a step and a save: at each boundary the
   allocator's bytes against the device-memory ledger's accounting of the same objects
   (``testing/device_ledger.state_holders``), each phase's peak, bit-exactness of every parameter, grad buffer and
   optimizer tensor after the round trip, and the pinned host buffers (one per component, exactly sized, against
   what the caching host allocator would reserve for one pinned buffer per storage).
   ``bf16_fused`` / ``bf16_unfused``: forward/backward tokens/s with the platform's fused kernels and with none.
5. ``logprobs_8k``: ``MegatronActor.compute_log_probs`` on 8192-token responses (chunked log-probs from
   ``algo.logprobs.response_log_probs``), and ``response_log_probs`` forward+backward on [8704, 151936] bf16 logits
   against a float32 ``log_softmax`` reference; peak memory of each.

Writes ``--out`` (JSON) with every number; exits non-zero on a failed check.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
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
PROMPT, RESPONSE, BATCH = 512, 1536, 8
LONG_RESPONSE = 8192


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
    from megatron_dapo.models.builder import build_gpt_chunks, freeze, wrap_for_training
    from megatron_dapo.training.actor import MegatronActor
    from megatron_dapo.training.optimizer import build_optimizer

    platform.seed(1)
    chunks = wrap_for_training(build_gpt_chunks(arch, cfg), cfg)
    optimizer, _ = build_optimizer(chunks, cfg.actor.optim, total_steps=100)
    actor = MegatronActor(chunks, arch.vocab_size, cfg.actor, optimizer)
    ref = freeze(build_gpt_chunks(arch, cfg))
    return actor, ref


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


def handoff_sequence(res, check, cfg, arch, platform, actor, ref, tiny: bool) -> None:
    """Start-up, one step's phase boundaries and a save with the CUDA plan (grads, optimizer and reference
    offloaded) plus params, around a stand-in engine that holds real device memory. At every boundary the device's
    allocated bytes must equal the ledger's accounting of the same objects (``testing/device_ledger.state_holders``
    + the engine) up to the constant rest (the batch, RNG states); the peak of each phase is printed beside it.
    Every tensor must be bit-identical after the round trip, and each offloaded component's pinned host buffer must
    be exactly its storages' size."""
    from dataclasses import replace

    from megatron_dapo.config.plan import resolve_handoff_plan
    from megatron_dapo.testing.device_ledger import state_holders
    from megatron_dapo.training.offload import (
        MemoryHandoff,
        grad_tensors,
        optimizer_tensors,
        param_tensors,
    )

    def host_state():
        tensors = param_tensors(actor.chunks) + grad_tensors(actor.chunks, actor.optimizer)
        tensors += optimizer_tensors(actor.optimizer, exclude=param_tensors(actor.chunks))
        return [t.detach().cpu().clone() for t in tensors]

    plan = replace(resolve_handoff_plan(cfg, platform), params=True, keep_grad_values=True)
    handoff = MemoryHandoff(platform, plan, actor.chunks, actor.optimizer)
    engine = StandInEngine(2**20 if tiny else 8 * 2**30, platform.device())
    before = host_state()
    rows: dict = {}

    def boundary(name: str) -> None:
        platform.synchronize()
        predicted = sum(state_holders(handoff).values()) + engine.held_bytes()
        real = torch.cuda.memory_allocated() if torch.cuda.is_available() else predicted
        rows[name] = {"real_gb": real / 2**30, "ledger_gb": predicted / 2**30, "rest_mb": (real - predicted) / 2**20}
        rows[name]["peak_gb"] = platform.peak_memory_gb()
        platform.reset_peak_memory()

    platform.reset_peak_memory()
    boundary("built")
    handoff.before_engine_start()
    boundary("startup")
    engine.wake_up()
    boundary("engine_start")
    handoff.after_engine_start(engine)
    handoff.attach_reference(ref)
    boundary("reference_built")
    handoff.before_rollout(engine, lambda: boundary("weight_sync"))
    boundary("rollout")
    handoff.after_rollout(engine)
    boundary("old_log_probs")
    handoff.before_reference()
    boundary("reference")
    handoff.after_reference()
    handoff.before_update()
    boundary("update")
    handoff.before_save(engine)
    boundary("save")
    handoff.after_save()
    rest = [r["rest_mb"] for r in rows.values()]
    res["handoff"] = {"boundaries": rows, "moved_gb": {k: v / 2**30 for k, v in handoff.offloader.stats.bytes.items()}}
    for name, r in rows.items():
        log(f"handoff:{name}", **{k: round(v, 3) for k, v in r.items()})
    check("ledger_matches_allocator", max(rest) - min(rest) <= 16, f"rest varies by {max(rest) - min(rest):.1f} MiB")
    check("handoff_bit_exact", all(torch.equal(a, b) for a, b in zip(before, host_state())), "a tensor changed")
    pinned_buffers(res, check, handoff)


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
        actor, ref = build(cfg, arch, platform)
        times = []
        for _ in range(3):  # the first includes torch.compile of the fused functions
            _, secs, peak = phase_peak(platform, lambda a=actor: a.compute_gradients(batch, temperature=1.0))
            times.append(secs)
        speeds[name] = {"tokens_per_s": round(tokens / min(times[1:]), 1), "peak_gb": peak, "first_s": times[0]}
        log(f"bf16_{name}", **speeds[name])
        del actor, ref
        platform.empty_cache()
    platform.transformer_config_overrides = own
    res["fusions"] = speeds
    res["fusions"]["fused_vs_unfused"] = round(speeds["fused"]["tokens_per_s"] / speeds["unfused"]["tokens_per_s"], 3)
    check("fused_not_slower", speeds["fused"]["tokens_per_s"] >= 0.9 * speeds["unfused"]["tokens_per_s"], str(speeds))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_check.json")
    # --platform cpu --tiny: a smoke run of this script's code paths on a CPU box (no numbers worth reporting).
    ap.add_argument("--platform", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    global PROMPT, RESPONSE, BATCH, LONG_RESPONSE
    if args.tiny:
        SHAPE.update(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=96)
        PROMPT, RESPONSE, BATCH, LONG_RESPONSE = 16, 24, 4, 64
    from megatron_dapo.config import load_config
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.parallel import control_group, init_distributed, init_model_parallel
    from megatron_dapo.testing.tiny_models import tiny_hf_config

    res: dict = {"failures": []}

    def check(name: str, ok: bool, detail: str = "") -> None:
        res[f"check/{name}"] = bool(ok)
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
    cfg = load_config(None, base + ["actor.recompute=none"])
    # 1. platform + mixed default group
    info, platform = init_distributed(cfg.parallel)
    init_model_parallel(cfg.parallel, seed=1)
    res["backend"] = str(dist.get_backend())
    res["control_group_created"] = control_group() is not None
    x_gpu = torch.ones(4, device=platform.device())
    x_cpu = torch.ones(4)
    dist.all_reduce(x_gpu)
    dist.all_reduce(x_cpu)  # a gloo-only or nccl-only default group would refuse one of the two
    check("mixed_backend", float(x_gpu.sum()) == 4.0 and float(x_cpu.sum()) == 4.0, res["backend"])
    device = torch.cuda.get_device_name() if args.platform == "cuda" else "cpu"
    log("init", backend=res["backend"], control_group_created=res["control_group_created"], device=device)

    arch = model_arch_from_hf(tiny_hf_config("qwen2", **SHAPE).to_dict())
    batch = make_batch(arch, BATCH, PROMPT, RESPONSE, seed=0)
    tokens = int(batch.sequence_lengths.sum())

    # 2. recompute: same gradients, less memory
    grads = {}
    for mode in ("none", "full"):
        cfg = load_config(None, base + [f"actor.recompute={mode}", "actor.recompute_num_layers=1"])
        actor, ref = build(cfg, arch, platform)
        res["params"] = sum(p.numel() for c in actor.chunks for p in c.parameters())
        _, secs, peak = phase_peak(platform, lambda a=actor: a.compute_gradients(batch, temperature=1.0))
        grads[mode] = [p.main_grad.detach().float().cpu() for c in actor.chunks for p in c.parameters()]
        res[f"recompute_{mode}"] = {"peak_gb": peak, "tokens_per_s": round(tokens / secs, 1)}
        log(f"recompute={mode}", peak_gb=peak, tokens_per_s=round(tokens / secs, 1))
        if mode == "none":
            del actor, ref
            platform.empty_cache()
    diff = max(float((a - b).abs().max()) for a, b in zip(grads["none"], grads["full"]))
    scale = max(float(a.abs().max()) for a in grads["none"])
    res["recompute_grad_max_diff"], res["grad_max_abs"] = diff, scale
    check("recompute_same_grads", diff <= 1e-2 * scale, f"max diff {diff} vs max |grad| {scale}")
    check(
        "recompute_saves_memory",
        args.tiny or res["recompute_full"]["peak_gb"] < res["recompute_none"]["peak_gb"],
        str((res["recompute_full"], res["recompute_none"])),
    )
    check("params_at_least_0.5B", args.tiny or res["params"] >= 5e8, str(res["params"]))

    # 3. update (forward/backward with the DAPO loss hook + optimizer step), recompute=full actor
    times = []
    for step in range(3):
        metrics, secs, peak = phase_peak(platform, lambda: actor.update(batch, temperature=1.0))
        times.append(secs)
        check(f"update_{step}_applied", metrics.get("actor/update_ok", 1.0) == 1.0, str(metrics.get("nonfinite")))
    res["update"] = {"peak_gb": peak, "tokens_per_s": round(tokens / min(times), 1), "seconds": times}
    log("update", peak_gb=peak, tokens_per_s=res["update"]["tokens_per_s"], params=res["params"])

    # 4. memory hand-off under real device memory: start-up, a step and a save, against the ledger's accounting
    handoff_sequence(res, check, cfg, arch, platform, actor, ref, args.tiny)
    # one more update after the hand-off must still work
    metrics, _, _ = phase_peak(platform, lambda: actor.update(batch, temperature=1.0))
    check("update_after_handoff", metrics.get("actor/update_ok", 1.0) == 1.0, str(metrics.get("nonfinite")))
    del actor, ref
    platform.empty_cache()

    # 4b. bf16 forward/backward with the platform's fused kernels and with none
    fusion_speed(res, check, base, arch, platform, batch, tokens)
    cfg = load_config(None, base + ["actor.recompute=full", "actor.recompute_num_layers=1"])
    actor, ref = build(cfg, arch, platform)

    # 5. chunked log-probs at 8k-token responses
    long_batch = make_batch(arch, 1, PROMPT, LONG_RESPONSE, seed=1)
    out, secs, peak = phase_peak(platform, lambda: actor.compute_log_probs(long_batch, temperature=1.0))
    lp = out["log_probs"] if isinstance(out, dict) else out
    check("logprobs_8k_finite", bool(torch.isfinite(lp[long_batch.response_mask.bool()]).all()), "non-finite")
    res["logprobs_8k"] = {"peak_gb": peak, "tokens_per_s": round((PROMPT + LONG_RESPONSE) / secs, 1)}
    log("logprobs_8k", peak_gb=peak, tokens_per_s=res["logprobs_8k"]["tokens_per_s"])

    from megatron_dapo.algo.logprobs import response_log_probs

    seq = PROMPT + LONG_RESPONSE
    dev = platform.device()
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

    Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    print(f"[gpu_check] wrote {args.out}; failures: {len(res['failures'])}", flush=True)
    dist.destroy_process_group()
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
