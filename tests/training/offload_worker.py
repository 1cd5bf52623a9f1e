"""torchrun worker (world 2): the memory hand-off on a real megatron-core actor + optimizer + frozen reference.

The CPU platform offloads nothing by declaration, so this worker installs ``CountingPlatform``: the CPU platform
with every component planned for offload and every device move counted (which storages were released, restored,
copied, and their bytes). For each case (fp32 / bf16 Float16 optimizer × plain / distributed optimizer):

* two identical actors are built from the same seed; both take an optimizer step with known gradients, then fresh
  gradients are written into the grad buffers (so grads, optimizer state and fp32 main params all hold data);
* actor A goes through one full hand-off cycle (``MemoryHandoff.before_rollout`` … ``before_update``) with checks
  at each boundary: while offloaded every storage of the component has 0 bytes; after onload every parameter,
  grad buffer, ``main_grad``, optimizer state tensor and fp32 main parameter is ``torch.equal`` to its snapshot;
* then both actors take a second optimizer step on the same gradients and must end bit-identical (so the aliasing
  between model params, grad buffers, main params and optimizer state survived the hand-off);
* a second cycle with ``keep_grad_values=False``: grads come back as zeros, everything else bit-exact.

The rollout engine is a recorder of its sleep/wake calls (vLLM's sleep mode needs a GPU/NPU; CPU has none), so
the call order of the documented sequence is checked. Rank r writes ``<out>/rank<r>.json``; the test asserts.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from megatron_dapo.parallel import teardown
from megatron_dapo.platform.base import HandoffDefaults
from megatron_dapo.platform.cpu import CpuPlatform

CASES = {
    "fp32-plain": dict(params_dtype="fp32", dist_opt=False),
    "fp32-distopt": dict(params_dtype="fp32", dist_opt=True),
    "bf16-plain": dict(params_dtype="bf16", dist_opt=False),
    "bf16-distopt": dict(params_dtype="bf16", dist_opt=True),
}
OPTIM = dict(lr=1e-2, min_lr=0.0, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0)


class CountingPlatform(CpuPlatform):
    """CPU platform that plans every offload and counts every device move (stands in for GPU/NPU memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = {"host_buffer": 0, "copy_to_host": 0, "copy_to_device": 0, "release": 0, "restore": 0}
        self.released_bytes = 0
        self.restored_bytes = 0
        self.live_released: set[int] = set()

    def memory_handoff_defaults(self) -> HandoffDefaults:
        return HandoffDefaults(params=True, grads=True, optimizer=True, reference=True, sleep_level=2, grad_values=True)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        self.calls["host_buffer"] += 1
        return super().host_buffer(nbytes)

    def copy_to_host(self, host: torch.Tensor, device_bytes: torch.Tensor) -> None:
        self.calls["copy_to_host"] += 1
        super().copy_to_host(host, device_bytes)

    def copy_to_device(self, device_bytes: torch.Tensor, host: torch.Tensor) -> None:
        self.calls["copy_to_device"] += 1
        super().copy_to_device(device_bytes, host)

    def release_storage(self, storage: torch.UntypedStorage) -> None:
        self.calls["release"] += 1
        self.released_bytes += storage.nbytes()
        self.live_released.add(storage._cdata)
        super().release_storage(storage)

    def restore_storage(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        self.calls["restore"] += 1
        self.restored_bytes += nbytes
        self.live_released.discard(storage._cdata)
        super().restore_storage(storage, nbytes)


class RecordingEngine:
    """Records the hand-off's engine calls (vLLM sleep mode does not exist on CPU)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def wake_up(self, tags=None) -> None:
        self.calls.append(f"wake:{','.join(tags or [])}")

    def sleep(self, level: int = 1) -> None:
        self.calls.append(f"sleep:{level}")


def known_grads(params, step: int, dp_rank: int) -> None:
    from tests.training.common import name_seed

    for n, p in params:
        g = torch.Generator().manual_seed(name_seed(n, step, dp_rank))
        p.main_grad.copy_(torch.randn(p.shape, generator=g) * 2.0**-6)


def opt_step(chunks, optimizer, params, step: int, dp_rank: int) -> None:
    for c in chunks:
        c.zero_grad_buffer()
    optimizer.zero_grad()
    known_grads(params, step, dp_rank)
    for c in chunks:
        c.finish_grad_sync()
    optimizer.step()


def snapshot(chunks, optimizer, ref_chunks) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor the hand-off must preserve, cloned, by component and name (only call it on components that are
    on the device: reading an offloaded storage reads freed memory)."""
    from megatron_dapo.handoff.offload import _sub_optimizers
    from tests.training.common import named_params

    params, grads, opt, ref = {}, {}, {}, {}
    for n, p in named_params(chunks):
        params[n] = p.detach().clone()
        grads[f"main_grad:{n}"] = p.main_grad.detach().clone()
    for i, c in enumerate(chunks):
        for j, b in enumerate(c.buffers):
            grads[f"grad_data:{i}.{j}"] = b.grad_data.clone()
            if b.param_data is not None:
                params[f"param_data:{i}.{j}"] = b.param_data.clone()
    for k, sub in enumerate(_sub_optimizers(optimizer) if optimizer is not None else []):
        inner = sub.optimizer
        for g, group in enumerate(inner.param_groups):
            for i, p in enumerate(group["params"]):
                opt[f"main:{k}.{g}.{i}"] = p.detach().clone()
                for key, v in inner.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        opt[f"state:{k}.{g}.{i}.{key}"] = v.clone()
    for n, p in named_params(ref_chunks):
        ref[n] = p.detach().clone()
    return {"params": params, "grads": grads, "optimizer": opt, "reference": ref}


def snapshot_params(chunks) -> dict[str, torch.Tensor]:
    from tests.training.common import named_params

    out = {n: p.detach().clone() for n, p in named_params(chunks)}
    for i, c in enumerate(chunks):
        for j, b in enumerate(c.buffers):
            if b.param_data is not None:
                out[f"param_data:{i}.{j}"] = b.param_data.clone()
    return out


def compare(before: dict, after: dict) -> list[str]:
    """Names whose tensors differ (value, dtype or shape)."""
    bad = [n for n in before if n not in after or not torch.equal(before[n], after[n])]
    return bad + [n for n in after if n not in before]


def sizes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def run_case(name: str, spec: dict, platform: CountingPlatform) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_dapo.actor.optimizer import build_optimizer
    from megatron_dapo.config import OptimConfig
    from megatron_dapo.config.plan import resolve_handoff_plan
    from megatron_dapo.handoff.offload import (
        MemoryHandoff,
        grad_tensors,
        optimizer_tensors,
        param_tensors,
        reference_tensors,
    )
    from megatron_dapo.models.builder import build_gpt_chunks, freeze
    from tests.training.common import build_actor, named_params, tiny_arch

    actors = []
    for _ in range(2):
        cfg, chunks = build_actor(spec["params_dtype"], spec["dist_opt"])
        optimizer, _ = build_optimizer(chunks, OptimConfig(**OPTIM), total_steps=10)
        actors.append((chunks, optimizer))
    dp_rank = ps.get_data_parallel_rank()
    ref_chunks = freeze(build_gpt_chunks(tiny_arch(), cfg.model, cfg.parallel, cfg.actor))
    (chunks, optimizer), (ctl_chunks, ctl_optimizer) = actors
    params, ctl_params = named_params(chunks), named_params(ctl_chunks)
    for c, o, p in ((chunks, optimizer, params), (ctl_chunks, ctl_optimizer, ctl_params)):
        opt_step(c, o, p, 1, dp_rank)
        known_grads(p, 2, dp_rank)  # grads for the second step sit in the buffers during the hand-off
    res: dict = {"optimizer_types": [type(o).__name__ for o in getattr(optimizer, "chained_optimizers", [optimizer])]}

    def comp_sizes() -> dict[str, int]:
        return {
            "params": sizes(param_tensors(chunks)),
            "grads": sizes(grad_tensors(chunks, optimizer)),
            "optimizer": sizes(optimizer_tensors(optimizer, exclude=param_tensors(chunks))),
            "reference": sizes(reference_tensors(ref_chunks)),
        }

    res["sizes_start"] = comp_sizes()
    res["n_optimizer_tensors"] = len(optimizer_tensors(optimizer, exclude=param_tensors(chunks)))
    res["n_reference_storages"] = len({int(t.untyped_storage()._cdata) for t in reference_tensors(ref_chunks)})
    before = snapshot(chunks, optimizer, ref_chunks)
    for keep in (True, False):
        tag = "keep" if keep else "discard"
        planned = resolve_handoff_plan(cfg.actor, cfg.ref, cfg.rollout, cfg.trainer, platform)
        plan = replace(planned, keep_grad_values=keep)
        handoff = MemoryHandoff(platform, plan, chunks, optimizer, ref_chunks)
        engine = RecordingEngine()
        calls0 = dict(platform.calls)
        platform.live_released.clear()  # earlier cases' references are garbage; this case's state is all on device
        at_sync: dict = {}

        def sync_fn(at_sync: dict = at_sync) -> str:
            at_sync.update(comp_sizes())
            return "synced"

        res[f"{tag}_sync_returned"] = handoff.before_rollout(engine, sync_fn)
        res[f"{tag}_sizes_at_sync"] = at_sync
        res[f"{tag}_sizes_rollout"] = comp_sizes()
        res[f"{tag}_live_released_rollout"] = len(platform.live_released)
        handoff.after_rollout(engine)
        res[f"{tag}_sizes_old_logprobs"] = comp_sizes()
        res[f"{tag}_params_after_rollout_bad"] = compare(before["params"], snapshot_params(chunks))
        handoff.before_reference()
        res[f"{tag}_sizes_reference"] = comp_sizes()
        res[f"{tag}_reference_bad"] = compare(before["reference"], snapshot([], None, ref_chunks)["reference"])
        handoff.after_reference()
        res[f"{tag}_sizes_between"] = comp_sizes()
        handoff.before_update()
        res[f"{tag}_sizes_update"] = comp_sizes()
        res[f"{tag}_live_released_update"] = len(platform.live_released)
        after = snapshot(chunks, optimizer, [])  # the reference stays offloaded until the next before_reference
        if keep:
            res["keep_bad"] = {k: compare(before[k], after[k]) for k in ("params", "grads", "optimizer")}
        else:
            res["discard_bad"] = {k: compare(before[k], after[k]) for k in ("params", "optimizer")}
            res["discard_grads_all_zero"] = all(not bool(t.any()) for t in after["grads"].values())
            res["discard_grads_were_nonzero"] = sum(bool(t.any()) for t in before["grads"].values())
        handoff.end_step()
        res[f"{tag}_engine_calls"] = engine.calls
        res[f"{tag}_platform_calls"] = {k: platform.calls[k] - calls0[k] for k in platform.calls}
        res[f"{tag}_moved_bytes"] = dict(handoff.offloader.stats.bytes)
        res[f"{tag}_host_buffer_bytes"] = dict(handoff.offloader.stats.host_bytes)
        res[f"{tag}_storages"] = dict(handoff.offloader.stats.storages)
        res[f"{tag}_metrics_keys"] = sorted(handoff.metrics())
        if keep:
            # Second step on the same gradients, on the handed-off actor and on the control: must agree exactly.
            for c, o, p in ((chunks, optimizer, params), (ctl_chunks, ctl_optimizer, ctl_params)):
                opt_step(c, o, p, 2, dp_rank)
            res["step2_params_bad"] = [
                n for (n, a), (_, b) in zip(params, ctl_params) if not torch.equal(a.detach(), b.detach())
            ]
            res["step2_changed"] = sum(not torch.equal(a.detach(), before["params"][n]) for n, a in params)
            known_grads(params, 3, dp_rank)
            handoff.before_reference()  # bring the reference back for the snapshot of the next cycle
            before = snapshot(chunks, optimizer, ref_chunks)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import megatron_dapo.platform as plat

    platform = CountingPlatform()
    platform.setup()
    plat._current = platform  # the platform this process runs on (init_platform keeps it: same name, "cpu")
    import torch.distributed as dist

    out: dict = {}
    for name, spec in CASES.items():
        out[name] = run_case(name, spec, platform)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(out, indent=1))
    teardown(None)  # a live gloo group at interpreter exit can abort the process ("terminate called ...")


if __name__ == "__main__":
    main()
