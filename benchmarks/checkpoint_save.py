#!/usr/bin/env python
"""Benchmark: a training checkpoint save (``CheckpointManager.save``: model + Adam state, manifest) against writing
the same bytes without a checkpointer, in seconds per GB. Saves block training, so this is the step time they cost.

One process (world 1, CPU, gloo): a Qwen2-shaped GPT (fp32, ~60M parameters by default: ~0.7 GB with Adam's two
moments) built the trainer's way, one optimizer step so Adam has its state, one warm-up save of each kind (the first
save imports lazily and makes the host staging buffer of background saves), then ``--repeats`` rounds of:

* save:          a synchronous ``save`` (what ``save_vs_*`` compare),
* background:    ``save(blocking=False)`` (the blocking part: until training may go on) and the ``finalize`` that
                 waits for its files and publishes it,
* plain write:   the bytes of the last step directory's files, read into memory beforehand, written into files of the
                 same layout and sizes with 4 MiB ``write`` calls, each file fsynced (the floor for a writer whose bytes
                 are in memory, as a save's are),
* copy:          ``shutil.copyfile`` of every file of the last step directory (nothing made durable), and
* durable copy:  the same followed by an ``fsync`` of every file.

Every timed phase starts with no dirty pages (``os.sync``) and freshly used free pages (``convert.warm_pages``: this
VM gives free memory back to its host, and touching a page it took back costs a host fault). Prints every timing's
min and median, ``save_s_per_gb=.. copy_s_per_gb=.. durable_copy_s_per_gb=..``, ``plain_write_s_per_gb``,
``save_blocking_s_per_gb`` and ``background_total_s_per_gb``, the ratios ``save_vs_copy`` and
``save_vs_durable_copy`` (copy time / save time: 1.0 = at copy speed), and last ``save_vs_plain_write`` (plain-write
time / save time); ratios from the min of each. Everything generated is deleted at the end.

    python benchmarks/checkpoint_save.py [--work-dir /tmp] [--hidden 512] [--layers 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import inspect
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from convert import warm_pages  # benchmarks/ is the script's directory, first on sys.path
from single_process import add_model_shape_args, single_process_env  # benchmarks/: first on sys.path


def build(args: argparse.Namespace):
    """(model chunks, optimizer, scheduler) after one optimizer step with random gradients."""
    import torch

    from megatron_dapo.actor.optimizer import build_optimizer
    from megatron_dapo.config import OptimConfig, load_config
    from megatron_dapo.models.builder import build_gpt_chunks, wrap_for_training
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.parallel import init_distributed, init_model_parallel
    from megatron_dapo.testing.tiny_models import tiny_hf_config

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
    chunks = wrap_for_training(build_gpt_chunks(model_arch_from_hf(hf.to_dict()), cfg), cfg.parallel)
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


def fresh_start(root: Path, nbytes: int) -> None:
    """No dirty pages of the previous phase, and ``nbytes`` of recently used free pages (``warm_pages``)."""
    os.sync()
    warm_pages(root / ".warm", nbytes)


def copy_tree(src: Path, dst: Path, durable: bool, nbytes: int) -> float:
    """Wall seconds of copying every file of ``src`` (and fsyncing each copy when ``durable``)."""
    shutil.rmtree(dst, ignore_errors=True)
    fresh_start(dst.parent, nbytes)
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


def read_tree(src: Path) -> dict[Path, memoryview]:
    """Every file of ``src`` in memory, by relative path."""
    return {p.relative_to(src): memoryview(p.read_bytes()) for p in sorted(src.rglob("*")) if p.is_file()}


def plain_write(files: dict[Path, memoryview], dst: Path, nbytes: int) -> float:
    """Wall seconds of writing ``files`` from memory under ``dst`` (their directories made as they come) with 4 MiB
    ``write`` calls, each file fsynced."""
    shutil.rmtree(dst, ignore_errors=True)
    fresh_start(dst.parent, nbytes)
    t0 = time.perf_counter()
    for rel, data in files.items():
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        with open(dst / rel, "wb", buffering=0) as f:
            for off in range(0, len(data), 4 * 2**20):
                f.write(data[off : off + 4 * 2**20])
            os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    shutil.rmtree(dst)
    return seconds


class Saves:
    """The saves of one manager, every one started fresh (``fresh_start``); steps numbered as they come."""

    def __init__(self, root: Path, chunks: list, optimizer, scheduler) -> None:
        from megatron_dapo.checkpointing.checkpoint import CheckpointManager

        self.root, self.model = root, (chunks, optimizer, scheduler)
        self.manager = CheckpointManager(root / "ckpt", max_ckpt_to_keep=1)
        # A checkpointer without background saves blocks for all of a save (to compare revisions).
        self.background = "blocking" in inspect.signature(self.manager.save).parameters
        self.step, self.last, self.nbytes = 0, root, 0

    def settle(self) -> None:
        """Wait for the deletion of the checkpoint the last save rotated out (a background thread of the manager)."""
        getattr(self.manager, "wait_for_cleanup", lambda: None)()

    def _fresh(self) -> None:
        self.settle()
        fresh_start(self.root, self.nbytes)

    def sync(self) -> float:
        """Wall seconds of a synchronous save."""
        self._fresh()
        self.step += 1
        t0 = time.perf_counter()
        self.last = self.manager.save(self.step, *self.model)
        return time.perf_counter() - t0

    def background_save(self) -> tuple[float, float]:
        """Wall seconds of a background save's blocking part, and of all of it (blocking part + ``finalize``)."""
        if not self.background:
            seconds = self.sync()
            return seconds, seconds
        self._fresh()
        self.step += 1
        t0 = time.perf_counter()
        self.manager.save(self.step, *self.model, blocking=False)
        blocking = time.perf_counter() - t0
        self.last = self.manager.finalize()
        return blocking, time.perf_counter() - t0


def report(t: dict[str, list[float]], gb: float, num_files: int) -> None:
    """Every timing's min and median, the seconds per GB and the ratios (from each timing's min)."""
    print(f"checkpoint: {gb:.3f} GB in {num_files} files")
    labels = {"save": "save", "blocking": "background save, blocking part", "background": "background save, all"}
    labels.update(plain="plain durable write", copy="copy", durable="durable copy")
    for key, label in labels.items():
        all_of = ", ".join(f"{x:.3f}" for x in t[key])
        print(f"{label}: min {min(t[key]):.3f} median {statistics.median(t[key]):.3f} s ({all_of})")
    best = {k: min(v) for k, v in t.items()}
    per_gb = {k: v / gb for k, v in best.items()}
    print(
        f"save_s_per_gb={per_gb['save']:.3f} copy_s_per_gb={per_gb['copy']:.3f}"
        f" durable_copy_s_per_gb={per_gb['durable']:.3f} plain_write_s_per_gb={per_gb['plain']:.3f}"
    )
    print(f"save_blocking_s_per_gb={per_gb['blocking']:.3f} background_total_s_per_gb={per_gb['background']:.3f}")
    print(f"save_vs_copy={best['copy'] / best['save']:.3f} save_vs_durable_copy={best['durable'] / best['save']:.3f}")
    print(f"save_vs_plain_write={best['plain'] / best['save']:.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", default=None, help="where to put the generated files (default: system temp)")
    add_model_shape_args(ap, layers=8, vocab=32000)
    ap.add_argument("--repeats", type=int, default=5, help="rounds of every timing (ratios: best of N)")
    args = ap.parse_args()
    single_process_env()

    root = Path(tempfile.mkdtemp(prefix="save_bench_", dir=args.work_dir))
    saves = None
    try:
        saves = Saves(root, *build(args))
        saves.sync()  # warm-up: lazy imports (and, off the CPU, megatron-core's spawn-context results manager)
        saves.background_save()  # warm-up: the host staging buffer, kept for the run
        saves.nbytes = dir_bytes(saves.last)
        files = read_tree(saves.last)
        gb = saves.nbytes / 1e9
        t: dict[str, list[float]] = {k: [] for k in ("save", "blocking", "background", "plain", "copy", "durable")}
        for _ in range(args.repeats):
            t["save"].append(saves.sync())
            blocking, total = saves.background_save()
            t["blocking"].append(blocking)
            t["background"].append(total)
            saves.settle()
            t["plain"].append(plain_write(files, root / "plain", saves.nbytes))
            t["copy"].append(copy_tree(saves.last, root / "copy", False, saves.nbytes))
            t["durable"].append(copy_tree(saves.last, root / "copy", True, saves.nbytes))
        report(t, gb, len(files))
    finally:
        if saves is not None:
            saves.settle()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
