"""The streaming safetensors writer and reader, checked against the safetensors library itself."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megatron_dapo.weights import safetensors_io
from megatron_dapo.weights.safetensors_io import (
    BufferPool,
    SafetensorsDir,
    SafetensorsFile,
    StreamingSafetensorsWriter,
    TensorSpec,
    save_file_streaming,
)


def _sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w.f32": torch.randn(5, 7, generator=g),
        "w.bf16": torch.randn(3, 9, generator=g).bfloat16(),
        "w.f16": torch.randn(11, generator=g).half(),
        "w.f64": torch.randn(2, 2, generator=g).double(),
        "ids.i64": torch.arange(-3, 6),
        "mask.bool": torch.tensor([True, False, True]),
        "bytes.u8": torch.arange(0, 250, 7, dtype=torch.uint8),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def test_streaming_writer_output_reads_back_bit_exactly(tmp_path):
    tensors = _sample_tensors()
    path = tmp_path / "out.safetensors"
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    w = StreamingSafetensorsWriter(path, specs, {"format": "pt", "note": "streamed"})
    for name in reversed(list(tensors)):  # any order: each tensor has its slot from the header
        w.write(name, tensors[name])
    w.close()

    loaded = load_file(str(path))
    assert sorted(loaded) == sorted(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape
        assert torch.equal(loaded[name], t), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "note": "streamed"}
        assert torch.equal(f.get_slice("w.f32")[1:3], tensors["w.f32"][1:3])

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0 and raw[8:9] == b"{"
    header = json.loads(raw[8 : 8 + n])
    assert len(raw) == 8 + n + max(h["data_offsets"][1] for k, h in header.items() if k != "__metadata__")
    for name, h in header.items():
        if name != "__metadata__":
            itemsize = tensors[name].element_size()
            assert h["data_offsets"][0] % itemsize == 0, f"{name} is not aligned to its element size"


def test_write_parts_and_file_slices_concatenate(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(1)
    src = {"a": torch.randn(6, 4, generator=g), "b": torch.randn(3, 4, generator=g)}
    save_file(src, str(tmp_path / "src.safetensors"))
    reader = SafetensorsFile(tmp_path / "src.safetensors")
    # rows a[4:6], zeros, b[0:2], a[0:1] (strided view) — as a converter assembles a fused/padded shard
    expected = torch.cat([src["a"][4:6], torch.zeros(2, 4), src["b"][0:2], src["a"][0:1]])
    strided = torch.randn(4, 1, generator=g).expand(4, 4).t()[:1]  # non-contiguous 1x4
    expected2 = torch.cat([src["b"][1:3], strided])
    for kernel_copy in (True, False):
        # Both the kernel file-to-file copy and the read/write fallback (other file systems, old kernels).
        monkeypatch.setattr(safetensors_io, "_copy_file_range_ok", kernel_copy)
        out = tmp_path / f"out_{kernel_copy}.safetensors"
        specs = [TensorSpec("x", torch.float32, (7, 4)), TensorSpec("y", torch.float32, (3, 4))]
        with StreamingSafetensorsWriter(out, specs) as w:
            w.write_parts("x", [reader.rows("a", 4, 2), torch.zeros(2, 4), reader.rows("b", 0, 2), src["a"][0:1]])
            w.write_parts("y", [reader.rows("b", 1, 2), strided], scratch=BufferPool())
        loaded = load_file(str(out))
        assert torch.equal(loaded["x"], expected) and torch.equal(loaded["y"], expected2)
    reader.close()


def test_writer_rejects_wrong_use(tmp_path):
    specs = [TensorSpec("a", torch.float32, (2, 3)), TensorSpec("b", torch.bfloat16, (4,))]
    w = StreamingSafetensorsWriter(tmp_path / "x.safetensors", specs)
    with pytest.raises(KeyError, match="'c' was not declared"):
        w.write("c", torch.zeros(1))
    with pytest.raises(ValueError, match=r"declared torch.float32 \(2, 3\), got torch.float32 \(3, 2\)"):
        w.write("a", torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"declared torch.bfloat16 \(4,\), got torch.float32 \(4,\)"):
        w.write("b", torch.zeros(4))
    w.write("a", torch.zeros(2, 3))
    with pytest.raises(ValueError, match="'a' written twice"):
        w.write("a", torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"closed before these declared tensors were written: \['b'\]"):
        w.close()
    with pytest.raises(ValueError, match="declared twice"):
        StreamingSafetensorsWriter(tmp_path / "y.safetensors", specs + specs[:1])


def test_reader_matches_safetensors_library(tmp_path):
    tensors = _sample_tensors()
    save_file(tensors, str(tmp_path / "lib.safetensors"), metadata={"format": "pt"})
    with SafetensorsFile(tmp_path / "lib.safetensors") as f:
        assert f.metadata == {"format": "pt"}
        pool = BufferPool()
        for name, t in tensors.items():
            info = f.info(name)
            assert info.dtype == t.dtype and info.shape == tuple(t.shape)
            assert torch.equal(f.get(name), t), name
            # into a reused buffer: same values, and the buffer is not reallocated for smaller tensors
            assert torch.equal(f.get(name, pool.get("in", info.nbytes)), t), name
        assert pool.nbytes == max(f.info(n).nbytes for n in tensors)
    save_file_streaming(tensors, tmp_path / "ours.safetensors")
    with SafetensorsFile(tmp_path / "ours.safetensors") as f:
        for name, t in tensors.items():
            assert torch.equal(f.get(name), t), name


def test_directory_reader_errors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"no safetensors weights in .* found: \['config.json'\]"):
        SafetensorsDir(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        SafetensorsDir(tmp_path)
    (tmp_path / "bad.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="not a safetensors file"):
        SafetensorsFile(tmp_path / "bad.safetensors")
