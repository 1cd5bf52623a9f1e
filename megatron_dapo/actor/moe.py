"""Mixture-of-experts bookkeeping for the actor's update: the router's auxiliary losses and the load of each expert.

**Router losses, scaled like the policy loss.** Each megatron-core router attaches its load-balancing term
(``moe_aux_loss_coeff``, ``switch_load_balancing_loss_func`` over the micro-batch's tokens) and its z-loss
(``moe_z_loss_coeff / (TP·CP)`` x the mean of ``logsumexp(logits)²`` over the router's non-padding tokens) to the
routing scores (``MoEAuxLossAutoScaler``); both coefficients are read from the model's ``TransformerConfig`` at
forward time. The pipeline schedule scales these gradients by ``CP / num_microbatches`` and DDP averages over the
``DP·CP`` ranks, so left alone they would be a plain mean over micro-batches and ranks, while the DAPO loss is a
global token mean. ``MoEMeter.before_forward`` therefore sets, before each training micro-batch's forward,

    moe_aux_loss_coeff = coeff_aux · M · DP · n_mb / N
    moe_z_loss_coeff   = coeff_z   · M · DP · CP · TP · n_rank / N

(``router_loss_weights``) with ``M`` this rank's micro-batches, ``n_mb`` the micro-batch's non-padding tokens (all
its CP parts), ``n_rank`` those the router on this rank sees (its CP part; its TP part with sequence parallelism),
and ``N`` the mini-batch's non-padding tokens over all DP x CP ranks (one all-reduce per mini-batch, plus one over CP
for ``n_mb`` when CP > 1). The gradient of the router losses is then that of

    coeff_z · Σ_layers Σ_tokens logsumexp² / N  +  coeff_aux · Σ_layers Σ_micro-batches (n_mb / N) · LB_mb

over the whole mini-batch: the z-loss is exactly a global token mean (independent of the micro-batch, DP and CP
split, like the policy loss); the load-balancing loss is the token-weighted mean of per-micro-batch statistics. That
one is non-linear in the tokens it sees (expert fractions times mean probabilities), so no split of it is exactly
additive: a different split changes it (as it does in megatron-core, which takes the plain mean). The base
coefficients are restored after the update (``metrics``) and for any forward that is not the update's.
With ``actor.recompute=full`` a layer's first forward runs without gradients (no router loss) and the router
losses are made when the layer is recomputed during the backward, which pipeline schedules run after later
micro-batches' forwards. Each router therefore queues the weights of the micro-batches it saw without gradients and
takes them back, in the same (first-in first-out) order, when it is recomputed.

**Metrics.** ``actor/moe_aux_loss`` and ``actor/moe_z_loss`` are the *unweighted* losses (coefficient 1) as the
optimizer step sees them: per MoE layer the token-weighted mean ``Σ (n / N) · loss`` over micro-batches and ranks,
then the mean over MoE layers. megatron-core's tracker stores each forward's loss divided by its coefficient (so
unscaled whatever the weight); forward hooks on the routers take each forward's increment and weight it (the z-loss
metric is then the global token mean of ``logsumexp²``, independent of the split). ``actor/moe_expert_load/*``
counts the tokens routed to each expert with the same hooks. Padding is excluded everywhere: the actor passes each
micro-batch's ``padding_mask`` to the model, which hands it to every router. Only forwards with gradients count (a
fully recomputed layer's first, no-grad forward computes no router loss and is not counted twice).
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch
import torch.distributed as dist

from megatron_dapo.actor.router_replay import moe_layer_numbers

__all__ = ["MoEMeter", "router_loss_weights"]

_LOSSES = ("load_balancing_loss", "z_loss")  # megatron-core's tracker names


def _router_tokens(padding_mask: torch.Tensor, config) -> int:
    """Non-padding tokens of a (CP-local) micro-batch that this rank's routers see: with sequence parallelism the
    model scatters the sequence-major ``[s, b]`` mask over TP (``GPTModel.forward``), so this TP rank's share."""
    from megatron.core import parallel_state as ps  # heavy: megatron-core, once the platform has patched it

    keep = ~padding_mask.bool()
    tp = ps.get_tensor_model_parallel_world_size()
    if config.sequence_parallel and tp > 1:
        keep = keep.transpose(0, 1).chunk(tp, dim=0)[ps.get_tensor_model_parallel_rank()]
    return int(keep.sum())


def router_loss_weights(micro_batches: list, config, device: torch.device) -> list[dict[str, float]]:
    """Per micro-batch of this rank: the factors on the base router-loss coefficients (``aux``, ``z``) and the
    metric weights (``aux_frac`` = n_mb / N, ``z_frac`` = n_rank / N); see the module docstring. Collective over
    DP x CP (and CP)."""
    from megatron.core import parallel_state as ps  # heavy: megatron-core, once the platform has patched it

    dp, cp = ps.get_data_parallel_world_size(), ps.get_context_parallel_world_size()
    tp = ps.get_tensor_model_parallel_world_size()
    local = torch.tensor(
        [float((~mb.padding_mask.bool()).sum()) for mb in micro_batches], dtype=torch.float64, device=device
    )
    total = local.sum().reshape(1)
    dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
    whole = local.clone()  # each micro-batch's tokens over its CP parts (the CP ranks share the micro-batches)
    if cp > 1:
        dist.all_reduce(whole, group=ps.get_context_parallel_group())
    n_total = max(float(total.item()), 1.0)
    m = len(micro_batches)
    out = []
    for mb, n_mb in zip(micro_batches, whole.tolist()):
        n_rank = _router_tokens(mb.padding_mask, config)
        out.append(
            {
                "aux": m * dp * n_mb / n_total,
                "z": m * dp * cp * tp * n_rank / n_total,
                "aux_frac": n_mb / n_total,
                "z_frac": n_rank / n_total,
            }
        )
    return out


class MoEMeter:
    """Per optimizer step: ``actor/moe_aux_loss``, ``actor/moe_z_loss`` (unweighted losses, token-weighted over
    micro-batches and ranks, mean over MoE layers; only the losses that are on) and ``actor/moe_expert_load/min|max``
    (tokens per expert, over layers: the least and most loaded expert of any layer) plus
    ``actor/moe_expert_load/layer<i>/min|max`` per MoE layer. Also sets the router-loss coefficients per micro-batch
    (``start_step`` / ``before_forward``)."""

    def __init__(self, chunks: list, config) -> None:
        # heavy: megatron-core, once the platform has patched it
        from megatron.core.transformer.moe.router import TopKRouter

        self.config = config
        self.num_layers = config.num_layers
        self.num_moe_layers = len(moe_layer_numbers(config))
        # The coefficients the model was built with (the config's fields are re-set per micro-batch).
        self.base_aux = float(config.moe_aux_loss_coeff or 0.0)
        self.base_z = float(config.moe_z_loss_coeff or 0.0)
        self.counts = torch.zeros(self.num_layers, config.num_moe_experts, dtype=torch.float64)
        self.num_micro_batches = 0
        self._weights: dict[int, dict[str, float]] = {}
        self._current: Optional[dict[str, float]] = None
        self._loss_sums: Optional[torch.Tensor] = None  # [2, layers]: Σ weight x loss of (load balancing, z)
        self._snapshot: dict[int, list[Optional[torch.Tensor]]] = {}
        # Recomputed layers (see the module docstring): per router, the weights of the micro-batches its no-grad
        # first forwards saw, in forward order; and the weights each running router forward uses.
        self._queued: dict[int, deque] = {}
        self._active: dict[int, dict[str, float]] = {}
        routers = [module for chunk in chunks for module in chunk.modules() if isinstance(module, TopKRouter)]
        self._hooks = [r.register_forward_pre_hook(self._before_router) for r in routers]
        self._hooks += [r.register_forward_hook(self._count, with_kwargs=True) for r in routers]

    # ------------------------------------------------------------------------------------------ coefficients

    def start_step(self, micro_batches: list, device: Optional[torch.device] = None) -> None:
        """An optimizer step over this rank's ``micro_batches`` begins: their router-loss weights (collective over
        DP x CP when a router loss is on); forget what earlier forwards left (an update that did not finish, or
        megatron-core's tracker)."""
        # heavy: megatron-core, once the platform has patched it
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.num_micro_batches = len(micro_batches)
        self.counts.zero_()
        clear_aux_losses_tracker()
        self._loss_sums = None
        self._weights = {}
        self._queued, self._active = {}, {}
        self.restore()
        if self.base_aux > 0 or self.base_z > 0:
            device = device if device is not None else torch.device("cpu")
            weights = router_loss_weights(micro_batches, self.config, device)
            self._weights = {id(mb): w for mb, w in zip(micro_batches, weights)}

    def before_forward(self, micro_batch) -> None:
        """Set the router-loss coefficients for ``micro_batch`` (one of ``start_step``'s, as the data iterator
        yields it); any other micro-batch (a log-prob forward) gets the base coefficients."""
        w = self._weights.get(id(micro_batch))
        if w is None:
            self.restore()
            return
        self._current = w
        self._apply(w)

    def _apply(self, w: dict[str, float]) -> None:
        if self.base_aux > 0:
            self.config.moe_aux_loss_coeff = self.base_aux * w["aux"]
        if self.base_z > 0:  # None, not 0, when the router sees no token (megatron-core divides by it)
            self.config.moe_z_loss_coeff = self.base_z * w["z"] if w["z"] > 0 else None

    def restore(self) -> None:
        """The coefficients the model was built with."""
        self._current = None
        self.config.moe_aux_loss_coeff = self.base_aux
        self.config.moe_z_loss_coeff = self.base_z if self.base_z > 0 else None

    # ------------------------------------------------------------------------------------------ router hooks

    @staticmethod
    def _tracked(name: str, layer: int) -> Optional[torch.Tensor]:
        # heavy: megatron-core, once the platform has patched it
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        entry = get_moe_layer_wise_logging_tracker().get(name)
        return None if entry is None else entry["values"][layer]

    def _before_router(self, router, args) -> None:
        if not router.training:
            return
        key = id(router)
        if not torch.is_grad_enabled():  # a recomputed layer's first forward: its losses come at recompute time
            if self._current is not None:
                self._queued.setdefault(key, deque()).append(self._current)
            return
        recomputing = torch._C._current_graph_task_id() != -1  # running inside autograd's backward
        if recomputing and self._queued.get(key):
            w = self._queued[key].popleft()
            self._apply(w)  # this router's forward reads the coefficients now; the next forward_step re-sets them
        else:
            w = self._current
        if w is None:
            return
        self._active[key] = w
        layer = router.layer_number - 1
        snaps = []
        for name in _LOSSES:
            value = self._tracked(name, layer)
            snaps.append(None if value is None else value.detach().double().clone())
        self._snapshot[id(router)] = snaps

    def _count(self, router, args, kwargs, outputs) -> None:
        # Log-prob forwards are not part of the update's load; a recomputed layer's no-grad forward is counted when
        # it is recomputed (with gradients).
        if not router.training or not torch.is_grad_enabled():
            return
        _, routing_map = outputs
        routed = routing_map.detach().to(torch.float64)
        padding: Optional[torch.Tensor] = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)
        if padding is not None:  # [s, b] as the router sees the tokens (sequence-major), True on padding
            routed = routed * (~padding.reshape(-1)).to(routed.device, torch.float64).unsqueeze(-1)
        layer = router.layer_number - 1
        self.counts[layer] += routed.sum(0).cpu()
        snaps = self._snapshot.pop(id(router), None)
        w = self._active.pop(id(router), None)
        if snaps is None or w is None:
            return
        fracs = (w["aux_frac"], w["z_frac"])
        for i, (name, before, frac) in enumerate(zip(_LOSSES, snaps, fracs)):
            value = self._tracked(name, layer)
            if value is None:
                continue
            if self._loss_sums is None:
                self._loss_sums = torch.zeros(2, self.num_layers, dtype=torch.float64, device=value.device)
            delta = value.detach().double() - (before if before is not None else 0.0)
            self._loss_sums[i, layer] += frac * delta

    # ------------------------------------------------------------------------------------------ metrics

    def metrics(self, device: torch.device) -> dict[str, float]:
        """The step's metrics (collective over the model: PP, DP×CP, TP); restores the base coefficients and resets
        the meter."""
        # heavy: megatron-core, once the platform has patched it
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.restore()
        self._weights = {}
        self._snapshot, self._queued, self._active = {}, {}, {}
        out: dict[str, float] = {}
        tp = ps.get_tensor_model_parallel_world_size()
        sp = self.config.sequence_parallel and tp > 1
        if self.base_aux > 0 or self.base_z > 0:
            sums = torch.zeros(2, self.num_layers, dtype=torch.float64, device=device)
            if self._loss_sums is not None:
                sums += self._loss_sums.to(device)
            if ps.get_pipeline_model_parallel_world_size() > 1:
                dist.all_reduce(sums, group=ps.get_pipeline_model_parallel_group())
            dist.all_reduce(sums, group=ps.get_data_parallel_group(with_context_parallel=True))
            if tp > 1:  # load balancing: each TP rank holds a part of the micro-batch's statistic
                dist.all_reduce(sums, group=ps.get_tensor_model_parallel_group())
                if not sp:  # z-loss: without SP every TP rank saw the same tokens
                    sums[1] /= tp
            per_layer = sums.sum(-1).cpu() / max(self.num_moe_layers, 1)
            if self.base_aux > 0:
                out["actor/moe_aux_loss"] = float(per_layer[0])
            if self.base_z > 0:
                out["actor/moe_z_loss"] = float(per_layer[1])
        self._loss_sums = None
        clear_aux_losses_tracker()
        counts = self.counts.to(device, copy=True)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(counts, group=ps.get_pipeline_model_parallel_group())
        dist.all_reduce(counts, group=ps.get_data_parallel_group(with_context_parallel=True))
        if sp:
            dist.all_reduce(counts, group=ps.get_tensor_model_parallel_group())
        counts = counts.cpu()
        self.last_counts = counts  # [layers, experts] tokens routed to each expert in the step (all ranks)
        moe_layers = [i for i in range(self.num_layers) if counts[i].sum() > 0]
        for i in moe_layers:
            out[f"actor/moe_expert_load/layer{i}/min"] = float(counts[i].min())
            out[f"actor/moe_expert_load/layer{i}/max"] = float(counts[i].max())
        if moe_layers:
            out["actor/moe_expert_load/min"] = min(out[f"actor/moe_expert_load/layer{i}/min"] for i in moe_layers)
            out["actor/moe_expert_load/max"] = max(out[f"actor/moe_expert_load/layer{i}/max"] for i in moe_layers)
        self.counts.zero_()
        return out
