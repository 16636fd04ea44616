"""Prompt data: the Prompt record, prompt files (JSONL / Parquet) and tokenizer loading."""

from april_ext.data.dataset import DatasetConfig, PromptDataset
from april_ext.data.prompt import Prompt, PromptSource
from april_ext.data.records import read_records
from april_ext.data.tokenizer import encode_prompt, load_tokenizer

__all__ = [
    "DatasetConfig",
    "Prompt",
    "PromptDataset",
    "PromptSource",
    "encode_prompt",
    "load_tokenizer",
    "read_records",
]
