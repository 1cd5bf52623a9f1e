"""Step time against TRL's ``GRPOTrainer(loss_type="dapo")`` (TRL 1.16) on the same model, prompts, group size, token
budget and reward, both on this box's 2 cores, one after the other.

* ours: ``launch/run_local.sh`` on 2 processes of one thread (``--nproc 1``: one process of two threads), as
  ``benchmarks/e2e.py`` runs it, dynamic sampling off, the lenient first-number scorer
  (``tasks/arithmetic.compute_score``);
* TRL: one process with 2 threads, HF ``generate`` (its vLLM path needs a GPU), DAPO loss, no KL (``beta=0``),
  ``epsilon_high=0.28``, fp32 without gradient checkpointing as ours (TRL defaults to bf16 and checkpointing), the
  same scorer, ``per_device_train_batch_size`` = prompts x n, one optimizer step per generation batch.

Sizes (``benchmarks/e2e.py``'s models and data): ``tiny`` = the demo model, 16 prompts x 8, responses of at most 8
tokens; ``70m`` = the ~70M random Qwen2, 16 x 8, up to 128 tokens. The first step of each is excluded (warm-up),
and of ours the last (it holds the end-of-run checkpoint save; TRL saves nothing).
Tokens are prompt + response tokens trained per step (ours: ``perf/total_num_tokens``; TRL: its ``num_tokens``).

TRL and ``datasets`` are not project dependencies: they are installed from the package registry into ``--trl-site``
(outside ``.venv``, ``pip install --target``, no dependencies beyond what ``.venv`` has) and put on the TRL
process's ``PYTHONPATH`` only.

Last line: ``vs_trl_per_step=<TRL s/step ÷ ours> vs_trl_per_token=<our tokens/s ÷ TRL's>`` (above 1: faster).

    python benchmarks/vs_trl.py --size tiny --steps 8
    python benchmarks/vs_trl.py --size 70m --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import CORES, SIZES, prepare, run_training, steady_rows  # noqa: E402 - the models, data and launch, shared

REPO = Path(__file__).resolve().parents[1]
TRL_PACKAGES = ["trl==1.16.0", "datasets", "multiprocess", "dill", "xxhash"]
SHAPES = {"tiny": dict(prompts=16, n=8, tokens=8), "70m": dict(prompts=16, n=8, tokens=128)}


def our_overrides(size: str) -> list[str]:
    s = SHAPES[size]
    same = [
        f"data.train_batch_size={s['prompts']}",
        f"data.gen_batch_size={s['prompts']}",
        f"actor.ppo_mini_batch_size={s['prompts']}",
        f"rollout.n={s['n']}",
        f"data.max_response_length={s['tokens']}",
        "algorithm.filter_groups.enable=false",
        "reward.custom_function.name=compute_score",
    ]
    return [*SIZES[size]["overrides"], *same]


def ours(demo: Path, hf_dir: Path, tmp: Path, size: str, steps: int, nproc: int) -> tuple[float, float, int]:
    """Steady seconds per step, tokens per step and the number of steady steps of our run."""
    rows, _ = run_training(demo, hf_dir, tmp, size, steps, "29640", our_overrides(size), nproc=nproc)
    steady = steady_rows(rows)  # as TRL's (save_strategy="no"): without the end-of-run checkpoint
    return (
        statistics.mean(r["timing_s/step"] for r in steady),
        statistics.mean(r["perf/total_num_tokens"] for r in steady),
        len(steady),
    )


def ensure_trl(site: Path) -> None:
    if (site / "trl" / "__init__.py").is_file():
        return
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--target", str(site), "--no-deps", *TRL_PACKAGES]
    subprocess.run(cmd, check=True)


def trl(
    demo: Path, hf_dir: Path, tmp: Path, size: str, steps: int, site: Path, timeout_s: float
) -> tuple[float, float, int]:
    """Steady seconds per step, tokens per step and the number of steady steps of TRL's run (a subprocess with TRL
    on its path; after ``timeout_s`` it is stopped and the steps it finished count)."""
    spec = {
        **SHAPES[size],
        "model": str(hf_dir),
        "tokenizer": str(demo / "tokenizer"),
        "train": str(demo / "data" / "train.parquet"),
        "out": str(tmp / "trl"),
        "steps": steps,
    }
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{REPO}", OMP_NUM_THREADS="2")
    cmd = [sys.executable, __file__, "--trl-worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        stdout, failed = proc.stdout, proc.returncode != 0
        if failed:
            print(proc.stdout[-4000:], proc.stderr[-4000:], file=sys.stderr)
    except subprocess.TimeoutExpired as expired:  # keep the steps it finished (printed as they end)
        stdout, failed = expired.stdout or "", False
        stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
        print(f"TRL stopped after {timeout_s:.0f} s (--trl-timeout-s)", file=sys.stderr)
    logged = [json.loads(x.removeprefix("TRL_STEP ")) for x in stdout.splitlines() if x.startswith("TRL_STEP ")]
    if failed or len(logged) < 2:
        raise SystemExit(f"TRL finished {len(logged)} steps; 2 are needed (the first is the warm-up)")
    ends, tokens = [e["time"] for e in logged], [e["num_tokens"] for e in logged]
    step_s = [b - a for a, b in zip(ends, ends[1:])]  # the first step (warm-up) has no start here
    per_step_tokens = [b - a for a, b in zip(tokens, tokens[1:])]
    return statistics.mean(step_s), statistics.mean(per_step_tokens), len(step_s)


def trl_worker(spec: dict) -> None:
    """TRL's GRPOTrainer with the DAPO loss on the run's model and prompts (runs with TRL on ``PYTHONPATH``)."""
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_dapo.tasks.arithmetic import compute_score

    torch.set_num_threads(2)
    rows = pq.read_table(spec["train"]).to_pylist()
    data = Dataset.from_list(
        [{"prompt": list(r["prompt"]), "ground_truth": str(r["reward_model"]["ground_truth"])} for r in rows]
    )

    def reward(completions: list, ground_truth: list, **_: object) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [compute_score("arithmetic", t, gt)["score"] for t, gt in zip(texts, ground_truth)]

    class Clock(TrainerCallback):
        """Prints each step's end as it happens (``logging_steps=1``: a log follows every step), so that a run
        stopped by the parent's timeout still reports the steps it finished."""

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN201 - TRL's signature
            if logs and "num_tokens" in logs:
                print("TRL_STEP " + json.dumps({"time": time.perf_counter(), "num_tokens": logs["num_tokens"]}))
                sys.stdout.flush()

    args = GRPOConfig(
        output_dir=spec["out"],
        per_device_train_batch_size=spec["prompts"] * spec["n"],
        num_generations=spec["n"],
        max_completion_length=spec["tokens"],
        loss_type="dapo",
        # Ours trains in fp32 without activation recompute; TRL's config defaults to bf16 autocast and gradient
        # checkpointing (TRL 1.16 GRPOConfig), and this CPU has no bf16 arithmetic: set both as ours.
        bf16=False,
        gradient_checkpointing=False,
        beta=0.0,
        epsilon_high=0.28,
        temperature=1.0,
        learning_rate=1e-6,
        max_steps=spec["steps"],
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tokenizer, callbacks=[Clock()]
    )
    trainer.train()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--trl-site", default=str(Path(tempfile.gettempdir()) / "megatron_dapo_trl_site"))
    ap.add_argument("--nproc", type=int, choices=(1, 2), default=CORES, help="our processes (threads: the rest)")
    ap.add_argument("--trl-timeout-s", type=float, default=3600.0, help="stop TRL after this; its finished steps count")
    ap.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        trl_worker(json.loads(args.trl_worker))
        return 0
    site = Path(args.trl_site)
    ensure_trl(site)
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        demo = Path(tmp) / "demo"
        hf_dir = prepare(demo, args.size)
        our_s, our_tokens, our_steps = ours(demo, hf_dir, Path(tmp), args.size, args.steps, args.nproc)
        trl_s, trl_tokens, trl_steps = trl(demo, hf_dir, Path(tmp), args.size, args.steps, site, args.trl_timeout_s)
    print(f"size={args.size} {SHAPES[args.size]} steady steps: ours {our_steps}, TRL {trl_steps}")
    ours_label = f"ours ({args.nproc} processes)"
    print(f"{ours_label} s_per_step={our_s:.3f} tokens_per_step={our_tokens:.0f} tokens_per_s={our_tokens / our_s:.1f}")
    print(f"trl  s_per_step={trl_s:.3f} tokens_per_step={trl_tokens:.0f} tokens_per_s={trl_tokens / trl_s:.1f}")
    print(f"vs_trl_per_step={trl_s / our_s:.3f} vs_trl_per_token={(our_tokens / our_s) / (trl_tokens / trl_s):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
