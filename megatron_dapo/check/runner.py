"""``run_check``: load the config and the model's architecture, run every rule of the run once
(``config.plan.plan_problems``, as ``train``'s ``resolve`` does, with the world size spelled out), lay out the run
(``config.plan.build_plan``) and its memory (``config.memory.memory_model``), check the input files, and render."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from megatron_dapo.check.inputs import InputChecker
from megatron_dapo.check.render import memory_lines, plan_lines
from megatron_dapo.check.report import CheckReport
from megatron_dapo.check.user_code_checks import UserCodeChecks
from megatron_dapo.config import (
    ConfigError,
    ExperimentConfig,
    ParallelConfig,
    apply_override,
    from_dict,
    read_config_file,
)
from megatron_dapo.config.memory import GIB, MemoryModel, memory_model
from megatron_dapo.config.plan import RunPlan, build_plan, plan_problems, uses_reference
from megatron_dapo.config.run_rules import layout_sizes_usable
from megatron_dapo.judge.judge_memory import judge_lines, judge_terms
from megatron_dapo.models.families import ModelArch, UnsupportedModelError, model_arch_from_hf
from megatron_dapo.platform import Platform, make_platform
from megatron_dapo.weights.checkpoint_errors import CheckpointError
from megatron_dapo.weights.dist_format import hf_config_dir_of

DEFAULT_SAMPLE_ROWS = 1000
NOT_COMPUTED = "plan: not computed (needs a readable HF config and a valid parallel layout; see problems)"


def check_platform(parallel: ParallelConfig, device_memory_gb: Optional[float]) -> Platform:
    """The platform whose answers (defaults, attention, sleep mode) the check uses; not set up, since the check plans
    a CUDA or NPU run on any machine. ``parallel.platform``; ``auto`` counts as ``cuda`` when ``--device-memory-gb``
    is given (a device is being planned), else as ``cpu``."""
    name = parallel.platform
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
        self.range_ok = False  # the sizes the layout, batch and memory arithmetic divide by are usable
        self.layout_ok = False  # the layouts fit the world and the model: the run can be laid out
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
        self.range_ok = layout_sizes_usable(cfg.parallel, cfg.actor, cfg.rollout, cfg.data)
        self.platform = check_platform(cfg.parallel, self.device_memory_gb)
        if self.nproc_per_node is None:
            self.nproc_per_node = 8 if self.platform.has_device_memory else 2
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

    def check_rules(self) -> None:
        """Every rule of the run, once (``plan_problems``, the gate ``train``'s ``resolve`` runs), with the world size
        spelled out; they lead the report. The model's rules need its architecture and a usable world; the reward
        files are left to ``InputChecker``, which imports and calls them itself and words their problems its own way.
        TransformerEngine is not imported to answer (the check plans for a platform it does not run on)."""
        cfg = self.cfg
        where = f" = {self.nnodes} node(s) x {self.nproc_per_node} process(es) per node"
        arch = self.arch if self.range_ok else None
        found = plan_problems(
            cfg, arch, self.world_size, self.platform, probe_imports=False, world_desc=where, reward_files=False
        )
        self.problems[:0] = found
        self.layout_ok = arch is not None and found.layout_ok
        p = cfg.parallel
        if self.layout_ok and p.virtual_pipeline_model_parallel_size is not None and cfg.actor.use_dynamic_bsz:
            self.warnings.append(
                "parallel.virtual_pipeline_model_parallel_size with actor.use_dynamic_bsz=true: megatron-core's "
                "interleaved schedule needs the number of micro-batches to be a multiple of PP="
                f"{p.pipeline_model_parallel_size}, which dynamic batching does not guarantee"
            )

    # ----------------------------------------------------------------------------------------- plan

    def memory(self, plan: Optional[RunPlan]) -> Optional[MemoryModel]:
        """The plan's memory on a device of ``--device-memory-gb``; its problems and warnings join the report's."""
        if plan is None:
            return None
        model = memory_model(plan, self.arch, self.cfg, self.capacity)
        self.problems.extend(model.problems)
        self.warnings.extend(model.warnings)
        return model

    @property
    def capacity(self) -> Optional[float]:
        """The device's bytes (``--device-memory-gb``), None when not given."""
        return self.device_memory_gb * GIB if self.device_memory_gb else None

    def plan_text(self, model: MemoryModel) -> list[str]:
        cfg, nproc = self.cfg, self.nproc_per_node
        a, p, r, d = cfg.actor, cfg.parallel, cfg.rollout, cfg.data
        return (
            ["plan:"]
            + plan_lines(model.plan, p, a, r, d, cfg.algorithm, self.nnodes, nproc)
            + memory_lines(model, self.arch, a, p, r, d, self.hf_dir, nproc)
            + judge_lines(cfg.reward.judge, model.plan, judge_terms(cfg.reward.judge, model.plan, self.capacity))
        )

    # ----------------------------------------------------------------------------------------- driver

    def run(self) -> CheckReport:
        if not self.load():
            return self.report("")
        self.load_model()
        self.check_rules()
        cfg = self.cfg
        sections = (cfg.checkpoint, cfg.parallel, cfg.model, cfg.data, cfg.reward, cfg.rollout.multi_turn)
        with_ref = uses_reference(cfg.actor, cfg.algorithm)
        inputs = InputChecker(*sections, with_ref, self.arch, self.hf_dir, self.hf_key, self.sample_rows)
        inputs.check_checkpoints()
        if self.range_ok:
            inputs.check_data()
        # the reward functions and tools, each on the first row of every data source the data check found
        found = (inputs.data_sources, inputs.problems, inputs.lines)
        user_code = UserCodeChecks(cfg.reward, cfg.rollout.multi_turn, *found)
        user_code.check_rewards()
        user_code.check_tools()
        self.problems.extend(inputs.problems)
        lines = [f"megatron-dapo check {self.config_path or '(defaults)'} {' '.join(self.overrides)}".rstrip()]
        model = None
        if self.layout_ok:  # the sizes and the layout are usable: the plan's numbers are shown beside the problems
            model = self.memory(build_plan(self.cfg, self.arch, self.world_size, self.platform, probe_imports=False))
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
