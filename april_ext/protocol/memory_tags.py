"""The memory tags every engine, the HTTP server and the SGLang client accept (SGLang's names).

"weights" and "kv_cache" are the model's parameters and its KV cache. "cuda_graph" is SGLang's captured
CUDA graphs; an engine that captures none (the embedded and the simulated engine) accepts the tag with
nothing in it: releasing or resuming it changes nothing (it is not reported among the paused tags), so
one release / resume sequence written for SGLang runs unchanged on every engine.
"""

from __future__ import annotations

from collections.abc import Iterable

from april_ext.errors import InvalidArgumentError

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def memory_tags(tags: str | Iterable[str] | None) -> list[str]:
    """The tags a release / resume names, in order without repeats: every tag when None, else the given
    ones (a str is one tag). Raises InvalidArgumentError naming the allowed tags on an unknown one."""
    if tags is None:
        return list(MEMORY_TAGS)
    names = [tags] if isinstance(tags, str) else list(tags)
    bad = [t for t in names if t not in MEMORY_TAGS]
    if bad:
        raise InvalidArgumentError(f"unknown memory tags {bad} (allowed: {list(MEMORY_TAGS)})")
    return list(dict.fromkeys(names))


__all__ = ["MEMORY_TAGS", "memory_tags"]
