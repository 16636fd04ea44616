"""The embedded engine across a weight update and a memory release without recompute (issue 14 `carry`):
running requests keep their KV cache, the prefix cache never serves K/V of older weights to a new request,
and a KV cache released with a host backup comes back bit-exactly."""

from __future__ import annotations

import itertools

import pytest
import torch
from _engine_utils import GREEDY, engine, greedy_reference, greedy_with_carried_kv, tiny_model

from april_ext.protocol import SamplingParams

_prefixes = itertools.count()


def _kv_of(core, table: list[int]) -> list[torch.Tensor]:
    return [cache[table].clone() for cache in core.runner.k_caches + core.runner.v_caches]


def _step_until(core, generated: int) -> list:
    chunks = []
    while core.stats().generated_tokens < generated:
        chunks += core.step()
    return chunks


def test_weight_update_keeps_running_requests_and_their_kv() -> None:
    old, new = tiny_model(seed=0), tiny_model(seed=1)
    core = engine(tiny_model(seed=0))
    prompts = [[5, 17, 33, 2, 60, 7, 9], [1, 2, 3]]
    ids = [core.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=12)) for p in prompts]
    chunks = _step_until(core, 2 * 5)
    seqs = [core._requests[i] for i in ids]
    tables = [list(s.block_table) for s in seqs]
    computed = [s.num_computed for s in seqs]
    kv = [_kv_of(core, t) for t in tables]
    before = core.stats()

    core.update_weights(dict(new.named_parameters()), version=1)
    # Nothing was dropped: same blocks, same computed tokens, the same K/V bit for bit.
    assert [s.block_table for s in seqs] == tables and [s.num_computed for s in seqs] == computed
    assert all(torch.equal(a, b) for t, k in zip(tables, kv) for a, b in zip(_kv_of(core, t), k))
    while core.has_unfinished():
        chunks += core.step()
    after = core.stats()
    assert after.preemptions == before.preemptions == 0
    assert after.prefill_tokens == before.prefill_tokens  # no token was recomputed
    for rid, prompt, num_computed in zip(ids, prompts, computed):
        mine = [c for c in chunks if c.request_id == rid]
        tokens = [t for c in mine for t in c.token_ids]
        logprobs = [lp for c in mine for lp in c.logprobs]
        assert [c.weight_version for c in mine for _ in c.token_ids] == [0] * 5 + [1] * 7
        expected, expected_logprobs = greedy_with_carried_kv(old, new, prompt + tokens[:5], num_computed, 7)
        assert tokens[5:] == expected
        torch.testing.assert_close(torch.tensor(logprobs[5:]), torch.tensor(expected_logprobs), atol=1e-4, rtol=0)
        # Not what a recompute under the new weights gives: the old K/V really were used.
        recomputed = greedy_with_carried_kv(new, new, prompt + tokens[:5], num_computed, 7)[1]
        assert not torch.allclose(torch.tensor(logprobs[5:]), torch.tensor(recomputed), atol=1e-4)


def test_a_request_after_an_update_never_reuses_kv_of_older_weights() -> None:
    """A runs across the update; its first block fills only after it (prompt 3 tokens, blocks of 4), so
    its blocks hold K/V of both weights. B, admitted after the update with A's tokens as its prompt, must
    compute everything under the new weights: its output equals a fresh engine's."""
    new = tiny_model(seed=1)
    core = engine(tiny_model(seed=0))
    prompt = [4, 8, 15]
    a = core.add_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=20))
    chunks = _step_until(core, 1)
    core.update_weights(dict(new.named_parameters()), version=1)
    chunks += _step_until(core, 12)
    a_tokens = prompt + [t for c in chunks if c.request_id == a for t in c.token_ids]
    hits = core.stats().prefix_cache_hit_tokens
    b = core.add_request(a_tokens[:11], SamplingParams(temperature=0.0, max_new_tokens=6))
    got = []
    while core.has_request(b):
        got += [c for c in core.step() if c.request_id == b]
    assert core.stats().prefix_cache_hit_tokens == hits
    fresh = engine(tiny_model(seed=1)).generate([a_tokens[:11]], SamplingParams(temperature=0.0, max_new_tokens=6))[0]
    assert [t for c in got for t in c.token_ids] == fresh.token_ids
    torch.testing.assert_close(torch.tensor([lp for c in got for lp in c.logprobs]), torch.tensor(fresh.logprobs),
                               atol=1e-5, rtol=0)


def test_the_prefix_cache_still_shares_kv_computed_after_the_update() -> None:
    core = engine(tiny_model(seed=0))
    core.generate([[9] * 13], GREEDY)
    core.update_weights(dict(tiny_model(seed=1).named_parameters()), version=1)
    hits = core.stats().prefix_cache_hit_tokens
    first = core.generate([[9] * 13], GREEDY)[0]
    assert core.stats().prefix_cache_hit_tokens == hits  # the blocks of version 0 are not served
    second = core.generate([[9] * 13], GREEDY)[0]
    assert core.stats().prefix_cache_hit_tokens - hits == 12
    assert first.token_ids == second.token_ids == greedy_reference(tiny_model(seed=1), [9] * 13, 16)


def _colocated_engine(backup: bool):
    return engine(tiny_model(seed=0), kv_cache_cpu_backup=backup, memory_tag_prefix=f"test-carry-{next(_prefixes)}-")


def _run(core, prompts, params, pause_after: int | None) -> tuple[dict, dict]:
    ids = [core.add_request(p, params) for p in prompts]
    chunks = _step_until(core, pause_after) if pause_after is not None else []
    info = {}
    if pause_after is not None:
        tables = {i: list(core._requests[i].block_table) for i in ids if core.has_request(i)}
        kv = {i: _kv_of(core, t) for i, t in tables.items()}
        prefill = core.stats().prefill_tokens
        core.release_memory(None)
        info["resident_kv"] = core.memory.resident_bytes()["kv_cache"]
        core.resume_memory(None)
        info["kv_equal"] = all(torch.equal(a, b) for i, t in tables.items() for a, b in zip(_kv_of(core, t), kv[i]))
        info["running_after_resume"] = core.stats().running
        info["prefill_before"] = prefill
    while core.has_unfinished():
        chunks += core.step()
    info["prefill_after"] = core.stats().prefill_tokens
    out = {i: ([t for c in chunks if c.request_id == i for t in c.token_ids],
               [lp for c in chunks if c.request_id == i for lp in c.logprobs]) for i in ids}
    return out, info


def test_kv_cache_released_with_a_host_backup_resumes_bit_exactly_and_generation_continues_identically() -> None:
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1], [8, 2, 8, 1, 8, 2, 8, 4, 5, 9]]
    for params in (SamplingParams(temperature=0.0, max_new_tokens=24),
                   SamplingParams(temperature=1.0, max_new_tokens=24, seed=5)):
        baseline, _ = _run(_colocated_engine(backup=True), prompts, params, pause_after=None)
        paused_core = _colocated_engine(backup=True)
        paused, info = _run(paused_core, prompts, params, pause_after=3 * 7)
        assert info["resident_kv"] == 0
        assert info["kv_equal"] and info["running_after_resume"] == 3
        assert info["prefill_after"] == info["prefill_before"]  # nothing recomputed
        assert paused_core.stats().preemptions == 0
        assert list(paused.values()) == list(baseline.values())  # tokens and logprobs, exactly


def test_kv_cache_released_without_a_backup_is_flushed_and_recomputed() -> None:
    core = _colocated_engine(backup=False)
    _, info = _run(core, [[3, 1, 4, 1, 5, 9, 2, 6]], GREEDY, pause_after=5)
    assert info["running_after_resume"] == 0 and core.stats().preemptions == 1
    assert info["prefill_after"] > info["prefill_before"]


def test_async_pause_in_place_keeps_the_kv_across_an_update_and_retract_recomputes() -> None:
    import asyncio

    from april_ext.engine import AsyncEngine
    from april_ext.errors import InvalidArgumentError
    from april_ext.protocol import PausableEngine

    old, new = tiny_model(seed=0), tiny_model(seed=1)
    prompt = [5, 17, 33, 2, 60, 7, 9]

    async def main(mode: str):
        core = engine(tiny_model(seed=0))
        async with AsyncEngine(core) as eng:
            assert isinstance(eng, PausableEngine)
            with pytest.raises(InvalidArgumentError, match="in_place"):
                await eng.pause_generation("abort")
            stream = eng.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=16))
            tokens = []
            async for chunk in stream:
                tokens += chunk.token_ids
                if len(tokens) >= 4:
                    await eng.pause_generation(mode)
                    held = eng.stats()
                    await eng.update_weights(dict(new.named_parameters()), version=1)
                    await asyncio.sleep(0.05)
                    assert eng.stats().generated_tokens == held.generated_tokens  # nothing ran while paused
                    await eng.continue_generation()
                    break
            async for chunk in stream:
                tokens += chunk.token_ids
            return tokens, held, core.stats()

    tokens, held, end = asyncio.run(main("in_place"))
    generated = held.generated_tokens
    assert tokens[:generated] == greedy_reference(old, prompt, generated)
    assert tokens[generated:] == greedy_with_carried_kv(old, new, prompt + tokens[:generated],
                                                        len(prompt) + generated - 1, 16 - generated)[0]
    assert end.prefill_tokens == held.prefill_tokens and end.preemptions == 0
    tokens, held, end = asyncio.run(main("retract"))
    generated = held.generated_tokens
    assert tokens[generated:] == greedy_reference(new, prompt + tokens[:generated], 16 - generated)
    assert end.prefill_tokens == held.prefill_tokens + len(prompt) + generated
