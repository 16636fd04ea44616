"""slime's advantage estimators with KL reward shaping (REINFORCE++, REINFORCE++-baseline), the KL
estimators and the advantage whitening, against values worked out by hand; GRPO ignores the shaping."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from _torch_threads import one_thread  # noqa: F401 (fixture)
from _trainer_utils import make_batch, make_model

from april_ext.algorithms import AlgorithmConfig, approx_kl, masked_whiten, sample_advantages, token_advantages
from april_ext.errors import InvalidArgumentError
from april_ext.trainer import TorchTrainer, TrainerConfig
from april_ext.trainer.batching import prepare_inputs
from april_ext.trainer.loss_step import LossStep

# Two samples of one group. Sample 0: tokens 0-3, token 0 is its prompt; sample 1: tokens 4-6, token 4 its
# prompt and token 6 outside the loss mask (a tool's output, say), so token 5 is its last trained token.
OFFSETS = torch.tensor([0, 4, 7])
TRAINABLE = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
# The KL of untrained tokens (9.0, 5.0) must not count.
KL = torch.tensor([9.0, 0.2, 0.4, 0.1, 9.0, 0.3, 5.0])
REWARDS = torch.tensor([1.0, -1.0])
GROUPS = torch.tensor([0, 0])


def _advantages(config: AlgorithmConfig, kl: torch.Tensor | None = KL, mask: torch.Tensor = TRAINABLE) -> list[float]:
    per_sample = sample_advantages(config, REWARDS, GROUPS)
    return token_advantages(config, per_sample, OFFSETS, TRAINABLE, mask, kl).tolist()


def test_reinforce_plus_plus_discounts_kl_shaped_token_rewards():
    # kl_coef 0.5: token rewards -0.1, -0.2, -0.05 + 1 (the reward at the last trained token) in sample 0;
    # -0.15 - 1 at token 5 and 0 at token 6 in sample 1. gamma 0.5: G_t = r_t + 0.5 G_{t+1} from the end.
    config = AlgorithmConfig.reinforce_plus_plus(kl_coef=0.5, gamma=0.5)
    g3 = 0.95
    g2 = -0.2 + 0.5 * g3
    g1 = -0.1 + 0.5 * g2
    g5 = -1.15
    assert _advantages(config) == pytest.approx([0.5 * g1, g1, g2, g3, 0.5 * g5, g5, 0.0], abs=1e-6)
    # gamma 1 (slime's default): suffix sums.
    undiscounted = AlgorithmConfig.reinforce_plus_plus(kl_coef=0.5)
    assert _advantages(undiscounted) == pytest.approx([0.65, 0.65, 0.75, 0.95, -1.15, -1.15, 0.0], abs=1e-6)
    # Without shaping every trained token carries the raw reward (gamma 1).
    assert _advantages(AlgorithmConfig.reinforce_plus_plus(), kl=None) == pytest.approx(
        [1.0, 1.0, 1.0, 1.0, -1.0, -1.0, 0.0])


def test_reinforce_plus_plus_baseline_subtracts_the_group_mean_and_the_kl():
    # Group mean 0: advantages 1 and -1 before the KL; then - 0.5 * KL at the trained tokens.
    config = AlgorithmConfig.reinforce_plus_plus_baseline(kl_coef=0.5)
    assert _advantages(config) == pytest.approx([1.0, 0.9, 0.8, 0.95, -1.0, -1.15, -1.0], abs=1e-6)
    # The group mean only, no std division (slime centres these rewards without normalising them).
    per_sample = sample_advantages(config, torch.tensor([3.0, 1.0, 2.0]), torch.tensor([0, 0, 0]))
    assert per_sample.tolist() == pytest.approx([1.0, -1.0, 0.0])


def test_normalize_advantages_whitens_over_the_loss_tokens():
    config = AlgorithmConfig.reinforce_plus_plus_baseline(kl_coef=0.5, normalize_advantages=True)
    # Loss tokens 1, 2, 3, 5 hold 0.9, 0.8, 0.95, -1.15: mean 0.375, deviations 0.525, 0.425, 0.575, -1.525,
    # unbiased variance (0.275625 + 0.180625 + 0.330625 + 2.325625) / 3 = 1.0375.
    std = math.sqrt(1.0375 + 1e-8)
    raw = [1.0, 0.9, 0.8, 0.95, -1.0, -1.15, -1.0]
    assert _advantages(config) == pytest.approx([(a - 0.375) / std for a in raw], abs=1e-6)
    # Only the effective mask's tokens count (an off-policy masked token 3 leaves 0.9, 0.8, -1.15).
    mask = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    mean = (0.9 + 0.8 - 1.15) / 3
    var = ((0.9 - mean) ** 2 + (0.8 - mean) ** 2 + (-1.15 - mean) ** 2) / 2
    assert _advantages(config, mask=mask) == pytest.approx([(a - mean) / math.sqrt(var) for a in raw], abs=1e-5)
    assert masked_whiten(torch.tensor([1.0, 2.0]), torch.zeros(2)).tolist() == [1.0, 2.0]


def test_grpo_ignores_kl_coef():
    shaped = AlgorithmConfig.grpo(kl_coef=0.5)
    assert not shaped.kl_shaping and not shaped.needs_reference
    assert _advantages(shaped) == _advantages(AlgorithmConfig.grpo(), kl=None)
    assert "no effect" in shaped.unused_kl_coef_note() and AlgorithmConfig.grpo().unused_kl_coef_note() is None


def test_shaping_needs_the_kl():
    with pytest.raises(InvalidArgumentError, match="kl must be a per-token tensor"):
        _advantages(AlgorithmConfig.reinforce_plus_plus(kl_coef=0.5), kl=None)


def test_kl_estimators():
    # log pi = ln 0.5, log pi_ref = ln 0.25: d = ln 2.
    d = math.log(2.0)
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert approx_kl(lp, ref, "k1").item() == pytest.approx(d)
    assert approx_kl(lp, ref, "k2").item() == pytest.approx(d * d / 2)
    assert approx_kl(lp, ref, "k3").item() == pytest.approx(0.5 + d - 1)
    # low_var_kl is k3 clipped at 10: exp(20) - 20 - 1 for a token the reference finds e^20 times likelier.
    far = approx_kl(torch.tensor([-25.0, math.log(0.5)]), torch.tensor([-5.0, math.log(0.25)]), "low_var_kl")
    assert far.tolist() == pytest.approx([10.0, 0.5 + d - 1])
    with pytest.raises(InvalidArgumentError, match="kind"):
        approx_kl(lp, ref, "k4")


def test_the_trainer_shapes_with_the_kl_of_its_weights_to_the_reference(caplog, monkeypatch, one_thread):
    """The torch trainer's advantages for reinforce_plus_plus with kl_coef: the KL of its log-probs before
    the update to the reference's, computed here by hand from the same two models."""
    model = make_model(3)
    reference = make_model(5)
    config = TrainerConfig(lr=1e-2, micro_batch_tokens=40, mixed_precision="fp32", device="cpu",
                           algorithm=AlgorithmConfig.reinforce_plus_plus(kl_coef=0.3, kl_loss_type="k3"))
    trainer = TorchTrainer(model, config)
    assert trainer.ref_model is not None
    trainer.ref_model.load_state_dict(reference.state_dict())
    batch = make_batch(model, 0)
    logprobs = trainer.token_logprobs(batch)
    trainer.model, policy = reference, trainer.model
    ref_logprobs = trainer.token_logprobs(batch)
    trainer.model = policy
    inputs = prepare_inputs(batch, config.algorithm, torch.device("cpu"))
    kl = approx_kl(torch.from_numpy(logprobs), torch.from_numpy(ref_logprobs), "k3")
    expected = token_advantages(config.algorithm, inputs.advantages, inputs.offsets, inputs.trainable, inputs.mask,
                                kl * inputs.trainable)
    seen = {}
    original = LossStep.accumulate_gradients

    def spy(self, step_inputs, *args):
        seen["advantages"] = step_inputs.token_advantages.clone()
        return original(self, step_inputs, *args)

    monkeypatch.setattr(LossStep, "accumulate_gradients", spy)
    metrics = trainer.train_step(batch)
    torch.testing.assert_close(seen["advantages"], expected, rtol=1e-5, atol=1e-6)
    assert not torch.equal(expected, inputs.token_advantages)  # the shaping changed them
    assert metrics["kl_shaping"] == pytest.approx(float((kl * inputs.mask).sum() / inputs.mask.sum()), rel=1e-5)
    # grpo with kl_coef: no reference, a warning, and the same update as without kl_coef.
    with caplog.at_level(logging.WARNING):
        ignored = TorchTrainer(make_model(3), TrainerConfig(lr=1e-2, mixed_precision="fp32", device="cpu",
                                                            algorithm=AlgorithmConfig(kl_coef=0.3)))
    assert ignored.ref_model is None and "has no effect with advantage='grpo'" in caplog.text
    plain = TorchTrainer(make_model(3), TrainerConfig(lr=1e-2, mixed_precision="fp32", device="cpu"))
    assert ignored.train_step(batch)["loss"] == plain.train_step(batch)["loss"]
    for (name, a), (_, b) in zip(ignored.export_weights(), plain.export_weights()):
        assert torch.equal(a, b), name

