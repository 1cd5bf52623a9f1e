"""A misbehaving user tool against the well-behaved one (issue #42): what the faults cost the rest of the run.

The faulty tool is ``tests/agent/faulty_tool.py:FaultyLookup``: the tool task's ``lookup`` as a verl-style class from
a file (async methods, no project base class) whose calls, each with probability ``--rate``, raise, block the event
loop in ``time.sleep(60)``, answer 200 kB, call ``os._exit`` or allocate 6 GiB — with the user's settings:
``tool_timeout_s=3``, ``tool_memory_mb=1024`` (``--timeout-s``, ``--memory-mb``), ``tool_workers`` and
``max_concurrent_tool_calls`` as configured (``configs/tiny_agent_cpu.yaml``: the defaults). The well-behaved tool is
the task's own ``tasks/lookup_tool.py:LookupTool``.

``--level pool`` (seconds): one rank's tool calls of a generation batch of the agent quickstart (``--conversations``,
each calling once, as the solved task does) through ``agent/host.ToolHost``, every call sent at once; the faulty and
the well-behaved tool, one after the other. Here the benchmark draws the faults (seeded, ``--rate`` each) and names
them in the calls, so the injected ones are known. Per tool: the batch's wall time, the failed calls by kind. Last
line: ``pool_faulty_vs_good_s=<faulty - good seconds> failed_frac=<failed ÷ calls> injected_frac=<raise, hang, exit
and memory calls ÷ calls; a huge answer is not a failure> cascade=<failed_frac ÷ injected_frac> workers_lost=<n>``.

``--level train`` (minutes): ``configs/tiny_agent_cpu.yaml`` on 2 CPU processes (``launch/run_local.sh``) for
``--steps`` steps with each tool, the same model, data and seeds; greedy validation before the first step and after
the last. Per tool: the steady steps' mean ``timing_s/step`` and ``timing_s/gen``, the tool calls and failures
(``tool/*``, summed over the steps), validation. Last line: ``faulty_vs_good_step=<ratio> failed_frac=<f>
injected_frac=<i> cascade=<f ÷ i> val_good=<first>-><last> val_faulty=<first>-><last>``.

    python benchmarks/tool_faults.py --level pool
    python benchmarks/tool_faults.py --level train --steps 10
    python benchmarks/tool_faults.py --level train --steps 10 --partial

``--override rollout.multi_turn.tool_abandon_after_s=1.5``: once no model turn is left, a conversation stops waiting
for a call that has run that long (``tool/abandoned``, counted as failed); synchronous rollout then waits that long
for a hung call instead of ``tool_timeout_s`` + grace (docs/agent.md).

``--partial``: both runs with partial rollout, where a round does not wait for calls that outlast
``tool_round_wait_s`` (docs/async.md); synchronous rollout waits for its slowest conversation. The partial runs also
print the steps trained with a partial batch and the conversations left waiting for their calls per step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import wait
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from megatron_dapo.agent.hermes import ToolCall  # noqa: E402 - the repository on the path first
from megatron_dapo.agent.host import ToolHost  # noqa: E402
from megatron_dapo.agent.tools import read_tool_config  # noqa: E402
from megatron_dapo.config import load_config  # noqa: E402

FAULTY = REPO / "tests" / "agent" / "faulty_tool.py"
CONFIG = REPO / "configs" / "tiny_agent_cpu.yaml"
FAILURES = ("error", "timeout", "crashed", "abandoned")
FAULTS = ("raise", "hang", "huge", "exit", "memory")
VAL_ACC = "val-core/lookup/acc/mean@1"


def good_tool_config(path: Path) -> Path:
    # heavy: tasks.agent imports torch; the tool zygote re-imports this main module, so its top stays light
    from megatron_dapo.tasks.agent import write_tool_config

    return write_tool_config(path)


def faulty_tool_config(path: Path, rate: float) -> Path:
    # heavy: as in good_tool_config
    from megatron_dapo.tasks.agent import TOOL_SCHEMA

    rates = dict.fromkeys(FAULTS, rate)
    config = {"rates": rates, "hang_s": 60}
    entry = {"class_name": f"{FAULTY}:FaultyLookup", "config": config, "tool_schema": TOOL_SCHEMA}
    path.write_text(yaml.safe_dump({"tools": [entry]}, sort_keys=False))
    return path


def pool_batch(tools_yaml: Path, args: argparse.Namespace, plan: list) -> dict[str, float]:
    """One rank's calls of a generation batch, all sent at once (``plan``: each call's fault, or None): wall seconds
    and outcomes."""
    mt = load_config(CONFIG).rollout.multi_turn
    specs = read_tool_config(str(tools_yaml))
    host = ToolHost(
        specs, args.timeout_s, mt.max_concurrent_tool_calls, memory_mb=args.memory_mb, workers=mt.tool_workers
    )
    with host:
        host.start()
        kwargs = {"lookup": {"create_kwargs": {"boxes": {"a": 1, "b": 2}}}}
        wait([host.create(f"c{i}", kwargs) for i in range(args.conversations)])
        host.reset_metrics()
        started = time.perf_counter()
        calls = [host.call(f"c{i}", ToolCall("lookup", {"box": "ab"[i % 2], "fault": f})) for i, f in enumerate(plan)]
        results = [f.result() for f in calls]
        wall = time.perf_counter() - started
        metrics = host.metrics()
    out = {"wall_s": wall, "calls": float(len(results)), "workers_lost": metrics["tool/crashes"]}
    out.update({s: float(sum(r.status == s for r in results)) for s in ("ok", *FAILURES)})
    print(
        f"tool={tools_yaml.stem:8s} wall_s={wall:.2f} calls={len(results)} ok={out['ok']:g} error={out['error']:g}"
        f" timeout={out['timeout']:g} crashed={out['crashed']:g} workers_lost={out['workers_lost']:g}"
        f" resent={metrics['tool/resent']:g}"
    )
    return out


def run_pool(args: argparse.Namespace, tmp: Path) -> None:
    rng = random.Random(args.seed)  # the faults drawn here, so that the injected ones are known
    plan = [rng.choice(FAULTS) if rng.random() < 5 * args.rate else None for _ in range(args.conversations)]
    good = pool_batch(good_tool_config(tmp / "good.yaml"), args, [None] * args.conversations)
    bad = pool_batch(faulty_tool_config(tmp / "faulty.yaml", 0.0), args, plan)  # no faults of its own drawing
    failed = sum(bad[s] for s in FAILURES) / bad["calls"]
    injected = sum(f not in (None, "huge") for f in plan) / len(plan)
    print(
        f"pool_faulty_vs_good_s={bad['wall_s'] - good['wall_s']:.2f} failed_frac={failed:.3f}"
        f" injected_frac={injected:.3f} cascade={failed / injected:.2f} workers_lost={bad['workers_lost']:g}"
    )


def prepare_task(work: Path) -> Path:
    """The agent quickstart's task, tokenizer and model under ``work/agent`` (made once), converted."""
    task = work / "agent"
    if not (task / "hf_model" / "config.json").is_file():
        cmd = [sys.executable, "-m", "megatron_dapo.tasks.agent", "--out-dir", str(task)]
        subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    if not (task / "mcore" / "latest_checkpointed_iteration.txt").is_file():
        cmd = [sys.executable, "tools/checkpoint_convert/convert.py", "hf-to-mcore", "--hf-dir", str(task / "hf_model")]
        subprocess.run([*cmd, "--save-dir", str(task / "mcore")], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return task


def train(task: Path, tools_yaml: Path, out: Path, args: argparse.Namespace) -> dict[str, float]:
    """``--steps`` steps of the quickstart with ``tools_yaml``; the summary of its metrics."""
    overrides = [
        f"model.hf_config_dir={task / 'hf_model'}",
        f"model.tokenizer_dir={task / 'tokenizer'}",
        f"checkpoint.load_dir={task / 'mcore'}",
        f"data.train_files=[{task / 'data' / 'train.parquet'}]",
        f"data.val_files=[{task / 'data' / 'val.parquet'}]",
        f"rollout.multi_turn.tool_config_path={tools_yaml}",
        f"rollout.multi_turn.tool_timeout_s={args.timeout_s}",
        f"rollout.multi_turn.tool_memory_mb={args.memory_mb}",
        f"trainer.output_dir={out}",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.test_freq={args.steps}",
        "trainer.logger=[jsonl]",
        "trainer.progress_bar=false",
        *(["rollout.partial_rollout.enable=true"] if args.partial else []),
        *args.override,
    ]
    env = dict(os.environ, NPROC_PER_NODE="2", MASTER_PORT=str(args.port), OMP_NUM_THREADS="1")
    cmd = ["bash", "launch/run_local.sh", str(CONFIG), *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"the {tools_yaml.stem} run failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "timing_s/step" in r]
    steady = steps[1:] or steps
    val = [r[VAL_ACC] for r in rows if VAL_ACC in r]
    out_row = {
        "step_s": statistics.mean(r["timing_s/step"] for r in steady),
        "gen_s": statistics.mean(r.get("timing_s/gen", 0.0) for r in steady),
        "val_first": val[0],
        "val_last": val[-1],
        "partial_batches": sum(r.get("train/partial_batch", 0.0) for r in steps),
        "awaiting_tools": statistics.mean(r.get("rollout/partial/awaiting_tools", 0.0) for r in steps),
        **{k: sum(r.get(f"tool/{k}", 0.0) for r in steps) for k in ("calls", *FAILURES)},
    }
    print(
        f"tool={tools_yaml.stem:8s} step_s={out_row['step_s']:.2f} gen_s={out_row['gen_s']:.2f}"
        f" calls={out_row['calls']:g} error={out_row['error']:g} timeout={out_row['timeout']:g}"
        f" crashed={out_row['crashed']:g} abandoned={out_row['abandoned']:g} val={val[0]:.3f}->{val[-1]:.3f}"
        f" partial_batches={out_row['partial_batches']:g} awaiting_tools={out_row['awaiting_tools']:.1f}"
    )
    return out_row


def run_train(args: argparse.Namespace, tmp: Path) -> None:
    task = prepare_task(Path(args.work_dir) if args.work_dir else tmp)
    runs = Path(args.out_dir) if args.out_dir else tmp
    good = train(task, good_tool_config(tmp / "good.yaml"), runs / "good", args)
    bad = train(task, faulty_tool_config(tmp / "faulty.yaml", args.rate), runs / "faulty", args)
    failed = sum(bad[s] for s in FAILURES) / max(bad["calls"], 1.0)
    injected = 4 * args.rate
    print(
        f"faulty_vs_good_step={bad['step_s'] / good['step_s']:.2f} failed_frac={failed:.3f}"
        f" injected_frac={injected:.3f} cascade={failed / injected:.2f}"
        f" val_good={good['val_first']:.3f}->{good['val_last']:.3f}"
        f" val_faulty={bad['val_first']:.3f}->{bad['val_last']:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--level", choices=("pool", "train"), default="pool")
    parser.add_argument("--rate", type=float, default=0.05, help="probability of each of the 5 faults per call")
    parser.add_argument("--timeout-s", type=float, default=3.0)
    parser.add_argument("--memory-mb", type=int, default=1024)
    parser.add_argument("--conversations", type=int, default=384, help="pool: one rank's generation batch")
    parser.add_argument("--steps", type=int, default=10, help="train: steps per run")
    parser.add_argument("--port", type=int, default=29531)
    parser.add_argument("--seed", type=int, default=0, help="pool: the draw of the faults")
    parser.add_argument("--partial", action="store_true", help="train: both runs with rollout.partial_rollout")
    parser.add_argument("--override", action="append", default=[], help="train: a config override for both runs")
    parser.add_argument("--out-dir", default="", help="train: where the two runs write (kept; default: removed)")
    parser.add_argument("--work-dir", default="", help="train: where the task is made (kept between runs)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (run_pool if args.level == "pool" else run_train)(args, Path(tmp))


if __name__ == "__main__":
    main()
