"""The paged-prefill suite (formerly bench/bench_paged_prefill.py): times a prefill chunk
against a KV cache (chunked prefill, as serving stacks run it) through flash_attn_with_kvcache:
the cache contiguous, cut into shuffled pages, and the same paged calls pinned to the mma.sync
kernels, in one process; prints the table last.

  python -m flash_attn_ext.bench paged-prefill                        # GPU, bf16
  python -m flash_attn_ext.bench paged-prefill --rounds 3 --csv prefill.csv
  python -m flash_attn_ext.bench paged-prefill --device cpu --quick   # CPU smoke run (tiny sizes)

Config: B=4, H=32, H_kv=8 (GQA), D=128, a chunk of --chunk new queries whose keys are already
in the cache (cache_seqlens = cache length, the chunk at its end; causal, bottom-right), caches
of --caches tokens. Backends:
  contig       k_cache / v_cache [B, S, H_kv, D] (the Hopper forward with seqused_k on sm_90)
  pagedP       the same keys in pools [B * S / P, P, H_kv, D], pages in a shuffled order, int32
               block_table [B, S / P] (P from --pages)
  pagedP_mma   pagedP with FLASH_ATTN_EXT_FWD_IMPL=mma: the mma.sync decode tiles that KV-cache
               prefill ran on before the Hopper forward took paged caches
TF/s count the useful FLOPs: 4 * B * H * D * (visible keys summed over the chunk's rows).
Ratios: X/contig = time(X) / time(contig). Timing: flash_attn_ext.bench.time_ms medians, with
--rounds N the backends in rotated order (flash_attn_ext.bench.rotated_rounds).
"""
import argparse
import sys

import torch

import flash_attn_ext as fa
from ..backends import DTYPES, env_set
from ..report import write_rows_csv
from ..timing import require_cuda, rotated_rounds, time_ms


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m flash_attn_ext.bench paged-prefill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("--chunk", type=int, default=1024, help="new queries per sequence")
    p.add_argument("--caches", default="4096,16384", help="cache lengths (tokens)")
    p.add_argument("--pages", default="16,64,256", help="page sizes")
    p.add_argument("--no-mma", action="store_true", help="skip the pagedP_mma backends")
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--csv", default=None, help="write every row to this CSV file")
    return p.parse_args(argv)


def paged(cache, page, order):
    """cache [B, S, H_kv, D] as a pool [B * S / page, page, H_kv, D] whose page i of the
    flattened (sequence, page) list sits at order[i]; the block table is order.view(B, -1)."""
    pool = torch.empty((order.numel(), page) + tuple(cache.shape[2:]), dtype=cache.dtype,
                       device=cache.device)
    pool[order.to(cache.device)] = cache.reshape(pool.shape)
    return pool


def main(argv=None):
    args = parse_args(argv)
    device = args.device
    if device == "cuda":
        require_cuda("paged-prefill --device cuda")
    dtype = DTYPES["fp32" if device == "cpu" else args.dtype]
    B, H, H_kv, D = (2, 4, 2, 64) if args.quick else (4, 32, 8, 128)
    chunk = 32 if args.quick else args.chunk
    caches = [256] if args.quick else [int(s) for s in args.caches.split(",")]
    pages = [int(p) for p in args.pages.split(",")]
    rows = []
    for S in caches:
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(B, chunk, H, D, generator=gen).to(device, dtype)
        k = torch.randn(B, S, H_kv, D, generator=gen).to(device, dtype)
        v = torch.randn(B, S, H_kv, D, generator=gen).to(device, dtype)
        lengths = torch.full((B,), S, dtype=torch.int32, device=device)
        calls = {"contig": lambda k=k, v=v: fa.flash_attn_with_kvcache(
            q, k, v, cache_seqlens=lengths, causal=True)}
        for page in pages:
            order = torch.randperm(B * S // page, generator=gen)
            kp, vp = paged(k, page, order), paged(v, page, order)
            table = order.view(B, -1).to(torch.int32).to(device)
            call = (lambda kp=kp, vp=vp, table=table: fa.flash_attn_with_kvcache(
                q, kp, vp, cache_seqlens=lengths, block_table=table, causal=True))
            calls[f"paged{page}"] = call
            if not args.no_mma and device == "cuda":
                def mma(call=call):
                    with env_set({"FLASH_ATTN_EXT_FWD_IMPL": "mma"}):
                        return call()
                calls[f"paged{page}_mma"] = mma

        def time_one(name, first):
            return {"fwd": {"ms": time_ms(calls[name], device)}}
        results = rotated_rounds(list(calls), time_one, args.rounds)
        visible = chunk * (S - chunk) + chunk * (chunk + 1) // 2
        flops = 4 * B * H * D * visible
        base = results["contig"]["fwd"]["ms"]
        for name in calls:
            ms = results[name]["fwd"]["ms"]
            rows.append(dict(cache=S, chunk=chunk, B=B, H=H, H_kv=H_kv, D=D,
                             dtype=str(dtype).replace("torch.", ""),
                             backend=name, ms=ms, tflops=flops / ms / 1e9, vs_contig=ms / base))
        print(f"  cache {S}: done", file=sys.stderr, flush=True)
    if args.csv:
        write_rows_csv(rows, args.csv)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"\nKV-cache prefill chunk, {str(dtype).replace('torch.', '')}, B={B} H={H}/{H_kv} "
          f"D={D}, chunk {chunk}, causal, device {name}, torch {torch.__version__}, "
          f"rounds {args.rounds}")
    head = f"{'cache':>7}  {'backend':<14}{'ms':>9}{'TF/s':>8}{'X/contig':>10}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['cache']:>7}  {r['backend']:<14}{r['ms']:9.3f}{r['tflops']:8.1f}"
              f"{r['vs_contig']:10.2f}")

