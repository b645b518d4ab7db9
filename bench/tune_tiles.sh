#!/usr/bin/env bash
# Measures alternative tile configurations on the GPU: one restricted build per variant
# (only that head dim, bf16, sm_90), then bench_attention.py for it, ours vs torch flash.
#   bash bench/tune_tiles.sh "fwd 128 128 64 4 2 false" "bwd 128 64 128 2" "dec 128 32 2" ...
# fwd variant: fwd D BLOCK_M BLOCK_N WARPS STAGES Q_IN_REGS
# bwd variant: bwd D BLOCK_M BLOCK_N WARPS_M_DQ [GEMM_UNROLL [LAYOUT]]  (LAYOUT: kRegisters,
#   kTiled or kSplit; default: the head dim's current layout)
# decode variant: dec D BLOCK_N STAGES [KEY_WARP_BLOCK_N]   (the seqlen_q <= 16 tiles: one
#   warp, and 4 key warps; timed on the decode shape B=8, H=32, Sq=1, Sk=8k..64k against
#   every SDPA backend)
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
  bench_args=(--hdims "$D" --seqlens ${TUNE_SEQLENS:-2048,8192} --causal 0,1 --pass "$pass" --backends ours,flash)
  want="geomean ours/flash"
  if [[ $pass == dec ]]; then
    defs="-DFAE_FWD_DECODE_TUNE_D=$D -DFAE_FWD_DECODE_TUNE_BN=$a -DFAE_FWD_DECODE_TUNE_STAGES=$b${c:+ -DFAE_FWD_DECODE_KW_TUNE_BN=$c}"
    bench_args=(--hdims "$D" --seqlen-q 1 --seqlens 8192,16384,32768,65536 --batch 8 --heads 32
                --causal 0 --pass fwd --backends ours,flash,efficient,cudnn)
    want="geomean ours/"
  elif [[ $pass == fwd ]]; then
    defs="-DFAE_FWD_TUNE_D=$D -DFAE_FWD_TUNE_BM=$a -DFAE_FWD_TUNE_BN=$b -DFAE_FWD_TUNE_WARPS=$c -DFAE_FWD_TUNE_STAGES=$d -DFAE_FWD_TUNE_QREGS=$e"
  else
    defs="-DFAE_BWD_TUNE_D=$D -DFAE_BWD_TUNE_BM=$a -DFAE_BWD_TUNE_BN=$b -DFAE_BWD_TUNE_WARPS_M_DQ=$c -DFAE_BWD_GEMM_UNROLL=${d:-1}${e:+ -DFAE_BWD_TUNE_LAYOUT=$e}"
  fi
  log="$OUT/tune_$(echo "$variant" | tr ' ' '_').log"
  if ! FLASH_ATTN_EXT_HEAD_DIMS=$D FLASH_ATTN_EXT_NVCC_EXTRA="$defs -Xptxas=-v" \
      python3 -m pip install --no-build-isolation --no-deps -v -e . > "$log" 2>&1; then
    echo "$variant: BUILD FAILED"; grep -m3 error "$log"; continue
  fi
  spills=$(grep -E "spill stores" "$log" | grep -v " 0 bytes spill" | wc -l)
  res=$(python3 ${BENCH_PY:-bench/bench_attention.py} "${bench_args[@]}" 2>/dev/null | grep "$want" | tr '\n' ' ')
  echo "$variant | spilling kernels: $spills | $res" | tee -a "$OUT/tune.csv"
done
