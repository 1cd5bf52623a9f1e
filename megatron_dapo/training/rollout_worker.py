"""The rollout ranks of an asynchronous job (trainer.mode=async, docs/async.md): vLLM engines that generate without
pause while the training ranks train.

The rollout ranks run rounds of the request-level rollout (``rollout/partial.py``): each round gives every response
in flight its next segment (a whole response when partial rollout is off) and, when the staleness gate allows, starts
a new generation batch of prompts. Groups that are done are scored here (once, off the trainer's critical path),
filtered by dynamic sampling, and put on the queue one by one. Between two rounds the ranks take a weight push, a
validation request, a snapshot request or the stop.

Dynamic sampling is counted per trained batch, as in a synchronous step (``algo/dynamic_sampling.py``): the groups
scored since the last ``train_batch_size`` queued ones, in generation batches of ``gen_batch_size`` groups. When
they reach ``algorithm.filter_groups.max_num_gen_batches`` without filling the batch, ``on_exhausted=train`` queues
dropped groups as its filler and ``stop`` / ``error`` queue a message (the training ranks stop or raise).

Staleness gate (AReaL's rule). With weights of version ``v`` (the trainer has made ``v`` updates), a new group starts
(gets its first segment) only while the groups put on the queue since the start plus the started ones in flight
stay below ``(v - v_start + max_staleness + 1) x train_batch_size``, and the queue holds fewer than
``async.queue_groups``: a group finished with weights ``v`` then falls in a training batch no later than the one
trained with weights ``v + max_staleness``. Prompts are drawn a generation batch at a time and wait, unstarted (no
token, so no version), until the gate lets them start. (Tokens of earlier segments can be older than the group's
last; the trainer drops what still exceeds the bound.)

All rollout ranks run the same rounds: the first one reads the store and broadcasts each decision to the others.
"""

from __future__ import annotations

import logging
import pickle
import time
from dataclasses import asdict
from typing import Any

from megatron_dapo.algo.dynamic_sampling import TrainedBatchWindow, gen_batch_budget
from megatron_dapo.algo.registry import ADV_ESTIMATORS
from megatron_dapo.config import ExperimentConfig
from megatron_dapo.config.plan import PartialPlan
from megatron_dapo.parallel import broadcast_object, placement, teardown
from megatron_dapo.reward.manager import RewardManager
from megatron_dapo.rollout.engine import RolloutEngine, freeze_heap_before_engine
from megatron_dapo.rollout.multi_turn import MultiTurnRollout, build_generator
from megatron_dapo.rollout.partial import Group, PartialRollout, group_from_dict, groups_to_rollout
from megatron_dapo.rollout.remote import PEER_CHECK_S, BridgeReceiver, Control, StoreQueue, raise_if_peer_died
from megatron_dapo.rollout.types import SamplingSpec
from megatron_dapo.training.failure import StopRequest
from megatron_dapo.training.reward_stage import RolloutScorer, greedy_baselines, score_to_batch
from megatron_dapo.training.rollout_phase import filter_metric, validation_metrics
from megatron_dapo.training.startup import start_run

log = logging.getLogger("megatron_dapo.rollout_worker")

IDLE_POLL_S = 0.02


class RolloutWorker:
    """One rollout rank (module docstring); ``fit`` serves the training ranks until they stop it."""

    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg = cfg
        # The same start as the training ranks' (training/startup.py): this side's process group, the data, the plan.
        run = start_run(cfg)
        self.info, self.platform, self.plan, self.data = run.info, run.platform, run.plan, run.data
        self.tokenizer = run.tokenizer
        self.place = placement()
        timeout_s = cfg.trainer.collective_timeout_s
        ids, budget = run.ids, cfg.data.max_response_length
        freeze_heap_before_engine()
        engine_ids = dict(pad_token_id=ids.pad, eos_token_ids=ids.eos)
        sections = (cfg.rollout, cfg.data, cfg.model, cfg.actor, cfg.trainer)
        self.engine = RolloutEngine(*sections, run.hf_dir, run.platform, **engine_ids, plan=run.plan)
        reward = RewardManager(self.tokenizer, cfg.reward, budget, list(ids.eos))
        self.scorer = RolloutScorer(reward, self.info.world_size, self.info.rank)
        segments = run.plan.partial or PartialPlan(budget, 1)
        # multi-turn: tools on replica leaders
        self.generator = build_generator(cfg.rollout.multi_turn, budget, self.engine, self.tokenizer)
        conversations = self.generator if isinstance(self.generator, MultiTurnRollout) else None
        self.buffer = PartialRollout(self.engine, segments, budget, conversations)
        self.sampling = SamplingSpec.for_training(cfg.rollout, budget, ids.eos)
        self.val_sampling = SamplingSpec.for_validation(cfg.rollout, budget, ids.eos)
        self.receiver = BridgeReceiver(self.place, self.engine, run.platform)
        self.leader = self.info.rank == 0
        self.queue, self.control = StoreQueue(self.place.store, timeout_s), Control(self.place.store, timeout_s)
        self.version = self.start_version = -1
        self.put_groups = 0
        self.stats = {"rounds": 0, "busy_s": 0.0, "idle_s": 0.0}
        fg, gen_batch_size = cfg.algorithm.filter_groups, self.data.sampler.batch_size
        cap = gen_batch_budget(fg.max_num_gen_batches, len(self.data.train), gen_batch_size)
        self.window = TrainedBatchWindow(cfg.data.train_batch_size, cfg.rollout.n, gen_batch_size, fg.enable, cap)
        self.served: dict[str, Any] = {"val": None, "snap": None}
        self.stop_request = StopRequest()

    # ------------------------------------------------------------------------------------------- the loop

    def fit(self) -> dict[str, float]:
        self.stop_request.install()
        start = broadcast_object(self._wait_for_start() if self.leader else None)
        if start is None:
            return {}  # the trainer stopped before generating anything (e.g. a resumed run that was complete)
        self.start_version = int(start["version"])  # the engine holds dummy weights until the first push
        if start["state"]:
            self._restore(start["state"])
        told, idle_since = False, time.perf_counter()
        while True:
            began = time.perf_counter()
            act = broadcast_object(self._next_action() if self.leader else None)
            if act["weights"] is not None:
                self.receiver.receive()
                self.version = act["weights"]
            if act["val"] is not None:
                self._validate(act["val"])
            if act["snap"] is not None:
                self._snapshot(act["snap"])
            if act["stop"]:
                return {}
            if self.leader and self.stop_request.requested and not told:
                self.control.post("stop_requested", True)  # the trainer stops at its next step boundary
                told = True
            if act["generate"]:
                self._round(act["start"])
                self.stats["busy_s"] += time.perf_counter() - began
                idle_since = time.perf_counter()
            else:
                # Idle that long: a training rank that died sends nothing more, so end instead of serving until
                # torchrun's SIGKILL (its SIGTERM to the survivors comes first, hence the closer look after a stop
                # request). Not while generating: a check of a peer on another host takes seconds.
                if began - idle_since > (1.0 if self.stop_request.requested else PEER_CHECK_S):
                    raise_if_peer_died("the training ranks' next request")
                    idle_since = time.perf_counter()
                time.sleep(IDLE_POLL_S)
                self.stats["idle_s"] += time.perf_counter() - began

    def _wait_for_start(self) -> Any:
        """The trainer's start message, or None when it stops first."""
        timeout_s = self.cfg.trainer.collective_timeout_s
        checked = time.monotonic()
        deadline = checked + timeout_s
        while time.monotonic() < deadline:
            start = self.control.read("start")
            if start is not None or self.control.read("stop"):
                return start
            if time.monotonic() - checked > PEER_CHECK_S:
                raise_if_peer_died("the training ranks' start")
                checked = time.monotonic()
            time.sleep(IDLE_POLL_S)
        raise RuntimeError(f"the training ranks sent no start within trainer.collective_timeout_s={timeout_s:g}")

    def _next_action(self) -> dict[str, Any]:
        """On the first rollout rank: what every rollout rank does next (weights, requests, stop, a round)."""
        c = self.control
        announced = c.read("weights")
        weights = announced if announced is not None and announced != self.version else None
        version = self.version if weights is None else weights
        val, snap = c.read("val/request"), c.read("snap/request")
        val = val if val is not None and val != self.served["val"] and val == version else None
        snap = snap if snap is not None and snap != self.served["snap"] else None
        self.served["val"] = val if val is not None else self.served["val"]
        self.served["snap"] = snap if snap is not None else self.served["snap"]
        start = self._startable(version) if version >= 0 else 0
        pending = version >= 0 and any(g.started for g, _ in self.buffer.pending(self.stats["rounds"]))
        waiting = self.buffer.num_done() > 0  # done groups to score and queue (a resume's queued groups)
        return {
            "weights": weights,
            "val": val,
            "snap": snap,
            "stop": bool(c.read("stop")),
            "generate": pending or waiting or start > 0,
            "start": start,
        }

    def _startable(self, version: int) -> int:
        """How many new groups may start now: the staleness gate and the queue bound (module docstring)."""
        budget = (version - self.start_version + self.plan.max_staleness + 1) * self.cfg.data.train_batch_size
        started = self.put_groups + sum(g.started for g in self.buffer.groups)
        return max(0, min(budget - started, self.plan.queue_groups - self.queue.length()))

    # ------------------------------------------------------------------------------------------- a round

    def _round(self, start: int) -> None:
        """A segment for every started response in flight, and the first segment of ``start`` new groups (a new
        generation batch drawn when too few wait); the done groups scored, filtered and queued."""
        step = self.stats["rounds"]
        todo = [(g, j) for g, j in self.buffer.pending(step) if g.started]
        if start > len(self.buffer.unstarted()):
            rows = self.data.sampler.next_batch()
            items = [self.data.train[i] for i in rows]
            self.buffer.add(rows, [it["input_ids"] for it in items], self.cfg.rollout.n, items)
        todo += [(g, j) for g in self.buffer.unstarted()[:start] for j in range(self.cfg.rollout.n)]
        self.buffer.advance(todo, step, self.version, self.sampling, seed_offset=step)
        self.stats["rounds"] += 1
        done = self.buffer.take_done(len(self.buffer.groups))
        if done:
            self._queue_groups(done)
        if self.leader:
            self.control.post(
                "stats",
                {
                    **self.stats,
                    "epoch": self.data.sampler.epoch,
                    "buffered_responses": self.buffer.buffered_responses(),
                    "awaiting_tools": self.buffer.awaiting_tools(),
                },
            )

    def _queue_groups(self, done: list[Group]) -> None:
        """Score the done groups (every rollout rank), keep the informative ones, queue them (the first rank), and
        count them in the trained batch's window (``algo/dynamic_sampling.py``: dynamic sampling per trained batch)."""
        items = [self.data.train[g.item] for g in done]
        tokenizer = self.tokenizer if self.cfg.trainer.rollout_data_dir else None
        rollout = groups_to_rollout(done, self.engine.pad_token_id)
        batch, reward_metrics = score_to_batch(self.scorer, self.cfg.algorithm, rollout, items, tokenizer)
        if ADV_ESTIMATORS.needs(self.cfg.algorithm.adv_estimator).greedy_baseline:  # with this round's weights
            seed = self.stats["rounds"]
            batch.reward_baselines = greedy_baselines(
                self.generator, self.scorer, self.cfg.algorithm, rollout, items, self.sampling, seed
            )
        n = self.cfg.rollout.n
        fg = self.cfg.algorithm.filter_groups
        metric = filter_metric(batch, fg.metric) if fg.enable else None
        for i, group in enumerate(done):
            rows = batch.select(range(i * n, (i + 1) * n))
            min_version = min(v for r in group.responses for v in r.versions)
            values = metric[i * n : (i + 1) * n] if metric is not None else None
            if self.window.add(rows, (group.key, min_version), values):
                payload = {"key": group.key, "batch": rows, "min_version": min_version}
                self._put({**payload, "group": asdict(group), "reward_metrics": reward_metrics})
            if self.window.exhausted:
                self._exhausted()

    def _exhausted(self) -> None:
        """The window used ``algorithm.filter_groups.max_num_gen_batches`` without filling its batch. On
        ``on_exhausted=train`` it is filled up with dropped groups, which the training ranks keep out of the loss
        (the synchronous step's filler); on ``stop`` and ``error`` the training ranks get the message instead, and
        they raise it also when ``train`` has nothing to fill with (every group kept, too few generated)."""
        fg = self.cfg.algorithm.filter_groups
        filled = self.window.take_filler() if fg.on_exhausted == "train" else None
        if filled is None:
            self._put({"exhausted": self.window.close(), "error": fg.on_exhausted != "stop"})
            return
        filler, ids = filled
        n = self.cfg.rollout.n
        for i in range(0, len(ids), n):
            key, min_version = ids[i]
            self._put({"key": key, "batch": filler.select(range(i, i + n)), "min_version": min_version, "filler": True})

    def _put(self, payload: dict[str, Any]) -> None:
        """Queue a group or a message (the first rank) with the window's run totals: the training ranks' metrics of a
        batch are the differences between its last payload's totals and the previous batch's."""
        self.put_groups += "key" in payload
        if self.leader:
            self.queue.put(pickle.dumps({**payload, "totals": dict(self.window.totals)}))

    # ------------------------------------------------------------------------------------------- requests

    def _validate(self, version: int) -> None:
        algorithm = self.cfg.algorithm
        metrics = validation_metrics(self.generator, self.scorer, algorithm, self.data.val, self.val_sampling)
        if self.leader:
            self.control.post(f"val/result/{version}", metrics)

    def _snapshot(self, request: int) -> None:
        """Everything not trained yet: the data position, the responses in flight, and the queued groups (they are
        scored again after a resume)."""
        if not self.leader:
            return
        payloads = [pickle.loads(p) for p in self.queue.waiting()]
        queued = [p["group"] for p in payloads if "group" in p]  # not the filler (dropped groups) nor messages
        state = {"sampler": self.data.sampler.state_dict(), "buffer": self.buffer.state_dict(), "queued": queued}
        self.control.post(f"snap/result/{request}", state)

    def _restore(self, state: dict[str, Any]) -> None:
        """A checkpoint's snapshot: the data position, the responses in flight, the queued groups as done groups
        (oldest first) to score again."""
        self.data.sampler.load_state_dict(state["sampler"])
        self.buffer.load_state_dict(state["buffer"])
        self.buffer.groups = [group_from_dict(g) for g in state["queued"]] + self.buffer.groups

    def close(self) -> None:
        self.stop_request.restore()
        self.scorer.close()
        self.generator.close()
        teardown(self.engine)
