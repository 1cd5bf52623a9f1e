"""Where a step's groups come from, inside the colocated rollout phase: one *round* at a time, each handing
``RolloutPhase.collect`` finished groups to score and filter (dynamic sampling) until the training batch is full.
(The trainer's own seam, one level up, is ``training/rollout_source.RolloutSource``.)

* ``WholeGroups`` (synchronous rollout): a round draws a generation batch of prompts and generates every response to
  its end with the current weights;
* ``PartialGroups`` (``rollout.partial_rollout``): a round advances responses by one segment through the
  request-level rollout (``rollout/partial.py``; conversations turn by turn in a multi-turn run) and hands over the
  groups that are done, oldest first. Unfinished
  responses stay in its buffer (a checkpoint component) and continue at the next step with that step's weights.

A round returns a ``Round`` (the rollout's rows, the dataset rows of its prompts, a group id per row, and the rewards
being computed already when the rollout was scored while it was generated) or None when no group finished in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from megatron_dapo.config.plan import PartialPlan
from megatron_dapo.data import PromptSampler
from megatron_dapo.rollout.engine import RolloutEngine
from megatron_dapo.rollout.multi_turn import MultiTurnRollout, tool_metrics
from megatron_dapo.rollout.partial import PartialRollout, groups_to_rollout, segments_of
from megatron_dapo.rollout.types import RolloutBatch, SamplingSpec
from megatron_dapo.training.reward_stage import RolloutScorer, ScoringInFlight


class Round(NamedTuple):
    rollout: RolloutBatch
    items: list[dict]
    ids: list
    scoring: Optional[ScoringInFlight] = None  # the rollout's rewards, computed while it was generated


@dataclass
class PromptData:
    train: Any  # RLDataset of the training prompts
    val: Optional[Any]  # RLDataset of the validation prompts, or None
    sampler: PromptSampler  # the resumable order of training prompts


class WholeGroups:
    """Synchronous rollout: every round is a new generation batch, generated whole by the run's ``generator``
    (single-turn, or multi-turn with tools: ``rollout/multi_turn.py``), and scored while it is generated where the
    ``scorer`` overlaps (``RunPlan.reward_overlap``)."""

    def __init__(self, generator: Any, data: PromptData, sampling: SamplingSpec, scorer: RolloutScorer) -> None:
        self.generator, self.data, self.sampling, self.scorer = generator, data, sampling, scorer

    def round(self, step: int, version: int, need: int, index: int) -> Optional[Round]:
        items = [self.data.train[i] for i in self.data.sampler.next_batch()]
        scoring = self.scorer.start(items, self.sampling.n)
        rollout = self.generator.generate(items, self.sampling, seed_offset=step * 1000 + index, on_step=scoring)
        ids = [f"{step}-{index}-{int(i)}" for i in rollout.prompt_index]
        return Round(rollout, items, ids, scoring)

    def metrics(self) -> dict[str, float]:
        return self.generator.metrics()


class PartialGroups:
    """Partial rollout: rounds advance the buffer's responses a segment at a time (module docstring).

    A round first advances every unfinished response that has not had a segment this step, and draws a new
    generation batch only when the done and advancing groups cannot fill what the batch still ``need``s (a group
    waiting for tool calls that outlasted their round is not counted as advancing: its calls may run until their
    timeout). At most
    ``2 x gen_batch_size`` groups are in flight; when that many are and none can advance this step, they get another
    segment with the same weights (no version is added, so the staleness bound holds).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        data: PromptData,
        sampling: SamplingSpec,
        plan: PartialPlan,
        max_response_length: int,
        n: int,
        conversations: Optional[MultiTurnRollout] = None,
    ) -> None:
        self.engine, self.data, self.sampling, self.n = engine, data, sampling, n
        self.buffer = PartialRollout(engine, plan, max_response_length, conversations)
        self.max_in_flight = 2 * data.sampler.batch_size
        self._segments: list[int] = []  # of every response handed over since the last metrics()
        self._turns: list[dict] = []  # multi-turn: the conversations handed over since the last metrics()

    def round(self, step: int, version: int, need: int, index: int) -> Optional[Round]:
        buf = self.buffer
        if buf.num_done() < need:
            todo = buf.pending(step)
            if not todo and buf.num_in_flight() >= self.max_in_flight:
                todo = buf.pending(step, again=True)
            advancing = len({g.key for g, _ in todo if not g.awaiting_tools})  # a slow call's group may take long
            if buf.num_done() + advancing < need and buf.num_in_flight() < self.max_in_flight:
                first_new = len(buf.groups)
                rows = self.data.sampler.next_batch()
                items = [self.data.train[i] for i in rows]
                buf.add(rows, [it["input_ids"] for it in items], self.n, items)
                todo += [(g, j) for g in buf.groups[first_new:] for j in range(self.n)]
            buf.advance(todo, step, version, self.sampling, seed_offset=step * 1000 + index)
        groups = buf.take_done(need)
        if not groups:
            return None
        self._segments += segments_of(groups)
        items = [self.data.train[g.item] for g in groups]
        ids = [f"g{g.key}" for g in groups for _ in g.responses]
        rollout = groups_to_rollout(groups, self.engine.pad_token_id)
        self._turns += rollout.turns or []
        return Round(rollout, items, ids)

    def metrics(self) -> dict[str, float]:
        """``rollout/partial/*``: segments per response handed over since the last call, responses carried over (of
        them, conversations whose tool calls outlasted their round);
        ``tool/*`` of the conversations handed over in a multi-turn run."""
        segments, self._segments = self._segments, []
        turns, self._turns = self._turns, []
        return {
            "rollout/partial/segments_mean": sum(segments) / len(segments) if segments else 0.0,
            "rollout/partial/buffered_responses": float(self.buffer.buffered_responses()),
            "rollout/partial/awaiting_tools": float(self.buffer.awaiting_tools()),
            **tool_metrics(turns),
        }

    # The buffer is checkpointed with every step (CheckpointManager component "rollout_buffer").
    def state_dict(self) -> dict[str, Any]:
        return self.buffer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state)
