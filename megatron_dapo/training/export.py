"""``megatron-dapo export``: a saved training step (dist_checkpointing) → an HF checkpoint.

Runs in one process at TP=PP=1 (dist_checkpointing reshards the model on load, whatever layout trained it), writes
the model in our per-rank format to a temporary directory and converts that with the converter's streaming
``mcore-to-hf`` — the same layout module as every other conversion.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Optional, Union

import yaml

from megatron_dapo.config import ExperimentConfig, from_dict, load_config
from megatron_dapo.training.checkpoint import CONFIG_FILE, STEP_PREFIX, CheckpointError, resolve_resume


def _step_dir(checkpoint: Union[str, Path], step: Optional[int]) -> Path:
    checkpoint = Path(checkpoint)
    if step is not None:
        return resolve_resume(str(checkpoint / f"{STEP_PREFIX}{step}"), None)
    if (checkpoint / CONFIG_FILE).is_file():
        return resolve_resume(str(checkpoint), None)  # already a step directory
    found = resolve_resume("auto", checkpoint)
    if found is None:
        raise CheckpointError(f"{checkpoint}: no complete {STEP_PREFIX}<n> checkpoint found to export")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export_step(
    checkpoint: Union[str, Path],
    save_dir: Union[str, Path],
    step: Optional[int] = None,
    config_path: Optional[Union[str, Path]] = None,
) -> Path:
    """Export ``step`` (default: latest) of ``checkpoint`` to an HF directory ``save_dir``; returns ``save_dir``."""
    step_dir = _step_dir(checkpoint, step)
    if config_path is not None:
        cfg = load_config(config_path)
    else:
        cfg = from_dict(ExperimentConfig, yaml.safe_load((step_dir / CONFIG_FILE).read_text()))
    # One process, no model parallelism: the checkpoint is resharded on load.
    cfg.parallel.tensor_model_parallel_size = 1
    cfg.parallel.pipeline_model_parallel_size = 1
    cfg.parallel.virtual_pipeline_model_parallel_size = None
    cfg.parallel.sequence_parallel = False
    cfg.parallel.use_distributed_optimizer = False
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_PORT", str(_free_port()))

    import torch.distributed as dist

    from megatron_dapo.models.builder import build_gpt_chunks
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.parallel import destroy_model_parallel, init_distributed, init_model_parallel
    from megatron_dapo.training.checkpoint import CheckpointManager
    from megatron_dapo.weights.convert import convert_mcore_to_hf
    from megatron_dapo.weights.mcore_checkpoint import save_mcore_checkpoint

    hf_dir = Path(cfg.model.hf_config_dir or Path(cfg.checkpoint.load_dir) / "hf_config")
    init_distributed(cfg.parallel)
    init_model_parallel(cfg.parallel, seed=cfg.trainer.seed)
    try:
        arch = model_arch_from_hf(hf_dir)
        chunks = build_gpt_chunks(arch, cfg)
        CheckpointManager(step_dir.parent).load(step_dir, chunks, load_optimizer=False, load_rng=False)
        parent = Path(save_dir).parent
        tmp = Path(tempfile.mkdtemp(prefix="export-mcore-", dir=parent if parent.is_dir() else None))
        try:
            mcore_dir = save_mcore_checkpoint(
                chunks, arch, tmp / "mcore", cfg.model.make_vocab_size_divisible_by, hf_config_dir=hf_dir
            )
            if dist.get_rank() == 0:
                convert_mcore_to_hf(mcore_dir, save_dir, hf_config_dir=hf_dir, overwrite=True)
            dist.barrier()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    return Path(save_dir)
