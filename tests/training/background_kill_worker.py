"""A plain process (world 1) killed in the middle of a background save: a synchronous save of step 1, then a
background save (``save(blocking=False)``) of step 2 whose writer threads write part of their file and stall, then
the process SIGKILLs itself while they are writing. ``test_checkpoint_integrity.py`` checks what a later run finds.

    python background_kill_worker.py <save_dir>     (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the environment)
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path


def main() -> None:
    from megatron_dapo.checkpointing.checkpoint import CheckpointManager
    from megatron_dapo.weights import dist_writer
    from tests.training.checkpoint_worker import build, train_step

    save_dir = Path(sys.argv[1])
    _, chunks, optimizer, scheduler = build("fp32", False)
    manager = CheckpointManager(save_dir)
    train_step(chunks, optimizer, scheduler, seed=1)
    manager.save(1, chunks, optimizer, scheduler, data_state={"position": 1})

    writing = threading.Event()

    def stalls(bucket):
        with open(bucket[0], "wb") as f:
            f.write(b"part of a tensor file")
        writing.set()
        time.sleep(60)

    dist_writer.write_bucket = stalls
    train_step(chunks, optimizer, scheduler, seed=2)
    manager.save(2, chunks, optimizer, scheduler, data_state={"position": 2}, blocking=False)
    assert writing.wait(60)
    (save_dir.parent / "pending_step.txt").write_text(str(manager.pending_step))
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
