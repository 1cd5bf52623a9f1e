"""A rollout's rewards, and the rollout as the step's ``TrainBatch``.

Every response is scored once, on one rank (rows dealt round-robin), and every rank gets all results (one object
gather on the CPU control group), so ranks agree on rewards — timeouts included — and on what dynamic sampling
keeps. A scorer failure on any rank is raised on every rank. ``eval`` scores on one rank with the same call.

With ``RunPlan.reward_overlap`` a generation batch is scored while it is generated (``ScoringInFlight``, the
generator's ``on_step``): each rank scores the responses of its replica that are its share as the engine ends them,
and the same gather then brings every rank's rows together.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_dapo.algo.registry import ADV_ESTIMATORS
from megatron_dapo.batch import TrainBatch
from megatron_dapo.config import AlgorithmConfig
from megatron_dapo.data.tokens import decode_responses
from megatron_dapo.judge.judge_scorer import JudgeScorer, score_judge
from megatron_dapo.parallel import control_group
from megatron_dapo.reward.manager import RewardManager, RewardResult, merge_results
from megatron_dapo.rm.scorer import RewardModelScorer, score_rollout
from megatron_dapo.rollout.types import RolloutBatch, SamplingSpec


def reward_inputs(rollout: RolloutBatch, items: list[dict]) -> tuple[list, list, list]:
    """The data source, ground truth and extra info of each rollout row's prompt; in a multi-turn rollout the extra
    info also holds the row's conversation (``messages``), ``num_turns``, ``tool_calls`` and ``tool_rewards``."""
    rows = rollout.prompt_index.tolist()
    extras = [items[i]["extra_info"] for i in rows]
    if rollout.turns is not None:
        extras = [{**extra, **turns} for extra, turns in zip(extras, rollout.turns)]
    return [items[i]["data_source"] for i in rows], [items[i]["ground_truth"] for i in rows], extras


class ScoringInFlight:
    """A generation batch scored while the engine generates it: the ``on_step`` sink of the run's generator
    (``types.FinishedSink``). Each response that ends goes to the reward workers at once; a replica's TP ranks all see
    it end and share the scoring (response ``k`` of the batch on peer ``k mod peers``). A failure (a data source no
    scorer takes) is kept and named at ``RolloutScorer.__call__``, so the engine's steps stay in lockstep."""

    def __init__(self, reward: RewardManager, items: list[dict], n: int, peer: int, peers: int) -> None:
        self.items, self.n, self.peer, self.peers = items, n, peer, peers
        self.stream = reward.stream()
        self.rows: list[int] = []  # the batch row of each response added, in order
        self.failure: Optional[BaseException] = None

    def __call__(self, finished: list[tuple[int, int, list[int], Optional[dict]]]) -> None:
        for prompt_index, sample, tokens, turns in finished:
            row = prompt_index * self.n + sample
            if row % self.peers != self.peer or self.failure is not None:
                continue
            item = self.items[prompt_index]
            extra = item["extra_info"] if turns is None else {**item["extra_info"], **turns}
            try:
                self.stream.add(tokens, item["data_source"], item["ground_truth"], extra)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 - raised after the generation, on every rank
                self.failure = exc
                return
            self.rows.append(row)

    def finish(self) -> tuple[list[int], object, float]:
        """``(rows, (scored rows, failures) or the failure's message, scored before this call)``; a failure of this
        rank is left in ``self.failure``."""
        early = float(self.stream.settled())
        try:
            scored = self.stream.finish()  # after a failure too: the pool session's thread ends with it
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - raised here, and named on every other rank
            self.failure = self.failure or exc
        if self.failure is not None:
            return self.rows, f"{type(self.failure).__name__}: {self.failure}", early
        return self.rows, scored, early


class RolloutScorer:
    """``reward`` over the ranks of a ``world_size`` job (1: this rank scores everything). With ``replica`` (this
    rank's ``(TP rank, TP size)`` in its rollout replica; ``RunPlan.reward_overlap``), ``start`` scores a generation
    batch while the engine generates it."""

    def __init__(
        self,
        reward: RewardManager,
        world_size: int,
        rank: int,
        replica: Optional[tuple[int, int]] = None,
        reward_model: Optional[RewardModelScorer] = None,
        judge: Optional[JudgeScorer] = None,
    ) -> None:
        self.reward, self.world_size, self.rank, self.replica = reward, world_size, rank, replica
        self.reward_model = reward_model  # reward.reward_model: its weighted score added to every response's reward
        self.judge = judge  # reward.judge: a generative judge's weighted score added too (judge/judge_scorer.py)

    def rule_based(self) -> RolloutScorer:
        """This scorer without the model-based terms (reward model, judge): validation reports rule-based accuracy
        only, so it skips their forwards, as verl's ``_validate`` skips model-based rewards."""
        return RolloutScorer(self.reward, self.world_size, self.rank, self.replica)

    def start(self, items: list[dict], n: int) -> Optional[ScoringInFlight]:
        """The sink that scores a generation batch of ``items`` x ``n`` responses as they end; None without
        overlap (the batch is then scored by ``__call__`` after the generation)."""
        if self.replica is None:
            return None
        return ScoringInFlight(self.reward, items, n, *self.replica)

    def __call__(
        self, rollout: RolloutBatch, items: list[dict], in_flight: Optional[ScoringInFlight] = None
    ) -> RewardResult:
        if in_flight is not None:
            return self._collect(rollout, in_flight)
        sources, truths, extras = reward_inputs(rollout, items)
        responses, mask = rollout.responses, rollout.response_mask
        if self.world_size == 1:
            return self.reward(responses, mask, sources, truths, extras)
        mine = list(range(self.rank, responses.shape[0], self.world_size))
        part: object = None
        failure: Optional[BaseException] = None
        if mine:
            try:
                part = self.reward(
                    responses[mine],
                    mask[mine],
                    [sources[i] for i in mine],
                    [truths[i] for i in mine],
                    [extras[i] for i in mine],
                )
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 - raised here, and named on every other rank
                failure = exc
                part = f"{type(exc).__name__}: {exc}"  # user exception types need not unpickle elsewhere
        parts = self._gathered((mine, part), failure)
        return merge_results([(rows, result) for rows, result in parts if rows], responses.shape[0])

    def _collect(self, rollout: RolloutBatch, in_flight: ScoringInFlight) -> RewardResult:
        """The rewards of a batch scored while it was generated: every rank's rows, gathered, as one result;
        ``reward/scored_during_gen`` is the share of the batch scored before the generation returned."""
        mine, part, early = in_flight.finish()
        parts = self._gathered((mine, part, early), in_flight.failure)
        batch = rollout.responses.shape[0]
        rows: list[Optional[dict]] = [None] * batch
        errors = timeouts = 0
        for indices, (scored, (num_errors, num_timeouts)), _ in parts:
            for i, row in zip(indices, scored):
                rows[i] = row
            errors, timeouts = errors + num_errors, timeouts + num_timeouts
        missing = [i for i, row in enumerate(rows) if row is None]
        if missing:
            raise RuntimeError(f"internal error: rollout rows {missing[:8]} were not scored while generated")
        result = self.reward.result(rows, rollout.responses, rollout.response_mask, (errors, timeouts))
        result.metrics["reward/scored_during_gen"] = sum(p[2] for p in parts) / batch if batch else 0.0
        return result

    def _gathered(self, part: tuple, failure: Optional[BaseException]) -> list:
        """Every rank's ``part`` (whose second item is a failure's message on a rank whose scoring failed), on every
        rank; a failure on any rank is raised on every rank."""
        if self.world_size == 1:
            parts = [part]
        else:
            parts = [None] * self.world_size
            dist.all_gather_object(parts, part, group=control_group())
        if failure is not None:
            raise failure
        for source_rank, gathered in enumerate(parts):
            if isinstance(gathered[1], str):
                raise RuntimeError(f"reward scoring failed on rank {source_rank}: {gathered[1]}")
        return parts

    def close(self) -> None:
        self.reward.close()
        if self.judge is not None:
            self.judge.close()


def score_to_batch(
    scorer: RolloutScorer,
    algorithm: AlgorithmConfig,
    rollout: RolloutBatch,
    items: list[dict],
    tokenizer: Optional[Any] = None,
    in_flight: Optional[ScoringInFlight] = None,
) -> tuple[TrainBatch, dict]:
    """The rollout as a ``TrainBatch``: rewards on the last response token (scored now, or while it was generated by
    ``in_flight``), overlong shaping/filtering, per-sample info; with a ``tokenizer``, the prompt and response texts
    too (for the rollout dump)."""
    rows = rollout.prompt_index.tolist()
    result = scorer(rollout, items, in_flight)
    score_rollout(scorer.reward_model, result, rollout)  # every training rank: the reward model's forward is collective
    score_judge(scorer.judge, result, rollout, items)  # every rollout rank: the judge's generate is collective
    # Multi-turn: only the tokens the model sampled are trained (tool turns are not).
    loss_mask = (rollout.response_mask if rollout.loss_mask is None else rollout.loss_mask).clone()
    if scorer.reward.config.overlong_filter:  # reward.overlong_filter
        loss_mask[result.overlong] = 0
    batch = TrainBatch(
        prompts=rollout.prompts,
        prompt_mask=rollout.prompt_mask,
        responses=rollout.responses,
        response_mask=rollout.response_mask,
        loss_mask=loss_mask,
        sampled_mask=rollout.loss_mask,
        rollout_log_probs=rollout.rollout_log_probs,
        token_versions=rollout.token_versions,
        truncated=rollout.truncated,
        token_level_scores=result.token_level_scores,
        seq_rewards=result.scores,
        verifier_scores=torch.tensor([float(s) if s is not None else 0.0 for s in result.extra["score"]]),
        acc=torch.tensor([float(bool(a)) for a in result.extra.get("acc", [None] * len(rows))]),
        data_source=[items[i]["data_source"] for i in rows],
        **(rollout.routed_experts or {}),  # routing replay: the experts vLLM chose per token
    )
    if ADV_ESTIMATORS.needs(algorithm.adv_estimator).reward_components:
        batch.reward_components = reward_components(result.extra, algorithm.gdpo_reward_keys or [])
    if tokenizer is not None:
        batch.prompt_text = [items[i]["raw_prompt"] for i in rows]
        batch.response_text = decode_responses(tokenizer, rollout.responses, rollout.response_lengths.tolist())
    return batch, dict(result.metrics)


def reward_components(extra: dict[str, list], keys: list[str]) -> torch.Tensor:
    """GDPO's ``[B, K]`` reward dimensions: the reward function's dict values under ``keys`` (0 for a row whose call
    failed). A key no row returned is a configuration error, named with the keys the function did return."""
    missing = [k for k in keys if all(v is None for v in extra.get(k, [None]))]
    if missing:
        returned = sorted(k for k, v in extra.items() if any(x is not None for x in v))
        raise ValueError(
            f"algorithm.gdpo_reward_keys: the reward function returned no {missing} (it returned {returned}); "
            "return them in compute_score's dict"
        )
    return torch.tensor([[float(v or 0.0) for v in extra[k]] for k in keys], dtype=torch.float32).T.contiguous()


def greedy_baselines(
    generator: Any,
    scorer: RolloutScorer,
    algorithm: AlgorithmConfig,
    rollout: RolloutBatch,
    items: list[dict],
    sampling: SamplingSpec,
    seed_offset: int,
) -> torch.Tensor:
    """ReMax's ``reward_baselines[B]``: the reward of one greedy response to each prompt of ``items`` (generated by
    ``generator`` with the training budget, scored like the rollout), for each row of ``rollout``. Collective."""
    greedy = dataclasses.replace(sampling, n=1, temperature=0.0, top_p=1.0, top_k=-1)
    baseline, _ = score_to_batch(scorer, algorithm, generator.generate(items, greedy, seed_offset=seed_offset), items)
    return baseline.seq_rewards[rollout.prompt_index]
