"""One rank of tests/test_trainer_ddp.py, started by torchrun.

Usage: torchrun --nproc-per-node N tests/trainer_ddp_worker.py OUT MODE
"train": every rank builds a TorchTrainer (rank r from weights of seed 3 + r: DistributedDataParallel
must broadcast rank 0's), takes two train steps and saves a checkpoint; rank 0 writes the metrics and
weights to OUT/train.pt, and each rank writes whether the checkpoint existed when save_checkpoint returned.
"raise": rank 1 raises while rank 0 trains (and waits in the gradient all-reduce).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _trainer_utils import make_batch, make_model

from april_ext.algorithms import AlgorithmConfig
from april_ext.errors import InvalidStateError
from april_ext.persistence import atomic_write
from april_ext.trainer import TorchTrainer, TrainerConfig, distributed

TIMEOUT_S = 30.0


def trainer_config() -> TrainerConfig:
    """Shared with the test's one-process reference: two minibatches, several micro-batches per rank,
    an active gradient clip and the KL term."""
    return TrainerConfig(lr=1e-2, micro_batch_tokens=40, grad_clip=0.5, mixed_precision="fp32", device="cpu",
                         algorithm=AlgorithmConfig(kl_loss_coef=0.05, kl_loss_type="k3", max_staleness=None),
                         minibatches=2)


def batches() -> list:
    model = make_model(3)
    return [make_batch(model, step, seed=step) for step in range(2)]


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    distributed.initialize(TIMEOUT_S)
    rank = dist.get_rank()
    trainer = TorchTrainer(make_model(3 + rank), trainer_config())
    if mode == "raise":
        if rank == 1:
            raise InvalidStateError("rank 1 failed on purpose")
        trainer.train_step(batches()[0])
        return
    metrics = [trainer.train_step(b) for b in batches()]
    path = os.path.join(out, "checkpoint")
    trainer.save_checkpoint(path)
    saved = os.path.isfile(os.path.join(path, "config.json"))
    atomic_write(os.path.join(out, f"saved{rank}.pt"), lambda p: torch.save(saved, p))
    if rank == 0:
        result = {"metrics": metrics, "weights": dict(trainer.export_weights(to_cpu=True).tensors)}
        atomic_write(os.path.join(out, "train.pt"), lambda p: torch.save(result, p))
    distributed.shutdown()


if __name__ == "__main__":
    main()
