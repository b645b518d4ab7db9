"""The mla-decode suite: DeepSeek MLA's absorbed decode step through flash_attn_with_kvcache,
q [B, 1, H, 576] over one latent head, k_cache the latent cache [B, S, 1, 576] and v_cache =
k_cache[..., :512] (a view: the cache is read once), contiguous and in shuffled pages; prints
the table last.

  python -m flash_attn_ext.bench mla-decode                          # GPU, bf16
  python -m flash_attn_ext.bench mla-decode --rounds 3 --csv mla.csv
  python -m flash_attn_ext.bench mla-decode --device cpu --quick     # CPU smoke run (tiny sizes)

Configs (B, S, H): --configs, default 8x65536x16, 32x16384x16, 128x8192x16, 64x4096x16,
8x65536x128. GB/s count the cache bytes read once (B * S * 576 * 2), against a device-to-device
copy's bandwidth (read + write bytes, measured in the same run: `copy GB/s`); TF/s the FLOPs
2 * B * H * S * (576 + 512). Timing: flash_attn_ext.bench.time_ms medians; with --rounds N the
cache layouts in rotated order.
"""
import argparse
import sys

import torch

import flash_attn_ext as fa
from ..backends import DTYPES
from ..report import write_rows_csv
from ..timing import require_cuda, rotated_rounds, time_ms

HEAD_DIM, HEAD_DIM_V = 576, 512


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m flash_attn_ext.bench mla-decode",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("--configs", default="8x65536x16,32x16384x16,128x8192x16,64x4096x16,8x65536x128",
                   help="comma list of BxSxH (batch, cache tokens, query heads)")
    p.add_argument("--page", type=int, default=64, help="page size of the paged layout")
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--csv", default=None, help="write every row to this CSV file")
    return p.parse_args(argv)


def copy_gbps(device):
    """A device-to-device copy's bandwidth (read + write bytes), GB/s; None on the CPU."""
    if device != "cuda":
        return None
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    ms = time_ms(lambda: x.clone(), device)
    return 2 * x.numel() / ms / 1e6


def main(argv=None):
    args = parse_args(argv)
    device = args.device
    if device == "cuda":
        require_cuda("mla-decode --device cuda")
    dtype = DTYPES["fp32" if device == "cpu" else args.dtype]
    configs = ([(2, 64, 4)] if args.quick else
               [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")])
    page = 16 if args.quick else args.page
    peak = copy_gbps(device)
    rows = []
    for B, S, H in configs:
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(B, 1, H, HEAD_DIM, generator=gen).to(device, dtype)
        cache = torch.randn(B, S, 1, HEAD_DIM, generator=gen).to(device, dtype)
        order = torch.randperm(B * S // page, generator=gen)
        pool = torch.empty((B * S // page, page, 1, HEAD_DIM), dtype=dtype, device=device)
        pool[order.to(device)] = cache.reshape(pool.shape)
        table = order.view(B, -1).to(torch.int32).to(device)
        lengths = torch.full((B,), S, dtype=torch.int32, device=device)
        calls = {
            "contig": lambda: fa.flash_attn_with_kvcache(q, cache, cache[..., :HEAD_DIM_V],
                                                         cache_seqlens=lengths),
            f"paged{page}": lambda: fa.flash_attn_with_kvcache(
                q, pool, pool[..., :HEAD_DIM_V], cache_seqlens=lengths, block_table=table),
        }

        def time_one(name, first):
            return {"fwd": {"ms": time_ms(calls[name], device)}}
        results = rotated_rounds(list(calls), time_one, args.rounds)
        gbytes = B * S * HEAD_DIM * cache.element_size() / 1e9
        flops = 2 * B * H * S * (HEAD_DIM + HEAD_DIM_V)
        for name in calls:
            ms = results[name]["fwd"]["ms"]
            gbps = gbytes / ms * 1e3
            rows.append(dict(B=B, S=S, H=H, dtype=str(dtype).replace("torch.", ""), layout=name,
                             ms=ms, gbps=gbps, copy_pct=100 * gbps / peak if peak else None,
                             tflops=flops / ms / 1e9))
        print(f"  B={B} S={S} H={H}: done", file=sys.stderr, flush=True)
        del q, cache, pool
    if args.csv:
        write_rows_csv(rows, args.csv)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"\nMLA decode (576 / 512, latent cache read once), {str(dtype).replace('torch.', '')}, "
          f"device {name}, torch {torch.__version__}, rounds {args.rounds}"
          + (f", copy {peak:.0f} GB/s" if peak else ""))
    head = f"{'B':>5}{'S':>7}{'H':>5}  {'layout':<13}{'us':>9}{'GB/s':>8}{'% copy':>8}{'TF/s':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        pct = f"{r['copy_pct']:8.0f}" if r["copy_pct"] is not None else f"{'-':>8}"
        print(f"{r['B']:>5}{r['S']:>7}{r['H']:>5}  {r['layout']:<13}{r['ms'] * 1e3:9.1f}"
              f"{r['gbps']:8.0f}{pct}{r['tflops']:7.1f}")
    return rows
