"""Every value is range-checked by the run's gate (``config/plan.resolve``), before any process group, model or engine
exists, and settings that cannot work together are rejected with a message that says how to fix them; reading the
config (``load_config``) only parses it."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dapo.config import ConfigError, ExperimentConfig, config_problems, load_config, required_input_problems
from megatron_dapo.config.plan import RunPlan, resolve
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.platform import make_platform
from tests.config.test_run_validation import TINY_HF

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny_cpu.yaml"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # tiny_cpu.yaml names its reward function relative to the repository root


def gate(cfg: ExperimentConfig) -> RunPlan:
    """train's gate for the tiny model on 2 CPU ranks."""
    return resolve(cfg, model_arch_from_hf(TINY_HF), 2, make_platform("cpu"), probe_imports=False)


def load_and_gate(path: Path, overrides: list[str]) -> RunPlan:
    return gate(load_config(path, overrides))


@pytest.mark.parametrize(
    "override, expected",
    [
        ("actor.clip_ratio_low=1.5", "actor.clip_ratio_low=1.5: expected a value in [0, 1)"),
        ("actor.clip_ratio_low=-0.1", "actor.clip_ratio_low=-0.1"),
        ("actor.ppo_mini_batch_size=-4", "actor.ppo_mini_batch_size=-4: expected an integer >= 1"),
        ("rollout.n=0", "rollout.n=0: expected an integer >= 1"),
        ("actor.clip_ratio_c=0.5", "actor.clip_ratio_c=0.5: expected a value > 1"),
        ("actor.optim.lr=0", "actor.optim.lr=0.0: expected a finite value > 0"),
        ("actor.optim.lr=.inf", "actor.optim.lr=inf"),
        ("rollout.top_p=0", "rollout.top_p=0.0: expected a value in (0, 1]"),
        ("rollout.temperature=-1", "rollout.temperature=-1.0"),
        ("reward.timeout_s=0", "reward.timeout_s=0.0: expected a value > 0"),
        ("reward.error_score=.nan", "reward.error_score=nan: expected a finite number"),
        ("trainer.collective_timeout_s=0", "trainer.collective_timeout_s=0.0"),
        ("trainer.max_consecutive_skipped_updates=0", "trainer.max_consecutive_skipped_updates=0"),
        ("algorithm.filter_groups.max_num_gen_batches=-1", "algorithm.filter_groups.max_num_gen_batches=-1"),
        ("checkpoint.save_freq=0", "checkpoint.save_freq=0: expected -1"),
        ("data.train_batch_size=0", "data.train_batch_size=0"),
        ("rollout.val_kwargs.n=0", "rollout.val_kwargs.n=0"),
        ("model.hidden_dropout=1.0", "model.hidden_dropout=1.0: expected a value in [0, 1)"),
        ("rollout.multi_turn.max_assistant_turns=0", "rollout.multi_turn.max_assistant_turns=0: expected an integer"),
        ("rollout.multi_turn.tool_timeout_s=0", "rollout.multi_turn.tool_timeout_s=0.0: expected a value > 0"),
        (
            "rollout.multi_turn.tool_abandon_after_s=30",
            "rollout.multi_turn.tool_abandon_after_s=30.0: expected null or a value > 0 and below tool_timeout_s",
        ),
        ("rollout.multi_turn.enable=true", "rollout.multi_turn.enable=true needs rollout.multi_turn.tool_config_path"),
    ],
)
def test_out_of_range_values_are_rejected_naming_key_and_range(override, expected):
    with pytest.raises(ConfigError) as err:
        load_and_gate(CONFIG, [override])
    assert expected in str(err.value)


def test_all_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_and_gate(CONFIG, ["actor.clip_ratio_low=1.5", "actor.ppo_mini_batch_size=-4", "rollout.n=0"])
    assert str(err.value).startswith("3 config problems:")
    assert len(err.value.problems) == 3
    assert {p.split("=")[0] for p in err.value.problems} == {
        "actor.clip_ratio_low",
        "actor.ppo_mini_batch_size",
        "rollout.n",
    }


def test_multi_turn_needs_its_tools_and_combines_with_partial_rollout_and_async():
    on = ["rollout.multi_turn.enable=true"]
    with pytest.raises(ConfigError, match="needs rollout.multi_turn.tool_config_path"):
        load_and_gate(CONFIG, on)
    base = on + ["rollout.multi_turn.tool_config_path=tools.yaml"]
    assert load_and_gate(CONFIG, base + ["rollout.partial_rollout.enable=true"]).partial is not None
    async_mode = ["trainer.mode=async", "placement.rollout_ranks=1"]
    assert load_and_gate(CONFIG, base + async_mode).mode == "async"


def test_greedy_rollout_with_dynamic_sampling_names_the_real_cause():
    with pytest.raises(ConfigError) as err:
        load_and_gate(CONFIG, ["rollout.temperature=0"])
    text = str(err.value)
    assert "algorithm.filter_groups.enable=true with rollout.temperature=0" in text
    assert "set rollout.temperature > 0" in text


def test_a_generation_budget_that_can_never_fill_a_batch_is_refused():
    with pytest.raises(ConfigError) as err:  # 2 x 6 prompts < 16, even with every group kept
        load_and_gate(CONFIG, ["algorithm.filter_groups.max_num_gen_batches=2", "data.gen_batch_size=6"])
    assert "max_num_gen_batches=2 generation batches of data.gen_batch_size=6 prompts can never fill" in str(err.value)
    assert load_and_gate(CONFIG, ["algorithm.filter_groups.max_num_gen_batches=2", "data.gen_batch_size=8"])


def test_warmup_not_shorter_than_training_says_how_to_fix():
    with pytest.raises(ConfigError) as err:
        load_and_gate(CONFIG, ["trainer.total_training_steps=10", "actor.optim.lr_warmup_steps=10"])
    text = str(err.value)
    assert "actor.optim.lr_warmup_steps=10" in text and "trainer.total_training_steps=10" in text
    assert "set actor.optim.lr_warmup_steps to at most 9" in text
    # the ratio form is checked the same way
    with pytest.raises(ConfigError, match="gives 10 warm-up steps"):
        load_and_gate(
            CONFIG,
            [
                "trainer.total_training_steps=10",
                "actor.optim.lr_warmup_steps=0",
                "actor.optim.lr_warmup_steps_ratio=1.0",
            ],
        )


def test_overlong_buffer_must_fit_in_the_response_budget():
    with pytest.raises(
        ConfigError, match="reward.overlong_buffer.len=8 must be shorter than data.max_response_length=4"
    ):
        load_and_gate(CONFIG, ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=8"])


def test_shipped_configs_are_valid():
    for path in sorted(CONFIG.parent.glob("*.yaml")):
        cfg = load_config(path)
        assert required_input_problems(cfg.checkpoint, cfg.data) + config_problems(cfg) == [], path


def test_required_run_inputs_are_reported_together():
    cfg = load_config(CONFIG, ["checkpoint.load_dir=null", "data.train_files=[]"])
    with pytest.raises(ConfigError) as err:
        gate(cfg)
    assert "checkpoint.load_dir is required" in str(err.value) and "data.train_files is required" in str(err.value)
