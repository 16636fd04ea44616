"""Builds april_ext._C with CMake + ninja.

Environment switches:
  APRIL_EXT_CUDA=auto|0|1    CUDA allocator backend (headers only; libcuda is dlopen'ed at run time)
  APRIL_EXT_ROCM=auto|0|1    ROCm/HIP allocator backend (headers only; libamdhip64 is dlopen'ed)
  APRIL_EXT_BUILD_TYPE=...   CMake build type (default Release)
  APRIL_EXT_SANITIZE=...     e.g. "address,undefined" (a build for sanitizer runs)
  APRIL_EXT_BUILD_DIR=...    CMake build directory (default build/cmake-<build type>)
  MAX_JOBS=N                 parallel compile jobs

The build directory is reused between installs, but the configure it holds is tied to one build
environment: an isolated pip build keeps cmake, ninja and pybind11 in a /tmp/pip-build-env-* that pip
deletes afterwards. So the configure inputs are recorded next to CMakeCache.txt, and the cache is cleared
when they change or when a tool path the cache holds is gone (see stale_cache_reason).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
# The configure inputs of the cache in a build directory; written only after a configure succeeded.
FINGERPRINT_FILE = "april_ext_configure.json"
# Cache entries holding paths of the build environment; any that vanished makes the cache unusable.
CACHE_PATH_KEYS = (
    "CMAKE_COMMAND",
    "CMAKE_ROOT",
    "CMAKE_MAKE_PROGRAM",
    "CMAKE_CXX_COMPILER",
    "Python_EXECUTABLE",
    "pybind11_DIR",
    "pybind11_INCLUDE_DIRS",
)


def _switch(name: str) -> str:
    value = os.environ.get(name, "auto").strip().lower()
    if value not in ("auto", "0", "1"):
        raise SystemExit(f"{name}={value!r} is not allowed: use auto, 0 or 1")
    return value


def _tool(name: str) -> str:
    """The tool found on PATH (where pip puts an isolated build's cmake and ninja), else its PyPI package's."""
    if found := shutil.which(name):
        return os.path.abspath(found)
    candidate: Path | None = None
    try:
        if name == "ninja":
            import ninja

            candidate = Path(ninja.BIN_DIR) / name
        else:
            import cmake

            candidate = Path(cmake.CMAKE_BIN_DIR) / name
    except ImportError:
        pass
    if candidate is None or not candidate.is_file():
        raise SystemExit(f"april_ext: {name} not found: pip install {name}")
    return str(candidate)


def read_cmake_cache(cache: Path) -> dict[str, str]:
    """NAME -> value of a CMakeCache.txt (lines NAME:TYPE=value)."""
    entries: dict[str, str] = {}
    for line in cache.read_text(errors="replace").splitlines():
        if not line or line.startswith(("#", "//")) or "=" not in line:
            continue
        key, value = line.split("=", 1)
        entries[key.split(":", 1)[0]] = value
    return entries


def stale_cache_reason(build_dir: Path, fingerprint: dict[str, str]) -> str | None:
    """Why the configure in build_dir can't be reused with these inputs, or None when it can."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.exists() and not (build_dir / "CMakeFiles").exists():
        return None
    try:
        recorded = json.loads((build_dir / FINGERPRINT_FILE).read_text())
    except (OSError, ValueError):
        return "no record of the build environment it was configured in"
    if recorded != fingerprint:
        changed = sorted(k for k in fingerprint.keys() | recorded.keys() if recorded.get(k) != fingerprint.get(k))
        return "the build environment changed: " + ", ".join(changed)
    if not cache.exists():
        return "CMakeFiles/ without CMakeCache.txt"
    entries = read_cmake_cache(cache)
    for key in CACHE_PATH_KEYS:
        for path in filter(None, entries.get(key, "").split(";")):
            if os.path.isabs(path) and not os.path.exists(path):
                return f"{key} points to {path}, which no longer exists"
    return None


def clear_cmake_cache(build_dir: Path) -> None:
    """Removes what a configure leaves; object files in CMakeFiles/ go too (built with the old tools)."""
    for name in ("CMakeCache.txt", FINGERPRINT_FILE):
        (build_dir / name).unlink(missing_ok=True)
    shutil.rmtree(build_dir / "CMakeFiles", ignore_errors=True)


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        # Imported here, not at the top: tests import this file's helpers without the build requirements.
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_type = os.environ.get("APRIL_EXT_BUILD_TYPE", "Release")
        sanitize = os.environ.get("APRIL_EXT_SANITIZE", "")
        default_dir = ROOT / "build" / f"cmake-{build_type}{'-' + sanitize.replace(',', '-') if sanitize else ''}"
        build_dir = Path(os.environ.get("APRIL_EXT_BUILD_DIR", default_dir)).resolve()
        cmake, ninja = _tool("cmake"), _tool("ninja")
        cxx = os.environ.get("CXX", "")
        # Everything a configure bakes into the cache. Python is not resolved: another venv counts as another.
        fingerprint = {
            "source_dir": str(ROOT),
            "build_dir": str(build_dir),
            "cmake": cmake,
            "ninja": ninja,
            "python": os.path.abspath(sys.executable),
            "pybind11_dir": pybind11.get_cmake_dir(),
            "cxx": cxx,
            "cxx_path": shutil.which(cxx or "c++") or "",
            "cxxflags": os.environ.get("CXXFLAGS", ""),
            "ldflags": os.environ.get("LDFLAGS", ""),
            "build_type": build_type,
            "sanitize": sanitize,
            "cuda": _switch("APRIL_EXT_CUDA"),
            "rocm": _switch("APRIL_EXT_ROCM"),
        }
        if reason := stale_cache_reason(build_dir, fingerprint):
            print(f"april_ext: configuring {build_dir} from scratch: {reason}", flush=True)
            clear_cmake_cache(build_dir)
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            cmake, "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            # Explicit, so the cache never keeps a ninja from an earlier build environment.
            f"-DCMAKE_MAKE_PROGRAM={ninja}",
            f"-DCMAKE_BUILD_TYPE={build_type}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={fingerprint['python']}",
            f"-Dpybind11_DIR={fingerprint['pybind11_dir']}",
            f"-DAPRIL_EXT_CUDA={fingerprint['cuda']}",
            f"-DAPRIL_EXT_ROCM={fingerprint['rocm']}",
            f"-DAPRIL_EXT_SANITIZE={sanitize}",
        ]
        # A configure that fails half-way leaves no record, so the next build starts from scratch.
        (build_dir / FINGERPRINT_FILE).unlink(missing_ok=True)
        subprocess.run(configure, check=True)
        (build_dir / FINGERPRINT_FILE).write_text(json.dumps(fingerprint, indent=1, sort_keys=True) + "\n")
        build = [cmake, "--build", str(build_dir)]
        if jobs := os.environ.get("MAX_JOBS"):
            build += ["-j", jobs]
        subprocess.run(build, check=True)


# Guarded so tests can import the helpers above; setuptools' build backend runs this file as __main__.
if __name__ == "__main__":
    setup(
        ext_modules=[CMakeExtension("april_ext._C")],
        cmdclass={"build_ext": CMakeBuild},
        # The kernels live in the top-level triton_kernels/ folder and ship as april_ext.triton_kernels.
        packages=find_packages(include=["april_ext", "april_ext.*"])
        + ["april_ext.triton_kernels"]
        + [f"april_ext.{p}" for p in find_packages(include=["triton_kernels.*"])],
        package_dir={"april_ext.triton_kernels": "triton_kernels"},
    )
