"""Context parallelism: exact attention over a sequence sharded across the ranks of a
torch.distributed process group (ring attention).

ring_flash_attn_func(q, k, v, group=None, causal=False, ...) takes this rank's shard of the
sequence, [batch, seqlen_local, heads, head_dim] (flash-attn's layout, GQA allowed), and
returns this rank's rows of the attention over the whole sequence; its gradients are those of
single-process attention over the whole sequence, restricted to this rank's shard.
ring_flash_attn_varlen_func does the same for a packed batch of sequences
([total_local, heads, head_dim] and the batch's global cu_seqlens).

Sharding:
  causal=False  any split of the sequence into per-rank shards (contiguous, zig-zag, ...;
                lengths may differ between ranks): without a mask the order of the keys does
                not matter.
  causal=True   the zig-zag layout of zigzag_shard: the sequence is cut into 2 * world chunks
                and rank r holds chunks r and 2 * world - 1 - r, so every rank has the same
                amount of causal work. Every rank must hold the same number of tokens.
  varlen        every sequence is cut like that (its length a multiple of world) and a rank
                holds its first chunk of every sequence, then its second chunk of every
                sequence (zigzag_shard_varlen), causal or not.

Schedule (world W, rank r): the forward runs W steps; at step i this rank computes its
queries against the K/V block of rank (r - i) mod W with the forward operator, which returns
(out, lse), and merges the partial results by their log-sum-exps (merge_partial_: a chunk of
rows keeps its blocks' results in q's dtype and merges them in fp32 in one pass at the last).
Each block comes straight from its owner, fetched during the step before the one that needs
it: on NCCL groups the owner's copy in symmetric memory is read by this GPU's copy engines
(torch.distributed._symmetric_memory; no SMs taken, so the transfer runs beside the
persistent forward kernel), otherwise by torch.distributed P2P (gloo, or
FLASH_ATTN_EXT_RING_SYMMETRIC_MEMORY=0). The backward runs the blocks in the reverse order
with the backward operator, given the global (merged) out and lse: FlashAttention's backward
rebuilds P = exp(scale * Q K^T - lse) and dS = P * (dP - rowsum(dO * O)), which for a block
of keys is the block's share of the whole-sequence gradient exactly when out and lse are the
global ones. Every call adds its dQ into one fp32 accumulator of the shard (the backward
operator's dq_accum), converted once; the dK/dV pieces of a block go straight to its owner
(P2P), which adds them up in fp32 (one pass, at the last one). Nothing is all-gathered:
memory stays O(local shard) (two K/V blocks in flight, one shard's K/V kept from the forward
for the backward's first step, up to four partial results per half shard held until they
are added up, the fp32 dQ accumulator, and on NCCL one shard's K/V in symmetric memory, kept
between calls).
"""
import contextlib
import itertools
import math
import numbers
import os
from typing import List, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from . import ops  # noqa: F401  (loads the operators)

__all__ = ["ring_flash_attn_func", "ring_flash_attn_varlen_func", "zigzag_shard",
           "zigzag_unshard", "zigzag_shard_varlen", "zigzag_unshard_varlen"]

_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}


# ---- zig-zag sharding ---------------------------------------------------------------------
def _check_world_and_rank(rank, world):
    if not (isinstance(world, int) and world >= 1):
        raise ValueError(f"flash_attn_ext: world must be an int >= 1, got {world!r}")
    if not (isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"flash_attn_ext: rank must be an int in [0, {world}), got {rank!r}")


def _zigzag_chunks(x, rank, world, dim):
    """(chunk rank, chunk 2 * world - 1 - rank) of x cut into 2 * world chunks along dim; with
    len(x) = world * n and n odd, the first world chunks have the extra token."""
    seqlen = x.shape[dim]
    if seqlen % world != 0:
        raise ValueError(f"flash_attn_ext: zig-zag sharding needs sequence lengths divisible "
                         f"by the world size (equal shards), got {seqlen} tokens for {world} "
                         f"ranks")
    chunks = x.tensor_split(2 * world, dim=dim)
    return chunks[rank], chunks[2 * world - 1 - rank]


def zigzag_shard(x: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s zig-zag shard of the full sequence `x` (sequence along `dim`): the
    sequence is split into 2 * world chunks (torch.tensor_split) and the shard is chunk `rank`
    followed by chunk 2 * world - 1 - rank, the layout ring_flash_attn_func(causal=True)
    expects. The sequence length must be a multiple of `world` (every rank then holds the same
    number of tokens; with an odd shard length its first chunk is one token longer). Returns a
    new tensor."""
    _check_world_and_rank(rank, world)
    return torch.cat(_zigzag_chunks(x, rank, world, dim), dim=dim)


def zigzag_unshard(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's zig-zag shard, in rank order (e.g. the list that
    torch.distributed.all_gather fills): the inverse of zigzag_shard."""
    if len(shards) == 0:
        raise ValueError("flash_attn_ext: zigzag_unshard needs the shards of every rank")
    if len({s.shape[dim] for s in shards}) != 1:
        raise ValueError(f"flash_attn_ext: zig-zag shards must all have the same length, got "
                         f"{[s.shape[dim] for s in shards]}")
    firsts, seconds = zip(*([_narrow(s, dim, rows) for rows in _halves(s.shape[dim])]
                            for s in shards))
    return torch.cat(firsts + seconds[::-1], dim=dim)


def _host_cu_seqlens(cu_seqlens) -> List[int]:
    """cu_seqlens (int tensor on any device, or a sequence of ints) -> a checked list."""
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if (len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:]))
            or not all(isinstance(c, int) for c in cu)):
        raise ValueError(f"flash_attn_ext: cu_seqlens must be [0, ...] non-decreasing ints "
                         f"(batch + 1 >= 2 of them), got {cu}")
    return cu


def zigzag_shard_varlen(x: torch.Tensor, cu_seqlens, rank: int, world: int,
                        dim: int = 0) -> torch.Tensor:
    """Rank `rank`'s shard of a packed batch (sequences along `dim` at the offsets of the
    global cu_seqlens, each length a multiple of `world`): every sequence is zig-zag split as
    by zigzag_shard, and the shard is the rank's first chunk of every sequence followed by its
    second chunk of every sequence, the layout ring_flash_attn_varlen_func expects (every
    piece of work is then a contiguous range of rows). Returns a new tensor of
    cu_seqlens[-1] / world rows."""
    _check_world_and_rank(rank, world)
    cu = _host_cu_seqlens(cu_seqlens)
    pairs = [_zigzag_chunks(x.narrow(dim, start, end - start), rank, world, dim)
             for start, end in zip(cu, cu[1:])]
    return torch.cat([first for first, _ in pairs] + [second for _, second in pairs], dim=dim)


def zigzag_unshard_varlen(shards: Sequence[torch.Tensor], cu_seqlens,
                          dim: int = 0) -> torch.Tensor:
    """The packed batch from every rank's zigzag_shard_varlen shard, in rank order."""
    world = len(shards)
    if world == 0:
        raise ValueError("flash_attn_ext: zigzag_unshard_varlen needs the shards of every rank")
    chunks = _PackedChunks(_host_cu_seqlens(cu_seqlens), world, torch.device("cpu"))
    if any(s.shape[dim] != chunks.total for s in shards):
        raise ValueError(f"flash_attn_ext: each shard must have {chunks.total} rows, got "
                         f"{[s.shape[dim] for s in shards]}")
    sequences = []
    for b in range(chunks.batch):
        per_rank = [[s.narrow(dim, *chunks.rows_of(c, b)) for c in (0, 1)] for s in shards]
        sequences += [firsts for firsts, _ in per_rank] + [seconds for _, seconds in per_rank[::-1]]
    return torch.cat(sequences, dim=dim)


# ---- the ring -----------------------------------------------------------------------------
class _InFlight:
    """Blocks on their way from another rank; wait() returns them (a tuple). Keeps the
    tensors being sent alive until the transfer is done (gloo reads them asynchronously).
    side: the blocks were allocated on our side stream (the caching allocator is told that
    the current stream uses them too)."""

    def __init__(self, works, received, sent=None, side=False):
        self._works, self._received, self._sent, self._side = works, received, sent, side

    def wait(self) -> torch.Tensor:
        # On CUDA, Work.wait() makes the current stream wait for NCCL's: no host sync.
        for work in self._works:
            work.wait()
        self._sent = None
        if self._side:
            for t in self._received:
                t.record_stream(torch.cuda.current_stream())
        return self._received


class _Ring:
    """This rank's place in `group` and the one P2P communication step: send blocks to one
    rank while receiving blocks from another.

    communicate=False (benchmarks only) keeps the same rank, world and block schedule but
    "receives" the block it sends, so a run computes exactly the same blocks without any
    communication: the difference in time is the communication that the compute does not
    hide."""

    def __init__(self, group=None, communicate=True):
        self.group = dist.group.WORLD if group is None else group
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.communicate = communicate

    def exchange(self, blocks, to, received, source, device, after=None) -> _InFlight:
        """Starts sending the tensors `blocks` (contiguous) to group rank `to` and receiving
        tensors of the (shape, dtype)s `received` from group rank `source`, in one batch of
        P2P operations (K and V go as two messages: no stacked copy of them). NCCL's stream
        waits for the current stream; with after (a CUDA event), for the side stream
        instead, which waits for that event, and the received tensors are allocated on the
        side stream (their memory's earlier users are then ordered before the receive)."""
        blocks = tuple(blocks)
        if self.world == 1 or not self.communicate:
            if [(tuple(b.shape), b.dtype) for b in blocks] == [(tuple(s), d) for s, d in received]:
                return _InFlight([], blocks)
            # Without communication, the same amount of memory in the shapes expected.
            return _InFlight([], tuple(torch.empty(s, dtype=d, device=device) for s, d in received))
        to, source = (dist.get_global_rank(self.group, r) for r in (to, source))
        side = after is not None  # a CUDA event: CUDA tensors
        with torch.cuda.stream(_side_stream(device, after)) if side else contextlib.nullcontext():
            received = tuple(torch.empty(s, dtype=d, device=device) for s, d in received)
            p2p = [dist.P2POp(dist.isend, b, to, self.group) for b in blocks]
            p2p += [dist.P2POp(dist.irecv, r, source, self.group) for r in received]
            works = dist.batch_isend_irecv(p2p) if p2p else []
        return _InFlight(works, received, sent=blocks, side=side)


# "0" keeps the K/V transfers on NCCL (torch.distributed P2P) instead of copy engines
# reading symmetric memory (README "Ring attention").
_SYMMETRIC_MEMORY = os.environ.get("FLASH_ATTN_EXT_RING_SYMMETRIC_MEMORY", "1") != "0"
_symmetric_buffers = {}  # (group, device, dtype) -> (buffer, handle, buffer's offset)


def _symmetric_memory_available(ring, block):
    if not (_SYMMETRIC_MEMORY and block.is_cuda and ring.communicate and ring.world > 1):
        return False
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return dist.get_backend(ring.group) == "nccl"


def _symmetric_buffer(ring, device, dtype, numel):
    """A buffer of symmetric memory (torch.distributed._symmetric_memory) of at least numel
    elements, the same on every rank of the ring (a collective when it is made or grown:
    every rank asks for the same size), with its handle and where it starts in the
    allocation that handle.get_buffer indexes (in elements: a pool may hold several)."""
    from torch.distributed import _symmetric_memory as symm_mem
    key = (ring.group, device, dtype)
    entry = _symmetric_buffers.get(key)
    if entry is None or entry[0].numel() < numel:
        if entry is not None:
            torch.cuda.synchronize(device)  # every read of the old one is done
        try:
            if hasattr(symm_mem, "enable_symm_mem_for_group"):  # older torch needs it first
                symm_mem.enable_symm_mem_for_group(ring.group.group_name)
            buf = symm_mem.empty(numel, dtype=dtype, device=device)
            handle = symm_mem.rendezvous(buf, ring.group)
        except Exception as e:  # noqa: BLE001  (torch raises several kinds here)
            raise RuntimeError(
                f"flash_attn_ext: ring attention could not set up symmetric memory for its K/V "
                f"transfers ({type(e).__name__}: {e}); set FLASH_ATTN_EXT_RING_SYMMETRIC_MEMORY=0 "
                f"on every rank to send them by NCCL P2P instead") from e
        offset = getattr(handle, "offset", None)
        if offset is None:
            offset = buf.data_ptr() - handle.buffer_ptrs[handle.rank]
        entry = _symmetric_buffers[key] = (buf, handle, offset // buf.element_size())
    return entry


class _Copied:
    """Blocks being copied from a peer on the side stream (allocated there); wait() makes
    the current stream wait for the copy and returns them (a tuple)."""

    def __init__(self, done, received):
        self._done, self._received = done, received

    def wait(self):
        current = torch.cuda.current_stream()
        current.wait_event(self._done)
        for t in self._received:
            t.record_stream(current)
        return self._received


class _KVFetches:
    """Fetching other ranks' K/V blocks (own: this rank's (K, V), contiguous; seqlens:
    every rank's length). start(source, to) starts fetching rank source's block while rank
    `to` fetches ours (the ranks' (source, to) pairs of one call form a permutation). The
    transfers are ordered on our side stream, after an event recorded at construction
    (own is ready then) and after each other, not after what the current stream queues
    later: a fetch can run while the compute queued before it still runs.

    With NCCL (CUDA, torch.distributed._symmetric_memory available): every rank copies its
    K/V into a buffer of symmetric memory, which the others read with their copy engines:
    a transfer that takes no SMs, so it runs beside the persistent forward kernel, which
    NCCL's kernels would have to wait for (4x H100: docs/PERFORMANCE.md). One device-side
    barrier after the copies in, one at finish() after every read (the buffer is written
    again by the next call). Otherwise (gloo, or FLASH_ATTN_EXT_RING_SYMMETRIC_MEMORY=0):
    one batch of P2P operations per start."""

    def __init__(self, ring, own, seqlens, dim):
        self.ring, self.own, self.seqlens, self.dim = ring, own, seqlens, dim
        self.device = own[0].device
        self.after = None  # where the transfers may start: once own is ready
        if own[0].is_cuda:
            self.after = torch.cuda.Event()
            self.after.record()
        self.handle = None
        if _symmetric_memory_available(ring, own[0]):
            k, v = own
            per_token = k.numel() // max(1, k.shape[dim])
            buf, self.handle, self.base = _symmetric_buffer(ring, self.device, k.dtype,
                                                            2 * per_token * max(seqlens))
            # After the previous call's finish() barrier (the side stream's order).
            with torch.cuda.stream(_side_stream(self.device, self.after)):
                buf[:k.numel()].view(k.shape).copy_(k)
                buf[k.numel():k.numel() + v.numel()].view(v.shape).copy_(v)
                self.handle.barrier(channel=0)

    def start(self, source, to):
        shapes = [(_block_shape(t, self.dim, self.seqlens[source]), t.dtype) for t in self.own]
        if self.handle is None:
            return self.ring.exchange(self.own, to, shapes, source, self.device, self.after)
        with torch.cuda.stream(_side_stream(self.device)):
            # One allocation for K and V: the source's buffer holds them one after the other.
            sizes = [math.prod(shape) for shape, _ in shapes]
            flat = torch.empty(sum(sizes), dtype=shapes[0][1], device=self.device)
            flat.copy_(self.handle.get_buffer(source, flat.shape, flat.dtype, self.base))
            done = torch.cuda.Event()
            done.record()
        return _Copied(done, (flat[:sizes[0]].view(shapes[0][0]),
                              flat[sizes[0]:].view(shapes[1][0])))

    def finish(self):
        """After the last start(): nobody reads our buffer once its barrier is passed."""
        if self.handle is not None:
            with torch.cuda.stream(_side_stream(self.device)):
                self.handle.barrier(channel=0)


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


def _halves(length):
    """The rows of a zig-zag shard's two chunks (the first one token longer if odd)."""
    first = (length + 1) // 2
    return slice(0, first), slice(first, length)


def _span(chunk_rows, chunks):
    """The rows from the first to the last of `chunks` (indices into chunk_rows)."""
    return slice(chunk_rows[min(chunks)].start, chunk_rows[max(chunks)].stop)


def _narrow(t, dim, rows: slice):
    return t.narrow(dim, rows.start, rows.stop - rows.start)


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
                                            None, 0.0, None, None, dq_accum)


class _PackedChunks:
    """The zig-zag chunks of a packed batch on every rank (all ranks alike): with sequence b of
    length world * n_b, its first chunk has ceil(n_b / 2) rows, its second floor(n_b / 2); a
    shard holds all first chunks, then all second chunks."""

    def __init__(self, cu_seqlens: List[int], world, device):
        lengths = [end - start for start, end in zip(cu_seqlens, cu_seqlens[1:])]
        if any(n % world for n in lengths):
            raise ValueError(f"flash_attn_ext: zig-zag sharding needs sequence lengths divisible "
                             f"by the world size ({world}), got {lengths}")
        local = [n // world for n in lengths]
        self.batch = len(lengths)
        self.lengths = ([(n + 1) // 2 for n in local], [n // 2 for n in local])
        self.offsets = [list(itertools.accumulate(n, initial=0)) for n in self.lengths]
        first_total = self.offsets[0][-1]
        self.total = first_total + self.offsets[1][-1]
        self.rows = [slice(0, first_total), slice(first_total, self.total)]
        # Each chunk's cu_seqlens, relative to its rows: what the varlen operators take.
        self.cu = [torch.tensor(o, dtype=torch.int32, device=device) for o in self.offsets]
        self.max_len = [max(n) for n in self.lengths]

    def rows_of(self, chunk, b):
        """(start, length) of chunk `chunk` of sequence b in a shard."""
        return self.rows[chunk].start + self.offsets[chunk][b], self.lengths[chunk][b]


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
                                                   self.softcap, None, 0.0, None, None, dq_accum)


def _block_shape(block, seq_dim, seqlen):
    """The shape of `block` (a K or V block, or a dK / dV piece) with `seqlen` rows."""
    shape = list(block.shape)
    shape[seq_dim] = seqlen
    return shape


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


def _whole_shard_piece(q, k, ring, attention):
    """The one piece of a single-rank ring when it covers the whole shard (then the ring is
    one call of the operators, with no partial results to merge), else None."""
    if ring.world != 1:
        return None
    pieces = attention.pieces(0, ring.rank, ring.world)
    dim = attention.seq_dim
    if (len(pieces) == 1 and pieces[0].rows == slice(0, q.shape[dim])
            and pieces[0].keys == slice(0, k.shape[dim])):
        return pieces[0]
    return None


def _ring_forward(q, k, v, ring, attention, check=None):
    """(out in q's dtype, lse float32, (K, V) of the block it ended with) of this rank's
    queries against the whole sequence, merged per chunk of rows (_ChunkMerges).

    At step i this rank computes against the K/V of rank r - i, fetched straight from its
    owner (_KVFetches; ours goes to rank r + i), not relayed round the ring: a fetch needs
    nothing but the owner's own K/V, so the first one starts before the first step's
    compute is queued, and each later one during the step before the one that needs it.
    `check` (_InputCheck) is finished first: nothing is sent before the inputs have passed
    on every rank. (Finished after the first step instead, its all_gather would wait for
    that step's persistent kernel to free SMs, and the first transfer for the host.)"""
    dim = attention.seq_dim
    if check is not None:  # every rank's length
        attention.seqlens = tuple(check.finish())
    whole = _whole_shard_piece(q, k, ring, attention)
    if whole is not None:
        return (*attention.forward(whole, q, k, v), (k, v))
    world, rank = ring.world, ring.rank
    out = torch.empty_like(q)
    lse = torch.full(attention.lse_shape(q), float("-inf"), dtype=torch.float32,
                     device=q.device)
    chunks = attention.chunks(rank)
    schedule = [attention.forward_pieces(step, rank, world) for step in range(world)]
    results = _ChunkMerges(chunks, _touches(chunks, [p.rows for ps in schedule for p in ps]),
                           dim, out, lse)
    fetches = _KVFetches(ring, (k.contiguous(), v.contiguous()), attention.seqlens, dim)

    def fetch(step):
        return fetches.start((rank - step) % world, (rank + step) % world)

    kv = fetches.own
    in_flight = fetch(1) if world > 1 else None
    for step in range(world):
        if step > 0:
            kv, in_flight = in_flight.wait(), (fetch(step + 1) if step + 1 < world else None)
        for p in schedule[step]:
            results.add(p.rows, *attention.forward(p, _narrow(q, dim, p.rows),
                                                   _narrow(kv[0], dim, p.keys),
                                                   _narrow(kv[1], dim, p.keys)))
    fetches.finish()
    return out, lse, kv


def _ring_backward(dout, q, k, v, out, lse, last_kv, ring, attention):
    """(dq, dk, dv) of this rank's shard, from the global out and lse of its rows.

    The K/V blocks come in the reverse order of the forward: first the one the forward
    ended with (last_kv, the block of rank + 1: no transfer to wait for), then those of
    rank + 2, ..., each from its owner (_KVFetches) one step ahead, last this rank's own.
    dQ adds up in one fp32 accumulator (_DqAccumulator).
    The dK/dV pieces a rank computes for a block go straight to the block's owner (at step
    i rank r sends to r + 1 + i and receives from r - 1 - i: a permutation, one message each
    way), as the operator returned them (q's dtype); the owner keeps its pieces as they
    arrive and adds them up in fp32 (_ChunkSums) with its own share at its last step."""
    dim = attention.seq_dim
    whole = _whole_shard_piece(q, k, ring, attention)
    if whole is not None:
        return attention.backward(whole, dout, q, k, v, out, lse.contiguous())
    world, rank = ring.world, ring.rank
    sources = [(rank + 1 + step) % world for step in range(world)]  # whose block, per step
    schedule = [attention.pieces((rank - s) % world, rank, world) for s in sources]
    dq = _DqAccumulator(q, attention)
    # Who computes pieces of our block at step i: rank - 1 - i, the last (i = world - 1) us.
    senders = [(rank - 1 - step) % world for step in range(world)]
    our_pieces = [attention.pieces((r - rank) % world, r, world) for r in senders]
    k_chunks = attention.chunks(rank)
    key_touches = _touches(k_chunks, [p.keys for ps in our_pieces for p in ps])
    dk_sums, dv_sums = (_ChunkSums(k_chunks, key_touches, dim, torch.empty_like(t))
                        for t in (k, v))

    def add_ours(pieces, dk_pieces, dv_pieces):
        for p, dk_piece, dv_piece in zip(pieces, dk_pieces, dv_pieces):
            dk_sums.add(p.keys, dk_piece)
            dv_sums.add(p.keys, dv_piece)

    # Blocks of other ranks at steps 1 .. world - 2, each from its owner (at step i rank r
    # fetches r + 1 + i's, r - 1 - i fetches ours), one step ahead of the compute.
    fetches = (_KVFetches(ring, (k.contiguous(), v.contiguous()), attention.seqlens, dim)
               if world > 2 else None)

    def fetch(step):
        return fetches.start(sources[step], (rank - 1 - step) % world)

    kv = last_kv
    row_lse = {}  # the operators want a contiguous lse: one copy per row range used
    grads_in_flight = None
    for step, (source, pieces) in enumerate(zip(sources, schedule)):
        kv_in_flight = fetch(step + 1) if step + 2 < world else None
        dk_pieces, dv_pieces = [], []
        for p in pieces:
            bounds = (p.rows.start, p.rows.stop)
            if bounds not in row_lse:
                row_lse[bounds] = _narrow(lse, -1, p.rows).contiguous()
            _, dk_piece, dv_piece = attention.backward(
                p, _narrow(dout, dim, p.rows), _narrow(q, dim, p.rows),
                _narrow(kv[0], dim, p.keys), _narrow(kv[1], dim, p.keys),
                _narrow(out, dim, p.rows), row_lse[bounds], dq.rows(p.rows))
            dk_pieces.append(dk_piece)
            dv_pieces.append(dv_piece)
        if grads_in_flight is not None:  # the pieces of our block from the previous step
            received = grads_in_flight.wait()
            add_ours(our_pieces[step - 1], received[:len(received) // 2],
                     received[len(received) // 2:])
            grads_in_flight = None
        if source == rank:  # the last step: our own block
            add_ours(pieces, dk_pieces, dv_pieces)
        else:
            specs = [(_block_shape(k, dim, p.keys.stop - p.keys.start), k.dtype)
                     for p in our_pieces[step]]
            grads_in_flight = ring.exchange(
                [t.contiguous() for t in dk_pieces + dv_pieces], source, specs + specs,
                senders[step], q.device)
        if kv_in_flight is not None:
            kv = kv_in_flight.wait()
        elif step + 2 == world:
            kv = (k, v)  # the last step's block is our own
    if fetches is not None:
        fetches.finish()
    return dq.finish(), dk_sums.finish(), dv_sums.finish()


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


# ---- input checks --------------------------------------------------------------------------
class _Signature(NamedTuple):
    """What every rank must agree on (sent as int64 in one all_gather). batch: the batch size,
    or for packed inputs the number of sequences; cu_checksum: 0, or a checksum of the packed
    batch's cu_seqlens."""
    error: int
    packed: int
    batch: int
    seqlen: int
    heads: int
    heads_k: int
    head_dim: int
    dtype: int
    causal: int
    cu_checksum: int


def _local_input_error(q, k, v, packed, cu_seqlens):
    """(exception type, message) for inputs that are wrong on this rank alone, else None."""
    if packed:
        try:
            _host_cu_seqlens(cu_seqlens)
        except (ValueError, TypeError) as e:
            return ValueError, str(e).replace("flash_attn_ext: ", "")
    expected_shape = "3-D tensor [total_local, heads, head_dim]" if packed else \
        "4-D tensor [batch, seqlen_local, heads, head_dim]"
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            return TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}"
        if t.dim() != (3 if packed else 4):
            return RuntimeError, f"{name} must be a {expected_shape}, got shape {tuple(t.shape)}"
        if t.dtype not in _DTYPE_CODES:
            return RuntimeError, (f"{name} has dtype {t.dtype}; expected float32, float16 or "
                                  "bfloat16")
        if t.dtype != q.dtype or t.device != q.device:
            return RuntimeError, (f"q and {name} must have the same dtype and device, got "
                                  f"{q.dtype} on {q.device} and {t.dtype} on {t.device}")
    if k.shape != v.shape:
        return RuntimeError, (f"k and v must have the same shape, got {tuple(k.shape)} and "
                              f"{tuple(v.shape)}")
    # Every dim but the heads must match q's: the shard (and batch), and head_dim.
    if k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]:
        return RuntimeError, (f"k and v must have q's shard length{'' if packed else ', batch'} "
                              f"and head_dim, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if q.shape[-2] % k.shape[-2] != 0:
        return RuntimeError, (f"the number of query heads ({q.shape[-2]}) must be a multiple of "
                              f"the number of key/value heads ({k.shape[-2]})")
    if q.numel() == 0 or k.numel() == 0:
        return RuntimeError, f"empty shard: q has shape {tuple(q.shape)}"
    return None


def _signature(q, k, causal, packed, cu_seqlens, error):
    if error is not None:
        return _Signature(1, *[0] * 9)
    batch = len(cu_seqlens) - 1 if packed else q.shape[0]
    # Sum of position-weighted offsets: different cu_seqlens almost surely differ here.
    checksum = sum((i + 1) * c for i, c in enumerate(cu_seqlens)) % (1 << 62) if packed else 0
    return _Signature(0, int(packed), batch, q.shape[-3], q.shape[-2], k.shape[-2], q.shape[-1],
                      _DTYPE_CODES[q.dtype], int(causal), checksum)


def _describe(s: _Signature):
    dtype = {code: str(dtype) for dtype, code in _DTYPE_CODES.items()}[s.dtype]
    shard = f"{s.seqlen} tokens of {s.batch} sequences" if s.packed else \
        f"batch {s.batch} x {s.seqlen} tokens"
    return f"{shard}, {s.heads}/{s.heads_k} heads, head_dim {s.head_dim}, {dtype}"


_side_streams = {}


def _side_stream(device, after=None):
    """A stream of our own on `device` (high priority: its small kernels get SMs as soon as
    the attention kernels' CTAs retire), for work that runs beside the current stream's
    queue: the input check's all_gather, the K/V transfers and their barriers. after: a
    CUDA event it waits for first."""
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device, priority=-1)
    stream = _side_streams[device]
    if after is not None:
        stream.wait_event(after)
    return stream


class _InputCheck:
    """The inputs checked on every rank at once (one all_gather of a few integers), so that
    a bad input raises the same error on every rank instead of leaving the others waiting in
    the ring. Started when the call begins and finished (finish(): on CUDA the one host
    sync, for the all_gather alone, on our side stream) before the forward's first step:
    nothing is sent before the check has passed, and the GPU still has earlier work queued
    while the host waits. With bad inputs on this rank, the error is shared and raised at
    once."""

    def __init__(self, q, k, v, causal, ring, packed=False, cu_seqlens=None):
        error = _local_input_error(q, k, v, packed, cu_seqlens)
        self.cu_seqlens = _host_cu_seqlens(cu_seqlens) if packed and error is None else None
        self._error, self._ring, self._causal, self._packed = error, ring, causal, packed
        self._seqlens = None
        if isinstance(q, torch.Tensor):
            device = q.device
        elif dist.get_backend(ring.group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        mine = _signature(q, k, causal, packed, self.cu_seqlens, error)
        if ring.world == 1:
            self._gathered = [mine]
        elif device.type == "cuda":
            # On a stream of our own, so that finish() waits for the all_gather alone, not
            # for whatever the current stream has queued.
            side = _side_stream(device)
            with torch.cuda.stream(side):
                sent = torch.tensor(mine, dtype=torch.int64).pin_memory()
                sent = sent.to(device, non_blocking=True)
                gathered = torch.empty((ring.world, len(mine)), dtype=torch.int64, device=device)
                dist.all_gather_into_tensor(gathered, sent, group=ring.group)
                host = torch.empty(gathered.shape, dtype=torch.int64, pin_memory=True)
                host.copy_(gathered, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
            self._gathered = (done, host, sent, gathered)
        else:
            sent = torch.tensor(mine, dtype=torch.int64)
            gathered = [torch.empty_like(sent) for _ in range(ring.world)]
            dist.all_gather(gathered, sent, group=ring.group)
            self._gathered = [s.tolist() for s in gathered]
        if error is not None:
            self.finish()

    def finish(self) -> List[int]:
        """Every rank's shard length, in group-rank order (raises for bad inputs on any
        rank)."""
        if self._seqlens is not None:
            return self._seqlens
        if isinstance(self._gathered, tuple):
            done, host = self._gathered[:2]
            done.synchronize()
            self._gathered = host.tolist()
        signatures = [_Signature(*s) for s in self._gathered]
        error, causal, packed, ring = self._error, self._causal, self._packed, self._ring
        if error is not None:
            raise error[0](f"flash_attn_ext: ring attention (rank {ring.rank}): {error[1]}")
        bad_ranks = [r for r, s in enumerate(signatures) if s.error]
        if bad_ranks:
            raise RuntimeError(f"flash_attn_ext: ring attention: the inputs of rank(s) "
                               f"{bad_ranks} of the group are invalid (see the error there)")
        if len({s.causal for s in signatures}) != 1:
            raise ValueError("flash_attn_ext: ring attention: every rank of the group must pass "
                             "the same causal flag")
        if packed and len({s.cu_checksum for s in signatures}) != 1:
            raise ValueError("flash_attn_ext: ring_flash_attn_varlen_func: every rank of the "
                             "group must pass the same (global) cu_seqlens")
        # Non-causal padded shards may differ in length, nothing else may.
        may_differ = ("seqlen",) if not (causal or packed) else ()
        agreed = {tuple(value for field, value in s._asdict().items() if field not in may_differ)
                  for s in signatures}
        if len(agreed) != 1:
            what = "shard length, " if not may_differ else ""
            per_rank = "; ".join(f"rank {r}: {_describe(s)}" for r, s in enumerate(signatures))
            raise ValueError(f"flash_attn_ext: ring attention needs the same batch, {what}heads, "
                             f"heads_k, head_dim and dtype on every rank of the group"
                             f"{' (causal: zig-zag shards)' if causal else ''}, got {per_rank}")
        self._seqlens = [s.seqlen for s in signatures]
        return self._seqlens


def _process_group_ring(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flash_attn_ext: ring attention needs an initialised "
                           "torch.distributed process group (call "
                           "torch.distributed.init_process_group first)")
    if group is not None and dist.get_rank(group) < 0:
        raise RuntimeError(f"flash_attn_ext: ring attention: this process (global rank "
                           f"{dist.get_rank()}) is not a member of the group it was given")
    return _Ring(group)


def _scalar_args(q, softmax_scale, softcap, deterministic):
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"flash_attn_ext: softcap must be a float, got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"flash_attn_ext: softcap must be a finite number >= 0, got {softcap}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return scale, float(softcap), bool(deterministic)


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
