"""``megatron-dapo export``: any Megatron checkpoint → an HF checkpoint, in one process, tensor by tensor.

Accepts what ``mcore-to-hf`` accepts — a Megatron-LM / Megatron-Bridge / converter checkpoint (tracker file,
``iter_*``/``release``, a bare dist_checkpointing directory) — and our training checkpoints: a ``save_dir`` (its
newest intact step, or ``step``) or a ``global_step_<n>`` directory, verified against its manifest first. The model
tensors are read straight from the dist checkpoint (any layout it was trained at; the optimizer state is not read)
by ``megatron_dapo.weights.convert.convert_mcore_to_hf``: no model is built and no process group is needed.

The HF config and tokenizer files come from, in order: ``hf_config_dir``; the checkpoint's own ``hf_config/``; for
a training step, its config's ``model.hf_config_dir``, else the ``hf_config/`` of its ``checkpoint.load_dir``
(what the run was started from; an HF directory there is used as is).

**A Qwen3.5 VLM** (or any source with tensors its text model does not own: the vision tower ``model.visual.*``, the
``mtp.*`` head) exports whole: the trained language model under ``model.language_model.*`` and every other tensor of
the source copied byte for byte, from the first of the HF config directory, the run's ``model.hf_config_dir`` and
its ``checkpoint.load_dir`` that holds them (an HF model directory's safetensors, or a converted checkpoint's
``hf_config/carried/``), under the source's own config.json: it loads as the source's class.

**Evaluation settings.** When the run's config is known (the ``config.yaml`` saved with a training step, or
``config_path``), the export also writes :data:`EVAL_SETTINGS_FILE`: the settings ``megatron-dapo eval`` needs to
score this model the way the run's validation did — the prompt/response lengths and prompt preparation (``data``),
the validation sampling and rollout seed/dtype (``rollout``), the reward functions (``reward``) and the tokenizer —
as a partial experiment config. A tokenizer of its own (``model.tokenizer_dir``) is copied to the ``tokenizer/``
subdirectory, so the export stays usable when moved. ``megatron-dapo eval --model <export>`` without ``--config``
starts from these settings (see :func:`read_eval_settings` and ``docs/evaluation_and_ray.md``).

**LoRA checkpoints** (``trainer_state.json``: ``adapters_only``, and ``lora.base_checkpoint``: the run's
``checkpoint.load_dir``) hold the adapters alone, so their export needs ``lora`` (``--lora``, docs/lora.md):
``adapter`` writes an HF peft adapter (``adapter_config.json`` + ``adapter_model.safetensors``, fused q/k/v and
gate/up adapters split by ``weights/lora_hf.mcore_adapters_to_peft``); ``merged`` writes the base with
``alpha/rank · B @ A`` added to every adapted HF weight: a plain HF model. Both read the adapters straight from the
dist checkpoint (any layout it was saved at) and the merge goes tensor by tensor: the base is first exported to HF
by the converter (a Megatron base) or read as it is (an HF base), then every HF weight gets its adapter's delta.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional, Union

import torch
import yaml

from megatron_dapo.checkpointing.checkpoint import (
    CONFIG_FILE,
    DIST_DIR,
    LATEST,
    STATE_FILE,
    STEP_PREFIX,
    resolve_resume,
)
from megatron_dapo.config import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    ExperimentConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    config_problems,
    from_dict,
    load_config,
    raise_if_any,
    to_dict,
)
from megatron_dapo.config.schema import LoRAConfig
from megatron_dapo.models.families import ModelArch, model_arch_from_hf, param_mappings
from megatron_dapo.weights.atomic import fresh_dir, publish_dir
from megatron_dapo.weights.checkpoint_errors import CheckpointError
from megatron_dapo.weights.convert import carried_source, convert_mcore_to_hf, copy_hf_side_files
from megatron_dapo.weights.dist_format import CheckpointSource, find_checkpoint
from megatron_dapo.weights.dist_reader import DistCheckpointReader
from megatron_dapo.weights.lora_hf import PEFT_PREFIX, mcore_adapters_to_peft, peft_adapter_config
from megatron_dapo.weights.safetensors_io import (
    INDEX_NAME,
    BufferPool,
    SafetensorsDir,
    StreamingSafetensorsWriter,
    TensorSpec,
)

log = logging.getLogger("megatron_dapo.export")

PathLike = Union[str, Path]
EVAL_SETTINGS_FILE = "megatron_dapo_eval.json"
EVAL_SETTINGS_FORMAT = 1
TOKENIZER_SUBDIR = "tokenizer"  # the run's own tokenizer, copied into the export
# The config keys the eval settings carry, per section: what decides the prompts, the validation samples and their
# scores. The engine's sizing (KV cache, max_num_seqs, TP) belongs to the machine the eval runs on, not the model.
EVAL_DATA_KEYS = (
    "prompt_key",
    "max_prompt_length",
    "max_response_length",
    "truncation",
    "filter_overlong_prompts",
    "apply_chat_template",
)
EVAL_ROLLOUT_KEYS = ("seed", "per_request_seed", "dtype", "logprobs_mode", "val_kwargs")
# LoRA checkpoints (``--lora``): what each export mode writes is in the module docstring.
LORA_MODES = ("merged", "adapter")
ADAPTER_CONFIG_FILE = "adapter_config.json"  # peft's names
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
_MODEL_FILES = ("config.json", "generation_config.json")  # left out of an adapter export
_ADAPTER_SUFFIXES = (".adapter.linear_in.weight", ".adapter.linear_out.weight")
_LAYERS = "decoder.layers."
_PER_LAYER = re.compile(r"^decoder\.layers\.\d+\.")
_STACKED_EXPERTS = ".mlp.experts.experts."  # megatron-core's key for a layer's routed experts, stacked
_LOCAL_EXPERTS = ".mlp.experts.local_experts."


def training_step_dir(checkpoint: Path, step: Optional[int]) -> Optional[Path]:
    """The verified step directory when ``checkpoint`` is a training save_dir or step directory, else None."""
    if step is not None:
        return resolve_resume(str(checkpoint / f"{STEP_PREFIX}{step}"), None)
    if (checkpoint / CONFIG_FILE).is_file() and checkpoint.name.startswith(STEP_PREFIX):
        return resolve_resume(str(checkpoint), None)
    if (checkpoint / LATEST).is_file() or any(checkpoint.glob(f"{STEP_PREFIX}*")):
        found = resolve_resume("auto", checkpoint)
        if found is None:
            raise CheckpointError(f"{checkpoint}: no complete {STEP_PREFIX}<n> checkpoint found to export")
        return found
    return None


def _run_config(step_dir: Optional[Path], config_path: Optional[PathLike]) -> Optional[ExperimentConfig]:
    """The run's config: ``config_path``, else the one saved with ``step_dir``, else None."""
    if config_path is not None:
        cfg = load_config(config_path)
        raise_if_any(config_problems(cfg))  # export's gate: the config's own rules, once (load_config only parses)
        return cfg
    if step_dir is not None and (step_dir / CONFIG_FILE).is_file():
        return from_dict(ExperimentConfig, yaml.safe_load((step_dir / CONFIG_FILE).read_text()) or {})
    return None


def _hf_config_of_run(model: ModelConfig, checkpoint: CheckpointConfig) -> Optional[Path]:
    """Where the run took its HF config from (see the module docstring): ``model.hf_config_dir``, else the one of
    ``checkpoint.load_dir``."""
    if model.hf_config_dir:
        return Path(model.hf_config_dir)
    if checkpoint.load_dir:
        try:
            return find_checkpoint(checkpoint.load_dir).hf_config_dir
        except CheckpointError:
            return None
    return None


def _carried_of_run(
    hf_config_dir: Optional[PathLike], model: ModelConfig, checkpoint: CheckpointConfig
) -> Optional[Path]:
    """Where the run's source keeps the tensors its text model does not own (``weights/convert.carried_source``):
    the first of ``hf_config_dir``, ``model.hf_config_dir`` and ``checkpoint.load_dir``'s HF config that has them."""
    candidates = [hf_config_dir, model.hf_config_dir or None]
    if checkpoint.load_dir:
        try:
            candidates.append(find_checkpoint(checkpoint.load_dir).hf_config_dir)
        except CheckpointError:
            pass
    for candidate in candidates:
        found = carried_source(candidate) if candidate is not None else None
        if found is not None:
            return found
    return None


def export_step(
    checkpoint: PathLike,
    save_dir: PathLike,
    step: Optional[int] = None,
    config_path: Optional[PathLike] = None,
    hf_config_dir: Optional[PathLike] = None,
    lora: Optional[str] = None,
) -> Path:
    """Export ``checkpoint`` (see the module docstring; ``step``: which training step, default the newest) to an
    HF directory ``save_dir``, with the run's evaluation settings when its config is known; returns ``save_dir``.
    ``lora`` (``merged`` | ``adapter``) is required for a LoRA training checkpoint and refused for any other."""
    checkpoint = Path(checkpoint)
    source = checkpoint
    step_dir = training_step_dir(checkpoint, step)
    adapters = lora_checkpoint_of(step_dir, lora, checkpoint)
    cfg = _run_config(step_dir, config_path)
    if adapters is not None:
        if hf_config_dir is None and cfg is not None:
            hf_config_dir = cfg.model.hf_config_dir or None  # the run's, before the base's own
        out = export_lora(adapters, save_dir, lora, hf_config_dir=hf_config_dir)
    else:
        carried = None
        if step_dir is not None:
            source = step_dir
            if hf_config_dir is None and find_checkpoint(step_dir).hf_config_dir is None and cfg is not None:
                hf_config_dir = _hf_config_of_run(cfg.model, cfg.checkpoint)
            if cfg is not None:
                carried = _carried_of_run(hf_config_dir, cfg.model, cfg.checkpoint)
        out = convert_mcore_to_hf(
            source, save_dir, hf_config_dir=hf_config_dir, overwrite=True, carried_dir=carried
        ).save_dir
    if cfg is not None:
        settings = eval_settings(cfg.model, cfg.data, cfg.rollout, cfg.reward)
        origin = str((step_dir or Path(config_path)).absolute())
        write_eval_settings(settings, cfg.model.tokenizer_dir, out, origin=origin)
    return out


# ================================================================================================================ LoRA


@dataclass(frozen=True)
class LoraCheckpoint:
    """A LoRA training step: its adapters (``dist``) and what ``trainer_state.json``'s ``lora`` entry says of them
    (``training/run_state.LoraBase``: the base checkpoint, rank, alpha, target modules, dropout)."""

    step_dir: Path
    base: Path
    entry: dict[str, Any]

    @property
    def dist(self) -> Path:
        return self.step_dir / DIST_DIR

    @property
    def scale(self) -> float:
        return float(self.entry["alpha"]) / int(self.entry["rank"])

    def lora_config(self) -> LoRAConfig:
        names = {f.name for f in fields(LoRAConfig)}
        return LoRAConfig(**{k: v for k, v in self.entry.items() if k in names})


def holds_lora_adapters(checkpoint: PathLike) -> bool:
    """Whether the training checkpoint ``checkpoint`` (a save_dir: its newest intact step, or a step directory)
    holds LoRA adapters only (``trainer_state.json``'s ``adapters_only``): it exports with ``--lora``."""
    # Read, not verified: verifying is collective under torchrun and this runs on one rank (evaluation.py); the
    # export verifies, and says what is wrong with a damaged step.
    checkpoint = Path(checkpoint)
    state = checkpoint / STATE_FILE
    if not state.is_file() and (checkpoint / LATEST).is_file():
        state = checkpoint / (checkpoint / LATEST).read_text().strip() / STATE_FILE
    try:
        return bool(json.loads(state.read_text()).get("adapters_only"))
    except (OSError, ValueError):
        return False


def lora_checkpoint_of(step_dir: Optional[Path], mode: Optional[str], checkpoint: Path) -> Optional[LoraCheckpoint]:
    """The LoRA step ``step_dir`` holds (None: a full checkpoint), checked against the export's ``mode``: a LoRA
    checkpoint needs one, any other checkpoint refuses one."""
    if mode is not None and mode not in LORA_MODES:
        raise ValueError(f"lora={mode!r}: expected one of {list(LORA_MODES)}")
    state = json.loads((step_dir / STATE_FILE).read_text()) if step_dir is not None else {}
    if not state.get("adapters_only"):
        if mode is not None:
            what = "a full-model training checkpoint, not" if step_dir is not None else "not"
            raise CheckpointError(
                f"--lora {mode}: {step_dir or checkpoint} is {what} a LoRA training checkpoint (no trainer_state.json "
                "with adapters_only); export it without --lora"
            )
        return None
    entry = state.get("lora")
    if not isinstance(entry, dict) or not entry.get("base_checkpoint") or not entry.get("rank"):
        raise CheckpointError(
            f"{step_dir / STATE_FILE}: adapters_only, but no 'lora' entry naming base_checkpoint and rank (found "
            f"{entry!r}); the adapters cannot be exported without their base"
        )
    if mode is None:
        raise CheckpointError(
            f"{step_dir} holds LoRA adapters only (rank {entry['rank']}, base {entry['base_checkpoint']}): pass "
            "--lora merged (the base with the adapters merged in: a plain HF model) or --lora adapter (an HF peft "
            "adapter: adapter_config.json + adapter_model.safetensors)"
        )
    return LoraCheckpoint(step_dir, Path(entry["base_checkpoint"]), entry)


def export_lora(
    ckpt: LoraCheckpoint,
    save_dir: PathLike,
    mode: str,
    hf_config_dir: Optional[PathLike] = None,
) -> Path:
    """Write the LoRA step ``ckpt`` to ``save_dir`` as a peft adapter (``mode`` ``adapter``) or merged into its base
    (``merged``: a plain HF model); returns ``save_dir`` (absolute). ``hf_config_dir``: the base's HF config (the
    run's ``model.hf_config_dir``); None = the base checkpoint's own."""
    base = _lora_base(ckpt, needs_weights=mode == "merged", hf_config_dir=hf_config_dir)
    side = _lora_hf_config(ckpt, base, hf_config_dir)
    arch = model_arch_from_hf(side)
    reader = DistCheckpointReader(ckpt.dist)
    tensors = adapter_tensors(reader)
    if not tensors:
        raise CheckpointError(f"{ckpt.dist}: a LoRA checkpoint with no adapter tensors (it holds {reader.keys()[:8]})")
    with _staged_dir(save_dir, inputs=(ckpt.step_dir, ckpt.base)) as tmp:
        if mode == "adapter":
            _warn_routed_experts(tensors)
            write_peft_adapter(tmp, arch, reader, tensors)
            name = str(base.path) if base is not None and base.kind == "hf" else str(ckpt.base)
            config = peft_adapter_config(arch, ckpt.lora_config(), base_model_name_or_path=name)
            (tmp / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
            _copy_tokenizer_files(side, tmp)
        else:
            deltas = AdapterDeltas(arch, reader, tensors, ckpt.scale)
            if base.kind == "hf":
                write_merged(base.path, tmp, deltas)
            else:
                _merge_megatron_base(ckpt.base, side, tmp, deltas)
    return Path(save_dir).absolute()


def _lora_base(
    ckpt: LoraCheckpoint, needs_weights: bool, hf_config_dir: Optional[PathLike]
) -> Optional[CheckpointSource]:
    """The base checkpoint (``find_checkpoint``'s answer), or None when it is gone and only its config is needed
    (the adapter export, with the HF config known otherwise)."""
    base = ckpt.base
    if not base.exists():
        if needs_weights or hf_config_dir is None:
            need = "its weights" if needs_weights else "its HF config (or pass hf_config_dir)"
            raise CheckpointError(
                f"{ckpt.step_dir}: the LoRA adapters' base checkpoint {base} (trainer_state.json lora.base_checkpoint)"
                f" does not exist; the export needs {need}: put the base back at {base}"
            )
        log.warning("export: the LoRA base %s does not exist; the adapter names it anyway", base)
        return None
    if (base / STATE_FILE).is_file() and json.loads((base / STATE_FILE).read_text()).get("adapters_only"):
        raise CheckpointError(f"{ckpt.step_dir}: its base {base} is itself a LoRA checkpoint (adapters only)")
    return find_checkpoint(base)


def _lora_hf_config(
    ckpt: LoraCheckpoint,
    base: Optional[CheckpointSource],
    hf_config_dir: Optional[PathLike],
) -> Path:
    """The HF config directory of the base: ``hf_config_dir`` (given, or the run's ``model.hf_config_dir``), else the
    base's own."""
    if hf_config_dir is not None:
        return Path(hf_config_dir)
    side = base.hf_config_dir if base is not None else None
    if side is None:
        raise CheckpointError(
            f"{ckpt.step_dir}: its base {ckpt.base} has no hf_config/config.json and the run names no "
            "model.hf_config_dir: pass hf_config_dir with the base model's HF config.json"
        )
    return side


@contextmanager
def _staged_dir(save_dir: PathLike, inputs: Iterable[Path]) -> Iterator[Path]:
    """A fresh sibling of ``save_dir`` to write into, renamed over ``save_dir`` when the block finishes (what was
    there is replaced only then), removed when it raises."""
    final = Path(save_dir).absolute()
    for src in inputs:
        if src.exists() and final.exists() and src.resolve() == final.resolve():
            raise CheckpointError(f"save directory {final} is the checkpoint's own input {src}; choose another")
    tmp = fresh_dir(final.parent / f"{final.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        publish_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@dataclass(frozen=True)
class AdapterTensor:
    """One adapter weight of a dist checkpoint: its per-layer (per-expert) global Megatron name
    (``decoder.layers.3.self_attention.linear_qkv.adapter.linear_in.weight``), where it is stored (key, index along
    the key's leading axis or None), its full (TP-merged) shape and dtype."""

    name: str
    key: str
    index: Optional[int]
    shape: tuple[int, ...]
    dtype: torch.dtype


def adapter_tensors(reader: DistCheckpointReader) -> list[AdapterTensor]:
    """Every adapter weight ``reader``'s checkpoint holds (not their optimizer state), one per layer and expert:
    megatron-core stacks homogeneous layers along a leading axis (``decoder.layers.<rest>``) and a layer's routed
    experts along another (``decoder.layers.<i>.mlp.experts.experts.<rest>``)."""
    out = []
    for key in sorted(reader.keys()):
        if not key.startswith(_LAYERS) or not key.endswith(_ADAPTER_SUFFIXES):
            continue  # the optimizer's state: ``optimizer.state.…``, ``chained_<i>.optimizer.state.…``
        dtype, shape = reader.tensors[key]
        if _PER_LAYER.match(key) is None:  # layer-stacked
            rest = key[len(_LAYERS) :]
            names = [(f"{_LAYERS}{i}.{rest}", i) for i in range(shape[0])]
        elif _STACKED_EXPERTS in key:
            names = [(key.replace(_STACKED_EXPERTS, f"{_LOCAL_EXPERTS}{e}."), e) for e in range(shape[0])]
        else:
            names = [(key, None)]
        full = tuple(shape[1:]) if names[0][1] is not None else tuple(shape)
        if len(full) != 2:
            raise CheckpointError(f"{reader.directory}: adapter tensor {key} of shape {shape}: layout not understood")
        out += [AdapterTensor(name, key, index, full, dtype) for name, index in names]
    return out


def _read_adapters(reader: DistCheckpointReader, tensors: Iterable[AdapterTensor]) -> Iterator[tuple[str, Any]]:
    """(name, full tensor), one read at a time."""
    for t in tensors:
        (full,) = reader.read([(t.key, t.index)])
        yield t.name, full


def write_peft_adapter(out: Path, arch: ModelArch, reader: DistCheckpointReader, tensors: list) -> None:
    """``adapter_model.safetensors`` in ``out``: the adapters under peft's names (fused layers split, A shared),
    declared from shapes alone (meta tensors) and then written one tensor at a time."""
    meta = ((t.name, torch.empty(t.shape, dtype=t.dtype, device="meta")) for t in tensors)
    specs = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in mcore_adapters_to_peft(arch, meta)]
    writer = StreamingSafetensorsWriter(out / ADAPTER_WEIGHTS_FILE, specs, {"format": "pt"})
    try:
        scratch = BufferPool()
        for name, tensor in mcore_adapters_to_peft(arch, _read_adapters(reader, tensors)):
            writer.write(name, tensor, scratch=scratch)
        writer.close()
    except BaseException:
        writer.abort()
        raise


def _warn_routed_experts(tensors: list[AdapterTensor]) -> None:
    experts = sum(_LOCAL_EXPERTS in t.name for t in tensors)
    if experts:
        log.warning(
            "export --lora adapter: %d adapter weights of routed experts are written under peft's per-expert names "
            "(mlp.experts.<e>.gate/up/down_proj, as vLLM reads them); peft on transformers >= 5, whose MoE layers "
            "hold all experts in one fused parameter, skips them without a word. --lora merged carries them exactly",
            experts,
        )


def _copy_tokenizer_files(side: Path, out: Path) -> None:
    """The base's tokenizer files next to the adapter (peft's layout: no config.json, which would make the
    directory look like a whole model)."""
    for name in copy_hf_side_files(side, out):
        if name in _MODEL_FILES:
            (out / name).unlink()


class AdapterDeltas:
    """``alpha/rank · B @ A`` (fp32) per HF weight name, from a checkpoint's adapters in peft's split (q/k/v_proj,
    gate/up_proj share A); read module by module (a few modules cached: a fused layer's projections come together).
    ``expected`` are the HF weights that get a delta, ``applied`` those asked for so far."""

    CACHED_MODULES = 8

    def __init__(self, arch: ModelArch, reader: DistCheckpointReader, tensors: list, scale: float) -> None:
        self.arch, self.reader, self.scale = arch, reader, scale
        mappings = {m.mcore[: -len(".weight")]: m for m in param_mappings(arch) if m.mcore.endswith(".weight")}
        self.modules: dict[str, list[AdapterTensor]] = {}
        for t in tensors:
            self.modules.setdefault(t.name.rsplit(".adapter.", 1)[0], []).append(t)
        self.hf_module: dict[str, str] = {}
        for module, parts in self.modules.items():
            if module not in mappings or len(parts) != 2:
                raise CheckpointError(
                    f"{reader.directory}: adapter {module} ({[t.name for t in parts]}) has no HF weight to merge into"
                )
            self.hf_module.update((hf, module) for hf in mappings[module].hf)
        self.expected = frozenset(self.hf_module)
        self.applied: set[str] = set()
        self._cache: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()

    def _peft(self, module: str) -> dict[str, torch.Tensor]:
        if module not in self._cache:
            parts = self.modules[module]
            self._cache[module] = dict(mcore_adapters_to_peft(self.arch, _read_adapters(self.reader, parts)))
            if len(self._cache) > self.CACHED_MODULES:
                self._cache.popitem(last=False)
        return self._cache[module]

    def __call__(self, hf_name: str) -> Optional[torch.Tensor]:
        """The delta of HF weight ``hf_name`` (None: not adapted)."""
        module = self.hf_module.get(hf_name)
        if module is None:
            return None
        peft = self._peft(module)
        prefix = PEFT_PREFIX + hf_name[: -len(".weight")]
        a, b = peft[f"{prefix}.lora_A.weight"], peft[f"{prefix}.lora_B.weight"]
        self.applied.add(hf_name)
        return self.scale * (b.float() @ a.float())


def write_merged(src: Path, out: Path, deltas: AdapterDeltas) -> None:
    """The HF model ``src`` into ``out`` (same files, names, dtypes and side files) with every adapted weight
    ``W + delta`` (in fp32, stored in W's dtype), one tensor at a time; raises when an adapted weight is absent."""
    with SafetensorsDir(src) as reader:
        scratch = BufferPool()
        for file_name in reader.files:
            names = [n for n in reader.keys() if reader.file_of(n) == file_name]
            specs = [TensorSpec(n, reader.info(n).dtype, tuple(reader.info(n).shape)) for n in names]
            writer = StreamingSafetensorsWriter(out / file_name, specs, {"format": "pt"})
            try:
                for name in names:
                    tensor, delta = reader.get(name), deltas(name)
                    if delta is not None:
                        tensor = (tensor.float() + delta).to(tensor.dtype)
                    writer.write(name, tensor, scratch=scratch)
                writer.close()
            except BaseException:
                writer.abort()
                raise
    missing = sorted(deltas.expected - deltas.applied)
    if missing:
        raise CheckpointError(
            f"{src}: the LoRA adapters' base weights {missing[:6]} ({len(missing)} in all) are not in this HF model; "
            "the adapters were trained on another model"
        )
    if (src / INDEX_NAME).is_file():
        shutil.copyfile(src / INDEX_NAME, out / INDEX_NAME)
    copy_hf_side_files(src, out)


def _merge_megatron_base(base: Path, side: Path, out: Path, deltas: AdapterDeltas) -> None:
    """A Megatron base: the converter's HF export of it (a sibling scratch directory), then the merge into ``out``."""
    scratch = out.parent / f"{out.name}-base"
    try:
        hf_base = convert_mcore_to_hf(base, scratch, hf_config_dir=side, overwrite=True).save_dir
        write_merged(hf_base, out, deltas)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# ====================================================================================================== eval settings


def _existing_path(path: Optional[str]) -> Optional[str]:
    """``path`` made absolute when it names a file here (relative config paths mean the run's working directory,
    which the export's usually is; the eval's need not be), else unchanged."""
    if path and Path(path).is_file():
        return str(Path(path).absolute())
    return path


def eval_settings(
    model: ModelConfig, data: DataConfig, rollout: RolloutConfig, reward_cfg: RewardConfig
) -> dict[str, Any]:
    """The partial experiment config :data:`EVAL_SETTINGS_FILE` records, from the run's sections
    (``model.tokenizer_dir`` is set by :func:`write_eval_settings`, which knows where the tokenizer went)."""
    full = {"model": to_dict(model), "data": to_dict(data), "rollout": to_dict(rollout), "reward": to_dict(reward_cfg)}
    reward = full["reward"]
    reward["custom_function"]["path"] = _existing_path(reward["custom_function"]["path"])
    for spec in reward["extra_functions"]:
        if isinstance(spec, dict) and "path" in spec:
            spec["path"] = _existing_path(spec["path"])
    return {
        "model": {"params_dtype": full["model"]["params_dtype"], "tokenizer_dir": None},
        "data": {k: full["data"][k] for k in EVAL_DATA_KEYS},
        "rollout": {k: full["rollout"][k] for k in EVAL_ROLLOUT_KEYS},
        "reward": reward,
    }


def write_eval_settings(
    settings: dict[str, Any], tokenizer_dir: Optional[str], save_dir: PathLike, origin: str = ""
) -> Path:
    """Write :data:`EVAL_SETTINGS_FILE` (``settings``: :func:`eval_settings`) into the HF directory ``save_dir``, and
    the run's own tokenizer (``model.tokenizer_dir``) into its ``tokenizer/``; returns the file's path."""
    save_dir = Path(save_dir)
    tok = tokenizer_dir
    if tok and Path(tok).is_dir():
        # Copied, not referenced: the export stays evaluable wherever it is moved. Everything but weights, as the
        # trainer's AutoTokenizer saw it (a config.json there decides the tokenizer class too).
        copy_hf_side_files(tok, save_dir / TOKENIZER_SUBDIR)
        settings["model"]["tokenizer_dir"] = TOKENIZER_SUBDIR
    elif tok:
        log.warning("export: model.tokenizer_dir %s is not a directory here; the eval settings name no tokenizer", tok)
    doc = {
        "format": EVAL_SETTINGS_FORMAT,
        "written_by": "megatron-dapo export",
        "from": origin,
        "about": "the run's settings for `megatron-dapo eval --model <this directory>` without --config; a"
        " partial experiment config (docs/evaluation_and_ray.md); model.tokenizer_dir is relative to this directory",
        "config": settings,
    }
    path = save_dir / EVAL_SETTINGS_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def read_eval_settings(hf_dir: PathLike) -> Optional[dict[str, Any]]:
    """The recorded settings of an exported HF directory as a raw partial config (``model.tokenizer_dir`` made
    absolute), or None when it has none. A file of another format is an error naming it."""
    path = Path(hf_dir) / EVAL_SETTINGS_FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc}); re-export the model or pass --config") from exc
    readable = isinstance(doc, dict) and isinstance(doc.get("config"), dict)
    if not readable or doc.get("format") != EVAL_SETTINGS_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ConfigError(
            f"{path}: format {found!r}, this version reads format {EVAL_SETTINGS_FORMAT}; re-export the model with"
            " megatron-dapo export or pass --config"
        )
    config = doc["config"]
    tok = (config.get("model") or {}).get("tokenizer_dir")
    if tok:
        config["model"]["tokenizer_dir"] = str(Path(hf_dir) / tok) if not Path(tok).is_absolute() else tok
    return config
