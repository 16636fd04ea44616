"""Process-group setup for megatron-core in one process: torch.distributed world size 1 (gloo on a CPU,
nccl on a GPU, rendezvous through a FileStore in a temporary directory, so no port is taken) and
tensor / pipeline model parallel size 1."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading

import torch
import torch.distributed as dist

from april_ext.errors import InvalidStateError
from april_ext.trainer.megatron import compat

_lock = threading.Lock()
_owned_dir: str | None = None
_owns_process_group = False
_owns_model_parallel = False


def initialize(seed: int = 0) -> None:
    """Makes megatron-core usable in this process. Reuses a process group and model-parallel state that
    someone else set up (they must have tensor / pipeline parallel size 1); otherwise creates them and
    remembers to tear them down in ``shutdown``."""
    global _owned_dir, _owns_process_group, _owns_model_parallel
    compat.apply_cpu_patches()
    from megatron.core import parallel_state, tensor_parallel

    with _lock:
        if not dist.is_initialized():
            _owned_dir = tempfile.mkdtemp(prefix="april_ext_megatron_pg-")
            store = dist.FileStore(os.path.join(_owned_dir, "store"), 1)
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, store=store, rank=0, world_size=1)
            _owns_process_group = True
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
            _owns_model_parallel = True
            if compat.cpu_patches_needed():
                compat.install_cpu_rng_tracker(seed)
            else:
                tensor_parallel.model_parallel_cuda_manual_seed(seed)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        if tp != 1 or pp != 1:
            raise InvalidStateError(f"MegatronTrainer runs with tensor and pipeline parallel size 1, the "
                                    f"process has tensor={tp}, pipeline={pp}")


def shutdown() -> None:
    """Destroys the model-parallel state and the process group, each only if ``initialize`` created it."""
    global _owned_dir, _owns_process_group, _owns_model_parallel
    with _lock:
        if _owns_model_parallel:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            _owns_model_parallel = False
        if _owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        if _owned_dir is not None:
            shutil.rmtree(_owned_dir, ignore_errors=True)
        _owned_dir = None
        _owns_process_group = False
