#!/usr/bin/env bash
# Tile tuning on a GPU machine: one restricted build per variant (that head dim only, bf16),
# then the benchmark for it; one result line per variant on stdout and in $OUT/tune.csv.
#   bash bench/tune_tiles.sh "fwd 128 128 64 4 2 false" "bwd 128 64 128 2" "dec 128 32 2" "sm90 128 176 2"
# fwd variant:  fwd D BLOCK_M BLOCK_N WARPS STAGES Q_IN_REGS       (mma.sync forward tiles)
# bwd variant:  bwd D BLOCK_M BLOCK_N WARPS_M_DQ [GEMM_UNROLL [LAYOUT]]  (mma.sync backward;
#   LAYOUT: kRegisters, kTiled or kSplit; default: the head dim's current layout)
# dec variant:  dec D BLOCK_N STAGES [KEY_WARP_BLOCK_N]   (the seqlen_q <= 16 tiles: one warp,
#   and 4 key warps; timed on the decode shape B=8, H=32, Sq=1, Sk=8k..64k against every
#   SDPA backend)
# sm90 variant: sm90 D BLOCK_N STAGES [Q_RING]   (the Hopper forward, every head dim's entry
#   of FwdSm90TileConfig at once; timed against cuDNN and FA2)
# fwd / bwd / dec build for FLASH_ATTN_EXT_CUDA_ARCHS (default 90: mma.sync code only), sm90
# for 90a. The tables these variants were measured for are next to the tile configs in
# csrc/cuda/sm80/fwd_kernel_traits.cuh, sm80/bwd_kernel_traits.cuh and hopper/fwd_sm90_kernel.cuh.
# Environment: OUT (logs, default /tmp/fae_out), TUNE_SEQLENS (fwd/bwd/sm90 key lengths,
# default 2048,8192), MAX_JOBS, BENCH_PY (default bench/bench_attention.py).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.bash
if [[ $# -eq 0 || "$1" == -h || "$1" == --help ]]; then print_header_usage bench/tune_tiles.sh; exit 0; fi
OUT=${OUT:-/tmp/fae_out}; mkdir -p "$OUT"
export FLASH_ATTN_EXT_DTYPES=bf16
archs=${FLASH_ATTN_EXT_CUDA_ARCHS:-90}
for variant in "$@"; do
  read -r pass D a b c d e <<< "$variant"
  bench_args=(--hdims "$D" --seqlens ${TUNE_SEQLENS:-2048,8192} --causal 0,1 --pass "$pass" --backends ours,flash)
  want="geomean ours/flash"
  arch=$archs
  case $pass in
    dec)
      defs="-DFAE_FWD_DECODE_TUNE_D=$D -DFAE_FWD_DECODE_TUNE_BN=$a -DFAE_FWD_DECODE_TUNE_STAGES=$b${c:+ -DFAE_FWD_DECODE_KW_TUNE_BN=$c}"
      bench_args=(--hdims "$D" --seqlen-q 1 --seqlens 8192,16384,32768,65536 --batch 8 --heads 32
                  --causal 0 --pass fwd --backends ours,flash,efficient,cudnn)
      want="geomean ours/" ;;
    fwd)
      defs="-DFAE_FWD_TUNE_D=$D -DFAE_FWD_TUNE_BM=$a -DFAE_FWD_TUNE_BN=$b -DFAE_FWD_TUNE_WARPS=$c -DFAE_FWD_TUNE_STAGES=$d -DFAE_FWD_TUNE_QREGS=$e" ;;
    bwd)
      defs="-DFAE_BWD_TUNE_D=$D -DFAE_BWD_TUNE_BM=$a -DFAE_BWD_TUNE_BN=$b -DFAE_BWD_TUNE_WARPS_M_DQ=$c -DFAE_BWD_GEMM_UNROLL=${d:-1}${e:+ -DFAE_BWD_TUNE_LAYOUT=$e}" ;;
    sm90)
      defs="-DFAE_SM90_BLOCK_N=$a -DFAE_SM90_STAGES=$b${c:+ -DFAE_SM90_Q_RING=$c}"
      bench_args=(--hdims "$D" --seqlens ${TUNE_SEQLENS:-2048,8192} --causal 0,1 --pass fwd
                  --backends ours,cudnn,flash --rounds 2)
      want="geomean ours/"
      arch=90a ;;
    *) echo "$variant: unknown pass '$pass' (fwd, bwd, dec or sm90; see --help)"; continue ;;
  esac
  log="$OUT/tune_$(echo "$variant" | tr ' ' '_').log"
  if ! FLASH_ATTN_EXT_CUDA_ARCHS=$arch FLASH_ATTN_EXT_HEAD_DIMS=$D FLASH_ATTN_EXT_NVCC_EXTRA="$defs -Xptxas=-v" \
      python3 -m pip install --no-build-isolation --no-deps -v -e . > "$log" 2>&1; then
    echo "$variant: BUILD FAILED"; grep -m3 error "$log"; continue
  fi
  spills=$(grep -E "spill stores" "$log" | grep -v " 0 bytes spill" | wc -l)
  res=$(python3 ${BENCH_PY:-bench/bench_attention.py} "${bench_args[@]}" 2>/dev/null | grep "$want" | tr '\n' ' ')
  echo "$variant | spilling kernels: $spills | $res" | tee -a "$OUT/tune.csv"
done
