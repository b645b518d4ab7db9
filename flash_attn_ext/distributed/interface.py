"""The public entry points ring_flash_attn_func and ring_flash_attn_varlen_func, and the
autograd Function (_RingFlashAttnFunction) that runs _ring_forward and _ring_backward.
"""
from typing import Optional

import torch
import torch.distributed as dist

from ..interface import _sink_arg
from .backward import _ring_backward
from .checks import _InputCheck, _process_group_ring, _scalar_args
from .forward import _ring_forward
from .schedule import _PackedAttention, _PaddedAttention
from .sharding import _PackedChunks


def _sink_rows(sink, lse):
    """The sink of each lse row's head, broadcastable to lse ([batch, heads, seqlen] padded,
    [heads, total] packed)."""
    return sink.view(-1, 1) if lse.dim() == 2 else sink.view(1, -1, 1)


def _rows_to_out(x, out):
    """An lse-shaped tensor as a factor of out's rows ([batch, seqlen, heads, 1] padded,
    [total, heads, 1] packed)."""
    return (x.transpose(0, 1) if x.dim() == 2 else x.transpose(1, 2)).unsqueeze(-1)


def _fold_sink(out, lse, sink):
    """(out, lse) of the whole sequence with the learnable sink joined to every row: one more
    logit with no value (flash_attn_func's learnable_sink), merged like one more block, once,
    after the ring: lse' = logaddexp(lse, sink), out' = out * exp(lse - lse')."""
    new_lse = torch.logaddexp(lse, _sink_rows(sink, lse))
    factor = torch.exp(lse - new_lse)  # rows without keys: exp(-inf) = 0, out stays 0
    return (out.float() * _rows_to_out(factor, out)).to(out.dtype), new_lse


def _sink_grad(dout, out, lse, sink):
    """This rank's part of the sink's gradient: -sum over its rows of exp(sink - lse) *
    rowsum(dout * out) (the other ranks hold the other rows: summing the gradients of a
    replicated parameter over the ranks, as data / context parallel training does, gives the
    whole sequence's)."""
    d = (dout.float() * out.float()).sum(-1)  # [batch, seqlen, heads] / [total, heads]
    d = d.transpose(0, 1) if lse.dim() == 2 else d.transpose(1, 2)
    terms = torch.where(torch.isneginf(lse), torch.zeros_like(lse),
                        torch.exp(_sink_rows(sink, lse) - lse) * d)
    return -(terms.sum(1) if lse.dim() == 2 else terms.sum((0, 2)))


class _RingFlashAttnFunction(torch.autograd.Function):
    """out, lse = _RingFlashAttnFunction.apply(q, k, v, sink, ring, attention, check); lse is
    not differentiable; sink (the learnable sink, float32 [heads]) may be None."""

    @staticmethod
    def forward(ctx, q, k, v, sink, ring, attention, check):
        out, lse, (last_k, last_v) = _ring_forward(q, k, v, ring, attention, check)
        if sink is not None:
            out, lse = _fold_sink(out, lse, sink)
        # The backward starts with the block the forward ended with (one K/V block of memory
        # for one transfer fewer, _ring_backward). With a sink, out and lse include it: the
        # ring's backward needs nothing else (P = exp(S - lse), D = rowsum(dO o O)).
        ctx.save_for_backward(q, k, v, out, lse, last_k, last_v, sink)
        ctx.ring, ctx.attention = ring, attention
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, last_k, last_v, sink = ctx.saved_tensors
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, (last_k, last_v), ctx.ring,
                                    ctx.attention)
        dsink = _sink_grad(dout, out, lse, sink) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsink, None, None, None


def _run(q, k, v, sink, ring, attention, return_lse, check):
    q, k, v = [t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v)]
    grads = (q, k, v) if sink is None else (q, k, v, sink)
    if torch.is_grad_enabled() and any(t.requires_grad for t in grads):
        out, lse = _RingFlashAttnFunction.apply(q, k, v, sink, ring, attention, check)
    else:
        out, lse, _ = _ring_forward(q, k, v, ring, attention, check)
        if sink is not None:
            out, lse = _fold_sink(out, lse, sink)
    return (out, lse) if return_lse else out


# ---- public entry points -------------------------------------------------------------------
def ring_flash_attn_func(q, k, v, group: Optional["dist.ProcessGroup"] = None,
                         causal: bool = False, softmax_scale: Optional[float] = None,
                         softcap: float = 0.0, deterministic: bool = False,
                         return_lse: bool = False, learnable_sink: Optional[torch.Tensor] = None):
    """Exact attention over a sequence sharded across the ranks of `group` (default: the
    whole world), each rank calling with its own shard; forward and backward.

    q: [batch, seqlen_local, heads, head_dim]; k, v: [batch, seqlen_local, heads_k, head_dim]
    (heads % heads_k == 0: GQA / MQA); float32, float16 or bfloat16; CPU tensors with a gloo
    group, CUDA tensors (this rank's current device) with NCCL. causal=False: any split of
    the sequence, shard lengths may differ between ranks. causal=True: the zig-zag shards of
    zigzag_shard (rank r holds chunks r and 2W-1-r of 2W), the same length on every rank.
    softmax_scale (default 1/sqrt(head_dim)), softcap, deterministic and learnable_sink as in
    flash_attn_func (the sink joins each row once, after the ring; its gradient on a rank is
    that rank's rows' part, which the usual sum over ranks of a replicated parameter's
    gradients completes).
    Every rank must call it, with the same causal flag and the same batch, heads and
    head_dim; a rank with bad inputs makes every rank raise.

    Returns this rank's rows of the attention output [batch, seqlen_local, heads, head_dim]
    (q's dtype), and with return_lse=True also lse float32 [batch, heads, seqlen_local], the
    log-sum-exp over the whole sequence. Gradients flow to q, k and v (this rank's shards of
    the whole-sequence gradients).

    Communication per call: one all_gather of a few integers (checks; on CUDA one host sync),
    then world - 1 K/V blocks fetched from their owners (on NCCL by copy engines from the
    owners' symmetric memory, which every rank fills with its K/V: a buffer of one shard's
    K and V per group and dtype, allocated on first use and kept; two device-side barriers
    per pass); the backward fetches world - 2 blocks the same way and sends each block's
    dK/dV pieces (q's dtype) to the block's owner (P2P), world - 1 times. The backward keeps
    the last K/V block the forward received (one shard's K/V of memory) so that it starts
    without waiting for a transfer. FLASH_ATTN_EXT_RING_SYMMETRIC_MEMORY=0 (read at import)
    fetches the K/V blocks by NCCL P2P instead (where symmetric memory is not available or
    its memory is not wanted; slower on 4x H100: docs/PERFORMANCE.md).
    """
    ring = _process_group_ring(group)
    check = _InputCheck(q, k, v, bool(causal), ring, sink=learnable_sink)
    # Every rank's length is known once the check is finished (_ring_forward, before its
    # first step).
    attention = _PaddedAttention((q.shape[1],) * ring.world, bool(causal),
                                 *_scalar_args(q, softmax_scale, softcap, deterministic))
    sink = _sink_arg(learnable_sink, q.shape[2], q.device)  # checked by _InputCheck
    return _run(q, k, v, sink, ring, attention, return_lse, check)


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, group: Optional["dist.ProcessGroup"] = None,
                                causal: bool = False, softmax_scale: Optional[float] = None,
                                softcap: float = 0.0, deterministic: bool = False,
                                return_lse: bool = False,
                                learnable_sink: Optional[torch.Tensor] = None):
    """ring_flash_attn_func for a packed batch of sequences (learnable_sink as there).

    cu_seqlens: the global batch's offsets, int [batch + 1] (a tensor on any device, or a
    list; the same on every rank), every sequence length a multiple of the group's size.
    q: [cu_seqlens[-1] / world, heads, head_dim], k, v: [same, heads_k, head_dim]: this
    rank's zigzag_shard_varlen shard (its first zig-zag chunk of every sequence, then its
    second chunk of every sequence), causal or not (causal: bottom-right = top-left within
    each sequence, whose queries and keys are the same tokens).

    Returns this rank's rows of the output [total_local, heads, head_dim] (and with
    return_lse=True lse float32 [heads, total_local]); gradients flow to q, k and v. Costs
    one host sync per call for cu_seqlens, and the varlen operators' own (one small copy
    per call, up to four calls per step).
    """
    ring = _process_group_ring(group)
    check = _InputCheck(q, k, v, bool(causal), ring, packed=True, cu_seqlens=cu_seqlens,
                        sink=learnable_sink)
    cu = check.cu_seqlens
    try:
        chunks = _PackedChunks(cu, ring.world, q.device)
        if chunks.total != q.shape[0]:
            raise ValueError(f"flash_attn_ext: ring_flash_attn_varlen_func: cu_seqlens[-1] = "
                             f"{cu[-1]} tokens over {ring.world} ranks is {chunks.total} per "
                             f"rank, but q has {q.shape[0]} rows")
    except ValueError:
        check.finish()  # ranks that disagree: that error, the same on every rank
        raise
    attention = _PackedAttention(chunks, ring.world, bool(causal),
                                 *_scalar_args(q, softmax_scale, softcap, deterministic))
    sink = _sink_arg(learnable_sink, q.shape[1], q.device)  # checked by _InputCheck
    return _run(q, k, v, sink, ring, attention, return_lse, check)
