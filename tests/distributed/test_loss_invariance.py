"""DAPO loss through megatron-core's forward_backward_func: same loss and gradients for any TP/PP/DP size and any
micro-batch split, and equal to an independent float64 HF-transformers computation of the whole-batch loss."""

import functools
from pathlib import Path

import pytest
import torch

from megatron_dapo.algo.kl import kl_penalty
from megatron_dapo.algo.loss import LossNormalisers, dapo_loss
from megatron_dapo.algo.loss_aggregation import agg_loss, compute_policy_loss_terms
from megatron_dapo.config import ActorConfig
from megatron_dapo.models.families import model_arch_from_hf, param_mappings
from megatron_dapo.testing.tiny_models import make_tiny_hf_model
from megatron_dapo.weights.layout import hf_to_mcore
from tests.distributed.loss_batch import HF_KWARGS, TEMPERATURE, make_batch
from tests.helpers.torchrun import run_torchrun

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
ENTROPY_COEFF, KL_COEF = 0.01, 0.1
WORKER = Path(__file__).with_name("loss_worker.py")

LAYOUTS = {
    # name: (nproc, worker args)
    "tp1_pp1_dp1_1mb": (1, "--micro 8"),
    "tp1_pp1_dp1_4mb": (1, "--micro 2"),
    "tp1_dynamic_bsz": (1, "--micro 8 --dynamic-tokens 30"),
    "tp2_sp_3mb": (2, "--tp 2 --sp --micro 3"),
    "pp2_4mb": (2, "--pp 2 --micro 2"),
    "dp2_4mb": (2, "--micro 1"),
    # megatron-core DDP overlapping the gradient all-reduce with the backward, in buckets of 5000 parameters.
    "dp2_4mb_overlap": (2, "--micro 1 --overlap-bucket 5000"),
    "tp2_pp2_sp": (4, "--tp 2 --pp 2 --sp --micro 2"),
}


@functools.cache
def run_world(nproc: int, tmp_root: str) -> None:
    """Every layout of ``nproc`` processes, one after the other in one launch (megatron-core's groups rebuilt)."""
    layouts = [arg for name, (n, args) in LAYOUTS.items() if n == nproc for arg in ("--layout", name, args)]
    run_torchrun(WORKER, nproc, layouts + ["--modes", ",".join(MODES), "--out", tmp_root], port=29920, timeout=600)


def run_layout(name: str, tmp_root: str) -> dict:
    run_world(LAYOUTS[name][0], tmp_root)
    return torch.load(f"{tmp_root}/{name}/result.pt")


@functools.cache
def reference(mode: str) -> dict:
    """Whole-batch float64 loss and gradients with HF transformers, mapped to full Megatron tensor names."""
    hf = make_tiny_hf_model("qwen2", seed=0, **HF_KWARGS).double()
    arch = model_arch_from_hf(hf.config.to_dict())
    b = make_batch()
    rows = []
    for i in range(b["responses"].shape[0]):
        p = b["prompts"][i][b["prompt_mask"][i].bool()]
        r = b["responses"][i][b["response_mask"][i].bool()]
        rows.append((p, r))
    seq = max(len(p) + len(r) for p, r in rows)
    tokens = torch.zeros(len(rows), seq, dtype=torch.long)
    for i, (p, r) in enumerate(rows):
        tokens[i, : len(p) + len(r)] = torch.cat([p, r])
    logits = hf(tokens).logits / TEMPERATURE  # right padding only: causal attention keeps valid rows exact
    logp_all = torch.log_softmax(logits, -1)
    T = b["responses"].shape[1]
    log_probs = torch.zeros(len(rows), T, dtype=torch.float64)
    entropy = torch.zeros(len(rows), T, dtype=torch.float64)
    for i, (p, r) in enumerate(rows):
        for t in range(len(r)):
            pos = len(p) - 1 + t
            log_probs[i, t] = logp_all[i, pos, r[t]]
            entropy[i, t] = -(logp_all[i, pos].exp() * logp_all[i, pos]).sum()
    mask = b["loss_mask"].double()
    cfg = ActorConfig(
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=10.0,
        loss_agg_mode=mode,
        entropy_coeff=ENTROPY_COEFF,
        use_kl_loss=True,
        kl_loss_coef=KL_COEF,
        kl_loss_type="low_var_kl",
    )
    # The whole batch through the one loss function (the hook runs it per micro-batch with global normalisers).
    loss, sums = dapo_loss(
        log_probs,
        entropy,
        loss_mask=mask,
        response_mask=b["response_mask"].double(),
        advantages=b["advantages"].double(),
        cfg=cfg,
        norm=LossNormalisers.of(mask, max_response_length=T),
        old_log_probs=b["old_log_probs"].double(),
        ref_log_probs=b["ref_log_probs"].double(),
    )
    # Independently of dapo_loss: the same objective written out from agg_loss and the PPO terms.
    agg = functools.partial(agg_loss, loss_mask=mask, loss_agg_mode=mode, max_response_length=T)
    terms = compute_policy_loss_terms(log_probs, b["old_log_probs"].double(), b["advantages"].double(), 0.2, 0.28, 10.0)
    by_hand = (
        agg(terms["pg_losses"])
        - ENTROPY_COEFF * agg(entropy)
        + KL_COEF * agg(kl_penalty(log_probs, b["ref_log_probs"].double(), "low_var_kl"))
    )
    torch.testing.assert_close(loss, by_hand, rtol=1e-12, atol=1e-14)
    pg = sums["pg_loss"]
    loss.backward()
    params = dict(hf.named_parameters())
    grads = {}
    for m in param_mappings(arch):
        hf_grads = [params[n].grad for n in m.hf]
        grads[m.mcore] = hf_to_mcore(m, hf_grads, arch, arch.vocab_size)
    return {"loss": pg.item(), "grads": grads, "log_probs": log_probs.detach(), "entropy": entropy.detach()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def compare_grads(got: dict, want: dict, vocab: int, tol: float) -> float:
    assert set(got) == set(want), set(got) ^ set(want)
    worst = 0.0
    for name, g in want.items():
        x = got[name]
        if name.startswith("embedding") or name.startswith("output_layer"):
            assert torch.count_nonzero(x[vocab:]) == 0, f"{name}: gradient leaked into padded vocabulary rows"
            x = x[:vocab]
        worst = max(worst, rel_err(x, g))
    assert worst <= tol, f"worst relative gradient error {worst:.3e} > {tol}"
    return worst


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("loss_invariance"))


@pytest.mark.parametrize(
    "layout", [k for k in LAYOUTS if LAYOUTS[k][0] < 4] + [pytest.param("tp2_pp2_sp", marks=pytest.mark.slow)]
)
def test_layout_matches_float64_reference_and_single_rank(layout, tmp_root):
    base = run_layout("tp1_pp1_dp1_1mb", tmp_root)
    res = run_layout(layout, tmp_root)
    b = make_batch()
    mask = b["response_mask"].bool()
    for mode in MODES:
        ref = reference(mode)
        # Loss (sum over micro-batches and ranks of the globally normalised hook losses) = whole-batch loss.
        assert res[mode]["metrics"]["actor/pg_loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
        compare_grads(res[mode]["grads"], ref["grads"], 100, tol=1e-5)
        # Same numbers as the single-rank, single-micro-batch run (fp32 vs fp32).
        assert res[mode]["metrics"]["actor/pg_loss"] == pytest.approx(base[mode]["metrics"]["actor/pg_loss"], rel=1e-6)
        compare_grads(
            res[mode]["grads"],
            {k: v[:100] if k.startswith(("embedding", "output")) else v for k, v in base[mode]["grads"].items()},
            100,
            tol=1e-6,
        )
    # The on-policy update (old log-probs = the training forward's own, detached) equals the recomputed path.
    on, re = res["path:on_policy"], res["path:recomputed"]
    assert on["metrics"]["actor/pg_loss"] == pytest.approx(re["metrics"]["actor/pg_loss"], rel=1e-6, abs=1e-8)
    compare_grads(
        on["grads"],
        {k: v[:100] if k.startswith(("embedding", "output")) else v for k, v in re["grads"].items()},
        100,
        tol=1e-6,
    )
    from megatron_dapo.rollout.sync import logprob_diff_metrics

    mismatch = logprob_diff_metrics(res["log_probs"], res["rollout_log_probs"], b["response_mask"])
    for key, value in mismatch.items():  # computed from the training forward on the on-policy path
        assert on["metrics"][key] == pytest.approx(value, rel=1e-5), key
    assert "rollout/logprob_diff_mean" not in re["metrics"]
    # Length-aware micro-batches: never more padding than one micro-batch of the whole batch padded to its longest.
    lengths = (b["prompt_mask"].sum(-1) + b["response_mask"].sum(-1)).float()
    assert 1.0 <= on["metrics"]["perf/padding_ratio/update"] <= lengths.max() * len(lengths) / lengths.sum() + 1e-6
    ref = reference("token-mean")
    assert (res["log_probs"][mask] - ref["log_probs"][mask]).abs().max() < 1e-5
    assert (res["entropy"][mask] - ref["entropy"][mask]).abs().max() < 1e-5
    assert torch.all(res["log_probs"][~mask] == 0)
    # The overlapped reduction runs bucket by bucket (several buckets, so the backward has something to overlap).
    assert (res["grad_buckets"] > 5) == layout.endswith("overlap"), res["grad_buckets"]
