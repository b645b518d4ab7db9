"""The backward operators' dq_accum (flash_attn_ext::bwd / varlen_bwd): dQ / softmax_scale
added into a caller's float32 accumulator in lse's layout with head_dim last, dq returned
empty (ring attention's steps add into one accumulator and convert once). Against the same
call without it: the added amount times softmax_scale equals its dq up to dq's rounding, dK
and dV are the same; padded and packed, GQA, causal, an accumulator that is rows of a bigger
one (the ring's pieces), one whose layout TMA cannot describe (the Hopper backward then
leaves the add to the op layer), bad inputs, opcheck."""
import pytest
import torch

import flash_attn_ext  # noqa: F401  (registers the operators)
from helpers import OPCHECK_UTILS, kernel_names, make_varlen, randn

bwd = torch.ops.flash_attn_ext.bwd
varlen_bwd = torch.ops.flash_attn_ext.varlen_bwd
SCALE = 0.3


def _padded(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, device, causal):
    q = randn((batch, seqlen_q, heads, head_dim), dtype, device, 1)
    k = randn((batch, seqlen_k, heads_k, head_dim), dtype, device, 2)
    v = randn((batch, seqlen_k, heads_k, head_dim), dtype, device, 3)
    out, lse = torch.ops.flash_attn_ext.fwd(q, k, v, SCALE, causal, True)
    dout = randn(out.shape, dtype, device, 4)
    return (dout, q, k, v, out, lse, SCALE, causal, True)


def _packed(heads, heads_k, head_dim, dtype, device, causal):
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen([37, 0, 70], [29, 45, 0], heads, heads_k,
                                                    head_dim, dtype, device, requires_grad=False)
    out, lse = torch.ops.flash_attn_ext.varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, SCALE,
                                                   causal)
    dout = randn(out.shape, dtype, device, 4)
    return (dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, SCALE, causal)


def _accum_like(q, packed, extra_cols=0, extra_rows=0):
    """A random float32 accumulator in lse's layout; extra rows / columns make it a view of a
    bigger tensor (rows narrowed as the ring's pieces are, or a padded row pitch)."""
    rows, heads, dim = (q.shape[0], q.shape[1], q.shape[2]) if packed else q.shape[1:]
    shape = ((heads, rows + extra_rows, dim + extra_cols) if packed
             else (q.shape[0], heads, rows + extra_rows, dim + extra_cols))
    big = randn(shape, torch.float32, q.device, 5)
    view = big.narrow(-2, extra_rows // 2, rows).narrow(-1, 0, dim)
    return big, view


def _check(op, args, packed, extra_cols=0, extra_rows=0, deterministic=None):
    """Calls `op` with and without dq_accum (twice with: the adds accumulate)."""
    kw = {} if deterministic is None else {"deterministic": deterministic}
    dq, dk, dv = op(*args, **kw)
    q = args[1]
    big, acc = _accum_like(q, packed, extra_cols, extra_rows)
    before = big.clone()
    dq_empty, dk2, dv2 = op(*args, **kw, dq_accum=acc)
    assert dq_empty.numel() == 0
    torch.testing.assert_close(dk2, dk, atol=0, rtol=0)
    torch.testing.assert_close(dv2, dv, atol=0, rtol=0)
    view = lambda t: t.narrow(-2, extra_rows // 2, q.shape[0] if packed else q.shape[1])
    added = (view(big) - view(before))[..., :q.shape[-1]] * SCALE
    added = added.movedim(-2, 0 if packed else 1)
    # dq is the accumulator rounded to q's dtype once (the CPU: dq computed, then added).
    eps = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[q.dtype]
    scale = dq.float().abs().max().item() + 1e-6
    torch.testing.assert_close(added, dq.float(), atol=4 * eps * scale, rtol=2 * eps)
    # Everything outside the view is untouched.
    mask = torch.ones_like(big, dtype=torch.bool)
    view(mask)[..., :q.shape[-1]] = False
    assert torch.equal(big[mask], before[mask])
    op(*args, **kw, dq_accum=acc)  # a second call adds again
    twice = (view(big) - view(before))[..., :q.shape[-1]].movedim(-2, 0 if packed else 1) * SCALE
    torch.testing.assert_close(twice, 2 * dq.float(), atol=8 * eps * scale, rtol=4 * eps)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads_k", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("view", ["dense", "rows_of_bigger", "padded_pitch"])
def test_padded_cpu(causal, heads_k, view):
    args = _padded(2, 23, 31, 4, heads_k, 16, torch.float32, "cpu", causal)
    _check(bwd, args, False, extra_cols=3 if view == "padded_pitch" else 0,
           extra_rows=10 if view == "rows_of_bigger" else 0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_cpu(causal):
    _check(varlen_bwd, _packed(4, 2, 16, torch.float32, "cpu", causal), True, extra_rows=8)


@pytest.mark.parametrize("what, match", [
    ("dtype", "dq_accum must be float32 of shape"),
    ("shape", "dq_accum must be float32 of shape"),
    ("q_layout", "dq_accum must be float32 of shape"),
    ("last_dim", "contiguous last dimension"),
    ("scale", "softmax_scale must not be 0"),
])
def test_bad_inputs(what, match):
    args = list(_padded(1, 8, 8, 2, 2, 16, torch.float32, "cpu", False))
    acc = torch.zeros(1, 2, 8, 16)
    if what == "dtype":
        acc = acc.double()
    elif what == "shape":
        acc = acc[:, :, :7]
    elif what == "q_layout":  # dq's own layout is not the accumulator's
        acc = torch.zeros(1, 8, 2, 16)
    elif what == "last_dim":
        acc = torch.zeros(1, 2, 16, 8).transpose(-1, -2)
    elif what == "scale":
        args[6] = 0.0
    with pytest.raises(RuntimeError, match=match):
        bwd(*args, dq_accum=acc)


def test_opcheck():
    args = _padded(1, 9, 11, 2, 1, 16, torch.float32, "cpu", True)
    torch.library.opcheck(bwd.default, args, {"dq_accum": torch.zeros(1, 2, 9, 16)},
                          test_utils=OPCHECK_UTILS)
    packed = _packed(2, 1, 16, torch.float32, "cpu", True)
    torch.library.opcheck(varlen_bwd.default, packed, {"dq_accum": torch.zeros(2, 107, 16)},
                          test_utils=OPCHECK_UTILS)


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("view", ["dense", "rows_of_bigger", "odd_pitch"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_padded_cuda(dtype, head_dim, causal, view, deterministic):
    """odd_pitch: rows head_dim + 1 floats apart, which TMA cannot address (the op layer adds
    the computed dq instead)."""
    _cuda()
    args = _padded(2, 200, 330, 4, 2, head_dim, dtype, "cuda", causal)
    _check(bwd, args, False, extra_cols=1 if view == "odd_pitch" else 0,
           extra_rows=96 if view == "rows_of_bigger" else 0, deterministic=deterministic)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_packed_cuda(causal, dtype):
    _cuda()
    _check(varlen_bwd, _packed(4, 2, 64, dtype, "cuda", causal), True, extra_rows=40)


@pytest.mark.gpu
def test_hopper_adds_in_kernel():
    """On an H100 / H200 the Hopper backward adds into the accumulator itself: no dQ
    conversion kernel runs."""
    _cuda()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 device")
    args = _padded(1, 256, 256, 4, 4, 128, torch.bfloat16, "cuda", True)
    acc = torch.zeros(1, 4, 256, 128, device="cuda")
    names = kernel_names(lambda: bwd(*args, dq_accum=acc))
    assert any("flash_bwd_sm90_kernel" in n for n in names), names
    assert not any("convert_dq" in n for n in names), names
    assert any("convert_dq" in n for n in kernel_names(lambda: bwd(*args)))
