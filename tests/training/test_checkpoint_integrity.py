"""Checkpoint integrity (``checkpointing.checkpoint`` + ``weights.integrity``): the manifest matches an independent read
of every file; damaged checkpoints (truncated ``.distcp``, truncated rng file, a flipped byte) give the same named
error on both ranks, ``auto`` falls back to the previous intact step with a warning, and raises when none is
intact; a NaN weight is refused before anything is written; a failing or stuck writer thread ends the save with a
``CheckpointError`` within ``timeout_s`` and nothing is published; background saves (``save(blocking=False)``) hold
the state of the moment they were asked for and are published by the next save or ``finalize``.

``integrity_worker.py`` runs everything in one torchrun (world 2); see its docstring.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import xxhash

from megatron_dapo.checkpointing.checkpoint import CheckpointIntegrityError, resolve_resume
from megatron_dapo.weights.integrity import crc32_combine, first_non_finite
from tests.helpers import run_torchrun

WORKER = Path(__file__).with_name("integrity_worker.py")
PORT = 29865


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("integrity")
    run_torchrun(WORKER, nproc=2, args=["--out", str(out)], port=PORT, timeout=400)
    return {"out": out, "ranks": [json.loads((out / f"integrity_rank{r}.json").read_text()) for r in range(2)]}


def test_manifest_matches_the_files(run: dict) -> None:
    step_dir = run["out"] / "ckpt" / "global_step_2"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["checksum"] == "xxh3_64" and manifest["version"] == 2
    on_disk = sorted(
        p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*") if p.is_file() and p.name != "manifest.json"
    )
    assert sorted(manifest["files"]) == on_disk  # every file, nothing else
    assert {"dist_ckpt/.metadata", "dist_ckpt/common.pt", "rng/rank_00001.pt", "trainer_state.json"} <= set(on_disk)
    for rel, entry in manifest["files"].items():
        data = (step_dir / rel).read_bytes()  # independent reference: the bytes on disk
        assert entry == {"size": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}, rel


def test_nan_weight_is_refused(run: dict) -> None:
    for r in run["ranks"]:
        nan = r["nan"]
        assert nan["type"] == "CheckpointIntegrityError"
        assert "refusing to save checkpoint" in nan["error"] and "global_step_3" in nan["error"]
        assert f"tensor 'model{nan['param']}' on rank 1 holds non-finite values" in nan["error"]
        assert nan["after"] == ["global_step_1", "global_step_2", "latest"]  # not even a temporary directory
        assert nan["latest"] == "global_step_2\n"
    assert run["ranks"][0]["nan"]["error"] == run["ranks"][1]["nan"]["error"]


def test_failing_or_stuck_writer(run: dict) -> None:
    for r in run["ranks"]:
        failed = r["failed"]
        assert failed["type"] == "CheckpointError"
        assert "checkpoint writer thread (writing " in failed["error"]
        assert "__0_0.distcp) for global_step_4" in failed["error"]
        assert "failed: OSError: [Errno 28] No space left on device" in failed["error"]
        assert "was not published" in failed["error"]
        assert failed["latest"] == "global_step_2\n" and "global_step_4" not in failed["after"]
        stuck = r["stuck"]
        assert stuck["type"] == "CheckpointError" and "did not finish within timeout_s=3" in stuck["error"]
        assert 3 <= stuck["seconds"] < 15  # about timeout_s: the writers hang until the worker releases them
        assert stuck["latest"] == "global_step_2\n" and "global_step_5" not in stuck["after"]
        # The next save works and removes the unpublished leftovers.
        assert r["after_recovery"] == ["global_step_1", "global_step_2", "global_step_6", "latest"]
    assert run["ranks"][0]["failed"]["error"] == run["ranks"][1]["failed"]["error"]
    # save() returned while rank 0's writers (it writes the files at DP=2) still hung: the timeout ended it.
    assert run["ranks"][0]["stuck"]["hung_writers"] >= 1


def test_background_save(run: dict) -> None:
    for r in run["ranks"]:
        bg = r["background"]
        # While step 2's files are written, latest names step 1 and step 2 is only a temporary directory.
        assert bg["pending"] == 2 and bg["latest_pending"] == "global_step_1\n"
        assert bg["while_pending"] == [".tmp-step_2", "global_step_1", "latest"]
        # The next save publishes it first; finalize publishes the last one.
        assert bg["pending_after_next"] == 3 and bg["latest_after_next"] == "global_step_2\n"
        assert bg["finalized"] == "global_step_3" and bg["latest_after_finalize"] == "global_step_3\n"
        assert bg["after_finalize"] == ["global_step_1", "global_step_2", "global_step_3", "latest"]
        # Step 2 holds the parameters of the moment save() was called, not those trained while it was written.
        assert bg["problem"] is None and bg["loaded_step"] == 2
        assert bg["max_diff_vs_save_time"] == 0.0
        # A background write that fails: save() returned, the finalize that completes it raises on every rank.
        assert bg["failing_save"]["error"] is None
        fin = bg["failing_finalize"]
        assert fin["type"] == "CheckpointError" and "global_step_4" in fin["error"] and "No space left" in fin["error"]
        assert bg["latest_after_failure"] == "global_step_3\n" and "global_step_4" not in bg["after_failure"]
        assert bg["nothing_pending"] is None
    errors = [r["background"]["failing_finalize"]["error"] for r in run["ranks"]]
    assert errors[0] == errors[1]


@pytest.mark.parametrize(
    ("kind", "file", "what"),
    [
        ("distcp", "dist_ckpt/__0_0.distcp", r"truncated \(expected (\d+) bytes, found (\d+)\)"),
        ("rng", "rng/rank_00001.pt", r"truncated \(expected \d+ bytes, found 100\)"),
        ("flip", "dist_ckpt/__0_1.distcp", r"corrupt \(expected xxh3_64 [0-9a-f]{16}, found [0-9a-f]{16}\)"),
    ],
)
def test_damaged_checkpoint(run: dict, kind: str, file: str, what: str) -> None:
    import re

    root = run["out"] / f"damaged-{kind}"
    damaged = root / "global_step_2"
    for r in run["ranks"]:
        res = r[kind]
        for key in ("explicit", "load"):
            assert res[key]["type"] == "CheckpointIntegrityError", res[key]
            assert re.search(f"{re.escape(str(damaged))}.* {re.escape(str(damaged / file))}: {what}", res[key]["error"])
        assert res["auto"] == str(root / "global_step_1")
        assert res["auto_loaded_step"] == 1
        if r is run["ranks"][0]:  # the warning is rank 0's
            assert len(res["auto_warnings"]) == 1
            assert re.search(f"skipping {re.escape(str(damaged))} is damaged: .*{what}", res["auto_warnings"][0])
    for key in ("explicit", "load"):  # the same error on both ranks
        assert run["ranks"][0][kind][key]["error"] == run["ranks"][1][kind][key]["error"]
    if kind == "distcp":
        m = re.search(what, run["ranks"][0][kind]["explicit"]["error"])
        assert int(m.group(2)) == int(m.group(1)) // 2  # the worker cut the file in half
        for r in run["ranks"]:
            none = r[kind]["none_intact"]
            assert none["type"] == "CheckpointIntegrityError"
            assert f"no intact checkpoint in {root}; newest: {damaged} is damaged" in none["error"]
        # In one process too (no torch.distributed): the same verdicts.
        with pytest.raises(CheckpointIntegrityError, match=f"{re.escape(str(damaged / file))}: {what}"):
            resolve_resume(str(damaged), None)


def test_old_checkpoint_without_manifest_still_resolves(run: dict, tmp_path: Path) -> None:
    import shutil

    step_dir = tmp_path / "global_step_2"
    shutil.copytree(run["out"] / "ckpt" / "global_step_2", step_dir)
    (step_dir / "manifest.json").unlink()
    assert resolve_resume(str(step_dir), None) == step_dir
    (step_dir / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointIntegrityError, match=r"manifest.json: corrupt manifest"):
        resolve_resume(str(step_dir), None)


def test_verification_cost_is_small(run: dict) -> None:
    # Counted, not timed: the first verification reads each manifest file once, on one of the 2 ranks (round-robin
    # over the sorted names), and a second verification of the same directory reads none (sizes only).
    ranks = run["ranks"]
    files = ranks[0]["manifest_files"]
    assert ranks[0]["checkpoint_bytes"] > 500_000 and sum(files.values()) > 0.9 * ranks[0]["checkpoint_bytes"]
    hashed = [dict(r["verify_hashed"]) for r in ranks]
    assert sorted(name for h in hashed for name in h) == sorted(files)  # every file once, by one rank
    for rank, h in enumerate(hashed):
        assert h == {name: files[name] for name in sorted(files)[rank::2]}
    assert all(r["verify_sizes_only_hashed"] == [] for r in ranks)


def test_crc32_combine_and_first_non_finite() -> None:
    import random

    import torch

    rng = random.Random(0)
    a, b = rng.randbytes(1001), rng.randbytes(77777)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b""), 0) == zlib.crc32(a)
    ok = torch.full((4,), 3.0e38)  # max |x| is finite even where a 2-norm would overflow
    nan, inf = torch.ones(3, dtype=torch.bfloat16), torch.zeros(2)
    nan[1], inf[0] = float("nan"), float("-inf")
    ints = torch.tensor([1, 2])
    assert first_non_finite([("ok", ok), ("ints", ints)]) is None
    assert first_non_finite([("ok", ok), ("inf", inf), ("nan", nan)]) == "inf"
    assert first_non_finite([("nan", nan), ("inf", inf)]) == "nan"


def test_process_killed_during_background_save(tmp_path: Path) -> None:
    """A process killed while a background save writes its files: ``latest`` stays on the previous step, which
    verifies and is what ``auto`` resumes from; the unpublished step is a temporary directory (the next save removes
    it: ``test_failing_or_stuck_writer``)."""
    import os
    import signal
    import subprocess
    import sys

    from tests.helpers import REPO_ROOT

    save_dir = tmp_path / "ckpt"
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29866")
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])))
    worker = Path(__file__).with_name("background_kill_worker.py")
    proc = subprocess.run(
        [sys.executable, str(worker), str(save_dir)],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-4000:]
    assert (tmp_path / "pending_step.txt").read_text() == "2"
    assert sorted(p.name for p in save_dir.iterdir()) == [".tmp-step_2", "global_step_1", "latest"]
    assert (save_dir / "latest").read_text() == "global_step_1\n"
    assert resolve_resume("auto", save_dir) == save_dir / "global_step_1"  # checksums verified
