"""Converted checkpoints under torchrun: one layout-free checkpoint loads at TP1, TP2, PP2 and TP2×PP2 (and with
virtual stages) with megatron-core logits within 1e-5 of HF's; starting from the HF directory directly gives
bit-identical parameters.

The 4-process checks share one torchrun (``verify_worker.py`` runs ``verify.py``'s ``main`` per case), so the
processes start megatron-core and transformers once; ``verify.py`` itself is also run directly as a script.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_dapo.weights.convert import convert_hf_to_mcore
from tests.helpers import run_torchrun

REPO = Path(__file__).resolve().parents[2]
VERIFY = REPO / "tools" / "checkpoint_convert" / "verify.py"
WORKER = Path(__file__).with_name("verify_worker.py")
TOL = 1e-5
FAMILIES = [("qwen2", True, True), ("qwen3", False, False), ("llama", False, True)]  # family, tied, SP
# (tp, pp): every layout in 4 processes, the rest of the world is data parallelism.
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def _diff(lines: list[str]) -> float:
    lines = [ln for ln in lines if ln.strip()]
    tail = "\n".join(lines[-20:])
    assert lines and lines[-1].startswith("max_abs_logits_diff="), f"output does not end with the diff line:\n{tail}"
    return float(lines[-1].split("=", 1)[1])


def _cases(stdout: str) -> dict[str, tuple[int, list[str]]]:
    """Split the worker's stdout at its ``=== case <name> rc=<rc>`` lines: name → (rc, the case's lines)."""
    out, current = {}, []
    for line in stdout.splitlines():
        if line.startswith("=== case "):
            name, rc = line[len("=== case ") :].rsplit(" rc=", 1)
            out[name] = (int(rc), current)
            current = []
        else:
            current.append(line)
    return out


@pytest.fixture(scope="module")
def four_process_run(tiny_hf, tmp_path_factory):
    """One 4-process torchrun: each family at every layout from one converted checkpoint, a wrong checkpoint, and
    HF-direct vs converted parameters (with virtual stages for qwen2)."""
    work = tmp_path_factory.mktemp("verify4")
    cases = []
    for family, tie, sp in FAMILIES:
        hf = tiny_hf(family, tie)
        convert_hf_to_mcore(hf, work / f"m_{family}")
        for tp, pp in LAYOUTS:
            argv = ["--hf-dir", str(hf), "--mcore-dir", str(work / f"m_{family}"), "--tp", str(tp), "--pp", str(pp)]
            argv += ["--tol", str(TOL)] + (["--sp"] if sp and tp > 1 else [])
            cases.append({"name": f"{family}_tp{tp}pp{pp}", "kind": "main", "argv": argv})
        compare = ["--hf-dir", str(hf), "--mcore-dir", str(work / f"m_{family}"), "--tp", "2", "--pp", "2"]
        compare += ["--vpp", "2"] if family == "qwen2" else []
        cases.append({"name": f"{family}_compare", "kind": "compare", "argv": compare, "hf_dir": str(hf)})
    # A checkpoint converted from other weights (seed 1) must fail the check (exit status 1).
    convert_hf_to_mcore(tiny_hf("qwen2", True, seed=1), work / "m_other")
    wrong = ["--hf-dir", str(tiny_hf("qwen2", True)), "--mcore-dir", str(work / "m_other"), "--tp", "2", "--pp", "2"]
    cases.append({"name": "wrong", "kind": "main", "argv": wrong})
    (work / "cases.json").write_text(json.dumps(cases))
    stdout = run_torchrun(
        WORKER, nproc=4, args=["--cases", str(work / "cases.json"), "--out", str(work)], port=29881, timeout=900
    )
    return _cases(stdout), work


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f, _, _ in FAMILIES])
def test_one_checkpoint_loads_at_every_layout(four_process_run, family):
    cases, _ = four_process_run
    for tp, pp in LAYOUTS:
        rc, lines = cases[f"{family}_tp{tp}pp{pp}"]
        diff = _diff(lines)
        print(f"{family} TP={tp} PP={pp}: max_abs_logits_diff={diff:.3e}")
        assert rc == 0 and diff <= TOL, (family, tp, pp, diff)
        assert any("loaded Megatron distributed checkpoint" in ln and "(release)" in ln for ln in lines)


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f, _, _ in FAMILIES])
def test_hf_directory_gives_the_converted_checkpoints_weights_bit_for_bit(four_process_run, family):
    _, work = four_process_run
    results = [json.loads((work / f"{family}_compare.rank{r}.json").read_text()) for r in range(4)]
    for r, res in enumerate(results):
        assert res["loaded"] == ["megatron", "hf"], (r, res)
        assert res["compared"] > 0 and res["differing"] == [], (r, res)
        assert res["max_abs_logits_diff"] <= TOL
        assert res["num_chunks"] == (2 if family == "qwen2" else 1)


@pytest.mark.slow
def test_verify_detects_a_wrong_checkpoint(four_process_run):
    rc, lines = four_process_run[0]["wrong"]
    assert rc == 1 and _diff(lines) > 1e-2


def test_verify_script_from_an_hf_directory(tiny_hf, tmp_path):
    """verify.py as a script (2 processes, TP=2), loading the HF directory itself."""
    hf = tiny_hf("llama")
    stdout = run_torchrun(
        VERIFY,
        nproc=2,
        args=["--hf-dir", str(hf), "--mcore-dir", str(hf), "--tp", "2", "--tol", str(TOL)],
        port=29882,
        timeout=300,
    )
    lines = stdout.splitlines()
    assert any(f"loaded HF model directory {hf}" in ln for ln in lines)
    assert _diff(lines) <= TOL
