import sys, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import flash_attn_ext as fa
D, S, causal = int(sys.argv[1]), int(sys.argv[2]), bool(int(sys.argv[3]))
B, H = max(1, 16384 // S // 4), 2048 // D
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(2):
    fa.scaled_dot_product_attention(q, k, v, is_causal=causal)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        F.scaled_dot_product_attention(q, k, v, is_causal=causal)
torch.cuda.synchronize()
