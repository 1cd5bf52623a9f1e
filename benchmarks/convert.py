#!/usr/bin/env python
"""Benchmark: streaming HF → Megatron distributed checkpoint conversion vs a plain file copy of the same checkpoint.

Makes a ~1 GB Qwen2-shaped HF checkpoint with random fp32 weights, written straight to safetensors shards (no
nn.Module), then in the same run times

* copy:    ``shutil.copyfile`` of every file of the HF directory (the floor for moving the bytes once),
* durable copy: the same followed by an ``fsync`` of every copy (the conversion fsyncs what it publishes: on a disk
           slower than memory, the copy above never waits for the disk and the conversion must),
* durable write: the files' bytes, read into memory beforehand, written with 4 MiB ``write`` calls and fsynced (the
           floor for a writer that makes its bytes in the process, as the conversion does), and
* convert: ``convert_hf_to_mcore`` (a layout-free dist checkpoint) in a child process, which reports its resident
           memory right before converting (baseline, after a warm-up conversion of a tiny checkpoint) and its peak
           (``VmHWM`` from /proc, measured in the child itself: ``getrusage(RUSAGE_CHILDREN)`` in this process would
           count the forked child's copy of this process's memory before it exec'd).

Prints ``convert_vs_copy=<copy_time/convert_time>`` (target >= 0.5), ``convert_vs_durable_copy``,
``convert_vs_durable_write`` and ``peak_rss_mb=.. baseline_rss_mb=.. largest_tensor_mb=..`` (target: peak <= baseline
+ 3 x largest tensor).
Everything generated is deleted at the end.

    python benchmarks/convert.py [--work-dir /tmp] [--layers 16] [--vocab 32000] [--repeats 2]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def warm_pages(path, nbytes: int) -> None:
    """Write then delete ``nbytes`` of page cache right before a timed phase, so that the phase's writes get pages the
    guest has just used. On a VM that reports freed memory to its host (virtio-balloon free page reporting, this box)
    a page left free for seconds is given back, and touching it again costs a host fault (docs/benchmarks.md has the
    same write timed both ways). Every timed phase, the conversion included (its child runs this function's source),
    starts warm, as on hardware without that cost. A 4 MiB block: the child's peak RSS barely moves.
    """
    import os

    block = bytes(4 * 2**20)
    with open(path, "wb", buffering=0) as f:
        for _ in range(-(-nbytes // len(block))):
            f.write(block)
    os.unlink(path)


CHILD = (
    inspect.getsource(warm_pages)
    + r"""
import json, sys, time
from megatron_dapo.weights.convert import convert_hf_to_mcore

def rss_mb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
hf_dir, save_dir, warm_hf, warm_out, warm_path, warm_bytes = sys.argv[1:7]
# Warm-up on a tiny checkpoint: lazily imported modules and first-touched library pages are part of the process,
# not of streaming this checkpoint, so the baseline is taken after them.
convert_hf_to_mcore(warm_hf, warm_out, overwrite=True)
baseline = rss_mb("VmRSS")
warm_pages(warm_path, int(warm_bytes))  # page cache only: not in VmRSS / VmHWM
t0, c0 = time.perf_counter(), time.process_time()
res = convert_hf_to_mcore(hf_dir, save_dir, overwrite=True)
seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "baseline_rss_mb": baseline, "peak_rss_mb": rss_mb("VmHWM"),
                  "num_tensors": res.num_tensors, "num_bytes": res.num_bytes}))
"""
)


def make_checkpoint(
    hf_dir: Path, layers: int, vocab: int, hidden: int, ffn: int, heads: int, kv_heads: int, shards: int
) -> int:
    """Write a Qwen2-shaped fp32 checkpoint (untied) as ``shards`` safetensors files + index; returns largest bytes."""
    import torch
    from safetensors.torch import save_file

    hf_dir.mkdir(parents=True)
    shapes = qwen2_shapes(layers, vocab, hidden, ffn, heads, kv_heads)
    sizes = {n: 4 * int(torch.Size(s).numel()) for n, s in shapes.items()}
    groups = shard_groups(sizes, shards)
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, group in enumerate(groups):
        fn = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(
            {n: torch.randn(shapes[n], generator=gen) * 0.02 for n in group},
            str(hf_dir / fn),
            metadata={"format": "pt"},
        )
        weight_map.update({n: fn for n in group})
    with open(hf_dir / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, f)
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    with open(hf_dir / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    return max(sizes.values())


def qwen2_shapes(
    layers: int, vocab: int, hidden: int, ffn: int, heads: int, kv_heads: int
) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of an untied Qwen2 model, in checkpoint order."""
    hd = hidden // heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (heads * hd, hidden),
                p + "self_attn.q_proj.bias": (heads * hd,),
                p + "self_attn.k_proj.weight": (kv_heads * hd, hidden),
                p + "self_attn.k_proj.bias": (kv_heads * hd,),
                p + "self_attn.v_proj.weight": (kv_heads * hd, hidden),
                p + "self_attn.v_proj.bias": (kv_heads * hd,),
                p + "self_attn.o_proj.weight": (hidden, heads * hd),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "mlp.gate_proj.weight": (ffn, hidden),
                p + "mlp.up_proj.weight": (ffn, hidden),
                p + "mlp.down_proj.weight": (hidden, ffn),
            }
        )
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def shard_groups(sizes: dict[str, int], shards: int) -> list[list[str]]:
    """The tensor names (in order) of each of at most ``shards`` files of about equal size."""
    per_shard = sum(sizes.values()) / shards
    groups: list[list[str]] = [[]]
    acc = 0
    for n in sizes:
        if groups[-1] and acc + sizes[n] > per_shard and len(groups) < shards:
            groups.append([])
            acc = 0
        groups[-1].append(n)
        acc += sizes[n]
    return groups


def copy_dir(src: Path, dst: Path, durable: bool = False) -> tuple[float, float]:
    """Wall and CPU seconds (user + system, this process) of copying every file of ``src`` (and fsyncing each copy
    when ``durable``)."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir()
    os.sync()
    warm_pages(dst.parent / ".warm", dir_bytes(src))
    t0, c0 = time.perf_counter(), time.process_time()
    for p in sorted(src.iterdir()):
        shutil.copyfile(p, dst / p.name)
        if durable:
            fd = os.open(dst / p.name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    return time.perf_counter() - t0, time.process_time() - c0


def dir_bytes(src: Path) -> int:
    return sum(p.stat().st_size for p in src.iterdir())


def write_dir(src: Path, dst: Path) -> float:
    """Wall seconds of writing every file of ``src`` from memory (read beforehand, untimed) with ``write`` calls of
    4 MiB and an fsync of each: the floor for a writer whose bytes are made in the process, as the conversion's are
    (it re-lays q/k/v and stacks layers), where ``copy_dir`` moves them inside the kernel."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir()
    files = {p.name: memoryview(p.read_bytes()) for p in sorted(src.iterdir())}
    os.sync()
    warm_pages(dst.parent / ".warm", dir_bytes(src))
    t0 = time.perf_counter()
    for name, data in files.items():
        with open(dst / name, "wb", buffering=0) as f:
            for off in range(0, len(data), 4 * 2**20):
                f.write(data[off : off + 4 * 2**20])
            os.fsync(f.fileno())
    return time.perf_counter() - t0


def time_copy_and_convert(
    root: Path, hf_dir: Path, warm_hf: Path, repeats: int
) -> tuple[list[float], list[float], list[float], list[float], list[dict]] | None:
    """``repeats`` rounds of a file copy, a durable copy, a durable write from memory and a conversion in a child
    process: ``(copy wall seconds, copy CPU seconds, durable copy wall seconds, durable write wall seconds, the child's
    reports)``, or None (after printing its stderr) if a
    conversion failed."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    copies, copy_cpus, durables, writes, children = [], [], [], [], []
    for _ in range(repeats):
        wall, cpu = copy_dir(hf_dir, root / "copy")
        copies.append(wall)
        copy_cpus.append(cpu)
        durables.append(copy_dir(hf_dir, root / "copy", durable=True)[0])
        writes.append(write_dir(hf_dir, root / "copy"))
        shutil.rmtree(root / "copy")
        # Start each timed phase with no dirty pages from the previous one (both write ~1 GB into the cache).
        os.sync()
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                CHILD,
                str(hf_dir),
                str(root / "mcore"),
                str(warm_hf),
                str(root / "warm_mcore"),
                str(root / ".warm"),
                str(dir_bytes(hf_dir)),
            ],
            env=env,
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return None
        children.append(json.loads(out.stdout.strip().splitlines()[-1]))
        shutil.rmtree(root / "mcore")
    return copies, copy_cpus, durables, writes, children


def report(
    copies: list[float],
    copy_cpus: list[float],
    durables: list[float],
    writes: list[float],
    children: list[dict],
    largest: int,
) -> None:
    """Print the timings, the ``convert_vs_copy`` ratio and the peak memory against its target."""
    converts = [c["seconds"] for c in children]
    copy_t, conv_t = min(copies), min(converts)
    peak = max(c["peak_rss_mb"] for c in children)
    baseline = min(c["baseline_rss_mb"] for c in children)
    print(
        f"copy_seconds={copy_t:.3f} convert_seconds={conv_t:.3f} (all: copy {[round(c, 3) for c in copies]},"
        f" convert {[round(c, 3) for c in converts]}; {children[0]['num_tensors']} tensors,"
        f" {children[0]['num_bytes'] / 2**20:.0f} MiB written)"
    )
    # CPU time is what a shared machine distorts least (wall time includes waiting for a core).
    conv_cpu = min(c["cpu_seconds"] for c in children)
    print(
        f"copy_cpu_seconds={min(copy_cpus):.3f} convert_cpu_seconds={conv_cpu:.3f}"
        f" cpu_ratio={min(copy_cpus) / conv_cpu:.3f}"
    )
    print(f"convert_vs_copy={copy_t / conv_t:.3f}")
    print(
        f"durable_copy_seconds={min(durables):.3f} (all {[round(d, 3) for d in durables]})"
        f" convert_vs_durable_copy={min(durables) / conv_t:.3f}"
    )
    print(
        f"durable_write_seconds={min(writes):.3f} (all {[round(w, 3) for w in writes]})"
        f" convert_vs_durable_write={min(writes) / conv_t:.3f}"
    )
    print(f"peak_rss_mb={peak:.1f} baseline_rss_mb={baseline:.1f} largest_tensor_mb={largest / 2**20:.1f}")
    budget = baseline + 3 * largest / 2**20
    print(
        f"peak_minus_baseline_mb={peak - baseline:.1f} target_peak_mb<={budget:.1f}"
        f" {'OK' if peak <= budget else 'ABOVE TARGET'}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", default=None, help="where to put the generated files (default: system temp)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="best of N for both timings")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="convert_bench_", dir=args.work_dir))
    try:
        hf_dir = root / "hf"
        t0 = time.perf_counter()
        largest = make_checkpoint(
            hf_dir, args.layers, args.vocab, args.hidden, args.ffn, args.heads, args.kv_heads, args.shards
        )
        total = sum(p.stat().st_size for p in hf_dir.iterdir())
        print(
            f"checkpoint: {total / 2**20:.0f} MiB in {args.shards} shards, largest tensor {largest / 2**20:.1f} MiB"
            f" (made in {time.perf_counter() - t0:.1f}s)",
            flush=True,
        )
        warm_hf = root / "warm_hf"
        make_checkpoint(warm_hf, 2, 256, 64, 96, 4, 2, 2)
        timings = time_copy_and_convert(root, hf_dir, warm_hf, args.repeats)
        if timings is None:
            return 1
        report(*timings, largest)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
