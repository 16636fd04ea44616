"""The RolloutEngine contract (april_ext.protocol), once, against every engine: the embedded AsyncEngine on a
tiny model, the SimulatedEngine, the SGLang adapter against the embedded server on loopback, and the
SGLang adapter against the same server serving a SimulatedEngine (the server takes any ServableEngine).

The simulated engine delivers a request's tokens in few chunks (at its finish, abort or a weight update),
so the tests ask only what every engine promises: streamed tokens with their logprobs and version, the
finish reasons, partial outputs of aborts, the same errors for the same bad input.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from _engine_utils import engine as embedded_core
from _engine_utils import tiny_model
from _torch_threads import one_torch_thread

from april_ext.batch import FinishReason
from april_ext.engine import AsyncEngine
from april_ext.errors import ConfigError, InvalidArgumentError, UnknownIdError
from april_ext.protocol import MEMORY_TAGS, GenerationChunk, RolloutEngine, SamplingParams, ServableEngine
from april_ext.server import EmbeddedServer, ServerConfig, ServerThread
from april_ext.sglang import SGLangEngine, SGLangEngineConfig
from april_ext.sim import ClusterConfig, CostModel, SimulatedEngine, TraceLengths

PROMPT = [5, 17, 33, 2, 60]
LONG = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
# Every id of the tiny model's vocabulary stops the embedded engine at its first token; the simulated
# engine ignores stop ids and stops at its drawn length (3 tokens).
STOPPING = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=tuple(range(101)))
_instances = itertools.count()


def _sim() -> SimulatedEngine:
    cost = CostModel(decode_fixed_s=1.0, decode_per_seq_s=0.0, decode_per_kv_token_s=0.0, prefill_per_token_s=0.0,
                     kv_capacity_tokens=10_000, max_num_seqs=8)
    return SimulatedEngine(ClusterConfig(cost=cost, num_engines=1), TraceLengths([[3]]))


def _embedded() -> AsyncEngine:
    # Allocator tags are process-wide: each engine gets its own.
    return AsyncEngine(embedded_core(tiny_model(), memory_tag_prefix=f"contract{next(_instances)}-"))


def _weights() -> dict[str, Any]:
    return {name: p.detach().clone() for name, p in tiny_model().named_parameters()}


@dataclass(frozen=True)
class Kind:
    """One engine under the contract: how to open it, the weights update_weights is given, and how
    many requests it has live (for the SGLang adapter: streams its servers have not ended)."""

    name: str
    open: Callable[[], contextlib.AbstractAsyncContextManager[Any]]
    weights: Callable[[], Any]
    live: Callable[[Any], int]


@contextlib.asynccontextmanager
async def _started(engine: Any) -> AsyncIterator[Any]:
    async with engine:
        yield engine


@contextlib.contextmanager
def _served(make: Callable[[], ServableEngine]) -> Iterator[str]:
    config = ServerConfig(port=0, enable_memory_saver=True)
    with ServerThread(make(), config) as server:
        assert server.url is not None
        yield server.url


def _over_http(make: Callable[[], ServableEngine]) -> Callable[[], contextlib.AbstractAsyncContextManager[Any]]:
    @contextlib.asynccontextmanager
    async def open_client() -> AsyncIterator[SGLangEngine]:
        with _served(make) as url:
            async with SGLangEngine(SGLangEngineConfig(worker_urls=(url,), abort_timeout_s=10.0)) as client:
                yield client
    return open_client


def _queued(engine: Any) -> int:
    return engine.stats().running + engine.stats().waiting


def _in_flight(engine: SGLangEngine) -> int:
    return sum(engine.stats().in_flight.values())


KINDS = [
    Kind("embedded", lambda: _started(_embedded()), _weights, _queued),
    Kind("simulated", lambda: _started(_sim()), dict, _queued),
    Kind("sglang", _over_http(_embedded), _weights, _in_flight),
    Kind("sglang-over-simulated", _over_http(_sim), dict, _in_flight),
]


# Behind HTTP nothing holds the virtual clock while the client reacts, so a simulated request runs to its
# end before a remote abort arrives: the tests that abort a running request leave that pairing out.
RUNNING = [k for k in KINDS if k.name != "sglang-over-simulated"]


@pytest.fixture(params=KINDS, ids=[k.name for k in KINDS])
def kind(request: pytest.FixtureRequest) -> Iterator[Kind]:
    with one_torch_thread():
        yield request.param


@pytest.fixture(params=RUNNING, ids=[k.name for k in RUNNING])
def running_kind(request: pytest.FixtureRequest) -> Iterator[Kind]:
    with one_torch_thread():
        yield request.param


def run(kind: Kind, body: Callable[[Any], Any]) -> Any:
    async def main() -> Any:
        async with kind.open() as engine:
            return await body(engine)
    return asyncio.run(main())


async def collect(engine: Any, ids: Any, params: SamplingParams | None, rid: str | None) -> list[GenerationChunk]:
    return [chunk async for chunk in engine.generate(ids, params, rid)]


def tokens(chunks: list[GenerationChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


async def started(engine: Any, rid: str) -> asyncio.Task[list[GenerationChunk]]:
    """A LONG request streaming in a task, with some tokens generated: a SHORT request ran to its end
    meanwhile (a simulated clock advances only while every stream waits)."""
    task = asyncio.ensure_future(collect(engine, PROMPT, LONG, rid))
    await asyncio.sleep(0)
    await collect(engine, [7, 8, 9], SHORT, f"{rid}-tick")
    return task


# Streaming and finish reasons ----------------------------------------------------------------------------

def test_streams_token_ids_with_logprobs_and_version_until_a_finish_reason(kind: Kind) -> None:
    async def body(engine):
        assert isinstance(engine, RolloutEngine)
        assert engine.health()["status"] == "ok"
        return (await collect(engine, PROMPT, SamplingParams(max_new_tokens=6, ignore_eos=True), "c-1"),
                await collect(engine, PROMPT, STOPPING, "c-2"))

    length, stopped = run(kind, body)
    assert len(tokens(length)) == 6 and all(isinstance(t, int) and t >= 0 for t in tokens(length))
    for chunks in (length, stopped):
        assert all(len(c.token_ids) == len(c.logprobs) for c in chunks)
        assert all(math.isfinite(lp) and lp <= 0 for c in chunks for lp in c.logprobs)
        assert all(c.weight_version == 0 and c.request_id == chunks[0].request_id for c in chunks)
        assert all(c.finish_reason is None for c in chunks[:-1])
    assert length[-1].finish_reason is FinishReason.LENGTH and length[-1].matched_stop is None
    assert stopped[-1].finish_reason is FinishReason.STOP and 1 <= len(tokens(stopped)) < 8
    assert stopped[-1].matched_stop == tokens(stopped)[-1]


def test_a_request_without_id_gets_a_fresh_one_and_a_live_id_is_refused(kind: Kind) -> None:
    async def body(engine):
        task = asyncio.ensure_future(collect(engine, PROMPT, LONG, "dup"))
        await asyncio.sleep(0)
        with pytest.raises(InvalidArgumentError, match=r"^request_id 'dup' is already in use$"):
            await collect(engine, PROMPT, SHORT, "dup")
        with pytest.raises(InvalidArgumentError, match=r"^request_id must be None or a non-empty string, got ''$"):
            await collect(engine, PROMPT, SHORT, "")
        await engine.abort()
        await task
        first, second = await asyncio.gather(collect(engine, PROMPT, SHORT, None), collect(engine, PROMPT, SHORT, None))
        return first[0].request_id, second[0].request_id

    first, second = run(kind, body)
    assert first != second


@pytest.mark.parametrize("ids, params, message", [
    ([], None, "input_ids must be a non-empty sequence of token ids (integers >= 0), got an empty sequence"),
    ([3, -1], None, "input_ids must be a non-empty sequence of token ids (integers >= 0), got [-1]"),
    ([3, 2.5], None, "input_ids must be a non-empty sequence of token ids (integers >= 0), got [2.5]"),
    ("abc", None, "input_ids must be a non-empty sequence of token ids (integers >= 0), got a str"),
    ([3], {"max_new_tokens": 4}, "params must be None or a SamplingParams, got dict"),
])
def test_bad_arguments_raise_the_same_message_before_the_first_chunk(kind: Kind, ids, params, message) -> None:
    async def body(engine):
        with pytest.raises(InvalidArgumentError) as err:
            await collect(engine, ids, params, "bad")
        # Nothing was submitted: the id is free and the engine serves on.
        return str(err.value), tokens(await collect(engine, PROMPT, SHORT, "bad"))

    text, after = run(kind, body)
    assert text == message and len(after) == 2


# Abort -------------------------------------------------------------------------------------------------

def test_abort_ids_returns_partial_outputs_and_ends_their_streams_with_abort(running_kind: Kind) -> None:
    async def body(engine):
        task = await started(engine, "a-1")
        [output] = await engine.abort("a-1")
        return output, await task

    output, chunks = run(running_kind, body)
    assert output.request_id == "a-1" and output.prompt_ids == PROMPT
    assert output.finish_reason is FinishReason.ABORT
    assert 1 <= len(output.token_ids) < LONG.max_new_tokens
    assert output.token_ids == tokens(chunks)
    assert len(output.logprobs) == len(output.versions) == len(output.token_ids) and set(output.versions) == {0}
    assert chunks[-1].finish_reason is FinishReason.ABORT


def test_abort_none_ends_every_request(running_kind: Kind) -> None:
    async def body(engine):
        tasks = [asyncio.ensure_future(collect(engine, PROMPT, LONG, rid)) for rid in ("n-1", "n-2")]
        await asyncio.sleep(0)
        await collect(engine, [7, 8, 9], SHORT, "n-tick")
        outputs = await engine.abort()
        return outputs, await asyncio.gather(*tasks), await engine.abort()

    outputs, streams, again = run(running_kind, body)
    assert sorted(o.request_id for o in outputs) == ["n-1", "n-2"]
    assert all(o.finish_reason is FinishReason.ABORT and len(o.token_ids) < LONG.max_new_tokens for o in outputs)
    assert all(chunks[-1].finish_reason is FinishReason.ABORT for chunks in streams)
    assert again == []


def test_unknown_ids_raise_and_abort_nothing(running_kind: Kind) -> None:
    async def body(engine):
        task = await started(engine, "u-1")
        with pytest.raises(UnknownIdError, match=r"abort: unknown or finished request ids \['nope'\]"):
            await engine.abort(["u-1", "nope"])
        return await task

    chunks = run(running_kind, body)
    assert chunks[-1].finish_reason is FinishReason.LENGTH and len(tokens(chunks)) == LONG.max_new_tokens


def test_leaving_a_stream_early_aborts_its_request(running_kind: Kind) -> None:
    async def body(engine):
        stream = engine.generate(PROMPT, LONG, "l-1")
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await stream.aclose()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while running_kind.live(engine):  # the abort of an abandoned stream runs in the background
            assert loop.time() < deadline, "the abandoned request is still live"
            await asyncio.sleep(0.01)
        with pytest.raises(UnknownIdError):
            await engine.abort("l-1")
        return engine.stats().generated_tokens

    assert run(running_kind, body) < LONG.max_new_tokens


# Weights, memory, health -------------------------------------------------------------------------------

def test_update_weights_sets_the_version_of_later_tokens(kind: Kind) -> None:
    async def body(engine):
        before = await collect(engine, PROMPT, SHORT, "w-1")
        with pytest.raises(InvalidArgumentError, match=r"^version must be an integer, got '3'$"):
            await engine.update_weights(kind.weights(), "3")
        await engine.update_weights(kind.weights(), 3)
        return before, await collect(engine, PROMPT, SHORT, "w-2")

    before, after = run(kind, body)
    assert {c.weight_version for c in before} == {0} and {c.weight_version for c in after} == {3}


def test_memory_tags_are_normalised_the_same_way(kind: Kind) -> None:
    async def body(engine):
        await engine.release_memory("kv_cache")
        await engine.resume_memory(["kv_cache"])
        await engine.release_memory(["cuda_graph"])
        await engine.resume_memory("cuda_graph")
        await engine.release_memory()
        await engine.resume_memory(list(MEMORY_TAGS))
        with pytest.raises(InvalidArgumentError) as err:
            await engine.release_memory(["kv_cache", "gpu"])
        return str(err.value), tokens(await collect(engine, PROMPT, SHORT, "m-1")), engine.health()["status"]

    message, after, status = run(kind, body)
    assert message == "unknown memory tags ['gpu'] (allowed: ['weights', 'kv_cache', 'cuda_graph'])"
    assert len(after) == 2 and status == "ok"


# The server serves any ServableEngine --------------------------------------------------------------------

def test_the_server_reports_the_capacity_of_the_engine_it_serves_and_refuses_other_objects() -> None:
    async def info(url: str) -> dict[str, Any]:
        async with SGLangEngine(SGLangEngineConfig(worker_urls=(url,))) as client:
            return (await client.server_info())[url]

    with _served(_sim) as url:
        served = asyncio.run(info(url))
    assert {k: served[k] for k in ("page_size", "max_total_num_tokens", "context_length", "device")} == {
        "page_size": 16, "max_total_num_tokens": 10_000, "context_length": 10_000, "device": "simulated"}
    assert isinstance(_sim(), ServableEngine) and isinstance(_embedded(), ServableEngine)
    client = SGLangEngine(SGLangEngineConfig(worker_urls=("http://127.0.0.1:1",)))
    with pytest.raises(ConfigError, match="EmbeddedServer serves a ServableEngine .* got a SGLangEngine"):
        EmbeddedServer(client)  # type: ignore[arg-type]
