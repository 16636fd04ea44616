"""One request in flight on an SGLang server: its wire form (rid, payload) and its state, which turns
SGLang's cumulative stream events into per-event deltas (new tokens, their logprobs, their version)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from april_ext.batch import FinishReason
from april_ext.protocol.outputs import GenerationChunk, GenerationOutput
from april_ext.protocol.sampling_params import SamplingParams
from april_ext.sglang.errors import SGLangBadRequestError, SGLangHTTPError

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def wire_rid(request_id: str) -> str:
    """The rid sent to SGLang. SGLang aborts every request whose rid starts with the given one, so ids
    are made prefix-free by a length prefix: aborting "s-1" must not abort "s-10"."""
    return f"{len(request_id)}:{request_id}"


def generate_payload(rid: str, ids: list[int], params: SamplingParams, priority: bool = False) -> dict[str, Any]:
    """The /generate body of a request (streaming; the non-streaming mode overrides "stream"); with
    ``priority``, the request's SamplingParams.priority as SGLang's (a server without
    --enable-priority-scheduling may refuse a request that carries one)."""
    # top_k <= 0 disables the filter here; SGLang refuses 0 and takes -1 for "disabled".
    sampling: dict[str, Any] = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
                                "top_p": params.top_p, "top_k": params.top_k if params.top_k > 0 else -1,
                                "ignore_eos": params.ignore_eos,
                                "stop_token_ids": list(params.stop_token_ids), "no_stop_trim": True}
    if params.seed is not None:
        sampling["sampling_seed"] = params.seed
    payload = {"rid": wire_rid(rid), "input_ids": ids, "sampling_params": sampling, "return_logprob": True,
               "stream": True}
    if priority and params.priority is not None:
        payload["priority"] = params.priority
    return payload


def weight_version_of(label: Any, initial: int) -> int:
    """SGLang's weight_version label -> int: numeric labels as they are (the adapter sends
    str(version)); any other label ("default") is the initial version."""
    if isinstance(label, int) and not isinstance(label, bool):
        return label
    if isinstance(label, str) and label.lstrip("-").isdigit():
        return int(label)
    return initial


@dataclass
class RequestState:
    """What the adapter knows of one request: the tokens so far, the chunks not yet consumed, whether
    it is over (``done``: finish reason known, or its stream failed) and the task reading its stream.
    ``opened`` and ``last_event`` (event-loop times) say since when it waits for its next event."""

    request_id: str
    prompt_ids: list[int]
    url: str
    queue: asyncio.Queue[GenerationChunk | BaseException] = field(default_factory=asyncio.Queue)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop: int | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    opened: float = 0.0
    last_event: float = 0.0

    def output(self) -> GenerationOutput:
        return GenerationOutput(self.request_id, list(self.prompt_ids), list(self.token_ids), list(self.logprobs),
                                list(self.versions), self.finish_reason, self.matched_stop)

    def apply(self, event: Any, url: str, initial_version: int, current_version: int) -> GenerationChunk | None:
        """Takes one cumulative event (or a non-streaming answer); returns the chunk of what is new in it
        (None when nothing is). Its tokens carry the event's meta_info.weight_version; a release that
        labels no weights (0.4.x) sends none, and they carry current_version, the adapter's own. Raises
        SGLangBadRequestError for an in-band error or refused input, and SGLangHTTPError for an event the
        adapter cannot read."""
        if not isinstance(event, dict) or "error" in event:
            message = event.get("error", {}).get("message", event) if isinstance(event, dict) else event
            raise SGLangBadRequestError(url, 200, str(message))
        meta = event.get("meta_info") or {}
        reason, matched = _finish(meta.get("finish_reason"), url)
        ids = event.get("output_ids") or []
        if 0 < len(ids) < len(self.token_ids):
            # An abort answer may carry no output_ids at all; fewer than before means deltas, not totals.
            raise SGLangHTTPError(url, 200, f"an event carries {len(ids)} output_ids after {len(self.token_ids)}: "
                                  "the server streams increments (--incremental-streaming-output); the adapter "
                                  "needs SGLang's default cumulative events")
        new_ids = ids[len(self.token_ids):]
        rows = meta.get("output_token_logprobs") or []
        if len(rows) < len(ids):
            raise SGLangHTTPError(url, 200, f"{len(ids)} output_ids but {len(rows)} output_token_logprobs: "
                                  "the server ignored return_logprob")
        new_logprobs = [float(row[0]) for row in rows[len(self.token_ids):len(ids)]]
        label = meta.get("weight_version")
        version = current_version if label is None else weight_version_of(label, initial_version)
        self.token_ids.extend(new_ids)
        self.logprobs.extend(new_logprobs)
        self.versions.extend([version] * len(new_ids))
        if not new_ids and reason is None:
            return None
        if reason is not None:
            self.finish_reason, self.matched_stop = reason, matched
        return GenerationChunk(self.request_id, list(new_ids), new_logprobs, version, reason, matched)


def _finish(raw: Any, url: str) -> tuple[FinishReason | None, int | None]:
    if raw is None:
        return None, None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in _FINISH:
        raise SGLangHTTPError(url, 200, f"unknown finish_reason {raw!r}")
    if kind == "abort" and raw.get("status_code") is not None:
        # SGLang reports refused input (too long, bad parameters) as an abort with an HTTP status.
        raise SGLangBadRequestError(url, int(raw["status_code"]), str(raw.get("message")))
    matched = raw.get("matched")
    return _FINISH[kind], matched if isinstance(matched, int) and not isinstance(matched, bool) else None


__all__ = ["RequestState", "generate_payload", "weight_version_of", "wire_rid"]
