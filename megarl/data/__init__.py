"""Prompt datasets: jsonl loading with file:line errors, synthetic verifiable tasks, a character tokenizer."""

from megarl.data.dataset import DataError, PromptDataset, PromptRow, PromptSampler, load_jsonl_rows
from megarl.data.tokenizer import CharTokenizer

__all__ = ["DataError", "PromptDataset", "PromptRow", "PromptSampler", "load_jsonl_rows", "CharTokenizer"]
