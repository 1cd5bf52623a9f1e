"""What a person watching a run sees: a progress bar and a compact metrics table on rank 0; library logs in files.

* ``setup_logging`` sends every log record (ours, megatron-core's, vLLM's, torch's, Python warnings) to
  ``<output_dir>/logs/rank<r>.log`` at INFO. The console gets, on rank 0, our own INFO messages and everyone's
  warnings; other ranks print errors only (a failing rank's error always reaches the console). ``verbose``
  restores library INFO output on the console.
* Known-benign library messages (``log_filters.BENIGN_MESSAGES``, each with its reason) stay out of the console and
  still go to the rank log; anything not in the table shows as before. The native stderr ``log_filters`` holds back
  while vLLM starts (``native_stderr_filtered``) is released into this rank log and console.
* ``ProgressBar``: step, score, validation accuracy, response length, s/step and ETA, on rank 0 when stderr is a
  terminal (in a pipe or a CI log the compact table carries the progress instead).
* ``format_header`` / ``format_row``: the key metrics of a step as one fixed-width row under a header, printed every
  ``trainer.console_every`` steps and on every validation step by the ``console`` metrics backend.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Optional, TextIO

from tqdm import tqdm

from megatron_dapo.log_filters import hold_native_stderr_for, record_is_benign

OWN_LOGGER = "megatron_dapo"

# (metric key or prefix, column title, width, format)
COLUMNS: tuple[tuple[str, str, int, str], ...] = (
    ("critic/score/mean", "score", 7, ".3f"),
    ("val-core/", "val_acc", 7, ".3f"),
    ("response_length/mean", "resp_len", 8, ".1f"),
    ("actor/pg_loss", "pg_loss", 9, ".4f"),
    ("actor/grad_norm", "grad_norm", 9, ".3g"),
    ("actor/entropy", "entropy", 7, ".3f"),
    ("train/kept_prompt_ratio", "kept", 5, ".2f"),
    ("actor/update_ok", "upd_ok", 6, ".2f"),
    ("timing_s/step", "s/step", 7, ".2f"),
)


class _ConsoleFilter(logging.Filter):
    """Rank 0: our INFO and everyone's WARNING+; other ranks: ERROR+ only. Never a ``BENIGN_MESSAGES`` one, nor a
    record marked ``file_only`` (native lines already shown or known benign)."""

    def __init__(self, is_main: bool) -> None:
        super().__init__()
        self.is_main = is_main

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "file_only", False) or record_is_benign(record):
            return False
        if record.levelno >= logging.ERROR:
            return True
        if not self.is_main:
            return False
        if record.name == "py.warnings":  # library deprecation/fallback notices: in the log file only
            return False
        own = record.name == OWN_LOGGER or record.name.startswith(OWN_LOGGER + ".")
        return record.levelno >= (logging.INFO if own else logging.WARNING)


def setup_logging(output_dir: str, rank: int, verbose: bool = False, stream: Optional[TextIO] = None) -> Path:
    """Route all logging as described in the module docstring; returns this rank's log file.

    Call before vLLM is imported: it stops vLLM from installing its own console handler, so that vLLM's records
    go through these handlers too.
    """
    log_dir = Path(output_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_file = log_dir / f"rank{rank}.log"
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.INFO)
    file_handler = logging.FileHandler(log_file, encoding="utf-8")
    file_handler.setFormatter(fmt)
    root.addHandler(file_handler)
    console = logging.StreamHandler(stream or sys.stderr)
    console.setFormatter(fmt)
    if verbose:
        console.setLevel(logging.INFO)
        hold_native_stderr_for(None)
    else:
        console.addFilter(_ConsoleFilter(rank == 0))
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        hold_native_stderr_for(log_file, console)
    root.addHandler(console)
    logging.captureWarnings(True)
    warnings.simplefilter("default")  # each distinct warning once per location, into the log file
    return log_file


def format_header() -> str:
    return " ".join(["step".rjust(9)] + [title.rjust(width) for _, title, width, _ in COLUMNS])


def format_row(metrics: dict[str, float], step: int, total_steps: Optional[int]) -> str:
    """One fixed-width row; a missing metric is blank, a validation accuracy is the mean over data sources."""
    cells = [(f"{step}/{total_steps}" if total_steps else str(step)).rjust(9)]
    for key, _, width, spec in COLUMNS:
        if key.endswith("/"):
            values = [v for k, v in metrics.items() if k.startswith(key)]
            value = sum(values) / len(values) if values else None
        else:
            value = metrics.get(key)
        cells.append(("" if value is None else format(value, spec)).rjust(width))
    return " ".join(cells)


class ProgressBar:
    """tqdm on rank 0 when stderr is a terminal; a no-op otherwise."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        self.bar = None
        self.last_val: Optional[float] = None
        if enabled and sys.stderr.isatty():
            self.bar = tqdm(total=total, initial=initial, desc="dapo", dynamic_ncols=True, unit="step")

    def start_at(self, step: int) -> None:
        """Position after a resume (the ETA then counts the remaining steps only)."""
        if self.bar is not None:
            self.bar.reset(total=self.bar.total)
            self.bar.update(step)

    def update(self, metrics: dict[str, float]) -> None:
        if self.bar is None:
            return
        postfix = {"score": f"{metrics.get('critic/score/mean', float('nan')):.3f}"}
        val = [v for k, v in metrics.items() if k.startswith("val-core/")]
        if val:
            self.last_val = sum(val) / len(val)
        if self.last_val is not None:
            postfix["val"] = f"{self.last_val:.3f}"
        postfix["len"] = f"{metrics.get('response_length/mean', float('nan')):.1f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

    def write(self, text: str, stream: TextIO) -> None:
        """Print above the bar (or plainly without one)."""
        if self.bar is not None:
            self.bar.write(text, file=stream)
        else:
            print(text, file=stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
