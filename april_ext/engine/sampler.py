"""Sampler: turns each sequence's last logits into a token and its behavior logprob.

Definition of the logprob returned with every token (the behavior logprob used for off-policy
correction): let z be the model's float32 logits for that position.
- temperature 0 (greedy): token = argmax z, logprob = log_softmax(z)[token].
- otherwise: z' = z / temperature; top-k keeps the entries >= the k-th largest of z' (ties kept);
  top-p keeps the smallest prefix of the entries sorted by probability, in descending order, whose
  mass reaches top_p (an entry is dropped when the mass before it already exceeds top_p); every other
  entry becomes -inf. logprob = log_softmax(z')[token] over the kept entries, i.e. the log of the
  probability with which the token was actually drawn.
The draw is inverse-CDF sampling with one uniform number u(seed, position) derived by a fixed hash
from the request's seed and the token's index in the sequence, so a request draws the same tokens at
the same positions whatever else is in the batch, and a resumed request continues the same stream.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import torch

from april_ext.engine.sampling import SamplingParams

_MASK64 = (1 << 64) - 1


def uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) from (seed, position): SplitMix64 of the pair, top 53 bits."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK64
    for _ in range(2):
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return (x >> 11) / float(1 << 53)


def processed_logprobs(logits: torch.Tensor, params: SequenceOf[SamplingParams]) -> torch.Tensor:
    """Row-wise log-probabilities [S, V] of the distribution each row samples from (see module doc).

    Greedy rows get the raw log_softmax; filtered-out entries are -inf.
    """
    logits = logits.float()
    device = logits.device
    greedy = torch.tensor([p.greedy for p in params], device=device)
    temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
    scaled = logits / temperature[:, None]
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab and not p.greedy else 0 for p in params]
    top_p = [p.top_p if not p.greedy else 1.0 for p in params]
    if any(top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, _ = scaled.sort(dim=-1, descending=True)
        threshold = torch.full((len(params), 1), float("-inf"), device=device)
        k_rows = [i for i, k in enumerate(top_k) if k]
        if k_rows:
            rows = torch.tensor(k_rows, device=device)
            kth = torch.tensor([top_k[i] - 1 for i in k_rows], device=device)
            threshold[rows, 0] = sorted_logits[rows, kth]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # top_p 1.0 must keep everything even when the float cumsum overshoots 1.
        p_limit = torch.tensor([p if p < 1.0 else float("inf") for p in top_p], device=device)[:, None]
        # The smallest kept logit per row; everything below it in the unsorted row is dropped.
        kept = (mass_before <= p_limit) & torch.isfinite(sorted_logits)
        last_kept = kept.sum(dim=-1, keepdim=True) - 1
        threshold = torch.maximum(threshold, sorted_logits.gather(-1, last_kept))
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    return torch.where(greedy[:, None], logits.log_softmax(dim=-1), scaled.log_softmax(dim=-1))


def sample(logits: torch.Tensor, params: SequenceOf[SamplingParams], seeds: SequenceOf[int],
           positions: SequenceOf[int]) -> tuple[list[int], list[float]]:
    """Draws one token per row of `logits` [S, V]; returns (tokens, behavior logprobs)."""
    logprobs = processed_logprobs(logits, params)
    greedy_tokens = logits.float().argmax(dim=-1)
    cdf = logprobs.double().exp().cumsum(dim=-1)
    u = torch.tensor([uniform(s, p) for s, p in zip(seeds, positions)], dtype=torch.float64,
                     device=logits.device)
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
    drawn = drawn.clamp_(max=logits.shape[-1] - 1)
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    tokens = torch.where(greedy, greedy_tokens, drawn)
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens.tolist(), chosen.tolist()
