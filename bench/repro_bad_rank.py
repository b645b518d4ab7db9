import torch, flash_attn_ext  # noqa
q = torch.randn(2, 16, 4, 32, device="cuda")
k = torch.randn(2, 24, 4, 32, device="cuda")
try:
    torch.ops.flash_attn_ext.fwd(q[0], k[0], k[0], 0.125, False, True, 0)
except RuntimeError as e:
    print("raised OK:", str(e)[:100])
