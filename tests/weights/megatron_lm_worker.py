"""torchrun worker (2 processes): a checkpoint written exactly as Megatron-LM's ``save_checkpoint`` writes a
model-only one, loaded at another layout, trained one step, saved as a training checkpoint.

1. ``write`` (TP=2): the tiny model, filled from the HF directory, saved by megatron-core's ``dist_checkpointing``
   with Megatron-LM's state dict (``generate_state_dict``: ``args`` — an ``argparse.Namespace`` with a torch dtype
   and a megatron-core enum, as Megatron-LM's holds —, ``checkpoint_version`` 3.0, ``iteration`` 100, ``model``)
   into ``<run>/iter_0000100``; rank 0 writes ``latest_checkpointed_iteration.txt`` = ``100``. No ``hf_config/``:
   Megatron-LM does not write one.
2. ``train`` (PP=2): ``load_mcore_checkpoint(chunks, arch, <run>)``; the parameters are compared with the same
   model loaded from the HF directory; one DAPO update with megatron_dapo's actor; a training checkpoint saved with
   ``CheckpointManager`` (config holding ``model.hf_config_dir``) and loaded again as a ``load_dir`` into a fresh
   model; the trained full tensors go to ``<out>``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def _cfg(hf_dir: str, tp: int, pp: int, save_dir: str = ""):
    from megatron_dapo.config import load_config

    overrides = [
        f"parallel.tensor_model_parallel_size={tp}",
        f"parallel.pipeline_model_parallel_size={pp}",
        "parallel.platform=cpu",
        "model.params_dtype=fp32",
        f"model.hf_config_dir={hf_dir}",
        "actor.ppo_micro_batch_size_per_gpu=4",
        "actor.log_prob_micro_batch_size_per_gpu=4",
    ]
    if save_dir:
        overrides.append(f"checkpoint.save_dir={save_dir}")
    return load_config(None, overrides)


def write(hf_dir: str, run_dir: Path) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.transformer.enums import AttnBackend

    from megatron_dapo.models.builder import build_gpt_chunks
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.parallel import init_distributed, init_model_parallel
    from megatron_dapo.weights.loading import load_hf_into_chunks

    cfg = _cfg(hf_dir, tp=2, pp=1)
    init_distributed(cfg.parallel)
    init_model_parallel(cfg.parallel, seed=1)
    arch = model_arch_from_hf(hf_dir)
    (model,) = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    load_hf_into_chunks([model], arch, hf_dir)
    args = argparse.Namespace(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=1,
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        params_dtype=torch.float32,
        attention_backend=AttnBackend.auto,
        ckpt_format="torch_dist",
        iteration=100,
    )
    state = {"args": args, "checkpoint_version": 3.0, "iteration": 100, "model": model.sharded_state_dict()}
    if dist.get_rank() == 0:
        (run_dir / "iter_0000100").mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(state, str(run_dir / "iter_0000100"))
    if dist.get_rank() == 0:
        (run_dir / "latest_checkpointed_iteration.txt").write_text("100")
    dist.barrier()


def train(hf_dir: str, run_dir: Path, out: Path) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.batch import TrainBatch
    from megatron_dapo.checkpointing.checkpoint import CheckpointManager
    from megatron_dapo.config import to_dict
    from megatron_dapo.models.builder import build_gpt_chunks, wrap_for_training
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.parallel import init_model_parallel
    from megatron_dapo.weights.loading import load_mcore_checkpoint
    from megatron_dapo.weights.model_io import local_param_table
    from tests.distributed.loss_batch import TEMPERATURE, make_batch

    cfg = _cfg(hf_dir, tp=1, pp=2, save_dir=str(out / "train"))
    init_model_parallel(cfg.parallel, seed=1)
    arch = model_arch_from_hf(hf_dir)
    chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    report = load_mcore_checkpoint(chunks, arch, run_dir)
    direct = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    load_mcore_checkpoint(direct, arch, hf_dir)
    differing = [
        n for (n, p), (_, q) in zip(chunks[0].named_parameters(), direct[0].named_parameters()) if not torch.equal(p, q)
    ]
    chunks = wrap_for_training(chunks, cfg.parallel)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0), chunks)
    actor = MegatronActor(chunks, arch.vocab_size, cfg.actor, optimizer=optimizer)
    metrics = actor.update(TrainBatch(**make_batch()), TEMPERATURE).metrics
    step_dir = CheckpointManager(cfg.checkpoint.save_dir).save(1, chunks, optimizer, config=to_dict(cfg))
    trained = {
        lp.mapping.mcore: lp.param.detach().clone() for lp in local_param_table([c.module for c in chunks], arch)
    }
    # The training step is itself a load_dir: a fresh model loaded from it holds the trained weights.
    again = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    step_report = load_mcore_checkpoint(again, arch, step_dir)
    not_restored = [
        n
        for (n, p), (_, q) in zip(chunks[0].module.named_parameters(), again[0].named_parameters())
        if not torch.equal(p, q)
    ]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, trained)
    if dist.get_rank() == 0:
        full: dict = {}
        for part in gathered:
            for k, v in part.items():
                full.setdefault(k, v)
        torch.save(full, out / "trained.pt")
        result = {
            "loaded": report["description"],
            "iteration": report["common"].get("iteration"),
            "args_tp": report["common"]["args"].tensor_model_parallel_size,
            "differing": differing,
            "update_ok": metrics.get("actor/update_ok"),
            "step_dir": str(step_dir),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "step_loaded": step_report["description"],
            "not_restored": not_restored,
        }
        (out / "result.json").write_text(json.dumps(result))
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from megatron_dapo.parallel import destroy_model_parallel

    write(a.hf_dir, Path(a.run_dir))
    destroy_model_parallel()
    train(a.hf_dir, Path(a.run_dir), Path(a.out))
    destroy_model_parallel()
    dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print("WORKER_OK", flush=True)


if __name__ == "__main__":
    main()
