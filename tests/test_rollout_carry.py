"""The rollout loop's `carry` step boundary over the embedded engine: running samples stay paused in place
with their KV cache across the weight update (no abort, no re-prefill), continue in the next step with the
new version, the staleness bound sends them back, and the engine generates nothing between steps."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest
from _torch_threads import one_thread  # noqa: F401 (fixture)

from april_ext import Scheduler, SchedulerConfig
from april_ext.engine import AsyncEngine, EngineConfig, EngineCore
from april_ext.model import LlamaForCausalLM
from april_ext.protocol import SamplingParams
from april_ext.rollout import RolloutLoop
from april_ext.tasks import CountingTask, CountingTaskConfig

TASK = CountingTask(CountingTaskConfig(n_symbols=2, max_count=24, median_count=3, sigma=1.0, seed=2))
_prefixes = itertools.count()


class _RecordingEngine(AsyncEngine):
    """Records each abort made while the engine is paused in place: an SGLang server cannot abort a request
    that reached it after the pause (it waits at the server's gate, not yet in flight), so the loop must
    continue the engine before it aborts anything."""

    def __init__(self, core: EngineCore) -> None:
        super().__init__(core)
        self.paused = False
        self.aborts_while_paused: list[object] = []

    async def pause_generation(self, mode: str = "in_place") -> None:
        await super().pause_generation(mode)
        self.paused = True

    async def continue_generation(self) -> None:
        self.paused = False
        await super().continue_generation()

    async def abort(self, request_ids=None):  # type: ignore[no-untyped-def]
        if self.paused:
            self.aborts_while_paused.append(request_ids)
        return await super().abort(request_ids)


async def _run(steps: int, **scheduler: object) -> tuple[list, list[dict], dict]:
    model = LlamaForCausalLM(TASK.model_config(hidden_size=32, intermediate_size=64, max_position_embeddings=96))
    model.init_weights(0)
    sched = Scheduler(SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=4, over_sampling_batch_size=6,
                                      max_response_len=40, **scheduler), TASK)  # type: ignore[arg-type]
    core = EngineCore(model, EngineConfig(num_blocks=256, max_num_seqs=64,
                                          memory_tag_prefix=f"carry-loop-{next(_prefixes)}-"))
    results, between = [], []
    async with _RecordingEngine(core) as engine:
        loop = RolloutLoop(engine, sched, TASK.reward, sampling=SamplingParams(stop_token_ids=(TASK.eos_id,)),
                           seed=3, engine_capacity=64)
        for version in range(steps):
            results.append(await loop.run_step(version))
            held = engine.stats()
            await asyncio.sleep(0.05)
            await engine.update_weights({}, version + 1)
            between.append({"carried": loop.carried, "running": held.running,
                            "generated_while_paused": engine.stats().generated_tokens - held.generated_tokens})
        await loop.abort_carried()
        await loop.drain_rewards()
        final = {"engine": core.stats(), "running": core.stats().running, "streams": loop.carried,
                 "aborts_while_paused": engine.aborts_while_paused}
    return results, between, final


def test_carry_keeps_running_samples_in_the_engine_across_the_update(one_thread):
    results, between, final = asyncio.run(_run(4, step_boundary="carry"))
    carried = [r.metrics.scheduler["carried_samples"] for r in results]
    # Nothing is carried into the first step; later steps start with the samples left running.
    assert carried[0] == 0 and sum(carried[1:]) > 0
    assert [b["carried"] for b in between[:-1]] == carried[1:]
    for r, b in zip(results, between):
        m = r.metrics
        assert m.aborted_samples == 0 and m.resumed_requests == 0 and m.scheduler["re_prefill_tokens"] == 0
        assert b["running"] == b["carried"] and b["generated_while_paused"] == 0  # paused in place
        assert r.batch.n_groups == 2
        versions = r.batch.versions[r.batch.loss_mask.astype(bool)]
        assert versions.max() <= r.batch.policy_version
    assert all(r.metrics.scheduler["carried_kv_tokens"] > 0 for r, c in zip(results, carried) if c > 0)
    # Carried samples produced tokens under two versions and none of them was recomputed by the engine.
    assert max(r.batch.versions[r.batch.loss_mask.astype(bool)].min() < r.batch.policy_version
               for r in results[1:])
    assert final["engine"].preemptions == 0
    assert final["running"] == 0 and final["streams"] == 0  # abort_carried ended them
    assert between[-1]["carried"] > 0 and final["aborts_while_paused"] == []  # after continuing the engine


def test_abort_re_prefills_what_carry_keeps(one_thread):
    results, between, _ = asyncio.run(_run(3, step_boundary="abort"))
    assert all(r.metrics.scheduler["carried_samples"] == 0 for r in results)
    assert all(b["carried"] == 0 and b["running"] == 0 for b in between)
    assert sum(r.metrics.aborted_samples for r in results) > 0
    assert sum(r.metrics.scheduler["re_prefill_tokens"] for r in results) > 0


def test_carried_samples_past_the_staleness_bound_are_restarted(one_thread):
    results, between, final = asyncio.run(_run(4, step_boundary="carry", max_staleness=0, staleness_policy="restart"))
    assert sum(r.metrics.aborted_samples for r in results[1:]) > 0
    # The stale carried samples, and at the end every carried one, were aborted after the engine continued.
    assert sum(b["carried"] for b in between) > 0 and final["aborts_while_paused"] == []
    for r in results:
        trained = r.batch.loss_mask.astype(bool)
        # Every token trained on comes from the policy of its step: stale carried samples started over.
        assert np.all(r.batch.versions[trained] == r.batch.policy_version)


@pytest.mark.parametrize("boundary", ["abort", "carry"])
def test_an_engine_without_pause_still_runs_the_loop(one_thread, boundary):
    """A RolloutEngine without pause_generation (PipelineRL-style engines) keeps generating between steps."""
    from _loop_utils import ScriptedEngine

    from april_ext import ListDataSource, Prompt

    data = ListDataSource([Prompt(f"p{i}", [1, 5, n, 3]) for i, n in enumerate([2, 9, 3, 30, 2, 4, 25, 3] * 3)])
    sched = Scheduler(SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=2, over_sampling_batch_size=3,
                                      max_response_len=40, step_boundary=boundary), data)
    engine = ScriptedEngine(lambda ids: int(ids[2]), delay=0.001)

    async def main():
        loop = RolloutLoop(engine, sched, lambda p, r: float(len(r) % 2), seed=1)
        out = []
        for version in range(3):
            out.append(await loop.run_step(version))
            await engine.update_weights({}, version + 1)
        await loop.abort_carried()
        return out

    results = asyncio.run(main())
    assert all(r.batch.n_groups == 2 for r in results)


def test_carried_samples_reach_the_batch_as_the_engine_generated_them(one_thread):
    """Records what the engine streamed (and returned from aborts) per request and checks every sample of every
    batch against it: the tokens, behavior logprobs, per-token versions and finish reason of carried samples
    across the boundary, the loss mask, and the reward of the assembled response."""
    from types import SimpleNamespace

    from april_ext.batch import FinishReason

    model = LlamaForCausalLM(TASK.model_config(hidden_size=32, intermediate_size=64, max_position_embeddings=96))
    model.init_weights(0)
    sched = Scheduler(SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=4, over_sampling_batch_size=6,
                                      max_response_len=40, step_boundary="carry"), TASK)
    core = EngineCore(model, EngineConfig(num_blocks=256, max_num_seqs=64,
                                          memory_tag_prefix=f"carry-loop-{next(_prefixes)}-"))
    generated: dict[int, list[dict]] = {}  # sample id -> its requests, in order

    async def main() -> list:
        async with AsyncEngine(core) as engine:
            generate, abort = engine.generate, engine.abort

            async def recorded(input_ids, params=None, request_id=None):
                record = {"id": request_id, "tokens": [], "logprobs": [], "versions": [], "finish": None}
                generated.setdefault(int(request_id.split("-")[1]), []).append(record)
                async for chunk in generate(input_ids, params, request_id):
                    record["tokens"] += chunk.token_ids
                    record["logprobs"] += chunk.logprobs
                    record["versions"] += [chunk.weight_version] * len(chunk.token_ids)
                    if chunk.finish_reason is not None:
                        record["finish"] = FinishReason(chunk.finish_reason)
                    yield chunk

            async def recorded_abort(request_ids=None):
                outputs = await abort(request_ids)
                for output in outputs:
                    for record in generated[int(output.request_id.split("-")[1])]:
                        if record["id"] == output.request_id:
                            record.update(tokens=list(output.token_ids), logprobs=list(output.logprobs),
                                          versions=list(output.versions), finish=FinishReason.ABORT)
                return outputs

            engine.generate, engine.abort = recorded, recorded_abort
            loop = RolloutLoop(engine, sched, TASK.reward, sampling=SamplingParams(stop_token_ids=(TASK.eos_id,)),
                               seed=3, engine_capacity=64)
            batches = []
            for version in range(5):
                batches.append((await loop.run_step(version)).batch)
                await engine.update_weights({}, version + 1)
            await loop.abort_carried()
            return batches

    batches = asyncio.run(main())
    spanning = 0
    for batch in batches:
        for i in range(batch.n_samples):
            start, end = batch.offsets[i], batch.offsets[i + 1]
            response = slice(start + batch.prompt_lens[i], end)
            requests = generated[int(batch.sample_ids[i])]
            tokens = [t for r in requests for t in r["tokens"]]
            assert batch.tokens[response].tolist() == tokens
            assert batch.behavior_logprobs[response].tolist() == pytest.approx(
                [lp for r in requests for lp in r["logprobs"]], abs=1e-6)
            assert batch.versions[response].tolist() == [v for r in requests for v in r["versions"]]
            assert batch.loss_mask[response].all() and not batch.loss_mask[start:response.start].any()
            finish = FinishReason(int(batch.finish_reasons[i]))
            assert finish == requests[-1]["finish"] != FinishReason.ABORT
            assert (tokens[-1] == TASK.eos_id) == (finish == FinishReason.STOP)
            prompt = SimpleNamespace(metadata=batch.metadata[batch.group_index[i]])
            assert batch.rewards[i] == pytest.approx(TASK.reward(prompt, tokens))
            spanning += len(set(batch.versions[response].tolist())) > 1
    assert spanning > 0  # some samples were carried across a weight update
