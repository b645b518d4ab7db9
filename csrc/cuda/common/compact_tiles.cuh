// A packed (varlen) batch's compact tile list (params.h compact_tiles): the
// (sequence, tile) pairs that exist, longest sequences first. The Hopper
// backward lists its key tiles in its preprocess kernel (one CTA per entry
// and head); the Hopper forward its (sequence, head, query tile) triples in
// compact_query_tiles_kernel before the kernel (tile t of its persistent grid
// is entry t), each head's tiles side by side as in the padded grid.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../../params.h"
#include "env.h"
#include "ptx.cuh"

namespace flash_attn_ext {
namespace cuda {

// Each sequence's block ranks it among all sequences (list_sequence_tiles),
// batch^2 steps in all: ~1 us of the GPU at 1k sequences, ~10 us at 4k, so
// larger batches keep the padded grids (compact_tiles_apply).
constexpr int kCompactTilesMaxBatch = 4096;

// Whether a call gets a compact list: packed, a batch that the ranking serves
// (and not empty: the list is written by one block per sequence), and
// FLASH_ATTN_EXT_VARLEN_GRID=compact (env.h; read only for packed calls, so
// that a bad value fails those alone).
inline bool compact_tiles_apply(const AttentionFwdParams& params) {
  return params.cu_seqlens_q != nullptr && params.batch > 0 &&
         params.batch <= kCompactTilesMaxBatch && varlen_grid_compact();
}

// An upper bound on sum_b ceil(len(b) / block) for sequences whose lengths add
// up to at most `total` rows: each sequence's last tile adds at most block - 1.
FAE_HOST_DEVICE int64_t compact_tiles_capacity(int64_t total, int batch, int block) {
  return (total + static_cast<int64_t>(batch) * (block - 1)) / block;
}

// Sequence b's entries for its n_b tiles, in `copies` runs of n_b (the
// forward: one run per head, so that the CTAs running at one time share a
// few heads' K / V in L2, as in the padded grid; with the heads innermost
// they spread over every head's and measured up to 7% slower): entry
// {b, tile * copies + c} for tile i = 0 .. n_b - 1 of run c (count_down:
// tile n_b - 1 - i), at the position that the sequences before it leave:
// those with more tiles, then those with as many and a smaller b.
// params.compact_tiles_capacity bounds the tiles per run. The last sequence
// also marks the entries past the list's end (b = -1). tiles_of(s): sequence
// s's tile count. All 256 threads of one block per sequence call it.
template <typename TilesOf>
FAE_DEVICE void list_sequence_tiles(const AttentionFwdParams& params, int b, bool count_down,
                                    int copies, TilesOf tiles_of) {
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
  // outside the list, and never a CTA of the backward's deterministic mode
  // waiting for a key tile of its sequence that is not in the grid (a hang).
  int2* const list = reinterpret_cast<int2*>(params.compact_tiles);
  const int64_t capacity = params.compact_tiles_capacity;
  const bool fits = before + mine <= capacity;
  const int64_t first = before * copies;
  const int64_t end = fits ? first + static_cast<int64_t>(mine) * copies : capacity * copies;
  for (int64_t e = first + threadIdx.x; e < end; e += blockDim.x) {
    const int k = static_cast<int>(e - first);  // mine > 0 here: the range is empty otherwise
    const int i = k % mine, tile = count_down ? mine - 1 - i : i;
    list[e] = fits ? make_int2(b, tile * copies + k / mine) : make_int2(-1, 0);
  }
  if (b == params.batch - 1) {
    for (int64_t e = total * copies + threadIdx.x; e < capacity * copies; e += blockDim.x) {
      list[e] = make_int2(-1, 0);
    }
  }
}

// The forward's list of (head, query tile) pairs per sequence (kBlockM rows),
// one block of 256 threads per sequence; block 0 also zeroes the dynamic scheduler's tile counter (in
// place of the memset before the padded grid).
template <int kBlockM>
__global__ void __launch_bounds__(256) compact_query_tiles_kernel(const AttentionFwdParams params) {
  if (blockIdx.x == 0 && threadIdx.x == 0 && params.tile_counter != nullptr) {
    *params.tile_counter = 0;
  }
  list_sequence_tiles(params, blockIdx.x, /*count_down=*/true, params.heads, [&](int s) {
    return (seq_bounds<true>(params, s).seqlen_q + kBlockM - 1) / kBlockM;
  });
}

}  // namespace cuda
}  // namespace flash_attn_ext
