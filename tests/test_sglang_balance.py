"""Least-loaded routing over several servers by their reported load (the SGLang adapter's worker pool, direct
mode): the embedded server serves each release's load report, the adapter reads it and sends a new or
continued request to the server with the fewest KV tokens, counting what it sent since the reading. The pool's
membership driven from outside (a Ray run's engine pool): a dropped worker gets nothing (its request comes back as a
partial, failover does not bring it back) until it is admitted, and a worker admitted on a new url gets requests."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

import aiohttp
import pytest
from _engine_utils import TINY, tiny_model
from _sglang_utils import get, live_server, wait_for
from _torch_threads import one_torch_thread

from april_ext.batch import FinishReason
from april_ext.errors import ConfigError
from april_ext.protocol import SamplingParams, sglang_wire
from april_ext.sglang import SGLangEngine, SGLangEngineConfig

LONG = SamplingParams(max_new_tokens=150, temperature=0.0, ignore_eos=True)
SHORT = [5, 17, 33, 2, 60]


@pytest.fixture(scope="module")
def two_servers() -> Iterator[tuple[str, str]]:
    with one_torch_thread(), live_server(tiny_model()) as a, live_server(tiny_model()) as b:
        yield a.url, b.url


def test_load_reports_of_each_release_read_as_tokens() -> None:
    assert sglang_wire.load_tokens({"loads": [{"num_used_tokens": 7, "num_total_tokens": 9},
                                              {"num_total_tokens": 4}]}) == 13
    assert sglang_wire.load_tokens([{"dp_rank": 0, "num_reqs": 2, "num_tokens": 30}]) == 30
    assert sglang_wire.load_tokens({"load": 12}) == 12
    for unreadable in ({"status": "ok"}, [{"num_tokens": -1}], {"loads": [{"num_reqs": 1}]}, "busy"):
        assert sglang_wire.load_tokens(unreadable) is None
    assert [d.load_path for d in sglang_wire.DIALECTS.values()] == ["/get_load"] * 4 + ["/v1/loads"]


@pytest.mark.parametrize("compat", list(sglang_wire.DIALECTS))
def test_the_embedded_server_reports_its_load_as_its_release_does(compat) -> None:
    dialect = sglang_wire.DIALECTS[compat]

    async def body(url: str) -> tuple[int, object, int, object]:
        async with aiohttp.ClientSession() as session, \
                SGLangEngine(SGLangEngineConfig(worker_urls=(url,))) as engine:
            idle = await get(session, f"{url}{dialect.load_path}")
            stream = engine.generate(list(range(1, 41)), LONG, "busy")
            await anext(stream)
            busy = await get(session, f"{url}{dialect.load_path}")
            await engine.abort()
            await stream.aclose()
            return idle[0], idle[1], busy[0], busy[1]

    with one_torch_thread(), live_server(tiny_model(), sglang_compat=compat) as server:
        idle_status, idle, busy_status, busy = asyncio.run(body(server.url))
    assert idle_status == busy_status == 200
    assert sglang_wire.load_tokens(idle) == 0
    # 40 prompt tokens and the first ones generated hold KV blocks (block size 4).
    assert sglang_wire.load_tokens(busy) >= 40


def test_requests_go_to_the_server_reporting_the_least_load(two_servers) -> None:
    busy_url, idle_url = two_servers

    async def body() -> tuple[dict[str, int], dict[str, int]]:
        # Another client fills the first server with long requests, held there with their KV.
        async with SGLangEngine(SGLangEngineConfig(worker_urls=(busy_url,))) as other, \
                SGLangEngine(SGLangEngineConfig(worker_urls=two_servers, load_interval_s=0.05)) as engine:
            streams = [other.generate(list(range(1 + i, 61 + i)), LONG, f"other-{i}") for i in range(3)]
            for stream in streams:
                await anext(stream)
            await other.pause_generation("in_place")

            async def read() -> bool:
                return engine._workers.reported.get(busy_url, 0) >= 180 and idle_url in engine._workers.reported
            await wait_for(read)
            mine = [engine.generate(SHORT, LONG, f"mine-{i}") for i in range(4)]
            # Opened in turn (a request sent to the paused server would get no first token).
            for stream in mine:
                await asyncio.wait_for(anext(stream), 30)
            spread = dict(engine.stats().in_flight)
            reported = dict(engine._workers.reported)
            await other.continue_generation()
            await engine.abort()
            await other.abort()
            for stream in (*streams, *mine):
                await stream.aclose()
            return spread, reported

    spread, reported = asyncio.run(body())
    # Counted by this client's requests in flight alone, they would alternate (2 and 2).
    assert spread == {busy_url: 0, idle_url: 4}, reported


def test_load_interval_is_validated() -> None:
    with pytest.raises(ConfigError, match="load_interval_s must be None"):
        SGLangEngineConfig(worker_urls=("http://a:1",), load_interval_s=0)



def test_a_dropped_worker_gets_nothing_until_admitted_and_its_requests_come_back_as_partials(two_servers) -> None:
    # The membership a Ray run with ray_routing "least_loaded" drives from its engine pool's watch.
    first, second = two_servers

    async def body() -> dict[str, object]:
        config = SGLangEngineConfig(worker_urls=two_servers, worker_timeout_s=1.0, load_interval_s=0.05)
        async with SGLangEngine(config) as engine:
            seen: dict[str, object] = {}
            running = engine.generate(SHORT, LONG, "running")
            tokens = list((await asyncio.wait_for(anext(running), 30)).token_ids)
            ((url, _),) = [(u, n) for u, n in engine.stats().in_flight.items() if n]
            other = second if url == first else first
            engine.drop_worker(url, "its actor is down")
            async for chunk in running:
                tokens += chunk.token_ids
                seen["partial"] = (chunk.finish_reason, len(tokens))
            # Failover checks every worker_timeout_s / 4 and brings back removed workers that answer: not this one.
            await asyncio.sleep(4 * config.worker_timeout_s)
            seen["health"] = sorted((await engine.check_health())["workers"])
            # As long as the positions allow, and nothing awaited between their first tokens and the admitted
            # request's but its own dispatch: they must still run when it is routed.
            longest = dataclasses.replace(LONG, max_new_tokens=TINY.max_position_embeddings - len(SHORT))
            mine = [engine.generate(SHORT, longest, f"while-dropped-{i}") for i in range(3)]
            for stream in mine:
                await asyncio.wait_for(anext(stream), 30)
            seen["while_dropped"] = dict(engine.stats().in_flight)
            seen["pool"] = engine.pool_health()
            engine.admit_worker(url)
            late = engine.generate(SHORT, LONG, "admitted")
            await asyncio.wait_for(anext(late), 30)
            seen["admitted"] = dict(engine.stats().in_flight)
            await engine.abort()
            for stream in (*mine, late):
                await stream.aclose()
            return {**seen, "url": url, "other": other}

    seen = asyncio.run(body())
    url, other = seen["url"], seen["other"]
    finish, count = seen["partial"]
    assert finish is FinishReason.ABORT and 1 <= count < LONG.max_new_tokens
    assert seen["while_dropped"] == {url: 0, other: 3}
    assert seen["pool"]["live"] == [other] and seen["pool"]["removed"] == {url: "its actor is down"}
    assert seen["health"] == [other]
    # Admitted (idle, while the other runs 3 requests), it gets the next one.
    assert seen["admitted"] == {url: 1, other: 3}


def test_a_worker_admitted_on_a_new_url_gets_requests_and_calls(two_servers) -> None:
    # A Ray engine restarted by Ray serves on a new url.
    first, second = two_servers

    async def body() -> tuple[dict[str, int], list[str]]:
        async with SGLangEngine(SGLangEngineConfig(worker_urls=(first,), load_interval_s=0.05)) as engine:
            engine.admit_worker(second)
            streams = [engine.generate(SHORT, LONG, f"new-url-{i}") for i in range(2)]
            for stream in streams:
                await asyncio.wait_for(anext(stream), 30)
            spread = dict(engine.stats().in_flight)
            health = sorted((await engine.check_health())["workers"])
            await engine.abort()
            for stream in streams:
                await stream.aclose()
            return spread, health

    spread, health = asyncio.run(body())
    assert spread == {first: 1, second: 1}
    assert health == sorted(two_servers)
