"""Divided rollout on the embedded engine: a continuation (prompt + the response so far, sent again after a
chunk ended with finish reason "length") reuses the KV of its earlier chunks through the prefix cache while
the weights are those that computed them, and recomputes everything after a weight update."""

from __future__ import annotations

import pytest
from _engine_utils import engine, prompts, tiny_model

from april_ext.batch import FinishReason
from april_ext.protocol import SamplingParams

BLOCK = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def _params(max_new_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=seed)


def _chunked(core, prompt: list[int], chunks: list[int], seeds: list[int]) -> tuple[list[list[int]], list[int]]:
    """Generates each prompt in chunks of the given sizes (all prompts' chunk k in one batch); returns the
    responses and the prefix-cache hit tokens of each round."""
    responses: list[list[int]] = [[] for _ in seeds]
    hits = []
    for size in chunks:
        before = core.stats().prefix_cache_hit_tokens
        outs = core.generate([prompt + r for r in responses], [_params(size, s) for s in seeds])
        hits.append(core.stats().prefix_cache_hit_tokens - before)
        for response, out in zip(responses, outs):
            assert out.finish_reason is FinishReason.LENGTH
            response += out.token_ids
    return responses, hits


def test_continuations_hit_the_prefix_cache_and_match_one_request(model) -> None:
    prompt = prompts(1, seed=3, low=10, high=10)[0]
    seeds = [11, 12, 13]
    whole = engine(model, block_size=BLOCK).generate([prompt] * 3, [_params(24, s) for s in seeds])
    responses, hits = _chunked(engine(model, block_size=BLOCK), prompt, [8, 8, 8], seeds)
    # The same random stream (a token's draw depends on the seed and its position), so the same tokens.
    assert responses == [o.token_ids for o in whole]
    # Each continuation finds the full blocks of everything computed before (its last token is computed anew).
    done = [len(prompt) + 8, len(prompt) + 16]
    assert hits[1:] == [3 * (n - 1) // BLOCK * BLOCK for n in done]


def test_continuation_after_a_weight_update_recomputes(model) -> None:
    prompt = prompts(1, seed=4, low=10, high=10)[0]
    core = engine(model, block_size=BLOCK)
    first = core.generate([prompt], _params(8, 5))[0]
    core.update_weights(dict(model.named_parameters()), version=1)
    before = core.stats()
    out = core.generate([prompt + first.token_ids], _params(8, 5))[0]
    after = core.stats()
    assert after.prefix_cache_hit_tokens == before.prefix_cache_hit_tokens
    assert after.prefill_tokens - before.prefill_tokens == len(prompt) + 8
    assert out.versions == [1] * 8
