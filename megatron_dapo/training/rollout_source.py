"""What the trainer needs of its rollout: the seam between ``DAPOTrainer`` (``training/trainer.py``) and where its
batches come from.

Two implementations: ``training/rollout_phase.RolloutPhase`` (the colocated engine on the training ranks: generated,
scored and filtered in the step) and ``training/async_phase.RemoteRolloutPhase`` (``trainer.mode=async``: scored
groups taken from the rollout ranks' queue). The trainer calls nothing else of either.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from megatron_dapo.batch import TrainBatch


class RolloutSource(Protocol):
    """The rollout side of a step (``DAPOTrainer.train_step``), of validation, of checkpoints and of the stop."""

    def prepare_engine(self, weights_step: int, timings: Optional[dict] = None) -> None:
        """Make the engines generate with the actor's weights of ``weights_step`` (synced once per version)."""
        ...

    def collect(self, step: int, weights_step: int, timings: dict) -> Optional[tuple[TrainBatch, dict]]:
        """The step's training batch and its rollout metrics; None when dynamic sampling was exhausted and
        ``algorithm.filter_groups.on_exhausted=stop``."""
        ...

    def validate(self, weights_step: int, timings: Optional[dict] = None) -> dict[str, float]:
        """The validation metrics of the weights of ``weights_step``."""
        ...

    def engine_released(self) -> None:
        """The engine slept (a save): the next use syncs it again."""
        ...

    def checkpoint_states(self) -> dict[str, Any]:
        """The rollout's checkpoint components (``CheckpointManager(states=...)``) by name."""
        ...

    def before_save(self) -> None:
        """Gather what the checkpoint components hold, at a step boundary before a save."""
        ...

    def stop_requested(self) -> bool:
        """Whether the rollout side asks the run to stop at this step boundary."""
        ...

    def close(self) -> None: ...

    @property
    def epoch(self) -> int:
        """Passes over the training prompts so far."""
        ...
