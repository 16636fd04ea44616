"""The torch trainer: steps, micro-batching, off-policy masking, weight export and exact checkpoints."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from april_ext import ConfigError, CorruptStateError, InvalidArgumentError, InvalidStateError, PersistenceError
from april_ext.algorithms import AlgorithmConfig
from april_ext.trainer import DROPPED_LOGPROB, TorchTrainer, Trainer, TrainerConfig, split_by_token_budget

from _torch_threads import one_thread  # noqa: F401 (fixture)
from _trainer_utils import make_batch, make_model

pytestmark = pytest.mark.usefixtures("one_thread")


def params_of(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in trainer.export_weights()}


def config(**changes) -> TrainerConfig:
    return TrainerConfig(**{"algorithm": AlgorithmConfig.dapo(), "lr": 1e-2, "device": "cpu", **changes})


def test_split_by_token_budget():
    assert split_by_token_budget([3, 4, 2, 9, 1], 7) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert split_by_token_budget([2, 2, 2], 100) == [(0, 3)]
    assert split_by_token_budget([], 5) == []
    # A sample cap cuts runs the budget alone would keep together; the budget still applies.
    assert split_by_token_budget([2, 2, 2, 2, 2], 100, max_samples=2) == [(0, 2), (2, 4), (4, 5)]
    assert split_by_token_budget([3, 4, 2, 9, 1], 7, max_samples=1) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert split_by_token_budget([1, 1, 9, 1], 7, max_samples=3) == [(0, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_micro_batch_size_is_validated(value):
    with pytest.raises(ConfigError, match="micro_batch_size must be None or an integer >= 1"):
        config(micro_batch_size=value)


def test_train_step_updates_weights_and_version():
    trainer = TorchTrainer(make_model(), config())
    assert isinstance(trainer, Trainer)
    before = params_of(trainer)
    metrics = trainer.train_step(make_batch(trainer.model, 0))
    after = trainer.export_weights()
    tensors = list(after)  # an export streams once
    assert after.version == trainer.version == 1
    assert [n for n, _ in tensors] == trainer.model.weight_names()
    assert any(not torch.equal(before[n], t) for n, t in tensors)
    for key in ("loss", "pg_loss", "entropy", "clip_frac_high", "grad_norm", "reward_mean", "n_loss_tokens"):
        assert np.isfinite(metrics[key]), key
    assert metrics["version"] == 1.0 and metrics["grad_norm"] > 0


def test_batch_for_another_version_is_rejected():
    trainer = TorchTrainer(make_model(), config())
    with pytest.raises(InvalidStateError, match="policy_version"):
        trainer.train_step(make_batch(trainer.model, 3))


@pytest.mark.parametrize("limits", [{"micro_batch_tokens": 16}, {"micro_batch_size": 1}, {"micro_batch_size": 3}])
def test_micro_batching_matches_one_pass(limits):
    batch = make_batch(make_model(), 0)
    whole = TorchTrainer(make_model(), config(micro_batch_tokens=10_000))
    pieces = TorchTrainer(make_model(), config(**limits))
    m_whole, m_pieces = whole.train_step(batch), pieces.train_step(batch)
    assert m_whole["loss"] == pytest.approx(m_pieces["loss"], abs=1e-6)
    assert m_whole["grad_norm"] == pytest.approx(m_pieces["grad_norm"], rel=1e-5)
    # Adam's first step is about lr * sign(grad), which amplifies rounding in near-zero gradients, so
    # compare the gradients themselves: exp_avg = (1 - beta1) * grad after one step.
    for pa, pb in zip(whole.params, pieces.params):
        torch.testing.assert_close(whole.optimizer.state[pa]["exp_avg"], pieces.optimizer.state[pb]["exp_avg"],
                                   rtol=1e-4, atol=1e-8)


def test_all_tokens_off_policy_and_masked_leaves_weights_unchanged():
    trainer = TorchTrainer(make_model(), config(algorithm=AlgorithmConfig(offpolicy_mask="offpolicy")),
                           initial_version=2)
    batch = make_batch(trainer.model, 2)
    batch.versions[batch.loss_mask == 1] = 1
    before = params_of(trainer)
    metrics = trainer.train_step(batch)
    assert metrics["n_loss_tokens"] == 0
    assert metrics["n_masked_offpolicy_tokens"] == batch.loss_mask.sum()
    assert metrics["offpolicy_token_frac"] == 1.0 and metrics["max_staleness"] == 1.0
    for name, t in trainer.export_weights():
        assert torch.equal(before[name], t), name


def test_kl_and_minibatches():
    cfg = config(algorithm=AlgorithmConfig(kl_loss_coef=0.5, kl_loss_type="k3", tis_cap=2.0), minibatches=2)
    trainer = TorchTrainer(make_model(), cfg)
    assert trainer.ref_model is not None
    trainer.train_step(make_batch(trainer.model, 0, seed=0))
    metrics = trainer.train_step(make_batch(trainer.model, 1, seed=1))
    assert metrics["optimizer_steps"] == 2
    # After one update the policy has moved away from the reference: KL > 0.
    assert metrics["kl"] > 0 and "tis_weight" in metrics


def test_top_k_top_p_renormalise_pi_train_and_train_finitely():
    """Rollouts drawn from the full distribution, trained with top-k / top-p: kept tokens gain mass, dropped
    ones get the finite stand-in, and KL + PPO over two minibatches stay finite with a nonzero gradient."""
    cfg = config(algorithm=AlgorithmConfig(kl_loss_coef=0.5, kl_loss_type="k3", tis_cap=2.0), minibatches=2, top_k=3,
                 top_p=0.9)
    trainer = TorchTrainer(make_model(), cfg)
    batch = make_batch(trainer.model, 0)
    response = batch.loss_mask == 1
    filtered = trainer.token_logprobs(batch)[response]
    full = TorchTrainer(make_model(), config()).token_logprobs(batch)[response]
    dropped = filtered == DROPPED_LOGPROB
    assert dropped.any() and not dropped.all()
    assert (filtered[~dropped] >= full[~dropped] - 1e-6).all() and (filtered[~dropped] > full[~dropped]).any()
    metrics = trainer.train_step(batch)
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    assert metrics["grad_norm"] > 0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_checkpoint_restores_training_exactly(tmp_path):
    batches = []
    gen_model = make_model(seed=5)
    for step in range(4):
        batches.append(make_batch(gen_model, step, seed=step))
    first = TorchTrainer(make_model(), config(algorithm=AlgorithmConfig.dapo(tis_cap=2.0)))
    first.train_step(batches[0])
    first.train_step(batches[1])
    first.save_checkpoint(tmp_path / "ckpt", extra={"scheduler": b"\x00state", "data_position": 24})
    torch.manual_seed(123)  # the checkpoint restores the RNG as saved
    first.train_step(batches[2])
    expected = params_of(first)

    second = TorchTrainer(make_model(seed=9), config(algorithm=AlgorithmConfig.dapo(tis_cap=2.0)))
    extra = second.load_checkpoint(tmp_path / "ckpt")
    assert extra == {"scheduler": b"\x00state", "data_position": 24}
    assert second.version == 2 and second.step == 2
    second.train_step(batches[2])
    for name, t in second.export_weights():
        assert torch.equal(expected[name], t), name


def test_checkpoint_overwrite_is_atomic_and_leaves_no_temporaries(tmp_path):
    trainer = TorchTrainer(make_model(), config())
    path = tmp_path / "ckpt"
    trainer.save_checkpoint(path, extra={"n": 1})
    trainer.train_step(make_batch(trainer.model, 0))
    trainer.save_checkpoint(path, extra={"n": 2})
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    fresh = TorchTrainer(make_model(seed=3), config())
    assert fresh.load_checkpoint(path) == {"n": 2} and fresh.version == 1


def test_checkpoint_errors(tmp_path):
    trainer = TorchTrainer(make_model(), config())
    with pytest.raises(InvalidArgumentError, match=r"extra\['data'\]\[1\] is a ndarray"):
        trainer.save_checkpoint(tmp_path / "x", extra={"data": [1, np.zeros(2)]})
    assert not os.path.exists(tmp_path / "x")
    with pytest.raises(PersistenceError, match="trainer_state.pt is missing"):
        trainer.load_checkpoint(tmp_path)
    trainer.save_checkpoint(tmp_path / "c")
    (tmp_path / "c" / "trainer_state.pt").write_bytes(b"garbage")
    with pytest.raises(CorruptStateError, match="trainer_state.pt"):
        trainer.load_checkpoint(tmp_path / "c")
    with_kl = TorchTrainer(make_model(), config(algorithm=AlgorithmConfig(kl_loss_coef=0.1)))
    trainer.save_checkpoint(tmp_path / "d")
    with pytest.raises(InvalidStateError, match="without a KL reference policy.*kl_loss_coef=0.1"):
        with_kl.load_checkpoint(tmp_path / "d")


def test_a_checkpoint_from_before_the_kl_rename_keeps_its_objective(tmp_path):
    """A checkpoint whose trainer config has kl_coef but no kl_loss_coef was saved when kl_coef named the
    weight of a k3 KL loss: it loads only into a trainer with that loss and no KL reward shaping."""
    saver = TorchTrainer(make_model(), config(algorithm=AlgorithmConfig(kl_loss_coef=0.1, kl_loss_type="k3")))
    saver.save_checkpoint(tmp_path / "old")
    state_file = tmp_path / "old" / "trainer_state.pt"
    state = torch.load(state_file, weights_only=True)
    algorithm = state["trainer_config"]["algorithm"]
    algorithm["kl_coef"] = algorithm.pop("kl_loss_coef")
    for key in ("kl_loss_type", "gamma", "normalize_advantages", "use_decoupled_loss", "behav_imp_weight_cap"):
        del algorithm[key]
    torch.save(state, state_file)
    same = TorchTrainer(make_model(), config(algorithm=AlgorithmConfig(kl_loss_coef=0.1, kl_loss_type="k3")))
    same.load_checkpoint(tmp_path / "old")
    for algo, message in ((AlgorithmConfig(kl_loss_coef=0.1), "kl_loss_type='k3'"),
                          (AlgorithmConfig.reinforce_plus_plus(kl_coef=0.1), "set kl_loss_coef=0.1"),
                          (AlgorithmConfig.reinforce_plus_plus(kl_coef=0.1, kl_loss_coef=0.1, kl_loss_type="k3"),
                           "kl_coef=0 ")):
        with pytest.raises(InvalidStateError, match=message):
            TorchTrainer(make_model(), config(algorithm=algo)).load_checkpoint(tmp_path / "old")
    # A checkpoint saved now carries kl_loss_coef and loads by the reference check alone.
    saver.save_checkpoint(tmp_path / "new")
    TorchTrainer(make_model(), config(algorithm=AlgorithmConfig(kl_loss_coef=0.3))).load_checkpoint(tmp_path / "new")


@pytest.mark.parametrize("changes, field", [
    ({"lr": 0.0}, "lr"), ({"grad_clip": -1.0}, "grad_clip"), ({"micro_batch_tokens": 0}, "micro_batch_tokens"),
    ({"minibatches": 0}, "minibatches"), ({"mixed_precision": "fp16"}, "mixed_precision"),
    ({"betas": (0.9, 1.5)}, "betas"), ({"device": "nonsense"}, "device"), ({"algorithm": "grpo"}, "algorithm"),
])
def test_config_errors(changes, field):
    with pytest.raises(ConfigError, match=f"TrainerConfig.{field}"):
        TrainerConfig(**changes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
def test_bf16_autocast_step_on_gpu():
    trainer = TorchTrainer(make_model(), config(device="cuda"))
    metrics = trainer.train_step(make_batch(make_model(), 0))
    assert trainer.logprobs.autocast and np.isfinite(metrics["loss"])
    assert all(t.device.type == "cuda" for _, t in trainer.export_weights())
