"""A checkpoint written as Megatron-LM's ``save_checkpoint`` writes a model-only one (``megatron_lm_worker.py``:
tracker file, ``iter_0000100/``, ``common.pt`` with ``args`` and ``iteration``, TransformerEngine key names, saved at
TP=2) loads at PP=2 bit-identical to the HF source, trains one step with megatron_dapo's actor, and exports: the
Megatron-LM checkpoint itself back to the HF source bit for bit, and the training step to the trained weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader

from megatron_dapo.checkpointing.export import export_step
from megatron_dapo.models.families import model_arch_from_hf, param_mappings
from megatron_dapo.weights.convert import convert_mcore_to_hf
from megatron_dapo.weights.layout import mcore_to_hf
from tests.helpers import run_torchrun
from tests.weights.conftest import assert_same_tensors, load_hf_tensors

WORKER = Path(__file__).with_name("megatron_lm_worker.py")


def test_megatron_lm_checkpoint_loads_trains_and_exports(tiny_hf, tmp_path):
    hf = tiny_hf("qwen2", False)
    run, out = tmp_path / "megatron_lm_run", tmp_path / "out"
    out.mkdir()
    stdout = run_torchrun(
        WORKER, nproc=2, args=["--hf-dir", str(hf), "--run-dir", str(run), "--out", str(out)], port=29883, timeout=600
    )
    assert "WORKER_OK" in stdout
    # The fixture is Megatron-LM's layout, with TE names (megatron-core's local spec maps to them on save).
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "100"
    keys = set(FileSystemReader(str(run / "iter_0000100")).read_metadata().state_dict_metadata)
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in keys
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in keys
    common = torch.load(run / "iter_0000100" / "common.pt", weights_only=False)
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 100 and "args" in common

    res = json.loads((out / "result.json").read_text())
    assert res["loaded"] == f"Megatron distributed checkpoint {run} (iter_0000100)"
    assert (res["iteration"], res["args_tp"]) == (100, 2)
    assert res["differing"] == []  # same parameters as loading the HF directory directly
    assert res["update_ok"] == 1.0
    assert res["step_loaded"] == f"training checkpoint {res['step_dir']}" and res["not_restored"] == []

    # Megatron-LM checkpoint → HF: bit for bit the source (it carries no hf_config/: the config is given).
    back = convert_mcore_to_hf(run, tmp_path / "hf_back", hf_config_dir=hf)
    assert_same_tensors(load_hf_tensors(hf), load_hf_tensors(back.save_dir))

    # Training step → HF: the trained weights (its config names model.hf_config_dir).
    exported = export_step(out / "train", tmp_path / "hf_trained")
    got = load_hf_tensors(exported)
    trained = torch.load(out / "trained.pt")
    arch = model_arch_from_hf(hf)
    changed = 0
    src = load_hf_tensors(hf)
    for m in param_mappings(arch):
        for name, t in zip(m.hf, mcore_to_hf(m, trained[m.mcore], arch)):
            assert torch.equal(got[name], t), name
            changed += int(not torch.equal(got[name], src[name]))
    assert changed > 0  # the update moved the weights
    assert json.loads((exported / "config.json").read_text())["num_hidden_layers"] == arch.num_layers
