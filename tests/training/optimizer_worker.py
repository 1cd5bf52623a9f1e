"""torchrun worker (world 2): ``build_optimizer`` against a float64 hand-written AdamW, and its lr schedule.

For each case (precision × plain/distributed optimizer × TP) every rank builds the tiny actor the trainer's way,
then runs two optimizer steps with known gradients written into megatron's grad buffers (``main_grad``), different
on each DP rank, reduced by the DDP wrapper (``finish_grad_sync``: all-reduce, or reduce-scatter for the distributed
optimizer). Step 1's gradients have a global norm far above ``clip_grad`` (clipping active), step 2's far below.
The reference, in float64, from the parameters' initial values: DP-mean gradient; global L2 norm over the model
(TP-sharded parameters summed over the TP group, replicated ones counted once); clip factor clip/(norm + 1e-6)
when < 1; AdamW with bias correction and decoupled weight decay on >= 2-D parameters only (megatron-core's default
grouping). Recorded per case: the largest relative error of the model parameters and of their updates against the
reference, of the fp32 main parameters (bf16 cases), how far bf16 parameters are beyond round-to-nearest of the
reference, how many differ from their main parameter rounded, and both grad norms.
The schedule part records the lr (and per-group weight decay) at steps 0..N for the three decay styles.
Rank r writes ``<out>/rank<r>.json``; the test asserts.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

CASES = {
    "fp32-plain": dict(params_dtype="fp32", dist_opt=False, tp=1),
    "fp32-distopt": dict(params_dtype="fp32", dist_opt=True, tp=1),
    "bf16-plain": dict(params_dtype="bf16", dist_opt=False, tp=1),
    "bf16-distopt": dict(params_dtype="bf16", dist_opt=True, tp=1),
    "fp32-tp2": dict(params_dtype="fp32", dist_opt=False, tp=2),
}
OPTIM = dict(lr=1e-2, min_lr=0.0, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0)
# Per-element std, powers of two: step 1 global norm ~ 2^-5 * sqrt(78k) ~ 9 (clipped), step 2 ~ 2e-3 (not clipped).
GRAD_SCALES = (2.0**-5, 2.0**-17)
SCHEDULE_TOTAL = 8


def known_grad(name: str, shape, step: int, dp_rank: int) -> torch.Tensor:
    from tests.training.common import name_seed

    # Dyadic values (integers / 2^10 times a power of two): their DP mean is exact in fp32. Adam is scale-free per
    # element, so a rounding error in a near-cancelling DP sum would flip the sign of that element's update.
    g = torch.Generator().manual_seed(name_seed(name, step, dp_rank))
    return torch.round(torch.randn(shape, generator=g, dtype=torch.float64) * 2**10) / 2**10 * GRAD_SCALES[step - 1]


def run_case(name: str, spec: dict) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_dapo.actor.optimizer import build_optimizer
    from megatron_dapo.config import OptimConfig
    from tests.training.common import build_actor, main_param_views, named_params

    cfg, chunks = build_actor(spec["params_dtype"], spec["dist_opt"], spec["tp"])
    optimizer, scheduler = build_optimizer(chunks, OptimConfig(**OPTIM), total_steps=10)
    params = named_params(chunks)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    tp_group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()

    # float64 reference state, per local parameter (TP shard when sharded; full otherwise).
    ref = {n: p.detach().double().clone() for n, p in params}
    init = {n: t.clone() for n, t in ref.items()}
    m = {n: torch.zeros_like(t) for n, t in ref.items()}
    v = {n: torch.zeros_like(t) for n, t in ref.items()}
    b1, b2, eps = OPTIM["adam_beta1"], OPTIM["adam_beta2"], OPTIM["adam_eps"]
    lr, wd = OPTIM["lr"], OPTIM["weight_decay"]
    norms = []
    for step in (1, 2):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        grads = {}
        for n, p in params:
            p.main_grad.copy_(known_grad(n, p.shape, step, dp_rank))
            grads[n] = sum(known_grad(n, p.shape, step, r) for r in range(dp)) / dp
        for chunk in chunks:
            chunk.finish_grad_sync()
        ok, grad_norm, _ = optimizer.step()
        scheduler.step(1)

        sharded_sq = torch.zeros((), dtype=torch.float64)
        replicated_sq = torch.zeros((), dtype=torch.float64)
        for n, p in params:
            if tp > 1 and getattr(p, "tensor_model_parallel", False):
                sharded_sq += grads[n].pow(2).sum()
            else:
                replicated_sq += grads[n].pow(2).sum()
        dist.all_reduce(sharded_sq, group=tp_group)
        norm = math.sqrt((sharded_sq + replicated_sq).item())
        coeff = OPTIM["clip_grad"] / (norm + 1e-6)
        norms.append({"megatron": float(grad_norm), "reference": norm, "clipped": coeff < 1.0, "ok": bool(ok)})
        for n, p in params:
            g = grads[n] * min(coeff, 1.0)
            m[n] = b1 * m[n] + (1 - b1) * g
            v[n] = b2 * v[n] + (1 - b2) * g * g
            decay = wd if p.dim() >= 2 and not n.endswith(".bias") else 0.0
            denom = (v[n] / (1 - b2**step)).sqrt() + eps
            ref[n] = ref[n] * (1 - lr * decay) - lr * (m[n] / (1 - b1**step)) / denom

    views = main_param_views(optimizer)
    param_rel = update_rel = main_rel = 0.0
    bf16_excess = -1.0
    covered = bf16_mismatch = 0
    for n, p in params:
        r, p64 = ref[n], p.detach().double()
        update = r - init[n]
        if spec["params_dtype"] == "fp32":
            param_rel = max(param_rel, ((p64 - r).abs().max() / r.abs().max()).item())
            update_rel = max(update_rel, (((p64 - init[n]) - update).abs().max() / update.abs().max()).item())
            continue
        # bf16 model parameters are the fp32 main parameters rounded to nearest: exactly that where this rank holds
        # the main parameter, and within half a bf16 ulp (<= 2^-8 relative) of the reference everywhere, up to the
        # main parameters' own fp32 error (absolute, relative to the tensor's scale).
        excess = ((p64 - r).abs() - 2**-8 * r.abs()).max() / r.abs().max()
        bf16_excess = max(bf16_excess, excess.item())
        if p in views:  # the distributed optimizer holds only the parameters overlapping this rank's shard
            main, _, sl = views[p]
            covered += sl.stop - sl.start
            bf16_mismatch += int((p.detach().reshape(-1)[sl] != main.detach().reshape(-1).to(p.dtype)).sum())
            main64 = main.detach().double().reshape(-1)
            r_flat, u_flat = r.reshape(-1)[sl], update.reshape(-1)[sl]
            main_rel = max(main_rel, ((main64 - r_flat).abs().max() / r.abs().max()).item())
            u_err = (main64 - init[n].reshape(-1)[sl] - u_flat).abs().max() / update.abs().max()
            update_rel = max(update_rel, u_err.item())
    return {
        "optimizer_types": [type(o).__name__ for o in getattr(optimizer, "chained_optimizers", [optimizer])],
        "param_rel": param_rel,
        "update_rel": update_rel,
        "main_rel": main_rel,
        "bf16_excess": bf16_excess,
        "bf16_mismatch": bf16_mismatch,
        "norms": norms,
        "dp": dp,
        "main_elements": covered,
        "model_elements": sum(p.numel() for _, p in params),
        "tp": tp,
    }


def run_schedules() -> dict:
    from megatron_dapo.actor.optimizer import build_optimizer
    from megatron_dapo.config import OptimConfig
    from tests.training.common import build_actor

    _, chunks = build_actor("fp32", False, 1)
    out = {}
    variants = {
        "constant": dict(lr_decay_style="constant", lr_warmup_steps_ratio=0.25),
        "cosine": dict(lr_decay_style="cosine", lr_warmup_steps_ratio=0.25),
        "linear": dict(lr_decay_style="linear", lr_warmup_steps=3, lr_warmup_steps_ratio=0.5),
    }
    for style, kw in variants.items():
        optim = OptimConfig(lr=2e-3, min_lr=2e-4, weight_decay=0.05, **kw)
        optimizer, scheduler = build_optimizer(chunks, optim, total_steps=SCHEDULE_TOTAL)
        lrs, wds = [], []
        for _ in range(SCHEDULE_TOTAL + 3):
            lrs.append(sorted({g["lr"] for g in optimizer.param_groups}))
            wds.append(sorted({g["weight_decay"] for g in optimizer.param_groups}))
            scheduler.step(1)
        out[style] = {"lrs": lrs, "wds": wds}
    return out


def main() -> None:
    import time

    started = time.perf_counter()
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {"cases": {name: run_case(name, spec) for name, spec in CASES.items()}, "schedules": run_schedules()}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result["seconds"] = time.perf_counter() - started
    (Path(args.out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=1))
    from megatron_dapo.parallel import destroy_model_parallel

    destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
