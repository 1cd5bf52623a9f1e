"""``megatron-dapo check`` (megatron_dapo/check.py): the tiny demo passes with the right plan, many problems are
listed at once, memory phases over --device-memory-gb are flagged, the per-phase memory plan matches hand-computed
bytes for a small model (offload, vLLM sleep level, recompute, pipeline stages, peak phase), and the shipped large
configs get a plan from locally written HF config.json files of the real model shapes (no weights) that agrees with
the budget in their header comments."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron_dapo.check import main, run_check
from megatron_dapo.data.rows import read_records
from megatron_dapo.tasks.arithmetic import DATA_SOURCE
from megatron_dapo.tasks.demo import prepare
from megatron_dapo.weights.convert import convert_hf_to_mcore
from tests.helpers.hf_configs import QWEN3_8B, QWEN3_32B, QWEN25_32B

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny_cpu.yaml")


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("check_demo")
    info = prepare(root, seed=0, train_rows=64)
    convert_hf_to_mcore(info["hf_model"], root / "mcore")
    info["mcore"] = str(root / "mcore")
    info["root"] = root
    info["hf_config"] = json.loads((Path(info["hf_model"]) / "config.json").read_text())
    return info


def demo_overrides(demo: dict, train: str | None = None, val: str | None = None) -> list[str]:
    return [
        f"model.hf_config_dir={demo['hf_model']}",
        f"model.tokenizer_dir={demo['tokenizer']}",
        f"checkpoint.load_dir={demo['mcore']}",
        f"data.train_files=[{train or demo['train']}]",
        f"data.val_files=[{val or demo['val']}]",
    ]


def test_tiny_config_passes_with_the_plan(demo, capsys):
    report = run_check(TINY, demo_overrides(demo))
    print(report.render())
    assert report.problems == []
    assert report.warnings == []
    assert report.ok

    # By hand from configs/tiny_cpu.yaml: 1 node x 2 processes, TP 1 PP 1 -> DP 2, rollout TP 1 -> 2 replicas;
    # train_batch 16 prompts x n 32 = 512 trajectories of 24 + 4 tokens; mini-batch 16 prompts = 1 optimizer step of
    # 512 sequences, 256 per DP rank, in micro-batches of 64 -> 4; log-probs: 512 / 2 ranks / 64 -> 4.
    n = report.numbers
    assert (n["world_size"], n["tp"], n["pp"], n["dp"], n["rollout_tp"], n["rollout_dp"]) == (2, 1, 1, 2, 1, 2)
    assert n["trajectories_per_step"] == 16 * 32
    assert n["max_tokens_per_step"] == 16 * 32 * (24 + 4)
    assert (n["mini_batches_per_step"], n["optimizer_steps_per_step"]) == (1, 1)
    assert n["sequences_per_mini_batch_per_rank"] == 256
    assert n["micro_batches_per_mini_batch"] == 4
    assert n["log_prob_micro_batches_per_step"] == 4

    # Parameter count from config.json vs the HF model's sum(p.numel()) (prepare() counts it on the real model).
    assert n["params"] == demo["params"] == 322688
    # Megatron pads the vocabulary (make_vocab_size_divisible_by 64 x TP 1) for the untied embedding and output.
    vocab, hidden = demo["hf_config"]["vocab_size"], demo["hf_config"]["hidden_size"]
    padded = -(-vocab // 64) * 64
    assert n["padded_vocab"] == padded
    assert n["actor_params_per_rank"] == demo["params"] + 2 * (padded - vocab) * hidden
    # fp32 actor: weights 4 B, fp32 grads 4 B, Adam 8 B (no master copy), no reference (no KL term).
    p = n["actor_params_per_rank"]
    assert n["memory_actor_weights_bytes"] == 4 * p
    assert n["memory_grads_bytes"] == 4 * p
    assert n["memory_optimizer_bytes"] == 8 * p
    assert n["memory_reference_bytes"] == 0
    assert n["memory_kv_cache_bytes"] == 64 * 2**20  # rollout.kv_cache_memory_mb on CPU
    # KV per token: K and V x 2 layers x 2 KV heads x head_dim 32 x 4 B = 1024 B -> 65536 tokens in 64 MiB.
    assert n["kv_cache_tokens"] == 65536

    text = report.plan
    assert "world size 2 = 1 node(s) x 2 process(es) per node" in text
    assert "actor: TP 1 x PP 1 (VPP -) x DP 2" in text
    assert "rollout: TP 1 x DP 2" in text
    assert "per mini-batch per rank: 256 sequences in 4 (of 64 sequences) micro-batches" in text
    assert "1 mini-batch(es) of 512 sequences x 1 epoch(s) = 1 optimizer step(s)" in text
    assert "322,688" in text
    loaded = f"checkpoint.load_dir: Megatron distributed checkpoint {demo['mcore']} (release), loaded at TP 1 PP 1"
    assert loaded in text
    assert f"{demo['train']}: 64 rows, 0 invalid" in text
    assert f"{demo['val']}: 25 rows, 0 invalid" in text

    assert main([TINY, *demo_overrides(demo)]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("OK")


def test_all_problems_are_listed_at_once(demo, tmp_path, capsys):
    # A training file whose row 5 has no reward_model, a val file that does not exist, a reward function that raises
    # on its row, a range error and a TP size that divides neither the heads, the KV heads nor the FFN size.
    rows = read_records(demo["train"])[:40]
    del rows[5]["reward_model"]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    missing_val = tmp_path / "nowhere" / "val.parquet"
    reward = tmp_path / "bad_reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    raise ValueError(f'cannot score {solution_str!r}')\n"
    )
    overrides = demo_overrides(demo, train=str(train), val=str(missing_val)) + [
        f"reward.custom_function.path={reward}",
        "reward.custom_function.name=compute_score",
        "actor.clip_ratio_c=0.5",
        "parallel.tensor_model_parallel_size=3",
    ]
    report = run_check(TINY, overrides, nnodes=1, nproc_per_node=3)
    print(report.render())
    heads = demo["hf_config"]["num_attention_heads"]
    kv = demo["hf_config"]["num_key_value_heads"]
    ffn = demo["hf_config"]["intermediate_size"]
    expected = [
        "actor.clip_ratio_c=0.5: expected a value > 1",
        f"parallel.tensor_model_parallel_size=3 does not divide the model's num_attention_heads={heads}",
        f"parallel.tensor_model_parallel_size=3 does not divide the model's num_key_value_heads={kv}",
        f"parallel.tensor_model_parallel_size=3 does not divide the model's intermediate_size={ffn}",
        f"data.val_files[0]: {missing_val}: no such file",
        f"{train}: row 5: field 'reward_model': missing",
        f"reward function {reward}:compute_score (reward.custom_function) on data_source {DATA_SOURCE!r} "
        f"({train}: row 0, response",
    ]
    for start in expected:
        assert any(p.startswith(start) for p in report.problems), (start, report.problems)
    assert len(report.problems) == len(expected), report.problems
    raised = next(p for p in report.problems if p.startswith("reward function"))
    first_truth = rows[0]["reward_model"]["ground_truth"]
    assert f"raised ValueError: cannot score '{first_truth}'" in raised
    assert "plan: not computed" in report.plan

    rc = main([TINY, *overrides, "--nproc-per-node", "3"])
    out = capsys.readouterr().out
    assert rc == 1
    assert f"problems ({len(expected)}):" in out
    assert out.rstrip().endswith(f"FAILED: {len(expected)} problem(s)")


def test_reward_returning_nan_and_overlong_prompt(demo, tmp_path):
    reward = tmp_path / "nan_reward.py"
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return float('nan')\n")
    overrides = demo_overrides(demo) + [
        f"reward.custom_function.path={reward}",
        "reward.custom_function.name=score",
        "data.max_prompt_length=10",  # the demo prompts are 12 tokens; truncation=error
        "data.max_response_length=4",
    ]
    report = run_check(TINY, overrides)
    print(report.render())
    nan = [p for p in report.problems if "returned a non-finite number: nan" in p]
    assert len(nan) == 1 and f"data_source {DATA_SOURCE!r}" in nan[0] and f"{reward}:score" in nan[0]
    overlong = [p for p in report.problems if "prompt is 12 tokens, longer than data.max_prompt_length=10" in p]
    # 5 rows listed per file, the rest counted: train (64 rows) and val (25 rows).
    assert len(overlong) == 10
    assert overlong[0].startswith(f"{demo['train']}: row 0: ")
    assert f"{demo['train']}: 59 more prompts longer than data.max_prompt_length=10 (first 5 above)" in report.problems
    assert f"{demo['val']}: 20 more prompts longer than data.max_prompt_length=10 (first 5 above)" in report.problems
    assert len(report.problems) == 1 + 10 + 2


def test_memory_phase_over_device_memory_is_flagged(demo):
    # CPU: nothing is offloaded and vLLM never sleeps (its 64 MiB KV cache stays). The tiny run needs ~70 MiB while
    # generating, ~98 MiB in the update and ~102 MiB in the weight sync (2 x 16 MiB buckets).
    report = run_check(TINY, demo_overrides(demo), device_memory_gb=0.08)
    print(report.render())
    n = report.numbers
    limit = 0.08 * 2**30
    assert n["memory_phase_gen_bytes"] < limit < n["memory_phase_update_bytes"] < n["memory_phase_sync_bytes"]
    lines = {
        line.split()[0]: line for line in report.plan.splitlines() if line.startswith("    ") and " device " in line
    }
    assert "OVER --device-memory-gb 0.08" in lines["update"]
    assert "OVER --device-memory-gb 0.08" in lines["sync"]
    assert "OVER" not in lines["gen"]
    # on-policy (one mini-batch, one epoch): no old-policy forward; no KL term: no reference forward.
    assert "[not run:" in lines["old_log_prob"] and "[not run: no KL term" in lines["ref"]
    assert report.peak_phase == "sync"
    assert "peak per rank: sync " in report.plan and "OVER --device-memory-gb 0.08 by" in report.plan
    assert any(w.startswith("memory estimate of phase 'update'") for w in report.warnings)
    assert report.ok  # an estimate over the limit warns; it is not a problem
    # Every phase's terms add up to its total, and CPU keeps everything on the "device" (no host column).
    for ph in report.phases:
        assert n[f"memory_phase_{ph.name}_bytes"] == sum(ph.device.values())
        assert ph.host == {}
        assert ph.device["vLLM KV cache"] == 64 * 2**20


# A small Qwen2-architecture model whose memory terms are worked out by hand below (no helper of check.py is used).
SMALL = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
# By hand, bf16 (2 B), TP 2 with sequence parallelism, 8 ranks -> DP 4, head_dim 256 / 4 = 64 (q 256, kv 128):
#   per layer, TP-split: qkv 256 x (256 + 2 x 128) + bias 512 = 131584; out 256 x 256 = 65536; MLP 3 x 256 x 512 =
#   393216 -> 590336 (295168 per TP rank); norms 2 x 256 = 512 (replicated).
#   vocabulary padded to a multiple of 128 x TP 2 = 256 -> 1024; embedding and output layer 1024 x 256 / 2 = 131072.
#   actor params per rank (PP 1) = 8 x (295168 + 512) + 2 x 131072 + final norm 256 = 2627840.
SMALL_P_RANK = 2627840
#   optimizer: fp32 master + Adam m, v = 12 B per param, / DP 4 (distributed optimizer).
SMALL_OPTIM = 2627840 * 12 // 4  # 7883520
SMALL_GRADS = 2627840 * 4  # fp32 main grads
#   vLLM at rollout TP 2: (unpadded 1000 x 256 x 2 + 8 x 590336) / 2 + 8 x 512 + 256 = 2621696 params x 2 B.
SMALL_VLLM = 2621696 * 2  # 5243392
#   activations per token per layer, kept for backward (flash attention): QKV output 256 + 128 + 128, rotated Q and
#   K 256 + 128, attention output 256, fc1 2 x 512, SwiGLU 512 = 2688 elements x 2 B / TP 2 = 2688 B; the two norms'
#   inputs and outputs 4 x 256 x 2 B / TP 2 (SP) = 1024 B; flash attention's softmax statistics 4 heads x 4 B / TP 2
#   = 8 B -> 3720 B.
#   A micro-batch is 2 sequences x (512 + 512) = 2048 tokens.
SMALL_TOKENS = 2048
SMALL_ACT_NONE = 8 * SMALL_TOKENS * 3720  # 8 layers, 1 micro-batch in flight (PP 1) = 60948480
SMALL_ACT_FULL = 8 * SMALL_TOKENS * 256 * 2 // 2 + 1 * SMALL_TOKENS * 3720  # layer inputs + one layer recomputed


def small_plan(tmp_path, *overrides: str, memory_gb: float = 1.0, nproc: int = 8):
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    base = [
        f"model.hf_config_dir={tmp_path}",
        "model.params_dtype=bf16",
        "model.make_vocab_size_divisible_by=128",
        "parallel.platform=cuda",
        "parallel.tensor_model_parallel_size=2",
        "parallel.sequence_parallel=true",
        "parallel.use_distributed_optimizer=true",
        "rollout.tensor_model_parallel_size=2",
        "rollout.gpu_memory_utilization=0.5",
        "data.max_prompt_length=512",
        "data.max_response_length=512",
        f"data.train_files=[{tmp_path}/no_data.jsonl]",  # the plan needs no data; its problem is expected
        "data.val_files=[]",
        f"checkpoint.load_dir={tmp_path}/no_ckpt",
        "actor.ppo_micro_batch_size_per_gpu=2",
        "actor.log_prob_micro_batch_size_per_gpu=2",
    ]
    report = run_check(TINY, base + list(overrides), nnodes=1, nproc_per_node=nproc, device_memory_gb=memory_gb)
    print(report.render())
    assert report.phases, report.problems
    return report


def phase(report, name: str):
    return next(ph for ph in report.phases if ph.name == name)


def test_memory_terms_by_hand(tmp_path):
    report = small_plan(tmp_path, "actor.recompute=none")
    n = report.numbers
    assert n["dp"] == 4
    assert n["actor_params_per_rank"] == SMALL_P_RANK
    assert n["memory_actor_weights_bytes"] == 2 * SMALL_P_RANK
    assert n["memory_grads_bytes"] == SMALL_GRADS
    assert n["memory_optimizer_bytes"] == SMALL_OPTIM
    assert n["memory_vllm_weights_bytes"] == SMALL_VLLM
    assert n["micro_batch_tokens"] == SMALL_TOKENS
    assert n["memory_activations_bytes"] == SMALL_ACT_NONE
    # Training logits: 2048 tokens x padded vocab / TP = 512 x 2 B; their gradient reuses their storage.
    assert n["memory_logits_bytes"] == 2048 * 512 * 2
    # The update holds everything the optimizer step needs and the training micro-batch's tensors; vLLM sleeps.
    upd = phase(report, "update")
    assert set(upd.device) == {"actor weights", "grads", "optimizer", "activations", "logits", "logit chunks"}
    assert upd.device["activations"] == SMALL_ACT_NONE
    # Generation: vLLM gets gpu_memory_utilization x device memory (weights + KV cache); the actor keeps its weights.
    gen = phase(report, "gen")
    assert gen.device == {
        "actor weights": 2 * SMALL_P_RANK,
        "vLLM weights": SMALL_VLLM,
        "vLLM KV cache": 2**29 - SMALL_VLLM,
    }
    assert "cuda defaults" in report.plan and "vLLM sleeps at level 2" in report.plan


def test_recompute_reduces_update_activations(tmp_path):
    none = small_plan(tmp_path, "actor.recompute=none").numbers["memory_activations_bytes"]
    selective = small_plan(tmp_path, "actor.recompute=selective").numbers["memory_activations_bytes"]
    full = small_plan(tmp_path, "actor.recompute=full").numbers["memory_activations_bytes"]
    full2 = small_plan(tmp_path, "actor.recompute=full", "actor.recompute_num_layers=2")
    assert none == SMALL_ACT_NONE
    # selective: the core attention is recomputed; with flash attention that drops only its softmax statistics.
    assert none - selective == 8 * SMALL_TOKENS * 8
    # full, groups of 1 layer: each layer keeps its input (2048 x 256 x 2 B / TP 2 with SP) + one layer recomputed.
    assert full == SMALL_ACT_FULL == 11812864
    assert none / full == pytest.approx(60948480 / 11812864)  # ~5.16x less
    # groups of 2: 4 group inputs + 2 layers recomputed at once.
    assert full2.numbers["memory_activations_bytes"] == 4 * SMALL_TOKENS * 256 + 2 * SMALL_TOKENS * 3720
    upd = phase(full2, "update")
    assert upd.device["layer inputs"] == 4 * SMALL_TOKENS * 256 and upd.device["recomputed group"] == 2 * 2048 * 3720


def test_offload_optimizer_moves_exactly_its_bytes_to_host(tmp_path):
    kept = small_plan(tmp_path, "actor.offload_optimizer=false", "actor.offload_grads=false")
    moved = small_plan(tmp_path, "actor.offload_optimizer=true", "actor.offload_grads=false")
    for name in ("sync", "gen", "old_log_prob"):
        k, m = phase(kept, name), phase(moved, name)
        assert k.device_total - m.device_total == SMALL_OPTIM, name
        assert m.host_total - k.host_total == SMALL_OPTIM, name
        assert m.host == {"optimizer": SMALL_OPTIM}
    # before_update brings it back: the update is the same either way.
    assert phase(kept, "update").device == phase(moved, "update").device
    assert phase(moved, "update").host == {}
    # Grads are offloaded by freeing them (values discarded, re-zeroed on onload): off the device, not on the host.
    grads = small_plan(tmp_path, "actor.offload_optimizer=false", "actor.offload_grads=true")
    assert phase(kept, "gen").device_total - phase(grads, "gen").device_total == SMALL_GRADS
    assert phase(grads, "gen").host_total == 0
    # The platform default (null) on CUDA offloads both; the pinned buffers are kept for the run.
    default = small_plan(tmp_path)
    assert phase(default, "gen").device_total == phase(kept, "gen").device_total - SMALL_OPTIM - SMALL_GRADS
    assert default.numbers["memory_pinned_host_bytes"] == SMALL_OPTIM
    # Params offloaded too: off the device only while generating (the sync reads them first).
    params = small_plan(tmp_path, "actor.offload_params=true")
    assert phase(params, "gen").host["actor weights"] == 2 * SMALL_P_RANK
    assert "actor weights" not in phase(params, "gen").device
    assert phase(params, "sync").device["actor weights"] == 2 * SMALL_P_RANK


def test_sleep_level_decides_where_vllm_weights_go(tmp_path):
    one = small_plan(tmp_path, "rollout.sleep_level=1")
    two = small_plan(tmp_path, "rollout.sleep_level=2")
    for name in ("old_log_prob", "ref", "update"):
        # Asleep at either level: nothing of vLLM on the device; level 1 keeps its weights in pinned host memory.
        assert phase(one, name).device == phase(two, name).device
        assert "vLLM weights" not in phase(one, name).device and "vLLM KV cache" not in phase(one, name).device
        assert phase(one, name).host_total - phase(two, name).host_total == SMALL_VLLM
        assert phase(one, name).host["vLLM weights"] == SMALL_VLLM
    for name in ("sync", "gen"):  # awake: the same
        assert phase(one, name).device == phase(two, name).device and phase(one, name).host == phase(two, name).host
    assert phase(one, "sync").device["vLLM weights"] == SMALL_VLLM and "vLLM KV cache" not in phase(one, "sync").device
    assert one.numbers["memory_pinned_host_bytes"] - two.numbers["memory_pinned_host_bytes"] == SMALL_VLLM
    # rollout.free_cache_engine=false: vLLM never sleeps, its weights and KV cache stay in every phase.
    awake = small_plan(tmp_path, "rollout.free_cache_engine=false")
    kv = 2**29 - SMALL_VLLM
    assert phase(awake, "update").device_total - phase(two, "update").device_total == SMALL_VLLM + kv


def test_peak_phase_is_named(tmp_path):
    # vLLM takes half of the 1 GiB device while generating; the update needs ~80 MB: generation is the peak.
    gen_peak = small_plan(tmp_path, "actor.recompute=none")
    assert gen_peak.peak_phase == "gen"
    assert gen_peak.numbers["memory_peak_bytes"] == 2 * SMALL_P_RANK + 2**29  # 517.01 MiB
    assert "peak per rank: gen 517.01 MiB: fits --device-memory-gb 1 with 506.99 MiB (50%)" in gen_peak.plan
    # 5% for vLLM (51.2 MiB, 48.6 MiB of KV cache) and no recomputation: the update is the peak.
    upd_peak = small_plan(tmp_path, "actor.recompute=none", "rollout.gpu_memory_utilization=0.05")
    assert upd_peak.peak_phase == "update"
    expected = (
        2 * SMALL_P_RANK + SMALL_GRADS + SMALL_OPTIM + SMALL_ACT_NONE + 2048 * 512 * 2 + 64 * 512 * (2 + 4 + 4 + 2)
    )
    assert upd_peak.numbers["memory_peak_bytes"] == expected == upd_peak.numbers["memory_phase_update_bytes"]
    # A device too small for it: marked OVER, warned about, and still named.
    over = small_plan(tmp_path, "actor.recompute=none", "rollout.gpu_memory_utilization=0.5", memory_gb=0.07)
    assert over.peak_phase == "update"
    assert "peak per rank: update" in over.plan and "OVER --device-memory-gb 0.07 by" in over.plan
    assert any(w.startswith("memory estimate of phase 'update'") for w in over.warnings)
    # With a KL term the reference forward runs and holds the reference's weights, offloaded elsewhere.
    kl = small_plan(tmp_path, "actor.use_kl_loss=true")
    ref = phase(kl, "ref")
    assert ref.runs and ref.device["reference"] == 2 * SMALL_P_RANK
    assert phase(kl, "update").host["reference"] == 2 * SMALL_P_RANK


def test_pipeline_stages_in_flight(tmp_path):
    # PP 2 (DP 2): stage 0 holds 2 micro-batches of its 4 layers, the last stage 1 plus the logits.
    pp = small_plan(tmp_path, "actor.recompute=none", "parallel.pipeline_model_parallel_size=2")
    assert pp.numbers["update_pipeline_stage"] == 0
    assert pp.numbers["memory_activations_bytes"] == 2 * 4 * SMALL_TOKENS * 3720
    # VPP 2: the interleaved schedule's first rank holds (2 - 1) x 2 + (2 - 1) x 2 + 1 = 5 chunks of 2 layers.
    vpp = small_plan(
        tmp_path,
        "actor.recompute=none",
        "parallel.pipeline_model_parallel_size=2",
        "parallel.virtual_pipeline_model_parallel_size=2",
    )
    assert vpp.numbers["memory_activations_bytes"] == 5 * 2 * SMALL_TOKENS * 3720


@pytest.mark.parametrize(
    "config, hf_config, nnodes, nproc, memory_gb, params",
    [
        ("dapo_qwen2.5_32b.yaml", QWEN25_32B, 16, 8, 80, 32.8e9),
        ("dapo_qwen3_32b_ascend.yaml", QWEN3_32B, 16, 16, 64, 32.8e9),  # Atlas 800T A2: 64 GB per NPU
        ("grpo_qwen3_8b.yaml", QWEN3_8B, 1, 8, 80, 8.19e9),
    ],
)
def test_shipped_large_configs_plan(tmp_path, config, hf_config, nnodes, nproc, memory_gb, params):
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    report = run_check(
        str(REPO / "configs" / config),
        [f"model.hf_config_dir={tmp_path}"],
        nnodes=nnodes,
        nproc_per_node=nproc,
        device_memory_gb=memory_gb,
    )
    print(report.render())
    n = report.numbers
    assert abs(n["params"] - params) / params < 0.01, n["params"]
    assert n["world_size"] == nnodes * nproc
    assert n["dp"] == nnodes * nproc // (n["tp"] * n["pp"])
    # The placeholder data and checkpoint paths do not exist here; nothing else is wrong with these configs.
    assert report.problems and all(("/data/" in p or "/ckpt/" in p) for p in report.problems), report.problems
    assert report.warnings == []  # no phase over the device memory

    # The per-phase budget in the config's header comment is what the check prints: every phase the step runs, its
    # total and each of its terms (GiB, rounded to 0.01), terms that add up to the total, and the peak.
    budget, peak = comment_budget(REPO / "configs" / config)
    phases = {ph.name: ph for ph in report.phases if ph.runs}
    assert set(budget) == set(phases), (set(budget), set(phases))
    for name, (total, terms) in budget.items():
        ph = phases[name]
        assert total == round(ph.device_total / 2**30, 2), (name, total, ph.device_total / 2**30)
        assert terms == {k: round(v / 2**30, 2) for k, v in ph.device.items() if v}, (name, terms, ph.device)
        assert abs(sum(terms.values()) - total) <= 0.03, (name, terms, total)
        assert total <= memory_gb
    assert peak == (report.peak_phase, round(report.numbers["memory_peak_bytes"] / 2**30, 2), memory_gb)


BUDGET_LINE = re.compile(r"^#\s+(sync|gen|old_log_prob|ref|update)\s+([\d.]+) = (.*)$")
PEAK_LINE = re.compile(r"^#\s+peak: (\w+) ([\d.]+) of ([\d.]+),")


def comment_budget(path: Path) -> tuple[dict, tuple]:
    """``{phase: (total, {term: GiB})}`` and ``(peak phase, GiB, device GiB)`` from a config's header comment: lines
    ``#   <phase>  <total> = <term> <GiB> + ...``, continued on lines starting with ``+``."""
    raw: dict[str, list] = {}
    peak: tuple = ()
    current = None
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if m := BUDGET_LINE.match(line):
            current = m.group(1)
            raw[current] = [float(m.group(2)), m.group(3)]
        elif current and line[1:].strip().startswith("+ "):
            raw[current][1] += " " + line[1:].strip()
        else:
            current = None
            if m := PEAK_LINE.match(line):
                peak = (m.group(1), float(m.group(2)), float(m.group(3)))
    budget = {}
    for name, (total, text) in raw.items():
        terms = [t.strip().rsplit(" ", 1) for t in text.split(" + ")]
        budget[name] = (total, {term: float(value) for term, value in terms})
    return budget, peak


def test_checkpoint_not_matching_or_not_converted(demo, tmp_path):
    # An HF config that differs from the one the checkpoint was converted from (wider MLP), and a reference
    # checkpoint directory that is an HF model of another architecture.
    hf = dict(demo["hf_config"], intermediate_size=2 * demo["hf_config"]["intermediate_size"])
    (tmp_path / "config.json").write_text(json.dumps(hf))
    overrides = demo_overrides(demo) + [
        f"model.hf_config_dir={tmp_path}",
        "actor.use_kl_loss=true",
        f"checkpoint.ref_load_dir={demo['hf_model']}",
    ]
    report = run_check(TINY, overrides)
    print(report.render())
    ffn = demo["hf_config"]["intermediate_size"]
    assert len(report.problems) == 2, report.problems
    assert report.problems[0].startswith(f"checkpoint.load_dir={demo['mcore']}: the checkpoint's architecture differs")
    assert f"ffn_hidden_size: {ffn} vs {2 * ffn}" in report.problems[0]
    assert report.problems[1].startswith(f"checkpoint.ref_load_dir={demo['hf_model']}: ")
    assert "the checkpoint's architecture differs" in report.problems[1]  # an HF directory is a load_dir too
    # The reference doubles the weights term: fp32 weights of the actor's size.
    assert report.numbers["memory_reference_bytes"] == report.numbers["memory_actor_weights_bytes"]
