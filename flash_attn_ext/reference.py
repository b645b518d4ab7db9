"""Naive attention: the definition our kernels are tested against.

It materialises the [seqlen_q, seqlen_k] score matrix, so use it on small inputs.
"""
import math
from typing import Optional, Tuple

import torch


def attention_ref(q, k, v, softmax_scale: Optional[float] = None, causal: bool = False,
                  causal_bottom_right: bool = True, upcast: bool = True,
                  layout: str = "bshd", return_lse: bool = False,
                  window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                  alibi_slopes: Optional[torch.Tensor] = None,
                  attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                  dropout_mask: Optional[torch.Tensor] = None,
                  learnable_sink: Optional[torch.Tensor] = None):
    """O = softmax(f(scale * Q K^T) + mask) V, computed the plain way.

    layout "bshd": q [batch, seqlen_q, heads, head_dim], k / v [batch, seqlen_k, heads,
    head_dim] (flash-attn's layout); "bhsd": [batch, heads, seqlen, head_dim] (torch SDPA's).
    k / v have as many heads as q (repeat them for GQA). softmax_scale defaults to
    1/sqrt(head_dim); causal_bottom_right aligns the causal mask to the bottom-right corner
    (flash-attn) instead of the top-left one (SDPA): query i sits at key i + offset, offset
    = seqlen_k - seqlen_q (bottom-right) or 0. The variants use the same diagonal:
    window_size=(left, right) keeps key j for query i iff
    i + offset - left <= j <= i + offset + right (-1 = unbounded); softcap > 0 maps a scaled
    score s to softcap * tanh(s / softcap); alibi_slopes ([heads] or [batch, heads]) then adds
    -slope * |i + offset - j|. attn_mask (torch SDPA's: bool, True = attend, or additive,
    broadcastable to [batch, heads, seqlen_q, seqlen_k]) is added last. dropout_mask (bool,
    broadcastable likewise; e.g. from torch.ops.flash_attn_ext.dropout_mask) keeps the
    probabilities where True, scaled by dropout_keep_scale(dropout_p), as the kernels do;
    lse stays that of the probabilities before dropout. learnable_sink ([heads]): gpt-oss's
    sink, as transformers' eager attention computes it: a column sink[h] joins the scores of
    head h before the softmax and its probability is dropped after (lse includes it).
    Returns out, shaped and typed like q; with return_lse=True (out, lse), lse
    [batch, heads, seqlen_q] in float32 (float64 for float64 inputs).
    upcast=True computes in float32 (or keeps float64 inputs), then casts the result to the
    input dtype: the reference. upcast=False computes in the input dtype, which is how large
    the error of "the same computation in PyTorch at this precision" is.
    Rows that see no key give zeros (and lse = -inf), as the kernels do.
    """
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"layout must be 'bshd' or 'bhsd', got {layout!r}")
    dtype_in = q.dtype
    if upcast and q.dtype != torch.float64:
        q, k, v = q.float(), k.float(), v.float()
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    seqlen_q, seqlen_k = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    scores = torch.matmul(q * scale, k.transpose(-2, -1))
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    offset = seqlen_k - seqlen_q if causal_bottom_right else 0
    i = torch.arange(seqlen_q, device=q.device).view(-1, 1)
    j = torch.arange(seqlen_k, device=q.device).view(1, -1)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=q.device, dtype=scores.dtype)
        slopes = slopes.view(-1 if slopes.dim() == 2 else 1, slopes.shape[-1], 1, 1)
        scores = scores - slopes * (i + offset - j).abs().to(scores.dtype)
    if attn_mask is not None:
        attn_mask = attn_mask.to(q.device)
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(scores.dtype)
    left, right = window_size
    masked = torch.zeros(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    if causal:
        masked |= j > i + offset
    if right >= 0:
        masked |= j > i + offset + right
    if left >= 0:
        masked |= j < i + offset - left
    scores = scores.masked_fill(masked, float("-inf"))
    if learnable_sink is not None:
        sink = learnable_sink.to(device=q.device, dtype=scores.dtype).view(1, -1, 1, 1)
        scores = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1)
    lse = torch.logsumexp(scores.float() if scores.dtype != torch.float64 else scores, dim=-1)
    # A row that sees no key would be softmax(all -inf) = NaN: give it zero probabilities
    # instead (and finite, zero gradients), as the kernels do.
    row_sees_a_key = (scores > float("-inf")).any(dim=-1, keepdim=True)
    scores = torch.where(row_sees_a_key, scores, torch.zeros_like(scores))
    probs = torch.softmax(scores, dim=-1) * row_sees_a_key
    if learnable_sink is not None:
        probs = probs[..., :seqlen_k]  # the sink's probability has no value
    if dropout_mask is not None:
        keep = dropout_mask.to(q.device)[..., :seqlen_q, :seqlen_k]
        probs = probs * keep.to(probs.dtype) * dropout_keep_scale(dropout_p)
    out = torch.matmul(probs, v)
    if layout == "bshd":
        out = out.transpose(1, 2)
    out = out.to(dtype_in)
    return (out, lse) if return_lse else out


def dropout_keep_scale(dropout_p: float) -> float:
    """The factor kept probabilities are scaled by: 1 / (1 - p) with p rounded to a multiple
    of 1/256 (at least 1/256 when p > 0), the resolution of the kernels' 8-bit random numbers
    (csrc/dropout.h; flash-attn's too)."""
    threshold = dropout_threshold(dropout_p)
    return 256.0 / (256.0 - threshold)


def dropout_threshold(dropout_p: float) -> int:
    """The kernels' drop threshold for dropout_p: an element is dropped iff its 8-bit random
    number is below it (csrc/dropout.h)."""
    threshold = min(int(dropout_p * 256.0 + 0.5), 255)
    return 1 if threshold == 0 and dropout_p > 0 else threshold
