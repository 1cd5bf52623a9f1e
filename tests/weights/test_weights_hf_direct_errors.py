"""Starting training straight from an HF directory (``checkpoint.load_dir`` = the HF model) that has a wrong-shape or
a missing tensor fails, on every rank, with the converter's message: the tensor, its expected and found shape, the
file that holds it (or the files searched) — not a bare ``RuntimeError`` from a ``view`` deep in the layout code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from tests.helpers import run_torchrun

WORKER = Path(__file__).with_name("hf_direct_errors_worker.py")
RESHAPED = "model.layers.0.self_attn.k_proj.weight"  # [kv_heads × head_dim, hidden] = (32, 64) in the tiny qwen2
DROPPED = "model.layers.3.mlp.up_proj.weight"  # a layer of the second pipeline stage


def _edit_tensor(directory: Path, edit) -> str:
    """Apply ``edit(tensors)`` to the safetensors file of ``directory`` holding ``RESHAPED`` / ``DROPPED`` (the
    index's ``weight_map`` kept in step); returns that file's name."""
    index = directory / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.exists() else None
    name = weight_map[RESHAPED] if weight_map else "model.safetensors"
    tensors = load_file(str(directory / name))
    edit(tensors)
    save_file(tensors, str(directory / name), metadata={"format": "pt"})
    return name


def test_hf_direct_start_names_the_bad_tensor_its_shapes_and_file(tiny_hf, tmp_path: Path) -> None:
    wrong_shape = shutil.copytree(tiny_hf("qwen2", False, shard="60KB"), tmp_path / "wrong_shape")

    def shrink(t):
        t[RESHAPED] = t[RESHAPED][:16].clone()

    shard = _edit_tensor(wrong_shape, shrink)
    assert shard.startswith("model-0000") and shard != "model-00001-of-00001.safetensors"  # really sharded
    missing = shutil.copytree(tiny_hf("qwen2", False), tmp_path / "missing")
    _edit_tensor(missing, lambda t: t.pop(DROPPED))
    left = len(load_file(str(missing / "model.safetensors")))
    cases = {"intact": str(tiny_hf("qwen2", False)), "wrong_shape": str(wrong_shape), "missing": str(missing)}
    (tmp_path / "cases.json").write_text(json.dumps(cases))

    stdout = run_torchrun(
        WORKER, nproc=2, args=["--cases", str(tmp_path / "cases.json"), "--out", str(tmp_path)], port=29884
    )
    assert "WORKER_OK" in stdout
    for rank in (0, 1):  # each pipeline stage, whether or not it holds the bad tensor
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["intact"] == {"kind": "hf"}, res["intact"]  # the unedited directory loads: the edits are the cause
        assert res["wrong_shape"]["error"] == "CheckpointError", res["wrong_shape"]
        assert res["wrong_shape"]["message"] == (
            f"{wrong_shape}: shape mismatches (1): {RESHAPED}: expected (32, 64), got (16, 64) in {shard}"
        )
        assert res["missing"]["error"] == "CheckpointError", res["missing"]
        message = res["missing"]["message"]
        assert message.startswith(f"{missing}: missing HF tensors (1): {DROPPED}; found ({left}) in model.safetensors:")
        assert "model.layers.0.mlp.up_proj.weight" in message  # what is there (the first 30 names), to compare with
