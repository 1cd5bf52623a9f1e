"""The Megatron-Core side of a step: forward-only log-probs and the DAPO update, through ``forward_backward_func``.

The actor takes a ``TrainBatch`` (``megatron_dapo/batch.py``; every rank holds all of it, as scoring returns it).
Rows are balanced over data-parallel ranks (``balance_rows``), grouped into micro-batches (``split_micro_batches``)
and re-laid out by ``make_micro_batch``. The loss hook computes response log-probs chunk by chunk from the
vocab-parallel logits (``algo/logprobs.py``) and hands them to ``algo/loss.py:dapo_loss`` with the mini-batch's
global normalisers; it undoes megatron-core's ``1/num_microbatches`` and DDP's ``1/dp`` scaling, so loss and
gradients do not depend on TP/PP/DP sizes or the micro-batch split.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist

from megatron_dapo.actor.extra_loss import EXTRA_LOSS, ExtraLossTerm, reduce_term_metrics
from megatron_dapo.actor.moe import MoEMeter
from megatron_dapo.actor.router_replay import RouterReplayer
from megatron_dapo.algo.logprobs import response_log_probs, response_sum_pi_squared
from megatron_dapo.algo.loss import (
    LOSS_METRIC_SUMS,
    LossNormalisers,
    dapo_loss,
    local_loss_counts,
    loss_metrics,
    partial_row_sum,
)
from megatron_dapo.batch import (
    MicroBatch,
    TrainBatch,
    context_parallel_slice,
    make_micro_batch,
    pack_micro_batch,
    padded_seq_len,
)
from megatron_dapo.config import ActorConfig
from megatron_dapo.config.plan import RunPlan
from megatron_dapo.models.builder import unwrap
from megatron_dapo.models.lora import adapters_enabled
from megatron_dapo.parallel import control_group
from megatron_dapo.platform import get_platform

# The autograd mode of a forward-only pass. megatron-core's schedules never turn autograd off for forward_only: with
# it on, every micro-batch's graph (its activations) lives until the pass ends, held by the results (Megatron-LM's
# evaluate and verl's megatron actor run the same call under no_grad). tests/gpu/gpu_check.py swaps it to measure
# the pass as it was.
FORWARD_ONLY_GRAD_MODE: Callable[[], contextlib.AbstractContextManager] = torch.no_grad


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


def plan_micro_batches(
    lengths: list[int],
    dp: int,
    dp_rank: int,
    micro_batch_size: int,
    max_tokens: Optional[int],
    packed: bool,
    seq_multiple: int,
) -> tuple[list[list[int]], list[list[int]], float]:
    """Every DP rank's rows (``balance_rows``), rank ``dp_rank``'s micro-batches as positions in its rows, and the
    padding ratio (padded ÷ real tokens) of the whole batch over all ranks — the same on every rank."""
    ranks = balance_rows(lengths, dp)
    padded = 0
    mine: list[list[int]] = []
    for r, rows in enumerate(ranks):
        row_lengths = [lengths[i] for i in rows]
        groups = split_micro_batches(row_lengths, micro_batch_size, max_tokens)
        for g in groups:
            if packed:
                padded += padded_seq_len(sum(row_lengths[i] for i in g), seq_multiple)
            else:
                padded += len(g) * padded_seq_len(max(row_lengths[i] for i in g), seq_multiple)
        if r == dp_rank:
            mine = groups
    return ranks, mine, padded / max(sum(lengths), 1)


def guarded_step(optimizer, loss_ok: bool, inputs_ok: bool) -> tuple[bool, float, list[str]]:
    """megatron-core's ``optimizer.step()`` split at its seams so that a non-finite value skips the update.

    ``prepare_grads`` (fp16 loss-scale check included), ``get_grad_norm`` (reduced over the model-parallel
    group, and DP for the distributed optimizer), one agreement over all ranks, then clipping and
    ``step_with_ready_grads`` only when everything was finite. bf16/fp32 have no loss scaler, so without this a
    NaN update would be applied.
    """
    from megatron.core.optimizer.clip_grads import (
        clip_grad_by_total_norm_fp32,
    )  # heavy: megatron-core

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


def _loss_inputs_finite(local: TrainBatch) -> bool:
    """Whether this rank's loss inputs are finite wherever the loss mask lets them into the loss."""
    mask = local.loss_mask.bool()
    for value in (
        local.old_log_probs, local.advantages, local.ref_log_probs, local.rollout_is_weights, local.teacher_log_probs
    ):  # fmt: skip
        if value is not None and not bool(torch.isfinite(value[mask]).all()):
            return False
    return True


_CAUSAL_MASKS: dict[str, torch.Tensor] = {}  # device -> the longest mask asked for there


def causal_mask(seq_len: int, device) -> torch.Tensor:
    """``[1, 1, S, S]`` True above the diagonal (masked), read-only. One mask per device, grown to the longest
    length asked for: a shorter one is its top-left corner (a view). A mask per length would keep one S x S tensor
    on the device for every micro-batch length ever seen."""
    key = str(device)
    mask = _CAUSAL_MASKS.get(key)
    if mask is None or mask.shape[-1] < seq_len:
        mask = torch.triu(torch.ones((1, 1, seq_len, seq_len), dtype=torch.bool, device=device), diagonal=1)
        _CAUSAL_MASKS[key] = mask
    return mask[..., :seq_len, :seq_len]


def _wraps_float16_module(chunk) -> bool:
    """Whether ``chunk`` (DDP / Float16Module / GPTModel) runs through megatron-core's ``Float16Module``."""
    from megatron.core.transformer.module import (
        Float16Module,
    )  # heavy: megatron-core

    while chunk is not None:
        if isinstance(chunk, Float16Module):
            return True
        chunk = getattr(chunk, "module", None)
    return False


def _packed_seq_params(mb: MicroBatch):
    """megatron-core's description of a THD micro-batch for the attention and rotary kernels."""
    from megatron.core.packed_seq_params import (
        PackedSeqParams,
    )  # heavy: megatron-core

    # Every row's padding counts as part of the row (verl does the same): causal attention keeps it out of the
    # real tokens, and FlashAttention writes every output row (with real lengths in cu_seqlens_q it leaves the pad
    # rows of the packed output unwritten, garbage that the backward then reads).
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=mb.cu_seqlens_padded,
        cu_seqlens_kv=mb.cu_seqlens_padded,
        cu_seqlens_q_padded=mb.cu_seqlens_padded,
        cu_seqlens_kv_padded=mb.cu_seqlens_padded,
        max_seqlen_q=mb.max_seqlen,
        max_seqlen_kv=mb.max_seqlen,
    )


def from_last_stage(t: torch.Tensor) -> torch.Tensor:
    """Broadcast a tensor held by the last pipeline stage to every stage (same shape everywhere)."""
    from megatron.core import (
        parallel_state as ps,
    )  # heavy: megatron-core

    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return t


# ------------------------------------------------------------------------------------------- log-probs


@torch.no_grad()
def reduce_update_metrics(results: list[dict], actor_cfg: ActorConfig, device: torch.device) -> dict[str, float]:
    """verl's ``actor/*`` metrics of one mini-batch from the loss hook's per-micro-batch sums, reduced over
    micro-batches, from the last pipeline stage and over data-parallel ranks (device tensors: NCCL/HCCL take
    no CPU tensor)."""
    from megatron.core import (
        parallel_state as ps,
    )  # heavy: megatron-core

    sums = torch.zeros(len(LOSS_METRIC_SUMS) + 1, dtype=torch.float64, device=device)  # + the mismatch max
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        for res in results:
            for i, key in enumerate(LOSS_METRIC_SUMS):
                if key in res:
                    sums[i] += float(res[key])
            sums[-1] = max(float(sums[-1]), float(res.get("logprob_diff_max", 0.0)))
    sums = from_last_stage(sums)
    diff_max = sums[-1:].clone()
    group = ps.get_data_parallel_group(with_context_parallel=True)  # CP ranks hold parts of the same rows
    dist.all_reduce(sums, group=group)
    dist.all_reduce(diff_max, op=dist.ReduceOp.MAX, group=group)
    return loss_metrics(dict(zip(LOSS_METRIC_SUMS, sums.tolist())), actor_cfg.use_kl_loss, float(diff_max.item()))


@dataclass(frozen=True)
class _LogitScoring:
    """What the loss hook reads from the last stage's vocab-parallel logits at the response positions."""

    true_vocab_size: int
    temperature: float
    tp_rank: int
    tp_group: Any

    def _rows(self, mb: MicroBatch, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(1 if mb.packed else mb.response_index.shape[0], -1)  # packed: one sequence holds every row

    def log_probs(self, logits: torch.Tensor, mb: MicroBatch, entropy_grad: bool) -> tuple:
        """Log-probs and entropy, read straight from the full-sequence logits chunk by chunk (no gathered copy, no
        [T, V] fp32 tensor); the gradient is written into the logits' storage, which nothing reads after the hook's
        backward."""
        log_probs, entropy = response_log_probs(
            logits,
            self._rows(mb, mb.response_index),
            self._rows(mb, mb.response_tokens),
            self.true_vocab_size,
            self.temperature,
            vocab_start=self.tp_rank * logits.shape[-1],
            tp_group=self.tp_group,
            entropy_requires_grad=entropy_grad,
            grad_into_logits=True,
        )
        shape = mb.response_index.shape
        return log_probs.view(shape), entropy.view(shape)

    def sum_pi_squared(self, logits: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """``Σ π²`` at each response position (the optimal-token-baseline estimators)."""
        sq = response_sum_pi_squared(
            logits,
            self._rows(mb, mb.response_index),
            self.true_vocab_size,
            self.temperature,
            vocab_start=self.tp_rank * logits.shape[-1],
            tp_group=self.tp_group,
        )
        return sq.view(mb.response_index.shape)


def seq_multiple(config) -> int:
    """Sequence lengths are padded to this: sequence parallelism splits them over TP, context parallelism into
    ``2 x CP`` chunks (each CP rank's share again split over TP with SP)."""
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    cp = config.context_parallel_size
    return tp * (2 * cp if cp > 1 else 1)


def local_micro_batches(
    batch: TrainBatch, micro_batch_size: int, actor_cfg: ActorConfig, packed: bool, multiple: int
) -> tuple[list[list[int]], TrainBatch, list[list[int]], list[MicroBatch], float]:
    """This rank's share of ``batch`` as micro-batches: (every DP rank's rows, this rank's rows of ``batch``, its
    micro-batch positions, the micro-batches, the padding ratio)."""
    from megatron.core import (
        parallel_state as ps,
    )  # heavy: megatron-core

    budget = actor_cfg.ppo_max_token_len_per_gpu if actor_cfg.use_dynamic_bsz else None
    dp_rank = ps.get_data_parallel_rank()
    ranks, groups, padding_ratio = plan_micro_batches(
        batch.sequence_lengths.tolist(),
        ps.get_data_parallel_world_size(),
        dp_rank,
        micro_batch_size,
        budget,
        packed,
        multiple,
    )
    local = batch.select(ranks[dp_rank])
    if packed:  # packed (THD), the whole padded to the SP multiple; CP is refused by config
        micro_batches = [pack_micro_batch(make_micro_batch(local, rows), 1, multiple) for rows in groups]
    else:
        cp_size, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        micro_batches = [
            context_parallel_slice(make_micro_batch(local, rows, multiple), cp_size, cp_rank) for rows in groups
        ]
    return ranks, local, groups, micro_batches, padding_ratio


@dataclass(frozen=True)
class ForwardStep:
    """What ``forward_step`` needs besides the micro-batch and the model chunk: set once per pass by
    ``MegatronActor._run``."""

    device: torch.device
    platform: Any
    moe: bool  # MoE routers leave padding out of their losses and the expert load
    moe_meter: Optional[MoEMeter]
    router_replay: Optional[RouterReplayer]
    half_wrapped: bool  # a Float16Module chunk: keep the logits in bf16/fp16 (the loss upcasts them chunk by chunk)
    explicit_mask: bool
    scoring: _LogitScoring
    entropy_grad: bool
    loss_fn: Callable[..., tuple]  # (log_probs, entropy, micro_batch[, sum_pi_squared=]) -> (loss, metric sums)
    sum_pi_squared: bool


def forward_step(step: ForwardStep, data_iterator, model) -> tuple[torch.Tensor, Callable]:
    """megatron-core's ``forward_step_func`` (bound to ``step`` with ``functools.partial``, as Megatron-LM binds its
    arguments): the chunk's forward on the next micro-batch, and the loss hook for its output."""
    with step.platform.model_compute():
        mb: MicroBatch = next(data_iterator)
        if step.moe_meter is not None:  # the router losses' weights for this micro-batch (actor/moe.py)
            step.moe_meter.before_forward(mb)
        mb = mb.to(step.device)
        if step.router_replay is not None:  # the rollout's expert choices for this chunk's routers
            step.router_replay.set_micro_batch(model, mb)
        kwargs: dict[str, Any] = {"padding_mask": mb.padding_mask} if step.moe else {}
        if step.half_wrapped:
            kwargs["fp32_output"] = False
        if mb.packed:  # THD: the attention masks by cu_seqlens
            output = model(mb.tokens, mb.position_ids, None, packed_seq_params=_packed_seq_params(mb), **kwargs)
        else:
            mask = causal_mask(mb.tokens.shape[1], step.device) if step.explicit_mask else None
            output = model(mb.tokens, mb.position_ids, mask, **kwargs)
    return output, functools.partial(loss_func, step, mb)


def loss_func(step: ForwardStep, mb: MicroBatch, logits: torch.Tensor) -> tuple:
    """The loss hook: response log-probs and entropy (and ``Σ π²``) from the last stage's logits, handed to
    ``step.loss_fn``."""
    with step.platform.model_compute():
        log_probs, entropy = step.scoring.log_probs(logits, mb, entropy_grad=step.entropy_grad)
        if not step.sum_pi_squared:
            return step.loss_fn(log_probs, entropy, mb)
        return step.loss_fn(log_probs, entropy, mb, sum_pi_squared=step.scoring.sum_pi_squared(logits, mb))


@dataclass(frozen=True)
class Gradients:
    """What ``MegatronActor.compute_gradients`` leaves besides the gradients in the DDP buffers."""

    micro_batch_sums: list[dict]  # the loss hook's metric sums per micro-batch (empty off the last stage)
    inputs_finite: bool  # this rank's loss inputs were finite where the loss mask lets them in
    padding_ratio: float
    guard_s: float  # seconds spent checking the loss inputs


@dataclass(frozen=True)
class UpdateResult:
    """One guarded optimizer step: verl's ``actor/*`` metrics, and what was not finite (the step was skipped)."""

    metrics: dict[str, float]
    nonfinite: tuple[str, ...] = ()


class MegatronActor:
    """Megatron-Core model chunks (actor or frozen reference) and, for the actor, its optimizer."""

    def __init__(
        self,
        chunks: list,
        true_vocab_size: int,
        actor_cfg: ActorConfig,
        optimizer=None,
        packed: Optional[bool] = None,
        explicit_causal_mask: Optional[bool] = None,
        extra_loss: Optional[ExtraLossTerm] = None,
    ):
        """``packed``: packed (THD) micro-batches, the run's ``RunPlan.use_remove_padding``; None = as
        ``actor.use_remove_padding`` says (off when unset: tests and tools outside a training run).
        ``explicit_causal_mask``: the run's ``RunPlan.explicit_causal_mask``; None = the platform's default.
        ``extra_loss``: a term the update's loss hook joins to the policy loss (``actor/extra_loss.py``)."""
        from megatron.core.distributed import finalize_model_grads  # heavy: megatron-core

        self.chunks = chunks
        self.packed = bool(actor_cfg.use_remove_padding) if packed is None else packed
        self.explicit_causal_mask = (
            get_platform().causal_mask_needed if explicit_causal_mask is None else explicit_causal_mask
        )
        self.true_vocab_size = true_vocab_size
        self.cfg = actor_cfg
        self.optimizer = optimizer
        self.extra_loss = extra_loss
        self.model_config = unwrap(chunks[0]).config
        self.moe: Optional[MoEMeter] = None
        if getattr(self.model_config, "num_moe_experts", None) and optimizer is not None:
            self.moe = MoEMeter(chunks, self.model_config)
        # actor.router_replay=rollout: the actor (not the frozen reference) routes tokens as the rollout did.
        self.router_replay: Optional[RouterReplayer] = None
        if actor_cfg.router_replay == "rollout" and optimizer is not None:
            self.router_replay = RouterReplayer(chunks)
        if optimizer is not None:
            self.model_config.finalize_model_grads_func = finalize_model_grads
            self.model_config.grad_scale_func = optimizer.scale_loss
            no_sync = [c.no_sync for c in chunks]
            self.model_config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
            ddp = getattr(chunks[0], "ddp_config", None)
            if ddp is not None and ddp.overlap_grad_reduce:  # the schedule starts each chunk's reduction (Megatron-LM)
                start = [c.start_grad_sync for c in chunks]
                self.model_config.grad_sync_func = start[0] if len(start) == 1 else start

    @classmethod
    def for_plan(
        cls,
        chunks: list,
        true_vocab_size: int,
        actor_cfg: ActorConfig,
        plan: RunPlan,
        optimizer=None,
        extra_loss: Optional[ExtraLossTerm] = None,
    ) -> MegatronActor:
        """The actor (with ``optimizer``, and ``extra_loss`` when the run adds a term to the policy loss) or a
        frozen model of a run: its micro-batch layout and causal mask as the run's plan resolved them."""
        return cls(
            chunks,
            true_vocab_size,
            actor_cfg,
            optimizer,
            packed=plan.use_remove_padding,
            explicit_causal_mask=plan.explicit_causal_mask,
            extra_loss=extra_loss,
        )

    @property
    def device(self) -> torch.device:
        return next(self.chunks[0].parameters()).device

    # ------------------------------------------------------------------------------------------- plumbing

    def _run(
        self,
        micro_batches: list[MicroBatch],
        loss_fn: Callable[..., tuple],
        temperature: float,
        forward_only: bool,
        sum_pi_squared: bool = False,
    ) -> list[dict]:
        """``forward_backward_func`` over ``micro_batches``; the loss hook turns the last stage's logits into response
        log-probs and entropy at ``temperature`` and calls ``loss_fn(log_probs, entropy, micro_batch)`` (with
        ``sum_pi_squared``, also ``sum_pi_squared=`` each response position's ``Σ π²``, for the optimal-token-baseline
        estimators)."""
        # heavy: megatron-core
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        step = ForwardStep(
            device=self.device,
            platform=get_platform(),
            moe=bool(getattr(self.model_config, "num_moe_experts", None)),
            moe_meter=self.moe,
            router_replay=self.router_replay,
            # Float16Module upcasts the last stage's output to fp32 by default: a second, 2x larger copy of the logits.
            half_wrapped=_wraps_float16_module(self.chunks[0]),
            explicit_mask=self.explicit_causal_mask,
            scoring=_LogitScoring(
                self.true_vocab_size,
                temperature,
                ps.get_tensor_model_parallel_rank(),
                ps.get_tensor_model_parallel_group(),
            ),
            entropy_grad=self.cfg.entropy_coeff != 0,
            loss_fn=loss_fn,
            sum_pi_squared=sum_pi_squared,
        )
        iterators = [iter(micro_batches) for _ in self.chunks] if len(self.chunks) > 1 else iter(micro_batches)
        try:
            with FORWARD_ONLY_GRAD_MODE() if forward_only else contextlib.nullcontext():
                return get_forward_backward_func()(
                    forward_step_func=functools.partial(forward_step, step),
                    data_iterator=iterators,
                    model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
                    num_microbatches=len(micro_batches),
                    seq_length=max(int(mb.tokens.shape[1]) for mb in micro_batches),
                    micro_batch_size=max(int(mb.tokens.shape[0]) for mb in micro_batches),
                    forward_only=forward_only,
                )
        finally:
            if self.router_replay is not None:
                self.router_replay.finish()

    def compute_log_probs(
        self, batch: TrainBatch, temperature: float, calculate_entropy: bool = False, calculate_sum_pi_squared=False
    ) -> dict:
        """Per-token log-probs (and entropy, and ``sum_pi_squared`` = ``Σ π²``) of ``batch.responses`` on every rank
        (``[B, T]`` float32, 0 outside the response mask), plus ``padding_ratio`` (padded ÷ real tokens of the
        forward passes)."""
        from megatron.core import (
            parallel_state as ps,
        )  # heavy: megatron-core

        for c in self.chunks:
            c.eval()
        ranks, local, groups, micro_batches, padding_ratio = local_micro_batches(
            batch, self.cfg.log_prob_micro_batch_size_per_gpu, self.cfg, self.packed, seq_multiple(self.model_config)
        )

        def keep(log_probs, entropy, mb: MicroBatch, sum_pi_squared=None):
            stats = [log_probs, entropy] + ([sum_pi_squared] if sum_pi_squared is not None else [])
            return log_probs.sum() * 0.0, {"stats": torch.stack(stats) * mb.response_mask}

        results = self._run(micro_batches, keep, temperature, True, calculate_sum_pi_squared)
        device = self.device
        out = torch.zeros((3, len(local), local.responses.shape[1]), dtype=torch.float32, device=device)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            for positions, res in zip(groups, results):
                index = torch.as_tensor(positions, dtype=torch.long, device=device)
                out[: len(res["stats"]), index] = res["stats"].float()
        out = from_last_stage(out)
        if ps.get_context_parallel_world_size() > 1:  # each CP rank holds the tokens predicted in its chunks
            dist.all_reduce(out, group=ps.get_context_parallel_group())
        gathered = [torch.empty_like(out) for _ in range(ps.get_data_parallel_world_size())]
        dist.all_gather(gathered, out, group=ps.get_data_parallel_group())
        full = torch.zeros((3, len(batch), out.shape[-1]), dtype=torch.float32)
        for rank_rows, part in zip(ranks, gathered):  # back to the batch's row order
            full[:, torch.as_tensor(rank_rows, dtype=torch.long)] = part.cpu()
        result = {"log_probs": full[0], "padding_ratio": padding_ratio}
        if calculate_entropy:
            result["entropy"] = full[1]
        if calculate_sum_pi_squared:
            result["sum_pi_squared"] = full[2]
        return result

    # ------------------------------------------------------------------------------------------- update

    def update(
        self,
        mini_batch: TrainBatch,
        temperature: float,
        rollout_is_threshold: Optional[float] = None,
        max_response_length: Optional[int] = None,
    ) -> UpdateResult:
        """One optimizer step on a mini-batch: forward-backward with the DAPO loss hook, then a guarded step.

        The step is applied only when the loss, the gradient norm and the loss inputs are finite on every rank (one
        reduction over all ranks, so no rank steps alone); otherwise parameters and optimizer state are left as
        they were and ``actor/update_ok`` is 0, with ``UpdateResult.nonfinite`` naming what was not finite.

        Without ``old_log_probs`` (the on-policy path: one epoch, one mini-batch, so the policy has not moved since
        the rollout) the loss uses the training forward's own log-probs, detached, as the old policy's; then the
        rollout mismatch metrics and the truncated-IS weights (``rollout_is_threshold``) come from this forward too.
        ``max_response_length`` is ``seq-mean-token-sum-norm``'s constant (``data.max_response_length``; default:
        the batch's response width).
        """
        grads = self.compute_gradients(mini_batch, temperature, rollout_is_threshold, max_response_length)
        loss_ok = all(
            math.isfinite(float(res["pg_loss"])) and math.isfinite(float(res.get(EXTRA_LOSS, 0.0)))
            for res in grads.micro_batch_sums
        )
        applied, grad_norm, nonfinite = guarded_step(self.optimizer, loss_ok, grads.inputs_finite)
        metrics = reduce_update_metrics(grads.micro_batch_sums, self.cfg, self.device)
        if self.extra_loss is not None:
            metrics.update(self._extra_metrics(grads.micro_batch_sums))
        metrics["actor/grad_norm"] = grad_norm
        metrics["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["actor/update_ok"] = float(applied)
        if self.moe is not None:
            metrics.update(self.moe.metrics(self.device))
        metrics["perf/padding_ratio/update"] = grads.padding_ratio
        metrics["perf/update_guard_s"] = grads.guard_s
        return UpdateResult(metrics, tuple(nonfinite))

    def _extra_metrics(self, results: list[dict]) -> dict[str, float]:
        """The extra loss term's metrics of a mini-batch, reduced as the term says (``actor/extra_loss.py``)."""
        from megatron.core import (
            parallel_state as ps,
        )  # heavy: megatron-core

        return reduce_term_metrics(
            results,
            self.extra_loss.metric_reductions,
            self.device,
            ps.is_pipeline_last_stage(ignore_virtual=True),
            from_last_stage,
            ps.get_data_parallel_group(with_context_parallel=True),
        )

    def compute_gradients(
        self,
        mini_batch: TrainBatch,
        temperature: float,
        rollout_is_threshold: Optional[float] = None,
        max_response_length: Optional[int] = None,
    ) -> Gradients:
        """Forward-backward of a mini-batch with the DAPO loss hook; gradients land in the DDP grad buffers."""
        from megatron.core import (
            parallel_state as ps,
        )  # heavy: megatron-core

        if self.optimizer is None:
            raise RuntimeError("update() needs an optimizer (this MegatronActor is a frozen reference)")
        for c in self.chunks:
            c.train()
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        _, local, _, micro_batches, padding_ratio = local_micro_batches(
            mini_batch, self.cfg.ppo_micro_batch_size_per_gpu, self.cfg, self.packed, seq_multiple(self.model_config)
        )
        if self.moe is not None:
            self.moe.start_step(micro_batches, self.device)
        # Global normalisers over every micro-batch of every DP rank: the loss is exact for any split.
        counts = local_loss_counts(local.loss_mask).to(self.device)
        dist.all_reduce(counts, group=ps.get_data_parallel_group())
        width = max_response_length or int(mini_batch.responses.shape[1])
        norm = LossNormalisers(counts[0].item(), counts[1].item(), width, counts[2].item())
        # Undo megatron's 1/num_microbatches and DDP's 1/dp (with CP, megatron's x cp and DDP's 1/(dp x cp) cancel).
        scale = len(micro_batches) * ps.get_data_parallel_world_size()
        cp_group = ps.get_context_parallel_group() if ps.get_context_parallel_world_size() > 1 else None

        def loss_hook(log_probs, entropy, mb: MicroBatch):
            # Sequence-level losses (GSPO, GMPO) need whole-sequence sums: under CP each rank holds part of every
            # row, so its partial sums are all-reduced over the CP group (packed/THD rows are whole: CP is off).
            row_sum = None
            if cp_group is not None:
                row_sum = partial_row_sum(mb.loss_mask, lambda t: dist.all_reduce(t, group=cp_group))
            loss, sums = dapo_loss(
                log_probs,
                entropy,
                loss_mask=mb.loss_mask,
                # the tokens the rollout sampled: the train-vs-rollout mismatch is measured on them
                response_mask=mb.response_mask if mb.sampled_mask is None else mb.sampled_mask,
                advantages=mb.advantages,
                cfg=self.cfg,
                norm=norm,
                old_log_probs=mb.old_log_probs,
                ref_log_probs=mb.ref_log_probs,
                rollout_log_probs=mb.rollout_log_probs,
                rollout_is_weights=mb.rollout_is_weights,
                rollout_is_threshold=rollout_is_threshold,
                row_sum=row_sum,
            )
            if self.extra_loss is not None:  # e.g. on-policy distillation's term (distill/loss_term.py)
                loss, extra = self.extra_loss.combine(loss, log_probs, mb, norm)
                sums.update(extra)
            return loss * scale, sums

        started = time.perf_counter()
        inputs_ok = _loss_inputs_finite(local)
        guard_s = time.perf_counter() - started
        sums = self._run(micro_batches, loss_hook, temperature, forward_only=False)
        return Gradients(sums, inputs_ok, padding_ratio, guard_s)


class LogProbModel(Protocol):
    """What the log-prob phase needs of a model: the actor, a frozen reference or the adapter-free actor."""

    def compute_log_probs(self, batch: TrainBatch, temperature: float, **kwargs: Any) -> dict: ...


class AdapterFreeReference:
    """The KL reference of a LoRA run (``actor.lora``): the actor itself with its adapters off, i.e. the base model
    it was loaded from (docs/lora.md). No second model is built and nothing needs to move for it."""

    def __init__(self, actor: MegatronActor) -> None:
        self.actor = actor

    def compute_log_probs(self, batch: TrainBatch, temperature: float, **kwargs: Any) -> dict:
        with adapters_enabled(self.actor.chunks, False):
            return self.actor.compute_log_probs(batch, temperature, **kwargs)
