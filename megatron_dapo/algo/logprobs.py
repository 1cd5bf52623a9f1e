"""Per-token log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds a slice ``[..., V/tp]`` of the (padded) vocabulary. Columns at or beyond the true
vocabulary size are padding and are excluded from the softmax (they never receive probability or gradient).
Logits are divided by the sampling temperature first so that training and rollout score the same distribution.

The TP reductions (max, sum of exponentials, target logit, expected logit) are three small all-reduces over
``[...]``-shaped tensors; the group is passed in by the caller (None = no tensor parallelism), so this module has
no knowledge of megatron-core's parallel state.

``vocab_parallel_log_probs`` scores logits already gathered at the response positions; ``response_log_probs``
reads the full-sequence logits at those positions chunk by chunk (same values and gradients), so that long responses
need neither the gathered copy nor any ``[T, V]`` float32 temporary.
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


# ----------------------------------------------------------------------------------------------------------------------
# Response positions only, in chunks: no full-sequence fp32 logits and no gathered [b, T, V] copy.


class _ResponseLogProbs(torch.autograd.Function):
    """Log-probs (and entropy) at the distinct logit rows that predict response tokens, ``chunk_rows`` rows at a time.

    Several response tokens may share a logit row (the actor clamps padded response positions to the last row);
    they share that row's distribution, so statistics are computed once per distinct row and their gradients summed.
    Saved for backward: the logits (a reference, not a copy) and per-row ``lse`` and entropy — O(T), not O(T × V).
    """

    @staticmethod
    def forward(
        ctx,
        logits,
        flat_index,
        targets,
        true_vocab_size,
        temperature,
        vocab_start,
        group,
        chunk_rows,
        with_entropy,
        entropy_requires_grad,
        grad_into_logits,
    ):
        flat = logits.reshape(-1, logits.shape[-1])
        shard = flat.shape[-1]
        valid_cols = max(0, min(shard, true_vocab_size - vocab_start))  # padding is a suffix of the vocabulary
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        rows, token_row = torch.unique(flat_index, sorted=True, return_inverse=True)
        n_rows = rows.numel()

        lse = torch.empty(n_rows, dtype=compute_dtype, device=logits.device)
        entropy = torch.empty(n_rows if with_entropy else 0, dtype=compute_dtype, device=logits.device)
        for start in range(0, n_rows, chunk_rows):
            end = min(start + chunk_rows, n_rows)
            z = _scaled_rows(flat, rows[start:end], valid_cols, compute_dtype, temperature)
            row_max = (
                z.amax(-1)
                if valid_cols
                else torch.full((end - start,), float("-inf"), dtype=compute_dtype, device=z.device)
            )
            row_max = _all_reduce(row_max, dist.ReduceOp.MAX, group)
            z.sub_(row_max.unsqueeze(-1))
            exp_z = torch.exp(z)
            sums = [exp_z.sum(-1)]
            if with_entropy:  # Σ exp(z - m) (z - m): a batched dot product, no [c, V] product temporary
                sums.append(torch.bmm(exp_z.unsqueeze(1), z.unsqueeze(2)).reshape(-1))
            sums = _all_reduce(torch.stack(sums), dist.ReduceOp.SUM, group)
            del z, exp_z
            log_sum = torch.log(sums[0])
            lse[start:end] = row_max + log_sum
            if with_entropy:  # H = lse - E_p[z] = log Σe - Σ e (z - m) / Σe
                entropy[start:end] = log_sum - sums[1] / sums[0]

        local_target = targets - vocab_start
        in_shard = (local_target >= 0) & (local_target < valid_cols)
        local_target = local_target.clamp(0, max(valid_cols - 1, 0))
        target_z = flat[flat_index, local_target].to(compute_dtype) / temperature * in_shard
        target_z = _all_reduce(target_z, dist.ReduceOp.SUM, group)
        log_probs = target_z - lse[token_row]
        token_entropy = entropy[token_row] if with_entropy else entropy

        ctx.save_for_backward(logits, rows, token_row, local_target, in_shard, lse, entropy)
        ctx.valid_cols, ctx.compute_dtype, ctx.temperature = valid_cols, compute_dtype, temperature
        ctx.chunk_rows, ctx.entropy_grad, ctx.grad_into_logits = chunk_rows, entropy_requires_grad, grad_into_logits
        if not entropy_requires_grad:
            ctx.mark_non_differentiable(token_entropy)
        return log_probs, token_entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, rows, token_row, local_target, in_shard, lse, entropy = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        valid_cols, compute_dtype, temperature = ctx.valid_cols, ctx.compute_dtype, ctx.temperature
        n_rows = rows.numel()
        # Per distinct row: Σ of the upstream gradients of its tokens (they share one distribution).
        row_grad_lp = torch.zeros(n_rows, dtype=compute_dtype, device=flat.device)
        row_grad_lp.index_add_(0, token_row, grad_log_probs.reshape(-1).to(compute_dtype))
        if ctx.entropy_grad:
            row_grad_h = torch.zeros_like(row_grad_lp).index_add_(
                0, token_row, grad_entropy.reshape(-1).to(compute_dtype)
            )
        # Tokens ordered by row, so each chunk of rows owns a contiguous range of tokens (for the target terms).
        token_order = torch.argsort(token_row, stable=True)
        token_bounds = torch.cumsum(torch.bincount(token_row, minlength=n_rows), 0).tolist()
        target_grad = (grad_log_probs.reshape(-1).to(compute_dtype) * in_shard)[token_order]
        ordered_row, ordered_target = token_row[token_order], local_target[token_order]

        if ctx.grad_into_logits:
            # The gradient takes the logits' storage: each distinct row is read (recomputed) before it is written,
            # and the rows/columns that get no gradient are zeroed first (their logits are not needed any more).
            grad_flat = flat
            grad_flat[:, valid_cols:] = 0
            keep = torch.zeros(flat.shape[0], dtype=torch.bool, device=flat.device)
            keep[rows] = True
            grad_flat.masked_fill_(~keep.unsqueeze(-1), 0)
        else:
            grad_flat = torch.zeros_like(flat)
        for start in range(0, n_rows if valid_cols else 0, ctx.chunk_rows):  # a shard of padding only: no gradient
            end = min(start + ctx.chunk_rows, n_rows)
            # d logp_t / dz_j = 1[j = t] - p_j ;  d H / dz_j = -p_j (log p_j + H)
            log_p = _scaled_rows(flat, rows[start:end], valid_cols, compute_dtype, temperature)
            log_p.sub_(lse[start:end].unsqueeze(-1))
            grad = torch.exp(log_p)
            if ctx.entropy_grad:
                log_p.add_(entropy[start:end].unsqueeze(-1)).mul_(row_grad_h[start:end].unsqueeze(-1))
                grad.mul_(log_p.add_(row_grad_lp[start:end].unsqueeze(-1))).neg_()
            else:
                grad.mul_(row_grad_lp[start:end].unsqueeze(-1)).neg_()
            del log_p
            first, last = (token_bounds[start - 1] if start else 0), token_bounds[end - 1]
            grad.index_put_(
                (ordered_row[first:last] - start, ordered_target[first:last]), target_grad[first:last], accumulate=True
            )
            grad.div_(temperature)
            grad_flat[:, :valid_cols].index_copy_(0, rows[start:end], grad.to(flat.dtype))
            del grad  # before the next chunk's temporaries exist
        return grad_flat.view_as(logits), None, None, None, None, None, None, None, None, None, None


def _scaled_rows(flat, rows, valid_cols, compute_dtype, temperature) -> torch.Tensor:
    """``logits[rows, :valid_cols] / temperature`` as a fresh ``compute_dtype`` tensor (one copy of the chunk)."""
    z = flat[:, :valid_cols].index_select(0, rows)
    return z.to(compute_dtype).div_(temperature)


def response_log_probs(
    logits: torch.Tensor,
    response_index: torch.Tensor,
    response_tokens: torch.Tensor,
    true_vocab_size: int,
    temperature: float = 1.0,
    vocab_start: int = 0,
    tp_group: Optional[dist.ProcessGroup] = None,
    *,
    chunk_tokens: int = 64,
    with_entropy: bool = True,
    entropy_requires_grad: bool = True,
    grad_into_logits: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (and entropy) of the response tokens, read straight from the full-sequence logits, in chunks.

    Same values and gradients as ``vocab_parallel_log_probs`` on ``logits`` gathered at ``response_index``, but
    neither that gathered copy nor any ``[T, V]`` float32 tensor is made: the forward walks ``chunk_tokens`` logit
    rows at a time (max, log-sum-exp, entropy in float32, vocab-parallel reductions over ``tp_group``) and keeps only
    per-row statistics; the backward recomputes each chunk's softmax and writes its rows of the logits' gradient.

    Args:
        logits: ``[b, s, V_shard]`` this TP rank's vocabulary slice for every sequence position (any float dtype).
        response_index: ``[b, T]`` position in ``s`` of the logit row predicting each response token.
        response_tokens: ``[b, T]`` response token ids in the global vocabulary.
        true_vocab_size: columns with global index ≥ this are padding and excluded (they get no gradient).
        temperature: rollout sampling temperature (> 0).
        vocab_start: global index of this rank's first column (``tp_rank × V_shard``).
        tp_group: tensor-parallel group (None without TP).
        chunk_tokens: logit rows processed at once; bounds the temporaries to a few ``[chunk_tokens, V_shard]``.
        with_entropy: compute the entropy (else ``None`` is returned for it and its work is skipped).
        entropy_requires_grad: False returns the entropy detached, and the backward skips the entropy terms (use it
            when the entropy coefficient is 0 and the entropy is only reported).
        grad_into_logits: the backward writes the gradient into ``logits``' own storage instead of a new tensor
            (as Megatron's fused cross-entropy does): only for logits nothing else reads after this backward.

    Returns:
        ``(log_probs[b, T], entropy[b, T] or None)`` in float32 (float64 for float64 logits).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score tokens, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be ≥ 1, got {chunk_tokens}")
    if logits.dim() != 3 or response_index.shape != response_tokens.shape or response_index.dim() != 2:
        raise ValueError(
            f"expected logits [b, s, V] and response_index/response_tokens [b, T], got {tuple(logits.shape)}, "
            f"{tuple(response_index.shape)}, {tuple(response_tokens.shape)}"
        )
    b, s, _ = logits.shape
    rows_of_batch = torch.arange(b, device=logits.device).unsqueeze(-1) * s
    flat_index = (rows_of_batch + response_index.to(logits.device)).reshape(-1)
    log_probs, entropy = _ResponseLogProbs.apply(
        logits,
        flat_index,
        response_tokens.to(logits.device).reshape(-1),
        true_vocab_size,
        temperature,
        vocab_start,
        tp_group,
        chunk_tokens,
        with_entropy,
        with_entropy and entropy_requires_grad,
        grad_into_logits,
    )
    shape = response_index.shape
    return log_probs.view(shape), (entropy.view(shape) if with_entropy else None)


@torch.no_grad()
def response_sum_pi_squared(
    logits: torch.Tensor,
    response_index: torch.Tensor,
    true_vocab_size: int,
    temperature: float = 1.0,
    vocab_start: int = 0,
    tp_group: Optional[dist.ProcessGroup] = None,
    *,
    chunk_tokens: int = 64,
) -> torch.Tensor:
    """``Σ_v π(v)²`` of softmax(logits / temperature) at every response position (``[b, T]`` float32; float64 for
    float64 logits), for the optimal-token-baseline estimators (verl's ``sum_pi_squared``): with the row max ``m``
    removed, ``Σ e^{2(z-m)} / (Σ e^{z-m})²``, both sums reduced over ``tp_group``, ``chunk_tokens`` logit rows at a
    time like ``response_log_probs`` (no ``[T, V]`` temporary). Not differentiable (an estimator input)."""
    b, s, shard = logits.shape
    flat = logits.reshape(-1, shard)
    flat_index = (torch.arange(b, device=logits.device).unsqueeze(-1) * s + response_index.to(logits.device)).reshape(
        -1
    )
    valid_cols = max(0, min(shard, true_vocab_size - vocab_start))
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    rows, token_row = torch.unique(flat_index, sorted=True, return_inverse=True)
    out = torch.empty(rows.numel(), dtype=compute_dtype, device=logits.device)
    for start in range(0, rows.numel(), chunk_tokens):
        end = min(start + chunk_tokens, rows.numel())
        z = _scaled_rows(flat, rows[start:end], valid_cols, compute_dtype, temperature)
        row_max = (
            z.amax(-1) if valid_cols else torch.full((end - start,), -torch.inf, dtype=compute_dtype, device=z.device)
        )
        z.sub_(_all_reduce(row_max, dist.ReduceOp.MAX, group=tp_group).unsqueeze(-1))
        exp_z = torch.exp(z)
        sums = _all_reduce(torch.stack([exp_z.sum(-1), (exp_z * exp_z).sum(-1)]), dist.ReduceOp.SUM, tp_group)
        out[start:end] = sums[1] / (sums[0] * sums[0])
    return out[token_row].view(response_index.shape)
