"""The colocated engine's side of LoRA (docs/lora.md "Weight sync to vLLM"): vLLM's LoRA settings and the
adapter loaded in memory into this rank's vLLM worker. ``RolloutEngine`` (``rollout/engine.py``) mixes in
``VllmLoRAMixin``; ``rollout/weight_transfer/lora_transport.py`` calls ``load_lora_adapter``.

vLLM 0.32 has no public API to register an adapter from tensors: ``_add_lora_in_worker`` does what its
``WorkerLoRAManager._load_adapter`` does for an adapter directory (``LoRAModel`` + ``PEFTHelper``), minus the disk,
and registers the result with the worker's LoRA model manager (``WorkerLoRAManager._adapter_manager``). A vLLM
upgrade must re-check it.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Any, Optional

import torch


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts (its ``MaxLoRARanks``: 1, 8, 16, ...) that holds ``rank``; vLLM
    zero-pads a smaller adapter to it."""
    from vllm.config.lora import MaxLoRARanks  # heavy: vLLM

    fits = [r for r in sorted(typing.get_args(MaxLoRARanks)) if r >= rank]
    if not fits:
        raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank {max(typing.get_args(MaxLoRARanks))}")
    return fits[0]


class VllmLoRAMixin:
    """``RolloutEngine``'s LoRA methods; the engine sets ``llm``, ``lora_request`` (None: no adapter) and
    ``_lora_ids`` and provides ``_check_awake``."""

    llm: Any
    lora_request: Any
    _lora_ids: int

    def _check_awake(self, what: str, weights_only: bool = False) -> None:  # RolloutEngine's
        raise NotImplementedError

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine runs vLLM's LoRA layers (``actor.lora.rank > 0`` with ``trainer.mode=sync``)."""
        return self.llm is not None and self.llm.llm_engine.vllm_config.lora_config is not None

    def load_lora_adapter(self, tensors: Sequence[tuple[str, torch.Tensor]], peft_config: dict) -> Any:
        """Register a LoRA adapter given as peft-named tensors (``base_model.model.model.layers.0.self_attn.q_proj.
        lora_A.weight``, full TP=1 tensors: vLLM slices its TP shard) with peft's ``adapter_config.json`` contents,
        in memory, under a new ``lora_int_id``; the previous adapter is removed and every later request uses this
        one. Not collective (each rank's engine member loads its own copy). Returns the ``LoRARequest``."""
        # heavy: vLLM, only with a colocated engine
        from vllm.lora.request import LoRARequest

        self._check_awake("load_lora_adapter", weights_only=True)
        if not self.lora_enabled:
            raise RuntimeError("RolloutEngine.load_lora_adapter: the engine was built without LoRA (actor.lora.rank 0)")
        self._lora_ids += 1
        previous = self.lora_request.lora_int_id if self.lora_request is not None else None
        self.lora_request = None  # until the new adapter is in place
        self.llm.collective_rpc(_add_lora_in_worker, args=(self._lora_ids, list(tensors), peft_config, previous))
        name = f"actor_lora_{self._lora_ids}"
        self.lora_request = LoRARequest(name, self._lora_ids, lora_path=f"in-memory/{name}")
        self.llm.reset_prefix_cache()  # cached prompt blocks were computed with the previous adapter
        return self.lora_request

    def remove_lora_adapter(self) -> None:
        """Drop the active adapter (if any): later requests run the model as it is. Not collective."""
        if self.lora_request is not None:
            self.llm.llm_engine.remove_lora(self.lora_request.lora_int_id)
            self.lora_request = None
            self.llm.reset_prefix_cache()

    def loaded_lora_ids(self) -> set[int]:
        """The adapter ids this rank's engine member holds (the active one only, after ``load_lora_adapter``)."""
        return set(self.llm.llm_engine.list_loras()) if self.lora_enabled else set()


def _add_lora_in_worker(
    worker: Any, lora_id: int, tensors: list[tuple[str, torch.Tensor]], peft_config: dict, previous: Optional[int]
) -> None:
    """Inside this rank's vLLM worker: build a ``LoRAModel`` from peft-named tensors (what ``WorkerLoRAManager.
    _load_adapter`` builds from an adapter directory, minus the disk) and register it with the worker's LoRA manager,
    removing ``previous``; a request with ``lora_id`` then finds it loaded and activates it."""
    # heavy: vLLM, only inside the engine's worker
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager  # vLLM's LRUCacheWorkerLoRAManager
    helper = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    adapters = manager._adapter_manager  # its LoRAModelManager: registered adapters, slots, the LoRA layers
    expected = {m for m in adapters.supported_lora_modules for m in adapters.packed_modules_mapping.get(m, [m])}
    unknown = sorted({n for n, _ in tensors if n.rsplit(".", 3)[-3] not in expected})
    if unknown:
        raise ValueError(f"LoRA tensors for modules vLLM has no LoRA layer for: {unknown[:3]} (expected {expected})")
    mapper = getattr(adapters.model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        lora_id,
        # copies: vLLM scales lora_B in place (``LoRALayerWeights.optimize``), and a tensor may be an actor parameter
        {n: t.detach().to(device="cpu", dtype=manager.lora_config.lora_dtype, copy=True) for n, t in tensors},
        helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
    )
    if previous is not None:
        manager.remove_adapter(previous)
    adapters.add_adapter(lora)
