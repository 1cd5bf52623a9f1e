"""``model.attention_backend=sdpa`` (torch's scaled_dot_product_attention, ``models/sdpa_attention.py``) gives
megatron-core's ``DotProductAttention`` logits and gradients, fp32, for every attention-only family in
``models/families.py``: GQA, the actor's causal mask, no mask, a left-padded batch with fully masked rows, and packed
THD sequences (which DotProductAttention refuses; compared with its right-padded batch). One process; see the
worker's docstring. The hybrids' full-attention layers (Qwen3.5 / Qwen3-Next, which take no packed sequences) run
through SDPA against transformers in ``tests/models/test_models_qwen35.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_dapo.models.families import FAMILIES
from tests.helpers import run_torchrun
from tests.models.sdpa_attention_worker import ATTENTION_ONLY

WORKER = Path(__file__).with_name("sdpa_attention_worker.py")
PORT = 29815  # this area's range is 29800-29849
# max |Δ| / max |reference|, fp32. Measured: dense families logits <= 4.4e-7, grads <= 7.2e-7; MoE logits <= 3.5e-6,
# grads <= 7.6e-6 (the routers amplify fp32 rounding: there the local backend itself is 3.5e-6 off a float64 run,
# SDPA 2.7e-6).
LOGITS_RTOL = {False: 1e-6, True: 1e-5}  # by FamilySpec.moe
GRAD_RTOL = {False: 2e-6, True: 2e-5}
# How SDPA must have been called per batch: the plain causal mask never materialised, the padded one passed.
EXPECTED_CALLS = {
    "causal": ["causal"],
    "no_mask": ["causal"],
    "padded": ["mask"],
    "packed": ["thd-causal"],
}


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sdpa_attention")
    run_torchrun(WORKER, 1, ["--out", str(out)], port=PORT, timeout=420)
    return json.loads((out / "result.json").read_text())


@pytest.mark.parametrize("family", ATTENTION_ONLY)
def test_sdpa_matches_dot_product_attention(result, family):
    r = result[family]
    moe = FAMILIES[family].moe
    assert r["built"] == {"sdpa": ["SDPAttention"], "local": ["DotProductAttention"]}
    assert r["gqa"][0] > r["gqa"][1] > 0  # more query heads than KV groups
    for batch, calls in EXPECTED_CALLS.items():
        b = r[batch]
        where = f"{family} {batch}: {b}"
        assert b["calls"] == calls and b["fallbacks"] == 0 and b["ref_calls"] == ["DotProductAttention"], where
        assert b["logits_ref_absmax"] > 0.1 and b["grad_ref_absmax"] > 0, where
        assert b["logits_max_abs"] <= LOGITS_RTOL[moe] * b["logits_ref_absmax"], where
        assert b["grads_compared"][0] == b["grads_compared"][1] > 10, where
        assert b["grad_max_abs"] <= GRAD_RTOL[moe] * b["grad_ref_absmax"], where


def test_attention_backend_key():
    """``model.attention_backend``: sdpa by default, local on request, anything else refused by name."""
    import dataclasses

    from megatron_dapo.config import ConfigError, config_problems, load_config, raise_if_any

    assert load_config(None, []).model.attention_backend == "sdpa"
    assert load_config(None, ["model.attention_backend=local"]).model.attention_backend == "local"
    with pytest.raises(ConfigError, match="model.attention_backend"):
        raise_if_any(config_problems(load_config(None, ["model.attention_backend=flash"])))
    cfg = load_config(None, [])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention_backend="flash"))
    assert any(p.startswith("model.attention_backend='flash': expected sdpa or local") for p in config_problems(cfg))
