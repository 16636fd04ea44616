#!/usr/bin/env bash
# One-shot check on a lent GPU machine (CUDA or ROCm): build, a fast first part, GPU tests, allocator
# and kernel reports. Writes everything under ${OUT:-gpu_out}:
#   bash bench/gpu_check.sh
# A lent machine gives a session about 15 minutes, its start included, and at most 10 per command:
# the step limits below add up to at most 7 minutes (BUDGET_S), so a rerun of the slow part fits.
# Every step runs even when an earlier one failed (the build excepted) and writes its own results;
# $OUT/steps.tsv gets one line per step as it ends: name, limit_s, rc, seconds, results file.
# APRIL_GPU_CHECK_DRY_RUN=1 replaces each step by a stand-in that writes its results file (for tests
# on a machine without a GPU); APRIL_GPU_CHECK_DRY_RUN_FAIL=<step> makes that stand-in fail.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
DRY_RUN="${APRIL_GPU_CHECK_DRY_RUN:-0}"
DRY_RUN_FAIL="${APRIL_GPU_CHECK_DRY_RUN_FAIL:-}"
BUDGET_S=420
KILL_AFTER_S=3  # from SIGTERM to SIGKILL, inside each step's limit
mkdir -p "$OUT"
: >"$OUT/steps.tsv"
export OUT PYTHONUNBUFFERED=1
failed=0

# step NAME LIMIT_S RESULTS_FILE COMMAND...: runs COMMAND (output in $OUT/NAME.log) under a limit that
# includes the kill grace; timeout(1) signals the command's whole process group.
step() {
  local name=$1 limit=$2 results=$3 rc start=$SECONDS
  shift 3
  if [ "$DRY_RUN" = 1 ]; then
    local fake_rc=0
    [ "$DRY_RUN_FAIL" = "$name" ] && fake_rc=1
    timeout -k "$KILL_AFTER_S" $((limit - KILL_AFTER_S)) python3 -c '
import json, sys
name, path, rc, command = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
json.dump({"step": name, "dry_run": True, "command": command}, open(path, "w"))
sys.exit(rc)' "$name" "$OUT/$results" "$fake_rc" "$@" >"$OUT/$name.log" 2>&1
  else
    timeout -k "$KILL_AFTER_S" $((limit - KILL_AFTER_S)) "$@" >"$OUT/$name.log" 2>&1
  fi
  rc=$?
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$limit" "$rc" "$((SECONDS - start))" "$results" >>"$OUT/steps.tsv"
  echo "[$name] rc=$rc after $((SECONDS - start)) s (limit $limit s)"
  [ "$rc" = 0 ] || failed=1
  return "$rc"
}

env_info() {
  { nvidia-smi || rocm-smi || true; } >"$OUT/env.txt" 2>&1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >>"$OUT/env.txt" 2>&1
}

# The GPU backend of this machine is required: with auto, a missing header would leave it out and
# every allocator GPU test would skip.
build() {
  local cuda=0 rocm=0
  if command -v nvidia-smi >/dev/null; then cuda=1; elif command -v rocm-smi >/dev/null; then rocm=1; else
    echo "neither nvidia-smi nor rocm-smi found: no GPU backend to require"; return 1
  fi
  APRIL_EXT_CUDA=$cuda APRIL_EXT_ROCM=$rocm MAX_JOBS=16 \
    python3 -m pip install -q --no-build-isolation --no-deps -e .
}

export -f env_info build
step env 10 env.txt bash -c env_info
# Nothing else can run without the extension.
step build 100 build.log bash -c build || { tail -50 "$OUT/build.log"; exit 1; }
# The fast first part: backends, allocator smoke test, one kernel case; quick.json before anything slow.
step quick 60 quick.json python3 bench/gpu_quick_check.py "$OUT/quick.json"
# No -x: one failing test must not hide the others.
step gpu_tests 90 gpu_tests.xml env APRIL_EXT_GPU_TESTS=1 python3 -m pytest -q -p no:cacheprovider \
  --junitxml "$OUT/gpu_tests.xml" -k "gpu or cuda" \
  tests/test_memory_gpu.py tests/test_engine_gpu.py tests/test_trainer.py tests/test_trainer_colocated.py
step memory_report 45 memory_report.json python3 bench/gpu_memory_report.py --out "$OUT/memory_report.json" \
  --sizes-gib 1 2 --rounds 2
# Asynchronous APRIL on the device beside synchronous APRIL (the trainer in a spawned process on the same GPU).
step async_run 35 async.json python3 bench/gpu_async_check.py "$OUT/async.json" --steps 20
step kernels_report 80 kernels_report.json python3 bench/gpu_kernels_report.py "$OUT/kernels_report.json" \
  --budget-s 65 --tests-timeout-s 40

total=$(awk -F'\t' '{s += $2} END {print s}' "$OUT/steps.tsv")
echo "step limits: $total s of a $BUDGET_S s budget"
tail -n 3 "$OUT"/*.log
exit "$failed"
