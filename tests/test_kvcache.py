"""flash_attn_with_kvcache's inference path: paged KV caches (block_table), cache_batch_idx,
cache_leftpad and rotary embeddings (both layouts, rotary_dim < head_dim), alone and with
causal / window / softcap / ALiBi, GQA and MQA; flash_attn_varlen_func against a paged cache
(chunked prefill); bad inputs; the debug checks; opcheck of the operators' new arguments; and
on CUDA the kernel head dims, split-KV, the fp32 kernel, a decode step without host
synchronisation and a decode loop captured in a CUDA graph.

The reference gathers every sequence's keys out of the (updated) cache into contiguous tensors
and runs attention_ref on them in float64 (FlashAttention's error rule, tests/helpers.py);
rotary embeddings are recomputed in float64 with complex numbers.
"""
import pytest
import torch

import flash_attn_ext as fa
from helpers import (OPCHECK_UTILS, alibi_slopes, assert_fa_rule, batch_entry,
                     capture_cuda_graph, check_lse, gqa_attention, randn)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
HEADS = 4


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _bits(t):
    """t as raw bytes when it is FP8 (comparisons and indexing of float8 tensors go through
    uint8 views, which every device implements), else t."""
    return t.view(torch.uint8) if t.dtype is torch.float8_e4m3fn else t


# ---- references ---------------------------------------------------------------------
def rotary_tables(positions, rotary_dim, dtype, device, base=10000.0):
    """cos / sin [positions, rotary_dim / 2] as flash-attn's rotary_cos / rotary_sin."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angle = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angle.cos().to(device, dtype), angle.sin().to(device, dtype)


def rotate64(x, cos, sin, positions, interleaved):
    """Reference rotary embedding in float64 (complex multiplication): x [batch, seqlen,
    heads, dim], positions [batch, seqlen] (long)."""
    x = x.double()
    half = cos.shape[1]
    c = cos.double()[positions].unsqueeze(2)
    s = sin.double()[positions].unsqueeze(2)
    rot = torch.complex(c, s)
    if interleaved:
        z = torch.view_as_complex(x[..., :2 * half].reshape(*x.shape[:-1], half, 2).contiguous())
        r = torch.view_as_real(z * rot).flatten(-2)
    else:
        z = torch.complex(x[..., :half], x[..., half:2 * half]) * rot
        r = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((r, x[..., 2 * half:]), dim=-1)


def cache_rows(cache, b, rows, block_table=None, cache_batch_idx=None):
    """Rows `rows` (long tensor) of batch entry b's cache: [len(rows), heads_k, dim]."""
    if block_table is not None:
        page_size = cache.shape[1]
        return cache[block_table[b].long()[rows // page_size], rows % page_size]
    entry = b if cache_batch_idx is None else int(cache_batch_idx[b])
    return cache[entry, rows]


class Case:
    """One flash_attn_with_kvcache call and everything its reference needs."""

    def __init__(self, device, dtype, *, batch=3, kv_heads=2, head_dim=32, seqlen_q=1,
                 new_len=2, lengths=(0, 17, 30), mode="dense", page_size=16, cache_len=48,
                 leftpad=None, rotary=None, causal=False, window=(-1, -1), softcap=0.0,
                 alibi=None, seed=0):
        self.device, self.dtype, self.batch = device, dtype, batch
        self.causal, self.window, self.softcap = causal, window, softcap
        self.rotary, self.new_len, self.mode = rotary, new_len, mode
        self.slopes = alibi_slopes(alibi, batch, HEADS, device)
        self.lengths = list(lengths)
        self.leftpad = list(leftpad) if leftpad is not None else None
        shape_tail = (kv_heads, head_dim)
        self.q = randn((batch, seqlen_q, HEADS, head_dim), dtype, device, seed + 1)
        self.block_table = self.cache_batch_idx = None
        gen = torch.Generator().manual_seed(seed + 7)
        if mode == "paged":
            max_pages = -(-cache_len // page_size)
            num_pages = batch * max_pages + 3
            self.capacity = max_pages * page_size
            pool = (num_pages, page_size) + shape_tail
            self.block_table = torch.randperm(num_pages, generator=gen)[:batch * max_pages] \
                .view(batch, max_pages).to(torch.int32).to(device)
        else:
            batch_c = batch + 2 if mode == "batch_idx" else batch
            self.capacity = cache_len
            pool = (batch_c, cache_len) + shape_tail
            if mode == "batch_idx":
                self.cache_batch_idx = torch.randperm(batch_c, generator=gen)[:batch] \
                    .to(torch.int32).to(device)
        self.k_cache = randn(pool, dtype, device, seed + 2)
        self.v_cache = randn(pool, dtype, device, seed + 3)
        new_shape = (batch, new_len) + shape_tail
        self.k_new = randn(new_shape, dtype, device, seed + 4) if new_len else None
        self.v_new = randn(new_shape, dtype, device, seed + 5) if new_len else None
        if rotary is not None:
            rotary_dim, self.interleaved = rotary
            self.cos, self.sin = rotary_tables(self.capacity, rotary_dim, torch.float32, device)
        assert max(self.lengths) + new_len <= self.capacity

    def kwargs(self):
        kw = dict(cache_seqlens=_i32(self.lengths, self.device), causal=self.causal,
                  window_size=self.window, softcap=self.softcap, alibi_slopes=self.slopes,
                  block_table=self.block_table, cache_batch_idx=self.cache_batch_idx)
        if self.leftpad is not None:
            kw["cache_leftpad"] = _i32(self.leftpad, self.device)
        if self.rotary is not None:
            kw.update(rotary_cos=self.cos, rotary_sin=self.sin,
                      rotary_interleaved=self.interleaved)
        return kw

    def run(self, **extra):
        """Calls flash_attn_with_kvcache on copies of the caches: (out, lse, k_cache, v_cache)."""
        kc, vc = self.k_cache.clone(), self.v_cache.clone()
        k = None if self.k_new is None else self.k_new.clone()
        v = None if self.v_new is None else self.v_new.clone()
        out, lse = fa.flash_attn_with_kvcache(self.q, kc, vc, k=k, v=v, return_softmax_lse=True,
                                              **self.kwargs(), **extra)
        if k is not None:  # the inputs are not modified
            assert torch.equal(_bits(k), _bits(self.k_new)) and torch.equal(_bits(v),
                                                                              _bits(self.v_new))
        return out, lse, kc, vc

    def rows(self, b, start, end):
        return torch.arange(start, end, device=self.device)

    def _k_positions(self):
        return (torch.tensor(self.lengths, device=self.device)[:, None]
                + torch.arange(self.new_len, device=self.device))

    def check_caches(self, kc, vc):
        """The new rows (rotated keys) are where they belong; nothing else changed."""
        expected_k = self.k_new.double()
        if self.rotary is not None:
            expected_k = rotate64(self.k_new, self.cos, self.sin, self._k_positions(),
                                  self.interleaved)
        written = torch.zeros(kc.shape[:2], dtype=torch.bool, device=self.device)
        for b in range(self.batch):
            rows = self.rows(b, self.lengths[b], self.lengths[b] + self.new_len)
            got_k = cache_rows(kc, b, rows, self.block_table, self.cache_batch_idx)
            got_v = cache_rows(vc, b, rows, self.block_table, self.cache_batch_idx)
            assert torch.equal(got_v, self.v_new[b])
            if self.rotary is None:
                assert torch.equal(got_k, self.k_new[b])
            else:  # rotated in fp32, rounded to the cache's dtype
                tol = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}[self.dtype]
                assert (got_k.double() - expected_k[b]).abs().max().item() <= tol
            if self.block_table is not None:
                page_size = kc.shape[1]
                written[self.block_table[b].long()[rows // page_size], rows % page_size] = True
            else:
                entry = b if self.cache_batch_idx is None else int(self.cache_batch_idx[b])
                written[entry, rows] = True
        assert torch.equal(kc[~written], self.k_cache[~written])
        assert torch.equal(vc[~written], self.v_cache[~written])

    def real_rows(self, cache, b, rows, which):
        """Batch entry b's rows of the K (which = 0) or V (1) cache, as the values attention
        sees (Fp8Case: dequantised)."""
        return cache_rows(cache, b, rows, self.block_table, self.cache_batch_idx)

    def reference(self, kc, vc):
        """(out, lse) in float64 and at the inputs' precision, over the updated caches."""
        q64 = self.q.double()
        if self.rotary is not None:
            left, right = self.window
            per_token = (self.causal or 0 <= left < self.capacity or 0 <= right < self.capacity)
            steps = torch.arange(self.q.shape[1], device=self.device)
            pos = torch.tensor(self.lengths, device=self.device)[:, None]
            q64 = rotate64(self.q, self.cos, self.sin, pos + steps if per_token else
                           pos.expand(-1, self.q.shape[1]), self.interleaved)
        variant = dict(window_size=self.window, softcap=self.softcap, alibi_slopes=self.slopes)
        results = []
        for dtype in (torch.float64, self.dtype):
            outs, lses = [], []
            for b in range(self.batch):
                start = 0 if self.leftpad is None else self.leftpad[b]
                rows = self.rows(b, start, self.lengths[b] + self.new_len)
                k = self.real_rows(kc, b, rows, 0)
                v = self.real_rows(vc, b, rows, 1)
                o, l = gqa_attention(q64[b:b + 1].to(dtype), k[None].to(dtype), v[None].to(dtype),
                                     self.causal, **batch_entry(variant, b))
                outs.append(o)
                lses.append(l)
            results.append((torch.cat(outs), torch.cat(lses)))
        return results

    def check(self, **extra):
        out, lse, kc, vc = self.run(**extra)
        if self.new_len:
            self.check_caches(kc, vc)
        (ref_out, ref_lse), (base_out, _) = self.reference(kc, vc)
        assert out.shape == self.q.shape and out.dtype == self.dtype
        assert_fa_rule(out, ref_out, base_out, 2)
        check_lse(lse, ref_lse, self.dtype)
        return out


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ---- paged KV cache -------------------------------------------------------------------
# (page_size, kv_heads, lengths before the append, new_len, seqlen_q): ragged lengths with
# 0, appends that cross page boundaries, GQA and MQA.
PAGED = [
    (16, 2, (0, 15, 33), 3, 1),     # 15 + 3 and 33 + 3: cross into the next page
    (16, 1, (31, 0, 64), 2, 3),     # MQA, an append starting exactly at a page boundary
    (64, 2, (63, 1, 100), 4, 1),    # 63 + 4 crosses a 64-key page
    (256, 2, (0, 255, 300), 2, 2),  # 255 + 2 crosses a 256-key page
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page_size,kv_heads,lengths,new_len,seqlen_q", PAGED, ids=str)
def test_paged(device, causal, page_size, kv_heads, lengths, new_len, seqlen_q):
    dtype = DTYPES[(PAGED.index((page_size, kv_heads, lengths, new_len, seqlen_q)) + causal) % 3]
    Case(device, dtype, kv_heads=kv_heads, lengths=lengths, new_len=new_len, seqlen_q=seqlen_q,
         mode="paged", page_size=page_size, cache_len=max(lengths) + new_len + 5,
         causal=causal).check()


@pytest.mark.parametrize("device", DEVICES)
def test_paged_no_append_and_full_table(device):
    """Attention over a paged cache without appending; cache_seqlens=None covers every page
    of the block table."""
    case = Case(device, torch.float16, new_len=0, lengths=(5, 0, 40), mode="paged", cache_len=48)
    case.check()
    full = Case(device, torch.float32, new_len=0, lengths=(48, 48, 48), mode="paged",
                cache_len=48)
    out = fa.flash_attn_with_kvcache(full.q, full.k_cache, full.v_cache,
                                     block_table=full.block_table)
    torch.testing.assert_close(out, full.check(), atol=0, rtol=0)


# ---- cache_batch_idx, cache_leftpad --------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cache_batch_idx(device, dtype):
    """Batch entries use a permutation of a larger cache's rows; the other rows are left alone."""
    Case(device, dtype, mode="batch_idx", lengths=(3, 0, 40), new_len=2, seqlen_q=2,
         causal=True).check()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,mode,causal", [(torch.float32, "dense", True),
                                               (torch.bfloat16, "dense", False),
                                               (torch.float16, "batch_idx", True)], ids=str)
def test_leftpad(device, dtype, mode, causal):
    """Keys before cache_leftpad are not attended; causal aligns to the shortened sequences
    (a pad equal to cache_seqlens leaves only the new keys)."""
    Case(device, dtype, mode=mode, lengths=(10, 4, 30), leftpad=(3, 4, 0), new_len=2,
         seqlen_q=3, causal=causal).check()


# ---- rotary embeddings -------------------------------------------------------------------
# (rotary_dim, head_dim, interleaved, causal, window, mode)
ROTARY = [
    (32, 32, True, True, (-1, -1), "dense"),     # all dims, token positions (causal)
    (32, 32, False, False, (-1, -1), "paged"),   # one position for all queries
    (16, 32, True, False, (-1, -1), "dense"),    # rotary_dim < head_dim
    (16, 64, False, True, (-1, -1), "paged"),
    (32, 64, True, False, (4, 0), "batch_idx"),  # a window: token positions
    (16, 48, False, False, (-1, 2), "dense"),    # head dim padded on CUDA
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rotary_dim,head_dim,interleaved,causal,window,mode", ROTARY, ids=str)
def test_rotary(device, rotary_dim, head_dim, interleaved, causal, window, mode):
    dtype = DTYPES[ROTARY.index((rotary_dim, head_dim, interleaved, causal, window, mode)) % 3]
    Case(device, dtype, head_dim=head_dim, lengths=(0, 13, 30), new_len=3, seqlen_q=3,
         mode=mode, rotary=(rotary_dim, interleaved), causal=causal, window=window).check()


@pytest.mark.parametrize("device", DEVICES)
def test_rotary_with_leftpad(device):
    """Rotary positions are the cache rows (cache_seqlens + t), as flash-attn: left padding
    does not shift them."""
    Case(device, torch.float32, lengths=(9, 20, 5), leftpad=(4, 0, 5), new_len=2, seqlen_q=2,
         rotary=(16, True), causal=True).check()


# ---- with the variants ---------------------------------------------------------------------
# (causal, window, softcap, alibi, mode, leftpad)
VARIANTS = [
    (True, (8, 0), 0.0, None, "paged", None),
    (False, (-1, -1), 30.0, "head", "paged", None),
    (True, (-1, -1), 0.0, "batch", "batch_idx", None),
    (False, (3, 1), 50.0, "head", "dense", (2, 0, 7)),
    (True, (-1, -1), 30.0, "batch", "dense", (5, 1, 0)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal,window,softcap,alibi,mode,leftpad", VARIANTS, ids=str)
def test_variants(device, causal, window, softcap, alibi, mode, leftpad):
    dtype = DTYPES[VARIANTS.index((causal, window, softcap, alibi, mode, leftpad)) % 3]
    Case(device, dtype, lengths=(12, 0, 33), leftpad=leftpad, new_len=2, seqlen_q=3,
         mode=mode, causal=causal, window=window, softcap=softcap, alibi=alibi,
         rotary=(16, False) if mode == "paged" else None).check()


# ---- paged varlen (chunked prefill) ----------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,causal,page_size,with_seqused_k",
                         [(torch.float32, True, 16, False), (torch.bfloat16, False, 64, True),
                          (torch.float16, True, 16, True)], ids=str)
def test_varlen_paged(device, dtype, causal, page_size, with_seqused_k):
    """flash_attn_varlen_func with block_table: packed queries against a paged cache whose
    sequence b holds cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys (seqused_k caps them)."""
    lens_q, lens_k = [5, 0, 37, 1], [40, 3, 70, 0]
    batch, kv_heads, head_dim = len(lens_q), 2, 32
    max_pages = -(-max(lens_k) // page_size) + 1
    num_pages = batch * max_pages + 2
    gen = torch.Generator().manual_seed(3)
    table = torch.randperm(num_pages, generator=gen)[:batch * max_pages].view(batch, max_pages)
    table = table.to(torch.int32).to(device)
    kp = randn((num_pages, page_size, kv_heads, head_dim), dtype, device, 11)
    vp = randn((num_pages, page_size, kv_heads, head_dim), dtype, device, 12)
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32).to(device)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32).to(device)
    q = randn((sum(lens_q), HEADS, head_dim), dtype, device, 13)
    used = [30, 3, 64, 0] if with_seqused_k else lens_k
    out, lse = fa.flash_attn_varlen_func(
        q, kp, vp, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, block_table=table,
        seqused_k=_i32(used, device) if with_seqused_k else None, return_lse=True)
    assert out.shape == q.shape and lse.shape == (HEADS, q.shape[0])
    results = []
    for prec in (torch.float64, dtype):
        outs, lses = [], []
        for b in range(batch):
            rows = torch.arange(used[b], device=device)
            k = cache_rows(kp, b, rows, table)[None].to(prec)
            v = cache_rows(vp, b, rows, table)[None].to(prec)
            qb = q[cu_q[b]:cu_q[b + 1]][None].to(prec)
            o, l = gqa_attention(qb, k, v, causal)
            outs.append(o[0])
            lses.append(l[0])
        results.append((torch.cat(outs), torch.cat(lses, dim=-1)))
    (ref_out, ref_lse), (base_out, _) = results
    assert_fa_rule(out, ref_out, base_out, 2)
    check_lse(lse, ref_lse, dtype)


def test_varlen_paged_under_autograd():
    """A paged call whose q requires grad runs the same forward as without grad and has a
    backward (tests/test_packed.py checks its gradients, into the page pools too)."""
    q = torch.randn(4, HEADS, 16, requires_grad=True)
    kp, vp = torch.randn(3, 16, 2, 16), torch.randn(3, 16, 2, 16)
    cu = _i32([0, 4], "cpu")
    args = (q, kp, vp, cu, _i32([0, 10], "cpu"), 4, 10)
    table = _i32([[2]], "cpu")
    out = fa.flash_attn_varlen_func(*args, block_table=table)
    with torch.no_grad():
        assert torch.equal(out, fa.flash_attn_varlen_func(*args, block_table=table))
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert dq.shape == q.shape and torch.isfinite(dq).all()


# ---- bad inputs ------------------------------------------------------------------------------
def _small(page_size=16, batch=2):
    q = torch.randn(batch, 1, HEADS, 32)
    pool = torch.randn(5, page_size, 2, 32)
    k = torch.randn(batch, 1, 2, 32)
    table = torch.tensor([[0, 1], [2, 3]][:batch], dtype=torch.int32)
    return q, pool, k, table


BAD = [
    (dict(block_table=torch.zeros(2, 2, dtype=torch.int64)), RuntimeError, "block_table.*int32"),
    (dict(block_table=torch.zeros(4, dtype=torch.int32)), RuntimeError, "block_table.*shape"),
    (dict(block_table=torch.zeros(3, 2, dtype=torch.int32)), RuntimeError, "block_table.*shape"),
    (dict(block_table=torch.zeros(2, 0, dtype=torch.int32)), RuntimeError, "block_table"),
    (dict(block_table=[[0, 1], [2, 3]]), TypeError, "block_table"),
    (dict(cache_batch_idx=torch.zeros(2, dtype=torch.int32)), RuntimeError,
     "cache_batch_idx.*block_table"),
    (dict(cache_leftpad=torch.zeros(2, dtype=torch.int32)), NotImplementedError,
     "cache_leftpad.*block_table"),
    (dict(rotary_cos=torch.ones(32, 4), rotary_sin=torch.ones(32, 4)), RuntimeError,
     "rotary_dim.*multiple of 16"),
    (dict(rotary_cos=torch.ones(32, 24), rotary_sin=torch.ones(32, 24)), RuntimeError,
     "rotary_dim.*head_dim"),
    (dict(rotary_cos=torch.ones(31, 8), rotary_sin=torch.ones(31, 8)), RuntimeError,
     "rotary_cos.*positions"),
    (dict(rotary_cos=torch.ones(32, 8)), RuntimeError, "rotary_sin"),
    (dict(rotary_cos=torch.ones(32, 8), rotary_sin=torch.ones(32, 16)), RuntimeError,
     "same shape"),
    (dict(rotary_cos=torch.ones(32, 8, dtype=torch.int32),
          rotary_sin=torch.ones(32, 8, dtype=torch.int32)), RuntimeError, "floating"),
    (dict(rotary_cos=torch.ones(32, 8), rotary_sin=torch.ones(32, 8), k=None, v=None),
     RuntimeError, "rotary.*k and v"),
    (dict(cache_seqlens=None), RuntimeError, "cache_seqlens"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD, ids=lambda x: str(x)[:40])
def test_bad_paged_inputs(kwargs, exc, match):
    q, pool, k, table = _small()
    args = dict(k=k, v=k.clone(), cache_seqlens=3, block_table=table)
    args.update(kwargs)
    before = pool.clone()
    with pytest.raises(exc, match=match):
        fa.flash_attn_with_kvcache(q, pool, pool.clone(), **args)
    assert torch.equal(pool, before)  # nothing was appended


@pytest.mark.parametrize("page_size", [8, 24, 40])
def test_bad_page_size(page_size):
    q, pool, k, table = _small(page_size)
    with pytest.raises(RuntimeError, match="page size.*multiple of 16"):
        fa.flash_attn_with_kvcache(q, pool, pool.clone(), k=k, v=k, cache_seqlens=1,
                                   block_table=table)
    with pytest.raises(RuntimeError, match="page size.*multiple of 16"):  # the raw operator too
        torch.ops.flash_attn_ext.fwd(q, pool, pool, 0.1, False, True, 0, 0, None,
                                     block_table=table)


@pytest.mark.parametrize("kwargs,match", [
    (dict(cache_batch_idx=torch.zeros(3, dtype=torch.int32)), "cache_batch_idx.*shape"),
    (dict(cache_batch_idx=torch.zeros(2, dtype=torch.int64)), "cache_batch_idx.*int32"),
    (dict(cache_leftpad=torch.zeros(2, 1, dtype=torch.int32)), "cache_leftpad.*shape"),
    (dict(cache_leftpad=torch.zeros(2, dtype=torch.float32)), "cache_leftpad.*int32"),
])
def test_bad_dense_cache_inputs(kwargs, match):
    q = torch.randn(2, 1, HEADS, 32)
    cache = torch.randn(2, 10, 2, 32)
    with pytest.raises(RuntimeError, match=match):
        fa.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=3, **kwargs)


def test_cache_batch_size_mismatch():
    q = torch.randn(2, 1, HEADS, 32)
    cache = torch.randn(3, 10, 2, 32)
    with pytest.raises(RuntimeError, match="cache_batch_idx"):
        fa.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=3)
    idx = _i32([2, 0], "cpu")
    out = fa.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=3, cache_batch_idx=idx)
    expected = fa.flash_attn_with_kvcache(q, cache[[2, 0]], cache[[2, 0]].clone(), cache_seqlens=3)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_dense_decode_fast_path(monkeypatch):
    # A plain decode step (dense cache, cache_seqlens tensor, nothing else) takes the Python
    # fast path (interface._dense_decode_step) and gives bit-identical results to the general
    # path (forced by the debug checks); a non-contiguous q with unit last stride takes it too,
    # an FP8 cache or a wrong cache_seqlens dtype falls through to the general path's checks.
    from flash_attn_ext import interface
    calls = []
    step = interface._dense_decode_step
    monkeypatch.setattr(interface, "_dense_decode_step",
                        lambda *a: calls.append(1) or step(*a))
    q = torch.randn(3, 2, 4, 64)[:, :1]  # strided, unit last stride
    kc, vc = torch.randn(3, 20, 2, 64), torch.randn(3, 20, 2, 64)
    seqlens = _i32([0, 7, 20], "cpu")
    for causal, scale in ((False, None), (True, 0.3)):
        out, lse = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=causal,
                                              softmax_scale=scale, return_softmax_lse=True)
        assert calls and interface._dense_decode_step is not step
        monkeypatch.setenv("FLASH_ATTN_EXT_DEBUG_CHECKS", "1")
        ref_out, ref_lse = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens,
                                                      causal=causal, softmax_scale=scale,
                                                      return_softmax_lse=True)
        monkeypatch.delenv("FLASH_ATTN_EXT_DEBUG_CHECKS")
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert step(q, kc, vc, seqlens.long(), None, False, 0) is None
    with pytest.raises(RuntimeError, match="cache_seqlens must be int32"):
        fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens.long())
    with pytest.raises(RuntimeError, match="cache_seqlens must have shape"):
        fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens[:2])
    with pytest.raises(RuntimeError, match="batch entries"):
        fa.flash_attn_with_kvcache(q[:2], kc, vc, cache_seqlens=seqlens[:2])
    with pytest.raises(TypeError):
        fa.flash_attn_with_kvcache("q", kc, vc, cache_seqlens=seqlens)
    fp8 = kc.to(torch.float8_e4m3fn)
    assert step(q, fp8, fp8, seqlens, None, False, 0) is None


def test_raw_operator_bad_inputs():
    q, pool, k, table = _small()
    fwd = torch.ops.flash_attn_ext.fwd
    with pytest.raises(RuntimeError, match="cache_batch_idx.*block_table"):
        fwd(q, pool, pool, 0.1, False, True, 0, 0, None, block_table=table,
            cache_batch_idx=_i32([0, 1], "cpu"))
    with pytest.raises(NotImplementedError, match="cache_leftpad"):
        fwd(q, pool, pool, 0.1, False, True, 0, 0, None, block_table=table,
            cache_leftpad=_i32([0, 1], "cpu"))
    with pytest.raises(RuntimeError, match="batch size"):  # no table: k's batch must match
        fwd(q, pool, pool, 0.1, False, True, 0, 0, None)
    with pytest.raises(RuntimeError, match="max_seqlen_k.*block_table"):
        torch.ops.flash_attn_ext.varlen_fwd(q[:, 0], pool, pool, _i32([0, 1, 2], "cpu"),
                                            _i32([0, 1, 40], "cpu"), 1, 39, 0.1, False,
                                            block_table=table)


# ---- debug checks (FLASH_ATTN_EXT_DEBUG_CHECKS=1) ---------------------------------------------
def test_debug_checks(monkeypatch):
    q, pool, k, table = _small()
    kv = dict(k=k, v=k.clone())
    bad = [
        (dict(cache_seqlens=32, block_table=table), "too short"),
        (dict(cache_seqlens=_i32([-1, 0], "cpu"), block_table=table), "too short"),
        (dict(cache_seqlens=3, block_table=_i32([[9, 0], [2, 3]], "cpu")), "block_table\\[0\\]"),
        (dict(cache_seqlens=20, block_table=_i32([[0, 1], [2, -1]], "cpu")), "block_table\\[1\\]"),
    ]
    dense = torch.randn(2, 10, 2, 32)
    bad_dense = [
        (dict(cache_seqlens=3, cache_batch_idx=_i32([0, 2], "cpu")), "cache_batch_idx"),
        (dict(cache_seqlens=3, cache_leftpad=_i32([0, 4], "cpu")), "cache_leftpad"),
    ]
    monkeypatch.setenv("FLASH_ATTN_EXT_DEBUG_CHECKS", "1")
    for kwargs, match in bad:
        with pytest.raises(RuntimeError, match=match):
            fa.flash_attn_with_kvcache(q, pool, pool.clone(), **kv, **kwargs)
    for kwargs, match in bad_dense:
        with pytest.raises(RuntimeError, match=match):
            fa.flash_attn_with_kvcache(q, dense, dense.clone(), **kv, **kwargs)
    # an unused page id past the sequence's keys is not an error
    fa.flash_attn_with_kvcache(q, pool, pool.clone(), **kv, cache_seqlens=3,
                               block_table=_i32([[0, 99], [2, 3]], "cpu"))
    # without the checks the same calls run (values clamped into the cache, no error)
    monkeypatch.setenv("FLASH_ATTN_EXT_DEBUG_CHECKS", "0")
    for kwargs, _ in bad:
        out = fa.flash_attn_with_kvcache(q, pool, pool.clone(), **kv, **kwargs)
        assert out.shape == q.shape
    for kwargs, _ in bad_dense:
        fa.flash_attn_with_kvcache(q, dense, dense.clone(), **kv, **kwargs)


# ---- opcheck of the new operator arguments -----------------------------------------------
def test_opcheck():
    q, pool, _, table = _small()
    fwd = torch.ops.flash_attn_ext.fwd.default
    varlen_fwd = torch.ops.flash_attn_ext.varlen_fwd.default
    used = _i32([20, 3], "cpu")
    torch.library.opcheck(fwd, (q, pool, pool, 0.2, True, True, 0, 0, used),
                          dict(block_table=table), test_utils=OPCHECK_UTILS)
    dense = torch.randn(3, 12, 2, 32)
    torch.library.opcheck(fwd, (q, dense, dense, 0.2, False, True, 0, 0, _i32([7, 12], "cpu")),
                          dict(cache_batch_idx=_i32([2, 0], "cpu"),
                               cache_leftpad=_i32([1, 12], "cpu")), test_utils=OPCHECK_UTILS)
    qv = torch.randn(5, HEADS, 32)
    torch.library.opcheck(varlen_fwd, (qv, pool, pool, _i32([0, 2, 5], "cpu"),
                                       _i32([0, 20, 23], "cpu"), 3, 20, 0.2, True),
                          dict(block_table=table), test_utils=OPCHECK_UTILS)


# ---- CUDA ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 160, 256])
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_cuda_head_dims_and_splits(head_dim, num_splits):
    """Every kernel head dim (row-wise and per-copy look-ups) of the cache kernels, unsplit,
    heuristic and forced split-KV, plain and variant kernels."""
    dtype = torch.bfloat16 if head_dim % 64 == 0 else torch.float16
    common = dict(head_dim=head_dim, lengths=(0, 200, 517), new_len=3, cache_len=600)
    Case("cuda", dtype, mode="paged", page_size=16, seqlen_q=1, **common).check(
        num_splits=num_splits)
    Case("cuda", dtype, mode="paged", page_size=64, seqlen_q=4, causal=True, rotary=(32, True),
         **common).check(num_splits=num_splits)
    Case("cuda", dtype, mode="batch_idx", seqlen_q=2, leftpad=(0, 50, 7), softcap=30.0,
         **common).check(num_splits=num_splits)


@pytest.mark.gpu
def test_cuda_inputs_on_another_device():
    case = Case("cuda", torch.float16, mode="paged", new_len=1)
    for name in ("block_table", "cache_seqlens"):
        kwargs = case.kwargs()
        if name == "cache_seqlens":  # moved to q's device (a copy), as before
            kwargs[name] = kwargs[name].cpu()
            fa.flash_attn_with_kvcache(case.q, case.k_cache.clone(), case.v_cache.clone(),
                                       k=case.k_new, v=case.v_new, **kwargs)
            continue
        kwargs[name] = kwargs[name].cpu()
        with pytest.raises(RuntimeError, match="block_table.*device"):
            fa.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, k=case.k_new,
                                       v=case.v_new, **kwargs)
    with pytest.raises(RuntimeError, match="rotary_cos.*device"):
        fa.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, k=case.k_new,
                                   v=case.v_new, cache_seqlens=3, block_table=case.block_table,
                                   rotary_cos=torch.ones(64, 8), rotary_sin=torch.ones(64, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [1, 2, 3])
def test_cuda_forced_tiles(tile):
    """The raw operator with a forced tile: paged calls always run the decode tiles (one warp
    or key warps); a forced large tile falls back to the one-warp tile."""
    case = Case("cuda", torch.float16, head_dim=128, mode="paged", lengths=(100, 0, 300),
                new_len=0, cache_len=320, seqlen_q=1)
    used = _i32(case.lengths, "cuda")
    out, _ = torch.ops.flash_attn_ext.fwd(case.q, case.k_cache, case.v_cache, 128 ** -0.5, False,
                                          True, 0, tile, used, block_table=case.block_table)
    (ref_out, _), (base_out, _) = case.reference(case.k_cache, case.v_cache)
    assert_fa_rule(out, ref_out, base_out, 2)


@pytest.mark.gpu
def test_cuda_long_paged_prefill():
    """A long query chunk against a paged cache (the decode tile at seqlen_q > 16)."""
    Case("cuda", torch.bfloat16, head_dim=128, mode="paged", page_size=16, lengths=(300, 0),
         batch=2, new_len=100, seqlen_q=100, cache_len=512, causal=True).check()


@pytest.mark.gpu
def test_cuda_gqa_regrouped_decode():
    """seqlen_q = 1 GQA decode regroups the query heads into rows (ops_cuda.cpp) on top of
    the block table; MQA too."""
    for kv_heads in (1, 2):
        Case("cuda", torch.float16, head_dim=64, kv_heads=kv_heads, mode="paged",
             lengths=(33, 1, 250), new_len=1, cache_len=256).check()


@pytest.mark.gpu
def test_cuda_no_host_sync():
    """A paged decode step with rotary embeddings runs without synchronising the host."""
    case = Case("cuda", torch.bfloat16, head_dim=128, mode="paged", lengths=(5, 90, 200),
                new_len=1, cache_len=256, rotary=(64, False), causal=True)
    case.run()  # warm-up (lazy initialisation)
    kw = case.kwargs()  # device tensors made before the check (a host-to-device copy syncs)
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for num_splits in (0, 2):
            fa.flash_attn_with_kvcache(case.q, kc, vc, k=case.k_new, v=case.v_new,
                                       num_splits=num_splits, **kw)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _check_graph_decode_loop(case, steps, cache_equal=torch.equal):
    """`steps` decode steps of `case` (append, then attention) captured once in a CUDA graph
    and replayed with new inputs: each step's output, and the caches at the end, equal the
    eager calls' bit for bit (cache_equal compares caches)."""
    lengths0 = _i32(case.lengths, "cuda")
    qs = [randn(case.q.shape, case.dtype, "cuda", 100 + t) for t in range(steps)]
    ks = [randn(case.k_new.shape, case.dtype, "cuda", 200 + t) for t in range(steps)]
    vs = [randn(case.v_new.shape, case.dtype, "cuda", 300 + t) for t in range(steps)]
    kw = case.kwargs()
    del kw["cache_seqlens"]

    kc_eager, vc_eager = case.k_cache.clone(), case.v_cache.clone()
    eager = [fa.flash_attn_with_kvcache(qs[t], kc_eager, vc_eager, k=ks[t], v=vs[t],
                                        cache_seqlens=lengths0 + t, **kw) for t in range(steps)]

    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    q_s, k_s, v_s = qs[0].clone(), ks[0].clone(), vs[0].clone()
    lengths_s = lengths0.clone()

    def step():
        return fa.flash_attn_with_kvcache(q_s, kc, vc, k=k_s, v=v_s, cache_seqlens=lengths_s, **kw)

    graph, out_s = capture_cuda_graph(step)
    kc.copy_(case.k_cache)  # undo the warm-up appends
    vc.copy_(case.v_cache)
    for t in range(steps):
        q_s.copy_(qs[t])
        k_s.copy_(ks[t])
        v_s.copy_(vs[t])
        lengths_s.copy_(lengths0 + t)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_s, eager[t]), f"step {t}"
    assert cache_equal(kc, kc_eager) and cache_equal(vc, vc_eager)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["paged", "batch_idx"])
def test_cuda_graph_decode_loop(mode):
    """Five decode steps (append with rotary embeddings, then attention) captured once in a
    CUDA graph and replayed with new inputs give what eager calls give, bit for bit."""
    steps, batch, head_dim = 5, 3, 128
    case = Case("cuda", torch.float16, batch=batch, head_dim=head_dim, mode=mode, page_size=16,
                lengths=(0, 15, 100), new_len=1, cache_len=128, rotary=(64, True), causal=True,
                leftpad=(0, 3, 10) if mode == "batch_idx" else None)
    _check_graph_decode_loop(case, steps)


# ---- FP8 (e4m3) KV cache under a 16-bit q ----------------------------------------------------
# The cache stores e4m3 values; the real cache is k_descale * stored (k_descale [] / [1] or
# [batch, heads_k], row b of the query batch also with cache_batch_idx / a block table). The
# reference is attention over the dequantised cache in float64; the FA rule's baseline the
# same computation in q's dtype (the dequantised cache rounded to it).
FP8 = torch.float8_e4m3fn


def zero_e4m3_subnormals(case):
    """Clears the e4m3 subnormals of an Fp8Case's caches: dequantised into an fp16 cache
    (x descale) they are fp16 subnormals, which the 16-bit kernels' MMAs need not take as
    the FP8 kernels take the (normal) fp16 values of the e4m3 codes themselves."""
    for cache in (case.k_cache, case.v_cache):
        codes = cache.view(torch.uint8)
        codes[(codes & 0x78) == 0] = 0


def fp8_kernel_column_order(t):
    """t with its head-dim columns in the order in which the CUDA FP8 cache kernels feed one
    16-column k-step of Q K^T to the tensor cores (csrc/cuda/sm80/fwd_mma.cuh,
    gemm_qk_fp8): the 16-bit kernels on q and k reordered alike run the same products in the
    same order, so the two can be compared bit for bit (the sum is the same either way)."""
    step = torch.tensor([0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15])
    dim = t.shape[-1]
    assert dim % 16 == 0
    order = (torch.arange(0, dim, 16)[:, None] + step).reshape(-1).to(t.device)
    return t[..., order]


# Every finite e4m3 code (NaN is 0x7f / 0xff): subnormals, zeros and +-448 included.
E4M3_CODES = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)


def quantize_ref(x, descale):
    """What an FP8 cache stores for the real values x [batch, n, heads_k, dim]: round(x /
    descale) saturated to +-448 (descale [] / [1] or [batch, heads_k])."""
    d = descale.reshape(()) if descale.numel() == 1 else descale[:, None, :, None]
    return (x.float() / d).clamp(-448, 448).to(FP8)


def fp8_descale(kind, batch, kv_heads, device, seed):
    """float32 descale: "scalar" [], "one" [1], "heads" [batch, kv_heads] (random, about
    1/64: stored values of ~64 are real values of ~1); "pow2" / "pow2_heads" powers of two
    (the dequantised cache is exact in 16 bits)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "pow2":
        return torch.tensor(2.0 ** -6, device=device)
    if kind == "pow2_heads":
        exps = torch.randint(5, 8, (batch, kv_heads), generator=gen).float()
        return (2.0 ** -exps).to(device)
    shape = {"scalar": (), "one": (1,), "heads": (batch, kv_heads)}[kind]
    return ((torch.rand(shape, generator=gen) + 0.5) / 64).to(device)


def fp8_pool(shape, device, seed):
    """Stored e4m3 values ~ N(0, 64^2), every finite code among the first elements."""
    gen = torch.Generator().manual_seed(seed)
    stored = (torch.randn(shape, generator=gen) * 64).clamp(-448, 448).to(FP8)
    flat = stored.view(-1).view(torch.uint8)
    n = min(flat.numel(), E4M3_CODES.numel())
    flat[:n] = E4M3_CODES[torch.randperm(E4M3_CODES.numel(), generator=gen)[:n]]
    return stored.to(device)


class Fp8Case(Case):
    """A Case whose caches are FP8 with k_descale / v_descale (kind: fp8_descale), q and the
    new k / v in `dtype` (new_fp8: the new k / v given already in e4m3)."""

    def __init__(self, device, dtype, *, descale="heads", new_fp8=False, seed=0, **kw):
        super().__init__(device, dtype, seed=seed, **kw)
        kv_heads = self.k_cache.shape[2]
        self.k_descale = fp8_descale(descale, self.batch, kv_heads, device, seed + 20)
        self.v_descale = fp8_descale(descale, self.batch, kv_heads, device, seed + 21)
        self.k_cache = fp8_pool(self.k_cache.shape, device, seed + 22)
        self.v_cache = fp8_pool(self.v_cache.shape, device, seed + 23)
        if new_fp8 and self.k_new is not None:
            self.k_new = quantize_ref(self.k_new, self.k_descale)
            self.v_new = quantize_ref(self.v_new, self.v_descale)

    def kwargs(self):
        return dict(super().kwargs(), k_descale=self.k_descale, v_descale=self.v_descale)

    @staticmethod
    def factor(descale, b):
        """Batch entry b's factor, broadcastable over [rows, heads_k, dim]."""
        d = descale.double()
        return d.reshape(()) if d.numel() == 1 else d[b][:, None]

    def stored_rows(self, cache, b, rows):
        """cache_rows of an FP8 cache (gathered as bytes)."""
        return cache_rows(_bits(cache), b, rows, self.block_table, self.cache_batch_idx).view(FP8)

    def real_rows(self, cache, b, rows, which):
        d = self.k_descale if which == 0 else self.v_descale
        return self.stored_rows(cache, b, rows).double() * self.factor(d, b)

    def check_caches(self, kc, vc):
        """The new rows hold the quantised new keys / values (rotated keys: within e4m3's
        rounding of the float64 rotation); nothing else changed."""
        fp8_given = self.k_new.dtype is FP8
        exp_k = self.k_new if fp8_given else quantize_ref(self.k_new, self.k_descale)
        exp_v = self.v_new if fp8_given else quantize_ref(self.v_new, self.v_descale)
        written = torch.zeros(kc.shape[:2], dtype=torch.bool, device=self.device)
        for b in range(self.batch):
            rows = self.rows(b, self.lengths[b], self.lengths[b] + self.new_len)
            got_k = self.stored_rows(kc, b, rows)
            got_v = self.stored_rows(vc, b, rows)
            assert torch.equal(got_v.view(torch.uint8), exp_v[b].view(torch.uint8))
            if self.rotary is None:
                assert torch.equal(got_k.view(torch.uint8), exp_k[b].view(torch.uint8))
            else:
                kd = self.factor(self.k_descale, b)
                new = self.k_new.double() * (kd if fp8_given else 1.0)
                rot = rotate64(new, self.cos, self.sin, self._k_positions(), self.interleaved)[b]
                err = (got_k.double() * kd - rot).abs()
                # e4m3 keeps 3 mantissa bits: half a step is 1/16 of the value (a full step
                # where fp32 rotation and float64 round apart), 2^-10 x descale subnormal.
                assert bool((err <= rot.abs() / 8 + 2.0 ** -9 * kd).all())
            if self.block_table is not None:
                page_size = kc.shape[1]
                written[self.block_table[b].long()[rows // page_size], rows % page_size] = True
            else:
                entry = b if self.cache_batch_idx is None else int(self.cache_batch_idx[b])
                written[entry, rows] = True
        assert torch.equal(_bits(kc)[~written], _bits(self.k_cache)[~written])
        assert torch.equal(_bits(vc)[~written], _bits(self.v_cache)[~written])


# (dtype, mode, kv_heads, descale, seqlen_q, new_len, causal, extra Case arguments)
FP8_CASES = [
    (torch.bfloat16, "dense", 2, "heads", 1, 2, False, {}),
    (torch.float16, "dense", 1, "scalar", 3, 0, True, {}),              # MQA, no append
    (torch.bfloat16, "paged", 2, "one", 1, 3, False, dict(lengths=(0, 15, 33))),  # across pages
    (torch.float16, "paged", 2, "heads", 4, 2, True, dict(rotary=(16, False))),
    (torch.bfloat16, "batch_idx", 2, "heads", 2, 2, True, {}),
    (torch.float16, "dense", 2, "one", 3, 2, False, dict(leftpad=(3, 4, 0), lengths=(10, 4, 30))),
    (torch.bfloat16, "dense", 4, "heads", 2, 1, True,
     dict(window=(6, 0), softcap=30.0, alibi="head")),
    (torch.float16, "batch_idx", 2, "scalar", 1, 2, False, dict(rotary=(32, True))),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,mode,kv_heads,descale,seqlen_q,new_len,causal,extra", FP8_CASES,
                         ids=str)
def test_fp8_cache(device, dtype, mode, kv_heads, descale, seqlen_q, new_len, causal, extra):
    """FP8 caches (dense, paged, cache_batch_idx, left padding, GQA / MQA / MHA, rotary,
    variants) against the dequantised cache; appended 16-bit keys / values are quantised."""
    extra = dict(dict(lengths=(0, 17, 30)), **extra)
    Fp8Case(device, dtype, mode=mode, kv_heads=kv_heads, descale=descale, seqlen_q=seqlen_q,
            new_len=new_len, causal=causal, **extra).check()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["dense", "paged"])
def test_fp8_cache_append_e4m3(device, mode):
    """New k / v given in e4m3 are stored as they are (already in the cache's units)."""
    Fp8Case(device, torch.bfloat16, mode=mode, new_fp8=True, lengths=(5, 0, 31), new_len=3,
            seqlen_q=2, causal=True).check()
    Fp8Case(device, torch.float16, mode=mode, new_fp8=True, lengths=(5, 0, 31), new_len=2,
            rotary=(16, True), descale="scalar").check()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("descale", ["pow2", "pow2_heads"])
def test_fp8_cache_matches_16bit_cache(device, descale):
    """With power-of-two descales the dequantised cache is exact in 16 bits: the same call on
    that 16-bit cache gives the same output (the kernels scale by powers of two only). fp16:
    the CUDA FP8 cache kernels run their MMAs in fp16 (a bf16 q is converted, so a bf16 call
    is not bit for bit the 16-bit cache's)."""
    case = Fp8Case(device, torch.float16, mode="paged", kv_heads=2, descale=descale,
                   lengths=(20, 0, 40), new_len=0, seqlen_q=1)
    zero_e4m3_subnormals(case)
    kw = case.kwargs()
    # The FP8 cache's split and tile rules differ: force one-warp tiles with 2 splits on both
    # (a forced split count > 1 keeps the one-warp tile) for the same summation order.
    kw["num_splits"] = 2
    out = fa.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, **kw)
    kd, vd = kw.pop("k_descale"), kw.pop("v_descale")
    # Pages are per batch entry (block_table rows are disjoint): dequantise each entry's pages.
    k16, v16 = case.k_cache.to(torch.float16), case.v_cache.to(torch.float16)
    for b in range(case.batch):
        pages = case.block_table[b].long()
        for cache16, cache8, d in ((k16, case.k_cache, kd), (v16, case.v_cache, vd)):
            f = d.reshape(()) if d.numel() == 1 else d[b][:, None]
            cache16[pages] = (_bits(cache8)[pages].view(FP8).double() * f).to(torch.float16)
    expected = fa.flash_attn_with_kvcache(fp8_kernel_column_order(case.q),
                                         fp8_kernel_column_order(k16), v16, **kw)
    tol = dict(atol=0, rtol=0) if device == "cuda" else {}
    torch.testing.assert_close(out, expected, **tol)


def _fp8_small(device="cpu", batch=2):
    q = torch.randn(batch, 1, HEADS, 32, dtype=torch.bfloat16).to(device)
    cache = (torch.randn(batch, 10, 2, 32) * 32).to(FP8).to(device)
    k = torch.randn(batch, 1, 2, 32, dtype=torch.bfloat16).to(device)
    d = torch.ones((), device=device)
    return q, cache, k, d


FP8_BAD = [
    (dict(k_descale=None), ValueError, "k_descale"),
    (dict(k_descale=None, v_descale=None), ValueError, "k_descale.*v_descale"),
    (dict(v_descale=torch.ones(3, 2)), RuntimeError, "v_descale.*shape"),
    (dict(k_descale=torch.ones(2, 2, 1)), RuntimeError, "k_descale.*shape"),
    (dict(k_descale=torch.ones(2)), RuntimeError, "k_descale.*shape"),
    (dict(k_descale=torch.ones((), dtype=torch.float64)), RuntimeError, "k_descale.*float32"),
    (dict(v_descale=torch.ones((), dtype=torch.bfloat16)), RuntimeError, "v_descale.*float32"),
    (dict(k_descale=1.0), TypeError, "k_descale"),
]


@pytest.mark.parametrize("kwargs,exc,match", FP8_BAD, ids=lambda x: str(x)[:40])
def test_fp8_bad_descales(kwargs, exc, match):
    q, cache, k, d = _fp8_small()
    args = dict(k=k, v=k.clone(), cache_seqlens=3, k_descale=d, v_descale=d.clone())
    args.update(kwargs)
    before = cache.clone()
    with pytest.raises(exc, match=match):
        fa.flash_attn_with_kvcache(q, cache, cache.clone(), **args)
    assert torch.equal(_bits(cache), _bits(before))  # nothing appended


def test_fp8_bad_inputs():
    q, cache, k, d = _fp8_small()
    desc = dict(k_descale=d, v_descale=d)
    with pytest.raises(ValueError, match="FP8"):  # descales with a 16-bit cache
        fa.flash_attn_with_kvcache(q, cache.to(torch.bfloat16), cache.to(torch.bfloat16),
                                   cache_seqlens=3, **desc)
    with pytest.raises(NotImplementedError, match="float32"):  # float32 q
        fa.flash_attn_with_kvcache(q.float(), cache, cache, cache_seqlens=3, **desc)
    with pytest.raises(RuntimeError, match="same dtype"):
        fa.flash_attn_with_kvcache(q, cache, cache.to(torch.bfloat16), cache_seqlens=3, **desc)
    # The raw operator checks the same (RuntimeError, NotImplementedError for float32 q).
    fwd = torch.ops.flash_attn_ext.fwd
    used = _i32([3, 3], "cpu")
    with pytest.raises(RuntimeError, match="k_descale and v_descale"):
        fwd(q, cache, cache, 0.1, False, True, 0, 0, used)
    with pytest.raises(RuntimeError, match="k_descale and v_descale"):
        fwd(q, cache, cache, 0.1, False, True, 0, 0, used, k_descale=d)
    with pytest.raises(RuntimeError, match="FP8"):
        fwd(q, q, q, 0.1, False, True, 0, 0, None, k_descale=d, v_descale=d)
    with pytest.raises(RuntimeError, match="v_descale.*shape"):
        fwd(q, cache, cache, 0.1, False, True, 0, 0, used, k_descale=d,
            v_descale=torch.ones(2, 3))
    with pytest.raises(NotImplementedError, match="float32"):
        fwd(q.float(), cache, cache, 0.1, False, True, 0, 0, used, **desc)
    with pytest.raises(RuntimeError, match="same dtype"):
        fwd(q, cache, cache.to(torch.bfloat16), 0.1, False, True, 0, 0, used, **desc)
    # FP8 k / v reach the kernels through the KV cache path only.
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        fa.flash_attn_func(q, cache, cache)
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        torch.ops.flash_attn_ext.bwd(q, q, cache, cache, q, torch.zeros(2, HEADS, 1), 0.1,
                                     False, True)
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        fa.flash_attn_varlen_func(q[:, 0], cache[0], cache[0], _i32([0, 1, 2], "cpu"),
                                  _i32([0, 5, 10], "cpu"), 1, 5)


def test_fp8_opcheck():
    """opcheck of fwd with an FP8 cache. Its test_schema compares the inputs before and after
    with torch.allclose, which float8 tensors lack (torch 2.15): the inputs are compared by
    their bytes here instead."""
    q, cache, _, d = _fp8_small()
    fwd = torch.ops.flash_attn_ext.fwd.default
    utils = [u for u in OPCHECK_UTILS if u != "test_schema"]
    kd = torch.rand(2, 2) + 0.5
    pool = (torch.randn(5, 16, 2, 32) * 32).to(FP8)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    calls = [((q, cache, cache, 0.2, True, True, 0, 0, _i32([7, 10], "cpu")),
              dict(k_descale=kd, v_descale=d)),
             ((q, pool, pool, 0.2, False, True, 0, 0, _i32([20, 3], "cpu")),
              dict(block_table=table, k_descale=d.reshape(1), v_descale=kd))]
    for args, kwargs in calls:
        torch.library.opcheck(fwd, args, kwargs, test_utils=utils)
        before = args[1].clone()
        fwd(*args, **kwargs)
        assert torch.equal(_bits(args[1]), _bits(before))


# ---- FP8 cache on CUDA ----------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 160, 192, 224, 256])
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_cuda_fp8_head_dims_and_splits(head_dim, num_splits):
    """Every kernel head dim of the FP8 cache kernels (row-wise and per-copy look-ups, both q
    dtypes), unsplit, heuristic and forced split-KV, plain and variant kernels."""
    dtype = torch.bfloat16 if head_dim % 64 == 0 else torch.float16
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    common = dict(head_dim=head_dim, lengths=(0, 200, 517), new_len=3, cache_len=600)
    Fp8Case("cuda", dtype, mode="paged", page_size=16, seqlen_q=1, **common).check(
        num_splits=num_splits)
    Fp8Case("cuda", other, mode="paged", page_size=64, seqlen_q=4, causal=True,
            rotary=(32, True), descale="one", **common).check(num_splits=num_splits)
    Fp8Case("cuda", dtype, mode="batch_idx", seqlen_q=2, leftpad=(0, 50, 7), softcap=30.0,
            descale="scalar", **common).check(num_splits=num_splits)
    Fp8Case("cuda", other, mode="dense", seqlen_q=1, kv_heads=1, **common).check(
        num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [40, 72, 200])
def test_cuda_fp8_padded_head_dim(head_dim):
    """Head dims that are no multiple of 16: the FP8 cache is padded to one (a copy)."""
    Fp8Case("cuda", torch.bfloat16, head_dim=head_dim, mode="paged", lengths=(3, 40, 90),
            new_len=2, cache_len=96, seqlen_q=2, causal=True).check()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tile", [1, 2, 3])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_fp8_forced_tiles_match_16bit(dtype, tile, head_dim):
    """The raw operator with a forced tile and one split: an FP8 cache with power-of-two
    descales gives exactly the output of the 16-bit cache kernels on the dequantised cache
    (same tile; the conversion is exact and the factors are powers of two) with an fp16 q;
    with a bf16 q the FP8 kernels run fp16 MMAs (q converted, P in fp16): the same lse, and
    the output within the FlashAttention rule."""
    case = Fp8Case("cuda", dtype, head_dim=head_dim, mode="paged", lengths=(100, 0, 300),
                   new_len=0, cache_len=320, seqlen_q=1, descale="pow2_heads")
    if dtype == torch.float16:
        zero_e4m3_subnormals(case)
    used = _i32(case.lengths, "cuda")
    fwd = torch.ops.flash_attn_ext.fwd
    out, lse = fwd(case.q, case.k_cache, case.v_cache, head_dim ** -0.5, False, True, 1, tile,
                   used, block_table=case.block_table, k_descale=case.k_descale,
                   v_descale=case.v_descale)
    k16, v16 = case.k_cache.to(dtype), case.v_cache.to(dtype)
    for b in range(case.batch):
        pages = case.block_table[b].long()
        k16[pages] = (_bits(case.k_cache)[pages].view(FP8).double() *
                      case.k_descale[b][:, None]).to(dtype)
        v16[pages] = (_bits(case.v_cache)[pages].view(FP8).double() *
                      case.v_descale[b][:, None]).to(dtype)
    out16, lse16 = fwd(fp8_kernel_column_order(case.q), fp8_kernel_column_order(k16), v16,
                       head_dim ** -0.5, False, True, 1, tile, used, block_table=case.block_table)
    if dtype == torch.float16:
        assert torch.equal(out, out16)
        torch.testing.assert_close(lse, lse16, atol=0, rtol=0)
    else:  # the same scores (exact products) up to the order of the sums; P rounded otherwise
        torch.testing.assert_close(lse, lse16)
    (ref_out, _), (base_out, _) = case.reference(case.k_cache, case.v_cache)
    assert_fa_rule(out, ref_out, base_out, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [2, 3, 6, 7])
@pytest.mark.parametrize("kv_heads", [8, 32])
def test_cuda_fp8_decode_splits(num_splits, kv_heads):
    """The benchmark's decode shape (B=8, H=32, D=128, one query per sequence) with split-KV:
    up to 6 splits merge in a thread-block cluster on sm_90, 7 in the combine kernel."""
    case = Fp8Case("cuda", torch.bfloat16, batch=8, kv_heads=kv_heads, head_dim=128,
                   lengths=tuple(range(1000, 1800, 100)), new_len=1, cache_len=2048,
                   seqlen_q=1)
    case.q = randn((8, 1, 32, 128), torch.bfloat16, "cuda", 5)
    case.check(num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("exponent", [20, -30])
@pytest.mark.parametrize("tile", [0, 1, 2, 3])
def test_cuda_fp8_bf16_q_outside_fp16_range(exponent, tile):
    """A bf16 q far outside fp16's range (|q| ~ 2^22 or 2^-28) on an FP8 cache, whose kernels
    run fp16 MMAs: fp8_prepare_q scales q by a power of two into fp16 and the softmax scale by
    its inverse, so q * 2^e with softmax_scale * 2^-e gives the plain call's output and lse
    bit for bit (the scaled q is the same fp16 tensor), for every tile."""
    case = Fp8Case("cuda", torch.bfloat16, head_dim=128, mode="paged", lengths=(100, 0, 300),
                   new_len=0, cache_len=320, seqlen_q=2, descale="heads")
    used = _i32(case.lengths, "cuda")
    fwd = torch.ops.flash_attn_ext.fwd
    scale = 128 ** -0.5

    def call(q, softmax_scale):
        return fwd(q, case.k_cache, case.v_cache, softmax_scale, False, True, 0, tile, used,
                   block_table=case.block_table, k_descale=case.k_descale,
                   v_descale=case.v_descale)

    out, lse = call(case.q, scale)
    big_out, big_lse = call(case.q * 2.0 ** exponent, scale * 2.0 ** -exponent)
    assert bool(torch.isfinite(big_out).all())
    assert torch.equal(big_out, out)
    assert torch.equal(big_lse, lse)
    (ref_out, _), (base_out, _) = case.reference(case.k_cache, case.v_cache)
    assert_fa_rule(out, ref_out, base_out, 2)


@pytest.mark.gpu
def test_cuda_fp8_long_paged_prefill():
    """A long query chunk against a paged FP8 cache (the decode tile at seqlen_q > 16)."""
    Fp8Case("cuda", torch.float16, head_dim=128, mode="paged", page_size=16, lengths=(300, 0),
            batch=2, new_len=100, seqlen_q=100, cache_len=512, causal=True).check()


@pytest.mark.gpu
def test_cuda_fp8_descale_on_another_device():
    q, cache, k, d = _fp8_small("cuda")
    with pytest.raises(RuntimeError, match="k_descale.*device"):
        fa.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=3,
                                   k_descale=d.cpu(), v_descale=d)
    with pytest.raises(RuntimeError, match="v_descale.*device"):
        torch.ops.flash_attn_ext.fwd(q, cache, cache, 0.1, False, True, 0, 0,
                                     _i32([3, 3], "cuda"), k_descale=d, v_descale=d.cpu())


@pytest.mark.gpu
def test_cuda_fp8_graph_decode_loop():
    """Five decode steps on a paged FP8 cache (append with quantisation and rotary embeddings,
    then attention) captured in a CUDA graph give what eager calls give, bit for bit."""
    steps = 5
    case = Fp8Case("cuda", torch.bfloat16, batch=3, head_dim=128, mode="paged", page_size=16,
                   lengths=(0, 15, 100), new_len=1, cache_len=128, rotary=(64, True),
                   causal=True)
    _check_graph_decode_loop(case, steps, lambda a, b: torch.equal(_bits(a), _bits(b)))
