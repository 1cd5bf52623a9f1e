"""``megatron-dapo eval``: generate on evaluation sets with the rollout engine and score like training's validation.

Flow (every process runs it; one process, or ``torchrun`` with rollout TP/DP as in training):

1. **Model.** ``--model`` is an HF directory (``config.json`` + safetensors), the converter's output
   (``megatron-dapo convert hf-to-mcore``) or any Megatron distributed checkpoint (Megatron-LM/Bridge: a tracker
   file ``latest_checkpointed_iteration.txt``, an ``iter_*``/``release`` or bare dist_checkpointing directory) or a
   training checkpoint (a
   ``global_step_<n>`` directory or a ``checkpoint.save_dir`` holding them). The last two are exported once, by
   rank 0, to an HF directory under the output directory (``convert_mcore_to_hf`` / ``export_step``, in a child
   process for the latter since it creates process groups of its own) and removed at the end.
2. **Config.** ``--config``, else the config saved with a training checkpoint, else the settings ``megatron-dapo
   export`` recorded next to an exported HF model (``megatron_dapo_eval.json``: the run's prompt/response lengths,
   prompt preparation, validation sampling, rollout seed and dtype, reward functions and tokenizer; see
   ``checkpointing/export.py``), else the built-in defaults with ``data.max_prompt_length`` /
   ``data.max_response_length`` fitted to the model's ``max_position_embeddings`` (the last two say so in one
   console line); then the dotted overrides. ``--n/--temperature/--top-p`` override ``rollout.val_kwargs``,
   ``--max-response-length`` ``data.max_response_length``, ``--tokenizer`` ``model.tokenizer_dir``. ``--data``
   files replace ``data.val_files``.
3. **Generation.** The training ``RolloutEngine`` (``rollout/engine.py``) with ``SamplingSpec.for_validation``, all
   prompts in one ``generate`` call with ``seed_offset=0``, exactly as ``DAPOTrainer.validate`` does: per-request
   seeds make the samples independent of the rollout layout, so the numbers match the trainer's ``val-core``
   metrics on the same checkpoint and settings. The engine starts from dummy weights; the HF tensors are pushed in
   with ``load_weights`` in buckets of whole decoder layers (a bucket must not split a vLLM layer, see
   ``rollout/sync.py``).
4. **Scoring.** ``RewardManager`` with the config's ``reward`` section (the same routing, scorers and custom
   functions as training), on rank 0.
5. **Report** (rank 0): ``<output-dir>/summary.json`` with per-data-source metrics from :func:`summarize` and
   ``<output-dir>/samples.jsonl``, one line per response.

Metric definitions (pure functions below; per data source, ``n`` responses per prompt, ``c`` of them correct):

* ``mean@n``: mean ``acc`` over all responses (= the trainer's ``val-core/<source>/acc/mean@n``);
* ``pass@k`` for k = 1, 2, 4, ... ≤ n and k = n: the unbiased estimator ``1 - C(n-c, k) / C(n, k)`` averaged over
  prompts (the probability that at least one of k responses drawn without replacement is correct);
* ``maj@k`` (k ≥ 2 from the same list, for sources whose scorer returns a ``pred``): the majority answer among a
  prompt's first k responses (responses without an extracted ``pred`` do not vote; ties go to the answer seen first) is
  correct, averaged over prompts; the responses are i.i.d., so the first k are an unbiased draw of k;
* ``response_length/mean`` (tokens, stop token included), ``truncation_rate`` (share of responses stopped by the
  length limit), ``num_prompts``, ``num_responses``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch.distributed as dist
import yaml

from megatron_dapo import dtypes
from megatron_dapo.checkpointing.checkpoint import CONFIG_FILE, LATEST, CheckpointError, resolve_resume
from megatron_dapo.checkpointing.export import EVAL_SETTINGS_FILE, holds_lora_adapters, read_eval_settings
from megatron_dapo.config import (
    DataConfig,
    ExperimentConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    apply_override,
    check_eval_options,
    config_problems,
    from_dict,
    load_config,
    raise_if_any,
)
from megatron_dapo.data import build_dataset
from megatron_dapo.data.tokens import decode_responses, load_tokenizer, token_ids
from megatron_dapo.parallel import broadcast_object, init_distributed, teardown
from megatron_dapo.reward.manager import RewardManager
from megatron_dapo.reward.math_dapo import INVALID_ANSWER
from megatron_dapo.rollout.engine import RolloutEngine, freeze_heap_before_engine
from megatron_dapo.rollout.multi_turn import build_generator, tool_schemas
from megatron_dapo.rollout.sync import load_hf_weights_into_engine
from megatron_dapo.rollout.types import SamplingSpec
from megatron_dapo.training.reward_stage import RolloutScorer
from megatron_dapo.weights.convert import convert_mcore_to_hf
from megatron_dapo.weights.dist_format import TRACKER_FILE, find_checkpoint, is_dist_checkpoint_dir

log = logging.getLogger("megatron_dapo.eval")

PathLike = Union[str, Path]
SUMMARY_FILE = "summary.json"
SAMPLES_FILE = "samples.jsonl"
EXPORT_SUBDIR = ".eval_hf_model"  # the temporary HF export of a non-HF --model, under the output directory

# ====================================================================================================== metrics


def k_values(n: int) -> list[int]:
    """The k of ``pass@k``: powers of two up to ``n``, and ``n`` itself (``k_values(6) == [1, 2, 4, 6]``)."""
    if n < 1:
        raise ValueError(f"k_values: n={n}, expected >= 1 responses per prompt")
    ks = [1 << i for i in range(n.bit_length()) if (1 << i) <= n]
    return ks if ks[-1] == n else ks + [n]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct out of ``n`` responses: ``1 - C(n-c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    # Exact integers; Python's int / int rounds the quotient correctly even when both are huge.
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(preds: Sequence[Optional[str]], accs: Sequence[float]) -> float:
    """1.0 if the most frequent extracted ``pred`` is correct (its first response's ``acc``), else 0.0.

    ``None`` and math_dapo's ``"[INVALID]"`` (no answer found) do not vote. Ties go to the answer that appears first;
    with no extracted answer at all the vote is wrong.
    """
    if len(preds) != len(accs):
        raise ValueError(f"majority_correct: {len(preds)} preds but {len(accs)} accs")
    counts: dict[str, int] = {}
    first_acc: dict[str, float] = {}
    for pred, acc in zip(preds, accs):
        if pred is None or pred == INVALID_ANSWER:
            continue
        counts[pred] = counts.get(pred, 0) + 1
        first_acc.setdefault(pred, float(acc))
    if not counts:
        return 0.0
    best = max(counts.values())
    winner = next(p for p in counts if counts[p] == best)  # dicts keep insertion order: the first to appear
    return 1.0 if first_acc[winner] > 0 else 0.0


@dataclass(frozen=True)
class SampleRecord:
    """One scored response: the fields :func:`summarize` needs (the eval also writes these to ``samples.jsonl``)."""

    data_source: str
    prompt_index: int
    sample_index: int
    acc: float
    pred: Optional[str]
    response_length: int
    truncated: bool


def summarize(records: Sequence[SampleRecord], n: int) -> dict[str, dict[str, float]]:
    """Per-data-source metrics (see the module docstring) from records with ``n`` responses per prompt."""
    if not records:
        raise ValueError("summarize: no records")
    groups: dict[str, dict[int, list[SampleRecord]]] = {}
    for rec in records:
        groups.setdefault(rec.data_source, {}).setdefault(rec.prompt_index, []).append(rec)
    ks = k_values(n)
    out: dict[str, dict[str, float]] = {}
    for source in sorted(groups):
        prompts = groups[source]
        for index, recs in prompts.items():
            if len(recs) != n:
                raise ValueError(f"summarize: data source {source!r} prompt {index} has {len(recs)} responses, not {n}")
        flat = [r for recs in prompts.values() for r in recs]
        metrics: dict[str, float] = {f"mean@{n}": sum(r.acc for r in flat) / len(flat)}
        ordered = [sorted(recs, key=lambda r: r.sample_index) for recs in prompts.values()]
        correct = [sum(1 for r in recs if r.acc > 0) for recs in ordered]
        for k in ks:
            metrics[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / len(ordered)
        if any(r.pred is not None for r in flat):
            for k in ks:
                if k >= 2:
                    votes = [
                        majority_correct([r.pred for r in recs[:k]], [r.acc for r in recs[:k]]) for recs in ordered
                    ]
                    metrics[f"maj@{k}"] = sum(votes) / len(votes)
        metrics["response_length/mean"] = sum(r.response_length for r in flat) / len(flat)
        metrics["truncation_rate"] = sum(1 for r in flat if r.truncated) / len(flat)
        metrics["num_prompts"] = float(len(ordered))
        metrics["num_responses"] = float(len(flat))
        out[source] = metrics
    return out


# ====================================================================================================== --model


class ModelInputError(ValueError):
    """``--model`` is none of the accepted kinds; the message says what was found and what would work."""


@dataclass(frozen=True)
class ModelSource:
    """What ``--model`` points at: ``kind`` is ``hf`` | ``mcore`` | ``training_checkpoint``."""

    kind: str
    path: Path


_STEP_DIR = re.compile(r"^global_step_\d+$")


def _has_hf_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file()


def identify_model(path: PathLike) -> ModelSource:
    """Which of the three accepted kinds ``path`` is; :class:`ModelInputError` naming what was found otherwise."""

    path = Path(path)
    if path.is_dir():
        if (path / TRACKER_FILE).is_file() or is_dist_checkpoint_dir(path):
            return ModelSource("mcore", path)
        if (path / "config.json").is_file() and _has_hf_weights(path):
            return ModelSource("hf", path)
        if (_STEP_DIR.match(path.name) and (path / CONFIG_FILE).is_file()) or (path / LATEST).is_file():
            return ModelSource("training_checkpoint", path)
        if any(p.is_dir() and _STEP_DIR.match(p.name) for p in path.iterdir()):
            return ModelSource("training_checkpoint", path)
        entries = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
        found = (
            f"a directory containing {entries[:12]}{' ...' if len(entries) > 12 else ''}"
            if entries
            else ("an empty directory")
        )
    elif path.exists():
        found = "a file, not a directory"
    else:
        found = "nothing (no such path)"
    raise ModelInputError(
        f"--model {path}: found {found}. Expected one of: (1) an HF model directory (config.json + *.safetensors);"
        f" (2) a Megatron distributed checkpoint (megatron-dapo convert hf-to-mcore, Megatron-LM/Bridge:"
        f" {TRACKER_FILE}, or an iter_*/release/bare dist_checkpointing directory with metadata.json + .metadata);"
        f" (3) a training checkpoint: a global_step_<n>/ directory (with {CONFIG_FILE}) or the checkpoint.save_dir"
        " holding them"
    )


def training_step_dir(path: PathLike) -> Path:
    """The step directory a training-checkpoint ``--model`` means: itself, or the latest step of a save_dir."""

    path = Path(path)
    if (path / CONFIG_FILE).is_file():
        return resolve_resume(str(path), None)
    found = resolve_resume("auto", path)
    if found is None:
        raise CheckpointError(f"--model {path}: no complete global_step_<n> checkpoint in this directory")
    return found


# ====================================================================================================== config


def build_eval_config(
    source: ModelSource,
    config_path: Optional[PathLike],
    overrides: Sequence[str],
    data_files: Sequence[str],
    output_dir: PathLike,
    n: Optional[int] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    max_response_length: Optional[int] = None,
    tokenizer_dir: Optional[PathLike] = None,
) -> ExperimentConfig:
    """The experiment config the eval runs with (see the module docstring, step 2), through eval's gate: its options,
    then the config's own rules once (``config_problems``), every problem in one ``ConfigError``; the engine checks
    its layout against the model and the world (``config.plan.rollout_plan``)."""

    overrides = list(overrides)
    headline = None  # said once the flags below are applied too
    if config_path is not None:
        cfg = load_config(config_path, overrides)
    elif source.kind == "training_checkpoint":
        saved = training_step_dir(source.path) / CONFIG_FILE
        raw = yaml.safe_load(saved.read_text()) or {}
        for item in overrides:
            apply_override(raw, item)
        cfg = from_dict(ExperimentConfig, raw)
    else:
        cfg, headline = _config_without_yaml(source, overrides, max_response_length)
    check_eval_options(data_files, n, temperature, top_p, max_response_length)
    cfg.data.val_files = [str(f) for f in data_files]
    cfg.trainer.output_dir = str(output_dir)
    v = cfg.rollout.val_kwargs
    if n is not None:
        v.n = n
    if temperature is not None:
        v.temperature = temperature
        v.do_sample = temperature > 0
    if top_p is not None:
        v.top_p = top_p
    if max_response_length is not None:
        cfg.data.max_response_length = max_response_length
    if tokenizer_dir is not None:
        cfg.model.tokenizer_dir = str(tokenizer_dir)
    raise_if_any(config_problems(cfg))
    if headline is not None:
        _announce(headline + _describe_settings(cfg.data, cfg.rollout, cfg.model, cfg.reward))
    return cfg


def _config_without_yaml(
    source: ModelSource, overrides: Sequence[str], max_response_length: Optional[int]
) -> tuple[ExperimentConfig, str]:
    """No ``--config`` and no saved training config: the settings ``megatron-dapo export`` recorded next to the
    model, else the built-in defaults with the sequence lengths fitted to the model; the overrides on top. Also
    the start of the console line that says which it was."""

    recorded = read_eval_settings(source.path) if source.kind == "hf" else None
    raw: dict = recorded if recorded is not None else {}
    for item in overrides:
        apply_override(raw, item)
    cfg = from_dict(ExperimentConfig, raw)
    if recorded is not None:
        headline = f"eval: using the settings recorded with the model ({source.path / EVAL_SETTINGS_FILE}): "
    else:
        given = {item.split("=", 1)[0].strip() for item in overrides}
        if max_response_length is not None and max_response_length >= 1:  # set here too: the prompt fits around it
            given.add("data.max_response_length")
            cfg.data.max_response_length = max_response_length
        max_positions = _max_position_embeddings(source)
        fitted = ""
        if max_positions is not None:
            fit_sequence_lengths(cfg.data, max_positions, given)
            fitted = f", lengths fitted to the model's max_position_embeddings={max_positions}"
        headline = (
            f"eval: --model {source.path} has no recorded settings ({EVAL_SETTINGS_FILE}, written by megatron-dapo"
            f" export) and no --config was given; pass --config or section.key=value overrides to change these"
            f" defaults{fitted}: "
        )
    return cfg, headline


def fit_sequence_lengths(d: DataConfig, max_positions: int, given: set[str]) -> None:
    """Shorten the default ``data.max_prompt_length`` / ``data.max_response_length`` (those not in ``given``) so
    that prompt + response fits ``max_positions``: half each when both are defaults, else the rest of the room.
    Given values are kept; if they alone do not fit, the engine's check names them."""
    if d.max_prompt_length + d.max_response_length <= max_positions:
        return
    prompt_given, response_given = "data.max_prompt_length" in given, "data.max_response_length" in given
    if not prompt_given and not response_given:
        d.max_prompt_length = max(1, max_positions // 2)
        d.max_response_length = max(1, max_positions - d.max_prompt_length)
    elif not prompt_given:
        d.max_prompt_length = max(1, max_positions - d.max_response_length)
    elif not response_given:
        d.max_response_length = max(1, max_positions - d.max_prompt_length)


def _max_position_embeddings(source: ModelSource) -> Optional[int]:
    """The model's ``max_position_embeddings`` from its HF ``config.json`` (a converter output's ``hf_config/``),
    or None when there is none to read (the export that follows names the problem)."""

    try:
        hf_dir = source.path if source.kind == "hf" else find_checkpoint(source.path).hf_config_dir
        if hf_dir is None:
            return None
        config = json.loads((Path(hf_dir) / "config.json").read_text())
    except (OSError, ValueError):  # CheckpointError is a ValueError, json's decode error too
        return None
    value = config.get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


def _describe_settings(d: DataConfig, r: RolloutConfig, m: ModelConfig, rw: RewardConfig) -> str:
    """The settings that decide an eval's numbers, in one line."""
    v, cf = r.val_kwargs, rw.custom_function
    sampling = f"n={v.n}, " + (
        f"temperature={v.temperature}, top_p={v.top_p}, top_k={v.top_k}"
        if v.do_sample and v.temperature > 0
        else "greedy"
    )
    reward = f"{cf.path}:{cf.name}" if cf.path else "built-in scorers by data_source only"
    return (
        f"data.max_prompt_length={d.max_prompt_length}, data.max_response_length={d.max_response_length},"
        f" chat template {'on' if d.apply_chat_template else 'off'}, rollout.val_kwargs {sampling},"
        f" rollout.seed={r.seed}, tokenizer {m.tokenizer_dir or 'from the model directory'},"
        f" reward {reward}"
    )


def _announce(message: str) -> None:
    """One console line from the first process (``torchrun`` runs every rank through the config)."""
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)


# ====================================================================================================== export


def _child_env() -> dict[str, str]:
    """The environment for a single-process child: without torchrun's variables, so it makes its own group."""
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("TORCHELASTIC")}
    env["MASTER_ADDR"] = "127.0.0.1"
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH", "")]))
    return env


def export_to_hf(source: ModelSource, dest: PathLike) -> Path:
    """Write the HF checkpoint of a ``mcore`` or ``training_checkpoint`` source to ``dest`` (call on one rank)."""

    dest = Path(dest)
    if source.kind == "mcore":
        convert_mcore_to_hf(source.path, dest, overwrite=True)
        return dest
    if source.kind != "training_checkpoint":
        raise ValueError(f"export_to_hf: {source.kind!r} needs no export")
    # export_step creates (and destroys) process groups of its own: run it where they cannot meet ours.
    cmd = [sys.executable, "-m", "megatron_dapo.cli", "export", "--checkpoint", str(source.path)]
    cmd += ["--save-dir", str(dest)]
    if holds_lora_adapters(source.path):  # a LoRA run's checkpoint: the base with its adapters merged in
        cmd += ["--lora", "merged"]
    proc = subprocess.run(cmd, env=_child_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise RuntimeError(f"exporting the training checkpoint {source.path} to HF failed:\n{tail}")
    return dest


# ====================================================================================================== run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _default_single_process_env() -> None:
    """A plain (non-torchrun) run is rank 0 of 1; vLLM's external_launcher reads these variables itself."""
    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))


def _engine_hf_dir(source: ModelSource, output_dir: Path, export_dir: Path, is_main: bool) -> Path:
    """The HF directory the engine loads: ``source.path`` itself, or its export to ``export_dir``, written by rank 0;
    the other ranks learn the outcome (and fail with it)."""

    if source.kind == "hf":
        return source.path
    error = None
    if is_main:
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            export_to_hf(source, export_dir)
        except Exception as exc:  # noqa: BLE001 - re-raised below on every rank
            error = f"{type(exc).__name__}: {exc}"
    error = broadcast_object(error)
    if error is not None:
        raise RuntimeError(f"--model {source.path} ({source.kind}): export to HF failed: {error}")
    return export_dir


def run_eval(
    model: PathLike,
    data_files: Sequence[str],
    output_dir: PathLike,
    *,
    config_path: Optional[PathLike] = None,
    overrides: Sequence[str] = (),
    tokenizer_dir: Optional[PathLike] = None,
    n: Optional[int] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    max_response_length: Optional[int] = None,
) -> dict[str, dict[str, float]]:
    """Evaluate ``model`` on ``data_files``; returns the summary (on every rank) and writes the report (rank 0)."""

    source = identify_model(model)
    output_dir = Path(output_dir)
    cfg = build_eval_config(
        source,
        config_path,
        overrides,
        data_files,
        output_dir,
        n,
        temperature,
        top_p,
        max_response_length,
        tokenizer_dir,
    )
    _default_single_process_env()
    info, platform = init_distributed(cfg.parallel)
    engine = None
    export_dir = output_dir / EXPORT_SUBDIR
    try:
        # 1. An HF directory for the engine.
        hf_dir = _engine_hf_dir(source, output_dir, export_dir, info.is_main)

        tokenizer = load_tokenizer(cfg.model.tokenizer_dir, hf_dir)  # --tokenizer is in the config by now
        ids = token_ids(tokenizer)
        tools = tool_schemas(cfg.rollout.multi_turn)
        dataset = build_dataset(cfg.data.val_files, tokenizer, cfg.data, name="eval", tools=tools)
        items = [dataset[i] for i in range(len(dataset))]
        sampling = SamplingSpec.for_validation(cfg.rollout, cfg.data.max_response_length, ids.eos)

        # 2. Generation, exactly as DAPOTrainer.validate: one call, seed_offset 0.
        freeze_heap_before_engine()
        sections = (cfg.rollout, cfg.data, cfg.model, cfg.actor, cfg.trainer)
        engine = RolloutEngine(*sections, str(hf_dir), platform, pad_token_id=ids.pad, eos_token_ids=ids.eos)
        load_hf_weights_into_engine(
            engine,
            hf_dir,
            dtypes.from_config_name(engine.rollout_plan.dtype, "rollout.dtype"),
            cfg.rollout.weight_sync_bucket_mb,
        )
        # multi-turn with tools when the config says so
        generator = build_generator(cfg.rollout.multi_turn, cfg.data.max_response_length, engine, tokenizer)
        try:
            rollout = generator.generate(items, sampling, seed_offset=0)
        finally:
            generator.close()

        # 3. Scoring and the report, on rank 0.
        summary: Optional[dict] = None
        if info.is_main:
            summary = _score_and_write(cfg, tokenizer, list(ids.eos), items, rollout, sampling.n, output_dir)
        summary = broadcast_object(summary)
        if dist.is_initialized():
            dist.barrier()
        return summary
    finally:
        teardown(engine)
        if info.is_main:
            shutil.rmtree(export_dir, ignore_errors=True)


def _score_and_write(cfg, tokenizer, eos_ids, items, rollout, n: int, output_dir: Path) -> dict:
    """Score the rollout with the ``reward`` config, write ``samples.jsonl`` and ``summary.json``; the summary."""

    rows = rollout.prompt_index.tolist()
    with RewardManager(tokenizer, cfg.reward, cfg.data.max_response_length, eos_ids) as reward:
        result = RolloutScorer(reward, world_size=1, rank=0)(rollout, items)  # as the trainer scores, on this rank
    lengths = rollout.response_lengths.tolist()
    texts = decode_responses(tokenizer, rollout.responses, lengths)
    accs = result.extra.get("acc", [None] * len(rows))
    preds = result.extra.get("pred", [None] * len(rows))
    records: list[SampleRecord] = []
    output_dir.mkdir(parents=True, exist_ok=True)
    with open(output_dir / SAMPLES_FILE, "w") as f:
        for r, i in enumerate(rows):
            rec = SampleRecord(
                data_source=str(items[i]["data_source"]),
                prompt_index=int(i),
                sample_index=r % n,  # rows come sorted by (prompt, sample), n per prompt
                acc=float(bool(accs[r])),
                pred=None if preds[r] is None else str(preds[r]),
                response_length=int(lengths[r]),
                truncated=bool(rollout.truncated[r]),
            )
            records.append(rec)
            score = result.extra["score"][r]
            line = _sample_line(rec, items[i], texts[r], score, float(result.scores[r]))
            f.write(json.dumps(line, default=str) + "\n")
    summary = summarize(records, n)
    (output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


def _sample_line(rec: SampleRecord, item: dict, response: str, score: Any, reward: float) -> dict[str, Any]:
    """One line of ``samples.jsonl``."""
    return {
        "data_source": rec.data_source,
        "prompt_index": rec.prompt_index,
        "sample_index": rec.sample_index,
        "prompt": item["raw_prompt"],
        "response": response,
        "ground_truth": item["ground_truth"],
        "score": float(score) if score is not None else None,
        "reward": reward,
        "pred": rec.pred,
        "acc": rec.acc,
        "response_length": rec.response_length,
        "truncated": rec.truncated,
    }
