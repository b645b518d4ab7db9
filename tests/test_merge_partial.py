"""flash_attn_ext::merge_partial_, ring attention's merge of blocks' partial results (out,
lse) into a running one: against the float64 log-sum-exp merge, 1 to 8 blocks, in place
and from prev_out, padded and packed layouts, strided views, rows without keys (-inf; a
fresh running result full of NaNs is not read), bad inputs and opcheck; the CUDA kernel
(vectorised and not) against the same reference."""
import pytest
import torch

import flash_attn_ext  # noqa: F401  (registers the operators)

merge_partial_ = torch.ops.flash_attn_ext.merge_partial_
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _reference(prev, lse, block_outs, block_lses, seq_dim):
    """float64 (out, lse) of the merge; rows without any key: out 0, lse -inf."""
    lses = torch.stack([lse.double()] + [b.double() for b in block_lses])
    merged = torch.logsumexp(lses, 0)
    weights = torch.exp(lses - merged.masked_fill(torch.isneginf(merged), 0.0))
    out = torch.zeros(prev.shape, dtype=torch.float64, device=prev.device)
    for w, t in zip(weights, [prev] + list(block_outs)):
        w = w.movedim(-1, seq_dim).unsqueeze(-1)
        out += torch.where(w > 0, w * t.double(), torch.zeros_like(w))
    return out, merged


def _inputs(shape, packed, out_dtype, block_dtype, device, with_prev, blocks=1,
            empty_rows=True, fresh=False):
    """merge_partial_'s arguments. fresh: a running result that holds nothing yet (lse -inf,
    out NaN)."""
    gen = torch.Generator().manual_seed(7)
    lse_shape = (shape[1], shape[0]) if packed else (shape[0], shape[2], shape[1])

    def randn(*s):
        return torch.randn(*s, generator=gen)
    lse = randn(*lse_shape) * 3
    block_lses = [randn(*lse_shape) * 3 for _ in range(blocks)]
    if empty_rows:  # rows without keys: in the running result, a block, all of them
        lse[..., 0] = float("-inf")
        block_lses[0][..., 1] = float("-inf")
        lse[..., 2] = float("-inf")
        for b in block_lses:
            b[..., 2] = float("-inf")
    running = randn(*shape)
    if fresh:
        lse.fill_(float("-inf"))
        running.fill_(float("nan"))
    args = dict(out=running.to(device, out_dtype), lse=lse.to(device),
                block_outs=[randn(*shape).to(device, block_dtype) for _ in range(blocks)],
                block_lses=[b.to(device) for b in block_lses])
    if with_prev:
        args["prev_out"] = args["out"].to(block_dtype)
        args["out"] = torch.full_like(args["out"], float("nan"))  # only written
    return args


def _check(args, packed):
    prev = args.get("prev_out", args["out"]).clone()
    expect_out, expect_lse = _reference(prev, args["lse"], args["block_outs"],
                                        args["block_lses"], 0 if packed else 1)
    merge_partial_(**args)
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[args["out"].dtype]
    torch.testing.assert_close(args["out"].double(), expect_out, atol=tol, rtol=tol)
    torch.testing.assert_close(args["lse"].double(), expect_lse, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("block_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("out_fp32", [True, False], ids=["out_fp32", "out_same"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("with_prev", [False, True], ids=["in_place", "prev_out"])
@pytest.mark.parametrize("blocks", [1, 3, 8])
def test_merge_cpu(block_dtype, out_fp32, packed, with_prev, blocks):
    shape = (13, 3, 16) if packed else (2, 7, 3, 16)
    out_dtype = torch.float32 if out_fp32 else block_dtype
    _check(_inputs(shape, packed, out_dtype, block_dtype, "cpu", with_prev, blocks), packed)


@pytest.mark.parametrize("blocks", [1, 4])
def test_merge_fresh_result_is_not_read(blocks):
    """A running result with lse -inf (out full of NaNs): the merge of the blocks alone."""
    args = _inputs((2, 7, 3, 16), False, torch.float32, torch.bfloat16, "cpu", False, blocks,
                   fresh=True)
    _check(args, False)
    assert not args["out"].isnan().any()


def test_merge_strided_views():
    """Chunks of a shard (narrowed along the sequence) and a head-major lse view."""
    out = torch.randn(2, 10, 3, 8)
    lse = torch.randn(2, 3, 10)
    block = torch.randn(2, 9, 3, 8)
    block_lse = torch.randn(2, 3, 9)
    views = [block.narrow(1, 0, 4), block.narrow(1, 5, 4)]
    lse_views = [block_lse.narrow(-1, 0, 4), block_lse.narrow(-1, 5, 4)]
    view, lse_view = out.narrow(1, 6, 4), lse.narrow(-1, 6, 4)
    expect_out, expect_lse = _reference(view.clone(), lse_view.clone(), views, lse_views, 1)
    merge_partial_(view, lse_view, views, lse_views)
    torch.testing.assert_close(out[:, 6:].double(), expect_out)
    torch.testing.assert_close(lse[..., 6:].double(), expect_lse)


@pytest.mark.parametrize("what, match", [
    ("no_blocks", "takes 1 to 8 blocks"),
    ("nine_blocks", "takes 1 to 8 blocks"),
    ("lse_count", "2 block_outs but 1 block_lses"),
    ("shape", "must have out's shape"),
    ("lse_shape", "block_lses\\[1\\] must be float32 of shape"),
    ("lse_dtype", "lse must be float32"),
    ("block_fp32_out_bf16", "must be float32 or the blocks' dtype"),
    ("block_dtypes", "must be of block_outs\\[0\\]'s dtype"),
    ("dims", "must be \\[batch, seqlen, heads, head_dim\\]"),
])
def test_merge_bad_inputs(what, match):
    args = _inputs((2, 5, 3, 8), False, torch.float32, torch.bfloat16, "cpu", False, 2, False)
    if what == "no_blocks":
        args["block_outs"], args["block_lses"] = [], []
    elif what == "nine_blocks":
        args["block_outs"], args["block_lses"] = args["block_outs"] * 5, args["block_lses"] * 5
    elif what == "lse_count":
        args["block_lses"] = args["block_lses"][:1]
    elif what == "shape":
        args["block_outs"][1] = args["block_outs"][1][:, :4]
    elif what == "lse_shape":
        args["block_lses"][1] = args["block_lses"][1][..., :4]
    elif what == "lse_dtype":
        args["lse"] = args["lse"].double()
    elif what == "block_fp32_out_bf16":
        args["out"] = args["out"].bfloat16()
        args["block_outs"] = [b.float() for b in args["block_outs"]]
    elif what == "block_dtypes":
        args["block_outs"][1] = args["block_outs"][1].half()
    elif what == "dims":
        args["out"] = args["out"][0, 0]
    with pytest.raises(RuntimeError, match=match):
        merge_partial_(**args)


@pytest.mark.parametrize("with_prev", [False, True], ids=["in_place", "prev_out"])
def test_merge_opcheck(with_prev):
    args = _inputs((2, 5, 3, 8), False, torch.float32, torch.bfloat16, "cpu", with_prev, 3,
                   False)
    torch.library.opcheck(merge_partial_.default, (), args)


@pytest.mark.gpu
@pytest.mark.parametrize("block_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("out_fp32", [True, False], ids=["out_fp32", "out_same"])
@pytest.mark.parametrize("layout", ["padded", "packed", "odd_dim", "strided"])
@pytest.mark.parametrize("with_prev", [False, True], ids=["in_place", "prev_out"])
@pytest.mark.parametrize("blocks", [1, 3, 8])
def test_merge_cuda(block_dtype, out_fp32, layout, with_prev, blocks):
    """The CUDA kernel against the float64 merge: 4-element vectors (head_dim 128 / 16, the
    packed rows), one element per thread (head_dim 6), views whose strides are not
    multiples of 4 (vectors off)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    packed = layout == "packed"
    shape = {"padded": (2, 37, 5, 128), "packed": (301, 3, 16), "odd_dim": (2, 9, 3, 6),
             "strided": (2, 9, 3, 16)}[layout]
    out_dtype = torch.float32 if out_fp32 else block_dtype
    args = _inputs(shape, packed, out_dtype, block_dtype, "cuda", with_prev, blocks)
    if layout == "strided":  # rows 17 elements apart: not aligned to 4

        def widened(t):
            wide = torch.zeros(*t.shape[:-1], 17, dtype=t.dtype, device=t.device)
            wide[..., 1:17] = t
            return wide[..., 1:17]
        for name in ("out",) + (("prev_out",) if with_prev else ()):
            args[name] = widened(args[name])
        args["block_outs"] = [widened(b) for b in args["block_outs"]]
    _check(args, packed)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_merge_cuda_fresh_result_is_not_read():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    args = _inputs((2, 7, 3, 16), False, torch.float32, torch.bfloat16, "cuda", False, 3,
                   fresh=True)
    _check(args, False)
    assert not args["out"].isnan().any()
