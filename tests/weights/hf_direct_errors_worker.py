"""torchrun worker (2 processes, PP=2): ``load_mcore_checkpoint`` straight from each HF directory of ``--cases``
(name → directory), into a fresh model each time; every rank writes ``<out>/rank<r>.json``: name → ``{"kind": ...}``
when it loaded, ``{"error": type, "message": ...}`` when it raised."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch.distributed as dist

from megatron_dapo.parallel import teardown


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    cases: dict[str, str] = json.loads(Path(args.cases).read_text())

    from megatron_dapo.config import load_config
    from megatron_dapo.models.builder import build_gpt_chunks
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.parallel import init_distributed, init_model_parallel
    from megatron_dapo.weights.loading import load_mcore_checkpoint

    hf_config = cases["intact"]
    overrides = [
        "parallel.pipeline_model_parallel_size=2",
        "parallel.platform=cpu",
        "model.params_dtype=fp32",
        f"model.hf_config_dir={hf_config}",
    ]
    cfg = load_config(None, overrides)
    init_distributed(cfg.parallel)
    init_model_parallel(cfg.parallel, seed=1)
    arch = model_arch_from_hf(hf_config)
    results: dict[str, dict] = {}
    for name, hf_dir in cases.items():
        chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
        try:
            results[name] = {"kind": load_mcore_checkpoint(chunks, arch, hf_dir)["kind"]}
        except Exception as e:  # what a user would read: recorded, compared by the test
            results[name] = {"error": type(e).__name__, "message": str(e)}
    (Path(args.out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    teardown(None)  # a live gloo group at interpreter exit can abort the process ("terminate called ...")
    print("WORKER_OK", flush=True)


if __name__ == "__main__":
    main()
