"""Converter errors say what was expected and what was found; a failed conversion leaves earlier output intact."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_dapo.models.families import UnsupportedModelError
from megatron_dapo.weights.convert import convert_hf_to_mcore, convert_mcore_to_hf
from megatron_dapo.weights.mcore_checkpoint import CheckpointError, rank_file
from megatron_dapo.weights.safetensors_io import StreamingSafetensorsWriter


def _edited_copy(src: Path, dst: Path, edit) -> Path:
    """Copy of a single-file HF checkpoint whose tensors went through ``edit(dict)``."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def test_missing_tensor_is_named_with_what_was_found(tiny_hf, tmp_path):
    hf = _edited_copy(tiny_hf("llama"), tmp_path / "hf", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError) as err:
        convert_hf_to_mcore(hf, tmp_path / "m", tp=2, pp=2)
    msg = str(err.value)
    assert "missing HF tensors (1): model.layers.1.mlp.up_proj.weight;" in msg
    assert "found (" in msg and "model.layers.1.mlp.gate_proj.weight" in msg
    assert not (tmp_path / "m").exists()


def test_unexpected_tensor_is_listed(tiny_hf, tmp_path):
    def add(t):
        t["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
        t["model.vision_tower.weight"] = torch.zeros(2)

    hf = _edited_copy(tiny_hf("qwen3"), tmp_path / "hf", add)
    expected = r"unexpected HF tensors for qwen3 \(2\): model.layers.0.mlp.extra_proj.weight, model.vision_tower.weight"
    with pytest.raises(CheckpointError, match=expected):
        convert_hf_to_mcore(hf, tmp_path / "m")


def test_shape_mismatch_names_tensor_expected_and_got(tiny_hf, tmp_path):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16].clone()

    hf = _edited_copy(tiny_hf("qwen2"), tmp_path / "hf", shrink)
    with pytest.raises(
        CheckpointError,
        match=r"shape mismatches \(1\): model.layers.0.self_attn.k_proj.weight: expected \(32, 64\),"
        r" got \(16, 64\)",
    ):
        convert_hf_to_mcore(hf, tmp_path / "m")


def test_unsupported_architecture_lists_supported_ones(tiny_hf, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf("qwen2"), hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=r"model_type='gpt2'.*supported: qwen2 \(Qwen2ForCausalLM\), qwen3"):
        convert_hf_to_mcore(hf, tmp_path / "m")


def test_layout_that_does_not_divide_the_model(tiny_hf, tmp_path):
    with pytest.raises(CheckpointError, match=r"TP=4 .*num_key_value_heads \(query groups\)=2 is not divisible"):
        convert_hf_to_mcore(tiny_hf("qwen2"), tmp_path / "m", tp=4)
    with pytest.raises(CheckpointError, match=r"num_hidden_layers=4 is not divisible by .* 3"):
        convert_hf_to_mcore(tiny_hf("qwen2"), tmp_path / "m", pp=3)


def test_existing_save_dir_is_refused_then_replaced_only_with_overwrite(tiny_hf, tmp_path):
    hf = tiny_hf("qwen2", True)
    convert_hf_to_mcore(hf, tmp_path / "m", tp=2)
    before = _digest(tmp_path / "m")
    with pytest.raises(
        CheckpointError,
        match=r"already exists and is not empty \(contains: hf_config, manifest.json, mcore_meta.json,"
        r" mp_rank_00_000, mp_rank_01_000\); pass --overwrite",
    ):
        convert_hf_to_mcore(hf, tmp_path / "m", pp=2)
    assert _digest(tmp_path / "m") == before
    with pytest.raises(CheckpointError, match="is the input directory"):
        convert_hf_to_mcore(hf, hf, overwrite=True)

    convert_hf_to_mcore(hf, tmp_path / "m", pp=2, overwrite=True)
    assert json.loads((tmp_path / "m" / "mcore_meta.json").read_text())["pipeline_model_parallel_size"] == 2
    assert rank_file(tmp_path / "m", 0, 1).is_file() and not rank_file(tmp_path / "m", 1, 0).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no .tmp-/.old- leftovers


def test_failure_while_writing_keeps_the_previous_checkpoint(tiny_hf, tmp_path, monkeypatch):
    hf = tiny_hf("llama")
    convert_hf_to_mcore(hf, tmp_path / "m", tp=2)
    before = _digest(tmp_path / "m")
    calls = {"n": 0}
    original = StreamingSafetensorsWriter.write_parts

    def failing(self, name, parts, scratch=None):
        calls["n"] += 1
        if calls["n"] == 20:
            raise OSError("No space left on device (injected)")
        return original(self, name, parts, scratch)

    monkeypatch.setattr(StreamingSafetensorsWriter, "write_parts", failing)
    with pytest.raises(OSError, match="injected"):
        convert_hf_to_mcore(hf, tmp_path / "m", tp=1, pp=2, overwrite=True)
    assert calls["n"] >= 20
    assert _digest(tmp_path / "m") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_mcore_side_errors(tiny_hf, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"mcore_meta.json is missing \(found: \)"):
        convert_mcore_to_hf(tmp_path / "empty", tmp_path / "out")
    convert_hf_to_mcore(tiny_hf("qwen2"), tmp_path / "m", tp=2, pp=2)
    rank_file(tmp_path / "m", 1, 1).unlink()
    with pytest.raises(CheckpointError, match=r"mp_rank_01_001/model.safetensors is missing: a TP=2 PP=2 checkpoint"):
        convert_mcore_to_hf(tmp_path / "m", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    other = tmp_path / "other_cfg"
    other.mkdir()
    cfg = json.loads((tiny_hf("qwen2") / "config.json").read_text())
    cfg["num_hidden_layers"] = 6
    (other / "config.json").write_text(json.dumps(cfg))
    convert_hf_to_mcore(tiny_hf("qwen2"), tmp_path / "m2")
    with pytest.raises(CheckpointError, match=r"does not describe the checkpoint .*num_layers: 6 vs 4"):
        convert_mcore_to_hf(tmp_path / "m2", tmp_path / "out", hf_config_dir=other)
