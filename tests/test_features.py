"""GQA / MQA, key padding (seqused_k), variable-length batches (flash_attn_varlen_func) and
the KV-cache entry point (flash_attn_with_kvcache): values and gradients against float64
references with FlashAttention's accuracy rule (tests/helpers.py), on CPU and (marked gpu)
CUDA, plus the bad-input errors of the new entry points and opcheck of the new operators."""
import math

import pytest
import torch

import flash_attn_ext as fa
from helpers import (capture_cuda_graph, check_lse, check_out_and_grads, gqa_attention,
                     make_varlen, padded_attention, randn, ref_and_base, varlen_attention)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ---- GQA / MQA -------------------------------------------------------------------
HEADS = [(4, 4), (4, 2), (16, 2), (5, 1)]  # (heads, kv heads): ratios 1, 2, 8 and MQA
HEAD_IDS = ["mha", "gqa2", "gqa8", "mqa"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(47, 47), (37, 61), (61, 37)])
def test_gqa_flash_attn_func(device, dtype, causal, heads, kv_heads, seqlen_q, seqlen_k):
    batch, head_dim = 2, 64
    q = randn((batch, seqlen_q, heads, head_dim), dtype, device, 1, True)
    k = randn((batch, seqlen_k, kv_heads, head_dim), dtype, device, 2, True)
    v = randn((batch, seqlen_k, kv_heads, head_dim), dtype, device, 3, True)
    out, lse = fa.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert out.shape == q.shape and lse.shape == (batch, heads, seqlen_q)
    dout = randn(out.shape, dtype, device, 4)
    ref, base = ref_and_base(lambda q, k, v: gqa_attention(q, k, v, causal), (q, k, v), dout)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert grads[1].shape == k.shape and grads[2].shape == v.shape
    check_out_and_grads(out, grads, ref, base, dtype)
    check_lse(lse, ref[1], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads", HEADS[1:], ids=HEAD_IDS[1:])
def test_gqa_sdpa(device, dtype, is_causal, heads, kv_heads):
    """torch's [B, H, S, D] layout, causal top-left, enable_gqa=True."""
    for seqlen_q, seqlen_k in ((37, 61), (61, 37)):
        q = randn((2, heads, seqlen_q, 32), dtype, device, 5, True)
        k = randn((2, kv_heads, seqlen_k, 32), dtype, device, 6, True)
        v = randn((2, kv_heads, seqlen_k, 32), dtype, device, 7, True)
        out = fa.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
        assert out.shape == q.shape
        dout = randn(out.shape, dtype, device, 8)
        ref, base = ref_and_base(
            lambda q, k, v: gqa_attention(q, k, v, is_causal, bottom_right=False, layout="bhsd"),
            (q, k, v), dout)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        assert grads[1].shape == k.shape and grads[2].shape == v.shape
        check_out_and_grads(out, grads, ref, base, dtype)
        if dtype == torch.float32:
            theirs = torch.nn.functional.scaled_dot_product_attention(
                q.detach(), k.detach(), v.detach(), is_causal=is_causal, enable_gqa=True)
            torch.testing.assert_close(out.detach(), theirs, atol=1e-4, rtol=1e-4)


def test_gqa_sdpa_needs_enable_gqa(device):
    q = randn((1, 4, 8, 16), torch.float32, device, 0)
    k = randn((1, 2, 8, 16), torch.float32, device, 1)
    with pytest.raises(RuntimeError, match="(?i)heads|enable_gqa"):
        fa.scaled_dot_product_attention(q, k, k)
    # enable_gqa=True with as many kv heads as query heads is plain attention
    k4 = randn((1, 4, 8, 16), torch.float32, device, 2)
    torch.testing.assert_close(fa.scaled_dot_product_attention(q, k4, k4, enable_gqa=True),
                               fa.scaled_dot_product_attention(q, k4, k4), atol=0, rtol=0)


def test_gqa_heads_not_divisible(device):
    q = randn((1, 8, 6, 16), torch.float32, device, 0)
    k = randn((1, 8, 4, 16), torch.float32, device, 1)
    with pytest.raises(RuntimeError, match="heads"):
        fa.flash_attn_func(q, k, k)
    with pytest.raises(RuntimeError, match="heads"):
        fa.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2),
                                        enable_gqa=True)


def test_gqa_matches_repeated_heads(device):
    """GQA == attention with k/v heads explicitly repeated; dk/dv are the repeated heads'
    gradients summed over each group, with k/v's shape."""
    q = randn((2, 33, 6, 32), torch.float32, device, 0, True)
    k = randn((2, 45, 2, 32), torch.float32, device, 1, True)
    v = randn((2, 45, 2, 32), torch.float32, device, 2, True)
    out = fa.flash_attn_func(q, k, v, causal=True)
    k_rep, v_rep = (t.detach().repeat_interleave(3, dim=2).requires_grad_() for t in (k, v))
    out_rep = fa.flash_attn_func(q.detach(), k_rep, v_rep, causal=True)
    torch.testing.assert_close(out, out_rep, atol=1e-5, rtol=1e-5)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    dk_rep, dv_rep = torch.autograd.grad(out_rep, (k_rep, v_rep), dout)
    torch.testing.assert_close(dk, dk_rep.unflatten(2, (2, 3)).sum(3), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dv, dv_rep.unflatten(2, (2, 3)).sum(3), atol=1e-4, rtol=1e-4)


# ---- key padding: seqused_k ----------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q", [23, 50])
@pytest.mark.parametrize("heads,kv_heads", [(3, 3), (4, 2)], ids=["mha", "gqa2"])
def test_seqused_k(device, dtype, causal, seqlen_q, heads, kv_heads):
    batch, seqlen_k, head_dim = 5, 41, 64
    used = torch.tensor([0, 1, seqlen_k, 17, 30], dtype=torch.int32, device=device)
    q = randn((batch, seqlen_q, heads, head_dim), dtype, device, 11, True)
    k = randn((batch, seqlen_k, kv_heads, head_dim), dtype, device, 12, True)
    v = randn((batch, seqlen_k, kv_heads, head_dim), dtype, device, 13, True)
    out, lse = fa.flash_attn_func(q, k, v, causal=causal, seqused_k=used, return_lse=True)
    dout = randn(out.shape, dtype, device, 14)
    ref, base = ref_and_base(lambda q, k, v: padded_attention(q, k, v, causal, used), (q, k, v), dout)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    check_out_and_grads(out, (dq, dk, dv), ref, base, dtype)
    check_lse(lse, ref[1], dtype)
    # batch 0 sees no key: zeros, lse -inf, zero dq
    assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf")) and torch.all(dq[0] == 0)
    for b, n in enumerate(used.tolist()):
        assert torch.all(dk[b, n:] == 0) and torch.all(dv[b, n:] == 0), f"batch {b}: grads past seqused_k"


def test_seqused_k_ignores_padding_values(device):
    """Keys past seqused_k never reach the result, even when they hold inf / nan."""
    used = torch.tensor([5, 12], dtype=torch.int32, device=device)
    q = randn((2, 7, 2, 16), torch.float32, device, 0)
    k = randn((2, 12, 2, 16), torch.float32, device, 1)
    v = randn((2, 12, 2, 16), torch.float32, device, 2)
    expected = fa.flash_attn_func(q, k, v, causal=True, seqused_k=used)
    k2, v2 = k.clone(), v.clone()
    k2[0, 5:] = float("inf")
    v2[0, 5:] = float("nan")
    out = fa.flash_attn_func(q, k2, v2, causal=True, seqused_k=used)
    assert torch.equal(out, expected)
    torch.testing.assert_close(expected[1], fa.flash_attn_func(q[1:], k[1:], v[1:], causal=True)[0])


@pytest.mark.parametrize("bad,match", [
    (lambda d: torch.tensor([3, 4], device=d), "int32"),
    (lambda d: torch.tensor([3, 4, 5], dtype=torch.int32, device=d), "(?i)length|shape|batch"),
    (lambda d: torch.tensor([[3, 4]], dtype=torch.int32, device=d), "(?i)1-?d|length|shape"),
], ids=["int64", "wrong_length", "2d"])
def test_seqused_k_bad_inputs(device, bad, match):
    q = randn((2, 5, 2, 16), torch.float32, device, 0)
    k = randn((2, 8, 2, 16), torch.float32, device, 1)
    with pytest.raises(RuntimeError, match=match):
        fa.flash_attn_func(q, k, k, seqused_k=bad(device))


@pytest.mark.gpu
def test_seqused_k_other_device():
    q = randn((2, 5, 2, 16), torch.float32, "cuda", 0)
    k = randn((2, 8, 2, 16), torch.float32, "cuda", 1)
    with pytest.raises(RuntimeError, match="device"):
        fa.flash_attn_func(q, k, k, seqused_k=torch.tensor([3, 4], dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gqa_deterministic(device, dtype):
    """dk / dv sum over each group's query heads: still bit-reproducible with deterministic."""
    q = randn((2, 130, 8, 64), dtype, device, 0, True)
    k = randn((2, 300, 1, 64), dtype, device, 1, True)
    v = randn((2, 300, 1, 64), dtype, device, 2, True)
    used = torch.tensor([300, 77], dtype=torch.int32, device=device)
    out = fa.flash_attn_func(q, k, v, causal=True, deterministic=True, seqused_k=used)
    dout = randn(out.shape, dtype, device, 3)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    again = torch.autograd.grad(out, (q, k, v), dout)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


# ---- varlen ------------------------------------------------------------------------
LENS_Q = [0, 1, 63, 17, 128, 5]
LENS_K = [5, 0, 63, 40, 100, 1]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_varlen(device, dtype, causal, head_dim):
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(LENS_Q, LENS_K, 4, 2, head_dim, dtype, device)
    out, lse = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                         return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    dout = randn(out.shape, dtype, device, 21)
    ref, base = ref_and_base(lambda q, k, v: varlen_attention(q, k, v, cu_q, cu_k, causal),
                             (q, k, v), dout)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_out_and_grads(out, grads, ref, base, dtype)
    check_lse(lse, ref[1], dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_lse_and_scale(device, causal):
    """lse is the per-sequence natural-log logsumexp of the scaled scores; custom scale."""
    lens_q, lens_k = [3, 30, 0, 9], [7, 21, 4, 9]
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, 3, 3, 32, torch.float32,
                                                    device, requires_grad=False)
    out, lse = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=0.3,
                                         causal=causal, return_lse=True)
    ref_lse = []
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lens_q)):
        qs = q[starts_q[b]:starts_q[b + 1]].double()
        ks = k[starts_k[b]:starts_k[b + 1]].double()
        s = torch.einsum("qhd,khd->hqk", qs, ks) * 0.3
        if causal:
            i = torch.arange(qs.shape[0], device=device).view(-1, 1)
            j = torch.arange(ks.shape[0], device=device).view(1, -1)
            s = s.masked_fill(j > i + ks.shape[0] - qs.shape[0], float("-inf"))
        ref_lse.append(torch.logsumexp(s, dim=-1))
    check_lse(lse, torch.cat(ref_lse, dim=-1), torch.float32)
    ref_out, _ = varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k, causal, scale=0.3)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_varlen_matches_padded(device, dtype):
    """Equal lengths: varlen == the padded entry point on the same data."""
    q4 = randn((3, 29, 4, 64), dtype, device, 0)
    k4 = randn((3, 45, 2, 64), dtype, device, 1)
    v4 = randn((3, 45, 2, 64), dtype, device, 2)
    cu_q = torch.arange(0, 4 * 29, 29, dtype=torch.int32, device=device)
    cu_k = torch.arange(0, 4 * 45, 45, dtype=torch.int32, device=device)
    for causal in (False, True):
        ours = fa.flash_attn_varlen_func(q4.flatten(0, 1), k4.flatten(0, 1), v4.flatten(0, 1),
                                         cu_q, cu_k, 29, 45, causal=causal)
        padded = fa.flash_attn_func(q4, k4, v4, causal=causal)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(ours, padded.flatten(0, 1), atol=tol, rtol=tol)


def test_varlen_padding_rows(device):
    """Rows past cu_seqlens[-1] belong to no sequence: out is finite there, and the gradients
    of those q / k / v rows are zero."""
    lens_q, lens_k = [4, 11], [6, 13]
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, 2, 1, 32, torch.float32,
                                                    device, pad_q=5, pad_k=7)
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    assert out.shape == q.shape and torch.isfinite(out).all()
    dout = randn(out.shape, torch.float32, device, 3)
    dout[15:] = 0  # the padding rows' out is not defined: give them no gradient
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ref, base = ref_and_base(lambda q, k, v: varlen_attention(q, k, v, cu_q, cu_k, True),
                             (q, k, v), dout)
    check_out_and_grads(out, (dq, dk, dv), ref, base, torch.float32, rows=15)
    assert torch.all(dq[15:] == 0) and torch.all(dk[19:] == 0) and torch.all(dv[19:] == 0)


def test_varlen_no_queries(device):
    """Every query sequence empty (max_seqlen_q = 0), plus rows outside every sequence:
    nothing to attend, zeros / -inf out, zero gradients."""
    q, k, v, cu_q, cu_k, _, max_k = make_varlen([0, 0], [3, 0], 2, 2, 32, torch.float32, device,
                                                pad_q=2)
    out, lse = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 0, max_k, causal=True,
                                         return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 2)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert torch.all(dq == 0) and torch.all(dk == 0) and torch.all(dv == 0)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_seqused_k(device, causal):
    lens_q, lens_k = [9, 1, 20, 6], [12, 8, 25, 6]
    used = torch.tensor([12, 0, 13, 3], dtype=torch.int32, device=device)
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, 4, 2, 32, torch.float32, device)
    # max_seqlen_* only need to bound the longest sequence
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q + 3, max_k + 70, causal=causal,
                                    seqused_k=used)
    dout = randn(out.shape, torch.float32, device, 3)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ref, base = ref_and_base(
        lambda q, k, v: varlen_attention(q, k, v, cu_q, cu_k, causal, seqused_k=used), (q, k, v), dout)
    check_out_and_grads(out, (dq, dk, dv), ref, base, torch.float32)
    for b, n in enumerate(used.tolist()):
        start, end = cu_k[b].item() + n, cu_k[b + 1].item()
        assert torch.all(dk[start:end] == 0) and torch.all(dv[start:end] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_varlen_strided_packed_qkv(device, dtype):
    """q / k / v as views of one packed [total, 3, heads, head_dim] tensor (row stride
    3 * heads * head_dim), gradients through the packed tensor."""
    lens = [13, 0, 40, 7]
    cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    qkv = randn((sum(lens), 3, 2, 64), dtype, device, 5, True)
    q, k, v = qkv.unbind(1)
    assert not q.is_contiguous()
    out = fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    dout = randn(out.shape, dtype, device, 6)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    ref, base = ref_and_base(lambda q, k, v: varlen_attention(q, k, v, cu, cu, True), (q, k, v), dout)
    check_out_and_grads(out, dqkv.unbind(1), ref, base, dtype)


def test_gqa_kv_packed(device):
    """GQA with k / v as views of one packed [batch, seqlen, 2, heads_k, head_dim] tensor."""
    q = randn((2, 21, 6, 32), torch.float16, device, 0, True)
    kv = randn((2, 35, 2, 2, 32), torch.float16, device, 1, True)
    k, v = kv.unbind(2)
    out = fa.flash_attn_func(q, k, v, causal=True)
    dout = randn(out.shape, torch.float16, device, 2)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    ref, base = ref_and_base(lambda q, k, v: gqa_attention(q, k, v, True), (q, k, v), dout)
    check_out_and_grads(out, (dq, *dkv.unbind(2)), ref, base, torch.float16)


def test_varlen_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen([5, 0, 19], [8, 3, 11], 4, 2, 32,
                                                    torch.float32, device)

    def f(q, k, v):
        out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
        return (out * out).sum()

    loss = torch.compile(f, fullgraph=True)(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    loss_eager = f(q2, k2, v2)
    grads_eager = torch.autograd.grad(loss_eager, (q2, k2, v2))
    torch.testing.assert_close(loss, loss_eager)
    for g, ge in zip(grads, grads_eager):
        torch.testing.assert_close(g, ge)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen_deterministic(device, dtype):
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen([70, 3, 129], [90, 200, 31], 4, 1, 64, dtype,
                                                    device)
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                    deterministic=True)
    dout = randn(out.shape, dtype, device, 9)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    again = torch.autograd.grad(out, (q, k, v), dout)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    out2 = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                     deterministic=True)
    assert torch.equal(out, out2)


# ---- varlen: bad inputs --------------------------------------------------------------
def _varlen_inputs(device="cpu"):
    q = torch.randn(20, 4, 16, device=device)
    k = torch.randn(24, 2, 16, device=device)
    v = torch.randn(24, 2, 16, device=device)
    cu_q = torch.tensor([0, 5, 20], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 10, 24], dtype=torch.int32, device=device)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=15,
                max_seqlen_k=14)


def _i32(values, device="cpu"):
    return torch.tensor(values, dtype=torch.int32, device=device)


BAD_VARLEN = {
    "cu_q_int64": (dict(cu_seqlens_q=torch.tensor([0, 5, 20])), "int32"),
    "cu_k_int64": (dict(cu_seqlens_k=torch.tensor([0, 10, 24])), "int32"),
    "cu_q_2d": (dict(cu_seqlens_q=_i32([[0], [5], [20]])), r"(?i)1-?d|dim"),
    "cu_q_decreasing": (dict(cu_seqlens_q=_i32([0, 12, 5])), r"(?i)monoton|decreas|sorted|negative"),
    "cu_k_decreasing": (dict(cu_seqlens_k=_i32([0, 12, 11])), r"(?i)monoton|decreas|sorted|negative"),
    "cu_q_first_not_zero": (dict(cu_seqlens_q=_i32([2, 5, 20])), r"(?i)first|\[0\]|start|zero|begin|be 0"),
    "cu_k_first_not_zero": (dict(cu_seqlens_k=_i32([1, 10, 24])), r"(?i)first|\[0\]|start|zero|begin|be 0"),
    "cu_lengths_differ": (dict(cu_seqlens_q=_i32([0, 5, 10, 20])), r"(?i)length|size|same|batch|number"),
    "cu_q_past_total": (dict(cu_seqlens_q=_i32([0, 5, 21]), max_seqlen_q=16),
                        r"(?i)total|rows|exceed|last|\[-1\]|larger|greater|more than|out of"),
    "cu_k_past_total": (dict(cu_seqlens_k=_i32([0, 10, 25]), max_seqlen_k=15),
                        r"(?i)total|rows|exceed|last|\[-1\]|larger|greater|more than|out of"),
    "max_seqlen_q_small": (dict(max_seqlen_q=14), "max_seqlen_q"),
    "max_seqlen_k_small": (dict(max_seqlen_k=13), "max_seqlen_k"),
    "heads_not_divisible": (dict(k=torch.randn(24, 3, 16), v=torch.randn(24, 3, 16)), "heads"),
}


@pytest.mark.parametrize("case", list(BAD_VARLEN))
def test_varlen_bad_inputs_raise(case):
    changes, match = BAD_VARLEN[case]
    args = _varlen_inputs()
    args.update(changes)
    with pytest.raises(RuntimeError, match=match):
        fa.flash_attn_varlen_func(**args)


def test_varlen_valid_inputs_pass():
    """The baseline of the bad-input cases above is itself accepted."""
    out = fa.flash_attn_varlen_func(**_varlen_inputs())
    assert out.shape == (20, 4, 16)


# cu_seqlens' values: on a GPU they are checked only with FLASH_ATTN_EXT_DEBUG_CHECKS=1 (the
# check copies them to the host, a sync per call that also breaks CUDA graph capture); without
# it the kernels clamp every sequence into the packed rows and to max_seqlen.
BAD_CU_VALUES = ["cu_q_decreasing", "cu_k_decreasing", "cu_q_first_not_zero",
                 "cu_k_first_not_zero", "cu_q_past_total", "cu_k_past_total",
                 "max_seqlen_q_small", "max_seqlen_k_small"]


def _cuda_varlen_inputs(case, dtype, head_dim):
    base = _varlen_inputs()
    args = {name: base[name] for name in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                          "max_seqlen_k")}
    args.update(BAD_VARLEN[case][0])
    for name, rows, heads in (("q", 20, 4), ("k", 24, 2), ("v", 24, 2)):
        args[name] = torch.randn(rows, heads, head_dim, device="cuda").to(dtype).requires_grad_()
    args["cu_seqlens_q"] = args["cu_seqlens_q"].cuda()
    args["cu_seqlens_k"] = args["cu_seqlens_k"].cuda()
    return args


@pytest.mark.gpu
@pytest.mark.parametrize("case", BAD_CU_VALUES)
def test_cuda_varlen_bad_cu_values_debug_checks(case, monkeypatch):
    monkeypatch.setenv("FLASH_ATTN_EXT_DEBUG_CHECKS", "1")
    args = _cuda_varlen_inputs(case, torch.bfloat16, 64)
    with pytest.raises(RuntimeError, match=BAD_VARLEN[case][1]):
        fa.flash_attn_varlen_func(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float16, 128),
                                            (torch.float32, 32)], ids=str)
@pytest.mark.parametrize("case", BAD_CU_VALUES)
def test_cuda_varlen_bad_cu_values_unchecked(case, dtype, head_dim, monkeypatch):
    """Unchecked bad values give wrong rows, never an access outside the tensors (which would
    poison the CUDA context: the synchronize below would raise), forward and backward, and
    never a hang (the deterministic backward must not wait for a key tile that no CTA runs)."""
    monkeypatch.delenv("FLASH_ATTN_EXT_DEBUG_CHECKS", raising=False)
    args = _cuda_varlen_inputs(case, dtype, head_dim)
    for causal, deterministic in ((False, False), (True, False), (True, True)):
        out = fa.flash_attn_varlen_func(**args, causal=causal, deterministic=deterministic)
        grads = torch.autograd.grad(out, (args["q"], args["k"], args["v"]), torch.ones_like(out))
        torch.cuda.synchronize()
        assert out.shape == args["q"].shape and len(grads) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_varlen_overlapping_sequences(head_dim, monkeypatch):
    """cu_seqlens_k that go down and up again ([0, 1000, 0, 1000]): sequences 0 and 2 both
    take keys 0..999 (wrong gradients, as for any bad values), and the deterministic backward
    finishes instead of waiting for a key tile that no CTA runs."""
    monkeypatch.delenv("FLASH_ATTN_EXT_DEBUG_CHECKS", raising=False)
    q = torch.randn(30, 4, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1000, 2, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1000, 2, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu_q = torch.tensor([0, 10, 20, 30], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 1000, 0, 1000], dtype=torch.int32, device="cuda")
    for causal, deterministic in ((False, True), (True, True), (False, False)):
        out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 10, 1000, causal=causal,
                                        deterministic=deterministic)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        torch.cuda.synchronize()
        assert len(grads) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 128), (torch.float16, 64)], ids=str)
def test_cuda_varlen_graph_capture(dtype, head_dim, monkeypatch):
    """A varlen forward + backward captured in a CUDA graph (no host copy of cu_seqlens) and
    replayed on new values and new sequence boundaries equals eager calls, bit for bit
    (deterministic dQ); rows past the last sequence are zeros / -inf."""
    monkeypatch.delenv("FLASH_ATTN_EXT_DEBUG_CHECKS", raising=False)
    total, max_len = 300, 160
    boundaries = [[0, 7, 150, 150, 290], [0, 160, 161, 260, 300]]
    q_s = torch.zeros(total, 4, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    k_s = torch.zeros(total, 2, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    v_s = torch.zeros(total, 2, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    dout_s = torch.zeros(total, 4, head_dim, device="cuda", dtype=dtype)
    cu_s = torch.zeros(5, dtype=torch.int32, device="cuda")

    def step():
        out, lse = fa.flash_attn_varlen_func(q_s, k_s, v_s, cu_s, cu_s, max_len, max_len,
                                             causal=True, deterministic=True,
                                             return_lse=True)
        return (out, lse) + torch.autograd.grad(out, (q_s, k_s, v_s), dout_s)

    graph, replayed = capture_cuda_graph(step)
    for t, cu in enumerate(boundaries):
        with torch.no_grad():
            for x, seed in ((q_s, 1), (k_s, 2), (v_s, 3), (dout_s, 4)):
                x.copy_(randn(x.shape, dtype, "cuda", 10 * t + seed))
            cu_s.copy_(_i32(cu, "cuda"))
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), replayed, eager):
            assert torch.equal(a, b), f"replay {t}: {name}"
        last = cu[-1]
        assert torch.all(replayed[0][last:] == 0) and torch.all(replayed[1][:, last:] == -math.inf)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,heads,kv_heads", [
    (torch.bfloat16, 128, 4, 2), (torch.float16, 64, 2, 2), (torch.bfloat16, 96, 4, 1),
    (torch.float32, 64, 2, 1)], ids=str)
def test_cuda_varlen_grads_outside_sequences(dtype, head_dim, heads, kv_heads):
    """The backward writes the zero gradients of rows outside every sequence (past the last
    one, keys past seqused_k) itself, into uninitialised buffers: checked on memory the
    caching allocator hands back NaN-poisoned, against the reference inside the sequences."""
    lens_q, lens_k = [37, 0, 130, 5], [50, 9, 200, 1]
    used = _i32([50, 3, 129, 0], "cuda")
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, heads, kv_heads, head_dim,
                                                    dtype, "cuda", pad_q=11, pad_k=13)
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                    seqused_k=used)
    dout = randn(out.shape, dtype, "cuda", 3)
    dout[sum(lens_q):] = 0
    poison = torch.full((1 << 22,), float("nan"), device="cuda")
    del poison  # its block is what the gradients' allocations get next
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ref, base = ref_and_base(
        lambda q, k, v: varlen_attention(q, k, v, cu_q, cu_k, True, seqused_k=used), (q, k, v),
        dout)
    check_out_and_grads(out, (dq, dk, dv), ref, base, dtype, rows=sum(lens_q))
    assert torch.all(dq[sum(lens_q):] == 0)
    starts = cu_k[:-1] + used
    for b in range(len(lens_k)):
        gap = slice(starts[b].item(), cu_k[b + 1].item())
        assert torch.all(dk[gap] == 0) and torch.all(dv[gap] == 0), f"sequence {b}"
    assert torch.all(dk[sum(lens_k):] == 0) and torch.all(dv[sum(lens_k):] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("q_device,cu_name,cu_device", [
    ("cuda", "cu_seqlens_q", "cpu"), ("cuda", "cu_seqlens_k", "cpu"),
    ("cpu", "cu_seqlens_k", "cuda")])
def test_varlen_cu_seqlens_other_device(q_device, cu_name, cu_device):
    args = _varlen_inputs(q_device)
    args[cu_name] = args[cu_name].to(cu_device)
    with pytest.raises(RuntimeError, match="device"):
        fa.flash_attn_varlen_func(**args)


def test_varlen_block_table_needs_page_pools():
    """With a block_table, k / v are a paged cache's pools (tests/test_kvcache.py covers the
    paged varlen forward); packed 3-D k / v are rejected."""
    with pytest.raises(RuntimeError, match="4-D.*page pool"):
        fa.flash_attn_varlen_func(**_varlen_inputs(),
                                  block_table=torch.zeros(3, 1, dtype=torch.int32))


# ---- varlen operators: opcheck ----------------------------------------------------------
def _varlen_op_args(requires_grad):
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen([7, 0, 13], [5, 9, 0], 4, 2, 16, torch.float32,
                                                    "cpu", requires_grad=requires_grad)
    return q, k, v, cu_q, cu_k, max_q, max_k


OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_autograd_registration")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_seqused_k", [False, True])
def test_opcheck_varlen_fwd(causal, with_seqused_k):
    q, k, v, cu_q, cu_k, max_q, max_k = _varlen_op_args(requires_grad=True)
    args = (q, k, v, cu_q, cu_k, max_q, max_k, 0.25, causal)
    if with_seqused_k:
        args = args + (_i32([3, 9, 0]),)
    torch.library.opcheck(torch.ops.flash_attn_ext.varlen_fwd.default, args, test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_opcheck_varlen_bwd(causal, deterministic):
    q, k, v, cu_q, cu_k, max_q, max_k = _varlen_op_args(requires_grad=False)
    out, lse = torch.ops.flash_attn_ext.varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, 0.25, causal)
    assert lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.flash_attn_ext.varlen_bwd.default,
                          (dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.25, causal,
                           deterministic), test_utils=OPCHECK_UTILS)


# ---- KV cache ------------------------------------------------------------------------
CACHE_LEN = 40


def _kvcache_reference(q, k_cache, v_cache, lengths, causal):
    """Full attention of each batch over the first lengths[b] keys of the (updated) cache."""
    fn = lambda q, k, v: padded_attention(q, k, v, causal, lengths)  # noqa: E731
    return ref_and_base(fn, (q, k_cache, v_cache))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens_kind", ["none", "int", "tensor"])
@pytest.mark.parametrize("new_len", [0, 2], ids=["no_append", "append2"])
@pytest.mark.parametrize("seqlen_q", [1, 3], ids=["decode", "q3"])
def test_kvcache(device, dtype, causal, seqlens_kind, new_len, seqlen_q):
    if seqlens_kind == "none" and new_len:
        pytest.skip("appending needs cache_seqlens")
    batch, heads, kv_heads, head_dim = 4, 8, 2, 64
    q = randn((batch, seqlen_q, heads, head_dim), dtype, device, 31)
    k_cache = randn((batch, CACHE_LEN, kv_heads, head_dim), dtype, device, 32)
    v_cache = randn((batch, CACHE_LEN, kv_heads, head_dim), dtype, device, 33)
    if seqlens_kind == "none":
        cache_seqlens, starts = None, [CACHE_LEN] * batch
    elif seqlens_kind == "int":
        cache_seqlens = 29
        starts = [29] * batch
    else:
        starts = [0, 1, 17, CACHE_LEN - new_len]
        cache_seqlens = torch.tensor(starts, dtype=torch.int32, device=device)
    k_new = randn((batch, new_len, kv_heads, head_dim), dtype, device, 34) if new_len else None
    v_new = randn((batch, new_len, kv_heads, head_dim), dtype, device, 35) if new_len else None
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b, s in enumerate(starts):
        if new_len:
            expected_k[b, s:s + new_len] = k_new[b]
            expected_v[b, s:s + new_len] = v_new[b]
    lengths = torch.tensor([s + new_len for s in starts], dtype=torch.int32)
    ref, base = _kvcache_reference(q, expected_k, expected_v, lengths, causal)
    ref_lse = ref[1]
    splits = [0, 1, 3] if device == "cuda" else [0]
    for num_splits in splits:
        kc, vc = k_cache.clone(), v_cache.clone()
        kn = None if k_new is None else k_new.clone()
        vn = None if v_new is None else v_new.clone()
        out, lse = fa.flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=cache_seqlens,
                                              causal=causal, num_splits=num_splits,
                                              return_softmax_lse=True)
        assert out.shape == q.shape and lse.shape == (batch, heads, seqlen_q)
        check_out_and_grads(out, None, ref, base, dtype)
        check_lse(lse, ref_lse, dtype)
        # the new rows are written in place, nothing else in the caches changes
        assert torch.equal(kc, expected_k) and torch.equal(vc, expected_v)
        if new_len:
            assert torch.equal(kn, k_new) and torch.equal(vn, v_new)
        # the same attention over the updated cache, without appending, returning out only
        out_only = fa.flash_attn_with_kvcache(q, kc.clone(), vc.clone(),
                                              cache_seqlens=lengths.to(device),
                                              causal=causal, num_splits=num_splits)
        assert isinstance(out_only, torch.Tensor)
        check_out_and_grads(out_only, None, ref, base, dtype)


def test_kvcache_decode_matches_flash_attn_func(device):
    """Sq = 1 over a full cache is ordinary attention (causal makes no difference)."""
    q = randn((3, 1, 4, 32), torch.float32, device, 0)
    k_cache = randn((3, 57, 1, 32), torch.float32, device, 1)
    v_cache = randn((3, 57, 1, 32), torch.float32, device, 2)
    expected = fa.flash_attn_func(q, k_cache, v_cache)
    for causal in (False, True):
        out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, causal=causal)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_kvcache_inplace_through_views(device):
    """Caches that are strided views of one packed buffer (as flash-attn's kv-packed layout):
    the append writes through the views into the buffer."""
    buf = randn((2, 20, 2, 2, 32), torch.float16, device, 0)  # [batch, cache, k|v, heads_k, dim]
    k_cache, v_cache = buf.unbind(2)
    assert not k_cache.is_contiguous()
    q = randn((2, 2, 4, 32), torch.float16, device, 1)
    k_new = randn((2, 2, 2, 32), torch.float16, device, 2)
    v_new = randn((2, 2, 2, 32), torch.float16, device, 3)
    seqlens = torch.tensor([3, 18], dtype=torch.int32, device=device)
    expected = buf.clone()
    for b, s in enumerate(seqlens.tolist()):
        expected[b, s:s + 2, 0] = k_new[b]
        expected[b, s:s + 2, 1] = v_new[b]
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=seqlens,
                                     causal=True)
    assert torch.equal(buf, expected)
    lengths = torch.tensor([5, 20], dtype=torch.int32)
    ref, base = ref_and_base(lambda q, k, v: padded_attention(q, k, v, True, lengths),
                             (q, expected[:, :, 0], expected[:, :, 1]))
    check_out_and_grads(out, None, ref, base, torch.float16)


def test_kvcache_append_too_long(device, monkeypatch):
    """Checked on the host with FLASH_ATTN_EXT_DEBUG_CHECKS=1 (the default path does not
    synchronise: an out-of-range append is clamped into the cache)."""
    monkeypatch.setenv("FLASH_ATTN_EXT_DEBUG_CHECKS", "1")
    q = randn((2, 3, 4, 16), torch.float32, device, 0)
    k_cache = randn((2, 10, 2, 16), torch.float32, device, 1)
    v_cache = randn((2, 10, 2, 16), torch.float32, device, 2)
    k = randn((2, 3, 2, 16), torch.float32, device, 3)
    v = randn((2, 3, 2, 16), torch.float32, device, 4)
    with pytest.raises(RuntimeError, match="(?i)cache|exceed|capacity|long|short"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=8)
    seqlens = torch.tensor([0, 8], dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="(?i)cache|exceed|capacity|long|short"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens)
    # exactly filling the cache is fine
    fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=7)
    monkeypatch.delenv("FLASH_ATTN_EXT_DEBUG_CHECKS")
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens)
    assert out.shape == q.shape and torch.isfinite(out).all()


def _kvcache_small():
    q = torch.randn(2, 1, 4, 16)
    k_cache = torch.randn(2, 10, 2, 16)
    v_cache = torch.randn(2, 10, 2, 16)
    k = torch.randn(2, 1, 2, 16)
    v = torch.randn(2, 1, 2, 16)
    return q, k_cache, v_cache, k, v


def test_kvcache_rotary_needs_new_keys():
    """Rotary embeddings, paged caches, cache_batch_idx and cache_leftpad: tests/test_kvcache.py."""
    q, k_cache, v_cache, k, v = _kvcache_small()
    with pytest.raises(RuntimeError, match="(?i)rotary"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=3,
                                   rotary_cos=torch.ones(10, 8), rotary_sin=torch.zeros(10, 8))
