"""Small cases of every CUDA kernel, for compute-sanitizer (memcheck / racecheck):
forward (full, causal, split-KV + combine), fp32 forward/backward, backward
(atomic and deterministic dQ), odd lengths and a padded head dim.

  compute-sanitizer --tool memcheck python bench/sanitize_case.py
"""
import argparse

import torch

import flash_attn_ext as fa

parser = argparse.ArgumentParser(description=__doc__)
parser.parse_args()
torch.manual_seed(0)
cases = [  # (dtype, seqlen_q, seqlen_k, head_dim, causal, num_splits, deterministic)
    (torch.bfloat16, 130, 130, 64, False, 1, False),
    (torch.float16, 77, 201, 128, True, 1, True),
    (torch.bfloat16, 1, 700, 128, True, 4, False),
    (torch.bfloat16, 70, 90, 256, True, 1, False),
    (torch.float16, 65, 65, 40, False, 1, False),
    (torch.float32, 70, 90, 64, True, 1, False),
]
for dtype, sq, sk, d, causal, splits, det in cases:
    q = torch.randn(1, sq, 2, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(1, sk, 2, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(1, sk, 2, d, device="cuda", dtype=dtype, requires_grad=True)
    out = fa.flash_attn_func(q, k, v, causal=causal, num_splits=splits, deterministic=det)
    out.backward(torch.randn_like(out))
torch.cuda.synchronize()
print("sanitize cases done")
