// The FP8 forward's V^T, made in shared memory by the producer warpgroup in
// short calls (fwd_fp8_transposes_v; longer ones read V^T written by a pass
// before the kernel, fp8_fwd.cu).
//
// Why: e4m3 wgmmas read both operands K-major, and in O += P V the K
// dimension is the keys, so the consumers need V's tile as [head_dim rows x
// keys]. TMA brings V's tile in as it is ([keys x head_dim], 128-byte
// swizzle, K's layout) into a staging buffer; the four producer warps turn
// it into the V^T stage that the consumers read.
//
// One piece = 16 keys x 32 head-dim bytes, one ldmatrix.x4.trans, two byte
// permutes per register pair and one stmatrix.x4 per warp:
//
//   staging (V rows = keys)             ldmatrix.x4.trans (16-bit elements):
//   key 16g + 0..7   | d 0..15 | d 16..31 |   x[0] x[2]     register i of lane (g', q)
//   key 16g + 8..15  | d 0..15 | d 16..31 |   x[1] x[3]     = keys 2q, 2q + 1 (low,
//                                                               high half) x d 2g', 2g' + 1
//   byte_perm(x[0], x[1], 0x6420) = d 2g'     at keys 2q, 2q + 1, 8 + 2q, 9 + 2q
//   byte_perm(x[0], x[1], 0x7531) = d 2g' + 1 at the same keys
//
// Those four keys in that order are exactly the V^T positions 4q .. 4q + 3
// that the P fragments need (fp8_p_key_of_column, sm90_primitives.cuh), so
// the transposed registers go out whole by stmatrix (no shuffles).
//
// The head dims are permuted within every 16 (vt_row_of_dim): the stmatrix
// register of d = 2g' (or 2g' + 1) goes to V^T row g' (or 8 + g') of the
// group, so each stored 8x8 matrix covers 8 consecutive rows and its 16-byte
// units land in 8 different bank groups of the 128-byte swizzle (with rows in
// d order, rows 0, 2, .., 14 would hit 4: two-way conflicts on every store;
// FlashAttention-3 measured ~4% for those at D = 256). O's columns come out
// permuted the same way, which the epilogue undoes by where it stores each
// register (store_accumulator_row_dim_permuted): a lane holds head-dim
// columns 4q .. 4q + 3 of every 16.
// The index maps were checked byte for byte by an emulation of ldmatrix /
// stmatrix / prmt on the swizzled layouts before the first GPU run
// (docs/PERFORMANCE.md, FP8 forward).
#pragma once
#include <cstdint>

#include "../common/ptx.cuh"
#include "sm90_primitives.cuh"

namespace flash_attn_ext {
namespace cuda {

// The V^T row that holds head-dim column d, and the inverse (O's column n
// holds head-dim column dim_of_vt_row(n)).
__host__ __device__ constexpr int vt_row_of_dim(int d) {
  return 16 * (d / 16) + 8 * (d % 2) + (d % 16) / 2;
}
__host__ __device__ constexpr int dim_of_vt_row(int n) {
  return 16 * (n / 16) + 2 * (n % 8) + (n % 16) / 8;
}
static_assert(dim_of_vt_row(vt_row_of_dim(13)) == 13 && vt_row_of_dim(3) == 9,
              "the head-dim permutation and its inverse");

// staging: [kHeadDim / 128 chunks][kBlockN keys][128 B] (TMA, 128-byte
// swizzle); vt: [kBlockN / 128 chunks][kHeadDim rows][128 B] (the V^T stage
// the P V wgmma reads). Called by all 128 threads of the producer warpgroup:
// warp w takes the head-dim groups (32 bytes) w, w + 4, .. and every key
// group of them. Within one head-dim group only the key group changes, and
// with it the ldmatrix address by 16 rows (an immediate offset) and the
// stmatrix one by a chunk and a swizzle XOR: the producer's 24 registers hold
// two addresses per lane, and nothing spills.
template <int kBlockN, int kHeadDim>
FAE_DEVICE void transpose_v_tile_e4m3(uint32_t vt, uint32_t staging, int warp, int lane) {
  constexpr int kKeyGroups = kBlockN / 16;
  constexpr int kDimGroups = kHeadDim / 32;
  static_assert(kBlockN % 128 == 0 && kHeadDim % 128 == 0,
                "whole 128-byte swizzle rows in both layouts");
  static_assert(kDimGroups % 4 == 0, "head-dim groups split evenly over the four producer warps");
  const int m = lane / 8;  // the 8x8 matrix this lane addresses
  const int r = lane % 8;  // and its row; the row's key and V^T row are r modulo 8
#pragma unroll
  for (int dim_group = warp; dim_group < kDimGroups; dim_group += 4) {
    // ldmatrix: matrix m = keys 8 (m % 2) + r of the key group, 16-byte unit
    // m / 2 of the 32 head-dim bytes.
    const int unit = 2 * dim_group + m / 2;
    const uint32_t src =
        staging + (unit / 8) * kBlockN * 128 + (8 * (m % 2) + r) * 128 + (((unit % 8) ^ r) * 16);
    // stmatrix: matrix m = 16-byte unit m / 2, head dims of parity m % 2; its
    // row r is V^T row vt_row_of_dim(32 dim_group + 16 (m / 2) + 2 r + m % 2).
    const int row = 32 * dim_group + 16 * (m / 2) + 8 * (m % 2) + r;
    const uint32_t dst = vt + row * 128 + r * 16;
#pragma unroll
    for (int key_group = 0; key_group < kKeyGroups; ++key_group) {
      uint32_t x[4];
      sm90::ldmatrix_x4_trans_at(src + key_group * 16 * 128, x);
      uint32_t y[4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        y[2 * h] = __byte_perm(x[2 * h], x[2 * h + 1], 0x6420);
        y[2 * h + 1] = __byte_perm(x[2 * h], x[2 * h + 1], 0x7531);
      }
      // 16-byte unit key_group % 8 of the row, swizzled: bits 4-6 of dst are r.
      sm90::stmatrix_x4(
          (dst + (key_group / 8) * kHeadDim * 128) ^ static_cast<uint32_t>((key_group % 8) * 16),
          y);
    }
  }
}

// O's row `half` (as store_accumulator_row) when its columns are permuted by
// vt_row_of_dim: n-tiles 2j and 2j + 1 give a lane head-dim columns
// 16 j + 4q + (0, 2) and (1, 3), so each lane stores 4 consecutive columns
// (8 bytes) per 16, and a quad one whole 32-byte sector.
template <typename T, int kCols>
FAE_DEVICE void store_accumulator_row_dim_permuted(T* row, const float (&acc)[kCols / 8][4],
                                                   int half, float scale, int col_end,
                                                   bool row_ok, int lane) {
  static_assert(kCols % 16 == 0, "16-column groups");
#pragma unroll
  for (int j = 0; j < kCols / 16; ++j) {
    const float(&a)[4] = acc[2 * j];
    const float(&b)[4] = acc[2 * j + 1];
    const uint32_t lo = pack2<T>(a[2 * half] * scale, b[2 * half] * scale);
    const uint32_t hi = pack2<T>(a[2 * half + 1] * scale, b[2 * half + 1] * scale);
    const int col = 16 * j + 4 * (lane % 4);
    if (row_ok && col < col_end) st_global_v2(row + col, lo, hi);
  }
}

}  // namespace cuda
}  // namespace flash_attn_ext
