"""``megatron-dapo check CONFIG [overrides]``: everything a launch would trip over, found in one plain process.

Run it before ``torchrun``. It needs no process group, builds no model and reads no tensor:

* the config (``megatron_dapo/config.py``: ``from_dict`` + ``validate_config``: required keys, ranges, cross-field);
* model-dependent checks from the HF ``config.json`` (``model.hf_config_dir``, else ``<checkpoint.load_dir>/hf_config``
  as ``DAPOTrainer.__init__`` in ``megatron_dapo/training/trainer.py`` does): the family is supported, the actor
  layout fits the world size and the model (``validate_parallel_layout``; FFN ÷ TP as the converter's
  ``_check_layout``), the rollout layout (``validate_rollout_layout`` in ``megatron_dapo/rollout/engine.py``, plus
  the heads / KV heads / FFN divisibility vLLM needs), the sequence budget against ``max_position_embeddings`` and
  ``rollout.max_num_batched_tokens``, mini-batches against the data-parallel size;
* every data file (``read_records`` + ``validate_row`` on every row; the chat template and tokenizer on the first
  ``sample_rows`` rows, reporting prompts over ``data.max_prompt_length`` under ``truncation=error``);
* the reward functions: imported, and called once per data source found, on that source's first row, with its
  ground truth as the response;
* the checkpoint at ``checkpoint.load_dir``: a Megatron checkpoint or HF directory whose architecture matches the
  HF config (``find_checkpoint``: what it is, its HF config, the manifest's sizes and the tensor index; no tensor data);
* a plan: sizes, batch arithmetic and a per-rank memory estimate by phase (formulas in ``docs/check.md`` and in the
  output itself).

All problems are collected and reported together; the exit status is 1 when there is any, 0 (and ``OK``) otherwise.
Memory estimates over ``--device-memory-gb`` are warnings (marked ``OVER`` in the plan), not problems: they are
rough and do not fail the check.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from megatron_dapo.config import (
    ConfigError,
    ExperimentConfig,
    apply_override,
    from_dict,
    validate_config,
    validate_parallel_layout,
)

GIB = 2**30
MIB = 2**20
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MAX_ROWS_LISTED = 5  # bad rows listed per file and kind of problem; the rest are counted
DEFAULT_SAMPLE_ROWS = 1000


@dataclass
class CheckReport:
    """What ``run_check`` found: ``problems`` (each names the key/file/row and the fix), ``warnings`` and the plan."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    plan: str = ""
    # The plan's numbers by name (world_size, dp, rollout_dp, params, actor_params_per_rank, micro_batches, ...,
    # memory_<phase>_bytes); empty where the plan could not be computed.
    numbers: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def render(self) -> str:
        parts = [self.plan.rstrip()] if self.plan else []
        if self.warnings:
            parts.append(f"warnings ({len(self.warnings)}):\n" + "\n".join(f"  - {w}" for w in self.warnings))
        if self.problems:
            parts.append(f"problems ({len(self.problems)}):\n" + "\n".join(f"  - {p}" for p in self.problems))
            parts.append(f"FAILED: {len(self.problems)} problem(s)")
        else:
            parts.append("OK")
        return "\n\n".join(parts) + "\n"


# --------------------------------------------------------------------------------------------- parameter counts


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of an HF ``ModelArch`` (``megatron_dapo/models/families.py``), unpadded vocabulary."""

    embedding: int  # V x h
    output_layer: int  # V x h, 0 when tied to the embedding
    layer_split: int  # per decoder layer, the tensors split across TP (qkv weight+bias, o, fc1, fc2)
    layer_replicated: int  # per decoder layer, the norms (input, pre-MLP, q/k layernorm)
    final_norm: int
    num_layers: int

    @property
    def layer(self) -> int:
        return self.layer_split + self.layer_replicated

    @property
    def total(self) -> int:
        return self.embedding + self.output_layer + self.num_layers * self.layer + self.final_norm


def param_counts(arch: Any) -> ParamCounts:
    """Count the parameters of ``arch`` (embedding, attention, MLP, norms; tied embeddings counted once)."""
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    qkv = h * (q + 2 * kv) + ((q + 2 * kv) if arch.qkv_bias else 0)
    attn_out = q * h
    mlp = 3 * h * f  # gate, up, down
    norms = 2 * h + (2 * d if arch.qk_layernorm else 0)
    vh = arch.vocab_size * h
    return ParamCounts(
        embedding=vh,
        output_layer=0 if arch.tie_word_embeddings else vh,
        layer_split=qkv + attn_out + mlp,
        layer_replicated=norms,
        final_norm=h,
        num_layers=arch.num_layers,
    )


def actor_params_per_rank(arch: Any, counts: ParamCounts, tp: int, pp: int, padded_vocab: int) -> int:
    """Parameters one actor rank holds on its largest pipeline stage (Megatron's padded vocabulary, TP shards).

    Stage 0 holds the embedding, the last stage the final norm and the output layer (a copy of the embedding when
    tied and PP > 1, as megatron-core's ``GPTModel`` holds it).
    """
    layers = arch.num_layers // pp
    body = layers * (counts.layer_split // tp + counts.layer_replicated)
    vocab_shard = padded_vocab * arch.hidden_size // tp
    stages = []
    for stage in range(pp):
        n = body
        if stage == 0:
            n += vocab_shard
        if stage == pp - 1:
            n += counts.final_norm
            if not arch.tie_word_embeddings or pp > 1:
                n += vocab_shard
        stages.append(n)
    return max(stages)


def rollout_params_per_rank(counts: ParamCounts, rollout_tp: int) -> int:
    """Parameters of one vLLM rank: the full model's TP-split tensors / rollout TP, norms replicated."""
    split = counts.embedding + counts.output_layer + counts.num_layers * counts.layer_split
    return split // rollout_tp + counts.num_layers * counts.layer_replicated + counts.final_norm


# --------------------------------------------------------------------------------------------- the check


def _sizes_usable(cfg: ExperimentConfig) -> bool:
    """The sizes the layout, batch and memory arithmetic divide by are in range (else those checks are skipped;
    ``validate_config`` has reported the bad values)."""
    p, a, r, d = cfg.parallel, cfg.actor, cfg.rollout, cfg.data
    positive = [
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        r.tensor_model_parallel_size,
        r.n,
        d.max_prompt_length,
        d.max_response_length,
        d.train_batch_size,
        a.ppo_mini_batch_size,
        a.ppo_micro_batch_size_per_gpu,
        a.log_prob_micro_batch_size_per_gpu,
        a.ppo_max_token_len_per_gpu,
        a.ppo_epochs,
        r.kv_cache_memory_mb,
    ]
    optional = [p.virtual_pipeline_model_parallel_size, d.gen_batch_size]
    return (
        all(v >= 1 for v in positive)
        and all(v is None or v >= 1 for v in optional)
        and 0 < r.gpu_memory_utilization <= 1
        and d.train_batch_size % a.ppo_mini_batch_size == 0
    )


class _Checker:
    def __init__(
        self,
        config_path: Optional[str],
        overrides: Sequence[str],
        nnodes: int,
        nproc_per_node: Optional[int],
        device_memory_gb: Optional[float],
        sample_rows: int,
    ) -> None:
        self.config_path = config_path
        self.overrides = list(overrides)
        self.nnodes = nnodes
        self.nproc_per_node = nproc_per_node
        self.device_memory_gb = device_memory_gb
        self.sample_rows = sample_rows
        self.problems: list[str] = []
        self.warnings: list[str] = []
        self.plan: list[str] = []
        self.cfg: Optional[ExperimentConfig] = None
        self.arch: Any = None
        self.hf_dir: Optional[str] = None
        self.hf_key = "model.hf_config_dir"
        self.range_ok = False
        self.layout_ok = False
        self.rollout_ok = False
        self.dp = 0
        self.rollout_dp = 0
        self.world_size = 0
        self.tokenizer: Any = None
        self.tokenizer_tried = False
        self.data_sources: dict[str, tuple[str, dict]] = {}  # data_source -> (where, row), first row seen
        self.train_rows = 0
        self.numbers: dict[str, float] = {}

    # ----------------------------------------------------------------------------------------- config

    def load(self) -> bool:
        raw: dict = {}
        if self.config_path is not None:
            path = Path(self.config_path)
            if not path.is_file():
                self.problems.append(f"config file {path} does not exist; pass the path of an experiment YAML")
                return False
            try:
                loaded = yaml.safe_load(path.read_text())
            except yaml.YAMLError as exc:
                self.problems.append(f"config file {path}: not valid YAML: {exc}")
                return False
            if loaded is not None and not isinstance(loaded, dict):
                self.problems.append(
                    f"config file {path}: expected a mapping at the top level, got {type(loaded).__name__}"
                )
                return False
            raw = loaded or {}
        for item in self.overrides:
            try:
                apply_override(raw, item)
            except ConfigError as exc:
                self.problems.extend(exc.problems)
        if self.problems:
            return False
        try:
            self.cfg = from_dict(ExperimentConfig, raw)
        except ConfigError as exc:  # unknown key or wrong type: nothing else can be checked reliably
            self.problems.extend(exc.problems)
            return False
        try:
            validate_config(self.cfg)
            self.range_ok = True
        except ConfigError as exc:
            self.problems.extend(exc.problems)
            self.range_ok = _sizes_usable(self.cfg)
        if self.nproc_per_node is None:
            self.nproc_per_node = 8 if self.cfg.parallel.platform in ("cuda", "npu") else 2
        if self.nnodes < 1 or self.nproc_per_node < 1:
            self.problems.append(f"--nnodes={self.nnodes} and --nproc-per-node={self.nproc_per_node} must both be >= 1")
            self.range_ok = False
        self.world_size = self.nnodes * self.nproc_per_node
        return True

    # ----------------------------------------------------------------------------------------- model

    def load_model(self) -> None:
        from megatron_dapo.models.families import UnsupportedModelError, model_arch_from_hf

        cfg = self.cfg
        if cfg.model.hf_config_dir:
            self.hf_dir = cfg.model.hf_config_dir
        elif cfg.checkpoint.load_dir:
            from megatron_dapo.weights.dist_format import CheckpointError, hf_config_dir_of

            self.hf_key = "checkpoint.load_dir (its HF config, since model.hf_config_dir is not set)"
            try:
                self.hf_dir = str(hf_config_dir_of(cfg.checkpoint.load_dir))
            except CheckpointError as exc:
                self.problems.append(f"checkpoint.load_dir={cfg.checkpoint.load_dir}: {exc}")
                return
        else:
            self.problems.append(
                "model.hf_config_dir is not set and checkpoint.load_dir is missing: no HF config.json to read the "
                "architecture from; set model.hf_config_dir to the HF model directory"
            )
            return
        try:
            self.arch = model_arch_from_hf(self.hf_dir)
        except FileNotFoundError as exc:
            self.problems.append(f"{self.hf_key}={self.hf_dir}: {exc}")
        except UnsupportedModelError as exc:
            self.problems.append(
                f"{self.hf_key}={self.hf_dir}: {exc}; use a model of a supported family "
                "(megatron_dapo/models/families.py)"
            )
        except (KeyError, ValueError, TypeError) as exc:  # a config.json missing a field or not JSON
            self.problems.append(
                f"{self.hf_key}={self.hf_dir}: config.json cannot be read as an HF model config: "
                f"{type(exc).__name__}: {exc}"
            )

    def check_layout(self) -> None:
        """Actor and rollout layouts against the world size and the model; every problem, not the first."""
        cfg, arch, world = self.cfg, self.arch, self.world_size
        p = cfg.parallel
        tp, pp, vpp = (
            p.tensor_model_parallel_size,
            p.pipeline_model_parallel_size,
            p.virtual_pipeline_model_parallel_size,
        )
        heads, groups, layers, ffn = (
            arch.num_attention_heads,
            arch.num_query_groups,
            arch.num_layers,
            arch.ffn_hidden_size,
        )
        found: list[str] = []
        where = f"(world size {world} = {self.nnodes} node(s) x {self.nproc_per_node} process(es) per node)"
        if world % (tp * pp):
            found.append(
                f"parallel.tensor_model_parallel_size x pipeline_model_parallel_size = {tp} x {pp} = {tp * pp} does "
                f"not divide the world size {world} {where}; change TP/PP or --nnodes/--nproc-per-node"
            )
        if heads % tp:
            found.append(
                f"parallel.tensor_model_parallel_size={tp} does not divide the model's num_attention_heads={heads}; "
                f"use a divisor of {heads}"
            )
        if groups % tp:
            found.append(
                f"parallel.tensor_model_parallel_size={tp} does not divide the model's num_key_value_heads={groups} "
                f"(query groups); use a divisor of {groups}"
            )
        if ffn % tp:
            found.append(
                f"parallel.tensor_model_parallel_size={tp} does not divide the model's intermediate_size={ffn}; "
                f"use a divisor of {ffn}"
            )
        if layers % (pp * (vpp or 1)):
            found.append(
                f"parallel.pipeline_model_parallel_size x virtual_pipeline_model_parallel_size = {pp} x {vpp or 1} "
                f"does not divide the model's num_hidden_layers={layers}; use sizes whose product divides {layers}"
            )
        if vpp is not None and pp < 2:
            found.append(
                f"parallel.virtual_pipeline_model_parallel_size={vpp} needs parallel.pipeline_model_parallel_size "
                ">= 2; set it to null or raise PP"
            )
        if p.sequence_parallel and tp == 1:
            found.append(
                "parallel.sequence_parallel=true needs parallel.tensor_model_parallel_size > 1; set it to false"
            )
        if not found:  # the trainer's own check must agree
            try:
                self.dp = validate_parallel_layout(p, world, layers, heads, groups)
            except ConfigError as exc:
                found.append(f"{exc} {where}")
        self.problems.extend(found)
        self.layout_ok = not found

        r = cfg.rollout
        rtp = r.tensor_model_parallel_size
        rfound: list[str] = []
        if world % rtp:
            rfound.append(
                f"rollout.tensor_model_parallel_size={rtp} does not divide the world size {world} {where}: each "
                f"group of {rtp} consecutive ranks forms one vLLM replica; use a divisor of {world}"
            )
        if heads % rtp:
            rfound.append(
                f"rollout.tensor_model_parallel_size={rtp} does not divide num_attention_heads={heads} (vLLM splits "
                f"the heads); use a divisor of {heads}"
            )
        if (groups % rtp) if rtp <= groups else (rtp % groups):
            rfound.append(
                f"rollout.tensor_model_parallel_size={rtp} and num_key_value_heads={groups}: vLLM needs one to divide "
                "the other (it splits the KV heads, or replicates them when TP is larger)"
            )
        if ffn % rtp:
            rfound.append(
                f"rollout.tensor_model_parallel_size={rtp} does not divide intermediate_size={ffn}; use a divisor"
            )
        budget = cfg.data.max_prompt_length + cfg.data.max_response_length
        if budget > arch.max_position_embeddings:
            rfound.append(
                f"data.max_prompt_length + data.max_response_length = {cfg.data.max_prompt_length} + "
                f"{cfg.data.max_response_length} = {budget} exceeds the model's max_position_embeddings="
                f"{arch.max_position_embeddings} ({self.hf_dir}/config.json); shorten one of them"
            )
        batched = r.max_num_batched_tokens
        if batched is not None and batched < budget:
            rfound.append(
                f"rollout.max_num_batched_tokens={batched} is below data.max_prompt_length + "
                f"data.max_response_length = {budget}: chunked prefill is off, so a whole sequence must fit in one "
                f"engine step; set it to at least {budget} (or null)"
            )
        if not rfound:
            from megatron_dapo.rollout.engine import validate_rollout_layout

            try:
                _, self.rollout_dp = validate_rollout_layout(cfg, world, arch.max_position_embeddings)
            except ConfigError as exc:
                rfound.append(str(exc))
        self.problems.extend(rfound)
        self.rollout_ok = not rfound

        if self.layout_ok:
            self._check_batches()

    def _check_batches(self) -> None:
        cfg, dp = self.cfg, self.dp
        a, n = cfg.actor, cfg.rollout.n
        mini_rows = a.ppo_mini_batch_size * n
        if mini_rows % dp:
            self.problems.append(
                f"actor.ppo_mini_batch_size x rollout.n = {a.ppo_mini_batch_size} x {n} = {mini_rows} sequences per "
                f"mini-batch is not divisible by the data-parallel size {dp} (world {self.world_size} / (TP x PP)); "
                "each DP rank takes an equal share: change the mini-batch size, rollout.n or the layout"
            )
            return
        vpp, pp = cfg.parallel.virtual_pipeline_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
        if vpp is None:
            return
        if a.use_dynamic_bsz:
            self.warnings.append(
                "parallel.virtual_pipeline_model_parallel_size with actor.use_dynamic_bsz=true: megatron-core's "
                f"interleaved schedule needs the number of micro-batches to be a multiple of PP={pp}, which "
                "dynamic batching does not guarantee"
            )
            return
        for key, mbs, rows in (
            ("actor.ppo_micro_batch_size_per_gpu", a.ppo_micro_batch_size_per_gpu, mini_rows // dp),
            (
                "actor.log_prob_micro_batch_size_per_gpu",
                a.log_prob_micro_batch_size_per_gpu,
                cfg.data.train_batch_size * n // dp,
            ),
        ):
            m = -(-rows // mbs)
            if m % pp:
                self.problems.append(
                    f"{key}={mbs}: {rows} sequences per rank give {m} micro-batches, not a multiple of "
                    f"parallel.pipeline_model_parallel_size={pp} as the interleaved (VPP) schedule needs; choose a "
                    "micro-batch size that gives a multiple"
                )

    # ----------------------------------------------------------------------------------------- checkpoint

    def check_checkpoint(self) -> None:
        cfg = self.cfg
        dirs = [("checkpoint.load_dir", cfg.checkpoint.load_dir)]
        if (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and cfg.checkpoint.ref_load_dir:
            dirs.append(("checkpoint.ref_load_dir", cfg.checkpoint.ref_load_dir))
        for key, directory in dirs:
            if not directory:
                continue  # validate_config reported it
            self._check_one_checkpoint(key, directory)
        mode = cfg.checkpoint.resume_mode
        if mode not in ("auto", "disable") and not Path(mode).is_dir():
            self.problems.append(
                f"checkpoint.resume_mode={mode!r}: no such step directory; use auto, disable or the path of a "
                "global_step_<n> directory"
            )

    def _check_one_checkpoint(self, key: str, directory: str) -> None:
        from megatron_dapo.weights.dist_format import CheckpointError, DistCheckpointReader, find_checkpoint
        from megatron_dapo.weights.integrity import read_manifest, verify_files
        from megatron_dapo.weights.mcore_checkpoint import arch_mismatches, checkpoint_arch

        tp, pp = self.cfg.parallel.tensor_model_parallel_size, self.cfg.parallel.pipeline_model_parallel_size
        fix = (
            "point it at an HF model directory or a Megatron checkpoint (make one with `megatron-dapo convert "
            f"hf-to-mcore --hf-dir <HF model> --save-dir {directory}`)"
        )
        if not Path(directory).is_dir():
            self.problems.append(f"{key}={directory}: no such directory; {fix}")
            return
        try:
            # What it is, its HF config, the manifest's file sizes and the tensor index; no tensor data is read.
            source = find_checkpoint(directory)
            stored = checkpoint_arch(source)
            if source.kind == "megatron":
                DistCheckpointReader(source.path)
                records = read_manifest(source.root)
                damaged = verify_files(source.root, records.values(), checksum=False) if records else None
                if damaged is not None:
                    raise CheckpointError(f"checkpoint {source.root} is damaged: {damaged}")
            diffs = arch_mismatches(stored, self.arch) if stored is not None and self.arch is not None else []
        except CheckpointError as exc:
            self.problems.append(f"{key}={directory}: {exc}")
            return
        except (OSError, ValueError, KeyError) as exc:
            self.problems.append(f"{key}={directory}: cannot read the checkpoint: {type(exc).__name__}: {exc}; {fix}")
            return
        if diffs:
            self.problems.append(
                f"{key}={directory}: the checkpoint's architecture differs from {self.hf_key}={self.hf_dir} "
                f"(checkpoint vs HF config): {'; '.join(diffs)}; convert the checkpoint again from that model, or "
                "point model.hf_config_dir at the model it was converted from"
            )
        self.plan.append(f"  {key}: {source.description}, loaded at TP {tp} PP {pp}")

    # ----------------------------------------------------------------------------------------- data

    def _load_tokenizer(self) -> Any:
        if self.tokenizer_tried:
            return self.tokenizer
        self.tokenizer_tried = True
        cfg = self.cfg
        source = cfg.model.tokenizer_dir or self.hf_dir
        key = "model.tokenizer_dir" if cfg.model.tokenizer_dir else self.hf_key
        if not source:
            return None
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers raises many types for a missing/broken tokenizer
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self.problems.append(
                f"{key}={source}: no tokenizer can be loaded ({type(exc).__name__}: {first}); point "
                "model.tokenizer_dir at a directory with the tokenizer files"
            )
        return self.tokenizer

    def check_data(self) -> None:
        cfg = self.cfg
        for key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
            total = 0
            for i, file in enumerate(files):
                total += self._check_file(f"{key}[{i}]", file)
            if key == "data.train_files":
                self.train_rows = total
        gen = cfg.data.gen_batch_size or cfg.data.train_batch_size
        if self.train_rows and gen > self.train_rows:
            self.problems.append(
                f"data.gen_batch_size (or data.train_batch_size)={gen} is larger than the {self.train_rows} rows of "
                "data.train_files: no generation batch can be formed; lower it or add data"
            )

    def _check_file(self, key: str, file: str) -> int:
        from megatron_dapo.data.prompts import prompt_text, truncate_prompt
        from megatron_dapo.data.rows import DataError, read_records, validate_row

        d = self.cfg.data
        try:
            records = read_records(file)
        except DataError as exc:
            self.problems.append(f"{key}: {exc}; fix the path in {key.split('[')[0]}")
            return 0
        if not records:
            self.problems.append(f"{key}: {file} has no rows")
            return 0
        bad: list[str] = []
        valid: list[tuple[int, dict]] = []
        for r, row in enumerate(records):
            try:
                validate_row(row, f"{file}: row {r}", d.prompt_key)
                valid.append((r, row))
            except DataError as exc:
                bad.append(str(exc))
        self._list_rows(bad, file, "rows not in verl format (see megatron_dapo/data/rows.py)")
        for r, row in valid:
            self.data_sources.setdefault(row["data_source"], (f"{file}: row {r}", row))
        sample = valid[: self.sample_rows] if self.sample_rows > 0 else valid
        tokenizer = self._load_tokenizer() if sample else None
        if tokenizer is None:
            self.plan.append(f"  {key}: {file}: {len(records)} rows, {len(bad)} invalid (prompts not tokenized)")
            return len(valid)
        overlong: list[str] = []
        templ: list[str] = []
        lengths: list[int] = []
        for r, row in sample:
            where = f"{file}: row {r}"
            try:
                text = prompt_text(row[d.prompt_key], tokenizer, d.apply_chat_template, where)
            except DataError as exc:
                templ.append(str(exc))
                continue
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            lengths.append(len(ids))
            if not ids:
                templ.append(f"{where}: the prompt tokenizes to no tokens; drop the row")
            elif len(ids) > d.max_prompt_length and not d.filter_overlong_prompts:
                try:
                    truncate_prompt(ids, d.max_prompt_length, d.truncation, where)
                except DataError as exc:
                    overlong.append(str(exc))
        self._list_rows(templ, file, "prompts the chat template/tokenizer rejects")
        self._list_rows(overlong, file, f"prompts longer than data.max_prompt_length={d.max_prompt_length}")
        n_over = sum(n > d.max_prompt_length for n in lengths)
        if d.filter_overlong_prompts and lengths and n_over == len(lengths):
            self.problems.append(
                f"{key}: all {len(lengths)} sampled prompts of {file} are longer than data.max_prompt_length="
                f"{d.max_prompt_length} and would be filtered out (data.filter_overlong_prompts=true); raise it"
            )
        longest = max(lengths) if lengths else 0
        fate = "" if not n_over else (" (filtered out)" if d.filter_overlong_prompts else f" ({d.truncation})")
        self.plan.append(
            f"  {key}: {file}: {len(records)} rows, {len(bad)} invalid; first {len(sample)} tokenized: longest "
            f"prompt {longest} tokens, {n_over} over data.max_prompt_length={d.max_prompt_length}{fate}"
        )
        return len(valid)

    def _list_rows(self, messages: list[str], file: str, what: str) -> None:
        self.problems.extend(messages[:MAX_ROWS_LISTED])
        if len(messages) > MAX_ROWS_LISTED:
            self.problems.append(
                f"{file}: {len(messages) - MAX_ROWS_LISTED} more {what} (first {MAX_ROWS_LISTED} above)"
            )

    # ----------------------------------------------------------------------------------------- rewards

    def check_rewards(self) -> None:
        from megatron_dapo.reward import custom
        from megatron_dapo.reward.manager import MATH_DAPO_SOURCES, route_data_source

        rw = self.cfg.reward
        specs: list[tuple[str, str, str]] = []  # (config key, path, name)
        if rw.custom_function.path:
            specs.append(("reward.custom_function", rw.custom_function.path, rw.custom_function.name))
        for i, item in enumerate(rw.extra_functions):
            key = f"reward.extra_functions[{i}]"
            if not isinstance(item, dict) or set(item) - {"path", "name", "weight"} or not item.get("path"):
                self.problems.append(f"{key}={item!r}: expected a mapping with keys path (required), name, weight")
                continue
            specs.append((key, str(item["path"]), str(item.get("name", "compute_score"))))
        functions: list[tuple[str, Any]] = []
        for key, path, name in specs:
            try:
                functions.append((key, custom.load_reward_function(path, name)))
            except (FileNotFoundError, ImportError, AttributeError, TypeError) as exc:
                self.problems.append(f"{key} (path={path}, name={name}): {exc}")
        loaded_all = len(functions) == len(specs)
        for source, (where, row) in sorted(self.data_sources.items()):
            truth = row["reward_model"]["ground_truth"]
            response = str(truth[0] if isinstance(truth, (list, tuple)) and truth else truth)
            extra = row.get("extra_info")
            if route_data_source(source) == "math_dapo":
                from megatron_dapo.reward import math_dapo

                calls = [("the built-in scorer", custom.MATH_DAPO_LABEL, _bind_math(math_dapo, response, truth))]
            elif not specs:
                self.problems.append(
                    f"{where}: no reward function for data_source {source!r}: the built-in scorer handles "
                    f"{', '.join(MATH_DAPO_SOURCES)} and aime*; set reward.custom_function.path (and .name) to a "
                    "Python file defining compute_score(data_source, solution_str, ground_truth, extra_info)"
                )
                continue
            else:
                if not loaded_all:
                    continue  # its import problem is listed already
                calls = [
                    (key, custom.function_label(fn), self._bind(fn, source, response, truth, extra))
                    for key, fn in functions
                ]
            for key, label, call in calls:
                self._call_reward(key, label, call, source, where, response)

    @staticmethod
    def _bind(fn: Any, source: str, response: str, truth: Any, extra: Any) -> Any:
        return lambda: fn(data_source=source, solution_str=response, ground_truth=truth, extra_info=extra)

    def _call_reward(self, key: str, label: str, call: Any, source: str, where: str, response: str) -> None:
        from megatron_dapo.reward import custom

        timeout = self.cfg.reward.timeout_s
        context = (
            f"reward function {label} ({key}) on data_source {source!r} ({where}, response "
            f"{custom.short_repr(response)} = the row's ground truth)"
        )
        try:
            result = custom.call_with_timeout(call, timeout)
            custom.finite_score(result, label)
        except custom.ScorerTimeout:
            self.problems.append(f"{context}: ran past reward.timeout_s={timeout:g} s; speed it up or raise the limit")
        except custom.InvalidRewardError as exc:
            self.problems.append(f"{context}: {exc}")
        except Exception as exc:  # noqa: BLE001 - the user's function may raise anything
            self.problems.append(
                f"{context}: raised {type(exc).__name__}: {exc}; fix the function (the trainer would score every "
                f"such response reward.error_score={self.cfg.reward.error_score:g})"
            )

    # ----------------------------------------------------------------------------------------- plan

    def make_plan(self) -> list[str]:
        cfg = self.cfg
        p, a, r, d = cfg.parallel, cfg.actor, cfg.rollout, cfg.data
        tp, pp, vpp = (
            p.tensor_model_parallel_size,
            p.pipeline_model_parallel_size,
            p.virtual_pipeline_model_parallel_size,
        )
        dp, rtp, rdp = self.dp, r.tensor_model_parallel_size, self.rollout_dp
        n, seq = r.n, d.max_prompt_length + d.max_response_length
        out = [
            f"  world size {self.world_size} = {self.nnodes} node(s) x {self.nproc_per_node} process(es) per node",
            f"  actor: TP {tp} x PP {pp} (VPP {vpp or '-'}) x DP {dp}; sequence parallel "
            f"{'on' if p.sequence_parallel else 'off'}; distributed optimizer "
            f"{'on' if p.use_distributed_optimizer else 'off'}",
            f"  rollout: TP {rtp} x DP {rdp} ({rdp} vLLM replica(s) of {rtp} rank(s))",
        ]
        gen = d.gen_batch_size or d.train_batch_size
        traj = d.train_batch_size * n
        mini_rows = a.ppo_mini_batch_size * n
        per_rank = mini_rows // dp
        minis = d.train_batch_size // a.ppo_mini_batch_size
        step_rows = traj // dp
        if a.use_dynamic_bsz:
            rows_per_mb = max(1, a.ppo_max_token_len_per_gpu // seq)
            micro = -(-per_rank // rows_per_mb)
            lp_micro = -(-step_rows // rows_per_mb)
            each = f"at most {{}} (dynamic: <= {a.ppo_max_token_len_per_gpu} tokens each; fewer for shorter sequences)"
            mbs, lp_mbs = each.format(micro), each.format(lp_micro)
        else:
            micro = -(-per_rank // a.ppo_micro_batch_size_per_gpu)
            lp_micro = -(-step_rows // a.log_prob_micro_batch_size_per_gpu)
            mbs = f"{micro} (of {a.ppo_micro_batch_size_per_gpu} sequences)"
            lp_mbs = f"{lp_micro} (of {a.log_prob_micro_batch_size_per_gpu} sequences)"
        self.numbers.update(
            world_size=self.world_size,
            tp=tp,
            pp=pp,
            dp=dp,
            rollout_tp=rtp,
            rollout_dp=rdp,
            trajectories_per_step=traj,
            max_tokens_per_step=traj * seq,
            mini_batches_per_step=minis,
            optimizer_steps_per_step=minis * a.ppo_epochs,
            sequences_per_mini_batch_per_rank=per_rank,
            micro_batches_per_mini_batch=micro,
            log_prob_micro_batches_per_step=lp_micro,
        )
        fg = cfg.algorithm.filter_groups
        gens = (
            f"1 to {fg.max_num_gen_batches or 'one pass over the data of'} generation batches (dynamic sampling)"
            if fg.enable
            else "1 generation batch"
        )
        out += [
            f"  per step: {gens} of {gen} prompts x {n} = {gen * n} sequences, {-(-gen * n // rdp)} per replica "
            f"(rollout.max_num_seqs={r.max_num_seqs})",
            f"  per step: {traj} trajectories ({d.train_batch_size} prompts x {n}), at most {traj * seq} tokens "
            f"({seq} per sequence = {d.max_prompt_length} prompt + {d.max_response_length} response)",
            f"  per step: {minis} mini-batch(es) of {mini_rows} sequences x {a.ppo_epochs} epoch(s) = "
            f"{minis * a.ppo_epochs} optimizer step(s)",
            f"  per mini-batch per rank: {per_rank} sequences in {mbs} micro-batches",
            f"  log-probs per step per rank (old policy{' and reference' if self._kl() else ''}): {step_rows} "
            f"sequences in {lp_mbs} micro-batches",
        ]
        return out

    def _kl(self) -> bool:
        return self.cfg.actor.use_kl_loss or self.cfg.algorithm.use_kl_in_reward

    def memory_plan(self) -> list[str]:
        from megatron_dapo.rollout.engine import rollout_dtype
        from megatron_dapo.weights.layout import padded_vocab_size

        cfg, arch = self.cfg, self.arch
        p, a, r, d = cfg.parallel, cfg.actor, cfg.rollout, cfg.data
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        counts = param_counts(arch)
        vp = padded_vocab_size(arch.vocab_size, cfg.model.make_vocab_size_divisible_by, tp)
        p_rank = actor_params_per_rank(arch, counts, tp, pp, vp)
        rtp = r.tensor_model_parallel_size
        p_vllm = rollout_params_per_rank(counts, rtp)
        b = DTYPE_BYTES[cfg.model.params_dtype]
        rdt = rollout_dtype(cfg)
        br = DTYPE_BYTES[rdt]
        dist_div = self.dp if p.use_distributed_optimizer else 1
        kl = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        h, L, heads = arch.hidden_size, arch.num_layers, arch.num_attention_heads
        seq = d.max_prompt_length + d.max_response_length

        weights = p_rank * b
        grads = p_rank * 4
        opt_per_param = 8 + (4 if b < 4 else 0)
        optim = p_rank * opt_per_param / dist_div
        ref = weights if kl else 0
        vllm_w = p_vllm * br
        mem = self.device_memory_gb * GIB if self.device_memory_gb else None
        on_device = p.platform in ("cuda", "npu") or (p.platform == "auto" and mem is not None)
        if on_device and mem is not None:
            budget = r.gpu_memory_utilization * mem
            kv = max(0.0, budget - vllm_w)
            kv_formula = (
                f"rollout.gpu_memory_utilization {r.gpu_memory_utilization:g} x {self.device_memory_gb:g} GiB - "
                "vLLM weights"
            )
            if budget <= vllm_w:
                self.problems.append(
                    f"rollout.gpu_memory_utilization={r.gpu_memory_utilization:g} of {self.device_memory_gb:g} GiB = "
                    f"{budget / GIB:.1f} GiB does not even hold the rollout weights ({vllm_w / GIB:.1f} GiB per rank "
                    f"at rollout TP {rtp}); raise it or rollout.tensor_model_parallel_size"
                )
        else:
            kv = r.kv_cache_memory_mb * MIB
            kv_formula = f"rollout.kv_cache_memory_mb={r.kv_cache_memory_mb}"
        # KV cache capacity: K and V per token per layer, KV heads split across rollout TP (replicated when fewer).
        kv_heads = max(1, arch.num_query_groups // rtp)
        kv_per_token = 2 * L * kv_heads * arch.head_dim * br
        kv_tokens = int(kv // kv_per_token) if kv_per_token else 0
        if kv_tokens < seq:
            self.problems.append(
                f"the rollout KV cache ({kv_formula} = {kv / MIB:.0f} MiB per rank) holds {kv_tokens} tokens at "
                f"{kv_per_token} bytes per token, fewer than one sequence of data.max_prompt_length + "
                f"data.max_response_length = {seq}; vLLM would refuse to start: give the KV cache more memory"
            )

        # Activations of one training micro-batch on the first pipeline stage (the one with the most in flight).
        tokens = max(a.ppo_max_token_len_per_gpu, seq) if a.use_dynamic_bsz else a.ppo_micro_batch_size_per_gpu * seq
        mini_rows = a.ppo_mini_batch_size * cfg.rollout.n // max(self.dp, 1)
        if a.use_dynamic_bsz:
            n_micro = -(-mini_rows // max(1, a.ppo_max_token_len_per_gpu // seq))
        else:
            n_micro = -(-mini_rows // a.ppo_micro_batch_size_per_gpu)
        in_flight = min(pp, n_micro)
        per_tok = (34 / tp) if p.sequence_parallel else (10 + 24 / tp)
        flash = on_device  # TransformerEngine / MindSpeed spec: fused attention, no s x s scores kept
        per_seq_len = seq if not a.use_dynamic_bsz else min(seq, tokens)
        attn = 0.0 if flash else 5 * heads * per_seq_len / (h * tp)
        act_layer = tokens * h * (per_tok + attn) * b / 2
        act = act_layer * (L // pp) * in_flight
        logits = tokens * (vp // tp) * (b + 8)
        lp_tokens = (
            max(a.ppo_max_token_len_per_gpu, seq) if a.use_dynamic_bsz else a.log_prob_micro_batch_size_per_gpu * seq
        )
        lp_logits = lp_tokens * (vp // tp) * (b + 8)
        bucket = 2 * r.weight_sync_bucket_mb * MIB

        resident = weights + grads + optim + ref + vllm_w + kv
        phases = [
            ("generation", resident, "resident"),
            ("log-probs", resident + lp_logits, "resident + log-prob micro-batch logits"),
            ("update", resident + act + logits, "resident + activations + logits of a training micro-batch"),
            ("weight sync", resident + bucket, "resident + 2 x rollout.weight_sync_bucket_mb"),
        ]

        def gib(x: float) -> str:
            return f"{x / GIB:9.2f} GiB" if x >= GIB else f"{x / MIB:9.2f} MiB"

        total = counts.total
        out = [
            f"  parameters (from {self.hf_dir}/config.json): {total:,} = {_human(total)} (embedding "
            f"{counts.embedding:,}, output layer {counts.output_layer:,}{' (tied)' if arch.tie_word_embeddings else ''}"
            f", {L} layers x {counts.layer:,}, final norm {counts.final_norm:,})",
            f"  actor parameters per rank (largest stage, vocabulary padded to {vp}): {p_rank:,}; rollout per rank "
            f"(rollout TP {rtp}): {p_vllm:,}",
            f"  memory per rank, estimate ({cfg.model.params_dtype} actor, {rdt} rollout; GiB = 2^30 bytes):",
            f"    actor weights      {gib(weights)}  = params/rank x {b} B",
            f"    actor grads        {gib(grads)}  = params/rank x 4 B (fp32 grad buffer, grad_reduce_in_fp32)",
            f"    optimizer state    {gib(optim)}  = params/rank x {opt_per_param} B (Adam: 2 fp32 moments"
            + (" + fp32 master weights" if b < 4 else "")
            + (f") / DP {dist_div} (distributed optimizer)" if dist_div > 1 else ")"),
            f"    reference weights  {gib(ref)}  = "
            + (f"params/rank x {b} B (KL term on)" if kl else "0 (no KL term)"),
            f"    vLLM weights       {gib(vllm_w)}  = full model / rollout TP {rtp} x {br} B",
            f"    vLLM KV cache      {gib(kv)}  = {kv_formula}; {kv_tokens:,} tokens = {kv_tokens // seq} full "
            "sequences",
            f"    activations        {gib(act)}  = tokens {tokens} x h {h} x ("
            + (f"34/TP {tp}" if p.sequence_parallel else f"10 + 24/TP {tp}")
            + (f" + 5 x heads {heads} x s {per_seq_len} / (h x TP)" if not flash else "")
            + f") x {b}/2 B x {L // pp} layers/stage x {in_flight} micro-batch(es) in flight"
            + (" [no recomputation; flash attention]" if flash else " [no recomputation; local attention spec]"),
            f"    training logits    {gib(logits)}  = tokens {tokens} x padded vocab/TP {vp // tp} x ({b} + 8) B",
            f"    log-prob logits    {gib(lp_logits)}  = tokens {lp_tokens} x padded vocab/TP {vp // tp} x ({b} + 8) B",
            f"    sync buckets       {gib(bucket)}  = 2 x rollout.weight_sync_bucket_mb={r.weight_sync_bucket_mb}",
            "  peak per rank by phase (vLLM weights and KV cache stay resident: the trainer does not put vLLM to "
            "sleep):",
        ]
        for name, value, formula in phases:
            flag = ""
            if mem is not None and value > mem:
                flag = f"  OVER --device-memory-gb {self.device_memory_gb:g}"
                self.warnings.append(
                    f"memory estimate of phase {name!r} is {value / GIB:.1f} GiB per rank, over --device-memory-gb "
                    f"{self.device_memory_gb:g} ({formula}); see the plan above for the terms"
                )
            out.append(f"    {name:<12} {gib(value)}  ({formula}){flag}")
        self.numbers.update(
            params=total,
            actor_params_per_rank=p_rank,
            rollout_params_per_rank=p_vllm,
            padded_vocab=vp,
            kv_cache_tokens=kv_tokens,
            micro_batch_tokens=tokens,
            **{
                f"memory_{k}_bytes": v
                for k, v in (
                    ("actor_weights", weights),
                    ("grads", grads),
                    ("optimizer", optim),
                    ("reference", ref),
                    ("vllm_weights", vllm_w),
                    ("kv_cache", kv),
                    ("activations", act),
                    ("logits", logits),
                    ("log_prob_logits", lp_logits),
                    ("sync_buckets", bucket),
                )
            },
            **{f"memory_phase_{name.replace(' ', '_').replace('-', '_')}_bytes": v for name, v, _ in phases},
        )
        return out

    # ----------------------------------------------------------------------------------------- driver

    def run(self) -> CheckReport:
        if not self.load():
            return CheckReport(self.problems, self.warnings, "")
        self.load_model()
        if self.arch is not None and self.range_ok:
            self.check_layout()
        self.check_checkpoint()
        if self.range_ok:
            self.check_data()
        self.check_rewards()
        lines = [f"megatron-dapo check {self.config_path or '(defaults)'} {' '.join(self.overrides)}".rstrip()]
        if self.arch is not None and self.layout_ok and self.rollout_ok:
            lines += ["plan:"] + self.make_plan() + self.memory_plan()
        else:
            lines.append("plan: not computed (needs a readable HF config and a valid parallel layout; see problems)")
        lines.append("inputs:")
        lines += self.plan or ["  (none readable)"]
        return CheckReport(self.problems, self.warnings, "\n".join(lines), self.numbers)


def _human(count: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.2f}{unit}"
    return str(count)


def _bind_math(math_dapo: Any, response: str, truth: Any) -> Any:
    return lambda: math_dapo.compute_score(response, truth)


def run_check(
    config_path: Optional[str],
    overrides: Optional[Sequence[str]] = None,
    nnodes: int = 1,
    nproc_per_node: Optional[int] = None,
    device_memory_gb: Optional[float] = None,
    sample_rows: int = DEFAULT_SAMPLE_ROWS,
) -> CheckReport:
    """Check a config, its model, data, reward functions and checkpoint for a launch of ``nnodes`` x
    ``nproc_per_node`` processes (default per node: 8 for platform cuda/npu, else 2); see the module docstring."""
    return _Checker(config_path, overrides or [], nnodes, nproc_per_node, device_memory_gb, sample_rows).run()


def build_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    """The ``check`` arguments (on ``parser`` when given, e.g. a ``megatron-dapo`` subcommand parser)."""
    parser = parser or argparse.ArgumentParser(prog="megatron-dapo check", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="experiment YAML (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor_model_parallel_size=2")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes of the planned launch (default 1)")
    parser.add_argument(
        "--nproc-per-node", type=int, default=None, help="processes per node (default: 8 on cuda/npu, else 2)"
    )
    parser.add_argument(
        "--device-memory-gb",
        type=float,
        default=None,
        help="memory per device in GiB: sizes the vLLM KV cache and marks phases estimated above it",
    )
    parser.add_argument(
        "--sample-rows",
        type=int,
        default=DEFAULT_SAMPLE_ROWS,
        help=f"rows per data file to template and tokenize (default {DEFAULT_SAMPLE_ROWS}; 0 = all); every row's "
        "fields are validated",
    )
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``megatron-dapo check``: print the report; exit status 0 when there is no problem, 1 otherwise."""
    args = build_parser().parse_args(argv)
    report = run_check(
        args.config, args.overrides, args.nnodes, args.nproc_per_node, args.device_memory_gb, args.sample_rows
    )
    sys.stdout.write(report.render())
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
