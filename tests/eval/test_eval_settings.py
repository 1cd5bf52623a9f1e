"""The settings ``megatron-dapo export`` records for ``megatron-dapo eval`` (``megatron_dapo_eval.json``), and the
defaults an HF model without them gets: no engine here (the end-to-end runs are in ``test_eval_e2e.py``).

* an export made with a run's config carries that run's data / validation-sampling / rollout-seed / reward /
  tokenizer settings, and the eval config built from the export alone (no ``--config``, from another working
  directory) equals the one built from the run's YAML on those keys; the tokenizer is copied into the export and
  loads to the same tokenizer;
* without recorded settings the default prompt/response lengths are fitted to ``max_position_embeddings``, values the
  user gave are kept, and one console line names the values chosen;
* an unreadable settings file is an error naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatron_dapo.checkpointing.export import (
    EVAL_DATA_KEYS,
    EVAL_ROLLOUT_KEYS,
    EVAL_SETTINGS_FILE,
    TOKENIZER_SUBDIR,
    export_step,
)
from megatron_dapo.config import ConfigError, ExperimentConfig, load_config, to_dict
from megatron_dapo.evaluation import ModelSource, build_eval_config, fit_sequence_lengths, identify_model
from megatron_dapo.weights.convert import convert_hf_to_mcore

REPO = Path(__file__).resolve().parents[2]
ARITHMETIC = "megatron_dapo/tasks/arithmetic.py"  # relative, as configs/tiny_cpu.yaml names it


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A tiny HF model (max_position_embeddings 64, no tokenizer files), its converter output and a tokenizer."""
    from megatron_dapo.testing.tiny_models import make_tiny_hf_model
    from megatron_dapo.testing.tokenizer import build_tiny_tokenizer

    root = tmp_path_factory.mktemp("eval_settings")
    tokenizer = build_tiny_tokenizer(root / "tokenizer")
    hf = root / "hf"
    make_tiny_hf_model("qwen2", seed=3, vocab_size=len(tokenizer), max_position_embeddings=64).save_pretrained(hf)
    convert_hf_to_mcore(hf, root / "mcore")
    return {"root": root, "hf": hf, "mcore": root / "mcore", "tokenizer": root / "tokenizer"}


def run_yaml(tiny: dict, path: Path) -> Path:
    """A run's config whose every eval-relevant value differs from the built-in defaults."""
    config = {
        "model": {"hf_config_dir": str(tiny["hf"]), "tokenizer_dir": str(tiny["tokenizer"])},
        "checkpoint": {"load_dir": str(tiny["mcore"])},
        "data": {
            "max_prompt_length": 20,
            "max_response_length": 6,
            "truncation": "left",
            "filter_overlong_prompts": True,
            "apply_chat_template": True,
        },
        "rollout": {
            "seed": 11,
            "per_request_seed": True,
            "val_kwargs": {"n": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "do_sample": True},
        },
        "reward": {
            "custom_function": {"path": ARITHMETIC, "name": "compute_score_exact"},
            "overlong_buffer": {"enable": True, "len": 2, "penalty_factor": 0.5},
            "num_workers": 0,
            "error_score": -1.0,
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


def recorded_sections(cfg: ExperimentConfig) -> dict:
    d = to_dict(cfg)
    return {
        "data": {k: d["data"][k] for k in EVAL_DATA_KEYS},
        "rollout": {k: d["rollout"][k] for k in EVAL_ROLLOUT_KEYS},
        "reward": d["reward"],
    }


def test_export_records_the_runs_settings_and_eval_reproduces_them(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)  # the run's relative paths (the reward file) mean the repository root
    config = run_yaml(tiny, tmp_path / "run.yaml")
    out = export_step(tiny["mcore"], tmp_path / "export", config_path=config)
    doc = json.loads((out / EVAL_SETTINGS_FILE).read_text())
    assert doc["format"] == 1 and doc["written_by"] == "megatron-dapo export"
    recorded = doc["config"]
    assert recorded["reward"]["custom_function"]["path"] == str(REPO / ARITHMETIC)  # made absolute
    assert recorded["model"]["tokenizer_dir"] == TOKENIZER_SUBDIR
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / TOKENIZER_SUBDIR / name).read_bytes() == (tiny["tokenizer"] / name).read_bytes()
    assert identify_model(out).kind == "hf"  # the extra file and folder do not hide the model

    # Built from the export alone, somewhere else: the run's values on every recorded key.
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    got = build_eval_config(identify_model(out), None, [], ["v.parquet"], tmp_path / "o")
    want = load_config(config)
    want.reward.custom_function.path = str(REPO / ARITHMETIC)
    assert recorded_sections(got) == recorded_sections(want)
    assert got.model.tokenizer_dir == str(out / TOKENIZER_SUBDIR)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("eval: using the settings recorded with the model")
    assert "data.max_prompt_length=20, data.max_response_length=6" in err[0] and "n=3, temperature=0.7" in err[0]

    from transformers import AutoTokenizer

    text = "<|im_start|>user\n3+4=<|im_end|>\n"
    copied, original = (
        AutoTokenizer.from_pretrained(got.model.tokenizer_dir),
        AutoTokenizer.from_pretrained(str(tiny["tokenizer"])),
    )
    assert copied.encode(text) == original.encode(text) and copied.eos_token_id == original.eos_token_id

    # Overrides and flags still go on top of the recorded settings.
    got = build_eval_config(identify_model(out), None, ["rollout.seed=5"], ["v.parquet"], tmp_path / "o", n=7)
    assert (got.rollout.seed, got.rollout.val_kwargs.n, got.data.max_response_length) == (5, 7, 6)


def test_export_without_a_run_config_records_nothing(tiny, tmp_path):
    out = export_step(tiny["mcore"], tmp_path / "export")
    assert (out / "config.json").is_file() and not (out / EVAL_SETTINGS_FILE).exists()
    assert not (out / TOKENIZER_SUBDIR).exists()


def test_model_without_settings_gets_fitted_defaults_and_one_message(tiny, tmp_path, capsys):
    cfg = build_eval_config(ModelSource("hf", tiny["hf"]), None, [], ["v.parquet"], tmp_path)
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (32, 32)  # 512 + 512 > 64
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    line = err[0]
    assert "has no recorded settings (megatron_dapo_eval.json" in line and "max_position_embeddings=64" in line
    assert "data.max_prompt_length=32, data.max_response_length=32" in line and "n=1, greedy" in line

    # the converter output reads its hf_config/; values the user gave stay, the other takes the rest of the room
    mcore = ModelSource("mcore", tiny["mcore"])
    cfg = build_eval_config(mcore, None, [], ["v.parquet"], tmp_path, max_response_length=8)
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (56, 8)
    cfg = build_eval_config(mcore, None, ["data.max_prompt_length=40"], ["v.parquet"], tmp_path)
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (40, 24)
    assert capsys.readouterr().err.count("fitted to the model's max_position_embeddings=64") == 2


def test_model_that_fits_the_defaults_keeps_them(tmp_path, capsys, monkeypatch):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 4096}))
    cfg = build_eval_config(ModelSource("hf", hf), None, [], ["v.parquet"], tmp_path)
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (512, 512)
    assert "data.max_prompt_length=512, data.max_response_length=512" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")  # under torchrun only the first process says it
    build_eval_config(ModelSource("hf", hf), None, [], ["v.parquet"], tmp_path)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "lengths, given, limit, want",
    [
        ((512, 512), set(), 64, (32, 32)),
        ((512, 512), set(), 65, (32, 33)),
        ((512, 512), set(), 2048, (512, 512)),  # fits: unchanged
        ((512, 10), {"data.max_response_length"}, 64, (54, 10)),
        ((16, 512), {"data.max_prompt_length"}, 64, (16, 48)),
        ((100, 100), {"data.max_prompt_length", "data.max_response_length"}, 64, (100, 100)),  # the engine names it
    ],
)
def test_fit_sequence_lengths(lengths, given, limit, want):
    cfg = load_config(None, [f"data.max_prompt_length={lengths[0]}", f"data.max_response_length={lengths[1]}"])
    fit_sequence_lengths(cfg.data, limit, given)
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == want


def test_unreadable_settings_file_is_named(tiny, tmp_path):
    out = export_step(tiny["mcore"], tmp_path / "export")
    for text, expected in [("{", "not valid JSON"), ('{"format": 99, "config": {}}', "format 99")]:
        (out / EVAL_SETTINGS_FILE).write_text(text)
        with pytest.raises(ConfigError, match=expected) as err:
            build_eval_config(identify_model(out), None, [], ["v.parquet"], tmp_path)
        assert str(out / EVAL_SETTINGS_FILE) in str(err.value)
