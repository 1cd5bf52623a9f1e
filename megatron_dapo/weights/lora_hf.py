"""LoRA adapters, Megatron ⇄ HF peft: names, the fused-layer split and ``adapter_config.json`` (docs/lora.md).

Pure functions (no process groups): the input is the *full* (TP-merged) Megatron adapter tensor, the output peft's.
A Megatron adapter on a fused layer is one A and one B over the fused output (``ΔW = s·B·A``); in peft terms it is
exactly the per-projection adapters that **share A**:

  * ``linear_qkv``: ``q/k/v_proj.lora_A = A`` (a copy each), ``lora_B`` = B's rows split as the fused weight is
    (``weights/layout.split_qkv``: per query group ``[q heads, k, v]``);
  * ``linear_fc1``: ``gate/up_proj.lora_A = A``, ``lora_B`` = the two halves of B (``[gate; up]``);
  * ``linear_proj`` / ``linear_fc2``: ``o_proj`` / ``down_proj``, A and B as they are;
  * a hybrid's Gated DeltaNet ``in_proj``: Qwen3.5's ``in_proj_qkv/z/b/a`` (Qwen3-Next's ``in_proj_qkvz/ba``) share A,
    B split as the fused weight is; ``out_proj`` as it is.

Routed experts (``mlp.experts.local_experts.E.linear_fc{1,2}``) map to ``mlp.experts.E.{gate,up,down}_proj`` and
shared experts to ``mlp.shared_expert.*`` exactly as the base weights (``models/families.param_mappings``).

The converse (``peft_to_mcore_adapters``) is exact only when the fused projections' A's are equal (it raises
otherwise: such an adapter needs rank 3r / 2r, A stacked and B block-diagonal).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from megatron_dapo.models.families import ModelArch, ParamMapping, param_mappings
from megatron_dapo.models.lora import LORA_TARGETS, resolve_targets
from megatron_dapo.weights.layout import hf_to_mcore, mcore_to_hf

PEFT_PREFIX = "base_model.model."  # peft's LoraModel → the HF model's own names
_A, _B = "adapter.linear_in.weight", "adapter.linear_out.weight"
_PEFT_A, _PEFT_B = "lora_A.weight", "lora_B.weight"

def peft_target_modules(arch: ModelArch, target_modules: Sequence[str]) -> list[str]:
    """The HF module names peft's ``target_modules`` lists for our ``actor.lora.target_modules`` (``all-linear`` =
    every Megatron target the model has), read from the model's weight map: the HF projections each target's base
    weight is made from, in target order (a target the model does not have, e.g. ``in_proj`` of a model without Gated
    DeltaNet layers, adds nothing)."""
    names: list[str] = []
    for target in resolve_targets(target_modules):
        for module, mapping in _base_mappings(arch).items():
            if module.rsplit(".", 1)[-1] != target:
                continue
            for hf in mapping.hf:
                leaf = hf[: -len(".weight")].rsplit(".", 1)[-1]
                if leaf not in names:
                    names.append(leaf)
    return names


def peft_adapter_config(arch: ModelArch, lora_cfg: Any, base_model_name_or_path: str = "") -> dict:
    """The contents of peft's ``adapter_config.json`` for ``lora_cfg`` (``config.schema.LoRAConfig``), accepted by
    ``peft.PeftModel.from_pretrained`` and vLLM's ``PEFTHelper``. Scaling ``lora_alpha / r`` as ours."""
    if int(lora_cfg.rank) <= 0:
        raise ValueError(f"peft_adapter_config: LoRA rank {lora_cfg.rank} is off (expected > 0)")
    alpha = float(lora_cfg.alpha)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path or None,
        "r": int(lora_cfg.rank),
        "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
        "lora_dropout": float(lora_cfg.dropout),
        "target_modules": peft_target_modules(arch, lora_cfg.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
        "revision": None,
    }


def _base_mappings(arch: ModelArch) -> dict[str, ParamMapping]:
    """Megatron module name (``...linear_qkv``) → the base weight's mapping (its HF weight names and layout)."""
    return {m.mcore[: -len(".weight")]: m for m in param_mappings(arch) if m.mcore.endswith(".weight")}


def _split_name(name: str) -> tuple[str, str]:
    """``...linear_qkv.adapter.linear_in.weight`` → (``...linear_qkv``, ``A``/``B``); raises on anything else."""
    for suffix, which in ((_A, "A"), (_B, "B")):
        if name.endswith("." + suffix):
            return name[: -len(suffix) - 1], which
    raise KeyError(f"LoRA tensor {name!r}: expected a name ending in .{_A} or .{_B}")


def _hf_module(hf_weight: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` → peft's module ``base_model.model.model.layers.3...q_proj``."""
    return PEFT_PREFIX + hf_weight[: -len(".weight")]


def mcore_adapters_to_peft(
    arch: ModelArch, adapters: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(global Megatron adapter name, full TP-merged tensor) → peft's (name, tensor): A copied to every projection
    of a fused layer, B split as the fused base weight (module docstring). Raises ``KeyError`` naming the tensor
    for a name with no base mapping, ``ValueError`` for a shape that does not fit the base weight."""
    modules = _base_mappings(arch)
    for name, tensor in adapters:
        module, which = _split_name(name)
        mapping = modules.get(module)
        if mapping is None or module.rsplit(".", 1)[-1] not in LORA_TARGETS:
            raise KeyError(f"LoRA tensor {name!r}: no HF mapping for module {module!r} ({arch.family.name})")
        if tensor.dim() != 2:
            raise ValueError(f"LoRA tensor {name!r}: expected 2 dimensions, got shape {tuple(tensor.shape)}")
        if which == "A":
            for hf in mapping.hf:
                yield f"{_hf_module(hf)}.{_PEFT_A}", tensor
            continue
        parts = mcore_to_hf(mapping, tensor, arch) if len(mapping.hf) > 1 else [tensor]
        if sum(p.shape[0] for p in parts) != tensor.shape[0]:
            raise ValueError(f"LoRA tensor {name!r}: B shape {tuple(tensor.shape)} does not split like {mapping.hf}")
        for hf, part in zip(mapping.hf, parts):
            yield f"{_hf_module(hf)}.{_PEFT_B}", part


def peft_to_mcore_adapters(arch: ModelArch, peft: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The converse of ``mcore_adapters_to_peft`` for the modules present in ``peft`` (peft names, ``lora_A.weight``
    / ``lora_B.weight``; ``.default`` infixes are accepted): the fused layers' B's fused, their shared A checked
    equal. Raises ``ValueError`` when the projections of one fused layer have different A's (or some are missing)."""
    state = {
        k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v for k, v in peft.items()
    }
    used: set[str] = set()
    for module, mapping in _base_mappings(arch).items():
        if module.rsplit(".", 1)[-1] not in LORA_TARGETS:
            continue
        keys_a = [f"{_hf_module(hf)}.{_PEFT_A}" for hf in mapping.hf]
        keys_b = [f"{_hf_module(hf)}.{_PEFT_B}" for hf in mapping.hf]
        present = [k in state for k in keys_a + keys_b]
        if not any(present):
            continue
        if not all(present):
            missing = [k for k, p in zip(keys_a + keys_b, present) if not p]
            raise ValueError(f"peft adapter for {module}: missing {missing} (fused layers need every projection)")
        a_list = [state[k] for k in keys_a]
        if any(not torch.equal(a, a_list[0]) for a in a_list[1:]):
            raise ValueError(
                f"peft adapter for {module}: the lora_A of {list(mapping.hf)} differ; Megatron's fused adapter shares "
                "one A (converting would need rank × projections with a block-diagonal B)"
            )
        used.update(keys_a + keys_b)
        yield f"{module}.{_A}", a_list[0]
        yield f"{module}.{_B}", hf_to_mcore(mapping, [state[k] for k in keys_b], arch, 0)
    unused = sorted(set(state) - used)
    if unused:
        raise KeyError(f"peft adapter tensors with no Megatron mapping: {unused[:5]} ({len(unused)} in all)")
