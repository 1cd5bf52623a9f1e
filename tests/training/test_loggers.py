"""``reporting.loggers`` (console, jsonl, tensorboard, wandb error path, rank gating, rollout dumps) and
``tools/plot_metrics.py`` on a jsonl written by the logger."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_dapo.reporting.loggers import MetricsLogger, RolloutDumper
from tests.helpers import REPO_ROOT

STEPS = [
    {"critic/score/mean": 0.25, "actor/entropy": torch.tensor(1.5), "response_length/mean": np.float32(12.0)},
    {"critic/score/mean": 0.5, "actor/entropy": 1.25, "response_length/mean": 10, "val-core/math/acc/mean@1": 0.5},
    {"critic/score/mean": float("nan"), "actor/entropy": 1.0, "not/a/scalar": [1, 2], "tensor/vector": torch.ones(2)},
]


def log_steps(tmp_path: Path, backends: list[str], stream=None, verbose: bool = True) -> Path:
    logger = MetricsLogger(
        backends, str(tmp_path), "proj", "exp", {"a": 1}, enabled=True, stream=stream, verbose=verbose
    )
    for step, metrics in enumerate(STEPS, start=1):
        logger.log(metrics, step=step)
    logger.close()
    return tmp_path


def test_jsonl_round_trip(tmp_path: Path) -> None:
    log_steps(tmp_path, ["jsonl"])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [
        {"step": 1, "critic/score/mean": 0.25, "actor/entropy": 1.5, "response_length/mean": 12.0},
        {
            "step": 2,
            "critic/score/mean": 0.5,
            "actor/entropy": 1.25,
            "response_length/mean": 10.0,
            "val-core/math/acc/mean@1": 0.5,
        },
        # NaN is kept readable for strict JSON parsers; non-scalars are not logged.
        {"step": 3, "critic/score/mean": "nan", "actor/entropy": 1.0},
    ]
    # A resumed run appends to the same file.
    MetricsLogger(["jsonl"], str(tmp_path)).log({"x": 1.0}, step=4)
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1]) == {"step": 4, "x": 1.0}


def test_tensorboard_events_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_steps(tmp_path, ["tensorboard"])
    event_files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(event_files) == 1 and event_files[0].stat().st_size > 0
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    entropy = [(e.step, e.value) for e in acc.Scalars("actor/entropy")]
    assert entropy == [(1, 1.5), (2, 1.25), (3, 1.0)]
    score = acc.Scalars("critic/score/mean")
    assert [e.step for e in score] == [1, 2, 3] and score[1].value == 0.5 and math.isnan(score[2].value)
    assert [(e.step, e.value) for e in acc.Scalars("val-core/math/acc/mean@1")] == [(2, 0.5)]
    assert "not/a/scalar" not in acc.Tags()["scalars"]


def test_console_compact_table(tmp_path: Path) -> None:
    stream = io.StringIO()
    logger = MetricsLogger(["console"], str(tmp_path), stream=stream, console_every=10, total_steps=30)
    for step in range(1, 31):
        metrics = {"critic/score/mean": step / 30, "response_length/mean": 2.0, "timing_s/step": 0.5}
        if step == 15:
            metrics["val-core/a/acc/mean@1"] = 0.5
            metrics["val-core/b/acc/mean@1"] = 1.0
        logger.log(metrics, step=step)
    lines = stream.getvalue().splitlines()
    # header, then steps 1 (first), 10, 15 (validated), 20, 30 (every 10 and the last)
    assert lines[0].split() == [
        "step",
        "score",
        "val_acc",
        "resp_len",
        "pg_loss",
        "grad_norm",
        "entropy",
        "kept",
        "upd_ok",
        "s/step",
    ]
    assert [line.split()[0] for line in lines[1:]] == ["1/30", "10/30", "15/30", "20/30", "30/30"]
    assert lines[3].split() == ["15/30", "0.500", "0.750", "2.0", "0.50"]  # val_acc: mean over data sources
    assert len({len(line) for line in lines}) == 1  # fixed width


def test_console_verbose_line_per_step(tmp_path: Path) -> None:
    stream = io.StringIO()
    log_steps(tmp_path, ["console"], stream=stream)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0] == "step 1 | actor/entropy=1.5 | critic/score/mean=0.25 | response_length/mean=12"
    assert lines[2].startswith("step 3 | actor/entropy=1 | critic/score/mean=nan")
    assert not (tmp_path / "metrics.jsonl").exists()


def test_backend_errors_and_rank_gating(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"unknown backend\(s\) \['mlflow'\]; valid backends are \['console', 'jsonl'"):
        MetricsLogger(["jsonl", "mlflow"], str(tmp_path))
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail as when it is not installed
    with pytest.raises(ImportError, match="includes 'wandb' but wandb is not installed: pip install wandb"):
        MetricsLogger(["wandb"], str(tmp_path))
    # Not rank 0: constructs (even with an unusable backend), logs nothing, writes nothing.
    quiet = MetricsLogger(["jsonl", "tensorboard", "wandb"], str(tmp_path / "rank1"), enabled=False)
    quiet.log({"x": 1.0}, step=1)
    quiet.close()
    assert not (tmp_path / "rank1").exists()


def test_rollout_dumper(tmp_path: Path) -> None:
    dumper = RolloutDumper(str(tmp_path / "rollouts"))
    path = dumper.dump(7, ["1+1=", "2+2="], ["2", "5 ✓"], [1.0, 0])
    assert path == tmp_path / "rollouts" / "7.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert rows == [
        {"prompt": "1+1=", "response": "2", "score": 1.0, "step": 7},
        {"prompt": "2+2=", "response": "5 ✓", "score": 0.0, "step": 7},
    ]
    with pytest.raises(ValueError, match="2 prompts, 1 responses and 2 scores"):
        dumper.dump(8, ["a", "b"], ["x"], [0.0, 1.0])


def _plot(metrics: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "plot_metrics.py"), str(metrics), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_plot_metrics_writes_png(tmp_path: Path) -> None:
    import matplotlib.image

    logger = MetricsLogger(["jsonl"], str(tmp_path))
    for step in range(1, 21):
        metrics = {
            "critic/score/mean": step / 20,
            "critic/score/min": 0.0,
            "critic/score/max": 1.0,
            "response_length/mean": 30 - step,
            "response_length/clip_ratio": 0.5 / step,
            "actor/entropy": 2.0 / step,
        }
        if step % 5 == 0:
            metrics["val-core/arithmetic/acc/mean@1"] = step / 25
            metrics["val-core/gsm8k/acc/mean@4"] = step / 40
        logger.log(metrics, step=step)
    logger.close()
    proc = _plot(tmp_path / "metrics.jsonl", tmp_path / "curves.png")
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout and "from 20 steps" in proc.stdout and "no data" not in proc.stdout
    image = matplotlib.image.imread(tmp_path / "curves.png")
    assert image.shape[0] > 500 and image.shape[1] > 800
    assert image[..., :3].std() > 0.05  # not a blank canvas

    # Missing series leave their panels empty with a note; a broken line is named.
    (tmp_path / "partial.jsonl").write_text('{"step": 1, "critic/score/mean": 0.1}\n{"step": 2}\n')
    proc = _plot(tmp_path / "partial.jsonl", tmp_path / "partial.png")
    assert proc.returncode == 0, proc.stderr
    assert "no data for: validation accuracy, response length, entropy" in proc.stdout
    assert (tmp_path / "partial.png").stat().st_size > 0
    (tmp_path / "bad.jsonl").write_text('{"step": 1}\n{"step": 2,\n')
    proc = _plot(tmp_path / "bad.jsonl", tmp_path / "bad.png")
    assert proc.returncode == 2 and "bad.jsonl:2: not valid JSON" in proc.stderr
