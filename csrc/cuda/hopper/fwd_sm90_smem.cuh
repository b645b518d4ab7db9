// Hopper forward: FwdSm90Smem, the shared-memory addresses of
// fwd_sm90_kernel.cuh (the Q slices, the K / V ring, the mbarriers, the words
// the producer hands to the consumers and the attn_mask scratch), computed
// once from the dynamic shared memory base in the order of the layout in
// fwd_sm90_traits.cuh.
#pragma once
#include <cstdint>

#include "../common/ptx.cuh"
#include "sm90_primitives.cuh"

namespace flash_attn_ext {
namespace cuda {

template <typename Traits>
struct FwdSm90Smem {
  static constexpr int kQRing = Traits::kQRing;
  static constexpr int kStages = Traits::kStages;

  uint32_t q0;            // Q ring, slot 0
  uint32_t k0;            // K ring, stage 0
  uint32_t v0;            // V ring, stage 0
  uint32_t p0;            // kPInSmem: consumer warpgroup 0's P buffer
  uint32_t v_staging;     // kVtInKernel: V's tile before the transpose
  uint32_t bar0;          // mbarriers, then the tile and mask words
  uint32_t mask_scratch;  // kStageAttnMask: the consumer warps' attn_mask buffers

  FAE_DEVICE explicit FwdSm90Smem(const void* smem_raw)
      : q0(sm90::smem_align_1024(smem_raw)),
        k0(q0 + kQRing * Traits::kQSliceBytes),
        v0(k0 + kStages * Traits::kKTileBytes),
        p0(v0 + kStages * Traits::kVTileBytes),
        v_staging(p0 + Traits::kConsumerWarpgroups * Traits::kPBufferBytes),
        bar0(v_staging + Traits::kVStagingBytes),
        mask_scratch((bar0 + Traits::kBarrierBytes + 15) & ~15u) {}

  FAE_DEVICE uint32_t q(int slot) const { return q0 + slot * Traits::kQSliceBytes; }
  FAE_DEVICE uint32_t k(int stage) const { return k0 + stage * Traits::kKTileBytes; }
  FAE_DEVICE uint32_t v(int stage) const { return v0 + stage * Traits::kVTileBytes; }
  FAE_DEVICE uint32_t p(int wg) const { return p0 + wg * Traits::kPBufferBytes; }
  FAE_DEVICE uint32_t q_full(int slot) const { return bar0 + 8 * slot; }
  FAE_DEVICE uint32_t k_full(int stage) const { return bar0 + 8 * (kQRing + stage); }
  FAE_DEVICE uint32_t v_full(int stage) const { return bar0 + 8 * (kQRing + kStages + stage); }
  // K and V stages are released separately: K_i as soon as S_i is done, V_i
  // after O += P_i V_i, which (pipelined) completes one iteration later. With
  // one shared "empty" barrier, 2 stages would leave the next K load no slack.
  FAE_DEVICE uint32_t k_empty(int stage) const { return bar0 + 8 * (kQRing + 2 * kStages + stage); }
  FAE_DEVICE uint32_t v_empty(int stage) const { return bar0 + 8 * (kQRing + 3 * kStages + stage); }
  // q_empty(slot): the 4 warps reading the slice held there have finished
  // their last S = Q K^T of the tile.
  FAE_DEVICE uint32_t q_empty(int slot) const { return bar0 + 8 * (kQRing + 4 * kStages + slot); }
  // The tile index travels with each Q slice: the producer writes it before
  // arriving on q_full (mbarrier arrive = release, the consumers' wait =
  // acquire) and rewrites it only after q_empty, i.e. after every consumer of
  // the slice has read it. An index >= num_tiles (sent without a Q load)
  // tells the consumers to stop.
  FAE_DEVICE uint32_t tile_slot(int slot) const {
    return bar0 + 8 * (2 * kQRing + 4 * kStages) + 12 * slot;
  }
  // attn_mask kernels: bit w set = consumer warpgroup w reads the mask on the
  // K tile of this stage (written before k_full's arrive, read before k_empty's).
  FAE_DEVICE uint32_t mask_reads(int stage) const {
    return bar0 + 8 * (2 * kQRing + 4 * kStages) + 12 * kQRing + 4 * stage;
  }
  // kVtInKernel: the staging buffer's mbarrier (its TMA's bytes, or the
  // producer's arrive alone when there is nothing more to transpose) and the
  // word that says which (0: a V tile, 1: stop), written before that arrive.
  FAE_DEVICE uint32_t v_staging_full() const {
    return bar0 + 8 * (2 * kQRing + 4 * kStages) + 12 * kQRing + 4 * kStages;
  }
  FAE_DEVICE uint32_t v_staging_word() const { return v_staging_full() + 8; }
  // Slice u (= kWarpgroups * tile_count + warpgroup) of the ring: slot and phase.
  static FAE_DEVICE int q_slot_of(int u) { return u % kQRing; }
  static FAE_DEVICE uint32_t q_phase_of(int u) { return static_cast<uint32_t>((u / kQRing) & 1); }
};

}  // namespace cuda
}  // namespace flash_attn_ext
