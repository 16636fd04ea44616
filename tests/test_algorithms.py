"""Advantages, policy losses, off-policy correction and filters against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from april_ext import ConfigError
from april_ext.algorithms import (
    AlgorithmConfig,
    PolicyLossInputs,
    aggregation_weights,
    group_advantages,
    offpolicy_loss_mask,
    policy_loss,
    reject_uniform_groups,
    truncated_is_weights,
)

LN = math.log


def _inputs(logprobs, advantages, *, old=None, behavior=None, mask=None, seq_index=None, mode="token",
            ref=None):
    n = len(logprobs)
    lp = torch.tensor(logprobs, dtype=torch.float32, requires_grad=True)
    old_t = torch.tensor(old if old is not None else [0.0] * n)
    mask_t = torch.tensor(mask if mask is not None else [1.0] * n)
    seq = torch.tensor(seq_index if seq_index is not None else [0] * n)
    n_seqs = int(seq.max()) + 1
    return PolicyLossInputs(
        logprobs=lp, old_logprobs=old_t,
        behavior_logprobs=torch.tensor(behavior) if behavior is not None else old_t.clone(),
        advantages=torch.tensor(advantages, dtype=torch.float32), mask=mask_t,
        weights=aggregation_weights(mask_t, seq, n_seqs, mode), seq_index=seq, n_seqs=n_seqs,
        ref_logprobs=torch.tensor(ref) if ref is not None else None)


# Four tokens with old logprob 0, so ratio = exp(logprob):
#   t0 ratio 1.5, A=+1 -> clipped at 1 + eps_high         -> loss -1.28 (DAPO) / -1.2 (eps 0.2)
#   t1 ratio 0.5, A=+1 -> min(0.5, 0.8) = 0.5             -> loss -0.5
#   t2 ratio 0.5, A=-1 -> min(-0.5, -0.8) = -0.8 clipped  -> loss 0.8
#   t3 ratio 1.1, A=-2 -> inside the range                -> loss 2.2
PPO_LOGPROBS = [LN(1.5), LN(0.5), LN(0.5), LN(1.1)]
PPO_ADV = [1.0, 1.0, -1.0, -2.0]


def test_ppo_dapo_clip_token_level_loss_and_gradient():
    inputs = _inputs(PPO_LOGPROBS, PPO_ADV)
    out = policy_loss(AlgorithmConfig.dapo(), inputs)
    assert out.loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 2.2) / 4, abs=1e-6)
    out.loss.backward()
    # d(-r A)/d logprob = -r A where unclipped, 0 where the clipped term is the minimum.
    assert inputs.logprobs.grad.tolist() == pytest.approx([0.0, 0.5 * -1 / 4, 0.0, 1.1 * 2 / 4], abs=1e-6)
    assert out.metrics["clip_frac_high"].item() == pytest.approx(0.25)
    assert out.metrics["clip_frac_low"].item() == pytest.approx(0.25)


def test_ppo_symmetric_clip():
    out = policy_loss(AlgorithmConfig.grpo(), _inputs(PPO_LOGPROBS, PPO_ADV))
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 2.2) / 4, abs=1e-6)


def test_ppo_sequence_level_aggregation():
    # Sequence 0 = t0..t2 (mean (-1.28 - 0.5 + 0.8) / 3), sequence 1 = t3 (2.2); then the mean of both.
    out = policy_loss(AlgorithmConfig.dapo(aggregation="sequence"),
                      _inputs(PPO_LOGPROBS, PPO_ADV, seq_index=[0, 0, 0, 1], mode="sequence"))
    assert out.loss.item() == pytest.approx(((-1.28 - 0.5 + 0.8) / 3 + 2.2) / 2, abs=1e-6)


def test_loss_mask_excludes_tokens():
    out = policy_loss(AlgorithmConfig.dapo(), _inputs(PPO_LOGPROBS, PPO_ADV, mask=[1.0, 1.0, 1.0, 0.0]))
    assert out.loss.item() == pytest.approx((-1.28 - 0.5 + 0.8) / 3, abs=1e-6)


def test_truncated_importance_sampling_weights_each_token():
    # pi_train / pi_behavior = exp(0 - behavior): 4 (capped to 2), 0.5, 1, 1.
    behavior = [LN(0.25), LN(2.0), 0.0, 0.0]
    out = policy_loss(AlgorithmConfig.dapo(tis_cap=2.0), _inputs(PPO_LOGPROBS, PPO_ADV, behavior=behavior))
    assert out.loss.item() == pytest.approx((-1.28 * 2 - 0.5 * 0.5 + 0.8 + 2.2) / 4, abs=1e-6)
    assert out.metrics["tis_truncated_frac"].item() == pytest.approx(0.25)
    assert truncated_is_weights(torch.tensor([0.0, 0.0]), torch.tensor([LN(0.1), LN(4.0)]), 3.0).tolist() \
        == pytest.approx([3.0, 0.25])


def test_decoupled_loss_clips_against_the_proximal_policy_and_weights_by_behavior():
    """AReaL's decoupled PPO on three tokens of different rollout versions (a resumed partial's tokens carry
    their own behavior log-probs):
      t0: pi_prox 0.5, pi_behavior 0.25 -> w 2;   ratio pi / pi_prox 1.1, A=+1 inside the clip -> -1.1 * 2
      t1: pi_prox 0.3, pi_behavior 0.6  -> w 0.5; ratio 1.5, A=+1 clipped at 1.2                -> -1.2 * 0.5
      t2: pi_prox 0.9, pi_behavior 0.1  -> w 9 > cap 5: weight 0, still counted in the mean   -> 0
    """
    prox = [LN(0.5), LN(0.3), LN(0.9)]
    behavior = [LN(0.25), LN(0.6), LN(0.1)]
    logprobs = [LN(0.55), LN(0.45), LN(0.9)]
    adv = [1.0, 1.0, -1.0]
    config = AlgorithmConfig(use_decoupled_loss=True, behav_imp_weight_cap=5.0)
    inputs = _inputs(logprobs, adv, old=prox, behavior=behavior)
    out = policy_loss(config, inputs)
    assert out.loss.item() == pytest.approx((-1.1 * 2 - 1.2 * 0.5 + 0.0) / 3, abs=1e-6)
    out.loss.backward()
    # d(-r A w)/d logprob = -r A w where unclipped; 0 where clipped or masked by the cap.
    assert inputs.logprobs.grad.tolist() == pytest.approx([-1.1 * 2 / 3, 0.0, 0.0], abs=1e-6)
    assert out.metrics["behav_imp_weight"].item() == pytest.approx((2 + 0.5 + 0) / 3, abs=1e-6)
    assert out.metrics["behav_masked_frac"].item() == pytest.approx(1 / 3, abs=1e-6)
    # Without the cap t2 counts with weight 9: ratio 1, A=-1 -> 1 * 9.
    uncapped = policy_loss(AlgorithmConfig(use_decoupled_loss=True),
                           _inputs(logprobs, adv, old=prox, behavior=behavior))
    assert uncapped.loss.item() == pytest.approx((-1.1 * 2 - 1.2 * 0.5 + 9.0) / 3, abs=1e-5)
    # Off: the same tokens without the behavior weights.
    plain = policy_loss(AlgorithmConfig(), _inputs(logprobs, adv, old=prox, behavior=behavior))
    assert plain.loss.item() == pytest.approx((-1.1 - 1.2 + 1.0) / 3, abs=1e-6)
    # Tokens off the loss mask get weight 0 even where the weight overflows (no 0 * inf = nan).
    masked = policy_loss(config.replace(behav_imp_weight_cap=None),
                         _inputs([0.0, 0.0], [1.0, 1.0], old=[0.0, 0.0], behavior=[0.0, -200.0], mask=[1.0, 0.0]))
    assert masked.loss.item() == pytest.approx(-1.0)


def test_decoupled_loss_weights_gspo_per_token():
    # One sequence, ratios 2 and 0.5 against pi_prox (s = 1, A=+1 -> -1 per token), weights 2 and 0.5.
    prox = [0.0, 0.0]
    out = policy_loss(AlgorithmConfig(loss="gspo", use_decoupled_loss=True),
                      _inputs([LN(2.0), LN(0.5)], [1.0, 1.0], old=prox, behavior=[LN(0.5), LN(2.0)], seq_index=[0, 0]))
    assert out.loss.item() == pytest.approx((-1.0 * 2 - 1.0 * 0.5) / 2, abs=1e-6)


def test_gspo_sequence_ratio():
    # Sequence 0: token ratios 2 and 0.5 -> geometric mean 1, A=+1 -> loss -1.
    # Sequence 1: token ratios 1.1 x3 -> s = 1.1, A=-1 -> -min(-1.1, -clip(1.1)) = 1.1 with eps 0.2.
    logprobs = [LN(2.0), LN(0.5), LN(1.1), LN(1.1), LN(1.1)]
    adv = [1.0, 1.0, -1.0, -1.0, -1.0]
    seq = [0, 0, 1, 1, 1]
    cfg = AlgorithmConfig(loss="gspo", eps_low=0.2, eps_high=0.2, aggregation="sequence")
    out = policy_loss(cfg, _inputs(logprobs, adv, seq_index=seq, mode="sequence"))
    assert out.loss.item() == pytest.approx((-1.0 + 1.1) / 2, abs=1e-6)
    tok = policy_loss(cfg.replace(aggregation="token"), _inputs(logprobs, adv, seq_index=seq))
    assert tok.loss.item() == pytest.approx((2 * -1.0 + 3 * 1.1) / 5, abs=1e-6)
    # The paper's narrow range clips s = 1.1 with A=+1 at 1 + 4e-4.
    narrow = policy_loss(AlgorithmConfig.gspo(), _inputs([LN(1.1), LN(1.1)], [1.0, 1.0], seq_index=[0, 0],
                                                         mode="sequence"))
    assert narrow.loss.item() == pytest.approx(-1.0004, abs=1e-6)


def test_gspo_gradient_flows_through_the_sequence_ratio():
    # s = exp(mean(logprob)); d(-s A)/d logprob_t = -s A / n: with s = 1, A = 1, n = 2 -> -0.5 each.
    inputs = _inputs([LN(2.0), LN(0.5)], [1.0, 1.0], seq_index=[0, 0], mode="sequence")
    out = policy_loss(AlgorithmConfig(loss="gspo", aggregation="sequence"), inputs)
    out.loss.backward()
    assert inputs.logprobs.grad.tolist() == pytest.approx([-0.5, -0.5], abs=1e-6)


def test_kl_penalty_k3():
    # d = ln(0.25) - ln(0.5) = -ln 2; k3 = exp(d) - d - 1 = 0.5 + ln 2 - 1.
    out = policy_loss(AlgorithmConfig(kl_loss_coef=0.1, kl_loss_type="k3"),
                      _inputs([LN(0.5)], [0.0], old=[LN(0.5)], ref=[LN(0.25)]))
    assert out.loss.item() == pytest.approx(0.1 * (0.5 + LN(2.0) - 1.0), abs=1e-6)
    assert out.metrics["kl"].item() == pytest.approx(0.5 + LN(2.0) - 1.0, abs=1e-6)


def test_kl_requires_reference_logprobs():
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(AlgorithmConfig(kl_loss_coef=0.1), _inputs([0.0], [1.0]))


def test_micro_batches_add_up_to_the_batch_loss():
    gen = torch.Generator().manual_seed(0)
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1, 1, 1], dtype=torch.float32)
    lp = (torch.randn(10, generator=gen) * 0.3 - 1.0).requires_grad_()
    old = lp.detach() + torch.randn(10, generator=gen) * 0.3
    adv = torch.tensor([1.0, 1.0, 1.0, -0.5, -0.5, 2.0, 2.0, 2.0, 2.0, -1.0])
    for mode in ("token", "sequence"):
        for loss in ("ppo", "gspo"):
            cfg = AlgorithmConfig(loss=loss, aggregation=mode, tis_cap=1.5)
            w = aggregation_weights(mask, seq, 4, mode)
            full = policy_loss(cfg, PolicyLossInputs(lp, old, old - 0.1, adv, mask, w, seq, 4)).loss
            g_full, = torch.autograd.grad(full, lp)
            parts = []
            for sl, offset in ((slice(0, 5), 0), (slice(5, 10), 2)):
                parts.append(policy_loss(cfg, PolicyLossInputs(
                    lp[sl], old[sl], old[sl] - 0.1, adv[sl], mask[sl], w[sl], seq[sl] - offset, 2)).loss)
            total = parts[0] + parts[1]
            g_parts, = torch.autograd.grad(total, lp)
            assert total.item() == pytest.approx(full.item(), abs=1e-6)
            assert torch.allclose(g_parts, g_full, atol=1e-6)


def test_aggregation_weights():
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    seq = torch.tensor([0, 0, 1, 2])
    assert aggregation_weights(mask, seq, 3, "token").tolist() == pytest.approx([1 / 3, 1 / 3, 0, 1 / 3])
    # Sequence 1 has no loss token, so two sequences count: each gets 1/2, split over its tokens.
    assert aggregation_weights(mask, seq, 3, "sequence").tolist() == pytest.approx([0.25, 0.25, 0, 0.5])
    assert aggregation_weights(torch.zeros(3), torch.tensor([0, 0, 1]), 2, "token").tolist() == [0, 0, 0]


def test_grpo_and_drgrpo_advantages():
    rewards = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 5.0, 0.0, 1.0, 2.0]
    groups = [0, 0, 0, 0, 1, 1, 2, 3, 3, 3]
    # Group 0: mean 0.5, unbiased std sqrt(1/3); group 1: std 0; group 2: one sample; group 3: mean 1, std 1.
    a = 0.5 / math.sqrt(1 / 3)
    assert group_advantages(rewards, groups).tolist() == pytest.approx(
        [a, -a, -a, a, 0, 0, 0, -1, 0, 1], abs=1e-5)
    assert group_advantages(rewards, groups, normalize_std=False).tolist() == pytest.approx(
        [0.5, -0.5, -0.5, 0.5, 0, 0, 0, -1, 0, 1], abs=1e-6)


def test_advantages_reject_mismatched_shapes():
    with pytest.raises(ValueError, match="group_index"):
        group_advantages([1.0, 2.0], [0])


def test_offpolicy_masks():
    versions = torch.tensor([-1, -1, 3, 4, 5, 5])
    loss_mask = torch.tensor([0, 0, 1, 1, 1, 1], dtype=torch.uint8)
    assert offpolicy_loss_mask(loss_mask, versions, 5, mode="none").tolist() == [0, 0, 1, 1, 1, 1]
    # Staleness 5 - version: token of version 3 is 2 versions old.
    assert offpolicy_loss_mask(loss_mask, versions, 5, mode="stale", max_staleness=1).tolist() == \
        [0, 0, 0, 1, 1, 1]
    assert offpolicy_loss_mask(loss_mask, versions, 5, mode="offpolicy").tolist() == [0, 0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="max_staleness"):
        offpolicy_loss_mask(loss_mask, versions, 5, mode="stale")


def test_dynamic_sampling_filter():
    assert reject_uniform_groups([1.0, 0.0, 1.0]) is True
    assert reject_uniform_groups([0.5, 0.5, 0.5]) is False
    assert reject_uniform_groups([]) is False


@pytest.mark.parametrize("changes, field, allowed", [
    ({"advantage": "ppo"}, "advantage", "grpo"),
    ({"loss": "reinforce"}, "loss", "gspo"),
    ({"aggregation": "batch"}, "aggregation", "sequence"),
    ({"eps_low": 1.5}, "eps_low", "[0, 1)"),
    ({"eps_high": -0.1}, "eps_high", ">= 0"),
    ({"kl_coef": float("nan")}, "kl_coef", ">= 0"),
    ({"kl_loss_coef": -1.0}, "kl_loss_coef", ">= 0"),
    ({"kl_loss_type": "k4"}, "kl_loss_type", "low_var_kl"),
    ({"gamma": 1.5}, "gamma", "[0, 1]"),
    ({"advantage": "rloo"}, "advantage", "reinforce_plus_plus_baseline"),
    ({"behav_imp_weight_cap": 2.0}, "behav_imp_weight_cap", "use_decoupled_loss"),
    ({"use_decoupled_loss": True, "behav_imp_weight_cap": 1.0}, "behav_imp_weight_cap", "> 1"),
    ({"use_decoupled_loss": True, "tis_cap": 2.0}, "tis_cap", "use_decoupled_loss"),
    ({"tis_cap": 0.0}, "tis_cap", "> 0"),
    ({"offpolicy_mask": "stale"}, "max_staleness", "integer"),
    ({"max_staleness": -1}, "max_staleness", "integer >= 0"),
    ({"offpolicy_mask": "old"}, "offpolicy_mask", "offpolicy"),
])
def test_config_errors_name_field_value_and_allowed(changes, field, allowed):
    with pytest.raises(ConfigError) as info:
        AlgorithmConfig(**changes)
    message = str(info.value)
    assert f"AlgorithmConfig.{field}" in message and allowed in message


def test_presets():
    dapo = AlgorithmConfig.dapo()
    assert (dapo.eps_low, dapo.eps_high, dapo.dynamic_sampling, dapo.aggregation) == (0.2, 0.28, True, "token")
    assert AlgorithmConfig.drgrpo().advantage == "drgrpo"
    assert AlgorithmConfig.gspo().loss == "gspo"
