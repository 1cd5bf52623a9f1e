"""torchrun worker: several converter checks in one set of processes (one start-up of megatron-core + HF).

Reads a JSON list of cases and runs them in order on every rank:

* ``{"name", "kind": "main", "argv": [...]}`` — ``tools/checkpoint_convert/verify.py``'s ``main`` (its printed
  output and exit status, without tearing down the process group). Rank 0 prints ``=== case <name> rc=<rc>``
  after each, so the test can split stdout per case.
* ``{"name", "kind": "compare", "argv": [...], "hf_dir": ...}`` — the model at verify's layout loaded from the
  converted checkpoint (``run_verify``), then every parameter compared with the same model loaded straight from the
  HF directory; per-rank results go to ``<out>/<name>.rank<r>.json``.

    torchrun --nproc_per_node=N verify_worker.py --cases cases.json --out DIR
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _load_verify():
    spec = importlib.util.spec_from_file_location("verify", REPO / "tools" / "checkpoint_convert" / "verify.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["verify"] = module  # dataclasses resolve the module's string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def main() -> int:
    import torch
    import torch.distributed as dist

    from megatron_dapo.models.builder import build_gpt_chunks
    from megatron_dapo.parallel import destroy_model_parallel
    from megatron_dapo.weights.loading import load_mcore_checkpoint

    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True)
    ap.add_argument("--out", required=True)
    own = ap.parse_args()
    verify = _load_verify()
    cases = json.loads(Path(own.cases).read_text())
    for case in cases:
        if case["kind"] == "main":
            rc = verify.main(case["argv"], finalize=False)
            dist.barrier()
            if dist.get_rank() == 0:
                print(f"=== case {case['name']} rc={rc}", flush=True)
        else:
            args = verify.parse_args(case["argv"])
            res = verify.run_verify(args)
            direct = build_gpt_chunks(res.arch, res.cfg.model, res.cfg.parallel, res.cfg.actor)
            report = load_mcore_checkpoint(direct, res.arch, case["hf_dir"])
            differing, compared = [], 0
            for i, (a, b) in enumerate(zip(res.chunks, direct)):
                for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
                    compared += 1
                    if p.dtype != q.dtype or not torch.equal(p, q):
                        differing.append(f"chunk {i} {name}")
            result = {
                "max_abs_logits_diff": res.max_abs_diff,
                "loaded": [res.load_report["kind"], report["kind"]],
                "num_chunks": len(direct),
                "compared": compared,
                "differing": differing,
            }
            (Path(own.out) / f"{case['name']}.rank{dist.get_rank()}.json").write_text(json.dumps(result))
            dist.barrier()
            destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
