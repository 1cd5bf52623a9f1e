"""``megatron-dapo check`` on the command line: the arguments, the text report, ``--json``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Optional

from megatron_dapo.check.runner import DEFAULT_SAMPLE_ROWS, run_check


def build_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    """The ``check`` arguments (on ``parser`` when given, e.g. a ``megatron-dapo`` subcommand parser)."""
    summary = (sys.modules[__package__].__doc__ or "").split("\n\n")[0]
    parser = parser or argparse.ArgumentParser(prog="megatron-dapo check", description=summary)
    parser.add_argument("config", help="experiment YAML (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor_model_parallel_size=2")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes of the planned launch (default 1)")
    parser.add_argument(
        "--nproc-per-node", type=int, default=None, help="processes per node (default: 8 on cuda/npu, else 2)"
    )
    parser.add_argument(
        "--device-memory-gb",
        type=float,
        default=None,
        help="memory per device in GiB: sizes the vLLM KV cache (gpu_memory_utilization x it), checks vLLM's "
        "start-up rule, marks phases estimated above it and says whether the peak phase fits",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="also write the report as JSON (memory plan by phase, problems, warnings, numbers) to PATH; '-' = "
        "stdout, the text report then goes to stderr",
    )
    parser.add_argument(
        "--sample-rows",
        type=int,
        default=DEFAULT_SAMPLE_ROWS,
        help=f"rows per data file to template and tokenize (default {DEFAULT_SAMPLE_ROWS}; 0 = all); every row's "
        "fields are validated",
    )
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``megatron-dapo check``: print the report; exit status 0 when there is no problem, 1 otherwise. Overrides may
    come before or after the options. With ``--json -`` stdout carries only the JSON (the text goes to stderr)."""
    args = build_parser().parse_intermixed_args(argv)
    to_stdout = args.json == "-"
    with _stdout_to_stderr() if to_stdout else contextlib.nullcontext():
        report = run_check(
            args.config, args.overrides, args.nnodes, args.nproc_per_node, args.device_memory_gb, args.sample_rows
        )
    (sys.stderr if to_stdout else sys.stdout).write(report.render())
    if args.json:
        text = json.dumps(report.to_json(), indent=2) + "\n"
        if to_stdout:
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            try:
                Path(args.json).write_text(text)
            except OSError as exc:
                sys.stderr.write(f"megatron-dapo check: cannot write --json {args.json}: {exc}\n")
                return 2
    return 0 if report.ok else 1


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Whatever the check's imports and the user's reward functions print goes to stderr (Python's ``sys.stdout``
    and file descriptor 1), so that stdout carries only the JSON."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)
