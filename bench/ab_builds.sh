#!/usr/bin/env bash
# Same-machine A/B of compile-time switches on a GPU machine: one build per variant (its
# defines in FLASH_ATTN_EXT_NVCC_EXTRA), optionally tests, then the same benchmark in a
# process of its own with a reference backend (cuDNN) in every process; last, a table of
# ours' time per config and variant, each against the first variant and against the
# reference (which shows how far the processes' clocks drifted apart).
#   bash bench/ab_builds.sh "base:" "stages3:-DFAE_SM90_STAGES=3"
# A variant is NAME:DEFINES (DEFINES may be empty: the default build). Environment:
#   OUT             logs and CSVs (default /tmp/fae_out): build_NAME.log, ab_NAME.csv, ab.txt
#   AB_BENCH_ARGS   the benchmark's arguments (default: --pass bwd --hdims 64,128
#                   --seqlens 1024,4096,16384 --causal 0,1 --backends ours,cudnn --layout bshd
#                   --rounds 3)
#   AB_TEST         pytest arguments run from tests/ after each build (e.g. "-q -x
#                   test_sm90_bwd.py"); none by default
#   AB_ROUNDS       runs of the whole variant list, in alternating order (default 1)
#   FLASH_ATTN_EXT_HEAD_DIMS (default 64,128), FLASH_ATTN_EXT_CUDA_ARCHS (default 90a), MAX_JOBS
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.bash
if [[ $# -eq 0 || "$1" == -h || "$1" == --help ]]; then print_header_usage bench/ab_builds.sh; exit 0; fi
OUT=${OUT:-/tmp/fae_out}; mkdir -p "$OUT"
export FLASH_ATTN_EXT_HEAD_DIMS=${FLASH_ATTN_EXT_HEAD_DIMS:-64,128}
export FLASH_ATTN_EXT_CUDA_ARCHS=${FLASH_ATTN_EXT_CUDA_ARCHS:-90a}
read -r -a bench_args <<< "${AB_BENCH_ARGS:---pass bwd --hdims 64,128 --seqlens 1024,4096,16384 --causal 0,1 --backends ours,cudnn --layout bshd --rounds 3}"
variants=("$@")
run_variant() {  # NAME DEFINES ROUND
  local name=$1 defs=$2 round=$3 start
  start=$(date +%s)
  if ! FLASH_ATTN_EXT_NVCC_EXTRA="$defs" python3 -m pip install --no-build-isolation --no-deps -e . \
      > "$OUT/build_$name.log" 2>&1; then
    echo "$name: BUILD FAILED"; grep -m5 error "$OUT/build_$name.log"; return 1
  fi
  echo "$name: built in $(( $(date +%s) - start )) s (defines: ${defs:-none})"
  if [[ -n "${AB_TEST:-}" ]]; then
    (cd tests && python3 -m pytest -p no:cacheprovider $AB_TEST 2>&1 | tail -3 | sed "s/^/$name tests: /")
  fi
  python3 bench/bench_attention.py "${bench_args[@]}" --csv "$OUT/ab_${name}_r$round.csv" \
    > "$OUT/bench_${name}_r$round.log" 2>&1 || echo "$name: benchmark failed (see bench_${name}_r$round.log)"
}
for ((round = 0; round < ${AB_ROUNDS:-1}; ++round)); do
  order=("${variants[@]}")
  if (( round % 2 == 1 )); then  # alternate the order: the clock follows the recent load
    order=(); for ((i = ${#variants[@]} - 1; i >= 0; --i)); do order+=("${variants[i]}"); done
  fi
  for v in "${order[@]}"; do run_variant "${v%%:*}" "${v#*:}" "$round"; done
done
python3 - "$OUT" "${variants[@]}" <<'PY' | tee "$OUT/ab.txt"
import csv, glob, statistics, sys
out, names = sys.argv[1], [v.split(":", 1)[0] for v in sys.argv[2:]]
ms = {}  # (name, config) -> [ours ms], (name, config, "ref") -> [reference ms]
for name in names:
    for path in sorted(glob.glob(f"{out}/ab_{name}_r*.csv")):
        for row in csv.DictReader(open(path)):
            if not row["ms"]:
                continue
            key = (row["hdim"], row["S"], row["causal"], row["pass_"])
            tag = (name, key) if row["backend"] == "ours" else (name, key, row["backend"])
            ms.setdefault(tag, []).append(float(row["ms"]))
configs = sorted({k[1] for k in ms if len(k) == 2}, key=lambda k: (k[3], int(k[0]), int(k[2]), int(k[1])))
refs = sorted({k[2] for k in ms if len(k) == 3})
print("ours ms per variant (median over rounds); ratio = time(first) / time(variant), above 1 faster;")
print("ref = time(reference) / time(ours) in that variant's process (" + ",".join(refs) + ")")
print("D | S | causal | pass | " + " | ".join(f"{n} ms | {n} ref" + (f" | {n} vs {names[0]}" if i else "")
                                         for i, n in enumerate(names)))
ratios = {n: [] for n in names[1:]}
for key in configs:
    cells, base = [], None
    for i, n in enumerate(names):
        t = ms.get((n, key))
        if not t:
            cells += ["-", "-"] + (["-"] if i else [])
            continue
        t = statistics.median(t)
        ref = [statistics.median(ms[(n, key, r)]) for r in refs if (n, key, r) in ms]
        cells += [f"{t:.4g}", f"{ref[0] / t:.3f}" if ref else "-"]
        if i == 0:
            base = t
        else:
            cells.append(f"{base / t:.3f}" if base else "-")
            if base:
                ratios[n].append(base / t)
    print(" | ".join(list(key) + cells))
for n, r in ratios.items():
    if r:
        g = statistics.geometric_mean(r)
        print(f"geomean {n} vs {names[0]}: {g:.3f} (min {min(r):.3f}, max {max(r):.3f}, {len(r)} configs)")
PY
