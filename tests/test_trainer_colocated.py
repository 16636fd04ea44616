"""Colocated mode: the trainer's weights, gradients and optimizer state live in april_ext.memory and
offload / onload pause and resume them on the CPU backend without changing training."""

from __future__ import annotations

import uuid

import pytest
import torch

import april_ext.memory as mem
from april_ext import InvalidStateError
from april_ext.algorithms import AlgorithmConfig
from april_ext.trainer import TorchTrainer, TrainerConfig
from _torch_threads import one_thread  # noqa: F401 (fixture)
from _trainer_utils import make_batch, make_model

pytestmark = pytest.mark.usefixtures("one_thread")


def colocated_config(tag: str, **changes) -> TrainerConfig:
    return TrainerConfig(**{"algorithm": AlgorithmConfig.dapo(), "lr": 1e-2, "device": "cpu", "colocated": True,
                            "memory_tag": tag, **changes})


def test_offload_releases_memory_and_training_is_unchanged():
    tag = f"trainer-{uuid.uuid4().hex[:8]}"
    batches = [make_batch(make_model(seed=5), v, seed=v) for v in range(2)]
    plain = TorchTrainer(make_model(), colocated_config(tag, colocated=False))
    colo = TorchTrainer(make_model(), colocated_config(tag))
    pointers = {n: p.data_ptr() for n, p in colo.model.named_parameters()}
    grad_ptrs = [p.grad.data_ptr() for p in colo.params]
    for batch in batches:
        plain.train_step(batch)
        colo.train_step(batch)
        resident = mem.stats()[tag].resident_bytes
        colo.offload()
        stats = mem.stats()[tag]
        assert stats.paused and stats.resident_bytes == 0 and resident > 0
        with pytest.raises(InvalidStateError, match="onload"):
            colo.train_step(batch)
        colo.onload()
        assert mem.stats()[tag].resident_bytes == resident
    assert {n: p.data_ptr() for n, p in colo.model.named_parameters()} == pointers
    assert [p.grad.data_ptr() for p in colo.params] == grad_ptrs
    # Optimizer moments are in the region too (moved after the first step).
    moments = [s["exp_avg"] for s in colo.optimizer.state.values()]
    assert all(mem.allocation_info(m)["tag"] == tag for m in moments[:1])
    for (name, a), (_, b) in zip(plain.export_weights(), colo.export_weights()):
        assert torch.equal(a, b), name


def test_colocated_checkpoint_round_trip(tmp_path):
    tag = f"trainer-{uuid.uuid4().hex[:8]}"
    with_kl = AlgorithmConfig(kl_loss_coef=0.1, kl_loss_type="k3")
    trainer = TorchTrainer(make_model(), colocated_config(tag, algorithm=with_kl))
    trainer.train_step(make_batch(trainer.model, 0))
    trainer.save_checkpoint(tmp_path / "c")
    other_tag = f"trainer-{uuid.uuid4().hex[:8]}"
    fresh = TorchTrainer(make_model(seed=4), colocated_config(other_tag, algorithm=with_kl))
    fresh.load_checkpoint(tmp_path / "c")
    fresh.offload()
    fresh.onload()
    for (name, a), (_, b) in zip(trainer.export_weights(), fresh.export_weights()):
        assert torch.equal(a, b), name
    batch = make_batch(trainer.model, 1, seed=1)
    assert trainer.train_step(batch)["loss"] == fresh.train_step(batch)["loss"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
def test_colocated_offload_frees_gpu_memory():
    tag = f"trainer-{uuid.uuid4().hex[:8]}"
    trainer = TorchTrainer(make_model(), colocated_config(tag, device="cuda"))
    trainer.train_step(make_batch(make_model(), 0))
    before = {n: t.cpu() for n, t in trainer.export_weights()}
    resident = mem.stats()[tag].resident_bytes
    trainer.offload()
    assert mem.stats()[tag].resident_bytes == 0 < resident
    trainer.onload()
    for name, t in trainer.export_weights():
        assert torch.equal(before[name], t.cpu()), name
    assert trainer.train_step(make_batch(make_model(), 1, seed=1))["version"] == 2
