"""Context parallelism: exact attention over a sequence sharded across the ranks of a
torch.distributed process group (ring attention).

ring_flash_attn_func(q, k, v, group=None, causal=False, ...) takes this rank's shard of the
sequence, [batch, seqlen_local, heads, head_dim] (flash-attn's layout, GQA allowed), and
returns this rank's rows of the attention over the whole sequence; its gradients are those of
single-process attention over the whole sequence, restricted to this rank's shard.
ring_flash_attn_varlen_func does the same for a packed batch of sequences
([total_local, heads, head_dim] and the batch's global cu_seqlens).

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

Modules:
  sharding   zigzag_shard / zigzag_unshard (and _varlen): the layouts, and their chunks.
  transport  the ring of ranks and the K/V transfers (symmetric memory or P2P).
  schedule   the pieces of work of each step, and the operator calls on one piece.
  merge      the partial results added up per chunk (out / lse, dK / dV, the dQ accumulator).
  forward    _ring_forward.
  backward   _ring_backward.
  checks     the arguments, checked on every rank at once.
  interface  ring_flash_attn_func, ring_flash_attn_varlen_func and their autograd Function.
"""
# The private names besides are for tests/test_distributed.py and the ring bench suite (the
# per-chunk sums and merges, the no-communication ring), which reach them through here.
from .interface import (_RingFlashAttnFunction, ring_flash_attn_func,  # noqa: F401
                        ring_flash_attn_varlen_func)
from .merge import _ChunkMerges, _ChunkSums, _touches  # noqa: F401
from .schedule import _PaddedAttention  # noqa: F401
from .sharding import zigzag_shard, zigzag_shard_varlen, zigzag_unshard, zigzag_unshard_varlen
from .transport import _Ring  # noqa: F401

__all__ = ["ring_flash_attn_func", "ring_flash_attn_varlen_func", "zigzag_shard",
           "zigzag_unshard", "zigzag_shard_varlen", "zigzag_unshard_varlen"]
