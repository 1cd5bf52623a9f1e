"""Agentic RL end to end (torchrun, 2 CPU processes, vLLM + megatron-core, tools in their own process): the README's
``bash launch/agent_quickstart.sh``, i.e. ``configs/tiny_agent_cpu.yaml`` on the tool task of
``megatron_dapo/tasks/agent.py``.

* the policy learns to call its tool with the right box and to answer the digit the tool returns (validation from
  near chance to >= 0.9, the tool called in >= 90% of validation samples); the tool is a user class from a file,
  loaded from a verl-style tool YAML;
* every dumped sample's token ids and loss mask line up: mask-0 runs are exactly the chat template's tool turns (the
  tokens ``ToolTurns`` renders for their text), mask-1 runs are model turns (a call that is followed by a tool
  turn, the last one an answer);
* ``megatron-dapo eval`` on the final checkpoint runs the same tools and scores what the last validation scored.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from megatron_dapo.agent.chat import ToolTurns
from megatron_dapo.config import load_config
from tests.e2e.test_quickstart import ALARM
from tests.e2e.test_train_e2e import REPO, assert_same_as_straight, launch, read_metrics, wait_ok

LAST_LINE = re.compile(
    r"first_val_acc=([0-9.]+) final_val_acc=([0-9.]+) tool_called_frac=([0-9.]+) eval_acc=([0-9.]+)"
    r" steps=\d+ wall_s=\d+"
)
TOOL_TURN = re.compile(
    r"\n<\|im_start\|>user\n<tool_response>\n(.*)\n</tool_response><\|im_end\|>\n<\|im_start\|>assistant\n", re.S
)
TOOL_TURN_START = "\n<|im_start|>user\n<tool_response>\n"
VAL_ACC = "val-core/lookup/acc/mean@1"
BUDGET = load_config(REPO / "configs" / "tiny_agent_cpu.yaml").data.max_response_length
AGENT_STEPS = 40


def runs(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    """(mask value, tokens) of each maximal run of equal mask values."""
    out: list[tuple[int, list[int]]] = []
    for tok, m in zip(ids, mask):
        if out and out[-1][0] == m:
            out[-1][1].append(tok)
        else:
            out.append((m, [tok]))
    return out


def check_dumped_masks(dump: Path, tokenizer) -> int:
    """Every sample's runs: model turn first; tool runs exactly as rendered; returns how many tool turns were seen."""
    turns = ToolTurns(tokenizer)
    eos = tokenizer.eos_token_id
    tool_turns = 0
    for path in sorted(dump.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            ids, mask = row["response_ids"], row["loss_mask"]
            assert len(ids) == len(mask) and ids and mask[0] == 1
            parts = runs(ids, mask)
            for k, (m, toks) in enumerate(parts):
                text = tokenizer.decode(toks, skip_special_tokens=False)
                if m == 0:
                    match = TOOL_TURN.fullmatch(text)
                    if match is None:  # only the last turn of a response cut at the budget may be partial
                        assert k == len(parts) - 1 and len(ids) == BUDGET and text.startswith(TOOL_TURN_START), text
                    else:
                        assert toks == turns.tokens([match.group(1)])  # token in, token out: the template's tokens
                    tool_turns += 1
                    model_turn = tokenizer.decode(parts[k - 1][1], skip_special_tokens=False)
                    assert "<tool_call>" in model_turn and parts[k - 1][1][-1] == eos
            assert row["response"] == tokenizer.decode(ids, skip_special_tokens=True)
    return tool_turns


@pytest.mark.slow
def test_agent_quickstart_learns_with_its_tool_and_masks_line_up(tmp_path):
    out = tmp_path / "agent"
    env = dict(os.environ, AGENT_DIR=str(out), MASTER_PORT="29975")
    # The README's command with 40 of its 50 steps: validation is 1.0 from step 40 on (configs/tiny_agent_cpu.yaml),
    # and the last 10 steps cost ~50 s of CI for no new check.
    proc = subprocess.run(
        ["bash", "launch/agent_quickstart.sh", f"trainer.total_training_steps={AGENT_STEPS}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    # Once the task is solved most groups score all-correct, and the config caps the generation batches a step may
    # draw (max_num_gen_batches: 2), so the trainer says it trained on fewer groups: expected here, nothing else is.
    alarms = [line for line in log.splitlines() if ALARM.search(line) and "dynamic sampling exhausted" not in line]
    assert not alarms, "warning/traceback lines on a healthy run's console:\n" + "\n".join(alarms[:40])
    match = LAST_LINE.fullmatch(proc.stdout.strip().splitlines()[-1])
    assert match, proc.stdout[-2000:]
    first, final, called, eval_acc = (float(match[k]) for k in (1, 2, 3, 4))
    assert first <= 0.3 and final >= 0.9 and called >= 0.9, match[0]
    assert eval_acc == pytest.approx(final, abs=1e-12)  # eval ran the same tools, greedy, on the same checkpoint

    run = out / "run"
    rows = read_metrics(run)
    val = [r[VAL_ACC] for r in rows if VAL_ACC in r]
    assert val[0] == first and val[-1] == final
    trained = [r for r in rows if "actor/pg_loss" in r]
    assert trained and all(r["tool/calls"] > 0 and r["tool/crashed"] == 0 and r["tool/timeout"] == 0 for r in trained)
    tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer")
    assert check_dumped_masks(run / "rollouts", tokenizer) > 1000


@pytest.fixture(scope="module")
def agent_task(tmp_path_factory) -> dict:
    from megatron_dapo.tasks.agent import prepare
    from megatron_dapo.weights.convert import convert_hf_to_mcore

    root = tmp_path_factory.mktemp("agent_task")
    info = prepare(root, seed=0, measure=False)
    convert_hf_to_mcore(info["hf_model"], root / "mcore")
    return {**info, "mcore": str(root / "mcore")}


def run_agent(task: dict, out: Path, port: int, steps: int, *extra: str) -> None:
    """``steps`` training steps of configs/tiny_agent_cpu.yaml at CI size, dumping the trained samples."""
    args = [
        f"model.hf_config_dir={task['hf_model']}",
        f"model.tokenizer_dir={task['tokenizer']}",
        f"checkpoint.load_dir={task['mcore']}",
        f"data.train_files=[{task['train']}]",
        f"data.val_files=[{task['val']}]",
        f"rollout.multi_turn.tool_config_path={task['tool_config']}",
        f"trainer.output_dir={out}",
        f"trainer.rollout_data_dir={out / 'dump'}",
        f"trainer.total_training_steps={steps}",
        "actor.optim.lr_warmup_steps=0",
        "rollout.n=8",  # CI-sized: 6 prompts x 8 per generation batch, 4 trained
        "data.gen_batch_size=6",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "trainer.progress_bar=false",
        *extra,
    ]
    env = {"NPROC_PER_NODE": "2", "MASTER_PORT": str(port)}
    wait_ok(launch("run_local.sh", args, env, REPO / "configs" / "tiny_agent_cpu.yaml"), timeout=600)


def run_one_step(task: dict, out: Path, port: int, *extra: str) -> list[dict]:
    """One training step (and the validation before it); the step's dumped samples."""
    run_agent(task, out, port, 1, *extra)
    return [json.loads(line) for line in (out / "dump" / "1.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_rollout_tp2_runs_tools_on_the_leader_and_matches_tp1(agent_task, tmp_path):
    """Rollout TP 2 (one replica of 2 ranks: tools run on its first rank, results broadcast to the other) samples the
    same conversations as rollout TP 1 (two replicas): per-request seeds, tool turns identical. The TP 2 run scores
    each conversation in a reward worker as it ends (reward.overlap_generation, the two peers sharing the replica's
    conversations), the TP 1 run in-process after the generation: the rewards are the same."""
    tp1 = run_one_step(agent_task, tmp_path / "tp1", 29976)
    tp2 = run_one_step(
        agent_task, tmp_path / "tp2", 29977, "rollout.tensor_model_parallel_size=2", "reward.num_workers=1"
    )
    key = lambda r: (r["uid"], r["response_ids"], r["score"])  # noqa: E731
    assert sorted(map(key, tp1)) == sorted(map(key, tp2))
    assert "reward/scored_during_gen" in read_metrics(tmp_path / "tp2")[1]
    assert sum(0 in r["loss_mask"] for r in tp1) > 0.9 * len(tp1)  # most samples called the tool
    val = [read_metrics(tmp_path / d)[0]["val-core/lookup/acc/mean@1"] for d in ("tp1", "tp2")]
    assert val[0] == val[1]


# Partial rollout over conversations: segments of 4 tokens, the third runs to the end. A solved episode's call (6
# tokens) is cut inside (segment 1), continued by a second request that ends with the call, then its tool turn
# follows (segment 2), then the answer (segment 3). A step's rounds advance every group in flight until enough are
# done, and here every group needs the same 3 segments, so the buffer at a step boundary holds conversations that
# are done but not trained yet (a checkpoint of conversations cut inside or between turns: the unit tests,
# tests/rollout/test_multi_turn_partial.py, with a JSON checkpoint after every round).
PARTIAL = [
    "rollout.partial_rollout.enable=true",
    "rollout.partial_rollout.max_segments=3",
    "rollout.partial_rollout.segment_length=4",
    "algorithm.filter_groups.enable=false",
    "algorithm.filter_groups.max_num_gen_batches=4",  # the rounds a step may run: 3 segments need 3
    "trainer.test_freq=-1",
    # Every round waits for its calls (none is carried into a later round), so the run does not depend on how fast
    # the tool answers on a loaded box and the resumed run can be compared with the straight one.
    "rollout.multi_turn.tool_round_wait_s=600",
]


@pytest.mark.slow
def test_partial_rollout_over_conversations_resumes_to_the_same_run(agent_task, tmp_path):
    """Multi-turn with partial rollout on real vLLM: conversations span three segments (a model turn continued by a
    second request), their masks line up, and a checkpoint whose buffer holds conversations resumes to the same
    numbers, weights and samples as the uninterrupted run."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_agent(agent_task, straight, 29978, 4, *PARTIAL, "checkpoint.save_freq=2")
    state = json.loads((straight / "checkpoints" / "global_step_2" / "trainer_state.json").read_text())
    buffered = [r for g in state["rollout_buffer"]["groups"] for r in g["responses"]]
    assert buffered and all(r["segments"] == 3 and 0 in r["loss_mask"] for r in buffered)

    shutil.copytree(straight / "checkpoints" / "global_step_2", resumed / "checkpoints" / "global_step_2")
    (resumed / "checkpoints" / "latest").write_text("global_step_2\n")
    run_agent(agent_task, resumed, 29978, 4, *PARTIAL, "checkpoint.save_freq=2", "trainer.val_before_train=false")
    assert_same_as_straight(straight, resumed, (3, 4), tmp_path)
    for step in (3, 4):
        assert (resumed / "dump" / f"{step}.jsonl").read_text() == (straight / "dump" / f"{step}.jsonl").read_text()
    rows = [r for r in read_metrics(straight) if "actor/pg_loss" in r]
    assert all(r["rollout/partial/segments_mean"] > 2 and r["tool/calls"] > 0 for r in rows)
    tokenizer = AutoTokenizer.from_pretrained(agent_task["tokenizer"])
    assert check_dumped_masks(straight / "dump", tokenizer) > 100


@pytest.mark.slow
def test_async_mode_runs_conversations_on_the_rollout_rank(agent_task, tmp_path):
    """trainer.mode=async: the rollout rank runs the conversations and their tools; the trained samples' masks line
    up and the tool metrics reach the trainer's log."""
    out = tmp_path / "async"
    run_agent(agent_task, out, 29979, 2, "trainer.mode=async", "placement.rollout_ranks=1", "trainer.test_freq=2")
    rows = read_metrics(out)
    trained = [r for r in rows if "actor/pg_loss" in r]
    assert len(trained) == 2 and all(r["tool/calls"] > 0 and r["tool/crashed"] == 0 for r in trained)
    assert any("val-aux/tool/called_frac" in r for r in rows)
    tokenizer = AutoTokenizer.from_pretrained(agent_task["tokenizer"])
    assert check_dumped_masks(out / "dump", tokenizer) > 10
