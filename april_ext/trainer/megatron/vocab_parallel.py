"""Per-token log-probabilities and entropy from vocabulary-sharded logits.

With tensor parallelism each rank holds the logits of its 1/tp slice of the vocabulary. The
log-softmax needs only three reductions across the tensor-parallel group (the max, the sum of
exponentials, the picked token's logit), which megatron-core's ``vocab_parallel_cross_entropy`` does with
its own backward; the entropy (a metric, or with gradient the entropy bonus) needs one more sum. No rank ever holds the
whole vocabulary. Entries of a padded vocabulary past the real one are -inf before the softmax.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                   vocab_size: int | None = None,
                   with_entropy: bool = False, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature)[target] for each row of ``logits`` [N, V/tp] (this rank's slice of
    the vocabulary) and ``targets`` [N] (global token ids), with gradient; and the distribution's entropy
    [N] when ``with_entropy`` (with gradient when ``entropy_grad``: the entropy bonus). temperature 0 means the raw logits. vocab_size: the real
    vocabulary when the logits are padded past it (a vocabulary padded to a multiple of tp): the padded
    entries get no probability (and so no gradient)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    width = scaled.shape[-1]
    if vocab_size is not None and vocab_size < (parallel_state.get_tensor_model_parallel_rank() + 1) * width:
        column = torch.arange(width, device=scaled.device) + parallel_state.get_tensor_model_parallel_rank() * width
        scaled = scaled.masked_fill(column >= vocab_size, float("-inf"))
    entropy = None
    if with_entropy:
        group = parallel_state.get_tensor_model_parallel_group()
        entropy = _entropy(scaled, group) if entropy_grad else _entropy(scaled.detach(), group, grad=False)
    # vocab_parallel_cross_entropy overwrites its input in place; ``scaled`` is a fresh tensor.
    logp = -vocab_parallel_cross_entropy(scaled, targets)
    return logp, entropy


def _entropy(logits: torch.Tensor, group: dist.ProcessGroup, *, grad: bool = True) -> torch.Tensor:
    """-sum p log p = log Z - sum p x over the whole vocabulary, from this rank's slice (``group``: the
    tensor-parallel group); with ``grad`` the sums are all-reduced by Megatron's autograd-aware reduction, so
    each rank's slice gets its share of the gradient."""
    with torch.no_grad():
        # The shift cancels out of the entropy, so the max needs no gradient.
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top[:, None]
    exp = shifted.exp()
    # Padded entries are -inf: they add 0 (not 0 x -inf) to the sum.
    sums = torch.stack((exp.sum(-1), torch.where(exp > 0, exp * shifted, 0.0).sum(-1)))
    if grad:
        # Megatron's convention: the loss is the same on every tensor-parallel rank, so the backward of the sum
        # passes each rank's gradient through unchanged.
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        sums = reduce_from_tensor_model_parallel_region(sums)
    else:
        sums = sums.detach()
        dist.all_reduce(sums, group=group)
    return sums[0].log() - sums[1] / sums[0]


__all__ = ["token_logprobs"]
