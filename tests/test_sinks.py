"""Learnable attention sinks (gpt-oss; `learnable_sink=` on every entry point): one extra logit
per query head in each row's softmax denominator, with no value. Values, lse and the gradients
of q, k, v and the sink against float64 references with FlashAttention's accuracy rule
(tests/helpers.py), in combination with GQA, causal (both alignments), windows, softcap,
ALiBi, dropout, varlen, paged KV caches and split-KV decode; on CPU and (marked gpu) CUDA,
where the head dims cover the Hopper kernels (64 / 128 / 256) and the mma.sync ones."""
import pytest
import torch

import flash_attn_ext as fa
from flash_attn_ext.reference import attention_ref
from helpers import (OPCHECK_UTILS, assert_fa_rule, assert_grads_repeat, check_lse,
                     check_out_and_grads, gqa_attention, make_varlen, randn, ref_and_base,
                     varlen_attention)

CUDA = torch.cuda.is_available() and fa.has_cuda_kernels()


def _devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _need(device):
    if device == "cuda" and not CUDA:
        pytest.skip("needs CUDA and the CUDA kernels")


def _sink(heads, device, seed=3, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(heads, generator=gen) * scale).to(device).requires_grad_()


def _check_sink_grad(ours, ref, base):
    assert ours is not None and ours.dtype == torch.float32 and ours.shape == ref.shape
    assert_fa_rule(ours, ref, base, 3, atol=1e-4, what="dsink")


# ---- dense: flash_attn_func ---------------------------------------------------------------
DENSE = [
    # (batch, seqlen_q, seqlen_k, heads, kv heads, head_dim)
    (2, 37, 53, 4, 2, 32),
    (1, 64, 29, 6, 6, 48),  # Sq > Sk: bottom-right causal leaves the first rows without keys
]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", DENSE)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (7, 0)])
def test_dense_values_and_grads(device, dtype, shape, causal, window):
    _need(device)
    b, sq, sk, h, hk, d = shape
    q = randn((b, sq, h, d), dtype, device, 1, True)
    k = randn((b, sk, hk, d), dtype, device, 2, True)
    v = randn((b, sk, hk, d), dtype, device, 3, True)
    sink = _sink(h, device)
    dout = randn((b, sq, h, d), dtype, device, 4)
    out, lse = fa.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                  learnable_sink=sink, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v, sink), dout)

    def attention(q, k, v, s):
        return gqa_attention(q, k, v, causal, window_size=window, learnable_sink=s)

    ref, base = ref_and_base(attention, (q, k, v, sink), dout)
    check_out_and_grads(out, grads[:3], ref, base, dtype)
    check_lse(lse, ref[1], dtype)
    _check_sink_grad(grads[3], ref[2][3], base[2][3])


@pytest.mark.parametrize("device", _devices())
def test_rows_without_keys_give_zero_and_lse_sink(device):
    """A row that sees no key attends only to the sink: out 0, lse = sink, and its gradient
    adds nothing (D = dout . out = 0)."""
    _need(device)
    q = randn((1, 9, 2, 16), torch.float32, device, 1, True)
    k = randn((1, 4, 2, 16), torch.float32, device, 2, True)
    v = randn((1, 4, 2, 16), torch.float32, device, 3, True)
    sink = torch.tensor([0.5, -1.0], device=device, requires_grad=True)
    out, lse = fa.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_lse=True)
    empty = slice(0, 5)  # bottom-right: rows 0..4 of 9 see none of the 4 keys
    assert torch.equal(out[0, empty], torch.zeros_like(out[0, empty]))
    torch.testing.assert_close(lse[0, :, empty], sink.detach()[:, None].expand(2, 5))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("sink_value", [80.0, -80.0])
def test_extreme_sinks(device, sink_value):
    """A sink far above every score takes (almost) all of the mass without overflowing; one
    far below is the call without a sink."""
    _need(device)
    q, k, v = (randn((2, 33, 4, 32), torch.bfloat16, device, s, False) for s in (1, 2, 3))
    sink = torch.full((4,), sink_value, device=device)
    out, lse = fa.flash_attn_func(q, k, v, learnable_sink=sink, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    if sink_value > 0:
        assert out.abs().max().item() < 1e-20
        torch.testing.assert_close(lse, torch.full_like(lse, sink_value))
    else:
        plain, plain_lse = fa.flash_attn_func(q, k, v, return_lse=True)
        torch.testing.assert_close(out, plain, rtol=0, atol=0)
        torch.testing.assert_close(lse, plain_lse)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("variant", ["softcap", "alibi"])
def test_with_softcap_and_alibi(device, variant):
    _need(device)
    h = 4
    q = randn((2, 41, h, 64), torch.bfloat16, device, 1, True)
    k = randn((2, 41, 2, 64), torch.bfloat16, device, 2, True)
    v = randn((2, 41, 2, 64), torch.bfloat16, device, 3, True)
    sink = _sink(h, device)
    dout = randn((2, 41, h, 64), torch.bfloat16, device, 4)
    kw = ({"softcap": 5.0} if variant == "softcap" else
          {"alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625], device=device)})
    out = fa.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, **kw)
    grads = torch.autograd.grad(out, (q, k, v, sink), dout)

    def attention(q, k, v, s):
        return gqa_attention(q, k, v, True, learnable_sink=s, **kw)

    ref, base = ref_and_base(attention, (q, k, v, sink), dout)
    check_out_and_grads(out, grads[:3], ref, base, torch.bfloat16)
    _check_sink_grad(grads[3], ref[2][3], base[2][3])


@pytest.mark.parametrize("device", _devices())
def test_with_dropout(device):
    """The sink's probability is not dropped (it has no value); the kept ones are scaled."""
    _need(device)
    h = 4
    q = randn((2, 45, h, 32), torch.float32, device, 1, True)
    k = randn((2, 45, h, 32), torch.float32, device, 2, True)
    v = randn((2, 45, h, 32), torch.float32, device, 3, True)
    sink = _sink(h, device)
    dout = randn((2, 45, h, 32), torch.float32, device, 4)
    torch.manual_seed(11)
    out, lse, keep = fa.flash_attn_func(q, k, v, dropout_p=0.25, causal=True,
                                        learnable_sink=sink, return_attn_probs=True)
    grads = torch.autograd.grad(out, (q, k, v, sink), dout)

    def attention(q, k, v, s):
        return attention_ref(q, k, v, causal=True, upcast=False, return_lse=True,
                             dropout_p=0.25, dropout_mask=keep, learnable_sink=s)

    ref, base = ref_and_base(attention, (q, k, v, sink), dout)
    check_out_and_grads(out, grads[:3], ref, base, torch.float32)
    _check_sink_grad(grads[3], ref[2][3], base[2][3])


@pytest.mark.parametrize("device", _devices())
def test_deterministic_sink_grad(device):
    _need(device)
    q = randn((2, 70, 4, 64), torch.bfloat16, device, 1, True)
    k = randn((2, 70, 2, 64), torch.bfloat16, device, 2, True)
    v = randn((2, 70, 2, 64), torch.bfloat16, device, 3, True)
    sink = _sink(4, device)
    dout = randn((2, 70, 4, 64), torch.bfloat16, device, 4)
    out = fa.flash_attn_func(q, k, v, causal=True, deterministic=True, learnable_sink=sink)
    grads = torch.autograd.grad(out, (q, k, v, sink), dout, retain_graph=True)
    assert_grads_repeat(out, (q, k, v, sink), dout, grads, 3)


@pytest.mark.parametrize("device", _devices())
def test_sink_in_the_model_dtype(device):
    """A bfloat16 sink (a model parameter in its dtype) is cast to float32 for the kernels and
    its gradient comes back in bfloat16; a sink that needs no gradient gets none."""
    _need(device)
    q, k, v = (randn((1, 20, 2, 32), torch.bfloat16, device, s, True) for s in (1, 2, 3))
    sink = torch.tensor([0.25, -0.5], dtype=torch.bfloat16, device=device, requires_grad=True)
    out = fa.flash_attn_func(q, k, v, learnable_sink=sink)
    out.float().sum().backward()
    assert sink.grad is not None and sink.grad.dtype == torch.bfloat16
    plain = torch.tensor([0.25, -0.5], device=device)  # no grad: q, k, v still get theirs
    out = fa.flash_attn_func(q, k, v, learnable_sink=plain)
    assert out.requires_grad


@pytest.mark.parametrize("device", _devices())
def test_sdpa_entry_point(device):
    """scaled_dot_product_attention's layout [batch, heads, seqlen, head_dim], top-left causal,
    GQA, with and without autograd."""
    _need(device)
    q = randn((2, 4, 30, 32), torch.float32, device, 1, True)
    k = randn((2, 2, 30, 32), torch.float32, device, 2, True)
    v = randn((2, 2, 30, 32), torch.float32, device, 3, True)
    sink = _sink(4, device)
    dout = randn((2, 4, 30, 32), torch.float32, device, 4)
    out = fa.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                          learnable_sink=sink)
    grads = torch.autograd.grad(out, (q, k, v, sink), dout)

    def attention(q, k, v, s):
        return gqa_attention(q, k, v, True, bottom_right=False, layout="bhsd", learnable_sink=s)

    ref, base = ref_and_base(attention, (q, k, v, sink), dout)
    check_out_and_grads(out, grads[:3], ref, base, torch.float32)
    _check_sink_grad(grads[3], ref[2][3], base[2][3])
    with torch.no_grad():
        again = fa.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                learnable_sink=sink)
    torch.testing.assert_close(again, out, rtol=0, atol=0)


# ---- varlen, paged, decode ------------------------------------------------------------------
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [(-1, -1), (5, 0)])
def test_varlen(device, dtype, window):
    _need(device)
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen([17, 0, 40, 3], [23, 6, 40, 11], 4, 2, 64,
                                                    dtype, device, pad_q=3)
    sink = _sink(4, device)
    dout = randn(q.shape, dtype, device, 9)
    out, lse = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                         window_size=window, learnable_sink=sink,
                                         return_lse=True)

    def attention(q, k, v, s):
        return varlen_attention(q, k, v, cu_q, cu_k, True, window_size=window, learnable_sink=s)

    rows = int(cu_q[-1])
    dout_rows = dout.clone()
    dout_rows[rows:] = 0  # padding rows are not outputs of any sequence
    grads = torch.autograd.grad(out, (q, k, v, sink), dout_rows)
    ref, base = ref_and_base(attention, (q, k, v, sink), dout_rows)
    check_out_and_grads(out, grads[:3], ref, base, dtype, rows=rows)
    check_lse(lse[:, :rows], ref[1], dtype)
    _check_sink_grad(grads[3], ref[2][3], base[2][3])


@pytest.mark.parametrize("device", _devices())
def test_paged_varlen_under_autograd(device):
    """flash_attn_varlen_func over a paged cache (block_table) with a sink: the same values and
    gradients (the sink's included) as over the contiguous keys."""
    _need(device)
    lens_q, lens_k, page = [5, 12], [20, 33], 16
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, 4, 2, 32, torch.float32,
                                                    device)
    pages_per_seq = [(n + page - 1) // page for n in lens_k]
    n_pages = sum(pages_per_seq) + 1
    order = torch.randperm(n_pages, generator=torch.Generator().manual_seed(5))
    table = torch.zeros((2, max(pages_per_seq)), dtype=torch.int32)
    k_pool = torch.zeros((n_pages, page, 2, 32))
    v_pool = torch.zeros((n_pages, page, 2, 32))
    used = 0
    for b, n in enumerate(lens_k):
        for p in range(pages_per_seq[b]):
            slot = int(order[used])
            used += 1
            table[b, p] = slot
            rows = slice(p * page, min((p + 1) * page, n))
            count = rows.stop - rows.start
            start = int(cu_k[b]) + rows.start
            k_pool[slot, :count] = k.detach()[start:start + count].cpu()
            v_pool[slot, :count] = v.detach()[start:start + count].cpu()
    k_pool = k_pool.to(device).requires_grad_()
    v_pool = v_pool.to(device).requires_grad_()
    table = table.to(device)
    sink = _sink(4, device)
    dout = randn(q.shape, torch.float32, device, 9)
    out = fa.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, max_q, max_k, causal=True,
                                    block_table=table, learnable_sink=sink)
    dq, dsink = torch.autograd.grad(out, (q, sink), dout)
    sink2 = sink.detach().clone().requires_grad_()
    q2 = q.detach().clone().requires_grad_()
    ref = fa.flash_attn_varlen_func(q2, k.detach(), v.detach(), cu_q, cu_k, max_q, max_k,
                                    causal=True, learnable_sink=sink2)
    dq2, dsink2 = torch.autograd.grad(ref, (q2, sink2), dout)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(dq, dq2)
    torch.testing.assert_close(dsink, dsink2)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_kvcache_decode(device, num_splits, heads):
    """flash_attn_with_kvcache with a sink: one query token (split-KV adds the sink in exactly
    one split; GQA decode does not regroup heads into rows) and a short prefill chunk."""
    _need(device)
    h, hk = heads
    cache_len = 300
    k_cache = randn((2, cache_len, hk, 64), torch.bfloat16, device, 2)
    v_cache = randn((2, cache_len, hk, 64), torch.bfloat16, device, 3)
    lengths = torch.tensor([257, 131], dtype=torch.int32, device=device)
    sink = _sink(h, device).detach()
    for seqlen_q in (1, 4):
        q = randn((2, seqlen_q, h, 64), torch.bfloat16, device, 1)
        out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                              causal=True, num_splits=num_splits,
                                              learnable_sink=sink, return_softmax_lse=True)
        for b, n in enumerate(lengths.tolist()):
            def attention(q, k, v, s):
                return gqa_attention(q, k, v, True, learnable_sink=s)

            ref, base = ref_and_base(attention, (q[b:b + 1], k_cache[b:b + 1, :n],
                                                 v_cache[b:b + 1, :n], sink))
            assert_fa_rule(out[b:b + 1], ref[0], base[0], 2)
            check_lse(lse[b:b + 1], ref[1], torch.bfloat16)


# ---- torch.compile, opcheck, bad inputs -----------------------------------------------------
def test_opcheck_with_sink():
    q, k, v = (torch.randn(2, 11, 4, 16) for _ in range(3))
    sink = torch.randn(4)
    args = (q, k, v, 0.25, True, True, 0, 0, None, -1, -1, 0.0, None, 0.0, None, None, sink)
    torch.library.opcheck(torch.ops.flash_attn_ext.fwd.default, args, test_utils=OPCHECK_UTILS)
    out, lse = torch.ops.flash_attn_ext.fwd(*args)
    bwd_args = (torch.randn_like(out), q, k, v, out, lse, 0.25, True, True, False, None, -1, -1,
                0.0, None, 0.0, None, None, sink)
    torch.library.opcheck(torch.ops.flash_attn_ext.bwd.default, bwd_args,
                          {"dsink": torch.zeros(4)}, test_utils=OPCHECK_UTILS)


def test_compiled_matches_eager():
    q, k, v = (torch.randn(2, 16, 4, 16, requires_grad=True) for _ in range(3))
    sink = torch.randn(4, requires_grad=True)

    def f(q, k, v, sink):
        return fa.flash_attn_func(q, k, v, causal=True, learnable_sink=sink).square().sum()

    from helpers import assert_compiled_matches_eager
    assert_compiled_matches_eager(f, (q, k, v, sink))


@pytest.mark.parametrize("device", _devices())
def test_bad_sinks_raise(device):
    _need(device)
    q, k, v = (randn((1, 8, 4, 32), torch.bfloat16, device, s) for s in (1, 2, 3))
    bad = [
        (torch.zeros(3, device=device), RuntimeError, "shape"),
        (torch.zeros(1, 4, device=device), RuntimeError, "shape"),
        (torch.zeros(4, dtype=torch.float64, device=device), RuntimeError, "float32"),
        (torch.zeros(4, dtype=torch.int64, device=device), RuntimeError, "float32"),
        ([0.0] * 4, TypeError, "tensor"),
    ]
    if device == "cuda":
        bad.append((torch.zeros(4), RuntimeError, "device"))
    for sink, error, words in bad:
        with pytest.raises(error, match=words):
            fa.flash_attn_func(q, k, v, learnable_sink=sink)
    # The operators check a float32 sink too (shape), and the dsink of their backward.
    with pytest.raises(RuntimeError, match="learnable_sink"):
        torch.ops.flash_attn_ext.fwd(q, k, v, 0.1, False, True, 0, 0, None, -1, -1, 0.0, None,
                                     0.0, None, None, torch.zeros(5, device=device))
    out, lse = torch.ops.flash_attn_ext.fwd(q, k, v, 0.1, False, True)
    with pytest.raises(RuntimeError, match="dsink"):
        torch.ops.flash_attn_ext.bwd(out, q, k, v, out, lse, 0.1, False, True,
                                     dsink=torch.zeros(4, device=device))


@pytest.mark.parametrize("device", _devices())
def test_bad_sink_leaves_the_cache_alone(device):
    """A bad sink raises before flash_attn_with_kvcache appends k / v to the cache."""
    _need(device)
    k_cache = torch.zeros((1, 32, 2, 32), dtype=torch.bfloat16, device=device)
    v_cache = torch.zeros_like(k_cache)
    q = randn((1, 1, 4, 32), torch.bfloat16, device, 1)
    k_new = randn((1, 1, 2, 32), torch.bfloat16, device, 2)
    with pytest.raises(RuntimeError, match="shape"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new,
                                   cache_seqlens=torch.tensor([3], dtype=torch.int32,
                                                              device=device),
                                   learnable_sink=torch.zeros(3, device=device))
    assert not k_cache.any() and not v_cache.any()


def test_fp8_with_sink_is_not_implemented():
    q = torch.zeros((1, 8, 2, 32)).to(torch.float8_e4m3fn)
    one = torch.ones(())
    with pytest.raises(NotImplementedError, match="learnable_sink"):
        fa.flash_attn_func(q, q, q, q_descale=one, k_descale=one, v_descale=one,
                           learnable_sink=torch.zeros(2))


# ---- GPU: the Hopper kernels' head dims, long rows ------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_head_dims(head_dim, causal, dtype):
    """Sequences of several tiles at the Hopper kernels' head dims (64 runs three consumer
    warpgroups there for long rows) and an mma.sync one (96)."""
    _need("cuda")
    b, s, h, hk = 2, 1100, 4, 2
    q = randn((b, s, h, head_dim), dtype, "cuda", 1, True)
    k = randn((b, s + 37, hk, head_dim), dtype, "cuda", 2, True)
    v = randn((b, s + 37, hk, head_dim), dtype, "cuda", 3, True)
    sink = _sink(h, "cuda")
    dout = randn((b, s, h, head_dim), dtype, "cuda", 4)
    out, lse = fa.flash_attn_func(q, k, v, causal=causal, learnable_sink=sink, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v, sink), dout)

    def attention(q, k, v, s):
        return gqa_attention(q, k, v, causal, learnable_sink=s)

    ref, base = ref_and_base(attention, (q, k, v, sink), dout)
    check_out_and_grads(out, grads[:3], ref, base, dtype)
    check_lse(lse, ref[1], dtype)
    _check_sink_grad(grads[3], ref[2][3], base[2][3])
