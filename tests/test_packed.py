"""flash-attn's packed entry points (flash_attn_qkvpacked_func, flash_attn_kvpacked_func,
flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func: views of one tensor into
flash_attn_func / flash_attn_varlen_func) and the backward of flash_attn_varlen_func over a
paged KV cache (block_table): values and gradients against float64 references with
FlashAttention's accuracy rule (tests/helpers.py) and against the unpacked / contiguous calls,
on CPU and (marked gpu) CUDA."""
import inspect

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flash_attn_ext as fa
from helpers import (alibi_slopes, assert_grads_repeat, check_out_and_grads, gqa_attention, randn,
                     ref_and_base, varlen_attention)

DTYPES = [torch.float32, torch.bfloat16]
# (heads, kv heads) of the kv-packed tests: plain multi-head and grouped-query.
KV_HEADS = [(4, 4), (6, 2)]


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _cu_seqlens(lengths, device):
    return torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32).to(device)


def _assert_same(ours, theirs):
    """ours and theirs are one computation on the same values through other strides or
    another layout of the keys: identical on the CPU; on CUDA other tiles and the order of
    the backward's atomic adds may change the rounding (a few units of the largest value)."""
    if ours.device.type == "cpu":
        assert torch.equal(ours, theirs)
        return
    tol = 4 * torch.finfo(theirs.dtype).eps
    torch.testing.assert_close(ours, theirs, rtol=tol,
                               atol=1e-5 + tol * theirs.abs().max().item())


def _unpacked_grads(call, packed, dim, dout):
    """Output and gradient of call(*parts) on separate (contiguous) copies of packed's parts,
    the gradients stacked back into packed's shape."""
    parts = [t.detach().clone().requires_grad_() for t in packed.unbind(dim)]
    out = call(*parts)
    return out, torch.stack(torch.autograd.grad(out, parts, dout), dim=dim)


# ---- values and gradients -----------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_views_in_hopper_kernels(head_dim, causal):
    """Packed views (row pitch 3 * heads * head_dim, or 2 *) at the head dims of the Hopper
    kernels (on sm_90 their TMA maps read the views in place; elsewhere the mma.sync
    kernels): the same values and gradients as separate contiguous tensors."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    qkv = randn((2, 700, 3, 4, head_dim), torch.bfloat16, "cuda", 1, True)
    out = fa.flash_attn_qkvpacked_func(qkv, causal=causal)
    dout = randn(out.shape, torch.bfloat16, "cuda", 2)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    out_ref, dqkv_ref = _unpacked_grads(lambda q, k, v: fa.flash_attn_func(q, k, v,
                                                                            causal=causal),
                                        qkv, 2, dout)
    _assert_same(out, out_ref)
    _assert_same(dqkv, dqkv_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked(device, dtype, causal):
    qkv = randn((2, 37, 3, 4, 32), dtype, device, 1, True)
    out = fa.flash_attn_qkvpacked_func(qkv, causal=causal)
    assert out.shape == (2, 37, 4, 32)
    dout = randn(out.shape, dtype, device, 2)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    assert dqkv.shape == qkv.shape
    ref, base = ref_and_base(lambda qkv: gqa_attention(*qkv.unbind(2), causal), (qkv,), dout)
    check_out_and_grads(out, (dqkv,), ref, base, dtype, names=("dqkv",))
    unpacked_out, unpacked_dqkv = _unpacked_grads(
        lambda q, k, v: fa.flash_attn_func(q, k, v, causal=causal), qkv, 2, dout)
    _assert_same(out, unpacked_out)
    _assert_same(dqkv, unpacked_dqkv)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads", KV_HEADS, ids=["mha", "gqa"])
def test_kvpacked(device, dtype, causal, heads, kv_heads):
    q = randn((2, 29, heads, 32), dtype, device, 1, True)
    kv = randn((2, 45, 2, kv_heads, 32), dtype, device, 2, True)
    out = fa.flash_attn_kvpacked_func(q, kv, causal=causal)
    assert out.shape == q.shape
    dout = randn(out.shape, dtype, device, 3)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    assert dkv.shape == kv.shape
    ref, base = ref_and_base(lambda q, kv: gqa_attention(q, *kv.unbind(2), causal), (q, kv),
                             dout)
    check_out_and_grads(out, (dq, dkv), ref, base, dtype, names=("dq", "dkv"))
    unpacked_out, unpacked_dkv = _unpacked_grads(
        lambda k, v: fa.flash_attn_func(q.detach(), k, v, causal=causal), kv, 2, dout)
    _assert_same(out, unpacked_out)
    _assert_same(dkv, unpacked_dkv)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_qkvpacked(device, dtype, causal):
    lengths = [5, 0, 17, 33]  # uneven, odd, one empty sequence
    cu = _cu_seqlens(lengths, device)
    qkv = randn((sum(lengths), 3, 4, 32), dtype, device, 1, True)
    out = fa.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lengths), causal=causal)
    assert out.shape == (sum(lengths), 4, 32)
    dout = randn(out.shape, dtype, device, 2)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    assert dqkv.shape == qkv.shape
    ref, base = ref_and_base(lambda qkv: varlen_attention(*qkv.unbind(1), cu, cu, causal),
                             (qkv,), dout)
    check_out_and_grads(out, (dqkv,), ref, base, dtype, names=("dqkv",))
    unpacked_out, unpacked_dqkv = _unpacked_grads(
        lambda q, k, v: fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths),
                                                  causal=causal), qkv, 1, dout)
    _assert_same(out, unpacked_out)
    _assert_same(dqkv, unpacked_dqkv)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads", KV_HEADS, ids=["mha", "gqa"])
def test_varlen_kvpacked(device, dtype, causal, heads, kv_heads):
    lens_q, lens_k = [7, 13, 1, 0], [20, 9, 31, 4]
    cu_q, cu_k = _cu_seqlens(lens_q, device), _cu_seqlens(lens_k, device)
    q = randn((sum(lens_q), heads, 32), dtype, device, 1, True)
    kv = randn((sum(lens_k), 2, kv_heads, 32), dtype, device, 2, True)
    out = fa.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max(lens_q), max(lens_k),
                                             causal=causal)
    assert out.shape == q.shape
    dout = randn(out.shape, dtype, device, 3)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    assert dkv.shape == kv.shape
    ref, base = ref_and_base(
        lambda q, kv: varlen_attention(q, *kv.unbind(1), cu_q, cu_k, causal), (q, kv), dout)
    check_out_and_grads(out, (dq, dkv), ref, base, dtype, names=("dq", "dkv"))
    unpacked_out, unpacked_dkv = _unpacked_grads(
        lambda k, v: fa.flash_attn_varlen_func(q.detach(), k, v, cu_q, cu_k, max(lens_q),
                                               max(lens_k), causal=causal), kv, 1, dout)
    _assert_same(out, unpacked_out)
    _assert_same(dkv, unpacked_dkv)


def test_gradient_accumulates_into_one_packed_tensor(device):
    """.backward() leaves one .grad on qkv (packed layout), as flash-attn's packed functions."""
    qkv = randn((1, 9, 3, 2, 16), torch.float32, device, 1, True)
    fa.flash_attn_qkvpacked_func(qkv, causal=True).sum().backward()
    assert qkv.grad is not None and qkv.grad.shape == qkv.shape
    assert all(part.abs().sum() > 0 for part in qkv.grad.unbind(2))  # dq, dk and dv all there


# ---- every flash-attn argument is passed on -----------------------------------------------
def _packed_and_unpacked_calls(device, dtype):
    """(packed call, unpacked call, packed inputs) for each entry point, on small odd shapes."""
    lens_q, lens_k = [7, 12], [19, 3]
    cu_q, cu_k = _cu_seqlens(lens_q, device), _cu_seqlens(lens_k, device)
    q = randn((2, 11, 4, 32), dtype, device, 1, True)
    qkv = randn((2, 11, 3, 4, 32), dtype, device, 2, True)
    kv = randn((2, 23, 2, 2, 32), dtype, device, 3, True)
    vq = randn((sum(lens_q), 4, 32), dtype, device, 4, True)
    vqkv = randn((sum(lens_q), 3, 4, 32), dtype, device, 5, True)
    vkv = randn((sum(lens_k), 2, 2, 32), dtype, device, 6, True)
    mq, mk = max(lens_q), max(lens_k)
    return {
        "qkvpacked": (lambda qkv, **kw: fa.flash_attn_qkvpacked_func(qkv, **kw),
                      lambda qkv, **kw: fa.flash_attn_func(*qkv.unbind(2), **kw), (qkv,)),
        "kvpacked": (lambda q, kv, **kw: fa.flash_attn_kvpacked_func(q, kv, **kw),
                     lambda q, kv, **kw: fa.flash_attn_func(q, *kv.unbind(2), **kw), (q, kv)),
        "varlen_qkvpacked": (
            lambda qkv, **kw: fa.flash_attn_varlen_qkvpacked_func(qkv, cu_q, mq, **kw),
            lambda qkv, **kw: fa.flash_attn_varlen_func(*qkv.unbind(1), cu_q, cu_q, mq, mq,
                                                        **kw), (vqkv,)),
        "varlen_kvpacked": (
            lambda q, kv, **kw: fa.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, mq, mk,
                                                                   **kw),
            lambda q, kv, **kw: fa.flash_attn_varlen_func(q, *kv.unbind(1), cu_q, cu_k, mq, mk,
                                                          **kw), (vq, vkv)),
    }


ENTRY_POINTS = ["qkvpacked", "kvpacked", "varlen_qkvpacked", "varlen_kvpacked"]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_options_are_passed_on(device, entry):
    """dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic and
    return_attn_probs reach the unpacked function: the same (out, lse, keep-mask) and gradients
    as calling it on the parts with the same generator state."""
    packed_call, unpacked_call, inputs = _packed_and_unpacked_calls(device, torch.float32)[entry]
    options = dict(dropout_p=0.25, softmax_scale=0.3, causal=True, window_size=(9, 2),
                   softcap=4.0, alibi_slopes=alibi_slopes("batch", 2, 4, device),
                   deterministic=True, return_attn_probs=True)
    torch.manual_seed(11)
    out, lse, keep = packed_call(*inputs, **options)
    torch.manual_seed(11)
    out2, lse2, keep2 = unpacked_call(*inputs, **options)
    assert keep is not None and torch.equal(keep, keep2)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, dout)
    unpacked_grads = torch.autograd.grad(out2, inputs, dout)
    assert all(torch.equal(g, g2) for g, g2 in zip(grads, unpacked_grads))
    out3, lse3, keep3 = packed_call(*inputs, return_attn_probs=True)  # no dropout: no mask
    assert keep3 is None and lse3.dtype == torch.float32
    assert torch.equal(out3, packed_call(*inputs))


def test_signatures_match_flash_attn():
    """flash-attn 2's names, argument order and defaults (then ours: learnable_sink)."""
    options = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
               ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
               ("deterministic", False), ("return_attn_probs", False)]
    empty = inspect.Parameter.empty
    expected = {
        fa.flash_attn_qkvpacked_func: [("qkv", empty)],
        fa.flash_attn_kvpacked_func: [("q", empty), ("kv", empty)],
        fa.flash_attn_varlen_qkvpacked_func: [("qkv", empty), ("cu_seqlens", empty),
                                              ("max_seqlen", empty)],
        fa.flash_attn_varlen_kvpacked_func: [("q", empty), ("kv", empty),
                                             ("cu_seqlens_q", empty), ("cu_seqlens_k", empty),
                                             ("max_seqlen_q", empty), ("max_seqlen_k", empty)],
    }
    for fn, leading in expected.items():
        params = [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]
        assert params == leading + options + [("learnable_sink", None)], fn.__name__
        assert fn.__name__ in fa.__all__ and "head_dim]" in inspect.getdoc(fn)


# ---- no copies ----------------------------------------------------------------------------
class _RecordOps(TorchDispatchMode):
    """Records the operators called below autograd (with their arguments)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


_COPY_OPS = {"aten::clone", "aten::contiguous", "aten::copy_", "aten::_to_copy", "aten::stack",
             "aten::cat"}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("layout", ["stacked", "heads_outer"])
def test_forward_reads_the_packed_tensor_in_place(device, entry, layout):
    """The attention operator gets views of the packed tensor (its storage, its strides) and
    nothing is copied on the way, whether the packing dim is outermost of the per-token
    block (torch.stack) or inside it (a [.., heads, 3, head_dim] tensor transposed)."""
    packed_call, _, inputs = _packed_and_unpacked_calls(device, torch.bfloat16)[entry]
    packed = inputs[-1]
    if layout == "heads_outer":  # same shape, the packing dim after the heads in memory
        shape = packed.shape[:-3] + (packed.shape[-2], packed.shape[-3], packed.shape[-1])
        packed = randn(shape, packed.dtype, device, 9).transpose(-3, -2).requires_grad_()
        inputs = inputs[:-1] + (packed,)
    pack_dim = packed.dim() - 3
    with _RecordOps() as recorded:
        out = packed_call(*inputs)
    names = [func._schema.name for func, _ in recorded.calls]
    assert not _COPY_OPS & set(names), names
    attention = [args for func, args in recorded.calls
                 if func._schema.name in ("flash_attn_ext::fwd", "flash_attn_ext::varlen_fwd")]
    assert len(attention) == 1
    parts = packed.unbind(pack_dim)
    for got, part in zip(attention[0][3 - len(parts):3], parts):
        assert got.data_ptr() == part.data_ptr() and got.stride() == part.stride()
    (grad,) = torch.autograd.grad(out, packed, torch.ones_like(out))
    assert grad.shape == packed.shape


# ---- bad inputs ---------------------------------------------------------------------------
BAD_PACKING = {
    "qkv_packs_2": (lambda t: fa.flash_attn_qkvpacked_func(t(2, 8, 2, 2, 16)), RuntimeError,
                    r"qkv must stack 3 tensors in dim 2"),
    "qkv_4d": (lambda t: fa.flash_attn_qkvpacked_func(t(8, 3, 2, 16)), RuntimeError,
               r"qkv must be a 5-D tensor \[batch, seqlen, 3, heads, head_dim\]"),
    "kv_packs_3": (lambda t: fa.flash_attn_kvpacked_func(t(2, 8, 2, 16), t(2, 8, 3, 2, 16)),
                   RuntimeError, r"kv must stack 2 tensors in dim 2"),
    "kv_4d": (lambda t: fa.flash_attn_kvpacked_func(t(2, 8, 2, 16), t(2, 8, 2, 16)),
              RuntimeError, r"kv must be a 5-D tensor"),
    "varlen_qkv_packs_2": (lambda t: fa.flash_attn_varlen_qkvpacked_func(
        t(8, 2, 2, 16), _i32([0, 8], "cpu"), 8), RuntimeError,
        r"qkv must stack 3 tensors in dim 1"),
    "varlen_qkv_5d": (lambda t: fa.flash_attn_varlen_qkvpacked_func(
        t(1, 8, 3, 2, 16), _i32([0, 8], "cpu"), 8), RuntimeError,
        r"qkv must be a 4-D tensor \[total, 3, heads, head_dim\]"),
    "varlen_kv_packs_3": (lambda t: fa.flash_attn_varlen_kvpacked_func(
        t(8, 2, 16), t(8, 3, 2, 16), _i32([0, 8], "cpu"), _i32([0, 8], "cpu"), 8, 8),
        RuntimeError, r"kv must stack 2 tensors in dim 1"),
    "varlen_kv_3d": (lambda t: fa.flash_attn_varlen_kvpacked_func(
        t(8, 2, 16), t(8, 2, 16), _i32([0, 8], "cpu"), _i32([0, 8], "cpu"), 8, 8),
        RuntimeError, r"kv must be a 4-D tensor"),
    "kv_not_a_tensor": (lambda t: fa.flash_attn_kvpacked_func(t(2, 8, 2, 16), [[1.0]]),
                        TypeError, r"kv must be a torch.Tensor"),
}


@pytest.mark.parametrize("case", list(BAD_PACKING))
def test_bad_packing_raises(case):
    call, exc, match = BAD_PACKING[case]
    with pytest.raises(exc, match=match):
        call(lambda *shape: torch.randn(shape))


# ---- paged KV cache under autograd (flash_attn_varlen_func with block_table) --------------
PAGE_SIZE = 16


class PagedCase:
    """Packed queries against a paged cache whose block tables share a prefix page between two
    sequences (so that page's gradient is a sum), leave pages unused, and fill unused table
    entries with -1."""

    def __init__(self, device, dtype, lens_q=(5, 0, 37, 1), lens_k=(40, 3, 70, 0),
                 heads=4, kv_heads=2, head_dim=32, seqused_k=None):
        self.lens_q, self.lens_k = list(lens_q), list(lens_k)
        batch = len(lens_q)
        max_pages = -(-max(lens_k) // PAGE_SIZE)
        num_pages = batch * max_pages + 3
        gen = torch.Generator().manual_seed(3)
        table = torch.randperm(num_pages, generator=gen)[:batch * max_pages].view(batch,
                                                                                 max_pages)
        for b, n in enumerate(self.lens_k):
            table[b, -(-n // PAGE_SIZE):] = -1  # entries past a sequence's keys: never read
        table[2, 0] = table[0, 0]  # sequences 0 and 2 share their first page
        self.table = table.to(torch.int32).to(device)
        self.k_pages = randn((num_pages, PAGE_SIZE, kv_heads, head_dim), dtype, device, 11, True)
        self.v_pages = randn((num_pages, PAGE_SIZE, kv_heads, head_dim), dtype, device, 12, True)
        self.q = randn((sum(lens_q), heads, head_dim), dtype, device, 13, True)
        self.cu_q = _cu_seqlens(self.lens_q, device)
        self.cu_k = _cu_seqlens(self.lens_k, device)
        self.seqused_k = None if seqused_k is None else _i32(seqused_k, device)

    def call(self, q, k_pages, v_pages, **options):
        return fa.flash_attn_varlen_func(q, k_pages, v_pages, self.cu_q, self.cu_k,
                                         max(self.lens_q), max(self.lens_k),
                                         block_table=self.table, seqused_k=self.seqused_k,
                                         **options)

    def gather(self, pages):
        """Each sequence's keys out of `pages`, packed [sum(lens_k), kv_heads, head_dim]
        (differentiable: a page read by two sequences gets both gradients)."""
        rows = []
        for b, n in enumerate(self.lens_k):
            r = torch.arange(n, device=pages.device)
            rows.append(pages[self.table[b].long()[r // PAGE_SIZE], r % PAGE_SIZE])
        return torch.cat(rows)

    def contiguous_call(self, q, k_pages, v_pages, **options):
        """The same attention through the non-paged varlen path on gathered copies."""
        return fa.flash_attn_varlen_func(q, self.gather(k_pages), self.gather(v_pages),
                                         self.cu_q, self.cu_k, max(self.lens_q),
                                         max(self.lens_k), seqused_k=self.seqused_k, **options)

    def reference(self, q, k_pages, v_pages, causal):
        return varlen_attention(q, self.gather(k_pages), self.gather(v_pages), self.cu_q,
                                self.cu_k, causal, seqused_k=self.seqused_k)

    def unused_pages(self):
        used = set()
        for b, n in enumerate(self.lens_k):
            used.update(self.table[b, :-(-n // PAGE_SIZE)].tolist())
        return [p for p in range(self.k_pages.shape[0]) if p not in used]


@pytest.mark.parametrize("dtype,causal,seqused_k", [
    (torch.float32, True, None), (torch.bfloat16, False, None),
    (torch.float16, True, (30, 3, 64, 0))], ids=str)
def test_paged_varlen_backward(device, dtype, causal, seqused_k):
    case = PagedCase(device, dtype, seqused_k=seqused_k)
    inputs = (case.q, case.k_pages, case.v_pages)
    out = case.call(*inputs, causal=causal)
    with torch.no_grad():  # the forward is the inference call's, bit for bit
        assert torch.equal(out, case.call(*inputs, causal=causal))
    dout = randn(out.shape, dtype, device, 14)
    grads = torch.autograd.grad(out, inputs, dout)
    assert [g.shape for g in grads] == [t.shape for t in inputs]
    ref, base = ref_and_base(lambda *t: case.reference(*t, causal), inputs, dout)
    check_out_and_grads(out, grads, ref, base, dtype, names=("dq", "dk_pages", "dv_pages"))
    unused = case.unused_pages()
    assert unused and all(not g[unused].any() for g in grads[1:])
    contiguous_out = case.contiguous_call(*inputs, causal=causal)
    _assert_same(out, contiguous_out.detach())
    for g, g2 in zip(grads, torch.autograd.grad(contiguous_out, inputs, dout)):
        _assert_same(g, g2)


def test_paged_varlen_backward_with_variants(device):
    """Dropout (the backward regenerates the forward's mask), window, softcap, ALiBi and GQA
    through the paged backward: the gradients of the contiguous call on gathered copies."""
    case = PagedCase(device, torch.float32, heads=6, kv_heads=2)
    inputs = (case.q, case.k_pages, case.v_pages)
    options = dict(dropout_p=0.25, causal=True, window_size=(24, 0), softcap=3.0,
                   alibi_slopes=alibi_slopes("batch", 4, 6, device), deterministic=True)
    torch.manual_seed(5)
    out = case.call(*inputs, **options)
    torch.manual_seed(5)
    contiguous_out = case.contiguous_call(*inputs, **options)
    _assert_same(out, contiguous_out.detach())
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, dout, retain_graph=True)
    for g, g2 in zip(grads, torch.autograd.grad(contiguous_out, inputs, dout)):
        _assert_same(g, g2)
    assert_grads_repeat(out, inputs, dout, grads, 2)  # deterministic=True: bit-identical


@pytest.mark.parametrize("needs_grad", ["q", "pages"])
def test_paged_varlen_backward_partial(device, needs_grad):
    """Only q, or only the pools, require grad: the others get none."""
    case = PagedCase(device, torch.float32)
    q, k_pages, v_pages = case.q, case.k_pages, case.v_pages
    if needs_grad == "q":
        k_pages, v_pages = k_pages.detach(), v_pages.detach()
    else:
        q = q.detach()
    out = case.call(q, k_pages, v_pages, causal=True)
    out.backward(torch.ones_like(out))
    assert (q.grad is not None) == (needs_grad == "q")
    assert (k_pages.grad is not None) == (v_pages.grad is not None) == (needs_grad == "pages")
    if needs_grad == "pages":
        assert k_pages.grad.shape == k_pages.shape


def test_paged_varlen_backward_without_keys(device):
    """max_seqlen_k = 0: out is zeros and so are all gradients (no empty k reaches the
    backward operator)."""
    q = randn((4, 2, 16), torch.float32, device, 1, True)
    k_pages = randn((3, PAGE_SIZE, 2, 16), torch.float32, device, 2, True)
    out = fa.flash_attn_varlen_func(q, k_pages, k_pages, _i32([0, 4], device),
                                    _i32([0, 0], device), 4, 0, block_table=_i32([[1]], device))
    dq, dk = torch.autograd.grad(out, (q, k_pages), torch.ones_like(out))
    assert not out.any() and not dq.any() and not dk.any() and dk.shape == k_pages.shape
