"""The memory hand-off (megatron_dapo/handoff/offload.py) on a real megatron-core actor, optimizer and reference.

One torchrun run (world 2, see ``offload_worker.py``) covers fp32/bf16 × plain/distributed optimizer. The device
moves go through ``CountingPlatform`` (the CPU platform planning every offload and counting its calls), since this
machine has no accelerator memory to free; what is measured is real: storage sizes of megatron-core's own tensors
while offloaded, and bit-equality of every tensor after onload and after one more optimizer step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_dapo.config import load_config
from megatron_dapo.config.plan import resolve_handoff_plan
from megatron_dapo.platform import make_platform
from tests.helpers import run_torchrun

WORKER = Path(__file__).with_name("offload_worker.py")
PORT = 29870
N_PARAMS = 78400  # tiny qwen2 of tests/training/common.py (untied), elements per rank
ZERO = {"params": 0, "grads": 0, "optimizer": 0, "reference": 0}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("offload")
    run_torchrun(WORKER, nproc=2, args=["--out", str(out)], port=PORT, timeout=400)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


CASES = ["fp32-plain", "fp32-distopt", "bf16-plain", "bf16-distopt"]
OPTIMIZERS = {
    "fp32-plain": "FP32Optimizer",
    "fp32-distopt": "DistributedOptimizer",
    "bf16-plain": "Float16OptimizerWithFloat16Params",
    "bf16-distopt": "DistributedOptimizer",
}


@pytest.mark.parametrize("case", CASES)
def test_storages_released_then_restored_bit_exactly(results, case):
    for rank in results:
        r = rank[case]
        assert r["optimizer_types"] == [OPTIMIZERS[case]]
        start = r["sizes_start"]
        assert all(start[k] > 0 for k in ZERO), start
        for tag in ("keep", "discard"):
            # Grads, optimizer and reference leave first; the weight sync still sees the parameters.
            assert r[f"{tag}_sizes_at_sync"] == dict(ZERO, params=start["params"])
            assert r[f"{tag}_sync_returned"] == "synced"
            # During generation nothing of the actor or the reference holds memory.
            assert r[f"{tag}_sizes_rollout"] == ZERO
            # Old-policy log-probs: parameters only; the reference phase adds the reference back.
            assert r[f"{tag}_sizes_old_logprobs"] == dict(ZERO, params=start["params"])
            assert r[f"{tag}_params_after_rollout_bad"] == []
            assert r[f"{tag}_sizes_reference"] == dict(ZERO, params=start["params"], reference=start["reference"])
            assert r[f"{tag}_reference_bad"] == []
            assert r[f"{tag}_sizes_between"] == dict(ZERO, params=start["params"])
            # Update: everything of the actor is back at its full size; the reference waits for the next step.
            assert r[f"{tag}_sizes_update"] == dict(start, reference=0)
            # The documented engine sequence, at the planned sleep level.
            assert r[f"{tag}_engine_calls"] == ["wake:weights", "wake:kv_cache", "sleep:2"]
            calls = r[f"{tag}_platform_calls"]
            # What is still released at the update is the reference (offloaded again after its forward).
            assert calls["release"] - calls["restore"] == r[f"{tag}_live_released_update"] > 0
            # One exactly sized host buffer per component that keeps its values (discarded grads need none),
            # reused when the reference leaves a second time.
            host = r[f"{tag}_host_buffer_bytes"]
            assert calls["host_buffer"] == len(host) == (4 if tag == "keep" else 3)
            for component, nbytes in host.items():
                moved, count = r[f"{tag}_moved_bytes"][component], r[f"{tag}_storages"][component]
                assert moved <= nbytes < moved + 512 * count, (component, nbytes, moved, count)
            # The frozen reference is copied to host once; its second offload only frees the device memory.
            n_ref = r["n_reference_storages"]
            if tag == "keep":
                assert calls["copy_to_host"] == calls["release"] - n_ref and calls["copy_to_device"] == calls["restore"]
            else:  # the one DDP grad buffer is freed without a copy and zeroed on reload
                assert calls["release"] - n_ref - calls["copy_to_host"] == 1
                assert calls["restore"] - calls["copy_to_device"] == 1
        # Everything the actor holds came back bit-exactly; grads too when their values are kept.
        assert r["keep_bad"] == {"params": [], "grads": [], "optimizer": []}
        assert r["discard_bad"] == {"params": [], "optimizer": []}
        assert r["discard_grads_were_nonzero"] > 0 and r["discard_grads_all_zero"]
        # One more optimizer step: the handed-off actor and an untouched twin end bit-identical (aliasing intact).
        assert r["step2_changed"] > 0 and r["step2_params_bad"] == []


@pytest.mark.parametrize("case", CASES)
def test_moved_bytes_match_the_model(results, case):
    dtype_bytes = 2 if case.startswith("bf16") else 4
    shard = 0.5 if "distopt" in case else 1.0  # distributed optimizer: this rank's part (about half) of the state
    per_param = 3 if case.startswith("bf16") else 2  # Adam's two moments (+ the fp32 main copy when params are bf16)
    total = sum(rank[case]["keep_moved_bytes"]["optimizer"] for rank in results)
    assert N_PARAMS * 4 * per_param * shard * 2 <= total < N_PARAMS * 4 * per_param * shard * 2 * 1.01 + 512
    for rank in results:
        moved = rank[case]["keep_moved_bytes"]
        # DDP buffers are padded to a multiple of the DP size × 64 elements with the distributed optimizer.
        assert N_PARAMS * dtype_bytes <= moved["params"] < N_PARAMS * dtype_bytes * 1.01
        assert N_PARAMS * 4 <= moved["grads"] < N_PARAMS * 4 * 1.01  # grads reduced in fp32
        assert moved["reference"] == N_PARAMS * dtype_bytes
        # The fp32 main params are offloaded only where they are copies (bf16), not the params themselves.
        expect = N_PARAMS * 4 * shard * per_param
        assert expect * 0.99 <= moved["optimizer"] < expect * 1.01 + 256


def handoff_plan(cfg, platform):
    """The run's hand-off plan from the sections it reads."""
    return resolve_handoff_plan(cfg.actor, cfg.ref, cfg.rollout, cfg.trainer, platform)


def test_plan_follows_platform_defaults_and_config():
    cfg = load_config(None, [])
    cpu, cuda, npu = (make_platform(n) for n in ("cpu", "cuda", "npu"))
    plan = handoff_plan(cfg, cpu)
    assert (plan.params, plan.grads, plan.optimizer, plan.reference) == (False, False, False, False)
    gpu = handoff_plan(cfg, cuda)
    assert (gpu.params, gpu.grads, gpu.optimizer, gpu.reference, gpu.sleep_level) == (False, True, True, True, 2)
    assert handoff_plan(cfg, npu).sleep_level == 2
    cfg = load_config(
        None,
        [
            "actor.offload_params=true",
            "actor.offload_grads=false",
            "ref.offload=false",
            "rollout.sleep_level=1",
        ],
    )
    p = handoff_plan(cfg, cuda)
    assert (p.params, p.grads, p.optimizer, p.reference, p.sleep_level) == (True, False, True, False, 1)
    assert handoff_plan(cfg, cpu).params is True  # explicit config wins on CPU too


def test_garbage_collection_only_where_memory_is_given_back(monkeypatch):
    """``_empty_cache``'s full collection runs only where something is released between phases: on a device, with
    a planned offload, or once the engine sleeps; on CPU with nothing offloaded it is skipped (a per-step cost)."""
    from megatron_dapo.handoff import offload
    from megatron_dapo.handoff.offload import MemoryHandoff

    collected = []
    monkeypatch.setattr(offload.gc, "collect", lambda: collected.append(1))
    cfg = load_config(None, [])
    cpu, cuda = make_platform("cpu"), make_platform("cuda")

    class Engine:
        def __init__(self, sleeps: bool) -> None:
            self.sleep_supported = sleeps

        def sleep(self, level=None) -> None:
            pass

        def wake_up(self, tags=None) -> None:
            pass

    handoff = MemoryHandoff(cpu, handoff_plan(cfg, cpu), [])
    handoff.before_engine_start()
    handoff.after_engine_start(Engine(sleeps=False))
    handoff.before_rollout(Engine(sleeps=False), lambda: None)
    handoff.after_rollout(Engine(sleeps=False))
    assert not handoff.releases and collected == []
    handoff.after_engine_start(Engine(sleeps=True))  # an engine with a sleep mode gives memory back
    assert handoff.releases and collected == [1]
    offloading = handoff_plan(load_config(None, ["actor.offload_grads=true"]), cpu)
    assert MemoryHandoff(cpu, offloading, []).releases
    assert MemoryHandoff(cuda, handoff_plan(cfg, cuda), []).releases
