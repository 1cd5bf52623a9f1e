"""verl 0.9.1's other critic-free advantage estimators against verl's own outputs (the ``advantage_variants`` section
of ``tests/fixtures/verl_golden.json.gz``, written by ``tests/fixtures/verl_golden_estimators.py``): every case within
1e-6, the registry dispatch included; plus the cases verl refuses and the split invariances that hold by construction.

Deliberate difference (``docs/verl_config_mapping.md``): verl's trainer never passes ``norm_adv_by_std_in_grpo`` to
``grpo_vectorized`` and ``gdpo`` (their functions then default to dividing by the std); ours honours the setting.
The golden cases call verl's functions with the setting given, so both values are compared.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from megatron_dapo.algo.advantages import compute_advantages
from megatron_dapo.algo.outcome_estimators import (
    compute_gpg_advantages,
    compute_grpo_passk_advantages,
    compute_opo_advantages,
    compute_rloo_vectorized_advantages,
)
from megatron_dapo.config import config_problems, load_config, raise_if_any
from megatron_dapo.errors import ConfigError
from megatron_dapo.training.reward_stage import reward_components

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "verl_golden.json.gz"
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
ESTIMATORS = (
    "gdpo",
    "gpg",
    "grpo_passk",
    "grpo_vectorized",
    "opo",
    "optimal_token_baseline",
    "remax",
    "rloo_vectorized",
    "tir_optimal_token_baseline",
)


def f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def decode(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    return json.loads(gzip.decompress(GOLDEN.read_bytes()))["advantage_variants"]


def ours(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    rewards = f32(case["token_level_rewards"])
    extra = {}
    if "reward_baselines" in case:
        extra["reward_baselines"] = f32(case["reward_baselines"])
    for name in ("old_log_probs", "sum_pi_squared", "rollout_is_weights"):
        if case.get(name) is not None:
            extra[name] = f32(case[name])
    if "reward_components" in case:
        extra["reward_components"] = f32(case["reward_components"])
        extra["reward_weights"] = case["reward_weights"]
    return compute_advantages(
        case["estimator"],
        scores=rewards.sum(-1),
        group_ids=case["index"],
        response_mask=f32(case["response_mask"]),
        token_level_rewards=rewards,
        norm_adv_by_std_in_grpo=case.get("norm_adv_by_std_in_grpo", True),
        **extra,
    )


def test_every_estimator_matches_verl(cases):
    seen: dict[str, int] = {}
    for case in cases:
        adv, ret = ours(case)
        name = case["estimator"]
        torch.testing.assert_close(adv.double(), decode(case["advantages"]), rtol=0, atol=1e-6, msg=name)
        torch.testing.assert_close(ret.double(), decode(case["returns"]), rtol=0, atol=1e-6, msg=name)
        seen[name] = seen.get(name, 0) + 1
    assert sorted(seen) == sorted(ESTIMATORS), seen
    assert min(seen.values()) >= 16, seen


def test_cases_cover_what_tells_the_implementations_apart(cases):
    """Groups of one (rloo_vectorized gives 0 where rloo gives the score), Pass@k crediting one response per group,
    empty responses."""
    rloo = [c for c in cases if c["estimator"] == "rloo_vectorized"]
    assert any(c["index"].count(g) == 1 for c in rloo for g in c["index"])
    for c in (c for c in cases if c["estimator"] == "grpo_passk"):
        credited = int((decode(c["advantages"]).abs().sum(-1) > 0).sum())
        assert credited <= len(set(c["index"]))
    assert any(0.0 in [sum(r) for r in c["response_mask"]] for c in cases)


def test_passk_refuses_a_group_of_one_as_verl_does():
    with pytest.raises(ValueError, match="at least 2 responses per group"):
        compute_grpo_passk_advantages(f32([1.0, 0.0, 1.0]), ["a", "a", "b"], torch.ones(3, 2))


def test_remax_and_gdpo_name_what_they_miss():
    mask = torch.ones(2, 2)
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_advantages("remax", scores=f32([1, 0]), group_ids=[0, 0], response_mask=mask,
                           token_level_rewards=mask)  # fmt: skip
    with pytest.raises(ValueError, match="gdpo_reward_keys"):
        compute_advantages("gdpo", scores=f32([1, 0]), group_ids=[0, 0], response_mask=mask)


def test_group_estimators_are_invariant_to_row_order():
    """Per-group estimators depend on group membership, not on where rows sit in the batch (any split of a batch
    into micro-batches sees the advantages computed once on the whole batch)."""
    gen = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 2, (12,), generator=gen).float()
    ids = [i % 3 for i in range(12)]
    mask = (torch.rand(12, 5, generator=gen) > 0.2).float()
    perm = torch.randperm(12, generator=gen)
    for fn in (compute_opo_advantages, compute_gpg_advantages, compute_rloo_vectorized_advantages):
        whole, _ = fn(scores, ids, mask)
        shuffled, _ = fn(scores[perm], [ids[i] for i in perm.tolist()], mask[perm])
        torch.testing.assert_close(shuffled, whole[perm])


def test_gdpo_components_come_from_the_reward_dict_and_missing_keys_are_named():
    extra = {"score": [1.0, 0.0, None], "acc": [True, False, None], "pred": ["1", "2", None]}
    got = reward_components(extra, ["acc", "score"])
    assert got.tolist() == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]  # a failed call (None) counts 0
    with pytest.raises(ValueError, match=r"returned no \['format'\] \(it returned \['acc', 'pred', 'score'\]\)"):
        reward_components(extra, ["acc", "format"])


def test_gdpo_config_needs_its_keys_and_one_weight_each():
    with pytest.raises(ConfigError, match="needs algorithm.gdpo_reward_keys"):
        raise_if_any(config_problems(load_config(CONFIG, ["algorithm.adv_estimator=gdpo"])))
    with pytest.raises(ConfigError, match="has 1 values for 2 algorithm.gdpo_reward_keys"):
        raise_if_any(config_problems(load_config(CONFIG, ["algorithm.adv_estimator=gdpo",
            "algorithm.gdpo_reward_keys=[a,b]", "algorithm.gdpo_reward_weights=[1.0]"])))  # fmt: skip
    cfg = load_config(CONFIG, ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a,b]"])
    assert cfg.algorithm.gdpo_reward_keys == ["a", "b"]
    for name in ESTIMATORS:  # every estimator here is a valid config value
        cfg = load_config(CONFIG, [f"algorithm.adv_estimator={name}", "algorithm.gdpo_reward_keys=[a]"])
        assert not config_problems(cfg)
