"""On-policy distillation end to end (``distillation``, docs/distillation.md) under torchrun on CPU, 2 processes: the
demo's student (format warm start only: about chance on the addition table) learns the table from a teacher that
knows it, with task rewards off (``use_task_rewards=false``: the rewards only feed metrics).

The teacher is made honestly in the fixture: a tiny Qwen2 of its own, larger architecture than the student's (the
student's tokenizer), trained supervised on the table's true answers, its greedy accuracy checked with HF
transformers, then converted as ``megatron-dapo convert hf-to-mcore`` does (``load_dir``) with its HF directory as
``model_path`` (config.json and the tokenizer). The run distils with ``k1`` through the policy gradient (verl's
recommended use: the per-token reverse KL as a dense reward, clamped at ``loss_max_clamp``) and must lift the
student's greedy validation accuracy (vLLM, the whole table) well above chance.

Why the teacher is not one-hot: a sampled-token estimator only sees the teacher's log-prob of what the student
sampled; a one-hot teacher gives every wrong answer about -20, so ``k1`` pushes wrong answers down with nothing to
pull the right one up but its rare samples (the student's entropy grew and it did not learn), and
``k3``'s clamp at 10 leaves those tokens without gradient (it collapsed onto wrong answers). A teacher that keeps a
tenth of its mass on the other answers, as a real one would, gives balanced signals.
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

import pytest
import torch

from megatron_dapo.data import load_rows
from megatron_dapo.testing.tiny_models import make_tiny_hf_model
from megatron_dapo.weights.convert import convert_hf_to_mcore
from tests.e2e.test_train_e2e import launch, overrides, read_metrics, wait_ok

ENV = {"NPROC_PER_NODE": "2", "MASTER_PORT": "29300"}
# Larger than the student (hidden 128, 2 layers): the teacher's architecture may differ, its tokenizer may not.
TEACHER_SHAPE = dict(
    hidden_size=192,
    num_layers=3,
    num_heads=6,
    num_kv_heads=2,
    intermediate_size=384,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    initializer_range=0.1,  # as the demo's student: random features that already tell the prompts apart
)
VAL_KEY = "val-core/arithmetic/acc/mean@1"
CONFIDENCE = 0.9  # the teacher's probability of the right answer


def _encoded_table(tokenizer, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids through the chat template, answer ids + EOS) of each row, as the trainer tokenizes prompts."""
    out = []
    for row in rows:
        text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        answer = tokenizer.encode(row["reward_model"]["ground_truth"], add_special_tokens=False)
        out.append((tokenizer.encode(text, add_special_tokens=False), answer + [tokenizer.eos_token_id]))
    return out


def _fine_tune(model, table: list[tuple[list[int], list[int]]], pad: int, steps: int) -> float:
    """Supervised training on the table's true answers (whole model). The answer position's target keeps
    ``1 - CONFIDENCE`` of its mass on the other answers (a teacher that is sure, not one-hot: its log-prob of a wrong
    answer the student samples is a few nats, not the -20 of a one-hot fit); EOS after the answer is one-hot."""
    answers = sorted({a[0] for _, a in table})
    width = max(len(p) + len(a) for p, a in table)
    ids = torch.tensor([p + a + [pad] * (width - len(p) - len(a)) for p, a in table])
    vocab = model.config.vocab_size
    targets = torch.zeros(len(table), width, vocab)
    weights = torch.zeros(len(table), width)
    for row, (p, a) in enumerate(table):
        for j, token in enumerate(a):  # the logit at position len(p) - 1 + j predicts answer token j
            pos = len(p) - 1 + j
            if j == 0:
                targets[row, pos, answers] = (1 - CONFIDENCE) / (len(answers) - 1)
                targets[row, pos, token] = CONFIDENCE
            else:
                targets[row, pos, token] = 1.0
            weights[row, pos] = 1.0
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        log_q = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
        loss = -((targets * log_q).sum(-1) * weights).sum() / weights.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


@torch.no_grad()
def _greedy_accuracy(model, table: list[tuple[list[int], list[int]]]) -> float:
    correct = 0
    for prompt, answer in table:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=len(answer) + 2, do_sample=False)
        correct += out[0, len(prompt) :].tolist()[: len(answer)] == answer
    return correct / len(table)


@pytest.fixture(scope="module")
def teacher(demo, tmp_path_factory) -> dict:
    """A teacher that solves the table: HF directory (with the student's tokenizer files) and its conversion."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("teacher")
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(demo["tokenizer"])
    table = _encoded_table(tokenizer, load_rows([demo["val"]]))
    random.Random(0).shuffle(table)
    model = make_tiny_hf_model("qwen2", seed=1, vocab_size=len(tokenizer), **TEACHER_SHAPE)
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.config.bos_token_id = None
    loss = _fine_tune(model, table, tokenizer.pad_token_id, steps=60)
    accuracy = _greedy_accuracy(model, table)
    hf = root / "hf"
    model.save_pretrained(hf, safe_serialization=True)
    for f in Path(demo["tokenizer"]).iterdir():  # model_path holds the tokenizer too (verl's teacher model_path)
        if f.is_file():
            shutil.copy(f, hf / f.name)
    convert_hf_to_mcore(hf, root / "mcore")
    return {"hf": hf, "mcore": root / "mcore", "accuracy": accuracy, "loss": loss, "s": time.perf_counter() - started}


def test_student_learns_the_table_from_the_teacher(demo, teacher, tmp_path):
    # The teacher knows the table (HF greedy decoding, every prompt).
    assert teacher["accuracy"] == 1.0, teacher
    out = tmp_path / "run"
    steps = 30
    distill = {
        "distillation.enabled": "true",
        "distillation.teacher_models.teacher_model.model_path": str(teacher["hf"]),
        "distillation.teacher_models.teacher_model.load_dir": str(teacher["mcore"]),
        "distillation.distillation_loss.loss_mode": "k1",
        "distillation.distillation_loss.use_policy_gradient": "true",
        "distillation.distillation_loss.loss_max_clamp": 5.0,
        "distillation.distillation_loss.use_task_rewards": "false",
        "reward.custom_function.name": "compute_score_exact",  # the table's exact answers: the metrics' accuracy
        "trainer.test_freq": steps,
        "trainer.val_before_train": "true",
        "rollout.n": 8,
        "data.train_batch_size": 16,
        "data.gen_batch_size": 16,
        "actor.ppo_mini_batch_size": 8,
        "actor.optim.lr": 1e-3,
        # The hand-off moves the teacher as the reference: on host memory outside its forward (CPU keeps it by default).
        "ref.offload": "true",
    }
    started = time.perf_counter()
    wait_ok(launch("run_local.sh", overrides(demo, out, steps=steps, **distill), ENV))
    wall = time.perf_counter() - started
    rows = read_metrics(out)
    val = {r["step"]: r[VAL_KEY] for r in rows if VAL_KEY in r}
    first, last = val[0], val[steps]
    print(f"teacher: acc {teacher['accuracy']:.2f} loss {teacher['loss']:.4f} made in {teacher['s']:.1f}s; "
          f"student greedy val acc {first:.2f} -> {last:.2f} in {steps} steps, run {wall:.1f}s")  # fmt: skip
    trained = [r for r in rows if r["step"] >= 1]
    for r in trained:
        assert r["actor/update_ok"] == 1.0
        assert r["actor/num_nonfinite_teacher_log_probs"] == 0
        # On host memory outside its forward: back for it and off again (the last move of a step that validates is
        # the rollout's, which finds it off already).
        assert r["perf/offload_host_buffer_gb/teacher"] > 0
        assert r["perf/offload_gb/teacher"] > 0 or VAL_KEY in r
        assert r["distillation/loss_max"] >= r["distillation/loss_min"]
    # The distillation loss (the mean reverse-KL estimate on the student's samples) falls as the student comes to
    # agree with the teacher; one step is noisy, five are not.
    losses = [r["distillation/loss"] for r in trained]
    assert sum(losses[-5:]) < 0.75 * sum(losses[:5]), losses
    assert first <= 0.3  # about chance (1/9) before training
    assert last >= 0.6 and last - first >= 0.4, (first, last)
