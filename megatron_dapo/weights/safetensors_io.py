"""Streaming safetensors IO: read one tensor at a time, write a file whose header is known before its tensors.

Format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`` padded with spaces to a
multiple of 8, then the tensors' bytes back to back (offsets relative to the end of the header, no holes).

Why our own reader instead of ``safe_open``: ``safe_open`` memory-maps the whole file, and every page it touches
stays in the process's resident set until the file is closed, so walking a whole checkpoint grows RSS to the
checkpoint's size. Here ``get`` reads one tensor with ``pread`` (optionally into a reused buffer), so the resident set
holds only the tensors in use (mapping each tensor separately instead pays page faults and unmapping, which cost
more than the copy). The files we write are checked against the ``safetensors`` library itself in the tests.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

from megatron_dapo.weights.integrity import NonFiniteTensorError, crc32_combine

PathLike = Union[str, Path]

_DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_ST_TO_DTYPE: dict[str, torch.dtype] = {v: k for k, v in _DTYPE_TO_ST.items()}

INDEX_NAME = "model.safetensors.index.json"


class SafetensorsIntegrityError(ValueError):
    """A safetensors file is truncated or corrupt; the message names the file and says which."""


SINGLE_NAME = "model.safetensors"


def st_dtype(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_TO_ST:
        raise ValueError(f"dtype {dtype} has no safetensors name (supported: {sorted(map(str, _DTYPE_TO_ST))})")
    return _DTYPE_TO_ST[dtype]


def torch_dtype(st_name: str) -> torch.dtype:
    if st_name not in _ST_TO_DTYPE:
        raise ValueError(f"safetensors dtype {st_name!r} is not supported (supported: {sorted(_ST_TO_DTYPE)})")
    return _ST_TO_DTYPE[st_name]


def tensor_nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class FileSlice:
    """Whole rows of a tensor stored in a file, to be copied file-to-file by the kernel (``copy_file_range``).

    A converter whose output rows are runs of input rows never needs those bytes in user memory.
    """

    file: SafetensorsFile
    offset: int  # absolute byte offset in the file
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)


# Kernel file-to-file copies; False after the first refusal (e.g. across file systems on old kernels) or when absent.
_copy_file_range_ok = hasattr(os, "copy_file_range")


def _copy_range(src_fd: int, src_off: int, nbytes: int, dst_fd: int, dst_off: int) -> None:
    global _copy_file_range_ok
    done = 0
    if _copy_file_range_ok:
        try:
            while done < nbytes:
                n = os.copy_file_range(src_fd, dst_fd, nbytes - done, src_off + done, dst_off + done)
                if n == 0:
                    raise OSError(f"copy_file_range hit the end of the source at byte {src_off + done}")
                done += n
            return
        except OSError as e:
            if e.errno is None:
                raise
            _copy_file_range_ok = False  # EXDEV / EINVAL / ENOSYS ...: copy through user memory from here on
    chunk = 16 << 20
    buf = bytearray(min(chunk, nbytes - done))
    while done < nbytes:
        n = os.preadv(src_fd, [memoryview(buf)[: min(chunk, nbytes - done)]], src_off + done)
        if n <= 0:
            raise OSError(f"unexpected end of file at byte {src_off + done}")
        view = memoryview(buf)[:n]
        written = 0
        while written < n:
            written += os.pwrite(dst_fd, view[written:], dst_off + done + written)
        done += n


# ---------------------------------------------------------------------------------------------- reading


def read_header(path: PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse a safetensors header: ``({name: TensorInfo}, metadata)`` without touching tensor data.

    Damage is named: a header that does not parse or describes impossible tensors → "corrupt"; a data region
    shorter than the header says (a partial download or copy) → "truncated". Both raise ``SafetensorsIntegrityError``.
    """
    path = Path(path)
    with open(path, "rb") as f:
        raw_len = f.read(8)
        size = os.fstat(f.fileno()).st_size
        if len(raw_len) != 8:
            raise SafetensorsIntegrityError(
                f"{path}: truncated or not a safetensors file ({size} bytes, shorter than the 8-byte header length)"
            )
        (n,) = struct.unpack("<Q", raw_len)
        if n > size - 8:
            raise SafetensorsIntegrityError(
                f"{path}: truncated or corrupt: header length {n} exceeds the file size {size}"
            )
        try:
            header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError(f"expected a JSON object, got {type(header).__name__}")
        except ValueError as e:
            raise SafetensorsIntegrityError(f"{path}: corrupt: the {n}-byte JSON header does not parse ({e})") from e
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    infos = {}
    data_end = 0
    for name, h in header.items():
        try:
            begin, end = h["data_offsets"]
            dtype = torch_dtype(h["dtype"])
            shape = tuple(int(d) for d in h["shape"])
        except (KeyError, TypeError, ValueError) as e:
            raise SafetensorsIntegrityError(f"{path}: corrupt header entry for tensor {name!r}: {h!r} ({e})") from e
        if end - begin != tensor_nbytes(dtype, shape) or begin < 0:
            raise SafetensorsIntegrityError(
                f"{path}: corrupt header: tensor {name!r} has data_offsets {h['data_offsets']} for {h}"
            )
        data_end = max(data_end, end)
        infos[name] = TensorInfo(name, dtype, shape, base + begin, base + end)
    if base + data_end > size:
        raise SafetensorsIntegrityError(
            f"{path}: truncated: the header says the data ends at byte {base + data_end}, the file has {size} bytes"
        )
    return infos, meta


class SafetensorsFile:
    """One safetensors file, read tensor by tensor with ``pread`` (no memory map)."""

    def __init__(self, path: PathLike) -> None:
        self.path = Path(path)
        self.tensors, self.metadata = read_header(self.path)
        self._fd: Optional[int] = None

    def keys(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        return self.tensors[name]

    def get(self, name: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Read tensor ``name``; into ``out`` (a 1-D uint8 buffer of at least its size, e.g. from ``BufferPool``)
        when given, so that a converter reuses already-faulted-in memory instead of allocating per tensor."""
        info = self.info(name)
        if out is None:
            out = torch.empty(info.nbytes, dtype=torch.uint8)
        elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < info.nbytes or not out.is_contiguous():
            raise ValueError(
                f"read buffer for {name!r} must be a contiguous 1-D uint8 tensor of >= {info.nbytes} bytes"
            )
        out = out[: info.nbytes]
        if info.nbytes:
            self._read_into(out, info.begin)
        return out.view(info.dtype).reshape(info.shape)

    def rows(self, name: str, start: int, count: int) -> FileSlice:
        """Rows ``[start, start + count)`` of tensor ``name`` (dim 0) as a ``FileSlice``; nothing is read."""
        info = self.info(name)
        if not info.shape or start < 0 or start + count > info.shape[0]:
            raise ValueError(f"{self.path}: rows [{start}, {start + count}) out of range for {name!r} {info.shape}")
        row_bytes = tensor_nbytes(info.dtype, info.shape[1:])
        return FileSlice(self, info.begin + start * row_bytes, info.dtype, (count,) + info.shape[1:])

    def _fileno(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return self._fd

    def _read_into(self, out: torch.Tensor, offset: int) -> None:
        self._fileno()
        view = memoryview(out.numpy())
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"{self.path}: unexpected end of file at byte {offset + done}")
            done += got

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SafetensorsDir:
    """The safetensors weights of an HF model directory: ``model.safetensors`` or shards + ``*.index.json``."""

    def __init__(self, directory: PathLike) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX_NAME
        if index.is_file():
            with open(index) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
            missing = [fn for fn in files if not (self.directory / fn).is_file()]
            if missing:
                raise FileNotFoundError(f"{index} names shard files that do not exist (missing): {missing}")
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not files:
                others = sorted(p.name for p in self.directory.iterdir()) if self.directory.is_dir() else []
                raise FileNotFoundError(
                    f"no safetensors weights in {self.directory} (expected {SINGLE_NAME} or shards with {INDEX_NAME});"
                    f" found: {others}"
                )
            weight_map = None
        self.files = {fn: SafetensorsFile(self.directory / fn) for fn in files}
        self._where: dict[str, SafetensorsFile] = {}
        for fn, sf in self.files.items():
            for name in sf.tensors:
                if name in self._where:
                    raise ValueError(f"tensor {name!r} is stored twice: {self._where[name].path.name} and {fn}")
                if weight_map is not None and weight_map.get(name) != fn:
                    raise ValueError(f"{INDEX_NAME} maps {name!r} to {weight_map.get(name)!r} but it is stored in {fn}")
                self._where[name] = sf
        if weight_map is not None:
            absent = sorted(set(weight_map) - set(self._where))
            if absent:
                raise ValueError(f"{INDEX_NAME} lists tensors that no shard holds: {absent[:20]}")

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def info(self, name: str) -> TensorInfo:
        if name not in self._where:
            raise KeyError(f"no tensor {name!r} in {self.directory}")
        return self._where[name].info(name)

    def file_of(self, name: str) -> str:
        """The name of the file (in ``directory``) that holds tensor ``name``."""
        if name not in self._where:
            raise KeyError(f"no tensor {name!r} in {self.directory}")
        return self._where[name].path.name

    def get(self, name: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"no tensor {name!r} in {self.directory}")
        return self._where[name].get(name, out)

    def rows(self, name: str, start: int, count: int) -> FileSlice:
        if name not in self._where:
            raise KeyError(f"no tensor {name!r} in {self.directory}")
        return self._where[name].rows(name, start, count)

    def close(self) -> None:
        for sf in self.files.values():
            sf.close()

    def __enter__(self) -> SafetensorsDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------- writing


class BufferPool:
    """Named byte buffers reused across tensors.

    Fresh large allocations are page-faulted in on first touch (roughly as costly as copying the bytes again), so
    a streaming converter reads every tensor into one of a few buffers that only ever grow.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, key: str, nbytes: int) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < nbytes:
            self._buffers.pop(key, None)  # release the old buffer before allocating its replacement
            buf = torch.empty(nbytes, dtype=torch.uint8)
            self._buffers[key] = buf
        return buf[:nbytes]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())

    def extra_bytes(self, sizes: dict[str, int]) -> int:
        """Bytes that ``get`` would newly allocate for these (key, size) requests."""
        return sum(n for k, n in sizes.items() if k not in self._buffers or self._buffers[k].numel() < n)

    def clear(self) -> None:
        self._buffers.clear()


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)


class StreamingSafetensorsWriter:
    """Writes a safetensors file whose tensors are declared up front and then arrive one at a time, in any order.

    The header (all names, dtypes, shapes, offsets) is written at construction; ``write`` puts one tensor's bytes
    at its offset. Only the tensor being written is in memory. ``close`` checks that every declared tensor arrived.
    Tensors are laid out by element size (largest first), as the ``safetensors`` library does, so every tensor
    stays aligned to its element size.

    Integrity: each tensor's CRC-32 is computed from the bytes as they are written (kernel-copied ``FileSlice``
    pieces are read back from this file, still in page cache) and combined at ``close`` into the file's CRC-32,
    ``record`` = (size, crc32), for a manifest. With ``check_finite`` a floating tensor holding NaN/inf raises
    ``NonFiniteTensorError`` naming it.
    """

    def __init__(
        self,
        path: PathLike,
        specs: Iterable[TensorSpec],
        metadata: Optional[dict[str, str]] = None,
        check_finite: bool = True,
    ) -> None:
        self.path = Path(path)
        self.check_finite = check_finite
        self.record: Optional[tuple[int, int]] = None
        self._crcs: dict[str, int] = {}
        specs = list(specs)
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"{self.path}: tensor names declared twice: {dup}")
        ordered = sorted(specs, key=lambda s: -torch.empty((), dtype=s.dtype).element_size())
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        self._slots: dict[str, tuple[TensorSpec, int]] = {}
        offset = 0
        for s in ordered:
            header[s.name] = {
                "dtype": st_dtype(s.dtype),
                "shape": list(s.shape),
                "data_offsets": [offset, offset + s.nbytes],
            }
            self._slots[s.name] = (s, offset)
            offset += s.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self._base = 8 + len(raw)
        self._total = self._base + offset
        self._pending = set(self._slots)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        head = struct.pack("<Q", len(raw)) + raw
        self._header_crc = zlib.crc32(head)
        self._pwrite(head, 0)

    @property
    def pending(self) -> set[str]:
        return set(self._pending)

    def write(self, name: str, tensor: torch.Tensor, scratch: Optional[BufferPool] = None) -> None:
        self.write_parts(name, [tensor], scratch)

    def write_parts(
        self, name: str, parts: Sequence[Union[torch.Tensor, FileSlice]], scratch: Optional[BufferPool] = None
    ) -> None:
        """Write tensor ``name`` given as pieces whose concatenation along dim 0 is the tensor.

        Lets a converter write a fused or padded tensor straight from views of its inputs, or from rows of its input
        files (``FileSlice``, copied by the kernel), without a concatenated copy. A non-contiguous tensor piece is
        copied first — into ``scratch`` when given (reused memory), else into a new tensor.
        """
        if name not in self._slots:
            raise KeyError(f"{self.path}: tensor {name!r} was not declared (declared: {sorted(self._slots)[:20]} ...)")
        if name not in self._pending:
            raise ValueError(f"{self.path}: tensor {name!r} written twice")
        spec, offset = self._slots[name]
        shapes = [tuple(p.shape) for p in parts]
        dtypes = {p.dtype for p in parts}
        if len(parts) == 1:
            shape = shapes[0]
        elif all(len(sh) >= 1 and sh[1:] == shapes[0][1:] for sh in shapes):
            shape = (sum(sh[0] for sh in shapes),) + shapes[0][1:]
        else:
            shape = None
        if dtypes != {spec.dtype} or shape != spec.shape:
            got = ", ".join(f"{p.dtype} {tuple(p.shape)}" for p in parts)
            raise ValueError(f"{self.path}: tensor {name!r} declared {spec.dtype} {spec.shape}, got {got}")
        pos = self._base + offset
        crc = 0
        for part in parts:
            if isinstance(part, FileSlice):
                _copy_range(part.file._fileno(), part.offset, part.nbytes, self._fd, pos)
                crc = self._check_written(name, spec.dtype, pos, part.nbytes, crc)
                pos += part.nbytes
                continue
            if self.check_finite and part.is_floating_point() and not bool(part.isfinite().all()):
                bad = int((~part.isfinite()).sum())
                raise NonFiniteTensorError(
                    f"{self.path}: refusing to write tensor {name!r}: {bad} non-finite value(s) (NaN/inf)"
                )
            part = part.detach()
            if part.device.type != "cpu":
                part = part.to("cpu")
            if not part.is_contiguous():
                if scratch is not None:
                    buf = scratch.get("write", part.numel() * part.element_size())
                    part = buf.view(part.dtype).view(part.shape).copy_(part)
                else:
                    part = part.contiguous()
            flat = part.reshape(-1).view(torch.uint8)
            if flat.numel():
                view = memoryview(flat.numpy())
                crc = zlib.crc32(view, crc)
                self._pwrite(view, pos)
            pos += flat.numel()
        self._crcs[name] = crc
        self._pending.discard(name)

    def _check_written(self, name: str, dtype: torch.dtype, pos: int, nbytes: int, crc: int) -> int:
        """CRC-32 (and finiteness) of bytes the kernel copied into this file, read back in chunks."""
        chunk = (16 << 20) // 8 * 8  # whole elements per chunk
        done = 0
        while done < nbytes:
            data = os.pread(self._fd, min(chunk, nbytes - done), pos + done)
            if not data:
                raise OSError(f"{self.path}: unexpected end of file at byte {pos + done} reading back {name!r}")
            crc = zlib.crc32(data, crc)
            if self.check_finite and dtype.is_floating_point:
                values = torch.frombuffer(bytearray(data), dtype=dtype)
                if not bool(values.isfinite().all()):
                    raise NonFiniteTensorError(
                        f"{self.path}: refusing to write tensor {name!r}: it holds non-finite value(s) (NaN/inf)"
                    )
            done += len(data)
        return crc

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)

    def close(self) -> None:
        if self._fd is None:
            return
        try:
            if self._pending:
                raise ValueError(
                    f"{self.path}: closed before these declared tensors were written: {sorted(self._pending)}"
                )
            os.ftruncate(self._fd, self._total)
            crc = self._header_crc
            for tensor_name, (spec, _) in sorted(self._slots.items(), key=lambda kv: kv[1][1]):
                crc = crc32_combine(crc, self._crcs[tensor_name], spec.nbytes)
            self.record = (self._total, crc)
        finally:
            os.close(self._fd)
            self._fd = None

    def abort(self) -> None:
        """Close without the completeness check (the caller is failing anyway)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> StreamingSafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def save_file_streaming(
    tensors: dict[str, torch.Tensor], path: PathLike, metadata: Optional[dict[str, str]] = None
) -> None:
    """Convenience: write a dict of tensors through the streaming writer."""
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    with StreamingSafetensorsWriter(path, specs, metadata) as w:
        for n, t in tensors.items():
            w.write(n, t)
