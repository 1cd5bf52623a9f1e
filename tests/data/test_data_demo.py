"""The embedded demo's preparation: files, tokenizer, and a warm start that fixes the format but not the answers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_dapo.data import load_rows
from megatron_dapo.tasks.arithmetic import make_table_rows
from megatron_dapo.tasks.demo import MODEL_SHAPE, format_warm_start
from megatron_dapo.testing.tiny_models import make_tiny_hf_model

# demo: tests/conftest.py's (prepare(root, seed=0, train_rows=256), the one the e2e runs train on)


def test_files_and_tokenizer(demo: dict) -> None:
    assert [{k: v for k, v in r.items() if k != "_source"} for r in load_rows([demo["val"]])] == make_table_rows(4)
    assert len(load_rows([demo["train"]])) == 256
    hf = Path(demo["hf_model"])
    assert (hf / "config.json").is_file() and (hf / "model.safetensors").is_file()
    # no tokenizer next to the qwen2 config: AutoTokenizer would turn it into a Qwen2Tokenizer (see demo.py)
    assert not list(hf.glob("tokenizer*"))
    tok = AutoTokenizer.from_pretrained(demo["tokenizer"])
    text = tok.apply_chat_template([{"role": "user", "content": "3+4="}], add_generation_prompt=True, tokenize=False)
    # by the id table of megatron_dapo/testing/tokenizer.py: <|im_start|>=1 user=4 \n=8 '3'=28 '+'=20 '4'=29 '='=38
    # <|im_end|>=2 assistant=5
    assert tok.encode(text, add_special_tokens=False) == [1, 4, 8, 28, 20, 29, 38, 2, 8, 1, 5, 8]
    assert demo["num_answers"] == 9


def test_warm_start_trains_only_the_output_layer(demo: dict) -> None:
    trained = load_file(str(Path(demo["hf_model"]) / "model.safetensors"))
    fresh = make_tiny_hf_model("qwen2", seed=0, vocab_size=104, **MODEL_SHAPE).state_dict()
    assert set(trained) == set(fresh)
    changed = sorted(k for k in fresh if not torch.equal(trained[k], fresh[k]))
    assert changed == ["lm_head.weight"]


def test_warm_start_fixes_the_format_not_the_answers(demo: dict) -> None:
    tok = AutoTokenizer.from_pretrained(demo["tokenizer"])
    model = AutoModelForCausalLM.from_pretrained(demo["hf_model"]).eval()
    rows = make_table_rows(4)
    prompts = torch.tensor(
        [
            tok.encode(
                tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                add_special_tokens=False,
            )
            for r in rows
        ]
    )
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(9)]
    truth = torch.tensor([int(r["reward_model"]["ground_truth"]) for r in rows])
    with torch.no_grad():
        first = torch.softmax(model(input_ids=prompts).logits[:, -1].double(), -1)
        # after any answer digit the next token should be EOS
        then = torch.softmax(
            model(input_ids=torch.cat([prompts, torch.tensor(digits)[truth][:, None]], 1)).logits[:, -1].double(), -1
        )
    p_digits = first[:, digits]
    assert p_digits.sum(-1).mean() > 0.95  # the format: one answer digit ...
    assert then[:, tok.eos_token_id].mean() > 0.9  # ... then stop
    p_correct = p_digits[torch.arange(len(rows)), truth]
    assert 0.07 < p_correct.mean() < 0.16  # near 1/9: the answers are not taught
    greedy = p_digits.argmax(-1)
    assert (greedy == truth).float().mean() <= 0.3


def test_warm_start_needs_an_untied_output_layer(tiny_tokenizer) -> None:
    shape = dict(MODEL_SHAPE, tie_word_embeddings=True)
    model = make_tiny_hf_model("qwen2", seed=0, vocab_size=len(tiny_tokenizer), **shape)
    with pytest.raises(ValueError, match="untied"):
        format_warm_start(model, tiny_tokenizer, ["1+1="], ["2"], steps=1, seed=0)
