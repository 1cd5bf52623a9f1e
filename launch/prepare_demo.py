#!/usr/bin/env python
"""Make the inputs of a demo config when they are missing (``launch/run_local.sh`` runs this before torchrun).

    python launch/prepare_demo.py CONFIG [dotted.overrides ...]

``configs/tiny_cpu.yaml`` and ``configs/tiny_moe_cpu.yaml`` train a tiny model on a tokenizer and data that are made
locally by ``megatron_dapo.tasks.demo`` (``launch/quickstart.sh`` makes them under ``outputs/quickstart`` first).
So that ``launch/run_local.sh configs/tiny_cpu.yaml`` also runs on a fresh clone, this makes whatever of them is
missing the way the quickstart does: the demo (seed 0) when the model, tokenizer or data are missing, then the
Megatron conversion of the model when it is missing or was just remade.

It acts only for those two configs, and only while the config (after the overrides) still points at the demo's
layout under one directory ``D``: ``D/hf_model``, ``D/tokenizer``, ``D/mcore``, ``D/data/train.parquet``,
``D/data/val.parquet``. Paths overridden to anything else are the user's own, and a config that does not load is
left for the trainer to report: this script then does nothing and exits 0.

When the YAML and the overrides, read as plain YAML, already show that there is nothing to make (the inputs are not
the demo layout, or every input of it is there: every launch after the first), it exits without loading the config,
whose module imports torch and costs every launch 1.2-1.8 s here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # the config module imports torch: only when a demo config is seen (see prepare_inputs)
    from megatron_dapo.config import ExperimentConfig

# config file name → demo family (megatron_dapo.tasks.demo --family)
DEMO_CONFIGS = {
    "tiny_cpu.yaml": "qwen2",
    "tiny_moe_cpu.yaml": "qwen3_moe",
    "tiny_qwen3_next_moe_cpu.yaml": "qwen3_next_moe",
    "tiny_qwen35_moe_cpu.yaml": "qwen3_5_moe",
}
PREFIX = "[run_local]"
# megatron_dapo.weights.dist_format.TRACKER_FILE (that module imports torch; tests/launch/test_readme_commands.py
# holds the two equal)
MCORE_TRACKER = "latest_checkpointed_iteration.txt"
# The demo layout's keys: (section, key, a list of one path rather than a path)
LAYOUT_KEYS = (
    ("model", "hf_config_dir", False),
    ("model", "tokenizer_dir", False),
    ("checkpoint", "load_dir", False),
    ("data", "train_files", True),
    ("data", "val_files", True),
)


def _same(path: Optional[str], want: Path) -> bool:
    return path is not None and os.path.normpath(path) == os.path.normpath(want)


def demo_root(cfg: ExperimentConfig) -> Optional[Path]:
    """The directory ``D`` when every input of ``cfg`` is at its place in the demo layout, else None (``cfg``: the
    config, or the same five fields read as plain YAML, see :func:`nothing_to_make`)."""
    if not cfg.model.hf_config_dir:
        return None
    root = Path(cfg.model.hf_config_dir).parent
    layout_holds = (
        _same(cfg.model.hf_config_dir, root / "hf_model")
        and _same(cfg.model.tokenizer_dir, root / "tokenizer")
        and _same(cfg.checkpoint.load_dir, root / "mcore")
        and len(cfg.data.train_files) == 1
        and _same(cfg.data.train_files[0], root / "data" / "train.parquet")
        and len(cfg.data.val_files) == 1
        and _same(cfg.data.val_files[0], root / "data" / "val.parquet")
    )
    return root if layout_holds else None


def missing_inputs(root: Path) -> list[str]:
    """The demo files under ``root`` that are not there (the converted checkpoint excluded)."""
    wanted = [root / "hf_model" / "config.json", root / "tokenizer" / "tokenizer_config.json"]
    wanted += [root / "data" / "train.parquet", root / "data" / "val.parquet"]
    return [str(p) for p in wanted if not p.is_file()]


def _raw_config(config: str, overrides: list[str]) -> Optional[dict]:
    """The config file with ``overrides`` applied, as ``megatron_dapo.config.load_config`` reads them before it
    builds the config (YAML values, the last override of a key wins); None where it would raise."""
    import yaml  # not the config module: it imports torch

    try:
        raw = yaml.safe_load(Path(config).read_text()) or {}
        for item in overrides:
            key, value = item.split("=", 1)
            *sections, name = key.strip().split(".")
            node = raw
            for part in sections:
                node = node.setdefault(part, {})
            node[name] = yaml.safe_load(value) if value.strip() != "" else None
    except (OSError, ValueError, AttributeError, TypeError, yaml.YAMLError):
        return None
    return raw if isinstance(raw, dict) else None


def nothing_to_make(config: str, overrides: list[str]) -> bool:
    """True when :func:`prepare_inputs` would make nothing, whether or not the config loads, as read from the config
    file and ``overrides`` as plain YAML: the five inputs are named there (paths; lists of paths for the data) and
    are not the demo layout (the user's own inputs), or are the layout of a demo ``D`` whose every input is there,
    the converted checkpoint included. False wherever that is not certain."""
    from types import SimpleNamespace

    raw = _raw_config(config, overrides)
    if raw is None:
        return False
    named = {}
    for section, key, is_list in LAYOUT_KEYS:
        node = raw.get(section)
        if not isinstance(node, dict) or key not in node:
            return False  # the config's default: left to prepare_inputs
        value = node[key]
        if is_list:
            as_loaded = isinstance(value, list) and all(isinstance(v, str) for v in value)
        else:
            as_loaded = value is None or isinstance(value, str)
        if not as_loaded:
            return False  # coerced (or refused) by load_config: left to prepare_inputs
        named.setdefault(section, {})[key] = value
    root = demo_root(SimpleNamespace(**{section: SimpleNamespace(**keys) for section, keys in named.items()}))
    return root is None or (not missing_inputs(root) and (root / "mcore" / MCORE_TRACKER).is_file())


def prepare_inputs(config: str, overrides: list[str]) -> Optional[Path]:
    """Make the missing demo inputs of ``config`` (see the module docstring); the demo directory, or None when the
    config is not a demo config pointing at the demo layout."""
    family = DEMO_CONFIGS.get(Path(config).name)
    if family is None or not Path(config).is_file():
        return None
    from megatron_dapo.config import ConfigError, load_config

    try:
        cfg = load_config(config, overrides)
    except ConfigError:
        return None  # the trainer reports it, with the whole message
    root = demo_root(cfg)
    if root is None:
        return None
    remade = False
    missing = missing_inputs(root)
    if missing:
        from megatron_dapo.tasks.demo import prepare

        print(
            f"{PREFIX} {config}: {missing[0]} is missing; making the demo model, tokenizer and data under {root}"
            " (as launch/quickstart.sh does)",
            flush=True,
        )
        prepare(root, family=family)
        remade = True
    if remade or not (root / "mcore" / MCORE_TRACKER).is_file():
        from megatron_dapo.weights.convert import convert_hf_to_mcore

        print(f"{PREFIX} converting {root / 'hf_model'} to Megatron layout in {root / 'mcore'}", flush=True)
        convert_hf_to_mcore(root / "hf_model", root / "mcore", overwrite=True)
    return root


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python launch/prepare_demo.py CONFIG [dotted.overrides ...]", file=sys.stderr)
        return 2
    if Path(argv[0]).name in DEMO_CONFIGS and not nothing_to_make(argv[0], argv[1:]):
        prepare_inputs(argv[0], argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
