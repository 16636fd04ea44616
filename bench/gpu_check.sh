#!/usr/bin/env bash
# One-shot check on a lent GPU machine (CUDA or ROCm): build, GPU tests, kernel and allocator reports.
# Writes everything under ${OUT:-gpu_out}. Sized for a ~9 minute budget:
#   bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  nvidia-smi || rocm-smi || true
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} >"$OUT/env.txt" 2>&1

# The extension; GPU runtimes are dlopen'ed, headers come from the toolkit.
MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 \
  || { echo "build failed"; tail -50 "$OUT/build.log"; exit 1; }

# GPU tests of every area (each GPU scenario runs in its own subprocess where it can crash the device).
APRIL_EXT_GPU_TESTS=1 timeout 180 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_memory_gpu.py tests/test_engine_gpu.py tests/test_trainer.py tests/test_trainer_colocated.py \
  -k "gpu or cuda" >"$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?" | tee -a "$OUT/gpu_tests.log"

timeout 120 python3 bench/gpu_memory_report.py --out "$OUT/memory_report.json" >"$OUT/memory_report.log" 2>&1
echo "memory report rc=$?"
timeout 330 python3 bench/gpu_kernels_report.py "$OUT/kernels_report.json" --budget-s 240 \
  >"$OUT/kernels_report.log" 2>&1
echo "kernels report rc=$?"
tail -5 "$OUT"/*.log
