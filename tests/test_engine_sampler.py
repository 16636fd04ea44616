"""The sampler against a row-by-row reference of the documented logprob definition."""

from __future__ import annotations

import math

import pytest
import torch

from april_ext.engine.sampler import processed_logprobs, sample, uniform
from april_ext.errors import InvalidArgumentError
from april_ext.protocol.sampling_params import SamplingParams


def reference_logprobs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row, written out plainly: temperature, top-k (ties kept), top-p over sorted probabilities."""
    z = logits.double()
    if p.temperature == 0:
        return z.log_softmax(-1)
    z = z / p.temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    if 0 < p.top_k < z.numel():
        kth = z.sort(descending=True).values[p.top_k - 1]
        keep &= z >= kth
    if p.top_p < 1.0:
        probs = z.masked_fill(~keep, -math.inf).softmax(-1)
        order = probs.argsort(descending=True)
        mass = 0.0
        top_p_keep = torch.zeros_like(keep)
        for i in order.tolist():
            if mass > p.top_p:
                break
            top_p_keep[i] = True
            mass += float(probs[i])
        keep &= top_p_keep
    return z.masked_fill(~keep, -math.inf).log_softmax(-1)


PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.5),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=2.0, top_k=1000),
]


def test_processed_logprobs_match_the_reference() -> None:
    logits = torch.randn(len(PARAMS), 53, generator=torch.Generator().manual_seed(0)) * 3
    got = processed_logprobs(logits, PARAMS)
    for row, p in enumerate(PARAMS):
        expected = reference_logprobs(logits[row], p).float()
        assert torch.equal(torch.isinf(got[row]), torch.isinf(expected)), p
        finite = torch.isfinite(expected)
        torch.testing.assert_close(got[row][finite], expected[finite], rtol=1e-5, atol=1e-5)


def test_greedy_and_top_k_one_pick_the_argmax_with_their_own_logprob() -> None:
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=1)]
    tokens, logprobs = sample(logits, params, seeds=[3, 4], positions=[10, 10])
    assert tokens == [int(logits[0].argmax()), int(logits[1].argmax())]
    assert logprobs[0] == pytest.approx(float(logits[0].log_softmax(-1).max()), abs=1e-6)
    assert logprobs[1] == pytest.approx(0.0, abs=1e-6)


def test_draws_follow_the_processed_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0, 1.5]])
    p = SamplingParams(temperature=0.8, top_k=4)
    expected = processed_logprobs(logits, [p])[0].exp()
    n = 4000
    counts = torch.zeros(6)
    tokens, logprobs = sample(logits.expand(n, 6), [p] * n, seeds=[7] * n, positions=list(range(n)))
    for t in tokens:
        counts[t] += 1
    assert counts[expected == 0].sum() == 0
    # Each frequency within 4 standard deviations of its probability.
    sd = (expected * (1 - expected) / n).sqrt()
    assert bool(((counts / n - expected).abs() <= 4 * sd + 1e-9).all()), (counts / n, expected)
    assert logprobs == pytest.approx([math.log(float(expected[t])) for t in tokens], abs=1e-5)


def test_draw_depends_only_on_seed_and_position() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 300, generator=gen)
    params = [SamplingParams(temperature=1.0, seed=9)] * 5
    tokens, lps = sample(logits, params, seeds=[9, 9, 9, 1, 2], positions=[4, 5, 6, 4, 4])
    alone, alone_lp = sample(logits[1:2], params[:1], seeds=[9], positions=[5])
    assert tokens[1] == alone[0] and lps[1] == pytest.approx(alone_lp[0], abs=1e-6)
    assert uniform(9, 5) == uniform(9, 5) and uniform(9, 5) != uniform(9, 6) and uniform(9, 5) != uniform(8, 5)
    values = [uniform(3, i) for i in range(2000)]
    assert all(0 <= u < 1 for u in values) and abs(sum(values) / len(values) - 0.5) < 0.03


@pytest.mark.parametrize("field, value", [
    ("max_new_tokens", 0), ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0),
    ("top_p", 1.5), ("top_k", 2.5), ("seed", -1), ("stop_token_ids", (3, -2)),
])
def test_sampling_params_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        SamplingParams(**{field: value})
