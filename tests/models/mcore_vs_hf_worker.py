"""torchrun worker: megatron-core ``GPTModel`` (our builder + layout module) against HF transformers, fp32.

One run covers one or more parallel layouts (TP, PP, VPP, SP; DP = world / (TP x PP)), rebuilding megatron-core's
parallel state between them, and loops over the model families, so the process start-up is paid once per run.
For every layout and family each rank:
  1. builds the same seeded tiny HF model (eager attention: the plain reference implementation), builds the
     Megatron chunks with ``build_gpt_chunks``, loads the HF weights through ``hf_to_mcore`` + ``load_full_tensors``
     and wraps the chunks with ``wrap_for_training`` (megatron DDP, grads land in ``main_grad``);
  2. runs megatron-core's ``forward_backward_func`` over two micro-batches — a plain one (shared by all DP ranks)
     and a left-padded one with an attention mask (different on each DP rank) — with a mean token log-likelihood
     loss over the true vocabulary, then ``finalize_model_grads`` (DP average, SP/qk-norm TP all-reduce, tied
     embedding all-reduce between first and last stage);
  3. computes the same loss with HF on the same data (the mean over DP ranks of the mean over micro-batches, which
     is what megatron's loss scaling and DDP averaging produce) and backpropagates it;
  4. records, for the test to assert on: logits max|diff| on the non-pad positions (last stage), the relative max
     error of every local Megatron parameter gradient against the HF gradient mapped through ``hf_to_mcore`` +
     ``tp_shard`` (and that padded vocabulary rows get zero gradient), the losses, (DP > 1) how far the DP ranks'
     logits for the shared batch are apart, and the training code's ``vocab_parallel_log_probs`` on the real
     padded logits shard (``check_vocab_helper``: the padded columns must not leak into log-probs or entropy).
Each rank writes ``<out>/rank<r>.json`` (``{"layouts": {name: {ranks..., "families": {...}}}}``). The worker
asserts nothing about tolerances: the test does.
"""

from __future__ import annotations

import argparse
import re
import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from tests.helpers.worker import write_rank_report

FAMILIES = ("qwen2", "qwen3", "llama")
VOCAB = 100
SEQ = 16
BATCH = 2
HF_SEED = 0
HELPER_TEMPERATURE = 0.7
# Left-pad lengths of the padded micro-batch's rows (row 1 shorter pad, so the rows differ).
PAD_LEFT = (5, 2)
PAD_ID = 0


def family_config_kwargs(family: str) -> dict[str, Any]:
    """Tiny-model config per family: qwen2 exercises tied embeddings; llama has llama3 rope scaling by default."""
    return {"tie_word_embeddings": family == "qwen2"}


def make_micro_batches(dp_rank: int) -> list[dict[str, torch.Tensor]]:
    """Micro-batch 0: plain causal batch, the same on every rank. Micro-batch 1: left-padded, per DP rank."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    plain_valid = torch.ones(BATCH, SEQ, dtype=torch.bool)

    g = torch.Generator().manual_seed(5678 + dp_rank)
    pids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    ptargets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    pvalid = torch.ones(BATCH, SEQ, dtype=torch.bool)
    for row, n in enumerate(PAD_LEFT):
        pvalid[row, :n] = False
    pids = torch.where(pvalid, pids, torch.full_like(pids, PAD_ID))

    out = []
    for index, (x, t, valid) in enumerate(((ids, targets, plain_valid), (pids, ptargets, pvalid))):
        # Positions count real tokens only (as generation does for left-padded prompts).
        pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
        causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)
        # megatron-core's local attention takes a boolean mask, True = masked: causal or a pad key.
        mcore_mask = causal[None, None] | ~valid[:, None, None, :]
        out.append(
            {
                "index": index,
                "ids": x,
                "targets": t,
                "valid": valid,
                "pos": pos,
                "mcore_mask": mcore_mask,
                "hf_mask": valid.long(),
            }
        )
    return out


def token_loss(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of ``targets`` over the valid positions (``logits`` over the true vocab)."""
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return -(logp * valid).sum() / valid.sum()


def rel_err(got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> float:
    """max|got - ref| / max|scale|; ``scale`` is the full (unsharded) reference, since one TP shard of the padded
    vocabulary can hold only padding rows (an all-zero reference)."""
    return ((got.double() - ref.double()).abs().max() / scale.double().abs().max().clamp(min=1e-30)).item()


def check_vocab_helper(shard: torch.Tensor, mb: dict, hf_logits: torch.Tensor) -> dict[str, float]:
    """The training code's ``vocab_parallel_log_probs`` on this rank's padded vocabulary shard of the real logits.

    Against HF (float64): log-probs and entropy at temperature ``HELPER_TEMPERATURE`` on the non-pad positions, and
    the gradient of their sum w.r.t. the shard, ``(onehot - p) / T``. Padding must not leak: the result is unchanged
    when the padded columns are overwritten with huge values, and the padded columns get exactly zero gradient.
    """
    from megatron.core import parallel_state as ps

    from megatron_dapo.algo.logprobs import vocab_parallel_log_probs

    t = HELPER_TEMPERATURE
    width = shard.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * width
    group = ps.get_tensor_model_parallel_group()
    valid, targets = mb["valid"], mb["targets"]
    pad_cols = torch.arange(start, start + width) >= VOCAB
    real = slice(0, max(0, min(width, VOCAB - start)))

    x = shard.detach().clone().requires_grad_(True)
    logp, ent = vocab_parallel_log_probs(x, targets, VOCAB, t, vocab_start=start, tp_group=group)
    logp[valid].sum().backward()
    poisoned = torch.where(pad_cols, torch.full_like(x, 1e4), x.detach())
    logp_p, ent_p = vocab_parallel_log_probs(poisoned, targets, VOCAB, t, vocab_start=start, tp_group=group)

    ref = torch.log_softmax(hf_logits.double() / t, dim=-1)
    ref_logp = ref.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(ref.exp() * ref).sum(-1)
    onehot = torch.nn.functional.one_hot(targets, VOCAB).double()
    ref_grad = (onehot - ref.exp()) / t * valid.unsqueeze(-1)
    grad_err = (x.grad[..., real].double() - ref_grad[..., start + real.start : start + real.stop]).abs()
    return {
        "logp_max_abs": (logp.double() - ref_logp)[valid].abs().max().item(),
        "entropy_max_abs": (ent.double() - ref_ent)[valid].abs().max().item(),
        "grad_max_abs": grad_err.max().item() if grad_err.numel() else 0.0,
        "real_columns": real.stop - real.start,
        "pad_columns": int(pad_cols.sum()),
        "pad_grad_absmax": x.grad[..., pad_cols].abs().max().item() if pad_cols.any() else 0.0,
        "pad_poison_change": max((logp_p - logp).abs().max().item(), (ent_p - ent).abs().max().item()),
    }


def run_family(family: str, cfg, dp_size: int, dp_rank: int) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_dapo.models.builder import build_gpt_chunks, wrap_for_training
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.testing.tiny_models import make_tiny_hf_model
    from megatron_dapo.weights.layout import hf_to_mcore, padded_vocab_size, tp_shard
    from megatron_dapo.weights.model_io import load_full_tensors, local_param_table

    t0 = time.time()
    hf = make_tiny_hf_model(family, seed=HF_SEED, attn_implementation="eager", **family_config_kwargs(family))
    arch = model_arch_from_hf(hf.config.to_dict())
    tp_size, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    padded = padded_vocab_size(arch.vocab_size, cfg.model.make_vocab_size_divisible_by, tp_size)
    hf_params = dict(hf.named_parameters())

    # ---- HF reference: loss = mean over DP ranks of the mean over micro-batches (megatron's scaling).
    hf.zero_grad(set_to_none=True)
    hf_logits, hf_losses = {}, {}
    total = 0.0
    for d in range(dp_size):
        mbs = make_micro_batches(d)
        for mb in mbs:
            logits = hf(input_ids=mb["ids"], attention_mask=mb["hf_mask"], position_ids=mb["pos"]).logits
            loss = token_loss(logits, mb["targets"], mb["valid"])
            total = total + loss / (len(mbs) * dp_size)
            if d == dp_rank:
                hf_logits[mb["index"]] = logits.detach()
                hf_losses[mb["index"]] = loss.item()
    total.backward()
    hf_grads = {name: p.grad.detach().clone() for name, p in hf_params.items()}

    # ---- Megatron: build, load through the layout module, DDP-wrap.
    chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    load_full_tensors(chunks, arch, lambda m: hf_to_mcore(m, [hf_params[n].detach() for n in m.hf], arch, padded))
    model = wrap_for_training(chunks, cfg.parallel)
    for chunk in model:
        chunk.zero_grad_buffer()

    mbs = make_micro_batches(dp_rank)
    captured: dict[int, torch.Tensor] = {}
    local_vocab_width: list[int] = []
    helper: dict[int, dict[str, float]] = {}

    def loss_func(mb: dict, output: torch.Tensor):
        local_vocab_width.append(int(output.shape[-1]))  # padded vocab / TP: the padded columns are there
        helper[mb["index"]] = check_vocab_helper(output, mb, hf_logits[mb["index"]])
        full = gather_from_tensor_model_parallel_region(output)[..., :VOCAB]
        captured[mb["index"]] = full.detach().clone()
        loss = token_loss(full, mb["targets"], mb["valid"])
        # A copy: the schedule divides the returned loss in place by the number of micro-batches.
        return loss, {"loss": loss.detach().clone()}

    def forward_step(data_iterator, model_chunk):
        mb = next(data_iterator)
        return model_chunk(mb["ids"], mb["pos"], mb["mcore_mask"]), partial(loss_func, mb)

    vpp = cfg.parallel.virtual_pipeline_model_parallel_size
    # The interleaved schedule asks each model chunk's iterator for every micro-batch in order.
    data_iterator = [iter(mbs) for _ in model] if vpp else iter(mbs)
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=len(mbs),
        seq_length=SEQ,
        micro_batch_size=BATCH,
        forward_only=False,
    )
    finalize_model_grads(model)

    # ---- compare
    result: dict[str, Any] = {"grads": [], "logits": {}, "losses": {}, "padded_vocab": padded}
    # What was actually built, so the test can tell that the layout's flags took effect.
    result["built"] = {
        "chunks": len(chunks),
        "sequence_parallel": chunks[0].config.sequence_parallel,
        "tp": chunks[0].config.tensor_model_parallel_size,
        "pp": chunks[0].config.pipeline_model_parallel_size,
    }
    for lp in local_param_table(model, arch):
        ref_full = hf_to_mcore(lp.mapping, [hf_grads[n] for n in lp.mapping.hf], arch, padded)
        ref = tp_shard(ref_full, lp.mapping.kind, lp.mapping.tp_dim, tp_size, tp_rank)
        got = lp.param.main_grad
        entry = {}
        if lp.mapping.kind == "vocab":
            # Rows of the padded vocabulary (global index >= VOCAB) must get exactly zero gradient.
            rows = torch.arange(tp_rank * got.shape[0], (tp_rank + 1) * got.shape[0])
            entry["pad_rows"] = int((rows >= VOCAB).sum())
            entry["pad_rows_grad_absmax"] = got[rows >= VOCAB].abs().max().item() if entry["pad_rows"] else 0.0
        result["grads"].append(
            {
                "mcore": lp.mapping.mcore,
                "local": lp.local_name,
                "chunk": lp.chunk,
                "rel_err": rel_err(got, ref, ref_full),
                "ref_absmax": ref_full.abs().max().item(),
                **entry,
            }
        )
    last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
    if last_stage:
        result["local_vocab_width"] = sorted(set(local_vocab_width))
        for mb in mbs:
            i = mb["index"]
            got = captured[i]
            result["logits"][str(i)] = {
                "max_abs": (got - hf_logits[i])[mb["valid"]].abs().max().item(),
                "shape": list(got.shape),
            }
        result["vocab_helper"] = {str(i): v for i, v in helper.items()}
        for mb, reduced in zip(mbs, losses):
            result["losses"][str(mb["index"])] = {"mcore": reduced["loss"].item(), "hf": hf_losses[mb["index"]]}
        if dp_size > 1:
            # The plain micro-batch is the same on every DP rank: its logits must be too.
            group = ps.get_data_parallel_group()
            gathered = [torch.empty_like(captured[0]) for _ in range(dp_size)]
            dist.all_gather(gathered, captured[0].contiguous(), group=group)
            result["dp_plain_logits_max_diff"] = max((g - gathered[0]).abs().max().item() for g in gathered)
    result["seconds"] = round(time.time() - t0, 2)
    return result


def parse_layout(name: str) -> dict[str, Any]:
    """``tp2-pp1-sp``, ``tp1-pp2-vpp2`` ... -> sizes (DP is whatever the world leaves over)."""
    match = re.fullmatch(r"tp(\d+)-pp(\d+)(?:-vpp(\d+))?(-sp)?", name)
    if match is None:
        raise ValueError(f"layout {name!r}: expected tp<N>-pp<N>[-vpp<N>][-sp]")
    tp, pp, vpp, sp = match.groups()
    return {"tp": int(tp), "pp": int(pp), "vpp": int(vpp) if vpp else None, "sp": sp is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", required=True, help="comma-separated, e.g. tp2-pp1-sp,tp1-pp2-vpp2")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from megatron.core import parallel_state as ps

    from megatron_dapo.config import load_config
    from megatron_dapo.parallel import destroy_model_parallel, init_distributed, init_model_parallel

    report: dict[str, Any] = {"layouts": {}}
    info = None
    # Several layouts in one process: megatron-core's parallel state is torn down and rebuilt between them (the
    # start-up of a torchrun costs far more than the comparisons).
    for name in args.layouts.split(","):
        lay = parse_layout(name)
        overrides = [
            f"parallel.tensor_model_parallel_size={lay['tp']}",
            f"parallel.pipeline_model_parallel_size={lay['pp']}",
            f"parallel.sequence_parallel={str(lay['sp']).lower()}",
            "parallel.platform=cpu",
            "model.params_dtype=fp32",
        ]
        if lay["vpp"]:
            overrides.append(f"parallel.virtual_pipeline_model_parallel_size={lay['vpp']}")
        cfg = load_config(None, overrides)
        info, _ = init_distributed(cfg.parallel)
        init_model_parallel(cfg.parallel, seed=1)
        dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        entry: dict[str, Any] = {
            "rank": info.rank,
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "dp_rank": dp_rank,
            "dp_size": dp_size,
            "families": {},
        }
        for family in args.families.split(","):
            entry["families"][family] = run_family(family, cfg, dp_size, dp_rank)
        report["layouts"][name] = entry
        destroy_model_parallel()

    write_rank_report(args.out, info.rank, report)


if __name__ == "__main__":
    main()
