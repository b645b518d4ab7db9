"""FlashAttention's accuracy rule, shared by the numerical tests.

Our error against a float64 reference must be at most `factor` times the error of the
same computation done naively by PyTorch at the input precision, plus a small atol
(factor 2 for outputs, 3 for gradients).
"""
import torch

from flash_attn_ext import attention_ref


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def assert_fa_rule(ours, ref64, same_precision, factor, atol=1e-5, what="out"):
    assert torch.isfinite(ours).all(), f"{what}: non-finite values"
    err = max_err(ours, ref64)
    base = max_err(same_precision, ref64)
    assert err <= factor * base + atol, (
        f"{what}: max error {err:.3e} > {factor} x same-precision error {base:.3e} + {atol:.0e}")


def make_qkv(batch, seqlen_q, seqlen_k, heads, head_dim, dtype, device, layout="bshd",
             requires_grad=True, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def one(seqlen):
        shape = (batch, seqlen, heads, head_dim) if layout == "bshd" else (batch, heads, seqlen, head_dim)
        t = torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
        return t.requires_grad_(requires_grad)

    return one(seqlen_q), one(seqlen_k), one(seqlen_k)


def reference_and_baseline(q, k, v, dout, causal, bottom_right, layout="bshd", scale=None):
    """Returns ((out, dq, dk, dv) in float64, same in the input precision)."""
    results = []
    for upcast_dtype in (torch.float64, None):
        leaves = [t.detach().to(upcast_dtype or t.dtype).requires_grad_() for t in (q, k, v)]
        out = attention_ref(*leaves, softmax_scale=scale, causal=causal,
                            causal_bottom_right=bottom_right, upcast=False, layout=layout)
        grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
        results.append((out, *grads))
    return results


def kernel_names(fn):
    """Names of the CUDA kernels that fn() launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


# ---- references for GQA, key padding and varlen (per sequence) ----------------------
def randn(shape, dtype, device, seed, requires_grad=False):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    t = torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def gqa_attention(q, k, v, causal, bottom_right=True, layout="bshd", scale=None, **variant):
    """attention_ref at the inputs' precision, with k/v heads repeated over their query-head
    group (query head h uses kv head h // (H // H_kv)). `variant`: attention_ref's
    window_size / softcap / alibi_slopes. Returns (out, lse)."""
    head_axis = 2 if layout == "bshd" else 1
    groups = q.shape[head_axis] // k.shape[head_axis]
    k = k.repeat_interleave(groups, dim=head_axis)
    v = v.repeat_interleave(groups, dim=head_axis)
    return attention_ref(q, k, v, softmax_scale=scale, causal=causal,
                         causal_bottom_right=bottom_right, upcast=False, layout=layout,
                         return_lse=True, **variant)


def alibi_slopes(kind, batch=2, heads=4, device="cpu"):
    """ALiBi slopes for the variant tests: None, per head ([heads], the geometric ALiBi
    series) or per batch entry ([batch, heads], random)."""
    if kind is None:
        return None
    if kind == "head":
        return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)],
                            device=device)
    gen = torch.Generator().manual_seed(7)
    return (torch.rand((batch, heads), generator=gen) * 0.5).to(device)


def batch_entry(variant, b):
    """`variant` for batch entry b alone: [batch, heads] ALiBi slopes keep their row b."""
    slopes = variant.get("alibi_slopes")
    if slopes is None or slopes.dim() == 1:
        return variant
    return dict(variant, alibi_slopes=slopes[b:b + 1])


def padded_attention(q, k, v, causal, seqused_k=None, scale=None, **variant):
    """[B, S, H, D] attention where batch b only sees keys [0, seqused_k[b]); causal (and the
    variant's window / ALiBi) is bottom-right relative to seqused_k[b]. Returns (out, lse
    [B, H, Sq])."""
    if seqused_k is None:
        return gqa_attention(q, k, v, causal, scale=scale, **variant)
    outs, lses = [], []
    for b, n in enumerate(seqused_k.tolist()):
        o, l = gqa_attention(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], causal, scale=scale,
                             **batch_entry(variant, b))
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


def varlen_attention(q, k, v, cu_q, cu_k, causal, seqused_k=None, scale=None, **variant):
    """Packed [total, H, D] attention, one sequence at a time (causal and the variant's window
    / ALiBi bottom-right per sequence). Rows past cu_q[-1] get zeros. Returns (out [total_q, H,
    D], lse [H, cu_q[-1]])."""
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    used = None if seqused_k is None else seqused_k.tolist()
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        k_end = cu_k[b + 1] if used is None else cu_k[b] + used[b]
        o, l = gqa_attention(q[cu_q[b]:cu_q[b + 1]].unsqueeze(0), k[cu_k[b]:k_end].unsqueeze(0),
                             v[cu_k[b]:k_end].unsqueeze(0), causal, scale=scale,
                             **batch_entry(variant, b))
        outs.append(o[0])
        lses.append(l[0])
    outs.append(q.new_zeros((q.shape[0] - cu_q[-1], q.shape[1], v.shape[-1])))
    return torch.cat(outs), torch.cat(lses, dim=-1)


def ref_and_base(fn, tensors, dout=None):
    """Runs fn(*tensors) -> (out, lse) in float64 (the reference) and at the inputs' precision
    (the baseline of the FA rule). Returns [(out, lse, grads), ...] for the two, grads (w.r.t.
    `tensors`) only when dout is given."""
    results = []
    for dtype in (torch.float64, None):
        leaves = [t.detach().to(dtype or t.dtype).requires_grad_(dout is not None) for t in tensors]
        out, lse = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, dout.to(out.dtype)) if dout is not None else None
        results.append((out, lse, grads))
    return results


def check_lse(lse, ref_lse, dtype):
    """lse is -inf exactly where the reference is (rows that see no key), close elsewhere."""
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse must be -inf exactly on rows that see no key"
    assert (lse[~finite] == float("-inf")).all()
    if finite.any():
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        err = (lse[finite].double() - ref_lse[finite].double()).abs().max().item()
        assert err <= tol * max(1.0, ref_lse[finite].abs().max().item()), f"lse error {err:.3e}"


def check_out_and_grads(out, grads, ref, base, dtype, rows=None, names=("dq", "dk", "dv"),
                        grad_atol=1e-5):
    """FA rule: out within 2x, grads within 3x the same-precision error (+ grad_atol). `rows`
    optionally restricts the comparison of out to its first `rows` rows (varlen padding rows)."""
    (ref_out, _, ref_grads), (base_out, _, base_grads) = ref, base
    assert out.dtype == dtype and out.shape == ref_out.shape
    sl = slice(None) if rows is None else slice(0, rows)
    assert_fa_rule(out[sl], ref_out[sl], base_out[sl], 2, what="out")
    if grads is None:
        return
    for name, g, r, b in zip(names, grads, ref_grads, base_grads):
        assert g.dtype == dtype and g.shape == r.shape, f"{name}: {g.dtype} {tuple(g.shape)}"
        assert_fa_rule(g, r, b, 3, atol=grad_atol, what=name)


def make_varlen(lens_q, lens_k, heads, kv_heads, head_dim, dtype, device, pad_q=0, pad_k=0,
                seed=0, requires_grad=True):
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    total_q, total_k = sum(lens_q) + pad_q, sum(lens_k) + pad_k
    q = randn((total_q, heads, head_dim), dtype, device, seed, requires_grad)
    k = randn((total_k, kv_heads, head_dim), dtype, device, seed + 1, requires_grad)
    v = randn((total_k, kv_heads, head_dim), dtype, device, seed + 2, requires_grad)
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)


# opcheck's checks for our operators (the autograd check runs through FlashAttnFunction).
OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_autograd_registration")


def opcheck_varlen_ops(var, causal, heads=4, kv_heads=2):
    """torch.library.opcheck of varlen_fwd and varlen_bwd on a small CPU batch (an empty
    sequence, GQA), with the operators' trailing variant arguments `var`."""
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen([7, 0, 13], [5, 9, 0], heads, kv_heads, 16,
                                                    torch.float32, "cpu", requires_grad=False)
    args = (q, k, v, cu_q, cu_k, max_q, max_k, 0.25, causal, None, *var)
    torch.library.opcheck(torch.ops.flash_attn_ext.varlen_fwd.default, args,
                          test_utils=OPCHECK_UTILS)
    out, lse = torch.ops.flash_attn_ext.varlen_fwd(*args)
    torch.library.opcheck(torch.ops.flash_attn_ext.varlen_bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                           0.25, causal, False, None, *var), test_utils=OPCHECK_UTILS)


def assert_grads_repeat(out, inputs, dout, grads, repeats):
    """The backward of `out` run `repeats` more times gives bit-identical `grads`."""
    for _ in range(repeats):
        again = torch.autograd.grad(out, inputs, dout, retain_graph=True)
        for a, b in zip(grads, again):
            assert torch.equal(a, b)


def assert_compiled_matches_eager(f, inputs):
    """torch.compile(f, fullgraph=True) gives f's scalar loss and its gradients."""
    loss = torch.compile(f, fullgraph=True)(*inputs)
    grads = torch.autograd.grad(loss, inputs)
    eager = f(*inputs)
    eager_grads = torch.autograd.grad(eager, inputs)
    torch.testing.assert_close(loss, eager)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e)


def capture_cuda_graph(step):
    """Warms step() up twice on a side stream (allocations and lazy setup outside the graph),
    then captures one call in a CUDA graph. Returns (graph, the captured call's outputs, which
    each replay rewrites)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs
