"""The async bridge's push (trainer.mode=async, docs/async.md): each tensor sent by the training rank that owns it.

A colocated sync brings every bucket to every rank (TP all-gather, PP broadcast, the expert exchange: ``rollout/
sync.py``), because every rank's engine needs it. Over the bridge only the rollout ranks need the weights, so
``OwnerPush`` sends each Megatron tensor once, from its owner:

* the **sender** of a tensor is the rank of its pipeline stage (and, for a routed expert, of its expert-parallel rank)
  with TP rank 0 (expert TP for experts) in the first data-parallel replica (expert data parallel for experts); the
  plan (``plan_push``) agrees on it once, with the buckets of ``rollout/sync.plan_buckets`` (whole vLLM layers);
* a TP-split tensor is **gathered to its sender** (``dist.gather`` over its TP group, not an all-gather): the other
  TP ranks send their shard and receive nothing; other stages, replicas and expert-parallel ranks take no part;
* the sender turns its part of each bucket into HF tensors with the one Megatron → HF conversion of the reload
  transport (``reload_transport.ReloadTransport``: ``weights.layout.mcore_to_hf``, cast to the rollout dtype) and
  hands it to ``rollout/remote.BridgeSender``, which broadcasts it over the sender's bridge group without waiting.

Why gather to the sender rather than each TP rank sending its own shard: the rollout engines load HF tensors through
``reload_weights`` (each vLLM rank slices its own shard), so the Megatron → HF conversion (q/k/v split, gate/up,
vocabulary unpadding) needs the full tensor somewhere; on the sender it stays the reload transport's, written once,
and the rollout side stays a plain receiver. The gather moves the same bytes as the shards would have crossed the
bridge, inside the training side's fast links.

The push returns once its tensors are copied into the send buffers: the trainer goes on with the next step while
the rollout ranks take the push at their next round boundary. ``BridgeSender.wait`` (the next push, or the end of the
run) waits for it, so a sender holds at most one push of its tensors in flight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_dapo import dtypes
from megatron_dapo.models.families import ModelArch
from megatron_dapo.parallel import all_gather_object
from megatron_dapo.rollout.expert_exchange import Source
from megatron_dapo.rollout.remote import BridgeSender
from megatron_dapo.rollout.sync import plan_buckets
from megatron_dapo.rollout.weight_transfer.reload_transport import ReloadTransport
from megatron_dapo.weights.layout import tp_merge
from megatron_dapo.weights.model_io import LocalParam, shard_group, unique_local_params


@dataclass(frozen=True)
class PushPlan:
    """The buckets (``rollout/sync._Bucket``: whole vLLM layers, one stage each), the training rank that sends each
    Megatron tensor, and the sending ranks in order."""

    buckets: list
    sender: dict[str, int]
    senders: list[int]

    def bucket_senders(self) -> list[list[int]]:
        """Per bucket, the indices (into ``senders``) of the ranks that send a part of it, in rank order."""
        return [
            sorted({self.senders.index(self.sender[e.mapping.mcore]) for e in bucket.entries})
            for bucket in self.buckets
        ]


def _claims(lp: LocalParam) -> bool:
    """Whether this rank would send ``lp``: TP rank 0 of its shard group in the first (expert) data-parallel
    replica. (The tied output-layer copy on the last stage also claims the embedding's name; ``plan_push`` keeps the
    claim of the stage the bucket plan chose.)"""
    from megatron.core import parallel_state as ps  # heavy: megatron-core

    if lp.mapping.is_expert:
        replica = ps.get_expert_data_parallel_rank()
    else:
        replica = ps.get_data_parallel_rank(with_context_parallel=True)
    return replica == 0 and shard_group(lp.mapping)[1] == 0


def plan_push(local: list[LocalParam], arch: ModelArch, bucket_bytes: int) -> PushPlan:
    """The push's plan, the same on every training rank (collective: two metadata all-gathers)."""
    from megatron.core import parallel_state as ps  # heavy: megatron-core

    buckets = plan_buckets(local, arch, bucket_bytes)
    stage_of = {e.mapping.mcore: e.stage for b in buckets for e in b.entries}
    pp_rank = ps.get_pipeline_model_parallel_rank()
    claims = all_gather_object([lp.mapping.mcore for lp in local if _claims(lp)])
    stages = all_gather_object(pp_rank)
    sender: dict[str, int] = {}
    for rank, names in enumerate(claims):
        for name in names:
            if stages[rank] != stage_of.get(name):
                continue
            if name in sender:
                raise RuntimeError(f"weight push: ranks {sender[name]} and {rank} both own {name}")
            sender[name] = rank
    missing = sorted(set(stage_of) - set(sender))
    if missing:
        raise RuntimeError(f"weight push: no rank owns {missing[:5]} ({len(missing)} tensors)")
    return PushPlan(buckets, sender, sorted(set(sender.values())))


class OwnerPush:
    """The actor's weights over the bridge, each tensor from its owner (module docstring); an ``ActorWeightSync``.
    ``bucket_bytes`` is ``rollout.weight_sync_bucket_mb`` in bytes. Byte counters (this rank, over the run):
    ``gather_received_bytes`` (shards gathered to it as a sender), ``gather_sent_bytes`` (its shards gathered to
    another rank); ``bridge.sent_bytes`` what it sent over the bridge."""

    def __init__(self, bridge: BridgeSender, arch: ModelArch, bucket_bytes: int) -> None:
        self.bridge, self.arch, self.bucket_bytes = bridge, arch, int(bucket_bytes)
        dtype = dtypes.from_config_name(bridge.rollout_plan.dtype, "rollout.dtype")
        self.transport = ReloadTransport(bridge, arch, dtype)  # the one Megatron -> HF conversion
        self.plan: Optional[PushPlan] = None
        self.gather_received_bytes = 0
        self.gather_sent_bytes = 0
        self._groups: dict[bool, tuple[Any, list[int]]] = {}  # expert or not: (TP group, its ranks)

    @torch.no_grad()
    def sync(self, actor_chunks: list) -> dict[str, float]:
        """Push the actor's weights (collective over the training ranks); returns once this rank's part is in the
        send buffers. Waits first for the previous push to arrive."""
        from megatron.core import parallel_state as ps  # heavy: megatron-core

        t0 = time.perf_counter()
        waited = self.bridge.wait()
        local = unique_local_params(actor_chunks, self.arch)
        if self.plan is None:
            self.plan = plan_push(local, self.arch, self.bucket_bytes)
            self.bridge.open(self.plan.senders, self.plan.bucket_senders())
        by_name = {lp.mapping.mcore: lp for lp in local}
        pp_rank = ps.get_pipeline_model_parallel_rank()
        sent_before, received_before = self.bridge.sent_bytes, self.gather_received_bytes
        t_gather = t_send = 0.0
        sent: list[str] = []
        for bucket in self.plan.buckets:
            if bucket.stage != pp_rank:
                continue
            t = time.perf_counter()
            held = [e for e in bucket.entries if e.mapping.mcore in by_name]  # not another EP rank's experts
            part = [(e, full) for e in held if (full := self._to_sender(by_name[e.mapping.mcore])) is not None]
            t_gather += time.perf_counter() - t
            if part:
                t = time.perf_counter()
                names, _ = self.transport.send([e for e, _ in part], [Source(full, False) for _, full in part])
                sent.extend(names)
                t_send += time.perf_counter() - t
        self._check(sent)
        return {
            "timing_s/update_weights": time.perf_counter() - t0,
            "timing_s/update_weights_wait": waited,
            "timing_s/update_weights_gather": t_gather,
            "timing_s/update_weights_load": t_send,
            "bytes": float(self.bridge.sent_bytes - sent_before),
            "gather_received_bytes": float(self.gather_received_bytes - received_before),
            "buckets": float(len(self.plan.buckets)),
            "senders": float(len(self.plan.senders)),
        }

    def _to_sender(self, lp: LocalParam) -> Optional[torch.Tensor]:
        """The full Megatron tensor of ``lp`` on its sender (gathered over its TP group when split), None on every
        other rank (which sends its shard to the sender when it is in the sender's TP group)."""
        from megatron.core import parallel_state as ps  # heavy: megatron-core

        src, me = self.plan.sender[lp.mapping.mcore], dist.get_rank()
        size, _ = shard_group(lp.mapping)
        if lp.mapping.tp_dim is None or size == 1:
            return lp.param.detach() if me == src else None
        expert = lp.mapping.is_expert
        if expert not in self._groups:
            group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
            self._groups[expert] = (group, dist.get_process_group_ranks(group))
        group, ranks = self._groups[expert]
        if src not in ranks:
            return None  # another replica's (or expert-parallel rank's) group sends it
        local = lp.param.detach().contiguous()
        nbytes = local.numel() * local.element_size()
        if me != src:
            dist.gather(local, None, dst=src, group=group)
            self.gather_sent_bytes += nbytes
            return None
        shards = [torch.empty_like(local) for _ in range(size)]
        dist.gather(local, shards, dst=src, group=group)
        self.gather_received_bytes += (size - 1) * nbytes
        return tp_merge(shards, lp.mapping.kind, lp.mapping.tp_dim, lp.mapping.sections)

    def _check(self, sent: list[str]) -> None:
        """This rank sent exactly the HF tensors of the Megatron tensors it owns, each once."""
        me = dist.get_rank()
        mine = [e for b in self.plan.buckets for e in b.entries if self.plan.sender[e.mapping.mcore] == me]
        expected = sorted(n for e in mine for n in e.mapping.hf)
        if sorted(sent) != expected:
            missing, extra = sorted(set(expected) - set(sent)), sorted(set(sent) - set(expected))
            raise RuntimeError(f"weight push sent an incomplete set: missing {missing[:5]}, extra {extra[:5]}")
