"""Failover of the SGLang adapter (april_ext.sglang.failover) against real `april-ext serve` subprocesses
on loopback, directly (multi-url) and through the real router: a worker killed (SIGKILL) or stopped
(SIGSTOP) mid-step is removed, the requests it ran come back as resumable partials and the step completes
on the other worker with nothing lost or duplicated; the worker, restarted on its port or continued,
rejoins with the current weights and gets requests again."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import time
from collections.abc import Iterator

import aiohttp
import numpy as np
import pytest
from _engine_utils import greedy_reference, tiny_model
from _torch_threads import one_torch_thread

from april_ext import ListDataSource, Prompt, Scheduler, SchedulerConfig
from april_ext.batch import FinishReason
from april_ext.errors import ConfigError
from april_ext.model import save_pretrained
from april_ext.protocol import SamplingParams
from april_ext.rollout import RolloutLoop
from april_ext.sglang import (
    SGLangEngine,
    SGLangEngineConfig,
    SGLangNoWorkerError,
    SGLangServerArgs,
    SGLangServerProcess,
    free_port,
    launch_sglang_server,
)
from april_ext.sglang.requests import wire_rid
from april_ext.training.engines import engine_metrics

PROMPT = [5, 17, 33, 2, 60]
TIMEOUT_S = 2.0  # worker_timeout_s of these tests
RESPONSE_LEN = 160
HAS_ROUTER = importlib.util.find_spec("sglang_router") is not None


def test_worker_timeout_is_none_or_a_positive_number() -> None:
    assert SGLangEngineConfig(worker_urls=("http://a:1",)).worker_timeout_s is None
    assert SGLangEngineConfig(worker_urls=("http://a:1",), worker_timeout_s=0.5).worker_timeout_s == 0.5
    for bad in (0, -1.0, float("inf"), "5", True):
        with pytest.raises(ConfigError, match="worker_timeout_s must be None .* got"):
            SGLangEngineConfig(worker_urls=("http://a:1",), worker_timeout_s=bad)


# Live servers --------------------------------------------------------------------------------------------

def _launch(ckpt: str, port: int, log: str) -> SGLangServerProcess:
    # Two sequences at a time: requests queue, so the step lasts long enough to hit it mid-way.
    args = SGLangServerArgs(model_path=ckpt, port=port, extra_args=("--num-blocks", "512", "--block-size", "4",
                                                                    "--max-num-seqs", "2"))
    return launch_sglang_server(args, module="april_ext.server", env={"OMP_NUM_THREADS": "1"}, timeout_s=120,
                                log_path=log)


@contextlib.contextmanager
def _servers(tmp_path, ckpt: str) -> Iterator[list[SGLangServerProcess]]:
    """Two servers on fixed ports (a restarted one comes back on its port); each is stopped on exit, a
    stopped (SIGSTOP) one continued first."""
    servers = [_launch(ckpt, free_port(), str(tmp_path / f"server{i}.log")) for i in range(2)]
    try:
        yield servers
    finally:
        for server in servers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.process.pid, signal.SIGCONT)
            server.stop()


async def _server_state(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(f"{url}/server_info", timeout=aiohttp.ClientTimeout(total=5)) as resp:
        return (await resp.json())["internal_states"][0]


async def _until(predicate, timeout_s: float, what: str) -> float:
    """Polls predicate() (sync or async) every 20 ms; returns the seconds it took."""
    start = time.monotonic()
    while True:
        ok = predicate()
        if asyncio.iscoroutine(ok):
            ok = await ok
        if ok:
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not reached within {timeout_s} s: {what}")
        await asyncio.sleep(0.02)


def _check_against_scheduler(scheduler: Scheduler, batch, prompts: dict[int, list[int]], trained) -> None:
    """Nothing lost or duplicated: every response of the batch is exactly the greedy continuation of its
    prompt under the pushed weights (a token lost or repeated at a resume would shift it), the batch has
    N distinct complete groups, and the tokens the scheduler received this step are the tokens it holds."""
    config = scheduler.config
    stats = scheduler.stats()
    assert batch.n_groups == config.rollout_batch_size
    assert len(set(batch.prompt_ids)) == batch.n_groups
    assert np.bincount(batch.group_index).tolist() == [config.n_samples_per_prompt] * batch.n_groups
    assert len(set(batch.sample_ids.tolist())) == batch.n_samples
    held = 0
    greedy: dict[int, list[int]] = {}
    for i in range(batch.n_samples):
        start, end = int(batch.offsets[i]), int(batch.offsets[i + 1])
        prompt_id = batch.prompt_ids[int(batch.group_index[i])]
        if prompt_id not in greedy:
            greedy[prompt_id] = greedy_reference(trained, prompts[prompt_id], RESPONSE_LEN)
        response = batch.tokens[start + len(prompts[prompt_id]):end].tolist()
        assert len(response) == RESPONSE_LEN and batch.finish_reasons[i] == FinishReason.LENGTH
        assert response == greedy[prompt_id], f"sample {batch.sample_ids[i]}"
        held += len(response)
    # Besides the batch: the partials buffered for a resume and the surplus groups' samples.
    in_batch = set(batch.sample_ids.tolist())
    for sid in scheduler.sample_ids("queued") + scheduler.sample_ids("done"):
        if sid not in in_batch:
            held += int(scheduler.sample(sid).token_ids.size)
    assert stats["batch_response_tokens"] == RESPONSE_LEN * batch.n_samples
    assert stats["generated_tokens"] == held, (stats, held)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "stop"])
@pytest.mark.parametrize("mode", ["direct", pytest.param("router", marks=pytest.mark.skipif(
    not HAS_ROUTER, reason="sglang-router is not installed (pip install -e '.[test]' installs it)"))])
def test_a_worker_lost_mid_step_fails_over_and_rejoins_with_the_current_weights(tmp_path, mode, fault) -> None:
    served, trained = tiny_model(seed=1), tiny_model(seed=2)
    ckpt = str(tmp_path / "ckpt")
    save_pretrained(served, ckpt)
    weights = {name: p.detach().clone() for name, p in trained.named_parameters()}
    prompts = {i: [(7 * i + j) % 101 for j in range(3 + i % 4)] for i in range(40)}
    # N' = N: the step needs every group, so the victim's requests must be resumed within it (with surplus
    # groups the other worker alone could complete the step, as it did behind the router's uneven routing).
    config = SchedulerConfig(rollout_batch_size=4, n_samples_per_prompt=2, over_sampling_batch_size=4,
                             max_response_len=RESPONSE_LEN)
    scheduler = Scheduler(config, ListDataSource([Prompt(i, ids) for i, ids in prompts.items()]))

    async def body(servers: list[SGLangServerProcess], router: str | None) -> dict:
        victim, other = servers
        urls = {"worker_urls": (victim.url, other.url)} if router is None else {"router_url": router}
        # timeout_s stays 600 s: a stalled stream must end by failover, not by the read timeout.
        engine_config = SGLangEngineConfig(**urls, worker_timeout_s=TIMEOUT_S, abort_timeout_s=20.0,
                                           weight_sync_dir=str(tmp_path / "sync"))
        async with SGLangEngine(engine_config) as engine, aiohttp.ClientSession() as session:
            await engine.update_weights(weights, version=1)  # the trainer's weights, version 1
            loop = RolloutLoop(engine, scheduler, lambda prompt, response: 1.0,
                               sampling=SamplingParams(temperature=0.0, ignore_eos=True))
            step = asyncio.create_task(loop.run_step(1))

            async def victim_busy() -> bool:
                # A request the victim runs whose tokens reached this client (under load they lag), so the fault
                # cuts requests with tokens, which come back as resumable partials. The victim names the requests
                # it holds, which behind the router only it knows.
                state = await _server_state(session, victim.url)
                held = set(state["rids_in_flight"])
                return any(wire_rid(r.request_id) in held and r.token_ids for r in engine._inflight.values())

            await _until(victim_busy, 60, f"{victim.url} runs requests")
            os.killpg(victim.process.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            detected_s = await _until(lambda: victim.url in engine.pool_health()["removed"], 30,
                                      f"{victim.url} removed")
            removed = engine.pool_health()
            metrics_removed = await engine_metrics(engine)
            result = await asyncio.wait_for(step, 120)
            _check_against_scheduler(scheduler, result.batch, prompts, trained)

            if fault == "kill":
                victim.stop()
                servers[0] = victim = _launch(ckpt, int(victim.url.rsplit(":", 1)[1]), str(tmp_path / "again.log"))
            else:
                os.killpg(victim.process.pid, signal.SIGCONT)
            await _until(lambda: engine.pool_health()["rejoins"] == 1, 60, f"{victim.url} rejoins")
            versions = await engine.weight_versions()
            metrics_rejoined = await engine_metrics(engine)
            async with SGLangEngine(SGLangEngineConfig(worker_urls=(victim.url,))) as alone:
                greedy = [t async for c in alone.generate(PROMPT, SamplingParams(max_new_tokens=12, temperature=0.0,
                                                                                   ignore_eos=True))
                          for t in c.token_ids]
            before = (await _server_state(session, victim.url))["generated_tokens"]
            second = await asyncio.wait_for(loop.run_step(1), 120)
            after = (await _server_state(session, victim.url))["generated_tokens"]
            return {"detected_s": detected_s, "removed": removed, "metrics": result.metrics, "versions": versions,
                    "greedy": greedy, "dispatched_again": after - before, "second": second,
                    "health": engine.pool_health(), "metrics_removed": metrics_removed,
                    "metrics_rejoined": metrics_rejoined}

    with one_torch_thread(), _servers(tmp_path, ckpt) as servers:
        if mode == "router":
            from test_router import sglang_router

            with sglang_router([s.url for s in servers], tmp_path) as router:
                out = asyncio.run(asyncio.wait_for(body(servers, router), 300))
        else:
            out = asyncio.run(asyncio.wait_for(body(servers, None), 300))
        victim_url, other_url = servers[0].url, servers[1].url

    # The victim was removed (a kill at once, a stop within the timeout and one probe interval) with a
    # reason, the other stayed; the step went on and resumed the victim's requests.
    assert out["removed"]["live"] == [other_url] and list(out["removed"]["removed"]) == [victim_url]
    reason = out["removed"]["removed"][victim_url]
    if fault == "stop":
        assert "no answer" in reason and out["detected_s"] <= TIMEOUT_S * 1.25 + 1.5, (reason, out["detected_s"])
    else:
        assert out["detected_s"] <= TIMEOUT_S, (reason, out["detected_s"])
    assert out["metrics"].resumed_requests > 0
    # It came back with the trainer's weights, and gets requests again.
    assert out["versions"] == {victim_url: "1", other_url: "1"}
    assert out["greedy"] == greedy_reference(trained, PROMPT, 12)
    assert out["dispatched_again"] > 0
    health = out["health"]
    assert sorted(health["live"]) == sorted([victim_url, other_url]) and health["removed"] == {}
    assert (health["removals"], health["rejoins"]) == (1, 1)
    assert out["second"].batch.n_groups == 4
    # What a training run's metrics row gets (progress line: workers=live/all).
    pool_keys = ("engine/workers_live", "engine/workers_removed", "engine/worker_removals", "engine/worker_rejoins")
    assert [out["metrics_removed"][k] for k in pool_keys] == [1, 1, 1, 0]
    assert [out["metrics_rejoined"][k] for k in pool_keys] == [2, 0, 1, 1]


@pytest.mark.slow
def test_when_the_last_worker_dies_its_request_returns_its_tokens_and_the_next_one_names_the_worker(
        tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    save_pretrained(tiny_model(seed=1), ckpt)
    long = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)

    async def body(server: SGLangServerProcess):
        config = SGLangEngineConfig(worker_urls=(server.url,), worker_timeout_s=TIMEOUT_S, retries=0)
        async with SGLangEngine(config) as engine:
            chunks = []
            async for chunk in engine.generate(PROMPT, long, "dies"):
                chunks.append(chunk)
                if sum(len(c.token_ids) for c in chunks) >= 5 and len(chunks) == 5:
                    os.killpg(server.process.pid, signal.SIGKILL)
            await _until(lambda: server.url in engine.pool_health()["removed"], TIMEOUT_S, "the worker removed")
            with pytest.raises(SGLangNoWorkerError) as err:
                async for _ in engine.generate(PROMPT, long, "next"):
                    pass
            return chunks, err.value

    with one_torch_thread(), _launch(ckpt, free_port(), str(tmp_path / "server.log")) as server:
        chunks, error = asyncio.run(asyncio.wait_for(body(server), 120))
    received = [t for c in chunks for t in c.token_ids]
    assert chunks[-1].finish_reason is FinishReason.ABORT and not chunks[-1].token_ids
    assert 5 <= len(received) < 200
    assert received == greedy_reference(tiny_model(seed=1), PROMPT, len(received))
    assert str(error).startswith("no SGLang worker left to run requests, every one was removed")
    assert server.url in str(error) and "refused connections" in str(error)
