"""torchrun worker (world 1): ``model.attention_backend=sdpa`` (``models/sdpa_attention.SDPAttention``) against
``local`` (megatron-core's ``DotProductAttention``), fp32, every family the tiny models cover.

For each family one seeded tiny HF model (4 query heads over 2 KV groups: GQA) is loaded into two ``GPTModel``s
built by ``build_gpt_chunks``, one per backend, and each batch runs forward and backward (the mean log-likelihood of
random targets over the real tokens) through both:
  * ``causal``: the actor's explicit ``[1, 1, s, s]`` causal mask (SDPA's ``is_causal`` path);
  * ``no_mask``: ``attention_mask=None`` on the causal layers (megatron-core builds the causal mask itself);
  * ``padded``: left-padded rows with a ``[b, 1, s, s]`` causal-or-pad-key mask, whose pad rows have every key
    masked (compared on every position, pad rows included);
  * ``packed``: SDPA only, the rows' real tokens packed THD (``packed_seq_params``, slots padded to a multiple of 8)
    against the local backend's right-padded batch, on the real tokens.
Recorded per batch: max |Δ logits| and max |logits| of the reference, the worst gradient error relative to the
reference's largest gradient entry, how SDPA was called (``is_causal`` / with a mask / packed) and how often
DotProductAttention's own forward ran in the SDPA model (a fallback). Writes ``<out>/result.json``; the test asserts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.models.families import FAMILIES
from megatron_dapo.parallel import teardown

# The families whose every layer is attention (testing/tiny_models.py makes them); not the Gated DeltaNet hybrids.
ATTENTION_ONLY = sorted(name for name, spec in FAMILIES.items() if not spec.linear_attention)

VOCAB, BATCH, SEQ = 100, 3, 24
LEFT_PAD = (0, 5, 11)  # padded batch: row 2's first 11 queries see only pad keys
LENGTHS = (24, 13, 7)  # packed batch: real tokens per row
SLOT = 8  # packed slots are padded to a multiple of this
CALLS: list[str] = []


def _instrument() -> None:
    """Record each SDPA call's kind and each DotProductAttention forward (the fallback) in ``CALLS``."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_dapo.models.sdpa_attention import SDPAttention

    sdpa, dpa = SDPAttention._sdpa, DotProductAttention.forward

    def record_sdpa(self, q, k, v, keep, is_causal, dropout_p):
        kind = "causal" if is_causal else "mask" if keep is not None else "none"
        CALLS.append(f"{'thd-' if q.dim() == 3 else ''}{kind}")
        return sdpa(self, q, k, v, keep, is_causal, dropout_p)

    def record_dpa(self, *args, **kwargs):
        CALLS.append("DotProductAttention")
        return dpa(self, *args, **kwargs)

    SDPAttention._sdpa = record_sdpa
    DotProductAttention.forward = record_dpa


def batches() -> dict[str, dict[str, Any]]:
    """Token ids, targets, positions, the megatron mask and which positions are real, per batch."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).expand(BATCH, -1)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
    left = torch.arange(SEQ)[None] >= torch.tensor(LEFT_PAD)[:, None]
    right = torch.arange(SEQ)[None] < torch.tensor(LENGTHS)[:, None]
    return {
        "causal": {"ids": ids, "targets": targets, "pos": pos, "mask": causal, "real": torch.ones_like(left)},
        "no_mask": {"ids": ids, "targets": targets, "pos": pos, "mask": None, "real": torch.ones_like(left)},
        "padded": {
            "ids": ids.masked_fill(~left, 0),
            "targets": targets,
            "pos": (left.long().cumsum(-1) - 1).clamp(min=0),
            "mask": causal | ~left[:, None, None, :],
            "real": left,
        },
        "right_padded": {
            "ids": ids.masked_fill(~right, 0),
            "targets": targets,
            "pos": pos,
            "mask": causal,
            "real": right,
        },
    }


def packed(b: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """``b``'s real tokens (a right-padded batch) in THD slots of a multiple of ``SLOT``, and its PackedSeqParams."""
    from megatron.core.packed_seq_params import PackedSeqParams

    slots = [-(-n // SLOT) * SLOT for n in LENGTHS]
    total = sum(slots)
    ids, targets, pos = (torch.zeros(1, total, dtype=torch.long) for _ in range(3))
    real = torch.zeros(1, total, dtype=torch.bool)
    start = 0
    for row, (n, slot) in enumerate(zip(LENGTHS, slots)):
        ids[0, start : start + n], targets[0, start : start + n] = b["ids"][row, :n], b["targets"][row, :n]
        pos[0, start : start + slot] = torch.arange(slot)
        real[0, start : start + n] = True
        start += slot
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    cu_padded = torch.tensor([0, *torch.tensor(slots).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=max(slots),
        max_seqlen_kv=max(slots),
    )
    return {"ids": ids, "targets": targets, "pos": pos, "mask": None, "real": real}, params


def run(model, b: dict[str, Any], params=None) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[str]]:
    """(logits over the true vocabulary, parameter gradients, the attention calls) of one forward/backward."""
    model.zero_grad(set_to_none=True)
    CALLS.clear()
    kwargs = {"packed_seq_params": params} if params is not None else {}
    logits = model(b["ids"], b["pos"], b["mask"], **kwargs)[..., :VOCAB]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, b["targets"].unsqueeze(-1)).squeeze(-1)
    (-(logp * b["real"]).sum() / b["real"].sum()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads, list(CALLS)


def compare(got: tuple, ref: tuple, got_real: torch.Tensor, ref_real: torch.Tensor) -> dict[str, Any]:
    """Logits on the real positions (``got_real`` / ``ref_real`` pick the same tokens in order) and gradients."""
    a, b = got[0][got_real], ref[0][ref_real]
    grad_scale = max(g.abs().max().item() for g in ref[1].values())
    grad_err = max((got[1][n] - g).abs().max().item() for n, g in ref[1].items())
    return {
        "logits_max_abs": (a - b).abs().max().item(),
        "logits_ref_absmax": b.abs().max().item(),
        "grad_max_abs": grad_err,
        "grad_ref_absmax": grad_scale,
        "grads_compared": [len(got[1]), len(ref[1])],
        "calls": sorted(set(got[2])),
        "fallbacks": got[2].count("DotProductAttention"),
        "ref_calls": sorted(set(ref[2])),
    }


def run_family(family: str) -> dict[str, Any]:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_dapo.config import load_config
    from megatron_dapo.models.builder import build_gpt_chunks
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.models.sdpa_attention import SDPAttention
    from megatron_dapo.testing.tiny_models import make_tiny_hf_model
    from megatron_dapo.weights.layout import hf_to_mcore, padded_vocab_size, unfuse_hf_experts
    from megatron_dapo.weights.model_io import load_full_tensors

    hf = make_tiny_hf_model(family, seed=0)
    arch = model_arch_from_hf(hf.config.to_dict())
    weights = unfuse_hf_experts({n: p.detach() for n, p in hf.named_parameters()})
    models, built = {}, {}
    for backend in ("sdpa", "local"):
        cfg = load_config(None, [*BASE, f"model.attention_backend={backend}"])
        padded = padded_vocab_size(arch.vocab_size, cfg.model.make_vocab_size_divisible_by, 1)
        chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
        load_full_tensors(chunks, arch, lambda m, v=padded: hf_to_mcore(m, [weights[n] for n in m.hf], arch, v))
        models[backend] = chunks[0]
        layers = chunks[0].decoder.layers
        built[backend] = sorted({type(layer.self_attention.core_attention).__name__ for layer in layers})
    assert SDPAttention.__mro__[1] is DotProductAttention
    data = batches()
    out: dict[str, Any] = {"built": built, "gqa": [arch.num_attention_heads, arch.num_query_groups]}
    for name in ("causal", "no_mask", "padded"):
        b = data[name]
        out[name] = compare(run(models["sdpa"], b), run(models["local"], b), b["real"], b["real"])
    thd, params = packed(data["right_padded"])
    ref = data["right_padded"]
    out["packed"] = compare(run(models["sdpa"], thd, params), run(models["local"], ref), thd["real"], ref["real"])
    return out


BASE = [
    "parallel.platform=cpu",
    "model.params_dtype=fp32",
    "model.transformer_impl=local",
    "actor.moe_aux_loss_coeff=0",  # the packed and padded layouts route different pad tokens: no load-balancing term
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--families", default=",".join(ATTENTION_ONLY))
    args = ap.parse_args()
    from megatron_dapo.config import load_config
    from megatron_dapo.parallel import init_distributed, init_model_parallel

    cfg = load_config(None, BASE)
    init_distributed(cfg.parallel)
    init_model_parallel(cfg.parallel, seed=1)
    _instrument()
    result = {family: run_family(family) for family in args.families.split(",")}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "result.json").write_text(json.dumps(result, indent=1))
    teardown(None)  # a live gloo group at interpreter exit can abort the process


if __name__ == "__main__":
    main()
