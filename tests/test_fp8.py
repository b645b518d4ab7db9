"""The FP8 (e4m3) forward: flash_attn_func(q, k, v, q_descale=, k_descale=, v_descale=).

Accuracy rule: against a float64 reference on the *dequantised* inputs, our RMSE is at most
1.5x that of the same computation done by PyTorch at the kernel's precision (scores and
sums in float64, the probabilities rounded to e4m3 for P V as the kernel does,
fp8_p_reference). Rounding P to e4m3 (3 mantissa bits) is what FP8 attention costs: that
error is about 4x the error of a bfloat16 computation on the same inputs, which the tests
print and bound loosely (FlashAttention-3's FP8 forward makes the same trade). The CPU tests
check the argument handling (the CPU raises NotImplementedError); the GPU tests need a
Hopper GPU and a build with an sm_90a target.
"""
import math

import pytest
import torch

import flash_attn_ext as fa
from flash_attn_ext.fp8 import hadamard_transform, quantize_fp8
from helpers import gqa_attention

FP8 = torch.float8_e4m3fn


def fp8_inputs(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, device, per_head=False,
               seed=0, outliers=False):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def one(seqlen, h):
        x = torch.randn((batch, seqlen, h, head_dim), generator=gen)
        if outliers:  # a few channels 20x larger, as in LLM activations
            x[..., :: max(1, head_dim // 4)] *= 20.0
        return x.to(device)

    q, k, v = one(seqlen_q, heads), one(seqlen_k, heads_k), one(seqlen_k, heads_k)
    return q, k, v


def quantize_all(q, k, v, per_head):
    heads_k = k.shape[2]
    if per_head:  # q's factors are per kv head too (FA3): quantise q per kv-head group
        group = q.shape[2] // heads_k
        qg = q.reshape(q.shape[0], q.shape[1], heads_k, group * q.shape[3])
        q8, qd = quantize_fp8(qg, per_head=True)
        q8 = q8.reshape(q.shape)
    else:
        q8, qd = quantize_fp8(q)
    k8, kd = quantize_fp8(k, per_head=per_head)
    v8, vd = quantize_fp8(v, per_head=per_head)
    return (q8, k8, v8), (qd, kd, vd)


def dequantize(x8, d, heads_k):
    x = x8.float()
    if d.dim() == 2:  # [batch, heads_k]: head h uses kv head h // group
        group = x.shape[2] // heads_k
        x = x * d.repeat_interleave(group, dim=1)[:, None, :, None]
    else:
        x = x * d
    return x


def fp8_p_reference(q, k, v, causal):
    """Attention of float64 [B, S, H(_k), D] inputs with the probabilities (relative to the
    row max, times 2^8 as the kernel scales them) rounded to e4m3 before P V, the row sums
    from the unrounded ones: the kernel's computation (up to its per-tile running max)."""
    group = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(group, dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m) * 256.0
    l = p.sum(-1, keepdim=True)
    p8 = p.to(FP8).double()
    out = torch.einsum("bhqk,bkhd->bqhd", p8, v) / l.clamp_min(1e-300).transpose(1, 2)
    return out


def rmse(a, b):
    return (a.double() - b.double()).pow(2).mean().sqrt().item()


# ---- argument handling (every device; the CPU raises NotImplementedError) -----------------
def test_cpu_not_implemented():
    q, k, v = fp8_inputs(1, 8, 8, 2, 2, 64, "cpu")
    (q8, k8, v8), (qd, kd, vd) = quantize_all(q, k, v, False)
    with pytest.raises(NotImplementedError, match="Hopper"):
        fa.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)


def test_bad_arguments():
    q, k, v = fp8_inputs(2, 8, 8, 4, 2, 64, "cpu")
    (q8, k8, v8), (qd, kd, vd) = quantize_all(q, k, v, True)
    with pytest.raises(ValueError, match="missing k_descale"):
        fa.flash_attn_func(q8, k8, v8, q_descale=qd, v_descale=vd)
    with pytest.raises(ValueError, match="missing q_descale, k_descale, v_descale"):
        fa.flash_attn_func(q8, k8, v8)
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        fa.flash_attn_func(q8, k.bfloat16(), v8, q_descale=qd, k_descale=kd, v_descale=vd)
    with pytest.raises(ValueError, match="FP8"):
        fa.flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), k_descale=kd)
    with pytest.raises(ValueError, match="out_dtype"):
        fa.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                           out_dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r"\[batch, heads_k\]"):
        fa.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=torch.ones(3), v_descale=vd)
    with pytest.raises(RuntimeError, match="float32"):
        fa.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd.double(), v_descale=vd)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        q9, k9, v9 = (torch.zeros(1, 4, 2, 40, dtype=FP8) for _ in range(3))
        fa.flash_attn_func(q9, k9, v9, q_descale=qd[:1, :1], k_descale=kd[:1, :1],
                           v_descale=vd[:1, :1])
    for kwargs in ({"window_size": (4, 0)}, {"softcap": 30.0}, {"dropout_p": 0.1}):
        with pytest.raises(NotImplementedError, match="FP8"):
            fa.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, **kwargs)
    # Varlen: the same checks (descales per sequence), then the options it does not take.
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="missing q_descale"):
        fa.flash_attn_varlen_func(q8[0], k8[0], v8[0], cu, cu, 5, 5)
    with pytest.raises(RuntimeError, match=r"\[batch, heads_k\] = \[2, 2\]"):
        fa.flash_attn_varlen_func(q8[0], k8[0], v8[0], cu, cu, 5, 5, q_descale=qd,
                                  k_descale=torch.ones(1, 2), v_descale=vd)
    with pytest.raises(RuntimeError, match="3-D"):
        fa.flash_attn_varlen_func(q8, k8, v8, cu, cu, 5, 5, q_descale=qd, k_descale=kd,
                                  v_descale=vd)
    with pytest.raises(RuntimeError, match="max_seqlen_q"):
        fa.flash_attn_varlen_func(q8[0], k8[0], v8[0], cu, cu, 4, 5, q_descale=qd, k_descale=kd,
                                  v_descale=vd)
    with pytest.raises(ValueError, match="FP8"):
        fa.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 5, 5, k_descale=kd)
    for kwargs in ({"softcap": 30.0}, {"seqused_k": torch.tensor([1, 2], dtype=torch.int32)}):
        with pytest.raises(NotImplementedError, match="FP8"):
            fa.flash_attn_varlen_func(q8[0], k8[0], v8[0], cu, cu, 5, 5, q_descale=qd,
                                      k_descale=kd, v_descale=vd, **kwargs)
    with pytest.raises(NotImplementedError, match="Hopper"):  # the CPU
        fa.flash_attn_varlen_func(q8[0], k8[0], v8[0], cu, cu, 5, 5, q_descale=qd, k_descale=kd,
                                  v_descale=vd)


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q8 = torch.empty(2, 33, 8, 128, dtype=FP8)
        k8 = torch.empty(2, 40, 2, 128, dtype=FP8)
        d = torch.ones(())
        out, lse = torch.ops.flash_attn_ext.fwd_fp8(q8, k8, k8, d, d, d, 0.1, True, True,
                                                    torch.float16)
    assert out.shape == (2, 33, 8, 128) and out.dtype == torch.float16
    assert lse.shape == (2, 8, 33) and lse.dtype == torch.float32
    with FakeTensorMode():
        q8 = torch.empty(70, 8, 128, dtype=FP8)
        k8 = torch.empty(90, 2, 128, dtype=FP8)
        cu = torch.empty(4, dtype=torch.int32)
        d = torch.ones(())
        out, lse = torch.ops.flash_attn_ext.varlen_fwd_fp8(q8, k8, k8, cu, cu, 40, 50, d, d, d,
                                                           0.1, True, torch.bfloat16)
    assert out.shape == (70, 8, 128) and out.dtype == torch.bfloat16
    assert lse.shape == (8, 70) and lse.dtype == torch.float32


def test_quantize_and_hadamard():
    x = torch.randn(2, 16, 4, 64) * 3
    x8, d = quantize_fp8(x)
    assert x8.dtype == FP8 and d.shape == (1,)
    assert (x8.float() * d - x).abs().max() <= 0.07 * x.abs().max()  # e4m3: 3 mantissa bits
    x8, d = quantize_fp8(x, per_head=True)
    assert d.shape == (2, 4)
    y = hadamard_transform(x)
    torch.testing.assert_close(hadamard_transform(y), x, atol=1e-5, rtol=1e-5)  # H H = I
    torch.testing.assert_close((y * y).sum(-1), (x * x).sum(-1), atol=1e-3, rtol=1e-5)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_transform(torch.zeros(2, 48))


# ---- GPU -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hopper():
    from conftest import cuda_ready
    if not cuda_ready():
        pytest.skip("needs a CUDA GPU and a CUDA build")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FP8 forward needs a compute capability 9.0 GPU")


def check_fp8_call(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, causal, per_head,
                   out_dtype=torch.bfloat16, layout="bshd", outliers=False, rotate=False):
    q, k, v = fp8_inputs(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, "cuda",
                         outliers=outliers)
    if rotate:
        q, k = hadamard_transform(q), hadamard_transform(k)
    (q8, k8, v8), (qd, kd, vd) = quantize_all(q, k, v, per_head)
    qf, kf, vf = (dequantize(x, d, heads_k) for x, d in ((q8, qd), (k8, kd), (v8, vd)))
    if layout == "bhsd":  # strided views: [B, H, S, D] memory seen as [B, S, H, D]
        q8, k8, v8 = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q8, k8, v8))
    out, lse = fa.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd,
                                  v_descale=vd, out_dtype=out_dtype, return_lse=True)
    assert out.dtype == out_dtype and out.shape == q.shape
    ref, ref_lse = gqa_attention(qf.double(), kf.double(), vf.double(), causal)
    same, _ = fp8_p_reference(qf.double(), kf.double(), vf.double(), causal), None
    bf16, _ = gqa_attention(qf.bfloat16(), kf.bfloat16(), vf.bfloat16(), causal)
    assert torch.isfinite(out).all()
    err, same_err, bf16_err = rmse(out, ref), rmse(same, ref), rmse(bf16, ref)
    print(f"RMSE {err:.3e}: {err / same_err:.2f}x the e4m3-P computation's, "
          f"{err / bf16_err:.2f}x bfloat16's")
    assert err <= 1.5 * same_err + 1e-4, f"RMSE {err:.3e} > 1.5 x e4m3-P's {same_err:.3e}"
    assert err <= 8 * bf16_err + 1e-4, f"RMSE {err:.3e} > 8 x bfloat16's {bf16_err:.3e}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], atol=2e-2, rtol=0)
    # Rows without any key (causal, seqlen_q > seqlen_k): zeros.
    assert (out.transpose(1, 2)[~finite] == 0).all()
    return err, bf16_err


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(128, 128), (1, 300), (257, 999), (700, 333)])
def test_values(hopper, head_dim, causal, seqlens):
    check_fp8_call(2, *seqlens, 4, 4, head_dim, causal, per_head=False)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_gqa_per_head_descale(hopper, head_dim, causal, out_dtype, layout):
    check_fp8_call(3, 333, 1055, 8, 2, head_dim, causal, per_head=True, out_dtype=out_dtype,
                   layout=layout)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [48, 96, 160])
def test_padded_head_dims(hopper, head_dim):
    check_fp8_call(1, 200, 200, 2, 1, head_dim, True, per_head=False)


@pytest.mark.gpu
def test_long_and_mqa(hopper):
    check_fp8_call(1, 4096, 4096, 8, 1, 128, True, per_head=True)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_v_transposed_in_kernel_or_by_the_pass(hopper, causal):
    """Short calls transpose V inside the kernel, longer ones in a pass before it
    (fwd_fp8_transposes_v: up to 2048 query rows per kv head, causal rows counting half).
    One row more crosses over; the rows both calls share are equal bit for bit (the same
    products, only V^T's producer differs), and the longer call is checked as usual."""
    rows = 2048 if not causal else 4096
    total = rows + (2 if causal else 1)  # (4097 causal rows still count 2048)
    check_fp8_call(1, total, total, 2, 2, 128, causal, per_head=False)
    q, k, v = fp8_inputs(1, total, total, 2, 2, 128, "cuda")
    (q8, k8, v8), (qd, kd, vd) = quantize_all(q, k, v, False)
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=causal)
    by_pass = fa.flash_attn_func(q8, k8, v8, **kw)
    if causal:  # the first rows see the first keys only: drop the last key as well
        k8, v8 = k8[:, :rows], v8[:, :rows]
    in_kernel = fa.flash_attn_func(q8[:, :rows], k8, v8, **kw)
    torch.testing.assert_close(in_kernel, by_pass[:, :rows], atol=0, rtol=0)


@pytest.mark.gpu
def test_outliers_with_and_without_rotation(hopper):
    # Outlier channels make the scores large: then the error of the tensor cores' FP8
    # accumulation (not fp32 inside a wgmma) shows next to P's rounding, and the e4m3-P rule
    # does not apply; both stay well below a bfloat16 computation's error (whose rounded
    # scores are off by as much). Printed for the report: with and without rotation.
    results = []
    for rotate in (False, True):
        q, k, v = fp8_inputs(1, 512, 512, 4, 4, 128, "cuda", outliers=True)
        if rotate:
            q, k = hadamard_transform(q), hadamard_transform(k)
        (q8, k8, v8), (qd, kd, vd) = quantize_all(q, k, v, True)
        qf, kf, vf = (dequantize(x, d, 4) for x, d in ((q8, qd), (k8, kd), (v8, vd)))
        out = fa.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
        # Against the un-quantised inputs: what a user sees, quantisation included.
        exact, _ = gqa_attention(q.double(), k.double(), v.double(), False)
        ref, _ = gqa_attention(qf.double(), kf.double(), vf.double(), False)
        bf16, _ = gqa_attention(qf.bfloat16(), kf.bfloat16(), vf.bfloat16(), False)
        assert torch.isfinite(out).all()
        assert rmse(out, ref) <= 2 * rmse(bf16, ref) + 1e-4
        results.append((rmse(out, exact), rmse(out, ref)))
    print(f"outliers: RMSE vs the exact inputs {results[0][0]:.3e} plain, {results[1][0]:.3e} "
          f"Hadamard-rotated (vs the dequantised inputs {results[0][1]:.3e} / "
          f"{results[1][1]:.3e})")


@pytest.mark.gpu
def test_no_backward_and_compile(hopper):
    q, k, v = fp8_inputs(1, 64, 64, 2, 2, 128, "cuda")
    (q8, k8, v8), (qd, kd, vd) = quantize_all(q, k, v, False)
    q8.requires_grad_(True)
    out = fa.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    with pytest.raises(NotImplementedError, match="no backward"):
        out.float().sum().backward()
    q8 = q8.detach()
    eager = fa.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
    compiled = torch.compile(fa.flash_attn_func, fullgraph=True)(
        q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
def test_varlen(hopper, head_dim, causal, per_head):
    """Packed sequences (shorter and longer than a tile, empty ones, GQA), NaN in the rows
    past cu_seqlens[-1], descales per tensor or per (sequence, kv head): every sequence's
    out and lse equal, bit for bit, those of a padded call on that sequence alone (the same
    tiles from the sequence's first row; the padded path is checked against references
    above), and the rows past the sequences are zeros / -inf."""
    lens_q, lens_k = [0, 1, 63, 200, 128, 77, 5, 300], [5, 0, 63, 129, 300, 77, 1, 257]
    heads, heads_k, pad = 4, 2, 9
    gen = torch.Generator(device="cpu").manual_seed(3)
    packed = [torch.randn(sum(n) + pad, h, head_dim, generator=gen).to(FP8).cuda()
              for n, h in ((lens_q, heads), (lens_k, heads_k), (lens_k, heads_k))]
    for t in packed:
        t[-pad:] = float("nan")
    q8, k8, v8 = packed
    cu_q, cu_k = (torch.tensor([0] + n, dtype=torch.int64).cumsum(0).to(torch.int32).cuda()
                  for n in (lens_q, lens_k))
    batch = len(lens_q)
    if per_head:
        qd, kd, vd = (torch.rand(batch, heads_k, generator=gen).cuda() + 0.5 for _ in range(3))
    else:
        qd, kd, vd = (torch.full((1,), 0.7 + 0.1 * i).cuda() for i in range(3))
    out, lse = fa.flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, max(lens_q), max(lens_k),
                                         causal=causal, q_descale=qd, k_descale=kd,
                                         v_descale=vd, return_lse=True)
    rows = sum(lens_q)
    assert out.shape == q8.shape and out.dtype == torch.bfloat16 and lse.shape == (heads, q8.shape[0])
    assert (out[rows:] == 0).all() and (lse[:, rows:] == float("-inf")).all()
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for b in range(batch):
        sq = slice(starts_q[b], starts_q[b + 1])
        sk = slice(starts_k[b], starts_k[b + 1])
        if lens_q[b] == 0:
            continue
        d = [x[b:b + 1] if per_head else x for x in (qd, kd, vd)]
        if lens_k[b] == 0:
            assert (out[sq] == 0).all() and (lse[:, sq] == float("-inf")).all()
            continue
        o, l = fa.flash_attn_func(q8[sq][None], k8[sk][None], v8[sk][None], causal=causal,
                                  q_descale=d[0], k_descale=d[1], v_descale=d[2],
                                  return_lse=True)
        assert torch.equal(out[sq], o[0]), b
        assert torch.equal(lse[:, sq], l[0]), b
