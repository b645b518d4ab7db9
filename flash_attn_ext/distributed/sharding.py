"""Zig-zag sharding of sequences over the ranks of a ring, and the layout of its chunks.

zigzag_shard / zigzag_unshard (padded [batch, seqlen, ...] sequences) and
zigzag_shard_varlen / zigzag_unshard_varlen (packed batches at the offsets of cu_seqlens),
the helpers that find a zig-zag shard's chunks (_halves, _PackedChunks) and the checks of
their arguments.

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
"""
import itertools
from typing import List, Sequence

import torch


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


def _halves(length):
    """The rows of a zig-zag shard's two chunks (the first one token longer if odd)."""
    first = (length + 1) // 2
    return slice(0, first), slice(first, length)


def _narrow(t, dim, rows: slice):
    return t.narrow(dim, rows.start, rows.stop - rows.start)


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
