"""Megatron-core GPTModel (our builder + layout module) vs HF transformers: logits and gradients, fp32.

``mcore_vs_hf_worker.py`` runs every layout over all families (qwen2 with tied embeddings, qwen3 with qk-norm and
head_dim != hidden/heads, llama with llama3 rope scaling); the worker records numbers and this module asserts on
them, one test per layout. All 2-process layouts share one torchrun (process start-up dominates the cost); the
4-process layout has its own. See the worker's docstring for what is computed.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import run_torchrun
from tests.models.mcore_vs_hf_worker import BATCH, FAMILIES, SEQ, VOCAB, family_config_kwargs, parse_layout

WORKER = Path(__file__).with_name("mcore_vs_hf_worker.py")
LOGITS_ATOL = 1e-4  # max |Δ| of fp32 logits on the non-pad positions
GRAD_RTOL = 1e-4  # max |Δ| / max |g_hf| per parameter gradient
LOSS_ATOL = 1e-5
HELPER_ATOL = 1e-5  # vocab_parallel_log_probs log-probs / entropy / grads vs HF in float64

# (layout as the worker parses it, processes). tp1-pp1 on 2 processes is DP=2. Ports come from this area's range
# 29800-29849: the 2-process layouts share one run on 29800; each 4-process layout (marked slow) runs on its own.
LAYOUTS = [
    ("tp1-pp1", 2),
    ("tp2-pp1", 2),
    ("tp2-pp1-sp", 2),
    ("tp1-pp2", 2),
    ("tp1-pp2-vpp2", 2),
    ("tp2-pp2-sp", 4),
]
WORLD4_PORTS = {"tp2-pp2-sp": 29805}


def _expected_names(family: str) -> list[str]:
    from megatron_dapo.models.families import model_arch_from_hf, param_mappings
    from megatron_dapo.testing.tiny_models import tiny_hf_config

    arch = model_arch_from_hf(tiny_hf_config(family, **family_config_kwargs(family)).to_dict())
    return [m.mcore for m in param_mappings(arch)]


def _helper_ok(h: dict, width: int) -> bool:
    """``vocab_parallel_log_probs`` on a real logits shard: matches HF and ignores the padded columns entirely."""
    return (
        h["logp_max_abs"] <= HELPER_ATOL
        and h["entropy_max_abs"] <= HELPER_ATOL
        and h["grad_max_abs"] <= HELPER_ATOL
        and h["real_columns"] + h["pad_columns"] == width
        and h["pad_columns"] > 0  # this layout has padding to leak (vocab 100 padded to 128 x TP)
        and h["pad_grad_absmax"] == 0.0
        and h["pad_poison_change"] == 0.0
    )


def _check_family(family: str, reports: list[dict], layout: dict, world: int) -> list[str]:
    """All problems found for one family (empty = pass); every number is checked on every rank."""
    problems = []
    tp, pp = layout["tp"], layout["pp"]
    dp = world // (tp * pp)
    tied = family_config_kwargs(family)["tie_word_embeddings"]
    fam = [r["families"][family] for r in reports]
    built = {"chunks": layout["vpp"] or 1, "sequence_parallel": layout["sp"], "tp": tp, "pp": pp}
    for r, f in zip(reports, fam):
        chunks_compared = sorted({g["chunk"] for g in f["grads"]})
        if f["built"] != built or chunks_compared != list(range(built["chunks"])):
            problems.append(
                f"rank {r['rank']}: built {f['built']}, grads from chunks {chunks_compared}; expected {built}"
            )

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
            if "pad_rows" in g:
                # TP rank r holds rows [r*n, (r+1)*n) of the padded vocabulary; rows >= VOCAB are padding.
                n = f["padded_vocab"] // tp
                expected_pad = n - max(0, min(n, VOCAB - r["tp_rank"] * n))
                if g["pad_rows"] != expected_pad or g["pad_rows_grad_absmax"] != 0.0:
                    problems.append(
                        f"{where} {g['local']}: padded rows {g['pad_rows']} (expected {expected_pad}), "
                        f"their grad max {g['pad_rows_grad_absmax']}"
                    )
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
                helper = f["vocab_helper"].get(mb)
                if helper is None or not _helper_ok(helper, f["local_vocab_width"][0]):
                    problems.append(f"{where} micro-batch {mb}: vocab_parallel_log_probs {helper}")
            dp_diff = f.get("dp_plain_logits_max_diff")
            if dp > 1 and dp_diff != 0.0:
                problems.append(f"{where}: DP ranks' logits for the same batch differ by {dp_diff}")
        elif f["logits"]:
            problems.append(f"{where}: logits reported on a non-last pipeline stage")
    return problems


@pytest.fixture(scope="module")
def world2_reports(tmp_path_factory) -> list[dict]:
    """One 2-process torchrun for every 2-process layout (the worker rebuilds the parallel state between them)."""
    out = tmp_path_factory.mktemp("mcore_vs_hf_world2")
    layouts = ",".join(name for name, world in LAYOUTS if world == 2)
    run_torchrun(WORKER, 2, ["--layouts", layouts, "--out", str(out)], port=29800, timeout=480)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize(
    "name,world",
    [pytest.param(name, world, id=name, marks=[pytest.mark.slow] if world > 2 else []) for name, world in LAYOUTS],
)
def test_megatron_matches_hf_logits_and_grads(request, tmp_path, name, world):
    lay = parse_layout(name)
    if world == 2:
        runs = request.getfixturevalue("world2_reports")
    else:
        args = ["--layouts", name, "--out", str(tmp_path)]
        run_torchrun(WORKER, world, args, port=WORLD4_PORTS[name], timeout=300)
        runs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    reports = [run["layouts"][name] for run in runs]
    assert sorted(r["rank"] for r in reports) == list(range(world))
    assert [r["dp_size"] for r in reports] == [world // (lay["tp"] * lay["pp"])] * world
    problems = {fam: _check_family(fam, reports, lay, world) for fam in FAMILIES}
    problems = {fam: p for fam, p in problems.items() if p}
    assert not problems, json.dumps(problems, indent=1)
