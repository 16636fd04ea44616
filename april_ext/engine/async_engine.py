"""AsyncEngine: the asyncio face of EngineCore (streaming generate, abort, weight updates, memory).

One loop task owns the core. Every call is a command that the loop runs between model steps, in a
worker thread, so calls and steps never interleave and the event loop stays responsive while the
model computes. Chunks reach each request's stream in the order the core produced them.

By default the engine steps whenever it has work, so how many steps run before a call lands depends on
timing. In lockstep (``set_lockstep(True)``, protocol.LockstepEngine; the rollout loop's deterministic mode)
a step runs only when the consumer releases it, after it has taken the previous step's chunks and sent its
requests and aborts, so every step's batch is a function of the consumer's calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from collections.abc import Sequence as SequenceOf
from typing import Any, TypeVar

from april_ext.batch import FinishReason
from april_ext.engine.core import EngineCore, WeightsSource
from april_ext.errors import InvalidArgumentError
from april_ext.protocol.engine_base import RequestStream, generate_args, stream_until_finish
from april_ext.protocol.loop_task import LoopTaskEngine
from april_ext.protocol.memory_tags import memory_tags
from april_ext.protocol.outputs import EngineStats, GenerationChunk, GenerationOutput
from april_ext.protocol.request_ids import RequestIds
from april_ext.protocol.rollout_engine import HOLD_MODES
from april_ext.protocol.sampling_params import SamplingParams

T = TypeVar("T")
_Command = Callable[[], tuple[Any, list[GenerationChunk]]]
_Done = tuple[asyncio.Future[Any], Any, Exception | None, list[GenerationChunk]]  # future, result, error, chunks


_UNPUBLISHED: contextvars.ContextVar[bool] = contextvars.ContextVar("april_ext_unpublished_requests", default=False)
"""Set inside AsyncEngine.unpublished_requests()."""


class AsyncEngine(LoopTaskEngine):
    """Serves an EngineCore from an asyncio task. Use `async with AsyncEngine(core) as engine:`."""

    _task_name = "april_ext-engine-loop"

    def __init__(self, core: EngineCore) -> None:
        super().__init__()
        self.core = core
        self._streams: dict[str, asyncio.Queue[GenerationChunk | BaseException]] = {}
        self._commands: deque[tuple[_Command, asyncio.Future[Any]]] = deque()
        self._ids = RequestIds("async")
        self._held = False
        self._lockstep = False
        self._released: asyncio.Future[None] | None = None
        """Lockstep: the step release_step() let run, until it ran and its chunks are in their queues."""
        self._stepping = False
        self._pending_adds = 0
        """Requests whose add command is queued (work for the next step that the core does not hold yet)."""

    # Public API -------------------------------------------------------------------------------------

    def generate(self, input_ids: SequenceOf[int], params: SamplingParams | None = None,
                 request_id: str | None = None) -> AsyncIterator[GenerationChunk]:
        """Streams the request's chunks until one carries a finish reason. Leaving the iteration early
        aborts the request. Bad input raises before the first chunk."""
        publish = not _UNPUBLISHED.get()  # read at the call: the context it was made in decides
        return stream_until_finish(lambda: self._open(input_ids, params, request_id, publish))

    @contextlib.contextmanager
    def unpublished_requests(self) -> Iterator[None]:
        """Requests generated inside, by this task and the tasks it starts, publish no KV blocks to the prefix
        cache (they still reuse cached ones). A context variable, not an engine flag: other tasks' requests
        meanwhile publish as usual, and nested uses restore what was before."""
        token = _UNPUBLISHED.set(True)
        try:
            yield
        finally:
            _UNPUBLISHED.reset(token)

    async def _open(self, input_ids: SequenceOf[int], params: SamplingParams | None,
                    request_id: str | None, publish: bool) -> RequestStream:
        ids, params = generate_args(input_ids, params)
        rid = self._ids.claim(request_id, self._streams)
        queue: asyncio.Queue[GenerationChunk | BaseException] = asyncio.Queue()
        self._streams[rid] = queue
        self._pending_adds += 1
        try:
            await self._call(lambda: (self.core.add_request(ids, params, rid, publish_prefix=publish), []))
        except BaseException as exc:
            del self._streams[rid]
            if isinstance(exc, asyncio.CancelledError) and self._task is not None and not self._closing:
                # The caller left while the add was queued: it still runs, so abort what it adds.
                self._submit(lambda: self._abort_known([rid]))
            raise
        finally:
            self._pending_adds -= 1

        async def receive() -> GenerationChunk:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            return item

        def abort() -> None:
            if self._task is not None and not self._closing:
                self._submit(lambda: self._abort_known([rid]))

        return RequestStream(receive, abort, lambda: self._streams.pop(rid, None))

    async def abort(self, request_ids: str | Iterable[str] | None = None) -> list[GenerationOutput]:
        """Ends the requests (all when None) and returns their partial outputs (finish reason ABORT).
        Their streams end with an ABORT chunk. Unknown ids raise UnknownIdError."""
        def run() -> tuple[list[GenerationOutput], list[GenerationChunk]]:
            outputs = self.core.abort(request_ids)
            return outputs, [self._abort_chunk(o) for o in outputs]

        return await self._call(run)

    async def update_weights(self, weights: WeightsSource, version: int) -> list[str]:
        """Loads weights (named tensors or a checkpoint directory) between steps; see EngineCore."""
        return await self._call(lambda: (self.core.update_weights(weights, version), []))

    async def release_memory(self, tags: str | Iterable[str] | None = None) -> None:
        """Releases the tags' memory between steps; see EngineCore.release_memory."""
        names = memory_tags(tags)
        await self._call(lambda: (self.core.release_memory(names), []))

    async def resume_memory(self, tags: str | Iterable[str] | None = None) -> None:
        names = memory_tags(tags)
        await self._call(lambda: (self.core.resume_memory(names), []))

    async def pause_generation(self, mode: str = "in_place") -> None:
        """Stops stepping until continue_generation(); the requests stay (new ones queue). "in_place": their
        KV cache is kept as it is, also across update_weights (they continue over it); "retract": it is
        dropped (they go back to the queue and are recomputed when stepping resumes). See PausableEngine."""
        if mode not in HOLD_MODES:
            raise InvalidArgumentError(f"pause_generation mode must be one of {list(HOLD_MODES)}, got {mode!r} "
                                       "(to end the requests, abort() them)")

        def run() -> tuple[None, list[GenerationChunk]]:
            if mode == "retract":
                self.core.flush_cache()
            self._held = True
            return None, []

        await self._call(run)

    async def continue_generation(self) -> None:
        self._held = False
        self._notify()

    async def set_lockstep(self, on: bool) -> None:
        """True: a model step runs only after release_step() (calls sent before it are applied first, in order);
        returns once no step is running. False (the default): steps run whenever there is work. See
        protocol.LockstepEngine."""
        self._lockstep = bool(on)
        if not on and self._released is not None and not self._released.done():
            self._released.set_result(None)
        self._released = None
        self._notify()
        if on:
            await self._call(lambda: (None, []))  # runs between steps: one that was running has ended

    def release_step(self) -> asyncio.Future[None]:
        """Lockstep: lets the next model step run, once every call queued before it has run. The future is done
        when that step ran and its chunks are in their streams' queues (the same future until then)."""
        if self._released is None or self._released.done():
            self._released = asyncio.get_running_loop().create_future()
        self._notify()
        return self._released

    def lockstep_busy(self) -> bool:
        """A released step has not yet run (and can: there is work and generation is not held), or some chunk
        is still waiting in a stream's queue for its consumer."""
        if self._stepping or any(not queue.empty() for queue in self._streams.values()):
            return True
        return self._released is not None and not self._released.done() and self._can_step(pending_adds=True)

    def _can_step(self, *, pending_adds: bool = False) -> bool:
        work = self.core.has_unfinished() or (pending_adds and self._pending_adds > 0)
        return work and not self.core.paused and not self._held

    def _step_allowed(self) -> bool:
        return not self._lockstep or (self._released is not None and not self._released.done())

    def stats(self) -> EngineStats:
        return self.core.stats()

    def capacity(self) -> dict[str, Any]:
        """The /server_info fields of the core's configuration (see ServableEngine)."""
        config = self.core.config
        return {"page_size": config.block_size, "max_total_num_tokens": config.num_blocks * config.block_size,
                "max_running_requests": config.max_num_seqs, "context_length": self.core.max_model_len,
                "device": config.device}

    def health(self) -> dict[str, Any]:
        """{"status": "ok" | "paused" | "stopped" | "error", "weight_version", "paused_tags", "error"}."""
        return {"status": self._status(self.core.paused), "weight_version": self.core.weight_version,
                "paused_tags": sorted(self.core.memory.paused_tags),
                "error": None if self.last_error is None else repr(self.last_error)}

    # Loop -------------------------------------------------------------------------------------------

    def _abort_known(self, ids: list[str]) -> tuple[None, list[GenerationChunk]]:
        outputs = self.core.abort([i for i in ids if self.core.has_request(i)])
        return None, [self._abort_chunk(o) for o in outputs]

    def _abort_chunk(self, output: GenerationOutput) -> GenerationChunk:
        return GenerationChunk(output.request_id, [], [], self.core.weight_version, FinishReason.ABORT)

    def _submit(self, command: _Command) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._commands.append((command, future))
        self._notify()
        return future

    async def _call(self, command: _Command) -> Any:
        self._require_running()
        return await self._submit(command)

    def _dispatch(self, chunks: list[GenerationChunk]) -> None:
        for chunk in chunks:
            queue = self._streams.get(chunk.request_id)
            if queue is not None:
                queue.put_nowait(chunk)

    @staticmethod
    def _run_commands(batch: list[tuple[_Command, asyncio.Future[Any]]]) -> list[_Done]:
        """In the worker thread: the commands in order; a failure is its caller's and the rest still run."""
        done: list[_Done] = []
        for command, future in batch:
            try:
                result, chunks = command()
            except Exception as exc:  # the caller receives it; the engine keeps serving
                done.append((future, None, exc, []))
            else:
                done.append((future, result, None, chunks))
        return done

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            if self._commands:
                # Every queued command in one trip to the worker thread: a step's worth of new requests would
                # otherwise cost one thread hand-off each.
                batch = list(self._commands)
                self._commands.clear()
                for future, result, exc, chunks in await asyncio.to_thread(self._run_commands, batch):
                    self._dispatch(chunks)
                    if future.done():
                        continue
                    if exc is not None:
                        future.set_exception(exc)
                    else:
                        future.set_result(result)
                continue  # commands that came meanwhile also run before the next step
            if self._closing:
                return
            if self._can_step() and self._step_allowed():
                released, self._stepping = self._released, True
                try:
                    chunks = await asyncio.to_thread(self.core.step)
                except Exception as exc:  # a failed step fails its requests, not the server
                    self.last_error = exc
                    outputs = self.core.abort()
                    for output in outputs:
                        queue = self._streams.get(output.request_id)
                        if queue is not None:
                            queue.put_nowait(exc)
                    chunks = []
                self._dispatch(chunks)
                self._stepping = False
                if released is not None and not released.done():
                    released.set_result(None)  # after the chunks: their streams run first
                continue
            else:
                self._wake.clear()
                if not self._commands:
                    await self._wake.wait()
