"""What every engine does the same way at its boundary, whatever serves the request: the checks on
generate()'s arguments and the stream that runs until the finish chunk and aborts the request when its
consumer leaves early, and update_weights()' version check. Request ids and abort ids are in
request_ids.py, memory tags in memory_tags.py.

Each engine supplies the hooks (how a chunk is received, how a request is aborted: RequestStream); the
rules and the error messages live here once, so the three engines answer bad input alike.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from april_ext.errors import InvalidArgumentError
from april_ext.protocol.outputs import GenerationChunk
from april_ext.protocol.sampling_params import SamplingParams

_IDS_RULE = "input_ids must be a non-empty sequence of token ids (integers >= 0)"


def generate_args(input_ids: Sequence[int] | np.ndarray | Any,
                  params: SamplingParams | None) -> tuple[list[int] | np.ndarray, SamplingParams]:
    """generate()'s token ids and params (None: the defaults), checked. The ids come back as a list of
    ints, or as the given 1-D numpy array, checked vectorised (a simulator feeds long arrays); other
    array types (tensors) are read through ``tolist()``. Raises InvalidArgumentError saying what is allowed."""
    if params is None:
        params = SamplingParams()
    elif not isinstance(params, SamplingParams):
        raise InvalidArgumentError(f"params must be None or a SamplingParams, got {type(params).__name__}")
    if isinstance(input_ids, np.ndarray):
        if input_ids.ndim != 1:
            raise InvalidArgumentError(f"{_IDS_RULE}, got a {input_ids.ndim}-D array")
        if input_ids.size == 0:
            raise InvalidArgumentError(f"{_IDS_RULE}, got an empty sequence")
        bad = input_ids if not np.issubdtype(input_ids.dtype, np.integer) else input_ids[input_ids < 0]
        if bad.size:
            raise InvalidArgumentError(f"{_IDS_RULE}, got {bad[:5].tolist()}")
        return input_ids, params
    if hasattr(input_ids, "tolist") and not isinstance(input_ids, (str, bytes)):
        input_ids = input_ids.tolist()
    if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence):
        raise InvalidArgumentError(f"{_IDS_RULE}, got a {type(input_ids).__name__}")
    ids = list(input_ids)
    if not ids:
        raise InvalidArgumentError(f"{_IDS_RULE}, got an empty sequence")
    bad_ids = [t for t in ids if type(t) is not int or t < 0]
    if bad_ids:
        raise InvalidArgumentError(f"{_IDS_RULE}, got {bad_ids[:5]}")
    return ids, params


def check_weight_version(version: Any) -> int:
    """update_weights()' version: an int (the version later tokens carry). Raises InvalidArgumentError."""
    if not isinstance(version, int) or isinstance(version, bool):
        raise InvalidArgumentError(f"version must be an integer, got {version!r}")
    return version


@dataclass(frozen=True)
class RequestStream:
    """An engine's hooks for one request's stream (see stream_until_finish).

    receive: the next chunk (raises when the request failed). abort: ends the request at once, without
    awaiting (it runs in a ``finally`` that a cancellation may reach). release: the stream's own
    bookkeeping, run whenever the stream ends.
    """

    receive: Callable[[], Awaitable[GenerationChunk]]
    abort: Callable[[], None]
    release: Callable[[], None] = lambda: None


async def stream_until_finish(open_stream: Callable[[], Awaitable[RequestStream]]) -> AsyncIterator[GenerationChunk]:
    """generate()'s stream: opens the request (its argument errors raise at the first ``anext``), then
    yields chunks until one carries a finish reason.

    When the consumer leaves before the finish chunk (stops iterating and closes the generator, or is
    cancelled) the request is aborted, so it does not run on for nobody; not when ``receive`` raised,
    since that ended the request. ``open_stream`` itself must leave no request behind when it raises or
    is cancelled.
    """
    stream = await open_stream()
    over = False
    try:
        while True:
            try:
                chunk = await stream.receive()
            except Exception:
                over = True
                raise
            over = chunk.finish_reason is not None
            yield chunk
            if over:
                return
    finally:
        stream.release()
        if not over:
            stream.abort()


__all__ = ["RequestStream", "check_weight_version", "generate_args", "stream_until_finish"]
