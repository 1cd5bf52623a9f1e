"""Converted checkpoints under torchrun: megatron-core logits vs HF, reshard on load, save from a live model.

The 4-process checks share one torchrun (``verify_worker.py`` runs ``verify.py``'s ``main`` per case), so the
processes start megatron-core and transformers once; ``verify.py`` itself is also run directly as a script.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from megatron_dapo.weights.convert import convert_hf_to_mcore, convert_mcore_to_hf
from megatron_dapo.weights.mcore_checkpoint import rank_file
from tests.helpers import run_torchrun
from tests.weights.conftest import assert_same_tensors, load_hf_tensors

REPO = Path(__file__).resolve().parents[2]
VERIFY = REPO / "tools" / "checkpoint_convert" / "verify.py"
WORKER = Path(__file__).with_name("verify_worker.py")
TOL = 1e-4
FAMILIES = [("qwen2", True, True), ("qwen3", False, False), ("llama", False, True)]  # family, tied, SP


def _diff(lines: list[str]) -> float:
    lines = [ln for ln in lines if ln.strip()]
    tail = "\n".join(lines[-20:])
    assert lines and lines[-1].startswith("max_abs_logits_diff="), f"output does not end with the diff line:\n{tail}"
    return float(lines[-1].split("=", 1)[1])


def _load_report(lines: list[str]) -> list[dict]:
    line = next(ln for ln in lines if ln.startswith("load_report="))
    return json.loads(line.split("=", 1)[1])


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
    """One 4-process torchrun: TP=2 PP=2 per family, a wrong checkpoint, and VPP + DP reshard then save."""
    work = tmp_path_factory.mktemp("verify4")
    cases = []
    for family, tie, sp in FAMILIES:
        hf = tiny_hf(family, tie)
        convert_hf_to_mcore(hf, work / f"m_{family}", tp=2, pp=2)
        argv = [
            "--hf-dir",
            str(hf),
            "--mcore-dir",
            str(work / f"m_{family}"),
            "--tp",
            "2",
            "--pp",
            "2",
            "--tol",
            str(TOL),
        ] + (["--sp"] if sp else [])
        cases.append({"name": family, "kind": "main", "argv": argv})
    # Another seed's llama (same shapes) against the llama HF model: the check must fail.
    convert_hf_to_mcore(tiny_hf("llama", seed=1), work / "m_llama_seed1", tp=2, pp=2)
    cases.append(
        {
            "name": "wrong",
            "kind": "main",
            "argv": [
                "--hf-dir",
                str(tiny_hf("llama")),
                "--mcore-dir",
                str(work / "m_llama_seed1"),
                "--tp",
                "2",
                "--pp",
                "2",
            ],
        }
    )
    # Converted at TP=2 PP=1, run at TP=1 PP=2 VPP=2 DP=2: vocabulary re-padded 256 → 128, tied output layer built
    # from the embedding; then saved from that layout.
    convert_hf_to_mcore(tiny_hf("qwen2", True), work / "m_tp2pp1", tp=2, pp=1)
    cases.append(
        {
            "name": "vpp",
            "kind": "save",
            "save_dir": str(work / "saved"),
            "argv": [
                "--hf-dir",
                str(tiny_hf("qwen2", True)),
                "--mcore-dir",
                str(work / "m_tp2pp1"),
                "--tp",
                "1",
                "--pp",
                "2",
                "--vpp",
                "2",
            ],
        }
    )
    (work / "cases.json").write_text(json.dumps(cases))
    (work / "out").mkdir()
    stdout = run_torchrun(WORKER, 4, ["--cases", work / "cases.json", "--out", work / "out"], port=29701, timeout=500)
    return {"work": work, "cases": _cases(stdout), "stdout": stdout}


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f, _, _ in FAMILIES])
def test_verify_tp2_pp2(four_process_run, family):
    rc, lines = four_process_run["cases"][family]
    diff = _diff(lines)
    assert rc == 0 and 0.0 <= diff <= TOL, (rc, diff)
    # Same layout: every rank read its own file and nothing else (rank = tp + 2 * pp).
    report = _load_report(lines)
    assert [r["files"] for r in report] == [[str(rank_file("", t, p))] for p in (0, 1) for t in (0, 1)]
    assert all(r["same_layout"] for r in report)


@pytest.mark.slow
def test_verify_detects_a_wrong_checkpoint(four_process_run):
    rc, lines = four_process_run["cases"]["wrong"]
    assert rc == 1 and _diff(lines) > 0.1


@pytest.mark.slow
def test_reshard_with_virtual_stages_and_data_parallel_then_save(four_process_run, tiny_hf, tmp_path):
    work = four_process_run["work"]
    results = [json.loads((work / "out" / f"vpp.rank{r}.json").read_text()) for r in range(4)]
    assert all(0.0 <= r["max_abs_logits_diff"] <= TOL for r in results)
    assert not any(r["same_layout"] for r in results)
    # Each TP=1 rank merged the two old TP shards: it read both files of the single old stage.
    old_files = ["mp_rank_00_000", "mp_rank_01_000"]
    assert all(sorted(Path(f).parent.name for f in r["files"]) == old_files for r in results)

    saved = work / "saved"
    meta = json.loads((saved / "mcore_meta.json").read_text())
    assert (meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"]) == (1, 2)
    assert (meta["virtual_pipeline_model_parallel_size"], meta["padded_vocab_size"]) == (2, 128)
    expected_entries = ["hf_config", "mcore_meta.json", "mp_rank_00_000", "mp_rank_00_001"]
    assert sorted(p.name for p in saved.iterdir()) == expected_entries
    # With VPP=2 pipeline rank 0 holds layers 0 and 2, rank 1 layers 1 and 3 (global names in the files).
    layers = [
        {n.split(".")[2] for n in load_file(str(rank_file(saved, 0, p))) if n.startswith("decoder.layers.")}
        for p in (0, 1)
    ]
    assert layers == [{"0", "2"}, {"1", "3"}]
    assert "output_layer.weight" in load_file(str(rank_file(saved, 0, 1)))
    back = convert_mcore_to_hf(saved, tmp_path / "hf2")
    assert_same_tensors(load_hf_tensors(tiny_hf("qwen2", True)), load_hf_tensors(back.save_dir))


def test_verify_script_at_a_different_layout(tiny_hf, tmp_path):
    """``torchrun verify.py`` itself: converted at TP=2 PP=1, run at TP=1 PP=2 (reshard on load)."""
    hf = tiny_hf("qwen3")
    convert_hf_to_mcore(hf, tmp_path / "m", tp=2, pp=1)
    out = run_torchrun(
        VERIFY,
        2,
        ["--hf-dir", hf, "--mcore-dir", tmp_path / "m", "--tp", "1", "--pp", "2", "--tol", str(TOL)],
        port=29702,
        timeout=400,
    )
    lines = out.splitlines()
    assert 0.0 <= _diff(lines) <= TOL
    assert any("resharded on load" in ln for ln in lines)
    # Both stages read both old TP files of the one old stage.
    assert [sorted(r["files"]) for r in _load_report(lines)] == [
        ["mp_rank_00_000/model.safetensors", "mp_rank_01_000/model.safetensors"]
    ] * 2
