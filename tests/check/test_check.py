"""``megatron-dapo check`` (megatron_dapo/check.py): the tiny demo passes with the right plan, many problems are
listed at once, memory phases over --device-memory-gb are flagged, and the shipped large configs get a plan from
locally written HF config.json files of the real model shapes (no weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_dapo.check import main, run_check
from megatron_dapo.data.rows import read_records
from megatron_dapo.tasks.arithmetic import DATA_SOURCE
from megatron_dapo.tasks.demo import prepare
from megatron_dapo.weights.convert import convert_hf_to_mcore

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
    # The tiny run needs ~0.07 GiB resident (64 MiB of it KV cache) and ~0.10 GiB in the update phase.
    report = run_check(TINY, demo_overrides(demo), device_memory_gb=0.08)
    print(report.render())
    n = report.numbers
    limit = 0.08 * 2**30
    assert n["memory_phase_generation_bytes"] < limit < n["memory_phase_update_bytes"]
    lines = {line.split()[0]: line for line in report.plan.splitlines() if line.startswith("    ") and "GiB  (" in line}
    lines.update({line.split()[0]: line for line in report.plan.splitlines() if "MiB  (" in line})
    assert "OVER --device-memory-gb 0.08" in lines["update"]
    assert "OVER" not in lines["generation"]
    assert any(w.startswith("memory estimate of phase 'update'") for w in report.warnings)
    assert report.ok  # an estimate over the limit warns; it is not a problem


QWEN25_32B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 5120,
    "num_hidden_layers": 64,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "intermediate_size": 27648,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "use_sliding_window": False,
}
QWEN3_32B = {
    **QWEN25_32B,
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "num_attention_heads": 64,
    "head_dim": 128,
    "intermediate_size": 25600,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
}
QWEN3_8B = {
    **QWEN3_32B,
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "intermediate_size": 12288,
}


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
