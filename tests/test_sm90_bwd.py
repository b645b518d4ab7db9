"""The Hopper backward (wgmma + TMA, csrc/cuda/hopper/bwd_sm90_*): dispatch and gradients.

Runs only on a compute-capability 9.0 GPU with a build that has an sm_90a
target; FLASH_ATTN_EXT_BWD_IMPL (read on every call) switches between the
Hopper kernel ("auto"/"wgmma") and the mma.sync kernels ("mma").
"""
import os
import re

import pytest
import torch

import flash_attn_ext as fa
from flash_attn_ext.ops import FlashAttnFunction
from helpers import (assert_fa_rule, assert_grads_repeat, check_out_and_grads, gqa_attention,
                     kernel_names, make_qkv, make_varlen, padded_attention, randn, ref_and_base,
                     reference_and_baseline, varlen_attention)

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
SM90_BWD_KERNEL = "flash_bwd_sm90_kernel"


def backward_ran_sm90(q, k, v, **kwargs):
    out = fa.flash_attn_func(q, k, v, **kwargs)
    dout = torch.randn_like(out)
    names = kernel_names(lambda: torch.autograd.grad(out, (q, k, v), dout))
    return any(SM90_BWD_KERNEL in n for n in names)


@pytest.fixture(scope="module")
def sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper backward needs a compute capability 9.0 GPU")
    q, k, v = make_qkv(1, 256, 256, 2, 128, torch.bfloat16, DEVICE)
    if not backward_ran_sm90(q, k, v):
        pytest.skip("this build has no sm_90a target (FLASH_ATTN_EXT_CUDA_ARCHS)")


@pytest.fixture(params=["auto", "1"], ids=["walk-auto", "walk-forced"])
def gqa_walk(request, monkeypatch):
    """GQA backward both ways: as chosen (small grids and causal calls write dK / dV per
    query head and the op layer sums each group) and forced through the kernel's group walk
    (one CTA per kv head walks its query heads; by default only large non-causal grids)."""
    monkeypatch.setenv("FLASH_ATTN_EXT_GQA_BWD_WALK", request.param)
    return request.param


@pytest.fixture
def impl(monkeypatch):
    def set_impl(name):
        monkeypatch.setenv("FLASH_ATTN_EXT_BWD_IMPL", name)
    return set_impl


def test_dispatch(sm90, impl):
    q, k, v = make_qkv(2, 300, 300, 4, 128, torch.bfloat16, DEVICE)
    assert backward_ran_sm90(q, k, v, causal=True)
    impl("mma")
    assert not backward_ran_sm90(q, k, v, causal=True)
    impl("wgmma")
    assert backward_ran_sm90(q, k, v)
    assert backward_ran_sm90(q, k, v, deterministic=True)
    assert backward_ran_sm90(q, k, v, seqused_k=torch.tensor([300, 7], dtype=torch.int32,
                                                                device=DEVICE))
    # Head dims between the Hopper kernels' run the next one on zero-padded copies
    # (bwd_kernel_head_dim); those below 64 that do not round to it stay on mma.sync.
    for head_dim, hopper in ((96, True), (192, True), (32, False)):
        q2, k2, v2 = make_qkv(1, 300, 300, 2, head_dim, torch.bfloat16, DEVICE)
        try:
            assert backward_ran_sm90(q2, k2, v2) == hopper
        except RuntimeError as e:  # a build restricted with FLASH_ATTN_EXT_HEAD_DIMS
            assert "not compiled" in str(e)
    impl("bogus")
    out = fa.flash_attn_func(q, k, v)
    with pytest.raises(RuntimeError, match="FLASH_ATTN_EXT_BWD_IMPL"):
        out.backward(torch.randn_like(out))


def run_and_check_grads(q, k, v, causal, bottom_right=True, layout="bshd", **kwargs):
    if layout == "bhsd":
        out = fa.scaled_dot_product_attention(q, k, v, is_causal=causal, **kwargs)
    elif causal and not bottom_right:
        from flash_attn_ext.ops import FlashAttnFunction
        out = FlashAttnFunction.apply(q, k, v, q.shape[-1] ** -0.5, True, False, False, 0, 0, None)[0]
    else:
        out = fa.flash_attn_func(q, k, v, causal=causal, **kwargs)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    (ref, *ref_grads), (base, *base_grads) = reference_and_baseline(q, k, v, dout, causal,
                                                                    bottom_right, layout)
    assert_fa_rule(out, ref, base, 2)
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads):
        assert g.dtype == q.dtype and g.shape == r.shape
        assert_fa_rule(g, r, b, 3, what=name)
    return grads


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [40, 64, 104, 128, 232, 256])
@pytest.mark.parametrize("causal,bottom_right", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 17), (63, 1025), (127, 127),
                                               (128, 129), (1025, 63), (1025, 1025), (300, 3000),
                                               (80, 161), (161, 80)])  # 80-query steps' edges
def test_grads_match_reference(sm90, dtype, head_dim, causal, bottom_right, seqlen_q, seqlen_k):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 3, head_dim, dtype, DEVICE)
    run_and_check_grads(q, k, v, causal, bottom_right)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_layout_noncontiguous_and_gqa(sm90, gqa_walk, causal):
    q, k, v = make_qkv(2, 700, 700, 4, 128, torch.bfloat16, DEVICE, layout="bhsd")
    run_and_check_grads(q, k, v, causal, bottom_right=False, layout="bhsd")
    # Non-contiguous [B,S,H,D] views (two heads interleaved in one buffer).
    base = torch.randn(1, 333, 6, 2, 64, device=DEVICE, dtype=torch.bfloat16)
    q, k, v = (t.detach().requires_grad_() for t in (base[..., 0, :], base[..., 1, :],
                                                     base[..., 0, :].flip(1)))
    assert not q.is_contiguous()
    run_and_check_grads(q, k, v, causal)
    # GQA: dK/dV summed over the 4 query heads of each kv head; equal to the expanded call.
    gen = torch.Generator(device="cpu").manual_seed(3)
    q = torch.randn(2, 500, 8, 64, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_()
    k = torch.randn(2, 500, 2, 64, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_()
    v = torch.randn(2, 500, 2, 64, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_()
    assert backward_ran_sm90(q, k, v, causal=causal)
    ke, ve = (t.detach().repeat_interleave(4, 2).requires_grad_() for t in (k, v))
    out = fa.flash_attn_func(q, ke, ve, causal=causal)
    dout = torch.randn_like(out)
    out_gqa = fa.flash_attn_func(q, k, v, causal=causal)
    g_gqa = torch.autograd.grad(out_gqa, (q, k, v), dout)
    g_exp = torch.autograd.grad(out, (q, ke, ve), dout)
    torch.testing.assert_close(g_gqa[0], g_exp[0], atol=2e-2, rtol=0)  # dq: fp32 sums in any order
    for g, e in zip(g_gqa[1:], g_exp[1:]):
        torch.testing.assert_close(g.float(), e.float().unflatten(2, (2, 4)).sum(3), atol=2e-2,
                                   rtol=1e-2)


def test_fully_masked_rows_get_zero_grads(sm90):
    # bottom-right causal with more queries than keys: the first 200 rows see no key.
    q, k, v = make_qkv(1, 300, 100, 2, 128, torch.bfloat16, DEVICE)
    dq, dk, dv = run_and_check_grads(q, k, v, causal=True)
    assert torch.all(dq[:, :200] == 0)


def test_keys_nobody_sees_get_zero_grads(sm90):
    # top-left causal with more keys than queries: keys >= 300 are never attended.
    q, k, v = make_qkv(1, 300, 1000, 2, 64, torch.float16, DEVICE)
    dq, dk, dv = run_and_check_grads(q, k, v, causal=True, bottom_right=False)
    assert torch.all(dk[:, 300:] == 0) and torch.all(dv[:, 300:] == 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [128, 256])
def test_repeatable(sm90, dtype, head_dim):
    # dK / dV have one writer per element: bit-identical. dQ is summed in fp32 by
    # TMA reduce-adds (default, non-deterministic mode): equal up to summation order.
    q, k, v = make_qkv(2, 1000, 1000, 4, head_dim, dtype, DEVICE)
    out = fa.flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    for _ in range(50):
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        assert torch.equal(dk, first[1]) and torch.equal(dv, first[2])
        torch.testing.assert_close(dq, first[0], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_long_sequence(sm90, head_dim):
    q, k, v = make_qkv(1, 16384, 16384, 1, head_dim, torch.bfloat16, DEVICE)
    run_and_check_grads(q, k, v, causal=True)


def bwd_query_steps(names):
    """Query rows per step of the Hopper backward kernel among `names`, from its traits
    (BwdSm90Traits<T, head dim, v's head dim, rows>, rows 0 for the default 64)."""
    for name in names:
        match = re.search(r"BwdSm90Traits<[^,]+, \d+, \d+, (\d+)>", name)
        if match:
            return int(match.group(1)) or 64
    return None


# Causal D = 128 calls take 80-query steps from 4096 query rows on (bwd_sm90.h
# kBwdSm90CausalQ80MinRows): odd lengths either side of Sk, both alignments; below
# that, 64-query steps.
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bottom_right", [True, False])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(4097, 4500), (4500, 4097)])
def test_causal_80_query_steps(sm90, dtype, bottom_right, seqlen_q, seqlen_k):
    q, k, v = make_qkv(1, seqlen_q, seqlen_k, 2, 128, dtype, DEVICE)
    run_and_check_grads(q, k, v, True, bottom_right)
    for rows, steps in ((seqlen_q, 80), (4095, 64)):
        q, k, v = make_qkv(1, rows, seqlen_k, 2, 128, dtype, DEVICE)
        out = fa.flash_attn_func(q, k, v, causal=True)
        names = kernel_names(lambda: torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
        assert bwd_query_steps(names) == steps, names


def test_broadcast_inputs_stay_on_mma(sm90):
    # K/V and dO broadcast over the batch (stride 0, e.g. from expand()) cannot be described
    # by a TMA tensor map: both passes take the mma.sync kernels and stay exact.
    gen = torch.Generator(device="cpu").manual_seed(5)
    q = torch.randn(2, 300, 4, 64, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_()
    k, v = (torch.randn(1, 300, 4, 64, generator=gen).to(DEVICE, torch.bfloat16).expand(2, -1, -1, -1)
            .requires_grad_() for _ in range(2))
    dout = torch.randn(1, 300, 4, 64, generator=gen).to(DEVICE, torch.bfloat16).expand(2, -1, -1, -1)
    assert k.stride(0) == 0 and dout.stride(0) == 0
    out = fa.flash_attn_func(q, k, v, causal=True, num_splits=1)
    names = kernel_names(lambda: fa.flash_attn_func(q, k, v, causal=True, num_splits=1))
    assert not any("flash_fwd_sm90_kernel" in n for n in names)
    names = kernel_names(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    assert not any(SM90_BWD_KERNEL in n for n in names)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    (ref, *ref_grads), (base, *base_grads) = reference_and_baseline(q, k, v, dout, True, True)
    assert_fa_rule(out, ref, base, 2)
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads):
        assert_fa_rule(g, r, b, 3, what=name)


# ---- MLA's 192 / 128: a backward of its own -------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(131, 131), (77, 201), (257, 93)])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_head_dims_192_128(sm90, gqa_walk, dtype, causal, seqlen_q, seqlen_k, deterministic):
    """q / k head dim 192, v's 128: the Hopper kernel of that pair (no zero-padded copies),
    its consumers each owning 64 + 32 dK / dQ columns and 64 dV columns; GQA with the
    group walk forced and not, odd lengths both ways, the deterministic dQ order."""
    b, h, hk = 2, 4, 2
    q = randn((b, seqlen_q, h, 192), dtype, DEVICE, 1, True)
    k = randn((b, seqlen_k, hk, 192), dtype, DEVICE, 2, True)
    v = randn((b, seqlen_k, hk, 128), dtype, DEVICE, 3, True)
    dout = randn((b, seqlen_q, h, 128), dtype, DEVICE, 4)
    out = fa.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
    names = kernel_names(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    # The pair's own instantiation (Traits<T, 192, 128>), not the padded D = 256 one (which
    # a build without head dim 192 in FLASH_ATTN_EXT_HEAD_DIMS runs instead).
    ran = [n for n in names if SM90_BWD_KERNEL in n]
    assert ran
    if os.environ.get("FLASH_ATTN_EXT_HEAD_DIMS", "192").find("192") >= 0:
        assert any("192" in n for n in ran), ran
    grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    assert [g.shape[-1] for g in grads] == [192, 192, 128]
    ref, base = ref_and_base(lambda q, k, v: gqa_attention(q, k, v, causal), (q, k, v), dout)
    check_out_and_grads(out, grads, ref, base, dtype)
    if deterministic:
        assert_grads_repeat(out, (q, k, v), dout, grads, 2)


# ---- deterministic ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic(sm90, dtype, head_dim, causal):
    # One dQ accumulator per split, each filled by one CTA in a fixed tile order: grads
    # within the FA rule and bit-identical run to run (250 runs for one configuration).
    q, k, v = make_qkv(2, 1031, 1031, 3, head_dim, dtype, DEVICE)
    assert backward_ran_sm90(q, k, v, causal=causal, deterministic=True)
    run_and_check_grads(q, k, v, causal, deterministic=True)
    out = fa.flash_attn_func(q, k, v, causal=causal, deterministic=True)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    runs = 250 if (head_dim, causal, dtype) == (128, True, torch.bfloat16) else 10
    for _ in range(runs):
        again = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


# ---- varlen and seqused_k -------------------------------------------------------------
def varlen_ran_sm90(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    names = kernel_names(lambda: torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    return any(SM90_BWD_KERNEL in n for n in names)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen(sm90, gqa_walk, dtype, head_dim, causal, deterministic):
    # Sequences shorter than, equal to and longer than a tile, empty ones, GQA, and
    # NaN in the rows past cu_seqlens[-1]: packed tiles read neighbouring rows, which
    # the kernel zeroes in shared memory, so nothing leaks between sequences.
    lens_q, lens_k = [0, 1, 63, 200, 128, 77, 5], [5, 0, 63, 129, 300, 77, 1]
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, 4, 2, head_dim, dtype,
                                                    DEVICE, pad_q=9, pad_k=70)
    with torch.no_grad():
        for t in (q, k, v):
            t[-5:] = float("nan")
    kwargs = dict(causal=causal, deterministic=deterministic)
    assert varlen_ran_sm90(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    rows = sum(lens_q)
    dout = randn(out.shape, dtype, DEVICE, 21)
    dout[rows:] = 0  # the padding rows' out is not defined: give them no gradient
    grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=deterministic)
    keys = sum(lens_k)
    clean = [t.detach().clone() for t in (q, k, v)]
    for t, n in zip(clean, (rows, keys, keys)):
        t[n:] = 0
    ref, base = ref_and_base(lambda q, k, v: varlen_attention(q, k, v, cu_q, cu_k, causal),
                             clean, dout)
    check_out_and_grads(out, grads, ref, base, dtype, rows=rows)
    dq, dk, dv = grads
    assert torch.all(dq[rows:] == 0) and torch.all(dk[keys:] == 0) and torch.all(dv[keys:] == 0)
    if deterministic:
        again = torch.autograd.grad(out, (q, k, v), dout)
        for a, b in zip(grads, again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_many_sequences(sm90, head_dim, causal):
    # 300 sequences in random order of length, some without keys or queries: gradients pass
    # the FlashAttention rule, deterministic mode repeats them bit for bit, and the rows past
    # the last sequence are zeros.
    gen = torch.Generator().manual_seed(3)
    lens_q = torch.randint(0, 300, (300,), generator=gen).tolist()
    lens_k = torch.randint(0, 300, (300,), generator=gen).tolist()
    lens_q[:3], lens_k[3:6] = [0, 0, 0], [0, 0, 0]
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, 2, 1, head_dim,
                                                    torch.bfloat16, DEVICE, pad_q=3, pad_k=5)
    rows, keys = sum(lens_q), sum(lens_k)
    kwargs = dict(causal=causal, deterministic=True)
    assert varlen_ran_sm90(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    dout = randn(out.shape, torch.bfloat16, DEVICE, 21)
    dout[rows:] = 0
    grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    again = torch.autograd.grad(out, (q, k, v), dout)
    for a, b in zip(grads, again):
        assert torch.equal(a, b)
    clean = [t.detach().clone() for t in (q, k, v)]
    for t, n in zip(clean, (rows, keys, keys)):
        t[n:] = 0
    ref, base = ref_and_base(lambda q, k, v: varlen_attention(q, k, v, cu_q, cu_k, causal),
                             clean, dout)
    check_out_and_grads(out, grads, ref, base, torch.bfloat16, rows=rows)
    dq, dk, dv = grads
    assert torch.all(dq[rows:] == 0) and torch.all(dk[keys:] == 0) and torch.all(dv[keys:] == 0)
    # Non-deterministic: the same gradients up to the order of the adds.
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal)
    loose = torch.autograd.grad(out, (q, k, v), dout)
    check_out_and_grads(out, loose, ref, base, torch.bfloat16, rows=rows)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_seqused_k_ignores_cache_garbage(sm90, head_dim, causal):
    # Keys past seqused_k hold NaN (an unfilled cache): zero gradients there, exact elsewhere.
    used = torch.tensor([0, 1, 130, 300, 64], dtype=torch.int32, device=DEVICE)
    q = randn((5, 150, 4, head_dim), torch.bfloat16, DEVICE, 1, True)
    k = randn((5, 300, 2, head_dim), torch.bfloat16, DEVICE, 2)
    v = randn((5, 300, 2, head_dim), torch.bfloat16, DEVICE, 3)
    for b, n in enumerate(used.tolist()):
        k[b, n:] = float("nan")
        v[b, n:] = float("nan")
    k.requires_grad_()
    v.requires_grad_()
    assert backward_ran_sm90(q, k, v, causal=causal, seqused_k=used)
    out = fa.flash_attn_func(q, k, v, causal=causal, seqused_k=used)
    dout = randn(out.shape, torch.bfloat16, DEVICE, 4)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    clean = [t.detach().nan_to_num(0.0) for t in (q, k, v)]
    ref, base = ref_and_base(lambda q, k, v: padded_attention(q, k, v, causal, used), clean, dout)
    check_out_and_grads(out, grads, ref, base, torch.bfloat16)
    for b, n in enumerate(used.tolist()):
        assert torch.all(grads[1][b, n:] == 0) and torch.all(grads[2][b, n:] == 0)


# ---- attention variants (window / softcap / ALiBi / attn_mask: the kHasVariants kernel) -----
def _alibi(heads, batch=None):
    if batch is None:  # [heads], the geometric ALiBi series
        return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], device=DEVICE)
    gen = torch.Generator().manual_seed(7)
    return (torch.rand((batch, heads), generator=gen) * 0.5).to(DEVICE)


# (causal, window_size, softcap, alibi): windows that cut key tiles on both sides, one side
# only, a one-key window, causal as the right bound, and the score modifiers alone and together.
VARIANT_CASES = {
    "sliding": (False, (100, 30), 0.0, None),
    "causal_window": (True, (200, -1), 0.0, None),
    "left_only": (False, (130, -1), 0.0, None),
    "right_only": (False, (-1, 70), 0.0, None),
    "window_0_0": (False, (0, 0), 0.0, None),
    "softcap": (False, (-1, -1), 5.0, None),
    "softcap_causal": (True, (-1, -1), 30.0, None),
    "alibi": (False, (-1, -1), 0.0, "head"),
    "all_causal": (True, (150, -1), 3.0, "batch"),
    "all": (False, (90, 40), 8.0, "head"),
}


def _variant_kwargs(case, heads, batch):
    causal, window, softcap, alibi = VARIANT_CASES[case]
    slopes = None if alibi is None else _alibi(heads, batch if alibi == "batch" else None)
    return causal, dict(window_size=window, softcap=softcap, alibi_slopes=slopes)


def _check_variant_grads(q, k, v, case, deterministic=False, seqused_k=None):
    """Our gradients (the Hopper kernel ran) against the float64 reference, FA rule."""
    causal, variant = _variant_kwargs(case, q.shape[2], q.shape[0])
    scale = 0.25  # larger scores than 1/sqrt(d): the softcap bends them
    kwargs = dict(softmax_scale=scale, causal=causal, deterministic=deterministic,
                  seqused_k=seqused_k, **variant)
    assert backward_ran_sm90(q, k, v, **kwargs)
    out = fa.flash_attn_func(q, k, v, **kwargs)
    dout = randn(out.shape, q.dtype, DEVICE, 4)
    grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=deterministic)
    ref, base = ref_and_base(
        lambda q, k, v: padded_attention(q, k, v, causal, seqused_k, scale=scale, **variant),
        (q, k, v), dout)
    check_out_and_grads(out, grads, ref, base, q.dtype,
                        grad_atol=1e-5 * max(1, q.shape[-1] // 64))
    if deterministic:
        assert_grads_repeat(out, (q, k, v), dout, grads, 5)
    return grads


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", list(VARIANT_CASES))
@pytest.mark.parametrize("seqlen_q,seqlen_k,dtype", [(300, 1000, torch.bfloat16),
                                                     (1000, 300, torch.float16),
                                                     (777, 777, torch.bfloat16)], ids=str)
def test_variants(sm90, gqa_walk, head_dim, case, seqlen_q, seqlen_k, dtype):
    # GQA (query heads 4, kv heads 2); Sq > Sk leaves the first rows of bottom-right windows
    # without keys, Sq < Sk the last keys without rows (zero dK / dV).
    q = randn((2, seqlen_q, 4, head_dim), dtype, DEVICE, 1, True)
    k = randn((2, seqlen_k, 2, head_dim), dtype, DEVICE, 2, True)
    v = randn((2, seqlen_k, 2, head_dim), dtype, DEVICE, 3, True)
    _check_variant_grads(q, k, v, case)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", ["sliding", "causal_window", "right_only", "all_causal", "all"])
def test_variants_deterministic(sm90, head_dim, case):
    # The dQ order counts only the key tiles that a query tile's window reaches.
    q = randn((2, 1031, 3, head_dim), torch.bfloat16, DEVICE, 1, True)
    k = randn((2, 1500, 3, head_dim), torch.bfloat16, DEVICE, 2, True)
    v = randn((2, 1500, 3, head_dim), torch.bfloat16, DEVICE, 3, True)
    _check_variant_grads(q, k, v, case, deterministic=True)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", ["sliding", "softcap_causal", "all"])
def test_variants_seqused_k(sm90, gqa_walk, head_dim, case):
    used = torch.tensor([0, 1, 130, 300, 64], dtype=torch.int32, device=DEVICE)
    q = randn((5, 150, 4, head_dim), torch.bfloat16, DEVICE, 1, True)
    k = randn((5, 300, 2, head_dim), torch.bfloat16, DEVICE, 2, True)
    v = randn((5, 300, 2, head_dim), torch.bfloat16, DEVICE, 3, True)
    grads = _check_variant_grads(q, k, v, case, seqused_k=used)
    for b, n in enumerate(used.tolist()):
        assert torch.all(grads[1][b, n:] == 0) and torch.all(grads[2][b, n:] == 0)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", ["sliding", "causal_window", "all"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_variants_varlen(sm90, head_dim, case, deterministic):
    lens_q, lens_k = [0, 1, 63, 200, 128, 77, 5], [5, 0, 63, 129, 300, 77, 1]
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, 4, 2, head_dim,
                                                    torch.bfloat16, DEVICE, pad_q=9, pad_k=70)
    causal, variant = _variant_kwargs(case, 4, len(lens_q))
    kwargs = dict(causal=causal, deterministic=deterministic, **variant)
    assert varlen_ran_sm90(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    rows, keys = sum(lens_q), sum(lens_k)
    dout = randn(out.shape, torch.bfloat16, DEVICE, 21)
    dout[rows:] = 0
    grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=deterministic)
    clean = [t.detach().clone() for t in (q, k, v)]
    for t, n in zip(clean, (rows, keys, keys)):
        t[n:] = 0
    ref, base = ref_and_base(
        lambda q, k, v: varlen_attention(q, k, v, cu_q, cu_k, causal, **variant), clean, dout)
    check_out_and_grads(out, grads, ref, base, torch.bfloat16, rows=rows)
    dq, dk, dv = grads
    assert torch.all(dq[rows:] == 0) and torch.all(dk[keys:] == 0) and torch.all(dv[keys:] == 0)
    if deterministic:
        again = torch.autograd.grad(out, (q, k, v), dout)
        for a, b in zip(grads, again):
            assert torch.equal(a, b)


def test_variants_rows_and_keys_nobody_sees(sm90):
    # Bottom-right window (0, 0) with Sq > Sk: the first 700 rows see no key (zero dQ);
    # top-left-style reach with Sq < Sk: a narrow window leaves key tiles that no row sees
    # (their CTAs visit no query tile and write dK = dV = 0).
    q = randn((1, 1000, 2, 128), torch.bfloat16, DEVICE, 1, True)
    k = randn((1, 300, 2, 128), torch.bfloat16, DEVICE, 2, True)
    v = randn((1, 300, 2, 128), torch.bfloat16, DEVICE, 3, True)
    dq, _, _ = _check_variant_grads(q, k, v, "window_0_0")
    assert torch.all(dq[:, :700] == 0)
    q = randn((1, 100, 2, 64), torch.bfloat16, DEVICE, 1, True)
    k = randn((1, 2000, 2, 64), torch.bfloat16, DEVICE, 2, True)
    v = randn((1, 2000, 2, 64), torch.bfloat16, DEVICE, 3, True)
    _, dk, dv = _check_variant_grads(q, k, v, "window_0_0")
    assert torch.all(dk[:, :1900] == 0) and torch.all(dv[:, :1900] == 0)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kind", ["bool", "additive", "additive_staged"])
@pytest.mark.parametrize("causal", [False, True])
def test_attn_mask(sm90, head_dim, kind, causal):
    # torch SDPA's attn_mask through the Hopper kernels (their attn_mask instantiations): bool
    # (some rows fully masked: zero dQ) and additive (fp16 with -inf entries), broadcast over
    # the batch, GQA; additive_staged: bf16 rows of even stride, which the forward stages
    # through shared memory at D = 64 / 128 (stage_attn_mask).
    sq, sk = 333, 555
    q = randn((2, 4, sq, head_dim), torch.float16, DEVICE, 1, True)
    k = randn((2, 2, sk, head_dim), torch.float16, DEVICE, 2, True)
    v = randn((2, 2, sk, head_dim), torch.float16, DEVICE, 3, True)
    gen = torch.Generator().manual_seed(5)
    u = torch.rand((1, 4, sq, sk), generator=gen)
    if kind == "bool":
        mask = u > 0.3
        mask[:, :, 5] = False  # a row that sees nothing
        mask = mask.to(DEVICE)
    elif kind == "additive":
        mask = (torch.randn((1, 4, sq, sk), generator=gen) * 2).masked_fill(u < 0.2, float("-inf"))
        mask = mask.to(torch.float16).to(DEVICE)
    else:
        mask = (torch.randn((1, 4, sq, sk + 1), generator=gen) * 2)
        mask[..., :sk].masked_fill_(u < 0.2, float("-inf"))
        mask = mask.to(torch.bfloat16).to(DEVICE)[..., :sk]
        assert mask.stride(2) % 2 == 0
    out = fa.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          enable_gqa=True)
    dout = randn(out.shape, torch.float16, DEVICE, 4)
    names = kernel_names(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    assert any(SM90_BWD_KERNEL in n for n in names)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, base = ref_and_base(
        lambda q, k, v: gqa_attention(q, k, v, causal, bottom_right=False, layout="bhsd",
                                      attn_mask=mask), (q, k, v), dout)
    check_out_and_grads(out, grads, ref, base, torch.float16,
                        grad_atol=1e-5 * max(1, head_dim // 64))
    seen = torch.isfinite(ref[1])  # [B, H, Sq]
    assert torch.equal(grads[0][~seen], torch.zeros_like(grads[0][~seen]))


def _structured_bool_mask(kind, batch, heads, sq, sk):
    """Boolean masks whose 64-row x 64..176-key blocks are all masked, all attending or mixed
    (the Hopper kernels' block summary, csrc/cuda/common/mask_blocks.cuh)."""
    gen = torch.Generator().manual_seed(7)
    if kind == "key_padding":  # [B, 1, 1, Sk]: trailing key tiles dropped; batch 1 sees nothing
        lengths = torch.tensor([sk - 100, 0, 129][:batch])
        return torch.arange(sk).view(1, 1, 1, sk) < lengths.view(batch, 1, 1, 1)
    if kind == "key_prefix":  # leading key tiles masked
        return (torch.arange(sk) >= 200).view(1, 1, 1, sk).expand(batch, 1, 1, sk)
    if kind == "query_padding":  # [B, 1, Sq, 1]: trailing query tiles see nothing
        lengths = torch.tensor([sq - 70, 65, sq][:batch])
        return torch.arange(sq).view(1, 1, sq, 1) < lengths.view(batch, 1, 1, 1)
    # [1, H, Sq, Sk] blocks: masked, attending and random, a hole in the middle of each row
    # and a band of rows that see nothing
    block = torch.randint(0, 3, (heads, (sq + 63) // 64, (sk + 63) // 64), generator=gen)
    block[:, :, 2] = 0
    full = block.repeat_interleave(64, 1).repeat_interleave(64, 2)[:, :sq, :sk]
    rand = torch.rand((heads, sq, sk), generator=gen) > 0.4
    mask = (full == 1) | ((full == 2) & rand)
    mask[:, 130:200] = False
    return mask.unsqueeze(0)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kind", ["key_padding", "key_prefix", "query_padding", "blocks"])
@pytest.mark.parametrize("causal,deterministic", [(False, False), (True, False), (False, True)])
def test_attn_mask_block_summary(sm90, head_dim, kind, causal, deterministic):
    # Boolean masks with whole blocks masked or attending: the forward and backward drop the
    # key / query tiles at the ends of their ranges that nothing attends to and read no mask
    # where nothing is masked; values and gradients as the reference, zeros where a row sees
    # nothing, and bit-identical repeats in the deterministic mode.
    batch, heads, sq, sk = 2, 4, 333, 555
    dtype = torch.bfloat16
    q = randn((batch, heads, sq, head_dim), dtype, DEVICE, 1, True)
    k = randn((batch, 2, sk, head_dim), dtype, DEVICE, 2, True)
    v = randn((batch, 2, sk, head_dim), dtype, DEVICE, 3, True)
    mask = _structured_bool_mask(kind, batch, heads, sq, sk).to(DEVICE)
    # The operator in the [B, S, H, D] layout, top-left causal (torch SDPA's), with the mask.
    out = FlashAttnFunction.apply(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), head_dim ** -0.5, causal, False,
        deterministic, 0, 0, None, -1, -1, 0.0, None, 0.0, None, mask)[0].transpose(1, 2)
    dout = randn(out.shape, dtype, DEVICE, 4)
    names = kernel_names(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    assert any(SM90_BWD_KERNEL in n for n in names)
    grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=deterministic)
    ref, base = ref_and_base(
        lambda q, k, v: gqa_attention(q, k, v, causal, bottom_right=False, layout="bhsd",
                                      attn_mask=mask), (q, k, v), dout)
    check_out_and_grads(out, grads, ref, base, dtype, grad_atol=1e-5 * max(1, head_dim // 64))
    seen = torch.isfinite(ref[1])
    assert torch.equal(out[~seen], torch.zeros_like(out[~seen]))
    assert torch.equal(grads[0][~seen], torch.zeros_like(grads[0][~seen]))
    if deterministic:
        assert_grads_repeat(out, (q, k, v), dout, grads, 2)


# ---- dropout (the variant kernels' dropout branch) -------------------------------------------
def _check_dropout_grads(q, k, v, p, causal, deterministic=False, scale=None, **variant):
    """Our output and gradients (the Hopper backward ran) against the float64 reference with the
    call's own keep-mask (return_attn_probs), FA rule; deterministic: bit-identical repeats."""
    kwargs = dict(dropout_p=p, causal=causal, deterministic=deterministic, softmax_scale=scale,
                  **variant)
    assert backward_ran_sm90(q, k, v, **kwargs)
    out, _, keep = fa.flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    assert keep.shape == (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    dout = randn(out.shape, q.dtype, DEVICE, 4)
    grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=deterministic)
    ref, base = ref_and_base(lambda q, k, v: gqa_attention(
        q, k, v, causal, scale=scale, dropout_p=p, dropout_mask=keep, **variant), (q, k, v), dout)
    check_out_and_grads(out, grads, ref, base, q.dtype,
                        grad_atol=1e-5 * max(1, q.shape[-1] // 64))
    if deterministic:
        assert_grads_repeat(out, (q, k, v), dout, grads, 3)
    return grads


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k,dtype,p", [(300, 1000, torch.bfloat16, 0.17),
                                                       (1000, 300, torch.float16, 0.5),
                                                       (777, 777, torch.bfloat16, 0.9)], ids=str)
def test_dropout(sm90, head_dim, causal, seqlen_q, seqlen_k, dtype, p):
    # GQA (query heads 4, kv heads 2): the mask is per query head; key and query tiles cut
    # by the sequence ends (keys / rows past them are never kept in the reference).
    q = randn((2, seqlen_q, 4, head_dim), dtype, DEVICE, 1, True)
    k = randn((2, seqlen_k, 2, head_dim), dtype, DEVICE, 2, True)
    v = randn((2, seqlen_k, 2, head_dim), dtype, DEVICE, 3, True)
    _check_dropout_grads(q, k, v, p, causal)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_with_window_and_softcap(sm90, head_dim, causal):
    # Softcap's df/ds and dropout's Z in one dS (head-dim split: both handed to consumer 1
    # in the sign-marked fp32 P^T), a window that cuts key tiles, ALiBi.
    q = randn((2, 555, 4, head_dim), torch.bfloat16, DEVICE, 1, True)
    k = randn((2, 700, 2, head_dim), torch.bfloat16, DEVICE, 2, True)
    v = randn((2, 700, 2, head_dim), torch.bfloat16, DEVICE, 3, True)
    _check_dropout_grads(q, k, v, 0.3, causal, scale=0.25, window_size=(150, 60), softcap=5.0,
                         alibi_slopes=_alibi(4))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_dropout_deterministic(sm90, head_dim):
    q = randn((2, 1031, 3, head_dim), torch.bfloat16, DEVICE, 1, True)
    k = randn((2, 1500, 3, head_dim), torch.bfloat16, DEVICE, 2, True)
    v = randn((2, 1500, 3, head_dim), torch.bfloat16, DEVICE, 3, True)
    _check_dropout_grads(q, k, v, 0.25, True, deterministic=True)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_dropout_varlen(sm90, head_dim):
    # Rows and keys numbered within each sequence: sequence b takes keep[b, :, :len_q, :len_k].
    lens_q, lens_k = [0, 1, 63, 200, 128, 77, 5], [5, 0, 63, 129, 300, 77, 1]
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, 4, 2, head_dim,
                                                    torch.bfloat16, DEVICE, pad_q=9, pad_k=70)
    p, causal = 0.3, True
    kwargs = dict(dropout_p=p, causal=causal)
    assert varlen_ran_sm90(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    out, _, keep = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                             return_attn_probs=True, **kwargs)
    assert keep.shape == (len(lens_q), 4, max_q, max_k)
    rows, keys = sum(lens_q), sum(lens_k)
    dout = randn(out.shape, torch.bfloat16, DEVICE, 21)
    dout[rows:] = 0
    grads = torch.autograd.grad(out, (q, k, v), dout)
    clean = [t.detach().clone() for t in (q, k, v)]
    for t, n in zip(clean, (rows, keys, keys)):
        t[n:] = 0

    def per_sequence(q, k, v):
        outs, lses = [], []
        cq, ck = cu_q.tolist(), cu_k.tolist()
        for b in range(len(lens_q)):
            o, l = gqa_attention(q[cq[b]:cq[b + 1]].unsqueeze(0), k[ck[b]:ck[b + 1]].unsqueeze(0),
                                 v[ck[b]:ck[b + 1]].unsqueeze(0), causal, dropout_p=p,
                                 dropout_mask=keep[b:b + 1, :, :lens_q[b], :lens_k[b]])
            outs.append(o[0])
            lses.append(l[0])
        outs.append(q.new_zeros((q.shape[0] - cq[-1], q.shape[1], v.shape[-1])))
        return torch.cat(outs), torch.cat(lses, dim=-1)

    ref, base = ref_and_base(per_sequence, clean, dout)
    check_out_and_grads(out, grads, ref, base, torch.bfloat16, rows=rows)
    dq, dk, dv = grads
    assert torch.all(dq[rows:] == 0) and torch.all(dk[keys:] == 0) and torch.all(dv[keys:] == 0)


def test_dropout_sdpa_runs_sm90(sm90, impl):
    # The SDPA entry's dropout calls run the Hopper backward too (FLASH_ATTN_EXT_BWD_IMPL=mma
    # still sends them to mma.sync).
    q, k, v = make_qkv(1, 300, 300, 2, 128, torch.bfloat16, DEVICE, layout="bhsd")
    out = fa.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    dout = torch.randn_like(out)
    names = kernel_names(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    assert any(SM90_BWD_KERNEL in n for n in names)
    impl("mma")
    names = kernel_names(lambda: torch.autograd.grad(out, (q, k, v), dout))
    assert not any(SM90_BWD_KERNEL in n for n in names)
