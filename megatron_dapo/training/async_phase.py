"""The rollout phase of the training ranks in an asynchronous job (trainer.mode=async, docs/async.md): the remote end
of the rollout ranks (``training/rollout_worker.py``), with the interface of the colocated ``RolloutPhase``.

* ``prepare_engine`` pushes the actor's weights of a version to the rollout ranks (once per version), over the
  bridge (``rollout/remote.py``, each tensor from its owner: ``rollout/weight_transfer/owner_push.py``); the push
  returns once it is in the send buffers, and the rollout ranks apply it between two segments. The next push is
  announced only after the previous one has arrived (``push_done``);
* ``collect`` takes scored groups from the queue until the batch is full, dropping (and counting) every group that
  would be trained more than ``async.max_staleness`` versions after its oldest token was generated; dynamic sampling
  is counted per trained batch on the rollout ranks, whose filler groups or exhausted message it turns into what
  ``algorithm.filter_groups.on_exhausted`` does in a synchronous step;
* ``validate`` asks the rollout ranks to validate the current weights and waits for the result;
* ``before_save`` asks them for a snapshot of everything not trained yet — the data position, the responses in
  flight and the scored groups in the queue, and the groups this side took for a step that failed — which the
  checkpoint holds as its ``rollout_state`` component and gives back to them on resume: no prompt is lost or drawn
  twice, also when the save is the one after a failure (``run_state.StepCheckpoints.save_after_failure``).

Only the first training rank talks to the store; the others receive what it read through their own side's group.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable
from typing import Any, Optional

import torch

from megatron_dapo.batch import TrainBatch
from megatron_dapo.config import DataConfig, TrainerConfig
from megatron_dapo.config.plan import RunPlan
from megatron_dapo.parallel import Placement, broadcast_object
from megatron_dapo.reporting.loggers import RolloutDumper, turn_extras
from megatron_dapo.reporting.metrics import reduce_metrics
from megatron_dapo.reporting.timing import timed
from megatron_dapo.rollout.multi_turn import tool_metrics
from megatron_dapo.rollout.remote import Control, StoreQueue
from megatron_dapo.rollout.types import Conversation, response_from_dict
from megatron_dapo.training.rollout_phase import warn_partial_batch

log = logging.getLogger("megatron_dapo.trainer")

# The rollout side's cumulative statistics (Control "stats"), reported per step as differences.
STAT_KEYS = ("busy_s", "idle_s")
# The rollout side's dynamic-sampling totals (algo/dynamic_sampling.TrainedBatchWindow.totals), sent with every payload.
SAMPLING_KEYS = ("gen_batches", "generated", "kept")


class RolloutState:
    """The ``rollout_state`` checkpoint component: the last snapshot the rollout ranks sent (``before_save``), and
    on resume the snapshot to hand back to them.

    ``in_hand`` (first training rank): the groups taken from the queue for the step under way. They left the queue,
    so no snapshot of the rollout ranks holds them: a save of the last completed step after a failure puts them back
    in front of the snapshot's queued groups. ``step_completed`` (``run_state.StepCheckpoints.mark_boundary``) drops
    them once the step's update is applied."""

    def __init__(self) -> None:
        self.latest: dict[str, Any] = {}
        self.restored: Optional[dict[str, Any]] = None
        self.in_hand: list[dict[str, Any]] = []

    def step_completed(self) -> None:
        self.in_hand = []

    def state_dict(self) -> dict[str, Any]:
        return self.latest

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.latest = dict(state)
        if self.latest:
            self.restored = self.latest


class DataPosition:
    """The ``data_state`` component in async mode: the data position inside the rollout ranks' snapshot, under the
    name synchronous runs use, so that either mode resumes the other's checkpoint at its data position (responses in
    flight in the other mode are not carried over)."""

    def __init__(self, state: RolloutState) -> None:
        self.state = state

    def state_dict(self) -> Optional[dict[str, Any]]:
        return self.state.latest.get("sampler")  # None (no snapshot yet) is saved as null: nothing to restore

    def load_state_dict(self, position: dict[str, Any]) -> None:
        if position and self.state.restored is None:  # a synchronous run's checkpoint: only its data position
            empty = {"next_key": 0, "groups": []}
            self.state.restored = {"sampler": dict(position), "buffer": empty, "queued": []}


class RemoteRolloutPhase:
    """The training ranks' rollout phase in async mode (module docstring; a ``training/rollout_source.RolloutSource``).
    Reads ``trainer.collective_timeout_s``, ``data.train_batch_size`` and the plan's staleness bound."""

    def __init__(
        self,
        trainer: TrainerConfig,
        data_cfg: DataConfig,
        plan: RunPlan,
        place: Placement,
        push_weights: Callable[[], Any],
        dumper: Optional[RolloutDumper] = None,
        is_main: bool = False,
        push_done: Callable[[], Any] = lambda: None,
    ) -> None:
        self.plan, self.push_weights, self.dumper, self.is_main = plan, push_weights, dumper, is_main
        self.push_done = push_done  # waits until the push in flight has reached the rollout ranks
        self.batch_size = data_cfg.train_batch_size
        timeout_s = trainer.collective_timeout_s
        self.queue = StoreQueue(place.store, timeout_s)
        self.control = Control(place.store, timeout_s)
        self.state = RolloutState()
        self.pushed: Optional[int] = None  # the version the rollout ranks hold
        self.started = False
        self.dropped = 0  # groups dropped as too stale, over the run
        self.snapshots = 0
        self._stats: dict[str, float] = {}
        self._totals: dict[str, int] = {}  # the rollout ranks' dynamic-sampling totals at the last batch's end
        self._epoch = 0  # the rollout ranks' sampler's, as their statistics report it

    @property
    def epoch(self) -> int:
        return self._epoch

    def checkpoint_states(self) -> dict[str, Any]:
        # rollout_state first: it is restored before data_state looks whether a snapshot came with the checkpoint.
        return {"rollout_state": self.state, "data_state": DataPosition(self.state)}

    def engine_released(self) -> None:
        """The rollout ranks' engines never sleep."""

    # ------------------------------------------------------------------------------------------- weights

    def prepare_engine(self, weights_step: int, timings: Optional[dict] = None) -> None:
        """Start the rollout side (first call: the version and, on resume, its snapshot) and push the actor's
        weights of ``weights_step`` unless it holds them already."""
        timings = timings if timings is not None else {}
        if not self.started:
            if self.is_main:
                self.control.post("start", {"version": weights_step, "state": self.state.restored})
            self.started = True
        if self.pushed == weights_step:
            timings.setdefault("update_weights", 0.0)
            return
        with timed("update_weights", timings):
            self.push_done()  # the rollout ranks take one push per announcement: the previous one has arrived
            if self.is_main:
                self.control.post("weights", weights_step)  # announced; the rollout ranks join at a round boundary
            self.push_weights()
        self.pushed = weights_step

    # ------------------------------------------------------------------------------------------- groups

    def collect(self, step: int, weights_step: int, timings: dict) -> Optional[tuple[TrainBatch, dict]]:
        """``data.train_batch_size`` scored groups from the queue, none staler than ``async.max_staleness``.

        Dynamic sampling is counted per trained batch on the rollout ranks (``training/rollout_worker.py``). When
        it is exhausted, ``on_exhausted=train`` has filled the batch with dropped groups: their loss mask is zero
        (``train/partial_batch`` is 1), as in a synchronous step; ``stop`` returns None; ``error`` raises.
        """
        self.prepare_engine(weights_step, timings)
        with timed("gen", timings):  # on the training side, "generation" is the wait for the rollout ranks
            payloads = broadcast_object(self._take(weights_step) if self.is_main else None)
        groups, dropped, queued, stats, last = payloads
        if "exhausted" in last:  # on_exhausted=stop or error: the rollout ranks' message instead of filler
            if last["error"]:
                raise RuntimeError(last["exhausted"])
            return None
        self.dropped += dropped
        batch = TrainBatch.concat([g["batch"] for g in groups])
        batch.group_ids = [(0, g["key"]) for g in groups for _ in range(len(g["batch"]))]
        batch.filler = torch.tensor([bool(g.get("filler")) for g in groups for _ in range(len(g["batch"]))])
        batch.loss_mask[batch.filler] = 0
        kept = [g for g in groups if not g.get("filler")]
        metrics = reduce_metrics([g["reward_metrics"] for g in kept])
        metrics.update(self._stat_metrics(stats, last["totals"]))
        metrics["async/dropped_stale_groups"] = float(self.dropped)
        metrics["async/queue_groups"] = float(queued)
        metrics["train/partial_batch"] = float(bool(batch.filler.any()))
        responses = [response_from_dict(r) for g in kept for r in g["group"]["responses"]]
        metrics.update(tool_metrics([r.info() for r in responses if isinstance(r, Conversation)]))
        if self.is_main and metrics["train/partial_batch"]:
            warn_partial_batch(step, metrics, self.batch_size, bool(batch.loss_mask.any()))
        if self.dumper is not None and batch.prompt_text is not None:
            uids = [f"g{key}" for _, key in batch.group_ids]
            rewards = batch.seq_rewards.tolist()
            self.dumper.dump(step, batch.prompt_text, batch.response_text, rewards, uids, turn_extras(batch))
        return batch, metrics

    def _take(self, version: int) -> tuple[list[dict], int, int, dict, dict]:
        """On the first training rank: groups from the queue until the batch is full or an exhausted message comes;
        the dropped count, the queue length left, the rollout side's statistics and the last payload taken."""
        groups: list[dict] = []
        dropped = 0
        while len(groups) < self.batch_size:
            last = pickle.loads(self.queue.get())
            if "exhausted" in last:
                break
            if version - last["min_version"] > self.plan.max_staleness:
                dropped += 1
                continue
            groups.append(last)
            if not last.get("filler"):  # a filler is a dropped group: no snapshot holds those
                self.state.in_hand.append(last["group"])
        end = {k: v for k, v in last.items() if k in ("totals", "exhausted", "error")}  # what is read of it
        return groups, dropped, self.queue.length(), self.control.read("stats") or {}, end

    def _stat_metrics(self, stats: dict, totals: dict[str, int]) -> dict[str, float]:
        """This batch's dynamic sampling (the rollout ranks' totals since the last batch's end: generation batches,
        groups generated and kept, under the synchronous names) and the rollout ranks' idle fraction."""
        delta = {k: float(stats.get(k, 0.0)) - self._stats.get(k, 0.0) for k in STAT_KEYS}
        self._stats = {k: float(stats.get(k, 0.0)) for k in STAT_KEYS}
        self._epoch = int(stats.get("epoch", self._epoch))
        gen_batches, generated, kept = (float(totals[k] - self._totals.get(k, 0)) for k in SAMPLING_KEYS)
        self._totals = dict(totals)
        busy, idle = delta["busy_s"], delta["idle_s"]
        return {
            "train/num_gen_batches": gen_batches,
            "train/num_prompts_generated": generated,
            "train/num_prompts_kept": kept,
            "train/kept_prompt_ratio": kept / generated if generated else 0.0,
            "async/rollout_idle_frac": idle / (busy + idle) if busy + idle > 0 else 0.0,
            "rollout/partial/buffered_responses": float(stats.get("buffered_responses", 0.0)),
            "rollout/partial/awaiting_tools": float(stats.get("awaiting_tools", 0.0)),
        }

    # ------------------------------------------------------------------------------------------- requests

    def validate(self, weights_step: int, timings: Optional[dict] = None) -> dict[str, float]:
        """The rollout ranks validate the weights of ``weights_step`` (pushed first); waits for their result."""
        self.prepare_engine(weights_step, timings)
        result = None
        if self.is_main:
            self.control.post("val/request", weights_step)
            result = self.control.wait(f"val/result/{weights_step}", f"the validation of step {weights_step}")
        return broadcast_object(result)

    def before_save(self) -> None:
        """A snapshot of the rollout side for the checkpoint (the trainer is at a step boundary: it takes nothing
        from the queue meanwhile), with the groups taken for a step that did not complete (``RolloutState.in_hand``)
        queued first."""
        if not self.started:
            return  # nothing was generated yet: the restored snapshot (or none) still holds
        self.snapshots += 1
        if self.is_main:
            started = time.perf_counter()
            self.control.post("snap/request", self.snapshots)
            state = self.control.wait(f"snap/result/{self.snapshots}", "the rollout ranks' snapshot")
            if self.state.in_hand:  # a save after a failure: the failed step's groups are not trained
                state = {**state, "queued": self.state.in_hand + state["queued"]}
            self.state.latest = state
            self.snapshot_s = time.perf_counter() - started

    def stop_requested(self) -> bool:
        """A rollout rank received SIGTERM/SIGINT (it keeps serving until the trainer's clean stop)."""
        return bool(self.is_main and self.control.read("stop_requested"))

    def close(self) -> None:
        try:
            self.push_done()  # the rollout ranks take a push before the stop; its buffers must live until then
        except RuntimeError as exc:  # a rollout rank died with the push in flight: the run's own error is reported
            log.warning("the weight push in flight did not arrive: %s", exc)
        if self.is_main:
            self.control.post("stop", True)
