"""torchrun worker (world 2, TP=1, DP=2, fp32, non-distributed optimizer) for checkpoint integrity.

In one process pair, in order:
  1. ``save`` steps 1 and 2 (the manifest is checked by the test against an independent read of the files);
  2. a NaN written into one weight on rank 1 only: ``save(3)`` must refuse on both ranks, naming the tensor;
  3. a writer thread failing with an I/O error mid-file (on rank 0, which writes the files at DP=2) and writers that
     hang until the worker releases them after the save (``timeout_s=3``): both ranks raise ``CheckpointError``
     while the writers still hang; nothing is published, ``latest`` is unchanged;
  4. damaged copies of step 2 (a truncated ``.distcp``, a truncated ``rng`` file, a flipped byte): explicit
     ``resolve_resume``/``load`` raise on both ranks; ``auto`` falls back to step 1 with a warning and loads it;
     with step 1 damaged too, ``auto`` raises;
  5. background saves (``save(blocking=False)``, ``background_saves``).
Rank r writes ``<out>/integrity_rank<r>.json``. Imports stay inside functions.
"""

from __future__ import annotations

import argparse
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

# A bound on a hung writer's wait, reached only if the worker never releases it.
HUNG_WRITER_BOUND_S = 60.0
HUNG_WRITERS: list[str] = []  # the files whose (broken) writer thread is blocked now


def _error(fn) -> dict[str, Any]:
    started = time.monotonic()
    try:
        fn()
        return {"error": None, "type": None, "seconds": time.monotonic() - started}
    except Exception as e:  # noqa: BLE001 - the test asserts on type and text
        return {"error": str(e), "type": type(e).__name__, "seconds": time.monotonic() - started}


def listing(d: Path) -> list[str]:
    import torch.distributed as dist

    names = sorted(p.name for p in d.iterdir())
    dist.barrier()
    return names


def broken_writer(kind: str, on_rank: int | None):
    """Make the checkpoint writer threads ``"fail"`` (an I/O error after part of the file) or hang (``"stuck"``,
    listed in ``HUNG_WRITERS`` while they do) — on every rank, or only on ``on_rank`` (the other rank finishes and
    waits for it in a collective). Returns a function that restores the real writer and releases the hung ones,
    which then give up without writing (so nothing of theirs lands while the next save runs)."""
    import torch.distributed as dist

    from megatron_dapo.weights import dist_writer

    original = dist_writer.write_bucket
    released = threading.Event()

    def failing(bucket):
        with open(bucket[0], "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")

    def stuck(bucket):
        HUNG_WRITERS.append(bucket[0])
        try:
            released.wait(HUNG_WRITER_BOUND_S)
        finally:
            HUNG_WRITERS.remove(bucket[0])
        raise OSError("released by the test: the hung writer gives up")

    if on_rank is None or dist.get_rank() == on_rank:
        dist_writer.write_bucket = failing if kind == "fail" else stuck

    def restore() -> None:
        dist_writer.write_bucket = original
        released.set()

    return restore


def background_saves(save_dir: Path, chunks, optimizer, scheduler) -> dict[str, Any]:
    """``save(blocking=False)``: what is visible while the files are written, publication by the next save and by
    ``finalize``, the state saved being the one at ``save()`` although training went on, and a failing background
    writer raising in the ``finalize`` that completes it."""
    from megatron_dapo.checkpointing.checkpoint import CheckpointManager, checkpoint_problem
    from tests.training.checkpoint_worker import train_step
    from tests.training.common import named_params

    def latest() -> str:
        return (save_dir / "latest").read_text() if (save_dir / "latest").exists() else ""

    manager = CheckpointManager(save_dir, timeout_s=20)
    manager.save(1, chunks, optimizer, scheduler, data_state={"position": 1})
    at_save = {n: p.detach().clone() for n, p in named_params(chunks)}
    manager.save(2, chunks, optimizer, scheduler, data_state={"position": 2}, blocking=False)
    res: dict[str, Any] = {"pending": manager.pending_step, "while_pending": listing(save_dir)}
    res["latest_pending"] = latest()
    train_step(chunks, optimizer, scheduler, seed=9)  # the parameters change while step 2's files are written
    manager.save(3, chunks, optimizer, scheduler, data_state={"position": 3}, blocking=False)
    res.update(pending_after_next=manager.pending_step, latest_after_next=latest())
    res["finalized"] = manager.finalize().name
    res.update(latest_after_finalize=latest(), after_finalize=listing(save_dir), problem=None)
    res["problem"] = checkpoint_problem(save_dir / "global_step_2")
    info = manager.load(save_dir / "global_step_2", chunks, optimizer, scheduler)
    diffs = [float((p.detach() - at_save[n]).abs().max()) for n, p in named_params(chunks)]
    res.update(loaded_step=info["step"], max_diff_vs_save_time=max(diffs))
    restore = broken_writer("fail", on_rank=0)
    try:
        res["failing_save"] = _error(lambda: manager.save(4, chunks, optimizer, scheduler, blocking=False))
        res["failing_finalize"] = _error(manager.finalize)
    finally:
        restore()
    res.update(latest_after_failure=latest(), after_failure=listing(save_dir), nothing_pending=manager.finalize())
    return res


def main() -> None:
    import logging

    import torch
    import torch.distributed as dist

    from megatron_dapo.checkpointing.checkpoint import CheckpointManager, resolve_resume
    from megatron_dapo.parallel import destroy_model_parallel
    from tests.training.checkpoint_worker import build, train_step
    from tests.training.common import named_params

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    _, chunks, optimizer, scheduler = build("fp32", False)
    rank = dist.get_rank()
    res: dict[str, Any] = {}
    warnings: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("megatron_dapo.checkpoint").addHandler(Capture())

    # 1. two good checkpoints
    save_dir = out / "ckpt"
    manager = CheckpointManager(save_dir, timeout_s=20)
    for step in (1, 2):
        train_step(chunks, optimizer, scheduler, seed=step)
        t0 = time.perf_counter()
        manager.save(step, chunks, optimizer, scheduler, data_state={"position": step})
        res[f"save{step}_seconds"] = time.perf_counter() - t0
    res["after_saves"] = listing(save_dir)

    # 2. a NaN on rank 1 only: refused everywhere before anything is written
    name, param = named_params(chunks)[3]
    saved_value = param.detach().clone()
    if rank == 1:
        with torch.no_grad():
            param.view(-1)[5] = float("nan")
    nan = _error(lambda: manager.save(3, chunks, optimizer, scheduler, data_state={"position": 3}))
    with torch.no_grad():
        param.copy_(saved_value)
    res["nan"] = {**nan, "param": name, "after": listing(save_dir), "latest": (save_dir / "latest").read_text()}

    # 3a. a writer thread failing mid-save (rank 0: at DP=2 the replicated state is written by rank 0 only)
    restore = broken_writer("fail", on_rank=0)
    try:
        failed = _error(lambda: manager.save(4, chunks, optimizer, scheduler, data_state={"position": 4}))
    finally:
        restore()
    res["failed"] = {**failed, "after": listing(save_dir), "latest": (save_dir / "latest").read_text()}
    # 3b. writers that hang (both ranks): the timeout fires while they still do
    restore = broken_writer("stuck", on_rank=None)
    try:
        stuck = _error(
            lambda: CheckpointManager(save_dir, timeout_s=3).save(5, chunks, optimizer, scheduler, data_state={})
        )
        stuck["hung_writers"] = len(HUNG_WRITERS)
    finally:
        restore()
    res["stuck"] = {**stuck, "after": listing(save_dir), "latest": (save_dir / "latest").read_text()}
    # The next save works and clears the unpublished leftovers.
    manager.save(6, chunks, optimizer, scheduler, data_state={"position": 6})
    res["after_recovery"] = listing(save_dir)

    # Cost of verifying a checkpoint, counted in bytes read for checksums (sizes + checksums, files split across the
    # ranks; then sizes only): every file hashed by exactly one rank the first time, none the second.
    from megatron_dapo.checkpointing import checkpoint
    from megatron_dapo.weights import integrity

    hashed: list[list] = []
    real_digest = integrity.file_digest

    def counting_digest(path, *args, **kwargs):
        size, digest = real_digest(path, *args, **kwargs)
        hashed.append([str(Path(path).relative_to(save_dir / "global_step_6")), size])
        return size, digest

    checkpoint._verified.clear()
    integrity.file_digest = counting_digest
    try:
        assert checkpoint.checkpoint_problem(save_dir / "global_step_6") is None
        res["verify_hashed"] = list(hashed)
        hashed.clear()
        assert checkpoint.checkpoint_problem(save_dir / "global_step_6") is None
        res["verify_sizes_only_hashed"] = list(hashed)
    finally:
        integrity.file_digest = real_digest
    manifest = integrity.read_manifest(save_dir / "global_step_6")
    res["manifest_files"] = {name: record.size for name, record in manifest.items()}
    res["checkpoint_bytes"] = sum(f.stat().st_size for f in (save_dir / "global_step_6").rglob("*") if f.is_file())

    # 4. damaged copies of step 2
    def damaged_copy(kind: str) -> Path:
        root = out / f"damaged-{kind}"
        if rank == 0:
            root.mkdir()
            for step in (1, 2):
                shutil.copytree(save_dir / f"global_step_{step}", root / f"global_step_{step}")
            (root / "latest").write_text("global_step_2\n")
            target = root / "global_step_2"
            if kind == "distcp":
                f = sorted((target / "dist_ckpt").glob("*.distcp"))[0]
                f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
            elif kind == "rng":
                f = target / "rng" / "rank_00001.pt"
                f.write_bytes(f.read_bytes()[:100])
            else:  # one flipped byte in the middle of a tensor file, size unchanged
                f = sorted((target / "dist_ckpt").glob("*.distcp"))[-1]
                data = bytearray(f.read_bytes())
                data[len(data) // 2] ^= 0xFF
                f.write_bytes(bytes(data))
        dist.barrier()
        return root

    for kind in ("distcp", "rng", "flip"):
        root = damaged_copy(kind)
        target = root / "global_step_2"
        entry: dict[str, Any] = {}
        entry["explicit"] = _error(lambda t=target: resolve_resume(str(t), None))
        entry["load"] = _error(lambda t=target: CheckpointManager(t.parent).load(t, chunks, optimizer, scheduler))
        warnings.clear()
        t0 = time.perf_counter()
        chosen = resolve_resume("auto", root)
        entry["auto"] = str(chosen)
        entry["auto_warnings"] = list(warnings)
        info = CheckpointManager(root).load(chosen, chunks, optimizer, scheduler)
        entry["auto_seconds"] = time.perf_counter() - t0
        entry["auto_loaded_step"] = info["step"]
        if kind == "distcp":  # and with the fallback damaged as well: nothing intact
            if rank == 0:
                (root / "global_step_1" / "rng" / "rank_00000.pt").write_bytes(b"")
            dist.barrier()
            entry["none_intact"] = _error(lambda r=root: resolve_resume("auto", r))
        res[kind] = entry

    res["background"] = background_saves(out / "background", chunks, optimizer, scheduler)
    (out / f"integrity_rank{rank}.json").write_text(json.dumps(res, indent=1))
    destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
