"""The ring suite (formerly bench/bench_ring.py): context-parallel (ring) attention,
flash_attn_ext.ring_flash_attn_func: throughput per world size and how much of the
communication the compute leaves exposed.

  python -m flash_attn_ext.bench ring --all --csv ring.csv   # 1, 2, 4, 8 GPUs (up to the device
                                                             # count), each world size spawned here
  torchrun --nproc_per_node 2 -m flash_attn_ext.bench ring   # one world size, launched by torchrun
  python -m flash_attn_ext.bench ring --device cpu --all --max-world 2   # CPU smoke run (gloo, tiny)

Each rank holds --seqlen tokens (default 8192; the sequence has world * seqlen), zig-zag
causal, bf16, [batch, seqlen, heads, head_dim] with D = 128; one iteration is the forward
and the backward (torch.autograd.grad) of ring_flash_attn_func. The ranks start together
after a barrier and run --iters iterations back to back, as a training loop does (the host
queues ahead of the GPU); every iteration is timed by CUDA events around it on every rank,
the slowest rank counts, and the median over iterations is reported (several processes time
one step together: not flash_attn_ext.bench.time_ms). --sync-each instead times every
iteration from a barrier to the end of its backward (CUDA synchronised), which adds the
host's time to queue the iteration's first kernels and any time the GPU waits for the host.

The three steps below (1-GPU, ring, no-comm) are timed in --rounds rounds, in a rotated
order, each after --warmup iterations and at least --warmup-ms of them back to back, and the
median is taken over all rounds' iterations (not rotated_rounds' median of the rounds): a
GPU's clocks fall from their idle boost as it heats under load, within a few hundred ms, so
a step timed first on a cold GPU would look faster than one timed after it (one H100: the
same 1-GPU step 3.45 ms first, 3.65 ms after the ring's steps; docs/PERFORMANCE.md). Columns:

  ring ms      one iteration
  no-comm ms   the same iteration with the ring's communication left out: every rank runs the
               same blocks (same kernels, shapes and merges) against its own K/V instead of the
               ones passed around, and skips the input check's all_gather
  exposed %    (ring - no-comm) / ring: the share of the time communication is not hidden
  1-GPU ms     flash_attn_func on one rank's shard alone (seqlen tokens, causal): the baseline
  tokens/s     batch * world * seqlen / ring time: the whole sequence per second
  TF/s/GPU     attention FLOPs of the whole sequence (forward 4*B*H*N^2*D / 2 when causal,
               backward 2.5x that) / ring time / world
  scaling %    TF/s/GPU over the 1-GPU baseline's TF/s: 100 % is linear scaling of the
               attention throughput. (tokens/s cannot grow linearly with the world size at a
               fixed length per GPU: attention's work per token grows with the sequence.)

NCCL's NVLink multicast (NVLS) is switched off (NCCL_NVLS_ENABLE=0) and NCCL's streams get a
high priority (TORCH_NCCL_HIGH_PRIORITY=1) unless the environment sets them.
"""
import argparse
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flash_attn_ext
from flash_attn_ext import distributed as ring_attention
from ..backends import DTYPES
from ..report import write_rows_csv
from ..timing import require_cuda


def _nccl_defaults():
    """NCCL settings of this benchmark unless the environment sets them. Called first in main,
    before any NCCL communicator exists; ranks spawned by --all inherit them. (In main, not at
    import: the dispatcher and the tests import this module without running it.)"""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    # NCCL's kernels on a high-priority stream: their CTAs get SMs as the attention kernels'
    # CTAs retire instead of after the whole grid (2x H100: 6-8% of the step exposed instead
    # of 8-9%; README "Ring attention").
    os.environ.setdefault("TORCH_NCCL_HIGH_PRIORITY", "1")

COLUMNS = ["world", "seqlen_per_rank", "seqlen_total", "batch", "heads", "kv_heads",
           "head_dim", "dtype", "device", "ring_ms", "nocomm_ms", "exposed_comm_pct",
           "single_gpu_ms", "tokens_per_s", "tflops_per_gpu", "scaling_pct"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m flash_attn_ext.bench ring", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--all", action="store_true",
                   help="spawn world sizes 1, 2, 4, 8 (up to the device count / --max-world) "
                        "here, one after the other; without it, run the world of torchrun")
    p.add_argument("--max-world", type=int, default=8, help="largest world size with --all")
    p.add_argument("--device", choices=["cuda", "cpu"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seqlen", type=int, default=None,
                   help="tokens per rank (default 8192 on CUDA, 256 on the CPU)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=None, help="query heads (default 32, CPU 2)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: heads)")
    p.add_argument("--head-dim", type=int, default=None, help="default 128 (CPU 32)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="default bf16 (CPU fp32)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed iterations before each timed run (at least)")
    p.add_argument("--warmup-ms", type=float, default=None,
                   help="and at least this many ms of them (default 500 on CUDA, 0 on the CPU)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of the three timed steps, in rotated order")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--sync-each", action="store_true",
                   help="time every iteration from a barrier to its synchronised end (host "
                        "latency included) instead of back-to-back iterations by CUDA events")
    p.add_argument("--csv", help="write the table to this CSV file")
    args = p.parse_args(argv)
    cpu = args.device == "cpu"
    args.seqlen = args.seqlen or (256 if cpu else 8192)
    args.heads = args.heads or (2 if cpu else 32)
    args.kv_heads = args.kv_heads or args.heads
    args.head_dim = args.head_dim or (32 if cpu else 128)
    args.dtype = args.dtype or ("fp32" if cpu else "bf16")
    if args.warmup_ms is None:
        args.warmup_ms = 0.0 if cpu else 500.0
    return args


# ---- one rank ---------------------------------------------------------------------------------
def _synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _back_to_back(args):
    return args.device == "cuda" and not args.sync_each


def _warm_up(step, warmup, warmup_ms, device):
    """At least `warmup` steps and about warmup_ms of them, back to back (every rank runs as
    many: the ring's steps communicate)."""
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(warmup):
        step()
    _synchronize(device)
    per_step = (time.perf_counter() - start) / max(1, warmup)
    more = math.ceil(max(0.0, warmup_ms * 1e-3 - warmup * per_step) / max(per_step, 1e-6))
    more = torch.tensor([more], dtype=torch.int64, device=device)
    dist.all_reduce(more, op=dist.ReduceOp.MAX)
    for _ in range(int(more.item())):
        step()
    _synchronize(device)


def _slowest_rank_times(step, iters, device, back_to_back):
    """The slowest rank's time (s) of each of `iters` runs of step() (forward + backward):
    back_to_back, iterations queued one after the other and each timed by CUDA events;
    otherwise each started together after a barrier and timed on the host to its
    synchronised end."""
    if back_to_back:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        dist.barrier()
        _synchronize(device)
        for start, end in events:
            start.record()
            step()
            end.record()
        _synchronize(device)
        times = [start.elapsed_time(end) * 1e-3 for start, end in events]
    else:
        times = []
        for _ in range(iters):
            dist.barrier()
            _synchronize(device)
            start = time.perf_counter()
            step()
            _synchronize(device)
            times.append(time.perf_counter() - start)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def _median_ms_in_rounds(steps, args, device):
    """{name: median ms} of the (name, step) pairs, timed in args.rounds rounds whose order
    rotates, each run after its warm-up."""
    times = {name: [] for name, _ in steps}
    for r in range(args.rounds):
        shift = r % len(steps)
        for name, step in steps[shift:] + steps[:shift]:
            _warm_up(step, args.warmup, args.warmup_ms, device)
            times[name] += _slowest_rank_times(step, args.iters, device, _back_to_back(args))
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def _causal_flops(args, seqlen):
    """Forward + backward FLOPs of causal attention over `seqlen` tokens."""
    forward = 4 * args.batch * args.heads * seqlen * seqlen * args.head_dim / 2
    return forward * 3.5


def measure(args, device):
    """This rank's part of one world size's row; rank 0 returns the row."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device=device).manual_seed(rank)

    def randn(heads):
        return torch.randn(args.batch, args.seqlen, heads, args.head_dim, generator=gen,
                           device=device, dtype=dtype)

    q = randn(args.heads).requires_grad_()
    k, v = (randn(args.kv_heads).requires_grad_() for _ in "kv")
    dout = randn(args.heads)

    def fwd_bwd(attention):
        return lambda: torch.autograd.grad(attention(q, k, v), (q, k, v), dout)

    ring = fwd_bwd(lambda q, k, v: ring_attention.ring_flash_attn_func(q, k, v, causal=True))
    # The same blocks without communication: a ring that "receives" what it sends.
    silent_ring = ring_attention._Ring(communicate=False)
    same_blocks = ring_attention._PaddedAttention((args.seqlen,) * world, True,
                                                  args.head_dim ** -0.5, 0.0, False)
    # apply(q, k, v, sink, ring, attention, check): no sink, no input check (its all_gather).
    no_comm = fwd_bwd(lambda q, k, v: ring_attention._RingFlashAttnFunction.apply(
        q, k, v, None, silent_ring, same_blocks, None)[0])
    single = fwd_bwd(lambda q, k, v: flash_attn_ext.flash_attn_func(q, k, v, causal=True))

    ms = _median_ms_in_rounds([("single_gpu_ms", single), ("ring_ms", ring),
                               ("nocomm_ms", no_comm)], args, device)
    if rank != 0:
        return None
    total = world * args.seqlen
    tflops_per_gpu = _causal_flops(args, total) / (ms["ring_ms"] * 1e-3) / world / 1e12
    single_tflops = _causal_flops(args, args.seqlen) / (ms["single_gpu_ms"] * 1e-3) / 1e12
    return dict(world=world, seqlen_per_rank=args.seqlen, seqlen_total=total,
                batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
                head_dim=args.head_dim, dtype=args.dtype, device=_device_name(device), **ms,
                exposed_comm_pct=100 * max(0.0, ms["ring_ms"] - ms["nocomm_ms"]) / ms["ring_ms"],
                tokens_per_s=args.batch * total / (ms["ring_ms"] * 1e-3),
                tflops_per_gpu=tflops_per_gpu, scaling_pct=100 * tflops_per_gpu / single_tflops)


def _device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _init(rank, world, device_type, store_path=None):
    """Process group of this rank (FileStore when spawned here, torchrun's env:// otherwise);
    returns the rank's device."""
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    store = dist.FileStore(store_path, world) if store_path else None
    dist.init_process_group(backend, store=store, rank=rank if store else -1,
                            world_size=world if store else -1,
                            timeout=datetime.timedelta(minutes=5),
                            device_id=device if device.type == "cuda" else None)
    return device


def _spawned_rank(rank, world, args, store_path, result_path):
    device = _init(rank, world, args.device, store_path)
    row = measure(args, device)
    if row is not None:
        with open(result_path, "w") as f:
            json.dump(row, f)
    dist.destroy_process_group()


# ---- report -----------------------------------------------------------------------------------
def print_table(rows, args):
    print(f"\nring attention, zig-zag causal, forward + backward: {args.seqlen} tokens per "
          f"rank, batch {args.batch}, heads {args.heads}/{args.kv_heads}, D={args.head_dim}, "
          f"{args.dtype}, {rows[0]['device'] if rows else args.device}; median of {args.rounds} "
          f"rounds x {args.iters} (slowest rank, "
          f"{'back to back' if _back_to_back(args) else 'synchronised each'}, warm-up "
          f"{args.warmup} iterations and {args.warmup_ms:g} ms); "
          f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}, "
          f"TORCH_NCCL_HIGH_PRIORITY={os.environ.get('TORCH_NCCL_HIGH_PRIORITY')}")
    header = ["world", "tokens", "ring ms", "no-comm ms", "exposed %", "1-GPU ms",
              "tokens/s", "TF/s/GPU", "scaling %"]
    keys = ["world", "seqlen_total", "ring_ms", "nocomm_ms", "exposed_comm_pct",
            "single_gpu_ms", "tokens_per_s", "tflops_per_gpu", "scaling_pct"]
    formats = ["{:d}", "{:d}", "{:.2f}", "{:.2f}", "{:.1f}", "{:.2f}", "{:,.0f}", "{:.1f}",
               "{:.1f}"]
    table = [header] + [[f.format(r[k]) for f, k in zip(formats, keys)] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for line in table:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)))


def world_sizes(args):
    available = torch.cuda.device_count() if args.device == "cuda" else args.max_world
    sizes = [w for w in (1, 2, 4, 8) if w <= min(available, args.max_world)]
    if not sizes:
        sys.exit("ring: no CUDA device (use --device cpu for a smoke run)")
    return sizes


def run_all(args):
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in world_sizes(args):
            print(f"world size {world} ...", flush=True)
            store, result = (os.path.join(tmp, f"{name}{world}") for name in ("store", "row"))
            mp.start_processes(_spawned_rank, args=(world, args, store, result), nprocs=world,
                               start_method="spawn")
            with open(result) as f:
                rows.append(json.load(f))
    return rows


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda":
        require_cuda("ring --device cuda")
    _nccl_defaults()
    if args.all:
        rows = run_all(args)
    else:
        if "WORLD_SIZE" not in os.environ:
            sys.exit("ring: launch with torchrun --nproc_per_node N -m flash_attn_ext.bench ring, "
                     "or pass --all")
        device = _init(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.device)
        row = measure(args, device)
        dist.destroy_process_group()
        if row is None:
            return
        rows = [row]
    if args.csv:
        write_rows_csv(rows, args.csv, COLUMNS)
        print(f"wrote {args.csv}", file=sys.stderr)
    print_table(rows, args)  # last on stdout

