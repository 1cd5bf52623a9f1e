"""The table of known-benign library messages (``log_filters.py``) as the console applies it (``reporting/console.py``):
a listed message stays off the console but is in the rank log; anything else — an unknown message from the same
logger, the same message with another exception, our own warnings — still shows. Native stderr lines held back while
vLLM starts get the same treatment."""

from __future__ import annotations

import io
import logging
import os
import warnings
from pathlib import Path

import pytest

from megatron_dapo import log_filters
from megatron_dapo.log_filters import BENIGN_MESSAGES, NATIVE_STDERR, known_benign
from megatron_dapo.reporting.console import setup_logging

LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"
RENDERER = "vllm.renderers.base"
NUMA = (
    "[rank0]:[W1124 17:18:04.844549327 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory"
    " allocation on the NUMA nodes (0). Memory allocations will be strictly bound to these NUMA nodes."
    " (function init_cpu_memory_env)"
)


@pytest.fixture
def logged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``logged(rank)`` → (console stream, rank log file) after ``setup_logging``; the root logger, warnings and
    the native-stderr target are put back afterwards."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    monkeypatch.setattr(log_filters, "_native_target", None)
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)

    def make(rank: int = 0) -> tuple[io.StringIO, Path]:
        stream = io.StringIO()
        return stream, setup_logging(str(tmp_path / "run"), rank, stream=stream)

    with warnings.catch_warnings():
        yield make
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    for handler in saved[0]:
        root.addHandler(handler)
    root.setLevel(saved[1])
    logging.captureWarnings(False)


def _warmup_failure(logger: logging.Logger, exc: Exception) -> None:
    """What vLLM's ``renderer.warmup`` does when rendering its sample chat raises."""
    try:
        raise exc
    except Exception:
        logger.warning("Chat template warmup failed", exc_info=True)


def test_benign_records_reach_the_log_file_only_everything_else_the_console(logged) -> None:
    stream, log_file = logged(rank=0)
    layerwise = logging.getLogger(LAYERWISE)
    layerwise.warning("%s: Failed to load weights", "RotaryEmbedding")  # every weight sync: benign
    layerwise.warning("%s: Failed to load weights", "QKVParallelLinear")  # a real weight not loaded: shows
    layerwise.warning("Allocating 12.0 MB of device memory to buffers")  # unknown message of that logger: shows
    renderer = logging.getLogger(RENDERER)
    _warmup_failure(renderer, ValueError("Tokenizer not available when `skip_tokenizer_init=True`"))
    _warmup_failure(renderer, TypeError("chat template expects a list"))  # another failure: shows, traceback too
    logging.getLogger("megatron_dapo.trainer").warning("step 3: update skipped, not finite: actor/pg_loss")
    logging.getLogger("megatron_dapo.checkpoint").warning(
        "checkpoint.resume_mode=auto: skipping global_step_4 is damaged; trying an older checkpoint"
    )
    logging.getLogger("vllm.v1.worker.cpu_worker").warning("libtcmalloc is not found in LD_PRELOAD. For best ...")

    shown = stream.getvalue()
    assert "RotaryEmbedding" not in shown
    assert "LD_PRELOAD" not in shown
    assert "skip_tokenizer_init" not in shown
    assert shown.count("Traceback (most recent call last)") == 1
    for expected in (
        "QKVParallelLinear: Failed to load weights",
        "Allocating 12.0 MB of device memory",
        "TypeError: chat template expects a list",
        "WARNING megatron_dapo.trainer: step 3: update skipped, not finite: actor/pg_loss",
        "WARNING megatron_dapo.checkpoint: checkpoint.resume_mode=auto: skipping global_step_4",
    ):
        assert expected in shown, f"{expected!r} missing from the console:\n{shown}"

    written = log_file.read_text()
    assert f"WARNING {LAYERWISE}: RotaryEmbedding: Failed to load weights" in written
    assert "WARNING vllm.v1.worker.cpu_worker: libtcmalloc is not found in LD_PRELOAD" in written
    assert "ValueError: Tokenizer not available when `skip_tokenizer_init=True`" in written  # with its traceback
    assert written.count("Traceback (most recent call last)") == 2
    assert "QKVParallelLinear: Failed to load weights" in written


def test_other_ranks_show_errors_even_from_a_listed_logger(logged) -> None:
    stream, log_file = logged(rank=1)
    logging.getLogger(LAYERWISE).warning("%s: Failed to load weights", "QKVParallelLinear")  # rank 1: warnings off
    logging.getLogger(LAYERWISE).error("reload failed: shape mismatch")
    assert stream.getvalue().splitlines()[1:] == []  # the error alone
    assert "ERROR vllm.model_executor.model_loader.reload.layerwise: reload failed: shape mismatch" in stream.getvalue()
    assert "QKVParallelLinear" in log_file.read_text()


def test_table_matches_whole_messages_from_their_own_logger_only() -> None:
    assert known_benign(LAYERWISE, "RotaryEmbedding: Failed to load weights") is not None
    assert known_benign(LAYERWISE, "Llama3RotaryEmbedding: Failed to load weights") is not None
    assert known_benign(LAYERWISE, "RotaryEmbedding: Failed to load weights (and more)") is None
    assert known_benign("vllm.somewhere.else", "RotaryEmbedding: Failed to load weights") is None
    # the warm-up message is benign only with the skip_tokenizer_init exception attached
    assert known_benign(RENDERER, "Chat template warmup failed") is None
    tokenizer_off = ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
    assert known_benign(RENDERER, "Chat template warmup failed", tokenizer_off) is not None
    assert known_benign(RENDERER, "Chat template warmup failed", ValueError("bad template")) is None
    assert known_benign(NATIVE_STDERR, NUMA) is not None
    assert known_benign(NATIVE_STDERR, NUMA.replace("NUMA binding", "NUMA problem")) is None
    assert known_benign("vllm.v1.worker.cpu_worker", NUMA) is None
    assert all(entry.reason.strip() for entry in BENIGN_MESSAGES)


def test_native_stderr_is_held_back_and_only_unknown_lines_reach_fd2(logged, capfd) -> None:
    stream, log_file = logged(rank=0)
    with log_filters.native_stderr_filtered():
        os.write(2, (NUMA + "\n").encode())  # what C++ code does: a write to file descriptor 2
        os.write(2, b"[W1124 17:18:05 ProcessGroupGloo.cpp:1] Warning: something new\n")
        assert NUMA in (log_file.parent / "rank0.native.log").read_text()  # held in the log directory meanwhile
        logging.getLogger("megatron_dapo.rollout").warning("our warning inside the block")
    err = capfd.readouterr().err
    assert err == "[W1124 17:18:05 ProcessGroupGloo.cpp:1] Warning: something new\n"
    assert "WARNING megatron_dapo.rollout: our warning inside the block" in stream.getvalue()
    assert "NUMA" not in stream.getvalue()
    written = log_file.read_text()
    assert f"INFO {NATIVE_STDERR}: {NUMA}" in written
    assert f"INFO {NATIVE_STDERR}: [W1124 17:18:05 ProcessGroupGloo.cpp:1] Warning: something new" in written
    assert not (log_file.parent / "rank0.native.log").exists()
    os.write(2, b"after the block\n")  # fd 2 is back where it was
    assert capfd.readouterr().err == "after the block\n"
