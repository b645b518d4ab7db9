# throwaway: one call of ours and of cuDNN per config, for ncu
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import flash_attn_ext as fa
for D, S, causal in ((256, 512, True), (128, 512, False), (128, 8192, False)):
    B, H = 16384 // S, 2048 // D
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(2):
        fa.scaled_dot_product_attention(q, k, v, is_causal=causal)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.cuda.synchronize()
