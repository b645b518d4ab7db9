// Hopper backward: BwdSm90Smem, the shared-memory addresses of
// bwd_sm90_kernel.cuh (tiles, row statistics, mbarriers and the words the
// producer hands to the consumers), computed once from the dynamic shared
// memory base in the order of the layout in bwd_sm90_traits.cuh, and where
// each consumer's dQ chunks are staged.
#pragma once
#include <cstdint>

#include "../common/ptx.cuh"
#include "sm90_primitives.cuh"

namespace flash_attn_ext {
namespace cuda {

template <typename Traits>
struct BwdSm90Smem {
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kStages = Traits::kStages;
  static constexpr int kGradCols = Traits::kGradCols;
  static constexpr int kDqBuffers = Traits::kDqBuffers;

  uint32_t k;           // K of the key tile [kChunks][kBlockN][64]
  uint32_t v;           // V, alike
  uint32_t q0;          // Q ring, stage 0
  uint32_t do0;         // dO ring, stage 0
  uint32_t ds0;         // dS^T buffers
  uint32_t dq0;         // key split: the consumers' dQ buffers
  uint32_t p;           // head-dim split: P^T handed from consumer 0 to 1
  uint32_t row_stats0;  // lse (log2) and D rows of stage 0
  uint32_t bar0;        // mbarriers, then the mask and step words

  FAE_DEVICE explicit BwdSm90Smem(const void* smem_raw)
      : k(sm90::smem_align_1024(smem_raw)),
        v(k + Traits::kKVBytes),
        q0(v + Traits::kKVBytes),
        do0(q0 + kStages * Traits::kQBytes),
        ds0(do0 + kStages * Traits::kQBytes),
        dq0(ds0 + Traits::kDsBuffers * Traits::kDsBytes),
        p(dq0 + Traits::kDqSmemBytes),
        row_stats0(p + Traits::kPBytes),
        bar0(row_stats0 + kStages * Traits::kRowStatBytes) {}

  FAE_DEVICE uint32_t q(int stage) const { return q0 + stage * Traits::kQBytes; }
  FAE_DEVICE uint32_t dO(int stage) const { return do0 + stage * Traits::kQBytes; }
  FAE_DEVICE uint32_t ds(int buf) const { return ds0 + buf * Traits::kDsBytes; }
  FAE_DEVICE uint32_t lse(int stage) const { return row_stats0 + stage * Traits::kRowStatBytes; }
  FAE_DEVICE uint32_t dsum(int stage) const { return lse(stage) + kBlockM * 4; }

  FAE_DEVICE uint32_t kv_full() const { return bar0; }
  FAE_DEVICE uint32_t qdo_full(int stage) const { return bar0 + 8 * (1 + stage); }
  FAE_DEVICE uint32_t qdo_empty(int stage) const { return bar0 + 8 * (1 + kStages + stage); }
  // Consumer w's dQ buffer `buf` staged (dq_full) / read by the TMA (dq_empty).
  FAE_DEVICE uint32_t dq_full(int w, int buf) const {
    return bar0 + 8 * (1 + 2 * kStages + w * kDqBuffers + buf);
  }
  FAE_DEVICE uint32_t dq_empty(int w, int buf) const {
    return bar0 + 8 * (1 + 2 * kStages + (Traits::kConsumerWarpgroups + w) * kDqBuffers + buf);
  }
  // attn_mask kernels: per Q/dO stage, bit w = consumer w's keys need the mask
  // on that step (the loader writes it before qdo_full's arrive).
  FAE_DEVICE uint32_t mask_reads(int stage) const {
    return bar0 + 8 * (1 + 2 * kStages + 2 * Traits::kConsumerWarpgroups * kDqBuffers) + 4 * stage;
  }
  // kWalkGroup: step i's m_block and (+4) g (BwdSm90StepWalk::publish) in
  // word pair i % kStepWords, written by the loader before qdo_full's arrive
  // of step i (see the traits for why the pair is not overwritten before its
  // readers, the consumers and dQ writers of step i, have read it).
  FAE_DEVICE uint32_t step_word(int i) const {
    return mask_reads(kStages) + 8 * (i % Traits::kStepWords);  // after the mask words
  }

  // dQ chunk c of consumer w's step (stage, buf) goes out through shared
  // memory (see the traits): the key split's own buffers in turn, or consumer
  // w's column half of the step's Q tile (chunk 0) / dO tile (chunk 1), which
  // the 64-column chunks of those tiles hold contiguously (16 KB, 1024-byte
  // aligned).
  FAE_DEVICE uint32_t dq_buffer(int w, int stage, int buf, int c) const {
    if constexpr (Traits::kDqInQdoStage) {
      return (c == 0 ? q(stage) : dO(stage)) + w * (kGradCols / 64) * kBlockM * 128;
    } else {
      return dq0 + (w * kDqBuffers + buf) * Traits::kDqBufferBytes;
    }
  }
  // First column of consumer w's dQ chunk c, and its first row within the step.
  static FAE_DEVICE int dq_col0(int w, int c) {
    return (Traits::kDqByRows ? c : w * Traits::kDqChunks + c) * Traits::kDqCols;
  }
  static FAE_DEVICE int dq_row0(int w) { return Traits::kDqByRows ? w * Traits::kDqRows : 0; }
  // kDqPieces: the dQ column of box `box` of consumer w's buffer (the A
  // piece's boxes, then the B piece's).
  static FAE_DEVICE int dq_box_col(int w, int box) {
    constexpr int kBoxesA = Traits::kGradColsA / Traits::kDqBoxCols;
    return box < kBoxesA ? Traits::grad_col_a(w) + box * Traits::kDqBoxCols
                         : Traits::grad_col_b(w) + (box - kBoxesA) * Traits::kDqBoxCols;
  }
};

}  // namespace cuda
}  // namespace flash_attn_ext
