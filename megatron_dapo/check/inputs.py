"""The run's input files, as ``megatron-dapo check`` checks them: the checkpoints (metadata, manifest and
architecture; no tensor data) and every data row (and the tokenized prompts of a sample). The user's code those rows
reach (reward functions, tools) is tried by ``user_code_checks.py`` on the first row of each data source found here."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from megatron_dapo.config.schema import (
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    MultiTurnConfig,
    ParallelConfig,
    RewardConfig,
)
from megatron_dapo.data.prompts import prompt_text, truncate_prompt
from megatron_dapo.data.rows import DataError, read_records, validate_row
from megatron_dapo.models.families import ModelArch
from megatron_dapo.weights.checkpoint_errors import CheckpointError
from megatron_dapo.weights.dist_format import find_checkpoint
from megatron_dapo.weights.dist_reader import DistCheckpointReader
from megatron_dapo.weights.integrity import read_manifest, verify_files
from megatron_dapo.weights.loading import arch_mismatches, checkpoint_arch

MAX_ROWS_LISTED = 5  # bad rows listed per file and kind of problem; the rest are counted


class InputChecker:
    """Checks the files the config sections name; collects ``problems`` and the ``lines`` of the report's ``inputs:``
    section. ``uses_reference``: a KL term needs the reference (``checkpoint.ref_load_dir`` is checked too);
    ``hf_dir`` / ``hf_key``: the HF config directory and the config key it came from (for messages and the
    tokenizer's fallback); ``arch``: the model it describes (None when unreadable)."""

    def __init__(
        self,
        checkpoint: CheckpointConfig,
        parallel: ParallelConfig,
        model: ModelConfig,
        data: DataConfig,
        reward: RewardConfig,
        multi_turn: MultiTurnConfig,
        uses_reference: bool,
        arch: Optional[ModelArch],
        hf_dir: Optional[str],
        hf_key: str,
        sample_rows: int,
    ) -> None:
        self.checkpoint, self.parallel, self.model, self.data = checkpoint, parallel, model, data
        self.reward, self.multi_turn, self.uses_reference = reward, multi_turn, uses_reference
        self.arch, self.hf_dir, self.hf_key, self.sample_rows = arch, hf_dir, hf_key, sample_rows
        self.problems: list[str] = []
        self.lines: list[str] = []
        self._tokenizer: Any = None
        self._tokenizer_tried = False
        self.data_sources: dict[str, tuple[str, dict]] = {}  # data_source -> (where, row), first row seen

    # ----------------------------------------------------------------------------------------- checkpoint

    def check_checkpoints(self) -> None:
        ck = self.checkpoint
        dirs = [("checkpoint.load_dir", ck.load_dir)]
        if self.uses_reference and ck.ref_load_dir:
            dirs.append(("checkpoint.ref_load_dir", ck.ref_load_dir))
        for key, directory in dirs:
            if directory:  # else the rules reported it (config/rules.py required_input_problems)
                self._check_checkpoint(key, directory)
        mode = ck.resume_mode
        if mode not in ("auto", "disable") and not Path(mode).is_dir():
            self.problems.append(
                f"checkpoint.resume_mode={mode!r}: no such step directory; use auto, disable or the path of a "
                "global_step_<n> directory"
            )

    def _check_checkpoint(self, key: str, directory: str) -> None:
        tp, pp = self.parallel.tensor_model_parallel_size, self.parallel.pipeline_model_parallel_size
        fix = (
            "point it at an HF model directory or a Megatron checkpoint (make one with `megatron-dapo convert "
            f"hf-to-mcore --hf-dir <HF model> --save-dir {directory}`)"
        )
        if not Path(directory).is_dir():
            self.problems.append(f"{key}={directory}: no such directory; {fix}")
            return
        try:
            # What it is, its HF config, the manifest's file sizes and the tensor index; no tensor data is read.
            source = find_checkpoint(directory)
            stored = checkpoint_arch(source)
            if source.kind == "megatron":
                DistCheckpointReader(source.path)
                records = read_manifest(source.root)
                damaged = verify_files(source.root, records.values(), checksum=False) if records else None
                if damaged is not None:
                    raise CheckpointError(f"checkpoint {source.root} is damaged: {damaged}")
            diffs = arch_mismatches(stored, self.arch) if stored is not None and self.arch is not None else []
        except CheckpointError as exc:
            self.problems.append(f"{key}={directory}: {exc}")
            return
        except (OSError, ValueError, KeyError) as exc:
            self.problems.append(f"{key}={directory}: cannot read the checkpoint: {type(exc).__name__}: {exc}; {fix}")
            return
        if diffs:
            self.problems.append(
                f"{key}={directory}: the checkpoint's architecture differs from {self.hf_key}={self.hf_dir} "
                f"(checkpoint vs HF config): {'; '.join(diffs)}; convert the checkpoint again from that model, or "
                "point model.hf_config_dir at the model it was converted from"
            )
        self.lines.append(f"  {key}: {source.description}, loaded at TP {tp} PP {pp}")

    # ----------------------------------------------------------------------------------------- data

    def _tokenizer_for_prompts(self) -> Any:
        if self._tokenizer_tried:
            return self._tokenizer
        self._tokenizer_tried = True
        source = self.model.tokenizer_dir or self.hf_dir
        key = "model.tokenizer_dir" if self.model.tokenizer_dir else self.hf_key
        if not source:
            return None
        from transformers import AutoTokenizer  # heavy: transformers, only when there are prompts to tokenize

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers raises many types for a missing/broken tokenizer
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self.problems.append(
                f"{key}={source}: no tokenizer can be loaded ({type(exc).__name__}: {first}); point "
                "model.tokenizer_dir at a directory with the tokenizer files"
            )
        return self._tokenizer

    def check_data(self) -> None:
        d = self.data
        train_rows = 0
        for key, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
            total = sum(self._check_file(f"{key}[{i}]", file) for i, file in enumerate(files))
            if key == "data.train_files":
                train_rows = total
        gen = d.gen_batch_size or d.train_batch_size
        if train_rows and gen > train_rows:
            self.problems.append(
                f"data.gen_batch_size (or data.train_batch_size)={gen} is larger than the {train_rows} rows of "
                "data.train_files: no generation batch can be formed; lower it or add data"
            )

    def _check_file(self, key: str, file: str) -> int:
        """Every row of ``file`` in verl format, the first ``sample_rows`` prompts templated and tokenized; returns
        the number of valid rows."""
        d = self.data
        try:
            records = read_records(file)
        except DataError as exc:
            self.problems.append(f"{key}: {exc}; fix the path in {key.split('[')[0]}")
            return 0
        if not records:
            self.problems.append(f"{key}: {file} has no rows")
            return 0
        bad: list[str] = []
        valid: list[tuple[int, dict]] = []
        for r, row in enumerate(records):
            try:
                validate_row(row, f"{file}: row {r}", d.prompt_key)
                valid.append((r, row))
            except DataError as exc:
                bad.append(str(exc))
        self._list_rows(bad, file, "rows not in verl format (see megatron_dapo/data/rows.py)")
        for r, row in valid:
            self.data_sources.setdefault(row["data_source"], (f"{file}: row {r}", row))
        sample = valid[: self.sample_rows] if self.sample_rows > 0 else valid
        tokenizer = self._tokenizer_for_prompts() if sample else None
        if tokenizer is None:
            self.lines.append(f"  {key}: {file}: {len(records)} rows, {len(bad)} invalid (prompts not tokenized)")
        else:
            lengths = self._check_prompts(file, sample, tokenizer)
            self._summarise_prompts(key, file, len(records), len(bad), len(sample), lengths)
        return len(valid)

    def _check_prompts(self, file: str, sample: list[tuple[int, dict]], tokenizer: Any) -> list[int]:
        """Template and tokenize each sampled prompt; prompts the template rejects and (truncation=error) prompts
        over data.max_prompt_length are problems. Returns the prompt lengths."""
        d = self.data
        overlong: list[str] = []
        templ: list[str] = []
        lengths: list[int] = []
        for r, row in sample:
            where = f"{file}: row {r}"
            try:
                text = prompt_text(row[d.prompt_key], tokenizer, d.apply_chat_template, where)
            except DataError as exc:
                templ.append(str(exc))
                continue
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            lengths.append(len(ids))
            if not ids:
                templ.append(f"{where}: the prompt tokenizes to no tokens; drop the row")
            elif len(ids) > d.max_prompt_length and not d.filter_overlong_prompts:
                try:
                    truncate_prompt(ids, d.max_prompt_length, d.truncation, where)
                except DataError as exc:
                    overlong.append(str(exc))
        self._list_rows(templ, file, "prompts the chat template/tokenizer rejects")
        self._list_rows(overlong, file, f"prompts longer than data.max_prompt_length={d.max_prompt_length}")
        return lengths

    def _summarise_prompts(self, key: str, file: str, rows: int, bad: int, sampled: int, lengths: list[int]) -> None:
        d = self.data
        n_over = sum(n > d.max_prompt_length for n in lengths)
        if d.filter_overlong_prompts and lengths and n_over == len(lengths):
            self.problems.append(
                f"{key}: all {len(lengths)} sampled prompts of {file} are longer than data.max_prompt_length="
                f"{d.max_prompt_length} and would be filtered out (data.filter_overlong_prompts=true); raise it"
            )
        longest = max(lengths) if lengths else 0
        fate = "" if not n_over else (" (filtered out)" if d.filter_overlong_prompts else f" ({d.truncation})")
        self.lines.append(
            f"  {key}: {file}: {rows} rows, {bad} invalid; first {sampled} tokenized: longest "
            f"prompt {longest} tokens, {n_over} over data.max_prompt_length={d.max_prompt_length}{fate}"
        )

    def _list_rows(self, messages: list[str], file: str, what: str) -> None:
        self.problems.extend(messages[:MAX_ROWS_LISTED])
        if len(messages) > MAX_ROWS_LISTED:
            self.problems.append(
                f"{file}: {len(messages) - MAX_ROWS_LISTED} more {what} (first {MAX_ROWS_LISTED} above)"
            )
