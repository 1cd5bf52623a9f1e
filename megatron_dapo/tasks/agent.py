"""A tiny tool-use task for a CPU RL run: the model can only answer with its tool's help.

The prompt names a box (``open b``); every row has its own secret digits in the boxes (drawn at random per row, for
train and validation independently, so no answer can be memorised; by default 2 boxes, ``a`` and ``b``, holding
digits 0-4), given to the ``lookup`` tool through verl's ``extra_info.tools_kwargs``. The answer is the digit in the
named box. A solved episode is two assistant turns::

    <|im_start|>user\\nopen b<|im_end|>\\n<|im_start|>assistant\\n                            prompt (14 tokens)
    <tool_call>{"name": "lookup", "arguments": {"box": "b"}}</tool_call><|im_end|>      turn 1 (6 tokens)
    \\n<|im_start|>user\\n<tool_response>\\n3\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n   tool (14 tokens)
    3<|im_end|>                                                                         turn 2 (2 tokens)

The tokenizer makes the fixed parts of the call single tokens (``WORDS``), so a call is 5 tokens plus EOS and the
whole response 22 tokens. The chat template renders the tool turn as Qwen2.5 does (``TOOL_CHAT_TEMPLATE``).

The model is demo.py's tiny Qwen2 with demo.py's *format-only* warm start: only the output layer is trained, on
conversations whose call names a *random* box and whose answer is a *random* digit. It learns to call the tool and
to answer with one digit and stop, but not which box to open nor to copy the tool's digit, so its accuracy starts
near chance (1/5 with digits 0-4). What RL then has to learn — open the named box, copy the digit — comes from the
reward alone. Box names never occur elsewhere in the context ("open" has no a-d), so "find the letter / the digit
and copy it" is all the policy has to find; ``supervised_proxy`` measures how fast whole-model supervised training
finds it.

    python -m megatron_dapo.tasks.agent --out-dir outputs/agent [--boxes 2] [--digits 5] [--proxy]

Why 2 boxes and 5 digits: the reward of a random answer is 1/|digits| whatever box was opened, so most early
rewards teach nothing, and the box signal only grows as copying is learnt (and the reverse). With 3 boxes and
digits 0-9 the CPU run stayed near chance, and at a higher learning rate drifted to calls that name no box (a tool
error) and guessing. The measured curve of configs/tiny_agent_cpu.yaml is in docs/benchmarks.md.

The reward is ``lookup_tool.py:compute_score`` (exact match of the last assistant message); the tool YAML written
next to the data names ``lookup_tool.py:LookupTool`` as a user file.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import torch
import yaml

from megatron_dapo.agent.hermes import parse_tool_calls
from megatron_dapo.tasks.arithmetic import write_dataset
from megatron_dapo.tasks.demo import MODEL_SHAPE as DEMO_MODEL_SHAPE
from megatron_dapo.tasks.lookup_tool import TOOL_NAME, LookupTool, compute_score
from megatron_dapo.testing.tiny_models import make_tiny_hf_model
from megatron_dapo.testing.tokenizer import TOOL_CHAT_TEMPLATE, build_tiny_tokenizer

DATA_SOURCE = "lookup"
BOX_NAMES = "abcd"  # none of them occurs in the prompt word "open"
DEFAULT_BOXES = 2
DIGITS = "0123456789"
DEFAULT_DIGITS = 5  # the boxes hold digits 0..num_digits-1
CALL_PREFIX = '{"name": "lookup", "arguments": {"box": "'
CALL_SUFFIX = '"}}'
# Single tokens in the tiny tokenizer: a call is <tool_call> CALL_PREFIX <box> CALL_SUFFIX </tool_call>.
WORDS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", CALL_PREFIX, CALL_SUFFIX)
# Room for turns longer than a solved episode (48 tokens with the turn budgets below).
MODEL_SHAPE = dict(DEMO_MODEL_SHAPE, max_position_embeddings=128)
MAX_CALL_TOKENS = 16  # turn-1 budget when measuring
MAX_ANSWER_TOKENS = 4  # turn-2 budget when measuring

TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "The digit stored in one box.",
        "parameters": {
            "type": "object",
            "properties": {"box": {"type": "string", "description": "the box's name, one letter"}},
            "required": ["box"],
        },
    },
}


def box_names(num_boxes: int) -> str:
    if not 1 <= num_boxes <= len(BOX_NAMES):
        raise ValueError(f"lookup task: num_boxes must be in 1..{len(BOX_NAMES)}, got {num_boxes}")
    return BOX_NAMES[:num_boxes]


def call_text(box: str) -> str:
    """The Hermes call the task expects in turn 1 (without the EOS that ends the turn)."""
    return f"<tool_call>{CALL_PREFIX}{box}{CALL_SUFFIX}</tool_call>"


def digit_set(num_digits: int) -> str:
    if not 2 <= num_digits <= len(DIGITS):
        raise ValueError(f"lookup task: num_digits must be in 2..{len(DIGITS)}, got {num_digits}")
    return DIGITS[:num_digits]


def make_rows(
    n: int, seed: int, num_boxes: int = DEFAULT_BOXES, split: str = "train", num_digits: int = DEFAULT_DIGITS
) -> list[dict]:
    """``n`` verl-format rows: ``open <box>``, the row's secret digits as the tool's create kwargs, the digit in
    the named box as ground truth; drawn with ``random.Random(seed)``."""
    if n < 0:
        raise ValueError(f"make_rows: n must be >= 0, got {n}")
    names = box_names(num_boxes)
    digit_set(num_digits)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        boxes = {b: rng.randrange(num_digits) for b in names}
        box = rng.choice(names)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"open {box}"}],
                "ability": "tool_use",
                "reward_model": {"style": "rule", "ground_truth": str(boxes[box])},
                "extra_info": {
                    "index": i,
                    "split": split,
                    "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"boxes": boxes}}},
                },
            }
        )
    return rows


def tool_turn_text(tokenizer, messages: list[dict], tool_texts: list[str]) -> str:
    """What the chat template adds after an assistant turn that ended with EOS, for these tool results, through
    the next generation prompt: the rendering of ``messages + tools`` minus that of ``messages`` up to the EOS
    (the template's newline after ``<|im_end|>`` belongs to the tool turn, as the model samples only the EOS)."""
    before = tokenizer.apply_chat_template(messages, tokenize=False)
    tools = [{"role": "tool", "content": t} for t in tool_texts]
    full = tokenizer.apply_chat_template(messages + tools, add_generation_prompt=True, tokenize=False)
    end = before.rstrip("\n")
    if not full.startswith(end):
        raise ValueError("tool_turn_text: the chat template renders the earlier turns differently with tool results")
    return full[len(end) :]


class _Pieces:
    """Token ids of the parts of a conversation, encoded once."""

    def __init__(self, tokenizer, names: str) -> None:
        self.tok, self.eos = tokenizer, tokenizer.eos_token_id
        enc = self.encode
        self.prompt = {b: enc(self.render_prompt(b)) for b in names}
        self.call = {b: enc(call_text(b)) + [self.eos] for b in names}
        self.answer = {d: enc(d) + [self.eos] for d in DIGITS}
        self._tool: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def render_prompt(self, box: str) -> str:
        msgs = [{"role": "user", "content": f"open {box}"}]
        return self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)

    def tool(self, text: str) -> list[int]:
        if text not in self._tool:
            msgs = [{"role": "user", "content": "open a"}, {"role": "assistant", "content": call_text("a")}]
            self._tool[text] = self.encode(tool_turn_text(self.tok, msgs, [text]))
        return self._tool[text]

    def example(self, box: str, call_box: str, tool_text: str, answer: str) -> tuple[list[int], list[int]]:
        """(ids, labels) of a whole episode; labels on the two assistant turns only."""
        p, c, t, a = self.prompt[box], self.call[call_box], self.tool(tool_text), self.answer[answer]
        return p + c + t + a, [-100] * len(p) + c + [-100] * len(t) + a


def _batch(examples: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in examples])
    lab = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in examples])
    return ids, lab


def _train(model, params, make_example, steps: int, lr: float, batch_size: int, pad: int, on_step=None) -> float:
    """``steps`` AdamW steps on batches of ``make_example()``; only ``params`` train. Returns the last loss.
    ``on_step(step)`` runs after each step and stops training when it returns True."""
    trainable = {id(p) for p in params}
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    loss = torch.tensor(0.0)
    for step in range(1, steps + 1):
        model.train()
        ids, lab = _batch([make_example() for _ in range(batch_size)], pad)
        loss = model(input_ids=ids, labels=lab).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if on_step is not None:
            model.eval()
            if on_step(step):
                break
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()
    return float(loss.detach())


def format_warm_start(
    model,
    tokenizer,
    rows: list[dict],
    steps: int,
    seed: int,
    lr: float = 1e-2,
    batch_size: int = 64,
    digits: str = DIGITS,
) -> float:
    """Teach the episode's format with a random box in the call and a random digit as the answer (the tool's
    response is the row's digit in the called box, as in a rollout); only the output layer trains (demo.py)."""
    head = model.get_output_embeddings()
    if head is None or head.weight is model.get_input_embeddings().weight:
        raise ValueError("format_warm_start: the model needs an output layer untied from its input embeddings")
    names = sorted(rows[0]["extra_info"]["tools_kwargs"][TOOL_NAME]["create_kwargs"]["boxes"])
    pieces, rng = _Pieces(tokenizer, "".join(names)), random.Random(seed)

    def example():
        row = rows[rng.randrange(len(rows))]
        boxes = row["extra_info"]["tools_kwargs"][TOOL_NAME]["create_kwargs"]["boxes"]
        call_box = rng.choice(names)
        return pieces.example(_prompt_box(row), call_box, str(boxes[call_box]), rng.choice(digits))

    return _train(model, list(head.parameters()), example, steps, lr, batch_size, tokenizer.pad_token_id)


def _prompt_box(row: dict) -> str:
    return row["prompt"][-1]["content"].split()[-1]


# --------------------------------------------------------------------------------------------- measuring episodes


@torch.no_grad()
def _sample(model, contexts: list[list[int]], max_new: int, eos: int, greedy: bool, gen: torch.Generator):
    """Each context's continuation up to and including EOS (or ``max_new`` tokens), at temperature 1 or greedily.
    Contexts are batched by length, so no padding is involved."""
    outs: list[list[int]] = [[] for _ in contexts]
    groups: dict[int, list[int]] = defaultdict(list)
    for i, c in enumerate(contexts):
        groups[len(c)].append(i)
    for idx in groups.values():
        seqs = torch.tensor([contexts[i] for i in idx])
        alive = torch.ones(len(idx), dtype=torch.bool)
        for _ in range(max_new):
            logits = model(input_ids=seqs).logits[:, -1].float()
            nxt = logits.argmax(-1) if greedy else torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0]
            nxt = torch.where(alive, nxt, torch.full_like(nxt, eos))
            seqs = torch.cat([seqs, nxt[:, None]], 1)
            for j, i in enumerate(idx):
                if alive[j]:
                    outs[i].append(int(nxt[j]))
            alive &= nxt != eos
            if not alive.any():
                break
    return outs


def run_episodes(
    model,
    tokenizer,
    rows: list[dict],
    greedy: bool = False,
    seed: int = 0,
    hide_tool: bool = False,
    digits: str = DIGITS,
) -> dict[str, Any]:
    """Play every row's episode with the HF model (turn 1, the calls run by ``LookupTool``, the template's tool turn,
    turn 2; scored by ``compute_score``). ``hide_tool``: a random digit replaces the tool's result (no-tool baseline).

    Returns rates over all rows: ``call_ok`` (turn 1 is one valid ``lookup`` call with a ``box`` argument, then
    EOS), ``right_box`` (and it opens the prompt's box), ``answer_ok`` (of the rows that reached turn 2: one digit,
    then EOS), ``copied`` (the answer is the tool's text), ``accuracy``; and token lengths.
    """
    eos, gen, rng = tokenizer.eos_token_id, torch.Generator().manual_seed(seed), random.Random(seed)
    names = "".join(sorted({_prompt_box(r) for r in rows} | set(BOX_NAMES)))
    pieces = _Pieces(tokenizer, names)
    tool = LookupTool({}, TOOL_SCHEMA)
    prompts = [pieces.prompt[_prompt_box(r)] for r in rows]
    first = _sample(model, prompts, MAX_CALL_TOKENS, eos, greedy, gen)
    n = len(rows)
    stats = dict.fromkeys(("call_ok", "right_box", "reached_turn2", "answer_ok", "copied", "accuracy"), 0)
    contexts, pending, episodes = [], [], []
    for i, row in enumerate(rows):
        text = tokenizer.decode(first[i], skip_special_tokens=True)
        messages = list(row["prompt"]) + [{"role": "assistant", "content": text}]
        ep = {"messages": messages, "tool_texts": []}
        episodes.append(ep)
        _, calls = parse_tool_calls(text)
        ended = bool(first[i]) and first[i][-1] == eos
        ok = ended and len(calls) == 1 and calls[0].error is None and calls[0].name == TOOL_NAME
        ok = ok and isinstance(calls[0].arguments.get("box"), str)
        stats["call_ok"] += ok
        stats["right_box"] += ok and calls[0].arguments["box"] == _prompt_box(row)
        if not (ended and calls):
            continue  # no call (an answer, or a turn that hit its budget): the episode ends here
        iid = f"{seed}-{i}"
        tool.create(iid, **row["extra_info"]["tools_kwargs"][TOOL_NAME]["create_kwargs"])
        for call in calls:
            if call.error is not None:
                out = f"error: {call.error}"
            elif call.name != TOOL_NAME:
                out = f"error: no tool named {call.name!r}"
            else:
                out = tool.execute(iid, call.arguments)[0]
                if hide_tool and not out.startswith("error"):
                    out = rng.choice(digits)
            ep["tool_texts"].append(out)
        tool.release(iid)
        messages += [{"role": "tool", "content": t} for t in ep["tool_texts"]]
        tool_ids = pieces.encode(tool_turn_text(tokenizer, messages[: -len(calls)], ep["tool_texts"]))
        ep["tool_tokens"] = len(tool_ids)
        contexts.append(prompts[i] + first[i] + tool_ids)
        pending.append(i)
    second = _sample(model, contexts, MAX_ANSWER_TOKENS, eos, greedy, gen) if contexts else []
    for i, out in zip(pending, second):
        ep = episodes[i]
        ep["messages"].append({"role": "assistant", "content": tokenizer.decode(out, skip_special_tokens=True)})
        stats["reached_turn2"] += 1
        stats["answer_ok"] += len(out) == 2 and out[1] == eos and tokenizer.decode(out[:1]) in set(DIGITS)
        stats["copied"] += ep["messages"][-1]["content"].strip() == ep["tool_texts"][-1]
        ep["response_tokens"] = len(first[i]) + ep["tool_tokens"] + len(out)
    for row, ep in zip(rows, episodes):
        score = compute_score(DATA_SOURCE, "", row["reward_model"]["ground_truth"], {"messages": ep["messages"]})
        stats["accuracy"] += score["acc"]
    turn2 = max(stats["reached_turn2"], 1)
    lengths = [ep["response_tokens"] for ep in episodes if "response_tokens" in ep]
    return {
        "call_ok": stats["call_ok"] / n,
        "right_box": stats["right_box"] / n,
        "reached_turn2": stats["reached_turn2"] / n,
        "answer_ok": stats["answer_ok"] / turn2,
        "copied": stats["copied"] / turn2,
        "accuracy": stats["accuracy"] / n,
        "prompt_tokens": len(prompts[0]) if prompts else 0,
        "response_tokens_mean": sum(lengths) / len(lengths) if lengths else 0.0,
        "episodes": episodes,
    }


def summary(result: dict) -> dict:
    """``run_episodes``' numbers without the episodes."""
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items() if k != "episodes"}


def supervised_proxy(
    model,
    tokenizer,
    train: list[dict],
    val: list[dict],
    steps: int = 200,
    lr: float = 1e-3,
    batch_size: int = 64,
    eval_every: int = 5,
    seed: int = 0,
    target: float = 0.9,
) -> dict[str, Any]:
    """How learnable the task is: train a *copy* of the whole model on the true episodes (the prompt's box, the
    tool's digit copied) and return the greedy validation accuracy every ``eval_every`` steps and the first step
    at which it reaches ``target`` (None if never), stopping there. A proxy for how fast RL can find the same
    behaviour from the reward alone (RL sees far less signal per step, so this is a lower bound)."""
    model = copy.deepcopy(model)
    names = "".join(sorted(train[0]["extra_info"]["tools_kwargs"][TOOL_NAME]["create_kwargs"]["boxes"]))
    pieces, rng = _Pieces(tokenizer, names), random.Random(seed)
    curve: list[tuple[int, float]] = []

    def example():
        row = train[rng.randrange(len(train))]
        box, truth = _prompt_box(row), row["reward_model"]["ground_truth"]
        return pieces.example(box, box, truth, truth)

    def on_step(step: int) -> bool:
        if step % eval_every:
            return False
        curve.append((step, run_episodes(model, tokenizer, val, greedy=True, seed=seed)["accuracy"]))
        return curve[-1][1] >= target

    started = time.perf_counter()
    _train(model, list(model.parameters()), example, steps, lr, batch_size, tokenizer.pad_token_id, on_step)
    reached = next((s for s, acc in curve if acc >= target), None)
    no_tool = run_episodes(model, tokenizer, val, greedy=True, seed=seed, hide_tool=True)["accuracy"]
    return {
        "steps_to_target": reached,
        "target": target,
        "curve": curve,
        "no_tool_accuracy": no_tool,
        "seconds": round(time.perf_counter() - started, 1),
    }


# ------------------------------------------------------------------------------------------------------- prepare


def write_tool_config(path: str | Path) -> Path:
    """A verl-style tool YAML naming ``lookup_tool.py:LookupTool`` (an absolute path, so any working directory
    finds it)."""
    tool_file = Path(__file__).resolve().with_name("lookup_tool.py")
    entry = {"class_name": f"{tool_file}:LookupTool", "config": {}, "tool_schema": TOOL_SCHEMA}
    path = Path(path)
    path.write_text(yaml.safe_dump({"tools": [entry]}, sort_keys=False))
    return path


def prepare(
    out_dir: str | Path,
    seed: int = 0,
    num_boxes: int = DEFAULT_BOXES,
    warm_start_steps: int = 150,
    num_digits: int = DEFAULT_DIGITS,
    train_rows: int = 2048,
    val_rows: int = 64,
    measure: bool = True,
    proxy: bool = False,
) -> dict:
    """Write ``tokenizer/``, ``data/{train,val}.parquet``, ``hf_model/`` and ``tools.yaml`` under ``out_dir``;
    returns their paths and, with ``measure``, the warm-started model's episodes on the validation rows (sampled at
    temperature 1 with the tool, and with the tool's result hidden); with ``proxy``, ``supervised_proxy``'s."""
    out = Path(out_dir)
    tokenizer = build_tiny_tokenizer(out / "tokenizer", words=WORDS, chat_template=TOOL_CHAT_TEMPLATE)
    data = out / "data"
    # Different seeds for train and val: the digits of the two sets are drawn independently.
    digits = digit_set(num_digits)
    train = make_rows(train_rows, seed=seed, num_boxes=num_boxes, split="train", num_digits=num_digits)
    val = make_rows(val_rows, seed=seed + 1_000_003, num_boxes=num_boxes, split="val", num_digits=num_digits)
    write_dataset(data / "train.parquet", train)
    write_dataset(data / "val.parquet", val)
    tools_yaml = write_tool_config(out / "tools.yaml")

    model = make_tiny_hf_model("qwen2", seed=seed, vocab_size=len(tokenizer), **MODEL_SHAPE)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.bos_token_id = None
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    started = time.perf_counter()
    loss = format_warm_start(model, tokenizer, train, warm_start_steps, seed, digits=digits)
    warm_s = time.perf_counter() - started
    hf_dir = out / "hf_model"
    model.save_pretrained(hf_dir, safe_serialization=True)  # no tokenizer files here: see demo.py
    info: dict[str, Any] = {
        "tokenizer": str(out / "tokenizer"),
        "train": str(data / "train.parquet"),
        "val": str(data / "val.parquet"),
        "hf_model": str(hf_dir),
        "tool_config": str(tools_yaml),
        "reward_path": str(Path(__file__).resolve().with_name("lookup_tool.py")),
        "num_boxes": num_boxes,
        "num_digits": num_digits,
        "warm_start_loss": loss,
        "warm_start_seconds": round(warm_s, 1),
        "params": sum(p.numel() for p in model.parameters()),
    }
    if measure:
        info["start"] = summary(run_episodes(model, tokenizer, val, seed=seed))
        info["start_no_tool"] = summary(run_episodes(model, tokenizer, val, seed=seed, hide_tool=True, digits=digits))
    if proxy:
        info["proxy"] = supervised_proxy(model, tokenizer, train, val, seed=seed)
    (out / "agent.json").write_text(json.dumps(info, indent=2))
    return info


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--boxes", type=int, default=DEFAULT_BOXES, help=f"number of boxes (1-{len(BOX_NAMES)})")
    ap.add_argument("--digits", type=int, default=DEFAULT_DIGITS, help="the boxes hold digits 0..N-1 (2-10)")
    ap.add_argument("--warm-start-steps", type=int, default=150)
    ap.add_argument("--proxy", action="store_true", help="also run the supervised learnability proxy (~10-30 s)")
    args = ap.parse_args(argv)
    info = prepare(args.out_dir, args.seed, args.boxes, args.warm_start_steps, args.digits, proxy=args.proxy)
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
