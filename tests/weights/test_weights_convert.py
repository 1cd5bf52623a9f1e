"""HF ⇄ Megatron conversion: bit-exact round trips, the written Megatron-LM layout checked by hand (tracker file,
``release/`` dist checkpoint, common.pt, layer-stacked TransformerEngine-spec keys read back with torch DCP itself),
the manifest against an independent read, CLI and side files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemReader

from megatron_dapo.models.families import TE_NAME_ALIASES, model_arch_from_hf, param_mappings, to_te_name
from megatron_dapo.weights.convert import convert_hf_to_mcore, convert_mcore_to_hf, parse_size
from megatron_dapo.weights.dist_format import find_checkpoint
from megatron_dapo.weights.layout import hf_to_mcore, padded_vocab_size
from tests.weights.conftest import CASES, assert_same_tensors, load_hf_tensors

REPO = Path(__file__).resolve().parents[2]


def _read_whole(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a dist checkpoint, read by torch DCP's own default planner (independent of our reader)."""
    meta = FileSystemReader(str(directory)).read_metadata()
    out = {
        k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for k, md in meta.state_dict_metadata.items()
        if hasattr(md, "properties")
    }
    dcp.load(out, storage_reader=FileSystemReader(str(directory)), no_dist=True)
    return out


@pytest.mark.parametrize("family,tie", CASES, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in CASES])
def test_round_trip_is_bit_exact(tiny_hf, tmp_path, family, tie):
    # The untied qwen2 case reads a sharded HF checkpoint (index + several files).
    hf = tiny_hf(family, tie, shard="60KB" if (family, tie) == ("qwen2", False) else None)
    if (family, tie) == ("qwen2", False):
        index = json.loads((hf / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) >= 3
    res = convert_hf_to_mcore(hf, tmp_path / "mcore")
    root = tmp_path / "mcore"
    assert sorted(p.name for p in root.iterdir()) == [
        "hf_config",
        "latest_checkpointed_iteration.txt",
        "manifest.json",
        "release",
    ]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert sorted(p.name for p in (root / "release").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "common.pt",
        "metadata.json",
    ]
    # The manifest (hashed while writing) matches every file's bytes, read independently.
    manifest = json.loads((root / "manifest.json").read_text())["files"]
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert sorted(manifest) == files
    for rel in files:
        data = (root / rel).read_bytes()
        assert manifest[rel] == {"size": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}, rel
    back = convert_mcore_to_hf(root, tmp_path / "hf2")
    assert (back.save_dir / "model.safetensors").is_file()  # 2GB default shard size: one file, as save_pretrained
    want = load_hf_tensors(hf)
    if tie:
        want.pop("lm_head.weight", None)  # transformers may store the tied head; it is the embedding
    assert_same_tensors(want, load_hf_tensors(back.save_dir))
    assert json.loads((back.save_dir / "config.json").read_text()) == json.loads((hf / "config.json").read_text())
    assert res.num_tensors == len(param_mappings(model_arch_from_hf(hf)))


def test_written_layout_by_hand(tiny_hf, tmp_path):
    """Keys, stacked shapes and values against the HF tensors, read back with torch DCP's own planner."""
    hf = tiny_hf("qwen2", False)
    arch = model_arch_from_hf(hf)
    convert_hf_to_mcore(hf, tmp_path / "m", make_vocab_size_divisible_by=64)
    stored = _read_whole(tmp_path / "m" / "release")
    src = load_hf_tensors(hf)
    padded = padded_vocab_size(arch.vocab_size, 64, 1)
    assert padded == 128
    expected_keys = set()
    for m in param_mappings(arch):
        full = hf_to_mcore(m, [src[n] for n in m.hf], arch, padded)
        name = to_te_name(m.mcore)
        if m.layer is None:
            expected_keys.add(name)
            assert torch.equal(stored[name], full), name
        else:
            key = name.replace(f"decoder.layers.{m.layer}.", "decoder.layers.")
            expected_keys.add(key)
            assert stored[key].shape == (arch.num_layers,) + tuple(full.shape), key
            assert torch.equal(stored[key][m.layer], full), (key, m.layer)
    assert set(stored) == expected_keys
    # TransformerEngine names for the fused norms, no local-spec names.
    for te in TE_NAME_ALIASES.values():
        assert f"decoder.layers.{te}" in stored
    assert not any(k.endswith("input_layernorm.weight") or k.endswith("pre_mlp_layernorm.weight") for k in stored)
    # Vocabulary padding rows are zero; qkv interleaves per group: group 0 = q heads 0..1, k head 0, v head 0.
    emb = stored["embedding.word_embeddings.weight"]
    assert emb.shape == (128, arch.hidden_size) and not emb[arch.vocab_size :].any()
    qkv = stored["decoder.layers.self_attention.linear_qkv.weight"][1]
    hd = arch.head_dim
    q, k, v = (src[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(qkv[: 2 * hd], q[: 2 * hd])
    assert torch.equal(qkv[2 * hd : 3 * hd], k[:hd]) and torch.equal(qkv[3 * hd : 4 * hd], v[:hd])
    fc1 = stored["decoder.layers.mlp.linear_fc1.weight"][0]
    assert torch.equal(
        fc1, torch.cat([src["model.layers.0.mlp.gate_proj.weight"], src["model.layers.0.mlp.up_proj.weight"]])
    )
    # common.pt as Megatron-LM's save_checkpoint writes it for a model-only release checkpoint (no args).
    common = torch.load(tmp_path / "m" / "release" / "common.pt", weights_only=True)
    assert common == {"checkpoint_version": 3.0, "iteration": 0}
    assert json.loads((tmp_path / "m" / "release" / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    source = find_checkpoint(tmp_path / "m")
    assert (source.kind, source.path.name, source.hf_config_dir) == (
        "megatron",
        "release",
        tmp_path / "m" / "hf_config",
    )


def test_te_names_match_megatron_cores_own_key_map():
    """Our one TE⇄local map equals the ``sharded_state_dict_keys_map`` megatron-core's local spec declares."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    keys_map = get_gpt_layer_local_spec(normalization="RMSNorm").submodules.sharded_state_dict_keys_map
    assert {local + "weight": te + "weight" for local, te in keys_map.items()} == TE_NAME_ALIASES


def test_bf16_conversion_casts_and_updates_config(tiny_hf, tmp_path):
    hf = tiny_hf("llama")
    convert_hf_to_mcore(hf, tmp_path / "m", dtype="bf16")
    stored = _read_whole(tmp_path / "m" / "release")
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    back = convert_mcore_to_hf(tmp_path / "m", tmp_path / "hf2")
    got = load_hf_tensors(back.save_dir)
    for name, t in load_hf_tensors(hf).items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], t.to(torch.bfloat16)), name
    cfg = json.loads((back.save_dir / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"


def test_hf_output_loads_in_transformers_with_tokenizer(tmp_path):
    """Tokenizer files travel HF → hf_config/ → HF, and transformers gives the same logits as the source."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_dapo.testing.tiny_models import save_tiny_hf_checkpoint
    from megatron_dapo.testing.tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(tmp_path / "tok")
    hf = save_tiny_hf_checkpoint(tmp_path / "hf", "qwen3", seed=3, tokenizer=tok, vocab_size=len(tok))
    convert_hf_to_mcore(hf, tmp_path / "m")
    tok_files = sorted(p.name for p in (tmp_path / "m" / "hf_config").iterdir())
    assert "tokenizer.json" in tok_files and "config.json" in tok_files
    back = convert_mcore_to_hf(tmp_path / "m", tmp_path / "hf2", max_shard_size="40KB")
    assert (back.save_dir / "model.safetensors.index.json").is_file()
    text = "<|im_start|>user\n3+4=<|im_end|>"
    tok2 = AutoTokenizer.from_pretrained(back.save_dir)
    assert tok2(text)["input_ids"] == tok(text)["input_ids"]
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(hf).eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(back.save_dir).eval()(ids).logits
    assert torch.equal(ref, got)


def test_cli(tiny_hf, tmp_path):
    hf = tiny_hf("qwen3")
    tool = REPO / "tools" / "checkpoint_convert" / "convert.py"
    run = [sys.executable, str(tool)]
    proc = subprocess.run(
        run + ["hf-to-mcore", "--hf-dir", str(hf), "--save-dir", str(tmp_path / "m")], text=True, capture_output=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("wrote 35 tensors")
    proc = subprocess.run(
        run + ["hf-to-mcore", "--hf-dir", str(hf), "--save-dir", str(tmp_path / "m2"), "--tp", "2"],
        text=True,
        capture_output=True,
    )
    assert proc.returncode == 2 and "unrecognized arguments: --tp 2" in proc.stderr  # the layout is chosen on load
    proc = subprocess.run(
        run + ["mcore-to-hf", "--load-dir", str(tmp_path / "m"), "--save-dir", str(tmp_path / "h")],
        text=True,
        capture_output=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert_same_tensors(load_hf_tensors(hf), load_hf_tensors(tmp_path / "h"))
    proc = subprocess.run(
        run + ["mcore-to-hf", "--load-dir", str(hf), "--save-dir", str(tmp_path / "h2")], text=True, capture_output=True
    )
    assert proc.returncode == 1 and "is already an HF model directory" in proc.stderr


def test_parse_size():
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size(1000) == 1000
    with pytest.raises(ValueError, match="expected a byte count"):
        parse_size("lots")
