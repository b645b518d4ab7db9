#!/usr/bin/env python3
"""Split-KV sweep for decoding shapes: K/V read bandwidth of our forward with forced
num_splits, next to the heuristic (num_splits=0) and torch's cuDNN backend, to tune
csrc/cuda/fwd_dispatch.cu's heuristic for the small-M decode tile.

  python bench/decode_splits.py                  # B=8, H=32, Sq=1, D=128, bf16, Sk = 8k..64k
  python bench/decode_splits.py --heads-k 8 --seqlens 4096,8192   # GQA (regrouped decode)
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flash_attn_ext as fa

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--heads", type=int, default=32)
parser.add_argument("--heads-k", type=int, default=None, help="kv heads (default: --heads)")
parser.add_argument("--head-dim", type=int, default=128)
parser.add_argument("--seqlens", default="8192,16384,32768,65536")
parser.add_argument("--splits", default="0,1,2,3,4,6,8,12,16,24,32,48")
args = parser.parse_args()

B, H, D = args.batch, args.heads, args.head_dim
H_kv = args.heads_k or H
splits = [int(s) for s in args.splits.split(",")]
print(f"B={B} H={H} H_kv={H_kv} D={D} Sq=1 bf16; K/V read GB/s")
print("Sk | cudnn GB/s | " + " | ".join(f"splits={s}" for s in splits))
for Sk in (int(s) for s in args.seqlens.split(",")):
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Sk, H_kv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    bytes_moved = 2 * k.numel() * k.element_size()
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=H_kv != H)

    cells = [f"{bytes_moved / do_bench(cudnn, warmup=25, rep=100, return_mode='median') / 1e6:.0f}"]
    for s in splits:
        ms = do_bench(lambda: fa.flash_attn_func(q, k, v, num_splits=s), warmup=25, rep=100,
                      return_mode="median")
        cells.append(f"{bytes_moved / ms / 1e6:.0f}")
    print(f"{Sk} | " + " | ".join(cells), flush=True)
