"""FlashAttention's accuracy rule, shared by the numerical tests.

Our error against a float64 reference must be at most `factor` times the error of the
same computation done naively by PyTorch at the input precision, plus a small atol
(factor 2 for outputs, 3 for gradients).
"""
import torch

from flash_attn_ext import attention_ref


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def assert_fa_rule(ours, ref64, same_precision, factor, atol=1e-5, what="out"):
    assert torch.isfinite(ours).all(), f"{what}: non-finite values"
    err = max_err(ours, ref64)
    base = max_err(same_precision, ref64)
    assert err <= factor * base + atol, (
        f"{what}: max error {err:.3e} > {factor} x same-precision error {base:.3e} + {atol:.0e}")


def make_qkv(batch, seqlen_q, seqlen_k, heads, head_dim, dtype, device, layout="bshd",
             requires_grad=True, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def one(seqlen):
        shape = (batch, seqlen, heads, head_dim) if layout == "bshd" else (batch, heads, seqlen, head_dim)
        t = torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
        return t.requires_grad_(requires_grad)

    return one(seqlen_q), one(seqlen_k), one(seqlen_k)


def reference_and_baseline(q, k, v, dout, causal, bottom_right, layout="bshd", scale=None):
    """Returns ((out, dq, dk, dv) in float64, same in the input precision)."""
    results = []
    for upcast_dtype in (torch.float64, None):
        leaves = [t.detach().to(upcast_dtype or t.dtype).requires_grad_() for t in (q, k, v)]
        out = attention_ref(*leaves, softmax_scale=scale, causal=causal,
                            causal_bottom_right=bottom_right, upcast=False, layout=layout)
        grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
        results.append((out, *grads))
    return results


def kernel_names(fn):
    """Names of the CUDA kernels that fn() launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
