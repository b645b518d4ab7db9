"""Loads the native operators and makes them autograd- and compile-friendly.

torch.ops.flash_attn_ext.fwd(q, k, v, softmax_scale, causal, causal_bottom_right, num_splits=0,
                             tile=0) -> (out, lse)
torch.ops.flash_attn_ext.bwd(dout, q, k, v, out, lse, softmax_scale, causal,
                             causal_bottom_right, deterministic=False) -> (dq, dk, dv)

All tensors are [batch, seqlen, heads, head_dim] with a contiguous last dim; lse is
float32 [batch, heads, seqlen_q]. This module registers the fake (meta) kernels used by
torch.compile / FakeTensor, and FlashAttnFunction, the torch.autograd.Function that the
public API (interface.py) goes through.
"""
import torch

try:
    from . import _C  # noqa: F401  (loading the library registers the operators)
except ImportError as e:  # pragma: no cover - only on broken installs
    raise ImportError(
        "flash_attn_ext: the native extension flash_attn_ext._C could not be loaded "
        f"({e}). Build it with `pip install --no-build-isolation .` against the torch "
        "you are running (the extension is tied to the torch version it was built with).") from e

from . import autotune  # noqa: E402

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def has_cuda_kernels() -> bool:
    """True when this build contains the CUDA kernels."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("flash_attn_ext::fwd", "CUDA")


def _check_bshd(t, name):
    if t.dim() != 4:
        raise RuntimeError(f"flash_attn_ext: {name} must be a 4-D tensor [batch, seqlen, heads, "
                           f"head_dim], got {t.dim()}-D with shape {tuple(t.shape)}")
    if t.dtype not in _SUPPORTED_DTYPES:
        raise RuntimeError(f"flash_attn_ext: {name} has dtype {t.dtype}; expected float32, "
                           "float16 or bfloat16")


def _check_qkv(q, k, v):
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_bshd(t, name)
    for t, name in ((k, "k"), (v, "v")):
        if t.dtype != q.dtype:
            raise RuntimeError(f"flash_attn_ext: q and {name} must have the same dtype, got "
                               f"{q.dtype} and {t.dtype}")
        if t.device != q.device:
            raise RuntimeError(f"flash_attn_ext: q and {name} must be on the same device, got "
                               f"{q.device} and {t.device}")
    if k.shape != v.shape:
        raise RuntimeError(f"flash_attn_ext: k and v must have the same shape, got "
                           f"{tuple(k.shape)} and {tuple(v.shape)}")
    torch._check(q.shape[0] == k.shape[0], lambda: "flash_attn_ext: q and k must have the same batch size")
    torch._check(q.shape[2] == k.shape[2], lambda: "flash_attn_ext: q and k/v must have the same number of heads")
    torch._check(q.shape[3] == k.shape[3], lambda: "flash_attn_ext: q, k and v must have the same head_dim")


@torch.library.register_fake("flash_attn_ext::fwd")
def _fwd_fake(q, k, v, softmax_scale, causal, causal_bottom_right, num_splits=0, tile=0):
    _check_qkv(q, k, v)
    out = torch.empty_like(q)
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return out, lse


@torch.library.register_fake("flash_attn_ext::bwd")
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, causal_bottom_right,
              deterministic=False):
    _check_qkv(q, k, v)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


class FlashAttnFunction(torch.autograd.Function):
    """out, lse = FlashAttnFunction.apply(q, k, v, softmax_scale, causal, causal_bottom_right,
    deterministic, num_splits, tile). lse is returned but not differentiable.

    num_splits = 0 and tile = 0 mean "choose": by the built-in heuristics, or by timing
    when the autotuner is on (flash_attn_ext.autotune)."""

    @staticmethod
    def forward(q, k, v, softmax_scale, causal, causal_bottom_right, deterministic, num_splits,
                tile):
        q, k, v = [_last_dim_contiguous(t) for t in (q, k, v)]
        if num_splits == 0 and tile == 0 and autotune.is_enabled():
            num_splits, tile = autotune.choose_forward_config(q, k, v, softmax_scale, causal,
                                                              causal_bottom_right)
        return torch.ops.flash_attn_ext.fwd(q, k, v, softmax_scale, causal, causal_bottom_right,
                                            num_splits, tile)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, softmax_scale, causal, causal_bottom_right, deterministic, _, _ = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.softmax_scale = softmax_scale
        ctx.causal = causal
        ctx.causal_bottom_right = causal_bottom_right
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        q, k, v, dout = [_last_dim_contiguous(t) for t in (q, k, v, dout)]
        dq, dk, dv = torch.ops.flash_attn_ext.bwd(dout, q, k, v, out, lse, ctx.softmax_scale,
                                                  ctx.causal, ctx.causal_bottom_right,
                                                  ctx.deterministic)
        return dq, dk, dv, None, None, None, None, None, None
