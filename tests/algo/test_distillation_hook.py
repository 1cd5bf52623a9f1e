"""On-policy distillation in the training ranks (2 processes, one launch: ``distillation_hook_worker.py``).

* The distillation term through the actor's loss hook (megatron-core's ``forward_backward_func``): at TP 2 over 3
  micro-batches and at DP 2 over 1-row micro-batches, the update's loss and gradients equal an independent float64
  HF-transformers computation of the whole batch: the student's log-probs from HF, ``distillation_loss`` with the
  whole batch's normalisers, joined to the task's policy loss (``dapo_loss``) as ``combine_with_task_loss`` says.
* Two teachers (``distill/teacher.DistillationTeachers``, DP 2), built as the trainer builds them (the student's
  tokenizer checked, each its own architecture, one loaded from its HF weights, one from its converted Megatron
  checkpoint), score the rows their ``data_source`` routes to them; each row's ``teacher_log_probs`` equal its
  teacher's log-probs of the sampled tokens computed with HF transformers (float64, temperature 1), 0 outside the
  response."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch

from megatron_dapo.algo.loss import LossNormalisers, dapo_loss
from megatron_dapo.config import load_config
from megatron_dapo.distill.losses import DistillationInputs
from megatron_dapo.distill.objective import Normalisers, combine_with_task_loss, distillation_loss
from megatron_dapo.models.families import model_arch_from_hf, param_mappings
from megatron_dapo.testing.tiny_models import make_tiny_hf_model
from megatron_dapo.testing.tokenizer import build_tiny_tokenizer
from megatron_dapo.weights.convert import convert_hf_to_mcore
from megatron_dapo.weights.layout import hf_to_mcore
from tests.algo.distillation_hook_worker import CASES, KEYS, teacher_log_probs
from tests.distributed.loss_batch import HF_KWARGS, TEMPERATURE, make_batch
from tests.distributed.test_loss_invariance import compare_grads
from tests.helpers.torchrun import run_torchrun

WORKER = Path(__file__).with_name("distillation_hook_worker.py")
LAYOUTS = {"tp2_3mb": "--tp 2 --micro 3", "dp2_1mb": "--micro 1"}
SHAPES = {
    "math": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),
    "code": dict(hidden_size=96, num_layers=3, num_heads=6, num_kv_heads=3, intermediate_size=160,
                 tie_word_embeddings=False),
}  # fmt: skip


def make_teachers(root: Path) -> dict:
    """Two tiny teachers (HF directories with the tokenizer; the second also converted), as float64 HF models."""
    tokenizer = build_tiny_tokenizer(root / "tokenizer")
    models = {}
    for seed, (key, shape) in enumerate(SHAPES.items()):
        model = make_tiny_hf_model("qwen2", seed=seed, vocab_size=len(tokenizer), **shape)
        model.save_pretrained(root / key, safe_serialization=True)
        for f in (root / "tokenizer").iterdir():  # model_path holds the tokenizer (verl's teacher model_path)
            shutil.copy(f, root / key / f.name)
        models[key] = model.double()
    convert_hf_to_mcore(root / "code", root / "code_mcore")
    return models


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("distillation_hook")
    teachers = make_teachers(root / "teachers")
    layouts = [arg for name, args in LAYOUTS.items() for arg in ("--layout", name, args)]
    args = layouts + ["--out", str(root), "--teachers", str(root / "teachers")]
    run_torchrun(WORKER, 2, args, port=29302, timeout=600)
    out = {name: torch.load(root / name / "result.pt") for name in LAYOUTS}
    out["teachers"] = {"models": teachers, **torch.load(root / "teachers" / "scored.pt", weights_only=False)}
    return out


@functools.cache
def reference(case: str) -> dict:
    """Whole-batch float64 loss and gradients with HF transformers, mapped to full Megatron tensor names."""
    loss_cfg, agg = CASES[case]
    hf = make_tiny_hf_model("qwen2", seed=0, **HF_KWARGS).double()
    arch = model_arch_from_hf(hf.config.to_dict())
    b = make_batch()
    width = b["responses"].shape[1]
    log_probs = torch.zeros(b["responses"].shape, dtype=torch.float64)
    rows = []
    for i in range(b["responses"].shape[0]):
        p = b["prompts"][i][b["prompt_mask"][i].bool()]
        r = b["responses"][i][b["response_mask"][i].bool()]
        rows.append((p, r))
    for i, (p, r) in enumerate(rows):
        logp = torch.log_softmax(hf(torch.cat([p, r]).unsqueeze(0)).logits[0] / TEMPERATURE, -1)
        for t in range(len(r)):
            log_probs[i, t] = logp[len(p) - 1 + t, r[t]]
    mask = b["loss_mask"].double()
    actor = load_config(None, ["actor.clip_ratio_c=10.0", f"actor.loss_agg_mode={agg}"]).actor
    norm = LossNormalisers.of(mask, max_response_length=width)
    task, _ = dapo_loss(
        log_probs,
        None,
        loss_mask=mask,
        response_mask=b["response_mask"].double(),
        advantages=b["advantages"].double(),
        cfg=actor,
        norm=norm,
        old_log_probs=b["old_log_probs"].double(),
    )
    inputs = DistillationInputs(
        mask, loss_cfg, student_log_probs=log_probs, teacher_log_probs=teacher_log_probs(b).double()
    )
    distill, metrics = distillation_loss(
        inputs, agg, Normalisers(norm.token_count, norm.seq_count, width), old_log_probs=b["old_log_probs"].double()
    )
    combine_with_task_loss(task, distill, loss_cfg).backward()
    params = dict(hf.named_parameters())
    grads = {
        m.mcore: hf_to_mcore(m, [params[n].grad for n in m.hf], arch, arch.vocab_size) for m in param_mappings(arch)
    }
    return {"task": float(task.detach()), "metrics": {k: float(v) for k, v in metrics.items()}, "grads": grads}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_hook_loss_and_gradients_match_the_whole_batch_reference(results, layout, case):
    got, want = results[layout][case], reference(case)
    metrics = got["metrics"]
    assert metrics["actor/pg_loss"] == pytest.approx(want["task"], rel=1e-5, abs=1e-7)
    for name in ("distillation/loss", "distillation/loss_min", "distillation/loss_max"):
        assert metrics[name] == pytest.approx(want["metrics"][name], rel=1e-5, abs=1e-6), name
    compare_grads(got["grads"], want["grads"], 100, tol=1e-5)


@torch.no_grad()
def test_each_row_is_scored_by_its_teacher(results):
    scored = results["teachers"]
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
