#!/usr/bin/env python
"""Plot a training run's curves from its ``metrics.jsonl`` into one PNG.

    python tools/plot_metrics.py OUTPUT_DIR/metrics.jsonl -o curves.png [--title TEXT]

A 2×2 figure against the training step: reward (``critic/score/mean``, with its min-max band when logged),
validation accuracy (every ``val-core/<source>/acc/mean@<n>`` series), response length (``response_length/mean``,
band from ``/min``-``/max``, and the clip ratio on a second axis) and policy entropy (``actor/entropy``). A series
that is not in the file leaves its panel with a note instead of failing; a line that is not valid JSON is reported
with its line number.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Optional

VAL_KEY = re.compile(r"^val-core/(?P<source>.+)/acc/mean@(?P<n>\d+)$")


def read_metrics(path: Path) -> list[dict]:
    """The jsonl rows that carry a ``step`` (later rows for the same step win, as after a resumed run)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such metrics file (the jsonl logger writes <output_dir>/metrics.jsonl)")
    by_step: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if isinstance(row, dict) and "step" in row:
                by_step.setdefault(int(row["step"]), {}).update(row)
    return [by_step[s] for s in sorted(by_step)]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) where ``key`` has a finite number."""
    xs, ys = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            xs.append(int(row["step"]))
            ys.append(float(value))
    return xs, ys


def _missing(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in this file", ha="center", va="center", transform=ax.transAxes, color="0.5")


def _line_with_band(ax, rows: list[dict], prefix: str, label: str, color: str) -> bool:
    xs, ys = series(rows, f"{prefix}/mean")
    if not xs:
        return False
    lo_x, lo = series(rows, f"{prefix}/min")
    hi_x, hi = series(rows, f"{prefix}/max")
    if lo_x == xs and hi_x == xs:
        ax.fill_between(xs, lo, hi, color=color, alpha=0.15, linewidth=0, label=f"{label} min-max")
    ax.plot(xs, ys, color=color, marker="o" if len(xs) < 30 else None, markersize=3, label=f"{label} mean")
    return True


def plot(rows: list[dict], out: Path, title: Optional[str] = None) -> list[str]:
    """Write the PNG; returns the panels that had no data."""
    # optional: matplotlib (the [logging] extra); the Agg backend is chosen before pyplot is imported
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: as above

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
    (ax_reward, ax_val), (ax_len, ax_ent) = axes
    drawn = {
        "reward": _reward_panel(ax_reward, rows),
        "validation accuracy": _validation_panel(ax_val, rows),
        "response length": _length_panel(ax_len, rows),
        "entropy": _entropy_panel(ax_ent, rows),
    }
    _decorate(fig, axes, rows, title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [panel for panel, ok in drawn.items() if not ok]


def _reward_panel(ax, rows: list[dict]) -> bool:
    ok = _line_with_band(ax, rows, "critic/score", "score", "tab:blue")
    if not ok:
        _missing(ax, "critic/score/mean")
    ax.set_title("Reward (sequence score)")
    return ok


def _validation_panel(ax, rows: list[dict]) -> bool:
    val_keys = sorted({k for row in rows for k in row if VAL_KEY.match(k)})
    for i, key in enumerate(val_keys):
        xs, ys = series(rows, key)
        m = VAL_KEY.match(key)
        ax.plot(xs, ys, marker="o", markersize=3, color=f"C{i}", label=f"{m['source']} mean@{m['n']}")
    if val_keys:
        ax.set_ylim(-0.02, 1.02)
    else:
        _missing(ax, "val-core/*/acc/mean@* keys")
    ax.set_title("Validation accuracy")
    return bool(val_keys)


def _length_panel(ax, rows: list[dict]) -> bool:
    """Mean response length with its min-max band, and the clip ratio on a second axis."""
    ok = _line_with_band(ax, rows, "response_length", "length", "tab:green")
    if ok:
        xs, ys = series(rows, "response_length/clip_ratio")
        if xs:
            ax_clip = ax.twinx()
            ax_clip.plot(xs, ys, color="tab:red", linestyle="--", linewidth=1, label="clip ratio")
            ax_clip.set_ylim(-0.02, 1.02)
            ax_clip.set_ylabel("clip ratio", color="tab:red")
            ax_clip.legend(loc="upper right", fontsize=8)
    else:
        _missing(ax, "response_length/mean")
    ax.set_title("Response length (tokens)")
    return ok


def _entropy_panel(ax, rows: list[dict]) -> bool:
    xs, ys = series(rows, "actor/entropy")
    if xs:
        ax.plot(xs, ys, color="tab:purple", marker="o" if len(xs) < 30 else None, markersize=3, label="entropy")
    else:
        _missing(ax, "actor/entropy")
    ax.set_title("Policy entropy")
    return bool(xs)


def _decorate(fig, axes, rows: list[dict], title: Optional[str]) -> None:
    """Grids, legends, integer step ticks and the figure title (with the step range)."""
    from matplotlib.ticker import MaxNLocator  # optional: matplotlib (the [logging] extra)

    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("training step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    steps = [int(r["step"]) for r in rows]
    suptitle = title or "training curves"
    if steps:
        suptitle += f"  (steps {steps[0]}-{steps[-1]})"
    fig.suptitle(suptitle)
    fig.tight_layout()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", type=Path, help="metrics.jsonl written by the jsonl logger")
    parser.add_argument("-o", "--output", type=Path, required=True, help="PNG file to write")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    try:
        rows = read_metrics(args.metrics)
    except (FileNotFoundError, ValueError) as e:
        print(f"plot_metrics: {e}", file=sys.stderr)
        return 2
    if not rows:
        print(f"plot_metrics: {args.metrics} has no rows with a 'step'", file=sys.stderr)
        return 2
    empty = plot(rows, args.output, args.title)
    note = f" (no data for: {', '.join(empty)})" if empty else ""
    print(f"wrote {args.output} from {len(rows)} steps{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
