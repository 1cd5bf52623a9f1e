"""MoE routing replay ("R3", ``actor.router_replay=rollout``): the actor's forwards route every token to the experts
the rollout engine chose, so old log-probs and the update see the rollout's routing instead of re-deciding top-k.

megatron-core 0.16 has the mechanism (``megatron/core/transformer/moe/router_replay.py``): a router with a
``RouterReplay`` (``TopKRouter.router_replay``, created when ``moe_enable_routing_replay`` is set) takes its top-k
indices from ``target_topk_idx`` under ``REPLAY_FORWARD`` and pops them from ``replay_backward_list`` under
``REPLAY_BACKWARD`` (activation recomputation re-runs the router in the backward pass); the top-k *weights* are still
the model's own scores gathered at those indices, so gradients reach the router. Its global helpers address every
instance of the process at once (``set_replay_data`` wants one tensor per instance, in creation order); this module
addresses the routers of one model chunk at a time instead, which is what pipeline (and virtual pipeline) schedules
need: ``forward_step`` runs per chunk and per micro-batch, in an order the schedule decides.

``RouterReplayer(chunks)``:

* installs a ``RouterReplay`` on each ``TopKRouter`` of the actor's chunks (the frozen reference keeps routing by
  itself) — what ``moe_enable_routing_replay=True`` does at build time, done afterwards so only the actor replays;
* maps each router to its MoE layer: ``router.layer_number`` (global, 1-based, PP/VPP offsets included) → its
  position among the model's MoE layers (``config.moe_layer_freq``), the ``L`` axis of ``MicroBatch.routed_experts``;
* ``set_micro_batch(chunk, mb)`` (from ``forward_step``): gives each router of that chunk its ``[num_tokens, K]``
  indices in the order megatron-core's router flattens its input, ``[s, b]`` → ``s * b + b_idx`` — the
  sequence-parallel shard of this TP rank when SP is on (CP slicing and THD packing were already applied to the
  micro-batch, ``batch.py``). Padding tokens, and tokens whose K indices repeat (the last response token, which the
  engine never ran), get experts ``0..K-1`` (their outputs are masked; distinct indices keep the dispatch at exactly
  K copies per token);
* a forward pre-hook on each router sets ``REPLAY_BACKWARD`` when the router runs inside autograd's backward
  (megatron's ``CheckpointFunction`` recomputation) and ``REPLAY_FORWARD`` otherwise: the backward list is a FIFO
  in forward order, which is the order every megatron schedule recomputes a chunk's micro-batches in;
* ``clear()`` after ``forward_backward_func``: indices and actions are dropped (routers route by themselves again).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_dapo.batch import MicroBatch
from megatron_dapo.models.builder import unwrap

__all__ = ["RouterReplayer", "moe_layer_numbers"]


def moe_layer_numbers(config) -> list[int]:
    """The global 1-based numbers of the MoE layers (megatron-core's ``moe_layer_freq``: an int k = every k-th layer
    from the first, or a 0/1 list per layer)."""
    freq = config.moe_layer_freq
    pattern = [int(i % freq == 0) for i in range(config.num_layers)] if isinstance(freq, int) else list(freq)
    return [i + 1 for i, f in enumerate(pattern) if f]


class RouterReplayer:
    """Replays ``MicroBatch.routed_experts`` in the routers of an actor's model chunks (see the module docstring)."""

    def __init__(self, chunks: list) -> None:
        # heavy: megatron-core, once the platform has patched it
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay

        config = unwrap(chunks[0]).config
        if getattr(config, "moe_router_fusion", False):
            raise ValueError("router replay needs moe_router_fusion=False (the fused top-k kernel bypasses the replay)")
        self.config = config
        self.topk = int(config.moe_router_topk)
        self.num_experts = int(config.num_moe_experts)
        position = {number: i for i, number in enumerate(moe_layer_numbers(config))}
        self.num_moe_layers = len(position)
        # id(chunk as forward_step sees it) -> [(router, index of its MoE layer)]
        self._routers: dict[int, list[tuple[torch.nn.Module, int]]] = {}
        self._all: list[torch.nn.Module] = []
        self._mode: Optional[str] = None  # None (route by themselves) | "replay" | "record"
        config.moe_enable_routing_replay = True  # what megatron-core's routers read at build time; ours are built
        for chunk in chunks:
            found = []
            for module in unwrap(chunk).modules():
                if isinstance(module, TopKRouter):
                    if module.router_replay is None:
                        module.router_replay = RouterReplay()
                    module.register_forward_pre_hook(self._pre_hook)
                    found.append((module, position[int(module.layer_number)]))
            self._routers[id(chunk)] = found
            for inner in self._unwrapped_ids(chunk):
                self._routers[inner] = found
            self._all += [m for m, _ in found]

    @staticmethod
    def _unwrapped_ids(model) -> list[int]:
        ids = []
        while hasattr(model, "module"):
            model = model.module
            ids.append(id(model))
        return ids

    def _pre_hook(self, module, args) -> None:
        # heavy: megatron-core, once the platform has patched it
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        replay = module.router_replay
        if self._mode is None:
            replay.router_replay_action = None
        elif self._mode == "record":
            replay.router_replay_action = RouterReplayAction.RECORD
        elif torch._C._current_graph_task_id() != -1:  # inside backward: activation recomputation
            replay.router_replay_action = RouterReplayAction.REPLAY_BACKWARD
        else:
            replay.router_replay_action = RouterReplayAction.REPLAY_FORWARD

    def router_indices(self, mb: MicroBatch, moe_layer: int) -> torch.Tensor:
        """``[num_tokens, K]`` int64 indices of MoE layer ``moe_layer`` in the order this rank's router sees tokens."""
        routed = mb.routed_experts[:, :, moe_layer]  # [b, S, K]
        padding = mb.padding_mask
        if self.config.sequence_parallel and self.config.tensor_model_parallel_size > 1:
            from megatron.core import parallel_state as ps  # heavy: megatron-core, once the platform has patched it

            tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
            share = routed.shape[1] // tp
            routed = routed[:, rank * share : (rank + 1) * share]
            padding = padding[:, rank * share : (rank + 1) * share]
        flat = routed.transpose(0, 1).reshape(-1, self.topk).long()
        pad = padding.transpose(0, 1).reshape(-1)
        ordered = flat.sort(-1).values
        repeated = (ordered[:, 1:] == ordered[:, :-1]).any(-1) if self.topk > 1 else torch.zeros_like(pad)
        filler = pad | repeated
        flat = torch.where(filler.unsqueeze(-1), torch.arange(self.topk, device=flat.device), flat)
        if bool(((flat < 0) | (flat >= self.num_experts)).any()):
            raise ValueError(f"replayed routing holds expert ids outside 0..{self.num_experts - 1}")
        return flat.contiguous()

    def set_micro_batch(self, chunk, mb: MicroBatch) -> None:
        """Queue ``mb``'s routing in the routers of ``chunk`` (the model ``forward_step`` was given); nothing while
        recording."""
        if self._mode == "record":
            return
        routers = self._routers.get(id(chunk))
        if routers is None:
            raise ValueError("router replay: this model chunk is not one of the actor's")
        if mb.routed_experts is None:
            raise ValueError(
                "actor.router_replay=rollout but the batch carries no rollout routing "
                "(TrainBatch.prompt_routed_experts / response_routed_experts are None)"
            )
        layers, k = int(mb.routed_experts.shape[2]), int(mb.routed_experts.shape[3])
        if layers != self.num_moe_layers or k != self.topk:
            raise ValueError(
                f"rollout routing has {layers} MoE layers x top-{k}; the model has {self.num_moe_layers} x "
                f"top-{self.topk}"
            )
        self._mode = "replay"
        for router, moe_layer in routers:
            router.router_replay.set_target_indices(self.router_indices(mb, moe_layer))

    def finish(self) -> None:
        """After a ``forward_backward_func``: drop the replayed routing (a recording is kept until ``clear()``)."""
        if self._mode == "replay":
            self.clear()

    def clear(self) -> None:
        """Drop every queued index and action: the routers route by themselves again."""
        self._mode = None
        for router in self._all:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()

    def record(self) -> None:
        """Until ``clear()``, the routers route by themselves and keep their last forward's top-k (``recorded``)."""
        self._mode = "record"

    def recorded(self, chunk=None) -> list[Optional[torch.Tensor]]:
        """The routers' last recorded ``[num_tokens, K]`` indices (after ``record()``), in ``chunk``'s (or all)
        routers' order."""
        routers = self._routers[id(chunk)] if chunk is not None else [(m, 0) for m in self._all]
        return [m.router_replay.get_recorded_indices() for m, _ in routers]
