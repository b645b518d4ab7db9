"""The Hopper forward (wgmma + TMA, csrc/cuda/hopper): dispatch, numerics, races.

Runs only on a compute-capability 9.0 GPU with a build that has an sm_90a
target; FLASH_ATTN_EXT_FWD_IMPL (read on every call) switches between the
Hopper kernel ("auto"/"wgmma") and the mma.sync kernels ("mma").
"""
import pytest
import torch

import flash_attn_ext as fa
from helpers import (alibi_slopes, assert_fa_rule, check_lse, check_out_and_grads, kernel_names,
                     make_qkv, make_varlen, padded_attention, randn, ref_and_base,
                     reference_and_baseline, varlen_attention)

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
SM90_KERNEL = "flash_fwd_sm90_kernel"


def ran_sm90(fn):
    return any(SM90_KERNEL in n for n in kernel_names(fn))


@pytest.fixture(scope="module")
def sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper forward needs a compute capability 9.0 GPU")
    q, k, v = make_qkv(1, 256, 256, 2, 128, torch.bfloat16, DEVICE, requires_grad=False)
    if not ran_sm90(lambda: fa.flash_attn_func(q, k, v, num_splits=1)):
        pytest.skip("this build has no sm_90a target (FLASH_ATTN_EXT_CUDA_ARCHS)")


@pytest.fixture
def impl(monkeypatch):
    def set_impl(name):
        monkeypatch.setenv("FLASH_ATTN_EXT_FWD_IMPL", name)
    return set_impl


def test_dispatch(sm90, impl):
    q, k, v = make_qkv(2, 300, 300, 4, 128, torch.bfloat16, DEVICE, requires_grad=False)
    assert ran_sm90(lambda: fa.flash_attn_func(q, k, v, causal=True, num_splits=1))
    impl("mma")
    assert not ran_sm90(lambda: fa.flash_attn_func(q, k, v, causal=True, num_splits=1))
    impl("wgmma")
    assert ran_sm90(lambda: fa.flash_attn_func(q, k, v, num_splits=1))
    # Calls the Hopper kernel does not implement stay on mma.sync.
    assert not ran_sm90(lambda: fa.flash_attn_func(q[:, :1], k, v))            # decode tile
    assert not ran_sm90(lambda: fa.flash_attn_func(q, k, v, num_splits=3))     # split-KV
    q96, k96, v96 = make_qkv(1, 300, 300, 2, 96, torch.bfloat16, DEVICE, requires_grad=False)
    try:
        assert not ran_sm90(lambda: fa.flash_attn_func(q96, k96, v96))         # head dim 96
    except RuntimeError as e:  # a build restricted with FLASH_ATTN_EXT_HEAD_DIMS
        assert "not compiled" in str(e)
    # softmax_scale <= 0: the kernel folds the scale into exp2 after the row max.
    for scale in (-0.05, 0.0):
        assert not ran_sm90(lambda: fa.flash_attn_func(q, k, v, softmax_scale=scale, num_splits=1))
        out = fa.flash_attn_func(q, k, v, softmax_scale=scale, causal=True, num_splits=1)
        ref = fa.attention_ref(q, k, v, softmax_scale=scale, causal=True)
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=0)
    impl("bogus")
    with pytest.raises(RuntimeError, match="FLASH_ATTN_EXT_FWD_IMPL"):
        fa.flash_attn_func(q, k, v)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_loop_matches_single_tiles(sm90, causal, head_dim):
    """The persistent grid (one CTA per SM: round-robin over equal non-causal tiles, an
    atomic tile counter for causal ones) with more tiles than SMs, so every CTA loops
    (unequal tiles when causal), against calls on slices of the same tensors small enough
    that each CTA runs one tile: each tile is computed by the same code, so the outputs
    are bit-identical. D = 64 runs three consumer warpgroups (192-row tiles), D = 128 two."""
    q, k, v = make_qkv(2, 2000, 1500, 8, head_dim, torch.bfloat16, DEVICE, requires_grad=False)
    assert ran_sm90(lambda: fa.flash_attn_func(q, k, v, causal=causal, num_splits=1))
    out, lse = fa.flash_attn_func(q, k, v, causal=causal, return_lse=True, num_splits=1)
    for b in range(2):
        for h in (0, 4):  # 16 query tiles x 4 heads = 64 tiles per call
            sl = (slice(b, b + 1), slice(None), slice(h, h + 4))
            o, l = fa.flash_attn_func(q[sl], k[sl], v[sl], causal=causal, return_lse=True,
                                      num_splits=1)
            assert torch.equal(o, out[sl]), (b, h)
            assert torch.equal(l, lse[b:b + 1, h:h + 4]), (b, h)
    check_forward(q, k, v, causal)


def run_forward(q, k, v, causal, bottom_right):
    """[B,S,H,D] forward with either causal alignment; returns (out, lse).

    num_splits=1: the small test grids would otherwise take the mma.sync split-KV
    path, which the Hopper kernel leaves to mma.sync."""
    if causal and not bottom_right:
        return torch.ops.flash_attn_ext.fwd(q, k, v, q.shape[-1] ** -0.5, True, False, 1)
    return fa.flash_attn_func(q, k, v, causal=causal, return_lse=True, num_splits=1)


def check_forward(q, k, v, causal, bottom_right=True, layout="bshd"):
    if layout == "bshd":
        out, lse = run_forward(q, k, v, causal, bottom_right)
    else:
        out = fa.scaled_dot_product_attention(q, k, v, is_causal=causal)
        lse = None
    dout = torch.randn_like(out)
    (ref, *_), (base, *_) = reference_and_baseline(q, k, v, dout, causal, bottom_right, layout)
    assert_fa_rule(out, ref, base, 2)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [40, 64, 120, 128, 232, 256])
@pytest.mark.parametrize("causal,bottom_right", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(17, 17), (63, 1025), (127, 127), (128, 129),
                                               (1025, 63), (1025, 1025), (300, 3000)])
def test_forward_matches_reference(sm90, impl, dtype, head_dim, causal, bottom_right, seqlen_q, seqlen_k):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 3, head_dim, dtype, DEVICE, requires_grad=False)
    out, lse = check_forward(q, k, v, causal, bottom_right)
    # The LSE agrees with the mma.sync path (both fp32 softmax statistics).
    impl("mma")
    _, lse2 = run_forward(q, k, v, causal, bottom_right)
    finite = torch.isfinite(lse2)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse[finite], lse2[finite], atol=2e-3, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_layout_and_gqa(sm90, causal):
    # Big enough that the split heuristic leaves the grid unsplit.
    q, k, v = make_qkv(4, 1024, 1024, 16, 128, torch.bfloat16, DEVICE, layout="bhsd",
                       requires_grad=False)
    check_forward(q, k, v, causal, bottom_right=False, layout="bhsd")
    assert ran_sm90(lambda: fa.scaled_dot_product_attention(q, k, v, is_causal=causal))
    # GQA: 8 query heads over 2 kv heads, no expand.
    q = torch.randn(2, 500, 8, 64, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(2, 500, 2, 64, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn(2, 500, 2, 64, device=DEVICE, dtype=torch.bfloat16)
    out = fa.flash_attn_func(q, k, v, causal=causal, num_splits=1)
    assert ran_sm90(lambda: fa.flash_attn_func(q, k, v, causal=causal, num_splits=1))
    ref = fa.flash_attn_func(q, k.repeat_interleave(4, 2), v.repeat_interleave(4, 2), causal=causal,
                             num_splits=1)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_noncontiguous_and_batch_one(sm90):
    base = torch.randn(1, 333, 6, 2, 128, device=DEVICE, dtype=torch.bfloat16)
    q, k, v = base[..., 0, :], base[..., 1, :], base[..., 0, :].flip(1)
    assert not q.is_contiguous()
    check_forward(q, k, v, causal=True)
    assert ran_sm90(lambda: fa.flash_attn_func(q, k, v, causal=True, num_splits=1))


def test_fully_masked_rows(sm90):
    # bottom-right causal with more queries than keys: the first rows see no key.
    q, k, v = make_qkv(1, 300, 100, 2, 128, torch.bfloat16, DEVICE, requires_grad=False)
    out, lse = run_forward(q, k, v, True, True)
    assert torch.all(out[:, :200] == 0)
    assert torch.all(lse[:, :, :200] == float("-inf"))
    check_forward(q, k, v, causal=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_race_free(sm90, dtype):
    q, k, v = make_qkv(2, 1000, 1000, 4, 128, dtype, DEVICE, requires_grad=False)
    first, lse = run_forward(q, k, v, True, True)
    for _ in range(100):
        out, lse2 = run_forward(q, k, v, True, True)
        assert torch.equal(out, first) and torch.equal(lse, lse2)


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(256, 1), (256, 777), (1000, 4100), (2048, 300)])
def test_forward_even_query_tile_counts(sm90, head_dim, seqlen_q, seqlen_k):
    """Non-causal calls with an even number of 128-row query tiles per head (all other tests
    but test_sdpa_layout_and_gqa have odd counts): more tiles than SMs (2048 rows x 15 heads),
    odd key counts, one key; every run bit for bit the same."""
    q, k, v = make_qkv(3, seqlen_q, seqlen_k, 5, head_dim, torch.bfloat16, DEVICE,
                       requires_grad=False)
    first, lse = check_forward(q, k, v, causal=False)
    assert ran_sm90(lambda: run_forward(q, k, v, False, True))
    for _ in range(5):
        out, lse2 = run_forward(q, k, v, False, True)
        assert torch.equal(out, first) and torch.equal(lse, lse2)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_long_sequence(sm90, head_dim):
    q, k, v = make_qkv(1, 16384, 16384, 1, head_dim, torch.bfloat16, DEVICE, requires_grad=False)
    check_forward(q, k, v, causal=True)


def test_training_through_sm90(sm90):
    q, k, v = make_qkv(2, 513, 513, 4, 64, torch.bfloat16, DEVICE)
    out = fa.flash_attn_func(q, k, v, causal=True, num_splits=1)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    (ref, *ref_grads), (base, *base_grads) = reference_and_baseline(q, k, v, dout, True, True)
    assert_fa_rule(out, ref, base, 2)
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads):
        assert_fa_rule(g, r, b, 3, what=name)


def check_varlen_sm90(dtype, head_dim, causal, lens_q, lens_k, **variant):
    """Runs packed sequences with NaN in the rows past cu_seqlens[-1] through the Hopper
    forward and checks out and lse against the reference on the sequences' rows (the NaN
    rows zeroed there). Returns (call, out, lse, rows)."""
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, 4, 2, head_dim, dtype,
                                                    DEVICE, pad_q=9, pad_k=70,
                                                    requires_grad=False)
    for t in (q, k, v):
        t[-5:] = float("nan")
    call = lambda: fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                             return_lse=True, **variant)
    assert ran_sm90(call)
    out, lse = call()
    rows, keys = sum(lens_q), sum(lens_k)
    clean = [t.clone() for t in (q, k, v)]
    for t, n in zip(clean, (rows, keys, keys)):
        t[n:] = 0
    ref, base = ref_and_base(
        lambda q, k, v: varlen_attention(q, k, v, cu_q, cu_k, causal, **variant), clean)
    check_out_and_grads(out, None, ref, base, dtype, rows=rows)
    check_lse(lse[:, :rows], ref[1][:, :rows], dtype)
    return call, out, lse, rows


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen(sm90, impl, dtype, head_dim, causal):
    """Packed sequences (varlen) in the Hopper forward: sequences shorter than, equal to and
    longer than a tile, empty ones, GQA, and NaN in the rows past cu_seqlens[-1]: a tile
    reads past its sequence (the next sequence's rows, or the buffer's tail), which the key
    mask hides and whose V rows the kernel zeroes, so nothing leaks between sequences. The
    LSE agrees with the mma.sync kernels'."""
    call, _, lse, rows = check_varlen_sm90(dtype, head_dim, causal,
                                           [0, 1, 63, 200, 128, 77, 5, 300],
                                           [5, 0, 63, 129, 300, 77, 1, 257])
    impl("mma")
    assert not ran_sm90(call)
    _, lse_mma = call()
    finite = torch.isfinite(lse_mma[:, :rows])
    assert torch.equal(finite, torch.isfinite(lse[:, :rows]))
    torch.testing.assert_close(lse[:, :rows][finite], lse_mma[:, :rows][finite], atol=2e-3, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_three_warpgroups(sm90, causal):
    """D = 64 packed sequences longer than 1024 rows: the causal kernel with three consumer
    warpgroups (192-row tiles; shorter causal calls take two), tiles across sequence ends."""
    check_varlen_sm90(torch.bfloat16, 64, causal, [1100, 5, 0, 1300, 191], [1100, 7, 3, 1250, 400])


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_many_sequences(sm90, head_dim, causal):
    """300 packed sequences (the compact tile list's kernel ranks each among all 300 in
    256-thread strides) in random order of length, so that the longest-first list reorders
    them, some empty."""
    gen = torch.Generator().manual_seed(5)
    lens_q = torch.randint(0, 400, (300,), generator=gen).tolist()
    lens_k = torch.randint(0, 400, (300,), generator=gen).tolist()
    lens_q[:3], lens_k[3:6] = [0, 0, 0], [0, 0, 0]
    check_varlen_sm90(torch.bfloat16, head_dim, causal, lens_q, lens_k)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_more_sequences_than_the_tile_list_ranks(sm90, causal):
    """4100 packed sequences, more than the compact tile list ranks (kCompactTilesMaxBatch =
    4096): the padded grid, which claims the longest sequence's tile count for every sequence
    and skips the tiles past each one."""
    gen = torch.Generator().manual_seed(7)
    lens_q = torch.randint(0, 24, (4100,), generator=gen).tolist()
    lens_k = torch.randint(0, 24, (4100,), generator=gen).tolist()
    lens_q[0], lens_k[0] = 130, 70  # longer than a decode-sized call: the Hopper forward
    check_varlen_sm90(torch.bfloat16, 64, causal, lens_q, lens_k)


def test_varlen_dispatch(sm90):
    """Varlen calls take the Hopper forward, with seqused_k and with a variant too."""
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen([100, 300], [200, 300], 4, 2, 128,
                                                    torch.bfloat16, DEVICE, requires_grad=False)
    used = torch.tensor([150, 3], dtype=torch.int32, device=DEVICE)
    assert ran_sm90(lambda: fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k))
    assert ran_sm90(lambda: fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                                      seqused_k=used))
    assert ran_sm90(lambda: fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                                      softcap=30.0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_seqused_k(sm90, dtype, head_dim, causal):
    """seqused_k (a plain KV cache's cache_seqlens) in the Hopper forward. Padded: NaN in every
    key and value past it (a cache's unused rows), a batch entry with no key and one with a
    single key, more queries than keys used; packed: varlen with seqused_k."""
    used = torch.tensor([333, 0, 129, 1], dtype=torch.int32, device=DEVICE)
    q = randn((4, 150, 4, head_dim), dtype, DEVICE, 1)
    k = randn((4, 333, 2, head_dim), dtype, DEVICE, 2)
    v = randn((4, 333, 2, head_dim), dtype, DEVICE, 3)
    k_cache, v_cache = k.clone(), v.clone()
    for b, n in enumerate(used.tolist()):
        k_cache[b, n:] = float("nan")
        v_cache[b, n:] = float("nan")
    call = lambda: fa.flash_attn_func(q, k_cache, v_cache, causal=causal, seqused_k=used,
                                      num_splits=1, return_lse=True)  # (32 tiles: split-KV)
    assert ran_sm90(call)
    out, lse = call()
    ref, base = ref_and_base(lambda q, k, v: padded_attention(q, k, v, causal, used), (q, k, v))
    check_out_and_grads(out, None, ref, base, dtype)
    check_lse(lse, ref[1], dtype)
    check_varlen_sm90(dtype, head_dim, causal, [0, 1, 63, 200, 128], [5, 0, 63, 300, 257],
                      seqused_k=torch.tensor([5, 0, 1, 130, 257], dtype=torch.int32,
                                             device=DEVICE))


VARLEN_VARIANTS = {  # causal, window_size, softcap, ALiBi slopes
    "window": (False, (50, 10), 0.0, None),
    "causal_window": (True, (33, -1), 0.0, None),
    "softcap": (True, (-1, -1), 30.0, None),
    "alibi": (False, (-1, -1), 0.0, "batch"),
    "all_three": (False, (40, 8), 30.0, "batch"),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", list(VARLEN_VARIANTS))
def test_varlen_variants(sm90, dtype, head_dim, case):
    """Packed sequences with a window / softcap / ALiBi in the Hopper variant kernel (per
    sequence: bottom-right windows, [batch, heads] slopes), NaN past the packed rows."""
    causal, window, softcap, alibi = VARLEN_VARIANTS[case]
    lens_q, lens_k = [0, 1, 63, 200, 128, 77, 300], [5, 0, 63, 129, 300, 77, 257]
    _, out, _, rows = check_varlen_sm90(
        dtype, head_dim, causal, lens_q, lens_k, window_size=window, softcap=softcap,
        alibi_slopes=alibi_slopes(alibi, len(lens_q), 4, DEVICE))
    assert (out[rows:] == 0).all()


def paged_copy(k, used, page_size, seed):
    """k [B, S, Hk, D] as a shuffled page pool (NaN in every pool row that no sequence uses)
    and an int32 block table [B, max_pages] (entries past a sequence's pages: -1 or ids of
    NaN pages, which the kernel must never let through)."""
    batch, seqlen = k.shape[:2]
    max_pages = -(-seqlen // page_size)
    num_pages = batch * max_pages + 3
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(num_pages, generator=gen)[:batch * max_pages].view(batch, max_pages)
    pool = torch.full((num_pages, page_size) + tuple(k.shape[2:]), float("nan"), dtype=k.dtype,
                      device=k.device)
    for b, n in enumerate(used):
        for i in range(-(-n // page_size)):
            rows = min(page_size, n - i * page_size)
            pool[table[b, i], :rows] = k[b, i * page_size:i * page_size + rows]
        table[b, -(-n // page_size):] = -1 if b % 2 else table[b, -1].item()
    return pool, table.to(torch.int32).to(k.device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_paged_kv_cache(sm90, dtype, head_dim, causal, page_size):
    """A prefill chunk (150 queries) against a paged KV cache in the Hopper forward: shuffled
    pages, NaN in every unused pool row, table entries past a sequence -1 or naming NaN
    pages, cache_seqlens with an empty and a one-key sequence, GQA; page sizes below, equal
    to and above the key tile (16-row TMA boxes per page piece, or whole tiles)."""
    used = [333, 0, 129, 1]
    q = randn((4, 150, 4, head_dim), dtype, DEVICE, 1)
    k = randn((4, 333, 2, head_dim), dtype, DEVICE, 2)
    v = randn((4, 333, 2, head_dim), dtype, DEVICE, 3)
    k_pool, table = paged_copy(k, used, page_size, 4)
    v_pool, _ = paged_copy(v, used, page_size, 4)
    cache_seqlens = torch.tensor(used, dtype=torch.int32, device=DEVICE)
    call = lambda: fa.flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=cache_seqlens,
                                              block_table=table, causal=causal,
                                              return_softmax_lse=True)
    assert ran_sm90(call)
    out, lse = call()
    ref, base = ref_and_base(
        lambda q, k, v: padded_attention(q, k, v, causal, cache_seqlens), (q, k, v))
    check_out_and_grads(out, None, ref, base, dtype)
    check_lse(lse, ref[1], dtype)


@pytest.mark.parametrize("mode", ["paged", "batch_idx", "leftpad", "varlen_paged"])
def test_kv_cache_prefill_matches_mma(sm90, impl, mode):
    """Hopper vs mma.sync on the same KV-cache prefill calls: appending new keys across pages
    (paged), cache_batch_idx picking permuted cache rows, left-padded caches with softcap
    (keys from cache_leftpad on), packed queries against a paged cache (varlen + block_table)
    with a window and softcap; page sizes that are not a power of two stay on mma.sync."""
    dtype, D, page = torch.bfloat16, 128, 32
    q = randn((3, 70, 4, D), dtype, DEVICE, 5)
    new_k, new_v = randn((3, 70, 2, D), dtype, DEVICE, 6), randn((3, 70, 2, D), dtype, DEVICE, 7)
    lengths = torch.tensor([100, 0, 37], dtype=torch.int32, device=DEVICE)
    if mode == "batch_idx":
        k_cache = randn((5, 300, 2, D), dtype, DEVICE, 8)
        v_cache = randn((5, 300, 2, D), dtype, DEVICE, 9)
        idx = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE)
        kw = dict(cache_batch_idx=idx, k=new_k, v=new_v, cache_seqlens=lengths, causal=True)
    elif mode == "leftpad":
        k_cache = randn((3, 300, 2, D), dtype, DEVICE, 8)
        v_cache = randn((3, 300, 2, D), dtype, DEVICE, 9)
        pad = torch.tensor([5, 0, 30], dtype=torch.int32, device=DEVICE)
        kw = dict(cache_leftpad=pad, k=new_k, v=new_v, cache_seqlens=lengths, causal=True,
                  softcap=30.0)
    else:
        k_cache = randn((40, page, 2, D), dtype, DEVICE, 8)
        v_cache = randn((40, page, 2, D), dtype, DEVICE, 9)
        table = torch.randperm(40, generator=torch.Generator().manual_seed(1))[:30]
        table = table.view(3, 10).to(torch.int32).to(DEVICE)
        kw = dict(block_table=table, k=new_k, v=new_v, cache_seqlens=lengths, causal=True)

    def call():
        if mode != "varlen_paged":
            kc, vc = k_cache.clone(), v_cache.clone()  # the append writes into the cache
            return fa.flash_attn_with_kvcache(q, kc, vc, **kw)
        cu_q = torch.tensor([0, 70, 70, 140], dtype=torch.int32, device=DEVICE)
        cu_k = torch.tensor([0, 300, 301, 401], dtype=torch.int32, device=DEVICE)
        return fa.flash_attn_varlen_func(q[:2].reshape(140, 4, D), k_cache, v_cache, cu_q, cu_k,
                                         70, 300, causal=True, block_table=table,
                                         window_size=(90, 0), softcap=30.0)
    assert ran_sm90(call)
    out = call()
    impl("mma")
    ref = call()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=0)
    if mode == "paged":
        impl("auto")
        k_odd = k_cache[:36].reshape(24, 48, 2, D)  # 48-row pages: mma.sync
        v_odd = v_cache[:36].reshape(24, 48, 2, D)
        table_odd = table[:, :6].remainder(24).contiguous()
        assert not ran_sm90(lambda: fa.flash_attn_with_kvcache(
            q, k_odd.clone(), v_odd.clone(), cache_seqlens=lengths, block_table=table_odd))
