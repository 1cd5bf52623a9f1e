"""End-to-end step time on this box's 2 cores (2 processes of one thread, or ``--nproc 1``: one of two threads), by
phase, against plain single-process floors for the update (PyTorch) and the generation (vLLM).

Sizes:
* ``tiny``: the quickstart's model and task (``configs/tiny_cpu.yaml``: 16 prompts x 32 samples, answers of a digit).
* ``70m``: a ~70M-parameter random Qwen2 (same tokenizer and prompts), 16 prompts x 8 samples, responses up to 128
  tokens; a random model rarely stops early, so response lengths vary at random up to the cap. Dynamic sampling is
  off (rewards are nearly all zero) — this measures the machinery, not learning.

Runs ``launch/run_local.sh`` for ``--steps`` steps without validation or periodic checkpoints and summarises
``metrics.jsonl`` over :func:`steady_rows` (not the first step, warm-up, nor the last, which saves the end-of-run
checkpoint). Then, in this process, the *floor*: the same model as an HF transformers module, forward + backward over
the same number of sequences of the step's mean length, unpadded, in micro-batches of the same size, with a rank's
threads — divided by the number of training processes (ideal data parallelism).
Prints a table of the phases (mean seconds per steady step and share of the step; ``other`` is the step's time
outside every timed phase), the start-up (``timing_s/startup*``, logged with the first step: launch → first step,
split into imports, init, actor, engine and reference; the first weight sync is the first step's
``update_weights``), the launch's whole wall time, the padding ratios, and a last line
``e2e_s_per_step=<s> e2e_tokens_per_s=<t> update_s=<u> update_floor_s=<f> update_vs_floor=<u/f> gen_s=<g>
gen_floor_s=<h> gen_vs_floor=<g/h> step_vs_floors=<s/(f+h)> startup_s=<s> startup_vs_import_floor=<r>``. The
*generation floor* is plain vLLM alone (:func:`generation_floor_s`: one rank's share of the step's sequences at the
step's mean prompt and response lengths); ``step_vs_floors`` is the step against the sum of the two floors. The
start-up is set against a fresh interpreter that only imports megatron-core, vLLM and transformers (measured in the
same run), the part of it no change of ours can remove.

``--profile DIR`` runs the launch under py-spy (``--subprocesses --idle``: every process's collapsed stacks in
``DIR/e2e.txt``) to find fixed per-step costs; its timings are then inflated by the sampling.

    python benchmarks/e2e.py --size tiny --steps 10
    python benchmarks/e2e.py --size 70m --steps 4
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

import torch

REPO = Path(__file__).resolve().parents[1]
PHASES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "update_weights")
CORES = 2  # this box; the launch splits them over its processes (--nproc), one thread each by default
SIZES = {
    "tiny": {"model": None, "overrides": []},
    "70m": {
        "model": dict(hidden_size=768, num_layers=10, num_heads=12, num_kv_heads=4, intermediate_size=2560),
        "overrides": [
            "data.max_response_length=128",
            "data.train_batch_size=16",
            "data.gen_batch_size=16",
            "actor.ppo_mini_batch_size=16",
            "actor.ppo_micro_batch_size_per_gpu=8",
            "actor.log_prob_micro_batch_size_per_gpu=16",
            "rollout.n=8",
            "rollout.max_num_seqs=128",
            "rollout.kv_cache_memory_mb=512",
            "rollout.weight_sync_bucket_mb=128",
            "algorithm.filter_groups.enable=false",
            "reward.custom_function.name=compute_score",
        ],
    },
}


def prepare(demo: Path, size: str) -> Path:
    """The demo's tokenizer and data; for ``70m`` a bigger random model next to it. Returns the HF model dir."""
    if not (demo / "hf_model" / "config.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "megatron_dapo.tasks.demo", "--out-dir", str(demo)],
            check=True,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
        )
    shape = SIZES[size]["model"]
    if shape is None:
        return demo / "hf_model"
    hf_dir = demo / f"hf_model_{size}"
    if not (hf_dir / "config.json").is_file():
        from megatron_dapo.testing.tiny_models import make_tiny_hf_model

        base = json.loads((demo / "hf_model" / "config.json").read_text())
        model = make_tiny_hf_model("qwen2", seed=0, vocab_size=base["vocab_size"], max_position_embeddings=512, **shape)
        model.config.eos_token_id = base["eos_token_id"]
        model.config.pad_token_id = base.get("pad_token_id")
        model.config.bos_token_id = None
        model.save_pretrained(hf_dir, safe_serialization=True)
    return hf_dir


def run_training(
    demo: Path,
    hf_dir: Path,
    tmp: Path,
    size: str,
    steps: int,
    port: str,
    extra: list[str],
    profile: str = "",
    nproc: int = CORES,
) -> tuple[list[dict], float]:
    """The launch's metrics rows and its whole wall time (torchrun's start to its exit): ``nproc`` processes of
    ``CORES // nproc`` threads each."""
    mcore = tmp / "mcore"
    subprocess.run(
        [
            sys.executable,
            "tools/checkpoint_convert/convert.py",
            "hf-to-mcore",
            "--hf-dir",
            str(hf_dir),
            "--save-dir",
            str(mcore),
        ],
        check=True,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
    )
    out = tmp / "run"
    cmd_launch = [
        "bash",
        "launch/run_local.sh",
        "configs/tiny_cpu.yaml",
        f"model.hf_config_dir={hf_dir}",
        f"model.tokenizer_dir={demo / 'tokenizer'}",
        f"checkpoint.load_dir={mcore}",
        f"data.train_files=[{demo / 'data' / 'train.parquet'}]",
        "data.val_files=[]",
        f"trainer.output_dir={out}",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "checkpoint.save_freq=1000000",
        "trainer.logger=[jsonl]",
        "actor.optim.lr_warmup_steps=0",
        *SIZES[size]["overrides"],
        *extra,
    ]
    if profile:  # torchrun itself (not the bash launcher) under py-spy, so that it follows the training processes
        Path(profile).mkdir(parents=True, exist_ok=True)
        spy = str(Path(sys.executable).with_name("py-spy"))
        cmd = [spy, "record", "--subprocesses", "--idle", "-r", "100", "-f", "raw", "-o", f"{profile}/e2e.txt", "--"]
        cmd += [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={port}"]
        cmd += ["-m", "megatron_dapo.cli", "train", *cmd_launch[2:]]
    else:
        cmd = cmd_launch
    threads = str(CORES // nproc)
    env = dict(os.environ, OMP_NUM_THREADS=threads, NPROC_PER_NODE=str(nproc), MASTER_PORT=port, PYTHON=sys.executable)
    # vLLM's caches where launch/setup_env.sh puts them (shared by runs): without it every run's fresh output dir
    # would make vLLM inspect the model class in a new subprocess again (seconds of start-up).
    env.setdefault("VLLM_CACHE_ROOT", str(REPO / ".venv" / ".vllm_cache"))
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0 or not (out / "metrics.jsonl").is_file():
        print(proc.stdout[-4000:], proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(proc.returncode or 1)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], wall


def update_floor_s(hf_dir: Path, num_seqs: int, seq_len: int, micro_batch: int, threads: int = 1) -> float:
    """Plain PyTorch: HF forward + backward of ``num_seqs`` unpadded sequences of ``seq_len`` tokens, one process of
    ``threads`` threads."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    model.train()
    vocab = model.config.vocab_size
    tokens = torch.randint(3, vocab, (num_seqs, seq_len), generator=torch.Generator().manual_seed(0))

    def one_pass() -> None:
        for start in range(0, num_seqs, micro_batch):
            logits = model(tokens[start : start + micro_batch]).logits
            torch.log_softmax(logits.float(), -1).mean().backward()
        model.zero_grad(set_to_none=True)

    one_pass()  # warm-up
    started = time.perf_counter()
    one_pass()
    return time.perf_counter() - started


GEN_FLOOR_CHILD = """
import json, sys, time
spec = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
llm = LLM(model=spec["hf_dir"], skip_tokenizer_init=True, dtype=spec["dtype"], enforce_eager=True, seed=0,
          max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"],
          kv_cache_memory_bytes=spec["kv_cache_mb"] * 2**20, generation_config="vllm")
prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 50 for j in range(spec["prompt_len"])]}
           for i in range(spec["num_seqs"])]
params = SamplingParams(temperature=1.0, max_tokens=spec["response_len"], ignore_eos=True, detokenize=False)
llm.generate(prompts, params, use_tqdm=False)  # warm-up (first-call compilation, allocator)
started = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
elapsed = time.perf_counter() - started
print(json.dumps({"gen_s": elapsed, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}))
"""


def generation_floor_s(
    hf_dir: Path, num_seqs: int, prompt_len: int, response_len: int, overrides: list[str], nproc: int = CORES
) -> float:
    """Plain vLLM alone: one engine in a fresh process (a rank's threads, in-process engine core, engine seed, its
    default chunked prefill) generating one rank's share of the step's sequences (``num_seqs / nproc``), each
    ``prompt_len`` + exactly ``response_len`` tokens (``ignore_eos``), with the run's rollout dtype, context length,
    batch and KV cache (``configs/tiny_cpu.yaml`` + ``overrides``). Seconds of the second of two identical calls."""
    from megatron_dapo import dtypes
    from megatron_dapo.config.load import load_config
    from megatron_dapo.config.plan import rollout_dtype

    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", overrides)
    spec = dict(
        hf_dir=str(hf_dir),
        num_seqs=max(1, num_seqs // nproc),
        prompt_len=prompt_len,
        response_len=max(1, response_len),
        max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
        max_num_seqs=cfg.rollout.max_num_seqs,
        dtype=dtypes.hf_name(dtypes.from_config_name(rollout_dtype(cfg.model, cfg.rollout), "rollout.dtype")),
        kv_cache_mb=cfg.rollout.kv_cache_memory_mb,
    )
    env = dict(os.environ, OMP_NUM_THREADS=str(CORES // nproc), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run(
        [sys.executable, "-c", GEN_FLOOR_CHILD, json.dumps(spec)], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(proc.returncode)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if result["tokens"] != spec["num_seqs"] * spec["response_len"]:
        raise SystemExit(
            f"generation floor: {result['tokens']} tokens, expected {spec['num_seqs']} x {spec['response_len']}"
        )
    return float(result["gen_s"])


def print_phases(steady: list[dict], step_s: float) -> None:
    """Mean time and share of the step of every phase (``other``: outside every phase), the padding ratios and the
    non-finite guard's cost."""
    timed_s = 0.0
    print(f"{'phase':16s} {'mean_s':>8s} {'share':>6s}")
    for phase in PHASES:
        key = f"timing_s/{phase}"
        if any(key in r for r in steady):
            t = statistics.mean(r.get(key, 0.0) for r in steady)
            timed_s += t
            print(f"{phase:16s} {t:8.4f} {t / step_s:6.3f}")
    print(f"{'other':16s} {step_s - timed_s:8.4f} {(step_s - timed_s) / step_s:6.3f}")
    print(f"{'step':16s} {step_s:8.4f} {1:6.3f}")
    for key in sorted({k for r in steady for k in r if k.startswith("perf/padding_ratio/")}):
        print(f"{key}={statistics.mean(r[key] for r in steady if key in r):.3f}")
    if any("perf/update_guard_s" in r for r in steady):  # the non-finite guard's own cost (#16)
        guard = statistics.mean(r.get("perf/update_guard_s", 0.0) for r in steady)
        print(f"update_guard_s={guard:.5f} update_guard_share_of_step={guard / step_s:.5f}")


def print_startup(first: dict, wall_s: float, steps: int) -> float:
    """The start-up of rank 0 (launch → first step) and its parts, the first step's phases (the first weight sync
    among them) and the launch's whole wall time. Returns the start-up seconds (0 if the run did not log it)."""
    startup = first.get("timing_s/startup", 0.0)
    parts = sorted(k for k in first if k.startswith("timing_s/startup/"))
    print(f"startup_s={startup:.3f} (launch of the training process -> first step)")
    for key in parts:
        print(f"  {key.removeprefix('timing_s/'):20s} {first[key]:8.3f}")
    first_phases = " ".join(f"{p}={first[f'timing_s/{p}']:.3f}" for p in PHASES if f"timing_s/{p}" in first)
    print(f"first step_s={first['timing_s/step']:.3f} (warm-up): {first_phases}")
    print(f"launch wall_s={wall_s:.2f} for {steps} steps (torchrun start to exit, checkpoint at the end included)")
    return startup


def import_floor_s() -> float:
    """Wall seconds of a fresh interpreter that only imports what a training process must (megatron-core, vLLM's
    ``LLM``, transformers): the part of the start-up no change of ours can remove."""
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "import megatron.core, transformers; from vllm import LLM"],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - started


def steady_rows(rows: list[dict]) -> list[dict]:
    """The steps that measure the steady state: not the first (warm-up: vLLM's and the allocator's first calls) and
    not one that saved a checkpoint (the end-of-run save lands in the last step's time)."""
    rows = [r for r in rows if "timing_s/step" in r]
    rest = rows[1:] or rows[:1]
    return [r for r in rest if "timing_s/save_checkpoint" not in r] or rest


def floor_shape(steady: list[dict], overrides: list[str]) -> tuple[int, int, int]:
    """``(sequences, tokens per sequence, micro-batch)`` of a step, for :func:`update_floor_s`."""
    seq_len_mean = statistics.mean(r["prompt_length/mean"] + r["response_length/mean"] for r in steady)
    num_seqs = int(round(statistics.mean(r["perf/total_num_tokens"] for r in steady) / max(seq_len_mean, 1)))
    micro = next(
        (int(o.split("=")[1]) for o in overrides if o.startswith("actor.ppo_micro_batch_size_per_gpu=")),
        64,
    )
    return num_seqs, int(round(seq_len_mean)), micro


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--demo-dir", default=None, help="prepared demo (megatron_dapo.tasks.demo); default: make one")
    ap.add_argument("--port", default="29590")
    ap.add_argument("--profile", default="", help="directory: run the launch under py-spy (collapsed stacks)")
    ap.add_argument("--nproc", type=int, choices=(1, 2), default=CORES, help="training processes (threads: the rest)")
    args, extra = ap.parse_known_args()

    with tempfile.TemporaryDirectory(prefix="e2e-bench-") as tmp:
        demo = Path(args.demo_dir) if args.demo_dir else Path(tmp) / "demo"
        hf_dir = prepare(demo, args.size)
        rows, wall_s = run_training(
            demo, hf_dir, Path(tmp), args.size, args.steps, args.port, extra, args.profile, args.nproc
        )
        rows = [r for r in rows if "timing_s/step" in r]
        first, steady = rows[0], steady_rows(rows)
        step_s = statistics.mean(r["timing_s/step"] for r in steady)
        tokens = statistics.mean(r["perf/total_num_tokens"] for r in steady)
        print(f"size={args.size} steady_steps={len(steady)}")
        print_phases(steady, step_s)
        startup = print_startup(first, wall_s, args.steps)
        update_s = statistics.mean(r.get("timing_s/update_actor", 0.0) for r in steady)
        num_seqs, seq_len, micro = floor_shape(steady, SIZES[args.size]["overrides"] + extra)
        floor = update_floor_s(hf_dir, num_seqs, seq_len, micro, CORES // args.nproc) / args.nproc
        gen_s = statistics.mean(r.get("timing_s/gen", 0.0) for r in steady)
        prompt_len = round(statistics.mean(r["prompt_length/mean"] for r in steady))
        response_len = round(statistics.mean(r["response_length/mean"] for r in steady))
        overrides = SIZES[args.size]["overrides"] + extra
        gen_floor = generation_floor_s(hf_dir, num_seqs, prompt_len, response_len, overrides, args.nproc)
    print(
        f"update floor: HF forward+backward of {num_seqs} x {seq_len} tokens (micro-batch {micro}), one process"
        f" ({CORES // args.nproc} torch threads), / {args.nproc} processes"
    )
    print(
        f"generation floor: plain vLLM, one process, {num_seqs // args.nproc} sequences of {prompt_len} +"
        f" {response_len} tokens (one rank's share) in {gen_floor:.3f} s"
    )
    imports = import_floor_s()
    print(f"import floor: {imports:.2f} s for megatron-core, vLLM and transformers in a fresh interpreter")
    print(
        f"e2e_s_per_step={step_s:.3f} e2e_tokens_per_s={tokens / step_s:.1f} update_s={update_s:.3f} "
        f"update_floor_s={floor:.3f} update_vs_floor={update_s / floor:.2f} gen_s={gen_s:.3f} "
        f"gen_floor_s={gen_floor:.3f} gen_vs_floor={gen_s / gen_floor:.2f} "
        f"step_vs_floors={step_s / (floor + gen_floor):.2f} startup_s={startup:.2f} "
        f"startup_vs_import_floor={startup / imports:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
