"""Peak extra memory of the response log-prob computation for long responses: gathered path vs chunked path.

For each response length T (batch 1, a short prompt before it) the full-sequence logits ``[1, s, V]`` are made in
the dtype the model emits (bf16 by default), then one of three paths computes log-probs and entropy at the
response positions, forward and then backward of ``Σ w·logp + Σ w'·H`` (entropy gradient on: the worst case):

- ``gathered``: ``torch.gather`` of the response rows + ``vocab_parallel_log_probs`` (the path being replaced);
- ``chunked``: ``response_log_probs`` with a newly allocated gradient for the logits;
- ``chunked_inplace``: ``response_log_probs(grad_into_logits=True)``, the gradient takes the logits' storage (the
  actor's wiring; the logits are not read after the loss hook's backward).

Each case runs in a fresh subprocess. On CPU the peak is the kernel's resident-set high-water mark (``VmHWM``),
reset through ``/proc/self/clear_refs`` just before the computation, minus the resident set at that moment; on CUDA
it is ``torch.cuda.max_memory_allocated`` minus the memory allocated before. The peak is printed against the size of
one fp32 ``[T, V]`` logits tensor. The last line is ``long_response_peak_vs_logits=<largest ratio over the lengths
and over forward / forward+backward for chunked_inplace>``.

Usage: ``python benchmarks/long_response.py [--lengths 1024 4096 16384] [--vocab 8192] [--chunk-tokens 64]
[--dtype bf16|fp32] [--device cpu|cuda]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from megatron_dapo import dtypes

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT_LEN = 128
PATHS = ("gathered", "chunked", "chunked_inplace")


def _proc_status_kib(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


class PeakMemory:
    """Peak bytes above the level at ``start()``: CUDA allocator statistics, or the CPU resident-set high-water mark."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
            self.base = _proc_status_kib("VmRSS") * 1024

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return _proc_status_kib("VmHWM") * 1024 - self.base


def forward_backward(path, logits, index, tokens, weights, chunk_tokens: int, memory: PeakMemory) -> dict:
    """One path: peak extra bytes after the forward and after forward+backward (gradient w.r.t. ``logits``)."""
    from megatron_dapo.algo.logprobs import response_log_probs, vocab_parallel_log_probs

    vocab = logits.shape[-1]
    memory.start()
    if path == "gathered":
        rows = torch.gather(logits, 1, index.unsqueeze(-1).expand(-1, -1, vocab))
        log_probs, entropy = vocab_parallel_log_probs(rows, tokens, vocab, temperature=0.9)
    else:
        log_probs, entropy = response_log_probs(
            logits, index, tokens, vocab, 0.9, chunk_tokens=chunk_tokens, grad_into_logits=path == "chunked_inplace"
        )
    forward_peak = memory.peak()
    objective = (log_probs * weights[0]).sum() + (entropy * weights[1]).sum()
    (grad,) = torch.autograd.grad(objective, logits)
    both_peak = memory.peak()
    assert grad.shape == logits.shape and bool(torch.isfinite(log_probs).all())
    return {"forward": forward_peak, "forward_backward": both_peak}


def run_case(path: str, length: int, vocab: int, chunk_tokens: int, dtype: torch.dtype, device: torch.device) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(1, PROMPT_LEN + length, vocab, generator=g, device=device, dtype=dtype) * 2
    index = (PROMPT_LEN - 1 + torch.arange(length, device=device)).unsqueeze(0)
    tokens = torch.randint(0, vocab, (1, length), generator=g, device=device)
    weights = torch.randn(2, 1, length, generator=g, device=device)
    memory = PeakMemory(device)
    # Warm-up on a short slice: the first calls of some kernels map code pages and workspaces, which are not ours.
    warm = logits[:, : PROMPT_LEN + 64].clone().requires_grad_(True)
    forward_backward(path, warm, index[:, :64], tokens[:, :64], weights[..., :64], chunk_tokens, memory)
    del warm
    return forward_backward(path, logits.requires_grad_(True), index, tokens, weights, chunk_tokens, memory)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--chunk-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--case", nargs=2, metavar=("PATH", "LENGTH"), help=argparse.SUPPRESS)  # the subprocess mode
    args = ap.parse_args()
    dtype, device = dtypes.from_config_name(args.dtype, "--dtype"), torch.device(args.device)

    if args.case:
        path, length = args.case[0], int(args.case[1])
        print(json.dumps(run_case(path, length, args.vocab, args.chunk_tokens, dtype, device)))
        return

    print(f"vocab {args.vocab}, logits {args.dtype}, chunk_tokens {args.chunk_tokens}, device {device}, batch 1")
    print(
        f"{'T':>6} {'fp32 [T,V]':>11} {'path':>16} {'fwd MiB':>9} {'fwd/logits':>11} {'fwd+bwd MiB':>12} {'ratio':>7}"
    )
    worst = 0.0
    # A fixed mmap threshold: glibc then returns every large freed block to the kernel at once (by default it
    # raises the threshold after the first free and keeps later blocks in its heap), so the resident set follows
    # the live tensors.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    for length in args.lengths:
        logits_bytes = length * args.vocab * 4
        for path in PATHS:
            cmd = [sys.executable, __file__, "--case", path, str(length)]
            cmd += ["--vocab", str(args.vocab), "--chunk-tokens", str(args.chunk_tokens)]
            cmd += ["--dtype", args.dtype, "--device", args.device]
            out = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                sys.exit(f"case {path} T={length} failed:\n{out.stderr[-3000:]}")
            peaks = json.loads(out.stdout.strip().splitlines()[-1])
            fwd, both = peaks["forward"] / logits_bytes, peaks["forward_backward"] / logits_bytes
            if path == "chunked_inplace":
                worst = max(worst, fwd, both)
            print(
                f"{length:>6} {logits_bytes / 2**20:>9.0f}Mi {path:>16} {peaks['forward'] / 2**20:>9.1f} {fwd:>11.3f} "
                f"{peaks['forward_backward'] / 2**20:>12.1f} {both:>7.3f}",
                flush=True,
            )
    print(f"long_response_peak_vs_logits={worst:.3f}")


if __name__ == "__main__":
    main()
