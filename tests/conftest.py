"""Session-wide test setup.

The Triton interpreter is chosen when a kernel is decorated (at import), so TRITON_INTERPRET must be set
before any test module imports april_ext.triton_kernels. Setting it here, for the whole session, is
harmless for code that launches no Triton kernel. GPU runs (APRIL_EXT_GPU_TESTS=1, see
bench/gpu_kernels_report.py) start without it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

if os.environ.get("APRIL_EXT_GPU_TESTS") != "1":
    os.environ["TRITON_INTERPRET"] = "1"


def _map_plain_checkout() -> None:
    """Makes april_ext.triton_kernels importable from a checkout that was never pip-installed (the GPU
    machine runs the kernel tests that way): the repo root goes on sys.path and triton_kernels/ is
    mapped under april_ext as setup.py does. If april_ext's __init__ cannot be imported there (it may
    need the compiled extension, which the kernels do not), a bare package over its folder stands in."""
    root = str(Path(__file__).resolve().parents[1])
    if importlib.util.find_spec("april_ext") is None:
        sys.path.insert(0, root)
    try:
        import april_ext
    except ImportError:
        april_ext = types.ModuleType("april_ext")
        april_ext.__path__ = [str(Path(root) / "april_ext")]
        sys.modules["april_ext"] = april_ext
    if importlib.util.find_spec("april_ext.triton_kernels") is None:
        april_ext.__path__.append(root)


if os.environ.get("APRIL_EXT_GPU_TESTS") == "1":
    _map_plain_checkout()
