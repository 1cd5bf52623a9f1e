"""LoRA adapters on megatron-core's parallel linear layers (local and TransformerEngine specs); how training, the
weight sync, checkpoints and export use them: docs/lora.md.

Megatron-Bridge's PEFT LoRA (what verl and NeMo-RL use) imports ``transformer_engine.pytorch`` at module top, so it
cannot run on CPU. This module mirrors its config names (``target_modules``, ``dim`` = our ``rank``, ``alpha``,
``dropout``, ``dropout_position``, ``lora_A_init_method``/``lora_B_init_method``), its module structure and its
parameter names: a targeted ``linear_qkv`` becomes a ``LoRALinear`` holding the base layer as ``to_wrap`` and a
``LoRAAdapter`` as ``adapter`` (``...linear_qkv.adapter.linear_in.weight`` = A ``[rank, in]``,
``...linear_qkv.adapter.linear_out.weight`` = B ``[out, rank]``), and each rank's shards have Megatron-Bridge's
shapes. ``state_dict`` keeps the base weights at their unwrapped keys (``...linear_qkv.weight``) as Megatron-Bridge's
``AdapterWrapper`` does; ``named_parameters`` shows them under ``to_wrap.`` (``base_param_name`` strips it).

Forward: ``base(x) + alpha/rank * B(A(dropout(x)))``; ``x`` is the base layer's input (its norm's output for TE's
fused ``TELayerNormColumnParallelLinear``). Tensor parallelism, as Megatron-Bridge's ``ParallelLinearAdapter``:
  * column-parallel base (``linear_qkv``, ``linear_fc1``, a Gated DeltaNet's ``in_proj``): A is a
    ``ColumnParallelLinear`` split along the rank with its output gathered (every rank sees the whole ``A x``; with
    sequence parallelism ``x`` is first gathered along the sequence as the base layer does), B a
    ``ColumnParallelLinear`` split along the output like the base weight: rank r's B rows are the rows of rank r's
    base shard (fc1: ``cat(gate_r, up_r)``; qkv: rank r's query groups; in_proj: rank r's q, k, v, z, beta and alpha
    sections);
  * row-parallel base (``linear_proj``, ``linear_fc2``, ``out_proj``): A is a ``RowParallelLinear`` split along the
    input like the base weight, its partial outputs all-reduced; B a ``ColumnParallelLinear`` split along the output
    and gathered; with sequence parallelism the result is scattered along the sequence as the base layer's
    reduce-scatter does.
So ``rank`` must be divisible by TP (A of a column-parallel base is split along it). Every adapter weight is a
TP-sharded parameter whose gradient is complete on its rank (no extra TP reduction).
MoE: megatron-core's local ``SequentialMLP`` experts (``...experts.local_experts.<i>.linear_fc{1,2}``) get one
adapter each, as expert parameters (``is_expert``: reduced over the expert-data-parallel group), expert TP 1 only;
shared experts are adapted as dense layers. Not handled (raises): TE's grouped-GEMM experts (``TEGroupedMLP``),
expert TP > 1, and the router.
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

# Attention and MLP; then a hybrid's Gated DeltaNet token mixer (Qwen3-Next / Qwen3.5: its fused ``in_proj``, column-
# parallel, and ``out_proj``, row-parallel), which a model without such layers does not have.
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj")
_EXPERT_LINEAR = re.compile(r".*mlp\..*experts.*\.linear_fc[1-2]$")  # Megatron-Bridge's is_expert_linear


def resolve_targets(target_modules: Sequence[str]) -> tuple[str, ...]:
    """``target_modules`` → the layer names to wrap (``all-linear``, peft's spelling, = all of them)."""
    if "all-linear" in target_modules:
        return LORA_TARGETS
    unknown = sorted(set(target_modules) - set(LORA_TARGETS))
    if unknown:
        raise ValueError(f"LoRA target_modules {unknown}: expected a subset of {list(LORA_TARGETS)} or all-linear")
    return tuple(t for t in LORA_TARGETS if t in target_modules)


def _init_fn(name: str):
    """Megatron-Bridge's ``ParallelLinearAdapter._get_init_fn``: xavier (normal), normal(0.2), kaiming, zero."""
    inits = {
        "xavier": torch.nn.init.xavier_normal_,
        "normal": lambda t: torch.nn.init.normal_(t, mean=0.0, std=0.2),
        "kaiming": lambda t: torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5)),
        "zero": torch.nn.init.zeros_,
    }
    if name not in inits:
        raise ValueError(f"LoRA init method {name!r}: expected one of {sorted(inits)}")
    return inits[name]


def _parallel_linear_classes() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(column-parallel, row-parallel) classes that can be wrapped: megatron-core's, and TE's where it imports."""
    # heavy: megatron-core, once the platform has patched it
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    column: tuple[type, ...] = (ColumnParallelLinear,)
    row: tuple[type, ...] = (RowParallelLinear,)
    try:
        # optional: TransformerEngine (the [gpu] extra); without it megatron-core binds its TE names to MagicMocks
        from megatron.core.extensions import transformer_engine as te_ext
    except ImportError:
        return column, row
    if not getattr(te_ext, "HAVE_TE", False):
        return column, row
    te_column = (te_ext.TELayerNormColumnParallelLinear, te_ext.TEColumnParallelLinear)
    return column + te_column, row + (te_ext.TERowParallelLinear,)


class LoRAAdapter(torch.nn.Module):
    """Megatron-Bridge's ``ParallelLinearAdapter`` (identity activation, no norm) on megatron-core's linears:
    ``linear_in`` = A, ``linear_out`` = B, ``forward`` returns ``alpha/dim * B(A(dropout(x)))`` (module docstring:
    the sharding). ``in_features``/``out_features`` are the base layer's full (TP=1) sizes."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        lora_cfg: Any,
        *,
        config: Any,
        input_is_parallel: bool,
        is_expert: bool,
        tp_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        # heavy: megatron-core, once the platform has patched it
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        self.dim, self.alpha = int(lora_cfg.rank), float(lora_cfg.alpha)
        self.scale = self.alpha / self.dim
        self.input_is_parallel = input_is_parallel
        self.is_expert = is_expert
        self._swiglu = False  # fc1 of a gated MLP: the sharded checkpoint splits B in gate/up halves like fc1
        # The adapter's own sequence-parallel communication: the base layer's tokens are split along the sequence;
        # experts see dispatched tokens (no SP split), as in Megatron-Bridge.
        self.sequence_parallel = bool(config.sequence_parallel) and not is_expert
        self.dropout_position = lora_cfg.dropout_position
        self.dropout = torch.nn.Dropout(lora_cfg.dropout) if lora_cfg.dropout > 0 else torch.nn.Identity()
        cfg = copy.copy(config)  # the adapter's linears run without SP (its gather/scatter are explicit)
        cfg.sequence_parallel = False
        cfg.perform_initialization = True
        common = {"config": cfg, "bias": False, "is_expert": is_expert, "tp_group": tp_group}
        init_a, init_b = _init_fn(lora_cfg.lora_A_init_method), _init_fn(lora_cfg.lora_B_init_method)
        if input_is_parallel:
            self.linear_in = RowParallelLinear(
                in_features, self.dim, init_method=init_a, input_is_parallel=True, skip_bias_add=True, **common
            )
        else:
            self.linear_in = ColumnParallelLinear(
                in_features,
                self.dim,
                init_method=init_a,
                gather_output=True,
                disable_grad_reduce=self.sequence_parallel,  # the SP gather's backward reduce-scatters instead
                **common,
            )
        self.linear_out = ColumnParallelLinear(
            self.dim, out_features, init_method=init_b, gather_output=input_is_parallel, **common
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # heavy: megatron-core, once the platform has patched it
        from megatron.core.tensor_parallel import (
            gather_from_sequence_parallel_region,
            scatter_to_sequence_parallel_region,
        )

        if self.dropout_position == "pre":
            x = self.dropout(x)
        group = self.linear_in.tp_group
        if self.sequence_parallel and not self.input_is_parallel:
            x = gather_from_sequence_parallel_region(x, group=group)
        h, _ = self.linear_in(x)
        y, _ = self.linear_out(h)
        if self.sequence_parallel and self.input_is_parallel:
            y = scatter_to_sequence_parallel_region(y, group=group)
        if self.dropout_position == "post":
            y = self.dropout(y)
        return y * self.scale

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """``alpha/dim * B @ A`` for this rank's shard of the base weight (gathers the adapter's other TP shard)."""
        a, b = self.linear_in.weight, self.linear_out.weight
        if self.input_is_parallel:  # row-parallel base: W_r = B_full @ A_r
            b = _all_gather_rows(b, self.linear_out.tp_group)
        else:  # column-parallel base: W_r = B_r @ A_full
            a = _all_gather_rows(a, self.linear_in.tp_group)
        return self.scale * (b @ a)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """A and B as megatron-core's linears shard them; fc1's B in two halves (gate/up) as the base weight."""
        # heavy: megatron-core, once the platform has patched it
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        out = self.linear_in.sharded_state_dict(f"{prefix}linear_in.", sharded_offsets, metadata)
        b = self.linear_out.sharded_state_dict(f"{prefix}linear_out.", sharded_offsets, metadata)
        if self._swiglu:
            key = f"{prefix}linear_out.weight"
            b[key] = apply_swiglu_sharded_factory(b[key], sharded_offsets)
        out.update(b)
        return out


def _all_gather_rows(t: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    if size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _base_forward(module: torch.nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any):
    """(output, bias, the input the adapter sees): Megatron-Bridge's ``AdapterWrapper.base_linear_forward`` over the
    return patterns ``(out, bias)``, ``((out, ln_out), bias)`` and ``(out, bias, ln_out)``."""
    result = module(x, *args, **kwargs)
    bias, adapter_input = None, x
    if len(result) == 2:
        out, bias = result
        if isinstance(out, tuple) and len(out) == 2:
            out, adapter_input = out
    else:
        out, bias, adapter_input = result
    return out, bias, adapter_input


class LoRALinear(torch.nn.Module):
    """A base parallel linear (``to_wrap``) plus its ``adapter``: Megatron-Bridge's ``LoRALinear``."""

    def __init__(self, to_wrap: torch.nn.Module, adapter: LoRAAdapter) -> None:
        super().__init__()
        self.to_wrap = to_wrap
        self.adapter = adapter
        self._adapter_enabled = True
        self._merged = False
        self._register_load_state_dict_pre_hook(_wrapped_keys_hook, with_module=True)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any):
        out, bias, adapter_input = _base_forward(self.to_wrap, x, *args, **kwargs)
        if not self._adapter_enabled or self._merged:
            return out, bias
        return out + self.adapter(adapter_input.contiguous()).reshape(out.shape), bias

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        """The base layer's keys unwrapped (``linear_qkv.weight``), the adapter's under ``adapter.``."""
        if destination is None:
            destination = {}
        self.to_wrap.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        self.adapter.state_dict(destination=destination, prefix=f"{prefix}adapter.", keep_vars=keep_vars)
        return destination

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        out = dict(self.to_wrap.sharded_state_dict(prefix, sharded_offsets, metadata))
        out.update(self.adapter.sharded_state_dict(f"{prefix}adapter.", sharded_offsets, metadata))
        return out


def _wrapped_keys_hook(module, state_dict, prefix, *_args) -> None:
    """``load_state_dict``: the base layer's unwrapped keys (what ``state_dict`` writes) go to ``to_wrap.``."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix) :]
        if not rest.startswith(("adapter.", "to_wrap.")):
            state_dict[f"{prefix}to_wrap.{rest}"] = state_dict.pop(key)


def _geometry(module: torch.nn.Module, row: bool, tp_size: int) -> tuple[int, int]:
    """The base layer's full (TP=1) (in, out) features: megatron-core's layers store them, TE's the local ones."""
    if hasattr(module, "input_size"):
        return module.input_size, module.output_size
    if row:
        return module.in_features * tp_size, module.out_features
    return module.in_features, module.out_features * tp_size


def _make_lora_linear(module: torch.nn.Module, row: bool, is_expert: bool, lora_cfg: Any) -> LoRALinear:
    # heavy: megatron-core, once the platform has patched it
    from megatron.core import parallel_state as ps

    if hasattr(module, "return_layernorm_output"):  # TE's fused norm + linear: the adapter reads the norm's output
        module.return_layernorm_output = True
    in_features, out_features = _geometry(module, row, ps.get_tensor_model_parallel_world_size())
    adapter = LoRAAdapter(
        in_features,
        out_features,
        lora_cfg,
        config=module.config,
        input_is_parallel=row,
        is_expert=is_expert,
        tp_group=getattr(module, "tp_group", None),
    )
    return LoRALinear(module, adapter.to(module.weight.device))


def _targets_of(chunk: torch.nn.Module, targets: tuple[str, ...]) -> list[tuple[str, torch.nn.Module, bool, bool]]:
    """(name, module, row-parallel, expert) of every layer to wrap; raises before anything is wrapped."""
    # heavy: megatron-core, once the platform has patched it
    from megatron.core import parallel_state as ps

    column, row = _parallel_linear_classes()
    found = []
    for name, module in chunk.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in targets or isinstance(module, LoRALinear) or ".to_wrap" in f".{name}":
            continue
        if "Grouped" in type(module).__name__:
            raise NotImplementedError(
                f"LoRA on {name} ({type(module).__name__}): TE grouped-GEMM experts are not handled; use the local "
                "spec (SequentialMLP experts) or leave linear_fc1/linear_fc2 out of target_modules"
            )
        if not isinstance(module, column + row):
            raise NotImplementedError(f"LoRA on {name}: {type(module).__name__} is not a supported parallel linear")
        is_expert = _EXPERT_LINEAR.match(name) is not None and ".shared_experts." not in name
        if is_expert and ps.get_expert_tensor_parallel_world_size() > 1:
            raise NotImplementedError(f"LoRA on {name}: experts with expert tensor parallelism > 1 are not handled")
        found.append((name, module, isinstance(module, row), is_expert))
    return found


def apply_lora(model_chunks: Sequence[torch.nn.Module], lora_cfg: Any) -> list[torch.nn.Parameter]:
    """Wrap ``lora_cfg.target_modules`` in every (unwrapped) ``GPTModel`` chunk, freeze every base parameter and
    return the adapter parameters (the only trainable ones). ``lora_cfg``: ``config.schema.LoRAConfig`` (or any
    object with its fields); ``rank`` 0 = off (nothing changes, ``[]``). Call before ``wrap_for_training``: DDP's
    buffers must see the frozen base."""
    if lora_cfg.rank <= 0:
        return []
    # heavy: megatron-core, once the platform has patched it
    from megatron.core import parallel_state as ps

    targets = resolve_targets(lora_cfg.target_modules)
    tp_size = ps.get_tensor_model_parallel_world_size()
    if lora_cfg.rank % tp_size:
        raise ValueError(f"LoRA rank {lora_cfg.rank} is not divisible by tensor parallelism {tp_size}")
    if any(hasattr(chunk, "module") for chunk in model_chunks):
        raise ValueError("apply_lora needs the bare GPTModel chunks (before wrap_for_training / DDP)")
    found = [(chunk, t) for chunk in model_chunks for t in _targets_of(chunk, targets)]
    for chunk, (name, module, is_row, is_expert) in found:
        wrapped = _make_lora_linear(module, is_row, is_expert, lora_cfg)
        wrapped.adapter._swiglu = name.endswith("linear_fc1") and bool(module.config.gated_linear_unit)
        parent_name, _, leaf = name.rpartition(".")
        setattr(chunk.get_submodule(parent_name) if parent_name else chunk, leaf, wrapped)
    for chunk in model_chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
    params = [p for _, p in adapter_named_parameters(model_chunks)]
    for p in params:
        p.requires_grad_(True)
    return params


def _as_list(model: Any) -> list[torch.nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def lora_modules(model: Any) -> Iterator[LoRALinear]:
    """Every ``LoRALinear`` in a model or a list of chunks (wrapped or not)."""
    for chunk in _as_list(model):
        for module in chunk.modules():
            if isinstance(module, LoRALinear):
                yield module


def lora_modules_present(model: Any) -> bool:
    """Whether ``model`` (a module or a list of chunks) holds any LoRA adapter."""
    return next(lora_modules(model), None) is not None


def adapter_named_parameters(model: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every adapter weight, names as ``named_parameters`` gives them (chunk by chunk)."""
    return [(n, p) for chunk in _as_list(model) for n, p in chunk.named_parameters() if is_adapter_param(n)]


def is_adapter_param(name: str) -> bool:
    """Whether a ``named_parameters``/state-dict name is an adapter weight (``...adapter.linear_in.weight``)."""
    return ".adapter." in f".{name}"


def base_param_name(name: str) -> str:
    """A wrapped model's parameter name → the base model's (``...linear_qkv.to_wrap.weight`` → ``...weight``)."""
    return name.replace(".to_wrap.", ".")


@torch.no_grad()
def merge_adapters(model: Any) -> int:
    """Add ``alpha/dim * B @ A`` into every wrapped base weight (a merged export, or a vLLM without LoRA); the
    adapters then stay out of the forward until ``unmerge_adapters``. Collective over TP. Returns the count."""
    count = 0
    for m in lora_modules(model):
        if not m._merged:
            m.to_wrap.weight.add_(m.adapter.delta_weight().to(m.to_wrap.weight.dtype))
            m._merged = True
            count += 1
    return count


@torch.no_grad()
def unmerge_adapters(model: Any) -> int:
    """Subtract what ``merge_adapters`` added (the base weights back up to floating-point rounding)."""
    count = 0
    for m in lora_modules(model):
        if m._merged:
            m.to_wrap.weight.sub_(m.adapter.delta_weight().to(m.to_wrap.weight.dtype))
            m._merged = False
            count += 1
    return count


@contextlib.contextmanager
def adapters_enabled(model: Any, enabled: bool) -> Iterator[None]:
    """Run ``model`` with its adapters on or off (off: the base model, e.g. the KL reference without a second
    model), restoring each adapter's previous state on exit. Not on merged weights (they hold the adapters)."""
    modules = list(lora_modules(model))
    if not enabled and any(m._merged for m in modules):
        raise RuntimeError("adapters_enabled(False) on merged adapters: unmerge_adapters first")
    previous = [m._adapter_enabled for m in modules]
    for m in modules:
        m._adapter_enabled = enabled
    try:
        yield
    finally:
        for m, state in zip(modules, previous):
            m._adapter_enabled = state
