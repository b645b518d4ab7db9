"""Public entry points.

flash_attn_func              flash-attn's API and layout: [batch, seqlen, heads, head_dim],
                             causal aligned to the bottom-right corner when seqlen_q != seqlen_k.
scaled_dot_product_attention torch SDPA's API and layout: [batch, heads, seqlen, head_dim],
                             causal aligned to the top-left corner (a drop-in replacement).

Both reach the same kernels through strides: no copy when the last dim is contiguous.
"""
import math
from typing import Optional, Tuple

import torch

from .ops import FlashAttnFunction


def _not_implemented(what):
    raise NotImplementedError(f"flash_attn_ext: {what} is not implemented yet")


def _check_rank(t, name, layout):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"flash_attn_ext: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise RuntimeError(f"flash_attn_ext: {name} must be a 4-D tensor {layout}, got "
                           f"{t.dim()}-D with shape {tuple(t.shape)}")


def _default_scale(head_dim):
    return 1.0 / math.sqrt(head_dim)


def flash_attn_func(q, k, v, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                    softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
                    return_attn_probs: bool = False, return_lse: bool = False,
                    num_splits: int = 0):
    """Exact attention, flash-attn compatible.

    q: [batch, seqlen_q, heads, head_dim]; k, v: [batch, seqlen_k, heads, head_dim];
    float16, bfloat16 or float32, on CPU or CUDA. softmax_scale defaults to 1/sqrt(head_dim).
    causal=True masks key j for query i unless j <= i + seqlen_k - seqlen_q (bottom-right
    alignment, as flash-attn >= 2.1). deterministic=True makes the backward bit-reproducible.
    num_splits: split-KV for the CUDA forward (0 = heuristic, 1 = off, n = force n).

    Returns out [batch, seqlen_q, heads, head_dim]; with return_lse=True (out, lse) and with
    return_attn_probs=True (out, lse, None), lse being float32 [batch, heads, seqlen_q]
    (natural log; -inf for rows that see no key). There is no dropout, so no probability
    mask is returned.
    """
    if dropout_p != 0.0:
        _not_implemented(f"dropout (dropout_p={dropout_p})")
    if tuple(window_size) != (-1, -1):
        _not_implemented(f"sliding-window attention (window_size={tuple(window_size)})")
    if softcap != 0.0:
        _not_implemented(f"softcap (softcap={softcap})")
    if alibi_slopes is not None:
        _not_implemented("ALiBi (alibi_slopes)")
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_rank(t, name, "[batch, seqlen, heads, head_dim]")
    scale = _default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out, lse = FlashAttnFunction.apply(q, k, v, scale, bool(causal), True, bool(deterministic),
                                       int(num_splits), 0)
    if return_attn_probs:
        return out, lse, None
    if return_lse:
        return out, lse
    return out


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False):
    """Drop-in replacement for torch.nn.functional.scaled_dot_product_attention.

    query: [batch, heads, seqlen_q, head_dim]; key, value: [batch, heads, seqlen_k, head_dim].
    is_causal=True uses torch's top-left alignment (key j visible to query i iff j <= i).
    Returns [batch, heads, seqlen_q, head_dim].
    """
    if attn_mask is not None:
        _not_implemented("an explicit attn_mask (use is_causal=True for causal masking)")
    if dropout_p != 0.0:
        _not_implemented(f"dropout (dropout_p={dropout_p})")
    if enable_gqa:
        _not_implemented("grouped-query attention (enable_gqa=True)")
    for t, name in ((query, "query"), (key, "key"), (value, "value")):
        _check_rank(t, name, "[batch, heads, seqlen, head_dim]")
    softmax_scale = _default_scale(query.shape[-1]) if scale is None else float(scale)
    q, k, v = [t.transpose(1, 2) for t in (query, key, value)]
    out, _ = FlashAttnFunction.apply(q, k, v, softmax_scale, bool(is_causal), False, False, 0, 0)
    return out.transpose(1, 2)
