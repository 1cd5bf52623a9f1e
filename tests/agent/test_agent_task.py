"""The tiny tool-use task (``tasks/agent.py``, ``tasks/lookup_tool.py``): the tokenizer's words and tool template,
the tool with verl's tools_kwargs, the reward, and a prepared model whose warm start fixes the format only."""

from __future__ import annotations

import asyncio

import pytest

from megatron_dapo.agent.hermes import ToolCall, parse_tool_calls
from megatron_dapo.agent.tools import ToolRunner, build_tools, read_tool_config
from megatron_dapo.data.rows import read_records
from megatron_dapo.tasks import agent
from megatron_dapo.tasks.lookup_tool import LookupTool, compute_score
from megatron_dapo.testing.tokenizer import (
    BASE_VOCAB_SIZE,
    EOS_TOKEN_ID,
    TOOL_CHAT_TEMPLATE,
    build_tiny_tokenizer,
)

CALL_C = '<tool_call>{"name": "lookup", "arguments": {"box": "c"}}</tool_call>'


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"), words=agent.WORDS, chat_template=TOOL_CHAT_TEMPLATE)


def test_words_are_single_tokens_after_the_base_vocabulary_and_round_trip(tok, tmp_path):
    for word in agent.WORDS:
        ids = tok.encode(word, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] >= BASE_VOCAB_SIZE, word
        assert tok.decode(ids, skip_special_tokens=True) == word  # ordinary tokens: kept like Qwen's <tool_call>
    ids = tok.encode(CALL_C, add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["<tool_call>", agent.CALL_PREFIX, "c", agent.CALL_SUFFIX, "</tool_call>"]
    assert tok.decode(ids + [EOS_TOKEN_ID], skip_special_tokens=True) == CALL_C
    # Near misses fall back to characters; the role words still are single tokens; everything round trips.
    for text in ["<tool_call", "</tool_call>>", '"}}}', "user<tool_response>assistant", "open c\n\t~", "", CALL_C * 2]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.convert_ids_to_tokens(tok.encode("<tool_cal", add_special_tokens=False))[0] == "<"
    assert tok.convert_ids_to_tokens(tok.encode("user:", add_special_tokens=False)) == ["user", ":"]
    # The same words in another order give the same ids; the default build is untouched by the option.
    again = build_tiny_tokenizer(tmp_path / "again", words=list(reversed(agent.WORDS)))
    assert again.get_vocab() == tok.get_vocab()
    plain = build_tiny_tokenizer(tmp_path / "plain")
    assert len(plain) == BASE_VOCAB_SIZE and plain.encode("<tool_call>", add_special_tokens=False)[0] < BASE_VOCAB_SIZE


def test_template_renders_tool_turns_as_qwen25(tok):
    msgs = [{"role": "user", "content": "open c"}, {"role": "assistant", "content": CALL_C}]
    assert agent.tool_turn_text(tok, msgs, ["7"]) == (
        "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    both = msgs + [{"role": "tool", "content": "7"}, {"role": "tool", "content": "error: no box x"}]
    both += [{"role": "assistant", "content": "7"}]
    assert tok.apply_chat_template(both, tokenize=False) == (
        "<|im_start|>user\nopen c<|im_end|>\n<|im_start|>assistant\n" + CALL_C + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n7\n</tool_response>\n<tool_response>\nerror: no box x\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n7<|im_end|>\n"
    )
    rendered = tok.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=False)
    assert len(tok.encode(rendered, add_special_tokens=False)) == 14


def test_tool_create_execute_release_with_tools_kwargs(tmp_path):
    row = agent.make_rows(1, seed=3, num_boxes=3)[0]
    kwargs = row["extra_info"]["tools_kwargs"]
    boxes = kwargs["lookup"]["create_kwargs"]["boxes"]
    assert sorted(boxes) == ["a", "b", "c"] and row["reward_model"]["ground_truth"] == str(
        boxes[row["prompt"][0]["content"][-1]]
    )
    tool = LookupTool({}, agent.TOOL_SCHEMA)
    tool.create("s0", **kwargs["lookup"]["create_kwargs"])
    assert tool.execute("s0", {"box": "b"}) == (str(boxes["b"]), 0.0, {"found": 1})
    assert tool.execute("s0", {"box": "x"})[0] == "error: no box x"
    assert tool.execute("s0", {})[0].startswith("error:")
    tool.release("s0")
    assert tool.execute("s0", {"box": "b"})[0].startswith("error:")

    # Through the tool YAML that prepare writes and the runner, as a rollout would use it.
    path = agent.write_tool_config(tmp_path / "tools.yaml")
    tools = build_tools(read_tool_config(str(path)))
    runner = ToolRunner(tools, timeout_s=5)

    async def go():
        await runner.create("s1", kwargs)
        _, calls = parse_tool_calls(agent.call_text("a"))
        out = await runner.call("s1", calls[0])
        bad = await runner.call("s1", ToolCall(name="lookup", arguments={"box": "z"}))
        await runner.release("s1")
        return out, bad

    out, bad = asyncio.run(go())
    assert (out.text, out.status) == (str(boxes["a"]), "ok") and bad.text == "error: no box z"


def test_reward_cases():
    def score(*assistant_and_tool, truth="7"):
        msgs = [{"role": "user", "content": "open c"}]
        for i, content in enumerate(assistant_and_tool):
            msgs.append({"role": "assistant" if i % 2 == 0 else "tool", "content": content})
        return compute_score("lookup", "", truth, {"messages": msgs, "num_turns": 2, "tool_rewards": []})

    assert score(CALL_C, "7", " 7\n") == {"score": 1.0, "acc": True, "pred": "7", "called_tool": True}
    assert score(CALL_C, "7", "3")["score"] == 0.0
    assert score(CALL_C, "7", "77")["score"] == 0.0
    assert score(CALL_C, "7", "7" + CALL_C)["score"] == 0.0
    assert score("7") == {"score": 1.0, "acc": True, "pred": "7", "called_tool": False}  # a lucky guess
    assert score(CALL_C)["score"] == 0.0 and score(CALL_C)["called_tool"]  # ended on a call
    assert score(CALL_C, "7", "")["score"] == 0.0
    assert score()["pred"] == "" and score()["score"] == 0.0
    assert compute_score("lookup", "", "7", {"messages": []})["score"] == 0.0
    # No messages: the last assistant turn is read from the response text (special tokens removed).
    text = CALL_C + "\nuser\n<tool_response>\n7\n</tool_response>\nassistant\n7"
    assert compute_score("lookup", text, "7", None) == {"score": 1.0, "acc": True, "pred": "7", "called_tool": True}
    assert compute_score("lookup", "", "7", {})["score"] == 0.0


def test_rows_draw_train_and_val_digits_independently():
    rows = agent.make_rows(200, seed=0, num_boxes=3, num_digits=10)
    assert {r["prompt"][0]["content"] for r in rows} == {"open a", "open b", "open c"}
    assert len({r["reward_model"]["ground_truth"] for r in rows}) == 10
    rows = agent.make_rows(200, seed=0)  # the defaults: 2 boxes, digits 0-4
    assert {r["prompt"][0]["content"] for r in rows} == {"open a", "open b"}
    assert {r["reward_model"]["ground_truth"] for r in rows} == set("01234")
    with pytest.raises(ValueError):
        agent.make_rows(1, seed=0, num_boxes=5)
    with pytest.raises(ValueError):
        agent.make_rows(1, seed=0, num_digits=11)


def test_prepare_warm_start_fixes_the_format_not_the_answers(tmp_path):
    info = agent.prepare(tmp_path, seed=0)
    start, blind = info["start"], info["start_no_tool"]
    # Measured at seed 0 (64 val rows, temperature 1): call_ok 1.0, answer_ok 1.0, right_box 0.48, copied 0.14,
    # accuracy 0.125, 0.14 with the tool's result hidden (chance 1/5: 2 boxes, digits 0-4).
    assert start["call_ok"] >= 0.9 and start["answer_ok"] >= 0.9 and start["reached_turn2"] >= 0.9
    assert start["accuracy"] <= 0.3 and blind["accuracy"] <= 0.3 and start["copied"] <= 0.35
    assert start["right_box"] <= 0.7  # near 1/2: the box in the call is not yet the prompt's
    assert start["prompt_tokens"] == 14
    val = read_records(info["val"])
    assert len(val) == 64 and val[0]["extra_info"]["tools_kwargs"]["lookup"]["create_kwargs"]["boxes"].keys() == {
        "a",
        "b",
    }
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(info["tokenizer"])
    model = AutoModelForCausalLM.from_pretrained(info["hf_model"])
    assert model.config.vocab_size == len(tok) and model.config.eos_token_id == tok.eos_token_id
    # The saved model, played again from disk with rows read back from parquet, gives the same format rates.
    again = agent.run_episodes(model.eval(), tok, val, seed=0)
    assert again["call_ok"] == pytest.approx(start["call_ok"], abs=1e-3)
    assert again["answer_ok"] == pytest.approx(start["answer_ok"], abs=1e-3)
    assert read_tool_config(info["tool_config"])[0].name == "lookup"
