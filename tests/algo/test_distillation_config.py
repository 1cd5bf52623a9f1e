"""The ``distillation`` section (``config/schema.py``), its rules (``distill/config_checks.py``, run by the config
gate), the teachers by routing key, bad inputs to the losses, and the teacher-tokenizer refusal
(``distill/tokenizer_match.py``) on two tiny local tokenizers."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.config.load import from_dict, to_dict
from megatron_dapo.config.rules import config_problems
from megatron_dapo.config.schema import (
    ConfigError,
    DistillationConfig,
    DistillationInferenceConfig,
    DistillationLossConfig,
    DistillationTeacherConfig,
    ExperimentConfig,
)
from megatron_dapo.distill.config_checks import distillation_problems, teacher_for, teachers_by_key
from megatron_dapo.distill.losses import DISTILLATION_LOSSES, DistillationInputs, loss_settings
from megatron_dapo.distill.objective import distillation_loss
from megatron_dapo.distill.tokenizer_match import check_same_tokenizer, tokenizer_mismatches
from megatron_dapo.testing.tokenizer import build_tiny_tokenizer

VERL_SECTION = {  # verl 0.9.1's keys (trainer/config/distillation/distillation.yaml), two teachers by data source
    "enabled": True,
    "n_gpus_per_node": 4,
    "nnodes": 1,
    "teacher_key": "data_source",
    "teacher_models": {
        "math_teacher": {"key": "openai/gsm8k", "model_path": "/m/qwen3-8b", "num_replicas": 1,
                         "inference": {"tensor_model_parallel_size": 2}},
        "geo_teacher": {"key": "hiyouga/geometry3k", "model_path": "/m/qwen3-4b", "load_dir": "/ckpt/qwen3-4b",
                        "num_replicas": 2},
    },  # fmt: skip
    "distillation_loss": {"loss_mode": "forward_kl_topk", "topk": 64, "use_task_rewards": False,
                          "loss_max_clamp": 10.0, "log_prob_min_clamp": -10.0, "use_policy_gradient": False},
}  # fmt: skip


def _distill(**loss: object) -> DistillationConfig:
    return DistillationConfig(distillation_loss=DistillationLossConfig(**loss))


def _teacher(key: str | None = None, **kw: object) -> DistillationTeacherConfig:
    return DistillationTeacherConfig(key=key, model_path=kw.pop("model_path", "/m/teacher"), **kw)


def test_verl_section_loads_into_typed_teachers_and_passes_the_rules():
    cfg = from_dict(ExperimentConfig, {"distillation": VERL_SECTION})
    d = cfg.distillation
    assert isinstance(d.teacher_models["math_teacher"], DistillationTeacherConfig)
    assert d.teacher_models["math_teacher"].inference.tensor_model_parallel_size == 2
    assert d.teacher_models["geo_teacher"].load_dir == "/ckpt/qwen3-4b"
    assert d.distillation_loss.topk == 64 and d.distillation_loss.log_prob_min_clamp == -10.0
    assert distillation_problems(d) == []
    assert from_dict(ExperimentConfig, to_dict(cfg)) == cfg  # the saved config reads back (checkpoints, logs)
    assert sorted(teachers_by_key(d)) == ["hiyouga/geometry3k", "openai/gsm8k"]
    assert teacher_for(teachers_by_key(d), "openai/gsm8k", d.teacher_key) == "openai/gsm8k"
    with pytest.raises(ValueError, match=r"data_source='other/set': no teacher for it.*openai/gsm8k"):
        teacher_for(teachers_by_key(d), "other/set", d.teacher_key)


def test_unknown_teacher_key_names_the_dotted_path():
    bad = {"teacher_models": {"t": {"modelpath": "/m"}}}
    with pytest.raises(ConfigError, match=r"distillation\.teacher_models\.t\.modelpath.*did you mean 'model_path'"):
        from_dict(ExperimentConfig, {"distillation": bad})


def test_defaults_are_verls_yaml_and_valid():
    d = DistillationConfig()
    loss = d.distillation_loss
    assert (d.enabled, d.teacher_key, loss.loss_mode, loss.topk, loss.use_policy_gradient) == (
        False, "data_source", "k3", 32, False
    )  # fmt: skip
    assert (loss.loss_max_clamp, loss.log_prob_min_clamp, loss.policy_loss_mode) == (None, None, "vanilla")
    assert distillation_problems(d) == []
    assert not any(p.startswith("distillation") for p in config_problems(ExperimentConfig()))


def test_the_config_gate_reports_distillation_problems():
    cfg = ExperimentConfig(distillation=_distill(loss_mode="k1", use_policy_gradient=False))
    assert any("distillation.distillation_loss.loss_mode='k1'" in p for p in config_problems(cfg))


@pytest.mark.parametrize(
    ("loss", "expected"),
    [
        ({"loss_mode": "k4"}, "distillation.distillation_loss.loss_mode='k4': no such distillation loss; registered:"),
        ({"loss_mode": "kl"}, "loss_mode='kl' with use_policy_gradient=false: expected use_policy_gradient=true"),
        ({"loss_mode": "forward_kl_topk", "topk": None}, "distillation.distillation_loss.topk=None: expected an"),
        ({"loss_mode": "forward_kl_topk", "topk": 0}, "distillation.distillation_loss.topk=0: expected an integer"),
        ({"use_policy_gradient": True, "policy_loss_mode": "gspo"}, "policy_loss_mode='gspo': expected one of vanilla"),
        ({"loss_max_clamp": 0.0}, "distillation.distillation_loss.loss_max_clamp=0.0: expected null or a value > 0"),
        ({"log_prob_min_clamp": 1.0}, "log_prob_min_clamp=1.0: expected null or a log-prob < 0"),
        ({"distillation_loss_coef": float("nan")}, "distillation_loss_coef=nan: expected a finite value >= 0"),
        ({"clip_ratio_low": 1.5}, "distillation.distillation_loss.clip_ratio_low=1.5: expected a value in [0, 1)"),
    ],
)
def test_loss_rules_name_the_key_and_the_allowed_values(loss, expected):
    problems = distillation_problems(_distill(**loss))
    assert len(problems) == 1 and expected in problems[0], problems


def test_unknown_loss_mode_lists_every_registered_name():
    (problem,) = distillation_problems(_distill(loss_mode="reverse_kl"))
    for name in ("abs", "forward_kl_topk", "k1", "k2", "k3", "kl", "low_var_kl", "mse"):
        assert name in problem
    assert DISTILLATION_LOSSES.names() == ("abs", "forward_kl_topk", "k1", "k2", "k3", "kl", "low_var_kl", "mse")
    assert loss_settings("forward_kl_topk").use_topk and loss_settings("k3").use_estimator


def test_teacher_rules():
    def problems(teachers: dict, **kw: object) -> list[str]:
        return distillation_problems(DistillationConfig(enabled=True, teacher_models=teachers, **kw))

    assert problems({}) == ["distillation.teacher_models: expected at least one teacher with enabled=true, got none"]
    assert problems({"teacher_model": _teacher()}) == []  # one teacher: no key needed, it scores every row
    assert teachers_by_key(DistillationConfig(teacher_models={"teacher_model": _teacher()})).keys() == {"default"}
    (no_path,) = problems({"t": DistillationTeacherConfig()})
    assert no_path.startswith("distillation.teacher_models.t.model_path: expected the teacher's HF directory")
    (no_key,) = problems({"a": _teacher("x"), "b": _teacher()})
    assert no_key.startswith("distillation.teacher_models.b.key: expected the distillation.teacher_key value")
    (dup,) = problems({"a": _teacher("x"), "b": _teacher("x")})
    assert dup == "distillation.teacher_models.b.key='x': already the key of a"
    dropped = problems({"teacher_model": _teacher("x"), "b": _teacher("y")})
    assert dropped and "distillation.teacher_models.teacher_model: with several teachers" in dropped[0]


def test_teacher_pool_rules():
    def pool(teachers: dict, gpus: int) -> list[str]:
        return distillation_problems(
            DistillationConfig(enabled=True, teacher_models=teachers, n_gpus_per_node=gpus, nnodes=1)
        )

    tp2 = DistillationInferenceConfig(tensor_model_parallel_size=2)
    one = {"t": _teacher(inference=tp2)}
    assert pool(one, 4) == []
    (odd,) = pool(one, 3)
    assert "a replica's 2 devices (TP x DP x PP) must divide the teacher pool's 3" in odd
    two = {"a": _teacher("x", inference=tp2, num_replicas=1), "b": _teacher("y", num_replicas=1)}
    (sum_bad,) = pool(two, 4)
    assert "sum to 3 devices, expected the teacher pool's 4" in sum_bad
    assert pool(two, 3) == []
    bad_tp = {"t": _teacher(inference=DistillationInferenceConfig(tensor_model_parallel_size=0))}
    (tp0,) = distillation_problems(DistillationConfig(enabled=True, teacher_models=bad_tp))
    assert tp0 == "distillation.teacher_models.t.inference.tensor_model_parallel_size=0: expected an integer >= 1"


# --------------------------------------------------------------------------------------------------- bad inputs
def _inputs(**kw: object) -> DistillationInputs:
    mask = torch.ones(2, 3)
    base = {"response_mask": mask, "cfg": DistillationLossConfig(), "student_log_probs": -torch.rand(2, 3),
            "teacher_log_probs": -torch.rand(2, 3)}  # fmt: skip
    return DistillationInputs(**{**base, **kw})


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="distillation loss 'k3' needs teacher_log_probs, got None"):
        distillation_loss(_inputs(teacher_log_probs=None), "token-mean")
    with pytest.raises(ValueError, match=r"teacher_log_probs: expected a 2-dim tensor .* \(2, 3\), got \(2, 4\)"):
        distillation_loss(_inputs(teacher_log_probs=torch.zeros(2, 4)), "token-mean")
    topk = DistillationLossConfig(loss_mode="forward_kl_topk", topk=2)
    ids = torch.tensor([[[0, 7]] * 3] * 2)
    with pytest.raises(ValueError, match=r"teacher_topk_ids: expected ids in \[0, 5\) .* got \[0, 7\]"):
        distillation_loss(
            _inputs(cfg=topk, student_logits=torch.zeros(2, 3, 5), teacher_topk_log_probs=-torch.ones(2, 3, 2),
                    teacher_topk_ids=ids),
            "token-mean",
        )  # fmt: skip
    with pytest.raises(ValueError, match="use_policy_gradient needs student_log_probs and old_log_probs"):
        distillation_loss(_inputs(cfg=DistillationLossConfig(loss_mode="k1", use_policy_gradient=True)), "token-mean")


def test_fully_masked_micro_batch_gives_zero_loss_and_metrics():
    loss, metrics = distillation_loss(_inputs(response_mask=torch.zeros(2, 3)), "token-mean")
    assert float(loss) == 0.0 and all(float(v) == 0.0 for v in metrics.values())


# --------------------------------------------------------------------------------------------------- tokenizers
def test_same_tokenizer_passes(tmp_path):
    a = build_tiny_tokenizer(tmp_path / "a")
    b = build_tiny_tokenizer(tmp_path / "b")
    assert tokenizer_mismatches(a, b, "student", "teacher") == []
    check_same_tokenizer(a, b, "model.tokenizer_dir=a", "distillation.teacher_models.t.model_path=b")


def test_other_vocabulary_size_is_refused_naming_both(tmp_path):
    student = build_tiny_tokenizer(tmp_path / "s")
    teacher = build_tiny_tokenizer(tmp_path / "t", extra_texts=["é"])
    with pytest.raises(ConfigError) as err:
        check_same_tokenizer(student, teacher, "model.tokenizer_dir=/s", "distillation.teacher_models.t=/t")
    text = str(err.value)
    assert "student tokenizer (model.tokenizer_dir=/s) vs teacher tokenizer (distillation.teacher_models.t=/t)" in text
    assert "vocabulary size 104 vs 105" in text


def test_same_size_other_tokens_is_refused(tmp_path):
    student = build_tiny_tokenizer(tmp_path / "s", extra_texts=["é"])
    teacher = build_tiny_tokenizer(tmp_path / "t", extra_texts=["ü"])
    (problem,) = tokenizer_mismatches(student, teacher, "s", "t")
    assert "1 of" in problem and "sampled ids map to other tokens (id 104: 'é' vs 'ü')" in problem


def test_other_special_ids_are_refused(tmp_path):
    student = build_tiny_tokenizer(tmp_path / "s")
    teacher = build_tiny_tokenizer(tmp_path / "t")
    teacher.pad_token = "<unk>"
    problems = tokenizer_mismatches(student, teacher, "s", "t")
    assert problems == [
        "student tokenizer (s) vs teacher tokenizer (t): pad_token_id 0 vs 3",
        "student tokenizer (s) vs teacher tokenizer (t): all_special_ids [0, 1, 2, 3] vs [1, 2, 3]",
    ]
