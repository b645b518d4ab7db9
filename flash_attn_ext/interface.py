"""Public entry points.

flash_attn_func              flash-attn's API and layout: [batch, seqlen, heads, head_dim],
                             causal aligned to the bottom-right corner when seqlen_q != seqlen_k.
scaled_dot_product_attention torch SDPA's API and layout: [batch, heads, seqlen, head_dim],
                             causal aligned to the top-left corner (a drop-in replacement).
flash_attn_varlen_func       packed variable-length sequences (cu_seqlens), flash-attn's API.
flash_attn_qkvpacked_func, flash_attn_kvpacked_func, flash_attn_varlen_qkvpacked_func,
flash_attn_varlen_kvpacked_func
                             flash-attn's packed-input variants (q, k, v or k, v stacked in
                             one tensor): views of it into the functions above.
flash_attn_with_kvcache      decoding against a KV cache (in-place append; paged caches,
                             rotary embeddings, cache_batch_idx, left padding), forward only.

All reach the same kernels through strides: no copy when the last dim is contiguous. k/v
may have fewer heads than q (grouped-query / multi-query attention) everywhere.
"""
import math
import numbers
import operator
from typing import Optional, Tuple

import torch

from . import autotune as _autotune
from . import fp8 as _fp8
from . import kvcache as _kvcache
from .ops import FlashAttnFunction, FlashAttnVarlenFunction, _sink_grad_buffer, new_rng_state


def _not_implemented(what):
    raise NotImplementedError(f"flash_attn_ext: {what} is not implemented yet")


def _run(function, *args):
    """function.apply(*args) when autograd has something to record, else its forward
    directly: the same operator call without apply's argument binding (about two thirds of a
    small call's host time, CPU, torch 2.15), for inference and torch.no_grad()."""
    # (q, k, v, and the learnable sink, the last argument where given)
    if torch.is_grad_enabled() and (any(t.requires_grad for t in args[:3]) or (
            isinstance(args[-1], torch.Tensor) and args[-1].requires_grad)):
        return function.apply(*args)
    return function.forward(*args)


def _check_rank(t, name, layout):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"flash_attn_ext: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise RuntimeError(f"flash_attn_ext: {name} must be a 4-D tensor {layout}, got "
                           f"{t.dim()}-D with shape {tuple(t.shape)}")


def _check_ranks(tensors, names, layout):
    """_check_rank of each tensor, after one test that passes for every valid call (three
    separate checks cost ~0.6 us per call)."""
    a, b, c = tensors
    try:
        if a.dim() == 4 and b.dim() == 4 and c.dim() == 4:
            return
    except AttributeError:  # not tensors: _check_rank names the culprit
        pass
    for t, name in zip(tensors, names):
        _check_rank(t, name, layout)


def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _default_scale(head_dim):
    return 1.0 / math.sqrt(head_dim)


def _dropout_args(dropout_p, device):
    """dropout_p -> (dropout_p, rng_state) for the operators: a fresh rng_state from torch's
    generator of `device` when dropout is on (the backward reuses it), else None."""
    if type(dropout_p) is float and dropout_p == 0.0:  # the common call, without the checks
        return 0.0, None
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError("flash_attn_ext: dropout_p must be a float, got "
                        f"{type(dropout_p).__name__}")
    if not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"flash_attn_ext: dropout_p must be in [0, 1), got {dropout_p}")
    dropout_p = float(dropout_p)
    return dropout_p, (new_rng_state(device) if dropout_p > 0.0 else None)


def _dropout_keep_mask(dropout, batch, heads, seqlen_q, seqlen_k):
    """return_attn_probs' third value: the bool keep-mask [batch, heads, seqlen_q, seqlen_k]
    of this call's dropout (None without dropout)."""
    dropout_p, rng_state = dropout
    if rng_state is None:
        return None
    return torch.ops.flash_attn_ext.dropout_mask(rng_state, batch, heads, seqlen_q, seqlen_k,
                                                 dropout_p)


_NO_VARIANTS = (-1, -1, 0.0, None)
# The operators of the no-grad fast paths, looked up once (torch.ops' attribute chain costs
# ~0.2 us per call).
_FWD_OP = torch.ops.flash_attn_ext.fwd.default
_SDPA_FWD_OP = torch.ops.flash_attn_ext.sdpa_fwd.default


def _no_variants(window_size, softcap, alibi_slopes):
    """Whether the call has no variant, passed with the defaults' types (the common call)."""
    return (alibi_slopes is None and type(softcap) is float and softcap == 0.0
            and type(window_size) is tuple and window_size == (-1, -1))


def _variant_args(window_size, softcap, alibi_slopes):
    """flash-attn's window_size / softcap / alibi_slopes -> the operators' (window_left,
    window_right, softcap, alibi_slopes), checked. The tensor's dtype, shape and device are
    checked by the operators."""
    if _no_variants(window_size, softcap, alibi_slopes):  # without the checks' per-call cost
        return _NO_VARIANTS
    try:
        left, right = (operator.index(w) for w in window_size)
    except (TypeError, ValueError):
        raise TypeError("flash_attn_ext: window_size must be a pair of ints (left, right), got "
                        f"{window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError("flash_attn_ext: window_size entries must be >= 0, or -1 for unbounded, "
                         f"got {(left, right)}")
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"flash_attn_ext: softcap must be a float, got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"flash_attn_ext: softcap must be a finite number >= 0 (0 = off), got "
                         f"{softcap}")
    if alibi_slopes is not None and not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError("flash_attn_ext: alibi_slopes must be None or a float32 tensor [heads] or "
                        f"[batch, heads], got {type(alibi_slopes).__name__}")
    return left, right, float(softcap), alibi_slopes


_SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _sink_arg(learnable_sink, heads, device):
    """learnable_sink as the operators take it: float32 [heads] on q's device, contiguous. A
    float16 / bfloat16 sink (a model's parameter in its dtype) is cast here, differentiably, so
    its gradient comes back in its own dtype."""
    if learnable_sink is None:
        return None
    if not isinstance(learnable_sink, torch.Tensor):
        raise TypeError("flash_attn_ext: learnable_sink must be None or a tensor [heads], got "
                        f"{type(learnable_sink).__name__}")
    if learnable_sink.dtype not in _SINK_DTYPES:
        raise RuntimeError("flash_attn_ext: learnable_sink must be float32, bfloat16 or float16, "
                           f"got {learnable_sink.dtype}")
    if tuple(learnable_sink.shape) != (heads,):
        raise RuntimeError(f"flash_attn_ext: learnable_sink must have shape [heads] = [{heads}] "
                           f"(one logit per query head), got {tuple(learnable_sink.shape)}")
    if learnable_sink.device != device:
        raise RuntimeError(f"flash_attn_ext: learnable_sink must be on the device of q ({device}),"
                           f" got {learnable_sink.device}")
    return learnable_sink.float().contiguous()


def flash_attn_func(q, k, v, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                    softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
                    return_attn_probs: bool = False, return_lse: bool = False,
                    num_splits: int = 0, seqused_k: Optional[torch.Tensor] = None,
                    q_descale=None, k_descale=None, v_descale=None, out_dtype=None,
                    learnable_sink: Optional[torch.Tensor] = None):
    """Exact attention, flash-attn compatible.

    q: [batch, seqlen_q, heads, head_dim]; k, v: [batch, seqlen_k, heads_k, head_dim] with
    heads % heads_k == 0 (GQA; heads_k = 1 is MQA: query head h uses kv head
    h // (heads // heads_k)); v may have a head dim of its own (DeepSeek MLA, e.g. 192 / 128),
    which out then has; float16, bfloat16 or float32, on CPU or CUDA. softmax_scale
    defaults to 1/sqrt(head_dim) (q's). causal=True masks key j for query i unless
    j <= i + seqlen_k - seqlen_q (bottom-right alignment, as flash-attn >= 2.1).
    window_size=(left, right): sliding window, key j visible to query i iff
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (-1 = unbounded;
    causal=True sets right = 0). softcap > 0: scores s (already scaled by softmax_scale)
    become softcap * tanh(s / softcap). alibi_slopes: float32 [heads] or [batch, heads], adds
    -slope * |i + seqlen_k - seqlen_q - j| to the scores (after the softcap). All of them
    work on the CPU and on CUDA in every dtype.
    deterministic=True makes the backward bit-reproducible.
    num_splits: split-KV for the CUDA forward (0 = heuristic, 1 = off, n = force n).
    seqused_k: optional int32 tensor [batch] on q's device: batch b only attends to keys
    [0, seqused_k[b]) (key padding; values are clamped to [0, seqlen_k]); causal alignment
    and gradients follow, and unused keys get zero dk / dv.

    dropout_p: probability of dropping an attention probability (flash-attn's and torch's
    dropout: kept ones are scaled by 1 / (1 - p)), taken to a multiple of 1/256 (at least
    1/256 when p > 0), the resolution of flash-attn's (and so torch's flash backend's) 8-bit
    random numbers; the mask comes from torch's generator of
    q's device (torch.manual_seed reproduces it) and the backward regenerates it. Pass 0.0
    at evaluation time, as with flash-attn.

    Returns out [batch, seqlen_q, heads, head_dim of v]; with return_lse=True (out, lse) and with
    return_attn_probs=True (out, lse, keep), lse being float32 [batch, heads, seqlen_q]
    (natural log of the softmax denominator before dropout; -inf for rows that see no key)
    and keep the bool dropout keep-mask [batch, heads, seqlen_q, seqlen_k] (None without
    dropout; materialised, so for small problems).

    learnable_sink: [heads] (float32, or bfloat16 / float16, cast to float32), gpt-oss's
    attention sink: every row of query head h gets one more logit, sink[h], in its softmax
    denominator, with no value (its probability is dropped from out, as transformers' eager
    gpt-oss attention), and lse includes it. Differentiable (d_sink is computed by the
    backward, deterministically); works with every other option above, GQA and dropout.

    FP8 (FlashAttention-3's arguments; Hopper GPUs, forward only): q, k, v in
    torch.float8_e4m3fn with q_descale, k_descale, v_descale float32 dequantisation factors
    (the real tensor is descale * the stored values), each [] / [1] (per tensor) or
    [batch, heads_k] (per batch entry and kv head; q's too, as FA3). out is bfloat16, or
    out_dtype=torch.float16. causal, GQA and both alignments as above; the other options
    raise NotImplementedError with FP8 inputs. flash_attn_ext.fp8.quantize_fp8 makes such
    inputs; flash_attn_ext.fp8.hadamard_transform rotates q and k first when they have
    outlier channels.
    """
    if q.dtype is _fp8.FP8_DTYPE or q_descale is not None:
        if learnable_sink is not None:
            _not_implemented("learnable_sink with FP8 inputs")
        return _flash_attn_func_fp8(q, k, v, dropout_p, softmax_scale, causal, window_size,
                                    softcap, alibi_slopes, return_attn_probs, return_lse,
                                    num_splits, seqused_k, q_descale, k_descale, v_descale,
                                    out_dtype)
    if k_descale is not None or v_descale is not None or out_dtype is not None:
        raise ValueError("flash_attn_ext: q_descale / k_descale / v_descale / out_dtype apply to "
                         "FP8 (torch.float8_e4m3fn) inputs only")
    variants = _variant_args(window_size, softcap, alibi_slopes)
    _check_ranks((q, k, v), ("q", "k", "v"), "[batch, seqlen, heads, head_dim]")
    dropout = _dropout_args(dropout_p, q.device)
    scale = _default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    sink = _sink_arg(learnable_sink, q.shape[2], q.device)
    out, lse = _run(FlashAttnFunction, q, k, v, scale, bool(causal), True, bool(deterministic),
                    int(num_splits), 0, seqused_k, *variants, *dropout, None, sink)
    if return_attn_probs:
        return out, lse, _dropout_keep_mask(dropout, q.shape[0], q.shape[2], q.shape[1],
                                            k.shape[1])
    if return_lse:
        return out, lse
    return out


def _flash_attn_func_fp8(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                         alibi_slopes, return_attn_probs, return_lse, num_splits, seqused_k,
                         q_descale, k_descale, v_descale, out_dtype):
    """flash_attn_func with FP8 inputs (flash_attn_ext/fp8.py)."""
    _check_ranks((q, k, v), ("q", "k", "v"), "[batch, seqlen, heads, head_dim]")
    if _variant_args(window_size, softcap, alibi_slopes) != _NO_VARIANTS or dropout_p != 0.0:
        _not_implemented("window_size / softcap / alibi_slopes / dropout_p with FP8 inputs")
    if seqused_k is not None or return_attn_probs:
        _not_implemented("seqused_k / return_attn_probs with FP8 inputs")
    return _fp8_call(q, k, v, softmax_scale, causal, q_descale, k_descale, v_descale, out_dtype,
                     return_lse)


def _fp8_call(q, k, v, softmax_scale, causal, q_descale, k_descale, v_descale, out_dtype,
              return_lse, varlen=None):
    """The FP8 forward (flash_attn_ext/fp8.py) once the entry point has refused what it does
    not take; varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) or None."""
    scale = _default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out, lse = _fp8.flash_attn_fp8(q, k, v, scale, bool(causal), q_descale, k_descale,
                                   v_descale, out_dtype, varlen=varlen)
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False,
                                 learnable_sink: Optional[torch.Tensor] = None):
    """Drop-in replacement for torch.nn.functional.scaled_dot_product_attention.

    query: [batch, heads, seqlen_q, head_dim]; key, value: [batch, heads_k, seqlen_k,
    head_dim], heads_k == heads unless enable_gqa=True (then heads % heads_k == 0).
    is_causal=True uses torch's top-left alignment (key j visible to query i iff j <= i).
    scale defaults to 1/sqrt(head_dim). attn_mask: bool (True = attend) or an additive float
    (float32 / float16 / bfloat16) mask broadcastable to [batch, heads, seqlen_q, seqlen_k],
    read in place with its strides (broadcast dimensions are never expanded, nothing is
    copied); it may be combined with
    is_causal. Rows that a mask leaves without any key give zeros (torch's math backend gives
    NaN there). A mask that requires grad raises NotImplementedError (no gradient is computed
    for it). dropout_p as torch's (applied whenever > 0; from torch's generator).
    learnable_sink: [heads], as flash_attn_func's (an extension of torch's signature; it gets
    a gradient too).
    Returns [batch, heads, seqlen_q, head_dim] in query's dtype; gradients flow to query,
    key and value (same shapes as the inputs).
    """
    _check_ranks((query, key, value), ("query", "key", "value"),
                 "[batch, heads, seqlen, head_dim]")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError("flash_attn_ext: attn_mask must be None or a tensor, got "
                            f"{type(attn_mask).__name__}")
        if attn_mask.requires_grad and torch.is_grad_enabled():
            _not_implemented("the gradient of attn_mask (pass a mask that does not require "
                             "grad, e.g. attn_mask.detach())")
        if attn_mask.dim() == 0:
            raise RuntimeError("flash_attn_ext: attn_mask must have at least one dimension "
                               "(broadcastable to [batch, heads, seqlen_q, seqlen_k]), got a "
                               "0-dim tensor")
    if not enable_gqa and key.shape[1] != query.shape[1]:
        raise RuntimeError(
            f"flash_attn_ext: query has {query.shape[1]} heads but key/value have "
            f"{key.shape[1]}; pass enable_gqa=True for grouped-query attention")
    dropout = _dropout_args(dropout_p, query.device)
    softmax_scale = _default_scale(query.shape[-1]) if scale is None else float(scale)
    sink = _sink_arg(learnable_sink, query.shape[1], query.device)
    if not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                         or value.requires_grad)) and not _autotune.is_enabled() \
            and sink is None:
        # Nothing to record: one operator call in this layout (no Python transposes).
        if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
            query, key, value = (_last_dim_contiguous(query), _last_dim_contiguous(key),
                                 _last_dim_contiguous(value))
        return _SDPA_FWD_OP(query, key, value, softmax_scale, bool(is_causal), *dropout,
                            attn_mask)[0]
    q, k, v = [t.transpose(1, 2) for t in (query, key, value)]
    out, _ = _run(FlashAttnFunction, q, k, v, softmax_scale, bool(is_causal), False, False, 0, 0,
                  None, -1, -1, 0.0, None, *dropout, attn_mask, sink)
    return out.transpose(1, 2)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                           max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes=None, deterministic: bool = False,
                           return_attn_probs: bool = False, return_lse: bool = False,
                           seqused_k: Optional[torch.Tensor] = None, block_table=None,
                           q_descale=None, k_descale=None, v_descale=None, out_dtype=None,
                           learnable_sink: Optional[torch.Tensor] = None):
    """Exact attention over a batch of packed variable-length sequences (flash-attn's API).

    q: [total_q, heads, head_dim]; k, v: [total_k, heads_k, head_dim] (heads % heads_k == 0;
    v's head dim may differ, as in flash_attn_func).
    cu_seqlens_q / cu_seqlens_k: int32 [batch + 1] on q's device, starting at 0 and
    non-decreasing: sequence b is rows cu_seqlens[b]:cu_seqlens[b+1] (zero-length sequences
    are allowed). max_seqlen_q / max_seqlen_k: at least the longest sequence. causal is
    aligned bottom-right within each sequence. seqused_k (int32 [batch]) further limits the
    keys of each sequence. On a GPU the cu_seqlens values are not read on the host (no sync:
    the call can be captured in a CUDA graph): bad values give wrong rows, never accesses
    outside the tensors; FLASH_ATTN_EXT_DEBUG_CHECKS=1 checks them (one device-to-host copy)
    and raises. CPU tensors are always checked.
    window_size, softcap and alibi_slopes as in flash_attn_func, per sequence (alibi_slopes
    [batch, heads] has one row per sequence).

    dropout_p as in flash_attn_func (rows and keys numbered within each sequence).
    learnable_sink ([heads]) as in flash_attn_func.

    block_table (int32 [batch, max_pages]): k and v are then the page pools of a paged KV
    cache, [num_pages, page_size, heads_k, head_dim] with page_size a multiple of 16, and
    sequence b's keys are its first cu_seqlens_k[b + 1] - cu_seqlens_k[b] cache rows, row r
    at slot r % page_size of page block_table[b, r // page_size] (chunked prefill against a
    paged cache). Differentiable: the forward is the same paged kernel call as without grad;
    the backward gathers each sequence's pages (max_seqlen_k rows per sequence, a temporary
    copy) and gives dk / dv shaped like the pools, summed over the sequences that share a page.

    Returns out [total_q, heads, head_dim]; with return_lse also lse float32 [heads, total_q];
    with return_attn_probs (out, lse, keep), keep the dropout keep-mask [batch, heads,
    max_seqlen_q, max_seqlen_k] (sequence b's in keep[b, :, :len_q, :len_k]; None without
    dropout).

    FP8 as in flash_attn_func (q, k, v in torch.float8_e4m3fn with q_descale, k_descale,
    v_descale: [] / [1], or [batch, heads_k] with one row per sequence; out_dtype; Hopper,
    forward only), causal and GQA; the other options raise NotImplementedError.
    """
    if q.dtype is _fp8.FP8_DTYPE or q_descale is not None:
        if (_variant_args(window_size, softcap, alibi_slopes) != _NO_VARIANTS or dropout_p != 0.0
                or seqused_k is not None or block_table is not None or return_attn_probs
                or learnable_sink is not None):
            _not_implemented("window_size / softcap / alibi_slopes / dropout_p / seqused_k / "
                             "block_table / return_attn_probs / learnable_sink with FP8 inputs")
        varlen = (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
        return _fp8_call(q, k, v, softmax_scale, causal, q_descale, k_descale, v_descale,
                         out_dtype, return_lse, varlen)
    if k_descale is not None or v_descale is not None or out_dtype is not None:
        raise ValueError("flash_attn_ext: q_descale / k_descale / v_descale / out_dtype apply to "
                         "FP8 (torch.float8_e4m3fn) inputs only")
    variants = _variant_args(window_size, softcap, alibi_slopes)
    paged = block_table is not None
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flash_attn_ext: {name} must be a torch.Tensor, got {type(t).__name__}")
        if paged and name != "q":
            _check_rank(t, name, "page pool [num_pages, page_size, heads_k, head_dim] (with "
                        "block_table)")
        elif t.dim() != 3:
            raise RuntimeError(f"flash_attn_ext: varlen {name} must be a 3-D tensor "
                               f"[total_tokens, heads, head_dim], got shape {tuple(t.shape)}")
    dropout = _dropout_args(dropout_p, q.device)
    scale = _default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    sink = _sink_arg(learnable_sink, q.shape[1], q.device)
    if paged:
        if not isinstance(block_table, torch.Tensor):
            raise TypeError("flash_attn_ext: block_table must be None or an int32 tensor "
                            f"[batch, max_pages], got {type(block_table).__name__}")
        paged_args = (q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                      scale, bool(causal), seqused_k, block_table, *variants, *dropout)
        grads = (q, k, v) if sink is None else (q, k, v, sink)
        if torch.is_grad_enabled() and any(t.requires_grad for t in grads):
            out, lse = _PagedVarlenFunction.apply(*paged_args, sink, bool(deterministic))
        else:
            out, lse = _paged_varlen_fwd(*paged_args, sink)
    else:
        out, lse = _run(FlashAttnVarlenFunction, q, k, v, cu_seqlens_q, cu_seqlens_k,
                        int(max_seqlen_q), int(max_seqlen_k), scale, bool(causal),
                        bool(deterministic), seqused_k, *variants, *dropout, None, sink)
    if return_attn_probs:
        return out, lse, _dropout_keep_mask(dropout, cu_seqlens_q.shape[0] - 1, q.shape[1],
                                            int(max_seqlen_q), int(max_seqlen_k))
    if return_lse:
        return out, lse
    return out


# ---- packed inputs: flash-attn's *_qkvpacked_func / *_kvpacked_func ----------------------------
_QKV_LAYOUT = "[batch, seqlen, 3, heads, head_dim]"
_KV_LAYOUT = "[batch, seqlen_k, 2, heads_k, head_dim]"
_VARLEN_QKV_LAYOUT = "[total, 3, heads, head_dim]"
_VARLEN_KV_LAYOUT = "[total_k, 2, heads_k, head_dim]"


def _unpack(packed, name, rank, count, layout):
    """The `count` tensors stacked along dim -3 of `packed` (a `rank`-D tensor `layout`) as
    strided views: nothing is copied (the kernels read them in place when the last dim is
    contiguous), and autograd stacks their gradients back into one tensor shaped like
    `packed` (unbind's backward)."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"flash_attn_ext: {name} must be a torch.Tensor {layout}, got "
                        f"{type(packed).__name__}")
    if packed.dim() != rank:
        raise RuntimeError(f"flash_attn_ext: {name} must be a {rank}-D tensor {layout}, got "
                           f"{packed.dim()}-D with shape {tuple(packed.shape)}")
    if packed.shape[-3] != count:
        raise RuntimeError(f"flash_attn_ext: {name} must stack {count} tensors in dim {rank - 3} "
                           f"({layout}), got shape {tuple(packed.shape)}")
    return packed.unbind(rank - 3)


def flash_attn_qkvpacked_func(qkv, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                              causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                              softcap: float = 0.0, alibi_slopes=None,
                              deterministic: bool = False, return_attn_probs: bool = False,
                              learnable_sink: Optional[torch.Tensor] = None):
    """flash_attn_func with q, k and v stacked in one tensor (flash-attn's API).

    qkv: [batch, seqlen, 3, heads, head_dim]; q, k, v are qkv[:, :, 0], qkv[:, :, 1] and
    qkv[:, :, 2], read in place (no copy while the last dim is contiguous). The other
    arguments and the return values are flash_attn_func's: out [batch, seqlen, heads,
    head_dim], and with return_attn_probs=True (out, lse, keep). The gradient is one tensor
    shaped like qkv.
    """
    q, k, v = _unpack(qkv, "qkv", 5, 3, _QKV_LAYOUT)
    return flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale,
                           causal=causal, window_size=window_size, softcap=softcap,
                           alibi_slopes=alibi_slopes, deterministic=deterministic,
                           return_attn_probs=return_attn_probs,
                           learnable_sink=learnable_sink)


def flash_attn_kvpacked_func(q, kv, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                             causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                             softcap: float = 0.0, alibi_slopes=None,
                             deterministic: bool = False, return_attn_probs: bool = False,
                             learnable_sink: Optional[torch.Tensor] = None):
    """flash_attn_func with k and v stacked in one tensor (flash-attn's API).

    q: [batch, seqlen_q, heads, head_dim]; kv: [batch, seqlen_k, 2, heads_k, head_dim] with
    heads % heads_k == 0 (GQA / MQA); k, v are kv[:, :, 0] and kv[:, :, 1], read in place.
    The other arguments and the return values are flash_attn_func's. kv's gradient is one
    tensor shaped like kv.
    """
    k, v = _unpack(kv, "kv", 5, 2, _KV_LAYOUT)
    return flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale,
                           causal=causal, window_size=window_size, softcap=softcap,
                           alibi_slopes=alibi_slopes, deterministic=deterministic,
                           return_attn_probs=return_attn_probs,
                           learnable_sink=learnable_sink)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen: int, dropout_p: float = 0.0,
                                     softmax_scale: Optional[float] = None, causal: bool = False,
                                     window_size: Tuple[int, int] = (-1, -1),
                                     softcap: float = 0.0, alibi_slopes=None,
                                     deterministic: bool = False,
                                     return_attn_probs: bool = False,
                                     learnable_sink: Optional[torch.Tensor] = None):
    """flash_attn_varlen_func with q, k and v stacked in one tensor (flash-attn's API).

    qkv: [total, 3, heads, head_dim] (q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2], read in
    place); cu_seqlens (int32 [batch + 1]) and max_seqlen serve as both the query and the key
    ones. The other arguments and the return values are flash_attn_varlen_func's: out [total,
    heads, head_dim], and with return_attn_probs=True (out, lse, keep). The gradient is one
    tensor shaped like qkv.
    """
    q, k, v = _unpack(qkv, "qkv", 4, 3, _VARLEN_QKV_LAYOUT)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p=dropout_p, softmax_scale=softmax_scale,
                                  causal=causal, window_size=window_size, softcap=softcap,
                                  alibi_slopes=alibi_slopes, deterministic=deterministic,
                                  return_attn_probs=return_attn_probs,
                                  learnable_sink=learnable_sink)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                                    max_seqlen_k: int, dropout_p: float = 0.0,
                                    softmax_scale: Optional[float] = None, causal: bool = False,
                                    window_size: Tuple[int, int] = (-1, -1),
                                    softcap: float = 0.0, alibi_slopes=None,
                                    deterministic: bool = False,
                                    return_attn_probs: bool = False,
                                    learnable_sink: Optional[torch.Tensor] = None):
    """flash_attn_varlen_func with k and v stacked in one tensor (flash-attn's API).

    q: [total_q, heads, head_dim]; kv: [total_k, 2, heads_k, head_dim] with heads % heads_k
    == 0 (k, v = kv[:, 0], kv[:, 1], read in place). The other arguments and the return
    values are flash_attn_varlen_func's. kv's gradient is one tensor shaped like kv.
    """
    k, v = _unpack(kv, "kv", 4, 2, _VARLEN_KV_LAYOUT)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p=dropout_p, softmax_scale=softmax_scale,
                                  causal=causal, window_size=window_size, softcap=softcap,
                                  alibi_slopes=alibi_slopes, deterministic=deterministic,
                                  return_attn_probs=return_attn_probs,
                                  learnable_sink=learnable_sink)


# ---- paged KV cache under autograd (flash_attn_varlen_func with block_table) -----------------
def _paged_varlen_fwd(q, k_pages, v_pages, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      softmax_scale, causal, seqused_k, block_table, window_left, window_right,
                      softcap, alibi_slopes, dropout_p, rng_state, learnable_sink):
    """The paged varlen forward operator (with or without autograd, the same call): out
    [total_q, heads, head_dim] and lse float32 [heads, total_q] of packed q against page pools
    k_pages / v_pages [num_pages, page_size, heads_k, head_dim]."""
    q, k_pages, v_pages = (_last_dim_contiguous(t) for t in (q, k_pages, v_pages))
    return torch.ops.flash_attn_ext.varlen_fwd(
        q, k_pages, v_pages, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        softmax_scale, causal, seqused_k, window_left, window_right, softcap, alibi_slopes,
        dropout_p, rng_state, None, learnable_sink, block_table)


def _paged_key_counts(cu_seqlens_k, seqused_k, max_seqlen_k):
    """int32 [batch]: the keys each sequence of the paged forward attended to, as the kernels
    count them (csrc/params.h, packed_sequence and seq_bounds): cu_seqlens_k's length capped at
    max_seqlen_k, then at seqused_k."""
    begin = cu_seqlens_k[:-1].clamp(min=0)
    counts = (torch.maximum(cu_seqlens_k[1:], begin) - begin).clamp(max=max_seqlen_k)
    if seqused_k is not None:
        counts = torch.minimum(counts, seqused_k.clamp(min=0))
    return counts.to(torch.int32)


def _pool_gradient(row_grads, rows_used, pool, pages, slots):
    """The gradient of a page pool [num_pages, page_size, heads_k, head_dim] from that of the
    rows gathered from it (row i = pool[pages[i], slots[i]]): filler rows (rows_used False)
    add nothing, and a page read by several sequences gets the sum of their gradients."""
    grad = torch.zeros(pool.shape, dtype=row_grads.dtype, device=row_grads.device)
    # index_put_ with accumulate sums repeated indices (deterministically on CUDA too).
    grad.index_put_((pages, slots), row_grads.masked_fill(~rows_used, 0), accumulate=True)
    return grad


class _PagedVarlenFunction(torch.autograd.Function):
    """flash_attn_varlen_func over a paged KV cache (block_table) when autograd records: the
    forward is the paged operator call itself (_paged_varlen_fwd, the values of a call without
    grad). The backward copies each sequence's keys and values out of the pages into
    max_seqlen_k rows per sequence (its keys, then filler rows that seqused_k hides: the row
    count is known without reading cu_seqlens_k on the host), runs the varlen backward on them
    with the forward's out, lse and dropout state, and adds dK / dV back into pool-shaped
    gradients."""

    @staticmethod
    def forward(ctx, q, k_pages, v_pages, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                softmax_scale, causal, seqused_k, block_table, window_left, window_right, softcap,
                alibi_slopes, dropout_p, rng_state, learnable_sink, deterministic):
        """(out [total_q, heads, head_dim], lse float32 [heads, total_q]) as
        _paged_varlen_fwd; lse is not differentiable."""
        out, lse = _paged_varlen_fwd(q, k_pages, v_pages, cu_seqlens_q, cu_seqlens_k,
                                     max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                     seqused_k, block_table, window_left, window_right, softcap,
                                     alibi_slopes, dropout_p, rng_state, learnable_sink)
        ctx.save_for_backward(q, k_pages, v_pages, out, lse, cu_seqlens_q, cu_seqlens_k,
                              seqused_k, block_table, alibi_slopes, rng_state, learnable_sink)
        ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
        ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
        ctx.variants = (window_left, window_right, softcap)
        ctx.dropout_p = dropout_p
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        """dout [total_q, heads, head_dim] -> dq shaped like q and dk / dv shaped like the
        pools (None for the other inputs)."""
        (q, k_pages, v_pages, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
         alibi_slopes, rng_state, learnable_sink) = ctx.saved_tensors
        batch = block_table.shape[0]
        key_counts = _paged_key_counts(cu_seqlens_k, seqused_k, ctx.max_seqlen_k)
        # Sequence b is rows b * rows_per_seq ... of the gathered k / v (at least one row:
        # the operators take no empty k).
        rows_per_seq = max(ctx.max_seqlen_k, 1)
        pages, slots = _kvcache.paged_key_rows(block_table, k_pages.shape[0], k_pages.shape[1],
                                               rows_per_seq)
        pages, slots = pages.reshape(-1), slots.reshape(-1)
        cu_rows = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * rows_per_seq
        dsink = _sink_grad_buffer(ctx, 17, learnable_sink)
        dq, dk_rows, dv_rows = torch.ops.flash_attn_ext.varlen_bwd(
            _last_dim_contiguous(dout), _last_dim_contiguous(q), k_pages[pages, slots],
            v_pages[pages, slots], out, lse, cu_seqlens_q, cu_rows, ctx.max_seqlen_q,
            rows_per_seq, ctx.softmax_scale, ctx.causal, ctx.deterministic, key_counts,
            *ctx.variants, alibi_slopes, ctx.dropout_p, rng_state, None, learnable_sink,
            dsink=dsink)
        rows_used = (torch.arange(rows_per_seq, device=q.device) < key_counts[:, None])
        rows_used = rows_used.reshape(-1, 1, 1)
        dk = (_pool_gradient(dk_rows, rows_used, k_pages, pages, slots)
              if ctx.needs_input_grad[1] else None)
        dv = (_pool_gradient(dv_rows, rows_used, v_pages, pages, slots)
              if ctx.needs_input_grad[2] else None)
        return (dq if ctx.needs_input_grad[0] else None, dk, dv) + (None,) * 14 + (dsink, None)


def _cache_lengths(cache_seqlens, batch, capacity, device):
    """cache_seqlens (None, int or tensor) -> int32 tensor [batch] on `device`."""
    if cache_seqlens is None:
        return torch.full((batch,), capacity, dtype=torch.int32, device=device)
    if isinstance(cache_seqlens, int):
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError("flash_attn_ext: cache_seqlens must be None, an int or an int32 tensor, "
                        f"got {type(cache_seqlens).__name__}")
    if cache_seqlens.dtype != torch.int32:
        raise RuntimeError(f"flash_attn_ext: cache_seqlens must be int32, got {cache_seqlens.dtype}")
    if cache_seqlens.dim() != 1 or cache_seqlens.shape[0] != batch:
        raise RuntimeError(f"flash_attn_ext: cache_seqlens must have shape ({batch},), got "
                           f"{tuple(cache_seqlens.shape)}")
    return cache_seqlens if cache_seqlens.device == device else cache_seqlens.to(device)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None,
                            softmax_scale: Optional[float] = None, causal: bool = False,
                            window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes=None,
                            num_splits: int = 0, return_softmax_lse: bool = False,
                            k_descale=None, v_descale=None,
                            learnable_sink: Optional[torch.Tensor] = None):
    """Attention of new queries against a KV cache (flash-attn's API), forward only.

    q: [batch, seqlen_q, heads, head_dim]. k_cache, v_cache: [batch_c, cache_size, heads_k,
    head_dim] (heads % heads_k == 0; batch_c == batch unless cache_batch_idx is given), or with
    block_table (int32 [batch, max_pages], a paged cache) page pools [num_pages, page_size,
    heads_k, head_dim], page_size a multiple of 16: key r of batch entry b is slot
    r % page_size of page block_table[b, r // page_size].
    cache_seqlens: int or int32 tensor [batch], where each entry's keys end in its cache (None =
    the whole cache). If k, v ([batch, seqlen_new, heads_k, head_dim]) are given they are
    written into the caches in place at positions cache_seqlens[b] .. cache_seqlens[b] +
    seqlen_new - 1, and attention runs over the first cache_seqlens[b] + seqlen_new keys.
    cache_batch_idx (int32 [batch]): batch entry b uses cache row cache_batch_idx[b] (not with
    block_table). cache_leftpad (int32 [batch]): entry b's keys start at cache row
    cache_leftpad[b] (the rows before are not attended; not with block_table).
    rotary_cos / rotary_sin ([seqlen_ro >= the cache's key capacity, rotary_dim / 2],
    rotary_dim a multiple of 16 and <= head_dim; need k and v): the rotary embedding applied
    to the new keys before they are appended and to q, at cache positions cache_seqlens[b] + t
    (q: token t when causal or with a window, else all at cache_seqlens[b]); rotary_interleaved
    rotates dims (0, 1), (2, 3), ... else (i, i + rotary_dim / 2), as flash-attn.
    causal=True aligns the queries with the end of each entry's keys, and so do window_size
    and alibi_slopes (softcap as in flash_attn_func). num_splits: split-KV (0 = heuristic).
    learnable_sink ([heads]) as in flash_attn_func (forward only here).

    FP8 cache (FlashAttention-3's k_descale / v_descale): k_cache and v_cache in
    torch.float8_e4m3fn under a float16 / bfloat16 q (everything above works alike), with
    k_descale, v_descale (required then, an error with a 16-bit cache) float32 on q's device,
    [] / [1] (one factor) or [batch, heads_k] (per batch entry of q and kv head; with
    cache_batch_idx or block_table still q's entry b): the real cache is descale * the stored
    values. New k / v in q's dtype (any float dtype) are stored as round(k / k_descale)
    saturated to +-448 (the factor of the batch entry they belong to), e4m3 ones as given.
    out stays in q's dtype. On CUDA the decode kernels read the e4m3 tiles (half the bytes of
    a 16-bit cache) and convert them exactly to q's dtype; the CPU widens them to float32.

    No host synchronisation: a decode step can be captured in a CUDA graph. Out-of-range
    values (cache_seqlens + seqlen_new beyond the cache, page ids, cache_batch_idx) are
    clamped into the cache rather than checked; FLASH_ATTN_EXT_DEBUG_CHECKS=1 checks them
    (one device-to-host copy) and raises.

    Returns out [batch, seqlen_q, heads, head_dim] (and lse [batch, heads, seqlen_q] with
    return_softmax_lse=True).
    """
    # A decode step over a dense 16-bit cache with nothing else (what a serving loop calls
    # once per layer per token) skips the general path's checks and objects: its Python
    # layer 3.7 -> ~2.2 us per call. Anything unusual, invalid inputs included, falls through
    # to the general path, which names the problem.
    if (k is None and v is None and block_table is None and cache_batch_idx is None
            and cache_leftpad is None and rotary_cos is None and rotary_sin is None
            and k_descale is None and v_descale is None and type(cache_seqlens) is torch.Tensor
            and _no_variants(window_size, softcap, alibi_slopes) and learnable_sink is None):
        out = _dense_decode_step(q, k_cache, v_cache, cache_seqlens, softmax_scale, causal,
                                 num_splits)
        if out is not None:
            return out if return_softmax_lse else out[0]
    variants = _variant_args(window_size, softcap, alibi_slopes)
    _check_ranks((q, k_cache, v_cache), ("q", "k_cache", "v_cache"),
                 "[batch, seqlen, heads, head_dim]")
    sink = _sink_arg(learnable_sink, q.shape[2], q.device)
    if (k is None) != (v is None):
        raise RuntimeError("flash_attn_ext: pass both k and v to append to the cache, or neither")
    batch = q.shape[0]
    fp8 = _kvcache.check_fp8_cache(q, k_cache, v_cache, k_descale, v_descale)
    _kvcache.check_cuda_head_dims(q, v_cache, fp8, variants != _NO_VARIANTS)
    layout = _kvcache.CacheLayout(q, k_cache, block_table, cache_batch_idx, cache_leftpad)
    lengths = _cache_lengths(cache_seqlens, batch, layout.capacity, q.device)
    seqlen_new = 0
    if k is not None:
        if cache_seqlens is None:
            raise RuntimeError("flash_attn_ext: appending k / v needs cache_seqlens (where each "
                               "batch entry's new keys go)")
        # (Checked here before anything is written; without an append the operator checks it.)
        if k_cache.shape[:-1] != v_cache.shape[:-1]:
            raise RuntimeError(f"flash_attn_ext: k_cache and v_cache must have the same shape "
                               f"but for the last (head_dim) dimension, got "
                               f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
        for t, name, cache in ((k, "k", k_cache), (v, "v", v_cache)):
            _check_rank(t, name, "[batch, seqlen_new, heads_k, head_dim]")
            if (t.shape[0], t.shape[2:]) != (batch, cache.shape[2:]):
                raise RuntimeError(f"flash_attn_ext: {name} must have shape [batch, seqlen_new, "
                                   f"{cache.shape[2]}, {cache.shape[3]}], got {tuple(t.shape)}")
        if k.shape[1] != v.shape[1]:
            raise RuntimeError(f"flash_attn_ext: k and v must have the same shape, got "
                               f"{tuple(k.shape)} and {tuple(v.shape)}")
        seqlen_new = k.shape[1]
    rotary_dim = _kvcache.check_rotary(rotary_cos, rotary_sin, q, k, layout.capacity)
    if _kvcache.debug_checks_enabled():
        layout.debug_check(k_cache, lengths, seqlen_new)
    if rotary_dim > 0:
        steps = torch.arange(q.shape[1], device=q.device)
        if _kvcache.rotary_per_token(causal, variants[:2], layout.capacity):
            q_positions = lengths.long().unsqueeze(1) + steps
        else:
            q_positions = lengths.long().unsqueeze(1)
        k_positions = lengths.long().unsqueeze(1) + torch.arange(seqlen_new, device=q.device)
        # An FP8 cache's new keys are rotated in fp32 and rounded once, to e4m3; e4m3 ones
        # are in the cache's units already (rounded back without the factor).
        k_stored = fp8 and k.dtype is _kvcache.FP8_DTYPE
        with torch.no_grad():
            q = _kvcache.apply_rotary(q, rotary_cos, rotary_sin, q_positions,
                                      bool(rotary_interleaved))
            k = _kvcache.apply_rotary(k.float() if fp8 else k, rotary_cos, rotary_sin,
                                      k_positions, bool(rotary_interleaved))
        if k_stored:
            k = _kvcache.quantize_for_cache(k, None)
    if seqlen_new > 0:
        rows = layout.cache_indices(k_cache, lengths, seqlen_new)
        with torch.no_grad():
            if fp8:
                k = _kvcache.quantize_for_cache(k, k_descale)
                v = _kvcache.quantize_for_cache(v, v_descale)
            _kvcache.store_rows(k_cache, rows, k)
            _kvcache.store_rows(v_cache, rows, v)
        lengths = lengths + seqlen_new
    scale = _default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    k_c, v_c = k_cache, v_cache
    if q.stride(-1) != 1 or k_c.stride(-1) != 1 or v_c.stride(-1) != 1:
        q, k_c, v_c = (_last_dim_contiguous(q), _last_dim_contiguous(k_c),
                       _last_dim_contiguous(v_c))
    # Positional arguments (keywords cost the dispatcher's parsing ~1 us per call).
    args = (q, k_c, v_c, scale, bool(causal), True, int(num_splits), 0, lengths, *variants, 0.0,
            None, None, sink, block_table, cache_batch_idx, cache_leftpad, k_descale, v_descale)
    out, lse = _fwd_no_grad(args)
    return (out, lse) if return_softmax_lse else out


def _fwd_no_grad(args):
    """The forward operator outside autograd (the KV-cache path has no backward)."""
    if torch.is_grad_enabled():
        with torch.no_grad():
            return _FWD_OP(*args)
    return _FWD_OP(*args)


def _dense_decode_step(q, k_cache, v_cache, cache_seqlens, softmax_scale, causal, num_splits):
    """flash_attn_with_kvcache's fast path: (out, lse) when q / k_cache / v_cache are 4-D
    tensors with unit last strides and a 16-bit or fp32 cache, k_cache has q's batch,
    cache_seqlens is an int32 [batch] tensor on q's device and the debug checks are off; else
    None (the caller takes the general path). The operator checks the rest (shapes, dtypes,
    devices)."""
    try:
        shape = q.shape
        if not (q.dim() == 4 and k_cache.dim() == 4 and v_cache.dim() == 4
                and k_cache.shape[0] == shape[0] and cache_seqlens.dtype is torch.int32
                and cache_seqlens.dim() == 1 and cache_seqlens.shape[0] == shape[0]
                and cache_seqlens.device == q.device
                and k_cache.dtype is not _kvcache.FP8_DTYPE
                and v_cache.dtype is not _kvcache.FP8_DTYPE):
            return None
        if not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
            if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
                return None
    except (AttributeError, TypeError):  # not tensors
        return None
    if _kvcache.debug_checks_enabled():
        return None
    scale = _default_scale(shape[3]) if softmax_scale is None else float(softmax_scale)
    return _fwd_no_grad((q, k_cache, v_cache, scale, bool(causal), True, int(num_splits), 0,
                         cache_seqlens, *_NO_VARIANTS, 0.0, None, None, None, None, None, None,
                         None, None))
