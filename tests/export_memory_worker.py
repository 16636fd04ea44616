"""One rank of tests/test_export_memory.py, started by torchrun: a DistributedMegatronTrainer at tensor
parallel = world size for a model with one large tensor (a 2^17 x 256 fp32 tied embedding, 128 MiB, split
by vocabulary), then its streamed export (``iter_hf_weights``) with each tensor dropped once seen; the rank
writes to OUT/rank<R>.json the largest tensor's size and the peak resident memory during the export above
the resident memory before it (Linux's VmHWM, reset through /proc/self/clear_refs).

Usage: torchrun --nproc-per-node 2 tests/export_memory_worker.py OUT
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys

import torch.distributed as dist

from april_ext.model import ModelConfig
from april_ext.trainer import TrainerConfig
from april_ext.trainer.megatron import parallel
from april_ext.trainer.megatron.distributed_trainer import DistributedMegatronTrainer
from april_ext.trainer.megatron.parallel import MegatronParallelConfig
from april_ext.trainer.megatron.trainer import MegatronTrainerConfig

VOCAB, HIDDEN = 2**17, 256


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise SystemExit(f"/proc/self/status has no {field}")


def main(out: str) -> None:
    world = int(os.environ["WORLD_SIZE"])
    model = ModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    trainer = DistributedMegatronTrainer(MegatronTrainerConfig(
        model=model, trainer=TrainerConfig(mixed_precision="fp32"),
        parallel=MegatronParallelConfig(tensor_model_parallel_size=world, timeout_s=120.0)))
    largest = 0
    gc.collect()
    # Freed memory back to the system, so that the resident memory is what lives and reuse cannot hide a peak.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    dist.barrier()
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")  # the peak (VmHWM) starts again from the current resident memory
    for _, tensor in trainer.iter_hf_weights():
        largest = max(largest, tensor.numel() * tensor.element_size())
        del tensor
    peak = _status_kib("VmHWM")
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w", encoding="ascii") as handle:
        json.dump({"largest_bytes": largest, "peak_extra_bytes": (peak - before) * 1024}, handle)
    parallel.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
