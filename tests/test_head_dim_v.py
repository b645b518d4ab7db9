"""A value head dim other than the query / key one (DeepSeek MLA: q, k 192 and v 128 in
training; 576 / 512 in decode, k and v views of one latent cache, v = kv_cache[..., :512]).

out, dout and dv have v's head dim, dq and dk q's; the default softmax_scale is
1/sqrt(q's head dim). Values, lse and gradients against float64 references with
FlashAttention's accuracy rule (tests/helpers.py) through flash_attn_func (causal in both
alignments, odd lengths, GQA, sinks, windows, softcap, ALiBi, dropout, deterministic),
flash_attn_varlen_func (an empty sequence, paged pools), flash_attn_with_kvcache (dense and
paged caches, appends, the 576 / 512 latent cache) and scaled_dot_product_attention (against
torch's, strides included); opcheck of the operators, torch.compile, and the errors: k / v
that differ elsewhere than the last dim, q / k head dims, ring attention and FP8
(NotImplementedError), and on CUDA head dims above 256 (NotImplementedError). On CPU in
float32 and (marked gpu) on CUDA in bfloat16 / float16, where (192, 128) on Hopper runs a
forward of its own and every other pair, and the backward, runs padded.
"""
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import flash_attn_ext as fa
from flash_attn_ext.reference import attention_ref
from helpers import (OPCHECK_UTILS, assert_compiled_matches_eager, assert_fa_rule,
                     assert_grads_repeat, check_lse, check_out_and_grads, gqa_attention,
                     make_varlen, randn, ref_and_base, varlen_attention)

CUDA = torch.cuda.is_available() and fa.has_cuda_kernels()
GPU = pytest.mark.gpu

# (device, dtype): float32 on the CPU, the 16-bit dtypes on CUDA.
DEVICE_DTYPES = [
    pytest.param("cpu", torch.float32, id="cpu-fp32"),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=GPU),
    pytest.param("cuda", torch.float16, id="cuda-fp16", marks=GPU),
]
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]
# MLA's absorbed decode dims: on CUDA a forward of their own (no backward there).
MLA_DECODE = (576, 512)


def _need(device):
    if device == "cuda" and not CUDA:
        pytest.skip("needs CUDA and the CUDA kernels")


def _dtype_of(device):
    return torch.float32 if device == "cpu" else torch.bfloat16


def _qkv(b, sq, sk, h, hk, d, dv, dtype, device, requires_grad=True, seed=1):
    q = randn((b, sq, h, d), dtype, device, seed, requires_grad)
    k = randn((b, sk, hk, d), dtype, device, seed + 1, requires_grad)
    v = randn((b, sk, hk, dv), dtype, device, seed + 2, requires_grad)
    return q, k, v


def _sink(heads, device, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(heads, generator=gen) * 2.0).to(device).requires_grad_()


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


# ---- flash_attn_func ----------------------------------------------------------------------
DENSE = [
    # (batch, seqlen_q, seqlen_k, heads, kv heads, head_dim, head_dim_v)
    pytest.param((2, 37, 53, 4, 2, 192, 128), id="192-128-sq<sk-gqa"),
    pytest.param((1, 61, 29, 4, 2, 48, 32), id="48-32-sq>sk-gqa"),  # first rows see no key
    pytest.param((2, 33, 33, 2, 2, 32, 48), id="32-48-mha"),        # v wider than q / k
    pytest.param((1, 9, 40, 4, 1, *MLA_DECODE), id="576-512-mqa"),   # CUDA: forward only
]


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("shape", DENSE)
@pytest.mark.parametrize("causal", [False, True])
def test_dense_values_and_grads(device, dtype, shape, causal):
    _need(device)
    b, sq, sk, h, hk, d, dv = shape
    if device == "cuda" and max(d, dv) > 256:
        pytest.skip("no CUDA backward for 576 / 512 (test_cuda_mla_forward)")
    q, k, v = _qkv(b, sq, sk, h, hk, d, dv, dtype, device)
    dout = randn((b, sq, h, dv), dtype, device, 4)
    out, lse = fa.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert out.shape == (b, sq, h, dv) and out.dtype == dtype
    grads = torch.autograd.grad(out, (q, k, v), dout)
    # attention_ref's default scale is 1/sqrt(q's head dim), as flash_attn_func's must be.
    ref, base = ref_and_base(lambda q, k, v: gqa_attention(q, k, v, causal), (q, k, v), dout)
    check_out_and_grads(out, grads, ref, base, dtype)
    check_lse(lse, ref[1], dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_default_scale_is_that_of_q(device):
    """softmax_scale defaults to 1/sqrt(q's head dim), not v's: the same values as passing it."""
    _need(device)
    q, k, v = _qkv(1, 17, 23, 2, 2, 48, 32, _dtype_of(device), device, requires_grad=False)
    default = fa.flash_attn_func(q, k, v)
    explicit = fa.flash_attn_func(q, k, v, softmax_scale=48 ** -0.5)
    other = fa.flash_attn_func(q, k, v, softmax_scale=32 ** -0.5)
    torch.testing.assert_close(default, explicit, rtol=0, atol=0)
    assert not torch.equal(default, other)


VARIANTS = {
    "sink": {},  # the sink is added below (it gets a gradient)
    "window": {"window_size": (7, 3)},
    "softcap": {"softcap": 5.0},
    "alibi": {"alibi_slopes": "slopes"},
    "dropout0": {"dropout_p": 0.0},
    "all": {"window_size": (11, 0), "softcap": 8.0, "alibi_slopes": "slopes"},
}


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("causal", [False, True])
def test_dense_variants(device, dtype, variant, causal):
    _need(device)
    b, sq, sk, h, hk = 2, 41, 47, 4, 2
    d, dv = (48, 32) if device == "cpu" else (192, 128)
    q, k, v = _qkv(b, sq, sk, h, hk, d, dv, dtype, device)
    dout = randn((b, sq, h, dv), dtype, device, 4)
    kw = dict(VARIANTS[variant])
    if kw.get("alibi_slopes") == "slopes":
        kw["alibi_slopes"] = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=device)
    sink = _sink(h, device) if variant in ("sink", "all") else None
    out, lse = fa.flash_attn_func(q, k, v, causal=causal, learnable_sink=sink, return_lse=True,
                                  **kw)
    leaves = (q, k, v) if sink is None else (q, k, v, sink)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_kw = {key: val for key, val in kw.items() if key != "dropout_p"}

    def attention(q, k, v, *s):
        return gqa_attention(q, k, v, causal, learnable_sink=s[0] if s else None, **ref_kw)

    ref, base = ref_and_base(attention, leaves, dout)
    check_out_and_grads(out, grads[:3], ref, base, dtype)
    check_lse(lse, ref[1], dtype)
    if sink is not None:
        assert grads[3].shape == (h,)
        assert_fa_rule(grads[3], ref[2][3], base[2][3], 3, atol=1e-4, what="dsink")


@pytest.mark.parametrize("device", DEVICES)
def test_dropout(device):
    """dropout_p > 0: the keep-mask applies to P before P V (v's head dim) and the backward
    regenerates it."""
    _need(device)
    dtype = torch.float32
    q, k, v = _qkv(2, 29, 35, 4, 2, 48, 32, dtype, device)
    dout = randn((2, 29, 4, 32), dtype, device, 4)
    torch.manual_seed(11)
    out, lse, keep = fa.flash_attn_func(q, k, v, dropout_p=0.25, causal=True,
                                        return_attn_probs=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    groups = q.shape[2] // k.shape[2]

    def attention(q, k, v):
        k, v = (t.repeat_interleave(groups, dim=2) for t in (k, v))
        return attention_ref(q, k, v, causal=True, upcast=False, return_lse=True,
                             dropout_p=0.25, dropout_mask=keep)

    ref, base = ref_and_base(attention, (q, k, v), dout)
    check_out_and_grads(out, grads, ref, base, dtype)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_deterministic(device, dtype):
    _need(device)
    d, dv = (48, 32) if device == "cpu" else (192, 128)
    q, k, v = _qkv(2, 70, 70, 4, 2, d, dv, dtype, device)
    dout = randn((2, 70, 4, dv), dtype, device, 4)
    out = fa.flash_attn_func(q, k, v, causal=True, deterministic=True)
    grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    assert [g.shape[-1] for g in grads] == [d, d, dv]
    ref, base = ref_and_base(lambda q, k, v: gqa_attention(q, k, v, True), (q, k, v), dout)
    check_out_and_grads(out, grads, ref, base, dtype)
    assert_grads_repeat(out, (q, k, v), dout, grads, 2)


# ---- flash_attn_varlen_func ---------------------------------------------------------------
@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen(device, dtype, causal):
    _need(device)
    d, dv = (48, 32) if device == "cpu" else (192, 128)
    lens_q, lens_k = [17, 0, 40, 3], [23, 6, 31, 11]  # an empty query sequence; sq > sk
    q, k, _, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, 4, 2, d, dtype, device,
                                                    pad_q=3)
    v = randn((k.shape[0], 2, dv), dtype, device, 7, True)
    dout = randn((q.shape[0], 4, dv), dtype, device, 9)
    rows = int(cu_q[-1])
    dout[rows:] = 0  # padding rows are not outputs of any sequence
    out, lse = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                         return_lse=True)
    assert out.shape == (q.shape[0], 4, dv)
    assert not out[rows:].any()
    grads = torch.autograd.grad(out, (q, k, v), dout)

    def attention(q, k, v):
        return varlen_attention(q, k, v, cu_q, cu_k, causal)

    ref, base = ref_and_base(attention, (q, k, v), dout)
    check_out_and_grads(out, grads, ref, base, dtype, rows=rows)
    check_lse(lse[:, :rows], ref[1], dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_paged_under_autograd(device):
    """flash_attn_varlen_func over page pools of two widths (block_table): the values and
    gradients of the call over the contiguous keys, dk / dv shaped like their pools."""
    _need(device)
    lens_q, lens_k, page, d, dv, hk = [5, 12], [20, 33], 16, 48, 32, 2
    q, k, _, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, 4, hk, d, torch.float32,
                                                    device)
    v = randn((k.shape[0], hk, dv), torch.float32, device, 7, True)
    pages_per_seq = [-(-n // page) for n in lens_k]
    n_pages = sum(pages_per_seq) + 1
    order = torch.randperm(n_pages, generator=torch.Generator().manual_seed(5)).tolist()
    table = torch.zeros((2, max(pages_per_seq)), dtype=torch.int32)
    k_pool = torch.zeros((n_pages, page, hk, d))
    v_pool = torch.zeros((n_pages, page, hk, dv))
    for b, n in enumerate(lens_k):
        for p in range(pages_per_seq[b]):
            slot = order.pop()
            table[b, p] = slot
            count = min(page, n - p * page)
            start = int(cu_k[b]) + p * page
            k_pool[slot, :count] = k.detach()[start:start + count].cpu()
            v_pool[slot, :count] = v.detach()[start:start + count].cpu()
    k_pool = k_pool.to(device).requires_grad_()
    v_pool = v_pool.to(device).requires_grad_()
    table = table.to(device)
    dout = randn((q.shape[0], 4, dv), torch.float32, device, 9)
    out = fa.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, max_q, max_k, causal=True,
                                    block_table=table)
    dq, dk_pool, dv_pool = torch.autograd.grad(out, (q, k_pool, v_pool), dout)
    assert dk_pool.shape == k_pool.shape and dv_pool.shape == v_pool.shape
    ref = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), dout)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(dq, rq)
    for b, n in enumerate(lens_k):  # the pools' gradient rows are the keys' ones
        for p in range(pages_per_seq[b]):
            slot, count = int(table[b, p]), min(page, n - p * page)
            start = int(cu_k[b]) + p * page
            torch.testing.assert_close(dk_pool[slot, :count], rk[start:start + count])
            torch.testing.assert_close(dv_pool[slot, :count], rv[start:start + count])


# ---- flash_attn_with_kvcache --------------------------------------------------------------
def _cache_rows(cache, b, rows, block_table=None):
    """Rows `rows` (list) of batch entry b's keys: [len(rows), heads_k, dim]."""
    rows = torch.tensor(rows, dtype=torch.long, device=cache.device)
    if block_table is None:
        return cache[b, rows]
    page = cache.shape[1]
    return cache[block_table[b].long()[rows // page], rows % page]


def _paged_pools(k_dense, v_dense, page, seed=5):
    """Dense caches [batch, capacity, heads_k, dim] as page pools with a shuffled block
    table (and two spare pages): (k_pool, v_pool, block_table)."""
    batch, capacity = k_dense.shape[:2]
    pages = capacity // page
    n_pages = batch * pages + 2
    order = torch.randperm(n_pages, generator=torch.Generator().manual_seed(seed))
    table = order[:batch * pages].view(batch, pages).to(torch.int32).to(k_dense.device)
    pools = []
    for dense in (k_dense, v_dense):
        pool = randn((n_pages, page) + tuple(dense.shape[2:]), dense.dtype, dense.device, 99)
        pool[table.long()] = dense.view(batch, pages, page, *dense.shape[2:])
        pools.append(pool)
    return pools[0], pools[1], table


def _check_kvcache_out(out, lse, q, kc, vc, lengths, causal, block_table=None, **variant):
    """out / lse of each batch entry against attention over its first lengths[b] keys."""
    dtype = q.dtype
    assert out.shape == q.shape[:-1] + (vc.shape[-1],) and out.dtype == dtype
    for b, n in enumerate(lengths):
        k = _cache_rows(kc, b, list(range(n)), block_table)[None]
        v = _cache_rows(vc, b, list(range(n)), block_table)[None]

        def attention(q, k, v):
            return gqa_attention(q, k, v, causal, **variant)

        ref, base = ref_and_base(attention, (q[b:b + 1], k, v))
        assert_fa_rule(out[b:b + 1], ref[0], base[0], 2)
        check_lse(lse[b:b + 1], ref[1], dtype)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("seqlen_q", [1, 5])
@pytest.mark.parametrize("extra", ["plain", "window", "sink"])
def test_kvcache_dense(device, dtype, seqlen_q, extra):
    """A dense cache with cache_seqlens, no append: the plain call takes the decode fast path,
    a window or a sink the general one."""
    _need(device)
    b, hk, h, cap, d, dv = 2, 2, 4, 64, 192, 128
    k_cache = randn((b, cap, hk, d), dtype, device, 2)
    v_cache = randn((b, cap, hk, dv), dtype, device, 3)
    q = randn((b, seqlen_q, h, d), dtype, device, 1)
    lengths = [41, 7]
    kw = {"window": {"window_size": (9, 0)}, "plain": {},
          "sink": {"learnable_sink": _sink(h, device).detach()}}[extra]
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=_i32(lengths, device),
                                          causal=True, return_softmax_lse=True, **kw)
    _check_kvcache_out(out, lse, q, k_cache, v_cache, lengths, True, **kw)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_append(device, dtype, paged, causal):
    """k_new [b, s_new, hk, 192] and v_new [b, s_new, hk, 128] are written into their caches
    at cache_seqlens (across a page boundary when paged), nothing else changes, and attention
    runs over the updated caches."""
    _need(device)
    b, hk, h, cap, d, dv, s_new, page = 3, 2, 4, 64, 192, 128, 3, 16
    k_dense = randn((b, cap, hk, d), dtype, device, 2)
    v_dense = randn((b, cap, hk, dv), dtype, device, 3)
    if paged:
        k_cache, v_cache, table = _paged_pools(k_dense, v_dense, page)
    else:
        k_cache, v_cache, table = k_dense, v_dense, None
    k0, v0 = k_cache.clone(), v_cache.clone()
    q = randn((b, 2, h, d), dtype, device, 1)
    k_new = randn((b, s_new, hk, d), dtype, device, 4)
    v_new = randn((b, s_new, hk, dv), dtype, device, 5)
    lengths = [0, 15, 40]  # 15 + 3 crosses into the next page
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                          cache_seqlens=_i32(lengths, device), causal=causal,
                                          block_table=table, return_softmax_lse=True)
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=device)
    for i, n in enumerate(lengths):
        rows = list(range(n, n + s_new))
        assert torch.equal(_cache_rows(k_cache, i, rows, table), k_new[i])
        assert torch.equal(_cache_rows(v_cache, i, rows, table), v_new[i])
        r = torch.tensor(rows, device=device)
        if table is None:
            written[i, r] = True
        else:
            written[table[i].long()[r // page], r % page] = True
    assert torch.equal(k_cache[~written], k0[~written])
    assert torch.equal(v_cache[~written], v0[~written])
    _check_kvcache_out(out, lse, q, k_cache, v_cache, [n + s_new for n in lengths], causal,
                       table)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("seqlen_q", [1, 2])
@pytest.mark.parametrize("sink", [False, True], ids=["", "sink"])
def test_kvcache_mla_latent_cache(device, dtype, paged, seqlen_q, sink):
    """MLA's absorbed decode: k_cache the latent cache [.., 1, 576] and v_cache =
    k_cache[..., :512], views of one tensor; the new latent token is appended through both
    views (v_new = kv_new[..., :512], the same values) and the cache holds it once. On CUDA
    the MLA forward (one query: the heads regrouped into rows; two: causal rows; a sink:
    not regrouped), its key splits spanning the longer cache."""
    _need(device)
    gpu = device == "cuda"
    b, h, page = 2, 16 if gpu else 8, 16
    cap, lengths = (640, [531, 77]) if gpu else (48, [31, 16])
    d, dv = MLA_DECODE
    dense = randn((b, cap, 1, d), dtype, device, 2)
    if paged:
        kv_cache, _, table = _paged_pools(dense, dense, page)
    else:
        kv_cache, table = dense, None
    k_cache, v_cache = kv_cache, kv_cache[..., :dv]
    assert v_cache.data_ptr() == k_cache.data_ptr()
    kv_new = randn((b, 1, 1, d), dtype, device, 4)
    q = randn((b, seqlen_q, h, d), dtype, device, 1)
    learnable_sink = _sink(h, device).detach() if sink else None
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, kv_new, kv_new[..., :dv],
                                          cache_seqlens=_i32(lengths, device), causal=True,
                                          softmax_scale=0.1, block_table=table,
                                          learnable_sink=learnable_sink,
                                          return_softmax_lse=True)
    assert out.shape == (b, seqlen_q, h, dv)
    for i, n in enumerate(lengths):
        assert torch.equal(_cache_rows(kv_cache, i, [n], table), kv_new[i])
    variant = {"scale": 0.1}
    if sink:
        variant["learnable_sink"] = learnable_sink
    _check_kvcache_out(out, lse, q, k_cache, v_cache, [n + 1 for n in lengths], True, table,
                       **variant)


# ---- scaled_dot_product_attention ---------------------------------------------------------
@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dims", [(48, 32), (32, 48)], ids=["48-32", "32-48"])
def test_sdpa_matches_torch(device, dtype, causal, dims):
    """Against torch.nn.functional.scaled_dot_product_attention (top-left causal, GQA), forward
    and backward, with torch's output strides; the no-grad fast path agrees."""
    _need(device)
    d, dv = dims
    b, h, hk, sq, sk = 2, 4, 2, 30, 47
    q = randn((b, h, sq, d), dtype, device, 1, True)
    k = randn((b, hk, sk, d), dtype, device, 2, True)
    v = randn((b, hk, sk, dv), dtype, device, 3, True)
    dout = randn((b, h, sq, dv), dtype, device, 4)
    out = fa.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    def torch_sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True), None

    ref, base = ref_and_base(torch_sdpa, (q, k, v), dout)
    check_out_and_grads(out, grads, ref, base, dtype)
    theirs = base[0]  # torch's, in this dtype
    assert out.shape == theirs.shape
    with torch.no_grad():
        fast = fa.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    if device == "cpu":
        # (torch's CUDA backends choose their own output layouts: [B, S, H, D] memory for the
        # flash / memory-efficient kernels; ours follows q's, contiguous here.)
        assert out.stride() == fast.stride() == theirs.stride()
    assert out.is_contiguous() and fast.is_contiguous()
    torch.testing.assert_close(fast, out.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_sdpa_transposed_inputs_keep_their_layout(device):
    """[B, H, S, D] views of [B, S, H, D] memory: out keeps that memory order (with v's head
    dim; what the operators promise, ops_params.h empty_out, and what they give when the head
    dims agree), with and without autograd, and torch's values."""
    _need(device)
    dtype = _dtype_of(device)
    q, k = (randn((2, s, 4, 48), dtype, device, i, True) for i, s in ((1, 30), (2, 47)))
    v = randn((2, 47, 4, 32), dtype, device, 3, True)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    out = fa.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    with torch.no_grad():
        fast = fa.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    for o in (out, fast):
        assert o.shape == (2, 4, 30, 32) and o.transpose(1, 2).is_contiguous()
    theirs = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, theirs, rtol=tol, atol=tol)
    torch.testing.assert_close(fast, out.detach(), rtol=0, atol=0)


# ---- operators: opcheck, torch.compile ----------------------------------------------------
def test_opcheck_fwd_bwd():
    q, k, v = _qkv(2, 11, 13, 4, 2, 24, 16, torch.float32, "cpu", requires_grad=False)
    for causal in (False, True):
        args = (q, k, v, 0.25, causal, True, 0)
        torch.library.opcheck(torch.ops.flash_attn_ext.fwd.default, args,
                              test_utils=OPCHECK_UTILS)
        out, lse = torch.ops.flash_attn_ext.fwd(*args)
        assert out.shape == (2, 11, 4, 16)
        torch.library.opcheck(torch.ops.flash_attn_ext.bwd.default,
                              (torch.randn_like(out), q, k, v, out, lse, 0.25, causal, True,
                               False), test_utils=OPCHECK_UTILS)
    # With autograd (FlashAttnFunction) and q / k / v that require grad.
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.flash_attn_ext.fwd.default, (qg, kg, vg, 0.25, True, True, 0),
                          test_utils=OPCHECK_UTILS)


def test_opcheck_strided_and_sdpa_layouts():
    """The fake kernels give out q's memory order with v's head dim, as the real ones."""
    qb, kb, vb = (randn((2, 4, s, d), torch.float32, "cpu", i)
                  for i, (s, d) in enumerate(((9, 24), (14, 24), (14, 16))))
    # [B, H, S, D] memory seen as [B, S, H, D] (fwd) and the sdpa operator itself.
    q, k, v = (t.transpose(1, 2) for t in (qb, kb, vb))
    torch.library.opcheck(torch.ops.flash_attn_ext.fwd.default, (q, k, v, 0.25, False, False, 0),
                          test_utils=OPCHECK_UTILS)
    out, _ = torch.ops.flash_attn_ext.fwd(q, k, v, 0.25, False, False, 0)
    assert out.shape == (2, 9, 4, 16) and out.transpose(1, 2).is_contiguous()
    torch.library.opcheck(torch.ops.flash_attn_ext.sdpa_fwd.default,
                          (qb, kb, vb, 0.25, True), test_utils=OPCHECK_UTILS)
    # sdpa_fwd's [B, H, S, D] arguments with [B, S, H, D] memory
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (qb, kb, vb)]
    torch.library.opcheck(torch.ops.flash_attn_ext.sdpa_fwd.default,
                          (*strided, 0.25, True), test_utils=OPCHECK_UTILS)
    out, _ = torch.ops.flash_attn_ext.sdpa_fwd(*strided, 0.25, True)
    assert out.shape == (2, 4, 9, 16) and out.transpose(1, 2).is_contiguous()


def test_opcheck_varlen():
    q, k, _, cu_q, cu_k, max_q, max_k = make_varlen([7, 0, 13], [5, 9, 0], 4, 2, 24,
                                                    torch.float32, "cpu", requires_grad=False)
    v = randn((k.shape[0], 2, 16), torch.float32, "cpu", 7)
    args = (q, k, v, cu_q, cu_k, max_q, max_k, 0.25, True, None)
    torch.library.opcheck(torch.ops.flash_attn_ext.varlen_fwd.default, args,
                          test_utils=OPCHECK_UTILS)
    out, lse = torch.ops.flash_attn_ext.varlen_fwd(*args)
    assert out.shape == (q.shape[0], 4, 16)
    torch.library.opcheck(torch.ops.flash_attn_ext.varlen_bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                           0.25, True, False, None), test_utils=OPCHECK_UTILS)


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    q, k, v = _qkv(2, 19, 23, 4, 2, 24, 16, torch.float32, "cpu")

    def f(q, k, v):
        return fa.flash_attn_func(q, k, v, causal=True).square().sum()

    assert_compiled_matches_eager(f, (q, k, v))


# ---- bad inputs ---------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_k_and_v_must_agree_but_for_the_head_dim(device):
    _need(device)
    dtype = _dtype_of(device)
    q = randn((2, 8, 4, 32), dtype, device, 1)
    k = randn((2, 10, 2, 32), dtype, device, 2)
    bad_v = {"batch": (1, 10, 2, 16), "seqlen": (2, 9, 2, 16), "heads": (2, 10, 1, 16)}
    for name, shape in bad_v.items():
        v = randn(shape, dtype, device, 3)
        with pytest.raises(RuntimeError, match="k and v must have the same shape but for the "
                                               "last"):
            fa.flash_attn_func(q, k, v)
        with pytest.raises(RuntimeError, match="k and v must have the same shape but for the "
                                               "last"):
            fa.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                            v.transpose(1, 2), enable_gqa=True)
        with pytest.raises(RuntimeError, match="k and v must have the same shape but for the "
                                               "last"):
            torch.ops.flash_attn_ext.fwd(q, k, v, 0.25, False, True)
    # varlen: a different number of key rows
    cu = _i32([0, 8], device)
    with pytest.raises(RuntimeError, match="k and v must have the same shape but for the last"):
        fa.flash_attn_varlen_func(q[0], k[0], randn((9, 2, 16), dtype, device, 3), cu,
                                  _i32([0, 10], device), 8, 10)
    # KV cache: caches of different capacities (the operator's check, and before an append)
    k_cache = torch.zeros((2, 32, 2, 32), dtype=dtype, device=device)
    v_cache = torch.zeros((2, 31, 2, 16), dtype=dtype, device=device)
    with pytest.raises(RuntimeError, match="k and v must have the same shape but for the last"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=_i32([3, 4], device))
    with pytest.raises(RuntimeError, match="k and v must have the same shape but for the last"):
        fa.flash_attn_with_kvcache(q, torch.zeros((4, 16, 2, 32), dtype=dtype, device=device),
                                   torch.zeros((4, 16, 1, 16), dtype=dtype, device=device),
                                   cache_seqlens=3, block_table=_i32([[0, 1], [2, 3]], device))
    k_new = randn((2, 1, 2, 32), dtype, device, 4)
    v_new = randn((2, 1, 2, 16), dtype, device, 5)
    with pytest.raises(RuntimeError, match="k_cache and v_cache must have the same shape but "
                                           "for the last"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                   cache_seqlens=_i32([3, 4], device))
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("device", DEVICES)
def test_q_and_k_must_share_the_head_dim(device):
    _need(device)
    dtype = _dtype_of(device)
    q = randn((1, 8, 2, 32), dtype, device, 1)
    k = randn((1, 8, 2, 48), dtype, device, 2)
    v = randn((1, 8, 2, 16), dtype, device, 3)
    with pytest.raises(RuntimeError, match="q and k must have the same head_dim"):
        fa.flash_attn_func(q, k, v)
    with pytest.raises(RuntimeError, match="q and k must have the same head_dim"):
        fa.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    cu = _i32([0, 8], device)
    with pytest.raises(RuntimeError, match="q and k must have the same head_dim"):
        fa.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8)
    with pytest.raises(RuntimeError, match="q and k must have the same head_dim"):
        fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=_i32([5], device))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_kvcache_append_shapes_leave_the_cache_alone(device):
    _need(device)
    dtype = _dtype_of(device)
    q = randn((1, 1, 4, 32), dtype, device, 1)
    k_cache = torch.zeros((1, 16, 2, 32), dtype=dtype, device=device)
    v_cache = torch.zeros((1, 16, 2, 16), dtype=dtype, device=device)
    k_new = randn((1, 2, 2, 32), dtype, device, 2)
    for v_new, words in ((randn((1, 2, 2, 32), dtype, device, 3), r"v must have shape .*16\]"),
                         (randn((1, 2, 2, 16), dtype, device, 3)[..., :8],
                          r"v must have shape .*16\]"),
                         (randn((1, 3, 2, 16), dtype, device, 3), "k and v must have the same")):
        with pytest.raises(RuntimeError, match=words):
            fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                       cache_seqlens=_i32([4], device))
    assert not k_cache.any() and not v_cache.any()


@GPU
def test_cuda_unsupported_head_dims_leave_the_cache_alone():
    """A v head dim above the CUDA limit, or MLA's 576 / 512 with softcap, raises before the
    append: the caches keep their contents."""
    _need("cuda")
    for d, dv, kw in ((128, 320, {}), (576, 512, {"softcap": 5.0})):
        q = randn((1, 1, 16, d), torch.bfloat16, "cuda", 1)
        k_cache = torch.zeros((1, 32, 1, d), dtype=torch.bfloat16, device="cuda")
        v_cache = torch.zeros((1, 32, 1, dv), dtype=torch.bfloat16, device="cuda")
        k_new = randn((1, 2, 1, d), torch.bfloat16, "cuda", 2)
        v_new = randn((1, 2, 1, dv), torch.bfloat16, "cuda", 3)
        with pytest.raises(NotImplementedError, match="head dims"):
            fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                       cache_seqlens=_i32([4], "cuda"), **kw)
        assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("device", DEVICES)
def test_bwd_dout_must_have_the_value_head_dim(device):
    _need(device)
    q, k, v = _qkv(1, 8, 8, 2, 2, 32, 16, _dtype_of(device), device, requires_grad=False)
    try:
        out, lse = torch.ops.flash_attn_ext.fwd(q, k, v, 0.25, False, True)
    except RuntimeError as e:  # a CUDA build restricted with FLASH_ATTN_EXT_HEAD_DIMS
        if "not compiled" not in str(e):
            raise
        pytest.skip("head dim 32 is not compiled in this build")
    assert out.shape[-1] == 16
    with pytest.raises(RuntimeError, match="dout must have the shape of q with v's head_dim"):
        torch.ops.flash_attn_ext.bwd(torch.zeros_like(q), q, k, v, out, lse, 0.25, False, True)
    with pytest.raises(RuntimeError, match="out must have the shape of q with v's head_dim"):
        torch.ops.flash_attn_ext.bwd(torch.zeros_like(out), q, k, v, torch.zeros_like(q), lse,
                                     0.25, False, True)


@pytest.fixture
def single_process_group():
    """A one-process gloo group of this process, destroyed afterwards (other tests expect no
    process group)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ring_attention_not_implemented(single_process_group):
    from flash_attn_ext.distributed import ring_flash_attn_func, ring_flash_attn_varlen_func
    q, k, v = _qkv(1, 8, 8, 2, 2, 32, 16, torch.float32, "cpu")
    with pytest.raises(NotImplementedError, match="value head dim other than the key's"):
        ring_flash_attn_func(q, k, v, causal=True)
    with pytest.raises(NotImplementedError, match="value head dim other than the key's"):
        ring_flash_attn_varlen_func(q[0], k[0], v[0], [0, 3, 8])
    # k / v that differ elsewhere too are a shape error, as before.
    with pytest.raises(RuntimeError, match="k and v must have the same shape"):
        ring_flash_attn_func(q, k, v[:, :5])


def test_fp8_forward_not_implemented():
    """The FP8 forward refuses v's own head dim before anything else (on the CPU, before the
    CPU's 'Hopper only' refusal)."""
    fp8 = torch.float8_e4m3fn
    q = torch.randn(1, 8, 2, 64).to(fp8)
    v = torch.randn(1, 8, 2, 32).to(fp8)
    one = torch.ones(())
    with pytest.raises(NotImplementedError, match="FP8 forward needs v's head_dim to be q's"):
        fa.flash_attn_func(q, q, v, q_descale=one, k_descale=one, v_descale=one)
    cu = _i32([0, 3, 8], "cpu")
    with pytest.raises(NotImplementedError, match="FP8 forward needs v's head_dim to be q's"):
        fa.flash_attn_varlen_func(q[0], q[0], v[0], cu, cu, 5, 5, q_descale=one, k_descale=one,
                                  v_descale=one)


# ---- CUDA: head dims above 256, long rows, split-KV decode --------------------------------
@GPU
def test_cuda_large_head_dims_not_implemented():
    """Above 256 CUDA has MLA's 576 / 512 forward only: other pairs, its backward, its
    variants and float32 raise."""
    _need("cuda")
    d, dv = MLA_DECODE
    q2, k2, v2 = _qkv(1, 16, 16, 2, 1, 128, 320, torch.bfloat16, "cuda", requires_grad=False)
    with pytest.raises(NotImplementedError, match="head dims up to 256"):
        fa.flash_attn_func(q2, k2, v2)
    q, k, v = _qkv(1, 16, 16, 2, 1, d, dv, torch.bfloat16, "cuda")
    out = fa.flash_attn_func(q, k, v)
    with pytest.raises(NotImplementedError, match="forward \\(decode\\) only"):
        out.sum().backward()
    with torch.no_grad():
        with pytest.raises(NotImplementedError, match="576 / 512"):
            fa.flash_attn_func(q, k, v, softcap=5.0)
        with pytest.raises(NotImplementedError, match="576 / 512"):
            fa.flash_attn_func(q.float(), k.float(), v.float())


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("latent", [False, True], ids=["separate-kv", "latent"])
def test_cuda_mla_forward(dtype, causal, latent):
    """The MLA forward on padded batches (causal both alignments, a key split per few tiles,
    separate k / v tensors or v a view of k) and on packed sequences (one empty)."""
    _need("cuda")
    d, dv = MLA_DECODE
    for sq, sk, h in ((37, 300, 4), (300, 129, 2), (1, 1000, 16)):
        q = randn((2, sq, h, d), dtype, "cuda", 1)
        k = randn((2, sk, 1, d), dtype, "cuda", 2)
        v = k[..., :dv] if latent else randn((2, sk, 1, dv), dtype, "cuda", 3)
        for num_splits in (0, 1, 5):
            out, lse = fa.flash_attn_func(q, k, v, causal=causal, return_lse=True,
                                          num_splits=num_splits)
            ref, base = ref_and_base(lambda q, k, v: gqa_attention(q, k, v, causal), (q, k, v))
            assert_fa_rule(out, ref[0], base[0], 2)
            check_lse(lse, ref[1], dtype)
    starts_q, starts_k = [0, 20, 20, 57], [0, 100, 130, 300]
    cu_q, cu_k = _i32(starts_q, "cuda"), _i32(starts_k, "cuda")
    q = randn((57, 4, d), dtype, "cuda", 1)
    k = randn((300, 1, d), dtype, "cuda", 2)
    v = k[..., :dv] if latent else randn((300, 1, dv), dtype, "cuda", 3)
    out, lse = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 37, 170, causal=causal,
                                         return_lse=True)
    for i in range(3):
        rq, rk = slice(starts_q[i], starts_q[i + 1]), slice(starts_k[i], starts_k[i + 1])
        if rq.start == rq.stop:
            continue
        ref, base = ref_and_base(lambda q, k, v: gqa_attention(q, k, v, causal),
                                 (q[None, rq], k[None, rk], v[None, rk]))
        assert_fa_rule(out[None, rq], ref[0], base[0], 2)


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dims", [(192, 128), (128, 192), (96, 64)], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_long_rows(dtype, dims, causal):
    """Several tiles per row: (192, 128) is the Hopper forward of its own there, the other
    pairs the padded path; the backward is padded for all."""
    _need("cuda")
    d, dv = dims
    b, s, h, hk = 2, 1000, 4, 2
    q, k, v = _qkv(b, s, s + 37, h, hk, d, dv, dtype, "cuda")
    dout = randn((b, s, h, dv), dtype, "cuda", 4)
    out, lse = fa.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, base = ref_and_base(lambda q, k, v: gqa_attention(q, k, v, causal), (q, k, v), dout)
    check_out_and_grads(out, grads, ref, base, dtype)
    check_lse(lse, ref[1], dtype)


@GPU
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_cuda_kvcache_splits(num_splits, heads):
    _need("cuda")
    h, hk = heads
    k_cache = randn((2, 300, hk, 192), torch.bfloat16, "cuda", 2)
    v_cache = randn((2, 300, hk, 128), torch.bfloat16, "cuda", 3)
    lengths = [257, 131]
    for seqlen_q in (1, 4):
        q = randn((2, seqlen_q, h, 192), torch.bfloat16, "cuda", 1)
        out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache,
                                              cache_seqlens=_i32(lengths, "cuda"), causal=True,
                                              num_splits=num_splits, return_softmax_lse=True)
        _check_kvcache_out(out, lse, q, k_cache, v_cache, lengths, True)
