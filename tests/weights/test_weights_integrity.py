"""Integrity of converted checkpoints and HF inputs: a truncated or corrupted file of a converted checkpoint
is named ("truncated" / "corrupt", the file, expected vs found) before its data is used; HF safetensors inputs
without a manifest are checked structurally (header parse → corrupt, short data region → truncated, an index naming
a missing shard); the writers refuse a non-finite tensor, naming it."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from megatron_dapo.weights.checkpoint_errors import CheckpointError
from megatron_dapo.weights.convert import convert_hf_to_mcore, convert_mcore_to_hf
from megatron_dapo.weights.integrity import NonFiniteTensorError
from megatron_dapo.weights.safetensors_io import (
    SafetensorsDir,
    SafetensorsIntegrityError,
    StreamingSafetensorsWriter,
    TensorSpec,
    save_file_streaming,
)


def test_converted_checkpoint_truncated_or_corrupt(tiny_hf, tmp_path):
    convert_hf_to_mcore(tiny_hf("qwen2"), tmp_path / "m")
    victim = tmp_path / "m" / "release" / "__0_0.distcp"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 1000])
    with pytest.raises(
        CheckpointError,
        match=rf"{re.escape(str(victim))}: truncated \(expected {len(data)} bytes, found {len(data) - 1000}\)",
    ):
        convert_mcore_to_hf(tmp_path / "m", tmp_path / "out")
    flipped = bytearray(data)
    flipped[len(data) - 10] ^= 0x01
    victim.write_bytes(bytes(flipped))
    with pytest.raises(
        CheckpointError, match=rf"{re.escape(str(victim))}: corrupt \(expected xxh3_64 [0-9a-f]{{16}}, found"
    ):
        convert_mcore_to_hf(tmp_path / "m", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    victim.write_bytes(data)  # repaired: converts
    convert_mcore_to_hf(tmp_path / "m", tmp_path / "out")


def test_hf_input_truncated_corrupt_or_missing_shard(tiny_hf, tmp_path):
    hf = shutil.copytree(tiny_hf("qwen2", shard="60KB"), tmp_path / "hf")  # the fixture's copy is shared
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shard = hf / sorted(set(index["weight_map"].values()))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[:-8])
    with pytest.raises(SafetensorsIntegrityError, match=rf"{re.escape(str(shard))}: truncated: the header says"):
        convert_hf_to_mcore(hf, tmp_path / "m")
    header_len = int.from_bytes(data[:8], "little")
    broken = bytearray(data)
    broken[8 + header_len // 2] = ord("\x00")  # inside the JSON header
    shard.write_bytes(bytes(broken))
    with pytest.raises(SafetensorsIntegrityError, match=rf"{re.escape(str(shard))}: corrupt: the \d+-byte JSON header"):
        SafetensorsDir(hf)
    shard.unlink()
    with pytest.raises(
        FileNotFoundError, match=rf"names shard files that do not exist \(missing\): \['{shard.name}'\]"
    ):
        SafetensorsDir(hf)
    assert not (tmp_path / "m").exists()


def test_non_finite_tensor_is_refused(tiny_hf, tmp_path):
    bad = torch.ones(4, 3)
    bad[2, 1] = float("inf")
    with pytest.raises(NonFiniteTensorError, match=r"x.safetensors: refusing to write tensor 'w': 1 non-finite"):
        save_file_streaming({"ok": torch.zeros(2), "w": bad}, tmp_path / "x.safetensors")
    # An HF input holding a NaN is not converted.
    hf = shutil.copytree(tiny_hf("qwen2"), tmp_path / "hf")  # the fixture's copy is shared
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(hf / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][3, 4] = float("nan")
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        NonFiniteTensorError, match=r"refusing to write tensor 'decoder.layers.mlp.linear_fc2.weight' \(layer 1\)"
    ):
        convert_hf_to_mcore(hf, tmp_path / "m")
    assert not (tmp_path / "m").exists()
    # Opting out writes it (e.g. a tool that inspects a broken checkpoint).
    with StreamingSafetensorsWriter(
        tmp_path / "y.safetensors", [TensorSpec("w", torch.float32, (4, 3))], None, False
    ) as w:
        w.write("w", bad)
    assert w.record is not None and w.record[0] == (tmp_path / "y.safetensors").stat().st_size
