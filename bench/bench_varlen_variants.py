"""Varlen forward with attention variants: the Hopper kernels against the mma.sync ones.

    python bench/bench_varlen_variants.py [--head-dim 128] [--rounds 2] [--csv out.csv]

Packed sequences of 128..4096 tokens (seeded) up to 16384 tokens, H = 16, bf16, forward only,
through flash_attn_varlen_func: plain, softcap 30, a causal 512-key window, per-sequence ALiBi
and causal dropout 0.1. FLASH_ATTN_EXT_FWD_IMPL (read on every call) switches between the
Hopper kernels ("auto" on sm_90) and the mma.sync kernels ("mma") in one process; the order
alternates every round and the best time of the rounds is kept (triton do_bench medians).
Table printed last; --csv writes it.
"""
import argparse
import csv
import os
import random

import torch

import flash_attn_ext as fa
from flash_attn_ext.bench.timing import time_ms

IMPLS = ("auto", "mma")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--csv", default=None)
    return ap.parse_args(argv)


def sequence_lengths(tokens, seed=0):
    rng = random.Random(seed)
    lens = []
    while sum(lens) < tokens:
        lens.append(rng.randint(128, 4096))
    lens[-1] -= sum(lens) - tokens
    return lens


def main(argv=None):
    args = parse_args(argv)
    lens = sequence_lengths(args.tokens)
    H, D = args.heads, args.head_dim
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                      device="cuda")
    q, k, v = (torch.randn(args.tokens, H, D, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    cases = {
        "plain": {},
        "softcap 30": dict(softcap=30.0),
        "causal window 512": dict(causal=True, window_size=(512, 0)),
        "ALiBi per sequence": dict(alibi_slopes=torch.rand(len(lens), H, device="cuda")),
        "causal dropout 0.1": dict(causal=True, dropout_p=0.1),
    }
    saved = os.environ.get("FLASH_ATTN_EXT_FWD_IMPL")
    rows = []
    try:
        with torch.no_grad():
            for name, kw in cases.items():
                times = {impl: [] for impl in IMPLS}
                for r in range(args.rounds):
                    for impl in IMPLS if r % 2 == 0 else IMPLS[::-1]:
                        os.environ["FLASH_ATTN_EXT_FWD_IMPL"] = impl
                        fn = lambda: fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens),  # noqa: E731
                                                               max(lens), **kw)
                        fn()
                        times[impl].append(time_ms(fn, "cuda"))
                best = {impl: min(t) for impl, t in times.items()}
                rows.append(dict(case=name, hopper_ms=best["auto"], mma_ms=best["mma"],
                                 speedup=best["mma"] / best["auto"]))
    finally:
        if saved is None:
            os.environ.pop("FLASH_ATTN_EXT_FWD_IMPL", None)
        else:
            os.environ["FLASH_ATTN_EXT_FWD_IMPL"] = saved
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
    print(f"\nvarlen forward, {len(lens)} sequences, {args.tokens} tokens, H={H}, D={D}, bf16, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, best of {args.rounds}")
    print(f"{'case':<22}{'hopper ms':>11}{'mma ms':>9}{'mma/hopper':>12}")
    for r in rows:
        print(f"{r['case']:<22}{r['hopper_ms']:>11.3f}{r['mma_ms']:>9.3f}{r['speedup']:>12.2f}")


if __name__ == "__main__":
    main()
