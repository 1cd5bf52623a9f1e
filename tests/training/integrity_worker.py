"""torchrun worker (world 2, TP=1, DP=2, fp32, non-distributed optimizer) for checkpoint integrity.

In one process pair, in order:
  1. ``save`` steps 1 and 2 (the manifest is checked by the test against an independent read of the files);
  2. a NaN written into one weight on rank 1 only: ``save(3)`` must refuse on both ranks, naming the tensor;
  3. a writer helper killed with SIGKILL mid-save (on rank 0, which writes the files at DP=2; its helpers are
     slowed by a wrapper so the kill lands during the write) and helpers that never finish (``timeout_s=3``): both
     ranks raise ``CheckpointError`` within the timeout; nothing is published, ``latest`` is unchanged;
  4. damaged copies of step 2 (a truncated ``.distcp``, a truncated ``rng`` file, a flipped byte): explicit
     ``resolve_resume``/``load`` raise on both ranks; ``auto`` falls back to step 1 with a warning and loads it;
     with step 1 damaged too, ``auto`` raises.
Rank r writes ``<out>/integrity_rank<r>.json``. Imports stay inside functions (the writer forks helpers).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

SLOW_HELPER_S = 60.0


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


def slow_helpers(kill_on_rank: int | None):
    """Make the writer helpers sleep before writing — on every rank, or only on ``kill_on_rank``, where a thread
    then SIGKILLs the first helper (the other rank finishes and waits for it in a collective)."""
    import os
    import threading

    import psutil
    import torch.distributed as dist

    from megatron_dapo.training import checkpoint

    original = checkpoint._write_bucket_hashed

    def sleepy(*args, **kwargs):
        time.sleep(SLOW_HELPER_S)
        return original(*args, **kwargs)

    if kill_on_rank is None or dist.get_rank() == kill_on_rank:
        checkpoint._write_bucket_hashed = sleepy
    killed: dict[str, Any] = {}
    if kill_on_rank is not None and dist.get_rank() == kill_on_rank:
        me = psutil.Process(os.getpid())
        before = {c.pid for c in me.children()}

        def killer() -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                new = [c for c in me.children() if c.pid not in before]
                if new:
                    time.sleep(0.5)  # it is inside the (slowed) write
                    killed["pid"] = new[0].pid
                    new[0].kill()
                    return
                time.sleep(0.05)

        threading.Thread(target=killer, daemon=True).start()

    def restore() -> None:
        checkpoint._write_bucket_hashed = original

    return killed, restore


def main() -> None:
    import logging

    import torch
    import torch.distributed as dist

    from megatron_dapo.parallel import destroy_model_parallel
    from megatron_dapo.training.checkpoint import CheckpointManager, resolve_resume
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

    # 3a. a writer helper killed mid-save (rank 0: at DP=2 the replicated state is written by rank 0 only)
    killed, restore = slow_helpers(kill_on_rank=0)
    try:
        kill = _error(lambda: manager.save(4, chunks, optimizer, scheduler, data_state={"position": 4}))
    finally:
        restore()
    res["killed"] = {**kill, "pid": killed.get("pid"), "after": listing(save_dir)}
    res["killed"]["latest"] = (save_dir / "latest").read_text()
    # 3b. a helper that never finishes (both ranks): the timeout fires
    _, restore = slow_helpers(kill_on_rank=None)
    try:
        stuck = _error(
            lambda: CheckpointManager(save_dir, timeout_s=3).save(5, chunks, optimizer, scheduler, data_state={})
        )
    finally:
        restore()
    res["stuck"] = {**stuck, "after": listing(save_dir), "latest": (save_dir / "latest").read_text()}
    # The next save works and clears the unpublished leftovers.
    manager.save(6, chunks, optimizer, scheduler, data_state={"position": 6})
    res["after_recovery"] = listing(save_dir)

    # Cost of verifying a checkpoint (sizes + checksums, files split across the ranks; then sizes only).
    from megatron_dapo.training import checkpoint

    checkpoint._verified.clear()
    t0 = time.perf_counter()
    assert checkpoint.checkpoint_problem(save_dir / "global_step_6") is None
    res["verify_seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert checkpoint.checkpoint_problem(save_dir / "global_step_6") is None
    res["verify_sizes_only_seconds"] = time.perf_counter() - t0
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

    (out / f"integrity_rank{rank}.json").write_text(json.dumps(res, indent=1))
    destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
