"""Dropout (dropout_p) and torch SDPA's attn_mask.

Dropout: the keep-mask definition (csrc/dropout.h: Philox-4x32-10, checked against an
independent numpy implementation and Random123's known answers) through the dropout_mask
operator; values and gradients of every entry point that takes dropout_p against the float64
reference (attention_ref with the call's own keep-mask, from return_attn_probs or from the
rng_state the call draws) with FlashAttention's accuracy rule (tests/helpers.py);
reproducibility under torch.manual_seed; the kept fraction. attn_mask: bool and additive
masks of every broadcast shape, strided views, with is_causal, GQA and dropout, rows left
without keys; against attention_ref and torch's own SDPA. Bad inputs, opcheck and
torch.compile. CPU always; CUDA marked gpu (skipped without one).
"""
import numpy as np
import pytest
import torch

import flash_attn_ext as fa
from flash_attn_ext.ops import FlashAttnFunction, new_rng_state
from flash_attn_ext.reference import dropout_keep_scale, dropout_threshold
from helpers import (OPCHECK_UTILS, alibi_slopes, assert_compiled_matches_eager, batch_entry,
                     check_lse, check_out_and_grads, gqa_attention, make_varlen,
                     opcheck_varlen_ops, randn, ref_and_base)

HEADS, KV_HEADS = 4, 2  # every attention test below is grouped-query

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

# ---- the keep-mask definition (csrc/dropout.h), independently in numpy ----------------------
_M32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Random123's Philox-4x32 with 10 rounds on numpy uint64 arrays holding 32-bit words
    (the 32 x 32 -> 64-bit products fit in uint64)."""
    c = [np.asarray(x, dtype=np.uint64) for x in (c0, c1, c2, c3)]
    k0, k1 = np.uint64(k0), np.uint64(k1)
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * c[0]
        p1 = np.uint64(0xCD9E8D57) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & _M32,
             (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & _M32]
        k0 = (k0 + np.uint64(0x9E3779B9)) & _M32
        k1 = (k1 + np.uint64(0xBB67AE85)) & _M32
    return c


def keep_mask_spec(seed, offset, batch, heads, seqlen_q, seqlen_k, dropout_p):
    """The documented keep-mask: counter = {(j/16)*32 + (j%8)*4 + (i/2)%4, i/32, b*heads+h,
    offset_lo}, key = {seed_lo, seed_hi}; element (i, j) = byte 8*((j/8)%2) + 2*((i/8)%4) + i%2
    of the 16 (little-endian words); kept iff >= dropout_threshold(p) (round(p * 256), 1..255).
    Seeds and offsets are int64 (two's complement)."""
    threshold = dropout_threshold(dropout_p)
    shape = (batch, heads, seqlen_q, seqlen_k)
    if threshold == 0:
        return np.ones(shape, dtype=bool)
    seed_u = seed & 0xFFFFFFFFFFFFFFFF
    bh, i, j = np.meshgrid(np.arange(batch * heads, dtype=np.uint64),
                           np.arange(seqlen_q, dtype=np.uint64),
                           np.arange(seqlen_k, dtype=np.uint64), indexing="ij")
    u = np.uint64
    group = (j // u(16)) * u(32) + (j % u(8)) * u(4) + (i // u(2)) % u(4)
    words = philox4x32_10(group, i // u(32), bh, np.full_like(j, offset & 0xFFFFFFFF),
                          seed_u & 0xFFFFFFFF, seed_u >> 32)
    byte = call_byte(i, j)
    word = np.choose((byte // u(4)).astype(np.int64), words)
    number = (word >> (u(8) * (byte % u(4)))) & u(0xFF)
    return (number >= threshold).reshape(shape)


def call_byte(i, j):
    """Element (i, j)'s byte in its Philox call group (csrc/dropout.h)."""
    u = np.uint64
    return u(8) * ((j // u(8)) % u(2)) + u(2) * ((i // u(8)) % u(4)) + i % u(2)


def test_philox_known_answers():
    """Random123's known-answer vectors (kat_vectors) for philox4x32_10."""
    f = 0xFFFFFFFF
    for ctr, key, expected in [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((f, f, f, f), (f, f), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]:
        assert tuple(int(w) for w in philox4x32_10(*ctr, *key)) == expected


MASK_CASES = [  # (seed, offset, batch, heads, seqlen_q, seqlen_k, dropout_p)
    (0, 0, 1, 1, 3, 45, 0.5),
    (12345, 7, 2, 3, 5, 77, 0.1),
    (-1, 2 ** 32 + 5, 2, 2, 4, 45, 0.9),  # negative seed; offset's high word is not used
    (-(2 ** 63), -3, 1, 3, 2, 130, 0.3),
    (0x0123456789ABCDEF, 2 ** 31 + 1, 3, 1, 7, 33, 0.25),
    (2 ** 63 - 1, 0, 1, 2, 1, 1, 0.6),
    (99, 1, 2, 2, 3, 64, 0.99999),  # threshold clamps at 255
    (5, 5, 1, 2, 3, 45, 1e-6),  # p > 0 drops at least 1/256 (threshold 1)
    (5, 5, 1, 2, 3, 45, 0.0),  # everything is kept
    (7, 9, 1, 2, 75, 37, 0.5),  # several 32-query blocks, odd lengths
    (5, 5, 1, 2, 0, 45, 0.5),  # empty
    (5, 5, 1, 2, 3, 0, 0.5),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", MASK_CASES, ids=str)
def test_dropout_mask_matches_spec(case, device):
    seed, offset, batch, heads, seqlen_q, seqlen_k, p = case
    rng_state = torch.tensor([seed, offset], dtype=torch.int64, device=device)
    mask = torch.ops.flash_attn_ext.dropout_mask(rng_state, batch, heads, seqlen_q, seqlen_k, p)
    assert mask.dtype == torch.bool and mask.device == rng_state.device
    assert mask.shape == (batch, heads, seqlen_q, seqlen_k)
    expected = keep_mask_spec(seed, offset, batch, heads, seqlen_q, seqlen_k, p)
    assert np.array_equal(mask.cpu().numpy(), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_mask_seed_and_offset_matter(device):
    """Each key / counter word changes the mask; the mask of (b, h) is that of b * heads + h."""
    def mask(seed, offset, batch=2, heads=3):
        rng = torch.tensor([seed, offset], dtype=torch.int64, device=device)
        return torch.ops.flash_attn_ext.dropout_mask(rng, batch, heads, 16, 45, 0.5)

    base = mask(1, 0)
    for other in (mask(2, 0), mask(1 + 2 ** 32, 0), mask(1, 1)):
        assert not torch.equal(base, other)
    assert torch.equal(mask(1, 2 ** 32), base)  # the offset's high word is not used
    assert torch.equal(mask(1, 0, batch=1, heads=6).view(2, 3, 16, 45), base)
    assert not torch.equal(base[0, 0], base[0, 1]) and not torch.equal(base[0, 0], base[1, 0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction(p, device):
    """~1e6 elements: the kept fraction within 5 sigma of 1 - threshold / 256, overall and
    for each of the 16 bytes of a Philox call group."""
    rng = torch.tensor([20240601, 3], dtype=torch.int64, device=device)
    seqlen_q, seqlen_k = 320, 416
    mask = torch.ops.flash_attn_ext.dropout_mask(rng, 2, 4, seqlen_q, seqlen_k, p).cpu().numpy()
    keep_p = 1.0 - dropout_threshold(p) / 256.0
    n = mask.size
    sigma = (keep_p * (1 - keep_p) / n) ** 0.5
    assert abs(mask.mean() - keep_p) < 5 * sigma
    i, j = np.meshgrid(np.arange(seqlen_q, dtype=np.uint64), np.arange(seqlen_k, dtype=np.uint64),
                       indexing="ij")
    byte = np.broadcast_to(call_byte(i, j), mask.shape)
    sigma_byte = (keep_p * (1 - keep_p) / (n // 16)) ** 0.5
    for b in range(16):
        assert abs(mask[byte == b].mean() - keep_p) < 5 * sigma_byte


def test_dropout_keep_scale():
    assert dropout_keep_scale(0.0) == 1.0
    assert dropout_keep_scale(0.5) == 2.0
    assert dropout_keep_scale(0.1) == 256.0 / (256 - 26)
    assert dropout_keep_scale(1e-6) == 256.0 / 255
    assert dropout_keep_scale(0.99999999) == 256.0


# ---- dropout: values and gradients against the reference --------------------------------------
def _peek_rng_state(device):
    """The rng_state that the next dropout call on `device` draws (torch's generator is left
    as it was)."""
    cuda = torch.device(device).type == "cuda"
    state = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()
    rng_state = new_rng_state(device)
    if cuda:
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)
    return rng_state


def _slopes(kind, batch=2, heads=HEADS, device="cpu"):
    return alibi_slopes(kind, batch, heads, device)


# (causal, window_size, softcap, alibi kind, dropout_p)
DROPOUT_CASES = {
    "p0.17": (False, (-1, -1), 0.0, None, 0.17),
    "causal_p0.3": (True, (-1, -1), 0.0, None, 0.3),
    "p0.9": (False, (-1, -1), 0.0, None, 0.9),
    "causal_p0.05": (True, (-1, -1), 0.0, None, 0.05),
    "window_p0.2": (False, (20, 5), 0.0, None, 0.2),
    "softcap_alibi_p0.4": (False, (-1, -1), 5.0, "batch", 0.4),
    "all_causal_p0.25": (True, (40, -1), 3.0, "head", 0.25),
}


def _dropout_variant(case, batch=2, device="cpu"):
    causal, window, softcap, alibi, p = DROPOUT_CASES[case]
    return causal, p, dict(window_size=window, softcap=softcap,
                           alibi_slopes=_slopes(alibi, batch, device=device))


SHAPES = [(113, 300), (300, 113), (77, 77), (1, 45)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FUNC_PARAMS = [  # every case meets two dtypes and two shapes
    (case, DTYPES[(i + n) % 3], *SHAPES[(i + n) % len(SHAPES)])
    for i, case in enumerate(DROPOUT_CASES) for n in range(2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case,dtype,seqlen_q,seqlen_k", FUNC_PARAMS, ids=str)
def test_flash_attn_func_dropout(case, dtype, seqlen_q, seqlen_k, device, head_dim=32,
                                 deterministic=False):
    """flash_attn_func (bottom-right causal) with its keep-mask from return_attn_probs, which
    must be the mask of the rng_state the call drew. The backward regenerates the mask: the
    gradients check that it is the forward's. lse is that before dropout."""
    batch = 2
    causal, p, variant = _dropout_variant(case, device=device)
    q = randn((batch, seqlen_q, HEADS, head_dim), dtype, device, 1, True)
    k = randn((batch, seqlen_k, KV_HEADS, head_dim), dtype, device, 2, True)
    v = randn((batch, seqlen_k, KV_HEADS, head_dim), dtype, device, 3, True)
    rng_state = _peek_rng_state(device)
    out, lse, keep = fa.flash_attn_func(q, k, v, dropout_p=p, causal=causal,
                                        deterministic=deterministic, return_attn_probs=True,
                                        **variant)
    assert keep.dtype == torch.bool and keep.shape == (batch, HEADS, seqlen_q, seqlen_k)
    assert torch.equal(keep, torch.ops.flash_attn_ext.dropout_mask(
        rng_state, batch, HEADS, seqlen_q, seqlen_k, p))
    dout = randn(out.shape, dtype, device, 4)
    ref, base = ref_and_base(lambda q, k, v: gqa_attention(
        q, k, v, causal, dropout_p=p, dropout_mask=keep, **variant), (q, k, v), dout)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_out_and_grads(out, grads, ref, base, dtype, grad_atol=1e-5 * max(1, head_dim // 64))
    check_lse(lse, ref[1], dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_keep_mask_exact(dtype, device):
    """Exactly the returned mask, forward and backward: with one-hot values (v[j] = e_j) out
    is the dropped-out probabilities themselves, zero exactly where dropped; with one-hot
    dout (dout[i] = e_i) dv is their transpose summed over the query heads of a kv head."""
    b, sq, sk, d = 2, 40, 45, 64
    q = randn((b, sq, HEADS, d), dtype, device, 1, True)
    k = randn((b, sk, KV_HEADS, d), dtype, device, 2, True)
    v = torch.eye(sk, d, dtype=dtype, device=device).view(1, sk, 1, d).expand(
        b, sk, KV_HEADS, d).contiguous().requires_grad_()
    out, _, keep = fa.flash_attn_func(q, k, v, dropout_p=0.4, softmax_scale=0.05,
                                      return_attn_probs=True)
    assert torch.equal(out[..., :sk].permute(0, 2, 1, 3) != 0, keep)
    assert (out[..., sk:] == 0).all()
    assert 0.37 < 1 - keep.float().mean().item() < 0.43
    dout = torch.eye(sq, d, dtype=dtype, device=device).view(1, sq, 1, d).expand(
        b, sq, HEADS, d)
    dv, = torch.autograd.grad(out, (v,), dout)
    kept_by_group = keep.view(b, KV_HEADS, HEADS // KV_HEADS, sq, sk).any(2)
    assert torch.equal(dv[..., :sq].permute(0, 2, 3, 1) != 0, kept_by_group)


def test_deterministic_dropout():
    """deterministic=True with dropout: right, and bit-identical when repeated."""
    test_flash_attn_func_dropout("all_causal_p0.25", torch.bfloat16, 300, 113, "cpu",
                                 deterministic=True)
    q, k, v = (randn((2, n, h, 32), torch.float16, "cpu", s, True)
               for n, h, s in ((70, HEADS, 1), (90, KV_HEADS, 2), (90, KV_HEADS, 3)))

    def run():
        torch.manual_seed(11)
        out = fa.flash_attn_func(q, k, v, dropout_p=0.3, causal=True, deterministic=True)
        return (out, *torch.autograd.grad(out, (q, k, v), out))

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal,dtype,seqlen_q,seqlen_k,p", [
    (True, torch.float32, 70, 45, 0.3),
    (True, torch.bfloat16, 45, 300, 0.5),
    (False, torch.float16, 113, 113, 0.1),
    (False, torch.float32, 1, 77, 0.6),
], ids=str)
def test_sdpa_dropout(causal, dtype, seqlen_q, seqlen_k, p, device, head_dim=32):
    """The SDPA entry (layout [B, H, S, D], top-left causal) draws its mask like the others."""
    q = randn((2, HEADS, seqlen_q, head_dim), dtype, device, 1, True)
    k = randn((2, KV_HEADS, seqlen_k, head_dim), dtype, device, 2, True)
    v = randn((2, KV_HEADS, seqlen_k, head_dim), dtype, device, 3, True)
    rng_state = _peek_rng_state(device)
    out = fa.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal,
                                          enable_gqa=True)
    keep = torch.ops.flash_attn_ext.dropout_mask(rng_state, 2, HEADS, seqlen_q, seqlen_k, p)
    dout = randn(out.shape, dtype, device, 4)
    ref, base = ref_and_base(lambda q, k, v: gqa_attention(
        q, k, v, causal, bottom_right=False, layout="bhsd", dropout_p=p, dropout_mask=keep),
        (q, k, v), dout)
    check_out_and_grads(out, torch.autograd.grad(out, (q, k, v), dout), ref, base, dtype,
                        grad_atol=1e-5 * max(1, head_dim // 64))


def _per_sequence_ref(q, k, v, cu_q, cu_k, causal, keep, p, seqused_k=None, **variant):
    """Packed [total, H, D] attention, sequence b with keep[b, :, :len_q, :len_k] (rows and
    keys numbered within the sequence). Returns (out, lse [H, cu_q[-1]])."""
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    used = None if seqused_k is None else seqused_k.tolist()
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        k_end = cu_k[b + 1] if used is None else cu_k[b] + min(used[b], cu_k[b + 1] - cu_k[b])
        var_b = batch_entry(variant, b)
        o, l = gqa_attention(q[cu_q[b]:cu_q[b + 1]].unsqueeze(0), k[cu_k[b]:k_end].unsqueeze(0),
                             v[cu_k[b]:k_end].unsqueeze(0), causal, dropout_p=p,
                             dropout_mask=keep[b:b + 1], **var_b)
        outs.append(o[0])
        lses.append(l[0])
    outs.append(q.new_zeros((q.shape[0] - cu_q[-1], q.shape[1], v.shape[-1])))
    return torch.cat(outs), torch.cat(lses, dim=-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case,dtype,with_seqused_k", [
    ("p0.17", torch.float32, False),
    ("causal_p0.3", torch.bfloat16, True),
    ("all_causal_p0.25", torch.float16, False),
    ("softcap_alibi_p0.4", torch.float32, True),
], ids=str)
def test_varlen_dropout(case, dtype, with_seqused_k, device, head_dim=32):
    lens_q, lens_k = [7, 0, 130, 300, 1], [300, 5, 130, 77, 0]
    causal, p, variant = _dropout_variant(case, batch=len(lens_q), device=device)
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, HEADS, KV_HEADS, head_dim,
                                                    dtype, device, pad_q=3, pad_k=2)
    used = (torch.tensor([250, 5, 64, 77, 0], dtype=torch.int32, device=device)
            if with_seqused_k else None)
    rng_state = _peek_rng_state(device)
    out, lse, keep = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=p,
                                               causal=causal, seqused_k=used,
                                               return_attn_probs=True, **variant)
    assert keep.shape == (len(lens_q), HEADS, max_q, max_k)
    assert torch.equal(keep, torch.ops.flash_attn_ext.dropout_mask(
        rng_state, len(lens_q), HEADS, max_q, max_k, p))
    dout = randn(out.shape, dtype, device, 9)
    ref, base = ref_and_base(lambda q, k, v: _per_sequence_ref(
        q, k, v, cu_q, cu_k, causal, keep, p, used, **variant), (q, k, v), dout)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_out_and_grads(out, grads, ref, base, dtype, grad_atol=1e-5 * max(1, head_dim // 64))
    check_lse(lse[:, :int(cu_q[-1])], ref[1], dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_seqused_k_dropout(device):
    """Padded batch with seqused_k: keys numbered from 0 in every batch entry."""
    dtype = torch.float32 if device == "cpu" else torch.float16
    q = randn((2, 37, HEADS, 32), dtype, device, 1, True)
    k = randn((2, 90, KV_HEADS, 32), dtype, device, 2, True)
    v = randn((2, 90, KV_HEADS, 32), dtype, device, 3, True)
    used = torch.tensor([61, 20], dtype=torch.int32, device=device)
    out, lse, keep = fa.flash_attn_func(q, k, v, dropout_p=0.35, causal=True, seqused_k=used,
                                        return_attn_probs=True)
    dout = randn(out.shape, dtype, device, 4)
    cu = torch.tensor([0, 37, 74], dtype=torch.int32)
    cu_k = torch.tensor([0, 90, 180], dtype=torch.int32)

    def ref_fn(q, k, v):
        o, l = _per_sequence_ref(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu_k,
                                 True, keep, 0.35, used.cpu())
        return o.view(q.shape), l.view(HEADS, 2, 37).transpose(0, 1)

    ref, base = ref_and_base(ref_fn, (q, k, v), dout)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_out_and_grads(out, grads, ref, base, dtype)
    check_lse(lse, ref[1], dtype)
    assert torch.equal(grads[1][1, 20:], torch.zeros_like(k[1, 20:]))


def test_operator_dropout_top_left():
    """FlashAttnFunction with an explicit rng_state (a negative seed) and top-left causal:
    the mask of that rng_state, and the same result every time."""
    q = randn((2, 70, HEADS, 16), torch.float32, "cpu", 1, True)
    k = randn((2, 45, KV_HEADS, 16), torch.float32, "cpu", 2, True)
    v = randn((2, 45, KV_HEADS, 16), torch.float32, "cpu", 3, True)
    rng_state = torch.tensor([-987654321987, 42], dtype=torch.int64)
    args = (q, k, v, 0.25, True, False, False, 0, 0, None, 9, -1, 0.0, None, 0.45, rng_state)
    out, lse = FlashAttnFunction.apply(*args)
    assert torch.equal(out, FlashAttnFunction.apply(*args)[0])
    keep = torch.from_numpy(keep_mask_spec(-987654321987, 42, 2, HEADS, 70, 45, 0.45))
    dout = randn(out.shape, torch.float32, "cpu", 4)
    ref, base = ref_and_base(lambda q, k, v: gqa_attention(
        q, k, v, True, bottom_right=False, scale=0.25, window_size=(9, -1), dropout_p=0.45,
        dropout_mask=keep), (q, k, v), dout)
    check_out_and_grads(out, torch.autograd.grad(out, (q, k, v), dout), ref, base,
                        torch.float32)
    check_lse(lse, ref[1], torch.float32)


# ---- reproducibility, p = 0 --------------------------------------------------------------------
def _run_dropout(q, k, v, dout, seed=None, p=0.3, **kwargs):
    if seed is not None:
        torch.manual_seed(seed)
    out = fa.flash_attn_func(q, k, v, dropout_p=p, **kwargs)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.parametrize("device", DEVICES)
def test_reproducible(device):
    """Same torch.manual_seed: bit-identical out and grads; another seed, or a second call
    without reseeding, draws another mask."""
    dtype = torch.bfloat16
    q, k, v = (randn((2, n, h, 64), dtype, device, s, True)
               for n, h, s in ((77, HEADS, 1), (130, KV_HEADS, 2), (130, KV_HEADS, 3)))
    dout = randn(q.shape, dtype, device, 4)
    first = _run_dropout(q, k, v, dout, seed=1, causal=True)
    again = _run_dropout(q, k, v, dout, seed=1, causal=True)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    other = _run_dropout(q, k, v, dout, seed=2, causal=True)
    unseeded = _run_dropout(q, k, v, dout, causal=True)  # continues seed 2's generator
    for t in (other, unseeded):
        for a, b in zip(first, t):
            assert not torch.equal(a, b)
    assert not torch.equal(other[0], unseeded[0])
    # the SDPA and varlen entries draw from the same generator
    torch.manual_seed(5)
    s1 = fa.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), dropout_p=0.2, enable_gqa=True)
    torch.manual_seed(5)
    s2 = fa.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), dropout_p=0.2, enable_gqa=True)
    assert torch.equal(s1, s2)


@pytest.mark.parametrize("device", DEVICES)
def test_no_dropout(device):
    """p = 0 draws no rng_state and is the plain call, bit for bit, with return_attn_probs'
    mask None; a tiny p > 0 still drops (1/256 of the elements, as flash-attn); dropout does
    not change lse."""
    q, k, v = (randn((2, n, h, 32), torch.float16, device, s, True)
               for n, h, s in ((50, HEADS, 1), (77, KV_HEADS, 2), (77, KV_HEADS, 3)))
    dout = randn(q.shape, torch.float16, device, 4)
    cuda = device == "cuda"
    get_state = (lambda: torch.cuda.get_rng_state()) if cuda else torch.get_rng_state
    plain = fa.flash_attn_func(q, k, v, causal=True)
    plain_grads = torch.autograd.grad(plain, (q, k, v), dout)
    before = get_state()
    zero = _run_dropout(q, k, v, dout, p=0.0, causal=True)
    res = fa.flash_attn_func(q, k, v, dropout_p=0, causal=True, return_attn_probs=True)
    sdpa = fa.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), dropout_p=0.0, is_causal=True,
                                           enable_gqa=True)
    assert torch.equal(get_state(), before)
    assert res[2] is None
    for a, b in zip(zero, (plain, *plain_grads)):
        assert torch.equal(a, b)
    assert torch.equal(res[0], plain)
    tiny = _run_dropout(q, k, v, dout, p=1e-6, causal=True)  # threshold 1: drops 1/256
    assert not torch.equal(get_state(), before)  # p > 0 draws
    assert not torch.equal(tiny[0], plain)
    _, lse_plain = fa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    _, lse_drop = fa.flash_attn_func(q, k, v, causal=True, dropout_p=0.5, return_lse=True)
    # CPU: the same arithmetic; CUDA: dropout runs the variant kernels
    tol = dict(atol=0, rtol=1e-6) if device == "cpu" else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_drop, lse_plain, **tol)
    assert torch.equal(sdpa, fa.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
        enable_gqa=True))


# ---- attn_mask -----------------------------------------------------------------------------------
B = 2


def _mask(kind, shape, seqlen_q, seqlen_k, dtype, device, seed=5, first_key=True):
    """kind 'bool' (True = attend, ~25% masked), 'add' (additive, with some -inf), 'add_finite'
    (additive, finite); shape one of the names below. first_key: key 0 is never masked (so
    every row sees a key, top-left causal or not), unless the mask has one key column."""
    full = {"sq_sk": (seqlen_q, seqlen_k), "11_sq_sk": (1, 1, seqlen_q, seqlen_k),
            "b11_sk": (B, 1, 1, seqlen_k), "bh_sq_sk": (B, HEADS, seqlen_q, seqlen_k),
            "1h_sq1": (1, HEADS, seqlen_q, 1), "h_sq_sk": (HEADS, seqlen_q, seqlen_k),
            "b1_sq_sk": (B, 1, seqlen_q, seqlen_k),
            "sk": (seqlen_k,)}[shape]
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(full, generator=gen)
    if first_key and full[-1] > 1:
        u[..., 0] = 1.0
    if kind == "bool":
        m = u > 0.25
        if shape == "b11_sk":  # key padding: batch 1 sees its first 20 keys only
            m = torch.ones(full, dtype=torch.bool)
            m[1, ..., 20:] = False
        return m.to(device)
    add = (torch.randn(full, generator=gen) * 2).to(dtype)
    if kind == "add":
        add = add.masked_fill(u < 0.2, float("-inf"))
    return add.to(device)


def _sdpa_ref(q, k, v, causal, mask, dropout=None, scale=None):
    p, keep = dropout if dropout is not None else (0.0, None)
    return gqa_attention(q, k, v, causal, bottom_right=False, layout="bhsd", scale=scale,
                         attn_mask=mask, dropout_p=p, dropout_mask=keep)


def _check_sdpa_mask(q, k, v, mask, causal, dtype, scale=None, dropout_p=0.0,
                     torch_compare=True):
    """Ours vs attention_ref (values, gradients; rows without keys: zeros, zero dq) and, on
    rows that see a key, vs torch's SDPA."""
    device = q.device
    rng_state = _peek_rng_state(device) if dropout_p > 0 else None
    out = fa.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          scale=scale, dropout_p=dropout_p,
                                          enable_gqa=k.shape[1] != q.shape[1])
    assert out.shape == q.shape and out.dtype == dtype
    dropout = None
    if dropout_p > 0:
        keep = torch.ops.flash_attn_ext.dropout_mask(rng_state, q.shape[0], q.shape[1],
                                                     q.shape[2], k.shape[2], dropout_p)
        dropout = (dropout_p, keep)
    dout = randn(out.shape, dtype, device, 4)
    ref, base = ref_and_base(lambda q, k, v: _sdpa_ref(q, k, v, causal, mask, dropout, scale),
                             (q, k, v), dout)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_out_and_grads(out, grads, ref, base, dtype,
                        grad_atol=1e-5 * max(1, q.shape[-1] // 64))
    seen = torch.isfinite(ref[1])  # [B, H, Sq]: rows that see some key
    assert torch.equal(out[~seen], torch.zeros_like(out[~seen]))
    assert torch.equal(grads[0][~seen], torch.zeros_like(grads[0][~seen]))
    if torch_compare and dropout_p == 0 and seen.any():
        # torch in float32 (its additive masks must have q's dtype), full-size mask (it
        # takes no 1-D one) with causal folded in (it takes no mask with is_causal)
        sq, sk = q.shape[2], k.shape[2]
        torch_mask = mask.expand(q.shape[0], q.shape[1], sq, sk)
        if torch_mask.dtype != torch.bool:
            torch_mask = torch_mask.float()
        if causal:
            above = torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)
            torch_mask = (torch_mask & ~above if torch_mask.dtype == torch.bool
                          else torch_mask.masked_fill(above, float("-inf")))
        expected = torch.nn.functional.scaled_dot_product_attention(
            q.detach().float(), k.detach().float(), v.detach().float(), attn_mask=torch_mask,
            scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(out.detach()[seen].float(), expected[seen], **tol)
    return out, grads, seen


def _sdpa_inputs(seqlen_q, seqlen_k, dtype, device, head_dim=32, kv_heads=KV_HEADS):
    q = randn((B, HEADS, seqlen_q, head_dim), dtype, device, 1, True)
    k = randn((B, kv_heads, seqlen_k, head_dim), dtype, device, 2, True)
    v = randn((B, kv_heads, seqlen_k, head_dim), dtype, device, 3, True)
    return q, k, v


MASK_PARAMS = [  # (kind, shape, mask dtype, q dtype, causal, seqlen_q, seqlen_k)
    ("bool", "sq_sk", None, torch.float32, False, 113, 300),
    ("bool", "11_sq_sk", None, torch.bfloat16, True, 300, 113),
    ("bool", "b11_sk", None, torch.float32, False, 70, 45),
    ("bool", "b11_sk", None, torch.float16, True, 45, 70),
    ("bool", "bh_sq_sk", None, torch.float32, True, 77, 77),
    ("bool", "1h_sq1", None, torch.float32, False, 37, 45),
    ("bool", "h_sq_sk", None, torch.float16, False, 1, 77),
    ("bool", "sk", None, torch.bfloat16, False, 33, 300),
    ("add", "sq_sk", torch.float32, torch.float32, True, 113, 300),
    ("add", "bh_sq_sk", torch.float32, torch.bfloat16, False, 77, 77),
    ("add_finite", "11_sq_sk", torch.bfloat16, torch.float32, False, 45, 70),
    ("add_finite", "b11_sk", torch.float16, torch.float32, True, 70, 45),
    ("add_finite", "bh_sq_sk", torch.float16, torch.float16, True, 113, 300),
    ("add_finite", "1h_sq1", torch.float32, torch.float32, False, 37, 45),
    ("add_finite", "sq_sk", "q", torch.bfloat16, True, 300, 113),
    ("add_finite", "h_sq_sk", "q", torch.float16, False, 77, 1),
    ("add", "b1_sq_sk", torch.float32, torch.float32, True, 45, 70),
]


def _mask_params(device):
    out = []
    for kind, shape, mdtype, dtype, causal, sq, sk in MASK_PARAMS:
        out.append(pytest.param(kind, shape, mdtype, dtype, causal, sq, sk,
                                id=f"{kind}-{shape}-{mdtype}-{dtype}-{causal}-{sq}-{sk}"))
    return out


@pytest.mark.parametrize("kind,shape,mask_dtype,dtype,causal,seqlen_q,seqlen_k",
                         _mask_params("cpu"))
def test_sdpa_attn_mask(kind, shape, mask_dtype, dtype, causal, seqlen_q, seqlen_k,
                        device="cpu", head_dim=32):
    """Every broadcast shape, bool and additive (float32 / bf16 / fp16 / q's dtype, with -inf
    entries or finite), with and without top-left causal, Sq < Sk and Sq > Sk, GQA."""
    q, k, v = _sdpa_inputs(seqlen_q, seqlen_k, dtype, device, head_dim)
    mdtype = dtype if mask_dtype == "q" else mask_dtype
    mask = _mask(kind, shape, seqlen_q, seqlen_k, mdtype, device)
    _check_sdpa_mask(q, k, v, mask, causal, dtype)


@pytest.mark.parametrize("layout", ["transposed", "row_sliced", "col_stepped", "expanded",
                                    "expanded_last", "channels_last"])
def test_sdpa_attn_mask_strided(layout, device="cpu", dtype=torch.float32, head_dim=32):
    """Views, all read in place through their strides (nothing is copied): a transposed mask,
    a row slice (row stride > Sk), every other key, broadcasts by expand (stride 0, also
    along the keys), a permuted-memory mask; the same results as the contiguous mask."""
    sq, sk = 70, 45
    q, k, v = _sdpa_inputs(sq, sk, dtype, device, head_dim)
    gen = torch.Generator().manual_seed(3)
    if layout == "transposed":
        mask = (torch.randn(sk, sq, generator=gen) * 2).to(device).t()
    elif layout == "row_sliced":
        mask = (torch.rand(B, HEADS, sq, sk + 9, generator=gen) > 0.3).to(device)[..., 4:4 + sk]
    elif layout == "col_stepped":
        mask = (torch.randn(1, HEADS, sq, 2 * sk, generator=gen)).to(device)[..., ::2]
    elif layout == "expanded":
        mask = (torch.rand(sq, sk, generator=gen) > 0.3).to(device).expand(B, HEADS, sq, sk)
    elif layout == "expanded_last":
        mask = torch.randn(B, 1, sq, 1, generator=gen).to(device).expand(B, HEADS, sq, sk)
    else:
        mask = torch.randn(B, sq, sk, HEADS, generator=gen).to(device).permute(0, 3, 1, 2)
    assert not mask.is_contiguous()
    causal = mask.dtype != torch.bool  # (a random bool mask could leave row 0 without keys)
    out, grads, _ = _check_sdpa_mask(q, k, v, mask, causal, dtype)
    out2 = fa.scaled_dot_product_attention(q, k, v, attn_mask=mask.contiguous(),
                                           is_causal=causal, enable_gqa=True)
    torch.testing.assert_close(out, out2, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,causal,p", [("bool", True, 0.3), ("add_finite", False, 0.6),
                                           ("add", True, 0.1)], ids=str)
def test_sdpa_attn_mask_with_dropout(kind, causal, p, device):
    dtype, head_dim = (torch.float32, 32) if device == "cpu" else (torch.bfloat16, 64)
    q, k, v = _sdpa_inputs(77, 130, dtype, device, head_dim)
    mask = _mask(kind, "bh_sq_sk", 77, 130, torch.float32, device)
    _check_sdpa_mask(q, k, v, mask, causal, dtype, dropout_p=p)


@pytest.mark.parametrize("device", ["cpu",
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kind", ["bool", "add"])
def test_sdpa_fully_masked_rows(kind, device):
    """Rows that the mask leaves without any key (alone, or with causal, or a first key tile
    all masked): zeros and no NaN anywhere, zero dq there, finite gradients elsewhere."""
    dtype, head_dim = (torch.float32, 32) if device == "cpu" else (torch.float16, 64)
    sq, sk = 40, 300
    q, k, v = _sdpa_inputs(sq, sk, dtype, device, head_dim)
    allowed = torch.ones(B, HEADS, sq, sk, dtype=torch.bool)
    allowed[:, :, 3] = False  # no key at all
    allowed[0, 1, 7] = False
    allowed[1, :, 9, :280] = False  # only keys past the first CPU tile (256 keys)
    allowed[:, :, 12, 1:] = False  # key 0 only
    allowed[:, :, 2, 5:] = False  # keys 0..4; with causal, 0..2
    allowed[1, 2, 2, :3] = False  # ... here keys 3, 4; with causal, none
    mask = allowed if kind == "bool" else torch.zeros(allowed.shape).masked_fill(
        ~allowed, float("-inf"))
    mask = mask.to(device)
    for causal in (False, True):
        out, grads, seen = _check_sdpa_mask(q, k, v, mask, causal, dtype, torch_compare=True)
        assert not seen[:, :, 3].any() and not seen[0, 1, 7] and seen[:, :, 12].all()
        assert seen[1, :, 9].all().item() == (not causal)  # causal: keys 0..9 only
        assert seen[1, 2, 2].item() == (not causal)
        for g in grads:
            assert torch.isfinite(g).all()


# ---- bad inputs ---------------------------------------------------------------------------
def _small(device="cpu", layout="bshd"):
    shape = (lambda n, h: (2, n, h, 16)) if layout == "bshd" else (lambda n, h: (2, h, n, 16))
    return [randn(shape(n, h), torch.float32, device, s)
            for n, h, s in ((8, HEADS, 1), (9, KV_HEADS, 2), (9, KV_HEADS, 3))]


@pytest.mark.parametrize("p,exc", [(-0.1, ValueError), (1.0, ValueError), (1.5, ValueError),
                                   (float("nan"), ValueError), (float("inf"), ValueError),
                                   ("0.1", TypeError), (True, TypeError), (None, TypeError),
                                   (torch.tensor(0.1), TypeError)], ids=str)
def test_bad_dropout_p(p, exc):
    q, k, v = _small()
    with pytest.raises(exc, match="dropout_p"):
        fa.flash_attn_func(q, k, v, dropout_p=p)
    qs, ks, vs = _small(layout="bhsd")
    with pytest.raises(exc, match="dropout_p"):
        fa.scaled_dot_product_attention(qs, ks, vs, dropout_p=p, enable_gqa=True)
    qv, kv, vv, cu_q, cu_k, mq, mk = make_varlen([3, 4], [5, 6], HEADS, KV_HEADS, 16,
                                                 torch.float32, "cpu")
    with pytest.raises(exc, match="dropout_p"):
        fa.flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, mq, mk, dropout_p=p)


def test_integer_dropout_p_accepted():
    """0 and numpy floats are Real: accepted like floats."""
    q, k, v = _small()
    assert torch.equal(fa.flash_attn_func(q, k, v, dropout_p=0), fa.flash_attn_func(q, k, v))
    torch.manual_seed(0)
    a = fa.flash_attn_func(q, k, v, dropout_p=np.float64(0.25))
    torch.manual_seed(0)
    assert torch.equal(a, fa.flash_attn_func(q, k, v, dropout_p=0.25))


@pytest.mark.parametrize("make_mask,exc,match", [
    (lambda sq, sk: torch.ones(sq, sk + 1, dtype=torch.bool), RuntimeError, "broadcastable"),
    (lambda sq, sk: torch.ones(sq + 1, sk, dtype=torch.bool), RuntimeError, "broadcastable"),
    (lambda sq, sk: torch.ones(3, 1, sq, sk, dtype=torch.bool), RuntimeError, "broadcastable"),
    (lambda sq, sk: torch.ones(1, KV_HEADS, sq, sk), RuntimeError, "broadcastable"),
    (lambda sq, sk: torch.ones(1, 1, 1, sq, sk), RuntimeError, "broadcastable"),
    pytest.param(lambda sq, sk: torch.ones((), dtype=torch.bool), RuntimeError,
                 "broadcastable", id="0-dim"),
    (lambda sq, sk: torch.ones(sq, sk, dtype=torch.int32), RuntimeError, "attn_mask.*bool"),
    (lambda sq, sk: torch.ones(sq, sk, dtype=torch.uint8), RuntimeError, "attn_mask.*bool"),
    (lambda sq, sk: torch.ones(sq, sk, dtype=torch.float64), RuntimeError, "attn_mask.*bool"),
    (lambda sq, sk: [[True] * sk] * sq, TypeError, "attn_mask"),
    (lambda sq, sk: torch.zeros(sq, sk, requires_grad=True), NotImplementedError, "attn_mask"),
])
def test_bad_attn_mask(make_mask, exc, match):
    q, k, v = _small(layout="bhsd")
    with pytest.raises(exc, match=match):
        fa.scaled_dot_product_attention(q, k, v, attn_mask=make_mask(8, 9), enable_gqa=True)


def test_attn_mask_requiring_grad_under_no_grad():
    """No gradient is asked for: the mask is just read."""
    q, k, v = _small(layout="bhsd")
    mask = torch.randn(8, 9, requires_grad=True)
    with torch.no_grad():
        out = fa.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    expected = fa.scaled_dot_product_attention(q, k, v, attn_mask=mask.detach(), enable_gqa=True)
    assert torch.equal(out, expected)


def _fwd_args(q, k, v, dropout_p=0.0, rng_state=None, attn_mask=None):
    return (q, k, v, 0.25, False, True, 0, 0, None, -1, -1, 0.0, None, dropout_p, rng_state,
            attn_mask)


@pytest.mark.parametrize("dropout_p,rng_state,match", [
    (0.5, None, "needs rng_state"),
    (0.5, torch.zeros(2, dtype=torch.int32), "rng_state must be a contiguous int64"),
    (0.5, torch.zeros(3, dtype=torch.int64), "rng_state must be a contiguous int64"),
    (0.5, torch.zeros(1, dtype=torch.int64), "rng_state must be a contiguous int64"),
    (0.5, torch.zeros(4, dtype=torch.int64)[::2], "rng_state must be a contiguous int64"),
    (0.5, torch.zeros(2, dtype=torch.float32), "rng_state must be a contiguous int64"),
    (1.0, torch.zeros(2, dtype=torch.int64), r"dropout_p must be in \[0, 1\)"),
    (-0.5, torch.zeros(2, dtype=torch.int64), r"dropout_p must be in \[0, 1\)"),
    (float("nan"), torch.zeros(2, dtype=torch.int64), r"dropout_p must be in \[0, 1\)"),
], ids=str)
def test_bad_dropout_operators(dropout_p, rng_state, match):
    """The raw operators check dropout_p and rng_state themselves (forward, backward, varlen,
    dropout_mask)."""
    q, k, v = _small()
    with pytest.raises(RuntimeError, match=match):
        torch.ops.flash_attn_ext.fwd(*_fwd_args(q, k, v, dropout_p, rng_state))
    out, lse = torch.ops.flash_attn_ext.fwd(q, k, v, 0.25, False, True)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.flash_attn_ext.bwd(out, q, k, v, out, lse, 0.25, False, True, False, None, -1,
                                     -1, 0.0, None, dropout_p, rng_state)
    qv, kv, vv, cu_q, cu_k, mq, mk = make_varlen([3, 4], [5, 6], HEADS, KV_HEADS, 16,
                                                 torch.float32, "cpu", requires_grad=False)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.flash_attn_ext.varlen_fwd(qv, kv, vv, cu_q, cu_k, mq, mk, 0.25, False, None,
                                            -1, -1, 0.0, None, dropout_p, rng_state)
    if rng_state is not None:
        with pytest.raises(RuntimeError, match=match):
            torch.ops.flash_attn_ext.dropout_mask(rng_state, 1, 1, 4, 4, dropout_p)


def test_bad_dropout_mask_sizes():
    rng = torch.zeros(2, dtype=torch.int64)
    for sizes in ((-1, 1, 4, 4), (1, 1, -4, 4), (1, 1, 4, -1), (256, 257, 1, 1),
                  (1, 1, 65536, 1)):
        with pytest.raises(RuntimeError, match="dropout_mask sizes"):
            torch.ops.flash_attn_ext.dropout_mask(rng, *sizes, 0.5)


def test_varlen_operators_reject_attn_mask():
    qv, kv, vv, cu_q, cu_k, mq, mk = make_varlen([3, 4], [5, 6], HEADS, KV_HEADS, 16,
                                                 torch.float32, "cpu", requires_grad=False)
    mask = torch.ones(mq, mk, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="attn_mask is not supported with packed"):
        torch.ops.flash_attn_ext.varlen_fwd(qv, kv, vv, cu_q, cu_k, mq, mk, 0.25, False, None,
                                            -1, -1, 0.0, None, 0.0, None, mask)
    out, lse = torch.ops.flash_attn_ext.varlen_fwd(qv, kv, vv, cu_q, cu_k, mq, mk, 0.25, False)
    with pytest.raises(RuntimeError, match="attn_mask is not supported with packed"):
        torch.ops.flash_attn_ext.varlen_bwd(out, qv, kv, vv, out, lse, cu_q, cu_k, mq, mk, 0.25,
                                            False, False, None, -1, -1, 0.0, None, 0.0, None,
                                            mask)


def test_operator_attn_mask_checks():
    """The fwd operator checks attn_mask's dtype and shape itself."""
    q, k, v = _small()
    with pytest.raises(RuntimeError, match="broadcastable"):
        torch.ops.flash_attn_ext.fwd(*_fwd_args(q, k, v, attn_mask=torch.ones(2, 8, 9)))
    with pytest.raises(RuntimeError, match="attn_mask must be bool"):
        torch.ops.flash_attn_ext.fwd(*_fwd_args(q, k, v, attn_mask=torch.ones(8, 9).long()))


@pytest.mark.gpu
def test_cuda_arguments_on_another_device():
    q, k, v = _small("cuda", layout="bhsd")
    with pytest.raises(RuntimeError, match="attn_mask must be on the device of q"):
        fa.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 9, dtype=torch.bool),
                                        enable_gqa=True)
    qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))
    with pytest.raises(RuntimeError, match="rng_state must be on the device of q"):
        torch.ops.flash_attn_ext.fwd(*_fwd_args(qb, kb, vb, 0.5, torch.zeros(2, dtype=torch.int64)))


# ---- opcheck and torch.compile --------------------------------------------------------------


@pytest.mark.parametrize("with_mask", [False, True])
def test_opcheck(with_mask):
    q, k, v = (randn((2, n, h, 16), torch.float32, "cpu", s)
               for n, h, s in ((37, HEADS, 1), (53, KV_HEADS, 2), (53, KV_HEADS, 3)))
    rng_state = torch.tensor([123456789, 17], dtype=torch.int64)
    mask = _mask("add_finite", "b11_sk", 37, 53, torch.float32, "cpu") if with_mask else None
    for causal_br in (True, False):
        var = (-1, -1, 0.0, None, 0.3, rng_state, mask)
        fwd_args = (q, k, v, 0.25, True, causal_br, 0, 0, None, *var)
        torch.library.opcheck(torch.ops.flash_attn_ext.fwd.default, fwd_args,
                              test_utils=OPCHECK_UTILS)
        out, lse = torch.ops.flash_attn_ext.fwd(*fwd_args)
        torch.library.opcheck(torch.ops.flash_attn_ext.bwd.default,
                              (torch.randn_like(out), q, k, v, out, lse, 0.25, True, causal_br,
                               False, None, *var), test_utils=OPCHECK_UTILS)
    torch.library.opcheck(torch.ops.flash_attn_ext.dropout_mask.default,
                          (rng_state, 2, 3, 5, 45, 0.4), test_utils=OPCHECK_UTILS)
    opcheck_varlen_ops((-1, -1, 0.0, None, 0.3, rng_state), True, HEADS, KV_HEADS)


def test_torch_compile_attn_mask():
    torch._dynamo.reset()
    q, k, v = _sdpa_inputs(33, 40, torch.float32, "cpu", 16)
    mask = _mask("bool", "b11_sk", 33, 40, None, "cpu")
    add = _mask("add_finite", "11_sq_sk", 33, 40, torch.float32, "cpu")

    def f(q, k, v):
        a = fa.scaled_dot_product_attention(q, k, v, attn_mask=mask[:1], is_causal=True,
                                            enable_gqa=True)
        b = fa.scaled_dot_product_attention(q, k, v, attn_mask=add, enable_gqa=True)
        return (a.square() + b).sum()

    assert_compiled_matches_eager(f, (q, k, v))


def test_torch_compile_dropout():
    """fullgraph compile of a dropout call. Inductor draws random numbers its own way
    (compiled and eager rng_states differ under the same seed), so: compiled runs are
    reproducible under torch.manual_seed and their backward matches their forward's mask
    (bit-identical to eager with inductor's fallback_random=True, which draws like eager)."""
    import torch._inductor.config as inductor_config
    torch._dynamo.reset()
    q, k, v = (randn((2, 33, h, 16), torch.float32, "cpu", s, True)
               for h, s in ((HEADS, 1), (KV_HEADS, 2), (KV_HEADS, 3)))

    dout = randn(q.shape, torch.float32, "cpu", 4)

    def f(q, k, v):  # no arithmetic around the call: inductor would fuse it its own way
        return fa.flash_attn_func(q, k, v, dropout_p=0.3, causal=True)

    def run(fn, seed=3):
        torch.manual_seed(seed)
        out = fn(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    compiled = torch.compile(f, fullgraph=True)
    first, again = run(compiled), run(compiled)
    for a, b in zip(first, again):
        assert torch.equal(a, b) and torch.isfinite(a).all()
    assert not torch.equal(run(compiled, seed=4)[0], first[0])
    torch._dynamo.reset()
    with inductor_config.patch(fallback_random=True):
        compiled = torch.compile(f, fullgraph=True)
        for a, b in zip(run(compiled), run(f)):
            assert torch.equal(a, b)


# ---- CUDA: the kernels' head dims and dtypes ---------------------------------------------------
CUDA_DROPOUT = [  # (case, dtype, head_dim, seqlen_q, seqlen_k)
    ("p0.17", torch.float16, 64, 113, 300),
    ("causal_p0.3", torch.bfloat16, 128, 300, 113),
    ("p0.9", torch.bfloat16, 64, 77, 77),
    ("window_p0.2", torch.float16, 128, 113, 300),
    ("softcap_alibi_p0.4", torch.bfloat16, 64, 300, 113),
    ("all_causal_p0.25", torch.float16, 128, 300, 113),
    ("causal_p0.05", torch.float32, 64, 113, 300),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case,dtype,head_dim,seqlen_q,seqlen_k", CUDA_DROPOUT, ids=str)
def test_cuda_dropout(case, dtype, head_dim, seqlen_q, seqlen_k):
    test_flash_attn_func_dropout(case, dtype, seqlen_q, seqlen_k, "cuda", head_dim=head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["causal_p0.3", "all_causal_p0.25"])
def test_cuda_dropout_deterministic(case):
    test_flash_attn_func_dropout(case, torch.float16, 300, 113, "cuda", head_dim=64,
                                 deterministic=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 128), (torch.float16, 64)], ids=str)
def test_cuda_varlen_sdpa_dropout(dtype, head_dim):
    test_varlen_dropout("all_causal_p0.25", dtype, False, "cuda", head_dim=head_dim)
    test_sdpa_dropout(True, dtype, 70, 45, 0.3, "cuda", head_dim=head_dim)


CUDA_MASK = [  # (kind, shape, mask dtype, q dtype, causal, seqlen_q, seqlen_k, head_dim)
    ("bool", "sq_sk", None, torch.float16, False, 113, 300, 64),
    ("bool", "b11_sk", None, torch.bfloat16, True, 300, 113, 128),
    ("bool", "1h_sq1", None, torch.float16, False, 77, 77, 64),
    ("add", "bh_sq_sk", torch.float32, torch.bfloat16, True, 113, 300, 128),
    ("add_finite", "11_sq_sk", "q", torch.float16, False, 300, 113, 128),
    ("add_finite", "h_sq_sk", torch.bfloat16, torch.float16, True, 77, 77, 64),
    ("add_finite", "b11_sk", torch.float16, torch.bfloat16, False, 45, 70, 64),
    ("bool", "bh_sq_sk", None, torch.float32, True, 113, 300, 64),
    # 16-bit masks whose rows are 16-byte aligned: the Hopper kernels stage them through
    # shared memory (keys past Sk zero-filled, rows past Sq clamped)
    ("add_finite", "bh_sq_sk", torch.bfloat16, torch.bfloat16, True, 200, 264, 128),
    ("add", "sq_sk", torch.float16, torch.float16, False, 77, 136, 64),
    ("add", "11_sq_sk", torch.bfloat16, torch.bfloat16, True, 136, 72, 256),
    # per-batch planes broadcast over the heads: the Hopper forward walks its tiles heads-first
    ("add_finite", "b1_sq_sk", torch.bfloat16, torch.bfloat16, False, 200, 264, 128),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kind,shape,mask_dtype,dtype,causal,seqlen_q,seqlen_k,head_dim",
                         CUDA_MASK, ids=str)
def test_cuda_attn_mask(kind, shape, mask_dtype, dtype, causal, seqlen_q, seqlen_k, head_dim):
    test_sdpa_attn_mask(kind, shape, mask_dtype, dtype, causal, seqlen_q, seqlen_k, "cuda",
                        head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["row_sliced", "expanded", "transposed"])
def test_cuda_attn_mask_strided(layout):
    test_sdpa_attn_mask_strided(layout, "cuda", torch.float16, 64)
