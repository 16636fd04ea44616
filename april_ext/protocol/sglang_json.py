"""The JSON of SGLang request bodies, field by field: the strict parse of a body (parse_json), typed readers of its
fields that refuse what SGLang's request classes would not take ("false" is not false), and the error answer.
Every endpoint's parser (sglang_generate, sglang_control, sglang_weights) reads its body with these.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from april_ext.errors import InvalidArgumentError
from april_ext.protocol.sglang_dialects import BASE_REQ_FIELDS

# SGLang bodies nest a few levels; a deeper one is refused before any field is read.
MAX_JSON_DEPTH = 32
MAX_RID_LENGTH = 256


def parse_json(data: bytes, what: str) -> Any:
    """A request body -> its JSON value (None for an empty body). Strict JSON: no NaN / Infinity, and at
    most MAX_JSON_DEPTH nested arrays and objects."""
    if not data.strip():
        return None
    try:
        value = json.loads(data, parse_constant=_no_constant)
        too_deep = _depth_exceeds(value, MAX_JSON_DEPTH)
    except RecursionError:  # the parser ran out of stack: far deeper than the limit
        too_deep = True
    except ValueError as exc:
        raise InvalidArgumentError(f"{what}: the body is not valid JSON ({exc})") from exc
    if too_deep:
        raise InvalidArgumentError(f"{what}: the JSON body is nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether arrays / objects nest more than `limit` levels (iterative: no recursion on hostile input)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def show(value: Any) -> str:
    """A value as JSON for a message, cut short: messages must not echo a large body back."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= 80 else text[:77] + "..."


def json_object(body: Any, what: str) -> Mapping[str, Any]:
    if body is None:
        return {}
    if not isinstance(body, Mapping):
        raise InvalidArgumentError(f"{what}: the JSON body must be an object, got {type(body).__name__}")
    return body


def check_keys(body: Mapping[str, Any], allowed: tuple[str, ...], what: str) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise InvalidArgumentError(f"{what}: unknown fields {unknown} (allowed: {sorted(allowed)})")


def bool_field(body: Mapping[str, Any], key: str, default: bool, what: str) -> bool:
    """A JSON boolean (null: the default). Strings and numbers are refused: "false" is not false."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{what}: {key} must be true or false (a JSON boolean) or null, "
                                   f"got {show(value)}")
    return value


def int_field(body: Mapping[str, Any], key: str, what: str) -> int | None:
    """A JSON integer (null: None). Booleans, floats and strings are refused."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{what}: {key} must be an integer or null, got {show(value)}")
    return value


def number_field(body: Mapping[str, Any], key: str, what: str) -> float | int | None:
    """A finite JSON number (null: None). Booleans and strings are refused."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgumentError(f"{what}: {key} must be a finite number or null, got {show(value)}")
    return value


def is_neutral(value: Any, allowed: tuple[Any, ...]) -> bool:
    """Whether value is one of allowed as the same JSON value: false is not 0, 1.0 is not 1."""
    return any(type(value) is type(a) and value == a for a in allowed)


def str_field(body: Mapping[str, Any], key: str, what: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InvalidArgumentError(f"{what}: {key} must be a string, got {value!r}")
    return str(value)


_KINDS: dict[str, tuple[type, ...]] = {"bool": (bool,), "int": (int,), "number": (int, float), "str": (str,),
                                       "object": (dict,)}


def hint_field(body: Mapping[str, Any], key: str, kind: str, what: str) -> None:
    """Checks the JSON type of a field whose value is not used."""
    checks = {"bool": lambda: bool_field(body, key, False, what), "int": lambda: int_field(body, key, what),
              "number": lambda: number_field(body, key, what)}
    if kind in checks:
        checks[kind]()
        return
    value = body.get(key)
    if value is None or kind == "any":
        return
    types = _KINDS[kind]
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise InvalidArgumentError(f"{what}: {key} must be a JSON {'string' if kind == 'str' else kind} or null, "
                                   f"got {show(value)}")


def check_rid(rid: Any, what: str) -> None:
    """A request id: a string of at most MAX_RID_LENGTH characters."""
    if not isinstance(rid, str):
        raise InvalidArgumentError(f"{what}: rid must be a string or null, got {show(rid)}")
    if len(rid) > MAX_RID_LENGTH:
        raise InvalidArgumentError(f"{what}: rid must have at most {MAX_RID_LENGTH} characters, got {len(rid)}")


def base_fields(body: Mapping[str, Any], what: str) -> None:
    """BASE_REQ_FIELDS, typed: what they hold changes nothing here."""
    for key in BASE_REQ_FIELDS:
        hint_field(body, key, "str", what)


def error_json(message: str) -> dict[str, Any]:
    return {"error": {"message": message}}


__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_RID_LENGTH",
    "base_fields",
    "bool_field",
    "check_keys",
    "check_rid",
    "error_json",
    "hint_field",
    "int_field",
    "is_neutral",
    "json_object",
    "number_field",
    "parse_json",
    "show",
    "str_field",
]
