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

from april_ext.model.logits import processed_logprobs
from april_ext.protocol.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) from (seed, position): SplitMix64 of the pair, top 53 bits."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK64
    for _ in range(2):
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return (x >> 11) / float(1 << 53)


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
