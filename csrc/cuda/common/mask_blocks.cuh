// Block summary of a boolean attn_mask (params.h, attn_mask_blocks): for
// blocks of kMaskBlock query rows x block_cols keys (block_cols: the key tile
// of the kernel that reads it, given to compute_attn_mask_blocks), whether
// some element attends (bit 0) and whether some element is masked (bit 1).
// The Hopper kernels trim key tiles (forward) or query tiles (backward) that
// nothing attends to from the ends of their ranges, and skip the
// per-element mask reads of tiles that nothing masks: a key-padding mask then
// costs what the shorter sequence costs. One byte per block, so that the
// forward's producer warp (24 registers) reads a tile's summary with one load.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../../params.h"
#include "ptx.cuh"

namespace flash_attn_ext {
namespace cuda {

constexpr uint32_t kMaskBlockAttends = 1u;  // some element attends
constexpr uint32_t kMaskBlockMasks = 2u;    // some element is masked

// Sets params.attn_mask_block_strides for blocks of kMaskBlock x block_cols
// (block_cols a multiple of 16, >= kMaskBlock: the op layer sized the buffer
// for kMaskBlock) and fills params.attn_mask_blocks (when set) from the mask
// on `stream`; mask_blocks.cu.
void compute_attn_mask_blocks(AttentionFwdParams& params, int block_cols, cudaStream_t stream);

// The summary's row r (rows [r, r + 1) * kMaskBlock) of (b, h), as an offset
// into params.attn_mask_blocks; broadcast dimensions have stride 0.
FAE_DEVICE int attn_mask_block_row(const AttentionFwdParams& p, int b, int h, int r) {
  const auto& st = p.attn_mask_block_strides;
  return b * st.batch + h * st.head + r * st.row;
}

// The summary of column block c in the row at offset `row` (attn_mask_block_row).
FAE_DEVICE uint32_t attn_mask_block_at(const AttentionFwdParams& p, int row, int c) {
  return p.attn_mask_blocks[row + c * p.attn_mask_block_strides.col];
}

// The summary of row block r and column block c of (b, h).
FAE_DEVICE uint32_t attn_mask_block(const AttentionFwdParams& p, int b, int h, int r, int c) {
  return attn_mask_block_at(p, attn_mask_block_row(p, b, h, r), c);
}

// The (block, head, batch) of tile t of the Hopper forward's attn_mask kernel
// (num_blocks x heads x batch tiles). Without broadcasting, block is fastest
// (the other kernels' order: the CTAs running at one time share a few heads'
// K/V in L2). A mask plane [Sq, Sk] that broadcasts over the batch (heads),
// e.g. a [1, H, Sq, Sk] bias, is read whole by each of the batch (head)
// tiles that use it, at the same place in their loops if they run side by
// side: so the batch (then heads) goes fastest, and a plane's tile comes from
// DRAM once and from L2 for the others (4x fewer DRAM bytes at B = 4; H100,
// bf16, D = 128, S = 4k, [1, H, S, S] bias: forward 6% faster). A mask without
// a row stride ([B, H, 1, Sk] padding) is small and keeps the order.
// The Hopper backward's attn_mask kernel (one CTA per key tile of a head)
// takes the same idea through its grid: (batch, key tile, head) where a mask
// plane broadcasts over the batch, so the batch's CTAs of a key tile, which
// read the same mask columns in the same order, run side by side; it reads
// (b, h, key tile) from blockIdx either way. (The order computed from a linear
// index, as the forward does, made its attn_mask kernels spill: the padding
// mask's backward lost 2.5%.) H100, bf16, D = 128, B = 4, S = 4k, [1, H, S, S]
// bias: backward 3.77 -> 3.64 ms; bool padding 2.80 -> 2.77 ms.
inline __host__ __device__ bool attn_mask_grid_batch_first(const AttentionFwdParams& p) {
  return p.attn_bias != nullptr && p.attn_bias_strides.row != 0 && p.attn_bias_strides.batch == 0 &&
         p.batch > 1;
}

struct MaskGridTile {
  int block, h, b;
};
FAE_DEVICE MaskGridTile attn_mask_grid_tile(const AttentionFwdParams& p, int t, int num_blocks) {
  const BiasStrides& st = p.attn_bias_strides;
  const bool batch_first = st.row != 0 && st.batch == 0;
  const bool heads_first = st.row != 0 && st.head == 0;
  MaskGridTile tile{0, 0, 0};
  if (batch_first) {
    tile.b = t % p.batch;
    t /= p.batch;
  }
  if (heads_first) {
    tile.h = t % p.heads;
    t /= p.heads;
  }
  tile.block = t % num_blocks;
  t /= num_blocks;
  if (!heads_first) {
    tile.h = t % p.heads;
    t /= p.heads;
  }
  if (!batch_first) tile.b = t;
  return tile;
}

}  // namespace cuda
}  // namespace flash_attn_ext
