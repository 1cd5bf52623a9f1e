"""HF ⇄ Megatron checkpoint conversion, streaming: one tensor at a time.

``convert_hf_to_mcore`` writes a model-only megatron-core distributed checkpoint in Megatron-LM's layout
(``megatron_dapo/weights/dist_format.py`` describes it): every tensor is planned from the HF headers (shapes and
dtypes, no data), then read, put into Megatron's layout (``megatron_dapo/weights/layout.py``: QKV interleave,
gate/up fuse, vocabulary padding) and written, one at a time. The checkpoint has no parallel layout: whoever loads
it picks one. ``convert_mcore_to_hf`` reads any Megatron distributed checkpoint (any TP/PP/VPP it was saved at; ours,
Megatron-LM's, Megatron-Bridge's, a training step) tensor by tensor into HF-style shards of at most ``max_shard_size``.

The source's tensors that the text model does not own (a Qwen3.5 VLM's vision tower ``model.visual.*`` and its
``mtp.*`` head) are carried: ``convert_hf_to_mcore`` copies them byte for byte into ``hf_config/carried/`` (covered by
the checkpoint's manifest), and ``convert_mcore_to_hf`` copies them back from there, or from the HF model directory
given as ``hf_config_dir``, next to the text model, under the source's config: the export loads as the source's class.

Output goes to ``<save_dir>.tmp-<pid>`` and is renamed into place at the end, so a failed conversion never leaves
a half-written checkpoint where a complete one is expected, and never deletes what was there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Optional, Union

import torch

from megatron_dapo import dtypes
from megatron_dapo.models.families import (
    VLM_TEXT_PREFIX,
    ModelArch,
    ParamMapping,
    UnsupportedModelError,
    ignorable_hf_names,
    is_ignorable_hf_name,
    load_hf_config,
    model_arch_from_hf,
    param_mappings,
    to_te_name,
)
from megatron_dapo.rm.score_head import ScoreHeadSpec, body_mappings, reward_head
from megatron_dapo.weights.atomic import fresh_dir, publish_dir
from megatron_dapo.weights.checkpoint_errors import CheckpointError
from megatron_dapo.weights.dist_format import (
    HF_CONFIG_SUBDIR,
    RELEASE_DIR,
    TRACKER_FILE,
    CheckpointSource,
    find_checkpoint,
    list_entries,
    stacked_layer_key,
)
from megatron_dapo.weights.dist_reader import DistCheckpointReader
from megatron_dapo.weights.dist_writer import TensorPlan, write_model_checkpoint
from megatron_dapo.weights.integrity import FileRecord, file_digest, read_manifest, verify_files, write_manifest
from megatron_dapo.weights.layout import checkpoint_pieces, hf_shapes, hf_to_mcore, mcore_to_hf, padded_vocab_size
from megatron_dapo.weights.safetensors_io import (
    INDEX_NAME,
    SINGLE_NAME,
    BufferPool,
    FileSlice,
    SafetensorsDir,
    StreamingSafetensorsWriter,
    TensorSpec,
    tensor_nbytes,
)

PathLike = Union[str, Path]

# HF buffers that older checkpoints carry and that are not parameters.
_IGNORABLE_HF = re.compile(r".*\.rotary_emb\.inv_freq$")
# Files of an HF model directory that are weights (not copied into hf_config/).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# Where a converted checkpoint keeps the source's carried tensors (module docstring): ``hf_config/carried/``.
CARRIED_SUBDIR = "carried"


@dataclass(frozen=True)
class ConversionResult:
    save_dir: Path
    num_tensors: int  # tensors written (all files)
    num_bytes: int  # tensor bytes written (all files)
    seconds: float


def _fmt_list(names: Sequence[str], limit: int = 30) -> str:
    names = list(names)
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


# ------------------------------------------------------------------------------------------ output directory


def _temp_output_dir(save_dir: PathLike, overwrite: bool, inputs: Sequence[Optional[PathLike]] = ()) -> Path:
    """Check ``save_dir`` and create the temporary sibling we write into (published by ``_staged_output``).

    Nothing already in ``save_dir`` is touched until the new checkpoint is complete.
    """
    save_dir = Path(save_dir).absolute()
    for src in inputs:
        if src is not None and Path(src).exists() and save_dir.exists() and Path(src).resolve() == save_dir.resolve():
            raise CheckpointError(f"save directory {save_dir} is the input directory; choose another save directory")
    if save_dir.exists():
        if not save_dir.is_dir():
            raise CheckpointError(f"save directory {save_dir} exists and is not a directory")
        if any(save_dir.iterdir()) and not overwrite:
            raise CheckpointError(
                f"save directory {save_dir} already exists and is not empty (contains: {list_entries(save_dir, 10)});"
                " pass --overwrite (overwrite=True) to replace it"
            )
    return fresh_dir(save_dir.parent / f"{save_dir.name}.tmp-{os.getpid()}")


@contextmanager
def _staged_output(save_dir: PathLike, overwrite: bool, inputs: Sequence[Optional[PathLike]]) -> Iterator[Path]:
    """The temporary directory to write into; renamed to ``save_dir`` when the block finishes, removed (only our
    own partial output) when it raises."""
    tmp = _temp_output_dir(save_dir, overwrite, inputs)
    try:
        yield tmp
        publish_dir(tmp, Path(save_dir).absolute())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_hf_side_files(src_dir: PathLike, dst_dir: PathLike) -> list[str]:
    """Copy config.json, generation config and tokenizer files (everything but weights) from an HF directory."""
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for p in sorted(src_dir.iterdir()):
        if not p.is_file() or p.name.endswith(WEIGHT_SUFFIXES) or p.name in WEIGHT_INDEXES:
            continue
        shutil.copyfile(p, dst_dir / p.name)
        copied.append(p.name)
    return copied


# ------------------------------------------------------------------------------------------ carried tensors


def carried_names(reader: SafetensorsDir, arch: ModelArch, owned: Iterable[str]) -> list[str]:
    """The tensors of ``reader``'s HF checkpoint that the text model of ``arch`` does not own (``owned``: its HF
    names), sorted: a VLM's vision tower, an ``mtp.*`` head. Not what the text model derives: rotary buffers, a tied
    model's ``lm_head.weight`` (a copy of the embedding, which training changed)."""
    skip = set(owned) | ignorable_hf_names(arch)
    return sorted(n for n in reader.keys() if n not in skip and not _IGNORABLE_HF.match(n))


def carried_source(hf_config_dir: PathLike) -> Optional[Path]:
    """Where the carried tensors that go with ``hf_config_dir`` are: a converted checkpoint's
    ``hf_config/carried/``, else the directory itself when it is an HF model directory (its safetensors); else None."""
    d = Path(hf_config_dir)
    for where in (d / CARRIED_SUBDIR, d):
        if (where / INDEX_NAME).is_file() or any(where.glob("*.safetensors")):
            return where
    return None


def carried_parts(reader: SafetensorsDir, name: str) -> list[Union[torch.Tensor, FileSlice]]:
    """Tensor ``name`` as the writer takes it: its file's bytes (copied by the kernel, untouched), or a 0-d / empty
    tensor read whole."""
    shape = reader.info(name).shape
    return [reader.rows(name, 0, shape[0])] if shape and shape[0] else [reader.get(name)]


def write_carried(reader: SafetensorsDir, names: Sequence[str], path: Path) -> None:
    """The tensors ``names`` of ``reader`` into the safetensors file ``path``, byte for byte, same dtypes."""
    specs = [TensorSpec(n, reader.info(n).dtype, tuple(reader.info(n).shape)) for n in names]
    with StreamingSafetensorsWriter(path, specs, {"format": "pt"}) as writer:
        for n in names:
            writer.write_parts(n, carried_parts(reader, n))


# ------------------------------------------------------------------------------------------------ HF → Megatron


def check_hf_tensors(
    reader: SafetensorsDir,
    arch: ModelArch,
    mappings: Sequence[ParamMapping],
    unexpected_ok: bool = False,
    extra: Mapping[str, tuple[int, ...]] = MappingProxyType({}),
) -> None:
    """Every HF tensor of ``mappings`` (and of ``extra``: name → shape, a reward model's score head) present with
    the shape ``arch`` gives it and, unless ``unexpected_ok``, nothing else; from the headers alone. The error lists
    all problems: missing names (with the files searched), then shape mismatches, each with the file that holds it.

    The converter and the loader's HF-direct start (``weights/loading.py``) both check with this, before any data
    is read, so a wrong checkpoint is reported the same way by both."""
    expected: dict[str, tuple[int, ...]] = dict(extra)
    for m in mappings:
        for name, shape in zip(m.hf, hf_shapes(m, arch)):
            expected[name] = tuple(shape)
    found = set(reader.keys())
    ignorable = {n for n in found if _IGNORABLE_HF.match(n) or is_ignorable_hf_name(arch, n)}
    missing = sorted(set(expected) - found)
    unexpected = [] if unexpected_ok else sorted(found - set(expected) - ignorable)
    problems = []
    if missing:
        problems.append(
            f"missing HF tensors ({len(missing)}): {_fmt_list(missing)};"
            f" found ({len(found)}) in {_fmt_list(sorted(reader.files), 5)}: {_fmt_list(sorted(found))}"
        )
    if unexpected:
        problems.append(f"unexpected HF tensors for {arch.family.name} ({len(unexpected)}): {_fmt_list(unexpected)}")
    if problems:
        raise CheckpointError(f"{reader.directory}: " + "; ".join(problems))
    bad = [
        f"{name}: expected {shape}, got {reader.info(name).shape} in {reader.file_of(name)}"
        for name, shape in expected.items()
        if reader.info(name).shape != shape
    ]
    if bad:
        raise CheckpointError(f"{reader.directory}: shape mismatches ({len(bad)}): " + "; ".join(bad))


def mcore_full_shape(mapping: ParamMapping, arch: ModelArch, padded_vocab: int) -> tuple[int, ...]:
    """The whole (unsharded) Megatron tensor's shape, from the HF shapes alone (the layout functions on meta
    tensors: no data)."""
    metas = [torch.empty(s, device="meta") for s in hf_shapes(mapping, arch)]
    return tuple(hf_to_mcore(mapping, metas, arch, padded_vocab).shape)


# Layouts whose Megatron tensor is its HF tensors' rows one after another (then zero rows: vocabulary padding).
_ROW_STACKED = ("gate_up", "vocab")


def read_row_stacked(reader: SafetensorsDir, names: Sequence[str], shape: tuple[int, ...]) -> Optional[torch.Tensor]:
    """A new tensor of ``shape`` holding the HF tensors ``names``' rows one after another, each read from its file
    straight into its place (no intermediate copy, as ``torch.cat`` of separately read tensors would make), the rows
    past theirs zero; None when they do not stack so (mixed dtypes or row shapes): the caller builds it generally."""
    infos = [reader.info(n) for n in names]
    dtype = infos[0].dtype
    if not shape or any(i.dtype != dtype or i.shape[1:] != shape[1:] for i in infos):
        return None
    if sum(i.shape[0] for i in infos) > shape[0]:
        return None
    out = torch.empty(shape, dtype=dtype)
    row = 0
    for info in infos:
        dest = out[row : row + info.shape[0]]
        if dest.numel():
            reader.get(info.name, out=dest.reshape(-1).view(torch.uint8))
        row += info.shape[0]
    out[row:].zero_()
    return out


def _plan_hf_to_mcore(
    reader: SafetensorsDir,
    arch: ModelArch,
    padded_vocab: int,
    out_dtype: Optional[torch.dtype],
    mappings: Sequence[ParamMapping],
) -> list[TensorPlan]:
    """One ``TensorPlan`` per Megatron tensor, from the HF headers alone; each reads and transforms its HF tensors
    only when the writer asks for it (row-stacked layouts straight into the Megatron tensor: ``read_row_stacked``)."""

    def produce(m: ParamMapping, shape: tuple[int, ...]):
        def read() -> torch.Tensor:
            full = read_row_stacked(reader, m.hf, shape) if m.kind in _ROW_STACKED else None
            if full is None:
                full = hf_to_mcore(m, [reader.get(n) for n in m.hf], arch, padded_vocab)
            return full if out_dtype is None else full.to(out_dtype)

        return read

    plans = []
    for m in mappings:
        key, index, count = checkpoint_key(m, arch)
        dtype = out_dtype or reader.info(m.hf[0]).dtype
        shape = mcore_full_shape(m, arch, padded_vocab)
        for suffix, first, rows in checkpoint_pieces(m):  # a Gated DeltaNet's in_proj / conv1d: one key per block
            piece = _row_block(produce(m, shape), first, rows)
            plans.append(TensorPlan(f"{key}.{suffix}", dtype, (rows, *shape[1:]), piece, index, count))
        if not checkpoint_pieces(m):
            plans.append(TensorPlan(key, dtype, shape, produce(m, shape), index, count))
    return plans


def _row_block(read: Callable[[], torch.Tensor], first: int, rows: int) -> Callable[[], torch.Tensor]:
    """Rows ``first .. first + rows`` of what ``read`` returns (a piece of a tensor stored in pieces)."""
    return lambda: read()[first : first + rows].clone()


def expert_checkpoint_key(mapping: ParamMapping) -> str:
    """megatron-core's key for a routed expert's weight (``SequentialMLP.sharded_state_dict``): all experts of a
    layer in one tensor ``decoder.layers.{i}.mlp.experts.experts.linear_fc{1,2}.weight`` with a leading global expert
    axis (``[E, 2I, H]`` / ``[E, H, I]``); each EP rank writes and reads its block of experts."""
    return f"decoder.layers.{mapping.layer}.mlp.experts.experts.{mapping.mcore.rsplit('.', 2)[-2]}.weight"


def checkpoint_key(mapping: ParamMapping, arch: ModelArch) -> tuple[str, Optional[int], Optional[int]]:
    """(key, index along the key's leading axis or None, that axis' size) of ``mapping`` in a checkpoint we write.

    Dense models: layer-stacked keys (megatron-core's default for homogeneous layers). MoE models: megatron-core
    always saves them with ``non_homogeneous_layers`` (``moe_layer_freq`` is a list), i.e. one key per layer, and
    every expert weight is index ``expert`` of its layer's stacked-experts tensor."""
    if mapping.is_expert:
        return expert_checkpoint_key(mapping), mapping.expert, arch.num_experts
    name = to_te_name(mapping.mcore, arch)
    if arch.is_moe or arch.gated_delta_net is not None:  # a hybrid block is non-homogeneous too: per-layer keys
        return name, None, None
    key, layer = stacked_layer_key(name)
    return key, layer, arch.num_layers if layer is not None else None


def _write_release_checkpoint(
    out: Path, hf_dir: Path, plans: Sequence[TensorPlan], reader: SafetensorsDir, carried: Sequence[str]
) -> None:
    """``out``: tracker file → ``release/`` (the tensors), ``hf_config/`` (config + tokenizer, and the ``carried``
    tensors of ``reader`` in ``carried/``), ``manifest.json``."""
    records = write_model_checkpoint(out / RELEASE_DIR, plans, iteration=0)
    (out / TRACKER_FILE).write_text(RELEASE_DIR)
    records.append(FileRecord(str(out / TRACKER_FILE), *file_digest(out / TRACKER_FILE)))
    copy_hf_side_files(hf_dir, out / HF_CONFIG_SUBDIR)
    if carried:
        (out / HF_CONFIG_SUBDIR / CARRIED_SUBDIR).mkdir()
        write_carried(reader, carried, out / HF_CONFIG_SUBDIR / CARRIED_SUBDIR / SINGLE_NAME)
    for p in sorted(q for q in (out / HF_CONFIG_SUBDIR).rglob("*") if q.is_file()):
        records.append(FileRecord(str(p), *file_digest(p)))
    write_manifest(
        out, [FileRecord(Path(r.path).relative_to(out).as_posix(), r.size, r.digest, r.algorithm) for r in records]
    )


def _score_head_plan(reader: SafetensorsDir, head: ScoreHeadSpec, out_dtype: Optional[torch.dtype]) -> TensorPlan:
    """A reward model's score head (``rm/score_head.py``): copied as it is, replicated, under ``head.mcore``."""

    def read() -> torch.Tensor:
        t = reader.get(head.hf)
        return t if out_dtype is None else t.to(out_dtype)

    return TensorPlan(head.mcore, out_dtype or reader.info(head.hf).dtype, head.shape, read)


def convert_hf_to_mcore(
    hf_dir: PathLike,
    save_dir: PathLike,
    dtype: Optional[str] = None,
    make_vocab_size_divisible_by: int = 128,
    overwrite: bool = False,
) -> ConversionResult:
    """HF safetensors checkpoint → a model-only Megatron distributed checkpoint (``release``) with no layout.

    Streams: every tensor is planned from the HF headers, then read, transformed (``layout.hf_to_mcore``: QKV
    interleave, gate/up fuse, vocabulary padding to ``make_vocab_size_divisible_by``) and written one at a time.
    ``dtype`` (fp32 | bf16 | fp16) casts every tensor; None keeps each tensor's HF dtype (bit-exact round trip).
    """
    start = time.perf_counter()
    hf_dir = Path(hf_dir)
    arch = model_arch_from_hf(hf_dir)  # UnsupportedModelError lists the supported families
    if dtype is not None and dtype not in dtypes.CONFIG_NAMES:
        raise CheckpointError(f"dtype={dtype!r}: expected one of {sorted(dtypes.CONFIG_NAMES)}")
    padded = padded_vocab_size(arch.vocab_size, make_vocab_size_divisible_by, 1)
    out_dtype = dtypes.from_config_name(dtype) if dtype else None
    head = reward_head(arch)  # a *ForSequenceClassification checkpoint: decoder + score head, no LM head
    mappings = param_mappings(arch) if head is None else body_mappings(arch)
    with SafetensorsDir(hf_dir) as reader:
        check_hf_tensors(reader, arch, mappings, extra={head.hf: head.shape} if head else {})
        plans = _plan_hf_to_mcore(reader, arch, padded, out_dtype, mappings)
        if head is not None:
            plans.append(_score_head_plan(reader, head, out_dtype))
        owned = [n for m in mappings for n in m.hf] + ([head.hf] if head is not None else [])
        carried = carried_names(reader, arch, owned)  # a VLM's vision tower, mtp.*: kept as they are
        with _staged_output(save_dir, overwrite, inputs=[hf_dir]) as tmp:
            _write_release_checkpoint(tmp, hf_dir, plans, reader, carried)
    nbytes = sum(tensor_nbytes(p.dtype, p.shape) for p in plans)
    return ConversionResult(Path(save_dir).absolute(), len(plans), nbytes, time.perf_counter() - start)


# ------------------------------------------------------------------------------------------ Megatron → HF


def parse_size(size: Union[int, str]) -> int:
    """``2GB`` → 2·10⁹, ``500MiB`` → 500·2²⁰, ``1000`` → 1000 (transformers' convention)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", size.upper())
    if not m:
        raise ValueError(f"size {size!r}: expected a byte count like 2GB, 500MB, 100KiB or 1000")
    value, unit = float(m.group(1)), m.group(2) or "B"
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0] if unit != "B" else "B"]
    return int(value * base**power)


def plan_hf_shards(specs: Sequence[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Greedy, in order, like ``save_pretrained``: a tensor larger than the limit gets a shard of its own."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def _config_for_dtype(cfg: dict, stored: set[torch.dtype]) -> dict:
    """config.json with its dtype field following the stored weights (after e.g. ``--dtype bf16``)."""
    cfg = dict(cfg)
    if len(stored) == 1:
        try:
            name = dtypes.hf_name(next(iter(stored)))
        except ValueError:
            return cfg
        for key in ("torch_dtype", "dtype"):
            if key in cfg:
                cfg[key] = name
    return cfg


def stored_key(mapping: ParamMapping, reader: DistCheckpointReader, arch: ModelArch) -> tuple[str, Optional[int]]:
    """Where ``mapping`` is stored: (key, layer index in a layer-stacked tensor or None). Keys are megatron-core's
    TransformerEngine-spec names, layer-stacked (its default) or one per layer (``non_homogeneous_layers``). A routed
    expert's weight is (its layer's stacked-experts key, global expert id)."""
    if mapping.is_expert:
        return expert_checkpoint_key(mapping), mapping.expert
    name = to_te_name(mapping.mcore, arch)
    return (name, None) if name in reader else stacked_layer_key(name)


def stored_keys(
    mapping: ParamMapping, reader: DistCheckpointReader, arch: ModelArch
) -> list[tuple[str, Optional[int]]]:
    """``stored_key``, or the keys of its pieces (a Gated DeltaNet's in_proj / conv1d: ``layout.checkpoint_pieces``)."""
    pieces = checkpoint_pieces(mapping)
    if not pieces:
        return [stored_key(mapping, reader, arch)]
    names = [f"{to_te_name(mapping.mcore, arch)}.{suffix}" for suffix, _, _ in pieces]
    return [(name, None) if name in reader else stacked_layer_key(name) for name in names]


def read_stored(reader: DistCheckpointReader, mapping: ParamMapping, arch: ModelArch) -> torch.Tensor:
    """``mapping``'s full Megatron tensor from the checkpoint (its pieces concatenated)."""
    parts = reader.read(stored_keys(mapping, reader, arch))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def check_stored_tensors(reader: DistCheckpointReader, arch: ModelArch, mappings: Sequence[ParamMapping]) -> None:
    """Every model tensor present with the shape ``arch`` gives it (any vocabulary padding); errors list all."""
    missing, bad = [], []
    for m in mappings:
        key, layer = stored_key(m, reader, arch)
        pieces = checkpoint_pieces(m)
        if pieces:  # each piece: its rows of the full tensor
            full = mcore_full_shape(m, arch, arch.vocab_size)
            for (k, at), (_, _, rows) in zip(stored_keys(m, reader, arch), pieces):
                got = reader.tensors[k][1][(0 if at is None else 1) :] if k in reader else None
                if got is None:
                    missing.append(k)
                elif got != (rows, *full[1:]):
                    bad.append(f"{k}: expected {(rows, *full[1:])}, got {got}")
            continue
        if key not in reader:
            missing.append(key)
            continue
        got = reader.tensors[key][1]
        if layer is not None:
            count, what = (arch.num_experts, "experts") if m.is_expert else (arch.num_layers, "layers")
            if got[0] != count:
                bad.append(f"{key}: stacks {got[0]} {what}, the model has {count}")
                continue
            got = got[1:]
        want = mcore_full_shape(m, arch, arch.vocab_size)
        if m.kind == "vocab":
            ok = len(got) == 2 and got[0] >= arch.vocab_size and got[1:] == want[1:]
        else:
            ok = got == want
        if not ok:
            bad.append(f"{key}: expected {want}{' (+ padding rows)' if m.kind == 'vocab' else ''}, got {got}")
    if missing:
        raise CheckpointError(
            f"{reader.directory}: tensors of a {arch.family.name} model with {arch.num_layers} layers are missing"
            f" ({len(missing)}): {_fmt_list(missing)};"
            f" it holds {len(reader.keys())}: {_fmt_list(sorted(reader.keys()))}"
        )
    if bad:
        raise CheckpointError(f"{reader.directory}: shape mismatches ({len(bad)}): " + "; ".join(bad))


def verify_checkpoint_files(root: PathLike) -> None:
    """Sizes and checksums of every file against ``<root>/manifest.json`` (nothing to check without one)."""
    try:
        records = read_manifest(root)
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    if records is not None:
        problem = verify_files(root, [records[k] for k in sorted(records)], checksum=True)
        if problem is not None:
            raise CheckpointError(f"checkpoint {root} is damaged: {problem}")


def _open_mcore_source(load_dir: PathLike, hf_config_dir: Optional[PathLike]) -> tuple[CheckpointSource, Path]:
    """The Megatron checkpoint at ``load_dir`` and the HF config directory that describes its model."""
    source = find_checkpoint(load_dir)
    if source.kind != "megatron":
        raise CheckpointError(f"{load_dir} is already an HF model directory; mcore-to-hf needs a Megatron checkpoint")
    side = Path(hf_config_dir) if hf_config_dir is not None else source.hf_config_dir
    if side is None:
        raise CheckpointError(
            f"{source.description} has no {HF_CONFIG_SUBDIR}/config.json: pass --hf-config-dir (hf_config_dir=) with"
            " the HF config.json (and tokenizer files) of the model it holds"
        )
    return source, side


@dataclass(frozen=True)
class CarriedTensors:
    """The source's tensors an export carries (``carried_names``) and the HF weights that hold them."""

    reader: SafetensorsDir
    names: list[str]


def _verify_carried(where: Path, verified: Path) -> None:
    """The files under ``where`` against the manifest of the checkpoint that holds them (a converted checkpoint's
    ``hf_config/carried/``, or an HF directory with a ``manifest.json``), unless ``verified`` (already checked)."""
    roots = [where] + ([where.parent.parent] if where.parent.name == HF_CONFIG_SUBDIR else [])
    for root in roots:
        if root.resolve() == verified.resolve():
            return
        try:
            records = read_manifest(root)
        except ValueError as e:
            raise CheckpointError(str(e)) from e
        if records is None:
            continue
        under = where.resolve().relative_to(root.resolve()).as_posix()
        mine = [r for name, r in sorted(records.items()) if under == "." or name.startswith(f"{under}/")]
        problem = verify_files(root, mine, checksum=True)
        if problem is not None:
            raise CheckpointError(f"the carried tensors in {where} are damaged: {problem}")
        return


@contextmanager
def open_carried(
    side: Path, arch: ModelArch, carried_dir: Optional[PathLike], verified: Path
) -> Iterator[Optional[CarriedTensors]]:
    """The tensors an export of ``arch`` carries: from ``carried_dir``, else ``carried_source(side)``; None when
    there are none. A VLM config without them is refused: its export would not load as the VLM's class."""
    where = Path(carried_dir) if carried_dir is not None else carried_source(side)
    if where is not None:
        _verify_carried(where, verified)
    with SafetensorsDir(where) if where is not None else contextlib.nullcontext() as reader:
        names = carried_names(reader, arch, (n for m in param_mappings(arch) for n in m.hf)) if reader else []
        if arch.hf_prefix == VLM_TEXT_PREFIX and not names:
            raise CheckpointError(
                f"{side}/config.json is a {arch.family.hf_architecture} (a VLM) but {where or side} holds none of its"
                " other tensors (vision tower model.visual.*, mtp.*): pass --hf-config-dir (hf_config_dir=) with the"
                " source HF model directory (config.json + *.safetensors), or convert the source again with"
                f" `convert hf-to-mcore`, which keeps them in {HF_CONFIG_SUBDIR}/{CARRIED_SUBDIR}/"
            )
        yield CarriedTensors(reader, names) if names else None


@dataclass(frozen=True)
class _HfFilePlan:
    """Which HF tensors go to which safetensors file."""

    specs: list[TensorSpec]  # every HF tensor, in HF order, with the stored dtype
    files: list[str]
    shards: list[list[TensorSpec]]  # per file
    where: dict[str, str]  # tensor name → file


def _plan_hf_files(
    reader: DistCheckpointReader, arch: ModelArch, max_bytes: int, carried: Optional[CarriedTensors]
) -> _HfFilePlan:
    specs: list[TensorSpec] = []
    for m in param_mappings(arch):
        stored_dtype = reader.tensors[stored_keys(m, reader, arch)[0][0]][0]
        for name, shape in zip(m.hf, hf_shapes(m, arch)):
            specs.append(TensorSpec(name, stored_dtype, tuple(shape)))
    for name in carried.names if carried is not None else []:
        info = carried.reader.info(name)
        specs.append(TensorSpec(name, info.dtype, tuple(info.shape)))
    shards = plan_hf_shards(specs, max_bytes)
    if len(shards) == 1:
        files = [SINGLE_NAME]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    where = {s.name: files[i] for i, shard in enumerate(shards) for s in shard}
    return _HfFilePlan(specs, files, shards, where)


def _write_hf_tensors(
    out: Path, reader: DistCheckpointReader, arch: ModelArch, plan: _HfFilePlan, carried: Optional[CarriedTensors]
) -> None:
    """The safetensors files (+ index when sharded), one Megatron tensor read and split at a time, then the carried
    tensors copied byte for byte."""
    writers: dict[str, StreamingSafetensorsWriter] = {}
    try:
        for fn, shard in zip(plan.files, plan.shards):
            writers[fn] = StreamingSafetensorsWriter(out / fn, shard, {"format": "pt"})
        scratch = BufferPool()  # q/k/v and vocabulary slices are strided views: copied through one reused buffer
        for m in param_mappings(arch):
            full = read_stored(reader, m, arch)
            for name, t in zip(m.hf, mcore_to_hf(m, full, arch)):
                writers[plan.where[name]].write(name, t, scratch=scratch)
            del full
        for name in carried.names if carried is not None else []:
            writers[plan.where[name]].write_parts(name, carried_parts(carried.reader, name))
        for w in writers.values():
            w.close()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    if len(plan.files) > 1:
        index = {
            "metadata": {"total_size": sum(s.nbytes for s in plan.specs)},
            "weight_map": dict(sorted(plan.where.items())),
        }
        with open(out / INDEX_NAME, "w") as f:
            json.dump(index, f, indent=2)


def convert_mcore_to_hf(
    load_dir: PathLike,
    save_dir: PathLike,
    hf_config_dir: Optional[PathLike] = None,
    max_shard_size: Union[int, str] = "2GB",
    overwrite: bool = False,
    carried_dir: Optional[PathLike] = None,
) -> ConversionResult:
    """A Megatron distributed checkpoint (ours, Megatron-LM's, Megatron-Bridge's, a training step; any layout it
    was saved at) → HF safetensors (+ index when sharded), config.json, tokenizer files. One process, tensor by
    tensor. ``hf_config_dir`` defaults to the checkpoint's ``hf_config/``. The source's tensors the text model does
    not own (a VLM's vision tower, ``mtp.*``) are copied from ``carried_dir``, by default the ``carried/`` of
    ``hf_config_dir`` or ``hf_config_dir`` itself when it is an HF model directory (``carried_source``)."""
    start = time.perf_counter()
    max_bytes = parse_size(max_shard_size)
    source, side = _open_mcore_source(load_dir, hf_config_dir)
    arch = model_arch_from_hf(side)
    verify_checkpoint_files(source.root)
    reader = DistCheckpointReader(source.path)
    check_stored_tensors(reader, arch, param_mappings(arch))
    with open_carried(side, arch, carried_dir, source.root) as carried:
        plan = _plan_hf_files(reader, arch, max_bytes, carried)
        with _staged_output(save_dir, overwrite, inputs=[load_dir, hf_config_dir, carried_dir]) as tmp:
            _write_hf_tensors(tmp, reader, arch, plan, carried)
            copy_hf_side_files(side, tmp)
            config = _config_for_dtype(load_hf_config(side), {s.dtype for s in plan.specs})  # the source's: a VLM's
            with open(tmp / "config.json", "w") as f:
                json.dump(config, f, indent=2)
    nbytes = sum(s.nbytes for s in plan.specs)
    return ConversionResult(Path(save_dir).absolute(), len(plan.specs), nbytes, time.perf_counter() - start)


# ------------------------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``hf-to-mcore`` / ``mcore-to-hf`` subcommands (shared by tools/checkpoint_convert and the main CLI)."""
    sub = parser.add_subparsers(dest="direction", required=True)
    h = sub.add_parser("hf-to-mcore", help="HF safetensors → Megatron distributed checkpoint (no layout)")
    h.add_argument("--hf-dir", required=True, help="HF model directory (config.json + safetensors)")
    h.add_argument("--save-dir", required=True)
    h.add_argument(
        "--dtype", choices=sorted(dtypes.CONFIG_NAMES), default=None, help="cast weights (default: keep HF dtype)"
    )
    h.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    h.add_argument("--overwrite", action="store_true", help="replace an existing save directory")
    m = sub.add_parser("mcore-to-hf", help="Megatron distributed checkpoint (any source, any layout) → HF safetensors")
    m.add_argument(
        "--load-dir",
        required=True,
        help="a Megatron-LM/Bridge/our checkpoint (tracker file, iter_*/release, bare dist_checkpointing dir) or a"
        " training global_step_<n> directory",
    )
    m.add_argument("--save-dir", required=True)
    m.add_argument("--hf-config-dir", default=None, help="config.json/tokenizer source (default: <load-dir>/hf_config)")
    m.add_argument("--max-shard-size", default="2GB")
    m.add_argument("--overwrite", action="store_true")


def run(args: argparse.Namespace) -> ConversionResult:
    if args.direction == "hf-to-mcore":
        return convert_hf_to_mcore(
            args.hf_dir,
            args.save_dir,
            dtype=args.dtype,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            overwrite=args.overwrite,
        )
    return convert_mcore_to_hf(
        args.load_dir,
        args.save_dir,
        hf_config_dir=args.hf_config_dir,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Convert checkpoints between HF safetensors and Megatron layouts")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        res = run(args)
    except (CheckpointError, UnsupportedModelError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {res.num_tensors} tensors ({res.num_bytes / 2**20:.1f} MiB) to {res.save_dir} in {res.seconds:.2f}s")
    return 0
