"""The /generate request (SGLang's GenerateReqInput and its sampling params, field by field: honoured, hints
typed and ignored, unsupported features only at their off value) and the finish_reason of its answer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from april_ext.batch import FinishReason
from april_ext.errors import InvalidArgumentError
from april_ext.protocol.sampling_params import MAX_SEED, SamplingParams
from april_ext.protocol.sglang_json import (
    bool_field,
    check_keys,
    check_rid,
    hint_field,
    int_field,
    is_neutral,
    json_object,
    number_field,
    show,
)

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

ABORT_MESSAGE = "Aborted"
ABORT_QUEUED_MESSAGE = "Abort in waiting queue"


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


def parse_generate(body: Any) -> GenerateRequest:
    """Validates a /generate body (SGLang's GenerateReqInput, one request): input_ids, or text for a
    server with a tokenizer (the caller turns it into ids)."""
    what = "/generate"
    body = json_object(body, what)
    check_keys(body, GENERATE_FIELDS, what)
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None and ids is not None:
        raise InvalidArgumentError(f"{what}: send either text or input_ids, not both")
    if isinstance(text, list):
        raise InvalidArgumentError(f"{what}: batched requests (a list of texts) are not supported by the embedded "
                                   "server: send one request per call")
    if text is not None and not isinstance(text, str):
        raise InvalidArgumentError(f"{what}: text must be a string, got {show(text)}")
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
        check_rid(rid, what)
        if not rid:
            raise InvalidArgumentError(f"{what}: rid must be a non-empty string or null, got \"\"")
    for key, allowed in GENERATE_NEUTRAL.items():
        if key in body and not is_neutral(body[key], allowed):
            raise InvalidArgumentError(f"{what}: {key} is not supported by the embedded server (allowed: "
                                       f"{' or '.join(show(a) for a in allowed)}), got {show(body[key])}")
    for key, kind in _GENERATE_HINTS.items():
        hint_field(body, key, kind, what)
    raw = json_object(body.get("sampling_params"), f"{what} sampling_params")
    interval = int_field(raw, "stream_interval", f"{what} sampling_params")
    if interval is not None and interval < 1:
        raise InvalidArgumentError(f"{what} sampling_params: stream_interval must be an integer >= 1 or null, "
                                   f"got {interval}")
    params = parse_sampling_params(raw)
    priority = int_field(body, "priority", what)
    if priority is not None:
        if not -2**63 <= priority < 2**63:
            raise InvalidArgumentError(f"{what}: priority must be a signed 64-bit integer or null, got {priority}")
        params = replace(params, priority=priority)
    return GenerateRequest(rid=rid, input_ids=ids, params=params,
                           return_logprob=bool_field(body, "return_logprob", False, what),
                           stream=bool_field(body, "stream", False, what), text=text, stream_interval=interval,
                           skip_special_tokens=bool_field(raw, "skip_special_tokens", True, f"{what} sampling_params"))


def parse_sampling_params(raw: Any) -> SamplingParams:
    """SGLang sampling_params -> SamplingParams. Unknown fields and enabled unsupported features are errors;
    top_k 0 is refused as SGLang refuses it (-1 disables the filter)."""
    what = "/generate sampling_params"
    raw = json_object(raw, what)
    check_keys(raw, SAMPLING_FIELDS, what)
    for key, neutral in SAMPLING_NEUTRAL.items():
        if key in raw and not is_neutral(raw[key], neutral):
            raise InvalidArgumentError(f"{what}: {key}={show(raw[key])} is not supported by the embedded engine "
                                       f"(allowed: {' or '.join(show(n) for n in neutral)})")
    for key in _TEXT_ONLY:
        bool_field(raw, key, False, what)
    values = {"max_new_tokens": int_field(raw, "max_new_tokens", what),
              "temperature": number_field(raw, "temperature", what),
              "top_p": number_field(raw, "top_p", what), "top_k": int_field(raw, "top_k", what),
              "sampling_seed": int_field(raw, "sampling_seed", what),
              "ignore_eos": bool_field(raw, "ignore_eos", False, what)}
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
                                       f"got {show(stop)}")
        values["stop_token_ids"] = tuple(stop)
    kwargs = {_MAPPED[key]: value for key, value in values.items() if value is not None}
    try:
        return SamplingParams(**kwargs)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{what}: {exc}") from exc


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


__all__ = [
    "ABORT_MESSAGE",
    "ABORT_QUEUED_MESSAGE",
    "GENERATE_FIELDS",
    "GENERATE_NEUTRAL",
    "GenerateRequest",
    "ROUTER_FIELDS",
    "SAMPLING_FIELDS",
    "SAMPLING_NEUTRAL",
    "finish_reason_json",
    "parse_generate",
    "parse_sampling_params",
]
