"""flash_attn_ext::sum_partial_, ring attention's sum of gradient pieces: out = prev + the
pieces, added in float32 in order and rounded once. Against a float32 sum in that order
(the same rounding) and a float64 one; padded and packed layouts, strided views, out
aliasing prev, bad inputs and opcheck; the CUDA kernel (vectorised and not) likewise."""
import pytest
import torch

import flash_attn_ext  # noqa: F401  (registers the operators)

sum_partial_ = torch.ops.flash_attn_ext.sum_partial_
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(shape, n, piece_dtype, out_dtype, prev_dtype, device, seed=3):
    gen = torch.Generator().manual_seed(seed)
    pieces = [torch.randn(*shape, generator=gen).to(device, piece_dtype) for _ in range(n)]
    prev = None if prev_dtype is None else torch.randn(*shape, generator=gen).to(device, prev_dtype)
    out = torch.full(shape, float("nan"), dtype=out_dtype, device=device)  # only written
    return out, pieces, prev


def _expected(pieces, prev):
    """The float32 sum in the kernel's order, and the float64 one."""
    f32 = torch.zeros(pieces[0].shape, dtype=torch.float32, device=pieces[0].device)
    f64 = f32.double()
    for t in ([prev] if prev is not None else []) + pieces:
        f32 += t.float()
        f64 += t.double()
    return f32, f64


def _check(out, pieces, prev):
    f32, f64 = _expected(pieces, prev)
    sum_partial_(out, pieces, prev)
    # One rounding of the float32 sum to out's dtype: exactly what a cast of it gives.
    torch.testing.assert_close(out, f32.to(out.dtype), atol=0, rtol=0)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[out.dtype]
    torch.testing.assert_close(out.double(), f64, atol=tol, rtol=tol)


@pytest.mark.parametrize("piece_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("out_fp32", [True, False], ids=["out_fp32", "out_same"])
@pytest.mark.parametrize("prev", ["none", "fp32", "same"])
@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_sum_cpu(piece_dtype, out_fp32, prev, n, packed):
    shape = (13, 3, 16) if packed else (2, 7, 3, 16)
    out_dtype = torch.float32 if out_fp32 else piece_dtype
    prev_dtype = {"none": None, "fp32": torch.float32, "same": piece_dtype}[prev]
    _check(*_inputs(shape, n, piece_dtype, out_dtype, prev_dtype, "cpu"))


def _strided_and_aliased(device):
    """Pieces that are chunks of a bigger tensor (narrowed along the sequence), and out that
    is prev (a running fp32 sum folded in place)."""
    big = torch.randn(2, 10, 3, 8, device=device, dtype=torch.bfloat16)
    pieces = [big.narrow(1, 6, 4), big.narrow(1, 0, 4)]
    running = torch.randn(2, 4, 3, 8, device=device)
    f32, _ = _expected(pieces, running)
    sum_partial_(running, pieces, running)
    torch.testing.assert_close(running, f32, atol=0, rtol=0)
    dest = torch.zeros(2, 10, 3, 8, device=device, dtype=torch.bfloat16)
    sum_partial_(dest.narrow(1, 3, 4), pieces, running)
    f32, _ = _expected(pieces, running)
    torch.testing.assert_close(dest[:, 3:7], f32.bfloat16(), atol=0, rtol=0)
    assert dest[:, :3].eq(0).all() and dest[:, 7:].eq(0).all()


def test_sum_strided_and_aliased():
    _strided_and_aliased("cpu")


@pytest.mark.parametrize("what, match", [
    ("no_pieces", "takes 1 to 8 pieces"),
    ("nine_pieces", "takes 1 to 8 pieces"),
    ("shape", "must have out's shape"),
    ("piece_dtypes", "must be of the first piece's dtype"),
    ("out_dtype", "must be float32 or the pieces' dtype"),
    ("prev_dtype", "must be float32 or the pieces' dtype"),
    ("int_pieces", "pieces must be float32, float16 or bfloat16"),
    ("dims", "must be \\[batch, seqlen, heads, head_dim\\]"),
    ("last_dim", "contiguous last dimension"),
])
def test_sum_bad_inputs(what, match):
    out, pieces, prev = _inputs((2, 5, 3, 8), 2, torch.bfloat16, torch.float32, None, "cpu")
    if what == "no_pieces":
        pieces = []
    elif what == "nine_pieces":
        pieces = pieces * 5
    elif what == "shape":
        pieces[1] = pieces[1][:, :4]
    elif what == "piece_dtypes":
        pieces[1] = pieces[1].half()
    elif what == "out_dtype":
        out = out.half()
    elif what == "prev_dtype":
        prev = torch.zeros_like(out, dtype=torch.float64)
    elif what == "int_pieces":
        pieces = [p.int() for p in pieces]
    elif what == "dims":
        out, pieces = out[0, 0], [p[0, 0] for p in pieces]
    elif what == "last_dim":
        pieces[0] = pieces[0].transpose(2, 3).contiguous().transpose(2, 3)
    with pytest.raises(RuntimeError, match=match):
        sum_partial_(out, pieces, prev)


@pytest.mark.parametrize("with_prev", [False, True], ids=["no_prev", "prev"])
def test_sum_opcheck(with_prev):
    out, pieces, prev = _inputs((2, 5, 3, 8), 3, torch.bfloat16, torch.float32,
                                torch.float32 if with_prev else None, "cpu")
    torch.library.opcheck(sum_partial_.default, (out, pieces, prev))


@pytest.mark.gpu
@pytest.mark.parametrize("piece_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("out_fp32", [True, False], ids=["out_fp32", "out_same"])
@pytest.mark.parametrize("prev", ["none", "fp32", "same"])
@pytest.mark.parametrize("layout", ["padded", "packed", "odd_dim", "strided"])
def test_sum_cuda(piece_dtype, out_fp32, prev, layout):
    """The CUDA kernel: 4-element vectors (head_dim 128 / 16, the packed rows), one element
    per thread (head_dim 6), pieces whose strides are not multiples of 4 (vectors off)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    shape = {"padded": (2, 37, 5, 128), "packed": (301, 3, 16), "odd_dim": (2, 9, 3, 6),
             "strided": (2, 9, 3, 8)}[layout]
    out_dtype = torch.float32 if out_fp32 else piece_dtype
    prev_dtype = {"none": None, "fp32": torch.float32, "same": piece_dtype}[prev]
    out, pieces, prev_t = _inputs(shape, 5, piece_dtype, out_dtype, prev_dtype, "cuda")
    if layout == "strided":  # rows 10 elements apart: not 4-aligned
        pieces = [torch.randn(2, 9, 3, 10, device="cuda").to(piece_dtype)[..., 1:9]
                  for _ in pieces]
    _check(out, pieces, prev_t)


@pytest.mark.gpu
def test_sum_cuda_strided_and_aliased():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _strided_and_aliased("cuda")
