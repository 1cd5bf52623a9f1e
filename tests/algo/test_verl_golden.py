"""Our reward and algorithm functions against golden cases computed by verl 0.9.1 itself.

The cases come from ``tests/fixtures/verl_golden.json.gz``, written by ``tests/fixtures/make_verl_golden.py`` from
verl's own ``math_dapo.compute_score``, ``core_algos`` estimators, ``agg_loss``, ``compute_policy_loss_vanilla`` and
every other registered policy loss but ``bypass_mode``, ``compute_entropy_loss``, ``kl_penalty``, the KL
controllers, ``ray_trainer.apply_kl_penalty`` and the token-level truncated IS weights of ``rollout_corr_helper``.
verl is not needed here.

Each ``*_mismatches`` function returns one line per golden case we do not reproduce (so the same functions also
count mismatches of an older implementation). Scores, ``acc`` and ``pred`` must be identical; tensors agree to
``1e-6`` (absolute plus relative), as our group statistics run in float64 where verl loops in float32.
Deliberate differences from verl (``docs/verl_config_mapping.md``, "Deliberate differences from verl 0.9.1") are
excluded from the mismatch counts by name and asserted separately.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from megatron_dapo.algo.advantages import compute_advantages
from megatron_dapo.algo.kl import apply_kl_penalty_to_rewards, get_kl_controller, kl_penalty
from megatron_dapo.algo.logprobs import response_log_probs
from megatron_dapo.algo.loss import LossNormalisers, dapo_loss, loss_metrics
from megatron_dapo.algo.loss_aggregation import METRIC_TERMS, agg_loss, compute_rollout_is_weights
from megatron_dapo.algo.registry import POLICY_LOSSES
from megatron_dapo.algo.rollout_correction import RS_OPTIONS
from megatron_dapo.config import ActorConfig
from megatron_dapo.config.schema import PolicyLossConfig, RolloutCorrectionConfig
from megatron_dapo.reward.math_dapo import compute_score

GOLDEN_PATH = Path(__file__).resolve().parents[1] / "fixtures" / "verl_golden.json.gz"
GOLDEN = json.loads(gzip.decompress(GOLDEN_PATH.read_bytes()))
TOL = 1e-6
# verl divides 0 by 0 for a batch without any loss token; we return 0 (an empty micro-batch must not poison the step).
FULLY_MASKED_CASE = "fully_masked_batch"


def f32(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def close(ours: torch.Tensor | float, ref: list | float) -> bool:
    """``|ours - ref| <= TOL + TOL * |ref|`` everywhere, same shape, no NaN on either side."""
    a = torch.as_tensor(ours).detach().to(torch.float64)
    b = torch.tensor(ref, dtype=torch.float64)
    if a.shape != b.shape or not bool(torch.isfinite(b).all()) or not bool(torch.isfinite(a).all()):
        return False
    return bool(((a - b).abs() <= TOL + TOL * b.abs()).all())


def math_dapo_mismatches() -> list[str]:
    bad = []
    for i, case in enumerate(GOLDEN["math_dapo"]):
        ours = compute_score(case["solution"], case["ground_truth"], strict_box_verify=case["strict_box_verify"])
        ref = {"score": case["score"], "acc": case["acc"], "pred": case["pred"]}
        if ours != ref or type(ours["acc"]) is not bool:
            bad.append(f"math_dapo[{i}] ({case['style']}): ours {ours} verl {ref}")
    return bad


def advantage_mismatches() -> list[str]:
    bad = []
    for i, case in enumerate(GOLDEN["advantages"]):
        rewards = f32(case["token_level_rewards"])
        adv, ret = compute_advantages(
            case["estimator"],
            scores=rewards.sum(-1),
            group_ids=case.get("index", [0] * rewards.shape[0]),
            response_mask=f32(case["response_mask"]),
            token_level_rewards=rewards,
            norm_adv_by_std_in_grpo=case.get("norm_adv_by_std_in_grpo", True),
            gamma=case.get("gamma", 1.0),
        )
        if not (close(adv, case["advantages"]) and close(ret, case["returns"])):
            bad.append(f"advantages[{i}] {case['estimator']} norm={case.get('norm_adv_by_std_in_grpo')}")
    for case in GOLDEN["advantage_errors"]:
        rewards = f32(case["token_level_rewards"])
        try:
            compute_advantages(
                case["estimator"],
                scores=rewards.sum(-1),
                group_ids=case["index"],
                response_mask=f32(case["response_mask"]),
                token_level_rewards=rewards,
            )
        except ValueError:
            continue
        bad.append(f"advantage_errors {case['name']}: verl raises {case['error']}, ours does not")
    return bad


def agg_loss_mismatches() -> list[str]:
    bad = []
    for i, case in enumerate(GOLDEN["agg_loss"]):
        if case["name"] == FULLY_MASKED_CASE:
            continue
        mat, mask = f32(case["loss_mat"]), f32(case["loss_mask"])
        mode = case["loss_agg_mode"]
        if "bounds" in case:
            bounds = case["bounds"]
            for part, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
                ours = agg_loss(
                    mat[lo:hi],
                    mask[lo:hi],
                    mode,
                    global_token_count=case["global_token_count"],
                    global_seq_count=case["global_seq_count"],
                    max_response_length=case["max_response_length"],
                )
                if not close(ours, case["micro_losses"][part]):
                    bad.append(f"agg_loss[{i}] {case['name']} {mode} micro-batch {part}")
        elif not close(agg_loss(mat, mask, mode), case["loss"]):
            bad.append(f"agg_loss[{i}] {case['name']} {mode}")
    return bad


def policy_loss_mismatches() -> list[str]:
    bad = []
    for i, case in enumerate(GOLDEN["policy_loss"]):
        log_prob = f32(case["log_prob"]).requires_grad_(True)
        mask = f32(case["response_mask"])
        cfg = ActorConfig(
            clip_ratio_low=case["clip_ratio_low"],
            clip_ratio_high=case["clip_ratio_high"],
            clip_ratio_c=case["clip_ratio_c"],
            loss_agg_mode=case["loss_agg_mode"],
        )
        loss, sums = dapo_loss(  # the loss the actor's hook trains with, on the whole batch
            log_prob,
            None,
            loss_mask=mask,
            response_mask=mask,
            advantages=f32(case["advantages"]),
            cfg=cfg,
            norm=LossNormalisers.of(mask),
            old_log_probs=f32(case["old_log_prob"]),
            rollout_is_weights=None if case["is_weights"] is None else f32(case["is_weights"]),
        )
        metrics = {k.split("/")[1]: v for k, v in loss_metrics(sums, use_kl_loss=False).items()}
        loss.backward()
        checks = {
            "pg_loss": close(loss, case["pg_loss"]),
            "grad": close(log_prob.grad, case["grad_log_prob"]),
            **{key: close(metrics[key], case[key]) for key in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")},
        }
        failed = [key for key, ok in checks.items() if not ok]
        if failed:
            bad.append(f"policy_loss[{i}] {case['name']} {case['loss_agg_mode']}: {failed}")
    return bad


def variant_config(case: dict) -> ActorConfig:
    """Our config for a ``policy_loss_variants`` case: verl's ``actor.policy_loss.*`` and ``actor.tau_*`` keys."""
    settings = case["settings"]
    taus = {k: v for k, v in settings.items() if k in ("tau_pos", "tau_neg")}
    keys = {k: v for k, v in settings.items() if k not in taus}
    if "rollout_correction" in keys:
        keys["rollout_correction"] = RolloutCorrectionConfig(**keys["rollout_correction"])
    return ActorConfig(
        clip_ratio_low=case["clip_ratio_low"],
        clip_ratio_high=case["clip_ratio_high"],
        clip_ratio_c=case["clip_ratio_c"],
        loss_agg_mode=case["loss_agg_mode"],
        policy_loss=PolicyLossConfig(loss_mode=case["loss_mode"], **keys),
        **taus,
    )


def policy_loss_variant_mismatches() -> list[str]:
    """Every registered verl loss through ``dapo_loss`` (the actor's loss) on the whole batch: the loss, its gradient
    and the metrics verl returns for that loss (the ones it does not return read 0 here: a deliberate difference).
    ``bypass_mode``'s old policy is the rollout's: verl's ``old_log_prob`` reaches ours as ``rollout_log_probs``."""
    bad = []
    for i, case in enumerate(GOLDEN["policy_loss_variants"]):
        log_prob = f32(case["log_prob"]).requires_grad_(True)
        mask = f32(case["response_mask"])
        bypass = case["loss_mode"] == "bypass_mode"
        torch.manual_seed(case["torch_seed"])  # clip_cov samples the tokens it cuts as verl does
        loss, sums = dapo_loss(
            log_prob,
            None,
            loss_mask=mask,
            response_mask=mask,
            advantages=f32(case["advantages"]),
            cfg=variant_config(case),
            norm=LossNormalisers.of(mask),
            # bypass_mode ignores the proximal log-probs: shifted here, the loss must not move
            old_log_probs=f32(case["old_log_prob"]) + (0.5 if bypass else 0.0),
            rollout_log_probs=f32(case["old_log_prob"]) if bypass else None,
            rollout_is_weights=None if case["is_weights"] is None else f32(case["is_weights"]),
        )
        loss.backward()
        metrics = {k.split("/")[1]: v for k, v in loss_metrics(sums, use_kl_loss=False).items() if k[:6] == "actor/"}
        checks = {
            "pg_loss": close(loss, case["pg_loss"]),
            "grad": close(log_prob.grad, case["grad_log_prob"]),
            **{key: close(metrics[key], value) for key, value in case["metrics"].items()},
            **{f"{key}=0": metrics[key] == 0.0 for key in METRIC_TERMS if key not in case["metrics"]},
        }
        failed = [key for key, ok in checks.items() if not ok]
        if failed:
            bad.append(f"policy_loss_variants[{i}] {case['name']} {case['loss_agg_mode']}: {failed}")
    return bad


def rollout_is_and_entropy_mismatches() -> list[str]:
    bad = []
    for i, case in enumerate(GOLDEN["rollout_is_weights"]):
        weights = compute_rollout_is_weights(
            f32(case["old_log_prob"]), f32(case["rollout_log_prob"]), f32(case["response_mask"]), case["threshold"]
        )
        if not close(weights, case["weights"]):
            bad.append(f"rollout_is_weights[{i}] threshold={case['threshold']}")
    for i, case in enumerate(GOLDEN["entropy"]):
        logits, mask = f32(case["logits"]), f32(case["response_mask"])
        entropy = training_entropy(logits)
        verl_exact = verl_entropy_is_exact(case)
        if not close(entropy[verl_exact], torch.tensor(case["entropy"])[verl_exact].tolist()):
            bad.append(f"entropy[{i}] entropy_from_logits")
        for mode, expected in case["entropy_loss"].items():
            if not close(agg_loss(entropy, mask, mode), expected):
                bad.append(f"entropy[{i}] compute_entropy_loss {mode}")
    return bad


def training_entropy(logits: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` entropy of ``logits[B, T, V]`` as training computes it: ``response_log_probs`` (one logit row per
    response token; the targets do not matter) on the full vocabulary. verl's ``compute_entropy_loss`` is this
    entropy (``entropy_from_logits``) aggregated with ``agg_loss``."""
    batch, length, vocab = logits.shape
    index = torch.arange(length).expand(batch, length)
    _, entropy = response_log_probs(logits, index, torch.zeros_like(index), vocab)
    return entropy


def float64_entropy(logits: torch.Tensor) -> torch.Tensor:
    z = logits.to(torch.float64)
    return torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)


def verl_entropy_is_exact(case: dict) -> torch.Tensor:
    """Where verl's per-token entropy is within ``TOL`` of the float64 value. verl computes ``logsumexp(z) -
    sum(softmax(z) * z)`` in float32, which cancels badly for logits of magnitude ~30; training subtracts the row
    maximum first. See :func:`test_deliberate_difference_entropy_of_large_logits`."""
    exact = float64_entropy(f32(case["logits"]))
    verl = torch.tensor(case["entropy"], dtype=torch.float64)
    return (verl - exact).abs() <= TOL + TOL * exact.abs()


def kl_mismatches() -> list[str]:
    bad = []
    for i, case in enumerate(GOLDEN["kl_penalty"]):
        lp = f32(case["log_prob"]).requires_grad_(True)
        ref = f32(case["ref_log_prob"]).requires_grad_(True)
        kl = kl_penalty(lp, ref, case["kind"])
        (kl * f32(case["grad_weights"])).sum().backward()
        ok = (
            close(kl, case["kl"])
            and close(lp.grad, case["grad_log_prob"])
            and close(ref.grad, case["grad_ref_log_prob"])
        )
        if not ok:
            bad.append(f"kl_penalty[{i}] {case['kind']} {case['name']}")
    for case in GOLDEN["apply_kl_penalty"]:
        batch = len(case["response_mask"])
        rewards, metrics = apply_kl_penalty_to_rewards(
            f32(case["token_level_scores"]),
            f32(case["old_log_prob"]),
            f32(case["ref_log_prob"]),
            f32(case["response_mask"]),
            case["kl_coef"],
            case["kind"],
        )
        ctrl = get_kl_controller(
            "adaptive" if case["adaptive"] else "fixed", case["kl_coef"], case["target_kl"], case["horizon"]
        )
        coef_before = ctrl.value
        ctrl.update(metrics["actor/reward_kl_penalty"], n_steps=batch)  # verl passes the number of responses
        ok = (
            close(rewards, case["token_level_rewards"])
            and close(metrics["actor/reward_kl_penalty"], case["reward_kl_penalty"])
            and metrics["actor/reward_kl_penalty_coeff"] == case["reward_kl_penalty_coeff"] == coef_before
            and close(ctrl.value, case["coef_after_update"])
        )
        if not ok:
            bad.append(f"apply_kl_penalty {case['kind']} adaptive={case['adaptive']}")
    for i, case in enumerate(GOLDEN["kl_controller"]):
        ctrl = get_kl_controller("adaptive", case["init_kl_coef"], case["target_kl"], case["horizon"])
        for step, ((current_kl, n_steps), expected) in enumerate(zip(case["updates"], case["values"])):
            ctrl.update(current_kl, n_steps)
            if ctrl.value != pytest.approx(expected, rel=1e-12, abs=0.0):
                bad.append(f"kl_controller[{i}] step {step}: ours {ctrl.value!r} verl {expected!r}")
                break
    return bad


def _report(bad: list[str]) -> str:
    return f"{len(bad)} mismatches with verl {GOLDEN['verl_version']}:\n" + "\n".join(bad[:20])


MISMATCH_CHECKS: dict[str, Callable[[], list[str]]] = {
    "math_dapo": math_dapo_mismatches,
    "advantages": advantage_mismatches,
    "agg_loss": agg_loss_mismatches,
    "policy_loss": policy_loss_mismatches,
    "policy_loss_variants": policy_loss_variant_mismatches,
    "rollout_is_and_entropy": rollout_is_and_entropy_mismatches,
    "kl": kl_mismatches,
}


def test_golden_file_covers_every_area() -> None:
    assert GOLDEN["verl_version"] == "0.9.1"
    assert len(GOLDEN["math_dapo"]) >= 2000
    styles = {case["style"] for case in GOLDEN["math_dapo"]}
    assert len(styles) == 20
    # Both verl branches must be exercised: Answer-line hits, box fallbacks and outright misses, right and wrong.
    preds = [case["pred"] for case in GOLDEN["math_dapo"]]
    assert preds.count("[INVALID]") > 50 and preds.count(None) > 10
    assert 0.2 < sum(case["acc"] for case in GOLDEN["math_dapo"]) / len(preds) < 0.8
    estimators = {(c["estimator"], c.get("norm_adv_by_std_in_grpo")) for c in GOLDEN["advantages"]}
    assert estimators == {
        ("grpo", True),
        ("grpo", False),
        ("rloo", None),
        ("reinforce_plus_plus", None),
        ("reinforce_plus_plus_baseline", None),
    }
    assert {c["loss_agg_mode"] for c in GOLDEN["policy_loss"]} == {c["loss_agg_mode"] for c in GOLDEN["agg_loss"]}
    assert len({c["loss_agg_mode"] for c in GOLDEN["agg_loss"]}) == 4
    assert len({c["kind"] for c in GOLDEN["kl_penalty"]}) == 14
    # verl 0.9.1's twelve policy losses
    variants = {c["loss_mode"] for c in GOLDEN["policy_loss_variants"]}
    assert variants == set(POLICY_LOSSES.names()) and len(variants) == 12
    # bypass_mode: both loss types, every IS level and threshold form, every rejection option
    corrections = [c["settings"].get("rollout_correction") for c in GOLDEN["policy_loss_variants"]]
    corrections = [rc for rc in corrections if rc is not None]
    assert {rc.get("loss_type") for rc in corrections} == {"ppo_clip", "reinforce"}
    assert {(rc.get("rollout_is"), "_" in str(rc.get("rollout_is_threshold", ""))) for rc in corrections} >= {
        (level, icepop) for level in ("token", "sequence") for icepop in (False, True)
    }
    assert any(rc.get("rollout_is_batch_normalize") for rc in corrections)
    options = {o.strip() for rc in corrections for o in str(rc.get("rollout_rs") or "").split(",") if o.strip()}
    assert options == set(RS_OPTIONS)
    for loss_mode in variants:
        cases = [c for c in GOLDEN["policy_loss_variants"] if c["loss_mode"] == loss_mode]
        assert {c["loss_agg_mode"] for c in cases} == {c["loss_agg_mode"] for c in GOLDEN["agg_loss"]}
        assert any(sum(map(sum, c["response_mask"])) == 1 for c in cases)  # a one-token batch
        assert any(0.0 in map(sum, c["response_mask"]) for c in cases)  # fully masked rows


@pytest.mark.parametrize("area", sorted(MISMATCH_CHECKS))
def test_matches_verl(area: str) -> None:
    bad = MISMATCH_CHECKS[area]()
    assert not bad, _report(bad)


def test_deliberate_difference_fully_masked_batch_gives_zero() -> None:
    """verl: NaN (0 tokens / 0 tokens, or 0 / 0 non-empty sequences) in every mode; ours: 0."""
    cases = [c for c in GOLDEN["agg_loss"] if c["name"] == FULLY_MASKED_CASE]
    assert len(cases) == 4
    for case in cases:
        ours = agg_loss(f32(case["loss_mat"]), f32(case["loss_mask"]), case["loss_agg_mode"])
        assert ours.item() == 0.0
        assert math.isnan(case["loss"]), case["loss_agg_mode"]


def test_deliberate_difference_unknown_kl_kind_raises_value_error() -> None:
    """verl raises NotImplementedError (also for "full", which needs whole-vocabulary logits); we raise ValueError."""
    assert {c["kind"] for c in GOLDEN["kl_penalty_errors"]} == {"full", "k4", "kl++", ""}
    for case in GOLDEN["kl_penalty_errors"]:
        assert case["error"] == "NotImplementedError"
        with pytest.raises(ValueError, match="unknown KL kind"):
            kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), case["kind"])


def test_deliberate_difference_entropy_of_large_logits() -> None:
    """verl's float32 entropy is off by more than ``TOL`` for 8 tokens of the case with logits up to ~30 in
    magnitude; there the training entropy agrees with the float64 value instead (everywhere, in fact)."""
    inexact = [int((~verl_entropy_is_exact(case)).sum()) for case in GOLDEN["entropy"]]
    assert inexact == [0, 0, 8]
    for case in GOLDEN["entropy"]:
        logits = f32(case["logits"])
        assert close(training_entropy(logits), float64_entropy(logits).tolist())
