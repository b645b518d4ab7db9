"""The fp8 suite (formerly bench/bench_fp8.py): FP8 (e4m3) forward against our bf16 forward and
torch's bf16 SDPA backends, same run. CUDA only (the FP8 forward runs on Hopper).

    python -m flash_attn_ext.bench fp8 [--head-dims 128,256] [--seqlens 1024,4096,8192,16384]
                                       [--causal 0,1] [--rounds 3] [--backends ...] [--csv out.csv]
    python -m flash_attn_ext.bench --dtype fp8 [--hdims ...] ...   (the same, from the
                                                                     attention suite's options)

Per (head dim, seqlen, causal): B = 16384 / S sequences, H = 2048 / D heads (16k tokens,
2048 model dims), q/k/v quantised per tensor. Times are medians (triton do_bench, L2
flushed; flash_attn_ext.bench.time_ms) with the backends' order rotated every round and the
median of the rounds kept (flash_attn_ext.bench.rotated_rounds); TFLOP/s count the bf16 FLOPs
4 B H S^2 D (half when causal). The FP8 time includes the V transpose pass it runs
(fp8_fwd.cu). fp8_varlen / bf16_varlen (not in the default set): the same sequences packed
through flash_attn_varlen_func. fa4: FlashAttention-4's FP8 forward (flash-attn-4, per-(batch,
kv head) descales), where it runs: its CuTe kernels take FP8 on SM100 only, so on Hopper the
column is dropped with a one-line notice, as it is when flash-attn-4 does not import. Table
printed last; --csv writes it.
"""
import argparse
import importlib
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn_ext as fa
from flash_attn_ext.fp8 import quantize_fp8
from ..backends import missing_backend
from ..report import write_rows_csv
from ..timing import require_cuda, rotated_rounds, time_ms

BACKENDS = ("fp8", "bf16", "cudnn", "fa2", "fa4", "fp8_varlen", "bf16_varlen")
DEFAULT_BACKENDS = BACKENDS[:5]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m flash_attn_ext.bench fp8", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", default="128,256")
    ap.add_argument("--seqlens", default="1024,4096,8192,16384")
    ap.add_argument("--causal", default="0,1", help="comma list of 0/1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backends", default=",".join(DEFAULT_BACKENDS),
                    help="a subset of " + ",".join(BACKENDS))
    ap.add_argument("--csv", default=None)
    return ap.parse_args(argv)


def make_fn(backend, q, k, v, q8, k8, v8, descales, causal):
    if backend == "fp8":
        qd, kd, vd = descales
        return lambda: fa.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd,
                                          v_descale=vd)
    if backend == "bf16":
        return lambda: fa.flash_attn_func(q, k, v, causal=causal)
    if backend == "fa4":
        fa4_func = importlib.import_module("flash_attn.cute").flash_attn_func
        B, Hk = k8.shape[0], k8.shape[2]  # FA4's descales: one per (batch, kv head)
        qd, kd, vd = (x.reshape(1, 1).expand(B, Hk).contiguous() for x in descales)
        return lambda: fa4_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd,
                                v_descale=vd)
    if backend.endswith("_varlen"):
        B, S = q.shape[:2]
        cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=q.device)
        if backend == "fp8_varlen":
            qd, kd, vd = descales
            p8 = [x.flatten(0, 1) for x in (q8, k8, v8)]
            return lambda: fa.flash_attn_varlen_func(*p8, cu, cu, S, S, causal=causal,
                                                     q_descale=qd, k_descale=kd, v_descale=vd)
        p16 = [x.flatten(0, 1) for x in (q, k, v)]
        return lambda: fa.flash_attn_varlen_func(*p16, cu, cu, S, S, causal=causal)
    sdpa = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}[backend]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def run():
        with sdpa_kernel(sdpa):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    return run


def fa4_fp8_notice():
    """None where FlashAttention-4's FP8 forward runs here, else why not (one line)."""
    reason = missing_backend("fa4")
    if reason:
        return reason
    major, minor = torch.cuda.get_device_capability()
    if major != 10:
        return (f"fa4: FlashAttention-4's FP8 forward runs on SM100 only (this GPU: sm_{major}{minor}); "
                "no fa4 column")
    return None


def main(argv=None):
    args = parse_args(argv)
    require_cuda("fp8")
    backends = tuple(b for b in args.backends.split(",") if b)
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise SystemExit(f"unknown backend(s) {unknown}; choose from {','.join(BACKENDS)}")
    notice = fa4_fp8_notice() if "fa4" in backends else None
    if notice:
        print(notice, file=sys.stderr)
        backends = tuple(b for b in backends if b != "fa4")
    causals = [bool(int(c)) for c in args.causal.split(",") if c.strip()]
    rows = []
    for D in (int(d) for d in args.head_dims.split(",")):
        for S in (int(s) for s in args.seqlens.split(",")):
            B, H = max(1, 16384 // S), 2048 // D
            gen = torch.Generator(device="cpu").manual_seed(0)
            q, k, v = (torch.randn(B, S, H, D, generator=gen).to("cuda", torch.bfloat16)
                       for _ in range(3))
            (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(x) for x in (q, k, v))
            for causal in causals:
                # Inputs as default arguments: the del below frees them with this function.
                def time_one(b, first_round, causal=causal,
                             inputs=(q, k, v, q8, k8, v8, (qd, kd, vd))):
                    try:
                        fn = make_fn(b, *inputs, causal)
                        fn()
                        return {"fwd": {"ms": time_ms(fn, "cuda")}}
                    except Exception as e:  # a backend that refuses this shape
                        print(f"  {b}: {type(e).__name__}: {str(e)[:80]}", file=sys.stderr)
                        return {"fwd": {"ms": None}}
                with torch.no_grad():
                    results = rotated_rounds(list(backends), time_one, args.rounds)
                flops = 4 * B * H * S * S * D / (2 if causal else 1)
                row = dict(D=D, S=S, B=B, H=H, causal=causal)
                for b in backends:
                    ms = results[b]["fwd"]["ms"]
                    row[b + "_ms"] = ms
                    row[b + "_tflops"] = flops / ms / 1e9 if ms else None
                rows.append(row)
                print(f"  D={D} S={S} causal={causal} done", file=sys.stderr, flush=True)
            del q, k, v, q8, k8, v8, time_one
    if args.csv:
        write_rows_csv(rows, args.csv)

    def ratio(a, b):
        return f"{a / b:.2f}" if a and b else "-"
    print(f"\nFP8 forward, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"rounds {args.rounds}; TFLOP/s (bf16 FLOP count)")
    head = (f"{'D':>4}{'S':>7}{'causal':>8}" + "".join(f"{b:>12}" for b in backends) +
            f"{'fp8/bf16':>10}{'fp8/cudnn':>11}")
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = "".join(f"{r[b + '_tflops']:12.0f}" if r[b + "_tflops"] else f"{'-':>12}"
                        for b in backends)
        print(f"{r['D']:>4}{r['S']:>7}{str(r['causal']):>8}{cells}"
              f"{ratio(r.get('bf16_ms'), r.get('fp8_ms')):>10}"
              f"{ratio(r.get('cudnn_ms'), r.get('fp8_ms')):>11}")
    print("fp8/bf16, fp8/cudnn: speed-up of the FP8 forward (> 1: FP8 faster)")

