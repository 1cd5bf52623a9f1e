"""The ``lora_adapters`` transport: a LoRA actor's weight sync (docs/lora.md "Weight sync to vLLM"), the base once,
then the adapters only.

``LoraAdapterSync.sync`` has ``WeightSync.sync``'s contract (collective over all ranks, returns the same metric
names: an ``ActorWeightSync``). Two modes, from the run's plan (``weight_transfer/factory.build_weight_sync``:
``vllm_lora`` where ``RunPlan.weight_transport`` is ``lora_adapters``, ``merge`` where it is ``reload``, the async
bridge); at its first call ``vllm_lora`` verifies that every rank's engine runs vLLM's LoRA (a live-engine fact; a
custom engine factory may build one without) and, where one does not, every rank merges instead (one warning):

* ``vllm_lora`` (a colocated ``RolloutEngine`` built with LoRA, ``RolloutEngine.lora_enabled``): the first call pushes
  the base weights with an internal ``WeightSync`` through vLLM's ``reload_weights`` (``weights.model_io.
  local_param_table`` leaves the adapters out and gives the base weights their unwrapped names; the direct
  transport's layer lookup does not see through vLLM's LoRA wrappers). The base is pushed again only when the
  engine's weights changed since (another sync wrote into it, or a level-2 sleep dropped them:
  ``RolloutEngine.weight_updates`` / ``weights_discarded``). vLLM drops its adapters on every ``reload_weights``,
  so an adapter is always loaded after the base. Every call then
    1. TP-gathers each adapter weight to the full Megatron tensor: for a column-parallel base (``linear_qkv``,
       ``linear_fc1``) A ``[r, in]`` is split along r and B like the base weight's rows (``weights.layout.tp_merge``
       with the base mapping's kind, so fc1's ``[gate_t; up_t]`` shards merge to ``[gate; up]``); for a row-parallel
       base (``linear_proj``, ``linear_fc2``) A is split along its input (dim 1) and B along dim 0;
    2. sends each tensor held by only some ranks (pipeline stages, expert-parallel ranks) from its lowest-ranked
       holder to every rank, one flat broadcast per holder (every vLLM replica needs every layer);
    3. converts them to peft's names and tensors (``weights.lora_hf.mcore_adapters_to_peft``: q/k/v and gate/up
       share A, B split as the fused weight) and loads them into the engine **in memory** as a new LoRA adapter
       (``RolloutEngine.load_lora_adapter``: a new ``lora_int_id``, the previous one removed; nothing on disk).
* ``merge`` (any other target: an engine without LoRA, the async bridge ``rollout.remote.BridgeSender``):
  ``merged_sync`` on every call: ``models.lora.merge_adapters`` → the full ``WeightSync.sync`` →
  ``unmerge_adapters`` (the base weights come back up to floating-point rounding, ≤ 1e-8 in fp32: docs/lora.md).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_dapo import dtypes
from megatron_dapo.config.schema import LoRAConfig
from megatron_dapo.models.families import ModelArch, ParamMapping, param_mappings
from megatron_dapo.models.lora import is_adapter_param, lora_modules_present, merge_adapters, unmerge_adapters
from megatron_dapo.parallel import control_group
from megatron_dapo.rollout.sync import WeightSync
from megatron_dapo.rollout.weight_transfer.transport import ActorWeightSync, WeightTarget, numel
from megatron_dapo.weights.layout import tp_merge
from megatron_dapo.weights.lora_hf import mcore_adapters_to_peft, peft_adapter_config
from megatron_dapo.weights.model_io import global_named_parameters, shard_group

logger = logging.getLogger(__name__)

_IN, _OUT = ".adapter.linear_in.weight", ".adapter.linear_out.weight"


@dataclass(frozen=True)
class LocalAdapter:
    """One adapter weight on this rank: its global Megatron name, the base weight's mapping and the parameter."""

    name: str  # global name: decoder.layers.{global}.….adapter.linear_{in,out}.weight (global expert index)
    base: ParamMapping  # the wrapped layer's base weight (layout kind, TP dimension, expert or not)
    param: torch.Tensor

    @property
    def is_a(self) -> bool:
        return self.name.endswith(_IN)


def local_adapters(chunks: list, arch: ModelArch) -> list[LocalAdapter]:
    """This rank's adapter weights with their global names and base mappings (virtual-pipeline chunks in order)."""
    by_name = {m.mcore: m for m in param_mappings(arch)}
    out = []
    for _, local_name, name, param in global_named_parameters(chunks, arch):
        if is_adapter_param(local_name):
            suffix = _IN if name.endswith(_IN) else _OUT
            base = by_name.get(name[: -len(suffix)] + ".weight")
            if base is None or base.tp_dim is None:
                raise KeyError(f"LoRA adapter {local_name!r} (global {name!r}): no base weight mapping to sync it by")
            out.append(LocalAdapter(name, base, param))
    return out


def merge_rule(la: LocalAdapter) -> tuple[str, int]:
    """(``tp_merge`` kind, dimension) of an adapter weight's TP shards. Column-parallel base: A split along r, B like
    the base weight's rows (fc1 in gate/up halves); row-parallel base: A along the base's input, B along dim 0."""
    column = la.base.tp_dim == 0
    if la.is_a:
        return "copy", 0 if column else 1
    return (la.base.kind, 0) if column else ("copy", 0)


@torch.no_grad()
def gather_full_adapters(local: list[LocalAdapter]) -> dict[str, torch.Tensor]:
    """The full (TP=1) Megatron tensor of each of this rank's adapter weights: one all-gather of all the shards of
    one TP group and dtype, flattened together (collective over TP; expert adapters run with expert TP 1: no
    communication). Module docstring, step 1."""
    from megatron.core import parallel_state as ps  # heavy: megatron-core, once the platform has patched it

    out: dict[str, torch.Tensor] = {}
    groups: dict[tuple[bool, torch.dtype], list[LocalAdapter]] = {}
    for la in local:
        if shard_group(la.base)[0] == 1:
            out[la.name] = la.param.detach()
        else:
            groups.setdefault((la.base.is_expert, la.param.dtype), []).append(la)
    for (is_expert, _), members in groups.items():
        size = shard_group(members[0].base)[0]
        group = ps.get_expert_tensor_parallel_group() if is_expert else ps.get_tensor_model_parallel_group()
        flat = torch.cat([la.param.detach().reshape(-1) for la in members])
        parts = [torch.empty_like(flat) for _ in range(size)]
        dist.all_gather(parts, flat, group=group)
        per_rank = [torch.split(p, [la.param.numel() for la in members]) for p in parts]
        for k, la in enumerate(members):
            kind, dim = merge_rule(la)
            out[la.name] = tp_merge([r[k].view(la.param.shape) for r in per_rank], kind, dim)
    return out


class LoraAdapterSync:
    """The actor's LoRA weights into the colocated engine (module docstring). ``lora`` is ``actor.lora``;
    ``bucket_bytes`` goes to the internal ``WeightSync`` (the base, and everything in ``merge`` mode, always through
    ``reload``); ``mode`` is ``vllm_lora`` (``RunPlan.weight_transport`` ``lora_adapters``; needs an engine with
    LoRA) or ``merge``. ``base_syncs`` counts the full syncs run, ``adapter_syncs`` the adapter loads."""

    def __init__(self, engine: WeightTarget, arch: ModelArch, lora: LoRAConfig, bucket_bytes: int, mode: str) -> None:
        if mode not in ("vllm_lora", "merge"):
            raise ValueError(f"LoraAdapterSync mode {mode!r}: expected 'vllm_lora' or 'merge'")
        if lora.rank <= 0:
            raise ValueError("LoraAdapterSync needs actor.lora.rank > 0 (use WeightSync)")
        self.engine, self.arch = engine, arch
        # The base goes through reload_weights: the direct transport's layer lookup does not see through vLLM's LoRA
        # wrappers (on CPU it refuses them; elsewhere it would skip the layers' weight processing).
        self.base_sync = WeightSync(engine, arch, bucket_bytes, "reload")
        self.peft_config = peft_adapter_config(arch, lora, str(getattr(engine, "hf_dir", "")))
        self.dtype = dtypes.from_config_name(engine.rollout_plan.dtype, "rollout.dtype")
        self.mode = mode  # "vllm_lora" | "merge"
        self._verified = mode == "merge"  # vllm_lora: every engine's LoRA checked at the first sync
        self._base_state: Optional[tuple[int, int]] = None  # ``_engine_state()`` right after our base push
        self.base_syncs = 0
        self.adapter_syncs = 0
        self._owners: Optional[list[tuple[int, torch.dtype, list]]] = None

    def _engine_state(self) -> tuple[int, int]:
        """(weight updates, level-2 sleeps) of the engine: when it differs from the value right after our base push,
        the engine no longer holds exactly the base (another sync wrote into it, e.g. merged weights, or a level-2
        sleep dropped the weights) and the base is pushed again."""
        return int(getattr(self.engine, "weight_updates", 0)), int(getattr(self.engine, "weights_discarded", 0))

    def _verify_mode(self) -> str:
        """``vllm_lora`` when every rank's target is an engine with vLLM LoRA (all ranks agree), else ``merge`` with one
        warning: the plan assumed the engine the trainer builds, a custom engine factory may build one without."""
        ok = torch.tensor([int(bool(getattr(self.engine, "lora_enabled", False)))])
        if dist.is_initialized():
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=control_group())
        if ok.item():
            return "vllm_lora"
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.warning("LoRA weight sync: planned lora_adapters, but an engine has no vLLM LoRA; merging instead")
        return "merge"

    @torch.no_grad()
    def sync(self, actor_chunks: list) -> dict[str, float]:
        """Push the actor (base once, then its adapters; ``merge`` mode: the merged weights) into the engine.
        Collective over all ranks. Returns ``WeightSync.sync``'s metrics plus ``perf/lora_sync_bytes`` (the
        adapter tensors loaded, bytes) and ``lora/base_synced`` (1 when this call pushed the base)."""
        t0 = time.perf_counter()
        if not self._verified:
            self.mode, self._verified = self._verify_mode(), True
        if self.mode == "merge":
            return self._merged_sync(actor_chunks, t0)
        metrics = {k: 0.0 for k in ("bytes", "buckets", "direct", "direct_fallback", "local_shards", "expert_shards")}
        metrics["expert_received_bytes"] = 0.0
        base_synced = 0.0
        if self._base_state != self._engine_state():  # first call, or the engine's weights changed since
            metrics.update(self.base_sync.sync(actor_chunks))
            self.base_syncs += 1
            self._base_state = self._engine_state()
            base_synced = 1.0
        sync_dev = self.engine.platform.synchronize
        t = time.perf_counter()
        full = self._all_adapters(actor_chunks)
        peft = [(n, x.to(self.dtype)) for n, x in mcore_adapters_to_peft(self.arch, full)]
        sync_dev()
        t_gather = time.perf_counter() - t
        t = time.perf_counter()
        self.engine.load_lora_adapter(peft, self.peft_config)
        sync_dev()
        t_load = time.perf_counter() - t
        self.adapter_syncs += 1
        lora_bytes = float(sum(x.numel() * x.element_size() for _, x in peft))
        metrics.update(
            {
                "timing_s/update_weights": time.perf_counter() - t0,
                "timing_s/update_weights_gather": metrics.get("timing_s/update_weights_gather", 0.0) + t_gather,
                "timing_s/update_weights_load": metrics.get("timing_s/update_weights_load", 0.0) + t_load,
                "bytes": metrics["bytes"] + lora_bytes,
                "perf/lora_sync_bytes": lora_bytes,
                "lora/base_synced": base_synced,
                "lora/adapter_id": float(self.engine.lora_request.lora_int_id),
            }
        )
        return metrics

    def _merged_sync(self, chunks: list, t0: float) -> dict[str, float]:
        """``merge`` mode: the full sync of the merged weights, the base restored after (also on an error)."""
        if getattr(self.engine, "lora_request", None) is not None:
            self.engine.remove_lora_adapter()  # the merged weights hold the adapters
        metrics = merged_sync(self.base_sync, chunks)
        self.base_syncs += 1
        metrics.update({"timing_s/update_weights": time.perf_counter() - t0, "perf/lora_sync_bytes": 0.0})
        metrics["lora/base_synced"] = 1.0
        return metrics

    # ------------------------------------------------------------------------------------------------ gather

    def _all_adapters(self, chunks: list) -> list[tuple[str, torch.Tensor]]:
        """Every adapter weight of the model as a full Megatron tensor, on every rank (steps 1-2)."""
        mine = gather_full_adapters(local_adapters(chunks, self.arch))
        if self._owners is None:
            self._owners = self._plan({n: (tuple(t.shape), t.dtype) for n, t in mine.items()})
        device = self.engine.platform.device()
        out = dict(mine)
        for owner, dtype, entries in self._owners:
            sizes = [numel(shape) for _, shape in entries]
            if dist.get_rank() == owner:
                flat = torch.cat([mine[n].reshape(-1).to(device) for n, _ in entries])
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            dist.broadcast(flat, src=owner)
            for (name, shape), part in zip(entries, torch.split(flat, sizes)):
                out.setdefault(name, part.view(shape))
        return sorted(out.items())

    def _plan(self, mine: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> list[tuple[int, torch.dtype, list]]:
        """(owner rank, dtype, [(name, full shape)]) for the tensors some rank lacks, each sent by its lowest-ranked
        holder, one flat buffer per (owner, dtype). Every rank's list is exchanged once: the same plan everywhere."""
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        holders: dict[str, list[int]] = {}
        for rank, names in enumerate(everyone):
            for name in names:
                holders.setdefault(name, []).append(rank)
        by_owner: dict[tuple[int, torch.dtype], list[tuple[str, tuple[int, ...]]]] = {}
        for name in sorted(holders):
            owner = holders[name][0]
            if len(holders[name]) < len(everyone):
                shape, dtype = everyone[owner][name]
                by_owner.setdefault((owner, dtype), []).append((name, shape))
        return [
            (owner, dtype, entries) for (owner, dtype), entries in sorted(by_owner.items(), key=lambda kv: kv[0][0])
        ]


def merged_sync(weight_sync: ActorWeightSync, actor_chunks: list) -> dict[str, float]:
    """``weight_sync.sync`` of the actor with its LoRA adapters merged into the base weights (a target without LoRA
    support; the async bridge's push), unmerged right after, also when the sync fails. A model without adapters syncs as
    is. Collective over all ranks (merging gathers the adapters' other TP shard)."""
    if not lora_modules_present(actor_chunks):
        return weight_sync.sync(actor_chunks)
    merge_adapters(actor_chunks)
    try:
        return weight_sync.sync(actor_chunks)
    finally:
        unmerge_adapters(actor_chunks)
