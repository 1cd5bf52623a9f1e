"""Reference recompute of a rollout's sampled-token log-probs with the Megatron model (checks and benchmarks).

The trainer computes its log-probs in ``actor/actor`` (micro-batched, vocab-parallel); this is the plain
whole-batch version used to check that the vLLM engine runs the weights the actor holds: one forward through
megatron-core's ``forward_backward_func``, TP logits gathered, float64 log-softmax over the true vocabulary.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_dapo.models.builder import unwrap
from megatron_dapo.rollout.types import RolloutBatch


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, 1, S, S]`` boolean for megatron-core's local attention, True = masked: future positions and padding."""
    s = attention_mask.shape[1]
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=attention_mask.device), diagonal=1)
    return causal[None, None] | (attention_mask == 0)[:, None, None, :]


def pad_for_sequence_parallel(model_chunks: list, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Right-pad ``[B, S]`` tensors with zeros to a multiple of TP when the model uses sequence parallelism (its
    sequence is split over TP ranks); padded keys are masked by a zero attention mask."""
    from megatron.core import parallel_state as ps  # heavy: megatron-core

    multiple = ps.get_tensor_model_parallel_world_size() if unwrap(model_chunks[0]).config.sequence_parallel else 1
    extra = -tensors[0].shape[1] % multiple
    return tuple(torch.nn.functional.pad(t, (0, extra)) if extra else t for t in tensors)


@torch.no_grad()
def megatron_sampled_log_probs(
    model_chunks: list, vocab_size: int, batch: RolloutBatch, temperature: float = 1.0
) -> Optional[torch.Tensor]:
    """``log p(responses | prefix)`` as ``[B, T]`` float64 (0 on padding) on the last pipeline stage, else None.

    Collective over the model-parallel groups (every rank of the model calls it with the same batch).
    """
    # heavy: megatron-core
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    ids, pos, attention_mask = pad_for_sequence_parallel(
        model_chunks, batch.input_ids, batch.position_ids, batch.attention_mask
    )
    b, s = ids.shape
    mask = causal_padding_mask(attention_mask)
    out: dict[str, torch.Tensor] = {}

    def forward_step(_data, model):
        output = model(ids, pos, mask)

        def loss_func(output_tensor):
            out["logits"] = gather_from_tensor_model_parallel_region(output_tensor)
            return output_tensor.sum() * 0, {}

        return output, loss_func

    was_training = [m.training for m in model_chunks]
    for m in model_chunks:
        m.eval()
    try:
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter([None]) for _ in model_chunks],
            model=model_chunks,
            num_microbatches=1,
            seq_length=s,
            micro_batch_size=b,
            forward_only=True,
        )
    finally:
        for m, training in zip(model_chunks, was_training):
            m.train(training)
    if not ps.is_pipeline_last_stage():
        return None
    logp = torch.log_softmax(out["logits"][..., :vocab_size].double() / temperature, dim=-1)
    p, t = batch.prompts.shape[1], batch.responses.shape[1]
    # The token at input position p + k is predicted by the logits at position p + k - 1.
    pred = logp[:, p - 1 : p + t - 1]
    return torch.gather(pred, 2, batch.responses.unsqueeze(-1)).squeeze(-1) * batch.response_mask
