"""torchrun worker for ``checkpointing.checkpoint`` (phase ``main``: world 2; phase ``dp1``: world 1).

Phase ``main`` (TP=1, DP=2), for two actors — ``fp32-plain`` (non-distributed optimizer) and ``bf16-distopt``
(Float16Module + distributed optimizer):
  1. two optimizer steps with random gradients, RNG advanced by a rank-dependent amount, ``save`` at step 2;
  2. snapshot what must come back: parameters, fp32 main parameters, Adam ``exp_avg``/``exp_avg_sq``/``step``,
     scheduler step and lr, the next draws of every generator (python, numpy, torch, megatron's TP tracker);
  3. one step with zero gradients (its update is made of the Adam moments, step count and weight decay only, so
     it is the same computation in any parallel layout) → full parameters ``P_cont`` (kept in ``<out>``);
  4. perturb parameters, scheduler and RNG; ``load``; compare with the snapshot (max |diff|, draws);
  5. the zero-gradient step again → compare with ``P_cont``;
  6. (bf16) a weights-only save (``save_optimizer=False``) and load: weights back, fp32 main params refreshed.
  ``bf16-distopt``'s save of step 2 is a background save (``save(blocking=False)``), finalised after steps 3-4
  changed the state: what loads is the state at ``save()``.
  Then ``max_ckpt_to_keep=2`` rotation over three saves, a crash inside a save (megatron-core's writer raises after
  the temporary directory exists), the state afterwards, and a successful re-save. Then at TP=2 (DP=1) in the same
  processes: the ``fp32-plain`` checkpoint loaded into a TP=2 actor (model and non-distributed optimizer reshard);
  the ``bf16-distopt`` checkpoint into a TP=2 distributed-optimizer actor (must refuse with a clear error).
Phase ``dp1``: the ``bf16-distopt`` checkpoint (saved at DP=2) loaded at DP=1, then the zero-gradient step. Then the
registered components (``CheckpointManager(states=...)``: trainer-like counters, an adaptive KL controller moved to a
known value, a prompt sampler part-way through its epoch): saved, loaded into fresh ones; and a copy of that
checkpoint rewritten as before components were registered (no ``trainer``/``kl_ctrl`` entries) loaded into fresh ones.
Rank r writes ``<out>/<phase>_rank<r>.json``; the test asserts. Imports stay inside functions: megatron-core's
checkpoint writer spawns a helper that re-imports this file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

TOTAL_STEPS = 20
DATA_STATE = {"epoch": 1, "position": 3, "seed": 7}
CASES = {"fp32-plain": ("fp32", False), "bf16-distopt": ("bf16", True)}
# Adaptive KL controller: initial coefficient, target, horizon, and the (current_kl, n_steps) updates before the save.
KL_SETUP = (0.05, 0.1, 100)
KL_UPDATES = ((0.13, 8), (0.5, 8), (0.02, 16))
# Entries of trainer_state.json before components were registered (format 1 as first written).
OLD_STATE_KEYS = (
    "format_version",
    "step",
    "data_state",
    "scheduler",
    "has_optimizer",
    "distributed_optimizer",
    "torch_adam_steps",
    "num_model_chunks",
    "layout",
    "saved_at",
)


def optim_config():
    from megatron_dapo.config import OptimConfig

    return OptimConfig(lr=1e-2, min_lr=1e-3, lr_warmup_steps=2, lr_decay_style="cosine", weight_decay=0.1)


def build(params_dtype: str, dist_opt: bool, tp: int = 1):
    from megatron_dapo.actor.optimizer import build_optimizer
    from tests.training.common import build_actor

    cfg, chunks = build_actor(params_dtype, dist_opt, tp)
    optimizer, scheduler = build_optimizer(chunks, optim_config(), TOTAL_STEPS)
    return cfg, chunks, optimizer, scheduler


def train_step(chunks, optimizer, scheduler, seed: int | None) -> None:
    """One optimizer step; gradients random (seeded per rank) or zero (``seed=None``)."""
    import torch
    import torch.distributed as dist

    from tests.training.common import named_params

    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    if seed is not None:
        g = torch.Generator().manual_seed(seed + 1000 * dist.get_rank())
        for _, p in named_params(chunks):
            p.main_grad.copy_(torch.randn(p.shape, generator=g) * 0.01)
    for chunk in chunks:
        chunk.finish_grad_sync()
    optimizer.step()
    scheduler.step(1)


def draws() -> dict[str, list[float]]:
    """The next values of every generator a rank owns (consumes them)."""
    import random

    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracker = torch.rand(3).tolist()
    return {
        "python": [random.random() for _ in range(3)],
        "numpy": np.random.rand(3).tolist(),
        "torch": torch.rand(3).tolist(),
        "tracker": tracker,
    }


def snapshot(chunks, optimizer, scheduler) -> dict[str, Any]:
    from tests.training.common import main_param_views, named_params

    views = main_param_views(optimizer)
    params, opt = {}, {}
    for name, p in named_params(chunks):
        params[name] = p.detach().clone()
        if p in views:
            main, state, _ = views[p]
            opt[name] = {"main": main.detach().clone(), **{k: v.detach().clone() for k, v in state.items()}}
    return {"params": params, "opt": opt, "num_steps": scheduler.num_steps, "lr": optimizer.param_groups[0]["lr"]}


def compare(before: dict, after: dict) -> dict[str, Any]:
    """Largest |difference| of parameters and of each optimizer state entry, and which entries were compared."""
    param_diff = max((before["params"][n] - p).abs().max().item() for n, p in after["params"].items())
    opt_diff: dict[str, float] = {}
    for name, entries in before["opt"].items():
        for key, value in entries.items():
            diff = (value.double() - after["opt"][name][key].double()).abs().max().item()
            opt_diff[key] = max(opt_diff.get(key, 0.0), diff)
    return {
        "param_max_diff": param_diff,
        "opt_max_diff": opt_diff,
        "num_params": len(after["params"]),
        "num_opt_params": len(before["opt"]),
        "steps": sorted({float(e["step"]) for e in before["opt"].values() if "step" in e}),
        "num_steps": [before["num_steps"], after["num_steps"]],
        "lr": [before["lr"], after["lr"]],
    }


def full_params(chunks) -> dict[str, Any]:
    """Full (TP-gathered) Megatron tensors by global name, float64, through the weights layout module."""
    from megatron_dapo.weights.model_io import iter_full_tensors
    from tests.training.common import tiny_arch

    return {m.mcore: t.detach().double().clone() for m, t in iter_full_tensors(chunks, tiny_arch())}


def max_full_diff(a: dict, b: dict) -> float:
    """Largest |a - b| over all tensors. The padded vocabulary grows with TP (128 rows at TP=1, 256 at TP=2):
    embedding/output rows are compared over the rows both have (megatron-core loads those and leaves the extra
    padding rows as initialised, its ``allow_shape_mismatch``)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst = 0.0
    for k in a:
        x, y = a[k], b[k]
        if x.shape != y.shape:
            assert x.shape[1:] == y.shape[1:] and k.endswith(("word_embeddings.weight", "output_layer.weight")), k
            rows = min(x.shape[0], y.shape[0])
            x, y = x[:rows], y[:rows]
        worst = max(worst, (x - y).abs().max().item())
    return worst


def weights_only(chunks, optimizer, scheduler, save_dir: Path) -> dict[str, Any]:
    """``save_optimizer=False``: loading restores the weights and refreshes the optimizer's fp32 main parameters
    from them (bf16: otherwise the next step would start from the stale main copy)."""
    import torch

    from megatron_dapo.checkpointing.checkpoint import CheckpointManager
    from tests.training.common import main_param_views, named_params

    manager = CheckpointManager(save_dir)
    path = manager.save(3, chunks, optimizer, scheduler, save_optimizer=False)
    saved = {n: p.detach().clone() for n, p in named_params(chunks)}
    with torch.no_grad():
        for main, _, _ in main_param_views(optimizer).values():
            main.add_(1.0)
        for _, p in named_params(chunks):
            p.add_(0.5)
    info = manager.load(path, chunks, optimizer, scheduler)
    views = main_param_views(optimizer)
    main_vs_model = max(
        (views[p][0].reshape(-1) - p.detach().float().reshape(-1)[views[p][2]]).abs().max().item()
        for _, p in named_params(chunks)
        if p in views
    )
    return {
        "optimizer_restored": info["optimizer_restored"],
        "param_max_diff": max((saved[n] - p).abs().max().item() for n, p in named_params(chunks)),
        "main_vs_model_max_diff": main_vs_model,
        "has_optimizer": json.loads((path / "trainer_state.json").read_text())["has_optimizer"],
    }


def round_trip(case: str, out: Path) -> dict[str, Any]:
    import random
    import time

    import numpy as np
    import psutil
    import torch
    import torch.distributed as dist

    from megatron_dapo.checkpointing.checkpoint import CheckpointManager
    from megatron_dapo.config import to_dict
    from tests.training.common import main_param_views

    cfg, chunks, optimizer, scheduler = build(*CASES[case])
    rank = dist.get_rank()
    for step in (1, 2):
        train_step(chunks, optimizer, scheduler, seed=step)
    # Give every rank its own generator states, so restoring another rank's file would show.
    for _ in range(1 + 2 * rank):
        random.random()
    np.random.rand(1 + rank)
    torch.rand(1 + rank)
    manager = CheckpointManager(out / case)
    # bf16-distopt saves in the background, finalised only after the state is changed below: it must hold this one.
    background = case == "bf16-distopt"
    t0 = time.perf_counter()
    kwargs = {"data_state": DATA_STATE, "config": to_dict(cfg), "blocking": not background}
    path = manager.save(2, chunks, optimizer, scheduler, **kwargs)
    save_seconds = time.perf_counter() - t0
    # Whatever the save started (off the CPU megatron-core's results manager) and left running.
    children = [" ".join(c.cmdline()[:4]) for c in psutil.Process().children(recursive=True)]
    before = snapshot(chunks, optimizer, scheduler)
    expected_draws = draws()
    saved_full = full_params(chunks)

    train_step(chunks, optimizer, scheduler, seed=None)
    continued = full_params(chunks)
    if rank == 0:
        torch.save({"saved": saved_full, "continued": continued}, out / f"{case}-reference.pt")

    with torch.no_grad():
        for main, state, _ in main_param_views(optimizer).values():
            main.add_(1.0)
            state["exp_avg"].mul_(2.0)
            state["exp_avg_sq"].add_(1.0)
        for chunk in chunks:
            for p in chunk.parameters():
                p.add_(0.5)
    scheduler.step(3)
    draws()
    perturbed = snapshot(chunks, optimizer, scheduler)
    if background:
        assert manager.finalize() == path

    t0 = time.perf_counter()
    info = manager.load(path, chunks, optimizer, scheduler)
    load_seconds = time.perf_counter() - t0
    after = snapshot(chunks, optimizer, scheduler)
    got_draws = draws()
    train_step(chunks, optimizer, scheduler, seed=None)
    continued_diff = max_full_diff(full_params(chunks), continued)
    weights = None
    if case.startswith("bf16"):
        weights = weights_only(chunks, optimizer, scheduler, out / f"{case}-weights-only")
    return {
        "seconds": {"save": save_seconds, "load": load_seconds},
        "children_after_save": children,
        "weights_only": weights,
        "path": str(path),
        "loaded": compare(before, after),
        "perturbed": compare(before, perturbed),
        "expected_draws": expected_draws,
        "draws_after_load": got_draws,
        "info": {k: (str(v) if isinstance(v, Path) else v) for k, v in info.items() if k != "config"},
        "config_round_trip": info["config"] == to_dict(cfg),
        "continued_max_diff": continued_diff,
        "saved_vs_continued": max_full_diff(saved_full, continued),
    }


def rotation_and_crash(out: Path) -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_dapo.checkpointing.checkpoint import CheckpointManager, resolve_resume

    def listing(d: Path) -> list[str]:
        manager.wait_for_cleanup()  # rank 0 deletes rotated-out checkpoints in the background
        dist.barrier()
        names = sorted(p.name for p in d.iterdir())
        dist.barrier()  # every rank has looked before any starts the next save
        return names

    _, chunks, optimizer, scheduler = build("fp32", False)
    save_dir = out / "rotation"
    manager = CheckpointManager(save_dir, max_ckpt_to_keep=2)
    result: dict[str, Any] = {"after_each_save": []}
    for step in (1, 2, 3):
        train_step(chunks, optimizer, scheduler, seed=step)
        manager.save(step, chunks, optimizer, scheduler, data_state={"position": step})
        result["after_each_save"].append(listing(save_dir))

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash while writing the checkpoint")

    real_save = dist_checkpointing.save
    dist_checkpointing.save = crash
    try:
        manager.save(4, chunks, optimizer, scheduler, data_state={"position": 4})
        result["crash_raised"] = None
    except RuntimeError as e:
        result["crash_raised"] = str(e)
    finally:
        dist_checkpointing.save = real_save
    result["after_crash"] = listing(save_dir)
    result["latest_after_crash"] = (save_dir / "latest").read_text().strip()
    result["resume_after_crash"] = str(resolve_resume("auto", save_dir))
    manager.save(4, chunks, optimizer, scheduler, data_state={"position": 4})
    result["after_resave"] = listing(save_dir)
    result["latest_after_resave"] = (save_dir / "latest").read_text().strip()
    return result


def reshard_tp2(out: Path) -> dict[str, Any]:
    """fp32-plain checkpoint (TP=1, DP=2) into a TP=2 actor; bf16-distopt checkpoint into TP=2 must be refused."""
    import torch

    from megatron_dapo.checkpointing.checkpoint import CheckpointError, CheckpointManager

    ref = torch.load(out / "fp32-plain-reference.pt")
    _, chunks, optimizer, scheduler = build("fp32", False, tp=2)
    step_dir = out / "fp32-plain" / "global_step_2"
    info = CheckpointManager(out / "fp32-plain").load(step_dir, chunks, optimizer, scheduler)
    loaded_diff = max_full_diff(full_params(chunks), ref["saved"])
    train_step(chunks, optimizer, scheduler, seed=None)
    result = {
        "info": {k: v for k, v in info.items() if k in ("step", "data_state", "optimizer_restored", "rng_restored")},
        "num_steps": scheduler.num_steps,
        "loaded_max_diff": loaded_diff,
        "continued_max_diff": max_full_diff(full_params(chunks), ref["continued"]),
    }
    _, chunks, optimizer, scheduler = build("bf16", True, tp=2)
    try:
        step_dir = out / "bf16-distopt" / "global_step_2"
        CheckpointManager(out / "bf16-distopt").load(step_dir, chunks, optimizer, scheduler)
        result["distopt_tp_change_error"] = None
    except CheckpointError as e:
        result["distopt_tp_change_error"] = str(e)
    return result


def reshard_dp1(out: Path) -> dict[str, Any]:
    """bf16-distopt checkpoint saved at DP=2 loaded at DP=1 (world 1)."""
    import torch

    from megatron_dapo.checkpointing.checkpoint import CheckpointManager

    ref = torch.load(out / "bf16-distopt-reference.pt")
    _, chunks, optimizer, scheduler = build("bf16", True)
    info = CheckpointManager(out / "bf16-distopt").load(
        out / "bf16-distopt" / "global_step_2", chunks, optimizer, scheduler
    )
    loaded_diff = max_full_diff(full_params(chunks), ref["saved"])
    train_step(chunks, optimizer, scheduler, seed=None)
    return {
        "info": {k: v for k, v in info.items() if k in ("step", "data_state", "optimizer_restored", "rng_restored")},
        "num_steps": scheduler.num_steps,
        "loaded_max_diff": loaded_diff,
        "continued_max_diff": max_full_diff(full_params(chunks), ref["continued"]),
    }


class Counters:
    """A trainer-like component: run counters, a field missing from the loaded state keeps its value."""

    def __init__(self) -> None:
        self.num_skipped_updates = 0
        self.num_partial_batches = 0

    def state_dict(self) -> dict[str, int]:
        return {"num_skipped_updates": self.num_skipped_updates, "num_partial_batches": self.num_partial_batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("num_skipped_updates", "num_partial_batches"):
            if key in state:
                setattr(self, key, int(state[key]))


def components() -> dict[str, Any]:
    from megatron_dapo.algo.kl import AdaptiveKLController
    from megatron_dapo.data import PromptSampler

    return {
        "trainer": Counters(),
        "kl_ctrl": AdaptiveKLController(*KL_SETUP),
        "data_state": PromptSampler(10, 2, shuffle=True, seed=3),
    }


def states_of(parts: dict[str, Any]) -> dict[str, Any]:
    return {name: part.state_dict() for name, part in parts.items()}


def as_old_checkpoint(step_dir: Path, dest: Path) -> Path:
    """A copy of ``step_dir`` whose trainer_state.json has only the entries written before components were
    registered (its manifest record updated, so that the copy is intact)."""
    import shutil

    from megatron_dapo.weights.integrity import FileRecord, file_crc32, read_manifest, write_manifest

    shutil.copytree(step_dir, dest)
    path = dest / "trainer_state.json"
    state = json.loads(path.read_text())
    path.write_text(json.dumps({k: state[k] for k in OLD_STATE_KEYS}, indent=2))
    records = read_manifest(dest)
    records["trainer_state.json"] = FileRecord("trainer_state.json", *file_crc32(path))
    write_manifest(dest, records.values())
    return dest


def registered_states(out: Path) -> dict[str, Any]:
    """World 1: components saved with a checkpoint and restored in place; an older checkpoint keeps the defaults."""
    import logging

    from megatron_dapo.checkpointing.checkpoint import CheckpointManager

    warnings: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("megatron_dapo.checkpoint").addHandler(Capture())
    _, chunks, optimizer, scheduler = build("fp32", False)
    train_step(chunks, optimizer, scheduler, seed=1)  # an optimizer with state to save
    saved = components()
    saved["trainer"].num_skipped_updates, saved["trainer"].num_partial_batches = 3, 1
    for current_kl, n_steps in KL_UPDATES:
        saved["kl_ctrl"].update(current_kl, n_steps)
    for _ in range(3):
        saved["data_state"].next_batch()
    path = CheckpointManager(out / "states", states=saved).save(5, chunks, optimizer, scheduler)
    fresh = components()
    info = CheckpointManager(out / "states", states=fresh).load(path, chunks, optimizer, scheduler)
    result: dict[str, Any] = {
        "saved": states_of(saved),
        "loaded": states_of(fresh),
        "missing": info["missing_states"],
        "data_state": info["data_state"],
        "file": json.loads((path / "trainer_state.json").read_text()),
        "warnings": list(warnings),
    }
    old = as_old_checkpoint(path, out / "states-old" / path.name)
    fresh = components()
    warnings.clear()
    info = CheckpointManager(old.parent, states=fresh).load(old, chunks, optimizer, scheduler)
    result["old"] = {
        "step": info["step"],
        "loaded": states_of(fresh),
        "missing": info["missing_states"],
        "warnings": list(warnings),
    }
    return result


def main() -> None:
    import time

    import torch.distributed as dist

    from megatron_dapo.parallel import destroy_model_parallel

    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("main", "dp1"), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    started = time.perf_counter()
    if args.phase == "main":
        result = {case: round_trip(case, out) for case in CASES}
        result["rotation"] = rotation_and_crash(out)
        result["tp2"] = reshard_tp2(out)
    else:
        result = {"dp1": reshard_dp1(out), "states": registered_states(out)}
    result["seconds"] = time.perf_counter() - started
    (out / f"{args.phase}_rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=1))
    destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
