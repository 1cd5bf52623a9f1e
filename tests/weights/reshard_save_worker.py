"""torchrun worker: verify a checkpoint at a layout different from the converted one, then save the live model.

Runs ``tools/checkpoint_convert/verify.py``'s check (load with reshard-on-load, forward through megatron-core,
compare logits with HF), then ``save_mcore_checkpoint`` from that layout, and writes per-rank results as JSON.

    torchrun --nproc_per_node=N reshard_save_worker.py --out DIR --save-dir S <verify.py arguments>
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    import torch.distributed as dist

    from megatron_dapo.parallel import destroy_model_parallel
    from megatron_dapo.weights.mcore_checkpoint import save_mcore_checkpoint

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--save-dir", required=True)
    own, rest = ap.parse_known_args()
    spec = importlib.util.spec_from_file_location("verify", REPO / "tools" / "checkpoint_convert" / "verify.py")
    verify = importlib.util.module_from_spec(spec)
    sys.modules["verify"] = verify  # dataclasses resolve the module's string annotations through sys.modules
    spec.loader.exec_module(verify)
    args = verify.parse_args(rest)
    res = verify.run_verify(args)
    saved = save_mcore_checkpoint(res.chunks, res.arch, own.save_dir, hf_config_dir=args.hf_dir)
    rank = dist.get_rank()
    result = {
        "rank": rank,
        "max_abs_logits_diff": res.max_abs_diff,
        "same_layout": res.load_report["same_layout"],
        "files": res.load_report["files"],
        "saved": str(saved),
    }
    (Path(own.out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
