"""Builds april_ext._C with CMake + ninja.

Environment switches:
  APRIL_EXT_CUDA=auto|0|1    CUDA allocator backend (headers only; libcuda is dlopen'ed at run time)
  APRIL_EXT_ROCM=auto|0|1    ROCm/HIP allocator backend (headers only; libamdhip64 is dlopen'ed)
  APRIL_EXT_BUILD_TYPE=...   CMake build type (default Release)
  APRIL_EXT_SANITIZE=...     e.g. "address,undefined" (a build for sanitizer runs)
  APRIL_EXT_BUILD_DIR=...    CMake build directory (default build/cmake-<build type>)
  MAX_JOBS=N                 parallel compile jobs
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pybind11
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _switch(name: str) -> str:
    value = os.environ.get(name, "auto").strip().lower()
    if value not in ("auto", "0", "1"):
        raise SystemExit(f"{name}={value!r} is not allowed: use auto, 0 or 1")
    return value


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_type = os.environ.get("APRIL_EXT_BUILD_TYPE", "Release")
        sanitize = os.environ.get("APRIL_EXT_SANITIZE", "")
        default_dir = ROOT / "build" / f"cmake-{build_type}{'-' + sanitize.replace(',', '-') if sanitize else ''}"
        build_dir = Path(os.environ.get("APRIL_EXT_BUILD_DIR", default_dir))
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DCMAKE_BUILD_TYPE={build_type}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DAPRIL_EXT_CUDA={_switch('APRIL_EXT_CUDA')}",
            f"-DAPRIL_EXT_ROCM={_switch('APRIL_EXT_ROCM')}",
            f"-DAPRIL_EXT_SANITIZE={sanitize}",
        ]
        subprocess.run(configure, check=True)
        build = ["cmake", "--build", str(build_dir)]
        if jobs := os.environ.get("MAX_JOBS"):
            build += ["-j", jobs]
        subprocess.run(build, check=True)


setup(
    ext_modules=[CMakeExtension("april_ext._C")],
    cmdclass={"build_ext": CMakeBuild},
    # The kernels live in the top-level triton_kernels/ folder and ship as april_ext.triton_kernels.
    packages=find_packages(include=["april_ext", "april_ext.*"])
    + ["april_ext.triton_kernels"]
    + [f"april_ext.{p}" for p in find_packages(include=["triton_kernels.*"])],
    package_dir={"april_ext.triton_kernels": "triton_kernels"},
)
