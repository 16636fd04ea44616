"""The SGLang adapter against live embedded servers on loopback: streaming deltas, token-exact resume,
aborts, weights, memory, balancing over workers and a router, errors, the launcher, one APRIL step."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace

import aiohttp
import numpy as np
import pytest
from _engine_utils import greedy_reference, tiny_model
from _sglang_utils import engine_state, in_flight, live_server, wait_for
from _torch_threads import one_torch_thread
from aiohttp import web

from april_ext import ListDataSource, Prompt, Scheduler, SchedulerConfig
from april_ext.batch import FinishReason
from april_ext.errors import ConfigError, InvalidArgumentError, UnknownIdError
from april_ext.model import save_pretrained
from april_ext.protocol import GenerationChunk, SamplingParams
from april_ext.rollout import RolloutEngine, RolloutLoop
from april_ext.sglang import (
    SGLangBadRequestError,
    SGLangConnectionError,
    SGLangEngine,
    SGLangEngineConfig,
    SGLangHTTPError,
    SGLangLaunchError,
    SGLangServerArgs,
    free_port,
    launch_sglang_server,
    wire_rid,
)

PROMPT = [5, 17, 33, 2, 60]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    """The reference copy of the served weights (each server owns its own instance)."""
    return tiny_model()


@pytest.fixture(scope="module")
def server():
    with one_torch_thread(), live_server(tiny_model()) as s:
        yield s


def run(coro):
    return asyncio.run(coro)


@contextlib.asynccontextmanager
async def adapter(*urls: str, **overrides) -> AsyncIterator[SGLangEngine]:
    async with SGLangEngine(SGLangEngineConfig(worker_urls=urls, **overrides)) as engine:
        yield engine


async def collect(engine: SGLangEngine, ids, params, rid) -> list[GenerationChunk]:
    return [chunk async for chunk in engine.generate(ids, params, rid)]


def tokens(chunks: list[GenerationChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


async def until_tokens(engine: SGLangEngine, rid: str, n: int) -> None:
    async def enough() -> bool:
        state = engine._inflight.get(rid)
        return state is not None and len(state.token_ids) >= n
    await wait_for(enough)


# Configuration -------------------------------------------------------------------------------------

def test_config_validation_names_the_field() -> None:
    with pytest.raises(ConfigError, match="exactly one of worker_urls"):
        SGLangEngineConfig()
    with pytest.raises(ConfigError, match="exactly one of worker_urls"):
        SGLangEngineConfig(worker_urls=("http://a:1",), router_url="http://r:2")
    with pytest.raises(ConfigError, match="not an http"):
        SGLangEngineConfig(worker_urls=("a:1",))
    with pytest.raises(ConfigError, match="not one string"):
        SGLangEngineConfig(worker_urls="http://a:1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="balance must be one of"):
        SGLangEngineConfig(worker_urls=("http://a:1",), balance="random")
    with pytest.raises(ConfigError, match="stream must be True or False"):
        SGLangEngineConfig(worker_urls=("http://a:1",), stream="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="retries must be an integer >= 0"):
        SGLangEngineConfig(worker_urls=("http://a:1",), retries=-1)
    assert SGLangEngineConfig(worker_urls=("http://a:1/",)).worker_urls == ("http://a:1",)


def test_wire_rids_are_prefix_free() -> None:
    ids = ["s-1", "s-10", "s-1:0", "", "1:s", "12"]
    wires = [wire_rid(i) for i in ids]
    for a, wa in zip(ids, wires):
        for b, wb in zip(ids, wires):
            if a != b:
                assert not wb.startswith(wa), (a, b)


# Generation ----------------------------------------------------------------------------------------

def test_is_a_rollout_engine_and_streams_deltas_with_logprobs_and_versions(server, model) -> None:
    async def body():
        async with adapter(server.url) as engine:
            assert isinstance(engine, RolloutEngine)
            assert engine.health()["status"] == "ok"
            chunks = await collect(engine, PROMPT, GREEDY, "d-1")
            return chunks, engine.stats()

    chunks, stats = run(body())
    assert tokens(chunks) == greedy_reference(model, PROMPT, 24)
    assert all(len(c.token_ids) == len(c.logprobs) == 1 for c in chunks)
    assert all(c.weight_version == 0 and c.request_id == "d-1" for c in chunks)
    assert all(math.isfinite(lp) and lp <= 0 for c in chunks for lp in c.logprobs)
    assert [c.finish_reason for c in chunks] == [None] * 23 + [FinishReason.LENGTH]
    assert stats.requests == 1 and stats.generated_tokens == 24 and sum(stats.in_flight.values()) == 0


def test_stop_token_finishes_with_matched_stop(server, model) -> None:
    greedy = greedy_reference(model, PROMPT, 10)
    stop = greedy[4]
    params = SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=(stop,))

    async def body():
        async with adapter(server.url) as engine:
            return await collect(engine, PROMPT, params, "stop-1")

    chunks = run(body())
    assert tokens(chunks) == greedy[:greedy.index(stop) + 1]
    assert (chunks[-1].finish_reason, chunks[-1].matched_stop) == (FinishReason.STOP, stop)


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True),
    SamplingParams(max_new_tokens=40, temperature=1.0, top_k=20, seed=7, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_abort_then_resume_with_partial_is_token_exact(server, params) -> None:
    async def body():
        async with adapter(server.url) as engine:
            whole = await collect(engine, PROMPT, params, "whole")
            stream = asyncio.create_task(collect(engine, PROMPT, params, "part"))
            await until_tokens(engine, "part", 5)
            outputs = await engine.abort(["part"])
            streamed = await stream
            partial = outputs[0].token_ids
            rest = await collect(engine, PROMPT + partial, replace(params, max_new_tokens=40 - len(partial)),
                                 "part-resumed")
            return whole, outputs, streamed, rest

    whole, outputs, streamed, rest = run(body())
    (out,) = outputs
    assert out.finish_reason is FinishReason.ABORT and out.request_id == "part"
    assert 5 <= len(out.token_ids) < 40
    assert out.prompt_ids == PROMPT and len(out.logprobs) == len(out.versions) == len(out.token_ids)
    # The stream delivered exactly the partial output, then an ABORT chunk.
    assert tokens(streamed) == out.token_ids and streamed[-1].finish_reason is FinishReason.ABORT
    assert out.token_ids + tokens(rest) == tokens(whole)
    assert np.allclose([lp for c in streamed for lp in c.logprobs] + [lp for c in rest for lp in c.logprobs],
                       [lp for c in whole for lp in c.logprobs], atol=1e-5)


def test_non_streaming_mode_yields_one_chunk_and_aborts_with_the_partial_output(server) -> None:
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=5, ignore_eos=True)

    async def body():
        async with adapter(server.url, stream=False) as engine, aiohttp.ClientSession() as session:
            whole = await collect(engine, PROMPT, params, "ns-whole")
            before = (await engine_state(session, server.url))["generated_tokens"]
            task = asyncio.create_task(collect(engine, PROMPT, params, "ns-part"))

            async def started() -> bool:
                return (await engine_state(session, server.url))["generated_tokens"] >= before + 5
            await wait_for(started)
            outputs = await engine.abort(["ns-part"])
            part = await task
            partial = outputs[0].token_ids
            rest = await collect(engine, PROMPT + partial, replace(params, max_new_tokens=40 - len(partial)), "ns-rest")
            return whole, outputs[0], part, rest

    whole, output, part, rest = run(body())
    assert len(whole) == 1 and len(whole[0].token_ids) == len(whole[0].logprobs) == 40
    assert whole[0].finish_reason is FinishReason.LENGTH
    assert len(part) == 1 and part[0].finish_reason is FinishReason.ABORT
    assert part[0].token_ids == output.token_ids and 5 <= len(output.token_ids) < 40
    assert output.token_ids + tokens(rest) == tokens(whole)


def test_abort_one_id_leaves_ids_it_prefixes_running_and_abort_all_ends_the_rest(server) -> None:
    async def body():
        async with adapter(server.url) as engine:
            streams = {rid: asyncio.create_task(collect(engine, PROMPT, LONG, rid)) for rid in ("s-1", "s-10", "s-11")}
            for rid in streams:
                await until_tokens(engine, rid, 1)
            with pytest.raises(UnknownIdError, match="unknown or finished request ids"):
                await engine.abort(["s-2"])
            first = await engine.abort("s-1")
            still_running = [rid for rid, task in streams.items() if not task.done()]
            rest = await engine.abort()
            finished = {rid: await task for rid, task in streams.items()}
            return first, still_running, rest, finished, engine.stats()

    first, still_running, rest, finished, stats = run(body())
    assert [o.request_id for o in first] == ["s-1"]
    assert still_running == ["s-10", "s-11"]
    assert sorted(o.request_id for o in rest) == ["s-10", "s-11"]
    assert all(o.finish_reason is FinishReason.ABORT for o in first + rest)
    assert all(chunks[-1].finish_reason is FinishReason.ABORT for chunks in finished.values())
    assert stats.aborted == 3


def test_leaving_the_iteration_early_aborts_on_the_server(server) -> None:
    async def body():
        async with adapter(server.url) as engine, aiohttp.ClientSession() as session:
            async for chunk in engine.generate(PROMPT, LONG, "early"):
                if chunk.token_ids:
                    break
            await wait_for(lambda: _idle(session, server.url), timeout=10)
            return engine.stats()

    stats = run(body())
    assert sum(stats.in_flight.values()) == 0


async def _idle(session, url: str) -> bool:
    return await in_flight(session, url) == 0


# Weights and memory --------------------------------------------------------------------------------

def test_update_weights_from_dir_and_tensors_tag_later_chunks(tmp_path) -> None:
    first, second = tiny_model(seed=0), tiny_model(seed=1)
    save_pretrained(second, tmp_path / "ckpt")
    want_first, want_second = greedy_reference(first, PROMPT, 8), greedy_reference(second, PROMPT, 8)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    fresh_first = dict(tiny_model(seed=0).named_parameters())

    async def body(url):
        async with adapter(url) as engine:
            names = await engine.update_weights(tmp_path / "ckpt", 3)
            after_dir = await collect(engine, PROMPT, params, "w-1")
            loaded = await engine.update_weights(fresh_first, 4)
            after_tensors = await collect(engine, PROMPT, params, "w-2")
            with pytest.raises(SGLangBadRequestError) as err:
                await engine.update_weights({"model.no_such.weight": fresh_first["lm_head.weight"]}, 5)
            return names, after_dir, loaded, after_tensors, err.value, engine.health()

    with one_torch_thread(), live_server(first) as s:
        names, after_dir, loaded, after_tensors, err, health = run(body(s.url))
    assert names == sorted(n for n, _ in second.named_parameters())
    assert loaded == sorted(fresh_first)
    assert tokens(after_dir) == want_second and {c.weight_version for c in after_dir} == {3}
    assert tokens(after_tensors) == want_first and {c.weight_version for c in after_tensors} == {4}
    assert err.status == 400 and err.url.endswith("/update_weights_from_tensor") and "no_such" in str(err)
    assert health["weight_version"] == 4


def test_named_tensors_travel_through_a_weight_sync_dir(tmp_path) -> None:
    new = tiny_model(seed=1)
    want = greedy_reference(new, PROMPT, 8)
    fresh = {name: p.detach().clone() for name, p in new.named_parameters()}

    async def body(url):
        async with adapter(url, weight_sync_dir=str(tmp_path / "sync")) as engine:
            names = await engine.update_weights(fresh, 9)
            return names, await collect(engine, PROMPT, SamplingParams(max_new_tokens=8, temperature=0.0,
                                                                       ignore_eos=True), "sync")

    with one_torch_thread(), live_server() as s:
        names, chunks = run(body(s.url))
    assert names == sorted(fresh) and (tmp_path / "sync" / "model.safetensors.index.json").is_file()
    assert tokens(chunks) == want and {c.weight_version for c in chunks} == {9}


def test_weight_update_mid_stream_changes_the_version_of_later_tokens(tmp_path) -> None:
    save_pretrained(tiny_model(seed=1), tmp_path / "ckpt")

    async def body(url):
        async with adapter(url) as engine:
            stream = asyncio.create_task(collect(engine, PROMPT, SamplingParams(max_new_tokens=150, temperature=0.0,
                                                                                ignore_eos=True), "mid"))
            await until_tokens(engine, "mid", 3)
            await engine.update_weights(tmp_path / "ckpt", 1)
            return await stream

    with one_torch_thread(), live_server() as s:
        chunks = run(body(s.url))
    versions = [c.weight_version for c in chunks for _ in c.token_ids]
    assert len(versions) == 150 and versions[0] == 0 and versions[-1] == 1
    assert versions == sorted(versions)


def test_release_then_two_stage_resume_with_update(tmp_path) -> None:
    model = tiny_model(seed=0)
    save_pretrained(model, tmp_path / "ckpt")
    want = greedy_reference(model, PROMPT, 6)

    async def body(url):
        async with adapter(url) as engine, aiohttp.ClientSession() as session:
            await engine.release_memory()
            async with session.get(f"{url}/server_info") as resp:
                released = (await resp.json())["internal_states"][0]["paused_tags"]
            await engine.resume_and_update(tmp_path / "ckpt", 2)
            chunks = await collect(engine, PROMPT, SamplingParams(max_new_tokens=6, temperature=0.0,
                                                                  ignore_eos=True), "after")
            with pytest.raises(InvalidArgumentError, match="memory tags"):
                await engine.release_memory(["activations"])
            return released, chunks

    with one_torch_thread(), live_server(model, weights_cpu_backup=False) as s:
        released, chunks = run(body(s.url))
    assert sorted(released) == ["kv_cache", "weights"]
    assert tokens(chunks) == want and {c.weight_version for c in chunks} == {2}


def test_pause_ends_running_streams_and_holds_new_requests_until_continue(server) -> None:
    async def body():
        async with adapter(server.url) as engine:
            running = asyncio.create_task(collect(engine, PROMPT, LONG, "p-1"))
            await until_tokens(engine, "p-1", 1)
            await engine.pause_generation()
            aborted = await running
            held = asyncio.create_task(collect(engine, PROMPT, SamplingParams(max_new_tokens=3, temperature=0.0),
                                               "p-2"))
            await asyncio.sleep(0.2)
            held_while_paused = not held.done()
            with pytest.raises(InvalidArgumentError, match="mode must be one of"):
                await engine.pause_generation("later")
            await engine.continue_generation()
            return aborted, held_while_paused, await held

    aborted, held_while_paused, held = run(body())
    assert aborted[-1].finish_reason is FinishReason.ABORT and 0 < len(tokens(aborted)) < 200
    assert held_while_paused and len(tokens(held)) == 3


# Errors --------------------------------------------------------------------------------------------

def test_bad_input_raises_bad_request_with_url_status_and_body(server) -> None:
    async def body():
        async with adapter(server.url) as engine:
            with pytest.raises(SGLangBadRequestError) as err:
                await collect(engine, [1, 5000], GREEDY, "bad")
            with pytest.raises(InvalidArgumentError, match="input_ids"):
                await collect(engine, [], GREEDY, "empty")
            ok = await collect(engine, PROMPT, SamplingParams(max_new_tokens=2, temperature=0.0), "ok")
            return err.value, ok

    err, ok = run(body())
    assert isinstance(err, InvalidArgumentError)
    assert err.status == 400 and err.url == f"{server.url}/generate" and "outside the vocabulary" in err.body
    assert len(tokens(ok)) == 2


def test_unreachable_server_fails_fast_for_generate_and_after_retries_for_idempotent_calls() -> None:
    url = f"http://127.0.0.1:{free_port()}"

    async def body():
        async with adapter(url, retries=2, backoff_s=0.01, connect_timeout_s=2.0) as engine:
            health = engine.health()
            with pytest.raises(SGLangConnectionError) as gen_err:
                await collect(engine, PROMPT, GREEDY, "x")
            with pytest.raises(SGLangConnectionError) as call_err:
                await engine.release_memory()
            return health, gen_err.value, call_err.value

    health, gen_err, call_err = run(body())
    assert health["status"] == "error" and url in health["error"]
    assert gen_err.url == f"{url}/generate" and gen_err.status is None
    assert call_err.url == f"{url}/release_memory_occupation" and "after 3 attempts" in str(call_err)


class _ScriptedServer:
    """Answers /generate with a fixed list of SSE payloads: SGLang behaviours the embedded server never shows."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app)

    async def __aenter__(self) -> str:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def __aexit__(self, *exc_info: object) -> None:
        await self.runner.cleanup()

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in self.events:
            await response.write(f"data: {event}\n\n".encode())
        await response.write_eof()
        return response


def _event(ids, reason=None, version="default") -> str:
    meta = {"finish_reason": reason, "weight_version": version,
            "output_token_logprobs": [[-0.5, t, None] for t in ids]}
    return json.dumps({"output_ids": ids, "meta_info": meta})


ABORT = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


@pytest.mark.parametrize("events, expect", [
    # Several tokens per event, labels "default" then "5", a stop string (matched is not a token id).
    ([_event([4, 5]), _event([4, 5, 6, 7], version="5"),
      _event([4, 5, 6, 7, 8], {"type": "stop", "matched": "</s>"}, "5"), "[DONE]"],
     [([4, 5], 0, None), ([6, 7], 5, None), ([8], 5, FinishReason.STOP)]),
    # An abort answered from the waiting queue, without output_ids (older servers).
    (['{"meta_info": {"id": "x", "finish_reason": {"type": "abort", "message": '
      '"Abort in waiting queue"}}}', "[DONE]"], [([], 0, FinishReason.ABORT)]),
    ([_event([1]), _event([1, 2], ABORT), "[DONE]"], [([1], 0, None), ([2], 0, FinishReason.ABORT)]),
])
def test_sglang_event_shapes_become_deltas(events, expect) -> None:
    async def body():
        async with _ScriptedServer(events) as url, adapter(url) as engine:
            return await collect(engine, [1, 2], GREEDY, "e")

    chunks = run(body())
    assert [(c.token_ids, c.weight_version, c.finish_reason) for c in chunks] == expect
    assert all(c.matched_stop is None for c in chunks)


@pytest.mark.parametrize("events, error, fragment", [
    (['{"error": {"message": "prompt too long"}}', "[DONE]"], SGLangBadRequestError, "prompt too long"),
    ([_event([], {"type": "abort", "message": "input is longer than the context", "status_code": 400,
                  "err_type": "BadRequestError"}), "[DONE]"], SGLangBadRequestError, "longer than the context"),
    ([_event([1, 2]), _event([3]), "[DONE]"], SGLangHTTPError, "incremental-streaming-output"),
    ([_event([1]), "[DONE]"], SGLangHTTPError, "without a finish reason"),
    ([_event([1], {"type": "eos"}), "[DONE]"], SGLangHTTPError, "unknown finish_reason"),
])
def test_sglang_stream_errors_raise_with_the_url(events, error, fragment) -> None:
    async def body():
        async with _ScriptedServer(events) as url, adapter(url) as engine:
            with pytest.raises(error) as err:
                await collect(engine, [1, 2], GREEDY, "e")
            return url, err.value

    url, err = run(body())
    assert fragment in str(err) and err.url == f"{url}/generate"


# Several servers -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_servers() -> Iterator[tuple[str, str]]:
    with one_torch_thread(), live_server(tiny_model()) as a, live_server(tiny_model()) as b:
        yield a.url, b.url


@pytest.mark.parametrize("balance", ["least_loaded", "round_robin"])
def test_requests_spread_over_workers_and_abort_all_reaches_each(two_servers, balance) -> None:
    async def body():
        async with adapter(*two_servers, balance=balance) as engine:
            streams = [asyncio.create_task(collect(engine, PROMPT, LONG, f"b-{i}")) for i in range(4)]
            await asyncio.sleep(0)
            spread = dict(engine.stats().in_flight)
            for i in range(4):
                await until_tokens(engine, f"b-{i}", 1)
            outputs = await engine.abort()
            await asyncio.gather(*streams)
            return spread, outputs

    spread, outputs = run(body())
    assert spread == {two_servers[0]: 2, two_servers[1]: 2}
    assert len(outputs) == 4 and all(o.finish_reason is FinishReason.ABORT for o in outputs)


def test_router_lists_workers_for_aborts_and_weight_updates(two_servers, model, tmp_path) -> None:
    save_pretrained(model, tmp_path / "ckpt")

    async def body():
        router = _FakeRouter(list(two_servers))
        url = await router.start()
        try:
            async with SGLangEngine(SGLangEngineConfig(router_url=url)) as engine:
                workers = await engine.worker_urls()
                done = await collect(engine, PROMPT, GREEDY, "r-0")
                running = asyncio.create_task(collect(engine, PROMPT, LONG, "r-1"))
                await until_tokens(engine, "r-1", 1)
                aborted = await engine.abort(["r-1"])
                await running
                await engine.update_weights(tmp_path / "ckpt", 6)
                info = await engine.server_info()
                return workers, done, aborted, info, router.generates
        finally:
            await router.stop()

    workers, done, aborted, info, generates = run(body())
    assert workers == list(two_servers)
    assert tokens(done) == greedy_reference(model, PROMPT, 24)
    assert aborted[0].finish_reason is FinishReason.ABORT
    assert {u: i["weight_version"] for u, i in info.items()} == {two_servers[0]: "6", two_servers[1]: "6"}
    assert generates == 2


class _FakeRouter:
    """An old-style router: no /workers (404), /list_workers, and /generate forwarded round-robin."""

    def __init__(self, workers: list[str]) -> None:
        self.workers = workers
        self.generates = 0
        app = web.Application()
        app.router.add_get("/list_workers", self.list_workers)
        app.router.add_post("/generate", self.generate)
        self.runner = web.AppRunner(app)
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> str:
        self.session = aiohttp.ClientSession()
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        await self.runner.cleanup()
        assert self.session is not None
        await self.session.close()

    async def list_workers(self, request: web.Request) -> web.Response:
        return web.json_response({"urls": self.workers})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        target = self.workers[self.generates % len(self.workers)]
        self.generates += 1
        assert self.session is not None
        async with self.session.post(f"{target}/generate", data=await request.read(),
                                     headers={"Content-Type": "application/json"}) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={"Content-Type": upstream.content_type})
            await response.prepare(request)
            async for data in upstream.content.iter_any():
                await response.write(data)
            await response.write_eof()
            return response


# Launcher ------------------------------------------------------------------------------------------

def test_launcher_starts_waits_for_health_and_stops_a_stand_in_server(tmp_path, model) -> None:
    save_pretrained(model, tmp_path / "ckpt")
    args = SGLangServerArgs(model_path=str(tmp_path / "ckpt"), enable_weights_cpu_backup=True,
                            extra_args=("--num-blocks", "64", "--block-size", "4"))
    assert args.argv(1234)[:8] == ["--model-path", str(tmp_path / "ckpt"), "--host", "127.0.0.1", "--port", "1234",
                                   "--tp", "1"]
    assert {"--enable-memory-saver", "--skip-tokenizer-init", "--enable-weights-cpu-backup"} <= set(args.argv(1))

    async def use(url):
        async with adapter(url) as engine:
            chunks = await collect(engine, PROMPT, SamplingParams(max_new_tokens=6, temperature=0.0,
                                                                  ignore_eos=True), "l-1")
            await engine.release_memory()
            await engine.resume_memory()
            return chunks

    with launch_sglang_server(args, module="april_ext.server", env={"OMP_NUM_THREADS": "1"}, timeout_s=120,
                              log_path=str(tmp_path / "server.log")) as server:
        chunks = run(use(server.url))
        assert server.healthy()
    assert tokens(chunks) == greedy_reference(model, PROMPT, 6)
    assert server.process.returncode == 0 and not server.healthy()  # SIGTERM: a clean shutdown
    assert "listening on" in (tmp_path / "server.log").read_text()


def test_a_server_killed_mid_stream_raises_a_connection_error_naming_it_and_close_releases_the_session(
        tmp_path, model) -> None:
    save_pretrained(model, tmp_path / "ckpt")
    args = SGLangServerArgs(model_path=str(tmp_path / "ckpt"), extra_args=("--num-blocks", "128", "--block-size", "4"))

    async def use(url: str, pid: int):
        first, second = (SGLangEngine(SGLangEngineConfig(worker_urls=(url,), retries=0, abort_timeout_s=5.0))
                         for _ in range(2))
        await first.start()
        await second.start()
        sessions = (first._http.session, second._http.session)
        streamed, abandoned = first.generate(PROMPT, LONG, "killed-1"), second.generate(PROMPT, LONG, "killed-2")
        await anext(streamed)
        await anext(abandoned)
        os.killpg(pid, signal.SIGKILL)
        close_error = None
        try:  # "killed-2" is still in flight: its abort cannot reach the dead server
            await second.close()
        except BaseException as exc:  # noqa: BLE001 - the test reports what close() raised
            close_error = exc
        with pytest.raises(SGLangHTTPError) as err:
            async with first:  # what the caller reads is the stream's error, whatever close() meets
                async for _ in streamed:
                    pass
        return err.value, close_error, sessions

    with launch_sglang_server(args, module="april_ext.server", env={"OMP_NUM_THREADS": "1"}, timeout_s=120,
                              log_path=str(tmp_path / "server.log")) as server:
        error, close_error, sessions = run(use(server.url, server.process.pid))
    assert isinstance(error, SGLangConnectionError), repr(error)
    assert str(error).startswith(f"{server.url}/generate broke its stream mid-response"), str(error)
    assert isinstance(error.__cause__, aiohttp.ClientError), repr(error.__cause__)
    assert close_error is None, repr(close_error)
    assert all(session.closed for session in sessions)


def test_launcher_reports_a_server_that_exits_with_its_log(tmp_path) -> None:
    args = SGLangServerArgs(model_path=str(tmp_path / "no_checkpoint"))
    with pytest.raises(SGLangLaunchError, match="exited with code 2") as err:
        launch_sglang_server(args, module="april_ext.server", timeout_s=120, log_path=str(tmp_path / "log"))
    assert "april-ext serve: error: no config.json" in str(err.value)


# One APRIL step through the real loop and scheduler --------------------------------------------------

@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_april_rollout_steps_through_the_loop_over_the_adapter(model, stream) -> None:
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    prompts = [Prompt(i, [(7 * i + j) % 101 for j in range(4 + i % 3)]) for i in range(12)]
    config = SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=2, over_sampling_batch_size=4,
                             max_response_len=32)
    scheduler = Scheduler(config, ListDataSource(prompts))
    # Stop tokens make response lengths vary, so some samples are still running when 2 groups are done.
    sampling = SamplingParams(temperature=1.0, stop_token_ids=tuple(range(0, 101, 9)))

    def reward(prompt: Prompt, response: np.ndarray) -> float:
        return float(len(response) % 2)

    async def body(url):
        async with adapter(url, stream=stream) as engine, aiohttp.ClientSession() as session:
            loop = RolloutLoop(engine, scheduler, reward, sampling=sampling, seed=3)
            first = await loop.run_step(0)
            idle_after_step = await in_flight(session, url) == 0
            # The "trained" policy: same values, new version, as a trainer's weight push would be.
            await engine.update_weights(weights, 1)
            second = await loop.run_step(1)
            await loop.drain_rewards()
            return first, idle_after_step, second

    with one_torch_thread(), live_server(tiny_model()) as server:
        first, idle_after_step, second = run(body(server.url))
    assert idle_after_step
    for version, result in enumerate((first, second)):
        batch = result.batch
        assert batch.n_groups == 2 and batch.n_samples == 4
        assert (batch.response_lens >= 1).all() and (batch.response_lens <= 32).all()
        for i in range(batch.n_samples):
            lo, hi = int(batch.offsets[i]) + int(batch.prompt_lens[i]), int(batch.offsets[i + 1])
            versions = batch.versions[lo:hi].tolist()
            assert versions == sorted(versions) and set(versions) <= set(range(version + 1))
            assert (batch.behavior_logprobs[lo:hi] <= 0).all()
            if batch.finish_reasons[i] == FinishReason.STOP:
                assert batch.tokens[hi - 1] in sampling.stop_token_ids
    # Prioritized resumption: every partial sample buffered by the first step is resumed by the second.
    assert second.metrics.resumed_requests == first.metrics.scheduler["buffered_samples"]
    assert first.metrics.generated_tokens > 0
