"""Per-token log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds a slice ``[..., V/tp]`` of the (padded) vocabulary. Columns at or beyond the true
vocabulary size are padding and are excluded from the softmax (they never receive probability or gradient).
Logits are divided by the sampling temperature first so that training and rollout score the same distribution.

The TP reductions (max, sum of exponentials, target logit, expected logit) are three small all-reduces over
``[...]``-shaped tensors; the group is passed in by the caller (None = no tensor parallelism), so this module has
no knowledge of megatron-core's parallel state.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, true_vocab_size, temperature, group):
        shard = logits.shape[-1]
        col = torch.arange(vocab_start, vocab_start + shard, device=logits.device)
        valid = col < true_vocab_size  # [V/tp]
        z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
        z = torch.where(valid, z, torch.zeros((), dtype=z.dtype, device=z.device))

        local_max = torch.where(valid, z, torch.full((), float("-inf"), dtype=z.dtype, device=z.device)).amax(-1)
        m = _all_reduce(local_max, dist.ReduceOp.MAX, group)
        exp_z = torch.exp(z - m.unsqueeze(-1)) * valid
        sum_exp = _all_reduce(exp_z.sum(-1), dist.ReduceOp.SUM, group)
        lse = m + torch.log(sum_exp)
        probs = exp_z / sum_exp.unsqueeze(-1)

        in_shard = (targets >= vocab_start) & (targets < vocab_start + shard)
        local_idx = (targets - vocab_start).clamp(0, shard - 1)
        target_z = torch.gather(z, -1, local_idx.unsqueeze(-1)).squeeze(-1) * in_shard
        target_z = _all_reduce(target_z, dist.ReduceOp.SUM, group)
        expected_z = _all_reduce((probs * z).sum(-1), dist.ReduceOp.SUM, group)

        log_prob = target_z - lse
        entropy = lse - expected_z
        ctx.save_for_backward(probs, z, local_idx, in_shard, expected_z)
        ctx.temperature = temperature
        ctx.in_dtype = logits.dtype
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        probs, z, local_idx, in_shard, expected_z = ctx.saved_tensors
        # d logp / dz_j = 1[j = target] - p_j ;  d H / dz_j = -p_j (z_j - E_p[z])
        grad = -probs * grad_log_prob.unsqueeze(-1)
        grad.scatter_add_(-1, local_idx.unsqueeze(-1), (grad_log_prob * in_shard).unsqueeze(-1))
        if grad_entropy is not None:
            grad = grad - probs * (z - expected_z.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
        grad = grad / ctx.temperature
        return grad.to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    true_vocab_size: int,
    temperature: float = 1.0,
    vocab_start: int = 0,
    tp_group: Optional[dist.ProcessGroup] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``targets`` and entropy of softmax(logits / temperature) over the true vocabulary.

    Args:
        logits: ``[..., V_shard]`` this TP rank's vocabulary slice (padded vocabulary split evenly over TP).
        targets: ``[...]`` token ids in the global vocabulary.
        true_vocab_size: columns with global index ≥ this are padding and excluded.
        temperature: rollout sampling temperature (> 0).
        vocab_start: global index of this rank's first column (``tp_rank × V_shard``).
        tp_group: tensor-parallel group (None without TP).

    Returns:
        ``(log_probs[...], entropy[...])`` in float32 (float64 for float64 logits), differentiable w.r.t. ``logits``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score tokens, got {temperature}")
    return _VocabParallelLogProbEntropy.apply(logits, targets, vocab_start, true_vocab_size, temperature, tp_group)
