"""Checkpoint integrity: manifests (file → size + CRC-32), their verification, and non-finite tensor checks.

Checksum: CRC-32 as computed by ``zlib.crc32`` (xxhash is not installed here; zlib is in every Python). It is
computed over the bytes as they are written — by a stream wrapper (``HashingWriter``) for sequential writers, or per
tensor and combined with ``crc32_combine`` for writers that place tensors out of order (the streaming safetensors
writer) — so saving never reads a file back.

A manifest is JSON ``{"format": "megatron-dapo-manifest", "version": 1, "checksum": "crc32", "files": {relative
path: {"size": int, "crc32": int}}}``. ``verify_files`` reports each damaged file as a ``FileProblem`` whose text
says *truncated* (smaller than recorded), *corrupt* (larger, or the checksum differs, or unreadable) or *missing*.
"""

from __future__ import annotations

import io
import json
import os
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from megatron_dapo.weights.atomic import write_bytes_durable

PathLike = Union[str, Path]

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "megatron-dapo-manifest"
MANIFEST_VERSION = 1
CHECKSUM = "crc32"
_READ_CHUNK = 8 << 20


class NonFiniteTensorError(ValueError):
    """A tensor about to be written holds NaN or ±inf; nothing with it is published."""


# ------------------------------------------------------------------------------------------- checksums


class HashingWriter(io.RawIOBase):
    """Wraps a binary stream: every ``write`` goes through to it and updates a running CRC-32 and byte count."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw = raw
        self.crc = 0
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = self.raw.write(view)
        n = len(view) if n is None else n
        self.crc = zlib.crc32(view[:n], self.crc)
        self.size += n
        return n

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()


def _gf2_times(matrix: Sequence[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= matrix[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(matrix: Sequence[int]) -> list[int]:
    return [_gf2_times(matrix, matrix[n]) for n in range(32)]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's ``crc32_combine``, which Python's
    zlib module does not expose): lets a writer that fills a file out of order hash each piece as it writes it."""
    if len2 <= 0:
        return crc1
    odd = [0xEDB88320] + [1 << n for n in range(31)]  # the operator for one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    while True:
        even = _gf2_square(odd)  # first pass: one zero byte
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


def file_crc32(path: PathLike) -> tuple[int, int]:
    """(size, CRC-32) of a file, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_READ_CHUNK)
            if not chunk:
                return size, crc
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)


# -------------------------------------------------------------------------------------------- manifests


@dataclass(frozen=True)
class FileRecord:
    path: str  # relative to the manifest's directory, '/'-separated
    size: int
    crc32: int


@dataclass(frozen=True)
class FileProblem:
    """One damaged file: ``kind`` is "truncated", "corrupt" or "missing"; ``detail`` says expected vs found."""

    path: Path
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.path}: {self.kind} ({self.detail})"


def write_manifest(directory: PathLike, records: Iterable[FileRecord]) -> Path:
    """Write ``<directory>/manifest.json`` (fsynced) for the given records; returns its path."""
    files = {r.path: {"size": int(r.size), CHECKSUM: int(r.crc32)} for r in sorted(records, key=lambda r: r.path)}
    text = json.dumps(
        {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "checksum": CHECKSUM, "files": files}, indent=1
    )
    path = Path(directory) / MANIFEST_NAME
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return path


def read_manifest(directory: PathLike) -> Optional[dict[str, FileRecord]]:
    """The manifest's records by relative path; None when the directory has no manifest.

    A manifest that cannot be parsed raises ``ValueError`` naming it (the caller reports the checkpoint corrupt).
    """
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != MANIFEST_FORMAT or data.get("checksum") != CHECKSUM:
            raise ValueError(f"format {data.get('format')!r} checksum {data.get('checksum')!r}")
        return {rel: FileRecord(rel, int(entry["size"]), int(entry[CHECKSUM])) for rel, entry in data["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(
            f"{path}: corrupt manifest (expected JSON with format {MANIFEST_FORMAT!r}, checksum {CHECKSUM!r} and "
            f"files {{path: {{size, {CHECKSUM}}}}}): {e}"
        ) from e


def verify_file(directory: PathLike, record: FileRecord, checksum: bool = True) -> Optional[FileProblem]:
    """Compare one file with its record: size first (a stat), then, if asked, the CRC-32 (a full read)."""
    path = Path(directory) / record.path
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return FileProblem(path, "missing", f"expected {record.size} bytes, the file does not exist")
    except OSError as e:
        return FileProblem(path, "corrupt", f"unreadable: {e}")
    if size < record.size:
        return FileProblem(path, "truncated", f"expected {record.size} bytes, found {size}")
    if size > record.size:
        return FileProblem(path, "corrupt", f"expected {record.size} bytes, found {size}")
    if checksum:
        try:
            _, crc = file_crc32(path)
        except OSError as e:
            return FileProblem(path, "corrupt", f"unreadable: {e}")
        if crc != record.crc32:
            return FileProblem(path, "corrupt", f"expected {CHECKSUM} {record.crc32:08x}, found {crc:08x}")
    return None


def verify_files(directory: PathLike, records: Iterable[FileRecord], checksum: bool = True) -> Optional[FileProblem]:
    """The first damaged file among ``records`` (sizes of all files are checked before any checksum), or None."""
    records = list(records)
    for r in records:
        problem = verify_file(directory, r, checksum=False)
        if problem is not None:
            return problem
    if checksum:
        for r in records:
            problem = verify_file(directory, r, checksum=True)
            if problem is not None:
                return problem
    return None


def manifest_problem(root: PathLike, checksum: bool = True, rank: int = 0, world: int = 1) -> Optional[str]:
    """One rank's share of verifying ``root`` against its ``manifest.json``: a message, or None when intact (or
    when there is no manifest). Every rank checks every file's size (a stat); the checksums (a full read) are split
    round-robin over ``world`` ranks. Not collective: callers agree on the answer."""
    try:
        records = read_manifest(root)
    except ValueError as e:
        return str(e)
    if records is None:
        return None
    ordered = [records[k] for k in sorted(records)]
    problem = verify_files(root, ordered, checksum=False)
    if problem is None and checksum:
        problem = verify_files(root, ordered[rank::world], checksum=True)
    return None if problem is None else str(problem)


# ----------------------------------------------------------------------------------------- hashed writes


def write_bytes_hashed(path: PathLike, data: bytes) -> FileRecord:
    """Write ``data`` to ``path`` (fsynced); its record."""
    write_bytes_durable(path, data)
    return FileRecord(str(path), len(data), zlib.crc32(data))


def torch_save_hashed(obj: Any, path: PathLike) -> FileRecord:
    """``torch.save(obj)`` to ``path`` (fsynced), hashed as it is written; its record."""
    with open(path, "wb") as raw:
        stream = HashingWriter(raw)
        torch.save(obj, stream)
        raw.flush()
        os.fsync(raw.fileno())
    return FileRecord(str(path), stream.size, stream.crc)


# ----------------------------------------------------------------------------------------- finite checks


def first_non_finite(named: Iterable[tuple[str, torch.Tensor]]) -> Optional[str]:
    """Name of the first floating tensor holding NaN/±inf, or None.

    One fused reduction per (device, dtype) group: ``torch._foreach_norm`` with ord=inf (the max |x|, which is
    non-finite exactly when an element is, and cannot overflow), then a single ``isfinite().all()`` per group; only a
    failing group is searched tensor by tensor for the first name.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, str, torch.Tensor]]] = {}
    order = 0
    for name, t in named:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0 or t.is_meta:
            continue
        groups.setdefault((t.device, t.dtype), []).append((order, name, t.detach()))
        order += 1
    first: Optional[tuple[int, str]] = None
    for items in groups.values():
        norms = torch._foreach_norm([t for _, _, t in items], float("inf"))
        if bool(torch.stack(norms).isfinite().all()):
            continue
        for (i, name, _), norm in zip(items, norms):
            if not bool(norm.isfinite()) and (first is None or i < first[0]):
                first = (i, name)
                break
    return None if first is None else first[1]


def count_non_finite(t: torch.Tensor) -> int:
    return int((~t.detach().isfinite()).sum()) if t.is_floating_point() else 0
