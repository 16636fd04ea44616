"""Prompt data: prompt files (JSONL / Parquet) as scheduler data sources, and tokenizer loading."""

from april_ext.data.dataset import DatasetConfig, PromptDataset
from april_ext.data.records import read_records
from april_ext.data.tokenizer import encode_prompt, load_tokenizer

__all__ = [
    "DatasetConfig",
    "PromptDataset",
    "encode_prompt",
    "load_tokenizer",
    "read_records",
]
