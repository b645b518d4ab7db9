"""The varlen and decode suites (formerly bench/bench_features.py): flash_attn_ext's
variable-length and KV-cache (GQA decode) entry points against torch's own kernels, in one
process, tables printed last. Ratios, not absolute times, are the result: every reference runs
in the same process, on the same inputs, right after ours.

  python -m flash_attn_ext.bench varlen                    # GPU, bf16
  python -m flash_attn_ext.bench decode --json d.json
  python -m flash_attn_ext.bench decode --graph            # decode steps replayed from CUDA graphs
  python -m flash_attn_ext.bench varlen --device cpu --quick   # CPU smoke run (tiny sizes, fp32)

What each suite runs: VARLEN_DOC and DECODE_DOC below (their --help). Both share the inputs'
seeding, the timing, the rows (CSV_FIELDS, a `section` column naming the suite) and the
outputs.
"""
import argparse
import functools
import importlib
import inspect
import itertools
import random
import sys

import torch
import torch.nn.functional as F

import flash_attn_ext as fa
from ..backends import DTYPES, PASS_FLOP_FACTOR, _sdpa_backend_enum, missing_backend
from ..report import _fmt, _geomean, write_json, write_rows_csv
from ..timing import (Progress, Skip, measure_peaks, require_cuda, rotated_rounds,
                      time_passes, timer_name)

VARLEN_DOC = """\
Varlen: sequence lengths drawn (seeded) uniformly from 128..4096 until the total reaches 16k
tokens (the last length is cut so that the total is 16384 exactly, or dropped when under 128;
--lengths LO:HI and --tokens N change the range and the total),
H=16 (hidden 2048 at D=128), D in {64, 128}, causal 0/1, fwd and bwd. Backends:
  ours         flash_attn_ext.flash_attn_varlen_func on packed q/k/v [total, H, D]
  ours_padded  flash_attn_ext.flash_attn_func on the padded batch [B, max_len, H, D]
  sdpa_flash   torch SDPA pinned to FLASH_ATTENTION on the padded batch [B, H, max_len, D]
  sdpa_cudnn   torch SDPA pinned to CUDNN_ATTENTION, same padded input
  varlen_flash torch.nn.attention.varlen.varlen_attn under sdpa_kernel(FLASH_ATTENTION)
  varlen_cudnn the same under sdpa_kernel(CUDNN_ATTENTION)
               (a torch whose varlen_attn does not follow sdpa_kernel gets one column,
               `varlen`; a torch without varlen_attn gets a note; CUDA only)
  fa4_varlen   FlashAttention-4's flash_attn_varlen_func on the packed q/k/v (CUDA, when
               flash-attn-4 imports; otherwise a one-line notice and no column)
The padded backends attend to the zero padding too (no key mask): different results, a
timing reference only. Every backend's TF/s counts the same useful FLOPs: sum over sequences
of 4*H*len*len*D, halved when causal; bwd 2.5x. Their TF/s therefore include the time they
spend on padding.
"""

DECODE_DOC = """\
Decode with GQA: B=8, H=32, H_kv=8, D=128, Sq=1, full caches of 4k..64k tokens (cache_seqlens
= cache length), forward only. Backends:
  ours         flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=...)
               with caches [B, S_cache, H_kv, D]
  ours_func    flash_attn_ext.flash_attn_func(q, k_cache, v_cache) (GQA, no cache API): info
  ours_pagedP  flash_attn_with_kvcache on the same caches cut into pages of P tokens
               (P = 16, 64, 256: pools [B * S / P, P, H_kv, D] in a shuffled page order,
               or in sequence order with --page-order sequential,
               int32 block_table [B, S / P]); the table shows their time over ours
  ours_fp8     flash_attn_with_kvcache on the caches quantised to FP8 (e4m3, one factor
               per tensor: k_descale / v_descale [1]), q in the run's dtype (bf16 when that
               is fp32); its GB/s count the FP8 cache bytes (half of a 16-bit cache's), and
               the table shows its time and "fp8 speedup" = time(ours) / time(ours_fp8)
  sdpa_<be>    F.scaled_dot_product_attention(q, k, v, enable_gqa=True) on [B, H, S, D]
               inputs, pinned to flash, efficient, cudnn (and math on the CPU only)
  best_sdpa    the fastest sdpa_<be> of that row (its name in the note)
GB/s = (K and V caches read once + q read + out written) / median time (ours_fp8: its 1-byte
caches); %BW = that over the device-copy bandwidth measured at start-up
(flash_attn_ext.bench.measure_peaks; a copy both reads and writes, so a kernel that mostly
reads can pass 100 %: cuDNN reached ~102 % at 64k on an H200, torch 2.11).
"""

COMMON_DOC = """\
Ratios: ours/X = time(X) / time(ours), above 1 ours is faster (the attention suite's
convention). Timing: flash_attn_ext.bench.time_ms (CUDA: triton.testing.do_bench median, L2
flushed before each call, CUDA-event timer without triton; CPU: time.perf_counter median).
bwd is the backward alone (torch.autograd.grad with retain_graph=True on a forward built
before timing), via flash_attn_ext.bench.timing.time_passes. A backend that refuses an input,
or is CUDA-only on the CPU, gets a note instead of a time.
"""

EXAMPLES = {
    "varlen": """\
  python -m flash_attn_ext.bench varlen                        # GPU, bf16
  python -m flash_attn_ext.bench varlen --rounds 2 --csv v.csv
  python -m flash_attn_ext.bench varlen --device cpu --quick   # CPU smoke run (tiny sizes, fp32)
""",
    "decode": """\
  python -m flash_attn_ext.bench decode                        # GPU, bf16
  python -m flash_attn_ext.bench decode --json d.json
  python -m flash_attn_ext.bench decode --graph                # steps replayed from CUDA graphs
  python -m flash_attn_ext.bench decode --device cpu --quick   # CPU smoke run (tiny sizes, fp32)
"""}

# Full sizes (the brief's), and --quick sizes per device.
SIZES = {
    "full": dict(varlen=dict(tokens=16384, lo=128, hi=4096, H=16, hdims=(64, 128)),
                 decode=dict(B=8, H=32, H_kv=8, D=128,
                             caches=(4096, 8192, 16384, 32768, 65536))),
    "quick_cuda": dict(varlen=dict(tokens=4096, lo=128, hi=2048, H=16, hdims=(128,)),
                       decode=dict(B=8, H=32, H_kv=8, D=128, caches=(4096, 16384))),
    "quick_cpu": dict(varlen=dict(tokens=512, lo=16, hi=128, H=2, hdims=(64,)),
                      decode=dict(B=2, H=4, H_kv=2, D=64, caches=(256, 1024))),
}
PADDING_NOTE = ("varlen: ours_padded / sdpa_* run on the zero-padded batch [B, max_len] and attend "
                "to the padding (no key mask): other results than varlen, for timing only; all "
                "TF/s count the useful FLOPs sum_i 4*H*len_i^2*D (halved when causal), bwd 2.5x")
DECODE_NOTE = ("decode: GB/s = (K + V caches + q + out bytes) / time; %BW = GB/s / measured copy "
               "bandwidth (a copy reads and writes; a read-mostly kernel may pass 100 %); "
               "best_sdpa = fastest SDPA backend of the row; ours_fp8 GB/s count its FP8 cache "
               "bytes, fp8 speedup = time(ours, 16-bit cache) / time(ours_fp8)")
RATIO_NOTE = "ours/X = time(X) / time(ours): above 1, ours is faster"

CSV_FIELDS = ["section", "dtype", "pass_", "backend", "B", "H", "H_kv", "D", "Sq", "Sk", "tokens",
              "causal", "ms", "tflops", "gbps", "bw_frac", "flops_frac", "ours_speedup",
              "peak_extra_mb", "flops", "bytes", "note"]
# Number formats of the CSV cells (the rest are written as they are).
CSV_FORMATS = {"ms": ".4g", "tflops": ".4g", "gbps": ".4g", "bw_frac": ".3f", "flops_frac": ".3f",
               "ours_speedup": ".3f", "peak_extra_mb": ".1f", "flops": ".6g"}


def parse_args(argv=None, part="varlen"):
    """The command line of `python -m flash_attn_ext.bench <part>` (part: varlen or decode)."""
    doc = VARLEN_DOC if part == "varlen" else DECODE_DOC
    p = argparse.ArgumentParser(
        prog=f"python -m flash_attn_ext.bench {part}",
        description="\n".join([__doc__.split("\n\n")[0] + "\n", EXAMPLES[part], doc, COMMON_DOC]),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes: " + ("CPU 512 tokens (16..128) H=2 D=64; GPU 4096 tokens D=128"
                                          if part == "varlen" else
                                          "CPU B=2 H=4 H_kv=2 D=64 cache 256,1024; GPU cache 4k,16k"))
    if part == "varlen":
        p.add_argument("--tokens", type=int, default=None,
                       help="total tokens of the packed batch (default 16384; --quick: 4096 GPU, "
                            "512 CPU)")
        p.add_argument("--lengths", default=None, metavar="LO:HI",
                       help="range of the seeded sequence lengths (default 128:4096; --quick: "
                            "128:2048 GPU, 16:128 CPU), e.g. 128:8192 with --tokens 266240 for "
                            "~64 sequences of 128 to 8k tokens")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the varlen lengths and the inputs" if part == "varlen" else
                        "seed of the inputs")
    p.add_argument("--no-peaks", action="store_true",
                   help="skip the peak FLOP/s and copy-bandwidth measurement (no %%peak / %%BW)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every backend this many times, each round in a rotated order, and "
                        "keep the median (see flash_attn_ext.bench.rotated_rounds; default 1)")
    if part == "decode":
        p.add_argument("--graph", action="store_true",
                       help="time every backend's call replayed from a CUDA graph (captured "
                            "once per input set) instead of eager calls")
        p.add_argument("--page-order", choices=("shuffled", "sequential"), default="shuffled",
                       help="where the paged backends' pages lie in their pools: a seeded "
                            "random permutation (default; what a long-running server's pool looks "
                            "like) or in sequence order (the same look-ups over memory laid out as "
                            "the contiguous cache: what is left of the paged cost is the look-ups')")
    p.add_argument("--csv", default=None, help="write every row to this CSV file")
    p.add_argument("--json", default=None, help="write every row and the run's metadata here")
    args = p.parse_args(argv)
    if part == "varlen":  # the decode-only settings, at the values that leave them out
        args.graph, args.page_order = False, "shuffled"
        if args.lengths is not None:
            try:
                lo, hi = (int(x) for x in args.lengths.split(":"))
            except ValueError:
                p.error(f"--lengths takes LO:HI (two integers), got {args.lengths!r}")
            if not 1 <= lo <= hi:
                p.error(f"--lengths needs 1 <= LO <= HI, got {args.lengths!r}")
            args.lengths = (lo, hi)
        if args.tokens is not None and args.tokens < 1:
            p.error(f"--tokens must be positive, got {args.tokens}")
    return args


def _sdpa_pinned(name, **kw):
    from torch.nn.attention import sdpa_kernel
    be = _sdpa_backend_enum(name)

    def fn(q, k, v):
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(q, k, v, **kw)
    return fn


def _row(**kw):
    row = {f: None for f in CSV_FIELDS}
    row["note"] = ""
    row.update(kw)
    return row


# ----------------------------------------------------------------------------------------------
# 1. varlen
# ----------------------------------------------------------------------------------------------

def draw_lengths(total, lo, hi, seed):
    """Uniform lengths in [lo, hi] until `total` tokens; the last one is cut to reach `total`
    exactly, or dropped when fewer than `lo` tokens are left."""
    rng = random.Random(seed)
    lens = []
    while sum(lens) < total:
        n, left = rng.randint(lo, hi), total - sum(lens)
        if n > left:
            if left < lo:
                break
            n = left
        lens.append(n)
    return lens


def _torch_varlen():
    """torch.nn.attention.varlen.varlen_attn and whether it follows sdpa_kernel, or (None, _)."""
    try:
        from torch.nn.attention import varlen as vm
    except ImportError:
        return None, False
    f = getattr(vm, "varlen_attn", None)
    return f, f is not None and hasattr(vm, "_select_backend")


def _varlen_causal_kw(f, causal):
    params = inspect.signature(f).parameters
    if "window_size" in params:  # torch >= 2.11: causal is window (-1, 0)
        return {"window_size": (-1, 0) if causal else (-1, -1)}
    if "is_causal" in params:
        return {"is_causal": causal}
    if causal:
        raise Skip("varlen_attn: no causal option")
    return {}


def varlen_backends(device):
    f, pinnable = _torch_varlen()
    names = ["ours", "ours_padded", "sdpa_flash", "sdpa_cudnn"]
    names += ["varlen_flash", "varlen_cudnn"] if pinnable else ["varlen"]
    if device == "cuda" and missing_backend("fa4") is None:
        names.append("fa4_varlen")
    return names, f


def make_varlen_fn(name, causal, cu, max_len, device, torch_varlen):
    if name == "ours":
        if not hasattr(fa, "flash_attn_varlen_func"):
            raise Skip("no fa.flash_attn_varlen_func")
        return lambda q, k, v: fa.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len,
                                                         causal=causal)
    if name == "ours_padded":
        return lambda q, k, v: fa.flash_attn_func(q, k, v, causal=causal)
    if name.startswith("sdpa_"):
        if name == "sdpa_cudnn" and device != "cuda":
            raise Skip("skipped: CUDA only")
        return _sdpa_pinned(name[len("sdpa_"):], is_causal=causal)
    if name == "fa4_varlen":  # compiles each shape on its first call (the probe call)
        fa4_varlen = importlib.import_module("flash_attn.cute").flash_attn_varlen_func

        def fa4(q, k, v):
            out = fa4_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                             max_seqlen_k=max_len, causal=causal)
            return out[0] if isinstance(out, tuple) else out  # (out, lse) in FA4 4.0
        return fa4
    if name.startswith("varlen"):
        if torch_varlen is None:
            raise Skip(f"no varlen_attn in torch {torch.__version__}")
        if device != "cuda":
            raise Skip("skipped: CUDA only")
        kw = _varlen_causal_kw(torch_varlen, causal)
        if name == "varlen":
            return lambda q, k, v: torch_varlen(q, k, v, cu, cu, max_len, max_len, **kw)
        from torch.nn.attention import sdpa_kernel
        be = _sdpa_backend_enum(name[len("varlen_"):])

        def pinned(q, k, v):
            with sdpa_kernel(be):
                return torch_varlen(q, k, v, cu, cu, max_len, max_len, **kw)
        return pinned
    raise ValueError(name)


def varlen_inputs(lens, H, D, device, dtype, seed):
    """Packed (q, k, v) [total, H, D], their zero-padded copies [B, max_len, H, D] (ours_padded)
    and [B, H, max_len, D] (SDPA), each set its own leaf tensors, and cu_seqlens (int32)."""
    gen = torch.Generator().manual_seed(seed)
    B, L, total = len(lens), max(lens), sum(lens)
    starts = [0] + list(itertools.accumulate(lens))
    packed = [torch.randn(total, H, D, generator=gen).to(device, dtype) for _ in range(3)]
    bshd = []
    for x in packed:
        p = x.new_zeros(B, L, H, D)
        for i, n in enumerate(lens):
            p[i, :n] = x[starts[i]:starts[i] + n]
        bshd.append(p)
    bhsd = [p.transpose(1, 2).contiguous() for p in bshd]
    leaf = lambda ts: tuple(t.detach().requires_grad_() for t in ts)  # noqa: E731
    cu = torch.tensor(starts, dtype=torch.int32, device=device)
    return dict(packed=leaf(packed), bshd=leaf(bshd), bhsd=leaf(bhsd), cu=cu, max_len=L)


def run_varlen(run, sizes, progress):
    device, dtype, dt = run["device"], run["dtype"], run["dtype_name"]
    lens = draw_lengths(sizes["tokens"], sizes["lo"], sizes["hi"], run["seed"])
    H = sizes["H"]
    names, torch_varlen = varlen_backends(device)
    passes = ["fwd", "bwd"]
    rows = []
    for D in sizes["hdims"]:
        inp = varlen_inputs(lens, H, D, device, dtype, run["seed"])
        for causal in (False, True):
            base = 4.0 * H * D * sum(n * n for n in lens) / (2 if causal else 1)
            def time_one(name, first_round, inp=inp, causal=causal):
                packed = name in ("ours", "fa4_varlen") or name.startswith("varlen")
                layout = "packed" if packed else "bshd" if name == "ours_padded" else "bhsd"
                make = functools.partial(make_varlen_fn, name, causal, inp["cu"], inp["max_len"],
                                         device, torch_varlen)
                res = time_passes(make, [inp[layout]], passes, device)
                if first_round:
                    progress.step(f"varlen D={D} causal={int(causal)} {name}")
                return res
            results = rotated_rounds(names, time_one, run["rounds"])
            for p in passes:
                f = base * PASS_FLOP_FACTOR[p]
                ours_ms = results["ours"][p]["ms"]
                for name in names:
                    r = results[name][p]
                    ms = r["ms"]
                    tf = f / ms / 1e9 if ms else None
                    rows.append(_row(
                        section="varlen", dtype=dt, pass_=p, backend=name, B=len(lens), H=H,
                        H_kv=H, D=D, Sq=inp["max_len"], Sk=inp["max_len"], tokens=sum(lens),
                        causal=int(causal), ms=ms, tflops=tf,
                        flops_frac=tf * 1e12 / run["peak_flops"] if tf and run["peak_flops"] else None,
                        ours_speedup=ms / ours_ms if ms and ours_ms else None,
                        peak_extra_mb=r["mem_mb"], flops=f, note=r["note"]))
        del inp, time_one  # the inputs (time_one holds them too)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows, lens


# ----------------------------------------------------------------------------------------------
# 2. decode with GQA
# ----------------------------------------------------------------------------------------------

PAGE_SIZES = (16, 64, 256)


def decode_backends(device):
    sdpa = ["sdpa_flash", "sdpa_efficient", "sdpa_cudnn"] + (["sdpa_math"] if device != "cuda" else [])
    return ["ours", "ours_fp8", "ours_func"] + [f"ours_paged{p}" for p in PAGE_SIZES] + sdpa


def _paged(cache, page, order):
    """cache [B, S, H_kv, D] as a pool of pages [B * S / page, page, H_kv, D] stored in
    `order` (a permutation of the pages), and the block_table that finds them."""
    B, S = cache.shape[:2]
    pages = cache.reshape(B * (S // page), page, *cache.shape[2:])
    pool = torch.empty_like(pages)
    pool[order] = pages
    table = order.view(B, S // page).to(torch.int32)
    return pool, table


def make_decode_fn(name, seqlens, device, page_order="shuffled"):
    if name == "ours":
        if not hasattr(fa, "flash_attn_with_kvcache"):
            raise Skip("no fa.flash_attn_with_kvcache")
        return lambda q, k, v: fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens)
    if name == "ours_fp8":
        fp8 = {}  # the quantised caches of this size, made on the first (warm-up) call

        def run_fp8(q, k, v):
            if "caches" not in fp8:
                (k8, kd), (v8, vd) = fa.fp8.quantize_fp8(k), fa.fp8.quantize_fp8(v)
                fp8["caches"] = (k8, v8, kd, vd)
            k8, v8, kd, vd = fp8["caches"]
            q16 = q if q.dtype in (torch.float16, torch.bfloat16) else q.to(torch.bfloat16)
            return fa.flash_attn_with_kvcache(q16, k8, v8, cache_seqlens=seqlens, k_descale=kd,
                                              v_descale=vd)
        return run_fp8
    if name == "ours_func":
        return lambda q, k, v: fa.flash_attn_func(q, k, v)
    if name.startswith("ours_paged"):
        page = int(name[len("ours_paged"):])
        paged = {}  # the pools of the caches of this size, built on the first (warm-up) call

        def run(q, k, v):
            if k.shape[1] % page != 0:
                raise Skip(f"cache not a multiple of {page}")
            if "pools" not in paged:
                n_pages = k.shape[0] * (k.shape[1] // page)
                order = (torch.arange(n_pages) if page_order == "sequential" else
                         torch.randperm(n_pages, generator=torch.Generator().manual_seed(0)))
                order = order.to(k.device)
                (kp, table), (vp, _) = _paged(k, page, order), _paged(v, page, order)
                paged["pools"] = (kp, vp, table)
            kp, vp, table = paged["pools"]
            return fa.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table)
        return run
    if name.startswith("sdpa_"):
        be = name[len("sdpa_"):]
        if device != "cuda" and be in ("cudnn", "efficient"):
            raise Skip("skipped: CUDA only")
        return _sdpa_pinned(be, enable_gqa=True)
    raise ValueError(name)


def _graphed(fn):
    """fn(*inputs) captured in a CUDA graph on its first call with these inputs (after two
    warm-up calls on a side stream), replayed on every call: a decode step as serving stacks
    run it, without the host's per-call work."""
    graphs = {}

    def run(*inputs):
        key = tuple(id(t) for t in inputs)
        if key not in graphs:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn(*inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fn(*inputs)
            graphs[key] = (graph, out)
        graph, out = graphs[key]
        graph.replay()
        return out
    return run


def run_decode(run, sizes, progress):
    device, dtype, dt = run["device"], run["dtype"], run["dtype_name"]
    B, H, Hkv, D, Sq = sizes["B"], sizes["H"], sizes["H_kv"], sizes["D"], 1
    elt = torch.empty((), dtype=dtype).element_size()
    names = decode_backends(device)
    sdpa_names = [n for n in names if n.startswith("sdpa_")]
    rows = []
    for S in sizes["caches"]:
        gen = torch.Generator().manual_seed(run["seed"])
        q = torch.randn(B, Sq, H, D, generator=gen).to(device, dtype)
        kc, vc = (torch.randn(B, S, Hkv, D, generator=gen).to(device, dtype) for _ in range(2))
        seqlens = torch.full((B,), S, dtype=torch.int32, device=device)
        sets = {"bshd": [(q, kc, vc)],
                "bhsd": [tuple(t.transpose(1, 2).contiguous() for t in (q, kc, vc))]}
        nbytes = (2 * B * S * Hkv * D + 2 * B * Sq * H * D) * elt  # K, V, q, out
        q16_elt = elt if elt == 2 else 2  # ours_fp8's q / out: the run's dtype, or bf16
        nbytes_fp8 = 2 * B * S * Hkv * D + 2 * B * Sq * H * D * q16_elt  # 1-byte K, V
        f = 4.0 * B * H * Sq * S * D
        def time_one(name, first_round, sets=sets):
            make = functools.partial(make_decode_fn, name, seqlens, device,
                                     run.get("page_order", "shuffled"))
            if run.get("graph") and device == "cuda":
                make = lambda make=make: _graphed(make())  # noqa: E731
            layout = "bhsd" if name.startswith("sdpa_") else "bshd"
            res = time_passes(make, sets[layout], ["fwd"], device)
            if first_round:
                progress.step(f"decode S={S} {name}")
            return res
        results = {n: r["fwd"] for n, r in rotated_rounds(names, time_one, run["rounds"]).items()}
        timed = [n for n in sdpa_names if results[n]["ms"]]
        if timed:
            best = min(timed, key=lambda n: results[n]["ms"])
            results["best_sdpa"] = dict(results[best], note=best)
        else:
            results["best_sdpa"] = {"ms": None, "mem_mb": None, "note": "no SDPA backend ran"}
        ours_ms = results["ours"]["ms"]
        for name in names + ["best_sdpa"]:
            r = results[name]
            ms = r["ms"]
            row_bytes = nbytes_fp8 if name == "ours_fp8" else nbytes
            gbps = row_bytes / ms / 1e6 if ms else None
            rows.append(_row(
                section="decode", dtype=dt, pass_="fwd", backend=name, B=B, H=H, H_kv=Hkv, D=D,
                Sq=Sq, Sk=S, tokens=B * Sq, causal=0, ms=ms, tflops=f / ms / 1e9 if ms else None,
                gbps=gbps, bw_frac=gbps * 1e9 / run["peak_bw"] if gbps and run["peak_bw"] else None,
                ours_speedup=ms / ours_ms if ms and ours_ms else None, peak_extra_mb=r["mem_mb"],
                flops=f, bytes=row_bytes, note=r["note"]))
        del q, kc, vc, sets, time_one  # the inputs (time_one holds them too)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------

def _print(header, lines):
    print(" | ".join(header))
    for cells in lines:
        print(" | ".join(cells))


def _cell(r, key, spec):
    if r is None:
        return "-"
    if r[key] is not None:
        return format(r[key], spec)
    return (r["note"] or "-")[:24]


def print_varlen_table(rows):
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    others = [b for b in backends if b != "ours"]
    by = {}
    for r in rows:
        by.setdefault((r["pass_"], r["D"], r["causal"]), {})[r["backend"]] = r
    any_r = rows[0]
    print(f"\nvarlen: {any_r['B']} sequences, {any_r['tokens']} tokens, max_len {any_r['Sq']}, "
          f"H={any_r['H']}, {any_r['dtype']}")
    mem = any(r["peak_extra_mb"] is not None for r in rows if r["backend"] == "ours")
    frac = any(r["flops_frac"] is not None for r in rows)
    header = (["pass", "D", "causal", "ours ms"] + [f"{b} TF/s" for b in backends] +
              [f"ours/{b}" for b in others] + (["ours MB"] if mem else []) +
              (["ours %peak"] if frac else []))
    lines, ratios = [], {b: [] for b in others}
    for key in sorted(by, key=lambda k: (k[0] != "fwd", k[1], k[2])):
        res = by[key]
        ours = res.get("ours")
        cells = [key[0], str(key[1]), str(key[2]), _cell(ours, "ms", ".4g")]
        cells += [_cell(res.get(b), "tflops", ".4g") for b in backends]
        for b in others:
            sp = res.get(b, {}).get("ours_speedup")
            cells.append(_fmt(sp, ".2f") or "-")
            if sp:
                ratios[b].append(sp)
        if mem:
            cells.append(_fmt(ours and ours["peak_extra_mb"], ".1f") or "-")
        if frac:
            cells.append(_fmt(ours and ours["flops_frac"] and 100 * ours["flops_frac"], ".0f") or "-")
        lines.append(cells)
    _print(header, lines)
    for b, rs in ratios.items():
        if rs:
            print(f"varlen geomean ours/{b}: {_geomean(rs):.3f} (min {min(rs):.2f}, {len(rs)} configs)")


def print_decode_table(rows, graph=False):
    backends = [b for b in dict.fromkeys(r["backend"] for r in rows) if b != "best_sdpa"]
    by = {}
    for r in rows:
        by.setdefault(r["Sk"], {})[r["backend"]] = r
    any_r = rows[0]
    print(f"\ndecode: B={any_r['B']} H={any_r['H']} H_kv={any_r['H_kv']} D={any_r['D']} "
          f"Sq={any_r['Sq']}, full cache, {any_r['dtype']}"
          f"{', replayed from CUDA graphs' if graph else ''}")
    frac = any(r["bw_frac"] is not None for r in rows)
    header = (["cache", "ours ms"] + [f"{b} GB/s" for b in backends] +
              (["ours %BW", "best %BW"] if frac else []) +
              ["best sdpa", "ours/best", "ours/ours_func", "fp8 ms", "fp8 speedup"] +
              [f"paged{p}/ours" for p in PAGE_SIZES])
    lines, ratios = [], []
    for S in sorted(by):
        res = by[S]
        ours, best = res.get("ours"), res.get("best_sdpa")
        cells = [str(S), _cell(ours, "ms", ".4g")] + [_cell(res.get(b), "gbps", ".4g") for b in backends]
        if frac:
            cells += [_fmt(r and r["bw_frac"] and 100 * r["bw_frac"], ".3g") or "-" for r in (ours, best)]
        sp = best and best["ours_speedup"]
        if sp:
            ratios.append(sp)
        cells += [(best["note"] if best and best["ms"] else "-"), _fmt(sp, ".2f") or "-",
                  _fmt(res.get("ours_func", {}).get("ours_speedup"), ".2f") or "-"]
        fp8 = res.get("ours_fp8")
        fp8_sp = fp8 and fp8["ours_speedup"]  # time(fp8) / time(ours)
        cells += [_cell(fp8, "ms", ".4g"), _fmt(fp8_sp and 1.0 / fp8_sp, ".2f") or "-"]
        cells += [_fmt(res.get(f"ours_paged{p}", {}).get("ours_speedup"), ".3f") or "-"
                  for p in PAGE_SIZES]
        lines.append(cells)
    _print(header, lines)
    if ratios:
        print(f"decode geomean ours/best_sdpa: {_geomean(ratios):.3f} (min {min(ratios):.2f}, "
              f"{len(ratios)} configs)")


def main(argv=None, part="varlen"):
    """Runs one part (varlen or decode), writes the requested outputs, prints the settings and
    the table last; returns the rows."""
    args = parse_args(argv, part)
    device = args.device
    if device == "cuda":
        require_cuda(f"{part} --device cuda")
    dtype_name = args.dtype or ("bf16" if device == "cuda" else "fp32")
    sizes = SIZES["full" if not args.quick else "quick_cuda" if device == "cuda" else "quick_cpu"]
    if part == "varlen" and (args.tokens is not None or args.lengths is not None):
        varlen = dict(sizes["varlen"])
        if args.tokens is not None:
            varlen["tokens"] = args.tokens
        if args.lengths is not None:
            varlen["lo"], varlen["hi"] = args.lengths
        sizes = dict(sizes, varlen=varlen)
    parts = [part]
    run = dict(device=device, dtype=DTYPES[dtype_name], dtype_name=dtype_name, seed=args.seed,
               rounds=args.rounds, graph=args.graph, page_order=args.page_order,
               peak_flops=None, peak_bw=None)
    meta = dict(torch=torch.__version__, flash_attn_ext=getattr(fa, "__version__", "?"),
                device=device, device_name=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                cpu_threads=torch.get_num_threads(), dtype=dtype_name, timer=timer_name(device),
                quick=args.quick, seed=args.seed, graph=args.graph, page_order=args.page_order,
                parts=parts,
                sizes={k: sizes[k] for k in parts},
                notes=[PADDING_NOTE, DECODE_NOTE, RATIO_NOTE])
    if not args.no_peaks:
        run["peak_flops"], run["peak_bw"], meta["peaks"] = measure_peaks(device, run["dtype"])
        meta["peak_tflops"], meta["peak_gbps"] = run["peak_flops"] / 1e12, run["peak_bw"] / 1e9

    n_steps = 0
    if "varlen" in parts and device == "cuda" and missing_backend("fa4"):
        print(missing_backend("fa4"), file=sys.stderr)
    if "varlen" in parts:
        n_steps += len(sizes["varlen"]["hdims"]) * 2 * len(varlen_backends(device)[0])
    if "decode" in parts:
        n_steps += len(sizes["decode"]["caches"]) * len(decode_backends(device))
    progress = Progress(n_steps)
    varlen_rows, decode_rows = [], []
    if "varlen" in parts:
        varlen_rows, lens = run_varlen(run, sizes["varlen"], progress)
        meta["varlen_lengths"] = lens
    if "decode" in parts:
        decode_rows = run_decode(run, sizes["decode"], progress)
    progress.close()
    rows = varlen_rows + decode_rows

    written = []
    if args.csv:
        write_rows_csv(rows, args.csv, CSV_FIELDS, CSV_FORMATS)
        written.append(args.csv)
    if args.json:
        write_json(rows, meta, args.json)
        written.append(args.json)
    if written:
        print("wrote " + ", ".join(written), file=sys.stderr)

    # Settings and conventions first: the tables are the last thing on stdout.
    print(f"torch {meta['torch']}, flash_attn_ext {meta['flash_attn_ext']}, device "
          f"{meta['device_name']} ({meta['cpu_threads']} CPU threads), dtype {dtype_name}, "
          f"timer: {meta['timer']}")
    if meta.get("peaks"):
        print(meta["peaks"])
    if varlen_rows:
        print(f"varlen lengths (seed {args.seed}): {meta['varlen_lengths']}")
        print(PADDING_NOTE)
        print("fwd: inference forward; bwd: the backward alone (autograd.grad, retain_graph); "
              "ours %peak = ours TF/s / measured matmul peak; MB = peak extra CUDA memory of "
              "one forward (+ backward)")
    if decode_rows:
        print(DECODE_NOTE)
    print(RATIO_NOTE)
    if varlen_rows:
        print_varlen_table(varlen_rows)
    if decode_rows:
        print_decode_table(decode_rows, graph=run['graph'])
    return rows


def main_varlen(argv=None):
    """`python -m flash_attn_ext.bench varlen`."""
    return main(argv, "varlen")


def main_decode(argv=None):
    """`python -m flash_attn_ext.bench decode`."""
    return main(argv, "decode")
