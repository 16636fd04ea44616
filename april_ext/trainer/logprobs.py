"""pi_train: the log-probability of each packed token under the rollouts' sampling distribution
(logits / temperature, then the engine's top-k / top-p), with gradient for the loss or without for
pi_old and the KL reference."""

from __future__ import annotations

import contextlib

import torch

from april_ext.model import LlamaForCausalLM
from april_ext.model.logits import processed_logprobs
from april_ext.protocol.sampling_params import SamplingParams
from april_ext.trainer.batching import split_by_token_budget
from april_ext.trainer.config import TrainerConfig

# pi_train of a token that top-k / top-p drop (probability 0): finite, so that PPO ratios, TIS weights and
# the KL term stay finite (exp(50) fits in float32) and masked products stay 0; it carries no gradient.
DROPPED_LOGPROB = -50.0


def use_bf16_autocast(mode: str, device: torch.device) -> bool:
    """"auto": bf16 on GPUs that support it, fp32 elsewhere; "bf16" / "fp32" as asked."""
    if mode == "auto":
        return device.type == "cuda" and torch.cuda.is_bf16_supported()
    return mode == "bf16"


class PolicyLogprobs:
    """Computes pi_train for a model on the trainer's device, as the trainer config describes the
    rollouts' sampling (temperature, top-k, top-p) and the forward's precision."""

    def __init__(self, config: TrainerConfig, device: torch.device) -> None:
        self.device = device
        self.autocast = use_bf16_autocast(config.mixed_precision, device)
        self.temperature = config.temperature
        self.micro_batch_tokens = config.micro_batch_tokens
        self.micro_batch_size = config.micro_batch_size
        # The rollouts' top-k / top-p, as the engine's sampler takes them; None when neither filters.
        self.filters = (SamplingParams(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k)
                        if config.temperature > 0 and (config.top_k > 0 or config.top_p < 1) else None)

    def __call__(self, model: LlamaForCausalLM, tokens: torch.Tensor, cu_seqlens: torch.Tensor, *,
                 with_entropy: bool = False, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probability of each token given the tokens before it in its sample (0 at sample starts)
        under the sampling distribution, and that distribution's entropy (zeros unless ``with_entropy``;
        with gradient when ``entropy_grad``, for the entropy bonus)."""
        logp = torch.log_softmax(self._sampling_logits(model, tokens, cu_seqlens), dim=-1)
        out = torch.zeros(tokens.shape[0], dtype=torch.float32, device=tokens.device)
        picked = logp[:-1].gather(1, tokens[1:, None]).squeeze(1)
        if self.filters is not None:
            picked = torch.where(picked == float("-inf"), torch.full_like(picked, DROPPED_LOGPROB), picked)
        out[1:] = picked
        starts = cu_seqlens[:-1].to(tokens.device)
        out = out.index_fill(0, starts, 0.0)
        entropy = torch.zeros_like(out)
        if with_entropy:
            with torch.no_grad() if not entropy_grad else contextlib.nullcontext():
                # entr(0) = 0: dropped tokens add nothing (exp(-inf) * -inf would be nan).
                entropy = torch.cat((entropy[:1], torch.special.entr(logp[:-1].exp()).sum(-1)))
                entropy = entropy.index_fill(0, starts, 0.0)
        return out, entropy

    @torch.no_grad()
    def no_grad(self, model: LlamaForCausalLM, tokens: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """pi_train of every token of a packed batch, micro-batch by micro-batch, without gradient."""
        pieces = []
        for a, b in split_by_token_budget(offsets.diff().tolist(), self.micro_batch_tokens, self.micro_batch_size):
            u0, u1 = int(offsets[a]), int(offsets[b])
            pieces.append(self(model, tokens[u0:u1], offsets[a:b + 1] - offsets[a])[0])
        return torch.cat(pieces)

    def _sampling_logits(self, model: LlamaForCausalLM, tokens: torch.Tensor,
                         cu_seqlens: torch.Tensor) -> torch.Tensor:
        """fp32 logits with the tokens top-k / top-p drop at -inf, divided by the temperature (> 0)."""
        autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast
                    else contextlib.nullcontext())
        with autocast:
            logits = model(tokens, cu_seqlens=cu_seqlens.to(tokens.device))
        logits = logits.float()
        if self.filters is not None:
            # The engine's own processing picks the kept tokens; the gradient flows through the kept logits.
            with torch.no_grad():
                dropped = processed_logprobs(logits.detach(), [self.filters] * logits.shape[0]) == float("-inf")
            logits = logits.masked_fill(dropped, float("-inf"))
        if self.temperature > 0:
            logits = logits / self.temperature
        return logits


__all__ = ["DROPPED_LOGPROB", "PolicyLogprobs", "use_bf16_autocast"]
