"""flash_attn_ext::merge_partial_, ring attention's merge of a block's partial result (out,
lse) into a running one: against the float64 log-sum-exp merge, in place and from prev_out,
padded and packed layouts, strided views, rows without keys (-inf), bad inputs and opcheck;
the CUDA kernel (vectorised and not) against the same reference."""
import pytest
import torch

import flash_attn_ext  # noqa: F401  (registers the operators)

merge_partial_ = torch.ops.flash_attn_ext.merge_partial_
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _reference(prev, lse, block_out, block_lse, seq_dim):
    """float64 (out, lse) of the merge."""
    prev, block_out = prev.double(), block_out.double()
    lse, block_lse = lse.double(), block_lse.double()
    merged = torch.logaddexp(lse, block_lse)
    keep = torch.exp(lse - merged).nan_to_num(0.0)
    share = torch.exp(block_lse - merged).nan_to_num(0.0)
    weights = [w.movedim(-1, seq_dim).unsqueeze(-1) for w in (keep, share)]
    out = prev * weights[0] + block_out * weights[1]
    # Rows with no key on either side keep their running output.
    empty = torch.isneginf(merged).movedim(-1, seq_dim).unsqueeze(-1)
    return torch.where(empty, prev, out), merged


def _inputs(shape, packed, out_dtype, block_dtype, device, with_prev, empty_rows=True):
    gen = torch.Generator().manual_seed(7)
    lse_shape = (shape[1], shape[0]) if packed else (shape[0], shape[2], shape[1])

    def randn(*s):
        return torch.randn(*s, generator=gen)
    lse, block_lse = randn(*lse_shape) * 3, randn(*lse_shape) * 3
    if empty_rows:  # rows without keys: in the running result, the block, both
        lse[..., 0] = float("-inf")
        block_lse[..., 1] = float("-inf")
        lse[..., 2] = block_lse[..., 2] = float("-inf")
    running, block_out = randn(*shape), randn(*shape)
    args = dict(out=running.to(device, out_dtype), lse=lse.to(device),
                block_out=block_out.to(device, block_dtype), block_lse=block_lse.to(device))
    if with_prev:
        args["prev_out"] = args["out"].to(block_dtype)
        args["out"] = torch.full_like(args["out"], float("nan"))  # only written
    return args


def _check(args, packed, atol_scale=1.0):
    prev = args.get("prev_out", args["out"]).clone()
    expect_out, expect_lse = _reference(prev, args["lse"], args["block_out"], args["block_lse"],
                                        0 if packed else 1)
    merge_partial_(**args)
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[args["out"].dtype]
    torch.testing.assert_close(args["out"].double(), expect_out, atol=tol * atol_scale,
                               rtol=tol)
    torch.testing.assert_close(args["lse"].double(), expect_lse, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("block_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("out_fp32", [True, False], ids=["out_fp32", "out_same"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("with_prev", [False, True], ids=["in_place", "prev_out"])
def test_merge_cpu(block_dtype, out_fp32, packed, with_prev):
    shape = (13, 3, 16) if packed else (2, 7, 3, 16)
    out_dtype = torch.float32 if out_fp32 else block_dtype
    _check(_inputs(shape, packed, out_dtype, block_dtype, "cpu", with_prev), packed)


def test_merge_strided_views():
    """Chunks of a shard (narrowed along the sequence) and a head-major lse view."""
    out = torch.randn(2, 10, 3, 8)
    lse = torch.randn(2, 3, 10)
    block_out, block_lse = torch.randn(2, 4, 3, 8), torch.randn(2, 3, 4)
    view, lse_view = out.narrow(1, 6, 4), lse.narrow(-1, 6, 4)
    expect_out, expect_lse = _reference(view.clone(), lse_view.clone(), block_out, block_lse, 1)
    merge_partial_(view, lse_view, block_out, block_lse)
    torch.testing.assert_close(out[:, 6:].double(), expect_out)
    torch.testing.assert_close(lse[..., 6:].double(), expect_lse)


@pytest.mark.parametrize("what, match", [
    ("shape", "must have out's shape"),
    ("lse_shape", "lse must be float32 of shape"),
    ("lse_dtype", "lse must be float32"),
    ("block_fp32_out_bf16", "must be float32 or block_out's dtype"),
    ("dims", "must be \\[batch, seqlen, heads, head_dim\\]"),
])
def test_merge_bad_inputs(what, match):
    args = _inputs((2, 5, 3, 8), False, torch.float32, torch.bfloat16, "cpu", False, False)
    if what == "shape":
        args["block_out"] = args["block_out"][:, :4]
    elif what == "lse_shape":
        args["block_lse"] = args["block_lse"][..., :4]
    elif what == "lse_dtype":
        args["lse"] = args["lse"].double()
    elif what == "block_fp32_out_bf16":
        args["out"], args["block_out"] = args["out"].bfloat16(), args["block_out"].float()
    elif what == "dims":
        args["out"] = args["out"][0, 0]
    with pytest.raises(RuntimeError, match=match):
        merge_partial_(**args)


@pytest.mark.parametrize("with_prev", [False, True], ids=["in_place", "prev_out"])
def test_merge_opcheck(with_prev):
    args = _inputs((2, 5, 3, 8), False, torch.float32, torch.bfloat16, "cpu", with_prev, False)
    torch.library.opcheck(merge_partial_.default, (), args)


@pytest.mark.gpu
@pytest.mark.parametrize("block_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("out_fp32", [True, False], ids=["out_fp32", "out_same"])
@pytest.mark.parametrize("layout", ["padded", "packed", "odd_dim", "strided"])
@pytest.mark.parametrize("with_prev", [False, True], ids=["in_place", "prev_out"])
def test_merge_cuda(block_dtype, out_fp32, layout, with_prev):
    """The CUDA kernel against the float64 merge: 4-element vectors (head_dim 128 / 16, the
    packed rows), one element per thread (head_dim 6), a view whose strides are not
    multiples of 4 (vectors off)."""
    packed = layout == "packed"
    shape = {"padded": (2, 37, 5, 128), "packed": (301, 3, 16), "odd_dim": (2, 9, 3, 6),
             "strided": (2, 9, 3, 16)}[layout]
    out_dtype = torch.float32 if out_fp32 else block_dtype
    args = _inputs(shape, packed, out_dtype, block_dtype, "cuda", with_prev)
    if layout == "strided":  # rows 17 elements apart: not aligned to 4
        for name in ("out", "block_out") + (("prev_out",) if with_prev else ()):
            t = args[name]
            wide = torch.zeros(*t.shape[:-1], 17, dtype=t.dtype, device=t.device)
            wide[..., 1:17] = t
            args[name] = wide[..., 1:17]
    _check(args, packed)
    torch.cuda.synchronize()
