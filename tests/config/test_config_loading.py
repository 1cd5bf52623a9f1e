"""ExperimentConfig: YAML + dotted overrides, typed coercion, helpful errors, parallel-layout validation."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from megatron_dapo.config import (
    ConfigError,
    ExperimentConfig,
    ParallelConfig,
    apply_override,
    from_dict,
    load_config,
    to_dict,
)
from megatron_dapo.config.run_rules import validate_parallel_layout


def write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def config_error(path=None, overrides=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


# ------------------------------------------------------------------------------------------ loading


def test_yaml_then_overrides(tmp_path):
    path = write_yaml(
        tmp_path,
        """
        model:
          params_dtype: bf16
        parallel:
          tensor_model_parallel_size: 2
          sequence_parallel: true
        actor:
          optim:
            lr: 1.0e-5
        data:
          train_files: [a.parquet, b.parquet]
        """,
    )
    cfg = load_config(path, ["parallel.tensor_model_parallel_size=4", "actor.optim.weight_decay=0", "trainer.seed=7"])
    assert isinstance(cfg, ExperimentConfig)
    assert cfg.model.params_dtype == "bf16"
    assert cfg.parallel.tensor_model_parallel_size == 4  # the override wins over the file
    assert cfg.parallel.sequence_parallel is True
    assert cfg.actor.optim.lr == pytest.approx(1e-5)
    # An int given for a float field becomes a float.
    assert cfg.actor.optim.weight_decay == 0.0 and isinstance(cfg.actor.optim.weight_decay, float)
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.trainer.seed == 7
    # Untouched keys keep their defaults.
    assert cfg.parallel.pipeline_model_parallel_size == 1
    assert cfg.actor.optim.adam_beta2 == 0.999


def test_no_file_gives_defaults_and_round_trips():
    cfg = load_config(None, [])
    assert cfg == ExperimentConfig()
    changed = load_config(None, ["rollout.n=4", "algorithm.filter_groups.enable=true"])
    assert from_dict(ExperimentConfig, to_dict(changed)) == changed
    assert to_dict(changed)["algorithm"]["filter_groups"]["enable"] is True


def test_override_values_are_parsed_as_yaml():
    cfg = load_config(
        None,
        [
            "actor.optim.lr=1e-6",  # YAML 1.1 reads this as a string; the float field accepts it
            "trainer.logger=[console, wandb]",
            "rollout.temperature=0.7",
            "trainer.total_training_steps=",  # empty value = null
            "checkpoint.load_dir=/ckpt/with=sign",  # only the first '=' separates key and value
        ],
    )
    assert cfg.actor.optim.lr == 1e-6
    assert cfg.trainer.logger == ["console", "wandb"]
    assert cfg.rollout.temperature == 0.7
    assert cfg.trainer.total_training_steps is None
    assert cfg.checkpoint.load_dir == "/ckpt/with=sign"


def test_empty_yaml_file_is_all_defaults(tmp_path):
    assert load_config(write_yaml(tmp_path, "# nothing\n")) == ExperimentConfig()


def test_missing_file_and_non_mapping_top_level(tmp_path):
    msg = config_error(tmp_path / "nope.yaml")
    assert "nope.yaml" in msg and "does not exist" in msg
    msg = config_error(write_yaml(tmp_path, "- a\n- b\n"))
    assert "exp.yaml" in msg and "mapping" in msg and "list" in msg


# ------------------------------------------------------------------------------------------ unknown keys


def valid_keys_listed(msg: str, section_cls) -> bool:
    """Every key of the section is listed, under its YAML name (``async_`` is written ``async``)."""
    import dataclasses

    from megatron_dapo.config.load import KEY_OF_FIELD

    names = [KEY_OF_FIELD.get(f.name, f.name) for f in dataclasses.fields(section_cls)]
    return all(re.search(rf"\b{name}\b", msg) for name in names)


def test_unknown_key_in_section_names_key_valid_keys_and_nearest():
    msg = config_error(overrides=["parallel.tensor_parallel_size=2"])
    assert "'parallel.tensor_parallel_size'" in msg
    assert "did you mean 'tensor_model_parallel_size'" in msg
    assert "Valid keys in parallel" in msg
    assert valid_keys_listed(msg, ParallelConfig)


def test_unknown_top_level_section_suggests_nearest(tmp_path):
    msg = config_error(write_yaml(tmp_path, "paralel:\n  tensor_model_parallel_size: 2\n"))
    assert "'paralel'" in msg and "did you mean 'parallel'" in msg
    assert valid_keys_listed(msg, ExperimentConfig)


def test_unknown_nested_key_without_close_match():
    from megatron_dapo.config import OptimConfig

    msg = config_error(overrides=["actor.optim.zzzz=1"])
    assert "'actor.optim.zzzz'" in msg
    assert "did you mean" not in msg  # nothing is close: no misleading suggestion
    assert "Valid keys in actor.optim" in msg and valid_keys_listed(msg, OptimConfig)


# ------------------------------------------------------------------------------------------ types


@pytest.mark.parametrize(
    "override,key,expected,got",
    [
        ("parallel.tensor_model_parallel_size=two", "parallel.tensor_model_parallel_size", "expected int", "str 'two'"),
        # bool is an int subclass in Python; the schema does not accept it for an int field.
        ("trainer.total_epochs=true", "trainer.total_epochs", "expected int", "bool True"),
        ("parallel.sequence_parallel=1", "parallel.sequence_parallel", "expected bool", "int 1"),
        ("actor.optim.lr=fast", "actor.optim.lr", "expected float", "str 'fast'"),
        ("data.prompt_key=[a]", "data.prompt_key", "expected str", "list ['a']"),
        ("trainer.total_training_steps=many", "trainer.total_training_steps", "expected int or null", "str 'many'"),
        ("reward.extra_functions=3", "reward.extra_functions", "expected list[dict]", "int 3"),
    ],
)
def test_wrong_type_names_key_expected_type_and_value(override, key, expected, got):
    msg = config_error(overrides=[override])
    assert f"'{key}'" in msg and expected in msg and got in msg, msg


def test_section_given_a_scalar():
    msg = config_error(overrides=["actor=3"])
    assert "actor" in msg and "expected a section (mapping)" in msg and "int 3" in msg


def test_async_section_under_its_yaml_key(tmp_path):
    cfg = load_config(write_yaml(tmp_path, "async:\n  max_staleness: 3\n"), ["async.queue_groups=7"])
    assert (cfg.async_.max_staleness, cfg.async_.queue_groups) == (3, 7)
    assert to_dict(cfg)["async"] == {"max_staleness": 3, "queue_groups": 7} and "async_" not in to_dict(cfg)


def test_list_fields():
    cfg = load_config(None, ["data.train_files=one.parquet"])  # a single path where a list is expected
    assert cfg.data.train_files == ["one.parquet"]
    cfg = load_config(None, ["data.val_files=[x.jsonl, y.jsonl]"])
    assert cfg.data.val_files == ["x.jsonl", "y.jsonl"]
    msg = config_error(overrides=["data.train_files=[a.parquet, 3]"])
    assert "'data.train_files[1]'" in msg and "expected str" in msg and "int 3" in msg
    msg = config_error(overrides=["data.train_files={a: 1}"])
    assert "'data.train_files'" in msg and "expected list[str]" in msg


def test_optional_fields():
    assert load_config(None, ["trainer.total_training_steps=12"]).trainer.total_training_steps == 12
    assert load_config(None, ["trainer.total_training_steps=null"]).trainer.total_training_steps is None
    assert load_config(None, ["algorithm.rollout_is_threshold=2"]).algorithm.rollout_is_threshold == 2.0


def test_literal_fields():
    assert load_config(None, ["actor.loss_agg_mode=seq-mean-token-sum"]).actor.loss_agg_mode == "seq-mean-token-sum"
    msg = config_error(overrides=["model.params_dtype=fp64"])
    assert "'model.params_dtype'" in msg
    assert "one of 'fp32', 'bf16', 'fp16'" in msg and "str 'fp64'" in msg


# ------------------------------------------------------------------------------------------ override syntax


@pytest.mark.parametrize(
    "override,fragment",
    [
        ("parallel.tensor_model_parallel_size", "expected the form section.key=value"),
        ("parallel..sequence_parallel=true", "empty key component"),
        ("=3", "empty key component"),
    ],
)
def test_override_syntax_errors(override, fragment):
    msg = config_error(overrides=[override])
    assert repr(override) in msg and fragment in msg, msg


def test_override_below_a_value_is_rejected(tmp_path):
    path = write_yaml(tmp_path, "data:\n  train_batch_size: 8\n")
    msg = config_error(path, ["data.train_batch_size.x=1"])
    assert "'train_batch_size' is a value, not a section" in msg
    # Without a value in the file the override creates a mapping, which the int field then rejects.
    msg = config_error(overrides=["data.train_batch_size.x=1"])
    assert "'data.train_batch_size'" in msg and "expected int" in msg and "dict" in msg


def test_apply_override_builds_nested_sections():
    raw: dict = {}
    apply_override(raw, "actor.optim.lr=3e-4")
    apply_override(raw, "actor.ppo_epochs=2")
    assert raw == {"actor": {"optim": {"lr": "3e-4"}, "ppo_epochs": 2}}


# ------------------------------------------------------------------------------------------ parallel layout


def layout(tp=1, pp=1, vpp=None, sp=False) -> ParallelConfig:
    return ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=sp,
    )


def layout_error(parallel, world=8, layers=8, heads=8, groups=4) -> str:
    with pytest.raises(ConfigError) as info:
        validate_parallel_layout(parallel, world, layers, heads, groups)
    return str(info.value)


def test_valid_layouts_return_dp_size():
    assert validate_parallel_layout(layout(tp=2, pp=2), 8, 8, 8, 4) == 2
    assert validate_parallel_layout(layout(tp=2, pp=2, vpp=2, sp=True), 4, 8, 8, 2) == 1
    assert validate_parallel_layout(layout(), 3, 8, 8, 4) == 3


def test_world_size_not_divisible_by_tp_pp():
    msg = layout_error(layout(tp=2, pp=2), world=6)
    assert "world size 6" in msg and "2 x 2 = 4" in msg


def test_heads_not_divisible_by_tp():
    msg = layout_error(layout(tp=4), world=4, heads=6, groups=2)
    assert "num_attention_heads=6" in msg and "tensor_model_parallel_size=4" in msg


def test_query_groups_not_divisible_by_tp():
    msg = layout_error(layout(tp=4), world=4, heads=8, groups=2)
    assert "query groups" in msg and "=2" in msg and "tensor_model_parallel_size=4" in msg


def test_layers_not_divisible_by_pp_times_vpp():
    msg = layout_error(layout(pp=4), world=4, layers=6)
    assert "num_hidden_layers=6" in msg and "4 x 1 = 4" in msg
    msg = layout_error(layout(pp=2, vpp=3), world=2, layers=8)
    assert "num_hidden_layers=8" in msg and "2 x 3 = 6" in msg


def test_vpp_needs_pipeline_parallelism():
    msg = layout_error(layout(pp=1, vpp=2), world=1, layers=8)
    assert "virtual_pipeline_model_parallel_size=2" in msg and "pipeline_model_parallel_size >= 2" in msg


def test_sequence_parallel_without_tp():
    msg = layout_error(layout(tp=1, sp=True), world=2)
    assert "sequence_parallel" in msg and "tensor_model_parallel_size > 1" in msg


def test_non_positive_sizes():
    msg = layout_error(layout(tp=0), world=2)
    assert "tensor_model_parallel_size=0" in msg and ">= 1" in msg
