"""Reward scoring overlapped with generation (``reward.overlap_generation``) against scoring after it, on 2 CPU
processes: the same model, data, seeds and reward, one launch each, one after the other.

Task: ``benchmarks/async_rl.py``'s long-tail one (the quickstart's tiny model warm-started for 20 steps, a 40-token
budget: most responses end within a few tokens, some run to the budget), so responses end at many different engine
steps, as in reasoning RL. The reward is the demo's scorer behind a verifier's latency: each call waits
``--delay-ms`` (a sandbox run or a remote judge: time off the CPU), or with ``--busy`` spins the CPU that long (a
CPU-bound checker, which on this 2-core box competes with vLLM for the cores). ``reward.num_workers`` processes
score (``--workers``).

Per mode it prints the steady steps' mean ``timing_s/gen``, ``timing_s/reward`` (with the overlap: what was left
when generation returned), their sum, the step and ``reward/scored_during_gen``. Last line:
``overlap_vs_sequential=<(gen + reward) overlapped ÷ (gen + reward) after> reward_hidden=<1 - reward left ÷ reward
after>``.

    python benchmarks/reward_overlap.py --steps 6 --delay-ms 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_rl import prepare, run_mode  # noqa: E402 - the long-tail task and its launch, shared

SCORER = """
import time
from megatron_dapo.tasks.arithmetic import compute_score as _score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    end = time.perf_counter() + {delay_s}
    if {busy}:
        while time.perf_counter() < end:
            pass
    else:
        time.sleep({delay_s})
    return _score(data_source, solution_str, ground_truth, extra_info)
"""


def summarise(name: str, rows: list[dict]) -> dict[str, float]:
    steady = rows[1:] or rows

    def mean(key: str) -> float:
        return statistics.mean(r.get(key, 0.0) for r in steady)

    out = {k: mean(f"timing_s/{k}") for k in ("gen", "reward", "step")}
    out["scored_during_gen"] = mean("reward/scored_during_gen")
    out["responses"] = mean("response_length/mean")
    print(
        f"mode={name:10s} gen_s={out['gen']:.3f} reward_s={out['reward']:.3f}"
        f" gen+reward_s={out['gen'] + out['reward']:.3f} step_s={out['step']:.3f}"
        f" scored_during_gen={out['scored_during_gen']:.3f}"
        f" response_len_mean={out['responses']:.1f}"
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--delay-ms", type=float, default=20.0, help="each reward call's latency")
    ap.add_argument("--busy", action="store_true", help="spin the CPU for the delay instead of waiting")
    ap.add_argument("--workers", type=int, default=2, help="reward.num_workers")
    ap.add_argument("--port", type=int, default=29630)
    args = ap.parse_args()

    results = {}
    with tempfile.TemporaryDirectory(prefix="reward-overlap-") as tmp:
        demo = prepare(Path(tmp))
        scorer = Path(tmp) / "slow_scorer.py"
        scorer.write_text(SCORER.format(delay_s=args.delay_ms / 1000, busy=args.busy))
        common = [f"reward.custom_function.path={scorer}", f"reward.num_workers={args.workers}"]
        for i, overlap in enumerate((False, True)):
            name = "overlap" if overlap else "after"
            extra = [*common, f"reward.overlap_generation={str(overlap).lower()}"]
            rows = run_mode(demo, Path(tmp) / name, args.steps, str(args.port + 2 * i), extra)
            results[name] = summarise(name, rows)
    after, overlap = results["after"], results["overlap"]
    ratio = (overlap["gen"] + overlap["reward"]) / (after["gen"] + after["reward"])
    print(f"overlap_vs_sequential={ratio:.3f} reward_hidden={1 - overlap['reward'] / after['reward']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
