"""RolloutEngine: what the rollout loop needs from any generation engine (embedded, simulated, SGLang).

The embedded ``april_ext.engine.AsyncEngine`` satisfies it as is. An engine whose time is not the wall
clock (a simulator with a virtual clock) exposes ``clock() -> float``; the loop then measures every
duration with it (see :func:`engine_clock`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from april_ext.protocol.outputs import EngineStats, GenerationChunk, GenerationOutput
from april_ext.protocol.sampling_params import SamplingParams

Clock = Callable[[], float]


@runtime_checkable
class RolloutEngine(Protocol):
    """Streaming generation by token ids, abort with partial output, versioned weights, memory, health.

    - ``generate`` streams :class:`GenerationChunk` s (new token ids, their behavior logprobs, the weight
      version that produced them); the last chunk carries a finish reason (STOP, LENGTH or ABORT).
    - ``abort(None)`` ends every request, ``abort(ids)`` the given ones; it returns each aborted request's
      whole output so far (all response tokens, logprobs and per-token versions), and their streams end
      with an ABORT chunk.
    - ``update_weights(weights, version)``: named tensors (Hugging Face names) or a checkpoint directory;
      later tokens carry ``version``.
    - ``release_memory(tags)`` / ``resume_memory(tags)``: tags of protocol.memory_tags.MEMORY_TAGS
      ("weights", "kv_cache", "cuda_graph"); None means all.
    - ``stats()``: a snapshot of load and counters; ``health()``: a dict with at least "status".
    """

    def generate(self, input_ids: Sequence[int], params: SamplingParams | None = None,
                 request_id: str | None = None) -> AsyncIterator[GenerationChunk]: ...

    async def abort(self, request_ids: str | Iterable[str] | None = None) -> list[GenerationOutput]: ...

    async def update_weights(self, weights: Any, version: int) -> Any: ...

    async def release_memory(self, tags: Iterable[str] | None = None) -> None: ...

    async def resume_memory(self, tags: Iterable[str] | None = None) -> None: ...

    def stats(self) -> Any: ...

    def health(self) -> dict[str, Any]: ...


@runtime_checkable
class ServableEngine(RolloutEngine, Protocol):
    """What the HTTP server (april_ext.server) needs of an in-process engine beyond RolloutEngine: a
    lifecycle, stats as EngineStats, and the capacity it reports in /server_info.

    AsyncEngine and SimulatedEngine satisfy it. ``capacity()`` returns SGLang's /server_info fields
    "page_size", "max_total_num_tokens", "max_running_requests", "context_length" and "device".
    """

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def stats(self) -> EngineStats: ...

    def capacity(self) -> dict[str, Any]: ...


HOLD_MODES = ("in_place", "retract")
"""Pause modes that hold the running requests (SGLang's /pause_generation; its third mode, "abort", is abort())."""


@runtime_checkable
class PausableEngine(Protocol):
    """An engine that can hold its running requests between two calls (SGLang's /pause_generation and
    /continue_generation), what the rollout loop's ``carry`` step boundary needs beyond RolloutEngine.

    - ``pause_generation("in_place")``: nothing is generated until ``continue_generation``; the requests keep
      their KV cache, also across ``update_weights`` (they continue over it, later tokens carry the new
      version). ``pause_generation("retract")``: the same, with their KV cache freed (recomputed on continue,
      under the weights loaded by then).
    - New requests wait while paused.
    """

    async def pause_generation(self, mode: str = ...) -> None: ...

    async def continue_generation(self) -> None: ...


@runtime_checkable
class PrefixIsolatingEngine(Protocol):
    """An engine whose prefix cache can be kept out of some requests' reach (the embedded AsyncEngine): requests
    generated inside ``unpublished_requests()`` reuse cached blocks but publish none of their own (they may still
    evict cached blocks by taking free ones). The run's evaluation uses it, so that evaluating does not change
    what the run trains; SGLang's radix cache has no such switch."""

    def unpublished_requests(self) -> contextlib.AbstractContextManager[None]: ...


@runtime_checkable
class LockstepEngine(Protocol):
    """An engine that can run its model steps in lockstep with one consumer (the embedded AsyncEngine), what the
    rollout loop's deterministic mode needs beyond RolloutEngine: with it, which requests share each model step
    and how many tokens a sample has when its abort lands are a function of the consumer's calls, not of the
    timing of the engine's thread.

    - ``await set_lockstep(True)``: from then on a model step runs only after ``release_step()``, one step per
      call; requests, aborts and other calls sent before it are applied before that step, in the order they were
      sent. It returns once no step is running. ``set_lockstep(False)``: steps run whenever there is work (the
      default).
    - ``release_step()``: the consumer has taken every chunk of the steps so far and sent everything for the next
      one. Returns a future done once that step ran and its chunks are in their streams (the same future until
      then).
    - ``lockstep_busy()``: a released step has not yet run, or some of its chunks are not yet taken by their
      streams' consumers.
    """

    async def set_lockstep(self, on: bool) -> None: ...

    def release_step(self) -> Any: ...

    def lockstep_busy(self) -> bool: ...


@runtime_checkable
class AbortAllEngine(Protocol):
    """An engine that can abort every request on its servers, including requests it did not send itself (those a
    slime custom generate function posts to the servers on its own), what CustomGenerateRollout needs beyond
    RolloutEngine: ``abort(None)`` ends only the engine's own requests.

    - ``abort_all()``: one abort of everything on every server (SGLang's ``/abort_request`` with
      ``{"rid": "", "abort_all": true}``); it returns once each server answered, not once the requests ended. A
      request that reaches a server after it may run on: the caller sends it again until its requests are back.
    """

    async def abort_all(self) -> None: ...


@runtime_checkable
class TrainerFedEngine(Protocol):
    """An engine built with its trainer, whose processes send it the trainer's weights themselves (a Ray run's
    engine: the trainer ranks post or broadcast them), so that the caller never holds them: what the run's
    weight hand-off calls instead of ``update_weights``.

    - ``update_from_trainer(version)``: the trainer's current weights, which must be of ``version``, into the
      engine; later tokens carry ``version``.
    """

    async def update_from_trainer(self, version: int) -> Any: ...


def engine_clock(engine: object, clock: Clock | None = None) -> Clock:
    """The clock the loop measures with: the one given, else the engine's ``clock()``, else
    ``time.perf_counter`` (an engine that runs in real time)."""
    if clock is not None:
        return clock
    own = getattr(engine, "clock", None)
    if callable(own):
        return own
    return time.perf_counter


__all__ = ["HOLD_MODES", "AbortAllEngine", "Clock", "LockstepEngine", "PausableEngine", "PrefixIsolatingEngine",
           "RolloutEngine", "ServableEngine", "TrainerFedEngine", "engine_clock"]
