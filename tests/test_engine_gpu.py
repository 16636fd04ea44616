"""The engine on a CUDA / ROCm device with the Triton kernels (skipped without a GPU).

Run for real with APRIL_EXT_GPU_TESTS=1 (tests/conftest.py otherwise turns on the Triton interpreter).
"""

from __future__ import annotations

import pytest
import torch
from _engine_utils import GREEDY, engine, prompts, tiny_model

from april_ext.protocol import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")]


def test_gpu_generation_matches_the_cpu_engine() -> None:
    batch = prompts(8, seed=30)
    cpu = engine(tiny_model(seed=0), max_num_batched_tokens=16).generate(batch, GREEDY)
    gpu_core = engine(tiny_model(seed=0), max_num_batched_tokens=16, device="cuda", memory_tag_prefix="gpu-test-")
    assert gpu_core.runner.use_triton
    gpu = gpu_core.generate(batch, GREEDY)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    for a, b in zip(gpu, cpu):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_new_tokens=12)
    assert gpu_core.generate(batch[:2], sampled)[0].token_ids == gpu_core.generate(batch[:2], sampled)[0].token_ids


def test_gpu_release_and_resume_memory() -> None:
    core = engine(tiny_model(seed=0), device="cuda", memory_tag_prefix="gpu-mem-")
    reference = core.generate([[1, 2, 3]], GREEDY)[0].token_ids
    core.release_memory()
    assert core.memory.resident_bytes() == {"weights": 0, "kv_cache": 0}
    core.resume_memory()
    assert core.generate([[1, 2, 3]], GREEDY)[0].token_ids == reference
