"""The host-overhead suite (formerly bench/bench_host_overhead.py): host time per call of tiny
attention calls, ours against torch's SDPA. Runs on CUDA and on the CPU.

    python -m flash_attn_ext.bench host-overhead [--device cuda|cpu] [--calls 2000] [--csv out.csv]

A tiny problem (B=1, S=4, H=2, D=128) is called `calls` times back to back under
torch.no_grad() and the wall time per call is reported (best of 2 repetitions in each of
--rounds passes over the calls, in rotated order, flash_attn_ext.bench.rotated_rounds keeping
the minimum): on CUDA the
kernels are queued asynchronously and take far less than the host's per-call work, so this
is the time the Python layer, the dispatcher, the op's checks and the launches cost. This is
not time_ms's measurement (one call's device time): a wall-clock loop of back-to-back calls,
best of its repetitions. Table printed last; --csv writes it.
"""
import argparse
import time

import torch
import torch.nn.functional as F

import flash_attn_ext as fa
from ..report import write_rows_csv
from ..timing import require_cuda, rotated_rounds


def per_call_us(fn, calls, device, repetitions=5):
    for _ in range(200):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repetitions):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m flash_attn_ext.bench host-overhead",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3,
                    help="passes over all calls, each starting one call later (best kept)")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)
    dev = args.device
    if dev == "cuda":
        require_cuda("host-overhead --device cuda")
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    q, k, v = (torch.randn(1, 4, 2, 128, device=dev, dtype=dtype) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kc, vc = (torch.randn(1, 64, 2, 128, device=dev, dtype=dtype) for _ in range(2))
    seqlens = torch.full((1,), 32, dtype=torch.int32, device=dev)
    q_step = q[:, :1]  # one decode step's query (sliced here: the slice is not the call's cost)
    calls = {
        "torch SDPA": lambda: F.scaled_dot_product_attention(qt, kt, vt),
        "torch SDPA causal": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True),
        "flash_attn_func": lambda: fa.flash_attn_func(q, k, v),
        "flash_attn_func causal": lambda: fa.flash_attn_func(q, k, v, causal=True),
        "ours SDPA": lambda: fa.scaled_dot_product_attention(qt, kt, vt),
        "flash_attn_with_kvcache": lambda: fa.flash_attn_with_kvcache(q_step, kc, vc,
                                                                      cache_seqlens=seqlens),
    }
    # Rounds over every call in rotated order, the best of each kept: a host's clock and
    # caches drift within a run (the first call timed once read ~30% high on an H100 host).
    # rotated_rounds' "ms" field carries microseconds here; reduce=min keeps the best round.
    def time_one(name, first_round):
        return {"host": {"ms": per_call_us(calls[name], args.calls, dev, 2)}}
    with torch.no_grad():
        best = rotated_rounds(list(calls), time_one, args.rounds, min)
    rows = [dict(call=name, us=best[name]["host"]["ms"]) for name in calls]
    if args.csv:
        write_rows_csv(rows, args.csv, ["call", "us"])
    base = rows[0]["us"]
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"\nHost time per call ({dev}, {name}, torch {torch.__version__}, {args.calls} calls, "
          f"best of {2 * args.rounds} repetitions over {args.rounds} rotated rounds)")
    print(f"{'call':<26}{'us':>8}{'/ torch SDPA':>14}")
    for r in rows:
        print(f"{r['call']:<26}{r['us']:8.1f}{r['us'] / base:14.2f}")

