"""Attention variants (flash-attn's window_size, softcap, alibi_slopes): values and gradients
against the float64 reference (attention_ref) with FlashAttention's accuracy rule
(tests/helpers.py) on the CPU and, marked gpu, on CUDA (the 16-bit mma.sync kernels and the
fp32 SIMT kernels), through every entry point that takes
them (flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, the raw operators);
the bad-value errors."""
import time

import pytest
import torch

import flash_attn_ext as fa
from flash_attn_ext.ops import FlashAttnFunction
from helpers import (OPCHECK_UTILS, alibi_slopes, assert_compiled_matches_eager, check_lse,
                     check_out_and_grads, gqa_attention, make_varlen, opcheck_varlen_ops,
                     padded_attention, randn, ref_and_base, varlen_attention)

HEADS, KV_HEADS = 4, 2  # every test below is grouped-query

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _slopes(kind, batch=2, heads=HEADS, device="cpu"):
    return alibi_slopes(kind, batch, heads, device)


# (causal, window_size, softcap, alibi kind): each variant alone, with causal, and combined.
CASES = {
    "window_0_0": (False, (0, 0), 0.0, None),
    "window_1_1": (False, (1, 1), 0.0, None),
    "window_left_only": (False, (17, -1), 0.0, None),
    "window_right_only": (False, (-1, 5), 0.0, None),
    "window_huge": (False, (100000, 100000), 0.0, None),
    "causal_window": (True, (33, -1), 0.0, None),
    "causal_window_0": (True, (0, 0), 0.0, None),
    "softcap30": (False, (-1, -1), 30.0, None),
    "softcap50_causal": (True, (-1, -1), 50.0, None),
    "softcap_strong": (False, (-1, -1), 1.5, None),
    "alibi_head": (False, (-1, -1), 0.0, "head"),
    "alibi_batch_causal": (True, (-1, -1), 0.0, "batch"),
    "all_three": (False, (40, 8), 30.0, "batch"),
    "all_three_causal": (True, (20, -1), 2.0, "head"),
}


def _variant(case, batch=2, device="cpu"):
    causal, window, softcap, alibi = CASES[case]
    return causal, dict(window_size=window, softcap=softcap,
                        alibi_slopes=_slopes(alibi, batch, device=device))


def _ops_variant(variant):
    """attention_ref's keyword arguments -> FlashAttnFunction's trailing arguments."""
    return (*variant["window_size"], variant["softcap"], variant["alibi_slopes"])


def _spread(cases, combos):
    """(case, *combo) pairs: every case with combos[0], and the other combos in turn, so each
    case meets more than one dtype / shape without the full cross product."""
    out = []
    for i, case in enumerate(cases):
        out.append((case, *combos[0]))
        out.append((case, *combos[1 + i % (len(combos) - 1)]))
    return out


SHAPES = [(113, 300), (300, 113)]
FUNC_PARAMS = _spread(list(CASES), [(torch.float32, *SHAPES[0]), (torch.float32, *SHAPES[1]),
                                    (torch.bfloat16, *SHAPES[0]), (torch.float16, *SHAPES[1]),
                                    (torch.bfloat16, *SHAPES[1]), (torch.float16, *SHAPES[0])])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case,dtype,seqlen_q,seqlen_k", FUNC_PARAMS, ids=str)
def test_flash_attn_func(case, dtype, seqlen_q, seqlen_k, device, head_dim=32,
                         deterministic=False):
    """Odd lengths across the CPU tiles (64 query rows, 256 keys) and the CUDA ones, Sq < Sk
    and Sq > Sk (where bottom-right windows leave the first rows without keys: zeros,
    lse = -inf)."""
    batch = 2
    causal, variant = _variant(case, device=device)
    q = randn((batch, seqlen_q, HEADS, head_dim), dtype, device, 1, True)
    k = randn((batch, seqlen_k, KV_HEADS, head_dim), dtype, device, 2, True)
    v = randn((batch, seqlen_k, KV_HEADS, head_dim), dtype, device, 3, True)
    scale = 0.5 if head_dim <= 32 else 0.25  # larger scores than 1/sqrt(d): the softcap bends them
    res = fa.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal,
                return_lse=True, deterministic=deterministic, **variant)
    out, lse = res
    dout = randn(out.shape, dtype, device, 4)
    ref, base = ref_and_base(lambda q, k, v: gqa_attention(q, k, v, causal, scale=scale,
                                                           **variant), (q, k, v), dout)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    # A one-key window makes dS = P (dP - D) exactly 0 in exact arithmetic (and in the
    # same-precision reference); here dP and D are fp32 dot products over head_dim terms in
    # different orders, so their difference leaves a residue that grows with head_dim.
    check_out_and_grads(out, grads, ref, base, dtype, grad_atol=1e-5 * max(1, head_dim // 64))
    check_lse(lse, ref[1], dtype)


@pytest.mark.parametrize("case", ["window_1_1", "causal_window", "all_three", "all_three_causal"])
def test_top_left_alignment(case):
    """The operators also align windows and ALiBi top-left (causal_bottom_right=False), like
    causal in the SDPA entry point."""
    causal, variant = _variant(case)
    q = randn((2, 70, HEADS, 16), torch.float32, "cpu", 1, True)
    k = randn((2, 45, KV_HEADS, 16), torch.float32, "cpu", 2, True)
    v = randn((2, 45, KV_HEADS, 16), torch.float32, "cpu", 3, True)
    out, lse = FlashAttnFunction.apply(q, k, v, 0.25, causal, False, False, 0, 0, None,
                                       *_ops_variant(variant))
    dout = randn(out.shape, torch.float32, "cpu", 4)
    ref, base = ref_and_base(lambda q, k, v: gqa_attention(q, k, v, causal, bottom_right=False,
                                                           scale=0.25, **variant), (q, k, v), dout)
    check_out_and_grads(out, torch.autograd.grad(out, (q, k, v), dout), ref, base, torch.float32)
    check_lse(lse, ref[1], torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_fully_masked_rows(device):
    """A window that excludes every key of some rows: those rows are zeros with lse = -inf,
    and every gradient is finite (the rows contribute nothing)."""
    dtype, d = (torch.float32, 16) if device == "cpu" else (torch.float16, 32)
    q = randn((1, 40, 2, d), dtype, device, 1, True)
    k = randn((1, 10, 2, d), dtype, device, 2, True)
    v = randn((1, 10, 2, d), dtype, device, 3, True)
    # row i sees keys [i - 32, i - 28]: rows 0..27 see none
    out, lse = fa.flash_attn_func(q, k, v, window_size=(2, 2), softcap=5.0,
                                  alibi_slopes=torch.tensor([0.1, 0.3], device=device),
                                  return_lse=True)
    assert torch.equal(out[:, :28], torch.zeros_like(out[:, :28]))
    assert (lse[..., :28] == float("-inf")).all() and torch.isfinite(lse[..., 28:]).all()
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[0][:, :28], torch.zeros_like(grads[0][:, :28]))


def test_equivalences():
    """Window (-1, 0) is causal; with causal the right bound is 0 whatever window_size says
    (flash-attn's rule); a window wider than the sequences and softcap 0 are no-ops: all
    bit-identical to the plain call."""
    q, k, v = (randn((2, n, HEADS, 32), torch.bfloat16, "cpu", s) for n, s in ((50, 1), (77, 2), (77, 3)))
    causal = fa.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(fa.flash_attn_func(q, k, v, window_size=(-1, 0)), causal)
    assert torch.equal(fa.flash_attn_func(q, k, v, causal=True, window_size=(-1, 7)), causal)
    assert torch.equal(fa.flash_attn_func(q, k, v, causal=True, window_size=(9, 7)),
                       fa.flash_attn_func(q, k, v, window_size=(9, 0)))
    plain = fa.flash_attn_func(q, k, v)
    assert torch.equal(fa.flash_attn_func(q, k, v, window_size=(76, 49), softcap=0.0), plain)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["window_1_1", "causal_window", "softcap_strong",
                                  "alibi_batch_causal", "all_three", "all_three_causal"])
def test_seqused_k(case, dtype, device):
    """Windows and ALiBi align to each batch entry's used keys."""
    causal, variant = _variant(case, device=device)
    q = randn((2, 37, HEADS, 32), dtype, device, 1, True)
    k = randn((2, 90, KV_HEADS, 32), dtype, device, 2, True)
    v = randn((2, 90, KV_HEADS, 32), dtype, device, 3, True)
    used = torch.tensor([61, 20], dtype=torch.int32, device=device)
    res = fa.flash_attn_func(q, k, v, causal=causal, seqused_k=used,
                return_lse=True, **variant)
    out, lse = res
    dout = randn(out.shape, dtype, device, 4)
    ref, base = ref_and_base(lambda q, k, v: padded_attention(q, k, v, causal, used, **variant),
                             (q, k, v), dout)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_out_and_grads(out, grads, ref, base, dtype)
    check_lse(lse, ref[1], dtype)
    assert torch.equal(grads[1][1, 20:], torch.zeros_like(k[1, 20:]))  # unused keys: dk = 0


VARLEN_CASES = ["window_1_1", "window_left_only", "causal_window", "softcap30",
                "alibi_batch_causal", "all_three", "all_three_causal"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case,dtype,with_seqused_k", _spread(
    VARLEN_CASES, [(torch.float32, False), (torch.bfloat16, True), (torch.float16, False),
                   (torch.float32, True)]), ids=str)
def test_varlen(case, dtype, with_seqused_k, device):
    """Per sequence: bottom-right windows, ALiBi slopes per sequence ([batch, heads])."""
    lens_q, lens_k = [7, 0, 130, 300, 1], [300, 5, 130, 77, 0]
    causal, variant = _variant(case, batch=len(lens_q), device=device)
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, HEADS, KV_HEADS, 32, dtype,
                                                    device, pad_q=3, pad_k=2)
    used = (torch.tensor([250, 5, 64, 77, 0], dtype=torch.int32, device=device)
            if with_seqused_k else None)
    res = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                causal=causal, seqused_k=used, return_lse=True, **variant)
    out, lse = res
    dout = randn(out.shape, dtype, device, 9)
    ref, base = ref_and_base(
        lambda q, k, v: varlen_attention(q, k, v, cu_q, cu_k, causal, used, **variant),
        (q, k, v), dout)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_out_and_grads(out, grads, ref, base, dtype)
    check_lse(lse[:, :int(cu_q[-1])], ref[1], dtype)


KVCACHE_CASES = ["window_0_0", "window_left_only", "causal_window", "softcap50_causal",
                 "alibi_head", "all_three", "all_three_causal"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case,dtype,seqlen_q", _spread(
    KVCACHE_CASES, [(torch.float32, 1), (torch.bfloat16, 3), (torch.float16, 1),
                    (torch.float32, 3), (torch.float16, 3), (torch.bfloat16, 1)]), ids=str)
def test_kvcache(case, dtype, seqlen_q, device, cache_len=40, head_dim=32, num_splits=0):
    """Decoding against a KV cache (with an in-place append): windows and ALiBi align to the
    end of each batch entry's valid prefix."""
    batch = 3
    causal, variant = _variant(case, batch=batch, device=device)
    q = randn((batch, seqlen_q, HEADS, head_dim), dtype, device, 31)
    k_cache = randn((batch, cache_len, KV_HEADS, head_dim), dtype, device, 32)
    v_cache = randn((batch, cache_len, KV_HEADS, head_dim), dtype, device, 33)
    k_new = randn((batch, 2, KV_HEADS, head_dim), dtype, device, 34)
    v_new = randn((batch, 2, KV_HEADS, head_dim), dtype, device, 35)
    seqlens = torch.tensor([0, 17, cache_len - 2], dtype=torch.int32, device=device)
    res = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new,
                v=v_new, cache_seqlens=seqlens, causal=causal, return_softmax_lse=True,
                num_splits=num_splits, **variant)
    out, lse = res
    lengths = seqlens + 2
    ref, base = ref_and_base(lambda q, k, v: padded_attention(q, k, v, causal, lengths, **variant),
                             (q, k_cache, v_cache))
    check_out_and_grads(out, None, ref, base, dtype)
    check_lse(lse, ref[1], dtype)


# ---- CUDA only: the kernels' head dims, deterministic backward, split-KV decode --------------
CUDA_CASES = ["window_0_0", "causal_window", "softcap30", "alibi_batch_causal", "all_three",
              "all_three_causal"]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("case", CUDA_CASES)
def test_cuda_head_dims(case, head_dim):
    """Every tile family of the 16-bit kernels (their tiles change with the head dim)."""
    dtype = torch.bfloat16 if head_dim % 64 == 0 else torch.float16
    seqlens = SHAPES[CUDA_CASES.index(case) % 2]
    test_flash_attn_func(case, dtype, *seqlens, "cuda", head_dim=head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("softcap,causal", [(50.0, True), (55.0, False), (56.0, True)])
def test_cuda_softcap_saturated(softcap, causal, head_dim):
    """Softcapped bf16 scores pushed to both caps (the Hopper forward skips the running max
    when softcap <= 55, csrc/cuda/common/fwd_softmax.cuh): rows whose every score sits near
    -softcap (probabilities ~2^-79 before normalising) and rows near +softcap keep the
    reference's values, lse and gradients."""
    dtype, batch, seqlen_q, seqlen_k = torch.bfloat16, 2, 200, 333
    direction = randn((head_dim,), torch.float32, "cuda", 5)
    direction = direction / direction.norm()
    k = randn((batch, seqlen_k, KV_HEADS, head_dim), torch.float32, "cuda", 2) * 0.3
    k = (k + 4.0 * direction).to(dtype).requires_grad_()
    q = randn((batch, seqlen_q, HEADS, head_dim), torch.float32, "cuda", 1) * 0.3
    sign = torch.where(torch.arange(seqlen_q, device="cuda") % 3 == 0, -1.0, 1.0)
    q = (q + 400.0 * sign[None, :, None, None] * direction).to(dtype).requires_grad_()
    v = randn((batch, seqlen_k, KV_HEADS, head_dim), dtype, "cuda", 3, True)
    scale = 1.0 / head_dim ** 0.5
    out, lse = fa.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, softcap=softcap,
                                  return_lse=True)
    dout = randn(out.shape, dtype, "cuda", 4)
    ref, base = ref_and_base(lambda q, k, v: gqa_attention(q, k, v, causal, scale=scale,
                                                           softcap=softcap), (q, k, v), dout)
    check_out_and_grads(out, torch.autograd.grad(out, (q, k, v), dout), ref, base, dtype)
    check_lse(lse, ref[1], dtype)


def _impls(device):
    return ["auto", "mma"] if device == "cuda" else ["auto"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap", [30.0, 50.0])
def test_softcap_single_key_rows_are_exact(device, head_dim, dtype, softcap, monkeypatch):
    """With softcap, a row that sees one key returns that key's v exactly (its probability
    is 1), on every path: CPU, the Hopper forward (whose bf16 softcap path has no running max
    and sums the bf16-rounded P it multiplies V with) and the mma.sync kernels. Rows of a
    (0, 0) window see one key each; causal row 0 sees key 0. Peaked rows (one key far above
    the others) keep the reference's values (FA rule)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q = randn((2, 70, HEADS, head_dim), dtype, device, 1)
    k = randn((2, 70, KV_HEADS, head_dim), dtype, device, 2)
    v = randn((2, 70, KV_HEADS, head_dim), torch.float32, device, 3).mul(3).to(dtype)
    v_rows = v.repeat_interleave(HEADS // KV_HEADS, dim=2)
    for impl in _impls(device):
        monkeypatch.setenv("FLASH_ATTN_EXT_FWD_IMPL", impl)
        out = fa.flash_attn_func(q, k, v, window_size=(0, 0), softcap=softcap)
        assert torch.equal(out, v_rows), f"{impl}: window (0, 0) rows differ from v"
        out = fa.flash_attn_func(q, k, v, causal=True, softcap=softcap)
        assert torch.equal(out[:, 0], v_rows[:, 0]), f"{impl}: causal row 0 differs from v"
        # Peaked rows: key i's score far above the others' for query i.
        peaked_k = (k.float() + 4 * q.float()[:, :, ::HEADS // KV_HEADS]).to(dtype)
        out = fa.flash_attn_func(q, peaked_k, v, softcap=softcap)
        ref, base = ref_and_base(lambda q, k, v: gqa_attention(q, k, v, False, softcap=softcap),
                                 (q, peaked_k, v))
        check_out_and_grads(out, None, (ref[0], ref[1], None), (base[0], base[1], None), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["window_1_1", "all_three_causal"])
def test_cuda_deterministic(case):
    test_flash_attn_func(case, torch.float16, 300, 113, "cuda", head_dim=64, deterministic=True)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("case", KVCACHE_CASES)
def test_cuda_kvcache_splits(case, seqlen_q, num_splits):
    """Decode tiles (one-warp and key-warp), split-KV through the combine kernel, and the GQA
    decode regrouping (seqlen_q = 1: softcap only; windows and ALiBi keep one row per head)."""
    dtype = torch.float16 if num_splits == 1 else torch.bfloat16
    test_kvcache(case, dtype, seqlen_q, "cuda", cache_len=300, head_dim=128,
                 num_splits=num_splits)


def test_window_skips_key_tiles():
    """Time falls with the window: key tiles outside every row's window are never visited
    (forward and backward). A 128-key causal window over 4096 keys does ~1/16 of full causal's
    work; the bound leaves a wide margin for timing noise."""
    q, k, v = (randn((1, 4096, 2, 64), torch.float32, "cpu", s, True) for s in (1, 2, 3))

    def timed(**kwargs):
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            out = fa.flash_attn_func(q, k, v, causal=True, **kwargs)
            torch.autograd.grad(out, (q, k, v), out)
            best = min(best, time.perf_counter() - start)
        return best

    assert timed(window_size=(128, 0)) < 0.5 * timed()


@pytest.mark.parametrize("with_variants", [False, True])
def test_torch_compile(with_variants):
    torch._dynamo.reset()
    q, k, v = (randn((2, 33, HEADS, 16), torch.float32, "cpu", s, True) for s in (1, 2, 3))
    kwargs = dict(window_size=(5, 3), softcap=4.0, alibi_slopes=_slopes("batch")) \
        if with_variants else {}

    def f(q, k, v):
        return fa.flash_attn_func(q, k, v, causal=True, **kwargs).square().sum()

    assert_compiled_matches_eager(f, (q, k, v))


# ---- operators: opcheck -------------------------------------------------------------------
VARIANT_ARGS = [(-1, -1, 0.0, None), (7, 3, 0.0, None), (-1, -1, 20.0, None), (-1, -1, 0.0, "head"),
                (11, -1, 3.0, "batch")]


@pytest.mark.parametrize("variant", VARIANT_ARGS, ids=str)
def test_opcheck(variant):
    left, right, softcap, alibi = variant
    q, k, v = (randn((2, n, HEADS, 16), torch.float32, "cpu", s) for n, s in ((37, 1), (53, 2), (53, 3)))
    var = (left, right, softcap, _slopes(alibi))
    fwd_args = (q, k, v, 0.25, True, True, 0, 0, None, *var)
    torch.library.opcheck(torch.ops.flash_attn_ext.fwd.default, fwd_args, test_utils=OPCHECK_UTILS)
    out, lse = torch.ops.flash_attn_ext.fwd(*fwd_args)
    torch.library.opcheck(torch.ops.flash_attn_ext.bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse, 0.25, True, True, False,
                           None, *var), test_utils=OPCHECK_UTILS)
    opcheck_varlen_ops((left, right, softcap, _slopes(alibi, batch=3)), False, HEADS, KV_HEADS)


# ---- bad values: clear errors ---------------------------------------------------------------
def _small():
    return (randn((2, 8, HEADS, 16), torch.float32, "cpu", s) for s in (1, 2, 3))


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(window_size=(0, -7)), ValueError, "window_size"),
    (dict(window_size=(3,)), TypeError, "window_size"),
    (dict(window_size=(1.5, 2)), TypeError, "window_size"),
    (dict(window_size=None), TypeError, "window_size"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(softcap="30"), TypeError, "softcap"),
    (dict(alibi_slopes=[0.5] * HEADS), TypeError, "alibi_slopes"),
    (dict(alibi_slopes=torch.ones(HEADS, dtype=torch.float64)), RuntimeError, "alibi_slopes.*float32"),
    (dict(alibi_slopes=torch.ones(HEADS, dtype=torch.float16)), RuntimeError, "alibi_slopes.*float32"),
    (dict(alibi_slopes=torch.ones(HEADS + 1)), RuntimeError, r"alibi_slopes.*shape"),
    (dict(alibi_slopes=torch.ones(KV_HEADS)), RuntimeError, r"alibi_slopes.*shape"),
    (dict(alibi_slopes=torch.ones(3, HEADS)), RuntimeError, r"alibi_slopes.*shape"),
    (dict(alibi_slopes=torch.ones(1, 2, HEADS)), RuntimeError, r"alibi_slopes.*shape"),
    (dict(alibi_slopes=torch.ones(HEADS, 2)[:, 0]), RuntimeError, "alibi_slopes.*contiguous"),
])
def test_bad_values(kwargs, exc, match):
    q, k, v = _small()
    with pytest.raises(exc, match=match):
        fa.flash_attn_func(q, k, v, **kwargs)
    with pytest.raises(exc, match=match):
        fa.flash_attn_with_kvcache(q, k, v, **kwargs)


@pytest.mark.parametrize("variant,match", [
    ((-3, -1, 0.0, None), "window_size"),
    ((-1, -2, 0.0, None), "window_size"),
    ((-1, -1, -0.5, None), "softcap"),
    ((-1, -1, 0.0, torch.ones(HEADS, dtype=torch.int32)), "alibi_slopes"),
])
def test_bad_values_operators(variant, match):
    """The raw operators check the values themselves."""
    q, k, v = _small()
    with pytest.raises(RuntimeError, match=match):
        torch.ops.flash_attn_ext.fwd(q, k, v, 0.25, False, True, 0, 0, None, *variant)


def test_bad_values_varlen():
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen([3, 4], [5, 6], HEADS, KV_HEADS, 16,
                                                    torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=r"alibi_slopes.*\[2, 4\]"):  # one row per sequence
        fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, alibi_slopes=torch.ones(3, 4))
    with pytest.raises(ValueError, match="window_size"):
        fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(0, -9))


def test_sdpa_keeps_torch_signature():
    import inspect
    params = inspect.signature(fa.scaled_dot_product_attention).parameters
    assert not {"window_size", "softcap", "alibi_slopes"} & set(params)




# ---- CUDA: argument checks and windows that are no variant --------------------------------
@pytest.mark.gpu
def test_cuda_alibi_on_another_device():
    q, k, v = (randn((2, 64, HEADS, 64), torch.float16, "cuda", s) for s in (1, 2, 3))
    with pytest.raises(RuntimeError, match="alibi_slopes must be on the device of q"):
        fa.flash_attn_func(q, k, v, alibi_slopes=_slopes("head"))


@pytest.mark.gpu
def test_cuda_windows_equal_to_plain_calls_run():
    """Windows that are exactly causal or wider than the sequences are no variant: CUDA runs."""
    q, k, v = (randn((2, 64, HEADS, 64), torch.float16, "cuda", s) for s in (1, 2, 3))
    causal = fa.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(fa.flash_attn_func(q, k, v, window_size=(-1, 0)), causal)
    assert torch.equal(fa.flash_attn_func(q, k, v, causal=True, window_size=(63, 5)), causal)
    assert torch.equal(fa.flash_attn_func(q, k, v, window_size=(1000, 1000)),
                       fa.flash_attn_func(q, k, v))
