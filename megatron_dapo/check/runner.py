"""``run_check``: load the config and the model's architecture, check the layout against the world, resolve the run
(``config.plan.resolve``) and its memory (``config.memory.memory_model``), check the input files, and render."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from megatron_dapo.check.inputs import InputChecker
from megatron_dapo.check.render import memory_lines, plan_lines
from megatron_dapo.check.report import CheckReport
from megatron_dapo.config import (
    ConfigError,
    ExperimentConfig,
    apply_override,
    from_dict,
    read_config_file,
    validate_config,
)
from megatron_dapo.config.memory import GIB, MemoryModel, memory_model
from megatron_dapo.config.plan import RunPlan, build_plan, plan_problems
from megatron_dapo.config.run_rules import batch_layout_problems, parallel_layout_problems, rollout_layout_problems
from megatron_dapo.models.families import ModelArch, UnsupportedModelError, model_arch_from_hf
from megatron_dapo.platform import Platform, make_platform
from megatron_dapo.weights.checkpoint_errors import CheckpointError
from megatron_dapo.weights.dist_format import hf_config_dir_of

DEFAULT_SAMPLE_ROWS = 1000
NOT_COMPUTED = "plan: not computed (needs a readable HF config and a valid parallel layout; see problems)"


def check_platform(cfg: ExperimentConfig, device_memory_gb: Optional[float]) -> Platform:
    """The platform whose answers (defaults, attention, sleep mode) the check uses; not set up, since the check plans
    a CUDA or NPU run on any machine. ``parallel.platform``; ``auto`` counts as ``cuda`` when ``--device-memory-gb``
    is given (a device is being planned), else as ``cpu``."""
    name = cfg.parallel.platform
    if name == "auto":
        name = "cuda" if device_memory_gb else "cpu"
    return make_platform(name)


def read_config(config_path: Optional[str], overrides: Sequence[str]) -> tuple[Optional[dict], list[str]]:
    """(the raw config: the YAML file with every override applied, or None; the problems). Every bad override is
    reported, not only the first."""
    try:
        raw = read_config_file(config_path) if config_path is not None else {}
    except ConfigError as exc:
        return None, exc.problems
    problems: list[str] = []
    for item in overrides:
        try:
            apply_override(raw, item)
        except ConfigError as exc:
            problems.extend(exc.problems)
    return (None if problems else raw), problems


def sizes_usable(cfg: ExperimentConfig) -> bool:
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
    """One check: the stages in ``run`` order, each adding problems, warnings and report lines."""

    def __init__(
        self,
        config_path: Optional[str],
        overrides: Sequence[str],
        nnodes: int,
        nproc_per_node: Optional[int],
        device_memory_gb: Optional[float],
        sample_rows: int,
    ) -> None:
        self.config_path, self.overrides = config_path, list(overrides)
        self.nnodes, self.nproc_per_node = nnodes, nproc_per_node
        self.device_memory_gb, self.sample_rows = device_memory_gb, sample_rows
        self.problems: list[str] = []
        self.warnings: list[str] = []
        self.cfg: Optional[ExperimentConfig] = None
        self.platform: Optional[Platform] = None
        self.arch: Optional[ModelArch] = None
        self.hf_dir: Optional[str] = None
        self.hf_key = "model.hf_config_dir"
        self.range_ok = False
        self.world_size = 0

    # ----------------------------------------------------------------------------------------- config

    def load(self) -> bool:
        raw, self.problems = read_config(self.config_path, self.overrides)
        if raw is None:
            return False
        try:
            cfg = self.cfg = from_dict(ExperimentConfig, raw)
        except ConfigError as exc:  # unknown key or wrong type: nothing else can be checked reliably
            self.problems.extend(exc.problems)
            return False
        try:
            validate_config(cfg)
            self.range_ok = True
        except ConfigError as exc:
            self.problems.extend(exc.problems)
            self.range_ok = sizes_usable(cfg)
        self.platform = check_platform(cfg, self.device_memory_gb)
        if self.nproc_per_node is None:
            self.nproc_per_node = 8 if self.platform.device_type != "cpu" else 2
        if self.nnodes < 1 or self.nproc_per_node < 1:
            self.problems.append(f"--nnodes={self.nnodes} and --nproc-per-node={self.nproc_per_node} must both be >= 1")
            self.range_ok = False
        self.world_size = self.nnodes * self.nproc_per_node
        return True

    # ----------------------------------------------------------------------------------------- model

    def load_model(self) -> None:
        """The architecture from ``model.hf_config_dir``, else ``<checkpoint.load_dir>``'s HF config (as the trainer
        finds it)."""
        cfg = self.cfg
        if cfg.model.hf_config_dir:
            self.hf_dir = cfg.model.hf_config_dir
        elif cfg.checkpoint.load_dir:
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

    def check_layout(self) -> bool:
        """Actor and rollout layouts against the world size and the model, and mini-batches against data
        parallelism (``config/run_rules.py``, with the world size spelled out); True when the run can be resolved."""
        cfg, arch, world = self.cfg, self.arch, self.world_size
        p = cfg.parallel
        where = f" = {self.nnodes} node(s) x {self.nproc_per_node} process(es) per node"
        actor = parallel_layout_problems(
            p,
            world,
            arch.num_layers,
            arch.num_attention_heads,
            arch.num_query_groups,
            arch.ffn_hidden_size,
            world_desc=where,
            num_experts=arch.num_experts,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        )
        self.problems.extend(actor)
        rollout = rollout_layout_problems(
            cfg, world, arch.max_position_embeddings, arch, world_desc=where, platform=self.platform
        )
        self.problems.extend(rollout)
        if actor:
            return False
        batches = batch_layout_problems(
            cfg,
            world // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * max(1, p.context_parallel_size)),
        )
        self.problems.extend(batches)
        if not batches and p.virtual_pipeline_model_parallel_size is not None and cfg.actor.use_dynamic_bsz:
            self.warnings.append(
                "parallel.virtual_pipeline_model_parallel_size with actor.use_dynamic_bsz=true: megatron-core's "
                "interleaved schedule needs the number of micro-batches to be a multiple of PP="
                f"{p.pipeline_model_parallel_size}, which dynamic batching does not guarantee"
            )
        return not rollout

    # ----------------------------------------------------------------------------------------- plan

    def resolve_plan(self) -> RunPlan:
        """The run as the trainer resolves it, for this check's platform (nothing imported to answer): its problems
        that no other stage of the check reports are added, and the plan is built all the same (the layout and the
        sizes are usable, so the plan's numbers are shown beside the problems)."""
        cfg, arch, world, platform = self.cfg, self.arch, self.world_size, self.platform
        # Reward files: the check imports and calls them itself and words their problems its own way.
        found = plan_problems(cfg, arch, world, platform, probe_imports=False)
        self.problems.extend(p for p in found if p not in self.problems and not p.startswith("reward."))
        return build_plan(cfg, arch, world, platform, probe_imports=False)

    def memory(self, plan: Optional[RunPlan]) -> Optional[MemoryModel]:
        """The plan's memory on a device of ``--device-memory-gb``; its problems and warnings join the report's."""
        if plan is None:
            return None
        capacity = self.device_memory_gb * GIB if self.device_memory_gb else None
        model = memory_model(plan, self.arch, self.cfg, capacity)
        self.problems.extend(model.problems)
        self.warnings.extend(model.warnings)
        return model

    def plan_text(self, model: MemoryModel) -> list[str]:
        nproc = self.nproc_per_node
        return (
            ["plan:"]
            + plan_lines(model.plan, self.cfg, self.nnodes, nproc)
            + memory_lines(model, self.arch, self.cfg, self.hf_dir, nproc)
        )

    # ----------------------------------------------------------------------------------------- driver

    def run(self) -> CheckReport:
        if not self.load():
            return self.report("")
        self.load_model()
        layout_ok = self.arch is not None and self.range_ok and self.check_layout()
        inputs = InputChecker(self.cfg, self.arch, self.hf_dir, self.hf_key, self.sample_rows)
        inputs.check_checkpoints()
        if self.range_ok:
            inputs.check_data()
        inputs.check_rewards()
        inputs.check_tools()
        self.problems.extend(inputs.problems)
        lines = [f"megatron-dapo check {self.config_path or '(defaults)'} {' '.join(self.overrides)}".rstrip()]
        model = self.memory(self.resolve_plan()) if layout_ok else None
        if model is not None:
            lines += self.plan_text(model)
        else:
            lines.append(NOT_COMPUTED)
        lines.append("inputs:")
        lines += inputs.lines or ["  (none readable)"]
        return self.report("\n".join(lines), model)

    def report(self, plan: str, model: Optional[MemoryModel] = None) -> CheckReport:
        return CheckReport(
            self.problems,
            self.warnings,
            plan,
            model.numbers() if model is not None else {},
            list(model.phases) if model is not None else [],
            model.peak.name if model is not None else "",
            capacity_gib=self.device_memory_gb,
            world_size=self.world_size,
            config=self.config_path,
            overrides=self.overrides,
        )


def run_check(
    config_path: Optional[str],
    overrides: Optional[Sequence[str]] = None,
    nnodes: int = 1,
    nproc_per_node: Optional[int] = None,
    device_memory_gb: Optional[float] = None,
    sample_rows: int = DEFAULT_SAMPLE_ROWS,
) -> CheckReport:
    """Check a config, its model, data, reward functions and checkpoint for a launch of ``nnodes`` x
    ``nproc_per_node`` processes (default per node: 8 on a cuda/npu platform, else 2); see ``megatron_dapo.check``."""
    return _Checker(config_path, overrides or [], nnodes, nproc_per_node, device_memory_gb, sample_rows).run()
