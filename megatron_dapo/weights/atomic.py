"""Publishing files and directories atomically: write into a temporary sibling, make it durable, rename it into
place. A crash at any point leaves either the old content or the new one where readers look, never a mix.

Used by the converter (``<save_dir>.tmp-<pid>`` → ``<save_dir>``) and the training checkpoints
(``<save_dir>/.tmp-step_<n>`` → ``<save_dir>/global_step_<n>``, then the ``latest`` marker).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional, Union

PathLike = Union[str, Path]

__all__ = ["fresh_dir", "fsync_dir", "publish_dir", "start_writeback", "write_bytes_durable", "write_text_atomic"]


def fsync_dir(path: PathLike) -> None:
    """Make a rename inside ``path`` durable: the directory entry itself must reach the disk (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Have the kernel start writing a just-written range of ``fd`` to disk now (best effort): a writer that calls it
    every few tens of MB keeps the disk busy while it writes the rest, and its final fsync waits for the tail only.
    Linux starts the writeback of a range's dirty pages for ``POSIX_FADV_DONTNEED`` (and drops its clean ones: a
    file written for later is not read back now)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    try:
        advise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass


def write_bytes_durable(path: PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (no rename: for files inside a directory published later)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_text_atomic(path: PathLike, text: str) -> None:
    """Replace ``path`` by a file holding ``text``: written to a hidden sibling, fsynced, ``os.replace``d."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fresh_dir(path: PathLike) -> Path:
    """Create ``path`` empty (a leftover of the same name, which only this writer uses, is removed first)."""
    path = Path(path)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def publish_dir(tmp: PathLike, final: PathLike, backup: Optional[PathLike] = None) -> Path:
    """Move the finished directory ``tmp`` to ``final``. An existing ``final`` is first renamed to ``backup``
    (default ``<final>.old-<pid>``) and deleted only after the new one is in place; nothing is half-visible."""
    tmp, final = Path(tmp), Path(final)
    fsync_dir(tmp)
    old = None
    if final.exists():
        old = Path(backup) if backup is not None else final.with_name(f"{final.name}.old-{os.getpid()}")
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final
