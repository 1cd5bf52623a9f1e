"""HF ⇄ Megatron checkpoint conversion, streaming: one HF tensor (or q/k/v, gate/up group) at a time.

``convert_hf_to_mcore`` declares every output tensor (name, dtype, shape — from the HF headers and the layout
module, before reading any data), opens one streaming safetensors writer per (TP rank, PP stage) and walks the
parameter map, parameter by parameter (its 1–3 HF tensors), writing each TP rank's slice into its file:

* parameters split along dim 0 or replicated (QKV, gate/up, vocabulary, norms): each slice is runs of whole HF
  rows (found by pushing row numbers through ``layout.hf_to_mcore``/``layout.tp_shard``), copied file to file by
  the kernel (``copy_file_range``), so those bytes never enter this process;
* parameters split along dim 1 (attention output, MLP down projection) and any dtype cast: the HF tensors are read
  into reused buffers and the layout functions' slices are written.

A writer thread overlaps the writes of one parameter with reading the next. ``convert_mcore_to_hf`` walks the same
map the other way (merge TP shards, ``layout.mcore_to_hf``) into HF-style shards of at most ``max_shard_size``.

Output goes to ``<save_dir>.tmp-<pid>`` and is renamed into place at the end, so a failed conversion never leaves
a half-written checkpoint where a complete one is expected, and never deletes what was there.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import shutil
import sys
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

from megatron_dapo.config import ConfigError, ParallelConfig, validate_parallel_layout
from megatron_dapo.models.families import (
    ModelArch,
    ParamMapping,
    UnsupportedModelError,
    model_arch_from_hf,
    param_mappings,
)
from megatron_dapo.weights.integrity import FileRecord, write_manifest
from megatron_dapo.weights.layout import (
    hf_shapes,
    hf_to_mcore,
    mcore_shard_shape,
    mcore_to_hf,
    padded_vocab_size,
    tp_shard,
)
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
    BufferPool,
    FileSlice,
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
            f"missing HF tensors ({len(missing)}): {_fmt_list(missing)};"
            f" found ({len(found)}): {_fmt_list(sorted(found))}"
        )
    if unexpected:
        problems.append(f"unexpected HF tensors for {arch.family.name} ({len(unexpected)}): {_fmt_list(unexpected)}")
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
            tp * pp,
            arch.num_layers,
            arch.num_attention_heads,
            arch.num_query_groups,
        )
    except ConfigError as e:
        raise CheckpointError(f"cannot convert to TP={tp} PP={pp}: {e}") from e
    if arch.ffn_hidden_size % tp:
        raise CheckpointError(
            f"cannot convert to TP={tp}: intermediate_size={arch.ffn_hidden_size} is not divisible by TP"
        )


Run = tuple[int, int, int]  # (index of the HF tensor in mapping.hf, or -1 for padding rows; first row; rows)


def shard_row_plan(
    mapping: ParamMapping, hf_rows: Sequence[int], arch: ModelArch, padded_vocab: int, tp_size: int, tp_rank: int
) -> list[Run]:
    """Which rows of which HF tensor make up TP rank ``tp_rank``'s slice of ``mapping``, as runs of whole rows.

    Derived by pushing row *numbers* through the layout module's own ``hf_to_mcore`` and ``tp_shard`` (no second
    copy of the QKV / gate-up / vocab rules), so the converter can write each slice straight from views of the HF
    tensors instead of materialising the fused tensor and its per-rank concatenations. Valid for parameters that
    are replicated or split along dim 0, whose transforms only move whole rows.
    """
    if mapping.tp_dim not in (None, 0):
        raise ValueError(f"{mapping.mcore}: row plans need tp_dim 0 or None, not {mapping.tp_dim}")
    ids, starts, nxt = [], [], 1  # id 0 marks a padding row
    for rows in hf_rows:
        ids.append(torch.arange(nxt, nxt + rows, dtype=torch.int64))
        starts.append(nxt)
        nxt += rows + 1  # a gap, so that a run of consecutive ids never spans two tensors
    shard = tp_shard(hf_to_mcore(mapping, ids, arch, padded_vocab), mapping.kind, mapping.tp_dim, tp_size, tp_rank)
    if shard.numel() == 0:
        return []
    pad = shard == 0
    new_run = torch.ones(len(shard), dtype=torch.bool)
    new_run[1:] = (pad[1:] != pad[:-1]) | (~pad[1:] & (shard[1:] - shard[:-1] != 1))
    firsts = new_run.nonzero().flatten().tolist()
    runs = []
    for a, b in zip(firsts, firsts[1:] + [len(shard)]):
        v = int(shard[a])
        if v == 0:
            runs.append((-1, 0, b - a))
        else:
            t = bisect.bisect_right(starts, v) - 1
            runs.append((t, v - starts[t], b - a))
    return runs


class _RowSource:
    """An HF tensor not read into memory: slicing rows gives a ``FileSlice`` for the writer."""

    def __init__(self, reader: SafetensorsDir, name: str) -> None:
        self.reader, self.name = reader, name
        info = reader.info(name)
        self.shape, self.dtype = info.shape, info.dtype

    def __getitem__(self, rows: slice) -> FileSlice:
        return self.reader.rows(self.name, rows.start, rows.stop - rows.start)


def plan_parts(plan: Sequence[Run], sources: Sequence) -> list:
    """The pieces whose dim-0 concatenation is the planned slice: row ranges of ``sources`` (tensors, or
    ``_RowSource``s giving file slices) and zeros for padding rows."""
    rest, dtype = tuple(sources[0].shape[1:]), sources[0].dtype
    return [sources[t][a : a + n] if t >= 0 else torch.zeros((n,) + rest, dtype=dtype) for t, a, n in plan]


class _ReadWritePipeline:
    """Overlaps writing one parameter's slices (or kernel copies) with reading the next parameter's HF tensors.

    Two slots of reusable read buffers alternate; a single writer thread writes one slot's jobs while the caller
    reads into the other (``preadv``/``pwrite`` release the GIL). A slot is reused only after its previous writes
    finished. ``budget`` caps the bytes both slots hold: when the next parameter would exceed it, the other slot is
    drained and released first, so memory stays near the largest parameter's size rather than twice it.
    """

    def __init__(self, budget: int) -> None:
        self.pools = [BufferPool(), BufferPool()]
        self.pending: list[Optional[Future]] = [None, None]
        self.budget = budget
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer")
        self._cur = 0

    def _wait(self, k: int) -> None:
        fut, self.pending[k] = self.pending[k], None
        if fut is not None:
            fut.result()  # re-raises a failed write here

    def next_pool(self, sizes: dict[str, int]) -> BufferPool:
        """The slot to read the next parameter into (``sizes``: buffer key → bytes it will need)."""
        k = self._cur = 1 - self._cur
        self._wait(k)
        pool, other = self.pools[k], self.pools[1 - k]
        if pool.nbytes + other.nbytes + pool.extra_bytes(sizes) > self.budget:
            self._wait(1 - k)
            other.clear()
            if pool.nbytes + pool.extra_bytes(sizes) > self.budget:
                pool.clear()  # its writes are done: drop the old buffers before allocating larger ones
        return pool

    def submit(self, jobs: list[tuple[StreamingSafetensorsWriter, str, list[torch.Tensor]]]) -> None:
        pool = self.pools[self._cur]

        def run() -> None:
            for writer, name, parts in jobs:
                writer.write_parts(name, parts, scratch=pool)

        self.pending[self._cur] = self._executor.submit(run)

    def finish(self) -> None:
        for k in (0, 1):
            self._wait(k)
        self._executor.shutdown()
        self.pools = [BufferPool(), BufferPool()]

    def abort(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.pending = [None, None]


class _Planner:
    """Row plans and per-rank shard shapes for one (arch, padded vocabulary, TP size), cached by shape."""

    def __init__(self, arch: ModelArch, padded_vocab: int, tp_size: int) -> None:
        self.arch, self.padded, self.tp = arch, padded_vocab, tp_size
        self._plans: dict[tuple, list[Run]] = {}

    @staticmethod
    def row_wise(m: ParamMapping, shapes: Sequence[Sequence[int]]) -> bool:
        return m.tp_dim != 1 and all(len(s) >= 1 for s in shapes)

    def plan(self, m: ParamMapping, shapes: Sequence[Sequence[int]], tp_rank: int) -> list[Run]:
        key = (m.kind, m.tp_dim, tuple(s[0] for s in shapes), tp_rank)
        if key not in self._plans:
            self._plans[key] = shard_row_plan(m, key[2], self.arch, self.padded, self.tp, tp_rank)
        return self._plans[key]

    def shard_shapes(self, m: ParamMapping, shapes: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        """Each TP rank's shard shape, from the HF shapes alone (no data read)."""
        if self.row_wise(m, shapes):
            rest = tuple(shapes[0][1:])
            return [(sum(n for _, _, n in self.plan(m, shapes, r)),) + rest for r in range(self.tp)]
        if m.kind == "copy":
            return [mcore_shard_shape(shapes[0], m.tp_dim, self.tp)] * self.tp
        # Any other transform: run the layout functions on data-less tensors.
        full = hf_to_mcore(m, [torch.empty(tuple(s), device="meta") for s in shapes], self.arch, self.padded)
        return [tuple(tp_shard(full, m.kind, m.tp_dim, self.tp, r).shape) for r in range(self.tp)]


def convert_hf_to_mcore(
    hf_dir: PathLike,
    save_dir: PathLike,
    tp: int = 1,
    pp: int = 1,
    dtype: Optional[str] = None,
    make_vocab_size_divisible_by: int = 128,
    overwrite: bool = False,
) -> ConversionResult:
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
        planner = _Planner(arch, padded, tp)
        for s, entries in enumerate(per_stage):
            for name, m in entries:
                shapes = planner.shard_shapes(m, [reader.info(n).shape for n in m.hf])
                tdtype = out_dtype or reader.info(m.hf[0]).dtype
                for r in range(tp):
                    specs[(r, s)].append(TensorSpec(name, tdtype, shapes[r]))

        tmp = prepare_save_dir(save_dir, overwrite, inputs=[hf_dir])
        writers: dict[tuple[int, int], StreamingSafetensorsWriter] = {}
        pipe: Optional[_ReadWritePipeline] = None
        try:
            for (r, s), sp in specs.items():
                path = rank_file(tmp, r, s)
                path.parent.mkdir(parents=True)
                writers[(r, s)] = StreamingSafetensorsWriter(path, sp, {"format": "pt"})
            targets: dict[str, list[tuple[int, str]]] = {}
            for s, entries in enumerate(per_stage):
                for name, m in entries:
                    targets.setdefault(m.mcore, []).append((s, name))
            pipe = _ReadWritePipeline(budget=max(sum(reader.info(n).nbytes for n in m.hf) for m in mappings) * 3 // 2)
            for m in mappings:
                shapes = [reader.info(n).shape for n in m.hf]
                row_wise = planner.row_wise(m, shapes)
                if row_wise and (out_dtype is None or all(reader.info(n).dtype == out_dtype for n in m.hf)):
                    # Every slice is runs of whole HF rows: the kernel copies them file to file, no read at all.
                    pipe.next_pool({})
                    sources: list = [_RowSource(reader, n) for n in m.hf]
                else:
                    sizes = {f"in{i}": reader.info(n).nbytes for i, n in enumerate(m.hf)}
                    pool = pipe.next_pool(sizes)
                    sources = [reader.get(n, pool.get(f"in{i}", sizes[f"in{i}"])) for i, n in enumerate(m.hf)]
                    if out_dtype is not None:
                        sources = [t.to(out_dtype) for t in sources]
                full = None if row_wise else hf_to_mcore(m, sources, arch, padded)
                jobs = []
                for r in range(tp):
                    if row_wise:
                        parts = plan_parts(planner.plan(m, shapes, r), sources)
                    else:
                        parts = [tp_shard(full, m.kind, m.tp_dim, tp, r)]
                    jobs += [(writers[(r, s)], name, parts) for s, name in targets[m.mcore]]
                pipe.submit(jobs)
                del sources, full, parts, jobs
            pipe.finish()
            for w in writers.values():
                w.close()
            write_manifest(tmp, [FileRecord(w.path.relative_to(tmp).as_posix(), *w.record) for w in writers.values()])
            meta_dtype = dtype or (dtype_name(next(iter(src_dtypes))) if len(src_dtypes) == 1 else "mixed")
            write_meta(tmp, make_meta(arch, tp, pp, meta_dtype, padded, make_vocab_size_divisible_by))
            copy_hf_side_files(hf_dir, tmp / HF_CONFIG_SUBDIR)
            final = finalize_save_dir(tmp, save_dir)
        except BaseException:
            if pipe is not None:
                pipe.abort()  # no write may still be running when the files are closed
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


def convert_mcore_to_hf(
    load_dir: PathLike,
    save_dir: PathLike,
    hf_config_dir: Optional[PathLike] = None,
    max_shard_size: Union[int, str] = "2GB",
    overwrite: bool = False,
) -> ConversionResult:
    """Our Megatron checkpoint (any TP/PP) → HF safetensors (+ index when sharded), config.json, tokenizer files."""
    start = time.perf_counter()
    max_bytes = parse_size(max_shard_size)
    with McoreCheckpoint(load_dir) as ckpt:
        arch = ckpt.arch
        if hf_config_dir is not None:
            other = model_arch_from_hf(hf_config_dir)
            diffs = arch_mismatches(other, arch)
            if diffs:
                raise CheckpointError(
                    f"{hf_config_dir}/config.json does not describe the checkpoint in {load_dir}: {diffs}"
                )
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
        planner = _Planner(arch, ckpt.padded_vocab, ckpt.tp)
        for entries in per_stage:
            # Found by name, not by expected stage: a checkpoint saved with virtual pipeline stages interleaves them.
            for name, m in entries:
                shard_shapes = planner.shard_shapes(m, hf_shapes(m, arch))
                for r in range(ckpt.tp):
                    got = ckpt.info(name, r).shape
                    if got != shard_shapes[r]:
                        bad.append(
                            f"{rank_file(load_dir, r, ckpt.stage(name))}:{name}: expected {shard_shapes[r]}, got {got}"
                        )
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
            scratch = BufferPool()  # q/k/v and vocabulary slices are strided views: copied through one reused buffer
            for m in mappings:
                full = ckpt.full(m.mcore, m)
                for name, t in zip(m.hf, mcore_to_hf(m, full, arch)):
                    writers[where[name]].write(name, t, scratch=scratch)
                del full
            for w in writers.values():
                w.close()
            if len(files) > 1:
                index = {
                    "metadata": {"total_size": sum(s.nbytes for s in specs)},
                    "weight_map": dict(sorted(where.items())),
                }
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
        return convert_hf_to_mcore(
            args.hf_dir,
            args.save_dir,
            tp=args.tp,
            pp=args.pp,
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
