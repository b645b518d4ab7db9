"""What the ring computes at each step, and how the operators run on it.

A step's work is a list of pieces (_Piece: query rows against the key rows of the block held
then, causal or not); _zigzag_chunk_pairs gives the (query chunk, key chunk) pairs of causal
zig-zag shards. _Attention and its two kinds, _PaddedAttention ([batch, seqlen_local,
heads, head_dim] shards: flash_attn_ext.fwd / bwd) and _PackedAttention (packed shards:
varlen_fwd / varlen_bwd), give every step's pieces and run the forward and backward operators
on one piece.
"""
from typing import List, NamedTuple

import torch

from .. import ops  # noqa: F401  (loads the operators)
from .sharding import _halves, _PackedChunks


class _Piece(NamedTuple):
    """This rank's query rows [rows) against the rows [keys) of the K/V block it holds at one
    step (contiguous ranges along the sequence dim); causal: masked like the diagonal block.
    q_chunk / k_chunk: which zig-zag chunk the ranges are (0 first, 1 second; packed
    batches look up their cu_seqlens by it)."""
    rows: slice
    keys: slice
    causal: bool
    q_chunk: int = -1
    k_chunk: int = -1


def _zigzag_chunk_pairs(step, rank, world):
    """For causal zig-zag shards: the (query chunk, key chunk, causal) pairs this rank computes
    at `step`, when it holds the block of rank s = (rank - step) mod world.

    Rank r holds global chunks r and 2W-1-r (its chunks 0 and 1), s holds s and 2W-1-s.
      step 0: 0-0 and 1-1 are diagonal (causal); 1-0 is in the past: full; 0-1 the future.
      s < r:  both our chunks come after chunk s and before chunk 2W-1-s: 0-0 and 1-0.
      s > r:  chunks s and 2W-1-s lie between our r and 2W-1-r: 1-0 and 1-1.
    Each later step is half a block of unmasked work, so every rank does the same amount."""
    source = (rank - step) % world
    if step == 0:
        return [(0, 0, True), (1, 0, False), (1, 1, True)]
    if source < rank:
        return [(0, 0, False), (1, 0, False)]
    return [(1, 0, False), (1, 1, False)]


def _nonempty(pieces):
    # One-token shards (and short packed sequences) have empty chunks: nothing to do there.
    return [p for p in pieces if p.rows.stop > p.rows.start and p.keys.stop > p.keys.start]


def _span(chunk_rows, chunks):
    """The rows from the first to the last of `chunks` (indices into chunk_rows)."""
    return slice(chunk_rows[min(chunks)].start, chunk_rows[max(chunks)].stop)


class _Attention:
    """What the ring loop needs to know about one kind of shard: the sequence dim, every
    rank's length, the pieces of each step and how to run the operators on a piece."""
    seq_dim: int  # of q / k / v / out; lse has its sequence dim last

    def __init__(self, seqlens, causal, softmax_scale, softcap, deterministic):
        self.seqlens = tuple(seqlens)  # tokens per rank, in group-rank order
        self.causal = causal
        self.scale, self.softcap, self.deterministic = softmax_scale, softcap, deterministic

    def lse_shape(self, q):
        raise NotImplementedError

    def chunks(self, rank) -> List[slice]:
        """The rows of rank's shard in its (non-empty) zig-zag chunks: every piece's rows and
        keys are a union of whole chunks, which is what _ChunkSums and _ring_forward keep
        their partial results by."""
        raise NotImplementedError

    def pieces(self, step, rank, world) -> List[_Piece]:
        raise NotImplementedError

    def forward_pieces(self, step, rank, world) -> List[_Piece]:
        """The pieces the forward computes at `step` (the same rows and keys as pieces())."""
        return self.pieces(step, rank, world)

    def forward(self, piece, q, k, v):
        raise NotImplementedError

    def backward(self, piece, dout, q, k, v, out, lse, dq_accum=None):
        """(dq, dk, dv) of a piece; with dq_accum (see _DqAccumulator) dQ / scale is added
        into it and dq comes back empty."""
        raise NotImplementedError


class _PaddedAttention(_Attention):
    """[batch, seqlen_local, heads, head_dim] shards, lse [batch, heads, seqlen_local].

    Causal: positions grow along a zig-zag shard, so the block's own diagonal (step 0) is one
    causal call over the whole shard, and the other steps' chunk pairs are contiguous too
    (all rows against the first chunk, or the second chunk against all keys)."""
    seq_dim = 1

    def lse_shape(self, q):
        return (q.shape[0], q.shape[2], q.shape[1])

    def chunks(self, rank):
        return [c for c in _halves(self.seqlens[rank]) if c.stop > c.start]

    def pieces(self, step, rank, world):
        q_len, k_len = self.seqlens[rank], self.seqlens[(rank - step) % world]
        if not self.causal:
            return _nonempty([_Piece(slice(0, q_len), slice(0, k_len), False)])
        # A padded shard's two chunks are adjacent, so a step's chunk pairs make one rectangle:
        # at step 0 the whole shard against itself (the 0-1 pair, the future, is masked out by
        # the causal call), later all rows against the first chunk or the second chunk
        # against all keys.
        pairs = _zigzag_chunk_pairs(step, rank, world)
        rows = _span(_halves(q_len), {q_chunk for q_chunk, _, _ in pairs})
        keys = _span(_halves(k_len), {k_chunk for _, k_chunk, _ in pairs})
        return _nonempty([_Piece(rows, keys, causal=step == 0)])

    def forward_pieces(self, step, rank, world):
        # The forward's first step in two calls: the first chunk against itself, then the
        # second against all keys (bottom-right causal: the first chunk unmasked, its own
        # diagonal masked). The first K/V fetch starts with a device-side barrier, a kernel:
        # behind one persistent forward kernel it would get an SM only when that kernel
        # ends, and the transfer would start only then, a whole step late; between two
        # calls the barrier (high-priority stream) gets one, and the transfer runs beside
        # the second (4x H100, 8k tokens per rank: 4 ranks 16.10 / 16.17 -> 15.94 / 15.80 ms
        # per iteration, 2 ranks 8.11 / 8.14 -> 7.95 / 8.01; the two calls cost no more
        # than the one without communication).
        if step != 0 or not self.causal or world == 1:
            return self.pieces(step, rank, world)
        first, second = _halves(self.seqlens[rank])
        return _nonempty([_Piece(first, first, True), _Piece(second, slice(0, second.stop), True)])

    def forward(self, piece, q, k, v):
        return torch.ops.flash_attn_ext.fwd(q, k, v, self.scale, piece.causal, True, 0, 0, None,
                                            -1, -1, self.softcap)

    def backward(self, piece, dout, q, k, v, out, lse, dq_accum=None):
        return torch.ops.flash_attn_ext.bwd(dout, q, k, v, out, lse, self.scale, piece.causal,
                                            True, self.deterministic, None, -1, -1, self.softcap,
                                            None, 0.0, None, None, dq_accum=dq_accum)


class _PackedAttention(_Attention):
    """Packed [total_local, heads, head_dim] shards (zigzag_shard_varlen), lse [heads,
    total_local]. A sequence's two chunks lie apart in the shard, so every step is up to four
    varlen calls, one per (query chunk, key chunk) pair, each over contiguous rows."""
    seq_dim = 0

    def __init__(self, chunks: _PackedChunks, world, *args):
        super().__init__((chunks.total,) * world, *args)
        self.chunks_of_shard = chunks

    def lse_shape(self, q):
        return (q.shape[1], q.shape[0])

    def chunks(self, rank):
        return [c for c in self.chunks_of_shard.rows if c.stop > c.start]

    def pieces(self, step, rank, world):
        if self.causal:
            pairs = _zigzag_chunk_pairs(step, rank, world)
        else:
            pairs = [(q_chunk, k_chunk, False) for q_chunk in (0, 1) for k_chunk in (0, 1)]
        rows = self.chunks_of_shard.rows
        return _nonempty([_Piece(rows[q_chunk], rows[k_chunk], causal, q_chunk, k_chunk)
                          for q_chunk, k_chunk, causal in pairs])

    def _varlen_args(self, piece):
        c = self.chunks_of_shard
        return (c.cu[piece.q_chunk], c.cu[piece.k_chunk], c.max_len[piece.q_chunk],
                c.max_len[piece.k_chunk], self.scale, piece.causal)

    def forward(self, piece, q, k, v):
        return torch.ops.flash_attn_ext.varlen_fwd(q, k, v, *self._varlen_args(piece), None, -1,
                                                   -1, self.softcap)

    def backward(self, piece, dout, q, k, v, out, lse, dq_accum=None):
        return torch.ops.flash_attn_ext.varlen_bwd(dout, q, k, v, out, lse,
                                                   *self._varlen_args(piece),
                                                   self.deterministic, None, -1, -1,
                                                   self.softcap, None, 0.0, None, None,
                                                   dq_accum=dq_accum)
