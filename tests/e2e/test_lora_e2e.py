"""LoRA end to end (``actor.lora``, docs/lora.md) under torchrun on CPU, 2 processes at TP 2: only the adapters train,
vLLM gets the base once and then the adapters into its own LoRA support, the KL reference is the actor with its
adapters off, and checkpoints hold the adapters (and their optimizer state) with a pointer to the base.

A 4-step run saving every step, and a second run resumed from its step-3 checkpoint for step 4: the resumed step
equals the straight one (adapters, their Adam state and the data position came back, the base from
``checkpoint.load_dir``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from tests.e2e.test_train_e2e import launch, overrides, read_metrics, wait_ok

ENV = {"NPROC_PER_NODE": "2", "MASTER_PORT": "29975"}
RANK = 8


def lora_overrides(demo: dict, out: Path, steps: int, **extra) -> list[str]:
    settings = {
        "parallel.tensor_model_parallel_size": 2,
        "actor.lora.rank": RANK,
        "actor.lora.alpha": 16,
        "actor.optim.lr": 2e-2,  # adapters learn at a larger lr than full fine-tuning
        "actor.use_kl_loss": "true",
        "actor.kl_loss_coef": 0.1,
        "trainer.val_before_train": "false",
        "trainer.test_freq": -1,
        "data.val_files": "[]",
        "checkpoint.save_freq": 1,
        **extra,
    }
    return overrides(demo, out, steps=steps, **settings)


@pytest.fixture(scope="module")
def runs(demo, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    straight, resumed = root / "straight", root / "resumed"
    wait_ok(launch("run_local.sh", lora_overrides(demo, straight, 4), ENV))
    step3 = straight / "checkpoints" / "global_step_3"
    wait_ok(launch("run_local.sh", lora_overrides(demo, resumed, 4, **{"checkpoint.resume_mode": str(step3)}), ENV))
    return {"straight": straight, "resumed": resumed, "step3": step3, "base": Path(demo["mcore"])}


def test_adapters_train_and_reach_vllm(runs):
    rows = {r["step"]: r for r in read_metrics(runs["straight"])}
    assert sorted(rows) == [1, 2, 3, 4]
    # Step 1 runs at lr 0 (warm-up): the adapters are still zero (B = 0), the actor is the base: KL exactly 0.
    assert rows[1]["actor/kl_loss"] == 0.0
    # Then the adapters move the policy away from the reference (the base: adapters off, not a copy of the actor).
    assert rows[4]["actor/kl_loss"] > 1e-4
    for step in (2, 3, 4):
        # vLLM generates with the synced adapters: its log-probs are the trainer's.
        assert rows[step]["rollout/logprob_diff_max"] <= 1e-3, (step, rows[step]["rollout/logprob_diff_max"])
        assert rows[step]["actor/update_ok"] == 1.0


def test_checkpoint_holds_adapters_and_points_at_the_base(runs):
    step3 = runs["step3"]
    state = json.loads((step3 / "trainer_state.json").read_text())
    assert state["adapters_only"] is True
    assert state["lora"]["base_checkpoint"] == str(runs["base"].absolute())
    assert state["lora"]["rank"] == RANK
    dist_dir = next(p for p in step3.iterdir() if p.is_dir() and (p / ".metadata").is_file())
    keys = list(FileSystemReader(str(dist_dir)).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if not k.startswith("optimizer")]
    optim_keys = [k for k in keys if k.startswith("optimizer.state.")]  # Adam moments
    assert model_keys and all(".adapter." in k for k in model_keys), model_keys[:5]
    assert optim_keys and all(".adapter." in k for k in optim_keys), optim_keys[:5]
    size = sum(f.stat().st_size for f in dist_dir.rglob("*") if f.is_file())
    base = sum(f.stat().st_size for f in runs["base"].rglob("*") if f.is_file())
    # Adapters of rank 8 and their two Adam moments: 0.41 of this tiny base (a 7B base's rank-16 adapters are ~0.3%).
    assert size < base / 2, (size, base)


def test_resumed_step_equals_the_straight_one(runs):
    straight = {r["step"]: r for r in read_metrics(runs["straight"])}
    resumed = {r["step"]: r for r in read_metrics(runs["resumed"])}
    assert sorted(resumed) == [4]
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/score/mean", "actor/entropy"):
        assert resumed[4][key] == pytest.approx(straight[4][key], rel=1e-5, abs=1e-7), key
