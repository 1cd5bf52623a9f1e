"""Qwen3-MoE checkpoints: HF → Megatron → HF bit-exact; the converted checkpoint has megatron-core's own expert
layout (the keys and shapes megatron-core writes for SequentialMLP), so ``dist_checkpointing`` loads it at other
expert layouts (EP, ETP) and a checkpoint megatron-core saves at EP=2 converts back to the same HF tensors;
``verify.py --ep`` logits vs HF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_dapo.weights.convert import convert_hf_to_mcore, convert_mcore_to_hf
from megatron_dapo.weights.dist_reader import DistCheckpointReader
from megatron_dapo.weights.safetensors_io import SafetensorsDir
from tests.helpers import run_torchrun

REPO = Path(__file__).resolve().parents[2]
VERIFY = REPO / "tools" / "checkpoint_convert" / "verify.py"
WORKER = Path(__file__).with_name("moe_load_worker.py")
TOL = 1e-4
# 2 processes; the first one also saves; -hf: load_mcore_checkpoint from the HF directory itself
LOAD_LAYOUTS = ["ep2-tp1", "ep1-tp1", "ep1-tp2", "ep2-tp2-etp1", "ep2-tp1-hf"]


@pytest.fixture(scope="module")
def moe_ckpt(tiny_hf, tmp_path_factory):
    hf = tiny_hf("qwen3_moe", shard="100KB")
    out = tmp_path_factory.mktemp("moe_ckpt") / "mcore"
    convert_hf_to_mcore(hf, out)
    return hf, out


def _same_hf(a_dir: Path, b_dir: Path) -> list[str]:
    with SafetensorsDir(a_dir) as a, SafetensorsDir(b_dir) as b:
        assert set(a.keys()) == set(b.keys()), set(a.keys()) ^ set(b.keys())
        return [k for k in a.keys() if not (a.get(k).dtype == b.get(k).dtype and torch.equal(a.get(k), b.get(k)))]


def test_round_trip_is_bit_exact_and_keys_are_megatron_cores(moe_ckpt, tmp_path):
    hf, mcore = moe_ckpt
    res = convert_mcore_to_hf(mcore, tmp_path / "hf", max_shard_size="100KB")
    # 3 MoE layers x 8 experts x gate/up/down, 8 attention + norm tensors x 4 layers, 3 routers, the dense MLP,
    # embedding + final norm + lm_head
    assert res.num_tensors == 3 * 8 * 3 + 8 * 4 + 3 + 3 + 3
    assert _same_hf(hf, tmp_path / "hf") == []
    stored = DistCheckpointReader(mcore / "release").tensors
    # MoE models are saved with one key per layer (megatron-core: moe_layer_freq list -> non_homogeneous_layers);
    # all experts of a layer in one tensor with a leading global expert axis (SequentialMLP.sharded_state_dict).
    assert stored["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"][1] == (8, 64, 64)
    assert stored["decoder.layers.3.mlp.experts.experts.linear_fc2.weight"][1] == (8, 64, 32)
    assert stored["decoder.layers.2.mlp.router.weight"][1] == (8, 64)
    # the pre-MLP norm fuses into linear_fc1 on the dense layer only
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in stored
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in stored
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" not in stored
    assert not any(k.startswith("decoder.layers.self_attention") for k in stored)


def test_qwen2_moe_round_trip_with_shared_expert(tiny_hf, tmp_path):
    hf = tiny_hf("qwen2_moe")
    convert_hf_to_mcore(hf, tmp_path / "mcore")
    stored = DistCheckpointReader(tmp_path / "mcore" / "release").tensors
    assert stored["decoder.layers.1.mlp.shared_experts.gate_weight"][1] == (1, 64)
    assert stored["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"][1] == (96, 64)
    assert stored["decoder.layers.1.self_attention.linear_qkv.bias"][1] == (128,)  # (4 + 2 x 2) heads x 16
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "hf")
    assert _same_hf(hf, tmp_path / "hf") == []


@pytest.fixture(scope="module")
def load_run(moe_ckpt, tmp_path_factory):
    hf, mcore = moe_ckpt
    work = tmp_path_factory.mktemp("moe_load")
    args = ["--hf", str(hf), "--ckpt", str(mcore), "--layouts", ",".join(LOAD_LAYOUTS), "--out", str(work / "out")]
    run_torchrun(WORKER, 2, args + ["--save", str(work / "saved")], port=29885, timeout=480)
    reports = [json.loads((work / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    return reports, work / "saved"


@pytest.mark.parametrize("layout", LOAD_LAYOUTS)
def test_dist_checkpointing_loads_converted_experts_at_any_expert_layout(load_run, layout):
    reports, _ = load_run
    ep = int(layout[2])
    for r in reports:
        res = r[layout]
        assert res["mismatched"] == [] and res["compared"] == 24 + 8 * 3 * 2 // ep + 8, res
        per = 8 // ep
        assert res["experts"] == list(range(res["ep_rank"] * per, (res["ep_rank"] + 1) * per))


def test_megatron_core_ep2_save_converts_back_bit_exact(load_run, moe_ckpt, tmp_path):
    hf, mcore = moe_ckpt
    _, saved = load_run
    assert set(DistCheckpointReader(saved).tensors) == set(DistCheckpointReader(mcore / "release").tensors)
    convert_mcore_to_hf(saved, tmp_path / "hf", hf_config_dir=hf)
    assert _same_hf(hf, tmp_path / "hf") == []


def _diff(stdout: str) -> float:
    last = [ln for ln in stdout.splitlines() if ln.startswith("max_abs_logits_diff=")]
    assert last, stdout[-3000:]
    return float(last[-1].split("=", 1)[1])


@pytest.mark.parametrize(
    "nproc,args,port,source",
    [
        (2, ["--ep", "2"], 29886, "converted"),
        (2, ["--ep", "2", "--tp", "2", "--etp", "1", "--sp"], 29887, "converted"),
        (1, ["--ep", "1"], 29888, "saved_ep2"),  # megatron-core's EP=2 save, loaded at EP=1
    ],
    ids=["ep2", "ep2-tp2-etp1", "ep1-from-ep2-save"],
)
def test_verify_moe_logits(moe_ckpt, load_run, nproc, args, port, source):
    hf, mcore = moe_ckpt
    ckpt = mcore if source == "converted" else load_run[1]
    stdout = run_torchrun(
        VERIFY, nproc=nproc, args=["--hf-dir", str(hf), "--mcore-dir", str(ckpt), *args], port=port, timeout=300
    )
    assert f"EP={args[1]}" in stdout
    assert _diff(stdout) <= TOL
