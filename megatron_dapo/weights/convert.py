"""HF ⇄ Megatron checkpoint conversion, streaming: one HF tensor (or q/k/v, gate/up group) in memory at a time.

``convert_hf_to_mcore`` declares every output tensor (name, dtype, shape — from the HF headers and the layout
module, before reading any data), opens one streaming safetensors writer per (TP rank, PP stage) and walks the
parameter map: read the 1–3 HF tensors of a parameter, build the full Megatron tensor with
``layout.hf_to_mcore``, write each TP rank's slice into its file. ``convert_mcore_to_hf`` walks the same map the
other way (merge TP shards, ``layout.mcore_to_hf``) into HF-style shards of at most ``max_shard_size``.

Output goes to ``<save_dir>.tmp-<pid>`` and is renamed into place at the end, so a failed conversion never leaves
a half-written checkpoint where a complete one is expected, and never deletes what was there.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from megatron_dapo.config import ConfigError, ParallelConfig, validate_parallel_layout
from megatron_dapo.models.families import ModelArch, ParamMapping, UnsupportedModelError, model_arch_from_hf, param_mappings
from megatron_dapo.weights.layout import hf_shapes, hf_to_mcore, mcore_to_hf, padded_vocab_size, tp_shard
from megatron_dapo.weights.mcore_checkpoint import (
    HF_CONFIG_SUBDIR,
    HF_DTYPE_NAMES,
    NAME_DTYPES,
    CheckpointError,
    McoreCheckpoint,
    arch_mismatches,
    copy_hf_side_files,
    dtype_name,
    finalize_save_dir,
    make_meta,
    prepare_save_dir,
    rank_file,
    stage_names,
    write_meta,
)
from megatron_dapo.weights.safetensors_io import (
    INDEX_NAME,
    SINGLE_NAME,
    SafetensorsDir,
    StreamingSafetensorsWriter,
    TensorSpec,
)

PathLike = Union[str, Path]

# HF buffers that older checkpoints carry and that are not parameters.
_IGNORABLE_HF = re.compile(r".*\.rotary_emb\.inv_freq$")


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


def check_hf_tensors(reader: SafetensorsDir, arch: ModelArch, mappings: Sequence[ParamMapping]) -> None:
    """Every expected HF tensor present with its expected shape, nothing unexpected; errors list all problems."""
    expected: dict[str, tuple[int, ...]] = {}
    for m in mappings:
        for name, shape in zip(m.hf, hf_shapes(m, arch)):
            expected[name] = tuple(shape)
    found = set(reader.keys())
    # A tied model may still carry lm_head.weight (transformers ties it to the embedding on load, so do we).
    ignorable = {n for n in found if _IGNORABLE_HF.match(n)}
    if arch.tie_word_embeddings:
        ignorable |= {"lm_head.weight"} & found
    missing = sorted(set(expected) - found)
    unexpected = sorted(found - set(expected) - ignorable)
    problems = []
    if missing:
        problems.append(
            f"missing HF tensors ({len(missing)}): {_fmt_list(missing)}; found ({len(found)}): {_fmt_list(sorted(found))}"
        )
    if unexpected:
        problems.append(
            f"unexpected HF tensors for {arch.family.name} ({len(unexpected)}): {_fmt_list(unexpected)}"
        )
    if problems:
        raise CheckpointError(f"{reader.directory}: " + "; ".join(problems))
    bad = [
        f"{name}: expected {shape}, got {reader.info(name).shape}"
        for name, shape in expected.items()
        if reader.info(name).shape != shape
    ]
    if bad:
        raise CheckpointError(f"{reader.directory}: shape mismatches ({len(bad)}): " + "; ".join(bad))


def _check_layout(arch: ModelArch, tp: int, pp: int) -> None:
    try:
        validate_parallel_layout(
            ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
            tp * pp, arch.num_layers, arch.num_attention_heads, arch.num_query_groups,
        )
    except ConfigError as e:
        raise CheckpointError(f"cannot convert to TP={tp} PP={pp}: {e}") from e
    if arch.ffn_hidden_size % tp:
        raise CheckpointError(f"cannot convert to TP={tp}: intermediate_size={arch.ffn_hidden_size} is not divisible by TP")


def _meta_tensors(shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    # Shape inference through the layout module itself: no tensor data, no second copy of the layout rules.
    return [torch.empty(tuple(s), device="meta") for s in shapes]


def convert_hf_to_mcore(hf_dir: PathLike, save_dir: PathLike, tp: int = 1, pp: int = 1, dtype: Optional[str] = None,
                        make_vocab_size_divisible_by: int = 128, overwrite: bool = False) -> ConversionResult:
    """HF safetensors checkpoint → our per-rank Megatron checkpoint at TP=``tp``, PP=``pp``.

    ``dtype`` (fp32 | bf16 | fp16) casts every tensor; None keeps each tensor's HF dtype (bit-exact round trip).
    """
    start = time.perf_counter()
    hf_dir = Path(hf_dir)
    arch = model_arch_from_hf(hf_dir)  # UnsupportedModelError lists the supported families
    if dtype is not None and dtype not in NAME_DTYPES:
        raise CheckpointError(f"dtype={dtype!r}: expected one of {sorted(NAME_DTYPES)}")
    _check_layout(arch, tp, pp)
    mappings = param_mappings(arch)
    padded = padded_vocab_size(arch.vocab_size, make_vocab_size_divisible_by, tp)
    with SafetensorsDir(hf_dir) as reader:
        check_hf_tensors(reader, arch, mappings)
        out_dtype = NAME_DTYPES[dtype] if dtype else None
        src_dtypes = {reader.info(n).dtype for m in mappings for n in m.hf}

        # Declare every output tensor first: the writers put the header before any data.
        per_stage = stage_names(mappings, arch, pp)
        specs: dict[tuple[int, int], list[TensorSpec]] = {(r, s): [] for r in range(tp) for s in range(pp)}
        for s, entries in enumerate(per_stage):
            for name, m in entries:
                full = hf_to_mcore(m, _meta_tensors([reader.info(n).shape for n in m.hf]), arch, padded)
                tdtype = out_dtype or reader.info(m.hf[0]).dtype
                for r in range(tp):
                    shard = tp_shard(full, m.kind, m.tp_dim, tp, r)
                    specs[(r, s)].append(TensorSpec(name, tdtype, tuple(shard.shape)))

        tmp = prepare_save_dir(save_dir, overwrite, inputs=[hf_dir])
        writers: dict[tuple[int, int], StreamingSafetensorsWriter] = {}
        try:
            for (r, s), sp in specs.items():
                path = rank_file(tmp, r, s)
                path.parent.mkdir(parents=True)
                writers[(r, s)] = StreamingSafetensorsWriter(path, sp, {"format": "pt"})
            targets: dict[str, list[tuple[int, str]]] = {}
            for s, entries in enumerate(per_stage):
                for name, m in entries:
                    targets.setdefault(m.mcore, []).append((s, name))
            for m in mappings:
                tensors = [reader.get(n) for n in m.hf]
                if out_dtype is not None:
                    tensors = [t.to(out_dtype) for t in tensors]
                full = hf_to_mcore(m, tensors, arch, padded)
                del tensors  # the fused/padded tensor is a copy: free the inputs before slicing
                for s, name in targets[m.mcore]:
                    for r in range(tp):
                        writers[(r, s)].write(name, tp_shard(full, m.kind, m.tp_dim, tp, r))
                del full
            for w in writers.values():
                w.close()
            meta_dtype = dtype or (dtype_name(next(iter(src_dtypes))) if len(src_dtypes) == 1 else "mixed")
            write_meta(tmp, make_meta(arch, tp, pp, meta_dtype, padded, make_vocab_size_divisible_by))
            copy_hf_side_files(hf_dir, tmp / HF_CONFIG_SUBDIR)
            final = finalize_save_dir(tmp, save_dir)
        except BaseException:
            for w in writers.values():
                w.abort()
            shutil.rmtree(tmp, ignore_errors=True)  # only our own partial output
            raise
    n = sum(len(v) for v in specs.values())
    nbytes = sum(s.nbytes for v in specs.values() for s in v)
    return ConversionResult(final, n, nbytes, time.perf_counter() - start)


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


def _config_for_dtype(cfg: dict, dtypes: set[torch.dtype]) -> dict:
    """config.json with its dtype field following the stored weights (after e.g. ``--dtype bf16``)."""
    cfg = dict(cfg)
    if len(dtypes) == 1 and (dt := next(iter(dtypes))) in HF_DTYPE_NAMES:
        for key in ("torch_dtype", "dtype"):
            if key in cfg:
                cfg[key] = HF_DTYPE_NAMES[dt]
    return cfg


def convert_mcore_to_hf(load_dir: PathLike, save_dir: PathLike, hf_config_dir: Optional[PathLike] = None,
                        max_shard_size: Union[int, str] = "2GB", overwrite: bool = False) -> ConversionResult:
    """Our Megatron checkpoint (any TP/PP) → HF safetensors (+ index when sharded), config.json, tokenizer files."""
    start = time.perf_counter()
    max_bytes = parse_size(max_shard_size)
    with McoreCheckpoint(load_dir) as ckpt:
        arch = ckpt.arch
        if hf_config_dir is not None:
            other = model_arch_from_hf(hf_config_dir)
            diffs = arch_mismatches(other, arch)
            if diffs:
                raise CheckpointError(f"{hf_config_dir}/config.json does not describe the checkpoint in {load_dir}: {diffs}")
        mappings = param_mappings(arch)
        per_stage = stage_names(mappings, arch, ckpt.pp)
        expected = {name for entries in per_stage for name, _ in entries}
        stored = set(ckpt.names())
        missing, unexpected = sorted(expected - stored), sorted(stored - expected)
        if missing or unexpected:
            raise CheckpointError(
                f"{load_dir}: tensors do not match a {arch.family.name} model with {arch.num_layers} layers at"
                f" PP={ckpt.pp}: missing {_fmt_list(missing)}; unexpected {_fmt_list(unexpected)}"
            )
        # Check every stored shard's shape against the layout before converting anything.
        bad = []
        for s, entries in enumerate(per_stage):
            for name, m in entries:
                if ckpt.stage(name) != s:
                    bad.append(f"{name}: stored in stage {ckpt.stage(name)}, expected stage {s}")
                    continue
                full = hf_to_mcore(m, _meta_tensors(hf_shapes(m, arch)), arch, ckpt.padded_vocab)
                for r in range(ckpt.tp):
                    want = tuple(tp_shard(full, m.kind, m.tp_dim, ckpt.tp, r).shape)
                    got = ckpt.info(name, r).shape
                    if got != want:
                        bad.append(f"{rank_file(load_dir, r, s)}:{name}: expected {want}, got {got}")
        if bad:
            raise CheckpointError(f"{load_dir}: shape mismatches ({len(bad)}): " + "; ".join(bad))

        specs: list[TensorSpec] = []
        for m in mappings:
            stored_dtype = ckpt.info(m.mcore, 0).dtype
            for name, shape in zip(m.hf, hf_shapes(m, arch)):
                specs.append(TensorSpec(name, stored_dtype, tuple(shape)))
        shards = plan_hf_shards(specs, max_bytes)
        if len(shards) == 1:
            files = [SINGLE_NAME]
        else:
            files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        where = {s.name: files[i] for i, shard in enumerate(shards) for s in shard}

        tmp = prepare_save_dir(save_dir, overwrite, inputs=[load_dir, hf_config_dir])
        writers: dict[str, StreamingSafetensorsWriter] = {}
        try:
            for fn, shard in zip(files, shards):
                writers[fn] = StreamingSafetensorsWriter(tmp / fn, shard, {"format": "pt"})
            for m in mappings:
                full = ckpt.full(m.mcore, m)
                for name, t in zip(m.hf, mcore_to_hf(m, full, arch)):
                    writers[where[name]].write(name, t)
                del full
            for w in writers.values():
                w.close()
            if len(files) > 1:
                index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": dict(sorted(where.items()))}
                with open(tmp / INDEX_NAME, "w") as f:
                    json.dump(index, f, indent=2)
            side = Path(hf_config_dir) if hf_config_dir is not None else Path(load_dir) / HF_CONFIG_SUBDIR
            if side.is_dir():
                copy_hf_side_files(side, tmp)
            cfg = ckpt.meta["hf_config"]
            if (side / "config.json").is_file():
                with open(side / "config.json") as f:
                    cfg = json.load(f)
            with open(tmp / "config.json", "w") as f:
                json.dump(_config_for_dtype(cfg, {s.dtype for s in specs}), f, indent=2)
            final = finalize_save_dir(tmp, save_dir)
        except BaseException:
            for w in writers.values():
                w.abort()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return ConversionResult(final, len(specs), sum(s.nbytes for s in specs), time.perf_counter() - start)


# ------------------------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``hf-to-mcore`` / ``mcore-to-hf`` subcommands (shared by tools/checkpoint_convert and the main CLI)."""
    sub = parser.add_subparsers(dest="direction", required=True)
    h = sub.add_parser("hf-to-mcore", help="HF safetensors → per-rank Megatron checkpoint")
    h.add_argument("--hf-dir", required=True, help="HF model directory (config.json + safetensors)")
    h.add_argument("--save-dir", required=True)
    h.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the written layout")
    h.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the written layout")
    h.add_argument("--dtype", choices=sorted(NAME_DTYPES), default=None, help="cast weights (default: keep HF dtype)")
    h.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    h.add_argument("--overwrite", action="store_true", help="replace an existing save directory")
    m = sub.add_parser("mcore-to-hf", help="per-rank Megatron checkpoint → HF safetensors")
    m.add_argument("--load-dir", required=True)
    m.add_argument("--save-dir", required=True)
    m.add_argument("--hf-config-dir", default=None, help="config.json/tokenizer source (default: <load-dir>/hf_config)")
    m.add_argument("--max-shard-size", default="2GB")
    m.add_argument("--overwrite", action="store_true")


def run(args: argparse.Namespace) -> ConversionResult:
    if args.direction == "hf-to-mcore":
        return convert_hf_to_mcore(args.hf_dir, args.save_dir, tp=args.tp, pp=args.pp, dtype=args.dtype,
                                   make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                                   overwrite=args.overwrite)
    return convert_mcore_to_hf(args.load_dir, args.save_dir, hf_config_dir=args.hf_config_dir,
                               max_shard_size=args.max_shard_size, overwrite=args.overwrite)


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
