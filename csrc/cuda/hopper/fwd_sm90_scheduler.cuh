// Hopper forward: the persistent grid's tile list (fwd_sm90_kernel.cuh):
// FwdSm90Tile and fwd_sm90_tile_at, which (query tile, head, batch) tile t of
// the list is (fwd_sm90_tile_of: with its key-tile range). Why this order and
// how CTAs claim tiles: the kernel; a packed batch's compact list:
// common/compact_tiles.cuh.
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

// The tile at (m_block, h, b), with its key tiles. trim (attn_mask kernels,
// producer only: the consumers get the range through the tile slot; the
// trimming loop would cost them registers). params by reference, as the
// kernel's lambdas capture them (helpers of the backward that took the
// kernel's scalars by value compiled to different SASS).
template <int kBlockM, int kBlockN, bool kIsCausal, bool kHasVariants, bool kAttnMask,
          bool kVarSeq>
FAE_DEVICE FwdSm90Tile fwd_sm90_tile_of(const AttentionFwdParams& params, int m_block, int h,
                                        int b, bool trim) {
  FwdSm90Tile tile;
  tile.m_block = m_block;
  tile.h = h;
  tile.b = b;
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

// Where tile t of the list is. The list has num_m_blocks query tiles per
// (head, batch), m_block fastest, counting down (attn_mask kernels: batch /
// heads first where the mask broadcasts, mask_blocks.cuh). kVarSeq kernels
// with a compact list (params.h compact_tiles): entry t, {b, m_block *
// heads + h}; an entry past the list gives b = -1.
struct FwdSm90TileCoords {
  int m_block, h, b;
};
template <bool kAttnMask, bool kVarSeq>
FAE_DEVICE FwdSm90TileCoords fwd_sm90_tile_coords(const AttentionFwdParams& params,
                                                  const int& num_m_blocks, int t) {
  if constexpr (kAttnMask) {
    const MaskGridTile g = attn_mask_grid_tile(params, t, num_m_blocks);
    return {num_m_blocks - 1 - g.block, g.h, g.b};
  }
  if (kVarSeq && params.compact_tiles != nullptr) {
    const int2 entry = reinterpret_cast<const int2*>(params.compact_tiles)[t];
    return {entry.y / params.heads, entry.y % params.heads, entry.x};
  }
  const int bh = t / num_m_blocks;
  return {num_m_blocks - 1 - t % num_m_blocks, bh % params.heads, bh / params.heads};
}

// Tile t of the list (fwd_sm90_tile_coords) with its key tiles; past a
// compact list's end: b = -1 and no rows (the producer stops there).
template <int kBlockM, int kBlockN, bool kIsCausal, bool kHasVariants, bool kAttnMask,
          bool kVarSeq>
FAE_DEVICE FwdSm90Tile fwd_sm90_tile_at(const AttentionFwdParams& params, const int& num_m_blocks,
                                        int t, bool trim) {
  const FwdSm90TileCoords c = fwd_sm90_tile_coords<kAttnMask, kVarSeq>(params, num_m_blocks, t);
  if (kVarSeq && c.b < 0) {
    FwdSm90Tile past;
    past.m_block = past.h = past.h_k = 0;
    past.b = -1;
    past.keys = {0, 0};
    past.has_rows = false;
    return past;
  }
  return fwd_sm90_tile_of<kBlockM, kBlockN, kIsCausal, kHasVariants, kAttnMask, kVarSeq>(
      params, c.m_block, c.h, c.b, trim);
}

}  // namespace cuda
}  // namespace flash_attn_ext
