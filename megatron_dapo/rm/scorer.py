"""``RewardModelScorer``: a frozen reward model (``rm/reward_model.py``) scoring responses on the training ranks.

Every training rank calls ``score`` with the same rows (collective): the rows are dealt to the data-parallel ranks
in contiguous blocks, each DP rank's tensor-parallel group runs its block in micro-batches of
``reward.reward_model.micro_batch_size``, and one all-gather over the DP group gives every rank every score. A
row is its prompt's real tokens then its response's (the actor's tokenizer: the reward model must share it), cut
to its last ``max_length`` tokens; its score is the ``score`` head at the position HF's
``*ForSequenceClassification`` reads (``rm/score_head.score_positions``). ``add_reward_model_scores`` adds
``weight x score`` to each response's reward, one more term, with the ``reward/rm_score/*`` metrics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_dapo.config.plan import RunPlan
from megatron_dapo.config.schema import ModelConfig, ParallelConfig, RewardModelConfig
from megatron_dapo.platform import get_platform
from megatron_dapo.reward.scoring import RewardResult
from megatron_dapo.rm.reward_model import build_reward_model, forward_scores, load_reward_model, reward_model_arch
from megatron_dapo.rm.score_head import ScoreHeadSpec, score_positions


class RewardModelScorer:
    """A loaded, frozen reward model and how to run it (its config section, the run's causal-mask choice)."""

    def __init__(
        self,
        model,
        head: ScoreHeadSpec,
        cfg: RewardModelConfig,
        vocab_size: int,
        explicit_causal_mask: bool = True,
        handoff: Optional[Any] = None,
    ) -> None:
        if head.shape[0] != 1:
            raise ValueError(
                f"reward.reward_model.load_dir={cfg.load_dir}: the score head has num_labels={head.shape[0]}; a reward"
                " model has one (num_labels=1)"
            )
        self.model, self.head, self.cfg = model, head, cfg
        self.vocab_size = vocab_size
        self.explicit_causal_mask = explicit_causal_mask
        # The memory hand-off (handoff/offload.MemoryHandoff) that moves the weights off the device between scorings.
        self.handoff = handoff
        if handoff is not None:
            handoff.attach_frozen("reward_model", [model])

    @classmethod
    def build(
        cls,
        cfg: RewardModelConfig,
        plan: RunPlan,
        model_cfg: ModelConfig,
        parallel: ParallelConfig,
        handoff: Optional[Any] = None,
    ) -> RewardModelScorer:
        """Build and load ``cfg.load_dir`` on this rank at the actor's tensor-parallel size (``parallel``; the
        ``model`` section's dtype and attention backend) and hand it to ``handoff`` (off the device until it scores,
        where the plan offloads the reference). Call it once the engine sleeps. Collective for a Megatron
        checkpoint."""
        if not cfg.load_dir:
            raise ValueError("reward.reward_model.load_dir is unset: there is no reward model to build")
        arch, head = reward_model_arch(cfg.load_dir)
        model = build_reward_model(arch, model_cfg, parallel, plan.transformer_impl)
        load_reward_model(model, arch, cfg.load_dir)
        return cls(model, head, cfg, arch.vocab_size, plan.explicit_causal_mask, handoff)

    def sequences(
        self, prompts: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor
    ) -> list[torch.Tensor]:
        """Each row's real prompt tokens then its real response tokens (a rollout's left-padded prompts and
        right-padded responses), the last ``max_length`` of them."""
        out = []
        for p, pm, r, rm in zip(prompts, prompt_mask.bool(), responses, response_mask.bool()):
            out.append(torch.cat([p[pm], r[rm]])[-self.cfg.max_length :])
        return out

    def score(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """``[N]`` float32 scores (on the host) of ``sequences``, the same list on every rank. Collective over the
        training ranks."""
        from megatron.core import parallel_state as ps  # heavy: megatron-core, once the platform has patched it

        rows = [torch.as_tensor(s, dtype=torch.long)[-self.cfg.max_length :] for s in sequences]
        for i, row in enumerate(rows):
            if row.numel() and (int(row.min()) < 0 or int(row.max()) >= self.vocab_size):
                raise ValueError(
                    f"reward model input row {i}: token ids span [{int(row.min())}, {int(row.max())}], outside the"
                    f" reward model's vocabulary of {self.vocab_size} (it must share the actor's tokenizer)"
                )
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        block = math.ceil(len(rows) / dp) if rows else 0
        mine = rows[dp_rank * block : (dp_rank + 1) * block]
        local = torch.zeros(block, dtype=torch.float32, device=get_platform().device())
        mbs = self.cfg.micro_batch_size
        # On the device for its forward only, inside the rollout phase that scores (the engine is awake then).
        on_device = self.handoff.frozen_forward("reward_model", own_phase=False) if self.handoff else nullcontext()
        with on_device:
            for start in range(0, len(mine), mbs):
                local[start : start + len(mine[start : start + mbs])] = self._forward(mine[start : start + mbs])
        if dp > 1 and block:
            parts = [torch.empty_like(local) for _ in range(dp)]
            dist.all_gather(parts, local, group=ps.get_data_parallel_group())
            local = torch.cat(parts)
        return local[: len(rows)].cpu()

    def _forward(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """Scores of one micro-batch: left-aligned rows, right-padded with 0 (causal attention keeps the padding
        out), each read at HF's position."""
        lengths = torch.tensor([len(r) for r in rows])
        tokens = torch.zeros(len(rows), max(int(lengths.max()), 1), dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = r
        scores = forward_scores(self.model, tokens, self.explicit_causal_mask)[..., 0]
        where = score_positions(tokens, lengths, self.head.pad_token_id).to(scores.device)
        return scores[torch.arange(len(rows), device=scores.device), where]


def add_reward_model_scores(result: RewardResult, scores: torch.Tensor, weight: float) -> None:
    """One more reward term: ``weight x scores`` added to each response's reward (``scores`` and the last response
    token of ``token_level_scores``, where the rule-based reward sits), the raw scores kept as ``extra["rm_score"]``
    and summarised as ``reward/rm_score/mean|max|min``."""
    if scores.shape != result.scores.shape:
        raise ValueError(
            f"reward model scores: shape {tuple(scores.shape)}, the batch's rewards {tuple(result.scores.shape)}"
        )
    term = weight * scores.to(result.scores.dtype)
    result.scores += term
    width = result.token_level_scores.shape[1]
    if width:
        lengths = result.response_lengths
        if lengths is None:
            raise ValueError("reward model scores: the reward result carries no response_lengths")
        last = torch.where(lengths > 0, lengths - 1, torch.full_like(lengths, width - 1))
        result.token_level_scores[torch.arange(len(term)), last] += term
    result.extra["rm_score"] = scores.tolist()
    result.metrics.update(rm_metrics(scores))


def rm_metrics(scores: torch.Tensor, prefix: str = "reward/rm_score") -> dict[str, float]:
    """``<prefix>/mean|max|min`` of a batch's reward-model scores (nothing for an empty batch)."""
    if not scores.numel():
        return {}
    s = scores.float()
    return {f"{prefix}/mean": s.mean().item(), f"{prefix}/max": s.max().item(), f"{prefix}/min": s.min().item()}


def score_rollout(scorer: Optional[RewardModelScorer], result: RewardResult, rollout) -> None:
    """The reward stage's hook: with a reward model, score ``rollout`` (a ``RolloutBatch``: prompts, responses and
    their masks; collective) and add the term to ``result``; nothing without one."""
    if scorer is None:
        return
    rows = scorer.sequences(rollout.prompts, rollout.prompt_mask, rollout.responses, rollout.response_mask)
    add_reward_model_scores(result, scorer.score(rows), scorer.cfg.weight)
