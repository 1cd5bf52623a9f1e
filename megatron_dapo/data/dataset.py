"""The prompt dataset: verl-format rows -> chat-templated, tokenized, length-checked prompts."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from megatron_dapo.config import DataConfig
from megatron_dapo.data.prompts import prompt_text, truncate_prompt
from megatron_dapo.data.rows import DataError, load_rows, row_location, validate_row

logger = logging.getLogger(__name__)

# Texts tokenized per tokenizer call: batching is much faster than one call per row, chunks bound the memory.
_TOKENIZE_CHUNK = 1024


class RLDataset:
    """Tokenized prompts, ready for ``PromptSampler`` and the rollout engine.

    All rows are templated and tokenized here, at construction, so that a bad or overlong row stops the run before
    any model is loaded, and so that ``filter_overlong_prompts`` knows the final length. Each item is a dict:

    - ``input_ids``: list[int], the (possibly truncated) prompt tokens, unpadded;
    - ``raw_prompt``: the text that was tokenized (chat template applied), before truncation;
    - ``data_source``, ``ground_truth`` (``reward_model.ground_truth`` as stored), ``extra_info`` (dict, {} if
      absent): what the reward function is called with;
    - ``index``: the item's position in this dataset (after filtering), i.e. the sampler's index.
    """

    def __init__(
        self,
        rows: Sequence[dict],
        tokenizer: Any,
        data_config: DataConfig,
        name: str = "dataset",
        tools: Optional[list[dict]] = None,
    ) -> None:
        self.name = name
        self.config = data_config
        max_length = data_config.max_prompt_length
        if not isinstance(max_length, int) or max_length <= 0:
            raise DataError(f"data.max_prompt_length: expected a positive integer, got {max_length!r}")
        if not rows:
            raise DataError(f"{name}: no rows")

        texts, places = _prompt_texts(rows, tokenizer, data_config, name, tools)
        all_ids = _tokenize(tokenizer, texts)
        self.num_filtered = 0
        self._items: list[dict] = []
        for row, text, ids, where in zip(rows, texts, all_ids, places):
            if not ids:
                raise DataError(f"{where}: the prompt tokenizes to no tokens")
            if len(ids) > max_length and data_config.filter_overlong_prompts:
                self.num_filtered += 1
                continue
            ids = truncate_prompt(ids, max_length, data_config.truncation, where)
            self._items.append(
                {
                    "input_ids": ids,
                    "raw_prompt": text,
                    "prompt_messages": row[data_config.prompt_key],  # the multi-turn reward's conversation starts here
                    "data_source": row["data_source"],
                    "ground_truth": row["reward_model"]["ground_truth"],
                    "extra_info": dict(row.get("extra_info") or {}),
                    "index": len(self._items),
                }
            )
        if self.num_filtered:
            logger.warning(
                "%s: dropped %d of %d prompts longer than data.max_prompt_length=%d (filter_overlong_prompts)",
                name,
                self.num_filtered,
                len(rows),
                max_length,
            )
        if not self._items:
            raise DataError(
                f"{name}: all {len(rows)} prompts are longer than data.max_prompt_length={max_length} and were "
                "filtered out"
            )

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> dict:
        item = self._items[index]
        # Copies of the mutable fields: a caller editing a batch must not change the dataset.
        return {**item, "input_ids": list(item["input_ids"]), "extra_info": dict(item["extra_info"])}


def _prompt_texts(
    rows: Sequence[dict], tokenizer: Any, data_config: DataConfig, name: str, tools: Optional[list[dict]] = None
) -> tuple[list[str], list[str]]:
    """Validate every row; returns the prompts' texts (chat template applied, given the ``tools`` schemas of a
    multi-turn run, which templates such as Qwen's list in the system turn) and the rows' locations (messages)."""
    texts: list[str] = []
    places: list[str] = []
    for i, row in enumerate(rows):
        where = row_location(row, f"{name}: row {i}")
        validate_row(row, where, data_config.prompt_key)
        texts.append(prompt_text(row[data_config.prompt_key], tokenizer, data_config.apply_chat_template, where, tools))
        places.append(where)
    return texts, places


def _tokenize(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of ``texts`` (no special tokens added), ``_TOKENIZE_CHUNK`` texts per tokenizer call."""
    all_ids: list[list[int]] = []
    for start in range(0, len(texts), _TOKENIZE_CHUNK):
        chunk = texts[start : start + _TOKENIZE_CHUNK]
        all_ids.extend(list(ids) for ids in tokenizer(chunk, add_special_tokens=False)["input_ids"])
    return all_ids


def build_dataset(
    files: Sequence[str | Path],
    tokenizer: Any,
    data_config: DataConfig,
    name: str = "dataset",
    tools: Optional[list[dict]] = None,
) -> RLDataset:
    """``load_rows`` + ``RLDataset``: the dataset of ``data.train_files`` or ``data.val_files``."""
    return RLDataset(load_rows(files, data_config.prompt_key), tokenizer, data_config, name=name, tools=tools)
