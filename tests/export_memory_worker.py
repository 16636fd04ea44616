"""One rank of tests/test_export_memory.py, started by torchrun: a DistributedMegatronTrainer at tensor
parallel = world size, then one export whose peak resident memory above the resident memory before it
(Linux's VmHWM, reset through /proc/self/clear_refs, with glibc's mmap threshold fixed: see main) the
rank writes to OUT/rank<R>.json.

Modes:
- ``stream``: a model with one large tensor (a 2^17 x 256 fp32 tied embedding, 128 MiB, split by
  vocabulary); every rank reads ``iter_hf_weights`` to the end, dropping each tensor once seen.
- ``disk``: a 16-layer model of about 290 MiB (largest tensor 8 MiB) built from an HF model's weights; rank 0
  sends its export through the SGLang adapter's disk sync (``push_weights`` with weight_sync "disk", to a
  worker pool that only answers) into OUT/sync with BUCKET_MB shards, the other ranks take part in the
  gather; rank 0 then reads the directory back and records whether it equals the HF weights bit for bit.

- ``load``: the same model's HF checkpoint (one safetensors file, written by rank 0 into OUT/hf) loaded
  into each rank's GPTModel (``sharded.load_hf_weights``, the load the trainer makes), split by tensor
  parallelism (LAYOUT ``tp``, the default) or pipeline parallelism (``pp``: each stage its 16 / world
  layers); the rank records the size of its model and of one decoder layer, and after the peak is taken,
  the model is exported again (gathered) and rank 0 records whether that equals the checkpoint bit for bit.
  SOURCE ``dir`` (the default) loads from the directory; ``model`` measures what the run path did before
  (issue 11): the whole HF model built from the checkpoint (``load_pretrained``), then the slice taken
  from its tensors.

Usage: torchrun --nproc-per-node 2 tests/export_memory_worker.py OUT stream|disk|load [LAYOUT [SOURCE]]
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import gc
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from april_ext.model import LlamaForCausalLM, ModelConfig
from april_ext.model.checkpoint import iter_safetensors
from april_ext.trainer import TrainerConfig
from april_ext.trainer.megatron import parallel
from april_ext.trainer.megatron.distributed_trainer import DistributedMegatronTrainer
from april_ext.trainer.megatron.parallel import MegatronParallelConfig
from april_ext.trainer.megatron.trainer import MegatronTrainerConfig

VOCAB, HIDDEN = 2**17, 256
BUCKET_MB = 16
DISK_MODEL = ModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=16,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise SystemExit(f"/proc/self/status has no {field}")


def _peak_extra_bytes(export: Callable[[], None]) -> int:
    gc.collect()
    # Freed memory back to the system, so that the resident memory is what lives and reuse cannot hide a peak.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    dist.barrier()
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")  # the peak (VmHWM) starts again from the current resident memory
    export()
    return (_status_kib("VmHWM") - before) * 1024


class _AnsweringWorkers:
    """A WorkerPool whose workers accept every weight update (push_weights' only call here)."""

    async def broadcast(self, endpoint: str, payload: Any) -> list[tuple[str, Any]]:
        return [("http://worker", {"success": True})]


def _stream(world: int, out: str) -> dict[str, Any]:
    model = ModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    trainer = DistributedMegatronTrainer(MegatronTrainerConfig(
        model=model, trainer=TrainerConfig(mixed_precision="fp32"),
        parallel=MegatronParallelConfig(tensor_model_parallel_size=world, timeout_s=120.0)))
    largest = [0]

    def export() -> None:
        for _, tensor in trainer.iter_hf_weights():
            largest[0] = max(largest[0], tensor.numel() * tensor.element_size())
            del tensor

    return {"peak_extra_bytes": _peak_extra_bytes(export), "largest_bytes": largest[0]}


def _disk(world: int, out: str) -> dict[str, Any]:
    from april_ext.weights import WeightBroadcaster, push_weights

    torch.manual_seed(0)
    hf = LlamaForCausalLM(DISK_MODEL)
    trainer = DistributedMegatronTrainer(MegatronTrainerConfig(
        model=DISK_MODEL, trainer=TrainerConfig(mixed_precision="fp32"),
        parallel=MegatronParallelConfig(tensor_model_parallel_size=world, timeout_s=120.0)),
        hf.named_parameters())
    sync_dir = os.path.join(out, "sync")
    sizes = {name: p.numel() * p.element_size() for name, p in hf.named_parameters()}
    if dist.get_rank() != 0:
        del hf  # rank 0 alone keeps the HF weights, to compare the directory with them

    def export() -> None:
        if dist.get_rank() == 0:
            workers: Any = _AnsweringWorkers()
            broadcaster = WeightBroadcaster(workers, bucket_bytes=BUCKET_MB * 2**20, timeout_s=60.0)
            asyncio.run(push_weights(workers, trainer.export_weights(), 1, "disk", sync_dir, broadcaster))
        else:
            collections.deque(trainer.iter_hf_weights(), maxlen=0)

    seen: dict[str, Any] = {"peak_extra_bytes": _peak_extra_bytes(export), "largest_bytes": max(sizes.values()),
                            "total_bytes": sum(sizes.values()), "bucket_bytes": BUCKET_MB * 2**20}
    if dist.get_rank() == 0:
        written = dict(iter_safetensors(sync_dir))
        expected = dict(hf.named_parameters())
        seen["bit_exact"] = written.keys() == expected.keys() and all(
            written[n].dtype == t.dtype and torch.equal(written[n], t) for n, t in expected.items())
        seen["files"] = sorted(os.listdir(sync_dir))
    return seen


def _load(world: int, out: str, layout: str = "tp", source: str = "dir") -> dict[str, Any]:
    from megatron.core import parallel_state

    from april_ext.model import load_pretrained, save_pretrained
    from april_ext.trainer.megatron import sharded
    from april_ext.trainer.megatron.model import build_gpt_model

    directory = os.path.join(out, "hf")
    tp, pp = {"tp": (world, 1), "pp": (1, world)}[layout]
    parallel.initialize(MegatronParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                               timeout_s=120.0))
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        save_pretrained(LlamaForCausalLM(DISK_MODEL), directory)
        gc.collect()
    dist.barrier()
    gpt = build_gpt_model(DISK_MODEL, packed=True, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          pre_process=parallel_state.is_pipeline_first_stage(),
                          post_process=parallel_state.is_pipeline_last_stage(),
                          vocab_size=sharded.padded_vocab_size(DISK_MODEL.vocab_size, tp))
    layer = sum(p.numel() * p.element_size() for n, p in LlamaForCausalLM(DISK_MODEL.replace(num_hidden_layers=1))
                .named_parameters() if n.startswith("model.layers.0."))

    def load() -> None:
        if source == "dir":
            sharded.load_hf_weights(gpt, directory, DISK_MODEL)
        else:
            sharded.load_hf_weights(gpt, load_pretrained(directory).named_parameters(), DISK_MODEL)

    seen: dict[str, Any] = {
        "peak_extra_bytes": _peak_extra_bytes(load),
        "layer_bytes": layer, "rank_model_bytes": sum(p.numel() * p.element_size() for p in gpt.parameters())}
    exported = sharded.iter_hf_weights(gpt, DISK_MODEL)
    if dist.get_rank() == 0:
        saved = dict(iter_safetensors(directory))
        seen["bit_exact"] = all(torch.equal(saved.pop(n), t) for n, t in exported) and not saved
    else:
        collections.deque(exported, maxlen=0)
    return seen


def main(out: str, mode: str, *options: str) -> None:
    # glibc's allocator raises its mmap threshold as large blocks are freed, and then keeps later freed
    # blocks of up to 32 MiB on its heap: a fixed threshold returns them at once, so that the resident
    # memory measures what lives (M_MMAP_THRESHOLD is -3).
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)
    world = int(os.environ["WORLD_SIZE"])
    seen = {"stream": _stream, "disk": _disk, "load": _load}[mode](world, out, *options)
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w", encoding="ascii") as handle:
        json.dump(seen, handle)
    parallel.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
