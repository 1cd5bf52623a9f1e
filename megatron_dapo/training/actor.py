"""The Megatron-Core side of a step: forward-only log-probs and the DAPO update, through ``forward_backward_func``.

A batch (every rank holds all of it, as the rollout returns it) is a dict of tensors:
  ``prompts[B,P]`` left-padded with ``prompt_mask``; ``responses[B,T]`` right-padded with ``response_mask`` (valid
  tokens); optional ``loss_mask[B,T]`` (defaults to ``response_mask``; overlong filtering zeroes rows of it);
  for updates also ``old_log_probs``, ``advantages`` and optionally ``ref_log_probs``, ``rollout_is_weights``.

Each data-parallel rank takes a contiguous slice of rows; micro-batches are re-laid out *left-aligned* (prompt
tokens, then response tokens, then padding) so that rotary positions start at 0 for every row — megatron-core's
GPTModel derives rope positions from the sequence index — and only a causal mask is needed.

Exactness of the loss: the hook receives one micro-batch at a time but normalises with the *global* counts of the
mini-batch (summed over micro-batches and DP ranks before the forward-backward), and undoes megatron-core's
``1/num_microbatches`` and DDP's ``1/dp`` scaling, so loss and gradients do not depend on TP/PP/DP sizes or the
micro-batch split. The DAPO math itself is in ``megatron_dapo.algo`` (pure functions).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist

from megatron_dapo.algo.kl import kl_penalty
from megatron_dapo.algo.logprobs import response_log_probs
from megatron_dapo.algo.policy_loss import (
    agg_loss,
    agg_normalisers,
    compute_policy_loss_terms,
    compute_rollout_is_weights,
    policy_loss_metric_sums,
)
from megatron_dapo.config import ActorConfig


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [b, S] left-aligned prompt+response, right-padded
    position_ids: torch.Tensor  # [b, S]
    response_index: torch.Tensor  # [b, T] position of the logit predicting response token t
    response_tokens: torch.Tensor  # [b, T]
    fields: dict  # per-token tensors [b, T] for the loss (masks, advantages, ...)


def balance_rows(lengths: list[int], dp: int) -> list[list[int]]:
    """Rows per data-parallel rank: equal counts, balanced tokens, each rank's rows longest first.

    Longest-processing-time assignment (verl's ``balance_batch`` goal): rows longest first, each to the rank with the
    fewest tokens among those that still take rows. Ordering each rank's rows by length makes consecutive rows — the
    micro-batches — of similar length, so little is padded. Every rank computes the same partition from the same
    batch, so results can be scattered back to the original order without communication.
    """
    if len(lengths) % dp != 0:
        raise ValueError(f"batch of {len(lengths)} sequences is not divisible by the data-parallel size {dp}")
    per = len(lengths) // dp
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    ranks: list[list[int]] = [[] for _ in range(dp)]
    load = [0] * dp
    for i in order:
        r = min((r for r in range(dp) if len(ranks[r]) < per), key=lambda r: (load[r], r))
        ranks[r].append(i)
        load[r] += lengths[i]
    return ranks


def split_micro_batches(lengths: list[int], micro_batch_size: int, max_tokens: Optional[int] = None) -> list[list[int]]:
    """Positions per micro-batch: fixed ``micro_batch_size`` rows, or (``max_tokens``) greedy packing so that
    ``rows × longest row ≤ max_tokens`` (a row longer than the budget gets a micro-batch of its own)."""
    if max_tokens is None:
        return [
            list(range(i, min(i + micro_batch_size, len(lengths)))) for i in range(0, len(lengths), micro_batch_size)
        ]
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, n) > max_tokens:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups


def padded_seq_len(longest: int, seq_multiple: int) -> int:
    return -(-longest // seq_multiple) * seq_multiple  # sequence parallelism splits the sequence over TP


def make_micro_batch(batch: dict, rows: list[int], field_names: tuple[str, ...], seq_multiple: int = 1) -> MicroBatch:
    """Re-lay rows left-aligned: prompt tokens (from the left-padded ``prompts``), then response tokens, then 0s."""
    index = torch.as_tensor(rows, dtype=torch.long)
    prompts, prompt_mask = batch["prompts"][index], batch["prompt_mask"][index].bool()
    responses, response_mask = batch["responses"][index], batch["response_mask"][index].bool()
    b, t = responses.shape
    width = prompts.shape[1]
    prompt_lens = prompt_mask.sum(-1, keepdim=True)
    total_lens = prompt_lens + response_mask.sum(-1, keepdim=True)
    seq_len = padded_seq_len(int(total_lens.max()), seq_multiple)
    pos = torch.arange(seq_len).unsqueeze(0)
    # Position j holds prompt token width - prompt_len + j (left padding) or response token j - prompt_len.
    from_prompt = prompts.gather(1, (width - prompt_lens + pos).clamp(0, width - 1))
    from_response = responses.gather(1, (pos - prompt_lens).clamp(0, t - 1))
    tokens = torch.where(pos < prompt_lens, from_prompt, torch.where(pos < total_lens, from_response, 0))
    position_ids = pos.expand(b, -1).contiguous()
    # Logit at position j predicts token j + 1: response token t sits at prompt_len + t.
    response_index = (prompt_lens - 1 + torch.arange(t).unsqueeze(0)).clamp(max=seq_len - 1)
    fields = {name: batch[name][index] for name in field_names if name in batch}
    fields["response_mask"] = response_mask
    return MicroBatch(tokens, position_ids, response_index, responses, fields)


LOSS_INPUT_FIELDS = ("old_log_probs", "advantages", "ref_log_probs", "rollout_is_weights")


def _loss_inputs_finite(local: dict) -> bool:
    """Whether this rank's loss inputs are finite wherever the loss mask lets them into the loss."""
    mask = local["loss_mask"].bool()
    for name in LOSS_INPUT_FIELDS:
        value = local.get(name)
        if value is not None and not bool(torch.isfinite(value[mask]).all()):
            return False
    return True


@functools.lru_cache(maxsize=64)
def causal_mask(seq_len: int, device) -> torch.Tensor:
    """``[1, 1, S, S]`` True above the diagonal (masked); cached: built once per length and device, read-only."""
    return torch.triu(torch.ones((1, 1, seq_len, seq_len), dtype=torch.bool, device=device), diagonal=1)


class MegatronActor:
    """Megatron-Core model chunks (actor or frozen reference) and, for the actor, its optimizer."""

    def __init__(self, chunks: list, true_vocab_size: int, actor_cfg: ActorConfig, optimizer=None):
        from megatron.core.distributed import finalize_model_grads

        self.chunks = chunks
        self.true_vocab_size = true_vocab_size
        self.cfg = actor_cfg
        self.optimizer = optimizer
        self.temperature = 1.0
        self._guard_s = 0.0
        config = self._model_config()
        if optimizer is not None:
            config.finalize_model_grads_func = finalize_model_grads
            config.grad_scale_func = optimizer.scale_loss
            no_sync = [c.no_sync for c in chunks]
            config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync

    def _model_config(self):
        model = self.chunks[0]
        while not hasattr(model, "config") and hasattr(model, "module"):
            model = model.module
        return model.config

    # ------------------------------------------------------------------------------------------- plumbing

    def _run(self, micro_batches: list[MicroBatch], loss_fn: Callable, forward_only: bool) -> list[dict]:
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_dapo.platform import get_platform

        device = next(self.chunks[0].parameters()).device
        tp_group = ps.get_tensor_model_parallel_group()
        vocab_start_rank = ps.get_tensor_model_parallel_rank()
        explicit_mask = get_platform().causal_mask_needed  # MindSpeed's flash attention wants None (causal itself)

        def forward_step(data_iterator, model):
            mb: MicroBatch = next(data_iterator)
            tokens = mb.tokens.to(device)
            mask = causal_mask(tokens.shape[1], device) if explicit_mask else None
            output = model(tokens, mb.position_ids.to(device), mask)

            def loss_func(logits):
                # Response positions are read straight from the full-sequence logits, chunk by chunk (no gathered
                # copy, no [T, V] fp32 tensor); the gradient is written into the logits' storage, which nothing
                # reads after this hook's backward.
                log_probs, entropy = response_log_probs(
                    logits,
                    mb.response_index.to(device),
                    mb.response_tokens.to(device),
                    self.true_vocab_size,
                    self.temperature,
                    vocab_start=vocab_start_rank * logits.shape[-1],
                    tp_group=tp_group,
                    entropy_requires_grad=self.cfg.entropy_coeff != 0,
                    grad_into_logits=True,
                )
                return loss_fn(log_probs, entropy, {k: v.to(device) for k, v in mb.fields.items()})

            return output, loss_func

        n = len(micro_batches)
        iterators = [iter(micro_batches) for _ in self.chunks] if len(self.chunks) > 1 else iter(micro_batches)
        forward_backward = get_forward_backward_func()
        return forward_backward(
            forward_step_func=forward_step,
            data_iterator=iterators,
            model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
            num_microbatches=n,
            seq_length=max(int(mb.tokens.shape[1]) for mb in micro_batches),
            micro_batch_size=max(int(mb.tokens.shape[0]) for mb in micro_batches),
            forward_only=forward_only,
        )

    def _plan(self, batch: dict, micro_batch_size: int) -> tuple[list[list[int]], list[list[int]], float]:
        """Every DP rank's rows (``balance_rows``), this rank's micro-batches as positions in its rows, and the
        padding ratio (padded ÷ real tokens) of the whole batch over all ranks — the same on every rank."""
        from megatron.core import parallel_state as ps

        lengths = (batch["prompt_mask"].sum(-1) + batch["response_mask"].sum(-1)).tolist()
        ranks = balance_rows(lengths, ps.get_data_parallel_world_size())
        budget = self.cfg.ppo_max_token_len_per_gpu if self.cfg.use_dynamic_bsz else None
        config = self._model_config()
        multiple = config.tensor_model_parallel_size if config.sequence_parallel else 1
        padded = 0
        mine: list[list[int]] = []
        for r, rows in enumerate(ranks):
            row_lengths = [lengths[i] for i in rows]
            groups = split_micro_batches(row_lengths, micro_batch_size, budget)
            padded += sum(len(g) * padded_seq_len(max(row_lengths[i] for i in g), multiple) for g in groups)
            if r == ps.get_data_parallel_rank():
                mine = groups
        return ranks, mine, padded / max(sum(lengths), 1)

    def _micro_batches(self, local: dict, groups: list[list[int]], field_names: tuple[str, ...]) -> list[MicroBatch]:
        config = self._model_config()
        multiple = config.tensor_model_parallel_size if config.sequence_parallel else 1
        return [make_micro_batch(local, rows, field_names, multiple) for rows in groups]

    @staticmethod
    def _from_last_stage(t: torch.Tensor) -> torch.Tensor:
        """Broadcast a tensor held by the last pipeline stage to every stage (same shape everywhere)."""
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(
                t, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
            )
        return t

    # ------------------------------------------------------------------------------------------- log-probs

    @torch.no_grad()
    def compute_log_probs(self, batch: dict, temperature: float, calculate_entropy: bool = False) -> dict:
        """Per-token log-probs (and entropy) of ``responses`` for the whole batch, on every rank ([B, T] float32),
        plus ``padding_ratio`` (padded ÷ real tokens of the forward passes)."""
        from megatron.core import parallel_state as ps

        for c in self.chunks:
            c.eval()
        self.temperature = temperature
        ranks, groups, padding_ratio = self._plan(batch, self.cfg.log_prob_micro_batch_size_per_gpu)
        rows = torch.as_tensor(ranks[ps.get_data_parallel_rank()], dtype=torch.long)
        local = {k: v[rows] for k, v in batch.items() if isinstance(v, torch.Tensor)}

        def loss_fn(log_probs, entropy, fields):
            mask = fields["response_mask"]
            out = {"log_probs": log_probs * mask, "entropy": entropy * mask}
            return log_probs.sum() * 0.0, out

        mbs = self._micro_batches(local, groups, ())
        results = self._run(mbs, loss_fn, forward_only=True)
        device = next(self.chunks[0].parameters()).device
        b_local, t = local["responses"].shape
        out = torch.zeros((2, b_local, t), dtype=torch.float32, device=device)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            for positions, res in zip(groups, results):
                index = torch.as_tensor(positions, dtype=torch.long, device=device)
                out[0, index] = res["log_probs"].float()
                out[1, index] = res["entropy"].float()
        out = self._from_last_stage(out)
        gathered = [torch.empty_like(out) for _ in range(ps.get_data_parallel_world_size())]
        dist.all_gather(gathered, out, group=ps.get_data_parallel_group())
        full = torch.zeros((2, batch["responses"].shape[0], t), dtype=torch.float32)
        for rank_rows, part in zip(ranks, gathered):  # back to the batch's row order
            full[:, torch.as_tensor(rank_rows, dtype=torch.long)] = part.cpu()
        result = {"log_probs": full[0], "padding_ratio": padding_ratio}
        if calculate_entropy:
            result["entropy"] = full[1]
        return result

    # ------------------------------------------------------------------------------------------- update

    def update(
        self, mini_batch: dict, temperature: float, rollout_is_threshold: Optional[float] = None
    ) -> dict[str, float]:
        """One optimizer step on a mini-batch: forward-backward with the DAPO loss hook, then a guarded step.

        The step is applied only when the loss, the gradient norm and the loss inputs are finite on every rank (one
        reduction over all ranks, so no rank steps alone); otherwise parameters and optimizer state are left as
        they were and ``actor/update_ok`` is 0, with ``nonfinite`` naming what was not finite.

        Without ``old_log_probs`` in the mini-batch (the on-policy case: one epoch, one mini-batch, so the policy has
        not moved since the rollout) the loss uses the training forward's own log-probs, detached, as the old
        policy's; then the rollout mismatch metrics and the truncated-IS weights (``rollout_is_threshold``) come from
        this forward too.
        """
        results, inputs_ok, padding_ratio = self.compute_gradients(mini_batch, temperature, rollout_is_threshold)
        loss_ok = all(math.isfinite(float(res["pg_loss"])) for res in results)  # empty off the last stage
        applied, grad_norm, nonfinite = self._guarded_step(loss_ok, inputs_ok)
        metrics = self._reduce_update_metrics(results, grad_norm, applied)
        metrics["perf/padding_ratio/update"] = padding_ratio
        metrics["perf/update_guard_s"] = self._guard_s
        metrics["nonfinite"] = nonfinite  # type: ignore[assignment]  # popped by the trainer
        return metrics

    def _guarded_step(self, loss_ok: bool, inputs_ok: bool) -> tuple[bool, float, list[str]]:
        """megatron-core's ``optimizer.step()`` split at its seams so that a non-finite value skips the update.

        ``prepare_grads`` (fp16 loss-scale check included), ``get_grad_norm`` (reduced over the model-parallel
        group, and DP for the distributed optimizer), one agreement over all ranks, then clipping and
        ``step_with_ready_grads`` only when everything was finite. bf16/fp32 have no loss scaler, so without this a
        NaN update would be applied.
        """
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        from megatron_dapo.parallel import control_group

        optimizer = self.optimizer
        found_inf = bool(optimizer.prepare_grads())
        grad_norm = float("nan") if found_inf else float(optimizer.get_grad_norm())
        flags = torch.tensor([not loss_ok, not math.isfinite(grad_norm), not inputs_ok, found_inf], dtype=torch.float32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=control_group())
        names = (
            "actor/pg_loss",
            "actor/grad_norm",
            "loss inputs (old/ref log-probs, advantages, IS weights)",
            "fp16 gradients (loss scaler)",
        )
        nonfinite = [name for name, bad in zip(names, flags.tolist()) if bad]
        if nonfinite:
            return False, grad_norm, nonfinite
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            params = [] if getattr(inner, "is_stub_optimizer", False) else inner.get_parameters()
            if params and inner.config.clip_grad > 0.0:
                clip_grad_by_total_norm_fp32(
                    params,
                    max_norm=inner.config.clip_grad,
                    total_norm=grad_norm,
                    use_decoupled_grad=inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                )
        return bool(optimizer.step_with_ready_grads()), grad_norm, []

    def compute_gradients(
        self, mini_batch: dict, temperature: float, rollout_is_threshold: Optional[float] = None
    ) -> tuple[list[dict], bool, float]:
        """Forward-backward of a mini-batch with the DAPO loss hook; gradients land in the DDP grad buffers.

        Returns the per-micro-batch metric sums, whether this rank's loss inputs were finite, and the padding ratio.
        """
        from megatron.core import parallel_state as ps

        if self.optimizer is None:
            raise RuntimeError("update() needs an optimizer (this MegatronActor is a frozen reference)")
        cfg = self.cfg
        for c in self.chunks:
            c.train()
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.temperature = temperature

        ranks, groups, padding_ratio = self._plan(mini_batch, cfg.ppo_micro_batch_size_per_gpu)
        rows = torch.as_tensor(ranks[ps.get_data_parallel_rank()], dtype=torch.long)
        local = {k: v[rows] for k, v in mini_batch.items() if isinstance(v, torch.Tensor)}
        local.setdefault("loss_mask", local["response_mask"])
        on_policy = "old_log_probs" not in local
        names = ("loss_mask", "old_log_probs", "advantages", "ref_log_probs", "rollout_is_weights", "rollout_log_probs")
        mbs = self._micro_batches(local, groups, names)

        # Global normalisers over every micro-batch of every DP rank: the loss is exact for any split.
        counts = agg_normalisers(local["loss_mask"].float())
        device = next(self.chunks[0].parameters()).device
        norm = torch.stack([counts["global_token_count"], counts["global_seq_count"]]).double().to(device)
        dist.all_reduce(norm, group=ps.get_data_parallel_group())
        token_count, seq_count = norm[0].item(), norm[1].item()
        max_len = mini_batch["responses"].shape[1]
        scale = len(mbs) * ps.get_data_parallel_world_size()  # undo megatron's 1/num_microbatches and DDP's 1/dp
        agg = partial(
            agg_loss,
            loss_agg_mode=cfg.loss_agg_mode,
            global_token_count=token_count,
            global_seq_count=seq_count,
            max_response_length=max_len,
        )

        def loss_fn(log_probs, entropy, f):
            mask = f["loss_mask"].to(log_probs.dtype)
            old = log_probs.detach() if on_policy else f["old_log_probs"]
            is_weights = f.get("rollout_is_weights")
            if on_policy and rollout_is_threshold:
                is_weights = compute_rollout_is_weights(
                    old, f["rollout_log_probs"], f["response_mask"], rollout_is_threshold
                )
            terms = compute_policy_loss_terms(
                log_probs,
                old,
                f["advantages"],
                cfg.clip_ratio_low,
                cfg.clip_ratio_high,
                cfg.clip_ratio_c,
                is_weights,
            )
            pg_loss = agg(terms["pg_losses"], mask)
            entropy_loss = agg(entropy, mask)
            loss = pg_loss - cfg.entropy_coeff * entropy_loss
            sums = policy_loss_metric_sums(terms, mask)
            metric = {
                "pg_loss": pg_loss.detach(),
                "entropy": entropy_loss.detach(),
                "pg_clipfrac": sums["pg_clipfrac"],
                "pg_clipfrac_lower": sums["pg_clipfrac_lower"],
                "ppo_kl": sums["ppo_kl"],
                "num_tokens": sums["num_tokens"],
            }
            if cfg.use_kl_loss:
                kl = agg(kl_penalty(log_probs, f["ref_log_probs"], cfg.kl_loss_type), mask)
                loss = loss + cfg.kl_loss_coef * kl
                metric["kl_loss"] = kl.detach()
            if on_policy and "rollout_log_probs" in f:  # train-vs-rollout mismatch, from this forward
                valid = f["response_mask"].bool()
                diff = (old.double() - f["rollout_log_probs"].double()).abs()[valid]
                metric["logprob_diff_sum"] = diff.sum()
                metric["logprob_diff_max"] = diff.max() if diff.numel() else diff.new_zeros(())
                metric["logprob_diff_count"] = torch.tensor(float(diff.numel()))
            return loss * scale, metric

        started = time.perf_counter()
        inputs_ok = _loss_inputs_finite(local)
        self._guard_s = time.perf_counter() - started
        return self._run(mbs, loss_fn, forward_only=False), inputs_ok, padding_ratio

    def _reduce_update_metrics(self, results: list[dict], grad_norm, update_ok: bool) -> dict[str, float]:
        from megatron.core import parallel_state as ps

        keys = [
            "pg_loss",
            "entropy",
            "kl_loss",
            "pg_clipfrac",
            "pg_clipfrac_lower",
            "ppo_kl",
            "num_tokens",
            "logprob_diff_sum",
            "logprob_diff_count",
        ]
        device = next(self.chunks[0].parameters()).device  # collectives on the device: NCCL/HCCL take no CPU tensor
        sums = torch.zeros(len(keys) + 1, dtype=torch.float64, device=device)  # + the mismatch max (reduced below)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            for res in results:
                for i, k in enumerate(keys):
                    if k in res:
                        sums[i] += float(res[k])
                sums[-1] = max(float(sums[-1]), float(res.get("logprob_diff_max", 0.0)))
        sums = self._from_last_stage(sums)
        diff_max = sums[-1:].clone()
        dist.all_reduce(sums, group=ps.get_data_parallel_group())
        dist.all_reduce(diff_max, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
        m = dict(zip(keys, sums.tolist()))
        tokens = m.pop("num_tokens") + 1e-8
        metrics = {
            "actor/pg_loss": m["pg_loss"],
            "actor/entropy": m["entropy"],
            "actor/pg_clipfrac": m["pg_clipfrac"] / tokens,
            "actor/pg_clipfrac_lower": m["pg_clipfrac_lower"] / tokens,
            "actor/ppo_kl": m["ppo_kl"] / tokens,
            "actor/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "actor/lr": self.optimizer.param_groups[0]["lr"],
            "actor/update_ok": float(bool(update_ok)),
        }
        if self.cfg.use_kl_loss:
            metrics["actor/kl_loss"] = m["kl_loss"]
        if m["logprob_diff_count"] > 0:  # on-policy update: the rollout mismatch comes from the training forward
            metrics["rollout/logprob_diff_mean"] = m["logprob_diff_sum"] / m["logprob_diff_count"]
            metrics["rollout/logprob_diff_max"] = float(diff_max.item())
        return metrics
