"""The runtime check behind a planned ``direct`` transport (``rollout/sync.WeightSync._choose_transport``): the plan
says direct (CPU, no LoRA, KV heads that split), but the live engine cannot take it — here the stand-in engine
(``megatron_dapo/testing/standin_engine.py``), which has no ``local_model`` — so every rank agrees on ``reload``, the
lowest rank with the reason logs one warning naming it, and the metrics say ``direct_fallback``. The weights still
arrive whole: the engine's tensors are compared with the HF checkpoint the actor was loaded from.

Two torchrun processes (TP 1, DP 2), this file being their worker (``main``); real megatron-core, the real sync.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from tests.helpers import run_torchrun
from tests.helpers.engines import engine_sections

PORT = 29790
WARNING = (
    "weight sync: planned direct, reload instead (rank 0: StandInEngine has no local_model (not a colocated vLLM"
    " engine))"
)


def test_planned_direct_falls_back_to_reload_once_with_one_warning(tiny_checkpoints, tmp_path):
    out = tmp_path / "report.json"
    stdout = run_torchrun(
        __file__, nproc=2, args=["--hf-dir", str(tiny_checkpoints["qwen2"]), "--out", str(out)], port=PORT
    )
    reports = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    for rank, rep in enumerate(reports):
        assert rep["planned"] == "direct", rep["reason"]  # what the plan alone can tell
        for metrics in (rep["first"], rep["second"]):
            assert (metrics["direct"], metrics["direct_fallback"]) == (0.0, 1.0)
            assert metrics["bytes"] == rep["hf_bytes"]  # every HF tensor once, full size (the reload transport)
        # The engine holds exactly the checkpoint's tensors: every name, every byte, every value (fp32 throughout).
        assert rep["received"] == rep["hf_bytes"] and rep["max_abs_diff"] == 0.0, rank
        assert rep["updates"] == 2
        # Decided once: one warning on the lowest rank that had the reason, none on the second sync.
        assert rep["warnings"] == ([WARNING] if rank == 0 else []), stdout[-2000:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    # heavy: megatron-core and torch.distributed, in the worker processes only
    from safetensors.torch import load_file

    from megatron_dapo.config import load_config
    from megatron_dapo.config.plan import build_plan
    from megatron_dapo.models.builder import build_gpt_chunks
    from megatron_dapo.models.families import model_arch_from_hf, param_mappings
    from megatron_dapo.parallel import init_distributed, init_model_parallel, teardown
    from megatron_dapo.rollout.weight_transfer.factory import build_weight_sync
    from megatron_dapo.testing.standin_engine import StandInEngine
    from megatron_dapo.weights.layout import hf_to_mcore, padded_vocab_size
    from megatron_dapo.weights.model_io import load_full_tensors

    cfg = load_config(
        None,
        [
            "parallel.platform=cpu",
            "model.params_dtype=fp32",
            "rollout.kv_cache_memory_mb=8",
            "data.max_prompt_length=12",
            "data.max_response_length=8",
            f"trainer.output_dir={os.path.dirname(args.out)}",
        ],
    )
    info, platform = init_distributed(cfg.parallel)
    init_model_parallel(cfg.parallel, seed=1)
    arch = model_arch_from_hf(args.hf_dir)
    plan = build_plan(cfg, arch, info.world_size, platform)
    chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    hf = load_file(os.path.join(args.hf_dir, "model.safetensors"))
    pv = padded_vocab_size(arch.vocab_size, cfg.model.make_vocab_size_divisible_by, 1)
    load_full_tensors(chunks, arch, lambda m: hf_to_mcore(m, [hf[n] for n in m.hf], arch, pv))
    engine = StandInEngine(*engine_sections(cfg), args.hf_dir, platform, pad_token_id=0, eos_token_ids=[1], plan=plan)

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("megatron_dapo.rollout.sync").addHandler(handler)
    sync = build_weight_sync(engine, arch, plan, cfg.rollout, cfg.actor.lora)
    first, second = sync.sync(chunks), sync.sync(chunks)
    names = [n for m in param_mappings(arch) for n in m.hf]
    report = {
        "planned": plan.weight_transport,
        "reason": plan.weight_transport_reason,
        "first": first,
        "second": second,
        "hf_bytes": float(sum(hf[n].numel() * hf[n].element_size() for n in names)),
        "received": float(sum(engine.last_update.values())),
        "max_abs_diff": max(float((engine.weights[n] - hf[n]).abs().max()) for n in names),
        "updates": engine.weight_updates,
        "warnings": warnings,
    }
    Path(f"{args.out}.rank{info.rank}.json").write_text(json.dumps(report))
    teardown(engine)


if __name__ == "__main__":
    sys.exit(main())
