"""Export of a Qwen3.5 model keeps the rest of its checkpoint (docs/qwen35.md, "Checkpoints").

A tiny ``Qwen3_5ForConditionalGeneration`` (transformers' own class, saved by ``save_pretrained``) with an ``mtp.*``
head in bf16 added to its safetensors, and processor / tokenizer files beside it: ``convert hf-to-mcore`` keeps the
vision tower and the mtp head in ``hf_config/carried/`` (in the manifest), and ``mcore-to-hf`` / ``export`` write
them back byte for byte next to the language model, under the source's config.json: the export loads as the VLM
again, the text model bit-exact (unmodified) or equal to the Megatron checkpoint's weights (modified); the MoE VLM
too. A text-only ``Qwen3_5MoeForCausalLM`` carries nothing and round-trips the same way.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megatron_dapo.checkpointing.export import export_step
from megatron_dapo.models.families import model_arch_from_hf, param_mappings
from megatron_dapo.weights.checkpoint_errors import CheckpointError
from megatron_dapo.weights.convert import (
    CARRIED_SUBDIR,
    convert_hf_to_mcore,
    convert_mcore_to_hf,
    read_stored,
)
from megatron_dapo.weights.dist_format import HF_CONFIG_SUBDIR, RELEASE_DIR
from megatron_dapo.weights.dist_reader import DistCheckpointReader
from megatron_dapo.weights.dist_writer import TensorPlan, write_model_checkpoint
from megatron_dapo.weights.integrity import read_manifest
from megatron_dapo.weights.layout import mcore_to_hf
from megatron_dapo.weights.safetensors_io import SINGLE_NAME
from tests.models.qwen35_worker import tiny_hybrid_config, tiny_hybrid_model
from tests.weights.conftest import load_hf_tensors

# What a processor / tokenizer directory holds besides the weights: copied into the export as they are.
SIDE_FILES = {
    "preprocessor_config.json": '{"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16}\n',
    "tokenizer_config.json": '{"model_max_length": 256, "tokenizer_class": "Qwen2Tokenizer"}\n',
    "chat_template.jinja": "{% for m in messages %}{{ m['content'] }}{% endfor %}\n",
}
MTP_NAMES = ("mtp.fc.weight", "mtp.norm.weight")
CARRIED_FILE = f"{HF_CONFIG_SUBDIR}/{CARRIED_SUBDIR}/{SINGLE_NAME}"


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes."""
    flat = (a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*flat)


def config_of(model) -> dict:
    """The model's config as a dict, less where it was loaded from."""
    return {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> dict[str, Path]:
    """The tiny VLM saved by transformers (+ a bf16 mtp head, + side files), and the converter's checkpoint of it."""
    root = tmp_path_factory.mktemp("qwen35_vlm")
    src = root / "hf"
    tiny_hybrid_model("qwen3_5").save_pretrained(src)
    tensors = load_hf_tensors(src)
    g = torch.Generator().manual_seed(7)
    tensors[MTP_NAMES[0]] = torch.randn(64, 128, generator=g).to(torch.bfloat16)
    tensors[MTP_NAMES[1]] = torch.randn(64, generator=g).to(torch.bfloat16)
    save_file(tensors, str(src / SINGLE_NAME), metadata={"format": "pt"})
    for name, text in SIDE_FILES.items():
        (src / name).write_text(text)
    convert_hf_to_mcore(src, root / "mcore")
    return {"root": root, "hf": src, "mcore": root / "mcore"}


def test_vlm_round_trip_is_the_source(vlm, tmp_path):
    """Unmodified: every tensor of the export has the source's dtype and bytes (the language model through Megatron's
    layout and back, the vision tower and the mtp head copied), the config.json and side files are the source's, the
    carried file is in the converted checkpoint's manifest, and transformers loads the export as the same VLM."""
    # heavy: transformers
    from transformers import Qwen3_5ForConditionalGeneration

    records = read_manifest(vlm["mcore"])
    assert records[CARRIED_FILE].size == (vlm["mcore"] / CARRIED_FILE).stat().st_size
    out = convert_mcore_to_hf(vlm["mcore"], tmp_path / "hf").save_dir
    want, got = load_hf_tensors(vlm["hf"]), load_hf_tensors(out)
    assert sorted(got) == sorted(want)
    assert any(n.startswith("model.visual.") for n in want) and set(MTP_NAMES) <= set(want)
    assert [n for n in want if not same_bytes(got[n], want[n])] == []
    assert got[MTP_NAMES[0]].dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text()) == json.loads((vlm["hf"] / "config.json").read_text())
    assert all((out / name).read_text() == text for name, text in SIDE_FILES.items())
    for name, text in SIDE_FILES.items():
        assert (out / name).read_text() == text
    source = Qwen3_5ForConditionalGeneration.from_pretrained(vlm["hf"])
    exported, info = Qwen3_5ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert config_of(exported) == config_of(source)
    a, b = source.state_dict(), exported.state_dict()
    assert sorted(a) == sorted(b) and [n for n in a if not same_bytes(a[n], b[n])] == []


def _trained_checkpoint(mcore: Path, out: Path) -> None:
    """A bare dist checkpoint (no hf_config/, as Megatron-LM's) of the converted model with every language-model
    tensor changed (``t * 1.5 + 0.25``): a trained model."""
    reader = DistCheckpointReader(mcore / RELEASE_DIR)

    def produce(key: str):
        return lambda: reader.read([(key, None)])[0] * 1.5 + 0.25

    plans = [TensorPlan(k, *reader.tensors[k], produce(k)) for k in sorted(reader.keys())]
    write_model_checkpoint(out, plans, iteration=1)


def test_vlm_export_of_trained_weights_carries_the_rest(vlm, tmp_path):
    """A modified Megatron checkpoint exported with the source HF directory as its config: the language model equals
    the checkpoint's weights in HF layout (bit-exact), the vision tower and mtp head are the source's bytes, and the
    VLM loads with nothing missing."""
    # heavy: transformers
    from transformers import Qwen3_5ForConditionalGeneration

    trained = tmp_path / "trained"
    _trained_checkpoint(vlm["mcore"], trained)
    out = export_step(trained, tmp_path / "hf", hf_config_dir=vlm["hf"])
    arch = model_arch_from_hf(vlm["hf"])
    reader = DistCheckpointReader(trained)
    want, got = load_hf_tensors(vlm["hf"]), load_hf_tensors(out)
    text = {}
    for m in param_mappings(arch):
        text.update(zip(m.hf, mcore_to_hf(m, read_stored(reader, m, arch), arch)))
    assert sorted(got) == sorted(want)
    assert [n for n, t in text.items() if not same_bytes(got[n], t.contiguous())] == []
    assert not torch.equal(got["model.language_model.norm.weight"], want["model.language_model.norm.weight"])
    carried = [n for n in want if n not in text]
    assert len(carried) > len(MTP_NAMES) and all(n.startswith(("model.visual.", "mtp.")) for n in carried)
    assert [n for n in carried if not same_bytes(got[n], want[n])] == []
    model, info = Qwen3_5ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    loaded = model.state_dict()
    assert [n for n in text if n in loaded and not same_bytes(loaded[n], got[n])] == []


def test_vlm_export_without_its_other_tensors_is_refused(vlm, tmp_path):
    """A VLM config with nowhere to take the vision tower from: refused, naming the config and what to pass."""
    trained = tmp_path / "trained"
    _trained_checkpoint(vlm["mcore"], trained)
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copyfile(vlm["hf"] / "config.json", config_only / "config.json")
    with pytest.raises(CheckpointError, match=r"Qwen3_5ForConditionalGeneration \(a VLM\).*--hf-config-dir"):
        convert_mcore_to_hf(trained, tmp_path / "hf", hf_config_dir=config_only)
    assert not (tmp_path / "hf").exists()


def test_damaged_carried_tensors_are_named(vlm, tmp_path):
    """A flipped byte in the converted checkpoint's carried file: the manifest names it, nothing is written."""
    damaged = tmp_path / "mcore"
    shutil.copytree(vlm["mcore"], damaged)
    path = damaged / CARRIED_FILE
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{CARRIED_FILE}: corrupt"):
        convert_mcore_to_hf(damaged, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_text_only_qwen35_moe_round_trip(tmp_path):
    """A text-only ``Qwen3_5MoeForCausalLM`` (decoder under ``model.``): nothing carried, every tensor and the config
    back as they were, and transformers loads the export as the same model."""
    # heavy: transformers
    from transformers import Qwen3_5MoeForCausalLM

    torch.manual_seed(3)
    model = Qwen3_5MoeForCausalLM._from_config(tiny_hybrid_config("qwen3_5_moe").text_config, dtype=torch.float32)
    model.save_pretrained(tmp_path / "src")
    convert_hf_to_mcore(tmp_path / "src", tmp_path / "mcore")
    assert not (tmp_path / "mcore" / HF_CONFIG_SUBDIR / CARRIED_SUBDIR).exists()
    out = convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "hf").save_dir
    want, got = load_hf_tensors(tmp_path / "src"), load_hf_tensors(out)
    assert sorted(got) == sorted(want) and [n for n in want if not same_bytes(got[n], want[n])] == []
    src_config = json.loads((tmp_path / "src" / "config.json").read_text())
    assert json.loads((out / "config.json").read_text()) == src_config
    source, exported = (Qwen3_5MoeForCausalLM.from_pretrained(d) for d in (tmp_path / "src", out))
    assert config_of(exported) == config_of(source)
    a, b = source.state_dict(), exported.state_dict()
    assert sorted(a) == sorted(b) and [n for n in a if not same_bytes(a[n], b[n])] == []


def test_training_step_export_takes_the_rest_from_the_runs_start(vlm, tmp_path):
    """A training step (``global_step_<n>``: dist_ckpt, trainer_state.json, rng, config.yaml; no hf_config/ of its
    own) of a run started from the converted VLM (``checkpoint.load_dir``) whose ``model.hf_config_dir`` holds the
    config and processor files only: ``export`` takes those from there and the vision tower and mtp head from the
    start's ``hf_config/carried/``."""
    # heavy: the training checkpoint's constants; config helpers
    from megatron_dapo.checkpointing.checkpoint import CONFIG_FILE, DIST_DIR, RNG_DIR, STATE_FILE
    from megatron_dapo.config import ExperimentConfig, to_dict

    step = tmp_path / "checkpoints" / "global_step_1"
    _trained_checkpoint(vlm["mcore"], step / DIST_DIR)
    (step / STATE_FILE).write_text(json.dumps({"step": 1, "layout": {"world_size": 1}}))
    (step / RNG_DIR).mkdir()
    torch.save({}, step / RNG_DIR / "rank_00000.pt")
    cfg = to_dict(ExperimentConfig())
    cfg["checkpoint"]["load_dir"] = str(vlm["mcore"])
    cfg["model"]["hf_config_dir"] = str(tmp_path / "config_only")
    for name in ("config.json", *SIDE_FILES):
        (tmp_path / "config_only").mkdir(exist_ok=True)
        shutil.copyfile(vlm["hf"] / name, tmp_path / "config_only" / name)
    (step / CONFIG_FILE).write_text(json.dumps(cfg))  # YAML reads JSON
    out = export_step(tmp_path / "checkpoints", tmp_path / "hf", step=1)
    want, got = load_hf_tensors(vlm["hf"]), load_hf_tensors(out)
    assert sorted(got) == sorted(want)
    carried = [n for n in want if n.startswith(("model.visual.", "mtp."))]
    assert carried and [n for n in carried if not same_bytes(got[n], want[n])] == []
    assert not same_bytes(got["model.language_model.norm.weight"], want["model.language_model.norm.weight"])
    assert json.loads((out / "config.json").read_text()) == json.loads((vlm["hf"] / "config.json").read_text())
    assert all((out / name).read_text() == text for name, text in SIDE_FILES.items())


def test_moe_vlm_round_trip(tmp_path):
    """The Qwen3.5-MoE VLM (experts per expert on disk, fused in transformers): converted and exported, it loads as
    ``Qwen3_5MoeForConditionalGeneration`` with the source's config and every parameter bit-exact."""
    # heavy: transformers
    from transformers import Qwen3_5MoeForConditionalGeneration

    tiny_hybrid_model("qwen3_5_moe").save_pretrained(tmp_path / "src")
    convert_hf_to_mcore(tmp_path / "src", tmp_path / "mcore")
    out = convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "hf").save_dir
    want, got = load_hf_tensors(tmp_path / "src"), load_hf_tensors(out)
    assert sorted(got) == sorted(want) and [n for n in want if not same_bytes(got[n], want[n])] == []
    source, exported = (Qwen3_5MoeForConditionalGeneration.from_pretrained(d) for d in (tmp_path / "src", out))
    assert config_of(exported) == config_of(source)
    a, b = source.state_dict(), exported.state_dict()
    assert any(n.startswith("model.visual.") for n in a)
    assert sorted(a) == sorted(b) and [n for n in a if not same_bytes(a[n], b[n])] == []
