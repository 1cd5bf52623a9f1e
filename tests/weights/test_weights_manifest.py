"""Manifest format and checksums (``weights.integrity``): new manifests are version 2 with XXH3-64 hex digests;
version 1 manifests (zlib CRC-32 ints, written by checkpoints before XXH3) still verify, and damage (a flipped byte,
a truncation) is detected in both; a converted checkpoint whose manifest is version 1 still converts back and is
refused once damaged; the hashing writers' digests match an independent hash of the bytes on disk; the finite check
finds NaN/±inf in every floating dtype and layout."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch
import xxhash

from megatron_dapo.weights.checkpoint_errors import CheckpointError
from megatron_dapo.weights.convert import convert_hf_to_mcore, convert_mcore_to_hf
from megatron_dapo.weights.integrity import (
    MANIFEST_NAME,
    FileRecord,
    HashingWriter,
    file_digest,
    first_non_finite,
    manifest_problem,
    read_manifest,
    torch_save_hashed,
    verify_files,
    write_bytes_hashed,
    write_manifest,
)


def write_v1_manifest(root: Path) -> None:
    """The manifest every file under ``root`` would have had before version 2: zlib CRC-32 ints, version 1."""
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST_NAME:
            data = p.read_bytes()
            files[p.relative_to(root).as_posix()] = {"size": len(data), "crc32": zlib.crc32(data)}
    doc = {"format": "megatron-dapo-manifest", "version": 1, "checksum": "crc32", "files": files}
    (root / MANIFEST_NAME).write_text(json.dumps(doc, indent=1))


def make_files(root: Path) -> dict[str, bytes]:
    contents = {"a.bin": bytes(range(256)) * 300, "sub/b.txt": b"hello manifest\n", "empty": b""}
    for rel, data in contents.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return contents


def flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("version", [1, 2])
def test_manifest_verifies_and_detects_damage(tmp_path: Path, version: int) -> None:
    contents = make_files(tmp_path)
    if version == 1:
        write_v1_manifest(tmp_path)
    else:
        write_manifest(tmp_path, [FileRecord(rel, *file_digest(tmp_path / rel)) for rel in contents])
    doc = json.loads((tmp_path / MANIFEST_NAME).read_text())
    algorithm = "crc32" if version == 1 else "xxh3_64"
    assert (doc["version"], doc["checksum"]) == (version, algorithm)
    if version == 2:  # hex digests, the reference xxh3_64 of the bytes
        assert doc["files"]["a.bin"] == {"size": 76800, "xxh3_64": xxhash.xxh3_64(contents["a.bin"]).hexdigest()}
    records = read_manifest(tmp_path)
    assert {r.algorithm for r in records.values()} == {algorithm}
    assert verify_files(tmp_path, records.values()) is None and manifest_problem(tmp_path) is None

    flip_byte(tmp_path / "a.bin", 1000)
    digits = 8 if version == 1 else 16
    problem = manifest_problem(tmp_path)
    assert problem is not None and f"a.bin: corrupt (expected {algorithm} " in problem
    assert len(problem.rsplit("found ", 1)[1].rstrip(")")) == digits
    assert manifest_problem(tmp_path, checksum=False) is None  # same size: only the checksum sees it
    (tmp_path / "a.bin").write_bytes(contents["a.bin"][:-1])
    assert "a.bin: truncated (expected 76800 bytes, found 76799)" in manifest_problem(tmp_path, checksum=False)


def test_rewriting_v1_records_keeps_their_checksum(tmp_path: Path) -> None:
    make_files(tmp_path)
    write_v1_manifest(tmp_path)
    records = read_manifest(tmp_path)
    write_manifest(tmp_path, records.values())  # e.g. a tool that replaces one record: still crc32
    assert json.loads((tmp_path / MANIFEST_NAME).read_text())["checksum"] == "crc32"
    assert read_manifest(tmp_path) == records and manifest_problem(tmp_path) is None
    with pytest.raises(ValueError, match="one manifest, one checksum"):
        write_manifest(tmp_path, [*records.values(), FileRecord("x", 1, "00" * 8)])


@pytest.mark.parametrize(
    "doc",
    [
        {"format": "megatron-dapo-manifest", "version": 3, "checksum": "xxh3_64", "files": {}},
        {"format": "megatron-dapo-manifest", "version": 1, "checksum": "xxh3_64", "files": {}},
        {"format": "megatron-dapo-manifest", "version": 2, "checksum": "md5", "files": {}},
        {"format": "megatron-dapo-manifest", "version": 2, "checksum": "xxh3_64", "files": {"a": {"size": 1}}},
        {
            "format": "megatron-dapo-manifest",
            "version": 2,
            "checksum": "xxh3_64",
            "files": {"a": {"size": 1, "xxh3_64": 7}},
        },
    ],
)
def test_unreadable_manifest_is_named(tmp_path: Path, doc: dict) -> None:
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="manifest.json: corrupt manifest"):
        read_manifest(tmp_path)


def test_converted_checkpoint_with_a_v1_manifest(tiny_hf, tmp_path: Path) -> None:
    root = tmp_path / "m"
    convert_hf_to_mcore(tiny_hf("qwen2"), root)
    assert json.loads((root / MANIFEST_NAME).read_text())["version"] == 2
    write_v1_manifest(root)  # as a checkpoint converted before version 2 would have it
    convert_mcore_to_hf(root, tmp_path / "out")
    victim = root / "release" / "__0_0.distcp"
    flip_byte(victim, victim.stat().st_size - 10)
    with pytest.raises(CheckpointError, match=r"__0_0.distcp: corrupt \(expected crc32 [0-9a-f]{8}, found"):
        convert_mcore_to_hf(root, tmp_path / "out2")


def test_hashing_writers_match_the_bytes_on_disk(tmp_path: Path) -> None:
    with open(tmp_path / "w.bin", "wb") as raw:
        w = HashingWriter(raw)
        w.write(b"abc")
        w.write(memoryview(torch.arange(1000, dtype=torch.float32).numpy()))
    rec = w.record(tmp_path / "w.bin")
    data = (tmp_path / "w.bin").read_bytes()
    assert (rec.size, rec.digest) == (len(data), xxhash.xxh3_64(data).hexdigest())
    rec = torch_save_hashed({"x": torch.ones(7)}, tmp_path / "t.pt")
    assert (rec.size, rec.digest) == file_digest(tmp_path / "t.pt")
    rec = write_bytes_hashed(tmp_path / "b.txt", b"state")
    assert (rec.size, rec.digest) == file_digest(tmp_path / "b.txt") == (5, xxhash.xxh3_64(b"state").hexdigest())
    assert file_digest(tmp_path / "b.txt", "crc32") == (5, f"{zlib.crc32(b'state'):08x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_first_non_finite_every_dtype(dtype: torch.dtype, bad: float) -> None:
    ok = torch.randn(64, 33).to(dtype)
    strided = torch.randn(64, 66).to(dtype)[:, ::2]
    strided[63, 32] = bad
    scalar = torch.tensor(bad, dtype=dtype)
    assert first_non_finite([("ok", ok), ("i", torch.arange(5))]) is None
    assert first_non_finite([("ok", ok), ("strided", strided), ("scalar", scalar)]) == "strided"
    assert first_non_finite([("scalar", scalar), ("f32", torch.full((3,), bad))]) == "scalar"
