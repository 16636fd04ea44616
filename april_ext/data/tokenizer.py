"""Loading a Hugging Face tokenizer from a local directory and turning prompts into token ids."""

from __future__ import annotations

import os
from typing import Any

from april_ext.errors import InvalidArgumentError


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """A transformers tokenizer from a local directory (never the Hub)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise InvalidArgumentError(f"tokenizer path {path!r} is not a directory")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise InvalidArgumentError(f"cannot load a tokenizer from {path!r}: {err}") from None


def encode_prompt(tokenizer: Any, prompt: str | list[dict[str, str]], *, where: str) -> list[int]:
    """Token ids of a text prompt (with the tokenizer's special tokens) or of a chat (a list of
    {"role", "content"} messages, through the tokenizer's chat template with the generation prompt)."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidArgumentError(f"{where}: the prompt is a chat (list of messages) but the tokenizer "
                                       f"has no chat template")
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        # transformers >= 5 may return a BatchEncoding instead of a list.
        if hasattr(ids, "keys") and "input_ids" in ids:
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    raise InvalidArgumentError(f"{where}: a prompt must be a string or a list of {{'role', 'content'}} "
                               f"messages, got {type(prompt).__name__}")
