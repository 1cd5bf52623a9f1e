"""``megatron-dapo check`` (megatron_dapo/check/; its memory model: megatron_dapo/config/memory.py): the tiny demo
passes with the right plan, many problems are listed at once, memory phases over --device-memory-gb are flagged, the
per-phase memory plan matches hand-computed bytes for a small model (offload, vLLM sleep level, recompute, pipeline
stages, peak phase; the startup row and vLLM's start-up rule, the save row), --json writes the plan (to stdout with
-), overrides may follow the options, and the shipped large configs get a plan from locally written HF config.json
files of the real model shapes (no weights) that agrees with the budget in their header comments."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron_dapo.check import main, run_check
from megatron_dapo.config.memory import (
    actor_stage_params,
    layer_activations,
    moe_activations,
    param_counts,
    rollout_params_per_rank,
)
from megatron_dapo.data.rows import read_records
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.tasks.arithmetic import DATA_SOURCE
from tests.helpers.hf_configs import QWEN3_8B, QWEN3_30B_A3B, QWEN3_32B, QWEN25_32B, SMALL_QWEN2

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny_cpu.yaml")


@pytest.fixture(scope="module")
def demo(demo_small) -> dict:
    """tests/conftest.py's demo of 64 training rows (``prepare(root, seed=0, train_rows=64)``, converted)."""
    return {**demo_small, "hf_config": json.loads((Path(demo_small["hf_model"]) / "config.json").read_text())}


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


TOOL_CLASSES = """
class Box:
    def __init__(self, config, tool_schema):
        self.boxes = {}
    def create(self, instance_id, boxes=None):
        if boxes is None:
            raise ValueError("no boxes given")
        self.boxes[instance_id] = boxes
    def execute(self, instance_id, arguments):
        return str(self.boxes[instance_id][arguments["box"]])
    def release(self, instance_id):
        self.boxes.pop(instance_id)
"""


def tool_yaml(tmp_path: Path, class_names: list[str]) -> Path:
    (tmp_path / "check_tools.py").write_text(TOOL_CLASSES)
    entries = "".join(
        f"  - class_name: {name}\n    tool_schema: {{type: function, function: {{name: t{i}, parameters: {{}}}}}}\n"
        for i, name in enumerate(class_names)
    )
    (tmp_path / "tools.yaml").write_text("tools:\n" + entries)
    return tmp_path / "tools.yaml"


def rows_with_tools_kwargs(demo: dict, tmp_path: Path, tools_kwargs: dict) -> str:
    rows = read_records(demo["val"])
    for row in rows:
        row["extra_info"] = {**(row.get("extra_info") or {}), "tools_kwargs": tools_kwargs}
    path = tmp_path / "val_tools.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_tools_are_built_created_and_released_once(demo, tmp_path):
    tools = tool_yaml(tmp_path, [f"{tmp_path / 'check_tools.py'}:Box"])
    val = rows_with_tools_kwargs(demo, tmp_path, {"t0": {"create_kwargs": {"boxes": {"a": 3}}}})
    multi_turn = ["rollout.multi_turn.enable=true", f"rollout.multi_turn.tool_config_path={tools}"]
    report = run_check(TINY, demo_overrides(demo, train=val, val=val) + multi_turn)
    assert report.problems == [], report.problems
    assert f"  rollout.multi_turn.tool_config_path: {tools}: t0 (built, create/release ok)" in report.render()

    # The same tool without create_kwargs (the demo's rows have none): its create raises.
    report = run_check(TINY, demo_overrides(demo) + multi_turn)
    assert len(report.problems) == 1, report.problems
    assert report.problems[0].startswith(f"rollout.multi_turn.tool_config_path={tools}: create failed: ")
    assert "ValueError: no boxes given" in report.problems[0]


def test_tool_import_errors_and_unknown_tools_kwargs_are_problems(demo, tmp_path):
    tools = tool_yaml(tmp_path, [f"{tmp_path / 'check_tools.py'}:Box", "no_such_pkg_xyz.Tool"])
    val = rows_with_tools_kwargs(demo, tmp_path, {"ghost": {"create_kwargs": {}}})
    multi_turn = ["rollout.multi_turn.enable=true", f"rollout.multi_turn.tool_config_path={tools}"]
    report = run_check(TINY, demo_overrides(demo, train=val, val=val) + multi_turn)
    unknown = [p for p in report.problems if "extra_info.tools_kwargs names ['ghost']" in p]
    assert len(unknown) == 1 and f"which {tools} does not define (tools: ['t0', 't1'])" in unknown[0]
    built = [p for p in report.problems if p.startswith(f"rollout.multi_turn.tool_config_path={tools}: ")]
    assert len(built) == 1 and "no_such_pkg_xyz.Tool" in built[0] and "ModuleNotFoundError" in built[0], built


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


# A small Qwen2-architecture model whose memory terms are worked out by hand below (no helper of the memory model
# is used).
SMALL = SMALL_QWEN2
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


def small_overrides(tmp_path) -> list[str]:
    """The overrides that make ``configs/tiny_cpu.yaml`` the ``SMALL`` model's CUDA plan (writes its config.json)."""
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    return [
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


def small_plan(tmp_path, *overrides: str, memory_gb: float = 1.0, nproc: int = 8):
    base = small_overrides(tmp_path)
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


# ------------------------------------------------------------------------------------------ startup and save rows


def test_startup_row_by_hand(tmp_path):
    # CUDA defaults: grads freed and optimizer offloaded right after the actor is built, then vLLM is built with only
    # the actor's weights resident; its share is gpu_memory_utilization 0.5 x 1 GiB (weights + KV cache).
    report = small_plan(tmp_path, "actor.use_kl_loss=true")
    startup = phase(report, "startup")
    assert report.phases[0] is startup and report.phases[-1].name == "save"
    assert startup.device == {
        "actor weights": 2 * SMALL_P_RANK,  # 5.01 MiB
        "vLLM weights": SMALL_VLLM,
        "vLLM KV cache": 2**29 - SMALL_VLLM,
    }
    assert startup.device_total == 2 * SMALL_P_RANK + 2**29  # 517.01 MiB
    # The reference (KL term on) is built after the engine: neither on the device nor on the host yet.
    assert startup.host == {"optimizer": SMALL_OPTIM}
    # vLLM's start-up rule: 1024 - 5.01 = 1018.99 MiB free >= 0.5 x 1 GiB = 512 MiB.
    n = report.numbers
    assert n["memory_startup_resident_bytes"] == 2 * SMALL_P_RANK
    assert n["memory_startup_free_bytes"] == 2**30 - 2 * SMALL_P_RANK
    assert n["memory_startup_asked_bytes"] == 2**29
    assert startup.fits is True
    assert "vLLM start-up: free 1018.99 MiB >= rollout.gpu_memory_utilization 0.5 x 1 GiB = 512.00 MiB" in startup.note
    # The same device total as generation: the peak stays the step's phase.
    assert startup.device_total == phase(report, "gen").device_total and report.peak_phase == "gen"
    # Nothing offloaded: grads and optimizer are resident when the engine is built too.
    kept = small_plan(tmp_path, "actor.offload_optimizer=false", "actor.offload_grads=false")
    k = phase(kept, "startup")
    assert k.device_total - startup.device_total == SMALL_GRADS + SMALL_OPTIM and k.host == {}
    assert kept.numbers["memory_startup_resident_bytes"] == 2 * SMALL_P_RANK + SMALL_GRADS + SMALL_OPTIM
    # Params offloaded too (actor.offload_params=true): they leave before the engine is built, as they do while vLLM
    # generates.
    params = phase(small_plan(tmp_path, "actor.offload_params=true"), "startup")
    assert "actor weights" not in params.device and params.host["actor weights"] == 2 * SMALL_P_RANK


def test_startup_that_does_not_fit_is_a_problem(tmp_path):
    # 0.2 GiB = 204.80 MiB device, vLLM asks 0.95 x it = 194.56 MiB. The optimizer kept on the device: resident
    # weights 5.01 + optimizer 7.52 = 12.53 MiB leave 192.27 MiB free, too little (generation, which holds the same
    # and vLLM's share, is over the device too: a warning).
    report = small_plan(tmp_path, "rollout.gpu_memory_utilization=0.95", "actor.offload_optimizer=false", memory_gb=0.2)
    startup = phase(report, "startup")
    resident = 2 * SMALL_P_RANK + SMALL_OPTIM
    assert set(startup.device) == {"actor weights", "optimizer", "vLLM weights", "vLLM KV cache"}
    assert startup.fits is False and report.fits is False
    assert phase(report, "gen").fits is False
    found = [p for p in report.problems if p.startswith("vLLM start-up")]
    assert len(found) == 1, report.problems
    mib = 2**20
    for text in (
        "free device memory when the engine is built must be >= rollout.gpu_memory_utilization x capacity",
        f"{resident / mib:.2f} MiB per rank resident (actor weights 5.01 MiB + optimizer 7.52 MiB)",
        f"leaves {(0.2 * 2**30 - resident) / mib:.2f} MiB of --device-memory-gb 0.2 free",  # 192.27 MiB
        "0.95 x 0.2 GiB = 194.56 MiB vLLM asks for",
        "lower rollout.gpu_memory_utilization to at most 0.93",
        "actor.offload_optimizer=true",
        "more ranks",
    ):
        assert text in found[0], (text, found[0])
    assert "actor.offload_grads=true" not in found[0]  # already offloaded
    # A problem, not a warning; the row is marked.
    assert not any("'startup'" in w for w in report.warnings)
    line = next(x for x in report.plan.splitlines() if x.strip().startswith("startup "))
    assert "OVER --device-memory-gb 0.2" in line and "vLLM would refuse to start" in line
    # Offloading the optimizer before the engine is built (the CUDA default) fixes it.
    fixed = small_plan(tmp_path, "rollout.gpu_memory_utilization=0.95", memory_gb=0.2)
    assert phase(fixed, "startup").fits and not any(p.startswith("vLLM start-up") for p in fixed.problems)


def test_startup_on_cpu_has_no_vllm_rule(demo):
    report = run_check(TINY, demo_overrides(demo))
    startup = phase(report, "startup")
    assert startup.fits is None and report.fits is None
    assert "vLLM start-up" not in startup.note and "memory_startup_free_bytes" not in report.numbers
    n = report.numbers
    assert startup.device == {
        "actor weights": n["memory_actor_weights_bytes"],
        "grads": n["memory_grads_bytes"],
        "optimizer": n["memory_optimizer_bytes"],
        "vLLM weights": n["memory_vllm_weights_bytes"],
        "vLLM KV cache": n["memory_kv_cache_bytes"],
    }


def test_save_row_vllm_terms_follow_the_sleep(tmp_path):
    # vLLM sleeps at level 2 before the save: only the actor's params, grads and optimizer state on the device; the
    # offloaded reference stays in pinned host memory.
    two = small_plan(tmp_path, "actor.use_kl_loss=true")
    save = phase(two, "save")
    assert save.device == {"actor weights": 2 * SMALL_P_RANK, "grads": SMALL_GRADS, "optimizer": SMALL_OPTIM}
    assert save.host == {"reference": 2 * SMALL_P_RANK}
    assert save.runs and save.fits is True and "vLLM asleep first (level 2" in save.note
    # The reference kept on the device (ref.offload=false) counts there.
    assert phase(small_plan(tmp_path, "actor.use_kl_loss=true", "ref.offload=false"), "save").device["reference"] == (
        2 * SMALL_P_RANK
    )
    # Level 1: vLLM's weights in pinned host memory, nothing of it on the device.
    one = phase(small_plan(tmp_path, "rollout.sleep_level=1"), "save")
    assert not any(k.startswith("vLLM") for k in one.device) and one.host == {"vLLM weights": SMALL_VLLM}
    # vLLM never sleeps (rollout.free_cache_engine=false): its weights and KV cache stay on the device.
    awake = small_plan(tmp_path, "actor.use_kl_loss=true", "rollout.free_cache_engine=false")
    a = phase(awake, "save")
    assert a.device["vLLM weights"] == SMALL_VLLM and a.device["vLLM KV cache"] == 2**29 - SMALL_VLLM
    assert a.device_total - save.device_total == 2**29
    assert "vLLM never sleeps" in a.note


def small_argv(tmp_path, *extra: str) -> list[str]:
    """The ``small_plan`` check as a command line: config, overrides, then ``extra``."""
    return [TINY, *small_overrides(tmp_path), *extra]


def test_json_to_stdout(tmp_path, capsys):
    rc = main(small_argv(tmp_path, "--nproc-per-node", "8", "--device-memory-gb", "1", "--json", "-"))
    out, err = capsys.readouterr()
    assert rc == 1  # the data file and checkpoint do not exist: problems, JSON all the same
    data = json.loads(out)  # stdout is only the JSON; the text report went to stderr
    assert "FAILED:" in err and "per phase, per rank" in err
    assert data["capacity_gib"] == 1.0 and data["world_size"] == 8 and data["ok"] is False
    assert list(data["phases"]) == ["startup", "sync", "gen", "old_log_prob", "ref", "update", "save"]
    for name in ("startup", "save"):
        ph = data["phases"][name]
        assert ph["fits"] is True and ph["runs"] is True
        assert ph["device_gib"] == pytest.approx(sum(ph["terms"].values()))
    assert data["phases"]["save"]["terms"] == pytest.approx(
        {"actor weights": 2 * SMALL_P_RANK / 2**30, "grads": SMALL_GRADS / 2**30, "optimizer": SMALL_OPTIM / 2**30}
    )
    assert data["peak_phase"] == "gen" and data["fits"] is True
    assert any("/no_data.jsonl" in p for p in data["problems"]) and data["warnings"] == []
    assert data["numbers"]["memory_startup_asked_bytes"] == 2**29


def test_json_to_a_file_and_without_a_plan(tmp_path, capsys):
    path = tmp_path / "plan.json"
    rc = main(small_argv(tmp_path, "--nproc-per-node", "8", "--json", str(path)))
    out = capsys.readouterr().out
    assert rc == 1 and "per phase, per rank" in out  # the text report on stdout
    data = json.loads(path.read_text())
    assert data["capacity_gib"] is None and data["fits"] is None
    assert data["phases"]["startup"]["fits"] is None and data["phases"]["save"]["fits"] is None
    # No plan (TP 3 on 8 ranks): still a JSON document, with the problems.
    rc = main(small_argv(tmp_path, "parallel.tensor_model_parallel_size=3", "--nproc-per-node", "8", "--json", "-"))
    data = json.loads(capsys.readouterr().out)
    assert rc == 1 and data["phases"] == {} and data["peak_phase"] is None and data["fits"] is None
    assert any("tensor_model_parallel_size=3" in p for p in data["problems"])


def test_overrides_after_the_options(tmp_path, capsys):
    # As README writes it: CONFIG --nnodes N --nproc-per-node P --device-memory-gb G [overrides...].
    argv = small_argv(tmp_path)
    config, overrides = argv[0], argv[1:]
    options = ["--nnodes", "1", "--nproc-per-node", "8", "--device-memory-gb", "1", "--json", "-"]
    documents = []
    for order in (
        [config, *options, *overrides],
        [config, *overrides, *options],
        [config, *overrides[:3], *options, *overrides[3:]],
    ):
        assert main(order) == 1
        documents.append(json.loads(capsys.readouterr().out))
    assert documents[0] == documents[1] == documents[2]
    assert documents[0]["world_size"] == 8 and documents[0]["overrides"] == overrides
    # Through the megatron-dapo command line as well.
    from megatron_dapo.cli import main as cli_main

    assert cli_main(["check", config, *options, *overrides]) == 1
    assert json.loads(capsys.readouterr().out) == documents[0]


@pytest.mark.parametrize(
    "config, hf_config, nnodes, nproc, memory_gb, params",
    [
        ("dapo_qwen2.5_32b.yaml", QWEN25_32B, 16, 8, 80, 32.8e9),
        ("dapo_qwen3_32b_ascend.yaml", QWEN3_32B, 16, 16, 64, 32.8e9),  # Atlas 800T A2: 64 GB per NPU
        ("grpo_qwen3_8b.yaml", QWEN3_8B, 1, 8, 80, 8.19e9),
        ("dapo_qwen3_30b_a3b.yaml", QWEN3_30B_A3B, 4, 8, 80, 30.5e9),  # MoE: EP 8, TP 2
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

    # vLLM's start-up rule holds: only the actor's weights are resident when the engine is built.
    startup = phase(report, "startup")
    assert startup.fits and set(startup.device) == {"actor weights", "vLLM weights", "vLLM KV cache"}
    assert report.fits

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


BUDGET_LINE = re.compile(r"^#\s+(startup|sync|gen|old_log_prob|ref|update|save)\s+([\d.]+) = (.*)$")
# Shipped configs whose header comment does not show the startup and save rows yet (the step's phases only).
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


# ------------------------------------------------------------------------------------------------ MoE models

# A small Qwen3-MoE model: 4 layers, MoE on layers 1 and 3 (decoder_sparse_step 2), the others dense; 4 experts of
# FFN 64, top-2; q/k norms, no qkv bias. Its counts are worked out by hand below.
TINY_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
# By hand (h 64, q = 4 x 16 = 64, kv = 2 x 16 = 32):
#   attention: qkv 64 x (64 + 2 x 32) = 8192 + o 64 x 64 = 4096 -> 12288 (÷ TP); norms 2 x 64 + q/k norms 2 x 16 = 160.
#   dense layer (0, 2): 12288 + MLP 3 x 64 x 128 = 24576 -> 36864 split + 160 = 37024.
#   MoE layer (1, 3): 12288 split + norms 160 + router 4 x 64 = 256 (replicated) + experts 4 x 3 x 64 x 64 = 49152
#   (÷ EP x ETP) = 61856; one token goes through 2 of the 4 experts: 2 x 12288 = 24576 active expert parameters.
#   embedding + output layer 2 x 1000 x 64 = 128000, final norm 64.
TINY_MOE_TOTAL = 128000 + 2 * 37024 + 2 * 61856 + 64  # 325824 (the HF model's numel, checked below)
TINY_MOE_EXPERTS = 2 * 49152  # 98304
TINY_MOE_ACTIVE = TINY_MOE_TOTAL - 2 * (49152 - 24576)  # 276672
# Per rank, TP 1, EP 2, ETP 1, PP 1, vocabulary padded to 1024 (128 x TP 1):
#   non-expert 2 x 37024 + 2 x (12288 + 160 + 256) + 2 x 1024 x 64 + 64 = 230592; experts 2 layers x 49152 / 2 = 49152.
TINY_MOE_DENSE_RANK = 230592
TINY_MOE_EXPERT_RANK = 49152


def test_moe_param_counts_by_hand():
    arch = model_arch_from_hf(TINY_MOE)
    counts = param_counts(arch)
    assert (counts.moe_layers, counts.dense_layers) == (2, 2)
    assert counts.layer_split == 36864 and counts.layer_replicated == 160
    assert (counts.moe_layer_split, counts.moe_layer_replicated) == (12288, 160 + 256)
    assert (counts.expert_layer, counts.expert_active_layer) == (49152, 24576)
    assert counts.total == TINY_MOE_TOTAL == 325824
    assert counts.experts == TINY_MOE_EXPERTS
    assert counts.non_expert == TINY_MOE_TOTAL - TINY_MOE_EXPERTS == 227520
    assert counts.active == TINY_MOE_ACTIVE == 276672
    # Per rank: the non-expert part ÷ TP, the routed experts ÷ EP x ETP (ETP defaults to TP).
    assert actor_stage_params(arch, counts, 1, 1, 1024, ep=2, etp=1) == (TINY_MOE_DENSE_RANK, TINY_MOE_EXPERT_RANK)
    # TP 2 (vocabulary padded to 1024 = 4 x 256): 2 x (36864 / 2 + 160) + 2 x (12288 / 2 + 416) + 2 x 1024 x 64 / 2
    # + 64 = 115904; experts / (EP 2 x ETP 1) = 49152, / (EP 2 x ETP 2, the default) = 24576.
    assert actor_stage_params(arch, counts, 2, 1, 1024, ep=2, etp=1) == (115904, 49152)
    assert actor_stage_params(arch, counts, 2, 1, 1024, ep=2) == (115904, 24576)
    # PP 2: stage 0 holds layers 0 (dense) and 1 (MoE) and the embedding, stage 1 layers 2 and 3 and the output layer.
    assert actor_stage_params(arch, counts, 1, 2, 1024, ep=2, etp=1, stage=0) == (37024 + 12704 + 65536, 24576)
    assert actor_stage_params(arch, counts, 1, 2, 1024, ep=2, etp=1, stage=1) == (37024 + 12704 + 64 + 65536, 24576)
    # vLLM holds every expert (no vLLM expert parallelism), split over rollout TP; the router replicated:
    # (128000 + 2 x 36864 + 2 x (12288 + 49152)) / 2 + 2 x 160 + 2 x 416 + 64 = 163520.
    assert rollout_params_per_rank(counts, 2) == 163520
    assert rollout_params_per_rank(counts, 1) == TINY_MOE_TOTAL


def test_moe_param_counts_match_the_hf_models():
    # The HF models' own parameter counts (transformers builds them from the same configs): Qwen3-MoE with dense and
    # MoE layers, and Qwen2-MoE with a shared expert (its fc1/fc2 ÷ TP, its sigmoid gate h replicated) and a dense
    # layer from mlp_only_layers.
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    qwen2_moe = dict(
        TINY_MOE,
        architectures=["Qwen2MoeForCausalLM"],
        model_type="qwen2_moe",
        shared_expert_intermediate_size=96,
        decoder_sparse_step=1,
        mlp_only_layers=[3],
        use_sliding_window=False,
    )
    del qwen2_moe["head_dim"]
    for hf, cls in ((TINY_MOE, "Qwen3MoeForCausalLM"), (qwen2_moe, "Qwen2MoeForCausalLM")):
        config_cls = getattr(transformers, cls.replace("ForCausalLM", "Config"))
        config = config_cls(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
        torch.manual_seed(0)
        model = getattr(transformers, cls)(config)
        counts = param_counts(model_arch_from_hf(hf))
        assert counts.total == sum(p.numel() for p in model.parameters()), cls
    shared = param_counts(model_arch_from_hf(qwen2_moe))
    # 3 MoE layers: attention 12288 + qkv bias 128 + shared expert 3 x 64 x 96 = 18432 split; norms 128 (no q/k norm)
    # + router 256 + shared gate 64 replicated.
    assert (shared.moe_layers, shared.moe_layer_split, shared.moe_layer_replicated) == (3, 12416 + 18432, 128 + 320)


def test_moe_activations_by_hand():
    arch = model_arch_from_hf(TINY_MOE)
    # Per token, bf16, TP 1: router scores 4 experts x 4 B + top-2 x (ETP 1 x h 64 + 4 x f_e 64) x 2 B = 16 + 1280.
    assert moe_activations(arch, 2, 1, False, etp=1) == 1296
    # TP 2 with SP and ETP 2: the rank routes T / 2 tokens; each copy is all-gathered over ETP:
    # (16 + 2 x (2 x 64 + 4 x 64) x 2) / 2 = 776.
    assert moe_activations(arch, 2, 2, True, etp=2) == (16 + 2 * (2 * 64 + 4 * 64) * 2) / 2 == 776
    # The MoE layer (no shared expert) keeps the attention part of a dense layer, not its MLP: QKV output 128 + rotated
    # Q and K 96 + QK-norm input 64 + attention output 64 = 352 x 2 B, norms 4 x 64 x 2 B, flash softmax stats 4 x 4 B.
    moe = layer_activations(arch, 2, 1, False, True, 1024, moe=True, etp=1)
    assert (moe.split, moe.replicated, moe.core, moe.moe, moe.total) == (704, 512, 16, 1296, 2528)
    dense = layer_activations(arch, 2, 1, False, True, 1024)
    assert dense.total == (352 + 3 * 128) * 2 + 512 + 16 == 2000


def moe_plan(tmp_path, *overrides: str, nproc: int = 2, hf: dict = TINY_MOE):
    (tmp_path / "config.json").write_text(json.dumps(hf))
    base = [
        f"model.hf_config_dir={tmp_path}",
        "model.params_dtype=bf16",
        "model.make_vocab_size_divisible_by=128",
        "parallel.platform=cuda",
        "parallel.expert_model_parallel_size=2",
        "parallel.expert_tensor_parallel_size=1",
        "parallel.use_distributed_optimizer=true",
        "rollout.tensor_model_parallel_size=2",
        "rollout.gpu_memory_utilization=0.5",
        "data.max_prompt_length=512",
        "data.max_response_length=512",
        f"data.train_files=[{tmp_path}/no_data.jsonl]",
        "data.val_files=[]",
        f"checkpoint.load_dir={tmp_path}/no_ckpt",
        "actor.ppo_micro_batch_size_per_gpu=2",
        "actor.log_prob_micro_batch_size_per_gpu=2",
    ]
    report = run_check(TINY, base + list(overrides), nnodes=1, nproc_per_node=nproc, device_memory_gb=1.0)
    print(report.render())
    return report


def test_moe_plan_per_rank_by_hand(tmp_path):
    # 2 ranks: TP 1 -> DP 2; EP 2 x ETP 1 -> expert DP 2 / (1 x 2 x 1) = 1: each rank holds 2 of the 4 experts.
    report = moe_plan(tmp_path, "actor.recompute=none")
    assert report.phases, report.problems
    n = report.numbers
    assert (n["params"], n["params_experts"], n["params_active"]) == (TINY_MOE_TOTAL, TINY_MOE_EXPERTS, TINY_MOE_ACTIVE)
    assert (n["ep"], n["etp"], n["dp"], n["expert_dp"]) == (2, 1, 2, 1)
    assert n["actor_params_per_rank"] == TINY_MOE_DENSE_RANK + TINY_MOE_EXPERT_RANK == 279744
    assert n["actor_expert_params_per_rank"] == TINY_MOE_EXPERT_RANK
    assert n["memory_actor_weights_bytes"] == 2 * 279744
    assert n["memory_grads_bytes"] == 4 * 279744  # expert grads too: fp32, in the expert-parallel DDP buffers
    # Distributed optimizer, 12 B per parameter: non-expert state ÷ DP 2, expert state ÷ expert DP 1.
    assert n["memory_optimizer_bytes"] == TINY_MOE_DENSE_RANK * 12 / 2 + TINY_MOE_EXPERT_RANK * 12 / 1 == 1973376
    assert n["memory_vllm_weights_bytes"] == 2 * 163520
    # Activations (recompute none, 2048 tokens, flash attention, PP 1): 2 dense layers x 2000 B + 2 MoE layers x 2528 B
    # per token.
    assert n["micro_batch_tokens"] == 2048
    assert n["memory_activations_bytes"] == 2048 * (2 * 2000 + 2 * 2528)
    # Full recompute: 4 layer inputs (2048 x 64 x 2 B) + one layer recomputed, the larger kind: the MoE layer.
    full = moe_plan(tmp_path, "actor.recompute=full").numbers
    assert full["memory_activations_bytes"] == 4 * 2048 * 128 + 2048 * 2528
    # The log-prob forward's one layer is the MoE layer too.
    assert full["memory_log_prob_activations_bytes"] == 2048 * 2528
    text = report.plan
    assert "active per token 276,672" in text and "EP 2 x ETP 1 (2 experts per rank" in text
    assert "routed experts 49,152 / (EP 2 x ETP 1)" in text
    assert "every replica holds all experts" in text
    # EP changes only the expert part: EP 1 holds all 4 experts (and expert DP = DP = 2).
    ep1 = moe_plan(tmp_path, "actor.recompute=none", "parallel.expert_model_parallel_size=1").numbers
    assert ep1["actor_params_per_rank"] == TINY_MOE_DENSE_RANK + 2 * TINY_MOE_EXPERT_RANK
    assert ep1["memory_optimizer_bytes"] == (TINY_MOE_DENSE_RANK + 2 * TINY_MOE_EXPERT_RANK) * 12 / 2


def test_moe_bad_expert_layout_is_reported(tmp_path):
    # 4 experts over EP 3 on 3 ranks: no even split of the experts; the plan is not computed.
    report = moe_plan(tmp_path, "parallel.expert_model_parallel_size=3", nproc=3, hf=TINY_MOE)
    expected = "parallel.expert_model_parallel_size=3 does not divide the model's num_experts=4; use a divisor of 4"
    assert any(p.startswith(expected) for p in report.problems), report.problems
    assert "plan: not computed" in report.plan and not report.phases


def test_qwen3_30b_a3b_published_sizes():
    # Qwen3-30B-A3B's model card: 30.5B parameters, 3.3B activated.
    counts = param_counts(model_arch_from_hf(QWEN3_30B_A3B))
    assert counts.total == pytest.approx(30.5e9, rel=0.02)
    assert counts.active == pytest.approx(3.3e9, rel=0.03)
    # 48 layers x 128 experts x 3 x 2048 x 768 routed-expert parameters; the rest is embeddings and attention.
    assert counts.experts == 48 * 128 * 3 * 2048 * 768
    assert counts.total == 30_532_122_624 and counts.active == 3_353_032_704
