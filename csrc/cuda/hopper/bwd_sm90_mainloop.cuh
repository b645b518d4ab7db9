// Hopper backward: the consumers' GEMMs and shared-memory staging in
// bwd_sm90_kernel.cuh's step loops (BwdSm90Consumer): the wgmmas of S^T /
// dP^T, of dV / dK and of the dQ chunks, dS^T into and out of shared memory
// in the layout the dQ wgmma reads, the dQ chunks' staging for the dQ
// writers, and the zeroing of tile rows past a sequence. The step loops
// themselves (which product when, the waits and barriers) are the kernel's.
#pragma once
#include <cstdint>

#include "../common/ptx.cuh"
#include "bwd_sm90_smem.cuh"
#include "sm90_primitives.cuh"
#include "wgmma_ops.cuh"

namespace flash_attn_ext {
namespace cuda {

// A consumer thread's place: warpgroup wg (consumer 0 or 1), its thread tid
// (warp, lane), its 64 keys from wg_key0 (rows of S^T, dK, dV within the
// tile), its first dK / dV column wg_col0, and key_row, the tile row of its
// accumulator elements e = 0, 1 (+ 8 for e = 2, 3).
//
// Accumulator layout of m64nN (per warp 16 rows, as mma.sync m16n8):
// acc[j][e], lane = 4g + q: e = 0,1 -> row g, cols 8j + 2q + {0,1};
// e = 2,3 -> row g + 8. Rows are keys here, columns queries (or head dim).
template <typename Traits>
struct BwdSm90Consumer {
  using T = typename Traits::T;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kGradCols = Traits::kGradCols;
  static constexpr int kDqCols = Traits::kDqCols;
  static constexpr int kDqRows = Traits::kDqRows;
  static constexpr int kDqBuffers = Traits::kDqBuffers;

  // References to the kernel's locals, as captured by the kernel's lambdas
  // that these steps used to be: copies compiled to different SASS
  // (registers assigned otherwise; in an attn_mask kernel, more spills).
  const BwdSm90Smem<Traits>& smem;
  const int &wg, &tid, &warp, &lane;
  const int &wg_key0, &wg_col0, &key_row;

  // X^T = A B^T for K-major A (this warpgroup's 64 keys) and B (queries):
  // kHeadDim / 16 k-steps, 32 bytes apart inside a 64-column chunk.
  FAE_DEVICE void issue_transposed_scores(float (&acc)[kBlockM / 8][4], uint32_t a_tile,
                                          uint32_t b_tile) const {
    using namespace sm90;
    // Descriptors built once and advanced by one add per k-step (smem_desc_advance):
    // rebuilt per wgmma they took ~10 uniform instructions each, half of a
    // consumer warp's instructions per step (SASS, D = 128).
    const uint64_t desc_a = smem_desc_sw128(a_tile + wg_key0 * 128, 16, 1024);
    const uint64_t desc_b = smem_desc_sw128(b_tile, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t chunk_offset = (kk % 4) * 32;
      const uint64_t a = smem_desc_advance(desc_a, (kk / 4) * kBlockN * 128 + chunk_offset);
      const uint64_t b = smem_desc_advance(desc_b, (kk / 4) * kBlockM * 128 + chunk_offset);
      WgmmaOps<T, kBlockM>::ss_kmajor(&acc[0][0], a, b, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
  }
  // acc += A^T B[:, col0 .. col0 + kCols) with A^T from registers (query
  // k-steps of 16 rows = 2048 B of the MN-major B tile; its head-dim chunks
  // are kBlockM * 128 B apart). col0: a 64-column chunk, or 32 columns into
  // one for a 32-column piece (+64 B in the swizzle row, as issue_dq_piece).
  template <int kCols>
  FAE_DEVICE void issue_grad_update(float (&acc)[kCols / 8][4],
                                    const uint32_t (&a)[kBlockM / 16][4], uint32_t b_tile,
                                    int col0) const {
    using namespace sm90;
    static_assert(kCols % 64 == 0 || kCols == 32, "whole chunks, or one 32-column piece");
    const uint64_t desc_b = smem_desc_sw128(b_tile + (col0 / 64) * kBlockM * 128 + (col0 % 64) * 2,
                                            kBlockM * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      WgmmaOps<T, kCols>::rs_mnmajor(&acc[0][0], a[kk], smem_desc_advance(desc_b, kk * 2048), 1);
    }
  }

  // dS^T (kBlockN keys x kBlockM queries, queries contiguous) in shared
  // memory, in the swizzled layout the dQ wgmma reads: 64-query chunks of
  // [kBlockN rows x 128 B], 16-byte unit u of row r at unit u ^ (r % 8). A
  // quad touches one unit per row, the 8 rows of a warp 8 different units:
  // conflict-free. A-fragment word (kk, w) of a thread holds row
  // key_row + 8 (w % 2), chunk kk / 4, unit 2 (kk % 4) + w / 2.
  FAE_DEVICE uint32_t ds_word_addr(uint32_t ds_buf, int kk, int w) const {
    const int r = key_row + 8 * (w % 2);
    return ds_buf + (kk / 4) * kBlockN * 128 + r * 128 + (((2 * (kk % 4) + w / 2) ^ (r % 8)) * 16) +
           (lane % 4) * 4;
  }
  // The key split stores a fragment with one stmatrix.x4 (a quarter of the
  // shared-memory instructions; ncu showed our consumers stalled on a full MIO
  // queue, cuDNN's not): lane l addresses row l % 8 of 8x8 matrix l / 8, which
  // receives words w = l / 8 (rows + 8 (w % 2), unit + w / 2). The head-dim
  // split keeps 32-bit stores and loads: there stmatrix / ldmatrix measured
  // 1-6% slower (H100, 6 configs, same process).
  FAE_DEVICE uint32_t ds_row_addr(uint32_t ds_buf, int kk) const {
    const int r = wg_key0 + warp * 16 + lane % 8 + 8 * ((lane / 8) % 2);
    return ds_buf + (kk / 4) * kBlockN * 128 + r * 128 +
           (((2 * (kk % 4) + lane / 16) ^ (r % 8)) * 16);
  }
  // 80-query steps (Traits::kDqTransposed): dS, not dS^T, as dQ^T's K-major B
  // operand: [key chunk wg][kBlockM queries][64 keys], 16-byte unit u of
  // query row q at unit u ^ (q % 8). stmatrix .trans stores fragment word w
  // (keys key_row + 8 (w % 2), queries 16 kk + 8 (w / 2) + ..) as 8 query rows
  // of one 16-byte key unit, 2 warp + w % 2: lane l gives query row
  // 16 kk + 8 (w / 2) + l % 8 of w = l / 8. The 8 lanes of a matrix hit 8
  // rows with 8 different swizzled units: conflict-free.
  FAE_DEVICE uint32_t ds_query_row_addr(uint32_t ds_buf, int kk) const {
    const int m = lane / 8;
    const int q = 16 * kk + 8 * (m / 2) + lane % 8;
    const int unit = 2 * warp + m % 2;
    return ds_buf + (wg_key0 / 64) * kBlockM * 128 + q * 128 + ((unit ^ (q % 8)) * 16);
  }
  FAE_DEVICE void store_ds(uint32_t ds_buf, const uint32_t (&ds_frag)[kBlockM / 16][4]) const {
    using namespace sm90;
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      if constexpr (Traits::kDqTransposed) {
        stmatrix_x4_trans(ds_query_row_addr(ds_buf, kk), ds_frag[kk]);
      } else if constexpr (!Traits::kSplitHeadDim) {
        stmatrix_x4(ds_row_addr(ds_buf, kk), ds_frag[kk]);
      } else {
#pragma unroll
        for (int w = 0; w < 4; ++w) st_shared_b32(ds_word_addr(ds_buf, kk, w), ds_frag[kk][w]);
      }
    }
  }
  FAE_DEVICE void load_ds(uint32_t ds_buf, uint32_t (&ds_frag)[kBlockM / 16][4]) const {
    using namespace sm90;
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
#pragma unroll
      for (int w = 0; w < 4; ++w) ds_frag[kk][w] = ld_shared_b32(ds_word_addr(ds_buf, kk, w));
    }
  }

  // dQ_i (64 queries x this warpgroup's dQ columns) = dS K, kDqCols columns
  // (chunk c) at a time: A = dS^T read transposed (k-steps of 16 keys = 2048
  // B), B = K read transposed from column dq_col0(c) of its 64-column chunk
  // (32 columns: +64 B inside the 128-byte swizzle row, as the K-major k-steps
  // step by 32 B; the swizzle applies to the absolute address). Issued and
  // committed here; staged and sent after the wait.
  FAE_DEVICE void issue_dq_chunk(float (&dq)[kDqCols / 8][4], uint32_t ds_buf, int c) const {
    issue_dq_piece<kDqCols>(dq, ds_buf, smem.dq_col0(wg, c));
  }
  template <int kCols>
  FAE_DEVICE void issue_dq_piece(float (&dq)[kCols / 8][4], uint32_t ds_buf, int col0) const {
    using namespace sm90;
    static_assert(kCols % 64 == 0 || kCols == 32, "whole chunks, or one 32-column piece");
    const uint32_t k_cols = smem.k + (col0 / 64) * kBlockN * 128 + (col0 % 64) * 2;
    ds_buf += (smem.dq_row0(wg) / 64) * kBlockN * 128;  // this consumer's query chunk of dS^T
    wgmma_fence();
    const uint64_t desc_a = smem_desc_sw128(ds_buf, kBlockM * 128, 1024);
    const uint64_t desc_b = smem_desc_sw128(k_cols, kBlockN * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      WgmmaOps<T, kCols>::ss_mnmajor(&dq[0][0], smem_desc_advance(desc_a, kk * 2048),
                                       smem_desc_advance(desc_b, kk * 2048), kk > 0 ? 1 : 0);
    }
    wgmma_commit();
  }
  // 80-query steps: dQ^T (this consumer's 64 columns x kBlockM queries) =
  // K^T dS^T over all kBlockN keys: A = K's column chunk wg read transposed
  // (MN-major, k-steps of 16 keys = 2048 B, as issue_dq_piece reads K), B =
  // dS query-major (K-major: k-step kk is key chunk kk / 4, 32 B into its
  // 128-byte rows, as issue_transposed_scores reads Q). Issued and committed
  // here; staged after the wait (stage_dq_flat).
  FAE_DEVICE void issue_dq_transposed(float (&dq)[kBlockM / 8][4], uint32_t ds_buf) const {
    using namespace sm90;
    static_assert(Traits::kDqTransposed && Traits::kGradColsA == kHeadDim,
                  "80-query steps: the key split's column halves of dQ");
    wgmma_fence();
    const uint64_t desc_a = smem_desc_sw128(smem.k + smem.dq_col0(wg, 0) / 64 * kBlockN * 128,
                                            kBlockN * 128, 1024);
    const uint64_t desc_b = smem_desc_sw128(ds_buf, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      WgmmaOps<T, kBlockM>::ss_a_mnmajor(
          &dq[0][0], smem_desc_advance(desc_a, kk * 2048),
          smem_desc_advance(desc_b, (kk / 4) * kBlockM * 128 + (kk % 4) * 32), kk > 0 ? 1 : 0);
    }
    wgmma_commit();
  }
  // dk, dv: kJ / kJV 8-column groups (the accumulators of any piece).
  template <int kJ, int kJV>
  static FAE_DEVICE void fence_grads(float (&dk)[kJ][4], float (&dv)[kJV][4]) {
    sm90::fence_registers(reinterpret_cast<float(&)[kJ * 4]>(dk));
    sm90::fence_registers(reinterpret_cast<float(&)[kJV * 4]>(dv));
  }
  // A chunk is kDqCols / 32 boxes of [64 rows x 128 B] in the 128-byte swizzle
  // of the dQ tensor map: 16-byte unit u of row r sits at unit u ^ (r % 8).
  // The float2 of (row r, columns 8j + 2q) is unit 2 (j % 4) + q / 2, byte
  // 8 (q % 2). An 8-byte store runs as two 16-lane phases (rows g = 0-3,
  // 4-7 of the warp's 8): for one j, rows g and g ^ 1 land in the same two
  // units, so each phase fills 4 of the 8 units twice (a 2-way bank conflict:
  // ncu counted 2 excess wavefronts per store, 67 M per backward at S = 8k,
  // where FlashAttention-4 has none). Odd rows therefore store column group
  // j ^ 2 (units ^ 4) when even rows store j: every phase covers all 8 units
  // once. The row's data is picked by a select; the columns stay in place
  // (only where Traits::kDqStagingAlternatesRows: the selects' cost).
  template <int kCols = kDqCols>
  FAE_DEVICE void stage_dq(uint32_t buf, const float (&dq)[kCols / 8][4]) const {
    static_assert(kCols % 32 == 0, "column groups j and j ^ 2 share a 32-column box");
    const bool odd_row = Traits::kDqStagingAlternatesRows && ((lane / 4) & 1) != 0;
#pragma unroll
    for (int t = 0; t < kCols / 8; ++t) {
      const int j = odd_row ? t ^ 2 : t;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = warp * 16 + lane / 4 + 8 * hh;
        const int unit = 2 * (j % 4) + (lane % 4) / 2;
        const uint32_t addr = buf + (j / 4) * kDqRows * 128 + r * 128 + ((unit ^ (r % 8)) * 16) +
                              (lane % 2) * 8;
        const float x = odd_row ? dq[t ^ 2][2 * hh] : dq[t][2 * hh];
        const float y = odd_row ? dq[t ^ 2][2 * hh + 1] : dq[t][2 * hh + 1];
        sm90::st_shared_v2_f32(addr, x, y);
      }
    }
  }
  // The flat dQ accumulator (bwd_sm90.h bwd_sm90_flat_dq): the 64 x 64 chunk
  // (80-query steps: the 64 x 80 dQ^T chunk) in fragment order, thread tid's
  // dq[k][0..3] at float4 k * 128 + tid: a warp's store is 512 contiguous
  // bytes (no bank conflict, no swizzle arithmetic), and the writer adds the
  // 16 KB (20 KB) with one bulk reduce.
  static constexpr int kDqAccN = Traits::kDqAccN;
  FAE_DEVICE void stage_dq_flat(uint32_t buf, const float (&dq)[kDqAccN / 8][4]) const {
    static_assert(kDqCols == 64 && Traits::kDqBufferBytes == 128 * (kDqAccN / 2) * 4 &&
                      kDqRows * kDqCols == 64 * kDqAccN,
                  "a consumer's 128 threads hold the chunk, kDqAccN / 2 floats each");
#pragma unroll
    for (int k = 0; k < kDqAccN / 8; ++k) {
      sm90::st_shared_v4_f32(buf + (k * 128 + tid) * 16, dq[k][0], dq[k][1], dq[k][2], dq[k][3]);
    }
  }
  // Staged dQ chunks of step i go to this consumer's dQ writer (dq_full).
  FAE_DEVICE void hand_dq_to_writer(int i) const {
    sm90::fence_proxy_async_smem();
    sm90::mbar_arrive(smem.dq_full(wg, i % kDqBuffers));
  }
  // Head-dim split: every chunk in turn, issued after the step's dK. The
  // first wait also retires the step's dV / dK products; the chunks are staged
  // in the step's Q/dO stage, which the writer releases after the TMA read.
  template <int kJ, int kJV>
  FAE_DEVICE void accumulate_dq_in_stage(uint32_t ds_buf, int stage, int i, float (&dk)[kJ][4],
                                         float (&dv)[kJV][4]) const {
    using namespace sm90;
#pragma unroll
    for (int c = 0; c < Traits::kDqChunks; ++c) {
      float dq[kDqCols / 8][4];
      issue_dq_chunk(dq, ds_buf, c);
      wgmma_wait<0>();
      fence_registers(reinterpret_cast<float(&)[kDqCols / 2]>(dq));
      fence_grads(dk, dv);
      if (c == 0) mbar_arrive(smem.qdo_empty(stage));
      stage_dq(smem.dq_buffer(wg, stage, 0, c), dq);
    }
    hand_dq_to_writer(i);
  }

  // D = 192 / 128 (kDqPieces): the consumer's 96 dQ columns as a 64- and a
  // 32-column piece (the traits' grad_col_a / grad_col_b), issued after the
  // step's dK; one wait retires dV, dK and both pieces, then the Q/dO stage is
  // released and the pieces are staged in the consumer's own buffer (boxes
  // of the A piece, then the B piece: smem.dq_box_col) for its writer.
  template <int kJ, int kJB, int kJV>
  FAE_DEVICE void accumulate_dq_pieces(uint32_t ds_buf, int stage, int i, float (&dk)[kJ][4],
                                       float (&dk_b)[kJB][4], float (&dv)[kJV][4]) const {
    using namespace sm90;
    static_assert(Traits::kDqPieces && Traits::kDqBuffers == 1, "one dQ buffer per consumer");
    float dq_a[Traits::kGradColsA / 8][4], dq_b[Traits::kGradColsB / 8][4];
    issue_dq_piece<Traits::kGradColsA>(dq_a, ds_buf, Traits::grad_col_a(wg));
    issue_dq_piece<Traits::kGradColsB>(dq_b, ds_buf, Traits::grad_col_b(wg));
    wgmma_wait<0>();
    fence_registers(reinterpret_cast<float(&)[Traits::kGradColsA / 2]>(dq_a));
    fence_registers(reinterpret_cast<float(&)[Traits::kGradColsB / 2]>(dq_b));
    fence_grads(dk, dv);
    fence_registers(reinterpret_cast<float(&)[kJB * 4]>(dk_b));
    mbar_arrive(smem.qdo_empty(stage));
    // The buffer's previous step has been read by the TMA.
    mbar_wait(smem.dq_empty(wg, 0), (i & 1) ^ 1);
    const uint32_t buf = smem.dq_buffer(wg, stage, 0, 0);
    stage_dq<Traits::kGradColsA>(buf, dq_a);
    stage_dq<Traits::kGradColsB>(buf + Traits::kGradColsA / 32 * kDqRows * 128, dq_b);
    hand_dq_to_writer(i);
  }

  // Packed sequences and key padding: rows of a tile past the sequence hold
  // other sequences' rows (or unused cache rows) instead of TMA's zeros.
  // They are zeroed in shared memory, so that every product sees what it
  // sees in a padded batch: P = 0 for padded queries (lse = +inf), and zero
  // contributions from padded keys (their dK / dV rows are not written).
  // Rows [row_begin, kRows) of every 64-column chunk, whole 128-byte rows (so
  // the swizzle does not matter), by the 256 consumer threads; the caller
  // syncs them (kZeroedBarrier) before any wgmma reads the tile.
  static constexpr int kZeroedBarrier = 5;
  // V's and every dO stage's chunks past v's head dim (kChunksV < kChunks):
  // zeros, by the 256 consumer threads, 16 bytes each; the caller fences and
  // syncs them (kZeroedBarrier) before any wgmma reads them.
  FAE_DEVICE void zero_pad_chunks() const {
    constexpr int kPadChunks = Traits::kChunks - Traits::kChunksV;
    const int thread = wg * 128 + tid;
    for (int u = thread; u < kPadChunks * kBlockN * 8; u += 256) {
      sm90::st_shared_v4_f32(smem.v + Traits::kChunksV * kBlockN * 128 + u * 16, 0.f, 0.f, 0.f, 0.f);
    }
    for (int stage = 0; stage < Traits::kStages; ++stage) {
      for (int u = thread; u < kPadChunks * kBlockM * 8; u += 256) {
        sm90::st_shared_v4_f32(smem.dO(stage) + Traits::kChunksV * kBlockM * 128 + u * 16, 0.f, 0.f,
                               0.f, 0.f);
      }
    }
  }
  FAE_DEVICE void zero_tile_rows(uint32_t tile, int tile_rows, int row_begin) const {
    sm90::zero_swizzled_tile_rows<Traits::kChunks>(tile, tile_rows, row_begin, wg * 128 + tid, 256);
  }
  // The step's Q and dO rows past seqlen_q (packed sequences).
  FAE_DEVICE void zero_rows_past_sequence(const bool& packed, const int& seqlen_q, int m_block,
                                          int stage) const {
    if (packed && (m_block + 1) * kBlockM > seqlen_q) {
      zero_tile_rows(smem.q(stage), kBlockM, seqlen_q - m_block * kBlockM);
      zero_tile_rows(smem.dO(stage), kBlockM, seqlen_q - m_block * kBlockM);
      sm90::fence_proxy_async_smem();
      sm90::named_barrier_sync(kZeroedBarrier, 256);
    }
  }
};

}  // namespace cuda
}  // namespace flash_attn_ext
