"""Evaluation leaves the prefix cache as it found it: requests the embedded engine serves with publish_prefix=False
(AsyncEngine.unpublished_requests) reuse cached blocks but publish none, so the rollouts after an evaluation
compute exactly what they would have without it. Before, the held-out prompts' blocks were published and a
rollout reused K/V computed in evaluation's batches: a run with --eval-interval drifted from the same run
without it in the last bits (the main job at lr 3e-3 diverged at step 107)."""

from __future__ import annotations

import asyncio

import pytest
from _engine_utils import GREEDY, engine, tiny_model
from _torch_threads import one_thread  # noqa: F401 (fixture)

from april_ext.engine import AsyncEngine
from april_ext.training import TrainConfig, train

PROMPT = [9, 4, 7, 1, 3, 8, 2, 6, 5]  # two full blocks of 4 before the last token


def _sampled(core, prompt, publish: bool = True):
    rid = core.add_request(prompt, GREEDY, publish_prefix=publish)
    seq = core._requests[rid]
    while core.has_request(rid):
        core.step()
    return seq.token_ids[len(prompt):]


def test_an_unpublished_request_reuses_the_cache_but_adds_nothing_to_it():
    core = engine(tiny_model(seed=0))
    hits = lambda: core.stats().prefix_cache_hit_tokens  # noqa: E731
    fresh = _sampled(engine(tiny_model(seed=0)), PROMPT)
    assert _sampled(core, PROMPT, publish=False) == fresh
    assert _sampled(core, PROMPT) == fresh and hits() == 0  # nothing was published for it to reuse
    published = hits()
    assert _sampled(core, PROMPT, publish=False) == fresh
    assert hits() - published == 8  # an unpublished request still reads the published blocks


def test_async_engine_requests_inside_unpublished_requests_publish_nothing():
    async def run() -> tuple[int, int]:
        async with AsyncEngine(engine(tiny_model(seed=0))) as eng:
            with eng.unpublished_requests():
                async for _ in eng.generate(PROMPT, GREEDY):
                    pass
            before = eng.stats().prefix_cache_hit_tokens
            async for _ in eng.generate(PROMPT, GREEDY):
                pass
            after_first = eng.stats().prefix_cache_hit_tokens - before
            async for _ in eng.generate(PROMPT, GREEDY):
                pass
            return after_first, eng.stats().prefix_cache_hit_tokens - before - after_first

    assert asyncio.run(run()) == (0, 8)


@pytest.mark.usefixtures("one_thread")
def test_a_run_evaluates_through_unpublished_requests(tmp_path, monkeypatch):
    entered = []
    original = AsyncEngine.unpublished_requests

    def counting(self):
        entered.append(self)
        return original(self)

    monkeypatch.setattr(AsyncEngine, "unpublished_requests", counting)
    config = TrainConfig(counting_median=3.0, counting_max_count=12, counting_symbols=2, hidden_size=16, num_layers=1,
                         rollout_batch_size=2, n_samples_per_prompt=4, max_num_seqs=16, num_blocks=256, num_steps=2,
                         eval_interval=1, eval_counting_prompts=4, progress=False, plots=False,
                         output_dir=str(tmp_path / "run"))
    result = train(config)
    assert len(entered) == 2 and all("eval/reward_mean" in row for row in result.history)


def test_unpublished_requests_is_per_task_and_nests():
    other = [7, 7, 2, 5, 1, 8, 3, 3, 4]

    async def run() -> tuple[int, int]:
        async with AsyncEngine(engine(tiny_model(seed=0))) as eng:
            async def drain(prompt):
                async for _ in eng.generate(prompt, GREEDY):
                    pass

            with eng.unpublished_requests():
                with eng.unpublished_requests():
                    pass
                await drain(PROMPT)  # still inside the outer block after the inner one ended
            start = eng.stats().prefix_cache_hit_tokens
            await drain(PROMPT)
            unpublished_hits = eng.stats().prefix_cache_hit_tokens - start
            # A task created outside the block publishes even while another task is inside one.
            async def inside(event_in: asyncio.Event, event_out: asyncio.Event):
                with eng.unpublished_requests():
                    event_in.set()
                    await event_out.wait()

            entered, leave = asyncio.Event(), asyncio.Event()
            holder = asyncio.create_task(inside(entered, leave))
            await entered.wait()
            await drain(other)
            leave.set()
            await holder
            start = eng.stats().prefix_cache_hit_tokens
            await drain(other)
            return unpublished_hits, eng.stats().prefix_cache_hit_tokens - start

    assert asyncio.run(run()) == (0, 8)
