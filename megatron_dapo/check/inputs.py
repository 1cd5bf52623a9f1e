"""The run's input files, as ``megatron-dapo check`` checks them: the checkpoints (metadata, manifest and
architecture; no tensor data), every data row (and the tokenized prompts of a sample), and each reward function,
called once per data source on that source's first row; a multi-turn run's tools, built and created once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from megatron_dapo.agent.host import ToolHost
from megatron_dapo.agent.tools import read_tool_config
from megatron_dapo.config import ConfigError, extra_function_spec
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
from megatron_dapo.reward import custom, math_dapo
from megatron_dapo.reward.scoring import MATH_DAPO_SOURCES, route_data_source
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

    # ----------------------------------------------------------------------------------------- rewards

    def check_rewards(self) -> None:
        """Import the reward functions, then call the one each data source routes to on its first row, with the
        row's ground truth as the response."""
        specs, functions = self._load_reward_functions()
        loaded_all = len(functions) == len(specs)
        for source, (where, row) in sorted(self.data_sources.items()):
            truth = row["reward_model"]["ground_truth"]
            response = str(truth[0] if isinstance(truth, (list, tuple)) and truth else truth)
            extra = row.get("extra_info")
            if route_data_source(source) == "math_dapo":
                calls = [("the built-in scorer", custom.MATH_DAPO_LABEL, _bind_math(response, truth))]
            elif not specs:
                self.problems.append(
                    f"{where}: no reward function for data_source {source!r}: the built-in scorer handles "
                    f"{', '.join(MATH_DAPO_SOURCES)} and aime*; set reward.custom_function.path (and .name) to a "
                    "Python file defining compute_score(data_source, solution_str, ground_truth, extra_info)"
                )
                continue
            elif not loaded_all:
                continue  # its import problem is listed already
            else:
                calls = [
                    (key, custom.function_label(fn), _bind(fn, source, response, truth, extra)) for key, fn in functions
                ]
            for key, label, call in calls:
                self._call_reward(key, label, call, source, where, response)

    def _load_reward_functions(self) -> tuple[list[tuple[str, str, str]], list[tuple[str, Any]]]:
        """((config key, path, name) of each function the config names, (config key, function) of those that
        import)."""
        rw = self.reward
        specs: list[tuple[str, str, str]] = []
        if rw.custom_function.path:
            specs.append(("reward.custom_function", rw.custom_function.path, rw.custom_function.name))
        for i, item in enumerate(rw.extra_functions):
            key = f"reward.extra_functions[{i}]"
            spec = extra_function_spec(item, key)[0]  # a malformed entry is the reward rule's problem (config/rules.py)
            if spec is not None:
                specs.append((key, spec[0], spec[1]))
        functions: list[tuple[str, Any]] = []
        for key, path, name in specs:
            try:
                functions.append((key, custom.load_reward_function(path, name)))
            except (FileNotFoundError, ImportError, AttributeError, TypeError) as exc:
                self.problems.append(f"{key} (path={path}, name={name}): {exc}")
        return specs, functions

    def _call_reward(
        self, key: str, label: str, call: Callable[[], Any], source: str, where: str, response: str
    ) -> None:
        timeout = self.reward.timeout_s
        context = (
            f"reward function {label} ({key}) on data_source {source!r} ({where}, response "
            f"{custom.short_repr(response)} = the row's ground truth)"
        )
        try:
            result = custom.call_with_timeout(call, timeout)
            custom.finite_score(result, label)
        except custom.ScorerTimeout:
            self.problems.append(f"{context}: ran past reward.timeout_s={timeout:g} s; speed it up or raise the limit")
        except custom.InvalidRewardError as exc:
            self.problems.append(f"{context}: {exc}")
        except Exception as exc:  # noqa: BLE001 - the user's function may raise anything
            self.problems.append(
                f"{context}: raised {type(exc).__name__}: {exc}; fix the function (the trainer would score every "
                f"such response reward.error_score={self.reward.error_score:g})"
            )

    # ----------------------------------------------------------------------------------------- tools

    def check_tools(self) -> None:
        """A multi-turn run's tool YAML: read, every class imported and built in the tool process, ``create`` and
        ``release`` called once (with the ``tools_kwargs`` of the first data row that has them), and every tool that
        a checked row's ``extra_info.tools_kwargs`` names defined."""
        mt = self.multi_turn
        if not mt.enable or not mt.tool_config_path:
            return  # a missing path is a config rule's problem
        path = mt.tool_config_path
        try:
            specs = read_tool_config(path)
        except ConfigError as exc:
            self.problems.append(str(exc))
            return
        names = {s.name for s in specs}
        first_kwargs: Optional[dict] = None
        for where, row in (self.data_sources[k] for k in sorted(self.data_sources)):
            kwargs = (row.get("extra_info") or {}).get("tools_kwargs")
            unknown = sorted(set(kwargs or {}) - names)
            if unknown:
                self.problems.append(
                    f"{where}: extra_info.tools_kwargs names {unknown}, which {path} does not define "
                    f"(tools: {sorted(names)})"
                )
            first_kwargs = first_kwargs if first_kwargs is not None else kwargs
        problem = _try_tools(specs, first_kwargs, mt.tool_timeout_s)
        if problem:
            self.problems.append(f"rollout.multi_turn.tool_config_path={path}: {problem}")
            return
        tools = ", ".join(sorted(names))
        self.lines.append(f"  rollout.multi_turn.tool_config_path: {path}: {tools} (built, create/release ok)")


def _try_tools(specs: list, tools_kwargs: Optional[dict], timeout_s: float) -> Optional[str]:
    """Build the tools in their own process, as the rollout does, and create and release one instance."""
    with ToolHost(specs, timeout_s) as host:
        try:
            host.start()
        except RuntimeError as exc:
            return str(exc)
        try:
            created = host.create("check-0", tools_kwargs).result(timeout=timeout_s + 10)
            host.release("check-0").result(timeout=timeout_s + 10)
        except TimeoutError:
            return f"create/release did not return within {timeout_s:g} s (rollout.multi_turn.tool_timeout_s)"
        return f"create failed: {created}" if isinstance(created, str) else None


def _bind(fn: Any, source: str, response: str, truth: Any, extra: Any) -> Callable[[], Any]:
    return lambda: fn(data_source=source, solution_str=response, ground_truth=truth, extra_info=extra)


def _bind_math(response: str, truth: Any) -> Callable[[], Any]:
    return lambda: math_dapo.compute_score(response, truth)
