"""AsyncEngine: streaming, abort, weight updates mid-stream, health and stats, through asyncio."""

from __future__ import annotations

import asyncio

import pytest
from _engine_utils import GREEDY, engine, greedy_reference, prompts, tiny_model

from april_ext.batch import FinishReason
from april_ext.engine import AsyncEngine
from april_ext.errors import InvalidArgumentError, InvalidStateError, UnknownIdError
from april_ext.protocol import LockstepEngine, SamplingParams


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


async def collect(stream) -> list:
    return [chunk async for chunk in stream]


def test_concurrent_streams_match_the_reference(model) -> None:
    batch = prompts(4, seed=20)

    async def main():
        async with AsyncEngine(engine(model)) as eng:
            results = await asyncio.gather(*(collect(eng.generate(p, GREEDY)) for p in batch))
            assert eng.health()["status"] == "ok"
            stats = eng.stats()
            assert stats.generated_tokens == 64 and stats.tokens_per_s > 0
        assert eng.health()["status"] == "stopped"
        return results

    for prompt, chunks in zip(batch, asyncio.run(main())):
        assert [t for c in chunks for t in c.token_ids] == greedy_reference(model, prompt, 16)
        assert all(c.finish_reason is None for c in chunks[:-1])
        assert chunks[-1].finish_reason is FinishReason.LENGTH
        assert all(c.weight_version == 0 and len(c.token_ids) == len(c.logprobs) for c in chunks)


def test_abort_returns_partial_output_and_ends_the_streams(model) -> None:
    async def main():
        async with AsyncEngine(engine(model, max_num_seqs=2)) as eng:
            long = SamplingParams(temperature=0.0, max_new_tokens=200)
            streams = [eng.generate(p, long, request_id=f"r{i}") for i, p in enumerate(prompts(3, seed=21))]
            tasks = [asyncio.create_task(collect(s)) for s in streams]
            while eng.stats().generated_tokens < 6:
                await asyncio.sleep(0.001)
            with pytest.raises(UnknownIdError):
                await eng.abort(["r0", "missing"])
            queued = await eng.abort("r2")  # still waiting: max_num_seqs=2
            first = await eng.abort("r0")
            rest = await eng.abort()
            chunks = await asyncio.gather(*tasks)
            return queued, first, rest, chunks

    queued, first, rest, chunks = asyncio.run(main())
    assert queued[0].request_id == "r2" and queued[0].token_ids == []
    assert first[0].request_id == "r0" and first[0].finish_reason is FinishReason.ABORT
    assert 0 < len(first[0].token_ids) < 200
    assert [o.request_id for o in rest] == ["r1"]
    for output, stream in zip(first + rest + queued, chunks):
        assert stream[-1].finish_reason is FinishReason.ABORT
        assert [t for c in stream for t in c.token_ids] == output.token_ids


def test_update_weights_mid_stream_reports_versions(model) -> None:
    new_weights = dict(tiny_model(seed=3).named_parameters())

    async def main():
        async with AsyncEngine(engine(tiny_model(seed=0))) as eng:
            chunks = []
            params = SamplingParams(temperature=0.0, max_new_tokens=30)
            async for chunk in eng.generate(prompts(1, seed=22)[0], params):
                chunks.append(chunk)
                if len(chunks) == 4:
                    await eng.update_weights(new_weights, version=7)
            return chunks

    chunks = asyncio.run(main())
    versions = [c.weight_version for c in chunks]
    assert len(chunks) == 30 and versions[:4] == [0] * 4 and versions[-1] == 7
    assert versions == sorted(versions) and set(versions) == {0, 7}


def test_bad_input_raises_to_its_caller_and_the_engine_keeps_serving(model) -> None:
    async def main():
        async with AsyncEngine(engine(model)) as eng:
            with pytest.raises(InvalidArgumentError, match="vocabulary"):
                await collect(eng.generate([1, 5000], GREEDY))
            with pytest.raises(InvalidArgumentError, match="empty"):
                await collect(eng.generate([], GREEDY))
            with pytest.raises(InvalidArgumentError, match="memory tags"):
                await eng.release_memory(["gpu"])
            with pytest.raises(InvalidArgumentError, match="shape"):
                await eng.update_weights({"model.norm.weight": model.model.norm.weight[:3]}, version=1)
            out = await collect(eng.generate([3, 4], GREEDY))
            assert eng.health()["status"] == "ok"
            return out

    out = asyncio.run(main())
    assert [t for c in out for t in c.token_ids] == greedy_reference(model, [3, 4], 16)


def test_leaving_a_stream_early_aborts_its_request(model) -> None:
    async def main():
        async with AsyncEngine(engine(model)) as eng:
            stream = eng.generate([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=100))
            async for _ in stream:
                break
            await stream.aclose()
            for _ in range(100):
                if not eng.core.has_unfinished():
                    break
                await asyncio.sleep(0.005)
            return eng.core.has_unfinished(), eng.stats().free_blocks

    unfinished, free = asyncio.run(main())
    assert not unfinished and free == 256


def test_calls_need_a_started_engine(model) -> None:
    async def main():
        eng = AsyncEngine(engine(model))
        with pytest.raises(InvalidStateError, match="not running"):
            await eng.abort()

    asyncio.run(main())


def test_lockstep_runs_one_model_step_per_release_after_the_calls_sent_before_it(model) -> None:
    """set_lockstep(True): no model step runs until release_step(); each release runs one, after every request
    and abort sent before it; its future is done once the step's chunks reached their streams. The tokens are
    those of free-running generation."""
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    batch = prompts(3, seed=30, high=10)

    async def main():
        async with AsyncEngine(engine(model)) as eng:
            assert isinstance(eng, LockstepEngine)
            await eng.set_lockstep(True)
            got: dict[str, list] = {}

            async def consume(rid: str, prompt: list[int]) -> None:
                got[rid] = []
                async for chunk in eng.generate(prompt, params, request_id=rid):
                    got[rid].append(chunk)

            tasks = [asyncio.create_task(consume(f"r{i}", p)) for i, p in enumerate(batch[:2])]
            await asyncio.sleep(0.05)
            assert eng.stats().steps == 0 and eng.stats().waiting == 2 and not eng.lockstep_busy()
            release = eng.release_step()
            assert eng.lockstep_busy() and eng.release_step() is release
            await release
            assert eng.stats().steps == 1 and not eng.lockstep_busy()
            assert [len(got[r]) for r in ("r0", "r1")] == [1, 1]  # chunks are in the streams
            await asyncio.sleep(0.05)
            assert eng.stats().steps == 1  # nothing runs ahead
            # Sent before the next release: a new request joins step 2, r0 is aborted before it.
            tasks.append(asyncio.create_task(consume("r2", batch[2])))
            await asyncio.sleep(0)
            aborted = await eng.abort("r0")
            await eng.release_step()
            assert eng.stats().steps == 2 and len(aborted[0].token_ids) == 1
            assert [len(got[r]) for r in ("r0", "r1", "r2")] == [2, 2, 1]  # r0: its token, then the abort end
            for _ in range(3):
                await eng.release_step()
            assert eng.stats().steps == 5 and sum(len(c.token_ids) for c in got["r2"]) == 4
            await eng.set_lockstep(False)  # free running again: the rest run to the end
            await asyncio.gather(*tasks)
            return got, aborted

    got, aborted = asyncio.run(main())
    assert got["r0"][-1].finish_reason is FinishReason.ABORT
    assert aborted[0].token_ids == greedy_reference(model, batch[0], 1)
    for rid, prompt in (("r1", batch[1]), ("r2", batch[2])):
        assert [t for c in got[rid] for t in c.token_ids] == greedy_reference(model, prompt, 6)
        assert got[rid][-1].finish_reason is FinishReason.LENGTH
