"""Loads the native operators and makes them autograd- and compile-friendly.

torch.ops.flash_attn_ext.fwd(q, k, v, softmax_scale, causal, causal_bottom_right, num_splits=0,
                             tile=0, seqused_k=None, *variants, block_table=None,
                             cache_batch_idx=None, cache_leftpad=None, k_descale=None,
                             v_descale=None) -> (out, lse)
torch.ops.flash_attn_ext.bwd(dout, q, k, v, out, lse, softmax_scale, causal,
                             causal_bottom_right, deterministic=False, seqused_k=None,
                             *variants, dq_accum=None, dsink=None) -> (dq, dk, dv)
torch.ops.flash_attn_ext.varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, softmax_scale, causal, seqused_k=None,
                                    *variants, block_table=None) -> (out, lse)
torch.ops.flash_attn_ext.varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                    deterministic=False, seqused_k=None, *variants,
                                    dq_accum=None, dsink=None) -> (dq, dk, dv)
with *variants = window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
dropout_p=0.0, rng_state=None, attn_mask=None, learnable_sink=None (flash-attn's window_size,
softcap, alibi_slopes and dropout_p, whose rng_state is an int64 [2] {seed, offset} on q's
device, torch SDPA's attn_mask, and gpt-oss's learnable sink, float32 [heads]: one more logit
per row with no value, counted in lse; the defaults turn them off). The backward operators'
dsink (float32 [heads], with learnable_sink) is added into: the sink's gradient,
-sum over each head's rows of exp(sink - lse) * rowsum(dout * out). The backward operators' dq_accum (float32 [batch,
heads, seqlen_q, head_dim], varlen [heads, total_q, head_dim]) is added into, dQ /
softmax_scale, instead of dq being returned (dq comes back empty): ring attention's steps add
into one accumulator and convert once. The forward operators also take flash-attn's KV cache
addressing (forward only): block_table int32 [batch, max_pages] with k / v page pools
[num_pages, page_size, heads_k, head_dim] (page_size a multiple of 16), cache_batch_idx and
cache_leftpad int32 [batch] (csrc/params.h). fwd's k_descale / v_descale (float32 [] / [1] or
[batch, heads_k] on q's device): k / v are an FP8 (torch.float8_e4m3fn) KV cache under a float16
/ bfloat16 q, whose real values are descale * the stored ones (required with an FP8 cache, an
error otherwise); out is in q's dtype.
torch.ops.flash_attn_ext.dropout_mask(rng_state, batch, heads, seqlen_q, seqlen_k, dropout_p)
    -> bool [batch, heads, seqlen_q, seqlen_k]: the elements that dropout keeps.
torch.ops.flash_attn_ext.sdpa_fwd(query, key, value, softmax_scale, causal, dropout_p=0.0,
                                  rng_state=None, attn_mask=None) -> (out, lse): fwd in torch
    SDPA's layout [batch, heads, seqlen, head_dim] (top-left causal), for calls without
    autograd (scaled_dot_product_attention's inference path).
torch.ops.flash_attn_ext.fwd_fp8(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal,
                                 causal_bottom_right, out_dtype) -> (out, lse): e4m3 q / k / v
    (flash_attn_ext/fp8.py; Hopper only, forward only).
torch.ops.flash_attn_ext.merge_partial_(out, lse, block_outs, block_lses, prev_out=None): folds
    1-8 blocks' partial results into the running (out, lse) in place by the log-sum-exp
    (ring attention's merge; prev_out: read the running output from there instead of out;
    a running result with lse -inf is not read).
torch.ops.flash_attn_ext.sum_partial_(out, pieces, prev=None): out = prev + the 1-8 pieces,
    added in float32 in order and rounded once (ring attention's gradient sums).

Padded tensors are [batch, seqlen, heads, head_dim] with a contiguous last dim and lse is
float32 [batch, heads, seqlen_q]; varlen tensors are packed [total, heads, head_dim] and
lse is [heads, total_q]. k/v may have fewer heads than q (GQA/MQA). This module registers
the fake (meta) kernels used by torch.compile / FakeTensor, and the torch.autograd.Functions
that the public API (interface.py) goes through.
"""
import inspect

import torch

try:
    from . import _C  # noqa: F401  (loading the library registers the operators)
except ImportError as e:  # pragma: no cover - only on broken installs
    raise ImportError(
        "flash_attn_ext: the native extension flash_attn_ext._C could not be loaded "
        f"({e}). Build it with `pip install --no-build-isolation .` against the torch "
        "you are running (the extension is tied to the torch version it was built with).") from e

from . import autotune  # noqa: E402

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def has_cuda_kernels() -> bool:
    """True when this build contains the CUDA kernels (False for a CPU-only build, where
    CUDA tensors raise)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("flash_attn_ext::fwd", "CUDA")


def _check_bshd(t, name, allow_fp8=False):
    if t.dim() != 4:
        raise RuntimeError(f"flash_attn_ext: {name} must be a 4-D tensor [batch, seqlen, heads, "
                           f"head_dim], got {t.dim()}-D with shape {tuple(t.shape)}")
    if t.dtype not in _SUPPORTED_DTYPES and not (allow_fp8 and t.dtype is torch.float8_e4m3fn):
        raise RuntimeError(f"flash_attn_ext: {name} has dtype {t.dtype}; expected float32, "
                           "float16 or bfloat16")


def _check_qkv(q, k, v, varlen=False, kv_batch_free=False, paged=False, fp8_kv=False):
    """kv_batch_free: k / v have a batch size of their own (a block table or cache_batch_idx
    picks their rows); paged: k / v are 4-D page pools [num_pages, page_size, heads_k,
    head_dim] (with varlen q); fp8_kv: k / v may be an FP8 (float8_e4m3fn) KV cache under a
    16-bit q (fwd with k_descale / v_descale)."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if paged and name != "q":
            _check_bshd(t, name)
        elif varlen:
            if t.dim() != 3:
                raise RuntimeError(f"flash_attn_ext: varlen {name} must be a 3-D tensor "
                                   f"[total_tokens, heads, head_dim], got shape {tuple(t.shape)}")
        else:
            _check_bshd(t, name, allow_fp8=fp8_kv and name != "q")
    fp8_kv = fp8_kv and k.dtype is torch.float8_e4m3fn and q.dtype in (torch.float16,
                                                                        torch.bfloat16)
    for t, name in ((k, "k"), (v, "v")):
        if fp8_kv and t.dtype is not torch.float8_e4m3fn:
            raise RuntimeError(f"flash_attn_ext: an FP8 KV cache needs k and v in "
                               f"torch.float8_e4m3fn, got {k.dtype} and {v.dtype}")
        if not fp8_kv and t.dtype != q.dtype:
            raise RuntimeError(f"flash_attn_ext: q and {name} must have the same dtype, got "
                               f"{q.dtype} and {t.dtype}")
        if t.device != q.device:
            raise RuntimeError(f"flash_attn_ext: q and {name} must be on the same device, got "
                               f"{q.device} and {t.device}")
    if k.shape[:-1] != v.shape[:-1]:
        raise RuntimeError(f"flash_attn_ext: k and v must have the same shape but for the last "
                           f"(head_dim) dimension, got {tuple(k.shape)} and {tuple(v.shape)}")
    if not varlen and not kv_batch_free:
        torch._check(q.shape[0] == k.shape[0],
                     lambda: "flash_attn_ext: q and k must have the same batch size")
    torch._check(q.shape[-2] % k.shape[-2] == 0, lambda: (
        "flash_attn_ext: the number of query heads must be a multiple of the number of "
        "key/value heads"))
    torch._check(q.shape[-1] == k.shape[-1],
                 lambda: "flash_attn_ext: q and k must have the same head_dim")


def _out_like(q, v):
    """The forward's out: q's shape with v's head dim (they differ in DeepSeek MLA), in q's
    memory layout, as the operators allocate it (ops_params.h, empty_out)."""
    if v.shape[-1] == q.shape[-1]:
        return torch.empty_like(q)
    order = sorted(range(q.dim()), key=lambda d: -q.stride(d))  # stable: ties in dim order
    sizes = [v.shape[-1] if d == q.dim() - 1 else q.shape[d] for d in order]
    inverse = [order.index(d) for d in range(q.dim())]
    return q.new_empty(sizes).permute(inverse)


@torch.library.register_fake("flash_attn_ext::fwd")
def _fwd_fake(q, k, v, softmax_scale, causal, causal_bottom_right, num_splits=0, tile=0,
              seqused_k=None, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
              dropout_p=0.0, rng_state=None, attn_mask=None, learnable_sink=None,
              block_table=None, cache_batch_idx=None, cache_leftpad=None, k_descale=None,
              v_descale=None):
    _check_qkv(q, k, v, kv_batch_free=block_table is not None or cache_batch_idx is not None,
               fp8_kv=k_descale is not None and v_descale is not None)
    out = _out_like(q, v)
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return out, lse


@torch.library.register_fake("flash_attn_ext::bwd")
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, causal_bottom_right,
              deterministic=False, seqused_k=None, window_left=-1, window_right=-1, softcap=0.0,
              alibi_slopes=None, dropout_p=0.0, rng_state=None, attn_mask=None,
              learnable_sink=None, dq_accum=None, dsink=None):
    _check_qkv(q, k, v)
    dq = torch.empty_like(q) if dq_accum is None else q.new_empty((0,))  # added into dq_accum
    return dq, torch.empty_like(k), torch.empty_like(v)


@torch.library.register_fake("flash_attn_ext::varlen_fwd")
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, causal, seqused_k=None, window_left=-1, window_right=-1,
                     softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None,
                     attn_mask=None, learnable_sink=None, block_table=None):
    _check_qkv(q, k, v, varlen=True, kv_batch_free=True, paged=block_table is not None)
    out = _out_like(q, v)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return out, lse


@torch.library.register_fake("flash_attn_ext::varlen_bwd")
def _varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, softmax_scale, causal, deterministic=False, seqused_k=None,
                     window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                     dropout_p=0.0, rng_state=None, attn_mask=None, learnable_sink=None,
                     dq_accum=None, dsink=None):
    _check_qkv(q, k, v, varlen=True)
    dq = torch.empty_like(q) if dq_accum is None else q.new_empty((0,))  # added into dq_accum
    return dq, torch.empty_like(k), torch.empty_like(v)


@torch.library.register_fake("flash_attn_ext::sdpa_fwd")
def _sdpa_fwd_fake(query, key, value, softmax_scale, causal, dropout_p=0.0, rng_state=None,
                   attn_mask=None):
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    _check_qkv(q, k, v)
    out = _out_like(q, v).transpose(1, 2)  # as fwd's, transposed back
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return out, lse


@torch.library.register_fake("flash_attn_ext::fwd_fp8")
def _fwd_fp8_fake(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal,
                  causal_bottom_right, out_dtype):
    out = q.new_empty(q.shape, dtype=out_dtype)
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return out, lse


@torch.library.register_fake("flash_attn_ext::varlen_fwd_fp8")
def _varlen_fwd_fp8_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         q_descale, k_descale, v_descale, softmax_scale, causal, out_dtype):
    out = q.new_empty(q.shape, dtype=out_dtype)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return out, lse


@torch.library.register_fake("flash_attn_ext::dropout_mask")
def _dropout_mask_fake(rng_state, batch, heads, seqlen_q, seqlen_k, dropout_p):
    return rng_state.new_empty((batch, heads, seqlen_q, seqlen_k), dtype=torch.bool)


# The variants' defaults (window_left, window_right, softcap, alibi_slopes, dropout_p,
# rng_state, attn_mask, learnable_sink): off.
_NO_VARIANTS = (-1, -1, 0.0, None, 0.0, None, None, None)


@torch.library.register_fake("flash_attn_ext::merge_partial_")
def _merge_partial_fake(out, lse, block_outs, block_lses, prev_out=None):
    return None


@torch.library.register_fake("flash_attn_ext::sum_partial_")
def _sum_partial_fake(out, pieces, prev=None):
    return None


def _with_variant_defaults(inputs, n_before):
    """apply()'s inputs with the variants' defaults filled in (torch.compile passes only the
    arguments given)."""
    return tuple(inputs) + _NO_VARIANTS[len(inputs) - n_before:]


def _has_variants(window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state,
                  attn_mask, learnable_sink=None):
    """Whether a variant is on (a learnable sink is not one: every kernel takes it)."""
    return ((window_left, window_right, softcap, dropout_p) != (-1, -1, 0.0, 0.0)
            or alibi_slopes is not None or attn_mask is not None)


def new_rng_state(device):
    """A fresh dropout rng_state (int64 [2] = {seed, offset}) on `device`, drawn from torch's
    default generator of that device: torch.manual_seed reproduces it, it needs no host
    synchronisation, and CUDA graphs and torch.compile capture it like any random op."""
    return torch.randint(-2**63, 2**63 - 1, (2,), dtype=torch.int64, device=device)


def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _sink_grad_buffer(ctx, index, learnable_sink):
    """The zeroed float32 dsink the backward operators add the sink's gradient into, when the
    sink (input `index` of the Function) needs one; else None."""
    if learnable_sink is None or not ctx.needs_input_grad[index]:
        return None
    return torch.zeros_like(learnable_sink, dtype=torch.float32)


class FlashAttnFunction(torch.autograd.Function):
    """out, lse = FlashAttnFunction.apply(q, k, v, softmax_scale, causal, causal_bottom_right,
    deterministic, num_splits, tile, seqused_k, window_left=-1, window_right=-1, softcap=0.0,
    alibi_slopes=None, dropout_p=0.0, rng_state=None, attn_mask=None, learnable_sink=None)

    q [batch, seqlen_q, heads, head_dim], k / v [batch, seqlen_k, heads_k, head_dim]
    (heads % heads_k == 0; any strides, a non-contiguous last dim is copied) -> out
    [batch, seqlen_q, heads, head_dim] (q's dtype) and lse float32 [batch, heads, seqlen_q],
    returned but not differentiable. The backward gives dq, dk, dv shaped like q, k, v.
    num_splits = 0 and tile = 0 mean "choose": by the built-in heuristics, or by timing
    when the autotuner is on (flash_attn_ext.autotune). seqused_k: None or int32 [batch].
    window_left / window_right / softcap / alibi_slopes / dropout_p (with rng_state, which the
    backward reuses) and attn_mask (torch SDPA's, [batch|1, heads|1, seqlen_q|1, seqlen_k|1],
    not differentiable): the variants (interface.py), aligned like causal
    (causal_bottom_right). learnable_sink: float32 [heads] (gets a gradient)."""

    @staticmethod
    def forward(q, k, v, softmax_scale, causal, causal_bottom_right, deterministic, num_splits,
                tile, seqused_k, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                dropout_p=0.0, rng_state=None, attn_mask=None, learnable_sink=None):
        """(out [batch, seqlen_q, heads, head_dim], lse float32 [batch, heads, seqlen_q])
        from q [batch, seqlen_q, heads, head_dim], k, v [batch, seqlen_k, heads_k, head_dim]."""
        q, k, v = [_last_dim_contiguous(t) for t in (q, k, v)]
        variants = (window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state,
                    attn_mask, learnable_sink)
        if (num_splits == 0 and tile == 0 and seqused_k is None and autotune.is_enabled()
                and not _has_variants(*variants)):
            num_splits, tile = autotune.choose_forward_config(q, k, v, softmax_scale, causal,
                                                              causal_bottom_right)
        # The overload itself: resolving it on the packet costs ~0.8 us per call.
        return torch.ops.flash_attn_ext.fwd.default(q, k, v, softmax_scale, causal,
                                                    causal_bottom_right, num_splits, tile,
                                                    seqused_k, *variants)

    @staticmethod
    def setup_context(ctx, inputs, output):
        """Saves q, k, v, out, lse (and seqused_k) and the flags for the backward."""
        (q, k, v, softmax_scale, causal, causal_bottom_right, deterministic, _, _, seqused_k,
         window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state,
         attn_mask, learnable_sink) = _with_variant_defaults(inputs, 10)
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, seqused_k, alibi_slopes, rng_state, attn_mask,
                              learnable_sink)
        ctx.variants = (window_left, window_right, softcap)
        ctx.dropout_p = dropout_p
        ctx.softmax_scale = softmax_scale
        ctx.causal = causal
        ctx.causal_bottom_right = causal_bottom_right
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx, dout, _dlse):
        """dout [batch, seqlen_q, heads, head_dim] -> dq, dk, dv shaped like q, k, v (None for
        the other inputs); lse's gradient is ignored."""
        (q, k, v, out, lse, seqused_k, alibi_slopes, rng_state, attn_mask,
         learnable_sink) = ctx.saved_tensors
        q, k, v, dout = [_last_dim_contiguous(t) for t in (q, k, v, dout)]
        dsink = _sink_grad_buffer(ctx, 17, learnable_sink)
        dq, dk, dv = torch.ops.flash_attn_ext.bwd(dout, q, k, v, out, lse, ctx.softmax_scale,
                                                  ctx.causal, ctx.causal_bottom_right,
                                                  ctx.deterministic, seqused_k, *ctx.variants,
                                                  alibi_slopes, ctx.dropout_p, rng_state,
                                                  attn_mask, learnable_sink, dsink=dsink)
        return (dq, dk, dv) + (None,) * 14 + (dsink,)


class FlashAttnVarlenFunction(torch.autograd.Function):
    """out, lse = FlashAttnVarlenFunction.apply(q, k, v, cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k, softmax_scale, causal, deterministic, seqused_k,
    window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, dropout_p=0.0,
    rng_state=None, attn_mask=None, learnable_sink=None)

    Packed sequences: q [total_q, heads, head_dim], k / v [total_k, heads_k, head_dim],
    cu_seqlens_q / cu_seqlens_k int32 [batch + 1], seqused_k None or int32 [batch] -> out
    [total_q, heads, head_dim] and lse float32 [heads, total_q] (not differentiable). The
    backward gives dq, dk, dv shaped like q, k, v. attn_mask must be None (the operators
    take none with packed sequences; it keeps the variants in FlashAttnFunction's order);
    learnable_sink as FlashAttnFunction's."""

    @staticmethod
    def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                causal, deterministic, seqused_k, window_left=-1, window_right=-1, softcap=0.0,
                alibi_slopes=None, dropout_p=0.0, rng_state=None, attn_mask=None,
                learnable_sink=None):
        """(out [total_q, heads, head_dim], lse float32 [heads, total_q]) from packed q
        [total_q, heads, head_dim], k, v [total_k, heads_k, head_dim]."""
        q, k, v = [_last_dim_contiguous(t) for t in (q, k, v)]
        return torch.ops.flash_attn_ext.varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                   max_seqlen_q, max_seqlen_k, softmax_scale,
                                                   causal, seqused_k, window_left, window_right,
                                                   softcap, alibi_slopes, dropout_p, rng_state,
                                                   attn_mask, learnable_sink)

    @staticmethod
    def setup_context(ctx, inputs, output):
        """Saves q, k, v, out, lse, the cu_seqlens (and seqused_k) and the flags."""
        (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
         deterministic, seqused_k, window_left, window_right, softcap, alibi_slopes, dropout_p,
         rng_state, _, learnable_sink) = _with_variant_defaults(inputs, 11)
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                              alibi_slopes, rng_state, learnable_sink)
        ctx.variants = (window_left, window_right, softcap)
        ctx.dropout_p = dropout_p
        ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
        ctx.softmax_scale = softmax_scale
        ctx.causal = causal
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx, dout, _dlse):
        """dout [total_q, heads, head_dim] -> dq, dk, dv shaped like q, k, v (None for the
        other inputs)."""
        (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes,
         rng_state, learnable_sink) = ctx.saved_tensors
        q, k, v, dout = [_last_dim_contiguous(t) for t in (q, k, v, dout)]
        dsink = _sink_grad_buffer(ctx, 18, learnable_sink)
        dq, dk, dv = torch.ops.flash_attn_ext.varlen_bwd(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, ctx.max_seqlen_q,
            ctx.max_seqlen_k, ctx.softmax_scale, ctx.causal, ctx.deterministic, seqused_k,
            *ctx.variants, alibi_slopes, ctx.dropout_p, rng_state, None, learnable_sink,
            dsink=dsink)
        return (dq, dk, dv) + (None,) * 15 + (dsink,)


# torch.autograd.Function.apply binds the call's arguments to forward's signature with
# inspect.signature on every call when setup_context is defined; building the Signature object
# was about half of the ~27 us that apply() added per call (CPU, torch 2.15). inspect.signature
# returns a function's __signature__ as is, so it is built once here.
for _fn in (FlashAttnFunction, FlashAttnVarlenFunction):
    _fn.forward.__signature__ = inspect.signature(_fn.forward)
del _fn
