"""The attention suite, the default of `python -m flash_attn_ext.bench`: times flash_attn_ext
against naive attention, torch's SDPA backends and flex_attention, in one process, and prints
a table last.

  python -m flash_attn_ext.bench                       # GPU: FlashAttention paper grid, bf16
  python -m flash_attn_ext.bench --device cpu --quick  # CPU demo: B=1 H=8 S=1024 D=64 fp32
  python -m flash_attn_ext.bench --hdims 128 --seqlens 4096 --causal 1 --pass fwd
  python -m flash_attn_ext.bench --hdims 128 --heads 32 --heads-k 8 --backends ours,fa4,cudnn  # GQA
  python -m flash_attn_ext.bench --csv out.csv --json out.json --plot plots/

Backends: ours, ours-mma (both passes pinned to the mma.sync kernels), ours-det (ours with
deterministic=True), naive (matmul-softmax-matmul in the input dtype), sdpa (torch's own choice),
math, flash, efficient, cudnn (torch SDPA pinned to one backend with sdpa_kernel), flex
(torch.compile(flex_attention), CUDA only) and fa4 (FlashAttention-4, `pip install
flash-attn-4`, Hopper / Blackwell; skipped with a notice when it does not import; its native
layout is --layout bshd). A backend that refuses an input, or would not fit in memory, gets a
note instead of a time.

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
import sys

import torch

import flash_attn_ext as fa
from .backends import (ALL_BACKENDS, DTYPES, PASS_FLOP_FACTOR, flops, make_inputs, min_bytes,
                       missing_backend)
from .report import FLOPS_NOTE, load_runs, print_table, write_csv, write_json, write_plots
from .suites import suite_list
from .timing import Progress, bench_backend, measure_peaks, require_cuda, rotated_rounds, timer_name


DEFAULT_BACKENDS = {"cuda": "ours,naive,flash,cudnn,efficient,math,flex",
                    "cpu": "ours,naive,math,sdpa"}


def parse_args(argv=None):
    """The command line (`python -m flash_attn_ext.bench --help`) as an argparse Namespace."""
    # The suite list first: this is also the help of `python -m flash_attn_ext.bench --help`.
    p = argparse.ArgumentParser(prog="python -m flash_attn_ext.bench [attention]",
                                usage="%(prog)s [options]   (or: python -m flash_attn_ext.bench "
                                      "SUITE [options])",
                                description=suite_list() + "\n\n" + __doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None,
                   help="bf16, fp16 or fp32 (default bf16 on GPU, fp32 on CPU); fp8: the FP8 (e4m3) "
                        "forward next to our bf16 forward, cuDNN, FA2 and FA4's FP8 where it runs "
                        "(Hopper; hands --hdims, --seqlens, --causal, --rounds, --backends and --csv "
                        "to the fp8 suite, `python -m flash_attn_ext.bench fp8 --help`)")
    p.add_argument("--hdims", default=None, help="comma list (default 64,128,256 on GPU, 64 on CPU)")
    p.add_argument("--hdim-v", type=int, default=None,
                   help="v's head dim where it is not q's (DeepSeek MLA: --hdims 192 --hdim-v 128)")
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
    p.add_argument("--heads-k", type=int, default=None,
                   help="key/value heads (GQA / MQA: a divisor of --heads; default: --heads). "
                        "SDPA and flex get enable_gqa=True, naive attention repeated k and v")
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


def resolve(args):
    """Fills the device-dependent defaults in; returns the run's settings."""
    device = args.device
    gpu = device == "cuda"
    if gpu:
        require_cuda("attention --device cuda")
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
    for b in list(backends):
        reason = missing_backend(b)
        if reason:
            print(reason, file=sys.stderr)
            backends.remove(b)
    if not backends:
        raise SystemExit("no backend left to run")
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
    """The config grid: dicts of layout, D, Sq, Sk, causal, B, H (GPU default: B = 16384/S,
    H = 2048/D, the FlashAttention paper's grid)."""
    gpu = run["device"] == "cuda"
    for layout in run["layouts"]:
        for D in run["hdims"]:
            for S in run["seqlens"]:
                for causal in run["causals"]:
                    H = args.heads or (max(1, 2048 // D) if gpu else 8)
                    if args.heads_k and H % args.heads_k:
                        raise SystemExit(f"--heads-k {args.heads_k} does not divide {H} heads")
                    yield dict(layout=layout, D=D, Dv=args.hdim_v or D, Sk=S, causal=causal,
                               Sq=args.seqlen_q or S,
                               B=args.batch or (max(1, 16384 // S) if gpu else 1),
                               H=H, Hk=args.heads_k or H)


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
                    dtype=meta["dtype"], layout=cfg["layout"], hdim=cfg["D"],
                    hdim_v=cfg["Dv"], B=cfg["B"],
                    H=cfg["H"], Hk=cfg["Hk"],
                    Sq=cfg["Sq"], S=cfg["Sk"], causal=int(cfg["causal"]), pass_=p, backend=be,
                    ms=ms, tflops=f / ms / 1e9 if ms else None,
                    ours_speedup=ms / ours_ms if ms and ours_ms else None,
                    peak_extra_mb=r["mem_mb"], note=r["note"], flops=f, min_bytes=nbytes,
                    intensity=intensity, bound=bound,
                    roof_pct=100 * f / (ms * 1e-3) / roof if ms and roof else None))
        sets = None  # frees the inputs before empty_cache
        if device == "cuda":
            torch.cuda.empty_cache()
    progress.close()
    return rows, meta


# --dtype fp8: our backends' names in the fp8 suite (ours: the FP8 forward and our bf16 one).
_FP8_BACKENDS = {"ours": ("fp8", "bf16"), "cudnn": ("cudnn",), "flash": ("fa2",), "fa4": ("fa4",)}


def fp8_suite_args(args):
    """The fp8 suite's command line for an attention-suite call with --dtype fp8 (forward only:
    the FP8 kernels have no backward)."""
    if args.device != "cuda":
        raise SystemExit("--dtype fp8: the FP8 forward runs on Hopper GPUs (CUDA) only")
    if args.passes.split(",") != ["fwd"] and args.passes != "fwd,bwd":
        raise SystemExit("--dtype fp8: forward only (the FP8 kernels have no backward)")
    argv = ["--rounds", str(max(1, args.rounds)), "--causal", args.causal]
    if args.hdims:
        argv += ["--head-dims", args.hdims]
    if args.seqlens:
        argv += ["--seqlens", args.seqlens]
    if args.backends:
        names = [n for b in args.backends.split(",") for n in _FP8_BACKENDS.get(b, ())]
        skipped = [b for b in args.backends.split(",") if b not in _FP8_BACKENDS]
        if skipped:
            print(f"--dtype fp8: no FP8 column for {','.join(skipped)}", file=sys.stderr)
        if not names:
            raise SystemExit(f"--dtype fp8 runs {','.join(_FP8_BACKENDS)}, got {args.backends}")
        argv += ["--backends", ",".join(names)]
    if args.csv:
        argv += ["--csv", args.csv]
    return argv


def main(argv=None):
    """Runs (or with --merge, loads) the benchmark, writes the requested outputs, prints the
    table last and returns the rows."""
    args = parse_args(argv)
    if args.dtype == "fp8":
        from .suites import fp8
        return fp8.main(fp8_suite_args(args))
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
