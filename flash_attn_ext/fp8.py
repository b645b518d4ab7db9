"""The FP8 (e4m3) forward behind flash_attn_func(q, k, v, ..., q_descale=, k_descale=,
v_descale=) (FlashAttention-3's arguments), and quantisation helpers.

e4m3 q, k, v with float32 dequantisation factors (the real tensor is descale * the stored
values), one per tensor ([] or [1]) or one per (batch, kv head) ([batch, heads_k]); out is
bfloat16 (or float16 with out_dtype), lse float32. Also packed varlen sequences
(flash_attn_varlen_func; the descales' batch is then the sequences'). Hopper GPUs only;
forward only.
"""
from typing import Optional, Tuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3 value: quantisation saturates there


def is_fp8(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype is FP8_DTYPE


class _NoBackward(torch.autograd.Function):
    """Passes the FP8 forward's output through and raises if a backward reaches it."""

    @staticmethod
    def forward(ctx, out, *inputs):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("flash_attn_ext: the FP8 forward has no backward; run it under "
                                  "torch.no_grad() / torch.inference_mode(), or train in bf16")


def flash_attn_fp8(q, k, v, softmax_scale: float, causal: bool, q_descale, k_descale,
                   v_descale, out_dtype: Optional[torch.dtype], varlen=None):
    """(out, lse) of e4m3 q, k, v [batch, seqlen, heads(_k), head_dim], or with varlen =
    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) packed [total, heads(_k),
    head_dim] (lse [heads, total_q]); the checks that need no kernel run here, the rest in
    the operators (csrc/ops_fp8.h)."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if not is_fp8(t):
            raise RuntimeError(
                f"flash_attn_ext: FP8 attention needs q, k and v in torch.float8_e4m3fn, but "
                f"{name} is {t.dtype} (mixing FP8 and 16-bit inputs is supported for an FP8 KV "
                "cache in flash_attn_with_kvcache only)")
    missing = [n for n, d in (("q_descale", q_descale), ("k_descale", k_descale),
                              ("v_descale", v_descale)) if d is None]
    if missing:
        raise ValueError(
            f"flash_attn_ext: FP8 inputs need q_descale, k_descale and v_descale (float32, shape "
            f"[] / [1] or [batch, heads_k]); missing {', '.join(missing)}. Pass "
            "torch.ones((), device=q.device) for a tensor stored unscaled.")
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"flash_attn_ext: out_dtype must be torch.bfloat16 or torch.float16 for "
                         f"FP8 inputs, got {out_dtype}")
    if varlen is None:
        out, lse = torch.ops.flash_attn_ext.fwd_fp8(q, k, v, q_descale, k_descale, v_descale,
                                                    softmax_scale, causal, True, out_dtype)
    else:
        out, lse = torch.ops.flash_attn_ext.varlen_fwd_fp8(q, k, v, *varlen, q_descale,
                                                           k_descale, v_descale, softmax_scale,
                                                           causal, out_dtype)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out = _NoBackward.apply(out, q, k, v)
    return out, lse


def quantize_fp8(x: torch.Tensor, per_head: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [batch, seqlen, heads, head_dim] (any float dtype) -> (e4m3 tensor, float32 descale)
    with descale = amax / 448 per tensor (shape [1]) or, with per_head, per (batch, head)
    ([batch, heads]; pass k / v's heads for k_descale / v_descale), so that
    descale * x_fp8 ~= x. Rounds to nearest and saturates."""
    if x.dim() != 4:
        raise RuntimeError(f"flash_attn_ext: quantize_fp8 expects [batch, seqlen, heads, "
                           f"head_dim], got shape {tuple(x.shape)}")
    xf = x.float()
    amax = xf.abs().amax(dim=(1, 3)) if per_head else xf.abs().amax().reshape(1)
    descale = (amax / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    scale = (1.0 / descale)[:, None, :, None] if per_head else 1.0 / descale
    x8 = (xf * scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return x8, descale


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """x @ H / sqrt(n) over the last dim (n a power of two): the orthonormal Walsh-Hadamard
    rotation. Applied to both q and k it leaves q . k unchanged and spreads outlier channels
    over all channels before FP8 quantisation (FlashAttention-3's incoherent processing)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"flash_attn_ext: hadamard_transform needs a power-of-two last dim, "
                         f"got {n}")
    y = x.float().reshape(-1, n)
    h = 1
    while h < n:
        y = y.reshape(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(x.shape) * n ** -0.5).to(x.dtype)
