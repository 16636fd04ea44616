"""Per-token log-probabilities and entropy from vocabulary-sharded logits.

With tensor parallelism each rank holds the logits of its 1/tp slice of the vocabulary. The
log-softmax needs only three reductions across the tensor-parallel group (the max, the sum of
exponentials, the picked token's logit), which megatron-core's ``vocab_parallel_cross_entropy`` does with
its own backward; the entropy (a metric, without gradient) needs one more sum. No rank ever holds the
whole vocabulary. Entries of a padded vocabulary past the real one are -inf before the softmax.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                   vocab_size: int | None = None,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature)[target] for each row of ``logits`` [N, V/tp] (this rank's slice of
    the vocabulary) and ``targets`` [N] (global token ids), with gradient; and the distribution's entropy
    [N] without gradient when ``with_entropy``. temperature 0 means the raw logits. vocab_size: the real
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
        entropy = _entropy(scaled.detach(), parallel_state.get_tensor_model_parallel_group())
    # vocab_parallel_cross_entropy overwrites its input in place; ``scaled`` is a fresh tensor.
    logp = -vocab_parallel_cross_entropy(scaled, targets)
    return logp, entropy


@torch.no_grad()
def _entropy(logits: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """-sum p log p = log Z - sum p x over the whole vocabulary, from this rank's slice."""
    top = logits.max(dim=-1).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top[:, None]
    exp = shifted.exp()
    # Padded entries are -inf: they add 0 (not 0 x -inf) to the sum.
    sums = torch.stack((exp.sum(-1), torch.where(exp > 0, exp * shifted, 0.0).sum(-1)))
    dist.all_reduce(sums, group=group)
    return sums[0].log() - sums[1] / sums[0]


__all__ = ["token_logprobs"]
