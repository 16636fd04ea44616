"""The kernel tests again, compiled for the GPU, when this machine has one.

This session interprets the kernels (tests/conftest.py), so the compiled run happens in a subprocess with
APRIL_EXT_GPU_TESTS=1, where tests/test_kernels.py uses CUDA / ROCm tensors and real launches.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA / ROCm device")
def test_compiled_kernels_match_references_on_gpu() -> None:
    env = {**os.environ, "APRIL_EXT_GPU_TESTS": "1"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kernels.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
