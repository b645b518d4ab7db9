#!/usr/bin/env bash
# Measures alternative tile configurations on the GPU: one restricted build per variant
# (only that head dim, bf16, sm_90), then bench_attention.py for it, ours vs torch flash.
#   bash bench/tune_tiles.sh "fwd 128 128 128 8 2 true" "bwd 128 64 128 1 4" ...
# fwd variant: fwd D BLOCK_M BLOCK_N WARPS STAGES Q_IN_REGS
# bwd variant: bwd D BLOCK_M BLOCK_N WARPS_D WARPS_M_DQ
# Results (one line per variant, geomean ours/flash) go to stdout and $OUT/tune.csv.
set -uo pipefail
OUT=${OUT:-/tmp/fae_out}; mkdir -p "$OUT"
cd "$(dirname "$0")/.."
# The GPU image's default CXX (/opt/gcc wrapper) built an extension whose error-message
# formatting segfaulted (libstdc++ mismatch with the runtime); the system compiler is fine.
if [[ -x /usr/bin/g++ && "${CXX:-}" == /opt/gcc/* ]]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
export MAX_JOBS=${MAX_JOBS:-16} FLASH_ATTN_EXT_CUDA_ARCHS=${FLASH_ATTN_EXT_CUDA_ARCHS:-90} FLASH_ATTN_EXT_DTYPES=bf16
for variant in "$@"; do
  read -r pass D a b c d e <<< "$variant"
  if [[ $pass == fwd ]]; then
    defs="-DFAE_FWD_TUNE_D=$D -DFAE_FWD_TUNE_BM=$a -DFAE_FWD_TUNE_BN=$b -DFAE_FWD_TUNE_WARPS=$c -DFAE_FWD_TUNE_STAGES=$d -DFAE_FWD_TUNE_QREGS=$e"
  else
    defs="-DFAE_BWD_TUNE_D=$D -DFAE_BWD_TUNE_BM=$a -DFAE_BWD_TUNE_BN=$b -DFAE_BWD_TUNE_WARPS_D=$c -DFAE_BWD_TUNE_WARPS_M_DQ=$d"
  fi
  log="$OUT/tune_$(echo "$variant" | tr ' ' '_').log"
  if ! FLASH_ATTN_EXT_HEAD_DIMS=$D FLASH_ATTN_EXT_NVCC_EXTRA="$defs -Xptxas=-v" \
      python3 -m pip install --no-build-isolation --no-deps -v -e . > "$log" 2>&1; then
    echo "$variant: BUILD FAILED"; grep -m3 error "$log"; continue
  fi
  spills=$(grep -E "spill stores" "$log" | grep -v " 0 bytes spill" | wc -l)
  res=$(python3 bench/bench_attention.py --hdims "$D" --seqlens ${TUNE_SEQLENS:-2048,8192} --causal 0,1 \
        --pass "$pass" --backends ours,flash 2>/dev/null | grep "geomean ours/flash")
  echo "$variant | spilling kernels: $spills | $res" | tee -a "$OUT/tune.csv"
done
