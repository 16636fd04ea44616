"""PromptDataset: prompts with labels from a JSONL or Parquet file, tokenized; a scheduler DataSource."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from april_ext.data.records import lookup, read_records
from april_ext.data.tokenizer import encode_prompt
from april_ext.data_source import Prompt
from april_ext.errors import ConfigError, InvalidArgumentError


@dataclass(frozen=True)
class DatasetConfig:
    """Where the fields of a record live. Dotted keys walk nested objects ("reward_model.ground_truth").

    prompt_key: a string or a chat (list of {"role", "content"}). label_key: the reference answer.
    id_key: a stable id (default: "<file name>:<line>"). max_prompt_len: longer prompts are skipped
    (counted in ``PromptDataset.skipped``). epochs: how many passes the data source offers before the
    scheduler sees it run out; None: endless, pass after pass (slime cycles its prompts the same way).
    shuffle: each epoch visits the prompts in a permutation drawn from (seed, epoch); False: file order.
    """

    prompt_key: str = "prompt"
    label_key: str = "label"
    id_key: str | None = None
    max_prompt_len: int | None = None
    epochs: int | None = 1
    shuffle: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompt_key", "label_key"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"DatasetConfig.{name} must be a non-empty string, got {value!r}")
        if self.id_key is not None and (not isinstance(self.id_key, str) or not self.id_key):
            raise ConfigError(f"DatasetConfig.id_key must be None or a non-empty string, got {self.id_key!r}")
        if self.max_prompt_len is not None and (not isinstance(self.max_prompt_len, int)
                                                or isinstance(self.max_prompt_len, bool)
                                                or self.max_prompt_len < 1):
            raise ConfigError(f"DatasetConfig.max_prompt_len must be None or an integer >= 1, "
                              f"got {self.max_prompt_len!r}")
        if self.epochs is not None and (not isinstance(self.epochs, int) or isinstance(self.epochs, bool)
                                        or self.epochs < 1):
            raise ConfigError(f"DatasetConfig.epochs must be None (endless) or an integer >= 1, got {self.epochs!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ConfigError(f"DatasetConfig.seed must be an integer >= 0, got {self.seed!r}")


# The length an endless dataset reports: the scheduler's data size is an int64, and no run gets near it.
ENDLESS = 2**62


class PromptDataset:
    """A scheduler DataSource: ``len()`` = epochs x prompts (ENDLESS when epochs is None); ``dataset[position]``
    walks the epochs, each a (seeded) permutation of the prompts when shuffling. ``prompts`` holds the distinct
    prompts in file order."""

    def __init__(self, prompts: list[Prompt], config: DatasetConfig | None = None, *, skipped: int = 0) -> None:
        if not prompts:
            raise InvalidArgumentError("a PromptDataset needs at least one prompt, got none")
        self.prompts = prompts
        self.config = config or DatasetConfig()
        self.skipped = skipped
        self._order_epoch = -1
        self._order = np.arange(len(prompts))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], tokenizer: Any, config: DatasetConfig | None = None, *,
                  fmt: str | None = None) -> PromptDataset:
        """Reads and tokenizes every record of a JSONL / Parquet file."""
        config = config or DatasetConfig()
        path = os.fspath(path)
        name = os.path.basename(path)
        prompts: list[Prompt] = []
        skipped = 0
        for line_no, record in read_records(path, fmt):
            where = f"{path}:{line_no}"
            ids = encode_prompt(tokenizer, lookup(record, config.prompt_key, where=where), where=where)
            if config.max_prompt_len is not None and len(ids) > config.max_prompt_len:
                skipped += 1
                continue
            label = lookup(record, config.label_key, where=where)
            pid = str(lookup(record, config.id_key, where=where)) if config.id_key else f"{name}:{line_no}"
            prompts.append(Prompt(id=pid, token_ids=tuple(ids),
                                  metadata={"label": label, "source": path, "line": line_no}))
        if not prompts:
            raise InvalidArgumentError(f"{path}: no usable prompt (records: {skipped} skipped as longer than "
                                       f"max_prompt_len={config.max_prompt_len})")
        return cls(prompts, config, skipped=skipped)

    def __len__(self) -> int:
        if self.config.epochs is None:
            return ENDLESS
        return len(self.prompts) * self.config.epochs

    def __getitem__(self, position: int) -> Prompt:
        if not 0 <= position < len(self):
            raise IndexError(f"position {position} is outside [0, {len(self)}) ({len(self.prompts)} prompts x "
                             f"{self.config.epochs} epochs)")
        epoch, index = divmod(position, len(self.prompts))
        if self.config.shuffle and epoch != self._order_epoch:
            self._order = np.random.default_rng([self.config.seed, epoch]).permutation(len(self.prompts))
            self._order_epoch = epoch
        return self.prompts[int(self._order[index])]
