#!/usr/bin/env python
"""Benchmark: a training checkpoint save (``CheckpointManager.save``: model + Adam state, manifest) against a plain
file copy of the checkpoint it wrote, in seconds per GB. Saves block training, so this is the step time they cost.

One process (world 1, CPU, gloo): a Qwen2-shaped GPT (fp32, ~60M parameters by default: ~0.7 GB with Adam's two
moments) built the trainer's way, one optimizer step so Adam has its state, then ``--repeats`` timed saves after one
warm-up save (the first save starts megatron-core's ``spawn`` manager: seconds, once per process). The same run then
times, on the last step directory,

* copy:         ``shutil.copyfile`` of every file (the floor for moving the bytes once, nothing made durable), and
* durable copy: the same followed by an ``fsync`` of every file (a save is fsynced before it is published).

Prints ``save_s_per_gb=.. copy_s_per_gb=.. durable_copy_s_per_gb=..`` and the ratios ``save_vs_copy`` and
``save_vs_durable_copy`` (copy time / save time: 1.0 = at copy speed). Everything generated is deleted at the end.

    python benchmarks/checkpoint_save.py [--work-dir /tmp] [--hidden 512] [--layers 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def build(args: argparse.Namespace):
    """(model chunks, optimizer, scheduler) after one optimizer step with random gradients."""
    import torch

    from megatron_dapo.config import OptimConfig, load_config
    from megatron_dapo.models.builder import build_gpt_chunks, wrap_for_training
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.parallel import init_distributed, init_model_parallel
    from megatron_dapo.testing.tiny_models import tiny_hf_config
    from megatron_dapo.training.optimizer import build_optimizer

    cfg = load_config(None, ["model.params_dtype=fp32", "parallel.platform=cpu"])
    init_distributed(cfg.parallel)
    init_model_parallel(cfg.parallel, seed=1)
    hf = tiny_hf_config(
        "qwen2",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        intermediate_size=args.ffn,
    )
    chunks = wrap_for_training(build_gpt_chunks(model_arch_from_hf(hf.to_dict()), cfg), cfg)
    optimizer, scheduler = build_optimizer(chunks, OptimConfig(lr=1e-4, lr_warmup_steps=0), 10)
    gen = torch.Generator().manual_seed(0)
    for chunk in chunks:
        chunk.zero_grad_buffer()
        for p in chunk.parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=gen) * 1e-3)
    optimizer.step()
    scheduler.step(1)
    return chunks, optimizer, scheduler


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def copy_tree(src: Path, dst: Path, durable: bool) -> float:
    """Wall seconds of copying every file of ``src`` (and fsyncing each copy when ``durable``)."""
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    t0 = time.perf_counter()
    for p in sorted(src.rglob("*")):
        target = dst / p.relative_to(src)
        if p.is_dir():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, target)
        if durable:
            fd = os.open(target, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    seconds = time.perf_counter() - t0
    shutil.rmtree(dst)
    return seconds


def timed_saves(root: Path, chunks: list, optimizer, scheduler, repeats: int) -> tuple[list[float], Path]:
    """Wall seconds of ``repeats`` saves (after a warm-up save) and the last step directory."""
    from megatron_dapo.training.checkpoint import CheckpointManager

    manager = CheckpointManager(root / "ckpt", max_ckpt_to_keep=1)
    # warm-up: lazy imports (and, off the CPU, megatron-core's spawn-context results manager)
    manager.save(1, chunks, optimizer, scheduler)
    times, last = [], root
    for i in range(repeats):
        os.sync()  # no dirty pages of the previous save in this one's fsyncs
        t0 = time.perf_counter()
        last = manager.save(2 + i, chunks, optimizer, scheduler)
        times.append(time.perf_counter() - t0)
    return times, last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", default=None, help="where to put the generated files (default: system temp)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="best of N for every timing")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))

    root = Path(tempfile.mkdtemp(prefix="save_bench_", dir=args.work_dir))
    try:
        chunks, optimizer, scheduler = build(args)
        saves, step_dir = timed_saves(root, chunks, optimizer, scheduler, args.repeats)
        gb = dir_bytes(step_dir) / 1e9
        copies = [copy_tree(step_dir, root / "copy", durable=False) for _ in range(args.repeats)]
        durable = [copy_tree(step_dir, root / "copy", durable=True) for _ in range(args.repeats)]
        save_t, copy_t, durable_t = min(saves), min(copies), min(durable)
        print(
            f"checkpoint: {gb:.3f} GB in {sum(1 for p in step_dir.rglob('*') if p.is_file())} files;"
            f" save {[round(s, 3) for s in saves]} s, copy {[round(c, 3) for c in copies]} s,"
            f" durable copy {[round(c, 3) for c in durable]} s"
        )
        print(
            f"save_s_per_gb={save_t / gb:.3f} copy_s_per_gb={copy_t / gb:.3f}"
            f" durable_copy_s_per_gb={durable_t / gb:.3f}"
        )
        print(f"save_vs_copy={copy_t / save_t:.3f} save_vs_durable_copy={durable_t / save_t:.3f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
