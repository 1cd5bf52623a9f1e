"""The one Megatron checkpoint format of the project: megatron-core's ``dist_checkpointing`` (torch_dist backend).

A converted (model-only) checkpoint is laid out as Megatron-LM's ``save_checkpoint`` lays it out::

    <dir>/latest_checkpointed_iteration.txt   "release" (or the iteration number)
    <dir>/release/                            a dist_checkpointing directory:
        .metadata                             torch DCP metadata (every tensor's global shape, dtype, chunks)
        __0_0.distcp                          tensor data
        common.pt                             the non-tensor part: checkpoint_version 3.0, iteration
        metadata.json                         megatron-core's backend description (torch_dist)
    <dir>/hf_config/                          config.json + tokenizer files of the source model
    <dir>/manifest.json                       size + XXH3-64 of every file (``megatron_dapo/weights/integrity.py``)

Tensor keys are those of megatron-core's ``GPTModel.sharded_state_dict()`` with the TransformerEngine spec, layer-
stacked as megatron-core stores homogeneous layers (``decoder.layers.self_attention.linear_qkv.layer_norm_weight``
of shape ``[num_layers, hidden]``; per-layer keys ``decoder.layers.{i}.…`` are read too): megatron-core's local
spec maps its own names to these on save and load, and ``megatron_dapo.models.families.to_te_name`` is our one copy
of that map. Tensors are stored whole (global shapes, the vocabulary padded to ``make_vocab_size_divisible_by``), so the
layout is chosen when loading: ``dist_checkpointing`` reads every rank's slice, and the vocabulary rows beyond the
checkpoint's padding are zero (megatron-core's ``allow_shape_mismatch`` for the embedding and output layer).

This module holds the format itself: file and directory names, the state-dict layout (``model``/``model0..``,
``checkpoint_version``, ``iteration``), the layer-stacked key naming, and ``find_checkpoint``, which says what a
directory is. Writing is in ``dist_writer`` (the streaming single-process writer), reading in ``dist_reader`` (a
single-process tensor reader), loading into live model chunks in ``loading``.
"""

from __future__ import annotations

import argparse
import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from megatron_dapo.models.builder import unwrap
from megatron_dapo.weights.checkpoint_errors import CheckpointError

PathLike = Union[str, Path]

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE_DIR = "release"
HF_CONFIG_SUBDIR = "hf_config"
CHECKPOINT_VERSION = 3.0
COMMON_FILE = "common.pt"
DCP_METADATA_FILE = ".metadata"
MCORE_METADATA_FILE = "metadata.json"
DATA_FILE = "__0_0.distcp"
# What megatron-core writes to metadata.json for its torch_dist backend (CheckpointingConfig).
MCORE_BACKEND = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
# Our training step directories (``checkpointing/checkpoint.py``): the dist checkpoint sits in this subdir.
TRAINING_DIST_SUBDIR = "dist_ckpt"


def iteration_dir_name(iteration: Optional[int]) -> str:
    """Megatron-LM's directory for an iteration: ``iter_0000100``; ``release`` for None."""
    return RELEASE_DIR if iteration is None else f"iter_{iteration:07d}"


def model_state_key(index: int, num_chunks: int) -> str:
    """Megatron-LM's ``generate_state_dict``: ``model`` for one chunk, ``model0``, ``model1``... with virtual stages."""
    return "model" if num_chunks == 1 else f"model{index}"


def model_sharded_state_dict(chunks: Sequence, metadata: Optional[dict] = None) -> dict[str, Any]:
    """The model part of a Megatron-LM state dict: each (unwrapped) chunk's ``sharded_state_dict(metadata=...)``
    (``metadata`` None: megatron-core's default, layer-stacked keys)."""
    return {
        model_state_key(i, len(chunks)): unwrap(c).sharded_state_dict(metadata=metadata) for i, c in enumerate(chunks)
    }


def common_state(iteration: int) -> dict[str, Any]:
    """The non-tensor entries Megatron-LM's ``save_checkpoint`` writes for a model-only checkpoint (no ``args``:
    there is no Megatron-LM argument namespace here; Megatron-LM loads a checkpoint without one)."""
    return {"checkpoint_version": CHECKPOINT_VERSION, "iteration": int(iteration)}


def allow_megatron_lm_common_state() -> None:
    """Let ``torch.load(weights_only=True)`` (megatron-core's ``load_common``) read Megatron-LM's ``common.pt``,
    whose ``args`` is an ``argparse.Namespace`` holding megatron-core enums (as Megatron-LM itself allows them)."""
    import megatron.core.transformer.enums as mcore_enums  # heavy: megatron-core, once the platform has patched it

    safe: list = [argparse.Namespace]
    safe += [v for v in vars(mcore_enums).values() if isinstance(v, type) and issubclass(v, enum.Enum)]
    torch.serialization.add_safe_globals(safe)


# ------------------------------------------------------------------------------------------- what is it


@dataclass(frozen=True)
class CheckpointSource:
    """What ``find_checkpoint`` found: ``kind`` "megatron" (``path`` is the dist_checkpointing directory) or "hf"
    (``path`` is the HF directory). ``root`` holds ``manifest.json``/``hf_config`` when the checkpoint has them."""

    kind: str
    path: Path
    root: Path
    description: str

    @property
    def hf_config_dir(self) -> Optional[Path]:
        if self.kind == "hf":
            return self.path
        for d in (self.root / HF_CONFIG_SUBDIR, self.path / HF_CONFIG_SUBDIR):
            if (d / "config.json").is_file():
                return d
        return None


def is_dist_checkpoint_dir(path: PathLike) -> bool:
    path = Path(path)
    return (path / MCORE_METADATA_FILE).is_file() and (path / DCP_METADATA_FILE).is_file()


def list_entries(path: Path, limit: int = 12) -> str:
    """``a, b, c, ... (n entries)``: the first ``limit`` names in directory ``path`` (for error messages)."""
    names = sorted(p.name for p in path.iterdir())
    more = f", ... ({len(names)} entries)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def describe_dir(path: Path, limit: int = 12) -> str:
    """What is at ``path`` (for error messages): missing, a file, empty, or its first entries."""
    if not path.exists():
        return "it does not exist"
    if not path.is_dir():
        return "it is a file, not a directory"
    if not any(path.iterdir()):
        return "it is empty"
    return "it contains: " + list_entries(path, limit)


WHAT_WORKS = (
    "(1) a Megatron distributed checkpoint: a directory with latest_checkpointed_iteration.txt (Megatron-LM, "
    "Megatron-Bridge, `megatron-dapo convert hf-to-mcore`), an iter_<n>/ or release/ directory in one, or a bare "
    "dist_checkpointing directory (metadata.json + .metadata); (2) a training checkpoint: a global_step_<n>/ "
    "directory or the save_dir holding them (its 'latest' marker); (3) an HF model directory (config.json + "
    "*.safetensors)"
)


def find_checkpoint(path: PathLike) -> CheckpointSource:
    """Say what ``path`` is, or raise ``CheckpointError`` naming what was found and the three things that work."""
    path = Path(path).absolute()
    if (path / TRACKER_FILE).is_file():
        text = (path / TRACKER_FILE).read_text().strip()
        if text == RELEASE_DIR:
            sub = RELEASE_DIR
        elif text.isdigit():
            sub = iteration_dir_name(int(text))
        else:
            raise CheckpointError(f"{path / TRACKER_FILE}: holds {text!r}; expected 'release' or an iteration number")
        if not is_dist_checkpoint_dir(path / sub):
            raise CheckpointError(
                f"{path / TRACKER_FILE} names {sub!r}, but {path / sub} is not a dist_checkpointing directory "
                f"({MCORE_METADATA_FILE} + {DCP_METADATA_FILE}): {describe_dir(path / sub)}"
            )
        return CheckpointSource("megatron", path / sub, path, f"Megatron distributed checkpoint {path} ({sub})")
    if is_dist_checkpoint_dir(path):
        parent = path.parent
        if (parent / TRACKER_FILE).is_file() or path.name.startswith("iter_") or path.name == RELEASE_DIR:
            return CheckpointSource("megatron", path, parent, f"Megatron distributed checkpoint {path}")
        return CheckpointSource("megatron", path, path, f"dist_checkpointing directory {path}")
    if is_dist_checkpoint_dir(path / TRAINING_DIST_SUBDIR):
        return CheckpointSource("megatron", path / TRAINING_DIST_SUBDIR, path, f"training checkpoint {path}")
    if (path / "latest").is_file():
        step = path / (path / "latest").read_text().strip()
        if is_dist_checkpoint_dir(step / TRAINING_DIST_SUBDIR):
            return CheckpointSource("megatron", step / TRAINING_DIST_SUBDIR, step, f"training checkpoint {step}")
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return CheckpointSource("hf", path, path, f"HF model directory {path}")
    raise CheckpointError(f"{path} is not a checkpoint this project reads: {describe_dir(path)}. Expected {WHAT_WORKS}")


# ------------------------------------------------------------------------------------------- tensor keys


def stacked_layer_key(name: str) -> tuple[str, Optional[int]]:
    """``decoder.layers.{i}.x`` → (``decoder.layers.x``, i): megatron-core's key for homogeneous layers, which
    stacks every layer's tensor along a leading axis. Other names → (name, None)."""
    m = _LAYER_RE.match(name)
    return (f"decoder.layers.{m.group(2)}", int(m.group(1))) if m else (name, None)


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def has_per_layer_keys(keys: Sequence[str]) -> bool:
    """Whether a checkpoint keeps one tensor per layer (``decoder.layers.{i}.x``: megatron-core with
    ``non_homogeneous_layers``) rather than layer-stacked tensors."""
    return any(_LAYER_RE.match(k) for k in keys)


def hf_config_dir_of(load_dir: PathLike) -> Path:
    """The HF config (+ tokenizer) directory that goes with ``load_dir``: an HF directory itself, or a Megatron
    checkpoint's ``hf_config/``; ``CheckpointError`` when it carries none."""
    source = find_checkpoint(load_dir)
    found = source.hf_config_dir
    if found is None:
        raise CheckpointError(
            f"{source.description} carries no {HF_CONFIG_SUBDIR}/config.json (Megatron-LM and Megatron-Bridge "
            "checkpoints do not): set model.hf_config_dir to the HF model directory it was made from"
        )
    return found
