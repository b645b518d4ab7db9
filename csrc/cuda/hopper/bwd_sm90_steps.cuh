// Hopper backward: the step walk of a CTA (BwdSm90StepWalk), the order in
// which the loader, the dQ writers and the consumers of bwd_sm90_kernel.cuh
// visit its (query head, query tile) steps: the query tiles of one head
// (bwd_sm90_variants.cuh's range with variants), or with kWalkGroup (GQA)
// those of every query head of the kv head's group in turn.
#pragma once
#include "../common/ptx.cuh"
#include "sm90_primitives.cuh"

namespace flash_attn_ext {
namespace cuda {

// The steps of a CTA, in the order that its loader, dQ writers and consumers
// all walk them: query tiles [m_begin, m_end) of the first query head, then
// the same tiles of the next head, ... (kWalkGroup: every query head of the
// kv head's group, n_steps in all; else one head). The step index i runs on
// across heads: it picks the Q/dO stage, the dS^T and dQ buffers and the
// mbarrier phases, so all of those continue from one head to the next. A
// Step's g is its head's place in the walk (query head h_first + g). Only the
// loader tracks the walk; it publishes each step's (m_block, g) in shared
// memory (publish / published, at BwdSm90Smem::step_word), where the
// consumers and the dQ writers read it: their registers are spent (the
// consumers' 240, the writers' 24).
// Without kWalkGroup a step is (i, m_begin + i, 0), the expressions of the
// loops before the walk, which therefore compile to the same code.
template <bool kWalkGroup>
struct BwdSm90StepWalk {
  int m_begin, m_end, n_steps;
  struct Step {
    int i, m_block, g;
  };
  FAE_DEVICE bool more(int i) const { return kWalkGroup ? i < n_steps : m_begin + i < m_end; }
  FAE_DEVICE Step first() const { return {0, m_begin, 0}; }
  FAE_DEVICE void advance(Step& s) const {
    ++s.i;
    if constexpr (kWalkGroup) {
      if (++s.m_block == m_end) {  // the next head, from its first tile
        s.m_block = m_begin;
        ++s.g;
      }
    } else {
      s.m_block = m_begin + s.i;
    }
  }
  // The loader: step s's (m_block, g) into its word pair `words`
  // (kWalkGroup), before qdo_full's arrive of step s.i.
  FAE_DEVICE void publish(const Step& s, uint32_t words) const {
    if constexpr (kWalkGroup) {
      sm90::st_shared_b32(words, s.m_block);
      sm90::st_shared_b32(words + 4, s.g);
    }
  }
  // Step i as the consumers and dQ writers see it (after the step's qdo_full
  // or dq_full wait; words: step i's pair): published by the loader with
  // kWalkGroup, else as before the walk.
  FAE_DEVICE Step published(int i, uint32_t words) const {
    if constexpr (kWalkGroup) {
      return Step{i, static_cast<int>(sm90::ld_shared_b32(words)),
                  static_cast<int>(sm90::ld_shared_b32(words + 4))};
    } else {
      return Step{i, m_begin + i, 0};
    }
  }
};

}  // namespace cuda
}  // namespace flash_attn_ext
