"""Releasing and resuming the engine's memory tags on the CPU allocator backend, measured by RSS."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from _engine_utils import GREEDY, TINY, engine, greedy_reference, tiny_model
from april_ext.engine import AsyncEngine
from april_ext.errors import InvalidArgumentError, InvalidStateError

_prefixes = itertools.count()
MIB = 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def fresh_engine(**overrides):
    # A model with ~20 MiB of weights and a 32 MiB cache so RSS changes stand out from noise.
    config = TINY.replace(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                          head_dim=64)
    model = tiny_model(seed=0, config=config)
    core = engine(model, num_blocks=2048, block_size=16, memory_tag_prefix=f"test-mem-{next(_prefixes)}-",
                  **overrides)
    return model, core


def test_release_frees_rss_and_resume_plus_reload_serves_again() -> None:
    """The RL cycle without host copies: release both tags, resume weights, load weights, resume KV."""
    model, core = fresh_engine(weights_cpu_backup=False)
    weights = {name: p.detach().clone() for name, p in core.model.named_parameters()}
    reference = greedy_reference(model, [7, 8, 9], 16)
    assert core.generate([[7, 8, 9]], GREEDY)[0].token_ids == reference
    kv_bytes = core.runner.kv_cache_bytes
    weight_bytes = sum(p.numel() * p.element_size() for p in core.model.parameters())
    assert kv_bytes >= 32 * MIB and weight_bytes >= 15 * MIB
    resident = core.memory.resident_bytes()
    assert resident["kv_cache"] >= kv_bytes and resident["weights"] >= weight_bytes

    before = rss_bytes()
    core.release_memory(["kv_cache"])
    after_kv = rss_bytes()
    assert before - after_kv >= 0.9 * kv_bytes
    assert core.memory.resident_bytes()["kv_cache"] == 0
    assert core.stats().paused_tags == ("kv_cache",)
    rid = core.add_request([7, 8, 9], GREEDY)  # requests queue while memory is released
    with pytest.raises(InvalidStateError, match="resume_memory"):
        core.step()

    core.release_memory(["weights"])
    assert after_kv - rss_bytes() >= 0.9 * weight_bytes
    with pytest.raises(InvalidStateError, match="weights"):
        core.update_weights(weights, version=1)

    core.resume_memory(["weights"])
    core.update_weights(weights, version=1)
    core.resume_memory(["kv_cache"])
    assert core.stats().paused_tags == ()
    tokens = []
    while core.has_unfinished():
        tokens += [t for c in core.step() if c.request_id == rid for t in c.token_ids]
    assert tokens == reference


def test_weights_host_backup_restores_them_on_resume() -> None:
    model, core = fresh_engine(weights_cpu_backup=True)
    reference = core.generate([[5, 4, 3]], GREEDY)[0].token_ids
    core.release_memory()
    assert core.memory.resident_bytes() == {"weights": 0, "kv_cache": 0}
    assert set(core.stats().paused_tags) == {"weights", "kv_cache"}
    core.resume_memory()
    assert core.generate([[5, 4, 3]], GREEDY)[0].token_ids == reference


def test_release_kv_cache_mid_request_recomputes_and_completes() -> None:
    model, core = fresh_engine()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    rid = core.add_request(prompt, GREEDY)
    tokens = []
    for _ in range(5):
        tokens += [t for c in core.step() for t in c.token_ids]
    core.release_memory("kv_cache")
    assert core.stats().running == 0 and core.stats().waiting == 1
    core.resume_memory("kv_cache")
    while core.has_unfinished():
        tokens += [t for c in core.step() if c.request_id == rid for t in c.token_ids]
    assert tokens == greedy_reference(model, prompt, 16)


def test_unknown_tags_are_rejected_and_cuda_graph_holds_nothing() -> None:
    _, core = fresh_engine()
    with pytest.raises(InvalidArgumentError, match=r"unknown memory tags \['activations'\] \(allowed: \['weights', "
                                                   r"'kv_cache', 'cuda_graph'\]\)"):
        core.release_memory(["kv_cache", "activations"])
    assert core.stats().paused_tags == ()
    core.release_memory("cuda_graph")
    assert core.stats().paused_tags == () and not core.paused


def test_async_engine_waits_while_released_and_continues_after_resume() -> None:
    model, core = fresh_engine()

    async def main():
        async with AsyncEngine(core) as eng:
            await eng.release_memory()
            assert eng.health()["status"] == "paused"
            task = asyncio.create_task(_collect(eng.generate([2, 7, 1, 8], GREEDY)))
            await asyncio.sleep(0.05)
            assert not task.done() and eng.stats().waiting == 1
            await eng.resume_memory(["weights"])
            await eng.resume_memory(["kv_cache"])
            return await task

    chunks = asyncio.run(main())
    assert [t for c in chunks for t in c.token_ids] == greedy_reference(model, [2, 7, 1, 8], 16)


async def _collect(stream) -> list:
    return [c async for c in stream]
