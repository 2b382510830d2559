"""Prompt datasets: jsonl / parquet loading with file:line (file: row N) errors, chat templates,
synthetic verifiable tasks, a character tokenizer."""

from megarl.data.dataset import (
    DataError,
    PromptDataset,
    PromptRow,
    PromptSampler,
    load_jsonl_rows,
    load_prompt_rows,
)
from megarl.data.tokenizer import CharTokenizer

__all__ = [
    "CharTokenizer",
    "DataError",
    "PromptDataset",
    "PromptRow",
    "PromptSampler",
    "load_jsonl_rows",
    "load_prompt_rows",
]
