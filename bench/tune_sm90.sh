#!/usr/bin/env bash
# Hopper forward tile sweep on the GPU machine: one bf16 build per variant
# (compile-time FAE_SM90_BLOCK_N / FAE_SM90_STAGES), each timed against cuDNN
# and FA2 in the same process by bench/sm90_variants.py. Logs under $OUT.
#   bash bench/tune_sm90.sh "128 176 2" "64 192 3" "256 80 2"     # "D BLOCK_N STAGES" ...
set -uo pipefail
OUT=${OUT:-/tmp/fae_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
if [[ -x /usr/bin/g++ && "${CXX:-}" == /opt/gcc/* ]]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
export MAX_JOBS=${MAX_JOBS:-16} FLASH_ATTN_EXT_CUDA_ARCHS=90a FLASH_ATTN_EXT_DTYPES=bf16
for variant in "$@"; do
  read -r dim block_n stages <<< "$variant"
  tag="d${dim}_bn${block_n}_st${stages}"
  FLASH_ATTN_EXT_HEAD_DIMS=$dim \
    FLASH_ATTN_EXT_NVCC_EXTRA="-DFAE_SM90_BLOCK_N=$block_n -DFAE_SM90_STAGES=$stages -Xptxas=-v" \
    python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build_$tag.log" 2>&1 \
    || { echo "$tag: build failed"; grep -E "error" "$OUT/build_$tag.log" | head -5; continue; }
  grep -A2 "flash_fwd_sm90_kernel" "$OUT/build_$tag.log" | grep -E "spill" | sort | uniq -c
  python3 bench/sm90_variants.py --hdims "$dim" --variants "$tag=" --csv "$OUT/$tag.csv" 2>&1 | tail -10
done
