"""The ring's forward pass: _ring_forward, W steps of the forward operator against the K/V
block of rank (r - i) mod W, fetched one step ahead (_KVFetches), merged per chunk
(_ChunkMerges); _whole_shard_piece, the single-rank shortcut it shares with the backward.
"""
import torch

from .merge import _ChunkMerges, _touches
from .sharding import _narrow
from .transport import _KVFetches


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
