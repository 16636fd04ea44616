"""Ray runs with ray_routing "least_loaded": no router, the driver's SGLang client sends each request straight to
the engine with the fewest KV tokens as the engines report them. On a local Ray cluster, with real embedded
servers in the engine actors.

- Through the real engine pool: a request goes to the engine reporting less KV (the other one holds another
  client's long requests); an engine whose actor stops answering gets no requests (the one it ran comes back
  as a partial) and no weight update, and once it answers again it gets the current weights, then requests.
- A training run of 2 engines: both get requests; one engine's server SIGKILLed mid-step: the step completes on
  the other with full batches of distinct groups, none trained twice; Ray restarts the engine, which rejoins
  with the current weights and gets requests again. No router is launched.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from _engine_utils import tiny_model
from _ray_utils import RAY, TINY, checked_and_armed, generated_tokens, keyed_session, label, needs, ray_cluster  # noqa: F401
from _ray_utils import ray_run, wait
from _torch_threads import one_thread  # noqa: F401 (fixture)

from april_ext.batch import FinishReason
from april_ext.cluster.ray_engine import RayEngine
from april_ext.cluster.server_pool import ServerPool
from april_ext.cluster.session import RaySession
from april_ext.cluster.topology_run import client_config
from april_ext.model import save_pretrained
from april_ext.protocol import SamplingParams
from april_ext.sglang import SGLangEngine, SGLangEngineConfig
from april_ext.training import TrainConfig

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread", "ray_cluster"), needs("ray")]

LONG = SamplingParams(max_new_tokens=150, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [5, 17, 33, 2, 60]


async def _complete(engine: RayEngine, count: int, tag: str) -> list[int]:
    """``count`` requests at once, each to its end: their token counts."""
    async def one(i: int) -> int:
        return sum([len(c.token_ids) async for c in engine.generate(PROMPT, SHORT, f"{tag}-{i}")])

    return list(await asyncio.gather(*(one(i) for i in range(count))))


def test_requests_go_to_the_least_loaded_engine_of_the_pool_and_follow_its_membership(tmp_path) -> None:
    checkpoint = str(tmp_path / "model")
    save_pretrained(tiny_model(), checkpoint)
    config = TrainConfig(**RAY, ray_routing="least_loaded", rollout_num_gpus=2, sglang_worker_timeout_s=3.0,
                         block_size=4, num_blocks=256, max_num_seqs=16, output_dir=str(tmp_path / "run"))

    async def body(session: RaySession) -> dict:
        pool = await ServerPool.start(session, config, checkpoint, 0)
        seen: dict = {}
        try:
            async with SGLangEngine(client_config(config, pool, 0)) as inner, \
                    RayEngine(inner, pool) as engine:
                busy, idle = (s.url for s in pool.slots)
                # Another client fills the first engine with long requests, held there with their KV.
                async with SGLangEngine(SGLangEngineConfig(worker_urls=(busy,), api_key=pool.network.api_key)) as other:
                    held = [other.generate(list(range(1 + i, 61 + i)), LONG, f"other-{i}") for i in range(3)]
                    for stream in held:
                        await anext(stream)
                    await other.pause_generation("in_place")
                    await wait(lambda: inner._workers.reported.get(busy, 0) >= 180 and idle in inner._workers.reported,
                               30, "both engines' load read")
                    mine = [engine.generate(PROMPT, LONG, f"mine-{i}") for i in range(4)]
                    sent_to = []
                    for i, stream in enumerate(mine):  # opened in turn: one sent to the paused engine gets no token
                        await asyncio.wait_for(anext(stream), 30)
                        # Where it went, read at its first token: on a loaded machine the first ones may have
                        # finished by the time the last one is open.
                        sent_to.append(inner._inflight[f"mine-{i}"].url)
                    seen["spread"] = {url: sent_to.count(url) for url in (busy, idle)}
                    await other.continue_generation()
                    await engine.abort()
                    await other.abort()
                    for stream in (*held, *mine):
                        await stream.aclose()

                await engine.update_weights(checkpoint, 1)
                await wait(lambda: inner._workers.reported == {busy: 0, idle: 0}, 30, "both engines idle")
                running = [engine.generate(PROMPT, LONG, f"running-{i}") for i in range(2)]
                for stream in running:
                    await asyncio.wait_for(anext(stream), 30)
                on = {inner._inflight[f"running-{i}"].url: stream for i, stream in enumerate(running)}
                stalled = pool.slots[1]
                try:
                    # Held on their servers, so that they still run when the stalled actor is noticed.
                    async with SGLangEngine(SGLangEngineConfig(worker_urls=(busy, idle), api_key=pool.network.api_key)) as holder:
                        await holder.pause_generation("in_place")
                        os.kill(stalled.pid, signal.SIGSTOP)
                        await wait(lambda: pool.states()[1] == "down", 30, "the stalled actor's engine taken out")
                        seen["ends"] = {idle: [c.finish_reason async for c in on[idle]][-1]}
                        await holder.continue_generation()
                    seen["ends"][busy] = [c.finish_reason async for c in on[busy]][-1]
                    before = {s.url: generated_tokens(s.url) for s in pool.slots}
                    await engine.update_weights(checkpoint, 2)
                    seen["while_down"] = await _complete(engine, 4, "while-down")
                    seen["down_delta"] = {s.url: generated_tokens(s.url) - before[s.url] for s in pool.slots}
                    seen["down_label"] = label(stalled.url)
                finally:
                    os.kill(stalled.pid, signal.SIGCONT)
                await wait(lambda: pool.states()[1] == "up" and engine.rejoins == 1, 60, "the engine back")
                seen["back_label"] = label(stalled.url)
                before = {s.url: generated_tokens(s.url) for s in pool.slots}
                await _complete(engine, 4, "back")
                seen["back_delta"] = {s.url: generated_tokens(s.url) - before[s.url] for s in pool.slots}
                seen["urls"] = (busy, idle)
        finally:
            pool.stop()
        return seen

    async def run() -> dict:
        with keyed_session(config) as session:
            return await body(session)

    seen = asyncio.run(run())
    busy, idle = seen["urls"]
    # Counted by this client's requests in flight alone they would alternate (2 and 2): the load reports decide.
    assert seen["spread"] == {busy: 0, idle: 4}
    # One request on each; the one on the stalled actor's engine comes back as a partial.
    assert seen["ends"] == {busy: FinishReason.LENGTH, idle: FinishReason.ABORT}
    # The stalled actor's engine (its server still up) got no requests and no update while it was out, then
    # the current weights before it got requests again.
    assert seen["while_down"] == [SHORT.max_new_tokens] * 4
    assert seen["down_delta"] == {busy: 4 * SHORT.max_new_tokens, idle: 0}
    assert seen["down_label"] == "1" and seen["back_label"] == "2"
    assert seen["back_delta"][idle] > 0 and sum(seen["back_delta"].values()) == 4 * SHORT.max_new_tokens


def test_a_run_routed_by_load_survives_an_engine_killed_mid_step_which_rejoins_and_gets_requests(tmp_path) -> None:
    config = TrainConfig(**{**TINY, "rollout_batch_size": 4}, **RAY, ray_routing="least_loaded", num_steps=4,
                         output_dir=str(tmp_path / "run"), rollout_num_gpus=2, sglang_worker_timeout_s=3.0)

    async def run() -> dict:
        async with ray_run(config) as run:
            engine, seen, trained = run.engine, {}, set()
            armed = checked_and_armed(run, trained)

            await run.step()
            killed = engine.pool.slots[0]
            seen["first_step"] = [generated_tokens(s.url) for s in engine.pool.slots]
            server = await asyncio.wrap_future(killed.actor.server_pid.remote().future())
            seen["killed_url"] = killed.url
            armed.append(lambda: os.kill(server, signal.SIGKILL))
            await asyncio.wait_for(run.step(), 120)
            assert not armed, "no token came in the step"
            await wait(lambda: engine.rejoins == 1 and engine.pool.states()[0] == "up", 120,
                       "the killed engine restarted and rejoined")
            seen["rejoined"] = (killed.url, label(killed.url), str(run.trainer.version))
            while not run.done:
                await run.step()
            seen["after_rejoin"] = generated_tokens(killed.url)
            seen["live"] = engine.pool_health()["live"]
            await run.finish()
            seen["history"] = run.history
            return seen

    seen = asyncio.run(run())
    assert all(n > 0 for n in seen["first_step"]), seen["first_step"]
    # Ray restarted the engine on a new server, given the current weights before it got requests, and it got some.
    new_url, rejoin_label, version = seen["rejoined"]
    assert new_url != seen["killed_url"] and rejoin_label == version
    assert seen["after_rejoin"] > 0
    assert seen["killed_url"] not in seen["live"] and new_url in seen["live"] and len(seen["live"]) == 2
    assert [r["engine/server_weight_versions"] for r in seen["history"]] == [["1"], ["2"], ["3"], ["4"]]
    assert not os.path.exists(tmp_path / "run" / "cluster" / "router.log")
