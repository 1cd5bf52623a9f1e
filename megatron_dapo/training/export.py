"""``megatron-dapo export``: any Megatron checkpoint → an HF checkpoint, in one process, tensor by tensor.

Accepts what ``mcore-to-hf`` accepts — a Megatron-LM / Megatron-Bridge / converter checkpoint (tracker file,
``iter_*``/``release``, a bare dist_checkpointing directory) — and our training checkpoints: a ``save_dir`` (its
newest intact step, or ``step``) or a ``global_step_<n>`` directory, verified against its manifest first. The model
tensors are read straight from the dist checkpoint (any layout it was trained at; the optimizer state is not read)
by ``megatron_dapo.weights.convert.convert_mcore_to_hf``: no model is built and no process group is needed.

The HF config and tokenizer files come from, in order: ``hf_config_dir``; the checkpoint's own ``hf_config/``; for
a training step, its config's ``model.hf_config_dir``, else the ``hf_config/`` of its ``checkpoint.load_dir``
(what the run was started from; an HF directory there is used as is).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import yaml

from megatron_dapo.training.checkpoint import CONFIG_FILE, LATEST, STEP_PREFIX, resolve_resume
from megatron_dapo.weights.dist_format import find_checkpoint
from megatron_dapo.weights.errors import CheckpointError

PathLike = Union[str, Path]


def _training_step_dir(checkpoint: Path, step: Optional[int]) -> Optional[Path]:
    """The verified step directory when ``checkpoint`` is a training save_dir or step directory, else None."""
    if step is not None:
        return resolve_resume(str(checkpoint / f"{STEP_PREFIX}{step}"), None)
    if (checkpoint / CONFIG_FILE).is_file() and checkpoint.name.startswith(STEP_PREFIX):
        return resolve_resume(str(checkpoint), None)
    if (checkpoint / LATEST).is_file() or any(checkpoint.glob(f"{STEP_PREFIX}*")):
        found = resolve_resume("auto", checkpoint)
        if found is None:
            raise CheckpointError(f"{checkpoint}: no complete {STEP_PREFIX}<n> checkpoint found to export")
        return found
    return None


def _hf_config_of_run(step_dir: Path, config_path: Optional[PathLike]) -> Optional[Path]:
    """Where the run saved in ``step_dir`` took its HF config from (see the module docstring)."""
    from megatron_dapo.config import ExperimentConfig, from_dict, load_config

    if config_path is not None:
        cfg = load_config(config_path)
    elif (step_dir / CONFIG_FILE).is_file():
        cfg = from_dict(ExperimentConfig, yaml.safe_load((step_dir / CONFIG_FILE).read_text()))
    else:
        return None
    if cfg.model.hf_config_dir:
        return Path(cfg.model.hf_config_dir)
    if cfg.checkpoint.load_dir:
        try:
            return find_checkpoint(cfg.checkpoint.load_dir).hf_config_dir
        except CheckpointError:
            return None
    return None


def export_step(
    checkpoint: PathLike,
    save_dir: PathLike,
    step: Optional[int] = None,
    config_path: Optional[PathLike] = None,
    hf_config_dir: Optional[PathLike] = None,
) -> Path:
    """Export ``checkpoint`` (see the module docstring; ``step``: which training step, default the newest) to an
    HF directory ``save_dir``; returns ``save_dir``."""
    from megatron_dapo.weights.convert import convert_mcore_to_hf

    checkpoint = Path(checkpoint)
    source = checkpoint
    step_dir = _training_step_dir(checkpoint, step)
    if step_dir is not None:
        source = step_dir
        if hf_config_dir is None and find_checkpoint(step_dir).hf_config_dir is None:
            hf_config_dir = _hf_config_of_run(step_dir, config_path)
    return convert_mcore_to_hf(source, save_dir, hf_config_dir=hf_config_dir, overwrite=True).save_dir
