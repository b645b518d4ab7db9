"""The varlen-variants suite (formerly bench/bench_varlen_variants.py): the varlen forward with
attention variants, the Hopper kernels against the mma.sync ones. CUDA only.

    python -m flash_attn_ext.bench varlen-variants [--head-dim 128] [--rounds 2] [--csv out.csv]

Packed sequences of 128..4096 tokens (seeded) up to 16384 tokens, H = 16, bf16, forward only,
through flash_attn_varlen_func: plain, softcap 30, a causal 512-key window, per-sequence ALiBi
and causal dropout 0.1. FLASH_ATTN_EXT_FWD_IMPL (read on every call) switches between the
Hopper kernels ("auto" on sm_90) and the mma.sync kernels ("mma") in one process; the order
alternates every round (flash_attn_ext.bench.rotated_rounds: with two names, rotating is
alternating) and the best time of the rounds is kept (triton do_bench medians,
flash_attn_ext.bench.time_ms). Table printed last; --csv writes it.
"""
import argparse
import random

import torch

import flash_attn_ext as fa
from ..backends import env_set
from ..report import write_rows_csv
from ..timing import require_cuda, rotated_rounds, time_ms

IMPLS = ("auto", "mma")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m flash_attn_ext.bench varlen-variants",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
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
    require_cuda("varlen-variants")
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
    rows = []
    with torch.no_grad():
        for name, kw in cases.items():
            fn = lambda kw=kw: fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens),  # noqa: E731
                                                         max(lens), **kw)

            def time_one(impl, first_round, fn=fn):
                # The switch is read on every call: set around the warm-up call and the timing.
                with env_set({"FLASH_ATTN_EXT_FWD_IMPL": impl}):
                    fn()
                    return {"fwd": {"ms": time_ms(fn, "cuda")}}
            best = {impl: r["fwd"]["ms"]
                    for impl, r in rotated_rounds(list(IMPLS), time_one, args.rounds, min).items()}
            rows.append(dict(case=name, hopper_ms=best["auto"], mma_ms=best["mma"],
                             speedup=best["mma"] / best["auto"]))
    if args.csv:
        write_rows_csv(rows, args.csv)
    print(f"\nvarlen forward, {len(lens)} sequences, {args.tokens} tokens, H={H}, D={D}, bf16, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, best of {args.rounds}")
    print(f"{'case':<22}{'hopper ms':>11}{'mma ms':>9}{'mma/hopper':>12}")
    for r in rows:
        print(f"{r['case']:<22}{r['hopper_ms']:>11.3f}{r['mma_ms']:>9.3f}{r['speedup']:>12.2f}")
