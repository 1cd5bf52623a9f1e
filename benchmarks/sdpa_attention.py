#!/usr/bin/env python
"""Benchmark: the local spec's core attention, ``model.attention_backend=sdpa`` (torch's
``scaled_dot_product_attention``, ``megatron_dapo/models/sdpa_attention.py``) against ``local`` (megatron-core's
``DotProductAttention``, which materialises ``[b, heads, s, s]`` scores and keeps the probabilities for backward),
in update time: one forward + backward of a long sequence.

One process (world 1, CPU, gloo, fp32): a Qwen2-shaped GPT (hidden 512, 8 query heads over 2 KV groups, 4 layers,
vocab 8192 by default) built the trainer's way (``build_gpt_chunks`` + ``wrap_for_training``) once per backend, the
second loaded with the first's weights. Each update is the actor's shape of it: the explicit ``[1, 1, s, s]``
causal mask, a token log-likelihood loss over a ``--batch`` x ``--seq`` batch, backward into megatron-core's grad
buffers. After a warm-up update per backend, ``--repeats`` timed updates alternate between the backends; the best
of each counts. Also printed: the logits' max |difference| between the backends (the same weights: they must agree)
and each update's peak extra resident memory (the kernel's ``VmHWM``, reset through ``/proc/self/clear_refs`` just
before, minus the resident set at that moment).

The last line is ``sdpa_vs_local_update=<local seconds / sdpa seconds>`` (> 1: SDPA is faster).

    python benchmarks/sdpa_attention.py [--seq 2048] [--batch 1] [--hidden 512] [--layers 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

from single_process import add_model_shape_args, single_process_env  # benchmarks/: first on sys.path

BACKENDS = ("sdpa", "local")


def build(args: argparse.Namespace) -> dict:
    """backend -> DDP-wrapped model chunk; every backend holds the same weights."""
    from megatron_dapo.config import load_config
    from megatron_dapo.models.builder import build_gpt_chunks, unwrap, wrap_for_training
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.parallel import init_distributed, init_model_parallel
    from megatron_dapo.testing.tiny_models import tiny_hf_config

    base = ["model.params_dtype=fp32", "parallel.platform=cpu", "model.transformer_impl=local"]
    init_distributed(load_config(None, base).parallel)
    init_model_parallel(load_config(None, base).parallel, seed=1)
    hf = tiny_hf_config(
        "qwen2",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        intermediate_size=args.ffn,
        max_position_embeddings=max(args.seq, 256),
    )
    arch = model_arch_from_hf(hf.to_dict())
    models = {}
    for backend in BACKENDS:
        cfg = load_config(None, [*base, f"model.attention_backend={backend}"])
        models[backend] = wrap_for_training(build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor), cfg.parallel)[0]
    first = unwrap(models[BACKENDS[0]]).state_dict()
    for backend in BACKENDS[1:]:
        unwrap(models[backend]).load_state_dict(first)
    return models


def resident_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def update(model, batch: dict) -> tuple[float, float, object]:
    """(wall seconds, peak extra resident GiB, logits) of one forward + backward."""
    import torch

    model.zero_grad_buffer()
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident set
    before = resident_kib("VmRSS")
    t0 = time.perf_counter()
    logits = model(batch["tokens"], batch["positions"], batch["mask"])
    logp = torch.log_softmax(logits.float(), -1).gather(-1, batch["targets"].unsqueeze(-1))
    (-logp.mean()).backward()
    seconds = time.perf_counter() - t0
    peak = (resident_kib("VmHWM") - before) / 2**20
    return seconds, peak, logits.detach()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    add_model_shape_args(ap, layers=4, vocab=8192)
    ap.add_argument("--repeats", type=int, default=3, help="best of N for each backend")
    args = ap.parse_args()
    single_process_env()
    import torch

    from megatron_dapo.parallel import teardown

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    models = build(args)
    gen = torch.Generator().manual_seed(0)
    batch = {
        "tokens": torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen),
        "targets": torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen),
        "positions": torch.arange(args.seq).expand(args.batch, -1),
        "mask": torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool).triu(1),  # the actor's causal mask
    }
    logits = {b: update(models[b], batch)[2] for b in BACKENDS}  # warm-up
    runs: dict[str, list[tuple[float, float]]] = {b: [] for b in BACKENDS}
    for _ in range(args.repeats):
        for b in BACKENDS:
            runs[b].append(update(models[b], batch)[:2])
    diff = (logits["sdpa"] - logits["local"]).abs().max().item()
    print(
        f"model: hidden {args.hidden}, {args.heads} heads / {args.kv_heads} KV groups, {args.layers} layers, vocab"
        f" {args.vocab}; batch {args.batch} x seq {args.seq}, {os.environ['OMP_NUM_THREADS']} thread(s);"
        f" logits max |sdpa - local| {diff:.2e}"
    )
    for b in BACKENDS:
        times, peaks = [round(t, 3) for t, _ in runs[b]], [round(p, 3) for _, p in runs[b]]
        print(f"{b}: update {times} s, peak extra resident {peaks} GiB")
    best = {b: min(t for t, _ in runs[b]) for b in BACKENDS}
    peak = {b: min(p for _, p in runs[b]) for b in BACKENDS}
    print(f"sdpa_update_s={best['sdpa']:.3f} local_update_s={best['local']:.3f}")
    print(f"sdpa_peak_gib={peak['sdpa']:.3f} local_peak_gib={peak['local']:.3f}")
    print(f"sdpa_vs_local_update={best['local'] / best['sdpa']:.3f}")
    teardown(None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
