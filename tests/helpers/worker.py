"""The end of a torchrun test worker: this rank's report as ``<out>/rank<r>.json``, then the process group closes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.distributed as dist


def write_rank_report(out: str | Path, rank: int, report: Any) -> None:
    """Write ``report`` (JSON-serialisable) for ``rank``, wait for every rank, and destroy the default group."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()
