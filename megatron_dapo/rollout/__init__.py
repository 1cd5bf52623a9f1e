"""Rollout: the colocated vLLM engine (``engine``), Megatron → vLLM weight sync (``sync``) and batch types."""

from megatron_dapo.rollout.types import RolloutBatch, SamplingSpec, build_rollout_batch

__all__ = ["RolloutBatch", "SamplingSpec", "build_rollout_batch"]
