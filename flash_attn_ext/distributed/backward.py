"""The ring's backward pass: _ring_backward, the blocks in the reverse order of the forward
with the backward operator given the global out and lse; dQ into one fp32 accumulator, the
dK/dV pieces of a block sent to its owner (P2P), which adds them up in fp32 (_ChunkSums).
"""
import torch

from .forward import _whole_shard_piece
from .merge import _ChunkSums, _DqAccumulator, _touches
from .sharding import _narrow
from .transport import _block_shape, _KVFetches


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
