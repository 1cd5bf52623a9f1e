"""Training: the loop (``trainer``), the start-up both sides of a job share (``startup``), the rollout's seam
(``rollout_source``) and its stages (``rollout_phase`` with ``group_sources``, ``reward_stage``, ``logprob_stage``,
``advantage_stage``), the async job's two sides (``async_phase``, ``rollout_worker``), the run's counters and step
checkpoints (``run_state``) and failure handling (``failure``).

No imports here: importing a submodule must not pull in megatron-core, vLLM or the others.
"""
