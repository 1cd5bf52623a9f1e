#!/usr/bin/env python
"""Write train/val files of the synthetic arithmetic task (``megatron_dapo.tasks.arithmetic``).

    python tools/data/make_arithmetic.py --output-dir data/arithmetic --train-size 2048 --val-size 128

The validation rows are drawn with ``seed + 1``; with single-digit operands there are only 100 distinct prompts
(per operator), so validation prompts also occur in training: the demo measures learning, not generalisation.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    from megatron_dapo.tasks.arithmetic import OPS, make_rows, write_dataset
except ImportError:  # run as a script from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from megatron_dapo.tasks.arithmetic import OPS, make_rows, write_dataset


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True, help="writes train.<format> and val.<format> here")
    parser.add_argument("--train-size", type=int, default=2048)
    parser.add_argument("--val-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-operand", type=int, default=9)
    parser.add_argument("--ops", default="+", help=f"operators to draw from, e.g. '+-' (any of {''.join(OPS)})")
    parser.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    args = parser.parse_args(argv)
    ops = tuple(args.ops)
    if not ops or any(op not in OPS for op in ops):
        parser.error(f"--ops: expected characters from {''.join(OPS)!r}, got {args.ops!r}")
    out = Path(args.output_dir)
    for split, size, seed in (("train", args.train_size, args.seed), ("val", args.val_size, args.seed + 1)):
        path = write_dataset(out / f"{split}.{args.format}", make_rows(size, seed, args.max_operand, ops, split))
        print(f"wrote {size} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
