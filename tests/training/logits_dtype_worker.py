"""One process: the logits a bf16 actor hands to its loss hook stay in bf16 (megatron-core's ``Float16Module``
would upcast them to a second, fp32 copy), and the log-probs are those of the fp32-upcast logits."""

from __future__ import annotations

import argparse
import json

import megatron_dapo.actor.actor as actor_module
from megatron_dapo.actor.actor import MegatronActor
from megatron_dapo.batch import TrainBatch
from megatron_dapo.parallel import teardown
from tests.distributed.loss_batch import TEMPERATURE, make_batch
from tests.training.common import build_actor, tiny_arch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    seen: list[str] = []
    original = actor_module.response_log_probs

    def spy(logits, *a, **kw):
        seen.append(str(logits.dtype))
        return original(logits, *a, **kw)

    actor_module.response_log_probs = spy
    report = {}
    cfg, chunks = build_actor("bf16", dist_opt=False)
    actor = MegatronActor(chunks, tiny_arch().vocab_size, cfg.actor)
    batch = TrainBatch(**make_batch())
    lp = actor.compute_log_probs(batch, TEMPERATURE)["log_probs"]
    report["logits_dtypes"] = sorted(set(seen))
    # The same forward with megatron-core's default fp32 output: the log-probs must not change (bf16 -> fp32 is exact).
    actor_module.response_log_probs = original
    forward = chunks[0].forward
    chunks[0].forward = lambda *a, **kw: forward(*a, **{**kw, "fp32_output": True})
    lp32 = actor.compute_log_probs(batch, TEMPERATURE)["log_probs"]
    report["max_diff_vs_fp32_output"] = float((lp - lp32).abs().max())
    report["tokens"] = int(batch.response_mask.sum())
    with open(args.out, "w") as f:
        json.dump(report, f)
    teardown(None)  # a live gloo group at interpreter exit can abort the process ("terminate called ...")


if __name__ == "__main__":
    main()
