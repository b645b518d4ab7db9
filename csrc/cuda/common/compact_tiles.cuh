// A packed (varlen) batch's compact tile list for the Hopper forward
// (params.h compact_tiles): the (sequence, head, query tile) triples that
// exist, longest sequences first, each head's tiles side by side as in the
// padded grid. compact_query_tiles_kernel writes it before the forward, whose
// persistent grid takes entry t as its tile t. (The padded grid claims the
// longest sequence's tile count for every sequence and skips the tiles past
// each one: one atomic claim per skipped tile. The backward keeps its padded
// grid, where a CTA past its sequence exits at once: a compact list measured
// no faster there, docs/PERFORMANCE.md, "Varlen: compact grids".)
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../../params.h"
#include "ptx.cuh"

namespace flash_attn_ext {
namespace cuda {

// Each sequence's block ranks it among all sequences (list_sequence_tiles),
// batch^2 steps in all: ~1 us of the GPU at 1k sequences, ~10 us at 4k, so
// larger batches keep the padded grid (compact_tiles_apply).
constexpr int kCompactTilesMaxBatch = 4096;

// Whether a call gets a compact list: packed, and a batch that the ranking
// serves (and not empty: the list is written by one block per sequence).
inline bool compact_tiles_apply(const AttentionFwdParams& params) {
  return params.cu_seqlens_q != nullptr && params.batch > 0 &&
         params.batch <= kCompactTilesMaxBatch;
}

// An upper bound on sum_b ceil(len(b) / block) for sequences whose lengths add
// up to at most `total` rows: each sequence's last tile adds at most block - 1.
FAE_HOST_DEVICE int64_t compact_tiles_capacity(int64_t total, int batch, int block) {
  return (total + static_cast<int64_t>(batch) * (block - 1)) / block;
}

// Sequence b's entries for its n_b query tiles, one run of n_b per head (so
// that the CTAs running at one time share a few heads' K / V in L2, as in the
// padded grid; with the heads innermost they spread over every head's and
// measured up to 7% slower): entry {b, tile * heads + h} for i = 0 .. n_b - 1
// of run h, tile = n_b - 1 - i (the last, and under causal masking the
// longest, tile first), at the position that the sequences before it leave:
// those with more tiles, then those with as many and a smaller b.
// params.compact_tiles_capacity bounds the tiles per head. The last sequence
// also marks the entries past the list's end (b = -1). tiles_of(s): sequence
// s's tile count. All 256 threads of one block per sequence call it.
template <typename TilesOf>
FAE_DEVICE void list_sequence_tiles(const AttentionFwdParams& params, int b, TilesOf tiles_of) {
  __shared__ int64_t warp_sums[2][8];  // int64: bad cu_seqlens can sum past 2^31
  const int mine = tiles_of(b);
  int64_t before = 0, total = 0;
  for (int s = threadIdx.x; s < params.batch; s += blockDim.x) {
    const int n = tiles_of(s);
    total += n;
    if (n > mine || (n == mine && s < b)) before += n;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    before += __shfl_xor_sync(0xffffffff, before, offset);
    total += __shfl_xor_sync(0xffffffff, total, offset);
  }
  if (threadIdx.x % 32 == 0) {
    warp_sums[0][threadIdx.x / 32] = before;
    warp_sums[1][threadIdx.x / 32] = total;
  }
  __syncthreads();
  before = total = 0;
  for (int w = 0; w < 8; ++w) {
    before += warp_sums[0][w];
    total += warp_sums[1][w];
  }
  // Bad cu_seqlens (overlapping sequences: checked on the host only on
  // request) can list more tiles than the capacity bound. A sequence that
  // does not fit whole is dropped whole, its entries below the capacity
  // marked b = -1: wrong results, as such inputs give anyway, never a write
  // outside the list.
  int2* const list = reinterpret_cast<int2*>(params.compact_tiles);
  const int64_t capacity = params.compact_tiles_capacity;
  const int heads = params.heads;
  const bool fits = before + mine <= capacity;
  const int64_t first = before * heads;
  const int64_t end = fits ? first + static_cast<int64_t>(mine) * heads : capacity * heads;
  for (int64_t e = first + threadIdx.x; e < end; e += blockDim.x) {
    const int k = static_cast<int>(e - first);  // mine > 0 here: the range is empty otherwise
    const int tile = mine - 1 - k % mine;
    list[e] = fits ? make_int2(b, tile * heads + k / mine) : make_int2(-1, 0);
  }
  if (b == params.batch - 1) {
    for (int64_t e = total * heads + threadIdx.x; e < capacity * heads; e += blockDim.x) {
      list[e] = make_int2(-1, 0);
    }
  }
}

// The list for query tiles of kBlockM rows, one block of 256 threads per
// sequence; block 0 also zeroes the dynamic scheduler's tile counter (in
// place of the memset before the padded grid).
template <int kBlockM>
__global__ void __launch_bounds__(256) compact_query_tiles_kernel(const AttentionFwdParams params) {
  if (blockIdx.x == 0 && threadIdx.x == 0 && params.tile_counter != nullptr) {
    *params.tile_counter = 0;
  }
  list_sequence_tiles(params, blockIdx.x, [&](int s) {
    return (seq_bounds<true>(params, s).seqlen_q + kBlockM - 1) / kBlockM;
  });
}

}  // namespace cuda
}  // namespace flash_attn_ext
