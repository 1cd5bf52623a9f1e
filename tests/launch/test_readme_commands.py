"""Every command in the README's fenced ``bash`` blocks runs as written, on a fresh clone, in README order.

The commands are read from README.md; :data:`COMMANDS` classifies each one, and a README command that is not in it
(or an entry the README no longer has) fails :func:`test_every_readme_command_is_classified`, so the README cannot
drift from what is tested. The kinds:

* ``run`` — run exactly as written;
* ``bound`` — run as written with its placeholders (``H``, ``M``, ``[--dtype …]``, ``[overrides…]``) bound to files of
  the fresh clone, the binding being data here; a README placeholder that is no longer there fails the test;
* ``dry-run`` — a command that needs a cluster is checked through its dry run, ``megatron-dapo check`` with the
  same config, node layout and overrides (the 32B model's ``config.json`` from ``tests/helpers/hf_configs.py``);
* ``covered`` — run whole by another test, which must still run it;
* ``exempt`` — not run, for the reason given.

The fresh clone is a directory with the checkout's tracked top-level folders linked in and no ``outputs/``, run with
this interpreter's environment (what ``launch/setup_env.sh`` makes). The README's order matters only through the
files one command leaves for the next (the training run's demo model and checkpoint feed the checkpoint commands);
each command runs at most once per session.

Classified today:

* run: ``launch/run_local.sh configs/tiny_cpu.yaml trainer.total_training_steps=20`` (on the fresh clone it makes
  the demo model, tokenizer and data first, as the quickstart would), and the two 4-step runs with partial rollout
  and in async mode; ``source launch/env_cuda.sh`` (and
  ``launch/env_ascend.sh``, which its comment names): the variables they export;
* bound: ``megatron-dapo check … [overrides…]`` (the model's ``config.json``; the placeholder data and checkpoint
  paths are then its only problems); the converter both ways, ``megatron-dapo export`` and the 4-process
  ``verify.py`` (on the demo model, the training run's checkpoint and the converter's output);
* dry-run: the 16-node ``launch/run_node.sh`` launch (needs 16 nodes × 8 GPUs, the 32B model and the DAPO data);
* covered: ``bash launch/quickstart.sh`` (``tests/e2e/test_quickstart.py``, with 40 of its 60 steps) and
  ``bash launch/agent_quickstart.sh`` (``tests/e2e/test_agent_e2e.py``, with 40 of its 50 steps);
* exempt: ``bash tests/run.sh`` (the whole suite, this test included; CI runs it as ``.ci/run``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

from tests.helpers.hf_configs import QWEN25_32B

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
# What a fresh clone has that the commands read (outputs/ and .venv/ are made by the commands themselves).
CLONE_ENTRIES = ("configs", "launch", "megatron_dapo", "tools", "tests", "docs", "benchmarks", "README.md")
TRAIN_PORT, VERIFY_PORT = 29980, 29981  # 29980-29989: tests/launch/test_readme_commands.py
QWEN32B_DIR = "outputs/readme/qwen2.5-32b"  # the fixture config.json for the check commands
DEMO = "outputs/quickstart"  # where configs/tiny_cpu.yaml reads the demo


# ================================================================================================ README parsing


def fenced_blocks(text: str) -> list[tuple[str, list[str]]]:
    """``(language, lines)`` of every fenced block, in order."""
    blocks, current, language = [], None, ""
    for line in text.splitlines():
        fence = re.match(r"^\s*```\s*(\S*)\s*$", line)
        if fence and current is None:
            current, language = [], fence.group(1)
        elif fence:
            blocks.append((language, current))
            current = None
        elif current is not None:
            current.append(line)
    assert current is None, "README.md: a fenced block is not closed"
    return blocks


def shell_commands(lines: list[str]) -> list[str]:
    """The commands of a shell block: continuations joined, comment lines and trailing comments dropped,
    whitespace collapsed."""
    commands, pending = [], ""
    for line in lines:
        if pending == "" and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        command = re.sub(r"\s+#\s.*$", "", pending)  # `cmd   # note`: the note is not part of the command
        commands.append(" ".join(command.split()))
        pending = ""
    assert pending == "", f"README.md: a command ends with a line continuation: {pending!r}"
    return commands


def readme_commands() -> list[str]:
    return [
        c for lang, lines in fenced_blocks(README.read_text()) if lang in SHELL_LANGUAGES for c in shell_commands(lines)
    ]


def placeholders(command: str) -> set[str]:
    """The placeholders of a README command: bracketed optional parts and capitalised words (``H``, ``CKPT_DIR``;
    not ``NAME=value`` assignments)."""
    brackets = re.findall(r"\[[^\]]*\]", command)
    words = re.findall(r"(?<![\w/.=$-])[A-Z][A-Z0-9_]*(?![\w.=-])", re.sub(r"\[[^\]]*\]", " ", command))
    return set(brackets) | set(words)


def bind(command: str, binding: dict[str, str]) -> str:
    """``command`` with every placeholder replaced as ``binding`` says (each must be bound, each binding used)."""
    found = placeholders(command)
    assert found == set(binding), f"{command!r}: placeholders {sorted(found)}, bound {sorted(binding)}"
    for key, value in binding.items():
        pattern = re.escape(key) if key.startswith("[") else rf"(?<![\w/.=$-]){re.escape(key)}(?![\w.=-])"
        command = re.sub(pattern, lambda _, value=value: value, command)
    return command


# ================================================================================================ the fresh clone


@dataclass
class FreshClone:
    root: Path
    env: dict[str, str]
    results: dict[str, subprocess.CompletedProcess] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def sh(
        self, command: str, timeout: float = 600, env: Optional[dict[str, str]] = None
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "-c", command],
            cwd=self.root,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def readme(self, command: str) -> subprocess.CompletedProcess:
        """The result of the README ``command`` in its runnable form (``run``/``bound``), run once per session."""
        if command not in self.results:
            entry = COMMANDS[command]
            for earlier in entry.after:  # the files this one reads
                self.ok(earlier)
            runnable = bind(command, entry.binding) if entry.kind == "bound" else command
            start = time.monotonic()
            self.results[command] = self.sh(runnable, env=entry.env)
            self.seconds[command] = time.monotonic() - start
        return self.results[command]

    def ok(self, command: str) -> subprocess.CompletedProcess:
        proc = self.readme(command)
        assert proc.returncode == 0, f"{command!r} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}"
        return proc


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Iterator[FreshClone]:
    root = tmp_path_factory.mktemp("fresh_clone")
    for name in CLONE_ENTRIES:
        (root / name).symlink_to(REPO / name)
    (root / QWEN32B_DIR).mkdir(parents=True)
    (root / QWEN32B_DIR / "config.json").write_text(json.dumps(QWEN25_32B))
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"}}
    bin_dir = str(Path(sys.executable).parent)  # megatron-dapo, torchrun: as after `source .venv/bin/activate`
    env.update(PATH=bin_dir + os.pathsep + env.get("PATH", ""), PYTHON=sys.executable, OMP_NUM_THREADS="1")
    fresh = FreshClone(root, env)
    yield fresh
    for command, seconds in fresh.seconds.items():
        print(f"{seconds:6.1f}s  {command}")


# ================================================================================================ the checks


def problems_of_check(output: str) -> list[str]:
    """The ``problems (n):`` list of ``megatron-dapo check``'s report."""
    if "problems (" not in output:
        return []
    section = output.split("problems (", 1)[1].split("\n", 1)[1]
    return [line[4:] for line in section.splitlines() if line.startswith("  - ")]


def expect_only_placeholder_paths(proc: subprocess.CompletedProcess) -> str:
    """The 32B config's check: its plan for 16 x 8 processes, and the config's placeholder checkpoint and data
    paths as its only problems (exit status 1). Returns the output."""
    out = proc.stdout + proc.stderr
    assert "world size 128 = 16 node(s) x 8 process(es) per node" in out, out[-4000:]
    problems = problems_of_check(out)
    assert proc.returncode == 1 and len(problems) == 3, out[-4000:]
    prefixes = ("checkpoint.load_dir=/ckpt/", "data.train_files[0]: /data/", "data.val_files[0]: /data/")
    assert all(p.startswith(prefixes) for p in problems), problems
    return out


def check_quickstart_is_covered(clone: FreshClone, command: str) -> None:
    covering = REPO / "tests" / "e2e" / "test_quickstart.py"
    # It runs the script with fewer steps (a config override, as the README says extra arguments are).
    assert '["bash", "launch/quickstart.sh", ' in covering.read_text(), f"{covering} no longer runs {command!r}"


def check_agent_quickstart_is_covered(clone: FreshClone, command: str) -> None:
    covering = REPO / "tests" / "e2e" / "test_agent_e2e.py"
    # It runs the script with fewer steps (a config override, as the README says extra arguments are).
    assert '["bash", "launch/agent_quickstart.sh", ' in covering.read_text(), f"{covering} no longer runs {command!r}"


def check_training(clone: FreshClone, command: str) -> None:
    proc = clone.ok(command)
    assert f"[run_local] configs/tiny_cpu.yaml: {DEMO}/hf_model/config.json is missing" in proc.stdout
    rows = [json.loads(line) for line in (clone.root / DEMO / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(21))
    assert (clone.root / DEMO / "run" / "checkpoints" / "latest").read_text().strip() == "global_step_20"


def check_partial_run(clone: FreshClone, command: str) -> None:
    clone.ok(command)
    rows = [json.loads(line) for line in (clone.root / "outputs/partial/metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "actor/pg_loss" in r]
    assert len(trained) == 4 and all("rollout/partial/segments_mean" in r for r in trained)
    assert max(r["rollout/partial/buffered_responses"] for r in trained) > 0  # 1-token segments: responses carried


def check_async_run(clone: FreshClone, command: str) -> None:
    clone.ok(command)
    rows = [json.loads(line) for line in (clone.root / "outputs/async/metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "actor/pg_loss" in r]
    assert len(trained) == 4 and all(r["async/staleness/max"] <= 1 for r in trained)
    state = json.loads((clone.root / "outputs/async/checkpoints/global_step_4/trainer_state.json").read_text())
    assert "rollout_state" in state  # the rollout rank's snapshot is in the checkpoint


def sourced_env(clone: FreshClone, command: str) -> dict[str, str]:
    proc = clone.sh(f"{command} && env -0")
    assert proc.returncode == 0, proc.stderr
    return dict(item.split("=", 1) for item in proc.stdout.split("\0") if "=" in item)


def check_env_scripts(clone: FreshClone, command: str) -> None:
    cuda = sourced_env(clone, command)
    assert cuda["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and cuda["TORCH_NCCL_AVOID_RECORD_STREAMS"] == "1"
    ascend = sourced_env(clone, "source launch/env_ascend.sh")  # the alternative its comment names
    assert ascend["HCCL_CONNECT_TIMEOUT"] == "1800" and ascend["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


def check_cluster_launch_dry_run(clone: FreshClone, command: str) -> None:
    words = shlex.split(command.replace("$i", "0"))
    env = {}
    while re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # the leading NAME=value assignments
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    script, config, *overrides = words
    assert script == "launch/run_node.sh", command
    dry = ["megatron-dapo", "check", config, "--nnodes", env["NNODES"], "--nproc-per-node", env["NPROC_PER_NODE"]]
    # The config is written for 80 GiB GPUs (its header); without a device size the check sizes vLLM's KV cache
    # for this CPU machine, where it cannot hold one 22k-token sequence.
    dry += ["--device-memory-gb", "80", *overrides, f"model.hf_config_dir={QWEN32B_DIR}"]
    expect_only_placeholder_paths(clone.sh(shlex.join(dry)))


def check_check(clone: FreshClone, command: str) -> None:
    out = expect_only_placeholder_paths(clone.readme(command))
    assert "fits --device-memory-gb 80" in out, out[-4000:]


def check_hf_to_mcore(clone: FreshClone, command: str) -> None:
    clone.ok(command)
    assert (clone.root / "outputs/readme/M/latest_checkpointed_iteration.txt").read_text().strip() == "release"


def check_mcore_to_hf(clone: FreshClone, command: str) -> None:
    from safetensors.torch import load_file

    clone.ok(command)
    want = load_file(str(clone.root / DEMO / "hf_model" / "model.safetensors"))
    got = load_file(str(clone.root / "outputs/readme/H2/model.safetensors"))
    assert set(got) == set(want) and all(got[k].equal(want[k]) for k in want)  # fp32: bit-exact round trip


def check_export(clone: FreshClone, command: str) -> None:
    assert "exported HF checkpoint to" in clone.ok(command).stdout
    export = clone.root / "outputs/readme/export"
    settings = json.loads((export / "megatron_dapo_eval.json").read_text())["config"]
    assert (settings["data"]["max_prompt_length"], settings["data"]["max_response_length"]) == (24, 4)
    assert (export / "model.safetensors").is_file() and (export / "tokenizer" / "tokenizer.json").is_file()


def check_verify(clone: FreshClone, command: str) -> None:
    last = clone.ok(command).stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"max_abs_logits_diff=(\S+)", last)
    assert match and float(match[1]) < 1e-4, last


@dataclass(frozen=True)
class Entry:
    kind: str  # run | bound | dry-run | covered | exempt
    check: Optional[Callable[[FreshClone, str], None]] = None
    binding: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    reason: str = ""
    after: tuple[str, ...] = ()  # README commands whose files this one reads (run first, once)


TRAINING = "launch/run_local.sh configs/tiny_cpu.yaml trainer.total_training_steps=20"
PARTIAL = (
    "launch/run_local.sh configs/tiny_cpu.yaml trainer.total_training_steps=4 trainer.output_dir=outputs/partial"
    " rollout.partial_rollout.enable=true rollout.partial_rollout.max_segments=4"
)
ASYNC = (
    "launch/run_local.sh configs/tiny_cpu.yaml trainer.total_training_steps=4 trainer.output_dir=outputs/async"
    " trainer.mode=async placement.rollout_ranks=1"
)
HF_TO_MCORE = "python tools/checkpoint_convert/convert.py hf-to-mcore --hf-dir H --save-dir M [--dtype bf16|fp16|fp32]"
H = f"{DEMO}/hf_model"
# README command (as extracted: continuations joined, comments dropped) → how it is checked. README order.
COMMANDS: dict[str, Entry] = {
    "bash launch/quickstart.sh": Entry("covered", check_quickstart_is_covered),
    "bash tests/run.sh": Entry("exempt", reason="runs ruff and the whole suite, this test included; CI runs it"),
    TRAINING: Entry("run", check_training, env={"MASTER_PORT": str(TRAIN_PORT)}),
    "source launch/env_cuda.sh": Entry("run", check_env_scripts),
    "NNODES=16 NODE_RANK=$i MASTER_ADDR=node0 NPROC_PER_NODE=8 launch/run_node.sh configs/dapo_qwen2.5_32b.yaml"
    " checkpoint.load_dir=/ckpt/qwen2.5-32b-mcore data.train_files=[/data/dapo-math-17k.parquet]": Entry(
        "dry-run", check_cluster_launch_dry_run, reason="16 nodes x 8 GPUs, the 32B model and the DAPO data"
    ),
    PARTIAL: Entry("run", check_partial_run, env={"MASTER_PORT": str(TRAIN_PORT + 2)}),
    ASYNC: Entry("run", check_async_run, env={"MASTER_PORT": str(TRAIN_PORT + 4)}),
    "bash launch/agent_quickstart.sh": Entry("covered", check_agent_quickstart_is_covered),
    "megatron-dapo check configs/dapo_qwen2.5_32b.yaml --nnodes 16 --nproc-per-node 8 --device-memory-gb 80"
    " [overrides…]": Entry("bound", check_check, binding={"[overrides…]": f"model.hf_config_dir={QWEN32B_DIR}"}),
    HF_TO_MCORE: Entry(
        "bound",
        check_hf_to_mcore,
        binding={"H": H, "M": "outputs/readme/M", "[--dtype bf16|fp16|fp32]": "--dtype fp32"},
        after=(TRAINING,),  # H: the demo model it made
    ),
    "python tools/checkpoint_convert/convert.py mcore-to-hf --load-dir M --save-dir H2 [--hf-config-dir H]": Entry(
        "bound",
        check_mcore_to_hf,
        binding={"M": "outputs/readme/M", "H2": "outputs/readme/H2", "[--hf-config-dir H]": f"--hf-config-dir {H}"},
        after=(HF_TO_MCORE,),
    ),
    "megatron-dapo export --checkpoint CKPT_DIR [--step N] --save-dir H2": Entry(
        "bound",
        check_export,
        binding={"CKPT_DIR": f"{DEMO}/run/checkpoints", "[--step N]": "--step 20", "H2": "outputs/readme/export"},
        after=(TRAINING,),
    ),
    "torchrun --nproc_per_node=4 tools/checkpoint_convert/verify.py --hf-dir H --mcore-dir M --tp 2 --pp 2": Entry(
        "bound",
        check_verify,
        binding={"H": H, "M": "outputs/readme/M"},
        env={"PET_MASTER_PORT": str(VERIFY_PORT)},
        after=(HF_TO_MCORE,),
    ),
}


# ================================================================================================ the tests


def test_every_readme_command_is_classified():
    found = readme_commands()
    unclassified = [c for c in found if c not in COMMANDS]
    stale = [c for c in COMMANDS if c not in found]
    assert not unclassified, f"README commands not classified in {__file__} (add them to COMMANDS): {unclassified}"
    assert not stale, f"COMMANDS entries the README no longer has: {stale}"
    assert found == list(COMMANDS), "COMMANDS must list the README's commands in README order"
    for command, entry in COMMANDS.items():
        assert entry.kind in {"run", "bound", "dry-run", "covered", "exempt"}, command
        assert (entry.check is None) == (entry.kind == "exempt"), command
        assert entry.reason or entry.kind not in {"exempt", "dry-run"}, f"{command!r}: say why it is not run"
        if entry.kind == "bound":
            bind(command, entry.binding)  # every placeholder bound, every binding a placeholder
        elif entry.kind in {"run", "covered"}:
            assert not placeholders(command), f"{command!r} has placeholders: classify it as bound"
        for earlier in entry.after:  # README order: a command reads only what the ones above it leave
            assert list(COMMANDS).index(earlier) < list(COMMANDS).index(command), (command, earlier)


def test_every_fenced_block_names_its_language():
    # An untagged block would hide its commands from this test: tag commands `bash`, anything else e.g. `text`.
    untagged = [lines[:1] for lang, lines in fenced_blocks(README.read_text()) if not lang]
    assert not untagged, f"README.md: fenced blocks without a language: {untagged}"


def test_parsing_joins_continuations_and_drops_comments():
    lines = ["# a comment", "cmd a   # note", "", "run \\", "    --x 1 \\", "  --y [opt…]"]
    assert shell_commands(lines) == ["cmd a", "run --x 1 --y [opt…]"]
    assert placeholders("A=1 run --in H --out H2/x [--f X] CKPT_DIR") == {"H", "H2", "[--f X]", "CKPT_DIR"}
    binding = {"H": "a/H", "H2": "b", "[--f X]": "--f 1"}
    assert bind("conv --in H --out H2 [--f X]", binding) == "conv --in a/H --out b --f 1"
    with pytest.raises(AssertionError, match=r"placeholders \['H', 'M'\], bound \['H'\]"):
        bind("conv --in H --out M", {"H": "a"})


def test_demo_inputs_are_made_only_for_the_demo_layout(tmp_path, monkeypatch):
    """launch/prepare_demo.py (run by run_local.sh) leaves every config but a demo one pointing at its layout alone;
    that it makes a missing demo is the training command's check above."""
    import importlib.util

    from megatron_dapo.config import load_config

    spec = importlib.util.spec_from_file_location("prepare_demo", REPO / "launch" / "prepare_demo.py")
    prepare_demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare_demo)
    monkeypatch.chdir(tmp_path)  # no outputs/ here: the demo would be made if it acted
    tiny = str(REPO / "configs" / "tiny_cpu.yaml")
    assert prepare_demo.prepare_inputs(tiny, ["model.hf_config_dir=/models/mine"]) is None  # the user's model
    assert prepare_demo.prepare_inputs(tiny, ["data.val_files=[mine.parquet]"]) is None
    assert prepare_demo.prepare_inputs(tiny, ["data.no_such_key=1"]) is None  # the trainer names it
    assert prepare_demo.prepare_inputs(str(REPO / "configs" / "dapo_qwen2.5_32b.yaml"), []) is None
    assert not (tmp_path / "outputs").exists()
    moved = ["model.hf_config_dir=d/hf_model", "model.tokenizer_dir=d/tokenizer", "checkpoint.load_dir=d/mcore"]
    moved += ["data.train_files=[d/data/train.parquet]", "data.val_files=[d/data/val.parquet]"]
    assert prepare_demo.demo_root(load_config(tiny, moved)) == Path("d")  # the quickstart's QUICKSTART_DIR
    assert prepare_demo.demo_root(load_config(tiny)) == Path(DEMO)

    # Every launch after the first (the inputs are all there) and every launch on the user's own inputs: nothing to
    # make, seen without loading the config (no torch); whatever is not certain is left to prepare_inputs.
    from megatron_dapo.weights.dist_format import TRACKER_FILE

    assert prepare_demo.MCORE_TRACKER == TRACKER_FILE
    assert not prepare_demo.nothing_to_make(tiny, moved)  # d/ is empty: there is something to make
    for name in ("hf_model/config.json", "tokenizer/tokenizer_config.json", "data/train.parquet", "data/val.parquet"):
        (tmp_path / "d" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "d" / name).write_text("{}")
    assert not prepare_demo.nothing_to_make(tiny, moved)  # no converted checkpoint yet: it would convert
    (tmp_path / "d" / "mcore").mkdir()
    (tmp_path / "d" / "mcore" / TRACKER_FILE).write_text("release")
    made = sorted(tmp_path.rglob("*"))
    elsewhere = ["model.tokenizer_dir=e/tokenizer", "data.val_files=[d/data/val.parquet,x.parquet]"]
    elsewhere += ["data.val_files=[]", "data.train_files=[bad.jsonl]", "model.hf_config_dir=null"]
    for case in ([], ["data.no_such_key=1"], *([change] for change in elsewhere)):
        assert prepare_demo.nothing_to_make(tiny, [*moved, *case]), case
        assert prepare_demo.prepare_inputs(tiny, [*moved, *case]) == (None if case else Path("d")), case
    assert sorted(tmp_path.rglob("*")) == made  # nor did prepare_inputs make anything
    (tmp_path / "partial.yaml").write_text("model:\n  hf_config_dir: d/hf_model\n")  # the rest: the defaults
    assert not prepare_demo.nothing_to_make(str(tmp_path / "partial.yaml"), [])
    for uncertain in ("model", "data.val_files=d/data/val.parquet", "model.hf_config_dir=7", "data.val_files=[7]"):
        assert not prepare_demo.nothing_to_make(tiny, [*moved, uncertain]), uncertain
    assert not prepare_demo.nothing_to_make(str(REPO / "configs" / "no_such.yaml"), moved)
    # main() in a fresh interpreter, as run_local.sh runs it: exits 0 with torch never imported
    script = "import runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
    script += "except SystemExit as e:\n    assert e.code == 0, e.code\nprint('torch' in sys.modules)\n"
    args = [str(REPO / "launch" / "prepare_demo.py"), tiny, *moved]
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c, e in COMMANDS.items() if e.kind != "exempt"], ids=lambda c: c[:60])
def test_readme_command_runs(clone, command):
    COMMANDS[command].check(clone, command)
