"""Times flash_attn_ext against naive attention, torch's SDPA backends and flex_attention, in
one process, and prints a table last.

  python -m flash_attn_ext.bench                       # GPU: FlashAttention paper grid, bf16
  python -m flash_attn_ext.bench --device cpu --quick  # CPU demo: B=1 H=8 S=1024 D=64 fp32
  python -m flash_attn_ext.bench --hdims 128 --seqlens 4096 --causal 1 --pass fwd
  python -m flash_attn_ext.bench --csv out.csv --json out.json --plot plots/

Backends: ours, naive (matmul-softmax-matmul in the input dtype), sdpa (torch's own choice),
math, flash, efficient, cudnn (torch SDPA pinned to one backend with sdpa_kernel) and flex
(torch.compile(flex_attention), CUDA only). A backend that refuses an input, or would not fit
in memory, gets a note instead of a time.

FLOPs (FlashAttention convention): forward 4*B*H*Sq*Sk*D, halved when causal (and Sq == Sk);
backward 2.5x the forward; fwd_bwd 3.5x. Times are medians after warm-up: on CUDA
triton.testing.do_bench (CUDA events, L2 flushed before each call; own CUDA-event timer when
triton is missing), cycling through --rotate input sets so that no call finds its inputs in
L2; on CPU time.perf_counter (5 to 100 calls). GPU default grid: 16k tokens (B = 16384/S),
hidden 2048 (H = 2048/D). Peak extra memory (CUDA): torch.cuda.max_memory_allocated during one call
minus what was allocated before it (the inputs); for fwd one inference forward, for bwd and
fwd_bwd one forward + backward (a training step's attention footprint).

Roofline: arithmetic intensity = FLOPs / minimum bytes moved (read q, k, v, write o; the
backward also reads o, do and writes dq, dk, dv); a config is compute-bound when that is
above peak FLOP/s / peak bytes/s, both measured at start-up (a large matmul in the bench
dtype, fp32 on CPU, and a large tensor copy).
"""
import argparse
import contextlib
import csv
import importlib
import itertools
import json
import math
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

import flash_attn_ext as fa

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ALL_BACKENDS = ("ours", "ours-mma", "naive", "sdpa", "math", "flash", "efficient", "cudnn", "flex")
SDPA_BACKENDS = ("math", "flash", "efficient", "cudnn")
# Backends that materialise the [Sq, Sk] score matrix: checked against free memory first.
QUADRATIC_BACKENDS = ("naive", "math")
DEFAULT_BACKENDS = {"cuda": "ours,naive,flash,cudnn,efficient,math,flex",
                    "cpu": "ours,naive,math,sdpa"}
PASS_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
FLOPS_NOTE = ("FLOPs: fwd 4*B*H*Sq*Sk*D (halved when causal and Sq == Sk), bwd 2.5x fwd, "
              "fwd_bwd 3.5x fwd; TF/s = FLOPs / median time; ours/X = time(X) / time(ours) "
              "(> 1: ours is faster)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m flash_attn_ext.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default bf16 on GPU, fp32 on CPU)")
    p.add_argument("--hdims", default=None, help="comma list (default 64,128,256 on GPU, 64 on CPU)")
    p.add_argument("--seqlens", default=None, help="comma list (default 512..16384 on GPU, 2048 on CPU)")
    p.add_argument("--causal", default="0,1", help="comma list of 0/1")
    p.add_argument("--pass", dest="passes", default="fwd,bwd", help="fwd, bwd, fwd_bwd (comma list)")
    p.add_argument("--layout", default="bhsd",
                   help="memory layout of q/k/v: bhsd ([B,H,S,D], torch SDPA) or bshd ([B,S,H,D], "
                        "flash-attn; SDPA backends get transposed views); comma list allowed")
    p.add_argument("--seqlen-q", type=int, default=None,
                   help="fixed query length (e.g. 1 for decoding); keys use --seqlens")
    p.add_argument("--batch", type=int, default=None, help="default 16384/S on GPU, 1 on CPU")
    p.add_argument("--heads", type=int, default=None, help="default 2048/D on GPU, 8 on CPU")
    p.add_argument("--backends", default=None,
                   help="comma list of " + ",".join(ALL_BACKENDS) + " (default: "
                        f"{DEFAULT_BACKENDS['cuda']} on GPU, {DEFAULT_BACKENDS['cpu']} on CPU)")
    p.add_argument("--deterministic", action="store_true", help="our backward in deterministic mode")
    p.add_argument("--rotate", type=int, default=None,
                   help="input sets cycled through while timing (default 3 on GPU, 1 on CPU)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every backend this many times per config, each round in a rotated "
                        "order, and report the median: on a GPU whose clock follows its recent "
                        "load, whichever runs first measured up to 5%% apart from the same kernel "
                        "run later (default 1)")
    p.add_argument("--no-roofline", action="store_true",
                   help="skip the peak FLOP/s and bandwidth measurement")
    p.add_argument("--csv", default=None, help="write every row to this CSV file")
    p.add_argument("--json", default=None, help="write every row, and the run's metadata, to this JSON file")
    p.add_argument("--plot", default=None, metavar="DIR",
                   help="write PNG charts (TF/s and peak memory vs seqlen) into DIR (needs matplotlib)")
    p.add_argument("--quick", action="store_true",
                   help="one small config (D=64, S=1024 on CPU; D=128, S=4096 on GPU, without "
                        "flex and math): a demo")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="run nothing: read the --json files of earlier runs (e.g. one per head dim, "
                        "to keep each run short) and print / write their table, CSV and plots together")
    return p.parse_args(argv)


def _int_list(s):
    return [int(x) for x in s.split(",") if x.strip()]


# ----------------------------------------------------------------------------------------------
# Work and traffic of one config
# ----------------------------------------------------------------------------------------------

def flops(cfg, pass_):
    f = 4.0 * cfg["B"] * cfg["H"] * cfg["Sq"] * cfg["Sk"] * cfg["D"]
    if cfg["causal"] and cfg["Sq"] == cfg["Sk"]:
        f /= 2
    return f * PASS_FLOP_FACTOR[pass_]


def min_bytes(cfg, pass_, elt):
    """Bytes that any implementation has to move through DRAM at least once."""
    q_like = cfg["B"] * cfg["H"] * cfg["Sq"] * cfg["D"] * elt  # q, o, do, dq
    k_like = cfg["B"] * cfg["H"] * cfg["Sk"] * cfg["D"] * elt  # k, v, dk, dv
    fwd = 2 * q_like + 2 * k_like                # read q, k, v; write o
    bwd = 4 * q_like + 4 * k_like                # read q, k, v, o, do; write dq, dk, dv
    return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}[pass_]


# ----------------------------------------------------------------------------------------------
# Backends: each is fn(q, k, v) -> out on [B, H, S, D]-shaped tensors (views when layout=bshd)
# ----------------------------------------------------------------------------------------------

def _sdpa_backend_enum(name):
    from torch.nn.attention import SDPBackend
    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]


def _causal_mask(Sq, Sk, device):
    # Top-left aligned (torch SDPA's is_causal): key j is hidden from query i when j > i.
    return torch.ones(Sq, Sk, dtype=torch.bool, device=device).triu(1)


def make_fn(backend, cfg, device, deterministic=False):
    causal, Sq, Sk = cfg["causal"], cfg["Sq"], cfg["Sk"]
    scale = 1.0 / math.sqrt(cfg["D"])
    if backend == "ours-mma":
        # ours with both passes pinned to the mma.sync kernels (on sm_90 the default is the
        # Hopper wgmma kernels); run_config times it inside _pinned_to_mma().
        return make_fn("ours", cfg, device, deterministic)
    if backend == "ours":
        if not deterministic:
            return lambda q, k, v: fa.scaled_dot_product_attention(q, k, v, is_causal=causal)

        # The SDPA wrapper has no deterministic flag; flash_attn_func has, but aligns causal
        # masks bottom-right. For Sq <= Sk, top-left causal attention (the other backends')
        # never sees keys past Sq, and on the first Sq keys both alignments coincide.
        if causal and Sq > Sk:
            raise NotImplementedError("--deterministic with causal and seqlen_q > seqlen_k")
        n_keys = Sq if causal else Sk

        def ours_det(q, k, v):
            out = fa.flash_attn_func(q.transpose(1, 2), k[:, :, :n_keys].transpose(1, 2),
                                     v[:, :, :n_keys].transpose(1, 2), causal=causal,
                                     deterministic=True)
            return out.transpose(1, 2)
        return ours_det
    if backend == "naive":
        # What attention looks like written out in PyTorch, in the input dtype (softmax
        # accumulates in fp32 internally). flash_attn_ext.attention_ref is the test
        # reference instead: it upcasts and guards empty rows, which is not the baseline
        # people would write.
        mask = _causal_mask(Sq, Sk, device) if causal else None

        def naive(q, k, v):
            s = torch.matmul(q, k.transpose(-2, -1)) * scale
            if mask is not None:
                s = s.masked_fill(mask, float("-inf"))
            return torch.matmul(torch.softmax(s, dim=-1), v)
        return naive
    if backend == "sdpa":  # torch's own choice (on CPU: its flash-attention CPU kernel)
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if backend in SDPA_BACKENDS:
        from torch.nn.attention import sdpa_kernel
        be = _sdpa_backend_enum(backend)

        def pinned(q, k, v):
            with sdpa_kernel(be):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return pinned
    if backend == "flex":
        if device != "cuda":
            raise RuntimeError("flex_attention is benchmarked on CUDA only")
        fx = importlib.import_module("torch.nn.attention.flex_attention")
        # A fresh compile per config: every shape is a recompile, and past dynamo's recompile
        # limit flex_attention would silently run unfused (eager), timing the wrong thing.
        torch._dynamo.reset()
        compiled = torch.compile(fx.flex_attention, dynamic=False)
        block_mask = None
        if causal:  # top-left, as SDPA's is_causal
            block_mask = fx.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, Sq, Sk,
                                              device=device)
        return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)
    raise ValueError(f"unknown backend {backend!r}")


# ----------------------------------------------------------------------------------------------
# Timing and memory
# ----------------------------------------------------------------------------------------------

def _cuda_event_time_ms(fn, warmup_ms=50, rep_ms=200):
    """Median of CUDA-event timed calls, L2 flushed before each (used when triton is missing)."""
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    est_ms = max((time.perf_counter() - t0) * 1e3 / 3, 1e-3)
    for _ in range(max(1, int(warmup_ms / est_ms))):
        fn()
    n = max(5, int(rep_ms / est_ms))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def timer_name(device):
    if device != "cuda":
        return "time.perf_counter, median of 5-100 calls after 1 warm-up"
    try:
        importlib.import_module("triton.testing")
        return "triton.testing.do_bench (median, L2 flushed per call)"
    except ImportError:
        return "CUDA events (median, L2 flushed per call)"


def time_ms(fn, device):
    if device == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            return _cuda_event_time_ms(fn)
        return do_bench(fn, warmup=50, rep=200, return_mode="median")
    t0 = time.perf_counter()
    fn()  # warm-up
    # At least 5 calls; short calls repeat up to ~50 ms in all, so that a few preempted calls
    # (a busy 2-core machine) do not move the median.
    n = max(5, min(100, int(0.05 / max(time.perf_counter() - t0, 1e-6))))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def peak_extra_mb(fn, device):
    """Peak memory one call allocates beyond what is live before it (the inputs), in MB."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def _free_bytes(device):
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        # Blocks cached by the allocator are free for torch too.
        return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def quadratic_bytes(backend, cfg, pass_, elt):
    """Rough upper bound of what naive / math attention allocate: a few score-sized matrices
    in the forward (scores, masked scores, probabilities), about twice as many when the
    backward runs. The math backend may upcast half inputs, so count 4 bytes for it."""
    n = cfg["B"] * cfg["H"] * cfg["Sq"] * cfg["Sk"] * (4 if backend == "math" else elt)
    return n * (3 if pass_ == "fwd" else 6)


def _short_error(e):
    if isinstance(e, torch.OutOfMemoryError):
        return "OOM"
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:60]}"


@contextlib.contextmanager
def env_set(values):
    """os.environ updated with `values` (name -> str) while active, then restored. Our env
    switches are read on every call, so this also covers a backward that autograd runs after
    the forward returned."""
    previous = {n: os.environ.get(n) for n in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for n, value in previous.items():
            if value is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = value


def _pinned_to_mma(active=True):
    """FLASH_ATTN_EXT_FWD_IMPL / _BWD_IMPL = mma while active."""
    names = ("FLASH_ATTN_EXT_FWD_IMPL", "FLASH_ATTN_EXT_BWD_IMPL")
    return env_set({n: "mma" for n in names} if active else {})


def _time_pass(fn, p, sets, douts, device):
    """(median ms, peak extra MB) of one pass. Its tensors die with this frame."""
    turn = itertools.cycle(range(len(sets)))
    if p == "fwd":
        def step():
            with torch.no_grad():
                fn(*sets[next(turn)])
        return time_ms(step, device), peak_extra_mb(step, device)
    if p == "bwd":
        outs = [fn(*s) for s in sets]  # the graphs the timed backward calls walk again

        def step():
            i = next(turn)
            torch.autograd.grad(outs[i], sets[i], douts[i], retain_graph=True)
    else:
        def step():
            i = next(turn)
            torch.autograd.grad(fn(*sets[i]), sets[i], douts[i])
    ms = time_ms(step, device)
    if p == "bwd":
        del outs, step
    # The training-step footprint, from the inputs alone: forward + backward.
    mem = peak_extra_mb(lambda: torch.autograd.grad(fn(*sets[0]), sets[0], douts[0]), device)
    return ms, mem


def bench_backend(backend, sets, cfg, passes, device, deterministic):
    """Times one backend on one config. Returns {pass: {"ms", "mem_mb", "note"}}."""
    res = {p: {"ms": None, "mem_mb": None, "note": ""} for p in passes}
    elt = sets[0][0].element_size()
    budget = 0.8 * _free_bytes(device)
    todo = {p: sets for p in passes}  # the input sets each pass cycles through
    if backend in QUADRATIC_BACKENDS:  # decided before any call, which could take the machine's memory
        for p in passes:
            need = quadratic_bytes(backend, cfg, p, elt)
            if need > budget:
                res[p]["note"] = (f"skipped: needs ~{need / 2**30:.1f} GiB" if need >= 2**30 else
                                  f"skipped: needs ~{need / 2**20:.0f} MiB")
                del todo[p]
            elif p == "bwd" and need * len(sets) > budget:
                # Each retained autograd graph holds score matrices: rotate only while they fit.
                todo[p] = sets[:1]
    fn = None
    if todo:
        try:
            fn = make_fn(backend, cfg, device, deterministic)
            with warnings.catch_warnings(), torch.no_grad(), _pinned_to_mma(backend == "ours-mma"):
                warnings.simplefilter("ignore")  # SDPA explains at length why a kernel was not used
                probe = fn(*sets[0])  # does the backend take this input? (also compiles flex)
            douts = [torch.randn_like(probe) for _ in sets]
            del probe
        except Exception as e:  # the backend refuses this input
            note = _short_error(e)
            for p in todo:
                res[p]["note"] = note
            fn = None
    for p, use in (todo.items() if fn is not None else ()):
        try:
            with _pinned_to_mma(backend == "ours-mma"):
                res[p]["ms"], res[p]["mem_mb"] = _time_pass(fn, p, use, douts, device)
        except Exception as e:
            res[p]["note"] = _short_error(e)
        # Outside the except block: its traceback no longer holds the failed pass's tensors.
        if device == "cuda" and res[p]["ms"] is None:
            torch.cuda.empty_cache()
    if device == "cuda" and fn is None:
        torch.cuda.empty_cache()
    return res


def make_inputs(cfg, layout, n_sets, device, dtype, seed=0):
    """n_sets independent (q, k, v), each [B, H, S, D]-shaped; for layout bshd these are
    transposed views of [B, S, H, D] storage, as a model using flash-attn's layout has them."""
    gen = torch.Generator().manual_seed(seed)
    B, H, D = cfg["B"], cfg["H"], cfg["D"]
    sets = []
    for _ in range(n_sets):
        t = []
        for n in (cfg["Sq"], cfg["Sk"], cfg["Sk"]):
            shape = (B, H, n, D) if layout == "bhsd" else (B, n, H, D)
            x = torch.randn(shape, generator=gen).to(device, dtype)
            if layout == "bshd":
                x = x.transpose(1, 2)
            t.append(x.requires_grad_())
        sets.append(tuple(t))
    return sets


# ----------------------------------------------------------------------------------------------
# Machine peaks for the roofline
# ----------------------------------------------------------------------------------------------

def _matmul_ms(n, dtype, device):
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # our fp32 kernels do not use tf32 either
    try:
        return time_ms(lambda: torch.matmul(a, b), device)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32


def _copy_ms(nbytes, device):
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return time_ms(lambda: dst.copy_(src), device)


def measure_peaks(device, dtype):
    """(peak FLOP/s, peak bytes/s, description), measured on this device now."""
    if device == "cuda":
        mm_dtype, n, copy_bytes = dtype, 8192, 2 * 2**30
    else:
        mm_dtype, n, copy_bytes = torch.float32, 1536, 256 * 2**20
    mm_ms = _matmul_ms(n, mm_dtype, device)
    copy_ms = _copy_ms(copy_bytes, device)
    peak_flops = 2.0 * n ** 3 / (mm_ms * 1e-3)
    peak_bw = 2.0 * copy_bytes / (copy_ms * 1e-3)  # a copy reads and writes every byte
    desc = (f"measured peaks: {peak_flops / 1e12:.3g} TFLOP/s ({str(mm_dtype).replace('torch.', '')} "
            f"{n}^3 matmul), {peak_bw / 1e9:.4g} GB/s ({copy_bytes >> 20} MiB copy); "
            f"ridge {peak_flops / peak_bw:.1f} FLOP/byte")
    return peak_flops, peak_bw, desc


# ----------------------------------------------------------------------------------------------
# Progress
# ----------------------------------------------------------------------------------------------

class Progress:
    """tqdm on stderr when it is installed, else a plain '[i/n] what' line per step."""

    def __init__(self, total):
        self.total, self.i = total, 0
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, file=sys.stderr, mininterval=0.5, dynamic_ncols=True)
        except ImportError:
            self.bar = None

    def step(self, what):
        self.i += 1
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(1)
        else:
            print(f"[{self.i}/{self.total}] {what}", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------

def resolve(args):
    """Fills the device-dependent defaults in; returns the run's settings."""
    device = args.device
    gpu = device == "cuda"
    if args.quick:
        args.hdims = args.hdims or ("128" if gpu else "64")
        args.seqlens = args.seqlens or ("4096" if gpu else "1024")
    dtype = DTYPES[args.dtype or ("bf16" if gpu else "fp32")]
    default_backends = DEFAULT_BACKENDS["cuda" if gpu else "cpu"]
    if args.quick and gpu:  # a demo: no flex compilation, no math backend
        default_backends = "ours,naive,flash,cudnn,efficient"
    backends = (args.backends or default_backends).split(",")
    unknown = [b for b in backends if b not in ALL_BACKENDS]
    if unknown:
        raise SystemExit(f"unknown backend(s) {unknown}; choose from {','.join(ALL_BACKENDS)}")
    passes = args.passes.split(",")
    bad = [p for p in passes if p not in PASS_FLOP_FACTOR]
    if bad:
        raise SystemExit(f"unknown pass(es) {bad}; choose from fwd,bwd,fwd_bwd")
    layouts = args.layout.split(",")
    if any(lay not in ("bhsd", "bshd") for lay in layouts):
        raise SystemExit(f"--layout takes bhsd and/or bshd, got {args.layout}")
    return dict(
        device=device, dtype=dtype, backends=backends, passes=passes, layouts=layouts,
        hdims=_int_list(args.hdims or ("64,128,256" if gpu else "64")),
        seqlens=_int_list(args.seqlens or ("512,1024,2048,4096,8192,16384" if gpu else "2048")),
        causals=[bool(int(x)) for x in args.causal.split(",")],
        rotate=args.rotate or (3 if gpu else 1))


def configs(run, args):
    gpu = run["device"] == "cuda"
    for layout in run["layouts"]:
        for D in run["hdims"]:
            for S in run["seqlens"]:
                for causal in run["causals"]:
                    yield dict(layout=layout, D=D, Sk=S, causal=causal, Sq=args.seqlen_q or S,
                               B=args.batch or (max(1, 16384 // S) if gpu else 1),
                               H=args.heads or (max(1, 2048 // D) if gpu else 8))


def rotated_rounds(names, time_one, rounds):
    """Times every name `rounds` times, round r in the order rotated by r (A B C, B C A, ...),
    and keeps the median ms per pass. A GPU's clock follows its recent load: the same kernel
    measured up to 5% apart first in a row of backends and later in it, so with as many rounds
    as names each one runs once in every position. time_one(name, first_round) returns
    {pass: {"ms", ...}}; the other fields are kept from the first round."""
    results, all_ms = {}, {}
    for rnd in range(max(1, rounds)):
        shift = rnd % len(names)
        for name in names[shift:] + names[:shift]:
            for p, r in time_one(name, rnd == 0).items():
                results.setdefault(name, {}).setdefault(p, r)
                all_ms.setdefault((name, p), []).append(r["ms"])
    for (name, p), times in all_ms.items():
        times = [t for t in times if t is not None]
        results[name][p]["ms"] = statistics.median(times) if times else None
    return results


def run_bench(args):
    """Runs every config; returns (rows, meta). Rows carry numbers (None when absent)."""
    run = resolve(args)
    device, dtype = run["device"], run["dtype"]
    elt = torch.empty((), dtype=dtype).element_size()
    meta = dict(torch=torch.__version__, flash_attn_ext=fa.__version__, device=device,
                device_name=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                cpu_threads=torch.get_num_threads(), dtype=str(dtype).replace("torch.", ""),
                backends=run["backends"], passes=run["passes"], rotate=run["rotate"],
                rounds=max(1, args.rounds),
                deterministic=args.deterministic, timer=timer_name(device), flops_convention=FLOPS_NOTE)
    peak_flops = peak_bw = None
    if not args.no_roofline:
        peak_flops, peak_bw, meta["peaks"] = measure_peaks(device, dtype)
        meta["peak_tflops"], meta["peak_gbps"] = peak_flops / 1e12, peak_bw / 1e9

    cfgs = list(configs(run, args))
    progress = Progress(len(cfgs) * len(run["backends"]))
    rows = []
    for cfg in cfgs:
        sets = make_inputs(cfg, cfg["layout"], run["rotate"], device, dtype)
        def time_one(be, first_round):
            res = bench_backend(be, sets, cfg, run["passes"], device,
                                args.deterministic and be == "ours")
            if first_round:
                progress.step(f"D={cfg['D']} Sk={cfg['Sk']} causal={int(cfg['causal'])} {be}")
            return res
        results = rotated_rounds(run["backends"], time_one, meta["rounds"])
        for p in run["passes"]:
            f, nbytes = flops(cfg, p), min_bytes(cfg, p, elt)
            intensity = f / nbytes
            bound = roof = None
            if peak_flops:
                bound = "compute" if intensity > peak_flops / peak_bw else "memory"
                roof = min(peak_flops, intensity * peak_bw)  # attainable FLOP/s for this config
            ours_ms = results.get("ours", {}).get(p, {}).get("ms")
            for be in run["backends"]:
                r = results[be][p]
                ms = r["ms"]
                rows.append(dict(
                    dtype=meta["dtype"], layout=cfg["layout"], hdim=cfg["D"], B=cfg["B"], H=cfg["H"],
                    Sq=cfg["Sq"], S=cfg["Sk"], causal=int(cfg["causal"]), pass_=p, backend=be,
                    ms=ms, tflops=f / ms / 1e9 if ms else None,
                    ours_speedup=ms / ours_ms if ms and ours_ms else None,
                    peak_extra_mb=r["mem_mb"], note=r["note"], flops=f, min_bytes=nbytes,
                    intensity=intensity, bound=bound,
                    roof_pct=100 * f / (ms * 1e-3) / roof if ms and roof else None))
        del sets
        if device == "cuda":
            torch.cuda.empty_cache()
    progress.close()
    return rows, meta


# ----------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------

# The first fourteen columns are the CSV of the original bench script, in its order and
# number format; scripts read them by name.
CSV_FIELDS = ["dtype", "hdim", "B", "H", "Sq", "S", "causal", "pass_", "backend", "ms", "tflops",
              "ours_speedup", "peak_extra_mb", "note", "layout", "flops", "min_bytes", "intensity",
              "bound", "roof_pct"]


def _fmt(v, spec):
    return "" if v is None else format(v, spec)


def csv_row(r):
    return dict(dtype=r["dtype"], hdim=r["hdim"], B=r["B"], H=r["H"], Sq=r["Sq"], S=r["S"],
                causal=r["causal"], pass_=r["pass_"], backend=r["backend"], ms=_fmt(r["ms"], ".4g"),
                tflops=_fmt(r["tflops"], ".4g"), ours_speedup=_fmt(r["ours_speedup"], ".2f"),
                peak_extra_mb=_fmt(r["peak_extra_mb"], ".1f"), note=r["note"], layout=r["layout"],
                flops=_fmt(r["flops"], ".6g"), min_bytes=r["min_bytes"],
                intensity=_fmt(r["intensity"], ".4g"), bound=r["bound"] or "",
                roof_pct=_fmt(r["roof_pct"], ".1f"))


def write_csv(rows, path):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(csv_row(r) for r in rows)


def write_json(rows, meta, path):
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def write_plots(rows, out_dir):
    """TF/s vs seqlen and peak extra memory vs seqlen: one PNG per (quantity, pass, layout),
    one panel per (causal, head dim), one line per backend. Returns the files written."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display on benchmark machines
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed (pip install matplotlib); no charts written",
              file=sys.stderr)
        return []
    os.makedirs(out_dir, exist_ok=True)
    written = []
    if not any(r["peak_extra_mb"] is not None for r in rows):
        print("--plot: no memory numbers (measured on CUDA only): no memory_*.png", file=sys.stderr)
    layouts = sorted({r["layout"] for r in rows})
    for p in dict.fromkeys(r["pass_"] for r in rows):
        for layout in layouts:
            sub = [r for r in rows if r["pass_"] == p and r["layout"] == layout]
            suffix = f"_{layout}" if len(layouts) > 1 else ""
            for key, ylabel, name in (("tflops", "TFLOP/s", "tflops"),
                                      ("peak_extra_mb", "peak extra memory (MB)", "memory")):
                if not any(r[key] for r in sub):
                    continue
                panels = sorted({(r["causal"], r["hdim"]) for r in sub})
                ncols = len({d for _, d in panels})
                nrows = len({c for c, _ in panels})
                fig, axes = plt.subplots(nrows, ncols, figsize=(4.5 * ncols, 3.6 * nrows),
                                         squeeze=False)
                hd = sorted({d for _, d in panels})
                cs = sorted({c for c, _ in panels})
                for (c, d) in panels:
                    ax = axes[cs.index(c)][hd.index(d)]
                    for be in dict.fromkeys(r["backend"] for r in sub):
                        pts = sorted((r["S"], r[key]) for r in sub
                                     if r["backend"] == be and r["causal"] == c and r["hdim"] == d
                                     and r[key])
                        if pts:
                            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=be)
                    ax.set_xscale("log", base=2)
                    ticks = sorted({r["S"] for r in sub})
                    ax.set_xticks(ticks, [f"{t // 1024}k" if t >= 1024 and t % 1024 == 0 else str(t)
                                          for t in ticks])
                    ax.minorticks_off()
                    if key == "peak_extra_mb":
                        ax.set_yscale("log")  # naive grows as S^2, ours as S: spans decades
                    else:
                        ax.set_ylim(bottom=0)
                    ax.set_title(f"{p}, D={d}, causal={c}")
                    ax.set_xlabel("seqlen (keys)")
                    ax.set_ylabel(ylabel)
                    ax.grid(True, alpha=0.3)
                    ax.legend(fontsize="small")
                dt = sub[0]["dtype"]
                fig.suptitle(f"{ylabel}, {dt}, layout {layout}")
                fig.tight_layout()
                path = os.path.join(out_dir, f"{name}_{p}{suffix}.png")
                fig.savefig(path, dpi=110)
                plt.close(fig)
                written.append(path)
    return written


def _geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def print_table(rows, meta):
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    others = [b for b in backends if b != "ours"]
    roofline = meta.get("peaks") is not None
    by = {}
    for r in rows:
        key = (r["pass_"], r["dtype"], r["layout"], r["hdim"], r["B"], r["H"], r["Sq"], r["S"], r["causal"])
        by.setdefault(key, {})[r["backend"]] = r
    pass_order = list(dict.fromkeys(r["pass_"] for r in rows))
    keys = sorted(by, key=lambda t: (pass_order.index(t[0]), t[2], t[3], t[8], t[7], t[6]))
    # Memory is measured on CUDA only: no columns of dashes on the CPU.
    mem_cols = [b for b in ("ours", "naive") if b in backends and
                any(r["peak_extra_mb"] is not None for r in rows if r["backend"] == b)]
    header = ["pass", "dtype", "layout", "D", "B", "H", "Sq", "Sk", "causal"] + \
        (["ours ms"] if "ours" in backends else []) + [f"{b} TF/s" for b in backends] + \
        [f"ours/{b}" for b in others if "ours" in backends] + [f"{b} MB" for b in mem_cols]
    if roofline:
        header += ["FLOP/B", "bound", "ours %roof"]
    print("\n" + " | ".join(header))
    ratios = {b: [] for b in others}
    per_pass = {}
    for key in keys:
        res = by[key]
        cells = [key[0], key[1], key[2]] + [str(x) for x in key[3:]]
        ours = res.get("ours")
        if "ours" in backends:
            cells.append(_fmt(ours["ms"], ".4g") if ours and ours["ms"] else "-")
        for b in backends:
            r = res.get(b)
            cells.append(_fmt(r["tflops"], ".4g") if r and r["tflops"] else
                         ((r["note"] if r else "")[:20] or "-"))
        if ours is not None:
            for b in others:
                r = res.get(b)
                if ours["ms"] and r and r["ms"]:
                    ratio = r["ms"] / ours["ms"]
                    ratios[b].append(ratio)
                    per_pass.setdefault((b, key[0]), []).append(ratio)
                    cells.append(f"{ratio:.2f}")
                else:
                    cells.append("-")
        for b in mem_cols:
            r = res.get(b)
            cells.append(_fmt(r["peak_extra_mb"], ".1f") if r and r["peak_extra_mb"] is not None else "-")
        if roofline:
            any_r = next(iter(res.values()))
            cells += [f"{any_r['intensity']:.4g}", any_r["bound"] or "-",
                      _fmt(ours["roof_pct"], ".0f") if ours and ours["roof_pct"] else "-"]
        print(" | ".join(cells))
    # The "geomean ours/<backend>:" lines are grep'ed by bench/tune_tiles.sh: keep their format.
    for b, rs in ratios.items():
        if rs:
            print(f"geomean ours/{b}: {_geomean(rs):.3f} (min {min(rs):.2f}, {len(rs)} configs)")
    passes = list(dict.fromkeys(k[0] for k in keys))
    if len(passes) > 1:
        for b in others:
            parts = [f"{p} {_geomean(per_pass[(b, p)]):.3f} (min {min(per_pass[(b, p)]):.2f}, "
                     f"max {max(per_pass[(b, p)]):.2f})" for p in passes if per_pass.get((b, p))]
            if parts:
                print(f"  per pass, ours/{b}: " + "; ".join(parts))


def load_runs(paths):
    """Rows and metadata of earlier --json outputs, concatenated (metadata of the first)."""
    rows, meta = [], None
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        rows += data["rows"]
        meta = meta or data["meta"]
    return rows, meta


def main(argv=None):
    args = parse_args(argv)
    rows, meta = load_runs(args.merge) if args.merge else run_bench(args)
    if not rows:
        raise SystemExit("no configurations to run")
    written = []
    if args.csv:
        write_csv(rows, args.csv)
        written.append(args.csv)
    if args.json:
        write_json(rows, meta, args.json)
        written.append(args.json)
    if args.plot:
        written += write_plots(rows, args.plot)
    if written:
        print("wrote " + ", ".join(written), file=sys.stderr)
    # Everything else first: the table is the last thing on stdout.
    print(f"torch {meta['torch']}, device {meta['device_name']} ({meta['cpu_threads']} CPU threads), "
          f"dtype {meta['dtype']}, timer: {meta['timer']}, {meta['rotate']} input set(s) rotated, "
          f"median of {meta.get('rounds', 1)} round(s) in rotated backend order")
    print(FLOPS_NOTE)
    if meta["device"] == "cuda":
        print("MB = peak extra memory: torch.cuda.max_memory_allocated during one call minus the "
              "memory allocated before it (inputs); fwd: inference forward, bwd/fwd_bwd: forward + backward")
    if meta.get("peaks"):
        print(meta["peaks"])
        print("roofline: FLOP/B = FLOPs / minimum DRAM bytes (q, k, v, o; + do, dq, dk, dv for the "
              "backward); bound = compute if FLOP/B > ridge else memory; ours %roof = ours FLOP/s / "
              "min(peak FLOP/s, FLOP/B x peak bytes/s)")
    print_table(rows, meta)
    return rows


if __name__ == "__main__":
    main()
