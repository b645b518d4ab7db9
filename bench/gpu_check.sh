#!/usr/bin/env bash
# One call on a GPU machine: build, GPU tests, benchmark, sanitizers; logs under $OUT.
#   bash bench/gpu_check.sh [build] [test] [test_mma] [bench] [sanitize]   (default: build test bench)
# build     pip install -e . with MAX_JOBS (default 16) jobs and ptxas's register / spill
#           report (-Xptxas=-v added to FLASH_ATTN_EXT_NVCC_EXTRA); prints spilling kernels
#           and ptxas's C75xx notes (serialised wgmma in a Hopper kernel)
# test      the GPU tests (pytest -m gpu; on sm_90 they cover the Hopper forward and backward;
#           with FLASH_ATTN_EXT_HEAD_DIMS / _DTYPES set, kernels outside the build are skips)
# test_mma  the same with both passes pinned to the mma.sync kernels
#           (FLASH_ATTN_EXT_FWD_IMPL=mma, FLASH_ATTN_EXT_BWD_IMPL=mma)
# bench     bench/bench_attention.py $BENCH_ARGS (or $BENCH_PY), CSV in $OUT/bench.csv
# sanitize  compute-sanitizer memcheck, racecheck and synccheck on bench/sanitize_case.py
# Environment: OUT (default /tmp/fae_out), FLASH_ATTN_EXT_CUDA_ARCHS (default 80;90a),
# FLASH_ATTN_EXT_HEAD_DIMS / FLASH_ATTN_EXT_DTYPES (faster builds), PYTEST_ARGS,
# TEST_TIMEOUT (s, default 420), BENCH_ARGS, BENCH_PY, BENCH_TIMEOUT (s, default 300).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.bash
for step in "$@"; do
  case $step in
    build|test|test_mma|bench|sanitize) ;;
    -h|--help) print_header_usage bench/gpu_check.sh; exit 0 ;;
    *) echo "gpu_check.sh: unknown step '$step' (see --help)" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-/tmp/fae_out}
mkdir -p "$OUT"
steps=${*:-build test bench}
export FLASH_ATTN_EXT_CUDA_ARCHS=${FLASH_ATTN_EXT_CUDA_ARCHS:-80;90a}
PY=python3

nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
if [[ " $steps " == *" build "* ]]; then
  start=$(date +%s)
  FLASH_ATTN_EXT_NVCC_EXTRA="${FLASH_ATTN_EXT_NVCC_EXTRA:-} -Xptxas=-v" $PY -m pip install --no-build-isolation --no-deps -v -e . > "$OUT/build.log" 2>&1 \
    || { grep -E "error|Error" "$OUT/build.log" | head -40; echo "BUILD FAILED"; exit 1; }
  echo "build: $(( $(date +%s) - start )) s"
  grep -E "spill|Used [0-9]+ registers" "$OUT/build.log" | grep -v " 0 bytes spill" | sort | uniq -c | head -20
  # ptxas C75xx: wgmma serialised or waits injected (a performance bug in a Hopper kernel).
  grep -E "C75[0-9][0-9]" "$OUT/build.log" | sort -u | head -10
fi
if [[ " $steps " == *" test "* ]]; then
  (cd tests && timeout ${TEST_TIMEOUT:-420} $PY -m pytest -m gpu -q -x -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/test.log" | tail -40)
fi
if [[ " $steps " == *" test_mma "* ]]; then
  (cd tests && FLASH_ATTN_EXT_FWD_IMPL=mma FLASH_ATTN_EXT_BWD_IMPL=mma timeout ${TEST_TIMEOUT:-420} $PY -m pytest -m gpu -q -x -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/test_mma.log" | tail -15)
fi
if [[ " $steps " == *" bench "* ]]; then
  timeout ${BENCH_TIMEOUT:-300} $PY ${BENCH_PY:-bench/bench_attention.py} ${BENCH_ARGS:-} --csv "$OUT/bench.csv" 2> "$OUT/bench.err" | tee "$OUT/bench.log"
fi
if [[ " $steps " == *" sanitize "* ]]; then
  $PY bench/sanitize_case.py --help > /dev/null 2>&1 && for tool in memcheck racecheck synccheck; do
    timeout 300 compute-sanitizer --tool $tool --print-limit 5 $PY bench/sanitize_case.py 2>&1 | tail -6 | tee "$OUT/sanitize_$tool.log"
  done
fi
