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
   engine (no vLLM here): device memory after each boundary, bytes moved, and bit-exactness of every parameter, grad
   buffer and optimizer tensor after the round trip (checksums against host copies).
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

    # 4. memory hand-off: every component off the GPU and back, bit-exactly
    from dataclasses import replace

    from megatron_dapo.training.offload import MemoryHandoff, resolve_handoff_plan

    class StandInEngine:  # no vLLM on this machine: record the calls
        calls: list = []

        def wake_up(self, tags=None):
            self.calls.append(("wake", tuple(tags or ())))

        def sleep(self, level=1):
            self.calls.append(("sleep", level))

    def host_state():
        from megatron_dapo.training.offload import grad_tensors, optimizer_tensors, param_tensors

        return [
            t.detach().cpu().clone()
            for t in param_tensors(actor.chunks)
            + grad_tensors(actor.chunks, actor.optimizer)
            + optimizer_tensors(actor.optimizer, exclude=param_tensors(actor.chunks))
        ]

    plan = replace(
        resolve_handoff_plan(cfg, platform),
        params=True,
        grads=True,
        optimizer=True,
        reference=True,
        keep_grad_values=True,
    )
    handoff = MemoryHandoff(platform, plan, actor.chunks, actor.optimizer, ref)
    before = host_state()
    mem = {"start": platform.memory_allocated_gb()}
    engine = StandInEngine()

    def sync():
        mem["at_sync"] = platform.memory_allocated_gb()

    _, secs_off, _ = phase_peak(platform, lambda: handoff.before_rollout(engine, sync))
    mem["rollout"] = platform.memory_allocated_gb()
    handoff.after_rollout(engine)
    mem["old_log_probs"] = platform.memory_allocated_gb()
    handoff.before_reference()
    mem["reference"] = platform.memory_allocated_gb()
    handoff.after_reference()
    _, secs_on, _ = phase_peak(platform, handoff.before_update)
    mem["update"] = platform.memory_allocated_gb()
    after = host_state()
    exact = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    moved = {k: round(v / 2**30, 3) for k, v in handoff.offloader.stats.bytes.items()}
    res["handoff"] = {"memory_allocated_gb": mem, "moved_gb": moved, "offload_s": secs_off, "onload_s": secs_on}
    check("handoff_bit_exact", exact, "a tensor changed across the offload/onload round trip")
    if args.platform == "cuda":  # CPU: the "device" is host memory, nothing is freed
        check("handoff_frees", mem["rollout"] < mem["start"] - 0.9 * sum(moved.values()), str(mem))
    log("handoff", **{f"mem_{k}_gb": round(v, 2) for k, v in mem.items()}, moved_gb=moved, offload_s=round(secs_off, 2))
    # one more update after the hand-off must still work
    metrics, _, _ = phase_peak(platform, lambda: actor.update(batch, temperature=1.0))
    check("update_after_handoff", metrics.get("actor/update_ok", 1.0) == 1.0, str(metrics.get("nonfinite")))

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
