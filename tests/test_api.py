"""Operator registration, torch.compile, API behaviour and bad-input errors."""
import os
import subprocess
import sys

import pytest
import torch

import flash_attn_ext as fa
from helpers import make_qkv


def _op_args(device, dtype=torch.float32, causal=True, requires_grad=False):
    q, k, v = make_qkv(2, 37, 53, 3, 32, dtype, device, requires_grad=requires_grad)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_fwd(device, causal):
    q, k, v = _op_args(device)
    torch.library.opcheck(torch.ops.flash_attn_ext.fwd.default, (q, k, v, 0.2, causal, True, 0))
    q, k, v = _op_args(device, requires_grad=True)
    torch.library.opcheck(torch.ops.flash_attn_ext.fwd.default, (q, k, v, 0.2, causal, False, 0),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_bwd(device, causal):
    q, k, v = _op_args(device)
    out, lse = torch.ops.flash_attn_ext.fwd(q, k, v, 0.2, causal, True, 0)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.flash_attn_ext.bwd.default,
                          (dout, q, k, v, out, lse, 0.2, causal, True, False))


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_sdpa_inference_path(device, layout):
    # Without autograd, scaled_dot_product_attention is one sdpa_fwd call in [B,H,S,D]: the
    # same values as the autograd path, any strides, the mask and causal passed through.
    q, k, v = make_qkv(2, 33, 47, 4, 32, torch.float32, device, layout="bhsd",
                       requires_grad=False)
    if layout == "strided":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    mask = torch.rand(2, 1, 33, 47, device=device) > 0.3
    torch.library.opcheck(torch.ops.flash_attn_ext.sdpa_fwd.default,
                          (q, k, v, 0.25, True, 0.0, None, mask))
    with torch.no_grad():
        fast = fa.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    slow = fa.scaled_dot_product_attention(*(t.clone().requires_grad_() for t in (q, k, v)),
                                           attn_mask=mask, is_causal=True)
    assert fast.shape == q.shape and fast.stride() == slow.stride()
    torch.testing.assert_close(fast, slow.detach(), atol=0, rtol=0)


def test_opcheck_sdpa_layout(device):
    # [B,H,S,D] tensors seen as [B,S,H,D] through a transpose: outputs keep that layout
    q, k, v = (t.transpose(1, 2) for t in make_qkv(2, 33, 33, 4, 16, torch.float32, device,
                                                   layout="bhsd", requires_grad=False))
    torch.library.opcheck(torch.ops.flash_attn_ext.fwd.default, (q, k, v, 0.25, False, False, 0))
    out, _ = torch.ops.flash_attn_ext.fwd(q, k, v, 0.25, False, False, 0)
    assert out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("entry", ["flash_attn_func", "sdpa"])
def test_torch_compile_fullgraph(device, entry):
    torch._dynamo.reset()
    layout = "bshd" if entry == "flash_attn_func" else "bhsd"
    q, k, v = make_qkv(2, 40, 40, 2, 32, torch.float32, device, layout=layout)

    def f(q, k, v):
        if entry == "flash_attn_func":
            out = fa.flash_attn_func(q, k, v, causal=True)
        else:
            out = fa.scaled_dot_product_attention(q, k, v, is_causal=True)
        return (out * out).sum()

    compiled = torch.compile(f, fullgraph=True)
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    loss_eager = f(q2, k2, v2)
    grads_eager = torch.autograd.grad(loss_eager, (q2, k2, v2))
    torch.testing.assert_close(loss, loss_eager)
    for g, ge in zip(grads, grads_eager):
        torch.testing.assert_close(g, ge)


def test_sdpa_matches_torch(device):
    q, k, v = make_qkv(2, 50, 50, 4, 32, torch.float32, device, layout="bhsd", requires_grad=False)
    for causal in (False, True):
        ours = fa.scaled_dot_product_attention(q, k, v, is_causal=causal)
        theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert ours.shape == theirs.shape and ours.is_contiguous()
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_return_values(device):
    q, k, v = make_qkv(1, 10, 12, 2, 16, torch.float32, device, requires_grad=False)
    out = fa.flash_attn_func(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    out2, lse = fa.flash_attn_func(q, k, v, return_lse=True)
    assert lse.shape == (1, 2, 10) and lse.dtype == torch.float32
    out3, lse3, probs = fa.flash_attn_func(q, k, v, return_attn_probs=True)
    assert probs is None
    torch.testing.assert_close(out, out2)
    torch.testing.assert_close(lse, lse3)


def test_deterministic_flag(device):
    q, k, v = make_qkv(1, 70, 90, 2, 32, torch.float32, device)
    out = fa.flash_attn_func(q, k, v, causal=True, deterministic=True)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    for _ in range(3):
        again = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


# ---- unsupported features raise, never silently ignored ----------------------
def test_inference_calls_skip_autograd(device):
    """Without grad (torch.no_grad, or inputs that need none) the entry points call the
    operator directly: the same outputs, bit for bit, and nothing recorded."""
    q, k, v = make_qkv(2, 37, 45, 4, 32, torch.float32, device, requires_grad=True)
    for fn in (lambda q, k, v: fa.flash_attn_func(q, k, v, causal=True),
               lambda q, k, v: fa.scaled_dot_product_attention(
                   q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)):
        recorded = fn(q, k, v)
        assert recorded.grad_fn is not None
        with torch.no_grad():
            plain = fn(q, k, v)
        detached = fn(*(t.detach() for t in (q, k, v)))
        for out in (plain, detached):
            assert out.grad_fn is None and not out.requires_grad
            assert torch.equal(out, recorded.detach())


def test_not_implemented_sdpa_mask_grad():
    """No gradient is computed for attn_mask: a mask that requires grad is refused."""
    q, k, v = make_qkv(1, 8, 8, 2, 16, torch.float32, "cpu", layout="bhsd", requires_grad=False)
    mask = torch.zeros(8, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        fa.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with torch.no_grad():  # nothing to differentiate: accepted
        fa.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# ---- bad inputs: clear errors --------------------------------------------------
def _qkv(device="cpu", dtype=torch.float32, shape_q=(2, 16, 4, 32), shape_kv=(2, 24, 4, 32)):
    return (torch.randn(shape_q, device=device, dtype=dtype),
            torch.randn(shape_kv, device=device, dtype=dtype),
            torch.randn(shape_kv, device=device, dtype=dtype))


def _fwd(q, k, v):
    return torch.ops.flash_attn_ext.fwd(q, k, v, 0.125, False, True, 0)


BAD_INPUTS = {
    "int_dtype": (lambda d: [t.to(torch.int32) for t in _qkv(d)], "dtype"),
    "float64": (lambda d: [t.double() for t in _qkv(d)], "dtype"),
    "mixed_dtypes": (lambda d: (lambda q, k, v: (q, k.half(), v))(*_qkv(d)), "same dtype"),
    "wrong_rank": (lambda d: (lambda q, k, v: (q[0], k[0], v[0]))(*_qkv(d)), "4-D"),
    "batch_mismatch": (lambda d: _qkv(d, shape_kv=(3, 24, 4, 32)), "batch"),
    "heads_mismatch": (lambda d: _qkv(d, shape_kv=(2, 24, 3, 32)), "heads"),
    "head_dim_mismatch": (lambda d: _qkv(d, shape_kv=(2, 24, 4, 16)), "head_dim"),
    "k_v_mismatch": (lambda d: (lambda q, k, v: (q, k, v[:, :20]))(*_qkv(d)), "same shape"),
    "empty_seqlen": (lambda d: _qkv(d, shape_q=(2, 0, 4, 32)), "empty"),
    "empty_batch": (lambda d: _qkv(d, shape_q=(0, 16, 4, 32), shape_kv=(0, 24, 4, 32)), "empty"),
    "noncontiguous_last_dim": (lambda d: (lambda q, k, v: (q.transpose(-1, -2).contiguous().transpose(-1, -2)
                                                           [..., :16, :], k[..., :16, :], v[..., :16, :]))(
        *_qkv(d, shape_q=(2, 16, 4, 16), shape_kv=(2, 24, 4, 16))), "contiguous"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_raise(device, case):
    make, match = BAD_INPUTS[case]
    q, k, v = make(device)
    with pytest.raises((RuntimeError, ValueError, TypeError), match=match):
        _fwd(q, k, v)


def test_noncontiguous_last_dim_via_api_is_accepted():
    # The public API copies a tensor whose last dim is strided, as flash-attn does.
    k, v = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    q = torch.randn(1, 8, 16, 2).transpose(-1, -2)
    assert q.stride(-1) != 1
    out = fa.flash_attn_func(q, k, v)
    torch.testing.assert_close(out, fa.flash_attn_func(q.contiguous(), k, v))


def test_bad_rank_public_api():
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="4-D"):
        fa.scaled_dot_product_attention(q[0], k[0], v[0])
    with pytest.raises(TypeError, match="torch.Tensor"):
        fa.flash_attn_func(q.numpy(), k, v)
    # Every entry point names the argument that is not a 4-D tensor.
    with pytest.raises(TypeError, match="v must be a torch.Tensor.*list"):
        fa.flash_attn_func(q, k, v.tolist())
    with pytest.raises(TypeError, match="value must be a torch.Tensor"):
        fa.scaled_dot_product_attention(q, k, None)
    with pytest.raises(TypeError, match="k_cache must be a torch.Tensor"):
        fa.flash_attn_with_kvcache(q, "cache", v, cache_seqlens=1)
    with pytest.raises(RuntimeError, match="v_cache must be a 4-D"):
        fa.flash_attn_with_kvcache(q, k, v[0], cache_seqlens=1)


def test_mismatched_devices_meta():
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="device"):
        _fwd(q, k.to("meta"), v)


@pytest.mark.gpu
def test_mismatched_devices_cuda():
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="device"):
        _fwd(q.cuda(), k, v.cuda())


def test_bwd_bad_lse():
    q, k, v = _qkv()
    out, lse = _fwd(q, k, v)
    with pytest.raises(RuntimeError, match="lse"):
        torch.ops.flash_attn_ext.bwd(out, q, k, v, out, lse[:, :, :-1], 0.125, False, True, False)
    with pytest.raises(RuntimeError, match="dout"):
        torch.ops.flash_attn_ext.bwd(out[:, :-1], q, k, v, out, lse, 0.125, False, True, False)


def test_autotune_is_a_noop_on_cpu():
    q, k, v = make_qkv(1, 17, 17, 2, 32, torch.float32, "cpu", requires_grad=False)
    fa.autotune.clear_cache()
    expected = fa.flash_attn_func(q, k, v, causal=True)
    with fa.autotune.enabled():
        assert fa.autotune.is_enabled()
        out = fa.flash_attn_func(q, k, v, causal=True)
    assert not fa.autotune.is_enabled()
    assert torch.equal(out, expected)
    assert fa.autotune.cache_info()["entries"] == {}


def test_autotune_switch_and_cache_file(tmp_path):
    parse = fa.autotune.parse_env
    assert parse(None) == parse("") == parse("0") == parse("false") == (False, None)
    assert parse("1") == parse("true") == parse(" ON ") == (True, None)
    assert parse("/tmp/tune.json") == (True, "/tmp/tune.json")
    path = tmp_path / "tune.json"
    before = fa.autotune.is_enabled(), fa.autotune.cache_file()
    with fa.autotune.enabled(cache=path):
        assert fa.autotune.is_enabled() and fa.autotune.cache_file() == str(path)
        assert fa.autotune.cache_info()["file"] == str(path)
        with fa.autotune.enabled(False):  # the file stays
            assert not fa.autotune.is_enabled() and fa.autotune.cache_file() == str(path)
    assert (fa.autotune.is_enabled(), fa.autotune.cache_file()) == before
    # A stored winner is read back from the file (the CUDA test times and writes one).
    path.write_text('{"sm90|bfloat16|128|full|1|4096|256": [2, 3]}')
    fa.autotune.clear_cache()
    try:
        fa.autotune.enable(False, cache=path)
        with fa.autotune._lock:
            fa.autotune._load_cache_file()
        assert fa.autotune.cache_info()["entries"] == {"sm90|bfloat16|128|full|1|4096|256": (2, 3)}
    finally:
        fa.autotune.enable(before[0], cache=before[1] or "")
        fa.autotune.clear_cache()


def test_autotune_env_value_is_the_cache_file(tmp_path):
    path = str(tmp_path / "tune.json")
    code = ("import flash_attn_ext as fa; "
            "print(fa.autotune.is_enabled(), fa.autotune.cache_file())")
    env = dict(os.environ, FLASH_ATTN_EXT_AUTOTUNE=path)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", path]


def test_fwd_op_rejects_bad_tile():
    q, k, v = make_qkv(1, 4, 4, 1, 8, torch.float32, "cpu", requires_grad=False)
    with pytest.raises(RuntimeError, match="tile must be"):
        torch.ops.flash_attn_ext.fwd(q, k, v, 1.0, False, False, 0, 4)


def test_public_functions_document_their_shapes():
    """Every public function of the package has a docstring; those taking or returning
    tensors give their shapes."""
    import inspect
    modules = (fa, fa.autotune, fa.ops, fa.interface, fa.reference)
    for module in modules:
        for name, obj in vars(module).items():
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if getattr(obj, "__module__", "").split(".")[0] != "flash_attn_ext":
                continue
            assert inspect.getdoc(obj), f"{module.__name__}.{name} has no docstring"
    for fn in (fa.flash_attn_func, fa.scaled_dot_product_attention, fa.flash_attn_varlen_func,
               fa.flash_attn_with_kvcache, fa.attention_ref, fa.FlashAttnFunction,
               fa.FlashAttnVarlenFunction, fa.autotune.choose_forward_config):
        assert "head_dim]" in inspect.getdoc(fn), fn.__name__
