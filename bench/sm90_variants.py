"""Same-run comparison of Hopper-forward variants that switch at run time
(environment variables read on every call) against torch SDPA's cuDNN and
FLASH_ATTENTION backends. Prints a table last and writes a CSV.

  python bench/sm90_variants.py --variants "pp=FLASH_ATTN_EXT_SM90_PINGPONG=1" \
      "nopp=FLASH_ATTN_EXT_SM90_PINGPONG=0" "mma=FLASH_ATTN_EXT_FWD_IMPL=mma"
"""
import argparse
import csv
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn_ext as fa
from flash_attn_ext.bench import env_set, rotated_rounds


def bench_ms(fn):
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["default="])
    ap.add_argument("--hdims", default="64,128,256")
    ap.add_argument("--seqlens", default="512,2048,8192")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--csv", default="sm90_variants.csv")
    ap.add_argument("--rounds", type=int, default=2, help="timings per variant (median), order rotated per round (rotated_rounds)")
    args = ap.parse_args()
    variants = []
    for v in args.variants:
        name, _, env = v.partition("=")
        pairs = [e.split("=", 1) for e in env.split(",") if e]
        variants.append((name, pairs))
    rows = []
    for D in map(int, args.hdims.split(",")):
        for S in map(int, args.seqlens.split(",")):
            for causal in (bool(int(c)) for c in args.causal.split(",")):
                B, H = 16384 // S, 2048 // D
                q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = 4 * B * H * S * S * D / (2 if causal else 1)
                def time_one(name, first_round):
                    if name in ("cudnn", "flash"):
                        sdpb = SDPBackend.CUDNN_ATTENTION if name == "cudnn" else SDPBackend.FLASH_ATTENTION
                        with sdpa_kernel(sdpb):
                            return {"fwd": {"ms": bench_ms(
                                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))}}
                    with env_set(dict(dict(variants)[name])):
                        return {"fwd": {"ms": bench_ms(
                            lambda: fa.scaled_dot_product_attention(q, k, v, is_causal=causal))}}

                order = [n for n, _ in variants] + ["cudnn", "flash"]
                res = {n: r["fwd"]["ms"] for n, r in rotated_rounds(order, time_one, args.rounds).items()}
                row = {"D": D, "S": S, "causal": int(causal)}
                row.update({f"{n} TF/s": flops / ms / 1e9 for n, ms in res.items()})
                rows.append(row)
                del q, k, v
    names = [n for n, _ in variants]
    with open(args.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  bf16 fwd, B=16384/S, H=2048/D")
    head = "  D     S  c | " + " ".join(f"{n:>8}" for n in names + ["cudnn", "flash"]) + " | " + \
        " ".join(f"{n + '/cudnn':>12}" for n in names)
    print(head)
    for r in rows:
        vals = [r[f"{n} TF/s"] for n in names + ["cudnn", "flash"]]
        ratios = [r[f"{n} TF/s"] / r["cudnn TF/s"] for n in names]
        print(f"{r['D']:3d} {r['S']:5d} {r['causal']:2d} | " + " ".join(f"{x:8.1f}" for x in vals) + " | " +
              " ".join(f"{x:12.3f}" for x in ratios))
    for n in names:
        for ref in ("cudnn", "flash"):
            ratios = [r[f"{n} TF/s"] / r[f"{ref} TF/s"] for r in rows]
            g = math.exp(sum(map(math.log, ratios)) / len(ratios))
            print(f"geomean {n}/{ref}: {g:.3f} (min {min(ratios):.2f})")


if __name__ == "__main__":
    main()
