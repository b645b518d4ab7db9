// Hopper forward: the persistent grid's tile list (fwd_sm90_kernel.cuh):
// FwdSm90Tile and fwd_sm90_tile_at, which (query tile, head, batch) tile t of
// the list is, with its key-tile range. Why this order and how CTAs claim
// tiles: the kernel.
#pragma once
#include "../../params.h"
#include "../common/fwd_softmax.cuh"
#include "../common/mask_blocks.cuh"
#include "../common/ptx.cuh"

namespace flash_attn_ext {
namespace cuda {

struct FwdSm90Tile {
  int m_block, h, b, h_k;
  KeyTileRange keys;
  bool has_rows;  // kVarSeq: the tile starts inside its sequence
};

// Tile t of the list of num_m_blocks query tiles per (head, batch): m_block
// fastest, counting down (attn_mask kernels: batch / heads first where the
// mask broadcasts, mask_blocks.cuh), with its key tiles. trim (attn_mask
// kernels, producer only: the consumers get the range through the tile slot;
// the trimming loop would cost them registers). params and num_m_blocks by
// reference, as the kernel's lambdas capture them (helpers of the backward
// that took the kernel's scalars by value compiled to different SASS).
template <int kBlockM, int kBlockN, bool kIsCausal, bool kHasVariants, bool kAttnMask,
          bool kVarSeq>
FAE_DEVICE FwdSm90Tile fwd_sm90_tile_at(const AttentionFwdParams& params, const int& num_m_blocks,
                                        int t, bool trim) {
  FwdSm90Tile tile;
  if constexpr (kAttnMask) {  // batch / heads first where the mask broadcasts
    const MaskGridTile g = attn_mask_grid_tile(params, t, num_m_blocks);
    tile.m_block = num_m_blocks - 1 - g.block;
    tile.h = g.h;
    tile.b = g.b;
  } else {
    tile.m_block = num_m_blocks - 1 - t % num_m_blocks;
    const int bh = t / num_m_blocks;
    tile.h = bh % params.heads;
    tile.b = bh / params.heads;
  }
  tile.h_k = tile.h / (params.heads / params.heads_k);
  const SeqBounds seq = seq_bounds<kVarSeq, kVarSeq>(params, tile.b);
  tile.has_rows = !kVarSeq || tile.m_block * kBlockM < seq.seqlen_q;
  if constexpr (kHasVariants) {
    tile.keys = key_tile_range_variants<kBlockM, kBlockN>(seq, make_window(params, seq),
                                                          tile.m_block, 0, 1);
    if constexpr (kAttnMask) {
      // A boolean attn_mask's summary: key tiles at either end that no row
      // of the tile attends to are dropped (a padding mask's tail).
      if (trim && params.attn_mask_blocks != nullptr) {
        // Row blocks of the summary (kMaskBlock = 64 rows, one per warpgroup).
        // The tile's second row block only where it has rows.
        const int row0 = attn_mask_block_row(params, tile.b, tile.h, tile.m_block * 2);
        const bool two_rows = (tile.m_block * 2 + 1) * kMaskBlock < seq.seqlen_q;
        const int row1 = two_rows ? row0 + params.attn_mask_block_strides.row : row0;
        auto attends = [&](int n) {
          return ((attn_mask_block_at(params, row0, n) | attn_mask_block_at(params, row1, n)) &
                  kMaskBlockAttends) != 0u;
        };
        while (tile.keys.end > tile.keys.begin && !attends(tile.keys.end - 1)) --tile.keys.end;
        while (tile.keys.begin < tile.keys.end && !attends(tile.keys.begin)) ++tile.keys.begin;
      }
    }
  } else {
    tile.keys = key_tile_range<kBlockM, kBlockN, kIsCausal>(seq, tile.m_block, 0, 1);
  }
  return tile;
}

}  // namespace cuda
}  // namespace flash_attn_ext
