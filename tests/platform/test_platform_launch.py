"""Launch-side platform choices: processes per node detected by launch/run_node.sh, and the Ascend environment.

The accelerators are absent here, so the device probes are stood in for by tiny fakes on PATH/PYTHONPATH (a fake
``nvidia-smi``/``npu-smi`` printing what the real tools print, a fake ``torch_npu`` reporting a SoC version); what
is tested is the script's selection logic. Real A2/A3/GPU nodes are unverified.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN_NODE = ROOT / "launch" / "run_node.sh"


def nproc(tmp_path: Path, *, nvidia: int = 0, npu_count: int = 0, soc: int = 0) -> int:
    bin_dir, py_dir = tmp_path / "bin", tmp_path / "py"
    bin_dir.mkdir(exist_ok=True)
    py_dir.mkdir(exist_ok=True)
    if nvidia:
        lines = "".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})\\n" for i in range(nvidia))
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '{lines}'\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    if npu_count:
        (bin_dir / "npu-smi").write_text(f"#!/bin/sh\nprintf '\\tTotal Count                    : {npu_count}\\n'\n")
        (bin_dir / "npu-smi").chmod(0o755)
    if soc:
        pkg = py_dir / "torch_npu"
        pkg.mkdir(exist_ok=True)
        (pkg / "__init__.py").write_text(
            "class npu:\n"
            f"    get_soc_version = staticmethod(lambda: {soc})\n"
            "    device_count = staticmethod(lambda: 4)\n"
        )
    env = {k: v for k, v in os.environ.items() if k != "NPROC_PER_NODE"}
    env.update(PATH=f"{bin_dir}:/usr/bin:/bin", PYTHONPATH=str(py_dir), PYTHON=sys.executable)
    out = subprocess.run(["bash", str(RUN_NODE), "--print-nproc"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


@pytest.mark.parametrize(
    "probe, expected",
    [
        (dict(), 2),  # CPU
        (dict(nvidia=8), 8),
        (dict(nvidia=4), 4),
        (dict(soc=223), 8),  # Atlas A2 (910B)
        (dict(soc=251), 16),  # Atlas A3: 16 devices per node
        (dict(soc=100), 4),  # unknown SoC: torch_npu's device count
        (dict(npu_count=8), 8),  # no torch_npu in this Python: npu-smi's count
        (dict(soc=251, nvidia=8), 16),  # the NPU probe comes first
    ],
)
def test_run_node_default_nproc(tmp_path, probe, expected):
    assert nproc(tmp_path, **probe) == expected


def test_explicit_nproc_wins(tmp_path):
    env = dict(os.environ, NPROC_PER_NODE="3")
    out = subprocess.run(["bash", str(RUN_NODE), "--print-nproc"], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "3"


def test_env_ascend_never_enables_expandable_segments(tmp_path):
    script = (
        f"export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True; source {ROOT / 'launch' / 'env_ascend.sh'};"
        ' echo "conf=${PYTORCH_NPU_ALLOC_CONF:-unset}"'
    )
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert out.stdout.strip().splitlines()[-1] == "conf=unset"
    assert "vllm-ascend sleep mode" in out.stderr
    out = subprocess.run(
        ["bash", "-c", f"source {ROOT / 'launch' / 'env_ascend.sh'}; echo conf=${{PYTORCH_NPU_ALLOC_CONF:-unset}}"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert out.stdout.strip().splitlines()[-1] == "conf=unset"
