"""The run's own state beside the models: counters checkpointed with every step (the ``trainer`` component of
``trainer_state.json``), the rule that stops a run after too many skipped updates, and the checkpoints of completed
steps (save, resume, and the save of the last completed step after a failure)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Optional

from megatron_dapo.checkpointing.checkpoint import CheckpointManager, resolve_resume
from megatron_dapo.config import CheckpointConfig, TrainerConfig
from megatron_dapo.config.schema import LoRAConfig
from megatron_dapo.handoff.offload import MemoryHandoff
from megatron_dapo.parallel import world_size as dist_world_size
from megatron_dapo.platform import Platform
from megatron_dapo.training.failure import NonFiniteUpdateError, all_ranks_in_handler
from megatron_dapo.weights.checkpoint_errors import CheckpointError

log = logging.getLogger("megatron_dapo.trainer")


@dataclass
class RunCounters:
    """Counters of a run (torchtitan's ``Stateful``). A checkpoint saved before a counter existed leaves it as it is."""

    num_skipped_updates: int = 0  # optimizer steps skipped because something was not finite
    consecutive_skipped_updates: int = 0
    num_partial_batches: int = 0  # steps trained on a batch that dynamic sampling could not fill
    num_empty_steps: int = 0  # exhausted steps that kept nothing, so had no update

    def state_dict(self) -> dict[str, int]:
        return {f.name: int(getattr(self, f.name)) for f in fields(self)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for f in fields(self):
            if f.name in state:
                setattr(self, f.name, int(state[f.name]))

    def skipped_update(self, step: int, nonfinite: list[str], limit: int, is_main: bool) -> Optional[str]:
        """Count a skipped optimizer step; returns why the run must stop (``limit`` in a row), else None."""
        self.num_skipped_updates += 1
        self.consecutive_skipped_updates += 1
        what = ", ".join(nonfinite)
        if is_main:
            log.warning(
                "step %d: update skipped, not finite: %s (%d in a row; the run stops at "
                "trainer.max_consecutive_skipped_updates=%d)",
                step,
                what,
                self.consecutive_skipped_updates,
                limit,
            )
        if self.consecutive_skipped_updates < limit:
            return None
        return (
            f"step {step}: {self.consecutive_skipped_updates} consecutive updates skipped because {what} was "
            f"not finite (trainer.max_consecutive_skipped_updates={limit})"
        )

    def applied_update(self) -> None:
        self.consecutive_skipped_updates = 0


def stop_after_skips(why: str, saved_step: Optional[int], save_dir: str) -> NonFiniteUpdateError:
    return NonFiniteUpdateError(
        f"{why}; the run stops without saving, so the last checkpoint (step {saved_step}) stays latest in "
        f"{save_dir}. Lower actor.optim.lr, check actor.optim.clip_grad, or look for a broken reward or data rows"
    )


def why_not_save_after(
    exc: BaseException, step: int, saved_step: Optional[int], update_in_progress: bool, saving: bool
) -> Optional[str]:
    """Why the last completed ``step`` must not (or need not: "") be saved after ``exc``; None = save it (once
    every rank has reached the failure handler)."""
    if isinstance(exc, NonFiniteUpdateError):
        return ""  # the last good checkpoint stays latest on purpose
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted by a second signal"
    if update_in_progress:
        return f"the failure interrupted step {step + 1}'s parameter update, so no consistent state is left"
    if saving:
        return "the failure happened while saving"
    if step == 0 or saved_step == step:
        return ""
    return None


class StepCheckpoints:
    """Checkpoints of completed steps: the save (the engine asleep meanwhile), the resume, and the save of the last
    completed step after a failure, from the components' state and RNG recorded at that step's boundary.

    ``background``: a save returns once the state is staged in host memory and its files are written while training
    goes on (``CheckpointManager.save(blocking=False)``); the next save publishes it first, and the owner calls
    ``finish_saves`` before it exits (``saved_step`` is the step last handed to a save)."""

    def __init__(
        self,
        ckpt: CheckpointManager,
        checkpoint: CheckpointConfig,
        trainer: TrainerConfig,
        run_config: dict,
        platform: Platform,
        handoff: MemoryHandoff,
        engine_released: Callable[[], None],
        is_main: bool,
        background: bool = False,
    ) -> None:
        self.ckpt, self.platform, self.handoff = ckpt, platform, handoff
        self.resume_mode, self.save_optimizer = checkpoint.resume_mode, checkpoint.save_optimizer
        self.timeout_s = trainer.collective_timeout_s
        self.run_config = run_config  # the whole config as a dict, saved with each checkpoint (config.yaml)
        self.engine_released, self.is_main, self.background = engine_released, is_main, background
        self.saved_step: Optional[int] = None
        self.saving = False
        self.boundary = self.snapshot()

    def snapshot(self) -> dict:
        """The registered components' states (counters, KL controller, data position) and the RNG at a step boundary:
        what a checkpoint of that step must hold, though the next step may already have moved them."""
        return {"states": self.ckpt.component_states(), "rng": self.platform.rng_state()}

    def mark_boundary(self) -> None:
        """A step completed: what a checkpoint of it (also one saved after a later failure) must hold. A component
        with a ``step_completed`` method hears of it first (async mode's ``RolloutState``: the groups it took for
        the step are trained now)."""
        for component in self.ckpt.states.values():
            completed = getattr(component, "step_completed", None)
            if completed is not None:
                completed()
        self.boundary = self.snapshot()

    def save(self, step: int, actor: Any, scheduler: Any, engine: Any) -> None:
        self.saving = True
        # A save reads the actor's parameters and optimizer state; the engine sleeps meanwhile (where it can; it is
        # woken and synced again by the next rollout or validation).
        self.handoff.before_save(engine)
        self.engine_released()
        self.ckpt.save(
            step=step,
            model_chunks=actor.chunks,
            optimizer=actor.optimizer,
            scheduler=scheduler,
            config=self.run_config,
            save_optimizer=self.save_optimizer,
            blocking=not self.background,
        )
        self.handoff.after_save()
        self.saving = False
        self.saved_step = step

    def finish_saves(self) -> None:
        """Collective: a save still being written in the background is published (or its failure raised as
        ``CheckpointError``). Before the process exits; a no-op when nothing is pending."""
        self.saving = True
        self.ckpt.finalize()
        self.saving = False

    def resume(self, actor: Any, scheduler: Any) -> Optional[int]:
        """Load the checkpoint ``checkpoint.resume_mode`` names (None: none); returns its step."""
        self.finish_saves()  # ``latest`` names a published step only
        step_dir = resolve_resume(self.resume_mode, self.ckpt.save_dir)
        if step_dir is None:
            return None
        self.handoff.restore_actor()  # the engine sleeps since start-up: the optimizer state can come back
        # Restores the registered components too: the counters, the KL controller, the data position.
        state = self.ckpt.load(step_dir, actor.chunks, actor.optimizer, scheduler)
        self.saved_step = int(state["step"])
        self.mark_boundary()
        if self.is_main:
            log.info("resumed from %s at step %d", step_dir, self.saved_step)
        return self.saved_step

    def save_after_failure(self, exc: BaseException, step: int, update_in_progress: bool, save: Callable) -> None:
        """Keep the last completed ``step`` when the loop fails, if that is safe and not done already."""
        # Async mode too: the save asks the rollout ranks for their snapshot and puts the failed step's groups back
        # in front of it (training/async_phase.RolloutState.in_hand); with a rollout rank gone that request fails and
        # nothing is written.
        why_not = why_not_save_after(exc, step, self.saved_step, update_in_progress, self.saving)
        # A background save made before the failure is complete state: published if every rank can take part.
        pending = self.ckpt.pending_step is not None and not self.saving and not isinstance(exc, KeyboardInterrupt)
        world, timeout_s = dist_world_size(), min(60.0, self.timeout_s)
        if (why_not is None or pending) and not all_ranks_in_handler(world, timeout_s):
            why_not, pending = "not every rank reached the failure handler (the others are blocked or gone)", False
        if why_not is not None:
            if pending:
                self._finish_after_failure()
            if why_not and self.is_main:
                log.error(
                    "not saving step %d after the failure: %s; last checkpoint: step %s", step, why_not, self.saved_step
                )
            return
        try:
            self.ckpt.load_component_states(self.boundary["states"])
            self.platform.set_rng_state(self.boundary["rng"])
            save()
            if self.is_main:
                log.error(
                    "the run failed; saved its last completed step %d to %s before exiting", step, self.ckpt.save_dir
                )
        except Exception as save_exc:  # noqa: BLE001 - the original failure is what the caller raises
            if self.is_main:
                log.error("saving step %d after the failure failed too: %r", step, save_exc)

    def _finish_after_failure(self) -> None:
        try:
            self.finish_saves()
        except Exception as save_exc:  # noqa: BLE001 - the original failure is what the caller raises
            if self.is_main:
                log.error("the background save of step %s failed too: %r", self.saved_step, save_exc)


class LoraBase:
    """The ``lora`` component of a LoRA run's checkpoints (docs/lora.md): what the adapters were trained on and
    their shape. A checkpoint of a LoRA run holds the adapters only; this entry is its pointer to the base
    (``checkpoint.load_dir``, as an absolute path), read by ``megatron-dapo export --lora``. Loading refuses a base
    or an adapter shape other than this run's, before any tensor is read."""

    KEYS = ("rank", "alpha", "target_modules", "dropout", "dropout_position")

    def __init__(self, load_dir: str, lora: LoRAConfig) -> None:
        self.base = os.path.abspath(load_dir)  # checkpoint.load_dir
        self.lora = {k: getattr(lora, k) for k in self.KEYS}
        self.lora["target_modules"] = list(self.lora["target_modules"])

    def state_dict(self) -> dict[str, Any]:
        return {"base_checkpoint": self.base, **self.lora}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if os.path.abspath(state["base_checkpoint"]) != self.base:
            raise CheckpointError(
                f"the checkpoint's LoRA adapters were trained on base {state['base_checkpoint']}, but this run's "
                f"checkpoint.load_dir is {self.base}: set checkpoint.load_dir to that base"
            )
        changed = [
            f"{k} {state[k]!r} -> {self.lora[k]!r}" for k in ("rank", "target_modules") if state[k] != self.lora[k]
        ]
        if changed:
            raise CheckpointError(f"the checkpoint's LoRA adapters differ from actor.lora: {', '.join(changed)}")
