"""The distribution a request samples from, as log-probabilities: temperature, top-k and top-p applied to
the model's logits. The engine draws its tokens from it and the trainer recomputes the behavior
logprobs with it, so both use this one definition (see april_ext.engine.sampler for the rules).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import torch

from april_ext.protocol.sampling_params import SamplingParams


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


__all__ = ["processed_logprobs"]
