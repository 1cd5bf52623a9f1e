"""Prompt data: verl-format rows, the tokenized prompt dataset, the resumable sampler and padding helpers."""

from megatron_dapo.data.dataset import RLDataset, build_dataset
from megatron_dapo.data.prompts import TRUNCATION_MODES, prompt_text, truncate_prompt
from megatron_dapo.data.rows import (
    SOURCE_KEY,
    DataError,
    load_rows,
    read_records,
    validate_messages,
    validate_row,
    write_rows,
)
from megatron_dapo.data.sampler import PromptSampler

__all__ = [
    "SOURCE_KEY",
    "TRUNCATION_MODES",
    "DataError",
    "PromptSampler",
    "RLDataset",
    "build_dataset",
    "load_rows",
    "prompt_text",
    "read_records",
    "truncate_prompt",
    "validate_messages",
    "validate_row",
    "write_rows",
]
