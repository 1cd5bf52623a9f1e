"""Converter and loader errors say what was expected and what was found; a failed conversion leaves earlier output
intact; a foreign or damaged directory is named with the three kinds of input that work."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_dapo.models.families import UnsupportedModelError
from megatron_dapo.weights import convert as convert_module
from megatron_dapo.weights.checkpoint_errors import CheckpointError
from megatron_dapo.weights.convert import convert_hf_to_mcore, convert_mcore_to_hf
from megatron_dapo.weights.dist_format import find_checkpoint


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
        convert_hf_to_mcore(hf, tmp_path / "m")
    msg = str(err.value)
    assert "missing HF tensors (1): model.layers.1.mlp.up_proj.weight;" in msg
    assert "found (" in msg and ") in model.safetensors: " in msg and "model.layers.1.mlp.gate_proj.weight" in msg
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
        r" got \(16, 64\) in model.safetensors$",
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


def test_existing_save_dir_is_refused_then_replaced_only_with_overwrite(tiny_hf, tmp_path):
    hf = tiny_hf("qwen2", True)
    convert_hf_to_mcore(hf, tmp_path / "m")
    before = _digest(tmp_path / "m")
    with pytest.raises(
        CheckpointError,
        match=r"already exists and is not empty \(contains: hf_config, latest_checkpointed_iteration.txt,"
        r" manifest.json, release\); pass --overwrite",
    ):
        convert_hf_to_mcore(hf, tmp_path / "m")
    assert _digest(tmp_path / "m") == before
    with pytest.raises(CheckpointError, match="is the input directory"):
        convert_hf_to_mcore(hf, hf, overwrite=True)
    convert_hf_to_mcore(tiny_hf("qwen2", False), tmp_path / "m", overwrite=True)
    assert _digest(tmp_path / "m") != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no .tmp-/.old- leftovers


def test_failure_while_writing_keeps_the_previous_checkpoint(tiny_hf, tmp_path, monkeypatch):
    hf = tiny_hf("llama")
    convert_hf_to_mcore(hf, tmp_path / "m")
    before = _digest(tmp_path / "m")
    calls = {"n": 0}
    original = convert_module.hf_to_mcore

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 20:
            raise OSError("No space left on device (injected)")
        return original(*args, **kwargs)

    monkeypatch.setattr(convert_module, "hf_to_mcore", failing)
    with pytest.raises(OSError, match="injected"):
        convert_hf_to_mcore(hf, tmp_path / "m", overwrite=True)
    assert calls["n"] >= 20
    assert _digest(tmp_path / "m") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_mcore_side_errors(tiny_hf, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError) as err:
        convert_mcore_to_hf(tmp_path / "empty", tmp_path / "out")
    assert f"{tmp_path / 'empty'} is not a checkpoint this project reads: it is empty" in str(err.value)
    convert_hf_to_mcore(tiny_hf("qwen2"), tmp_path / "m")
    (tmp_path / "m" / "latest_checkpointed_iteration.txt").write_text("100")
    with pytest.raises(CheckpointError, match=r"names 'iter_0000100', but .*iter_0000100 is not a dist_checkpointing"):
        convert_mcore_to_hf(tmp_path / "m", tmp_path / "out")
    (tmp_path / "m" / "latest_checkpointed_iteration.txt").write_text("best")
    with pytest.raises(CheckpointError, match=r"holds 'best'; expected 'release' or an iteration number"):
        convert_mcore_to_hf(tmp_path / "m", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (tmp_path / "m" / "latest_checkpointed_iteration.txt").write_text("release")
    other = tmp_path / "other_cfg"
    other.mkdir()
    cfg = json.loads((tiny_hf("qwen2") / "config.json").read_text())
    cfg["num_hidden_layers"] = 6
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"shape mismatches .*stacks 4 layers, the model has 6"):
        convert_mcore_to_hf(tmp_path / "m" / "release", tmp_path / "out", hf_config_dir=other)
    # A bare dist_checkpointing directory (what verl's converter writes) carries no HF config: asked for.
    bare = shutil.copytree(tmp_path / "m" / "release", tmp_path / "bare")
    with pytest.raises(
        CheckpointError, match=r"dist_checkpointing directory .*/bare has no hf_config/config.json: pass"
    ):
        convert_mcore_to_hf(bare, tmp_path / "out")
    convert_mcore_to_hf(bare, tmp_path / "out", hf_config_dir=tiny_hf("qwen2"))


def test_foreign_directories_get_the_three_things_that_work(tiny_hf, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "mp_rank_00_000").mkdir()
    (foreign / "mcore_meta.json").write_text("{}")
    with pytest.raises(CheckpointError) as err:
        find_checkpoint(foreign)
    msg = str(err.value)
    assert f"{foreign} is not a checkpoint this project reads: it contains: mcore_meta.json, mp_rank_00_000" in msg
    for works in ("latest_checkpointed_iteration.txt", "global_step_<n>/", "config.json + *.safetensors"):
        assert works in msg
    with pytest.raises(CheckpointError, match="it does not exist"):
        find_checkpoint(tmp_path / "nothing")
    # A dist checkpoint whose metadata is damaged is named.
    convert_hf_to_mcore(tiny_hf("qwen2"), tmp_path / "m")
    bare = shutil.copytree(tmp_path / "m" / "release", tmp_path / "bare")  # no manifest
    (tmp_path / "m" / "release" / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=r"checkpoint .*/m is damaged: .*/release/\.metadata: truncated"):
        convert_mcore_to_hf(tmp_path / "m", tmp_path / "out")
    (bare / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=r"bare/\.metadata: unreadable"):
        convert_mcore_to_hf(bare, tmp_path / "out", hf_config_dir=tiny_hf("qwen2"))
