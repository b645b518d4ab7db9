"""Adding up the ring's partial results per zig-zag chunk of the shard's rows.

_ChunkMerges: the forward's block outputs merged by their log-sum-exps (merge_partial_, in
fp32, one pass at a chunk's last block). _ChunkSums: the backward's dK/dV pieces added up in
fp32 (sum_partial_, one pass at a chunk's last piece). Both hold up to _MAX_HELD_PIECES
partial results in q's dtype before folding them into an fp32 one. _DqAccumulator: the fp32
dQ accumulator that every backward call adds into (the operators' dq_accum), converted once.
"""
import torch

from .. import ops  # noqa: F401  (loads the operators)
from .sharding import _narrow


def _covers(span: slice, chunk: slice):
    return span.start <= chunk.start and chunk.stop <= span.stop


def _part(t, dim, span: slice, chunk: slice):
    """The rows of `chunk` in t, a piece's output over the rows `span` (which covers it)."""
    return t.narrow(dim, chunk.start - span.start, chunk.stop - chunk.start)


# Partial results a chunk holds before they are folded into an fp32 one: a chunk's gradient
# pieces (_ChunkSums) or block outputs (_ChunkMerges) are added up in one pass when its last
# one arrives, up to this many of them held meanwhile (in q's dtype: with 16-bit ones the
# memory of two fp32 sums).
_MAX_HELD_PIECES = 4


class _ChunkSums:
    """Sums of gradient pieces over the zig-zag chunks of one shard (rows along dim), added
    in fp32 and rounded once, as an fp32 accumulator would, in few passes over memory: a
    chunk holds its pieces as the operator returned them (q's dtype: no copy) and at its
    last piece adds them straight into `result` (q's dtype) in one pass (sum_partial_), after
    folding every _MAX_HELD_PIECES of them into an fp32 sum on the way. (An fp32 accumulator
    read and written per piece moves 10 bytes per element and piece, one pass over the
    pieces 2: at 4 ranks the old running sums took 1.6 ms of the slowest rank's iteration,
    and the ring's iteration went from 17.2 to 16.1 ms with this, 4x H100.) touches: how
    many pieces will cover each chunk in all."""

    def __init__(self, chunks, touches, dim, result):
        self.chunks, self.dim, self.touches, self.result = chunks, dim, touches, result
        self.left = list(touches)
        self.held = [[] for _ in chunks]
        self.sums = [None] * len(chunks)  # fp32 sums of the pieces folded so far

    def add(self, span: slice, piece):
        add = torch.ops.flash_attn_ext.sum_partial_
        for i, chunk in enumerate(self.chunks):
            if not _covers(span, chunk):
                continue
            held, folded = self.held[i], self.sums[i]
            held.append(_part(piece, self.dim, span, chunk))
            self.left[i] -= 1
            if self.left[i] == 0:
                dest = _narrow(self.result, self.dim, chunk)
                if folded is None and len(held) == 1:
                    dest.copy_(held[0])
                else:
                    add(dest, held, folded)
                self.held[i], self.sums[i] = [], None
            elif len(held) == _MAX_HELD_PIECES:
                if folded is None:
                    self.sums[i] = torch.empty(held[0].shape, dtype=torch.float32,
                                               device=held[0].device)
                add(self.sums[i], held, folded)
                self.held[i] = []

    def finish(self):
        """The result, after zeroing the chunks that no piece covered."""
        for chunk, touches in zip(self.chunks, self.touches):
            if touches == 0:
                _narrow(self.result, self.dim, chunk).zero_()
        return self.result


class _DqAccumulator:
    """dQ of the shard over all its pieces: every backward call adds its dQ / scale into one
    fp32 accumulator (the backward operators' dq_accum, which the Hopper kernel adds into
    directly), converted to q's dtype once at the end. (Per call a dq of its own costs a
    zeroed workspace, a conversion pass and a sum over the pieces: at 4 ranks, 8k tokens
    per rank, the no-comm iteration 15.0-15.2 -> 14.6-14.9 ms on an H100.) With softmax_scale
    0, dQ is 0 and nothing is accumulated.

    The operators take the accumulator in lse's layout with head_dim last ([batch, heads,
    seqlen, head_dim], packed [heads, total, head_dim]); this one is that view of a tensor
    stored sequence first ([seqlen, batch, heads, head_dim], packed [total, heads,
    head_dim]): its (batch, head) slices are then one pitch apart, which the Hopper kernel's
    TMA map needs, and at batch 1 the conversion to q's layout is one contiguous pass."""

    def __init__(self, q, attention):
        self.q, self.attention = q, attention
        self.stored = None
        if attention.scale != 0:
            self.stored = torch.zeros(q.movedim(attention.seq_dim, 0).shape,
                                      dtype=torch.float32, device=q.device)

    def rows(self, rows: slice):
        """The accumulator of a piece's rows (for its backward call), or None."""
        if self.stored is None:
            return None
        return _narrow(self.stored.movedim(0, -2), -2, rows)  # lse's layout, head_dim last

    def finish(self):
        dq = torch.empty_like(self.q)
        if self.stored is None:
            return dq.zero_()
        return torch.mul(self.stored.movedim(0, self.attention.seq_dim), self.attention.scale,
                         out=dq)


def _touches(chunks, spans):
    return [sum(_covers(span, chunk) for span in spans) for chunk in chunks]


class _ChunkMerges:
    """The forward's result (out, lse) over the zig-zag chunks of the shard's rows, the
    counterpart of _ChunkSums: a chunk holds its blocks' outputs as the operator returned
    them (q's dtype: no copy) and merges them straight into `out` in one pass at its last
    block (merge_partial_, in fp32, rounded once), after folding every _MAX_HELD_PIECES of
    them into an fp32 running result on the way. touches: how many blocks will cover each
    chunk; chunks that none covers are finished here (rows without any key: zeros, lse
    -inf)."""

    def __init__(self, chunks, touches, dim, out, lse):
        self.chunks, self.dim, self.out, self.lse = chunks, dim, out, lse  # lse: all -inf
        self.held = [[] for _ in chunks]
        self.running = [None] * len(chunks)  # fp32 merge of the blocks folded so far
        self.left = list(touches)
        for chunk, left in zip(chunks, self.left):
            if left == 0:
                _narrow(out, dim, chunk).zero_()

    def add(self, span: slice, block_out, block_lse):
        merge = torch.ops.flash_attn_ext.merge_partial_
        for i, chunk in enumerate(self.chunks):
            if not _covers(span, chunk):
                continue
            held, running = self.held[i], self.running[i]
            held.append((_part(block_out, self.dim, span, chunk),
                         _part(block_lse, block_lse.dim() - 1, span, chunk)))
            lse = _narrow(self.lse, -1, chunk)
            self.left[i] -= 1
            if self.left[i] == 0:
                dest = _narrow(self.out, self.dim, chunk)
                if running is None and len(held) == 1:
                    dest.copy_(held[0][0])
                    lse.copy_(held[0][1])
                else:  # lse is -inf until the first fold: out is not read then
                    merge(dest, lse, [o for o, _ in held], [s for _, s in held], running)
                self.held[i], self.running[i] = [], None
            elif len(held) == _MAX_HELD_PIECES:
                if running is None:
                    self.running[i] = torch.empty(held[0][0].shape, dtype=torch.float32,
                                                  device=held[0][0].device)
                merge(self.running[i], lse, [o for o, _ in held], [s for _, s in held])
                self.held[i] = []
