"""Benchmark timing, shared by every suite: medians per device (triton do_bench / CUDA events /
perf_counter), peak memory, start-up peaks, one backend's passes (by name for the attention
suite, from a factory for the others), rotated rounds, progress, and the CUDA check."""
import importlib
import itertools
import os
import statistics
import sys
import time
import warnings

import torch

from .backends import QUADRATIC_BACKENDS, _pinned_to_mma, make_fn, quadratic_bytes


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
    """How time_ms measures on this device, for the printed settings."""
    if device != "cuda":
        return "time.perf_counter, median of 5-100 calls after 1 warm-up"
    try:
        importlib.import_module("triton.testing")
        return "triton.testing.do_bench (median, L2 flushed per call)"
    except ImportError:
        return "CUDA events (median, L2 flushed per call)"


def time_ms(fn, device):
    """Median milliseconds of fn() (triton's do_bench with L2 flushes on CUDA, CUDA events
    without triton, perf_counter calls on the CPU)."""
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


def require_cuda(what):
    """Exits with one line (no traceback) when CUDA is not available: `what` (a suite, or a
    suite's --device cuda) only runs on a GPU."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{what}: needs a CUDA device, and torch.cuda.is_available() is False "
                         "here (CPU-runnable suites take --device cpu)")


class Skip(Exception):
    """Raised by a backend that does not run here: time_passes makes its message the note."""


def _short_error(e):
    if isinstance(e, torch.OutOfMemoryError):
        return "OOM"
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:60]}"


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


def time_passes(make, sets, passes, device, describe_error=_short_error):
    """Times fn = make() on input sets (tuples of tensors) for each pass with _time_pass.
    Returns {pass: {"ms", "mem_mb", "note"}}; errors become notes (a Skip's message, else
    describe_error(e)). One probe call first: does the backend take this input?"""
    res = {p: {"ms": None, "mem_mb": None, "note": ""} for p in passes}
    try:
        fn = make()
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # SDPA explains at length why a kernel was not used
            probe = fn(*sets[0])  # does the backend take this input?
        douts = [torch.randn_like(probe) for _ in sets]
        del probe
    except Exception as e:
        note = str(e) if isinstance(e, Skip) else describe_error(e)
        for p in passes:
            res[p]["note"] = note
        fn = None
    for p in passes if fn is not None else ():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res[p]["ms"], res[p]["mem_mb"] = _time_pass(fn, p, sets, douts, device)
        except Exception as e:
            res[p]["note"] = describe_error(e)
        if device == "cuda" and res[p]["ms"] is None:
            torch.cuda.empty_cache()
    return res


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
        """One step done; `what` names it."""
        self.i += 1
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(1)
        else:
            print(f"[{self.i}/{self.total}] {what}", file=sys.stderr, flush=True)

    def close(self):
        """Ends the bar (nothing for the plain lines)."""
        if self.bar is not None:
            self.bar.close()


def rotated_rounds(names, time_one, rounds, reduce=statistics.median):
    """Times every name `rounds` times, round r in the order rotated by r (A B C, B C A, ...),
    and keeps the median ms per pass (or reduce(times): min for the suites that keep the best
    round). A GPU's clock follows its recent load: the same kernel measured up to 5% apart
    first in a row of backends and later in it, so with as many rounds as names each one runs
    once in every position. time_one(name, first_round) returns {pass: {"ms", ...}}; the other
    fields are kept from the first round; rounds whose "ms" is None are left out."""
    results, all_ms = {}, {}
    for rnd in range(max(1, rounds)):
        shift = rnd % len(names)
        for name in names[shift:] + names[:shift]:
            for p, r in time_one(name, rnd == 0).items():
                results.setdefault(name, {}).setdefault(p, r)
                all_ms.setdefault((name, p), []).append(r["ms"])
    for (name, p), times in all_ms.items():
        times = [t for t in times if t is not None]
        results[name][p]["ms"] = reduce(times) if times else None
    return results
