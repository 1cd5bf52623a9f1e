"""MoE router losses in the DAPO update of a tiny Qwen3-MoE actor (layer 0 dense, layers 1-3 MoE, 8 experts, top-2).

Against an independent float64 HF-transformers computation (``output_router_logits=True``, each row run on its own
valid tokens, the router losses written out by hand): the logged ``actor/moe_aux_loss`` / ``actor/moe_z_loss`` and
the gradient of DAPO loss + router losses. The z-loss is a global token mean: the same for one micro-batch, three
micro-batches of unequal token counts, DP = 2 and TP = 2 with sequence parallelism, and megatron-core's plain mean
over micro-batches and ranks (the control) is not. The load-balancing loss is the token-weighted mean of
per-micro-batch statistics.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from megatron_dapo.actor.actor import balance_rows, split_micro_batches
from megatron_dapo.algo.loss import LossNormalisers, dapo_loss
from megatron_dapo.config import ActorConfig, ConfigError, ParallelConfig, config_problems, load_config, raise_if_any
from megatron_dapo.models.builder import moe_config_kwargs, moe_router_coefficients
from megatron_dapo.models.families import model_arch_from_hf, param_mappings
from tests.distributed.loss_batch import TEMPERATURE, make_batch
from tests.helpers.torchrun import run_torchrun

WORKER = Path(__file__).with_name("moe_router_losses_worker.py")
AUX, Z = 0.1, 0.01
MICROS = (8, 3)  # one micro-batch of 8 rows per DP rank; rows in micro-batches of 3 (unequal token counts)
# name: (processes, TP, port, extra worker arguments). pp2-recompute: the routers' losses are made when a layer is
# recomputed in the backward, after the pipeline schedule ran later micro-batches' forwards.
LAYOUTS = {
    "dp1": (1, 1, 29791, []),
    "dp2": (2, 1, 29792, []),
    "tp2-sp": (2, 2, 29793, []),
    "pp2-recompute": (2, 1, 29794, ["--pp", "2", "--recompute", "full"]),
}
GRAD_RTOL_NORM = 5e-5  # per tensor, ||got - ref|| / ||ref|| (as tests/models/test_models_moe.py)
GRAD_RTOL_MAX = 1e-4  # per tensor, max|got - ref| / max|ref|


@functools.cache
def launch(nproc: int, root: str) -> None:
    """Every layout of ``nproc`` processes in one torchrun launch (the worker runs them in sequence)."""
    runs = []
    for layout, (n, tp, _, extra) in LAYOUTS.items():
        if n == nproc:
            micros = ",".join(map(str, MICROS))
            runs.append(["--out", f"{root}/{layout}", "--aux", str(AUX), "--z", str(Z), "--micros", micros])
            runs[-1] += ["--tp", str(tp), *extra]
    path = Path(root) / f"runs_w{nproc}.json"
    path.write_text(json.dumps(runs))
    port = min(port for n, _, port, _ in LAYOUTS.values() if n == nproc)
    run_torchrun(WORKER, nproc, [str(path)], port=port, timeout=600 * len(runs))


def worker(layout: str, root: str) -> dict:
    launch(LAYOUTS[layout][0], root)
    return torch.load(f"{root}/{layout}/result.pt")


def dp_size(layout: str) -> int:
    nproc, tp, _, extra = LAYOUTS[layout]
    pp = int(extra[extra.index("--pp") + 1]) if "--pp" in extra else 1
    return nproc // (tp * pp)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("moe_router_losses"))


def micro_batch_rows(world: int, micro: int) -> list[list[int]]:
    """The actor's micro-batches (global row indices) over all DP ranks."""
    b = make_batch()
    lengths = (b["prompt_mask"].sum(-1) + b["response_mask"].sum(-1)).tolist()
    groups = []
    for rows in balance_rows(lengths, world):
        for g in split_micro_batches([lengths[i] for i in rows], micro):
            groups.append([rows[j] for j in g])
    return groups


@functools.cache
def hf_model():
    from megatron_dapo.testing.tiny_models import make_tiny_hf_model

    hf = make_tiny_hf_model("qwen3_moe", seed=0, attn_implementation="eager")
    hf.config._experts_implementation = "eager"  # the per-expert loop (grouped_mm takes no float64)
    return hf.double()


def load_balancing(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """Switch-Transformer load balancing over the tokens of ``logits`` [T, E], megatron-core's per-layer scale:
    E/k · Σ_e f_e p_e, f_e = share of the T·k top-k assignments x k, p_e = mean softmax probability."""
    t, e = logits.shape
    probs = torch.softmax(logits, dim=-1)
    chosen = torch.zeros_like(probs).scatter(1, probs.topk(topk, dim=-1).indices, 1.0)
    f = chosen.sum(0) / t
    p = probs.sum(0) / t
    return e / topk * (f * p).sum()


@functools.cache
def reference(groups_key: tuple, aux: float, z: float) -> dict:
    """float64: DAPO loss of the whole batch + z · Σ_layers (global token mean of logsumexp²) + aux · Σ_layers
    Σ_micro-batches (n_mb / N) · load_balancing(micro-batch); its gradients by Megatron name and the two metrics
    (means over the MoE layers)."""
    from megatron_dapo.weights.layout import hf_to_mcore, padded_vocab_size, unfuse_hf_experts

    hf = hf_model()
    hf.zero_grad(set_to_none=True)
    arch = model_arch_from_hf(hf.config.to_dict())
    b = make_batch()
    rows, t_width = b["responses"].shape
    log_probs = torch.zeros(rows, t_width, dtype=torch.float64)
    router: list[list[torch.Tensor]] = []  # [row][layer] -> [n, E]
    for i in range(rows):
        p = b["prompts"][i][b["prompt_mask"][i].bool()]
        r = b["responses"][i][b["response_mask"][i].bool()]
        out = hf(input_ids=torch.cat([p, r])[None], output_router_logits=True)
        logp = torch.log_softmax(out.logits[0] / TEMPERATURE, -1)
        for t in range(len(r)):
            log_probs[i, t] = logp[len(p) - 1 + t, r[t]]
        router.append(list(out.router_logits))
    layers = len(router[0])
    assert layers == len(arch.moe_layers) == 3
    mask = b["loss_mask"].double()
    loss, _ = dapo_loss(
        log_probs,
        None,
        loss_mask=mask,
        response_mask=b["response_mask"].double(),
        advantages=b["advantages"].double(),
        cfg=ActorConfig(),
        norm=LossNormalisers.of(mask, max_response_length=t_width),
        old_log_probs=b["old_log_probs"].double(),
    )
    n_total = sum(x[0].shape[0] for x in router)
    z_layers = [sum((torch.logsumexp(x[k], -1) ** 2).sum() for x in router) / n_total for k in range(layers)]
    aux_layers = []
    for k in range(layers):
        value = 0.0
        for g in groups_key:
            logits = torch.cat([router[i][k] for i in g])
            value = value + logits.shape[0] / n_total * load_balancing(logits, arch.moe_router_topk)
        aux_layers.append(value)
    total = loss + z * sum(z_layers) + aux * sum(aux_layers)
    total.backward()
    grads = unfuse_hf_experts({n: p.grad for n, p in hf.named_parameters()})
    padded = padded_vocab_size(arch.vocab_size, 128, 1)
    return {
        "grads": {m.mcore: hf_to_mcore(m, [grads[n] for n in m.hf], arch, padded) for m in param_mappings(arch)},
        "aux_metric": float(sum(aux_layers).detach()) / layers,
        "z_metric": float(sum(z_layers).detach()) / layers,
    }


def grad_errors(got: dict, want: dict) -> tuple[float, float]:
    assert set(got) == set(want), set(got) ^ set(want)
    norm = worst_max = 0.0
    for name, ref in want.items():
        diff = got[name].double() - ref
        norm = max(norm, (diff.norm() / ref.norm().clamp(min=1e-30)).item())
        worst_max = max(worst_max, (diff.abs().max() / ref.abs().max().clamp(min=1e-30)).item())
    return norm, worst_max


def contribution(runs: dict, on: str, off: str) -> dict:
    return {k: runs[on]["grads"][k] - runs[off]["grads"][k] for k in runs[on]["grads"]}


def rel(a: dict, b: dict) -> float:
    num = sum(((a[k] - b[k]) ** 2).sum() for k in b)
    den = sum((b[k] ** 2).sum() for k in b)
    return float((num / den).sqrt())


SPLITS = [(layout, m) for layout in LAYOUTS for m in MICROS]


@pytest.mark.parametrize("layout,micro", SPLITS, ids=[f"{layout}-mb{m}" for layout, m in SPLITS])
def test_metrics_and_gradient_match_hf_float64(layout, micro, root):
    groups = micro_batch_rows(dp_size(layout), micro)
    ref = reference(tuple(map(tuple, groups)), AUX, Z)
    runs = worker(layout, root)["runs"]
    run = runs[f"both/mb{micro}"]
    m = run["metrics"]
    assert m["actor/moe_z_loss"] == pytest.approx(ref["z_metric"], rel=1e-6)
    assert m["actor/moe_aux_loss"] == pytest.approx(ref["aux_metric"], rel=1e-6)
    norm, worst = grad_errors(run["grads"], ref["grads"])
    assert norm <= GRAD_RTOL_NORM and worst <= GRAD_RTOL_MAX, (norm, worst)
    # z-loss only: the same reference without the load-balancing term
    ref_z = reference(tuple(map(tuple, groups)), 0.0, Z)
    norm, worst = grad_errors(runs[f"z/mb{micro}"]["grads"], ref_z["grads"])
    assert norm <= GRAD_RTOL_NORM and worst <= GRAD_RTOL_MAX, (norm, worst)
    # the load-balancing term alone (both - z only) against its reference contribution
    got = contribution(runs, f"both/mb{micro}", f"z/mb{micro}")
    want = {k: ref["grads"][k] - ref_z["grads"][k] for k in ref["grads"]}
    assert rel(got, want) <= 1e-4, rel(got, want)
    # the router losses matter: they move the gradient far beyond the tolerance
    assert rel(contribution(runs, f"both/mb{micro}", f"none/mb{micro}"), ref["grads"]) > 1e-2


def test_z_loss_is_invariant_to_the_micro_batch_and_dp_split(root):
    base_runs = worker("dp1", root)["runs"]
    base = contribution(base_runs, "z/mb8", "none/mb8")
    z_metric = base_runs["z/mb8"]["metrics"]["actor/moe_z_loss"]
    for layout, micro in SPLITS[1:]:
        runs = worker(layout, root)["runs"]
        assert len(micro_batch_rows(dp_size(layout), micro)) > 1 or LAYOUTS[layout][1] > 1 or LAYOUTS[layout][3]
        err = rel(contribution(runs, f"z/mb{micro}", f"none/mb{micro}"), base)
        # fp32 gradients; TP-merged ones carry ~2e-5 of their own against float64 (the test above)
        assert err <= (1e-5 if LAYOUTS[layout][1] == 1 else 5e-5), (layout, micro, err)
        assert runs[f"z/mb{micro}"]["metrics"]["actor/moe_z_loss"] == pytest.approx(z_metric, rel=1e-6)
        # megatron-core's plain mean over micro-batches and ranks depends on the split
        plain = rel(contribution(runs, f"z_plain/mb{micro}", f"none/mb{micro}"), base)
        if len(micro_batch_rows(dp_size(layout), micro)) > 1:
            assert plain > 1e-2, (layout, micro, plain)
            assert runs[f"z_plain/mb{micro}"]["metrics"]["actor/moe_z_loss"] != pytest.approx(z_metric, rel=1e-4)


def test_router_loss_coefficients_from_config():
    from megatron_dapo.testing.tiny_models import tiny_hf_config

    arch = model_arch_from_hf(tiny_hf_config("qwen3_moe").to_dict())
    assert arch.router_aux_loss_coef == 0.001 and arch.moe_router_topk == 2 and len(arch.moe_layers) == 3
    # None: HF's router_aux_loss_coef x topk / number of MoE layers; z-loss off
    assert moe_router_coefficients(arch, ActorConfig(moe_aux_loss_coeff=None)) == (pytest.approx(0.001 * 2 / 3), 0.0)
    assert moe_config_kwargs(arch, ParallelConfig(), ActorConfig())["moe_router_load_balancing_type"] == "none"
    kw = moe_config_kwargs(arch, ParallelConfig(), ActorConfig(moe_aux_loss_coeff=None))
    assert kw["moe_router_load_balancing_type"] == "aux_loss"
    assert kw["moe_aux_loss_coeff"] == pytest.approx(0.001 * 2 / 3) and kw["moe_z_loss_coeff"] is None
    kw = moe_config_kwargs(arch, ParallelConfig(), ActorConfig(moe_aux_loss_coeff=0.0, moe_z_loss_coeff=1e-3))
    assert kw["moe_router_load_balancing_type"] == "none" and kw["moe_aux_loss_coeff"] == 0.0
    assert kw["moe_z_loss_coeff"] == 1e-3
    explicit = moe_config_kwargs(arch, ParallelConfig(), ActorConfig(moe_aux_loss_coeff=0.02))
    assert explicit["moe_aux_loss_coeff"] == 0.02 and explicit["moe_router_load_balancing_type"] == "aux_loss"
    # no coefficient in the HF config: None means off
    no_coef = model_arch_from_hf(tiny_hf_config("qwen3_moe", router_aux_loss_coef=0.0).to_dict())
    assert moe_config_kwargs(no_coef, ParallelConfig())["moe_router_load_balancing_type"] == "none"
    # dense models ignore both
    dense = model_arch_from_hf(tiny_hf_config("qwen3").to_dict())
    assert moe_config_kwargs(dense, ParallelConfig(), ActorConfig(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.1)) == {}
    # the keys load and are range-checked
    cfg = load_config(None, ["actor.moe_aux_loss_coeff=0", "actor.moe_z_loss_coeff=0.001"])
    assert (cfg.actor.moe_aux_loss_coeff, cfg.actor.moe_z_loss_coeff) == (0.0, 0.001)
    assert load_config(None, []).actor.moe_aux_loss_coeff == 0.0  # off by default (RL recipes run MoE without it)
    assert load_config(None, ["actor.moe_aux_loss_coeff=null"]).actor.moe_aux_loss_coeff is None
    with pytest.raises(ConfigError, match=r"actor.moe_aux_loss_coeff=-0.1: expected null"):
        raise_if_any(config_problems(load_config(None, ["actor.moe_aux_loss_coeff=-0.1"])))
    with pytest.raises(ConfigError, match=r"actor.moe_z_loss_coeff=-1.0: expected a finite value >= 0"):
        raise_if_any(config_problems(load_config(None, ["actor.moe_z_loss_coeff=-1"])))
