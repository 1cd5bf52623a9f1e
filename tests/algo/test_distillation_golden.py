"""On-policy distillation losses (``megatron_dapo/distill/``) against golden cases computed by verl 0.9.1 itself.

The cases come from ``tests/fixtures/verl_golden_distillation.json.gz``, written by
``tools/make_distillation_golden.py`` from verl's ``distillation_loss`` and ``distillation_ppo_loss`` (the top-k loss
through verl's Megatron ``_VocabParallelKLDivergence``, its own backward). verl is not needed here.

For every case: the distillation loss alone and its sum with the task's PPO loss, their gradients w.r.t. the
student's log-probs and (top-k) logits, and every ``distillation/*`` metric, within ``1e-6`` (absolute plus
relative). Each ``*_mismatches`` function returns one line per value we do not reproduce.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch

from megatron_dapo.algo.loss_aggregation import agg_loss, compute_policy_loss_terms
from megatron_dapo.config.schema import DistillationConfig, DistillationLossConfig
from megatron_dapo.distill.config_checks import distillation_problems
from megatron_dapo.distill.losses import DISTILLATION_LOSSES, DistillationInputs
from megatron_dapo.distill.objective import CLIP_RATIO_C, Normalisers, combine_with_task_loss, distillation_loss

GOLDEN_PATH = Path(__file__).resolve().parents[1] / "fixtures" / "verl_golden_distillation.json.gz"
GOLDEN = json.loads(gzip.decompress(GOLDEN_PATH.read_bytes()))
TOL = 1e-6
ACTOR_CLIP = (0.2, 0.28)  # the generator's task-loss clip ratios (tools/make_distillation_golden.py)
LOSS_KEYS = ("loss_mode", "use_policy_gradient", "use_task_rewards", "distillation_loss_coef", "loss_max_clamp",
             "log_prob_min_clamp", "topk", "clip_ratio", "clip_ratio_low", "clip_ratio_high")  # fmt: skip


def f32(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def close(ours: torch.Tensor | float, ref: list | float) -> bool:
    a = torch.as_tensor(ours).detach().to(torch.float64)
    b = torch.tensor(ref, dtype=torch.float64)
    if a.shape != b.shape or not bool(torch.isfinite(a).all()) or not bool(torch.isfinite(b).all()):
        return False
    return bool(((a - b).abs() <= TOL + TOL * b.abs()).all())


def _leaves(inputs: dict) -> dict[str, torch.Tensor]:
    leaves = {"student_log_probs": f32(inputs["student_log_probs"]).requires_grad_(True)}
    if "student_logits" in inputs:
        leaves["student_logits"] = f32(inputs["student_logits"]).requires_grad_(True)
    return leaves


def _ours(case: dict) -> dict:
    """Our distillation loss alone and its sum with the task loss, each on fresh leaves, as the golden stores them."""
    s, inputs = case["settings"], case["inputs"]
    cfg = DistillationLossConfig(**{k: s[k] for k in LOSS_KEYS})
    mask = f32(inputs["response_mask"])
    norm = Normalisers(
        float(mask.sum()) + s["extra_tokens"], float((mask.sum(-1) > 0).sum()) + s["extra_seqs"], s["loss_scale_factor"]
    )
    old = f32(inputs["old_log_probs"])
    is_weights = f32(inputs["rollout_is_weights"]) if "rollout_is_weights" in inputs else None
    out = {}
    for which in ("distill", "total"):
        leaves = _leaves(inputs)
        batch = DistillationInputs(
            response_mask=mask, cfg=cfg, student_log_probs=leaves["student_log_probs"],
            teacher_log_probs=f32(inputs["teacher_log_probs"]) if "teacher_log_probs" in inputs else None,
            student_logits=leaves.get("student_logits"),
            teacher_topk_log_probs=f32(inputs["teacher_topk_log_probs"]) if "student_logits" in inputs else None,
            teacher_topk_ids=torch.tensor(inputs["teacher_topk_ids"]) if "student_logits" in inputs else None,
        )  # fmt: skip
        loss, metrics = distillation_loss(batch, s["loss_agg_mode"], norm, old_log_probs=old, is_weights=is_weights)
        if which == "total":
            terms = compute_policy_loss_terms(
                leaves["student_log_probs"], old, f32(inputs["advantages"]), *ACTOR_CLIP, CLIP_RATIO_C, is_weights
            )
            task = agg_loss(terms["pg_losses"], mask, s["loss_agg_mode"], norm.token_count, norm.seq_count,
                            norm.max_response_length)  # fmt: skip
            loss = combine_with_task_loss(task, loss, cfg)
        loss.backward()
        grads = {k: (t.grad if t.grad is not None else torch.zeros_like(t)) for k, t in leaves.items()}
        out[which] = {"loss": loss, "metrics": metrics, "grads": grads}
    return out


def case_mismatches(case: dict) -> list[str]:
    bad = []
    ours = _ours(case)
    for which in ("distill", "total"):
        ref, got = case["verl"][which], ours[which]
        where = f"{case['name']} [{which}]"
        if not close(got["loss"], ref["loss"]):
            bad.append(f"{where} loss: ours {float(got['loss'].detach()):.9g} verl {ref['loss']}")
        for name, grad in ref["grads"].items():
            if not close(got["grads"][name], grad):
                bad.append(f"{where} d/d{name}: ours {got['grads'][name].tolist()} verl {grad}")
        ref_metrics = {k: v for k, v in ref["metrics"].items() if k.startswith("distillation/")}
        if which == "distill":  # verl's distillation_ppo_loss adds the loss itself
            ref_metrics["distillation/loss"] = ref["loss"]
        if set(got["metrics"]) != set(ref_metrics):
            bad.append(f"{where} metric names: ours {sorted(got['metrics'])} verl {sorted(ref_metrics)}")
        for name in set(got["metrics"]) & set(ref_metrics):
            if not close(got["metrics"][name], ref_metrics[name]):
                bad.append(f"{where} {name}: ours {float(got['metrics'][name].detach()):.9g} verl {ref_metrics[name]}")
    return bad


def test_every_case_matches_verl():
    bad = [line for case in GOLDEN["cases"] for line in case_mismatches(case)]
    assert not bad, f"{len(bad)} mismatches with verl {GOLDEN['verl_version']}:\n" + "\n".join(bad[:20])


def test_golden_covers_every_loss_mode_use_clamp_and_aggregation():
    """The file holds every registered name in both uses (k1/kl: policy gradient only), clamps on and off, every
    aggregation mode, with and without task rewards: a regenerated file that lost a kind of case fails here."""
    settings = [c["settings"] for c in GOLDEN["cases"]]
    seen = {(s["loss_mode"], s["use_policy_gradient"], s["loss_max_clamp"] is not None) for s in settings}
    expected = {
        (mode, pg, clamp)
        for mode in DISTILLATION_LOSSES.names()
        for pg in (False, True)
        for clamp in (False, True)
        if pg or mode not in ("k1", "kl")
    }
    assert seen == expected
    topk = [s for s in settings if s["loss_mode"] == "forward_kl_topk"]
    assert {s["log_prob_min_clamp"] is not None for s in topk} == {False, True}
    assert {s["loss_agg_mode"] for s in settings} == {
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    }  # fmt: skip
    assert {s["use_task_rewards"] for s in settings} == {False, True}
    weighted = [c["settings"] for c in GOLDEN["cases"] if "rollout_is_weights" in c["inputs"]]
    assert {(s["use_policy_gradient"], s["loss_mode"] == "forward_kl_topk") for s in weighted} >= {(True, False)}
    assert len(GOLDEN["cases"]) == 32


def test_clamps_change_the_numbers():
    """The clamped cases are not degenerate: the loss clamp and the log-prob clamp each move verl's value, so a
    missing clamp on our side would be caught by the comparison above."""
    by_name = {c["name"]: c for c in GOLDEN["cases"]}
    for name, case in by_name.items():
        if case["settings"]["loss_max_clamp"] is None:
            continue
        unclamped = dict(case, settings={**case["settings"], "loss_max_clamp": None, "log_prob_min_clamp": None})
        moved = _ours(unclamped)["distill"]["loss"]
        assert not close(moved, case["verl"]["distill"]["loss"]), name


def test_the_loss_sections_verl_refuses_are_refused():
    """verl's DistillationLossConfig refusals (k1 without the policy gradient, a policy loss other than vanilla, an
    unknown mode) are config problems here, naming the key; verl accepts its alias kl without the policy gradient
    (its check names k1 only), which we refuse too (docs/verl_config_mapping.md)."""
    for entry in GOLDEN["refusals"]:
        keys = entry["settings"]
        problems = distillation_problems(DistillationConfig(distillation_loss=DistillationLossConfig(**keys)))
        if entry["refused"] is None and keys["loss_mode"] != "kl":
            assert problems == [], (keys, problems)
        else:
            assert problems, keys
            assert all("distillation.distillation_loss." in p for p in problems), problems
    kl = next(e for e in GOLDEN["refusals"] if e["settings"]["loss_mode"] == "kl")
    assert kl["refused"] is None  # the deliberate difference is verl's, as recorded
