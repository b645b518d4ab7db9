"""The public entry points ring_flash_attn_func and ring_flash_attn_varlen_func, and the
autograd Function (_RingFlashAttnFunction) that runs _ring_forward and _ring_backward.
"""
from typing import Optional

import torch
import torch.distributed as dist

from .backward import _ring_backward
from .checks import _InputCheck, _process_group_ring, _scalar_args
from .forward import _ring_forward
from .schedule import _PackedAttention, _PaddedAttention
from .sharding import _PackedChunks


class _RingFlashAttnFunction(torch.autograd.Function):
    """out, lse = _RingFlashAttnFunction.apply(q, k, v, ring, attention, check); lse is not
    differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, ring, attention, check):
        out, lse, (last_k, last_v) = _ring_forward(q, k, v, ring, attention, check)
        # The backward starts with the block the forward ended with (one K/V block of memory
        # for one transfer fewer, _ring_backward).
        ctx.save_for_backward(q, k, v, out, lse, last_k, last_v)
        ctx.ring, ctx.attention = ring, attention
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, last_k, last_v = ctx.saved_tensors
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, (last_k, last_v), ctx.ring,
                                    ctx.attention)
        return dq, dk, dv, None, None, None


def _run(q, k, v, ring, attention, return_lse, check):
    q, k, v = [t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out, lse = _RingFlashAttnFunction.apply(q, k, v, ring, attention, check)
    else:
        out, lse, _ = _ring_forward(q, k, v, ring, attention, check)
    return (out, lse) if return_lse else out


# ---- public entry points -------------------------------------------------------------------
def ring_flash_attn_func(q, k, v, group: Optional["dist.ProcessGroup"] = None,
                         causal: bool = False, softmax_scale: Optional[float] = None,
                         softcap: float = 0.0, deterministic: bool = False,
                         return_lse: bool = False):
    """Exact attention over a sequence sharded across the ranks of `group` (default: the
    whole world), each rank calling with its own shard; forward and backward.

    q: [batch, seqlen_local, heads, head_dim]; k, v: [batch, seqlen_local, heads_k, head_dim]
    (heads % heads_k == 0: GQA / MQA); float32, float16 or bfloat16; CPU tensors with a gloo
    group, CUDA tensors (this rank's current device) with NCCL. causal=False: any split of
    the sequence, shard lengths may differ between ranks. causal=True: the zig-zag shards of
    zigzag_shard (rank r holds chunks r and 2W-1-r of 2W), the same length on every rank.
    softmax_scale (default 1/sqrt(head_dim)), softcap and deterministic as in flash_attn_func.
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
    check = _InputCheck(q, k, v, bool(causal), ring)
    # Every rank's length is known once the check is finished (_ring_forward, before its
    # first step).
    attention = _PaddedAttention((q.shape[1],) * ring.world, bool(causal),
                                 *_scalar_args(q, softmax_scale, softcap, deterministic))
    return _run(q, k, v, ring, attention, return_lse, check)


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, group: Optional["dist.ProcessGroup"] = None,
                                causal: bool = False, softmax_scale: Optional[float] = None,
                                softcap: float = 0.0, deterministic: bool = False,
                                return_lse: bool = False):
    """ring_flash_attn_func for a packed batch of sequences.

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
    check = _InputCheck(q, k, v, bool(causal), ring, packed=True, cu_seqlens=cu_seqlens)
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
    return _run(q, k, v, ring, attention, return_lse, check)
