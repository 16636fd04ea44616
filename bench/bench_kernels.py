"""pytest-benchmark microbenchmarks of the paged-attention kernels against SDPA / flex_attention / flash-attn.

GPU only (skipped on CPU): pytest bench/bench_kernels.py --benchmark-only. Each benchmark synchronizes the
device inside the timed call. bench/gpu_kernels_report.py measures the same cases into one JSON report.
"""

from __future__ import annotations

import os

import pytest
import torch

import _kernel_cases as kc

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA / ROCm device and compiled (not interpreted) kernels",
)
SHAPES = ["extend_resume_16x1k-4k", "extend_resume_64x1k-16k", "decode_64x1k-16k", "decode_256x1k-4k"]
RUNNERS = ["ours", "sdpa", "flex_attention", "flash_attn", "flashinfer"]


@pytest.fixture(scope="module", params=SHAPES)
def case(request: pytest.FixtureRequest) -> kc.Case:
    return kc.make_case(kc.SHAPES[request.param], torch.device("cuda", 0))


@pytest.mark.parametrize("runner", RUNNERS)
def test_attention(benchmark, case: kc.Case, runner: str) -> None:
    try:
        fn = kc.ours(case) if runner == "ours" else kc.BASELINES[runner](case)
    except ImportError as exc:
        pytest.skip(f"{runner} is not installed: {exc}")
    fn()

    def timed() -> None:
        fn()
        torch.cuda.synchronize()

    benchmark.extra_info["tflops"] = None
    benchmark.pedantic(timed, rounds=10, warmup_rounds=2)
    benchmark.extra_info["tflops"] = case.flops() / benchmark.stats.stats.median / 1e12
