"""The single-process megatron-core runtime a test module needs: import ``megatron_runtime`` into the
module (an autouse, module-scoped fixture) to run its tests inside one process group of one rank."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from _torch_threads import one_torch_thread

from april_ext.trainer.megatron import parallel


@pytest.fixture(scope="module", autouse=True)
def megatron_runtime():
    with one_torch_thread():
        assert not dist.is_initialized()
        parallel.initialize(seed=0)
        yield
        parallel.shutdown()
    assert not dist.is_initialized()
