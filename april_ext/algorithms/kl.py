"""Per-token estimates of KL(pi || pi_ref) from the log-probabilities of the sampled tokens (Schulman's
k1 / k2 / k3, and slime's low_var_kl, k3 clipped), for the KL loss and the KL reward shaping."""

from __future__ import annotations

import torch

from april_ext.errors import InvalidArgumentError

# low_var_kl's clip: k3 grows like exp(log pi_ref - log pi) for tokens the reference finds far likelier.
_LOW_VAR_CLIP = 10.0


def approx_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """With d = log pi - log pi_ref per token: "k1" d, "k2" d^2 / 2, "k3" exp(-d) + d - 1, "low_var_kl"
    k3 clipped to [-10, 10]. Float32, with gradient through ``logprobs`` (``ref_logprobs`` is a constant)."""
    d = logprobs.float() - ref_logprobs.detach().float()
    if kind == "k1":
        return d
    if kind == "k2":
        return d * d / 2.0
    if kind in ("k3", "low_var_kl"):
        kl = torch.exp(-d) + d - 1.0
        return kl.clamp(-_LOW_VAR_CLIP, _LOW_VAR_CLIP) if kind == "low_var_kl" else kl
    raise InvalidArgumentError(f"kind must be one of ('k1', 'k2', 'k3', 'low_var_kl'), got {kind!r}")


__all__ = ["approx_kl"]
