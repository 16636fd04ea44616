"""The real RolloutLoop over a scripted engine, with settings and response lengths drawn by hypothesis: every step
ends (no stall, no hang) with exactly N groups of n samples, no group trained twice, and each trained response
is exactly the tokens its sample generated across its aborts and resumes (nothing lost or duplicated).

The scheduler's own property tests drive it with a hand-written loop; this drives the loop itself, which once
stalled with tail_extra_samples when a group completed by its cancelled samples' aborts was not handed out."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from _loop_utils import SampleLengthEngine, assert_logprobs_are_the_models
from _torch_threads import one_thread  # noqa: F401 (fixture)
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from april_ext import ListDataSource, Prompt, Scheduler, SchedulerConfig
from april_ext.algorithms import reject_uniform_groups
from april_ext.engine import AsyncEngine, EngineConfig, EngineCore
from april_ext.errors import ConfigError
from april_ext.model import LlamaForCausalLM
from april_ext.protocol import SamplingParams
from april_ext.rollout import RolloutLoop
from april_ext.tasks import CountingTask, CountingTaskConfig

CAP = 24


@st.composite
def _settings(draw: st.DrawFn) -> dict[str, Any]:
    n_groups = draw(st.integers(1, 3))
    n = draw(st.integers(1, 3))
    tail = draw(st.booleans())
    adaptive = draw(st.booleans())
    return dict(
        rollout_batch_size=n_groups, n_samples_per_prompt=n,
        over_sampling="adaptive" if adaptive else "fixed",
        target_inflight_samples=n * draw(st.integers(1, 4)) if adaptive else None,
        max_inflight_samples=draw(st.sampled_from([None, n, 2 * n + 1])),
        keep_surplus=draw(st.booleans()), resume_order=draw(st.sampled_from(["oldest_first", "longest_first"])),
        over_sampling_batch_size=n_groups + draw(st.integers(0, 2)), max_response_len=CAP,
        refill=draw(st.sampled_from(["batch", "continuous"])),
        step_boundary=draw(st.sampled_from(["abort", "carry"])),
        dispatch_order=draw(st.sampled_from(["fifo", "longest_predicted_first", "shortest_first"])),
        chunk_tokens=draw(st.sampled_from([None, 4])),
        tail_batching=tail, tail_batching_restart=tail and draw(st.booleans()),
        tail_extra_samples=draw(st.integers(0, 2)) if tail else 0,
        max_staleness=draw(st.sampled_from([None, 0, 1])),
        staleness_policy=draw(st.sampled_from(["keep", "mask", "restart", "drop"])))


async def _run(config: SchedulerConfig, lengths: list[int], steps: int, filtered: bool,
               engine_faults: tuple[int, int], restart_at: int | None) -> list[Any]:
    """``steps`` steps; with ``restart_at``, the run stops after that many (its scheduler state saved, its
    engine and loop abandoned, as a crash after a checkpoint) and a new one continues from the state."""
    lag, preempt_every = engine_faults

    def start(state: dict[str, Any] | None, version: int) -> tuple[Scheduler, SampleLengthEngine, RolloutLoop]:
        sched = Scheduler(config, ListDataSource([Prompt(f"p{i}", [1, 5, 4, 3]) for i in range(200)]))
        if state is not None:
            sched.load_state_dict(state)
        engine = SampleLengthEngine(lambda sid: lengths[sid % len(lengths)], abort_extra_tokens=lag,
                                    preempt_every=preempt_every)
        engine.version = version
        # Rewards by length parity, so that DAPO's filter rejects the groups whose lengths all share one.
        loop = RolloutLoop(engine, sched, lambda prompt, response: float(len(response) % 2), engine_capacity=8,
                           group_filter=reject_uniform_groups if filtered else None)
        return sched, engine, loop

    sched, engine, loop = start(None, 0)
    results = []
    for version in range(steps):
        if version == restart_at:
            await loop.drain_rewards()  # as a run does before it saves
            state = sched.state_dict()
            await loop.abort_carried()  # the old run's streams end; its scheduler is gone with it
            sched, engine, loop = start(state, version)
        results.append(await asyncio.wait_for(loop.run_step(version), 20))
        await engine.update_weights({}, version + 1)
    await loop.abort_carried()
    await loop.drain_rewards()
    return results


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=_settings(), lengths=st.lists(st.integers(1, CAP + 4), min_size=1, max_size=13),
       filtered=st.booleans(), engine_faults=st.tuples(st.integers(0, 3), st.sampled_from([0, 3, 7])),
       restart_at=st.sampled_from([None, 1, 3]))
def test_the_loop_ends_every_step_with_exactly_its_groups_and_every_token_once(config, lengths, filtered,
                                                                             engine_faults, restart_at) -> None:
    """engine_faults: abort results carrying up to that many tokens the stream had not delivered (an HTTP
    engine's last response), and the engine ending every k-th request itself (memory pressure). restart_at:
    the run continues from its saved scheduler state in a new loop and engine before that step."""
    try:
        config = SchedulerConfig(**config)
    except ConfigError:
        assume(False)  # a combination the scheduler refuses (e.g. adaptive over-sampling with batch refill)
    n = config.n_samples_per_prompt
    width = n + config.tail_extra_samples
    results = asyncio.run(_run(config, lengths, steps=5, filtered=filtered, engine_faults=engine_faults,
                               restart_at=restart_at))
    trained: set[int] = set()
    for result in results:
        batch = result.batch
        # The filter may use up the 200 prompts (every group uniform): then a step is short, never long.
        full = not result.metrics.scheduler["data_exhausted"]
        assert batch.n_groups == config.rollout_batch_size if full else batch.n_groups <= config.rollout_batch_size
        assert batch.n_samples == batch.n_groups * n
        if filtered:
            assert all(len(set(batch.rewards[i * n:(i + 1) * n].tolist())) == 2 for i in range(batch.n_groups))
        sids = batch.sample_ids.tolist()
        assert len(set(sids)) == len(sids)
        groups = {sid // width for sid in sids}
        assert len(groups) == batch.n_groups and not groups & trained
        trained |= groups
        for i, sid in enumerate(sids):
            start, end = batch.offsets[i], batch.offsets[i + 1]
            response = batch.tokens[start + batch.prompt_lens[i]:end].tolist()
            # Token id 10 + position: a lost token leaves a gap, a duplicated one a repeat.
            assert response == [10 + p for p in range(min(lengths[sid % len(lengths)], CAP))]


TASK = CountingTask(CountingTaskConfig(n_symbols=2, max_count=24, median_count=3, sigma=1.0, seed=2))
MODEL = LlamaForCausalLM(TASK.model_config(hidden_size=32, intermediate_size=64, max_position_embeddings=96))
MODEL.init_weights(0)
_tags = itertools.count()


async def _embedded(config: SchedulerConfig, slots: int, steps: int, deterministic: bool = False) -> list[Any]:
    sched = Scheduler(config, TASK)
    core = EngineCore(MODEL, EngineConfig(block_size=4, num_blocks=512, max_num_seqs=slots,
                                          memory_tag_prefix=f"loop-property-{next(_tags)}-"))
    batches = []
    async with AsyncEngine(core) as engine:
        loop = RolloutLoop(engine, sched, TASK.reward, sampling=SamplingParams(stop_token_ids=(TASK.eos_id,)),
                           seed=7, engine_capacity=slots, deterministic=deterministic)
        assert loop.deterministic == deterministic
        for version in range(steps):
            batches.append((await asyncio.wait_for(loop.run_step(version), 60)).batch)
            await engine.update_weights({}, version + 1)  # a new version, the same weights
        await loop.abort_carried()
        await loop.drain_rewards()
    return batches


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # one_thread: for all
@given(config=_settings(), slots=st.sampled_from([3, 8, 64]), deterministic=st.booleans())
def test_over_the_embedded_engine_every_trained_token_is_the_models_with_its_logprob(config, slots, deterministic,
                                                                                   one_thread):
    """The embedded engine (paused in place for carry, its prefix cache for chunks, re-prefill on resume) under
    the drawn settings, free-running or in lockstep with the loop (deterministic): every trained response, scored
    again by the model in one forward pass, has the behavior logprob the batch holds at every token (a token
    lost, duplicated or generated over the wrong KV would change the rest), and every step has its N groups."""
    config = {**config, "max_response_len": CAP, "tail_extra_samples": min(config["tail_extra_samples"], 1)}
    try:
        config = SchedulerConfig(**config)
    except ConfigError:
        assume(False)
    batches = asyncio.run(_embedded(config, slots, steps=3, deterministic=deterministic))
    for batch in batches:
        assert batch.n_groups == config.rollout_batch_size
        assert_logprobs_are_the_models(MODEL, batch)
