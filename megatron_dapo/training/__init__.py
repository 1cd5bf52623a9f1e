"""Training: the loop (``trainer``) and its stages (``rollout_phase`` with ``rollout_sources``, ``reward_stage``,
``logprob_stage``, ``advantage_stage``), the async job's two sides (``async_phase``, ``rollout_worker``), the run's
counters and step checkpoints (``run_state``) and failure handling (``failure``).

No imports here: importing a submodule must not pull in megatron-core, vLLM or the others.
"""
