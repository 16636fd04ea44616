"""The requests that steer a server's work and memory: /abort_request, /pause_generation and
/continue_generation (as each release line reads them), /release_memory_occupation and
/resume_memory_occupation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from april_ext.errors import InvalidArgumentError
from april_ext.protocol.memory_tags import MEMORY_TAGS, memory_tags
from april_ext.protocol.sglang_dialects import BASE_REQ_FIELDS, CURRENT, SGLangDialect
from april_ext.protocol.sglang_json import (
    base_fields,
    bool_field,
    check_keys,
    check_rid,
    hint_field,
    json_object,
    show,
)


@dataclass(frozen=True)
class AbortRequest:
    rid: str
    abort_all: bool


def parse_abort(body: Any) -> AbortRequest:
    what = "/abort_request"
    body = json_object(body, what)
    # finished_reason and weight_versions are filled in by SGLang's own processes; abort_message only
    # changes the text of the finish reason.
    check_keys(body, ("rid", "abort_all", "abort_message", "finished_reason", "weight_versions", "http_worker_ipc",
                      "abort_reason"), what)
    rid = body.get("rid")
    if rid is None:
        rid = ""
    check_rid(rid, what)
    hint_field(body, "abort_message", "str", what)
    hint_field(body, "http_worker_ipc", "str", what)
    return AbortRequest(rid, bool_field(body, "abort_all", False, what))


def parse_pause(body: Any, dialect: SGLangDialect = CURRENT) -> str:
    """The pause mode. A release without modes reads no body and always aborts."""
    what = "/pause_generation"
    if not dialect.pause_has_modes:
        return "abort"
    body = json_object(body, what)
    check_keys(body, ("mode", *BASE_REQ_FIELDS), what)
    base_fields(body, what)
    mode = body.get("mode")
    if mode is None:
        mode = "abort"
    if mode not in dialect.pause_modes:
        raise InvalidArgumentError(f"{what}: mode must be one of {list(dialect.pause_modes)}, got {show(mode)}")
    return mode


def parse_continue(body: Any, dialect: SGLangDialect = CURRENT) -> None:
    """/continue_generation: torch_empty_cache only frees the allocator cache of a GPU process."""
    what = "/continue_generation"
    if not dialect.pause_has_modes:
        return
    body = json_object(body, what)
    check_keys(body, ("torch_empty_cache", *BASE_REQ_FIELDS), what)
    base_fields(body, what)
    bool_field(body, "torch_empty_cache", True, what)


def parse_memory_tags(body: Any, what: str) -> list[str] | None:
    """SGLang memory tags -> engine tags (None = all). "cuda_graph" is accepted: the embedded engine
    captures no graphs, so it has nothing to release for it."""
    body = json_object(body, what)
    check_keys(body, ("tags", *BASE_REQ_FIELDS), what)
    base_fields(body, what)
    tags = body.get("tags")
    if tags is None:
        return None
    if isinstance(tags, str) or not isinstance(tags, list):
        raise InvalidArgumentError(f"{what}: tags must be null or a list of {list(MEMORY_TAGS)}, got {tags!r}")
    try:
        names = memory_tags(tags)
    except InvalidArgumentError as err:
        raise InvalidArgumentError(f"{what}: {err}") from None
    return [t for t in names if t != "cuda_graph"]


__all__ = [
    "AbortRequest",
    "parse_abort",
    "parse_continue",
    "parse_memory_tags",
    "parse_pause",
]
