"""``megatron-dapo export``: any Megatron checkpoint → an HF checkpoint, in one process, tensor by tensor.

Accepts what ``mcore-to-hf`` accepts — a Megatron-LM / Megatron-Bridge / converter checkpoint (tracker file,
``iter_*``/``release``, a bare dist_checkpointing directory) — and our training checkpoints: a ``save_dir`` (its
newest intact step, or ``step``) or a ``global_step_<n>`` directory, verified against its manifest first. The model
tensors are read straight from the dist checkpoint (any layout it was trained at; the optimizer state is not read)
by ``megatron_dapo.weights.convert.convert_mcore_to_hf``: no model is built and no process group is needed.

The HF config and tokenizer files come from, in order: ``hf_config_dir``; the checkpoint's own ``hf_config/``; for
a training step, its config's ``model.hf_config_dir``, else the ``hf_config/`` of its ``checkpoint.load_dir``
(what the run was started from; an HF directory there is used as is).

**Evaluation settings.** When the run's config is known (the ``config.yaml`` saved with a training step, or
``config_path``), the export also writes :data:`EVAL_SETTINGS_FILE`: the settings ``megatron-dapo eval`` needs to
score this model the way the run's validation did — the prompt/response lengths and prompt preparation (``data``),
the validation sampling and rollout seed/dtype (``rollout``), the reward functions (``reward``) and the tokenizer —
as a partial experiment config. A tokenizer of its own (``model.tokenizer_dir``) is copied to the ``tokenizer/``
subdirectory, so the export stays usable when moved. ``megatron-dapo eval --model <export>`` without ``--config``
starts from these settings (see :func:`read_eval_settings` and ``docs/evaluation_and_ray.md``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from megatron_dapo.config import ConfigError, ExperimentConfig, from_dict, load_config, to_dict
from megatron_dapo.training.checkpoint import CONFIG_FILE, LATEST, STEP_PREFIX, resolve_resume
from megatron_dapo.weights.convert import convert_mcore_to_hf, copy_hf_side_files
from megatron_dapo.weights.dist_format import find_checkpoint
from megatron_dapo.weights.errors import CheckpointError

log = logging.getLogger("megatron_dapo.export")

PathLike = Union[str, Path]
EVAL_SETTINGS_FILE = "megatron_dapo_eval.json"
EVAL_SETTINGS_FORMAT = 1
TOKENIZER_SUBDIR = "tokenizer"  # the run's own tokenizer, copied into the export
# The config keys the eval settings carry, per section: what decides the prompts, the validation samples and their
# scores. The engine's sizing (KV cache, max_num_seqs, TP) belongs to the machine the eval runs on, not the model.
EVAL_DATA_KEYS = (
    "prompt_key",
    "max_prompt_length",
    "max_response_length",
    "truncation",
    "filter_overlong_prompts",
    "apply_chat_template",
)
EVAL_ROLLOUT_KEYS = ("seed", "per_request_seed", "dtype", "logprobs_mode", "val_kwargs")


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


def _run_config(step_dir: Optional[Path], config_path: Optional[PathLike]) -> Optional[ExperimentConfig]:
    """The run's config: ``config_path``, else the one saved with ``step_dir``, else None."""
    if config_path is not None:
        return load_config(config_path)
    if step_dir is not None and (step_dir / CONFIG_FILE).is_file():
        return from_dict(ExperimentConfig, yaml.safe_load((step_dir / CONFIG_FILE).read_text()) or {})
    return None


def _hf_config_of_run(cfg: Optional[ExperimentConfig]) -> Optional[Path]:
    """Where the run took its HF config from (see the module docstring)."""
    if cfg is None:
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
    HF directory ``save_dir``, with the run's evaluation settings when its config is known; returns ``save_dir``."""
    checkpoint = Path(checkpoint)
    source = checkpoint
    step_dir = _training_step_dir(checkpoint, step)
    cfg = _run_config(step_dir, config_path)
    if step_dir is not None:
        source = step_dir
        if hf_config_dir is None and find_checkpoint(step_dir).hf_config_dir is None:
            hf_config_dir = _hf_config_of_run(cfg)
    out = convert_mcore_to_hf(source, save_dir, hf_config_dir=hf_config_dir, overwrite=True).save_dir
    if cfg is not None:
        write_eval_settings(cfg, out, origin=str((step_dir or Path(config_path)).absolute()))
    return out


# ====================================================================================================== eval settings


def _existing_path(path: Optional[str]) -> Optional[str]:
    """``path`` made absolute when it names a file here (relative config paths mean the run's working directory,
    which the export's usually is; the eval's need not be), else unchanged."""
    if path and Path(path).is_file():
        return str(Path(path).absolute())
    return path


def eval_settings(cfg: ExperimentConfig) -> dict[str, Any]:
    """The partial experiment config :data:`EVAL_SETTINGS_FILE` records (``model.tokenizer_dir`` is set by
    :func:`write_eval_settings`, which knows where the tokenizer went)."""
    full = to_dict(cfg)
    reward = full["reward"]
    reward["custom_function"]["path"] = _existing_path(reward["custom_function"]["path"])
    for spec in reward["extra_functions"]:
        if isinstance(spec, dict) and "path" in spec:
            spec["path"] = _existing_path(spec["path"])
    return {
        "model": {"params_dtype": full["model"]["params_dtype"], "tokenizer_dir": None},
        "data": {k: full["data"][k] for k in EVAL_DATA_KEYS},
        "rollout": {k: full["rollout"][k] for k in EVAL_ROLLOUT_KEYS},
        "reward": reward,
    }


def write_eval_settings(cfg: ExperimentConfig, save_dir: PathLike, origin: str = "") -> Path:
    """Write :data:`EVAL_SETTINGS_FILE` into the HF directory ``save_dir`` (and the run's own tokenizer into its
    ``tokenizer/``); returns the file's path."""
    save_dir = Path(save_dir)
    settings = eval_settings(cfg)
    tok = cfg.model.tokenizer_dir
    if tok and Path(tok).is_dir():
        # Copied, not referenced: the export stays evaluable wherever it is moved. Everything but weights, as the
        # trainer's AutoTokenizer saw it (a config.json there decides the tokenizer class too).
        copy_hf_side_files(tok, save_dir / TOKENIZER_SUBDIR)
        settings["model"]["tokenizer_dir"] = TOKENIZER_SUBDIR
    elif tok:
        log.warning("export: model.tokenizer_dir %s is not a directory here; the eval settings name no tokenizer", tok)
    doc = {
        "format": EVAL_SETTINGS_FORMAT,
        "written_by": "megatron-dapo export",
        "from": origin,
        "about": "the run's settings for `megatron-dapo eval --model <this directory>` without --config; a"
        " partial experiment config (docs/evaluation_and_ray.md); model.tokenizer_dir is relative to this directory",
        "config": settings,
    }
    path = save_dir / EVAL_SETTINGS_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def read_eval_settings(hf_dir: PathLike) -> Optional[dict[str, Any]]:
    """The recorded settings of an exported HF directory as a raw partial config (``model.tokenizer_dir`` made
    absolute), or None when it has none. A file of another format is an error naming it."""
    path = Path(hf_dir) / EVAL_SETTINGS_FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc}); re-export the model or pass --config") from exc
    readable = isinstance(doc, dict) and isinstance(doc.get("config"), dict)
    if not readable or doc.get("format") != EVAL_SETTINGS_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ConfigError(
            f"{path}: format {found!r}, this version reads format {EVAL_SETTINGS_FORMAT}; re-export the model with"
            " megatron-dapo export or pass --config"
        )
    config = doc["config"]
    tok = (config.get("model") or {}).get("tokenizer_dir")
    if tok:
        config["model"]["tokenizer_dir"] = str(Path(hf_dir) / tok) if not Path(tok).is_absolute() else tok
    return config
