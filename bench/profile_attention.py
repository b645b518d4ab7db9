#!/usr/bin/env python3
"""Profiles one attention config: torch.profiler (Chrome trace + kernel-time table), or
Nsight Compute (--ncu).

  python bench/profile_attention.py --hdim 128 --seqlen 4096 --pass fwd_bwd --trace trace.json
  python bench/profile_attention.py --device cpu --hdim 64 --seqlen 1024   # CPU ops
  python bench/profile_attention.py --ncu            # print the ncu command; run it if ncu is here

The trace opens in chrome://tracing or https://ui.perfetto.dev. The table is
key_averages() sorted by self device time (self CPU time on the CPU), then the rows of our
kernels alone.

--ncu prints the Nsight Compute command that profiles our forward and backward kernels with
`--set full` (for the GUI: it writes a .ncu-rep; with --backend, another backend's kernels of
the same config, e.g. `--backend fa4` for FlashAttention-4's), and, when `ncu` is installed,
runs ncu with `--csv --page details` on the same small config and prints per kernel: achieved
occupancy, registers per thread, shared memory per block, local-memory (spill) instructions, SM
throughput and DRAM throughput (% of peak). ncu needs access to the GPU performance counters
(root, or the nvidia driver option NVreg_RestrictProfilingToAdminUsers=0).
"""
import argparse
import csv
import os
import re
import shlex
import shutil
import subprocess
import sys

import torch

from flash_attn_ext import bench

# Our __global__ functions (csrc/cuda): flash_fwd_kernel, flash_fwd_sm90_kernel,
# flash_fwd_combine_kernel (split-KV), compact_query_tiles_kernel (varlen), flash_fwd_fp32_kernel,
# bwd_main_kernel, flash_bwd_sm90_kernel, bwd_preprocess_kernel (D, dQ zeroing),
# bwd_convert_dq_kernel (and its _flat_ twin), bwd_fp32_kernel. Matched against the plain
# function name, which is ncu's default --kernel-name-base. Torch's own FlashAttention kernels
# are also called flash_fwd_kernel, but this script launches only ours.
OUR_KERNELS = (r"flash_fwd|flash_bwd|fwd_fp32|bwd_fp32|bwd_main|bwd_preprocess|bwd_convert_dq|"
               r"compact_query_tiles")
# Extra raw metrics: local-memory instructions are what register spills turn into.
SPILL_METRICS = ("smsp__sass_inst_executed_op_local_ld.sum", "smsp__sass_inst_executed_op_local_st.sum")


def parse_args(argv=None):
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if gpu else "cpu")
    p.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default bf16 on GPU, fp32 on CPU)")
    p.add_argument("--hdim", type=int, default=None, help="default 128 on GPU, 64 on CPU")
    p.add_argument("--seqlen", type=int, default=None,
                   help="keys (and queries); default 4096 on GPU, 1024 on CPU")
    p.add_argument("--seqlen-q", type=int, default=None, help="query length if not --seqlen")
    p.add_argument("--batch", type=int, default=None, help="default 16384/S on GPU, 1 on CPU")
    p.add_argument("--heads", type=int, default=None, help="default 2048/D on GPU, 8 on CPU")
    p.add_argument("--causal", type=int, default=0, choices=(0, 1))
    p.add_argument("--pass", dest="pass_", default="fwd_bwd", choices=("fwd", "bwd", "fwd_bwd"))
    p.add_argument("--layout", default="bhsd", choices=("bhsd", "bshd"))
    p.add_argument("--backend", default="ours", choices=bench.ALL_BACKENDS,
                   help="profile a reference instead of ours (same names as the benchmark)")
    p.add_argument("--deterministic", action="store_true", help="our backward in deterministic mode")
    p.add_argument("--warmup", type=int, default=3, help="untraced iterations first")
    p.add_argument("--iters", type=int, default=5, help="traced iterations")
    p.add_argument("--trace", default="attention_trace.json", help="Chrome trace output path")
    p.add_argument("--row-limit", type=int, default=25, help="rows of the key_averages table")
    p.add_argument("--plain", action="store_true",
                   help="just run warm-up + iterations, no torch.profiler (what ncu / nsys launch)")
    p.add_argument("--ncu", action="store_true",
                   help="print the Nsight Compute command; run and summarise it when ncu is on PATH")
    p.add_argument("--ncu-report", default=None,
                   help="with --ncu: also write the full report (ncu -o PATH, a .ncu-rep for the GUI)")
    return p.parse_args(argv)


def config(args):
    gpu = args.device == "cuda"
    D = args.hdim or (128 if gpu else 64)
    S = args.seqlen or (4096 if gpu else 1024)
    return dict(layout=args.layout, D=D, Sk=S, Sq=args.seqlen_q or S, causal=bool(args.causal),
                B=args.batch or (max(1, 16384 // S) if gpu else 1),
                H=args.heads or (max(1, 2048 // D) if gpu else 8))


def make_step(args, cfg):
    """The work of one iteration of the chosen pass, as a no-argument callable."""
    dtype = bench.DTYPES[args.dtype or ("bf16" if args.device == "cuda" else "fp32")]
    (q, k, v), = bench.make_inputs(cfg, cfg["layout"], 1, args.device, dtype)
    fn = bench.make_fn(args.backend, cfg, args.device, args.deterministic and args.backend == "ours")
    dout = torch.randn_like(fn(q, k, v))
    if args.pass_ == "fwd":
        def step():
            with torch.no_grad():
                return fn(q, k, v)
    elif args.pass_ == "bwd":
        out = fn(q, k, v)  # the forward runs once, outside the profiled iterations

        def step():
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    else:
        def step():
            return torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
    return step, dtype


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def describe(args, cfg, dtype):
    return (f"{args.backend} {args.pass_}: {str(dtype).replace('torch.', '')} layout {cfg['layout']} "
            f"B={cfg['B']} H={cfg['H']} Sq={cfg['Sq']} Sk={cfg['Sk']} D={cfg['D']} "
            f"causal={int(cfg['causal'])} on {args.device}")


def profile(args):
    from torch.profiler import ProfilerActivity, profile as torch_profile, record_function
    cfg = config(args)
    step, dtype = make_step(args, cfg)
    for _ in range(args.warmup):
        step()
    sync(args.device)
    if args.plain:
        # ncu (--profile-from-start off) profiles what runs between these two calls: the
        # iterations, not the warm-up or the inputs. (Not NVTX ranges: autograd runs the
        # backward on a thread of its own, outside a range pushed here.)
        cudart = torch.cuda.cudart() if args.device == "cuda" else None
        if cudart is not None:
            cudart.cudaProfilerStart()
        for _ in range(args.iters):
            step()
        sync(args.device)
        if cudart is not None:
            cudart.cudaProfilerStop()
        return
    activities = [ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with torch_profile(activities=activities, record_shapes=True) as prof:
        for i in range(args.iters):
            with record_function(f"{args.backend}_{args.pass_}_{i}"):
                step()
            sync(args.device)
    if args.trace:
        os.makedirs(os.path.dirname(os.path.abspath(args.trace)), exist_ok=True)
        prof.export_chrome_trace(args.trace)
    gpu = args.device == "cuda"
    sort_key = "self_device_time_total" if gpu else "self_cpu_time_total"
    events = prof.key_averages()
    print(describe(args, cfg, dtype) + f", {args.iters} iterations")
    if args.trace:
        print(f"Chrome trace: {args.trace}")
    print(events.table(sort_by=sort_key, row_limit=args.row_limit))
    # Our kernels (or, on the CPU, our operators) alone, per iteration. Only when profiling ours:
    # torch's FlashAttention kernels share names with ours.
    ours = re.compile(OUR_KERNELS if gpu else r"flash_attn_ext::")
    mine = [e for e in events if ours.search(e.key)] if args.backend == "ours" else []
    if mine:
        print("ours, per iteration:")
        for e in sorted(mine, key=lambda e: -_self_time_us(e, gpu)):
            per_iter_us = _self_time_us(e, gpu) / args.iters
            print(f"  {per_iter_us:10.1f} us  x{e.count // args.iters:<3d} {e.key[:110]}")


def _self_time_us(evt, gpu):
    if not gpu:
        return evt.self_cpu_time_total
    # Renamed from self_cuda_time_total in torch 2.4; keep both spellings working.
    return getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)


# ----------------------------------------------------------------------------------------------
# Nsight Compute
# ----------------------------------------------------------------------------------------------

def ncu_command(args, ncu="ncu", csv_mode=False, report=None, spill_metrics=True):
    """The ncu command line that profiles our kernels in one plain iteration of this config."""
    me = os.path.abspath(__file__)
    child = [sys.executable, me, "--plain", "--warmup", "0", "--iters", "1", "--device", "cuda",
             "--pass", args.pass_, "--layout", args.layout, "--backend", args.backend,
             "--causal", str(args.causal)]
    for flag, val in (("--dtype", args.dtype), ("--hdim", args.hdim), ("--seqlen", args.seqlen),
                      ("--seqlen-q", args.seqlen_q), ("--batch", args.batch), ("--heads", args.heads)):
        if val is not None:
            child += [flag, str(val)]
    if args.deterministic:
        child.append("--deterministic")
    # The iteration's kernels (the child brackets them with cudaProfilerStart / Stop): ours by
    # name, another backend's (e.g. --backend fa4, FlashAttention-4) all of them.
    cmd = [ncu, "--set", "full", "--profile-from-start", "off", "--target-processes", "all"]
    if args.backend == "ours":
        cmd += ["--kernel-name", f"regex:{OUR_KERNELS}"]
    if spill_metrics:
        cmd += ["--metrics", ",".join(SPILL_METRICS)]
    if csv_mode:
        # Plain function names (template arguments make the demangled ones unreadable in a
        # table) and unscaled units (bytes, ns), so that numbers parse the same way every time.
        cmd += ["--csv", "--page", "details", "--print-units", "base", "--print-kernel-base", "function"]
    if report:
        cmd += ["-o", report, "-f"]
    return cmd + child


def _number(s):
    try:
        return float(s.replace(",", ""))
    except (AttributeError, ValueError):
        return None


# ncu renamed some metrics across versions: the first name present wins.
NCU_COLUMNS = (
    ("occupancy %", ("Achieved Occupancy",)),
    ("regs/thread", ("Registers Per Thread",)),
    ("smem/block B", None),  # static + dynamic, computed below
    ("local ld", (SPILL_METRICS[0], "smsp__inst_executed_op_local_ld.sum")),
    ("local st", (SPILL_METRICS[1], "smsp__inst_executed_op_local_st.sum")),
    ("SM %", ("Compute (SM) Throughput", "Compute (SM) [%]", "SM [%]")),
    ("DRAM %", ("DRAM Throughput", "DRAM [%]")),
    ("time us", ("Duration", "gpu__time_duration.sum")),
)


def parse_ncu_csv(text):
    """ncu --csv --page details: one row per (kernel launch, metric). Returns a list of
    {"id", "kernel", "grid", "block", "metrics": {name: (unit, value)}} in launch order."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]  # drop ==PROF== and app output
    kernels = {}
    for row in csv.DictReader(lines):
        kid = row.get("ID")
        if kid is None or row.get("Metric Name") is None:
            continue
        k = kernels.setdefault(kid, dict(id=kid, kernel=row.get("Kernel Name", "?"),
                                         grid=row.get("Grid Size", ""), block=row.get("Block Size", ""),
                                         metrics={}))
        k["metrics"][row["Metric Name"]] = (row.get("Metric Unit", ""), row.get("Metric Value", ""))
    return list(kernels.values())


def _metric(k, names):
    for n in names:
        if n in k["metrics"]:
            unit, val = k["metrics"][n]
            v = _number(val)
            if v is None:
                return None
            # Durations come in ns with --print-units base; older ncu may print usecond/msecond.
            if n in ("Duration", "gpu__time_duration.sum"):
                scale = {"ns": 1e-3, "nsecond": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3,
                         "ms": 1e3, "second": 1e6, "s": 1e6}.get(unit.strip(), 1e-3)
                v *= scale
            return v
    return None


def summarise_ncu(kernels):
    """Rows of the summary table: one per profiled launch."""
    rows = []
    for k in kernels:
        vals = {}
        for col, names in NCU_COLUMNS:
            if names is None:
                st = _metric(k, ("Static Shared Memory Per Block",))
                dy = _metric(k, ("Dynamic Shared Memory Per Block",))
                vals[col] = None if st is None and dy is None else (st or 0) + (dy or 0)
            else:
                vals[col] = _metric(k, names)
        name = k["kernel"].split("(")[0]
        rows.append(dict(kernel=name, grid=k["grid"], block=k["block"], **vals))
    return rows


def print_ncu_summary(rows):
    cols = ["kernel", "grid", "block"] + [c for c, _ in NCU_COLUMNS]
    print(" | ".join(cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r[c]
            if v is None:
                cells.append("-")
            elif isinstance(v, float):
                cells.append(f"{v:.0f}" if v >= 100 or v == int(v) else f"{v:.1f}")
            else:
                cells.append(str(v)[:60])
        print(" | ".join(cells))


def find_ncu():
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for cand in (shutil.which("ncu"), os.path.join(cuda_home, "bin", "ncu")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def run_ncu(args):
    # ncu replays every kernel dozens of times: default to a small config unless told otherwise.
    args.hdim = args.hdim or 128
    args.seqlen = args.seqlen or 1024
    args.batch = args.batch or 2
    args.heads = args.heads or 8
    print("Nsight Compute, full set (writes a report for the GUI):")
    print("  " + shlex.join(ncu_command(args, report=args.ncu_report or "flash_attn_ext")))
    ncu = find_ncu()
    if ncu is None:
        print("ncu is not on PATH: run the command above on a machine with Nsight Compute.")
        return 0
    if args.device != "cuda" or not torch.cuda.is_available():
        print("no CUDA device here: ncu not run.")
        return 0
    for spill_metrics in (True, False):
        cmd = ncu_command(args, ncu=ncu, csv_mode=True, spill_metrics=spill_metrics)
        print("running: " + shlex.join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        kernels = parse_ncu_csv(proc.stdout)
        if proc.returncode == 0 and kernels:
            break
        if spill_metrics:  # an ncu that does not know the raw local-memory metrics: once more without
            print(f"ncu failed (exit {proc.returncode}); retrying without --metrics", flush=True)
    if proc.returncode != 0 or not kernels:
        print(f"ncu failed (exit {proc.returncode}):")
        print("\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:]))
        return 1
    if args.ncu_report:
        subprocess.run(ncu_command(args, ncu=ncu, report=args.ncu_report, spill_metrics=spill_metrics),
                       capture_output=True)
        print(f"report: {args.ncu_report}.ncu-rep")
    print(f"\nper kernel ({len(kernels)} launches; %: of the GPU's peak; local ld/st: local-memory "
          "instructions executed, > 0 means register spills or local arrays):")
    print_ncu_summary(summarise_ncu(kernels))
    return 0


def main(argv=None):
    args = parse_args(argv)
    if args.ncu:
        return run_ncu(args)
    profile(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
