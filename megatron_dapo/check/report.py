"""``CheckReport``: what ``run_check`` found, as text (``render``) and as JSON (``to_json``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_dapo.config.memory import PhaseMemory


@dataclass
class CheckReport:
    """What ``run_check`` found: ``problems`` (each names the key/file/row and the fix), ``warnings`` and the plan."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    plan: str = ""
    # The plan's numbers by name (world_size, dp, rollout_dp, params, actor_params_per_rank, micro_batches, ...,
    # memory_<term>_bytes, memory_phase_<phase>_bytes / _host_bytes, memory_peak_bytes, memory_pinned_host_bytes);
    # empty where the plan could not be computed (``MemoryModel.numbers``).
    numbers: dict[str, float] = field(default_factory=dict)
    # The memory plan by phase (startup, sync, gen, old_log_prob, ref, update, save: device and host bytes by term)
    # and the name of the phase with the highest device estimate among those that run; empty where not computed.
    phases: list[PhaseMemory] = field(default_factory=list)
    peak_phase: str = ""
    capacity_gib: Optional[float] = None  # --device-memory-gb
    world_size: int = 0
    config: Optional[str] = None
    overrides: list[str] = field(default_factory=list)

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

    @property
    def fits(self) -> Optional[bool]:
        """Every phase that runs fits ``--device-memory-gb`` (vLLM's start-up rule for ``startup``); None without
        a capacity or a memory plan."""
        if self.capacity_gib is None or not self.phases:
            return None
        return all(bool(ph.fits) for ph in self.phases if ph.runs)

    def to_json(self) -> dict[str, Any]:
        """The report as ``megatron-dapo check --json`` writes it (GiB = 2^30 bytes; ``numbers`` in their own units,
        bytes for ``memory_*``)."""
        return {
            "config": self.config,
            "overrides": list(self.overrides),
            "capacity_gib": self.capacity_gib,
            "world_size": self.world_size,
            "ok": self.ok,
            "phases": {ph.name: ph.to_json() for ph in self.phases},
            "peak_phase": self.peak_phase or None,
            "fits": self.fits,
            "problems": list(self.problems),
            "warnings": list(self.warnings),
            "numbers": dict(self.numbers),
        }
