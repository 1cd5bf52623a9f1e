"""megatron-core's forward/backward schedule over a test's micro-batches, as the model-comparison workers run it."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch


def run_schedule(
    model: list,
    mbs: list[dict],
    vocab: int,
    seq: int,
    batch: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    forward_only: bool = False,
    mask_key: str = "mcore_mask",
) -> tuple[dict[int, torch.Tensor], list]:
    """``get_forward_backward_func()`` over ``mbs`` (each with ``ids``, ``pos``, ``mask_key``, ``targets``, ``valid``
    and ``index``): the last stage's logits per micro-batch, gathered over TP and cut to ``vocab`` (the padded
    columns dropped), and the reduced losses. ``loss_fn(logits, targets, valid)`` is the micro-batch's loss."""
    # heavy: megatron-core, in the torchrun workers only
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    captured: dict[int, torch.Tensor] = {}

    def loss_func(mb: dict, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        full = gather_from_tensor_model_parallel_region(output)[..., :vocab]
        captured[mb["index"]] = full.detach().clone()
        loss = loss_fn(full, mb["targets"], mb["valid"])
        # A copy: the schedule divides the returned loss in place by the number of micro-batches.
        return loss, {"loss": loss.detach().clone()}

    def forward_step(data_iterator, chunk):  # noqa: ANN001 - megatron-core's forward_step_func
        mb = next(data_iterator)
        return chunk(mb["ids"], mb["pos"], mb[mask_key]), partial(loss_func, mb)

    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(mbs),
        model=model,
        num_microbatches=len(mbs),
        seq_length=seq,
        micro_batch_size=batch,
        forward_only=forward_only,
    )
    return captured, losses
