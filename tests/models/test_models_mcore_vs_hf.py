"""Megatron-core GPTModel (our builder + layout module) vs HF transformers: logits and gradients, fp32.

One torchrun per parallel layout runs ``mcore_vs_hf_worker.py`` over all families (qwen2 with tied embeddings,
qwen3 with qk-norm and head_dim != hidden/heads, llama with llama3 rope scaling); the worker records numbers and
this module asserts on them. See the worker's docstring for what is computed.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import run_torchrun
from tests.models.mcore_vs_hf_worker import BATCH, FAMILIES, SEQ, VOCAB, family_config_kwargs

WORKER = Path(__file__).with_name("mcore_vs_hf_worker.py")
LOGITS_ATOL = 1e-4  # max |Δ| of fp32 logits on the non-pad positions
GRAD_RTOL = 1e-4  # max |Δ| / max |g_hf| per parameter gradient
LOSS_ATOL = 1e-5

# (id, tp, pp, vpp, sp, world, slow, port) — ports from this area's range 29800-29849.
LAYOUTS = [
    ("tp1-pp1-dp2", 1, 1, 0, False, 2, False, 29800),
    ("tp2-pp1", 2, 1, 0, False, 2, False, 29801),
    ("tp2-pp1-sp", 2, 1, 0, True, 2, False, 29802),
    ("tp1-pp2", 1, 2, 0, False, 2, False, 29803),
    ("tp1-pp2-vpp2", 1, 2, 2, False, 2, False, 29804),
    ("tp2-pp2-sp", 2, 2, 0, True, 4, True, 29805),
]


def _expected_names(family: str) -> list[str]:
    from megatron_dapo.models.families import model_arch_from_hf, param_mappings
    from megatron_dapo.testing.tiny_models import tiny_hf_config

    arch = model_arch_from_hf(tiny_hf_config(family, **family_config_kwargs(family)).to_dict())
    return [m.mcore for m in param_mappings(arch)]


def _check_family(family: str, reports: list[dict], tp: int, pp: int, world: int) -> list[str]:
    """All problems found for one family (empty = pass); every number is checked on every rank."""
    problems = []
    dp = world // (tp * pp)
    tied = family_config_kwargs(family)["tie_word_embeddings"]
    fam = [r["families"][family] for r in reports]

    # Every Megatron parameter was compared, on every rank that holds a slice of it.
    counts = Counter(g["mcore"] for f in fam for g in f["grads"])
    for name in _expected_names(family):
        # Tied embeddings with PP > 1: the last stage holds a second copy (output_layer.weight) of the embedding.
        copies = 2 if (tied and pp > 1 and name == "embedding.word_embeddings.weight") else 1
        seen = counts.pop(name, 0)
        if seen != tp * dp * copies:
            problems.append(f"{name}: compared on {seen} ranks, expected {tp * dp * copies}")
    if counts:
        problems.append(f"unexpected parameters compared: {sorted(counts)}")
    if tied and pp > 1:
        tied_copies = [g for f in fam for g in f["grads"] if g["local"] == "output_layer.weight"]
        if len(tied_copies) != tp * dp:
            problems.append(f"tied output_layer copy compared on {len(tied_copies)} ranks, expected {tp * dp}")

    for r, f in zip(reports, fam):
        where = f"rank {r['rank']} (tp {r['tp_rank']}, pp {r['pp_rank']}, dp {r['dp_rank']})"
        for g in f["grads"]:
            # A zero reference would make the relative check vacuous.
            if not g["ref_absmax"] > 0:
                problems.append(f"{where} {g['local']}: HF gradient is all zeros")
            if not g["rel_err"] <= GRAD_RTOL:
                problems.append(f"{where} {g['local']} (chunk {g['chunk']}): grad rel err {g['rel_err']:.3g}")
        if f["padded_vocab"] != (256 if tp == 2 else 128):
            problems.append(f"{where}: padded vocab {f['padded_vocab']}")
        if r["pp_rank"] == pp - 1:
            # The model's logits carry the padded columns; the comparison (and the loss) uses the true vocab.
            if f["local_vocab_width"] != [f["padded_vocab"] // tp]:
                problems.append(f"{where}: local logits width {f['local_vocab_width']}")
            for mb in ("0", "1"):
                lg = f["logits"].get(mb)
                if lg is None or lg["shape"] != [BATCH, SEQ, VOCAB] or not lg["max_abs"] <= LOGITS_ATOL:
                    problems.append(f"{where} micro-batch {mb}: logits {lg}")
                loss = f["losses"].get(mb)
                if loss is None or not abs(loss["mcore"] - loss["hf"]) <= LOSS_ATOL:
                    problems.append(f"{where} micro-batch {mb}: loss {loss}")
            dp_diff = f.get("dp_plain_logits_max_diff")
            if dp > 1 and dp_diff != 0.0:
                problems.append(f"{where}: DP ranks' logits for the same batch differ by {dp_diff}")
        elif f["logits"]:
            problems.append(f"{where}: logits reported on a non-last pipeline stage")
    return problems


@pytest.mark.parametrize(
    "tp,pp,vpp,sp,world,port",
    [
        pytest.param(tp, pp, vpp, sp, world, port, id=name, marks=[pytest.mark.slow] if slow else [])
        for name, tp, pp, vpp, sp, world, slow, port in LAYOUTS
    ],
)
def test_megatron_matches_hf_logits_and_grads(tmp_path, tp, pp, vpp, sp, world, port):
    args = ["--tp", str(tp), "--pp", str(pp), "--vpp", str(vpp), "--out", str(tmp_path)] + (["--sp"] if sp else [])
    run_torchrun(WORKER, world, args, port=port, timeout=300)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert sorted(r["dp_size"] for r in reports) == [world // (tp * pp)] * world
    problems = {fam: _check_family(fam, reports, tp, pp, world) for fam in FAMILIES}
    problems = {fam: p for fam, p in problems.items() if p}
    assert not problems, json.dumps(problems, indent=1)
