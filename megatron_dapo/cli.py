"""``megatron-dapo`` command line: train | convert | export."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Optional


def _train(args: argparse.Namespace) -> int:
    from megatron_dapo.config import load_config
    from megatron_dapo.training.trainer import run_training

    cfg = load_config(args.config, args.overrides)
    result = run_training(cfg)
    # the process group is gone by now; torchrun's RANK says which process reports
    if result and os.environ.get("RANK", "0") == "0":
        print(" ".join(f"{k}={v:.4g}" for k, v in sorted(result.items()) if isinstance(v, (int, float))))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from megatron_dapo.weights.convert import main as convert_main

    return convert_main(args.convert_argv)


def _export(args: argparse.Namespace) -> int:
    from megatron_dapo.training.export import export_step

    path = export_step(args.checkpoint, args.save_dir, step=args.step, config_path=args.config)
    print(f"exported HF checkpoint to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-dapo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run DAPO training (launch under torchrun; see launch/run_node.sh)")
    train.add_argument("config", help="experiment YAML (configs/*.yaml)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor_model_parallel_size=2")
    train.set_defaults(func=_train)

    convert = sub.add_parser(
        "convert", help="HF ⇄ Megatron checkpoint conversion (hf-to-mcore | mcore-to-hf)", add_help=False
    )
    convert.add_argument("convert_argv", nargs=argparse.REMAINDER, help="see tools/checkpoint_convert/convert.py -h")
    convert.set_defaults(func=_convert)

    export = sub.add_parser("export", help="write an HF checkpoint from a saved training step")
    export.add_argument("--checkpoint", required=True, help="checkpoint directory (checkpoint.save_dir) or a step dir")
    export.add_argument("--save-dir", required=True, help="where to write the HF checkpoint")
    export.add_argument("--step", type=int, default=None, help="step to export (default: latest)")
    export.add_argument("--config", default=None, help="experiment YAML (default: the config saved with the step)")
    export.set_defaults(func=_export)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
