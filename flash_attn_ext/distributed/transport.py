"""Moving blocks between the ranks of the ring.

_Ring: this rank's place in the process group and one batch of torch.distributed P2P
operations (send blocks to one rank while receiving from another; communicate=False, for
benchmarks, keeps the schedule without communicating). _KVFetches: fetching other ranks'
K/V blocks straight from their owners, on NCCL groups by this GPU's copy engines reading the
owner's copy in symmetric memory (torch.distributed._symmetric_memory, a buffer per group
and dtype kept between calls), otherwise by P2P (gloo, or
FLASH_ATTN_EXT_RING_SYMMETRIC_MEMORY=0, read at import). _InFlight / _Copied: transfers
under way. _side_stream: the high-priority stream the transfers (and the input check's
all_gather) run on.
"""
import contextlib
import math
import os

import torch
import torch.distributed as dist


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


def _block_shape(block, seq_dim, seqlen):
    """The shape of `block` (a K or V block, or a dK / dV piece) with `seqlen` rows."""
    shape = list(block.shape)
    shape[seq_dim] = seqlen
    return shape


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
