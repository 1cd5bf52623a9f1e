"""Metric logging backends (console, jsonl, tensorboard, wandb) and the rollout dumper. Rank 0 logs; the caller
passes ``enabled=(rank == 0)`` so that other ranks construct the same object and every call is a no-op."""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, TextIO

from megatron_dapo.batch import TrainBatch
from megatron_dapo.reporting.console import format_header, format_row

BACKENDS = ("console", "jsonl", "tensorboard", "wandb")

log = logging.getLogger("megatron_dapo.metrics")


def _scalar(value: Any) -> Optional[float]:
    """A float for numbers and one-element tensors/arrays; None for anything else (skipped)."""
    if isinstance(value, (bool, int, float)):
        return float(value)
    numel = getattr(value, "numel", None)  # torch tensors
    size = numel() if callable(numel) else getattr(value, "size", None)  # numpy arrays and scalars
    if size == 1 and callable(getattr(value, "item", None)):
        try:
            return float(value.item())
        except (TypeError, ValueError):
            return None
    return None


def _json_value(value: float) -> Any:
    # JSON has no NaN/Inf; keep them readable (Python's json reads these names back).
    return value if math.isfinite(value) else str(value)


class _Console:
    """Compact by default: a fixed-width row of the key metrics (``console.COLUMNS``) every ``every`` steps, on the
    first step and on every step that validated, with the header repeated every 20 rows. ``verbose``: one line
    per step with every metric (``step 3 | critic/score/mean=0.250 | ...``, keys sorted)."""

    HEADER_EVERY = 20

    def __init__(
        self,
        stream: TextIO,
        every: int = 1,
        total_steps: Optional[int] = None,
        verbose: bool = False,
        progress: Optional[Any] = None,
    ) -> None:
        self.stream = stream
        self.every = max(1, every)
        self.total_steps = total_steps
        self.verbose = verbose
        self.progress = progress
        self.rows = 0

    def _write(self, text: str) -> None:
        if self.progress is not None:
            self.progress.write(text, self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.verbose:
            self._write(" | ".join([f"step {step}"] + [f"{k}={_fmt(v)}" for k, v in sorted(metrics.items())]))
            return
        validated = any(k.startswith("val-core/") for k in metrics)
        if not (validated or step <= 1 or step % self.every == 0 or step == self.total_steps):
            return
        if self.rows % self.HEADER_EVERY == 0:
            self._write(format_header())
        self._write(format_row(metrics, step, self.total_steps))
        self.rows += 1

    def close(self) -> None:
        pass


def _fmt(value: float) -> str:
    if math.isfinite(value) and value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}"


class _Jsonl:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        row = {"step": step, **{k: _json_value(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()  # a crashed run keeps every completed step

    def close(self) -> None:
        self.file.close()


class _TensorBoard:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # optional: tensorboard (the [logging] extra)

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, output_dir: Path, project: str, experiment: str, config: dict) -> None:
        try:
            import wandb  # optional: wandb (the [logging] extra)
        except ImportError as e:
            raise ImportError("trainer.logger includes 'wandb' but wandb is not installed: pip install wandb") from e
        self.wandb = wandb
        self.run = wandb.init(project=project, name=experiment, config=config, dir=str(output_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsLogger:
    """Fan one metrics dict per step out to the configured backends.

    ``console`` prints the compact table (see ``_Console``; ``verbose`` prints every metric of every step),
    ``jsonl`` writes ``<output_dir>/metrics.jsonl`` (one object per step with ``"step"``, appended so a resumed run
    continues the file), ``tensorboard`` writes event files under ``<output_dir>/tensorboard``, ``wandb`` logs to
    the project/experiment given. Non-scalar values are skipped.
    """

    def __init__(
        self,
        backends: Sequence[str],
        output_dir: str,
        project: str = "megatron-dapo",
        experiment: str = "run",
        config_dict: Optional[dict] = None,
        enabled: bool = True,
        stream: Optional[TextIO] = None,
        console_every: int = 1,
        total_steps: Optional[int] = None,
        verbose: bool = False,
        progress: Optional[Any] = None,
    ) -> None:
        if isinstance(backends, str):
            backends = [backends]
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise ValueError(f"trainer.logger: unknown backend(s) {unknown}; valid backends are {list(BACKENDS)}")
        self.enabled = enabled
        self.backends: dict[str, Any] = {}
        if not enabled:
            return
        out = Path(output_dir)
        for name in dict.fromkeys(backends):  # keep order, drop duplicates
            if name == "console":
                self.backends[name] = _Console(stream or sys.stdout, console_every, total_steps, verbose, progress)
            elif name == "jsonl":
                self.backends[name] = _Jsonl(out / "metrics.jsonl")
            elif name == "tensorboard":
                self.backends[name] = _TensorBoard(out / "tensorboard")
            elif name == "wandb":
                self.backends[name] = _Wandb(out, project, experiment, config_dict or {})

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if not self.enabled:
            return
        clean = {}
        for key, value in metrics.items():
            scalar = _scalar(value)
            if scalar is None:
                log.debug("metric %s is not a scalar (%s); not logged", key, type(value).__name__)
                continue
            clean[key] = scalar
        for backend in self.backends.values():
            backend.log(clean, int(step))

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()
        self.backends = {}


class RolloutDumper:
    """Writes a step's samples to ``<rollout_data_dir>/<step>.jsonl``: one ``{prompt, response, score, step}`` row
    per sample (verl's ``trainer.rollout_data_dir``), with the sample's group id as ``uid`` when given and any
    per-sample ``extras`` (a multi-turn rollout's token ids and loss mask) merged in."""

    def __init__(self, rollout_data_dir: str) -> None:
        self.dir = Path(rollout_data_dir)
        self.dir.mkdir(parents=True, exist_ok=True)

    def dump(
        self,
        step: int,
        prompts: Sequence[str],
        responses: Sequence[str],
        scores: Sequence[float],
        uids: Optional[Sequence[str]] = None,
        extras: Optional[Sequence[dict]] = None,
    ) -> Path:
        if not len(prompts) == len(responses) == len(scores):
            raise ValueError(
                f"RolloutDumper.dump: {len(prompts)} prompts, {len(responses)} responses and {len(scores)} scores "
                "must have the same length"
            )
        path = self.dir / f"{step}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for i, (prompt, response, score) in enumerate(zip(prompts, responses, scores)):
                row = {"prompt": prompt, "response": response, "score": float(score), "step": step}
                if uids is not None:
                    row["uid"] = uids[i]
                if extras is not None:
                    row.update(extras[i])
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        return path


def turn_extras(batch: TrainBatch) -> Optional[list[dict]]:
    """A multi-turn batch's per-sample token ids and loss mask (1 = sampled by the model), for the rollout dump."""
    if batch.sampled_mask is None:
        return None
    lengths = batch.response_mask.sum(-1).tolist()
    return [
        {"response_ids": batch.responses[r, :n].tolist(), "loss_mask": batch.sampled_mask[r, :n].tolist()}
        for r, n in enumerate(lengths)
    ]
