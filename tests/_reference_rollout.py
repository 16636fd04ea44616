"""Plain-torch sampling and batch packing: a reference rollout for tests and benchmarks (no KV cache, no
scheduler; not part of the package). The real rollout path is the embedded engine driven by the scheduler."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from april_ext.batch import FinishReason, TrainingBatch
from april_ext.data_source import Prompt
from april_ext.errors import InvalidArgumentError
from april_ext.model import LlamaForCausalLM


@dataclass
class SampledResponse:
    tokens: list[int]
    logprobs: list[float]  # log-probability of each token under the distribution it was drawn from
    finish_reason: FinishReason


@torch.no_grad()
def sample_responses(model: LlamaForCausalLM, prompts: Sequence[Sequence[int]], *, n_samples: int,
                     max_new_tokens: int, eos_ids: Sequence[int], temperature: float = 1.0,
                     generator: torch.Generator | None = None) -> list[list[SampledResponse]]:
    """``n_samples`` responses per prompt, recomputing the whole sequence at every step."""
    if n_samples < 1 or max_new_tokens < 1 or temperature <= 0:
        raise InvalidArgumentError(f"n_samples and max_new_tokens must be >= 1 and temperature > 0, got "
                                   f"{n_samples}, {max_new_tokens}, {temperature}")
    device = next(model.parameters()).device
    seqs = [list(p) for p in prompts for _ in range(n_samples)]
    out = [SampledResponse([], [], FinishReason.LENGTH) for _ in seqs]
    active = list(range(len(seqs)))
    eos = set(eos_ids)
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        if not active:
            break
        flat = torch.tensor([t for i in active for t in seqs[i]], device=device)
        lengths = torch.tensor([len(seqs[i]) for i in active])
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(device)
        logits = model(flat, cu_seqlens=cu)[cu[1:] - 1].float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        picked = torch.multinomial(logp.exp().cpu(), 1, generator=generator).squeeze(1)
        chosen = logp.cpu().gather(1, picked[:, None]).squeeze(1)
        still = []
        for i, token, lp in zip(active, picked.tolist(), chosen.tolist()):
            seqs[i].append(token)
            out[i].tokens.append(token)
            out[i].logprobs.append(lp)
            if token in eos:
                out[i].finish_reason = FinishReason.STOP
            elif len(out[i].tokens) < max_new_tokens:
                still.append(i)
        active = still
    model.train(was_training)
    return [out[k * n_samples:(k + 1) * n_samples] for k in range(len(prompts))]


def pack_batch(prompts: Sequence[Prompt], groups: Sequence[Sequence[SampledResponse]],
               rewards: Sequence[Sequence[float]], policy_version: int) -> TrainingBatch:
    """A TrainingBatch of freshly sampled groups: every response token has version ``policy_version``."""
    if not (len(prompts) == len(groups) == len(rewards)):
        raise InvalidArgumentError(f"prompts, groups and rewards must have one entry per group, got "
                                   f"{len(prompts)}, {len(groups)}, {len(rewards)}")
    tokens: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    offsets, prompt_lens, flat_rewards, group_index, finish = [0], [], [], [], []
    for g, (prompt, group, group_rewards) in enumerate(zip(prompts, groups, rewards)):
        for response, reward in zip(group, group_rewards, strict=True):
            p = list(prompt.token_ids)
            tokens += p + response.tokens
            loss_mask += [0] * len(p) + [1] * len(response.tokens)
            logprobs += [0.0] * len(p) + response.logprobs
            versions += [-1] * len(p) + [policy_version] * len(response.tokens)
            offsets.append(len(tokens))
            prompt_lens.append(len(p))
            flat_rewards.append(reward)
            group_index.append(g)
            finish.append(int(response.finish_reason))
    return TrainingBatch(
        tokens=np.asarray(tokens, dtype=np.int32), offsets=np.asarray(offsets, dtype=np.int64),
        prompt_lens=np.asarray(prompt_lens, dtype=np.int32), loss_mask=np.asarray(loss_mask, dtype=np.uint8),
        behavior_logprobs=np.asarray(logprobs, dtype=np.float32), versions=np.asarray(versions, dtype=np.int32),
        rewards=np.asarray(flat_rewards, dtype=np.float32), group_index=np.asarray(group_index, dtype=np.int32),
        sample_ids=np.arange(len(flat_rewards), dtype=np.int64), finish_reasons=np.asarray(finish, dtype=np.uint8),
        policy_version=policy_version, prompt_ids=[p.id for p in prompts],
        metadata=[dict(p.metadata) for p in prompts])
