"""``checkpointing.checkpoint``: save → perturb → load restores parameters, Adam state, scheduler, every rank's RNG and
the data position exactly; the ``latest`` marker and rotation; a crash mid-save leaves the previous checkpoint in
charge; loading at DP=1 (distributed optimizer) and TP=2 (non-distributed optimizer) from a TP=1/DP=2 save;
``resolve_resume``'s choices and errors on real checkpoint directories; registered components (counters, an adaptive
KL controller, the prompt sampler) restored exactly, and a checkpoint saved before they were registered loading with
their defaults.

``checkpoint_worker.py`` runs the distributed parts (one torchrun at world 2, one at world 1); see its docstring.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from megatron_dapo.checkpointing.checkpoint import CheckpointError, resolve_resume
from tests.helpers import run_torchrun
from tests.training.checkpoint_worker import CASES, DATA_STATE, KL_SETUP, KL_UPDATES

WORKER = Path(__file__).with_name("checkpoint_worker.py")
PORTS = {"main": 29860, "dp1": 29861}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("checkpoint")
    run_torchrun(WORKER, nproc=2, args=["--phase", "main", "--out", str(out)], port=PORTS["main"], timeout=400)
    run_torchrun(WORKER, nproc=1, args=["--phase", "dp1", "--out", str(out)], port=PORTS["dp1"], timeout=300)
    ranks = [json.loads((out / f"main_rank{r}.json").read_text()) for r in range(2)]
    dp1 = json.loads((out / "dp1_rank0.json").read_text())
    return {"out": out, "ranks": ranks, "dp1": dp1["dp1"], "states": dp1["states"]}


@pytest.mark.parametrize("case", list(CASES))
def test_load_restores_exact_state(run: dict, case: str) -> None:
    for res in (r[case] for r in run["ranks"]):
        loaded, perturbed = res["loaded"], res["perturbed"]
        # The perturbation changed every kind of state, and loading brought each back bit for bit.
        assert perturbed["param_max_diff"] > 0.1
        assert set(loaded["opt_max_diff"]) == {"main", "exp_avg", "exp_avg_sq", "step"}
        for key, diff in perturbed["opt_max_diff"].items():
            assert diff > 0, key
        assert loaded["param_max_diff"] == 0.0
        assert loaded["opt_max_diff"] == {"main": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0, "step": 0.0}
        assert loaded["steps"] == [2.0]  # Adam's step counter as saved
        assert perturbed["num_steps"] == [2, 6] and loaded["num_steps"] == [2, 2]  # lr scheduler
        assert loaded["lr"][0] == loaded["lr"][1] != perturbed["lr"][1]
        assert res["draws_after_load"] == res["expected_draws"]
        info = res["info"]
        assert info["step"] == 2 and info["data_state"] == DATA_STATE
        assert info["optimizer_restored"] and info["rng_restored"]
        assert res["config_round_trip"]
        assert res["children_after_save"] == []  # no helper or manager process outlives a save
        # Training continues exactly as it would have without the save/perturb/load detour.
        assert res["saved_vs_continued"] > 0
        assert res["continued_max_diff"] == 0.0
    # Each rank got its own generators back (they differ between ranks; megatron's TP stream is shared at TP=1).
    d0, d1 = (r[case]["expected_draws"] for r in run["ranks"])
    for gen in ("python", "numpy", "torch"):
        assert d0[gen] != d1[gen], gen
    if case == "bf16-distopt":  # each rank holds its DP shard of the optimizer state
        counts = [r[case]["loaded"]["num_opt_params"] for r in run["ranks"]]
        assert all(0 < c < 17 for c in counts) and sum(counts) >= 17


def test_weights_only_checkpoint_refreshes_main_params(run: dict) -> None:
    # save_optimizer=False, then parameters and fp32 main params perturbed, then load: the bf16 weights come back and
    # the distributed optimizer's fp32 main shards are re-copied from them (the perturbation is gone).
    for r in run["ranks"]:
        res = r["bf16-distopt"]["weights_only"]
        assert res == {
            "optimizer_restored": False,
            "has_optimizer": False,
            "param_max_diff": 0.0,
            "main_vs_model_max_diff": 0.0,
        }


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_directory_layout(run: dict, case: str) -> None:
    save_dir = run["out"] / case
    step_dir = save_dir / "global_step_2"
    assert sorted(p.name for p in save_dir.iterdir()) == ["global_step_2", "latest"]
    assert (save_dir / "latest").read_text() == "global_step_2\n"
    assert (step_dir / "dist_ckpt" / "metadata.json").is_file()
    assert sorted(p.name for p in (step_dir / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]
    state = json.loads((step_dir / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["data_state"] == DATA_STATE
    assert state["scheduler"]["num_steps"] == 2 and state["scheduler"]["lr_decay_style"] == "cosine"
    assert state["layout"]["data_parallel_size"] == 2 and state["layout"]["world_size"] == 2
    distributed = case == "bf16-distopt"
    assert state["distributed_optimizer"] is distributed
    assert state["torch_adam_steps"] == ([2.0] if distributed else [None])
    config = yaml.safe_load((step_dir / "config.yaml").read_text())
    assert config["parallel"]["use_distributed_optimizer"] is distributed
    assert config["model"]["params_dtype"] == CASES[case][0]


def test_rotation_latest_and_crash_mid_save(run: dict) -> None:
    rot = run["ranks"][0]["rotation"]
    assert rot["after_each_save"] == [
        ["global_step_1", "latest"],
        ["global_step_1", "global_step_2", "latest"],
        ["global_step_2", "global_step_3", "latest"],  # max_ckpt_to_keep=2: the oldest went
    ]
    # The writer raised after the temporary directory existed: the previous checkpoint and marker are untouched.
    assert rot["crash_raised"] == "simulated crash while writing the checkpoint"
    assert rot["after_crash"] == [".tmp-step_4", "global_step_2", "global_step_3", "latest"]
    assert rot["latest_after_crash"] == "global_step_3"
    assert rot["resume_after_crash"].endswith("rotation/global_step_3")
    # The next save of that step cleans the leftover and commits.
    assert rot["after_resave"] == ["global_step_3", "global_step_4", "latest"]
    assert rot["latest_after_resave"] == "global_step_4"
    assert run["ranks"][1]["rotation"] == rot


def test_load_at_other_layouts(run: dict) -> None:
    # bf16 + distributed optimizer saved at DP=2, loaded at DP=1 (world 1); fp32 + non-distributed optimizer saved
    # at TP=1/DP=2, loaded at TP=2/DP=1 (padded vocabulary 128 -> 256 rows). Weights, Adam moments and step carry
    # over: the next (zero-gradient) step gives the same parameters as in the original run.
    for res in (run["dp1"], run["ranks"][0]["tp2"], run["ranks"][1]["tp2"]):
        assert res["info"]["step"] == 2 and res["info"]["data_state"] == DATA_STATE
        assert res["info"]["optimizer_restored"]
        assert not res["info"]["rng_restored"]  # another layout: generators keep their seeded state
        assert res["num_steps"] == 3
        assert res["loaded_max_diff"] == 0.0
        assert res["continued_max_diff"] == 0.0
    # The distributed optimizer's format cannot follow a TP change: refused before anything is read.
    for r in run["ranks"]:
        error = r["tp2"]["distopt_tp_change_error"]
        assert error is not None and "tensor_model_parallel_size 1 -> 2" in error and "global_step_2" in error


def test_resolve_resume(run: dict, tmp_path: Path) -> None:
    good = run["out"] / "fp32-plain"
    assert resolve_resume("disable", good) is None
    assert resolve_resume("auto", None) is None
    assert resolve_resume("auto", tmp_path / "nothing-here") is None
    assert resolve_resume("auto", good) == good / "global_step_2"
    assert resolve_resume(str(good / "global_step_2"), None) == good / "global_step_2"

    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        resolve_resume(str(tmp_path / "missing"), good)
    with pytest.raises(CheckpointError, match="looks like a save_dir"):
        resolve_resume(str(good), None)

    # Copies to break: a rank's RNG file gone; a marker naming a deleted step; no marker at all.
    save_dir = tmp_path / "ckpts"
    shutil.copytree(run["out"] / "rotation", save_dir)
    broken = save_dir / "global_step_3"
    (broken / "rng" / "rank_00001.pt").unlink()
    with pytest.raises(CheckpointError, match=r"global_step_3 is not a complete checkpoint \(missing: rng/rank_00001"):
        resolve_resume(str(broken), save_dir)
    (save_dir / ".tmp-step_9").mkdir()  # a crashed save is never picked
    assert resolve_resume("auto", save_dir) == save_dir / "global_step_4"
    # A marker naming a deleted step and every other step damaged: nothing intact to fall back to.
    shutil.rmtree(save_dir / "global_step_4")
    with pytest.raises(
        CheckpointError,
        match=r"no intact checkpoint in .*ckpts; newest: .*global_step_4 is damaged: incomplete \(missing: the dir",
    ):
        resolve_resume("auto", save_dir)
    (save_dir / "latest").unlink()
    with pytest.raises(CheckpointError, match=r"newest: .*global_step_3 is damaged: incomplete \(missing: rng/rank_0"):
        resolve_resume("auto", save_dir)  # step 4 gone, step 3 incomplete, tmp ignored
    shutil.rmtree(save_dir / "global_step_3")
    assert resolve_resume("auto", save_dir) is None  # no checkpoint at all: a fresh start


def adaptive_kl_after_updates() -> float:
    """The adaptive controller's coefficient after ``KL_UPDATES``, computed here from its formula."""
    value, target, horizon = KL_SETUP
    for current_kl, n_steps in KL_UPDATES:
        value *= 1 + min(max(current_kl / target - 1, -0.2), 0.2) * n_steps / horizon
    return value


def test_registered_components_are_restored_exactly(run: dict) -> None:
    res = run["states"]
    saved = res["saved"]
    # The controller moved away from its initial coefficient; the sampler is part-way through epoch 0.
    assert saved["kl_ctrl"] == {"type": "adaptive", "value": pytest.approx(adaptive_kl_after_updates(), rel=1e-12)}
    assert saved["kl_ctrl"]["value"] != KL_SETUP[0]
    assert saved["trainer"] == {"num_skipped_updates": 3, "num_partial_batches": 1}
    assert (saved["data_state"]["epoch"], saved["data_state"]["position"]) == (0, 3)
    # Fresh components (initial coefficient, zero counters, position 0) got every value back, the float bit for bit.
    assert res["loaded"] == saved
    assert res["missing"] == [] and res["warnings"] == []
    assert res["data_state"] == saved["data_state"]
    # trainer_state.json holds each component under its name, next to the checkpoint's own entries.
    assert {k: res["file"][k] for k in saved} == saved
    assert res["file"]["step"] == 5


def test_checkpoint_without_component_states_loads_with_defaults(run: dict) -> None:
    old = run["states"]["old"]
    assert old["step"] == 5
    assert old["missing"] == ["trainer", "kl_ctrl"]
    # No saved coefficient: the controller starts from the configured one, the counters from zero ...
    assert old["loaded"]["kl_ctrl"] == {"type": "adaptive", "value": KL_SETUP[0]}
    assert old["loaded"]["trainer"] == {"num_skipped_updates": 0, "num_partial_batches": 0}
    # ... and the data position, which checkpoints always held, is restored.
    assert old["loaded"]["data_state"] == run["states"]["saved"]["data_state"]
    assert any("has no state for trainer, kl_ctrl" in w and "global_step_5" in w for w in old["warnings"])
