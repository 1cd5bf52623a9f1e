"""``megatron-dapo export --lora adapter|merged`` (``checkpointing/export.py``) on a real LoRA training checkpoint.

``lora_export_worker.py`` (one torchrun, 2 processes, TP 2, fp32) loads a tiny qwen2 base converted to Megatron,
applies LoRA (rank 4, alpha 8) with random non-zero A and B, takes one optimizer step, saves the step with
``CheckpointManager(states={"lora": LoraBase(cfg)})`` and records the LoRA model's logits of a fixed input. Then:
the peft adapter export loaded by ``peft.PeftModel`` on the HF base, and the merged export loaded by plain
transformers, give those logits; the dist checkpoint holds the adapters and their optimizer state only; a LoRA
checkpoint needs ``--lora``, any other refuses it, and a missing base is named.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_dapo import cli
from megatron_dapo.checkpointing.checkpoint import DIST_DIR, STATE_FILE
from megatron_dapo.checkpointing.export import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    EVAL_SETTINGS_FILE,
    adapter_tensors,
    export_step,
)
from megatron_dapo.weights.checkpoint_errors import CheckpointError
from megatron_dapo.weights.dist_reader import DistCheckpointReader
from megatron_dapo.weights.integrity import MANIFEST_NAME, FileRecord, file_digest, read_manifest, write_manifest
from megatron_dapo.weights.safetensors_io import SafetensorsDir
from tests.helpers import run_torchrun
from tests.training.lora_export_worker import ALPHA, PHASES, RANK, fixed_ids

WORKER = Path(__file__).with_name("lora_export_worker.py")
PORT = 29880
TOL = 1e-4  # fp32, max |logit difference|
SHAPE = dict(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512)
HF_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Per phase (``dense``, ``moe``): the base (HF + Megatron), the LoRA checkpoint, its recorded logits and both
    exports (through the CLI)."""
    from megatron_dapo.testing.tiny_models import save_tiny_hf_checkpoint
    from megatron_dapo.testing.tokenizer import build_tiny_tokenizer
    from megatron_dapo.weights.convert import convert_hf_to_mcore

    root = tmp_path_factory.mktemp("lora_export")
    tok = build_tiny_tokenizer(root / "tokenizer")
    save_tiny_hf_checkpoint(root / "dense" / "hf", "qwen2", seed=3, vocab_size=len(tok), tokenizer=tok, **SHAPE)
    save_tiny_hf_checkpoint(root / "moe" / "hf", "qwen2_moe", seed=0, num_layers=2)
    for phase in PHASES:
        convert_hf_to_mcore(root / phase / "hf", root / phase / "mcore")
    run_torchrun(WORKER, nproc=2, args=["--root", str(root)], port=PORT, timeout=300)
    out = {}
    for phase in PHASES:
        d = root / phase
        for mode in ("adapter", "merged"):
            rc = cli.main(["export", "--checkpoint", str(d / "ckpt"), "--save-dir", str(d / mode), "--lora", mode])
            assert rc == 0
        out[phase] = {
            "root": d,
            "hf": d / "hf",
            "step": d / "ckpt" / "global_step_1",
            "logits": torch.load(d / "logits.pt"),
        }
    return out


@pytest.fixture
def run(runs: dict) -> dict:
    """qwen2, saved at TP 2."""
    return runs["dense"]


@pytest.fixture
def moe(runs: dict) -> dict:
    """qwen2_moe: layer 0 dense, layer 1 8 routed experts + a shared expert; saved at TP 2 + SP, EP 2."""
    return runs["moe"]


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=fixed_ids(model.config.vocab_size)).logits


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM  # heavy: transformers

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def rebased_copy(step_dir: Path, dest: Path, **lora_or_state) -> Path:
    """A copy of ``step_dir`` whose ``trainer_state.json`` is changed (``lora`` entries, or top-level keys given as
    ``state_<key>``), its manifest record updated so that the copy stays intact."""
    shutil.copytree(step_dir, dest)
    state = json.loads((dest / STATE_FILE).read_text())
    for key, value in lora_or_state.items():
        if key.startswith("state_"):
            state[key[len("state_") :]] = value
        else:
            state["lora"][key] = value
    (dest / STATE_FILE).write_text(json.dumps(state, indent=2))
    records = read_manifest(dest)
    records[STATE_FILE] = FileRecord(STATE_FILE, *file_digest(dest / STATE_FILE))
    (dest / MANIFEST_NAME).unlink()
    write_manifest(dest, records.values())
    return dest


def test_adapter_export_loads_in_peft_with_the_lora_logits(run: dict) -> None:
    from peft import PeftModel  # heavy: peft

    out = run["root"] / "adapter"
    # peft's layout plus the tokenizer and the run's eval settings; no config.json (not a whole model).
    assert {ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, EVAL_SETTINGS_FILE, "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    assert not (out / "config.json").exists()
    config = json.loads((out / ADAPTER_CONFIG_FILE).read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (RANK, ALPHA, "LORA")
    assert sorted(config["target_modules"]) == sorted(HF_TARGETS)
    assert config["base_model_name_or_path"] == str(run["root"] / "mcore")
    with SafetensorsDir(out) as st:
        names = st.keys()
        assert len(names) == SHAPE["num_layers"] * len(HF_TARGETS) * 2
        layer0 = "base_model.model.model.layers.0."
        # The fused q/k/v adapter is three that share A; B split per projection (4 query heads, 2 KV heads of 64).
        a_q, a_k = st.get(layer0 + "self_attn.q_proj.lora_A.weight"), st.get(layer0 + "self_attn.k_proj.lora_A.weight")
        assert torch.equal(a_q, a_k) and tuple(a_q.shape) == (RANK, 256)
        assert tuple(st.info(layer0 + "self_attn.q_proj.lora_B.weight").shape) == (256, RANK)
        assert tuple(st.info(layer0 + "self_attn.v_proj.lora_B.weight").shape) == (128, RANK)
        assert tuple(st.info(layer0 + "mlp.up_proj.lora_B.weight").shape) == (512, RANK)
        assert st.get(layer0 + "mlp.down_proj.lora_B.weight").abs().min() > 0  # trained, not a zero init
    base = load_hf(run["hf"])
    base_diff = (hf_logits(base) - run["logits"]).abs().max().item()
    model = PeftModel.from_pretrained(base, out)
    loaded = [n for n, _ in model.named_parameters() if ".lora_A.default." in n or ".lora_B.default." in n]
    assert len(loaded) == len(names)
    diff = (hf_logits(model) - run["logits"]).abs().max().item()
    assert base_diff > 0.05  # the adapters change the logits...
    assert diff <= TOL, diff  # ...and peft reproduces the Megatron LoRA model's


def test_merged_export_gives_the_lora_logits(run: dict) -> None:
    out = run["root"] / "merged"
    assert {"config.json", "model.safetensors", EVAL_SETTINGS_FILE, "tokenizer"} <= {p.name for p in out.iterdir()}
    # The base's scratch HF export and the staging directories are gone.
    assert sorted(p.name for p in run["root"].iterdir()) == ["adapter", "ckpt", "hf", "logits.pt", "mcore", "merged"]
    with SafetensorsDir(run["hf"]) as base, SafetensorsDir(out) as merged:
        assert sorted(base.keys()) == sorted(merged.keys())
        for name in base.keys():
            adapted = name.endswith(".weight") and any(f".{t}." in name for t in HF_TARGETS)
            same = torch.equal(base.get(name), merged.get(name))
            assert same != adapted, name  # every adapted weight changed, every other one is the base's bit for bit
    diff = (hf_logits(load_hf(out)) - run["logits"]).abs().max().item()
    assert diff <= TOL, diff


def test_merged_export_from_an_hf_base(run: dict, tmp_path: Path) -> None:
    # The same adapters with the run's base named as an HF directory (checkpoint.load_dir may be one).
    step = rebased_copy(run["step"], tmp_path / "global_step_1", base_checkpoint=str(run["hf"]))
    out = export_step(step, tmp_path / "merged", lora="merged")
    diff = (hf_logits(load_hf(out)) - run["logits"]).abs().max().item()
    assert diff <= TOL, diff
    with SafetensorsDir(out) as a, SafetensorsDir(run["root"] / "merged") as b:
        assert max((a.get(n) - b.get(n)).abs().max().item() for n in a.keys()) <= 1e-6


def test_dist_checkpoint_holds_adapters_and_their_optimizer_state_only(run: dict) -> None:
    reader = DistCheckpointReader(run["step"] / DIST_DIR)
    model_keys = [k for k in reader.keys() if not k.startswith("optimizer.")]
    assert model_keys and all(".adapter.linear_" in k for k in reader.keys()), reader.keys()
    assert {k.split(".decoder.")[0] for k in reader.keys() if k.startswith("optimizer.")} == {
        "optimizer.state.exp_avg",
        "optimizer.state.exp_avg_sq",
    }
    tensors = adapter_tensors(reader)
    assert len(tensors) == SHAPE["num_layers"] * 4 * 2  # 4 targets, A and B, per layer (layer-stacked keys)
    # rank × (in + out) per target: qkv 256→512, proj 256→256, fc1 256→1024, fc2 512→256.
    per_layer = RANK * ((256 + 512) + (256 + 256) + (256 + 1024) + (512 + 256))
    assert sum(t.shape[0] * t.shape[1] for t in tensors) == SHAPE["num_layers"] * per_layer
    size = sum(p.stat().st_size for p in (run["step"] / DIST_DIR).iterdir())
    base = sum(p.stat().st_size for p in (run["root"] / "mcore" / "release").iterdir())
    assert size < 0.2 * base, (size, base)


def test_lora_checkpoint_needs_lora_and_others_refuse_it(run: dict, tmp_path: Path, capsys) -> None:
    step = run["step"]
    with pytest.raises(CheckpointError, match=rf"{step} holds LoRA adapters only .* pass --lora merged"):
        export_step(step, tmp_path / "x")
    assert cli.main(["export", "--checkpoint", str(step), "--save-dir", str(tmp_path / "x")]) == 1
    assert "--lora merged" in capsys.readouterr().err
    mcore = run["root"] / "mcore"
    with pytest.raises(CheckpointError, match=rf"--lora adapter: {mcore} is not a LoRA training checkpoint"):
        export_step(mcore, tmp_path / "x", lora="adapter")
    full = rebased_copy(step, tmp_path / "global_step_1", state_adapters_only=False, state_lora=None)
    with pytest.raises(CheckpointError, match=rf"--lora merged: {full} is a full-model training checkpoint"):
        export_step(full, tmp_path / "x", lora="merged")
    with pytest.raises(ValueError, match="lora='fused'"):
        export_step(step, tmp_path / "x", lora="fused")
    assert not (tmp_path / "x").exists()


def test_missing_base_is_named(run: dict, tmp_path: Path) -> None:
    gone = tmp_path / "moved_away"
    step = rebased_copy(run["step"], tmp_path / "global_step_1", base_checkpoint=str(gone))
    for mode in ("merged", "adapter"):
        with pytest.raises(CheckpointError, match=rf"base checkpoint {gone} .*does not exist"):
            export_step(step, tmp_path / mode, lora=mode)
    assert [p.name for p in tmp_path.iterdir()] == ["global_step_1"]  # nothing written, nothing left behind


def test_moe_exports_carry_routed_and_shared_expert_adapters(moe: dict, caplog) -> None:
    run = moe
    tensors = adapter_tensors(DistCheckpointReader(run["step"] / DIST_DIR))
    # Layer-0 attention + MLP, layer-1 attention + shared expert: 8 adapters of 2 weights; 8 experts × 2 linears × 2.
    assert len(tensors) == 2 * 8 + 8 * 2 * 2
    assert sum(".mlp.experts.local_experts.7.linear_fc1." in t.name for t in tensors) == 2
    with SafetensorsDir(run["root"] / "adapter") as st:
        names = st.keys()
    assert len(names) == 2 * 2 * (3 + 1) + 2 * 3 + 2 * 3 + 8 * 2 * 3  # peft: q/k/v + o, MLPs split, A shared
    assert "base_model.model.model.layers.1.mlp.experts.7.up_proj.lora_B.weight" in names
    assert "base_model.model.model.layers.1.mlp.shared_expert.down_proj.lora_A.weight" in names
    # peft on transformers 5 cannot place per-expert adapters (fused experts): the export says so.
    export_step(run["step"], run["root"] / "adapter_again", lora="adapter")
    assert "32 adapter weights of routed experts" in caplog.text  # A and B of fc1 and fc2, 8 experts
    # The merged export carries every adapter, routed experts included: transformers gives the LoRA model's logits.
    base_diff = (hf_logits(load_hf(run["hf"])) - run["logits"]).abs().max().item()
    diff = (hf_logits(load_hf(run["root"] / "merged")) - run["logits"]).abs().max().item()
    assert base_diff > 0.05 and diff <= TOL, (base_diff, diff)
