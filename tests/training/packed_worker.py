"""torchrun worker (1 process): the actor's packed (THD, remove-padding) path against its padded path.

Packed attention is TransformerEngine's or MindSpeed's (GPU/NPU), and megatron-core's local attention refuses
``packed_seq_params``. So that the actor's packing — row layout, ``cu_seqlens``, ``response_index`` into the packed
sequence, ``PackedSeqParams``, the loss hook's reshape — runs here, the core attention of every layer is replaced by
``ReferenceThdAttention``: the same softmax(QK^T)V, per packed row with a causal mask, in plain torch (a stand-in for
the accelerator kernel; everything else, megatron-core's THD rotary embedding included, is the real code). Writes
log-probs, entropy, metrics and gradients of both paths to ``<out>/result.pt``.
"""

import argparse
import math
import os

import torch
import torch.distributed as dist

from megatron_dapo.actor.actor import MegatronActor, reduce_update_metrics
from megatron_dapo.batch import TrainBatch
from megatron_dapo.config import load_config
from megatron_dapo.models.builder import build_gpt_chunks, unwrap, wrap_for_training
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.parallel import init_distributed, init_model_parallel
from megatron_dapo.weights.layout import hf_to_mcore, padded_vocab_size
from megatron_dapo.weights.model_io import load_full_tensors
from tests.distributed.loss_batch import HF_KWARGS, TEMPERATURE, make_batch


class ReferenceThdAttention(torch.nn.Module):
    """Causal attention over THD-packed rows (``[t, heads, dim]``), per row of ``cu_seqlens_padded``; unpacked calls
    go to the layer's own attention."""

    def __init__(self, padded_attention: torch.nn.Module, heads: int, groups: int) -> None:
        super().__init__()
        self.padded_attention = padded_attention
        self.heads, self.groups = heads, groups

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip
        if packed_seq_params is None:
            return self.padded_attention(query, key, value, attention_mask, attn_mask_type, attention_bias)
        out = torch.zeros(query.shape[0], query.shape[1] * query.shape[2], dtype=query.dtype)
        starts = packed_seq_params.cu_seqlens_q_padded.tolist()
        real = packed_seq_params.cu_seqlens_q.tolist()
        for i in range(len(starts) - 1):
            a, n = starts[i], real[i + 1] - real[i]
            q, k, v = query[a : a + n], key[a : a + n], value[a : a + n]  # [n, h, d], [n, g, d]
            k = k.repeat_interleave(self.heads // self.groups, dim=1)
            v = v.repeat_interleave(self.heads // self.groups, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
            causal = torch.ones(n, n, dtype=torch.bool).triu(1)
            probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
            out[a : a + n] = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, -1)
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = load_config(
        None,
        [
            "actor.ppo_micro_batch_size_per_gpu=3",
            "actor.log_prob_micro_batch_size_per_gpu=3",
            "actor.entropy_coeff=0.01",
        ],
    )
    init_distributed(cfg.parallel)
    init_model_parallel(cfg.parallel, seed=1)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_dapo.testing.tiny_models import make_tiny_hf_model

    hf = make_tiny_hf_model("qwen2", seed=0, **HF_KWARGS)
    arch = model_arch_from_hf(hf.config.to_dict())
    sd = hf.state_dict()
    chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    pv = padded_vocab_size(arch.vocab_size, cfg.model.make_vocab_size_divisible_by, 1)
    load_full_tensors(chunks, arch, lambda m: hf_to_mcore(m, [sd[n] for n in m.hf], arch, pv))
    for layer in unwrap(chunks[0]).decoder.layers:
        attention = layer.self_attention
        attention.core_attention = ReferenceThdAttention(
            attention.core_attention, arch.num_attention_heads, arch.num_query_groups
        )
    chunks = wrap_for_training(chunks, cfg.parallel)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0), chunks)
    actor = MegatronActor(chunks, arch.vocab_size, cfg.actor, optimizer=optimizer)
    batch = TrainBatch(**make_batch())
    out = {}
    for packed in (False, True):
        actor.packed = packed
        lp = actor.compute_log_probs(batch, TEMPERATURE, calculate_entropy=True)
        grads = actor.compute_gradients(batch, TEMPERATURE)
        results, padding = grads.micro_batch_sums, grads.padding_ratio
        grads = {n: p.main_grad.detach().clone() for n, p in chunks[0].named_parameters()}
        out[packed] = {
            "log_probs": lp["log_probs"],
            "entropy": lp["entropy"],
            "padding_ratio": padding,
            "metrics": reduce_update_metrics(results, actor.cfg, actor.device),
            "grads": grads,
        }
    os.makedirs(args.out, exist_ok=True)
    torch.save(out, os.path.join(args.out, "result.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
