"""Two teachers in the training ranks (``distill/teacher.DistillationTeachers``, 2 processes at DP 2): built as the
trainer builds them (the student's tokenizer checked, each its own architecture, one loaded from its HF weights, one
from its converted Megatron checkpoint), they score the rows their ``data_source`` routes to them; each row's
``teacher_log_probs`` equal its teacher's log-probs of the sampled tokens computed with HF transformers (float64,
temperature 1), 0 outside the response."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from megatron_dapo.testing.tiny_models import make_tiny_hf_model
from megatron_dapo.testing.tokenizer import build_tiny_tokenizer
from megatron_dapo.weights.convert import convert_hf_to_mcore
from tests.algo.distillation_teachers_worker import KEYS
from tests.helpers.torchrun import run_torchrun

WORKER = Path(__file__).with_name("distillation_teachers_worker.py")
SHAPES = {
    "math": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),
    "code": dict(hidden_size=96, num_layers=3, num_heads=6, num_kv_heads=3, intermediate_size=160,
                 tie_word_embeddings=False),
}  # fmt: skip


@pytest.fixture(scope="module")
def scored(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("teachers")
    tokenizer = build_tiny_tokenizer(root / "tokenizer")
    models = {}
    for seed, (key, shape) in enumerate(SHAPES.items()):
        model = make_tiny_hf_model("qwen2", seed=seed, vocab_size=len(tokenizer), **shape)
        model.save_pretrained(root / key, safe_serialization=True)
        for f in (root / "tokenizer").iterdir():  # model_path holds the tokenizer (verl's teacher model_path)
            shutil.copy(f, root / key / f.name)
        models[key] = model.double()
    convert_hf_to_mcore(root / "code", root / "code_mcore")
    run_torchrun(WORKER, 2, ["--root", str(root)], port=29303, timeout=600)
    return {"models": models, **torch.load(root / "scored.pt", weights_only=False)}


@torch.no_grad()
def test_each_row_is_scored_by_its_teacher(scored):
    batch, got = scored["batch"], scored["teacher_log_probs"]
    for i, key in enumerate(KEYS):
        p = batch.prompts[i][batch.prompt_mask[i].bool()]
        r = batch.responses[i][batch.response_mask[i].bool()]
        logp = torch.log_softmax(scored["models"][key](torch.cat([p, r]).unsqueeze(0)).logits[0], -1)
        want = torch.stack([logp[len(p) - 1 + t, r[t]] for t in range(len(r))])
        torch.testing.assert_close(got[i, : len(r)].double(), want, rtol=1e-5, atol=1e-5, msg=f"row {i} ({key})")
        assert torch.all(got[i, len(r) :] == 0)
    other = {"math": "code", "code": "math"}
    i = KEYS.index("code")  # the other teacher would have scored it differently: the routing is what matched
    p, r = batch.prompts[i][batch.prompt_mask[i].bool()], batch.responses[i][batch.response_mask[i].bool()]
    logp = torch.log_softmax(scored["models"][other["code"]](torch.cat([p, r]).unsqueeze(0)).logits[0], -1)
    assert (got[i, 0].double() - logp[len(p) - 1, r[0]]).abs() > 1e-3
    assert scored["metrics"]["perf/padding_ratio/teacher"] >= 1.0
