"""The SGLang HTTP contract, as plain functions: request bodies in, validated values out, and the
JSON shapes the server answers with (finish reasons, meta_info, logprob triples).

Nothing here touches the network or the engine, so every rule is unit-testable.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from safetensors.torch import load as _load_safetensors
from safetensors.torch import save as _save_safetensors

from april_ext.batch import FinishReason
from april_ext.errors import InvalidArgumentError
from april_ext.protocol.memory_tags import MEMORY_TAGS, memory_tags
from april_ext.protocol.sampling_params import MAX_SEED, SamplingParams

# SGLang sampling fields the embedded engine maps onto SamplingParams (SGLang name -> our name).
_MAPPED = {"max_new_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p",
           "top_k": "top_k", "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
           "sampling_seed": "seed"}
# Detokenizer switches: either value is honoured (they only shape the text of a server with a tokenizer).
_TEXT_ONLY = ("no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens")
# SGLang sampling fields the engine does not implement: accepted only at the value that disables them
# (SGLang's default, of that JSON type: false is not 0 and 1.0 is not 1). The last six are fields SGLang
# fills in itself (normalize()), listed so that a body copied from its logs is still read.
SAMPLING_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "min_new_tokens": (0, None), "frequency_penalty": (0, 0.0, None), "presence_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None), "min_p": (0, 0.0, None), "n": (1, None), "stop": (None, [], ""),
    "stop_regex": (None, [], ""), "beam_width": (None, 1), "regex": (None,), "json_schema": (None,),
    "ebnf": (None,), "structural_tag": (None,), "logit_bias": (None, {}), "custom_params": (None,),
    "watermark": (None,), "stop_strs": (None, [], ""), "stop_regex_strs": (None, [], ""),
    "stop_str_max_len": (0, None), "stop_regex_max_len": (0, None), "is_normalized": (False, None),
    "ebnf_full_assistant": (False, None),
}
# Honoured per request: events of a streamed request every this many tokens (the server's by default).
_SAMPLING_EXTRA = ("stream_interval",)

PAUSE_MODES = ("abort", "retract", "in_place")

# The SGLang release whose request classes this module follows: the one place it is pinned. .ci/run installs
# its wheel and tests/test_sglang_contract.py checks this module and the adapter against that wheel's source.
SGLANG_RELEASE = "0.5.23"


@dataclass(frozen=True)
class SGLangDialect:
    """What one line of SGLang releases serves, as far as an RL client needs it (read from each release's
    http_server.py and io_struct.py). The adapter picks the row of the newest release not newer than a
    server's version; the embedded server can mimic each row (ServerConfig.sglang_compat) so that the
    adapter's adaptation is tested over real HTTP.

    server_info / model_info: the GET paths, preferred first. get_weight_version: GET /get_weight_version
    exists (deprecated, then removed). weight_versions: weights carry a version label (in /generate's
    meta_info, /model_info or /get_weight_version, and the weight_version field of the updates).
    pause_modes: the modes /pause_generation takes (an older server reads no body and always aborts).
    disk_fields / tensor_fields: the fields of update_weights_from_disk / _from_tensor. load_path: the GET
    path of the server's load report (KV tokens in use and queued; load_tokens reads each release's answer)."""

    name: str
    version: str
    server_info: tuple[str, ...]
    model_info: tuple[str, ...]
    get_weight_version: bool
    weight_versions: bool
    pause_modes: tuple[str, ...]
    disk_fields: tuple[str, ...]
    tensor_fields: tuple[str, ...]
    load_path: str

    @property
    def version_tuple(self) -> tuple[int, ...]:
        return version_tuple(self.version)

    @property
    def pause_has_modes(self) -> bool:
        """Whether /pause_generation reads a body with a mode (older releases read none and abort)."""
        return self.pause_modes != ("abort",)


_DISK_04 = ("model_path", "load_format", "abort_all_requests")
_TENSOR_04 = ("serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests")
_DISK_053 = (*_DISK_04, "weight_version", "is_async", "torch_empty_cache", "keep_pause")
_TENSOR_053 = (*_TENSOR_04, "weight_version")
DIALECTS: dict[str, SGLangDialect] = {d.name: d for d in (
    SGLangDialect("0.4", "0.4.10.post2", ("/get_server_info",), ("/get_model_info",), False, False, ("abort",),
                  _DISK_04, _TENSOR_04, "/get_load"),
    SGLangDialect("0.5.3", "0.5.3", ("/get_server_info",), ("/get_model_info",), True, True, ("abort",),
                  _DISK_053, _TENSOR_053, "/get_load"),
    SGLangDialect("current", SGLANG_RELEASE, ("/server_info", "/get_server_info"), ("/model_info", "/get_model_info"),
                  False, True, PAUSE_MODES,
                  (*_DISK_053, "recapture_cuda_graph", "token_step", "flush_cache", "manifest"),
                  (*_TENSOR_053, "selector", "torch_empty_cache"), "/v1/loads"),
)}
CURRENT = DIALECTS["current"]
# Fields every request class of the current release inherits (BaseReq): an id for its logs and the IPC
# address of the HTTP worker. Neither changes what the call does.
BASE_REQ_FIELDS = ("rid", "http_worker_ipc")


def version_tuple(version: str) -> tuple[int, ...]:
    """"0.4.10.post2" -> (0, 4, 10): the numeric release, suffixes dropped."""
    numbers = []
    for part in str(version).split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        numbers.append(int(digits))
        if len(digits) < len(part):
            break
    return tuple(numbers)


def dialect_for(version: str | None) -> SGLangDialect:
    """The row of the newest documented release not newer than `version` (the oldest row below them all;
    no version at all: the current release, which is what a server without one is taken to be)."""
    if version is None or not version_tuple(version):
        return CURRENT
    wanted = version_tuple(version)
    rows = sorted(DIALECTS.values(), key=lambda d: d.version_tuple)
    chosen = rows[0]
    for row in rows:
        if row.version_tuple <= wanted:
            chosen = row
    return chosen
def load_tokens(answer: Any) -> int | None:
    """The KV tokens a server reports in use or waiting for prefill, summed over its data-parallel ranks, from
    any release's load report: /v1/loads (0.5.23: {"loads": [{"num_total_tokens", "num_used_tokens", ...}]}),
    /get_load (0.5.x: [{"num_tokens", ...}], 0.4: {"load": N}). None for an answer of none of these shapes."""
    if isinstance(answer, dict) and isinstance(answer.get("loads"), list):
        ranks, keys = answer["loads"], ("num_total_tokens", "num_used_tokens")
    elif isinstance(answer, list):
        ranks, keys = answer, ("num_tokens",)
    elif isinstance(answer, dict) and "load" in answer:
        ranks, keys = [answer], ("load",)
    else:
        return None
    total = 0
    for rank in ranks:
        value = next((rank[k] for k in keys if isinstance(rank, dict) and k in rank), None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return None
        total += value
    return total


def load_json(dialect: SGLangDialect, *, used_tokens: int, waiting_tokens: int, running: int, waiting: int,
              capacity_tokens: int, max_running: int) -> Any:
    """The load report of one engine (one data-parallel rank) in the shape of the dialect's release."""
    total = used_tokens + waiting_tokens
    if dialect.version_tuple < (0, 5):
        return {"load": total}
    if dialect.load_path == "/get_load":
        return [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting, "num_tokens": total}]
    return {"version": dialect.version, "loads": [{
        "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting, "num_used_tokens": used_tokens,
        "num_total_tokens": total, "max_total_num_tokens": capacity_tokens, "max_running_requests": max_running,
        "token_usage": used_tokens / capacity_tokens if capacity_tokens else 0.0}]}


ABORT_MESSAGE = "Aborted"
ABORT_QUEUED_MESSAGE = "Abort in waiting queue"
# SGLang bodies nest a few levels; a deeper one is refused before any field is read.
MAX_JSON_DEPTH = 32
MAX_RID_LENGTH = 256


@dataclass(frozen=True)
class GenerateRequest:
    """One validated /generate request."""

    rid: str | None
    input_ids: list[int] | None
    params: SamplingParams
    return_logprob: bool
    stream: bool
    text: str | None = None
    stream_interval: int | None = None
    skip_special_tokens: bool = True


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


def _update_options(body: Mapping[str, Any], what: str) -> None:
    """The fields a tensor or distributed weight update shares: checked, with nothing to do here."""
    # The embedded engine has one model: "target" or "all" of it; "draft" names a speculative model it lacks.
    if body.get("selector") not in (None, "all", "target"):
        raise InvalidArgumentError(f"{what}: selector must be null, 'all' or 'target' (no draft model here), "
                                   f"got {_show(body['selector'])}")
    _bool(body, "flush_cache", True, what)
    _bool(body, "torch_empty_cache", False, what)


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


# GenerateReqInput (SGLang SGLANG_RELEASE), field by field. Honoured: what parse_generate reads (priority: the
# engine's waiting queue admits higher values first, as SGLang under --enable-priority-scheduling).
_GENERATE_HONOURED = ("rid", "text", "input_ids", "sampling_params", "return_logprob", "stream", "priority")
# Hints for SGLang's logging, tracing, routing and prefill-decode disaggregation: a value
# of the right JSON type changes nothing a single embedded engine does. Kind: "bool", "int", "number", "str",
# "object" (a JSON object) or "any".
_GENERATE_HINTS: dict[str, str] = {
    "log_metrics": "bool", "no_logs": "bool", "return_text_in_logprobs": "bool", "logprob_start_len": "int",
    "custom_labels": "object", "external_trace_header": "object", "received_time": "number",
    "routing_key": "str", "conversation_id": "str", "extra_key": "any", "cache_salt": "any",
    "http_worker_ipc": "str", "bootstrap_host": "str", "bootstrap_port": "int", "bootstrap_room": "int",
    "bootstrap_pair_key": "str", "decode_tp_size": "int", "routed_dp_rank": "int", "data_parallel_rank": "int",
    "disagg_prefill_dp_rank": "int", "kv_hints": "any",
}
# Not a GenerateReqInput field: sglang-router adds the model name it routed by to every /generate body it
# forwards (SGLang ignores fields it does not define; this server refuses unknown ones, so names it).
ROUTER_FIELDS: dict[str, str] = {"model": "any"}
# Features the engine lacks (multimodal input, embeddings, sessions, LoRA, hidden states, top / per-token
# logprobs of other tokens, ...): only SGLang's default, the value that leaves them off.
GENERATE_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "session_id": (None,), "input_embeds": (None,), "image_data": (None,), "video_data": (None,),
    "audio_data": (None,), "mm_hashes": (None,), "mm_content_hashes": (None,), "use_audio_in_video": (False, None),
    "video_config": (None,), "watermark": (None,), "top_logprobs_num": (None, 0), "token_ids_logprob": (None,),
    "return_sampling_mask": (None, False), "sampling_logprobs_mode": (None,),
    "return_flat_raw_top_logprobs": (False, None), "return_flat_raw_output_top_logprobs": (False, None),
    "return_flat_raw_top_logprobs_b64": (False, None), "return_hidden_states": (False, None),
    "return_routed_experts": (False, None), "routed_experts_start_len": (0, None),
    "return_indexer_topk": (False, None), "modalities": (None,), "session_params": (None,), "lora_path": (None,),
    "lora_id": (None,), "custom_logit_processor": (None,), "positional_embed_overrides": (None,),
    "background": (False, None), "require_reasoning": (False, None), "max_thinking_tokens": (None,),
    "return_bytes": (False, None), "return_entropy": (False, None), "return_prompt_token_ids": (False, None),
    "need_wait_for_mm_inputs": (None,), "num_items_assigned": (None,), "encoder_urls": (None,),
    "max_dynamic_patch": (None,), "min_dynamic_patch": (None,), "image_max_dynamic_patch": (None,),
    "video_max_dynamic_patch": (None,), "images_config": (None,), "mm_processor_kwargs": (None,),
    "multi_item_delimiter_indices": (None,), "token_indices_to_pool": (None,),
}
GENERATE_FIELDS = (*_GENERATE_HONOURED, *_GENERATE_HINTS, *GENERATE_NEUTRAL, *ROUTER_FIELDS)
SAMPLING_FIELDS = (*_MAPPED, *_TEXT_ONLY, *_SAMPLING_EXTRA, *SAMPLING_NEUTRAL)
_KINDS: dict[str, tuple[type, ...]] = {"bool": (bool,), "int": (int,), "number": (int, float), "str": (str,),
                                       "object": (dict,)}


def _hint(body: Mapping[str, Any], key: str, kind: str, what: str) -> None:
    """Checks the JSON type of a field whose value is not used."""
    checks = {"bool": lambda: _bool(body, key, False, what), "int": lambda: _int(body, key, what),
              "number": lambda: _number(body, key, what)}
    if kind in checks:
        checks[kind]()
        return
    value = body.get(key)
    if value is None or kind == "any":
        return
    types = _KINDS[kind]
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise InvalidArgumentError(f"{what}: {key} must be a JSON {'string' if kind == 'str' else kind} or null, "
                                   f"got {_show(value)}")


def parse_generate(body: Any) -> GenerateRequest:
    """Validates a /generate body (SGLang's GenerateReqInput, one request): input_ids, or text for a
    server with a tokenizer (the caller turns it into ids)."""
    what = "/generate"
    body = _object(body, what)
    _check_keys(body, GENERATE_FIELDS, what)
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None and ids is not None:
        raise InvalidArgumentError(f"{what}: send either text or input_ids, not both")
    if isinstance(text, list):
        raise InvalidArgumentError(f"{what}: batched requests (a list of texts) are not supported by the embedded "
                                   "server: send one request per call")
    if text is not None and not isinstance(text, str):
        raise InvalidArgumentError(f"{what}: text must be a string, got {_show(text)}")
    if text is None:
        if ids is None:
            raise InvalidArgumentError(f"{what}: input_ids is required (a list of token ids), or text on a server "
                                       "started with a tokenizer")
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
    for key, allowed in GENERATE_NEUTRAL.items():
        if key in body and not _neutral(body[key], allowed):
            raise InvalidArgumentError(f"{what}: {key} is not supported by the embedded server (allowed: "
                                       f"{' or '.join(_show(a) for a in allowed)}), got {_show(body[key])}")
    for key, kind in _GENERATE_HINTS.items():
        _hint(body, key, kind, what)
    raw = _object(body.get("sampling_params"), f"{what} sampling_params")
    interval = _int(raw, "stream_interval", f"{what} sampling_params")
    if interval is not None and interval < 1:
        raise InvalidArgumentError(f"{what} sampling_params: stream_interval must be an integer >= 1 or null, "
                                   f"got {interval}")
    params = parse_sampling_params(raw)
    priority = _int(body, "priority", what)
    if priority is not None:
        if not -2**63 <= priority < 2**63:
            raise InvalidArgumentError(f"{what}: priority must be a signed 64-bit integer or null, got {priority}")
        params = replace(params, priority=priority)
    return GenerateRequest(rid=rid, input_ids=ids, params=params,
                           return_logprob=_bool(body, "return_logprob", False, what),
                           stream=_bool(body, "stream", False, what), text=text, stream_interval=interval,
                           skip_special_tokens=_bool(raw, "skip_special_tokens", True, f"{what} sampling_params"))


def parse_sampling_params(raw: Any) -> SamplingParams:
    """SGLang sampling_params -> SamplingParams. Unknown fields and enabled unsupported features are errors;
    top_k 0 is refused as SGLang refuses it (-1 disables the filter)."""
    what = "/generate sampling_params"
    raw = _object(raw, what)
    _check_keys(raw, SAMPLING_FIELDS, what)
    for key, neutral in SAMPLING_NEUTRAL.items():
        if key in raw and not _neutral(raw[key], neutral):
            raise InvalidArgumentError(f"{what}: {key}={_show(raw[key])} is not supported by the embedded engine "
                                       f"(allowed: {' or '.join(_show(n) for n in neutral)})")
    for key in _TEXT_ONLY:
        _bool(raw, key, False, what)
    values = {"max_new_tokens": _int(raw, "max_new_tokens", what), "temperature": _number(raw, "temperature", what),
              "top_p": _number(raw, "top_p", what), "top_k": _int(raw, "top_k", what),
              "sampling_seed": _int(raw, "sampling_seed", what), "ignore_eos": _bool(raw, "ignore_eos", False, what)}
    if values["top_k"] is not None and (values["top_k"] == 0 or values["top_k"] < -1):
        raise InvalidArgumentError(f"{what}: top_k must be -1 (disable) or at least 1, as in SGLang, "
                                   f"got {values['top_k']}")
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
    # finished_reason and weight_versions are filled in by SGLang's own processes; abort_message only
    # changes the text of the finish reason.
    _check_keys(body, ("rid", "abort_all", "abort_message", "finished_reason", "weight_versions", "http_worker_ipc",
                       "abort_reason"), what)
    rid = body.get("rid")
    if rid is None:
        rid = ""
    _check_rid(rid, what)
    _hint(body, "abort_message", "str", what)
    _hint(body, "http_worker_ipc", "str", what)
    return AbortRequest(rid, _bool(body, "abort_all", False, what))


def _check_rid(rid: Any, what: str) -> None:
    if not isinstance(rid, str):
        raise InvalidArgumentError(f"{what}: rid must be a string or null, got {_show(rid)}")
    if len(rid) > MAX_RID_LENGTH:
        raise InvalidArgumentError(f"{what}: rid must have at most {MAX_RID_LENGTH} characters, got {len(rid)}")


def parse_pause(body: Any, dialect: SGLangDialect = CURRENT) -> str:
    """The pause mode. A release without modes reads no body and always aborts."""
    what = "/pause_generation"
    if not dialect.pause_has_modes:
        return "abort"
    body = _object(body, what)
    _check_keys(body, ("mode", *BASE_REQ_FIELDS), what)
    _base_fields(body, what)
    mode = body.get("mode")
    if mode is None:
        mode = "abort"
    if mode not in dialect.pause_modes:
        raise InvalidArgumentError(f"{what}: mode must be one of {list(dialect.pause_modes)}, got {_show(mode)}")
    return mode


def parse_continue(body: Any, dialect: SGLangDialect = CURRENT) -> None:
    """/continue_generation: torch_empty_cache only frees the allocator cache of a GPU process."""
    what = "/continue_generation"
    if not dialect.pause_has_modes:
        return
    body = _object(body, what)
    _check_keys(body, ("torch_empty_cache", *BASE_REQ_FIELDS), what)
    _base_fields(body, what)
    _bool(body, "torch_empty_cache", True, what)


def _base_fields(body: Mapping[str, Any], what: str) -> None:
    for key in BASE_REQ_FIELDS:
        _hint(body, key, "str", what)


def parse_memory_tags(body: Any, what: str) -> list[str] | None:
    """SGLang memory tags -> engine tags (None = all). "cuda_graph" is accepted: the embedded engine
    captures no graphs, so it has nothing to release for it."""
    body = _object(body, what)
    _check_keys(body, ("tags", *BASE_REQ_FIELDS), what)
    _base_fields(body, what)
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


@dataclass(frozen=True)
class WeightsFromDisk:
    model_path: str
    weight_version: str | None
    abort_all_requests: bool


def parse_weights_from_disk(body: Any, dialect: SGLangDialect = CURRENT) -> WeightsFromDisk:
    """The fields of the dialect's release, strictly. flush_cache, the scheduling hints (is_async, keep_pause,
    token_step) and the GPU ones (torch_empty_cache, recapture_cuda_graph) are accepted: the engine always
    drops its KV cache on a weight update, so requests in flight are recomputed under the new weights.
    manifest (a list of the files to load) is accepted only as null: the server loads the whole directory."""
    what = "/update_weights_from_disk"
    body = _object(body, what)
    _check_keys(body, dialect.disk_fields + (BASE_REQ_FIELDS if dialect is CURRENT else ()), what)
    _base_fields(body, what)
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise InvalidArgumentError(f"{what}: model_path must be a checkpoint directory path, got {_show(path)}")
    if body.get("load_format") not in (None, "auto", "safetensors"):
        raise InvalidArgumentError(f"{what}: load_format must be null, 'auto' or 'safetensors', "
                                   f"got {_show(body['load_format'])}")
    if body.get("manifest") is not None:
        raise InvalidArgumentError(f"{what}: manifest is not supported by the embedded server (allowed: null: "
                                   f"the whole directory is loaded), got {_show(body['manifest'])}")
    for key in ("flush_cache", "is_async", "torch_empty_cache", "keep_pause", "recapture_cuda_graph"):
        _bool(body, key, False, what)
    _int(body, "token_step", what)
    return WeightsFromDisk(path, _opt_str(body, "weight_version", what),
                           _bool(body, "abort_all_requests", False, what))


@dataclass(frozen=True)
class WeightsFromTensor:
    serialized: list[str]
    weight_version: str | None
    abort_all_requests: bool


def parse_weights_from_tensor(body: Any, dialect: SGLangDialect = CURRENT) -> WeightsFromTensor:
    what = "/update_weights_from_tensor"
    body = _object(body, what)
    _check_keys(body, dialect.tensor_fields + (BASE_REQ_FIELDS if dialect is CURRENT else ()), what)
    _base_fields(body, what)
    blobs = body.get("serialized_named_tensors")
    if not isinstance(blobs, list) or not blobs or not all(isinstance(b, str) for b in blobs):
        raise InvalidArgumentError(f"{what}: serialized_named_tensors must be a non-empty list of base64 strings "
                                   "(one per TP rank)")
    if body.get("load_format") not in (None, "safetensors"):
        raise InvalidArgumentError(f"{what}: load_format must be null or 'safetensors' (base64 of a safetensors "
                                   f"blob); SGLang's own serializer formats are not readable here, got "
                                   f"{_show(body['load_format'])}")
    _update_options(body, what)
    return WeightsFromTensor(blobs, _opt_str(body, "weight_version", what),
                             _bool(body, "abort_all_requests", False, what))


def parse_weight_version(body: Any) -> tuple[str, bool]:
    what = "/update_weight_version"
    body = _object(body, what)
    _check_keys(body, ("new_version", "abort_all_requests", *BASE_REQ_FIELDS), what)
    _base_fields(body, what)
    version = _opt_str(body, "new_version", what)
    if version is None:
        raise InvalidArgumentError(f"{what}: new_version is required")
    return version, _bool(body, "abort_all_requests", True, what)


# The collective weight update (SGLang's update from a trainer's broadcast) ------------------------------

DEFAULT_GROUP_NAME = "weight_update_group"
# The fields of the current release's request classes (BASE_REQ_FIELDS aside), by endpoint.
WEIGHT_GROUP_FIELDS: dict[str, tuple[str, ...]] = {
    "/init_weights_update_group": ("master_address", "master_port", "rank_offset", "world_size", "group_name",
                                   "backend"),
    "/update_weights_from_distributed": ("names", "dtypes", "shapes", "group_name", "flush_cache",
                                         "abort_all_requests", "weight_version", "load_format", "selector",
                                         "torch_empty_cache"),
    "/destroy_weights_update_group": ("group_name",),
    "/begin_weight_update": ("selector",),
    "/end_weight_update": (),
}


@dataclass(frozen=True)
class InitWeightsGroup:
    """/init_weights_update_group: join the group hosted by the trainer at master_address:master_port as rank
    rank_offset of world_size (one TP rank per server here)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str


def parse_init_weights_group(body: Any) -> InitWeightsGroup:
    what = "/init_weights_update_group"
    body = _object(body, what)
    _check_keys(body, WEIGHT_GROUP_FIELDS[what] + BASE_REQ_FIELDS, what)
    _base_fields(body, what)
    address = body.get("master_address")
    if not isinstance(address, str) or not address:
        raise InvalidArgumentError(f"{what}: master_address must be a host name or address, got {_show(address)}")
    port, offset, size = (_int(body, key, what) for key in ("master_port", "rank_offset", "world_size"))
    if port is None or not 1 <= port <= 65535:
        raise InvalidArgumentError(f"{what}: master_port must be an integer in [1, 65535], got {_show(port)}")
    if size is None or size < 2:
        raise InvalidArgumentError(f"{what}: world_size must be an integer >= 2 (the trainer and at least this "
                                   f"server), got {_show(size)}")
    if offset is None or not 1 <= offset < size:
        raise InvalidArgumentError(f"{what}: rank_offset must be an integer in [1, world_size) (rank 0 is the "
                                   f"trainer), got {_show(offset)}")
    name = _group_name(body, what)
    backend = body.get("backend")
    backend = "nccl" if backend is None else backend
    if backend not in ("gloo", "nccl"):
        raise InvalidArgumentError(f"{what}: backend must be 'gloo' (CPU) or 'nccl' (GPU), got {_show(backend)}")
    return InitWeightsGroup(address, port, offset, size, name, backend)


@dataclass(frozen=True)
class WeightsFromDistributed:
    """/update_weights_from_distributed: receive these tensors, in order, by broadcast from rank 0."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str
    weight_version: str | None
    abort_all_requests: bool


def parse_weights_from_distributed(body: Any) -> WeightsFromDistributed:
    """flush_cache and torch_empty_cache are accepted (the engine drops its KV cache on every update);
    load_format only as null (one broadcast per tensor); selector as the tensor update's."""
    what = "/update_weights_from_distributed"
    body = _object(body, what)
    _check_keys(body, WEIGHT_GROUP_FIELDS[what] + BASE_REQ_FIELDS, what)
    _base_fields(body, what)
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise InvalidArgumentError(f"{what}: names must be a non-empty list of parameter names")
    if not isinstance(dtypes, list) or len(dtypes) != len(names) or not all(isinstance(d, str) for d in dtypes):
        raise InvalidArgumentError(f"{what}: dtypes must be a list of {len(names)} dtype names (one per name)")
    if not isinstance(shapes, list) or len(shapes) != len(names) or not all(
            isinstance(s, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s)
            for s in shapes):
        raise InvalidArgumentError(f"{what}: shapes must be a list of {len(names)} shapes (lists of integers >= 0)")
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"{what}: names must not repeat")
    if body.get("load_format") is not None:
        raise InvalidArgumentError(f"{what}: load_format must be null here (one broadcast per tensor), got "
                                   f"{_show(body['load_format'])}")
    _update_options(body, what)
    return WeightsFromDistributed(names, dtypes, shapes, _group_name(body, what),
                                  _opt_str(body, "weight_version", what),
                                  _bool(body, "abort_all_requests", False, what))


def parse_destroy_weights_group(body: Any) -> str:
    """/destroy_weights_update_group: the group name."""
    what = "/destroy_weights_update_group"
    body = _object(body, what)
    _check_keys(body, WEIGHT_GROUP_FIELDS[what] + BASE_REQ_FIELDS, what)
    _base_fields(body, what)
    return _group_name(body, what)


def parse_weight_update_session(body: Any, what: str) -> None:
    """/begin_weight_update (selector) and /end_weight_update (no field): the session that brackets the
    tensor and distributed updates of the current release."""
    body = _object(body, what)
    _check_keys(body, WEIGHT_GROUP_FIELDS[what] + BASE_REQ_FIELDS, what)
    _base_fields(body, what)
    if body.get("selector") not in (None, "all", "target"):
        raise InvalidArgumentError(f"{what}: selector must be null, 'all' or 'target' (no draft model here), "
                                   f"got {_show(body['selector'])}")


def _group_name(body: Mapping[str, Any], what: str) -> str:
    name = body.get("group_name")
    if name is None:
        return DEFAULT_GROUP_NAME
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"{what}: group_name must be a non-empty string, got {_show(name)}")
    return name


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
