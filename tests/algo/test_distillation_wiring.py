"""On-policy distillation wired into training: the rows each teacher scores (``distill/teacher.route_rows``), the
actor's extra loss term (``distill/loss_term.DistillationLossTerm``: the loss equals ``distillation_loss`` computed
directly on the same tensors, joined as ``combine_with_task_loss`` says, and stays exact over a micro-batch split),
the metric reduction of the actor's seam (``actor/extra_loss.reduce_term_metrics``, one gloo process) and the gate's
refusals of what the colocated teacher stage cannot honour (``distill/config_checks.distillation_run_problems``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_dapo.actor.extra_loss import EXTRA_LOSS, reduce_term_metrics
from megatron_dapo.algo.loss import LossNormalisers
from megatron_dapo.batch import MicroBatch
from megatron_dapo.config.rules import config_problems
from megatron_dapo.config.schema import (
    DistillationConfig,
    DistillationInferenceConfig,
    DistillationLossConfig,
    DistillationTeacherConfig,
    ExperimentConfig,
)
from megatron_dapo.distill.config_checks import teachers_by_key
from megatron_dapo.distill.loss_term import DistillationLossTerm
from megatron_dapo.distill.losses import DistillationInputs
from megatron_dapo.distill.objective import METRIC_REDUCTIONS, Normalisers, combine_with_task_loss, distillation_loss
from megatron_dapo.distill.teacher import route_rows


def _two_teachers() -> DistillationConfig:
    return DistillationConfig(
        enabled=True,
        teacher_models={
            "math": DistillationTeacherConfig(key="math", model_path="/m/a"),
            "code": DistillationTeacherConfig(key="code", model_path="/m/b"),
        },
    )


def test_rows_go_to_the_teacher_their_data_source_names():
    keys = teachers_by_key(_two_teachers())
    routed = route_rows(keys, ["code", "math", "code", "math", "code"], "data_source", 5)
    assert routed == {"code": [0, 2, 4], "math": [1, 3]}
    with pytest.raises(ValueError, match=r"row data_source='poetry': no teacher for it; .*math.*code|code.*math"):
        route_rows(keys, ["math", "poetry"], "data_source", 2)
    with pytest.raises(ValueError, match="carries none"):
        route_rows(keys, None, "data_source", 2)
    single = DistillationConfig(
        enabled=True, teacher_models={"teacher_model": DistillationTeacherConfig(model_path="/m")}
    )
    # one teacher takes every row, whatever (or whether) the rows carry a key
    assert route_rows(teachers_by_key(single), None, "data_source", 3) == {"default": [0, 1, 2]}


def _micro_batch(seed: int, rows: int = 3, width: int = 5) -> tuple[MicroBatch, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(rows, width, generator=g) > 0.3).double()  # the log-probs' dtype, as in the actor
    mask[0] = 0.0  # a fully masked row (an exhausted step's filler)
    mb = MicroBatch(
        tokens=torch.zeros(rows, width, dtype=torch.long),
        position_ids=torch.zeros(rows, width, dtype=torch.long),
        response_index=torch.zeros(rows, width, dtype=torch.long),
        response_tokens=torch.zeros(rows, width, dtype=torch.long),
        response_mask=mask.bool(),
        loss_mask=mask,
        teacher_log_probs=-torch.rand(rows, width, generator=g, dtype=torch.float64) * 3,
        old_log_probs=-torch.rand(rows, width, generator=g, dtype=torch.float64) * 3,
    )
    student = (-torch.rand(rows, width, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    return mb, student


@pytest.mark.parametrize(
    "loss_cfg",
    [
        DistillationLossConfig(loss_mode="k3", use_task_rewards=False, loss_max_clamp=2.0),
        DistillationLossConfig(loss_mode="k1", use_policy_gradient=True, distillation_loss_coef=0.5),
        DistillationLossConfig(loss_mode="mse", use_task_rewards=True, distillation_loss_coef=2.0),
    ],
    ids=["k3-alone", "k1-pg-with-task", "mse-with-task"],
)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_loss_term_is_distillation_loss_on_the_same_tensors(loss_cfg, agg):
    term = DistillationLossTerm(loss_cfg, agg)
    mb, student = _micro_batch(0)
    task = (student * 0.1).sum()  # a stand-in policy loss with a gradient of its own
    norm = LossNormalisers(token_count=17.0, seq_count=4.0, max_response_length=5)
    loss, metrics = term.combine(task, student, mb, norm)

    inputs = DistillationInputs(
        mb.loss_mask, loss_cfg, student_log_probs=student, teacher_log_probs=mb.teacher_log_probs
    )
    direct, direct_metrics = distillation_loss(inputs, agg, Normalisers(17.0, 4.0, 5), old_log_probs=mb.old_log_probs)
    expected = combine_with_task_loss(task, direct, loss_cfg)
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-12, abs=1e-15)
    assert float(metrics[EXTRA_LOSS]) == pytest.approx(float(direct.detach()), rel=1e-12, abs=1e-15)
    for name, value in direct_metrics.items():
        assert float(metrics[name]) == pytest.approx(float(value), rel=1e-12, abs=1e-15), name
    (grad,) = torch.autograd.grad(loss, student, retain_graph=True)  # the task loss is shared by both graphs
    (expected_grad,) = torch.autograd.grad(expected, student)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-15)
    assert set(term.metric_reductions) == set(direct_metrics)
    assert all(term.metric_reductions[k] == METRIC_REDUCTIONS.get(k, "mean") for k in term.metric_reductions)


def test_loss_term_on_policy_path_reads_its_own_forward_as_the_old_policy():
    cfg = DistillationLossConfig(loss_mode="k1", use_policy_gradient=True, use_task_rewards=False)
    term = DistillationLossTerm(cfg, "token-mean")
    mb, student = _micro_batch(1)
    mb.old_log_probs = None
    loss, metrics = term.combine(torch.tensor(0.0, dtype=torch.float64), student, mb, LossNormalisers(9.0, 3.0, 5))
    # ratio 1 everywhere: the loss is the mean of (s - t) weighted as the negative advantage, nothing clipped
    m = mb.loss_mask
    hand = float(((student.detach() - mb.teacher_log_probs) * m).sum() / 9.0)
    assert float(loss.detach()) == pytest.approx(hand, rel=1e-12)
    assert float(metrics["distillation/pg_clipfrac"]) == 0.0


def test_split_micro_batches_add_up_to_the_whole_batch():
    cfg = DistillationLossConfig(loss_mode="k3", use_task_rewards=False)
    term = DistillationLossTerm(cfg, "seq-mean-token-mean")
    mb, student = _micro_batch(2, rows=4)
    norm = LossNormalisers.of(mb.loss_mask)
    whole = term.combine(torch.tensor(0.0), student, mb, norm)[0].detach()
    parts = 0.0
    for rows in ([0, 1], [2, 3]):
        part = MicroBatch(**{k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in vars(mb).items()})
        parts += float(term.combine(torch.tensor(0.0), student[rows], part, norm)[0].detach())
    assert parts == pytest.approx(float(whole), rel=1e-12)


def test_term_metrics_reduce_as_declared():
    own = not dist.is_initialized()
    if own:  # one gloo process: the reductions are then what one rank holds
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29301")
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        results = [
            {"distillation/loss": torch.tensor(0.25), "distillation/loss_max": torch.tensor(3.0), "d/mean": 1.0},
            {"distillation/loss": torch.tensor(0.5), "distillation/loss_max": torch.tensor(7.0), "d/mean": 2.0},
            {"pg_loss": 1.0},  # a micro-batch without the term's metrics counts for none of them
        ]
        reductions = {"distillation/loss": "sum", "distillation/loss_max": "max", "d/mean": "mean", "absent": "mean"}
        out = reduce_term_metrics(results, reductions, torch.device("cpu"), True, lambda t: t, None)
        assert out == {"distillation/loss": 0.75, "distillation/loss_max": 7.0, "d/mean": 1.5}
    finally:
        if own:
            dist.destroy_process_group()


def _gate(**kw) -> list[str]:
    cfg = ExperimentConfig()
    cfg.distillation = DistillationConfig(
        enabled=True,
        teacher_models={"teacher_model": DistillationTeacherConfig(model_path="/m/t", **kw.pop("teacher", {}))},
        distillation_loss=DistillationLossConfig(**kw.pop("loss", {})),
    )
    for path, value in kw.items():
        section, name = path.split("__")
        setattr(getattr(cfg, section), name, value)
    return [p for p in config_problems(cfg) if "distillation" in p]


def test_gate_refuses_what_the_colocated_teacher_cannot_honour():
    assert _gate() == []
    (tp,) = _gate(teacher={"inference": DistillationInferenceConfig(tensor_model_parallel_size=2)})
    assert "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=2: expected 1" in tp
    assert "parallel.tensor_model_parallel_size" in tp and "one parallel layout per process" in tp
    (topk,) = _gate(loss={"loss_mode": "forward_kl_topk"})
    assert "loss_mode='forward_kl_topk' with distillation.enabled=true: not wired" in topk
    (pool,) = _gate(distillation__n_gpus_per_node=2, distillation__nnodes=1)
    assert "no separate teacher pool" in pool
    cfg = ExperimentConfig()
    cfg.distillation = _two_teachers()
    cfg.distillation.teacher_key = "ability"
    assert any("teacher_key='ability': expected one of data_source" in p for p in config_problems(cfg))


def test_gate_refuses_dynamic_sampling_without_task_rewards_and_the_async_step():
    cfg = ExperimentConfig()
    cfg.distillation = DistillationConfig(
        enabled=True,
        teacher_models={"teacher_model": DistillationTeacherConfig(model_path="/m/t")},
        distillation_loss=DistillationLossConfig(use_task_rewards=False),
    )
    cfg.algorithm.filter_groups.enable = True
    cfg.rollout.partial_rollout.enable = True
    found = [p for p in config_problems(cfg) if "distillation" in p]
    assert any(p.startswith("algorithm.filter_groups.enable=true with distillation.distillation_loss.use_task_rewards")
               for p in found), found  # fmt: skip
    assert any(p.startswith("rollout.partial_rollout.enable=true with distillation.enabled=true") for p in found)


def test_check_plans_the_teachers_weights(tmp_path):
    """``check``'s memory model counts each teacher's frozen weights at the actor's layout (TP 2 here): its HF
    parameters, with the embedding and untied LM head padded to the actor's vocabulary multiple and split over TP,
    on the device in every step phase and the save (an upper bound where the hand-off offloads them), not at the
    start (the teachers are built after the engine)."""
    from megatron_dapo.config import load_config
    from megatron_dapo.config.memory import STEP_PHASES, memory_model
    from megatron_dapo.config.plan import resolve
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.platform import make_platform
    from megatron_dapo.testing.tiny_models import make_tiny_hf_model

    shape = dict(hidden_size=96, num_layers=3, num_heads=6, num_kv_heads=2, intermediate_size=160)
    teacher = make_tiny_hf_model("qwen2", vocab_size=100, tie_word_embeddings=False, **shape)
    teacher.config.save_pretrained(tmp_path / "teacher")
    student = make_tiny_hf_model("qwen2", vocab_size=100, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    student.config.save_pretrained(tmp_path / "student")
    base = [
        f"model.hf_config_dir={tmp_path / 'student'}",
        "model.make_vocab_size_divisible_by=64",
        "parallel.tensor_model_parallel_size=2",
        "rollout.tensor_model_parallel_size=2",
        "reward.custom_function.path=null",
        "algorithm.filter_groups.enable=false",
    ]
    teacher_on = [
        "distillation.enabled=true",
        f"distillation.teacher_models.teacher_model.model_path={tmp_path / 'teacher'}",
        "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=2",
    ]
    arch = model_arch_from_hf(tmp_path / "student")
    phases = {}
    for name, extra in (("without", []), ("with", teacher_on)):
        cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml", base + extra)
        plan = resolve(cfg, arch, 2, make_platform("cpu"), probe_imports=False)
        phases[name] = {ph.name: ph for ph in memory_model(plan, arch, cfg, None).phases}
    hf_params = sum(p.numel() for p in teacher.parameters())
    h, tp = 96, 2
    replicated = 3 * 2 * h + h  # whole on every TP rank: 2 norms per layer and the final norm (qwen2: no q/k norms)
    per_rank = (hf_params - replicated + (128 - 100) * h * 2) // tp + replicated  # vocab 100 -> 128 rows
    for name, phase in phases["with"].items():
        expected = per_rank * 4 if name in STEP_PHASES or name == "save" else 0  # fp32
        assert phase.device.get("teachers", 0) == expected, (name, phase.device)
        assert phase.device_total - phases["without"][name].device_total == expected, name


def test_a_fully_masked_micro_batch_reports_only_its_zero_loss():
    """Its extremes and means would otherwise enter the step's min/max/mean as 0s (``objective._extreme``)."""
    term = DistillationLossTerm(DistillationLossConfig(loss_mode="k3"), "token-mean")
    mb, student = _micro_batch(3, rows=1)
    assert not bool(mb.loss_mask.any())
    _, metrics = term.combine(torch.tensor(0.0, dtype=torch.float64), student, mb, LossNormalisers(5.0, 2.0, 5))
    assert set(metrics) == {"distillation/loss", EXTRA_LOSS} and float(metrics["distillation/loss"]) == 0.0


def test_gate_refuses_a_teacher_the_actor_layout_cannot_shard_or_read(tmp_path):
    """The teachers run at the actor's TP/PP: ``config/plan.plan_problems`` reads each teacher's config.json."""
    from megatron_dapo.config import load_config
    from megatron_dapo.config.plan import plan_problems
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.platform import make_platform
    from megatron_dapo.testing.tiny_models import tiny_hf_config

    tiny_hf_config("qwen2", vocab_size=100, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2).save_pretrained(
        tmp_path / "student"
    )
    # 6 heads, 3 KV heads, 3 layers: neither TP 2 nor PP 2 splits it
    odd = dict(vocab_size=100, hidden_size=96, num_layers=3, num_heads=6, num_kv_heads=3, intermediate_size=160)
    tiny_hf_config("qwen2", **odd).save_pretrained(tmp_path / "teacher")
    overrides = [
        f"model.hf_config_dir={tmp_path / 'student'}",
        "parallel.tensor_model_parallel_size=2",
        "parallel.pipeline_model_parallel_size=2",
        "rollout.tensor_model_parallel_size=2",
        "reward.custom_function.path=null",
        "algorithm.filter_groups.enable=false",
        "distillation.enabled=true",
        f"distillation.teacher_models.good.model_path={tmp_path / 'student'}",
        "distillation.teacher_models.good.key=a",
        f"distillation.teacher_models.odd.model_path={tmp_path / 'teacher'}",
        "distillation.teacher_models.odd.key=b",
        f"distillation.teacher_models.gone.model_path={tmp_path / 'nowhere'}",
        "distillation.teacher_models.gone.key=c",
    ] + [f"distillation.teacher_models.{n}.inference.{k}=2" for n in ("good", "odd", "gone")
         for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size")]  # fmt: skip
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml", overrides)
    arch = model_arch_from_hf(tmp_path / "student")
    found = [p for p in plan_problems(cfg, arch, 4, make_platform("cpu"), probe_imports=False) if "teacher" in p]
    odd_key = "distillation.teacher_models.odd (the teacher runs at the actor's layout): "
    assert (
        odd_key + "parallel.tensor_model_parallel_size=2 does not divide the model's num_attention_heads=6" not in found
    )
    assert any(p.startswith(odd_key + "parallel.tensor_model_parallel_size=2 does not divide the model's "
                            "num_key_value_heads=3") for p in found), found  # fmt: skip
    assert any(p.startswith(odd_key) and "num_hidden_layers=3" in p for p in found), found
    assert any(p.startswith("distillation.teacher_models.gone.model_path=") and "not readable" in p for p in found)
    assert not [p for p in found if ".good" in p], found
