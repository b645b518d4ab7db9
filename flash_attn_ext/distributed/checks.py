"""Checking a ring call's arguments: the process group (_process_group_ring), the scalars
(_scalar_args), and the tensors on every rank at once (_InputCheck: one all_gather of each
rank's _Signature, so that a bad input raises the same error on every rank).
"""
import math
import numbers
from typing import List, NamedTuple

import torch
import torch.distributed as dist

from .sharding import _host_cu_seqlens
from .transport import _Ring, _side_stream


_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}


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
    if k.shape[:-1] == v.shape[:-1] and k.shape[-1] != v.shape[-1]:
        # The K/V transport moves k and v as one kind of buffer.
        return NotImplementedError, (f"ring attention with a value head dim other than the "
                                     f"key's (k {tuple(k.shape)}, v {tuple(v.shape)}) is not "
                                     f"implemented; flash_attn_func takes it on one GPU")
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


def _sink_error(sink, q):
    """(exception type, message) for a bad learnable sink on this rank, else None: found
    before any collective, so that every rank raises (a rank raising alone would leave the
    others waiting in the check's all_gather)."""
    from ..interface import _sink_arg  # (interface imports nothing from distributed)
    try:
        _sink_arg(sink, q.shape[-2], q.device)
    except (TypeError, RuntimeError) as e:
        return type(e), str(e).replace("flash_attn_ext: ", "")
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


class _InputCheck:
    """The inputs checked on every rank at once (one all_gather of a few integers), so that
    a bad input raises the same error on every rank instead of leaving the others waiting in
    the ring. Started when the call begins and finished (finish(): on CUDA the one host
    sync, for the all_gather alone, on our side stream) before the forward's first step:
    nothing is sent before the check has passed, and the GPU still has earlier work queued
    while the host waits. With bad inputs on this rank, the error is shared and raised at
    once."""

    def __init__(self, q, k, v, causal, ring, packed=False, cu_seqlens=None, sink=None):
        error = _local_input_error(q, k, v, packed, cu_seqlens)
        if error is None and sink is not None:
            error = _sink_error(sink, q)
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
