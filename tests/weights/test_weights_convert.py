"""HF ⇄ Megatron conversion: bit-exact round trips, the written layout checked by hand, CLI and side files."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_dapo.models.families import model_arch_from_hf, param_mappings
from megatron_dapo.weights import safetensors_io
from megatron_dapo.weights.convert import (
    convert_hf_to_mcore,
    convert_mcore_to_hf,
    parse_size,
    plan_parts,
    shard_row_plan,
)
from megatron_dapo.weights.layout import hf_to_mcore, padded_vocab_size, tp_shard
from megatron_dapo.weights.mcore_checkpoint import META_NAME, McoreCheckpoint, rank_file
from tests.weights.conftest import CASES, assert_same_tensors, load_hf_tensors

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("family,tie", CASES, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in CASES])
def test_round_trip_tp2_pp2_is_bit_exact(tiny_hf, tmp_path, family, tie):
    # The untied qwen2 case reads a sharded HF checkpoint (index + several files).
    hf = tiny_hf(family, tie, shard="60KB" if (family, tie) == ("qwen2", False) else None)
    if (family, tie) == ("qwen2", False):
        index = json.loads((hf / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) >= 3
    res = convert_hf_to_mcore(hf, tmp_path / "mcore", tp=2, pp=2)
    assert sorted(p.name for p in (tmp_path / "mcore").iterdir()) == [
        "hf_config",
        "manifest.json",
        META_NAME,
        "mp_rank_00_000",
        "mp_rank_00_001",
        "mp_rank_01_000",
        "mp_rank_01_001",
    ]
    assert res.num_tensors == sum(len(load_file(str(rank_file(res.save_dir, r, s)))) for r in (0, 1) for s in (0, 1))
    # The manifest (hashed while writing, out of order and partly by kernel copies) matches the files' bytes.
    manifest = json.loads((tmp_path / "mcore" / "manifest.json").read_text())["files"]
    assert len(manifest) == 4
    for r in (0, 1):
        for s in (0, 1):
            data = rank_file(res.save_dir, r, s).read_bytes()
            rel = rank_file(res.save_dir, r, s).relative_to(res.save_dir).as_posix()
            assert manifest[rel] == {"size": len(data), "crc32": zlib.crc32(data)}
    back = convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "hf2")
    assert (back.save_dir / "model.safetensors").is_file()  # 2GB default shard size: one file, as save_pretrained
    assert_same_tensors(load_hf_tensors(hf), load_hf_tensors(back.save_dir))
    assert json.loads((back.save_dir / "config.json").read_text()) == json.loads((hf / "config.json").read_text())


def test_written_layout_by_hand(tiny_hf, tmp_path):
    """Rank files of an untied qwen2 at TP=2, PP=2, rebuilt from the HF tensors with explicit slicing."""
    hf = tiny_hf("qwen2", False)
    sd = load_hf_tensors(hf)
    convert_hf_to_mcore(hf, tmp_path / "m", tp=2, pp=2)
    meta = json.loads((tmp_path / "m" / META_NAME).read_text())
    assert (meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"]) == (2, 2)
    assert (meta["padded_vocab_size"], meta["vocab_size"], meta["dtype"], meta["family"]) == (256, 100, "fp32", "qwen2")
    assert meta["hf_config"] == json.loads((hf / "config.json").read_text())
    files = {(r, s): load_file(str(rank_file(tmp_path / "m", r, s))) for r in (0, 1) for s in (0, 1)}
    # 4 layers, PP=2: layers 0-1 on stage 0, 2-3 on stage 1, stored under their global numbers.
    assert {n.split(".")[2] for n in files[(1, 1)] if n.startswith("decoder.layers.")} == {"2", "3"}
    emb = "embedding.word_embeddings.weight"
    assert emb in files[(0, 0)] and emb not in files[(0, 1)]
    assert {"output_layer.weight", "decoder.final_layernorm.weight"} <= set(files[(0, 1)])
    # 4 heads in 2 groups of head_dim 16: TP rank 1 holds group 1 = query heads 2,3 and kv head 1.
    h = "model.layers.2.self_attn."
    qkv = files[(1, 1)]["decoder.layers.2.self_attention.linear_qkv.weight"]
    assert torch.equal(
        qkv, torch.cat([sd[h + "q_proj.weight"][32:64], sd[h + "k_proj.weight"][16:32], sd[h + "v_proj.weight"][16:32]])
    )
    bias = files[(0, 1)]["decoder.layers.2.self_attention.linear_qkv.bias"]
    assert torch.equal(
        bias, torch.cat([sd[h + "q_proj.bias"][:32], sd[h + "k_proj.bias"][:16], sd[h + "v_proj.bias"][:16]])
    )
    # intermediate 96: rank 1 holds gate rows 48..95 then up rows 48..95
    fc1 = files[(1, 0)]["decoder.layers.1.mlp.linear_fc1.weight"]
    m = "model.layers.1.mlp."
    assert torch.equal(fc1, torch.cat([sd[m + "gate_proj.weight"][48:], sd[m + "up_proj.weight"][48:]]))
    # row-parallel layers split the input dimension
    assert torch.equal(
        files[(1, 0)]["decoder.layers.0.self_attention.linear_proj.weight"],
        sd["model.layers.0.self_attn.o_proj.weight"][:, 32:],
    )
    assert torch.equal(
        files[(0, 1)]["decoder.layers.3.mlp.linear_fc2.weight"], sd["model.layers.3.mlp.down_proj.weight"][:, :48]
    )
    # vocabulary 100 padded to 256 (128 x TP): rank 0 = rows 0..99 + 28 zero rows, rank 1 = 128 zero rows
    emb0, emb1 = files[(0, 0)]["embedding.word_embeddings.weight"], files[(1, 0)]["embedding.word_embeddings.weight"]
    assert emb0.shape == emb1.shape == (128, 64)
    assert torch.equal(emb0[:100], sd["model.embed_tokens.weight"]) and not emb0[100:].any() and not emb1.any()
    assert torch.equal(files[(0, 1)]["output_layer.weight"][:100], sd["lm_head.weight"])
    # replicated norms are in every TP rank's file
    for r in (0, 1):
        assert torch.equal(files[(r, 1)]["decoder.final_layernorm.weight"], sd["model.norm.weight"])


def test_tied_embedding_is_stored_as_output_layer_on_the_last_stage(tiny_hf, tmp_path):
    hf = tiny_hf("qwen2", True)
    convert_hf_to_mcore(hf, tmp_path / "m", tp=2, pp=2)
    for r in (0, 1):
        first = load_file(str(rank_file(tmp_path / "m", r, 0)))
        last = load_file(str(rank_file(tmp_path / "m", r, 1)))
        assert torch.equal(last["output_layer.weight"], first["embedding.word_embeddings.weight"])
    assert "lm_head.weight" not in load_hf_tensors(convert_mcore_to_hf(tmp_path / "m", tmp_path / "hf2").save_dir)


def test_row_plans_match_the_layout_module():
    """The converter's file-to-file row plans give exactly ``tp_shard(hf_to_mcore(...))`` for every parameter."""
    from megatron_dapo.testing.tiny_models import make_tiny_hf_model

    for family, kw in [
        ("qwen2", {}),
        ("qwen3", {}),
        ("llama", {}),
        ("qwen2", {"num_kv_heads": 4}),
        ("qwen2", {"num_kv_heads": 1}),
    ]:
        model = make_tiny_hf_model(family, **kw)
        sd, arch = model.state_dict(), model_arch_from_hf(model.config.to_dict())
        for tp in (1, 2, 4):
            if arch.num_query_groups % tp:
                continue
            padded = padded_vocab_size(arch.vocab_size, 128, tp)
            for m in param_mappings(arch):
                if m.tp_dim == 1:
                    continue  # column slices are not runs of rows: the converter reads those
                tensors = [sd[n] for n in m.hf]
                full = hf_to_mcore(m, tensors, arch, padded)
                for r in range(tp):
                    plan = shard_row_plan(m, [t.shape[0] for t in tensors], arch, padded, tp, r)
                    assert torch.equal(torch.cat(plan_parts(plan, tensors)), tp_shard(full, m.kind, m.tp_dim, tp, r))


def test_bf16_conversion_casts_and_updates_config(tiny_hf, tmp_path):
    hf = tiny_hf("llama", False)
    convert_hf_to_mcore(hf, tmp_path / "m", tp=2, pp=1, dtype="bf16")
    with McoreCheckpoint(tmp_path / "m") as ckpt:
        assert ckpt.meta["dtype"] == "bf16"
        assert {ckpt.info(n, 0).dtype for n in ckpt.names()} == {torch.bfloat16}
    back = convert_mcore_to_hf(tmp_path / "m", tmp_path / "hf2", max_shard_size="40KB")
    index = json.loads((back.save_dir / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in back.save_dir.glob("*.safetensors"))
    assert len(files) >= 3 and sorted(set(index["weight_map"].values())) == files
    got = load_hf_tensors(back.save_dir)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    assert_same_tensors({k: v.bfloat16() for k, v in load_hf_tensors(hf).items()}, got)
    cfg = json.loads((back.save_dir / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"


def test_hf_output_loads_in_transformers_with_tokenizer(tmp_path):
    """Tokenizer files travel HF → hf_config/ → HF, and transformers gives the same logits as the source."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_dapo.testing.tiny_models import save_tiny_hf_checkpoint
    from megatron_dapo.testing.tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(tmp_path / "tok")
    hf = save_tiny_hf_checkpoint(tmp_path / "hf", "qwen3", seed=3, tokenizer=tok, vocab_size=len(tok))
    convert_hf_to_mcore(hf, tmp_path / "m", tp=1, pp=2)
    tok_files = sorted(p.name for p in (tmp_path / "m" / "hf_config").iterdir())
    assert "tokenizer.json" in tok_files and "config.json" in tok_files
    back = convert_mcore_to_hf(tmp_path / "m", tmp_path / "hf2")
    text = "<|im_start|>user\n3+4=<|im_end|>"
    tok2 = AutoTokenizer.from_pretrained(back.save_dir)
    assert tok2(text)["input_ids"] == tok(text)["input_ids"]
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(hf).eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(back.save_dir).eval()(ids).logits
    assert torch.equal(ref, got)


def test_kernel_copy_and_read_write_paths_write_identical_files(tiny_hf, tmp_path, monkeypatch):
    hf = tiny_hf("qwen2", True)
    convert_hf_to_mcore(hf, tmp_path / "a", tp=2, pp=2)
    monkeypatch.setattr(safetensors_io, "_copy_file_range_ok", False)
    convert_hf_to_mcore(hf, tmp_path / "b", tp=2, pp=2)
    for r in (0, 1):
        for s in (0, 1):
            assert rank_file(tmp_path / "a", r, s).read_bytes() == rank_file(tmp_path / "b", r, s).read_bytes()


def test_cli(tiny_hf, tmp_path):
    hf = tiny_hf("qwen3", False)
    tool = str(REPO / "tools" / "checkpoint_convert" / "convert.py")
    cmd = [sys.executable, tool, "hf-to-mcore", "--hf-dir", str(hf), "--save-dir", str(tmp_path / "m"), "--tp", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    per_rank = len(param_mappings(model_arch_from_hf(hf)))  # PP=1: every parameter in each TP rank's file
    assert f"wrote {2 * per_rank} tensors" in out.stdout
    assert [len(load_file(str(rank_file(tmp_path / "m", r, 0)))) for r in (0, 1)] == [per_rank, per_rank]
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert again.returncode == 1
    assert "error:" in again.stderr and "already exists" in again.stderr and "--overwrite" in again.stderr
    back = subprocess.run(
        [
            sys.executable,
            tool,
            "mcore-to-hf",
            "--load-dir",
            str(tmp_path / "m"),
            "--save-dir",
            str(tmp_path / "hf2"),
            "--max-shard-size",
            "100KB",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert back.returncode == 0, back.stderr
    assert_same_tensors(load_hf_tensors(hf), load_hf_tensors(tmp_path / "hf2"))


def test_parse_size():
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("10kb") == 10_000
    assert parse_size(1234) == 1234
    with pytest.raises(ValueError, match="expected a byte count"):
        parse_size("two gigabytes")
