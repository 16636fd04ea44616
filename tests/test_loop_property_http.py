"""The real RolloutLoop over the SGLang adapter and an embedded server on loopback (HTTP streaming, aborts by id
and all, pause in place and continue for carry, weight updates), with settings drawn by hypothesis: every step
has its N groups, no group is trained twice, and every trained token, rescored by a copy of the served model in
one forward pass, has the behavior logprob the batch holds (a token lost or duplicated on the wire, or generated
over the wrong KV, would change the rest)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from _engine_utils import tiny_model
from _loop_utils import assert_logprobs_are_the_models
from _sglang_utils import live_server
from _torch_threads import one_torch_thread
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from april_ext import ListDataSource, Prompt, Scheduler, SchedulerConfig
from april_ext.errors import ConfigError
from april_ext.protocol import SamplingParams
from april_ext.rollout import RolloutLoop
from april_ext.server import ServerThread
from april_ext.server.app import EmbeddedServer
from april_ext.sglang import SGLangEngine, SGLangEngineConfig

CAP = 20
REFERENCE = tiny_model()  # the served weights (the server owns its own copy)
WEIGHTS = {name: p.detach().clone() for name, p in REFERENCE.named_parameters()}
PROMPTS = [Prompt(i, [(7 * i + j) % 101 for j in range(3 + i % 4)]) for i in range(300)]
# Stop tokens make the lengths vary, so that samples are still running when a step's groups are done.
SAMPLING = SamplingParams(temperature=1.0, stop_token_ids=tuple(range(0, 101, 7)))
_versions = itertools.count(1)  # the server's weight version only grows, across examples too


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with one_torch_thread(), live_server(tiny_model(), max_num_seqs=12) as s:
        yield s


@st.composite
def _settings(draw: st.DrawFn) -> dict[str, Any]:
    n_groups = draw(st.integers(1, 3))
    tail = draw(st.booleans())
    return dict(
        rollout_batch_size=n_groups, n_samples_per_prompt=draw(st.integers(1, 3)),
        over_sampling_batch_size=n_groups + draw(st.integers(0, 2)), max_response_len=CAP,
        refill=draw(st.sampled_from(["batch", "continuous"])),
        step_boundary=draw(st.sampled_from(["abort", "carry"])),
        dispatch_order=draw(st.sampled_from(["fifo", "longest_predicted_first"])),
        chunk_tokens=draw(st.sampled_from([None, 4])), keep_surplus=draw(st.booleans()),
        tail_batching=tail, tail_batching_restart=tail and draw(st.booleans()),
        tail_extra_samples=draw(st.integers(0, 1)) if tail else 0,
        max_staleness=draw(st.sampled_from([None, 0, 1])),
        staleness_policy=draw(st.sampled_from(["keep", "restart", "drop"])))


async def _steps(url: str, config: SchedulerConfig, seed: int, steps: int) -> list[Any]:
    sched = Scheduler(config, ListDataSource(PROMPTS))
    batches = []
    async with SGLangEngine(SGLangEngineConfig(worker_urls=(url,))) as engine:
        loop = RolloutLoop(engine, sched, lambda prompt, response: float(len(response) % 2), sampling=SAMPLING,
                           seed=seed)
        version = next(_versions)
        await engine.update_weights(WEIGHTS, version)
        for _ in range(steps):
            batches.append((await asyncio.wait_for(loop.run_step(version), 60)).batch)
            version = next(_versions)
            await engine.update_weights(WEIGHTS, version)  # a new version, the same weights
        await loop.abort_carried()
        await loop.drain_rewards()
    return batches


# The same examples on every run (derandomize), so that CI never meets a new example by chance; run with more
# examples, randomized, to look for more (1,500 found the stale carried abort of the test below).
@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # one server for all
@given(config=_settings(), seed=st.integers(0, 1000))
def test_over_http_every_step_has_its_groups_and_every_token_its_logprob(server, config, seed) -> None:
    try:
        config = SchedulerConfig(**config)
    except ConfigError:
        assume(False)
    with one_torch_thread():
        batches = asyncio.run(_steps(server.url, config, seed, steps=3))
    trained: set[int] = set()
    width = config.n_samples_per_prompt + config.tail_extra_samples
    for batch in batches:
        assert batch.n_groups == config.rollout_batch_size
        groups = {sid // width for sid in batch.sample_ids.tolist()}
        assert len(groups) == batch.n_groups and not groups & trained
        trained |= groups
        assert_logprobs_are_the_models(REFERENCE, batch)


def test_a_stale_carried_request_that_reached_the_server_during_the_pause_is_aborted(monkeypatch) -> None:
    """A request sent just before the step's in-place pause can reach the server after it: it waits at the
    server's pause gate, not yet in flight, where no abort finds it (SGLang's tokenizer manager too). The loop
    aborted the carried samples past the staleness bound before continue_generation, so such an abort waited
    abort_timeout_s (re-sent every abort_resend_s) and the step with it; found by the randomized run of the
    property test above. Every request here reaches the server 0.3 s late, so that some are on their way at
    each pause."""
    admit, pause = EmbeddedServer.generate, EmbeddedServer.pause_generation
    pauses = [0]
    overtaken: list[int] = []  # requests that a pause overtook on their way

    async def late(self: EmbeddedServer, request: Any) -> Any:
        sent = pauses[0]
        await asyncio.sleep(0.3)
        if pauses[0] != sent:
            overtaken.append(sent)
        return await admit(self, request)

    async def counted(self: EmbeddedServer, request: Any) -> Any:
        pauses[0] += 1
        return await pause(self, request)

    monkeypatch.setattr(EmbeddedServer, "generate", late)
    monkeypatch.setattr(EmbeddedServer, "pause_generation", counted)
    config = SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=3, over_sampling_batch_size=4,
                             max_response_len=CAP, refill="continuous", step_boundary="carry", max_staleness=0,
                             staleness_policy="restart")

    async def run(url: str) -> list[Any]:
        sched = Scheduler(config, ListDataSource(PROMPTS))
        batches = []
        async with SGLangEngine(SGLangEngineConfig(worker_urls=(url,), abort_timeout_s=60.0)) as engine:
            loop = RolloutLoop(engine, sched, lambda prompt, response: 1.0, sampling=SAMPLING, seed=0)
            for version in range(1, 5):
                await engine.update_weights(WEIGHTS, version)
                batches.append((await asyncio.wait_for(loop.run_step(version), 30)).batch)
            await asyncio.wait_for(loop.abort_carried(), 30)
            await loop.drain_rewards()
        return batches

    with one_torch_thread(), live_server(tiny_model(), max_num_seqs=12) as server:
        batches = asyncio.run(run(server.url))
    assert overtaken, "no pause overtook a request on its way: the case was not exercised"
    assert [b.n_groups for b in batches] == [2] * 4
    for batch in batches:
        assert_logprobs_are_the_models(REFERENCE, batch)
