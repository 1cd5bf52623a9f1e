"""torchrun worker: a converted Qwen3-MoE checkpoint loaded with megatron-core's ``dist_checkpointing`` (through
``load_mcore_checkpoint``) into models built at other expert layouts, and saved back by megatron-core itself.

For each layout (``ep<E>-tp<T>[-etp<N>][-hf]``) every rank builds the chunks, loads ``--ckpt`` (``-hf``: the HF
directory itself) and compares every local
parameter with the HF tensors mapped through the name map (must be identical), then (``--save`` and the first
layout) saves the model with ``dist_checkpointing.save`` (megatron-core's own sharded layout for EP: each EP rank
writes its block of the experts axis). Writes ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch
import torch.distributed as dist

from tests.helpers.worker import write_rank_report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--layouts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--save", default=None)
    args = ap.parse_args()

    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatron_dapo.config import load_config
    from megatron_dapo.models.builder import build_gpt_chunks
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.parallel import destroy_model_parallel, init_distributed, init_model_parallel
    from megatron_dapo.weights.dist_format import model_sharded_state_dict
    from megatron_dapo.weights.layout import hf_to_mcore, tp_shard
    from megatron_dapo.weights.loading import load_mcore_checkpoint
    from megatron_dapo.weights.model_io import local_param_table, shard_group
    from megatron_dapo.weights.safetensors_io import SafetensorsDir

    arch = model_arch_from_hf(args.hf)
    report, info = {}, None
    for i, name in enumerate(args.layouts.split(",")):
        ep, tp, etp, from_hf = re.fullmatch(r"ep(\d+)-tp(\d+)(?:-etp(\d+))?(-hf)?", name).groups()
        overrides = [
            f"parallel.tensor_model_parallel_size={tp}",
            f"parallel.expert_model_parallel_size={ep}",
            f"parallel.sequence_parallel={'true' if int(tp) > 1 else 'false'}",
            "parallel.platform=cpu",
            "model.params_dtype=fp32",
        ] + ([f"parallel.expert_tensor_parallel_size={etp}"] if etp else [])
        cfg = load_config(None, overrides)
        info, _ = init_distributed(cfg.parallel)
        init_model_parallel(cfg.parallel, seed=1)
        chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
        load_mcore_checkpoint(chunks, arch, args.hf if from_hf else args.ckpt)
        mismatched, compared, experts = [], 0, set()
        with SafetensorsDir(args.hf) as hf:
            for lp in local_param_table(chunks, arch):
                size, rank = shard_group(lp.mapping)
                padded = lp.param.shape[0] * size if lp.mapping.kind == "vocab" else 0
                full = hf_to_mcore(lp.mapping, [hf.get(n) for n in lp.mapping.hf], arch, padded)
                want = tp_shard(full, lp.mapping.kind, lp.mapping.tp_dim, size, rank)
                compared += 1
                if lp.mapping.expert is not None:
                    experts.add(lp.mapping.expert)
                if not torch.equal(lp.param.detach(), want):
                    mismatched.append(lp.local_name)
        report[name] = {
            "rank": info.rank,
            "ep_rank": ps.get_expert_model_parallel_rank(),
            "compared": compared,
            "mismatched": mismatched,
            "experts": sorted(experts),
        }
        if args.save and i == 0:
            sharded = model_sharded_state_dict(chunks, {"non_homogeneous_layers": True})
            Path(args.save).mkdir(parents=True, exist_ok=True)
            dist.barrier()
            dist_checkpointing.save(sharded, args.save)
        destroy_model_parallel()
    write_rank_report(args.out, info.rank, report)


if __name__ == "__main__":
    main()
