"""Session-wide test setup.

The Triton interpreter is chosen when a kernel is decorated (at import), so TRITON_INTERPRET must be set
before any test module imports april_ext.triton_kernels. Setting it here, for the whole session, is
harmless for code that launches no Triton kernel. Real GPU runs (bench/gpu_kernels_report.py) start
without it.
"""

from __future__ import annotations

import os

if os.environ.get("APRIL_EXT_GPU_TESTS") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
