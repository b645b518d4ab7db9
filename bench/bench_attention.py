#!/usr/bin/env python3
"""Times flash_attn_ext against torch's SDPA backends, in one process, and prints a table last.

  python bench/bench_attention.py                          # GPU if present: FA paper grid, bf16
  python bench/bench_attention.py --device cpu             # CPU: B=1 H=8 S=2048 D=64 fp32
  python bench/bench_attention.py --hdims 128 --seqlens 4096 --causal 1 --pass fwd

FLOPs (FlashAttention convention): forward 4*B*H*Sq*Sk*D, halved when causal; backward 2.5x
the forward. Times are medians (triton.testing.do_bench on CUDA, perf_counter on CPU) after
warm-up. GPU default grid: 16k tokens (B = 16384/S), hidden 2048 (H = 2048/D).
Writes a CSV (--csv) with every row.
"""
import argparse
import csv
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import flash_attn_ext as fa


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default bf16 on GPU, fp32 on CPU)")
    p.add_argument("--hdims", default=None, help="comma list (default 64,128,256 on GPU, 64 on CPU)")
    p.add_argument("--seqlens", default=None, help="comma list (default 512..16384 on GPU, 2048 on CPU)")
    p.add_argument("--causal", default="0,1", help="comma list of 0/1")
    p.add_argument("--pass", dest="passes", default="fwd,bwd", help="fwd, bwd, fwd_bwd (comma list)")
    p.add_argument("--seqlen-q", type=int, default=None,
                   help="fixed query length (e.g. 1 for decoding); keys use --seqlens")
    p.add_argument("--batch", type=int, default=None, help="default 16384/S on GPU, 1 on CPU")
    p.add_argument("--heads", type=int, default=None, help="default 2048/D on GPU, 8 on CPU")
    p.add_argument("--backends", default=None,
                   help="comma list of ours,flash,efficient,cudnn,math (default: all that apply)")
    p.add_argument("--deterministic", action="store_true", help="our backward in deterministic mode")
    p.add_argument("--csv", default=None, help="write every row to this CSV file")
    p.add_argument("--quick", action="store_true",
                   help="one small config (D=64, S=1024 on CPU; D=128, S=4096 on GPU): a demo")
    return p.parse_args(argv)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def sdpa_backend(name):
    from torch.nn.attention import SDPBackend
    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]


def make_fn(backend, causal, deterministic):
    if backend == "sdpa":  # torch's own choice (on CPU: its flash-attention CPU kernel)
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if backend == "ours":
        return lambda q, k, v: fa.scaled_dot_product_attention(q, k, v, is_causal=causal) \
            if not deterministic else fa.flash_attn_func(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                deterministic=True).transpose(1, 2)
    from torch.nn.attention import sdpa_kernel
    be = sdpa_backend(backend)

    def fn(q, k, v):
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fn


def time_ms(fn, device):
    if device == "cuda":
        from triton.testing import do_bench
        return do_bench(fn, warmup=50, rep=200, return_mode="median")
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def peak_extra_mb(fn, device):
    """Peak memory a call allocates beyond what is live before it (inputs), in MB."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def bench_one(backend, q, k, v, causal, passes, device, deterministic):
    fn = make_fn(backend, causal, deterministic)
    res = {}
    try:
        out = fn(q, k, v)
    except Exception as e:  # backend refuses this input
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"}
    dout = torch.randn_like(out)
    res["fwd_mem"] = peak_extra_mb(lambda: fn(q, k, v), device)
    if "fwd" in passes:
        with torch.no_grad():
            res["fwd"] = time_ms(lambda: fn(q, k, v), device)
    if "bwd" in passes:
        out = fn(q, k, v)
        res["bwd"] = time_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), device)
        res["bwd_mem"] = peak_extra_mb(
            lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), device)
    if "fwd_bwd" in passes:
        res["fwd_bwd"] = time_ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout), device)
    return res


def main(argv=None):
    args = parse_args(argv)
    device = args.device
    gpu = device == "cuda"
    if args.quick:
        args.hdims = args.hdims or ("128" if gpu else "64")
        args.seqlens = args.seqlens or ("4096" if gpu else "1024")
    dtype = DTYPES[args.dtype or ("bf16" if gpu else "fp32")]
    hdims = [int(x) for x in (args.hdims or ("64,128,256" if gpu else "64")).split(",")]
    seqlens = [int(x) for x in (args.seqlens or ("512,1024,2048,4096,8192,16384" if gpu else "2048")).split(",")]
    causals = [bool(int(x)) for x in args.causal.split(",")]
    passes = args.passes.split(",")
    default_backends = "ours,flash,cudnn,efficient" if gpu else "ours,sdpa"
    backends = (args.backends or default_backends).split(",")

    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if gpu else 'cpu'} "
          f"({torch.get_num_threads()} CPU threads), dtype {dtype}", flush=True)
    rows = []
    for hdim in hdims:
        for S in seqlens:
            for causal in causals:
                B = args.batch or (max(1, 16384 // S) if gpu else 1)
                H = args.heads or (max(1, 2048 // hdim) if gpu else 8)
                Sq = args.seqlen_q or S
                gen = torch.Generator().manual_seed(0)
                q, k, v = (torch.randn(B, H, n, hdim, generator=gen).to(device, dtype).requires_grad_()
                           for n in (Sq, S, S))
                flops_fwd = 4 * B * H * Sq * S * hdim / (2 if causal and Sq == S else 1)
                flops = {"fwd": flops_fwd, "bwd": 2.5 * flops_fwd, "fwd_bwd": 3.5 * flops_fwd}
                results = {}
                for be in backends:
                    results[be] = bench_one(be, q, k, v, causal, passes, device,
                                            args.deterministic and be == "ours")
                for p in passes:
                    ours = results.get("ours", {}).get(p)
                    for name, res in results.items():
                        ms = res.get(p)
                        mem = res.get(f"{p}_mem")
                        row = dict(dtype=str(dtype).replace("torch.", ""), hdim=hdim, B=B, H=H, Sq=Sq, S=S,
                                   causal=int(causal), pass_=p, backend=name,
                                   ms=f"{ms:.4g}" if ms else "",
                                   tflops=f"{flops[p] / ms / 1e9:.4g}" if ms else "",
                                   ours_speedup=f"{ms / ours:.2f}" if ms and ours else "",
                                   peak_extra_mb=f"{mem:.1f}" if mem is not None else "",
                                   note=res.get("error", ""))
                        rows.append(row)
                print(f"  done D={hdim} S={S} causal={int(causal)}", file=sys.stderr, flush=True)
                del q, k, v
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    print_table(rows, backends)


def print_table(rows, backends):
    keys = sorted({(r["dtype"], r["hdim"], r["S"], r["causal"], r["pass_"], r["Sq"]) for r in rows},
                  key=lambda t: (t[4], t[1], t[3], t[2]))
    names = list(dict.fromkeys(r["backend"] for r in rows))
    by = {(r["dtype"], r["hdim"], r["S"], r["causal"], r["pass_"], r["Sq"], r["backend"]): r for r in rows}
    header = ["pass", "dtype", "D", "Sq", "Sk", "causal"] + [f"{n} TF/s" for n in names] + \
        [f"ours/{n}" for n in names if n != "ours"] + ["ours peak extra MB"]
    print("\n" + " | ".join(header))
    ratios = {n: [] for n in names if n != "ours"}
    for key in keys:
        cells = [key[4], key[0], str(key[1]), str(key[5]), str(key[2]), str(key[3])]
        tf = {n: by.get(key + (n,), {}).get("tflops", "") for n in names}
        cells += [tf[n] or by.get(key + (n,), {}).get("note", "-")[:20] or "-" for n in names]
        for n in names:
            if n == "ours":
                continue
            if tf["ours"] and tf[n]:
                r = float(by[key + (n,)]["ms"]) / float(by[key + ("ours",)]["ms"])
                ratios[n].append(r)
                cells.append(f"{r:.2f}")
            else:
                cells.append("-")
        cells.append(by.get(key + ("ours",), {}).get("peak_extra_mb") or "-")
        print(" | ".join(cells))
    for n, rs in ratios.items():
        if rs:
            gm = math.exp(sum(math.log(r) for r in rs) / len(rs))
            print(f"geomean ours/{n}: {gm:.3f} (min {min(rs):.2f}, {len(rs)} configs)")


if __name__ == "__main__":
    main()
