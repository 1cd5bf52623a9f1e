"""Checkpoint integrity: manifests (file → size + checksum), their verification, and non-finite tensor checks.

Checksum: XXH3-64 (``xxhash``, the reference xxHash library's Python binding: SIMD, ~5 GB/s on one core here
against zlib CRC-32's ~1.6 GB/s). It is computed once over the bytes as they are written, by a stream wrapper
(``HashingWriter``) around every sequential writer: the converter's dist writer, the training save's helper processes
(megatron-core's write buckets), ``torch_save_hashed`` and ``write_bytes_hashed``; saving never reads a file back.
Why not CRC-32C (``google-crc32c``): its extension accepts only ``bytes`` (``y#``), so hashing a tensor's memory
would copy every byte into a ``bytes`` object first, which is the copy this module exists to avoid; xxhash hashes
any buffer in place (a ``memoryview`` of the tensor being written). XXH3 is not combinable the way a CRC is, which
no manifest writer needs: all of them write a file front to back. The streaming safetensors writer, which fills a
file out of order, keeps zlib CRC-32 and ``crc32_combine`` for its own per-file record (no manifest holds it).

A manifest is JSON ``{"format": "megatron-dapo-manifest", "version": 2, "checksum": "xxh3_64", "files": {relative
path: {"size": int, "xxh3_64": "<16 hex digits>"}}}``: ``checksum`` names the algorithm and each file's entry holds
its digest under that name, as a hex string. Version 1 (checkpoints written before XXH3) is ``"checksum": "crc32"``
with ``"crc32": int`` entries (zlib CRC-32); it is still read and verified with zlib. A record carries its algorithm
(``FileRecord.algorithm``), so verifying a v1 checkpoint recomputes CRC-32 and a v2 one XXH3-64. ``verify_files``
reports each damaged file as a ``FileProblem`` whose text says *truncated* (smaller than recorded), *corrupt*
(larger, or the checksum differs, or unreadable) or *missing*.
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
import xxhash

from megatron_dapo.platform.base import Platform
from megatron_dapo.weights.atomic import start_writeback, write_bytes_durable

PathLike = Union[str, Path]

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "megatron-dapo-manifest"
MANIFEST_VERSION = 2
CHECKSUM = "xxh3_64"  # what new manifests use
LEGACY_CHECKSUM = "crc32"  # version 1 manifests (zlib CRC-32, stored as an int)
_READ_CHUNK = 8 << 20
_PIECE = 4 << 20  # HashingWriter's write size: a piece hashed just before it is written is still in the cache


class NonFiniteTensorError(ValueError):
    """A tensor about to be written holds NaN or ±inf; nothing with it is published."""


# ------------------------------------------------------------------------------------------- checksums


class _Crc32:
    """zlib CRC-32 behind the ``update``/``hexdigest`` interface of xxhash's hashers (version 1 manifests)."""

    def __init__(self) -> None:
        self.crc = 0

    def update(self, data: Any) -> None:
        self.crc = zlib.crc32(data, self.crc)

    def hexdigest(self) -> str:
        return f"{self.crc:08x}"


def new_hasher(algorithm: str = CHECKSUM) -> Any:
    """A running hash of ``algorithm`` ("xxh3_64" or "crc32"): ``update(buffer)``, ``hexdigest()``."""
    if algorithm == CHECKSUM:
        return xxhash.xxh3_64()
    if algorithm == LEGACY_CHECKSUM:
        return _Crc32()
    raise ValueError(f"unknown checksum {algorithm!r} (known: {CHECKSUM!r}, {LEGACY_CHECKSUM!r})")


def bytes_digest(data: Any, algorithm: str = CHECKSUM) -> str:
    """Hex digest of a bytes-like object (hashed in place)."""
    h = new_hasher(algorithm)
    h.update(data)
    return h.hexdigest()


class HashingWriter(io.RawIOBase):
    """Wraps a binary stream: every ``write`` goes through to it and updates a running hash (XXH3-64) and byte count,
    from the caller's buffer itself (no copy). ``writeback_every`` > 0 (a file written from its start): the kernel is
    asked to start writing each such many bytes to disk as soon as they are written (``atomic.start_writeback``)."""

    def __init__(self, raw: Any, algorithm: str = CHECKSUM, writeback_every: int = 0) -> None:
        super().__init__()
        self.raw = raw
        self.algorithm = algorithm
        self.hasher = new_hasher(algorithm)
        self.size = 0
        self.writeback_every = writeback_every
        self._written_back = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        """Writes all of ``b`` (``torch.save`` ignores a short count), in pieces of ``_PIECE`` bytes, each hashed
        right before it is written: the copy into the file then reads it from the cache, not from memory again."""
        view = memoryview(b).cast("B")
        for start in range(0, len(view), _PIECE):
            piece = view[start : start + _PIECE]
            self.hasher.update(piece)
            done = 0
            while done < len(piece):
                n = self.raw.write(piece[done:])
                done = len(piece) if n is None else done + n
            self.size += len(piece)
            if self.writeback_every and self.size - self._written_back >= self.writeback_every:
                start_writeback(self.raw.fileno(), self._written_back, self.size - self._written_back)
                self._written_back = self.size
        return len(view)

    @property
    def digest(self) -> str:
        return self.hasher.hexdigest()

    def record(self, path: PathLike) -> FileRecord:
        """The record of what went through this writer, as the file ``path``."""
        return FileRecord(str(path), self.size, self.digest, self.algorithm)

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


def file_digest(path: PathLike, algorithm: str = CHECKSUM, fsync: bool = False) -> tuple[int, str]:
    """(size, hex digest) of a file, read in chunks into one reused buffer; ``fsync``: the file is also made durable
    (on the same descriptor), for a file another writer made without an fsync."""
    h, size = new_hasher(algorithm), 0
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                if fsync:
                    os.fsync(f.fileno())
                return size, h.hexdigest()
            h.update(view[:n])
            size += n


def durable_file_record(path: PathLike) -> FileRecord:
    """The record of a file megatron-core wrote without an fsync (``common.pt``, ``.metadata``, ``metadata.json``),
    hashed from the page cache right after it was written and fsynced before its directory is published."""
    return FileRecord(str(path), *file_digest(path, fsync=True))


# The name callers outside this package still use (e.g. tests' checkpoint helpers): (size, digest) of a file in
# the current checksum, not necessarily CRC-32.
file_crc32 = file_digest


# -------------------------------------------------------------------------------------------- manifests


@dataclass(frozen=True)
class FileRecord:
    path: str  # relative to the manifest's directory, '/'-separated
    size: int
    digest: str  # hex digest in ``algorithm``
    algorithm: str = CHECKSUM  # "crc32" for the records of a version 1 manifest


@dataclass(frozen=True)
class FileProblem:
    """One damaged file: ``kind`` is "truncated", "corrupt" or "missing"; ``detail`` says expected vs found."""

    path: Path
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.path}: {self.kind} ({self.detail})"


def write_manifest(directory: PathLike, records: Iterable[FileRecord]) -> Path:
    """Write ``<directory>/manifest.json`` (version 2, fsynced) for the given records, which share one checksum
    algorithm (records read from a version 1 manifest keep theirs: "crc32"); returns its path."""
    records = sorted(records, key=lambda r: r.path)
    algorithms = {r.algorithm for r in records} or {CHECKSUM}
    if len(algorithms) != 1:
        raise ValueError(f"one manifest, one checksum: records use {sorted(algorithms)}")
    (algorithm,) = algorithms
    files = {r.path: {"size": int(r.size), algorithm: str(r.digest)} for r in records}
    text = json.dumps(
        {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "checksum": algorithm, "files": files}, indent=1
    )
    path = Path(directory) / MANIFEST_NAME
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return path


def _parse_manifest(data: Any) -> dict[str, FileRecord]:
    """Records of a parsed manifest, version 1 (``crc32`` ints) or 2 (hex digests in its ``checksum``)."""
    if data.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"format {data.get('format')!r}")
    version, algorithm = data.get("version"), data.get("checksum")
    if version == 1 and algorithm == LEGACY_CHECKSUM:
        return {
            rel: FileRecord(rel, int(e["size"]), f"{int(e[algorithm]):08x}", algorithm)
            for rel, e in data["files"].items()
        }
    if version == MANIFEST_VERSION and algorithm in (CHECKSUM, LEGACY_CHECKSUM):
        records = {}
        for rel, e in data["files"].items():
            digest = e[algorithm]
            if not isinstance(digest, str):
                raise TypeError(f"{rel}: {algorithm} {digest!r} is not a hex string")
            int(digest, 16)  # a hex string
            records[rel] = FileRecord(rel, int(e["size"]), digest.lower(), algorithm)
        return records
    raise ValueError(f"version {version!r} with checksum {algorithm!r} is not one this megatron-dapo reads")


def read_manifest(directory: PathLike) -> Optional[dict[str, FileRecord]]:
    """The manifest's records by relative path; None when the directory has no manifest.

    A manifest that cannot be parsed raises ``ValueError`` naming it (the caller reports the checkpoint corrupt).
    """
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        return _parse_manifest(json.loads(path.read_text(encoding="utf-8")))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(
            f"{path}: corrupt manifest (expected JSON with format {MANIFEST_FORMAT!r}, version {MANIFEST_VERSION}"
            f" and checksum {CHECKSUM!r} (or version 1 with {LEGACY_CHECKSUM!r}), and files {{path: {{size,"
            f" <checksum>}}}}): {e}"
        ) from e


def verify_file(directory: PathLike, record: FileRecord, checksum: bool = True) -> Optional[FileProblem]:
    """Compare one file with its record: size first (a stat), then, if asked, the checksum (a full read)."""
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
            _, digest = file_digest(path, record.algorithm)
        except OSError as e:
            return FileProblem(path, "corrupt", f"unreadable: {e}")
        if digest != record.digest:
            return FileProblem(path, "corrupt", f"expected {record.algorithm} {record.digest}, found {digest}")
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
    return FileRecord(str(path), len(data), bytes_digest(data))


def torch_save_hashed(obj: Any, path: PathLike) -> FileRecord:
    """``torch.save(obj)`` to ``path`` (fsynced), hashed as it is written; its record."""
    with open(path, "wb") as raw:
        stream = HashingWriter(raw)
        torch.save(obj, stream)
        raw.flush()
        os.fsync(raw.fileno())
    return stream.record(path)


# ----------------------------------------------------------------------------------------- finite checks


_MINMAX_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Picks the reduction when the caller passes no platform: the base rule (by the tensor's device). Not
# ``get_platform()``: that sets a platform up (CPU shims, MindSpeed) in a process that may only write files.
_BASE_PLATFORM = Platform()


def _first_bad_in_group(items: list[tuple[int, str, torch.Tensor]], platform: Platform) -> Optional[tuple[int, str]]:
    """(order, name) of the first non-finite tensor of one (device, dtype) group, or None.

    Where ``platform.prefers_fused_reductions(device)`` (accelerators): one fused ``torch._foreach_norm`` with
    ord=inf (the max |x|, non-finite exactly when an element is) and a single ``isfinite().all()`` for the group;
    only a failing group is searched tensor by tensor. Otherwise (host memory): ``torch.aminmax`` per tensor (one
    vectorised pass; NaN propagates into both ends, ±inf shows in one), for the dtypes it takes."""
    t0 = items[0][2]
    if not platform.prefers_fused_reductions(t0.device) and t0.dtype in _MINMAX_DTYPES:
        for i, name, t in items:
            lo, hi = torch.aminmax(t)
            if not (bool(lo.isfinite()) and bool(hi.isfinite())):
                return i, name
        return None
    norms = torch._foreach_norm([t for _, _, t in items], float("inf"))
    if bool(torch.stack(norms).isfinite().all()):
        return None
    for (i, name, _), norm in zip(items, norms):
        if not bool(norm.isfinite()):
            return i, name
    return None


def first_non_finite(named: Iterable[tuple[str, torch.Tensor]], platform: Optional[Platform] = None) -> Optional[str]:
    """Name of the first floating tensor holding NaN/±inf, or None: one reduction per tensor in host memory, one
    fused reduction per (device, dtype) group on an accelerator, as ``platform`` (default: the base rule) prefers
    (``_first_bad_in_group``); no temporary of a tensor's size."""
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, str, torch.Tensor]]] = {}
    order = 0
    for name, t in named:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0 or t.is_meta:
            continue
        groups.setdefault((t.device, t.dtype), []).append((order, name, t.detach()))
        order += 1
    chooser = platform or _BASE_PLATFORM
    found = [bad for items in groups.values() if (bad := _first_bad_in_group(items, chooser)) is not None]
    return min(found)[1] if found else None


def count_non_finite(t: torch.Tensor) -> int:
    return int((~t.detach().isfinite()).sum()) if t.is_floating_point() else 0
