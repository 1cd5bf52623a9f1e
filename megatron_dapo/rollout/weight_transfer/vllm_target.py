"""The colocated engine as a weight transports' target (``transport.WeightTarget``): ``RolloutEngine``'s methods that
take the actor's weights (the direct transport writes into ``local_model``; the reload transport calls
``load_weights``), beside the transports that use them. The engine sets ``llm``, ``platform``, ``tied_embeddings``,
``lora_request`` and ``weight_updates``, and provides ``_check_awake``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class VllmWeightTarget:
    """``RolloutEngine``'s weight-target methods (module docstring)."""

    llm: Any
    platform: Any
    tied_embeddings: bool
    lora_request: Any
    weight_updates: int
    _check_awake: Callable[..., None]  # RolloutEngine's: raise unless built and awake (for weights at least)

    def local_model(self) -> Any:
        """This rank's vLLM model (in this process with vLLM's ``external_launcher``): what a direct weight transport
        writes into (``rollout/vllm_direct.py``)."""
        if self.llm is None:
            raise RuntimeError("RolloutEngine.local_model: the engine has been shut down")
        return self.llm.apply_model(lambda model: model)[0]

    def ensure_writable(self, what: str) -> None:
        """Raise unless the engine's weights may be written now (built, and awake at least for weights)."""
        self._check_awake(what, weights_only=True)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Push full HF-named tensors into this rank's engine (vLLM shards them for its TP rank).

        ``model.load_weights`` cannot be used directly on CPU (weights are repacked into oneDNN handles and it fails
        half-way); ``reload_weights`` goes through vLLM's layer-wise reload, which rebuilds those handles. vLLM then
        drops every LoRA adapter (``reset_lora_state``): until the next ``load_lora_adapter`` requests run the base.
        """
        self._check_awake("load_weights", weights_only=True)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.lora_request = None  # vLLM removed it; a request naming it would make vLLM look for it on disk

    def after_weight_update(self) -> None:
        """Call once after the last ``load_weights`` of an update. The platform rebuilds what its kernels derived from
        the previous weights and the in-place reload leaves stale (``Platform.after_vllm_weight_reload``: on CPU the
        packed tied ``lm_head`` and fused-MoE experts; nothing on CUDA/NPU); then the prefix cache, whose prompt KV
        blocks were computed with the previous weights, is reset (every platform)."""
        self.platform.after_vllm_weight_reload(self.llm, self.tied_embeddings)
        self.llm.reset_prefix_cache()
        self.weight_updates += 1
