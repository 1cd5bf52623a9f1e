#!/usr/bin/env python
"""Check a converted Megatron checkpoint against its HF source: same logits on a random batch.

    torchrun --nproc_per_node=N tools/checkpoint_convert/verify.py --hf-dir H --mcore-dir M --tp T --pp P \
        [--vpp V] [--sp] [--ep E] [--etp T] [--tol 1e-4] [--seed 0]

Builds the megatron-core model at TP×PP (N = T×P×DP; Mixture-of-Experts models: experts split over EP, each
expert's FFN over ETP, N a multiple of ETP×EP×PP; a converted checkpoint has no layout: dist_checkpointing
reads each rank's slices), loads M with ``load_mcore_checkpoint`` (M may also be an HF directory), runs a forward
pass through megatron-core's ``forward_backward_func`` (forward only) and compares the vocabulary-gathered logits
with the HF model (transformers, fp32) on the same batch. Only the first ``vocab_size`` columns are compared: the
columns for the padded vocabulary rows are not logits of any token. The output ends with
``max_abs_logits_diff=<float>``; the exit status is 1 when the difference is above ``--tol``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.config.run_rules import expert_layout_problems, validate_parallel_layout
from megatron_dapo.models.builder import build_gpt_chunks
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.parallel import destroy_model_parallel, init_distributed, init_model_parallel
from megatron_dapo.weights.layout import padded_vocab_size
from megatron_dapo.weights.loading import load_mcore_checkpoint


@dataclass
class VerifyResult:
    max_abs_diff: float
    chunks: list
    arch: object
    cfg: object
    load_report: dict


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True, help="HF model directory (the reference)")
    p.add_argument(
        "--mcore-dir",
        required=True,
        help="what to load: a Megatron distributed checkpoint (convert.py hf-to-mcore, Megatron-LM, a training step)"
        " or an HF directory",
    )
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per pipeline rank")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    p.add_argument("--ep", type=int, default=1, help="expert parallelism (Mixture-of-Experts models)")
    p.add_argument("--etp", type=int, default=None, help="expert tensor parallelism (default: --tp)")
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=4, help="sequences; one per micro-batch")
    p.add_argument("--seq-len", type=int, default=16)
    return p.parse_args(argv)


def _build_and_load(args: argparse.Namespace):
    """Process groups, the model at ``args``' layout, ``--mcore-dir`` loaded into it: (cfg, info, platform, arch,
    chunks, load report)."""
    overrides = [
        f"parallel.tensor_model_parallel_size={args.tp}",
        f"parallel.pipeline_model_parallel_size={args.pp}",
        f"parallel.sequence_parallel={'true' if args.sp else 'false'}",
        f"parallel.expert_model_parallel_size={args.ep}",
        "model.params_dtype=fp32",
        f"model.make_vocab_size_divisible_by={args.make_vocab_size_divisible_by}",
    ]
    if args.vpp:
        overrides.append(f"parallel.virtual_pipeline_model_parallel_size={args.vpp}")
    if args.etp:
        overrides.append(f"parallel.expert_tensor_parallel_size={args.etp}")
    cfg = load_config(None, overrides)
    info, platform = init_distributed(cfg.parallel)
    arch = model_arch_from_hf(args.hf_dir)
    validate_parallel_layout(
        cfg.parallel, info.world_size, arch.num_layers, arch.num_attention_heads, arch.num_query_groups
    )
    expert_problems = expert_layout_problems(cfg.parallel, info.world_size, arch.num_experts, arch.moe_ffn_hidden_size)
    if expert_problems:
        raise ConfigError.of(expert_problems)
    init_model_parallel(cfg.parallel, seed=args.seed + 1)
    chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    report = load_mcore_checkpoint(chunks, arch, args.mcore_dir)
    for c in chunks:
        c.eval()
    return cfg, info, platform, arch, chunks, report


def _megatron_logits(chunks: list, ids: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """Forward-only pass of ``ids`` (one sequence per micro-batch); the vocabulary-gathered logits this rank saw
    (the last pipeline stage's)."""
    # heavy: megatron-core, once the platform has patched it (init_distributed)
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    b, s = ids.shape
    pos = torch.arange(s).unsqueeze(0)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]  # True = masked
    micro = [{"ids": ids[i : i + 1].to(device), "pos": pos.to(device), "mask": causal.to(device)} for i in range(b)]
    logits: list[torch.Tensor] = []

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        out = model(mb["ids"], mb["pos"], mb["mask"])

        def loss_func(output):
            logits.append(gather_from_tensor_model_parallel_region(output).float().cpu())
            return output.sum() * 0.0, {}

        return out, loss_func

    data = [iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro)
    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=b,
            seq_length=s,
            micro_batch_size=1,
            forward_only=True,
        )
    return logits


def run_verify(args: argparse.Namespace) -> VerifyResult:
    from megatron.core import parallel_state as ps  # heavy: megatron-core, once the platform has patched it

    cfg, info, platform, arch, chunks, report = _build_and_load(args)
    b, s = args.batch_size, args.seq_len
    gen = torch.Generator().manual_seed(args.seed)  # same batch on every rank
    ids = torch.randint(0, arch.vocab_size, (b, s), generator=gen)
    logits = _megatron_logits(chunks, ids, platform.device())

    # One rank holds the reference: the last stage's TP rank 0 of data-parallel replica 0.
    is_ref = (
        ps.is_pipeline_last_stage(ignore_virtual=True)
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank() == 0
    )
    diff = torch.zeros(1, dtype=torch.float64)
    if is_ref:
        from transformers import AutoModelForCausalLM  # heavy: transformers, on the reference rank only

        hf = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            ref = hf(ids).logits.float()
        got = torch.cat(logits, dim=0)
        padded = padded_vocab_size(arch.vocab_size, cfg.model.make_vocab_size_divisible_by, args.tp)
        if tuple(got.shape) != (b, s, padded):
            raise RuntimeError(f"Megatron logits have shape {tuple(got.shape)}, expected {(b, s, padded)}")
        # Columns >= vocab_size belong to padding rows, not tokens: excluded from the comparison.
        d = (got[..., : arch.vocab_size] - ref).abs().max().item()
        diff[0] = d if math.isfinite(d) else float("inf")
        print(
            f"reference rank {info.rank}: logits {tuple(got.shape)} (padded vocab {padded}, compared"
            f" {arch.vocab_size} columns)",
            flush=True,
        )
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return VerifyResult(float(diff.item()), chunks, arch, cfg, report)


def main(argv: Optional[Sequence[str]] = None, finalize: bool = True) -> int:
    """Run the check; 0 when within ``--tol``, else 1. ``finalize=False`` keeps the default process group (a
    caller running several checks in one torchrun)."""
    args = parse_args(argv)
    res = run_verify(args)
    rank = dist.get_rank()
    if rank == 0:
        print(
            f"model TP={args.tp} PP={args.pp} VPP={args.vpp} SP={args.sp} EP={args.ep} world={dist.get_world_size()};"
            f" loaded {res.load_report['description']}",
            flush=True,
        )
    dist.barrier()
    destroy_model_parallel()
    ok = res.max_abs_diff <= args.tol
    if rank == 0:
        print(f"max_abs_logits_diff={res.max_abs_diff:.6e}", flush=True)
    if finalize:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
