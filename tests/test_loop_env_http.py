"""Multi-turn trajectories over the SGLang adapter: the real RolloutLoop with an environment, driving an embedded
server on loopback through april_ext.sglang.SGLangEngine (streaming with stop_token_ids, aborts at the step
boundary, resumes of prompt + response with the env tokens in it), carried across a save and a restart. As on
the embedded engine (tests/test_loop_env.py): every trained model token rescored by a copy of the served model
has its behavior logprob, env tokens are never trained and are exactly the environment's answers, and every
group is trained once."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from _sglang_utils import live_server
from _torch_threads import one_torch_thread
from test_loop_env import (
    STOPS,
    ScriptedEnv,
    _assert_every_group_trained_once,
    _check_batch,
    _model,
    _prompts,
)

from april_ext import ListDataSource, Scheduler, SchedulerConfig
from april_ext.protocol import SamplingParams
from april_ext.rollout import RolloutLoop
from april_ext.server import ServerThread
from april_ext.sglang import SGLangEngine, SGLangEngineConfig

REFERENCE = _model(0)  # the served weights (the server owns its own copy)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with one_torch_thread(), live_server(_model(0), max_num_seqs=8) as s:
        yield s


async def _run(url: str, config: SchedulerConfig, prompts: list[Any], env: ScriptedEnv,
               restart_at: int | None) -> list[Any]:
    """Steps until the data ran out; with ``restart_at``, the states are saved after that many steps and a new
    scheduler, adapter and loop continue from them."""

    def build(state: dict[str, Any] | None) -> tuple[Scheduler, SGLangEngine, RolloutLoop]:
        sched = Scheduler(config, ListDataSource(prompts))
        if state is not None:
            sched.load_state_dict(state)
        engine = SGLangEngine(SGLangEngineConfig(worker_urls=(url,)))
        loop = RolloutLoop(engine, sched, None, sampling=SamplingParams(temperature=1.0, stop_token_ids=STOPS),
                           environment=env, tool_timeout_s=0.5)
        return sched, engine, loop

    results: list[Any] = []
    sched, engine, loop = build(None)
    await engine.start()
    try:
        for step in range(40):
            if results and results[-1].batch.n_groups == 0:
                break
            if step == restart_at:
                await loop.drain_rewards()
                state, saved = sched.state_dict(), loop.environment_state()
                await loop.abort_carried()
                await loop.close()
                await engine.close()
                sched, engine, loop = build(state)
                await engine.start()
                assert saved is not None
                loop.load_environment_state(saved)
            results.append(await asyncio.wait_for(loop.run_step(0), 60))
        await loop.close()
    finally:
        await engine.close()
    return results


@pytest.mark.parametrize("boundary", ["abort", "carry"])
def test_trajectories_over_the_adapter_resume_mid_turn_and_mid_tool_across_a_restart(server, boundary) -> None:
    env = ScriptedEnv()
    scripts = [{"turns": 2, "obs_len": 3, "latency": [0.0, 0.2]}, {"turns": 1, "obs_len": 2, "latency": [0.05]},
               {"turns": 0, "obs_len": 1, "latency": []}]
    config = SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=2, over_sampling_batch_size=4,
                             max_response_len=40, step_boundary=boundary)
    prompts = _prompts(14, scripts)
    results = asyncio.run(_run(server.url, config, prompts, env, restart_at=2))
    for r in results[:-1]:
        _check_batch(r.batch, REFERENCE, env, config.max_response_len)
    _assert_every_group_trained_once(results, prompts, config.n_samples_per_prompt)
    assert sum(r.metrics.env["observations"] for r in results) > 0
    assert sum(r.metrics.resumed_requests for r in results) > 0  # a turn resumed after its observation or abort
    assert max(r.metrics.env["waiting_at_boundary"] for r in results) > 0
