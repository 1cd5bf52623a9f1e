"""torchrun worker: the actor's collectives on device groups never carry a host-built tensor.

On GPU/NPU the model-parallel groups are NCCL/HCCL (behind a mixed default group) and a CPU tensor there is either an
error ("No backend type associated with device type cpu") or a silent detour through gloo. On the CPU box every
tensor is a CPU tensor, so this worker tells them apart itself: a ``TorchFunctionMode`` marks as *host-built* every
tensor created without an explicit ``device=`` (and whatever is computed only from such tensors, and ``.cpu()``
results), the batch's tensors are host data, and a tensor moved with ``.to(device)`` is a device tensor. The
collectives of ``torch.distributed`` are wrapped to refuse a host-built tensor on any group but the host groups
(the trainer's control group, megatron-core's gloo groups) — the platform that "refuses CPU tensors on its device
group". The worker runs ``compute_log_probs`` and ``update`` under that platform, then a deliberate violation (to
prove the check can fail), and writes what it saw to ``<out>/rank<r>.json``.
"""

import argparse
import json
import os
import traceback

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from megatron_dapo import parallel
from megatron_dapo.actor.actor import MegatronActor
from megatron_dapo.batch import TrainBatch
from megatron_dapo.config import load_config
from megatron_dapo.models.builder import build_gpt_chunks, wrap_for_training
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.parallel import init_distributed, init_model_parallel
from tests.distributed.loss_batch import HF_KWARGS, TEMPERATURE, make_batch

HOST = "_built_on_host"
FACTORIES = {
    torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.as_tensor, torch.arange, torch.rand,
    torch.randn, torch.randint, torch.eye, torch.linspace,
}  # fmt: skip
LIKE = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like}
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "reduce",
    "all_to_all_single",
)  # fmt: skip


def is_host(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, HOST, False)


def mark(out, host: bool):
    if isinstance(out, torch.Tensor):
        if host:
            setattr(out, HOST, True)
        elif is_host(out):  # same object handed back (e.g. .to() a no-op on CPU): a fresh alias, unmarked
            out = out.view_as(out)
    elif isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor) and host:
                setattr(o, HOST, True)
    return out


def tensors_in(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (tuple, list)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


def explicit_device(func, args, kwargs) -> bool:
    if kwargs.get("device") is not None:
        return True
    if func is torch.Tensor.to and len(args) > 1:
        return isinstance(args[1], (torch.device, str, int)) or isinstance(args[1], torch.Tensor)
    return func in (torch.Tensor.cuda,)


class HostTensorMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.Tensor.cpu:
            return mark(out, True)
        if func in FACTORIES:
            return mark(out, kwargs.get("device") is None)
        if explicit_device(func, args, kwargs):
            return mark(out, False)
        if func in LIKE:
            return mark(out, is_host(args[0]))
        inputs = list(tensors_in(args, kwargs))
        return mark(out, bool(inputs) and all(is_host(t) for t in inputs))


def refuse_host_tensors(host_groups: list, seen: list) -> None:
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def checked(*args, _original=original, _name=name, **kwargs):
            group = kwargs.get("group")
            if not any(group is g for g in host_groups):
                bad = [t for t in tensors_in(args, kwargs) if is_host(t)]
                if bad:
                    frame = next(
                        (f for f in reversed(traceback.extract_stack()[:-1]) if "megatron_dapo" in f.filename),
                        traceback.extract_stack()[-2],
                    )
                    seen.append(
                        f"{_name} of a host-built {tuple(bad[0].shape)} tensor at {frame.filename}:{frame.lineno}"
                    )
            return _original(*args, **kwargs)

        setattr(dist, name, checked)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = load_config(
        None,
        [
            f"parallel.tensor_model_parallel_size={args.tp}",
            f"parallel.pipeline_model_parallel_size={args.pp}",
            "actor.ppo_micro_batch_size_per_gpu=2",
            "actor.log_prob_micro_batch_size_per_gpu=2",
            "actor.use_kl_loss=true",
        ],
    )
    info, _ = init_distributed(cfg.parallel)
    init_model_parallel(cfg.parallel, seed=1)
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_dapo.testing.tiny_models import make_tiny_hf_model

    # The host groups: an explicit gloo control group (as on GPU, where the default group is mixed) and
    # megatron-core's gloo groups. Everything else — the default group included — is a device group.
    parallel._CONTROL_GROUP = dist.new_group(backend="gloo")
    host_groups = [parallel._CONTROL_GROUP, ps.get_data_parallel_group_gloo(with_context_parallel=True)]
    hf = make_tiny_hf_model("qwen2", seed=0, **HF_KWARGS)
    arch = model_arch_from_hf(hf.config.to_dict())
    chunks = wrap_for_training(build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor), cfg.parallel)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0), chunks)
    actor = MegatronActor(chunks, arch.vocab_size, cfg.actor, optimizer=optimizer)
    batch = TrainBatch(**make_batch())
    for value in vars(batch).values():  # the batch is host data (the trainer holds it in host memory)
        if isinstance(value, torch.Tensor):
            setattr(value, HOST, True)

    seen: list[str] = []
    refuse_host_tensors(host_groups, seen)
    with HostTensorMode():
        actor.compute_log_probs(batch, TEMPERATURE, calculate_entropy=True)
        metrics = actor.update(batch, TEMPERATURE).metrics
        actor_violations = list(seen)
        # A deliberate violation: the check must see it.
        canary = torch.zeros(2)
        dist.all_reduce(canary, group=ps.get_data_parallel_group())
    result = {
        "violations": actor_violations,
        "canary_seen": len(seen) > len(actor_violations),
        "update_ok": metrics["actor/update_ok"],
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{info.rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier(group=parallel._CONTROL_GROUP)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
