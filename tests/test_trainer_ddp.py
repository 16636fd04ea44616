"""TorchTrainer data parallel across real processes (torchrun, gloo on the CPU): two ranks training one
global batch give the same metrics and updated weights as one process (fp32 tolerance); a rank that
raises stops the launch; the one-process pieces (slices, init, refusals)."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import pytest
import torch
from _torchrun import check_a_failing_rank_stops_every_rank
from _torchrun import torchrun as launch
from _trainer_utils import make_model
from trainer_ddp_worker import batches, trainer_config

from april_ext.errors import ConfigError, InvalidArgumentError
from april_ext.trainer import TorchTrainer, distributed

WORKER = Path(__file__).with_name("trainer_ddp_worker.py")
LAUNCH_TIMEOUT_S = 120
# Wall-clock and throughput differ between runs.
UNTIMED = ("step_time_s", "tokens_per_s")


def torchrun(nproc: int, out: Path, mode: str) -> subprocess.CompletedProcess[str]:
    return launch(WORKER, nproc, LAUNCH_TIMEOUT_S, str(out), mode)


@pytest.mark.slow
def test_two_ranks_equal_one_process(tmp_path: Path) -> None:
    proc = torchrun(2, tmp_path, "train")
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(tmp_path / "train.pt", weights_only=False)
    trainer = TorchTrainer(make_model(3), trainer_config())
    expected = [trainer.train_step(b) for b in batches()]
    for want, have in zip(expected, got["metrics"], strict=True):
        assert sorted(want) == sorted(have)
        for name in want:
            if name not in UNTIMED:
                assert have[name] == pytest.approx(want[name], rel=1e-4, abs=1e-6), name
    weights = dict(trainer.export_weights(to_cpu=True).tensors)
    assert sorted(weights) == sorted(got["weights"])
    # Adam's step g / sqrt(v) magnifies reduction-order differences of near-zero gradients (lr 1e-2);
    # the steps themselves are ~1e-2, and the grad norm above checks the gradients' scale.
    for name, tensor in weights.items():
        torch.testing.assert_close(got["weights"][name], tensor, rtol=1e-4, atol=5e-5, msg=name)
    # Rank 0 wrote the checkpoint before either rank returned from save_checkpoint; it holds the weights.
    assert torch.load(tmp_path / "saved0.pt") and torch.load(tmp_path / "saved1.pt")
    resumed = TorchTrainer(make_model(5), trainer_config())
    resumed.load_checkpoint(tmp_path / "checkpoint")
    assert resumed.version == 2
    for name, tensor in resumed.export_weights(to_cpu=True).tensors:
        assert torch.equal(tensor, got["weights"][name]), name


@pytest.mark.slow
def test_a_failing_rank_stops_every_rank(tmp_path: Path) -> None:
    check_a_failing_rank_stops_every_rank(WORKER, tmp_path, LAUNCH_TIMEOUT_S)


def test_rank_slices_cover_the_minibatch_and_refuse_too_few_samples() -> None:
    assert [distributed.rank_slice(4, 11, r, 3) for r in range(3)] == [(4, 6), (6, 8), (8, 11)]
    with pytest.raises(InvalidArgumentError, match="2 samples cannot be split across 3"):
        distributed.rank_slice(0, 2, 0, 3)


def test_initialize_makes_a_world_of_one_and_validates_the_timeout() -> None:
    with pytest.raises(ConfigError, match=r"timeout_s must be a number in \(0, 6e8\] seconds"):
        distributed.initialize(0)
    owned = not torch.distributed.is_initialized()
    distributed.initialize(30.0)
    try:
        assert distributed.world() == (0, 1)
        trainer = TorchTrainer(copy.deepcopy(make_model(0)), trainer_config())
        assert trainer.dp_size == 1
    finally:
        distributed.shutdown()
    assert torch.distributed.is_initialized() != owned
