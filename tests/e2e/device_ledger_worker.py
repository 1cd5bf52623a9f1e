"""Runs the real ``DAPOTrainer`` (one rank of a torchrun job) on the modelled accelerator of
``megatron_dapo/testing/device_ledger.py`` and writes what the ledger saw as ``<out>/rank<r>.json``.

Arguments: ``--config``, ``--out``, ``--capacity`` (bytes), ``--engine-weights`` (bytes), then config overrides.
A failure (the ledger's out-of-memory, vLLM's start-up refusal) is reported, not raised, so that the test can name it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from megatron_dapo.config import load_config
from megatron_dapo.handoff.offload import optimizer_tensors, param_tensors, reference_tensors
from megatron_dapo.platform import use_platform
from megatron_dapo.reporting.console import setup_logging
from megatron_dapo.testing.device_ledger import LedgerPlatform
from megatron_dapo.training.trainer import DAPOTrainer


def storage_bytes(tensors) -> list[int]:
    seen: dict[int, int] = {}
    for t in tensors:
        seen[int(t.untyped_storage()._cdata)] = t.untyped_storage().nbytes()
    return list(seen.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--capacity", type=int, required=True)
    ap.add_argument("--engine-weights", type=int, required=True)
    args, overrides = ap.parse_known_args()
    rank = int(os.environ["RANK"])
    platform = use_platform(LedgerPlatform(args.capacity, args.engine_weights))
    cfg = load_config(args.config, overrides)
    setup_logging(cfg.trainer.output_dir, rank, verbose=False)
    report: dict = {"error": None}
    trainer = None
    try:
        with platform.metering():  # every allocation from the trainer's first on is charged
            trainer = DAPOTrainer(cfg)
            report["val"] = trainer.fit()
        h = trainer.handoff
        h.restore_actor()  # every storage at its full size, to compare with the host buffers
        if h.offloader.is_offloaded("reference"):
            h.offloader.onload("reference")
        report["storages"] = {
            "optimizer": storage_bytes(optimizer_tensors(h.optimizer, exclude=param_tensors(h.actor_chunks))),
            "reference": storage_bytes(reference_tensors(h.ref_chunks)),
        }
        report["host_buffer_bytes"] = dict(h.offloader.stats.host_bytes)
        report["host_buffers"] = list(platform.record.host_buffers)  # before close() gives them back
        report["global_step"] = trainer.global_step
    except Exception as exc:  # noqa: BLE001 - the report names it
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if trainer is not None:
            trainer.close()
    r = platform.record
    report.update(
        capacity=platform.capacity,
        startup=r.startup,
        peaks=r.peaks,
        phase_holders=r.phase_holders,
        events=r.events,
        peak_largest=r.peak_largest,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
