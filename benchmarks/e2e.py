"""End-to-end throughput of the tiny CPU config: steps/s, tokens/s and where a step's time goes, by phase.

Prepares the demo model and data in a temporary directory (or uses --demo-dir), runs ``launch/run_local.sh
configs/tiny_cpu.yaml`` for ``--steps`` steps on 2 processes without validation or checkpoints, and summarises
``metrics.jsonl`` (the first step is reported separately: it includes warm-up). Prints one line per phase and a last
line ``e2e_steps_per_s=<x> e2e_tokens_per_s=<y> gen_share=<z>``.

    python benchmarks/e2e.py --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "update_weights")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--demo-dir", default=None, help="prepared demo (megatron_dapo.tasks.demo); default: make one")
    ap.add_argument("--port", default="29590")
    args, overrides = ap.parse_known_args()

    with tempfile.TemporaryDirectory(prefix="e2e-bench-") as tmp:
        demo = Path(args.demo_dir) if args.demo_dir else Path(tmp) / "demo"
        if not (demo / "hf_model" / "config.json").is_file():
            subprocess.run(
                [sys.executable, "-m", "megatron_dapo.tasks.demo", "--out-dir", str(demo)],
                check=True,
                cwd=REPO,
                stdout=subprocess.DEVNULL,
            )
        mcore = Path(tmp) / "mcore"
        subprocess.run(
            [
                sys.executable,
                "tools/checkpoint_convert/convert.py",
                "hf-to-mcore",
                "--hf-dir",
                str(demo / "hf_model"),
                "--save-dir",
                str(mcore),
            ],
            check=True,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
        )
        out = Path(tmp) / "run"
        cmd = [
            "bash",
            "launch/run_local.sh",
            "configs/tiny_cpu.yaml",
            f"model.hf_config_dir={demo / 'hf_model'}",
            f"checkpoint.load_dir={mcore}",
            f"data.train_files=[{demo / 'data' / 'train.parquet'}]",
            "data.val_files=[]",
            f"trainer.output_dir={out}",
            f"trainer.total_training_steps={args.steps}",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "checkpoint.save_freq=1000000",
            "trainer.logger=[jsonl]",
            "actor.optim.lr_warmup_steps=0",
            *overrides,
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", NPROC_PER_NODE="2", MASTER_PORT=args.port, PYTHON=sys.executable)
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-4000:], proc.stderr[-4000:], file=sys.stderr)
            return proc.returncode
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    rows = [r for r in rows if "timing_s/step" in r]
    first, rest = rows[0], rows[1:] or rows[:1]
    # The last step also writes the final checkpoint; report it, but keep it out of the steady-state numbers.
    steady = [r for r in rest if "timing_s/save_checkpoint" not in r] or rest
    step_s = statistics.mean(r["timing_s/step"] for r in steady)
    tokens = statistics.mean(r["perf/total_num_tokens"] for r in steady)
    print(f"first_step_s={first['timing_s/step']:.3f} (warm-up)  steady steps measured={len(steady)}")
    for phase in PHASES:
        key = f"timing_s/{phase}"
        if any(key in r for r in steady):
            t = statistics.mean(r.get(key, 0.0) for r in steady)
            print(f"phase={phase:15s} mean_s={t:.4f} share={t / step_s:.3f}")
    gen_share = statistics.mean(r.get("timing_s/gen", 0.0) for r in steady) / step_s
    print(f"e2e_steps_per_s={1 / step_s:.3f} e2e_tokens_per_s={tokens / step_s:.1f} gen_share={gen_share:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
