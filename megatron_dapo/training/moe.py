"""Mixture-of-experts bookkeeping for the actor's update: the router's auxiliary losses and the load of each expert.

The auxiliary losses themselves enter the gradient inside megatron-core: each router attaches its load-balancing
(``moe_aux_loss_coeff``) and z-loss (``moe_z_loss_coeff``) terms to its routing scores (``MoEAuxLossAutoScaler``),
and the pipeline schedule scales them by ``1 / num_microbatches`` (times CP) while DDP averages gradients over
data-parallel ranks. The DAPO loss hook undoes both for the policy loss only (it is a global token sum), so the
auxiliary terms stay a *mean* over micro-batches and ranks of per-micro-batch losses: their weight relative to the
policy loss does not change with the micro-batch or data-parallel split. (A load-balancing loss is a non-linear
statistic of the tokens it sees, so no split of it is exactly additive; the mean is megatron-core's definition.)

``MoEMeter`` reads what megatron-core tracks per layer (the unscaled losses, summed over the micro-batches of an
optimizer step) and counts the tokens routed to each expert with forward hooks on the routers. Padding is excluded
from both: the actor passes each micro-batch's ``padding_mask`` to the model, which hands it to every router.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["MoEMeter"]


class MoEMeter:
    """Per optimizer step: ``actor/moe_aux_loss``, ``actor/moe_z_loss`` (means over MoE layers and micro-batches, as
    megatron-core logs them) and ``actor/moe_expert_load/min|max`` (tokens per expert, over layers: the least and most
    loaded expert of any layer) plus ``actor/moe_expert_load/layer<i>/min|max`` per MoE layer."""

    def __init__(self, chunks: list, config) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.config = config
        self.num_layers = config.num_layers
        freq = config.moe_layer_freq
        self.num_moe_layers = (
            sum(freq) if isinstance(freq, list) else sum(1 for i in range(self.num_layers) if i % freq == 0)
        )
        self.counts = torch.zeros(self.num_layers, config.num_moe_experts, dtype=torch.float64)
        self.num_micro_batches = 0
        self._hooks = [
            module.register_forward_hook(self._count, with_kwargs=True)
            for chunk in chunks
            for module in chunk.modules()
            if isinstance(module, TopKRouter)
        ]

    def _count(self, router, args, kwargs, outputs) -> None:
        if not router.training:  # log-prob forwards are not part of the update's load
            return
        _, routing_map = outputs
        routed = routing_map.detach().to(torch.float64)
        padding: Optional[torch.Tensor] = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)
        if padding is not None:  # [s, b] as the router sees the tokens (sequence-major), True on padding
            routed = routed * (~padding.reshape(-1)).to(routed.device, torch.float64).unsqueeze(-1)
        self.counts[router.layer_number - 1] += routed.sum(0).cpu()

    def start_step(self, num_micro_batches: int) -> None:
        """An optimizer step of ``num_micro_batches`` begins: forget what earlier forwards left (an update that did
        not finish, or megatron-core's tracker)."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.num_micro_batches = num_micro_batches
        self.counts.zero_()
        clear_aux_losses_tracker()

    def metrics(self, device: torch.device) -> dict[str, float]:
        """The step's metrics (collective over the model: PP, DP×CP, TP with SP); resets the meter."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.moe_utils import (
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
            reduce_aux_losses_tracker_across_ranks,
        )

        out: dict[str, float] = {}
        tracker = get_moe_layer_wise_logging_tracker()
        if tracker:
            reduce_aux_losses_tracker_across_ranks()
            names = {"load_balancing_loss": "actor/moe_aux_loss", "z_loss": "actor/moe_z_loss"}
            per = max(self.num_micro_batches, 1) * max(self.num_moe_layers, 1)
            for name, values in sorted(tracker.items()):
                out[names.get(name, f"actor/moe_{name}")] = float(values["values"].double().sum()) / per
            clear_aux_losses_tracker()
        counts = self.counts.to(device, copy=True)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(counts, group=ps.get_pipeline_model_parallel_group())
        dist.all_reduce(counts, group=ps.get_data_parallel_group(with_context_parallel=True))
        if self.config.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:
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
