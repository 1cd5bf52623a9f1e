"""The eval's metric math against brute force and hand-computed cases; --model detection and config flags."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dapo.config import ConfigError
from megatron_dapo.evaluation import (
    ModelInputError,
    ModelSource,
    SampleRecord,
    build_eval_config,
    identify_model,
    k_values,
    majority_correct,
    pass_at_k,
    summarize,
)
from megatron_dapo.reporting.metrics import compute_val_metrics
from megatron_dapo.rollout.sync import hf_weight_buckets

REPO = Path(__file__).resolve().parents[2]


def brute_force_pass_at_k(outcomes: list[bool], k: int) -> float:
    """Share of all k-subsets of the responses that contain a correct one (the definition pass@k estimates)."""
    subsets = list(itertools.combinations(range(len(outcomes)), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pass_at_k_equals_subset_enumeration(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(outcomes, k), abs=1e-12), (n, c, k)


def test_pass_at_k_hand_cases_and_errors():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)  # 1 - C(2,2)/C(4,2)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001)  # huge binomials stay exact
    with pytest.raises(ValueError, match="n=4, c=5, k=1"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="n=4, c=1, k=5"):
        pass_at_k(4, 1, 5)


def test_k_values():
    assert k_values(1) == [1]
    assert k_values(4) == [1, 2, 4]
    assert k_values(6) == [1, 2, 4, 6]
    assert k_values(32) == [1, 2, 4, 8, 16, 32]
    with pytest.raises(ValueError, match="n=0"):
        k_values(0)


def test_majority_correct_hand_cases():
    assert majority_correct(["4", "4", "5"], [1, 1, 0]) == 1.0
    assert majority_correct(["5", "4", "5"], [0, 1, 0]) == 0.0
    assert majority_correct(["5", "4"], [0, 1]) == 0.0  # a tie goes to the answer seen first
    assert majority_correct(["4", "5"], [1, 0]) == 1.0
    assert majority_correct([None, None, "4"], [0, 0, 1]) == 1.0  # no pred, no vote
    assert majority_correct([None, None], [0, 0]) == 0.0
    assert majority_correct(["[INVALID]", "[INVALID]", "4"], [0, 0, 1]) == 1.0  # math_dapo's "no answer found"
    with pytest.raises(ValueError, match="2 preds but 1 accs"):
        majority_correct(["1", "2"], [1])


def rec(source, prompt, sample, acc, pred, length=3, truncated=False):
    return SampleRecord(source, prompt, sample, float(acc), pred, length, truncated)


def test_summarize_hand_computed():
    records = [
        # source a, n = 4. prompt 0: correct answer "1", two of four correct
        rec("a", 0, 0, 0, "2", length=2),
        rec("a", 0, 1, 1, "1", length=2),
        rec("a", 0, 2, 1, "1", length=4, truncated=True),
        rec("a", 0, 3, 0, "3", length=2),
        # prompt 1: none correct, one unextractable answer
        rec("a", 1, 0, 0, None, length=4, truncated=True),
        rec("a", 1, 1, 0, "7", length=2),
        rec("a", 1, 2, 0, "7", length=2),
        rec("a", 1, 3, 0, "8", length=2),
        # source b (no preds: no maj@k), prompt 5: all correct
        *[rec("b", 5, j, 1, None, length=1) for j in range(4)],
    ]
    s = summarize(records, 4)
    a, b = s["a"], s["b"]
    assert a["mean@4"] == 2 / 8
    assert a["pass@1"] == pytest.approx((0.5 + 0) / 2)
    assert a["pass@2"] == pytest.approx((5 / 6 + 0) / 2)
    assert a["pass@4"] == pytest.approx(0.5)
    # maj@2: prompt 0 first two = "2"(wrong), "1" tie -> "2" wrong; prompt 1 -> "7" wrong. maj@4: prompt 0 "1" x2 wins.
    assert a["maj@2"] == 0.0 and a["maj@4"] == 0.5
    assert a["response_length/mean"] == 20 / 8 and a["truncation_rate"] == 2 / 8
    assert a["num_prompts"] == 2 and a["num_responses"] == 8
    assert b["mean@4"] == 1.0 and b["pass@4"] == 1.0 and "maj@2" not in b
    # mean@n is the trainer's validation metric
    val = compute_val_metrics([r.data_source for r in records], [r.acc for r in records], 4)
    assert val == {"val-core/a/acc/mean@4": a["mean@4"], "val-core/b/acc/mean@4": b["mean@4"]}
    with pytest.raises(ValueError, match="prompt 1 has 3 responses, not 4"):
        summarize(records[:7], 4)


def test_weight_buckets_keep_decoder_layers_whole():
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    sizes = dict.fromkeys(names, 10)
    assert (
        hf_weight_buckets(names, sizes, 25)
        == [
            ["model.embed_tokens.weight"],
            names[1:4],  # 30 bytes: over the budget, but a layer is never split
            names[4:6],
            ["model.norm.weight", "lm_head.weight"],
        ]
    )
    assert hf_weight_buckets(names, sizes, 10**6) == [names]


def test_unrecognised_model_names_what_was_found_and_what_works(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "weights.bin").write_text("x")
    for path, found in [
        (tmp_path / "junk", "a directory containing ['weights.bin']"),
        (tmp_path / "missing", "nothing (no such path)"),
        (tmp_path / "junk" / "weights.bin", "a file, not a directory"),
    ]:
        with pytest.raises(ModelInputError) as err:
            identify_model(path)
        msg = str(err.value)
        assert found in msg
        expected_kinds = ("HF model directory", "latest_checkpointed_iteration.txt", "global_step_<n>/", "save_dir")
        for expected in expected_kinds:
            assert expected in msg
    # the CLI turns it into a one-line error and exit status 2, before any process group or engine starts
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_dapo.cli", "eval", "--model", str(tmp_path / "junk"), "--data", "x.parquet"]
        + ["--output-dir", str(tmp_path / "o")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: --model") and "weights.bin" in proc.stderr


def test_model_kinds_detected(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    mcore = tmp_path / "mcore"
    mcore.mkdir()
    (mcore / "latest_checkpointed_iteration.txt").write_text("release")
    save_dir = tmp_path / "ckpts"
    (save_dir / "global_step_3").mkdir(parents=True)
    (save_dir / "global_step_3" / "config.yaml").write_text("{}")
    assert identify_model(hf) == ModelSource("hf", hf)
    assert identify_model(mcore) == ModelSource("mcore", mcore)
    assert identify_model(save_dir) == ModelSource("training_checkpoint", save_dir)
    step = save_dir / "global_step_3"
    assert identify_model(step) == ModelSource("training_checkpoint", step)


def test_flags_override_val_kwargs_and_config_errors(tmp_path):
    src = ModelSource("hf", tmp_path)
    cfg = build_eval_config(src, REPO / "configs" / "tiny_cpu.yaml", ["rollout.seed=5"], ["a.parquet"], tmp_path)
    v = cfg.rollout.val_kwargs
    assert (v.n, v.temperature, v.do_sample) == (1, 0.0, False)  # the YAML's val_kwargs
    assert cfg.rollout.seed == 5 and cfg.data.val_files == ["a.parquet"] and cfg.trainer.output_dir == str(tmp_path)
    cfg = build_eval_config(
        src, None, [], ["a.parquet", "b.jsonl"], tmp_path, n=8, temperature=0.7, top_p=0.9, max_response_length=9
    )
    v = cfg.rollout.val_kwargs
    assert (v.n, v.temperature, v.do_sample, v.top_p) == (8, 0.7, True, 0.9)
    assert cfg.data.max_response_length == 9 and cfg.data.val_files == ["a.parquet", "b.jsonl"]
    with pytest.raises(ConfigError, match="--top-p 1.5"):
        build_eval_config(src, None, [], ["a.parquet"], tmp_path, top_p=1.5)
    with pytest.raises(ConfigError, match="--n 0"):
        build_eval_config(src, None, [], ["a.parquet"], tmp_path, n=0)
    with pytest.raises(ConfigError, match="unknown config key 'rollout.sed'"):
        build_eval_config(src, None, ["rollout.sed=1"], ["a.parquet"], tmp_path)


def test_export_of_converter_output_is_bit_exact(tmp_path):
    from safetensors.torch import load_file

    from megatron_dapo.evaluation import export_to_hf
    from megatron_dapo.testing.tiny_models import make_tiny_hf_model
    from megatron_dapo.weights.convert import convert_hf_to_mcore

    hf = tmp_path / "hf"
    make_tiny_hf_model("qwen2", seed=3).save_pretrained(hf, safe_serialization=True)
    convert_hf_to_mcore(hf, tmp_path / "mcore")
    source = identify_model(tmp_path / "mcore")
    assert source.kind == "mcore"
    out = export_to_hf(source, tmp_path / "export")
    assert identify_model(out).kind == "hf"
    want, got = load_file(str(hf / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].equal(tensor), name


def test_export_of_incomplete_training_checkpoint_names_it(tmp_path):
    from megatron_dapo.evaluation import export_to_hf

    step = tmp_path / "ckpts" / "global_step_2"
    step.mkdir(parents=True)
    (step / "config.yaml").write_text("{}")
    with pytest.raises(RuntimeError, match="exporting the training checkpoint .*global_step_2 to HF failed") as err:
        export_to_hf(identify_model(step), tmp_path / "out")
    assert "global_step_2" in str(err.value).split("failed:", 1)[1]  # the exporter's own message names it too
