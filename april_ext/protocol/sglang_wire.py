"""The SGLang HTTP contract, as plain functions: request bodies in, validated values out, and the
JSON shapes the server answers with (finish reasons, meta_info, logprob triples).

Nothing here touches the network or the engine, so every rule is unit-testable.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from safetensors.torch import load as _load_safetensors
from safetensors.torch import save as _save_safetensors

from april_ext.batch import FinishReason
from april_ext.errors import InvalidArgumentError
from april_ext.protocol.memory_tags import MEMORY_TAGS
from april_ext.protocol.sampling_params import MAX_SEED, SamplingParams

# SGLang sampling fields the embedded engine maps onto SamplingParams (SGLang name -> our name).
_MAPPED = {"max_new_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p",
           "top_k": "top_k", "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
           "sampling_seed": "seed"}
# Text-only booleans: a token-only server has no text to trim or detokenize, so either value is harmless.
_TEXT_ONLY = ("no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens")
# SGLang fields the engine does not implement: accepted only at the value that disables them (of that
# JSON type: false is not 0 and 1.0 is not 1).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "min_new_tokens": (0, None), "frequency_penalty": (0, 0.0, None), "presence_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None), "min_p": (0, 0.0, None), "n": (1, None), "stop": (None, [], ""),
    "regex": (None,), "json_schema": (None,), "ebnf": (None,), "structural_tag": (None,),
    "logit_bias": (None, {}), "custom_params": (None,),
}

PAUSE_MODES = ("abort", "retract", "in_place")
ABORT_MESSAGE = "Aborted"
ABORT_QUEUED_MESSAGE = "Abort in waiting queue"
# SGLang bodies nest a few levels; a deeper one is refused before any field is read.
MAX_JSON_DEPTH = 32
MAX_RID_LENGTH = 256


@dataclass(frozen=True)
class GenerateRequest:
    """One validated /generate request."""

    rid: str | None
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    stream: bool


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


def _show(value: Any) -> str:
    """A value as JSON for a message, cut short: messages must not echo a large body back."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= 80 else text[:77] + "..."


def _object(body: Any, what: str) -> Mapping[str, Any]:
    if body is None:
        return {}
    if not isinstance(body, Mapping):
        raise InvalidArgumentError(f"{what}: the JSON body must be an object, got {type(body).__name__}")
    return body


def _check_keys(body: Mapping[str, Any], allowed: tuple[str, ...], what: str) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise InvalidArgumentError(f"{what}: unknown fields {unknown} (allowed: {sorted(allowed)})")


def _bool(body: Mapping[str, Any], key: str, default: bool, what: str) -> bool:
    """A JSON boolean (null: the default). Strings and numbers are refused: "false" is not false."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{what}: {key} must be true or false (a JSON boolean) or null, "
                                   f"got {_show(value)}")
    return value


def _int(body: Mapping[str, Any], key: str, what: str) -> int | None:
    """A JSON integer (null: None). Booleans, floats and strings are refused."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{what}: {key} must be an integer or null, got {_show(value)}")
    return value


def _number(body: Mapping[str, Any], key: str, what: str) -> float | int | None:
    """A finite JSON number (null: None). Booleans and strings are refused."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgumentError(f"{what}: {key} must be a finite number or null, got {_show(value)}")
    return value


def _neutral(value: Any, allowed: tuple[Any, ...]) -> bool:
    """Whether value is one of allowed as the same JSON value: false is not 0, 1.0 is not 1."""
    return any(type(value) is type(a) and value == a for a in allowed)


def _opt_str(body: Mapping[str, Any], key: str, what: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InvalidArgumentError(f"{what}: {key} must be a string, got {value!r}")
    return str(value)


# Generate fields of features the engine lacks: accepted only at the value that disables them.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {"top_logprobs_num": (None, 0), "return_hidden_states": (None, False),
                                            "lora_path": (None,), "custom_logit_processor": (None,)}
_GENERATE_KEYS = ("rid", "input_ids", "text", "sampling_params", "return_logprob", "stream", "logprob_start_len",
                  "top_logprobs_num", "return_text_in_logprobs", "return_hidden_states", "lora_path",
                  "custom_logit_processor", "bootstrap_host", "bootstrap_port", "bootstrap_room")


def parse_generate(body: Any) -> GenerateRequest:
    """Validates a /generate body (SGLang's GenerateReqInput, single request, token ids only)."""
    what = "/generate"
    body = _object(body, what)
    _check_keys(body, _GENERATE_KEYS, what)
    if body.get("text") is not None:
        raise InvalidArgumentError(f"{what}: this server is token-only (no tokenizer, like SGLang's "
                                   "--skip-tokenizer-init): send input_ids instead of text")
    ids = body.get("input_ids")
    if ids is None:
        raise InvalidArgumentError(f"{what}: input_ids is required (a list of token ids)")
    if not isinstance(ids, list):
        raise InvalidArgumentError(f"{what}: input_ids must be a list of token ids, got {type(ids).__name__}")
    if ids and isinstance(ids[0], list):
        raise InvalidArgumentError(f"{what}: batched requests (a list of input_ids lists) are not supported "
                                   "by the embedded server: send one request per call")
    rid = body.get("rid")
    if isinstance(rid, list):
        raise InvalidArgumentError(f"{what}: a list of rids is SGLang's batch form; the embedded server takes one "
                                   "request per call: send rid as a string")
    if rid is not None:
        _check_rid(rid, what)
        if not rid:
            raise InvalidArgumentError(f"{what}: rid must be a non-empty string or null, got \"\"")
    for key, allowed in _UNSUPPORTED.items():
        if key in body and not _neutral(body[key], allowed):
            raise InvalidArgumentError(f"{what}: {key} is not supported by the embedded server (allowed: "
                                       f"{' or '.join(_show(a) for a in allowed)}), got {_show(body[key])}")
    # Accepted and unused (no prompt logprobs, no text, no prefill-decode disaggregation), but typed.
    _bool(body, "return_text_in_logprobs", True, what)
    for key in ("logprob_start_len", "bootstrap_port", "bootstrap_room"):
        _int(body, key, what)
    if not isinstance(body.get("bootstrap_host", ""), (str, type(None))):
        raise InvalidArgumentError(f"{what}: bootstrap_host must be a string or null, "
                                   f"got {_show(body['bootstrap_host'])}")
    return GenerateRequest(rid=rid, input_ids=ids, params=parse_sampling_params(body.get("sampling_params")),
                           return_logprob=_bool(body, "return_logprob", False, what),
                           stream=_bool(body, "stream", False, what))


def parse_sampling_params(raw: Any) -> SamplingParams:
    """SGLang sampling_params -> SamplingParams. Unknown fields and enabled unsupported features are errors."""
    what = "/generate sampling_params"
    raw = _object(raw, what)
    _check_keys(raw, tuple(_MAPPED) + _TEXT_ONLY + tuple(_NEUTRAL), what)
    for key, neutral in _NEUTRAL.items():
        if key in raw and not _neutral(raw[key], neutral):
            raise InvalidArgumentError(f"{what}: {key}={_show(raw[key])} is not supported by the embedded engine "
                                       f"(allowed: {' or '.join(_show(n) for n in neutral)})")
    for key in _TEXT_ONLY:
        _bool(raw, key, False, what)
    values = {"max_new_tokens": _int(raw, "max_new_tokens", what), "temperature": _number(raw, "temperature", what),
              "top_p": _number(raw, "top_p", what), "top_k": _int(raw, "top_k", what),
              "sampling_seed": _int(raw, "sampling_seed", what), "ignore_eos": _bool(raw, "ignore_eos", False, what)}
    if values["sampling_seed"] is not None and not 0 <= values["sampling_seed"] <= MAX_SEED:
        raise InvalidArgumentError(f"{what}: sampling_seed must be an integer in [0, 2**64 - 1] (a 64-bit seed), "
                                   f"got {values['sampling_seed']}")
    stop = raw.get("stop_token_ids")
    if stop is not None:
        if not isinstance(stop, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in stop):
            raise InvalidArgumentError(f"{what}: stop_token_ids must be a list of integer token ids, "
                                       f"got {_show(stop)}")
        values["stop_token_ids"] = tuple(stop)
    kwargs = {_MAPPED[key]: value for key, value in values.items() if value is not None}
    try:
        return SamplingParams(**kwargs)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{what}: {exc}") from exc


@dataclass(frozen=True)
class AbortRequest:
    rid: str
    abort_all: bool


def parse_abort(body: Any) -> AbortRequest:
    what = "/abort_request"
    body = _object(body, what)
    _check_keys(body, ("rid", "abort_all", "abort_message"), what)
    rid = body.get("rid")
    if rid is None:
        rid = ""
    _check_rid(rid, what)
    return AbortRequest(rid, _bool(body, "abort_all", False, what))


def _check_rid(rid: Any, what: str) -> None:
    if not isinstance(rid, str):
        raise InvalidArgumentError(f"{what}: rid must be a string or null, got {_show(rid)}")
    if len(rid) > MAX_RID_LENGTH:
        raise InvalidArgumentError(f"{what}: rid must have at most {MAX_RID_LENGTH} characters, got {len(rid)}")


def parse_pause(body: Any) -> str:
    """Returns the pause mode. The embedded engine cannot hold a running batch, so only "abort"."""
    what = "/pause_generation"
    body = _object(body, what)
    _check_keys(body, ("mode", "torch_empty_cache"), what)
    _bool(body, "torch_empty_cache", False, what)
    mode = body.get("mode")
    if mode is None:
        mode = "abort"
    if mode not in PAUSE_MODES:
        raise InvalidArgumentError(f"{what}: mode must be one of {list(PAUSE_MODES)}, got {_show(mode)}")
    if mode != "abort":
        raise InvalidArgumentError(f"{what}: mode {mode!r} is not supported by the embedded engine (it cannot "
                                   "hold a running batch in place): use mode 'abort'")
    return mode


def parse_memory_tags(body: Any, what: str) -> list[str] | None:
    """SGLang memory tags -> engine tags (None = all). "cuda_graph" is accepted: the embedded engine
    captures no graphs, so it has nothing to release for it."""
    body = _object(body, what)
    _check_keys(body, ("tags",), what)
    tags = body.get("tags")
    if tags is None:
        return None
    if isinstance(tags, str) or not isinstance(tags, list):
        raise InvalidArgumentError(f"{what}: tags must be null or a list of {list(MEMORY_TAGS)}, got {tags!r}")
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise InvalidArgumentError(f"{what}: unknown memory tags {bad} (allowed: {list(MEMORY_TAGS)})")
    return [t for t in dict.fromkeys(tags) if t != "cuda_graph"]


@dataclass(frozen=True)
class WeightsFromDisk:
    model_path: str
    weight_version: str | None
    abort_all_requests: bool


def parse_weights_from_disk(body: Any) -> WeightsFromDisk:
    """flush_cache (and SGLang's scheduling hints) are accepted; the engine always drops its KV cache
    on a weight update, so requests in flight are recomputed under the new weights."""
    what = "/update_weights_from_disk"
    body = _object(body, what)
    _check_keys(body, ("model_path", "load_format", "abort_all_requests", "weight_version", "flush_cache",
                       "is_async", "torch_empty_cache", "keep_pause", "token_step"), what)
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise InvalidArgumentError(f"{what}: model_path must be a checkpoint directory path, got {_show(path)}")
    if body.get("load_format") not in (None, "auto", "safetensors"):
        raise InvalidArgumentError(f"{what}: load_format must be null, 'auto' or 'safetensors', "
                                   f"got {_show(body['load_format'])}")
    for key in ("flush_cache", "is_async", "torch_empty_cache", "keep_pause"):
        _bool(body, key, False, what)
    _int(body, "token_step", what)
    return WeightsFromDisk(path, _opt_str(body, "weight_version", what),
                           _bool(body, "abort_all_requests", False, what))


@dataclass(frozen=True)
class WeightsFromTensor:
    serialized: list[str]
    weight_version: str | None
    abort_all_requests: bool


def parse_weights_from_tensor(body: Any) -> WeightsFromTensor:
    what = "/update_weights_from_tensor"
    body = _object(body, what)
    _check_keys(body, ("serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
                       "weight_version"), what)
    blobs = body.get("serialized_named_tensors")
    if not isinstance(blobs, list) or not blobs or not all(isinstance(b, str) for b in blobs):
        raise InvalidArgumentError(f"{what}: serialized_named_tensors must be a non-empty list of base64 strings "
                                   "(one per TP rank)")
    if body.get("load_format") not in (None, "safetensors"):
        raise InvalidArgumentError(f"{what}: load_format must be null or 'safetensors' (base64 of a safetensors "
                                   f"blob); SGLang's own serializer formats are not readable here, got "
                                   f"{_show(body['load_format'])}")
    _bool(body, "flush_cache", True, what)
    return WeightsFromTensor(blobs, _opt_str(body, "weight_version", what),
                             _bool(body, "abort_all_requests", False, what))


def parse_weight_version(body: Any) -> tuple[str, bool]:
    what = "/update_weight_version"
    body = _object(body, what)
    _check_keys(body, ("new_version", "abort_all_requests"), what)
    version = _opt_str(body, "new_version", what)
    if version is None:
        raise InvalidArgumentError(f"{what}: new_version is required")
    return version, _bool(body, "abort_all_requests", True, what)


# Responses --------------------------------------------------------------------------------------------

def finish_reason_json(reason: FinishReason | None, matched: int | None, max_new_tokens: int,
                       num_tokens: int) -> dict[str, Any] | None:
    """SGLang's finish_reason object; an abort before any token reads as one from the waiting queue."""
    if reason is None:
        return None
    if reason is FinishReason.STOP:
        return {"type": "stop", "matched": matched}
    if reason is FinishReason.LENGTH:
        return {"type": "length", "length": max_new_tokens}
    message = ABORT_MESSAGE if num_tokens else ABORT_QUEUED_MESSAGE
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def error_json(message: str) -> dict[str, Any]:
    return {"error": {"message": message}}


def encode_named_tensors(tensors: Mapping[str, Any]) -> str:
    """Named tensors -> base64 of a safetensors blob (what /update_weights_from_tensor accepts here)."""
    blob = _save_safetensors({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
    return base64.b64encode(blob).decode("ascii")


def decode_named_tensors(blob: str) -> dict[str, Any]:
    try:
        return _load_safetensors(base64.b64decode(blob, validate=True))
    except Exception as exc:  # any parser failure means the client sent a malformed blob
        raise InvalidArgumentError("/update_weights_from_tensor: serialized_named_tensors[0] is not base64 of a "
                                   f"safetensors blob ({exc})") from exc
