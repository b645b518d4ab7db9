// Dropout on the attention probabilities: which elements are kept, as a pure
// function of (seed, offset, batch entry, query head, row, key), so that the
// forward never stores a mask and the backward regenerates it, on the CPU and
// on CUDA alike (host and device; plain integers, no torch).
//
// The random numbers are Philox-4x32-10 (Salmon et al., "Parallel random
// numbers: as easy as 1, 2, 3", SC'11; the generator behind torch's and
// cuRAND's CUDA dropout): key = seed, 128-bit counter below. One call gives
// four 32-bit words = eight 16-bit numbers, used for eight elements of one row:
//
//   counter = { (j / 32) * 4 + (j / 2) % 4,  i,  b * heads + h,  offset }
//   number of element (i, j) = 16-bit half (j % 2) of word ((j / 8) % 4)
//
// i.e. the eight keys {32c + 8t + 2u + e : t = 0..3, e = 0..1} of group (c, u)
// share a call. That is exactly the set of keys one lane of an mma / wgmma
// accumulator holds in a 32-key slice (lane % 4 = u, n-tiles t, e = the
// fragment's column pair), so the tensor-core kernels make one Philox call per
// row per 32 keys and use all of it (Dropout::keep_bits). Rows and keys are
// numbered within the sequence (varlen: per sequence b).
//
// An element is kept iff its number >= threshold (= round(p * 65536)), with
// probability 1 - threshold / 65536; kept probabilities are scaled by
// 65536 / (65536 - threshold). The forward's row sums (and so lse) are of the
// probabilities before dropout, as in torch and flash-attn.
#pragma once
#include <cstdint>

#include "params.h"

namespace flash_attn_ext {

struct PhiloxWords {
  uint32_t w[4];
};

FAE_HOST_DEVICE void mul_hi_lo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
#if defined(__CUDA_ARCH__)
  hi = __umulhi(a, b);
  lo = a * b;
#else
  const uint64_t product = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(product >> 32);
  lo = static_cast<uint32_t>(product);
#endif
}

// Philox-4x32 with 10 rounds (Random123's constants).
FAE_HOST_DEVICE PhiloxWords philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                          uint32_t k0, uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mul_hi_lo(kMul0, c0, hi0, lo0);
    mul_hi_lo(kMul1, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return PhiloxWords{{c0, c1, c2, c3}};
}

// Dropout of one (sequence b, query head h): built once per tile loop.
struct Dropout {
  uint32_t seed_lo = 0, seed_hi = 0, offset = 0;
  uint32_t bh = 0;         // b * heads + h
  uint32_t threshold = 0;  // 0 = off
  float scale = 1.f;       // applied to kept probabilities

  FAE_HOST_DEVICE bool active() const { return threshold > 0; }

  // The eight 16-bit numbers of row i's group holding key j (header comment).
  FAE_HOST_DEVICE PhiloxWords words(int i, int j) const {
    const uint32_t group = (static_cast<uint32_t>(j) >> 5) * 4 + ((static_cast<uint32_t>(j) >> 1) & 3u);
    return philox4x32_10(group, static_cast<uint32_t>(i), bh, offset, seed_lo, seed_hi);
  }

  // Whether element (i, j) is kept (one Philox call; use keep_bits in loops).
  FAE_HOST_DEVICE bool keep(int i, int j) const {
    const PhiloxWords r = words(i, j);
    const uint32_t word = r.w[(j >> 3) & 3];
    return ((j & 1) ? (word >> 16) : (word & 0xffffu)) >= threshold;
  }

  // Keep bits of the eight keys of row i that share key j's Philox call: bit
  // 2t + e is key 32 * (j / 32) + 8t + 2 * ((j / 2) % 4) + e.
  FAE_HOST_DEVICE uint32_t keep_bits(int i, int j) const {
    const PhiloxWords r = words(i, j);
    uint32_t bits = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int t = 0; t < 4; ++t) {
      bits |= static_cast<uint32_t>((r.w[t] & 0xffffu) >= threshold) << (2 * t);
      bits |= static_cast<uint32_t>((r.w[t] >> 16) >= threshold) << (2 * t + 1);
    }
    return bits;
  }

  // Keep bits of keys [j32, j32 + 32) of row i (j32 a multiple of 32): bit j - j32
  // (four Philox calls, one per lane group u).
  FAE_HOST_DEVICE uint32_t keep_bits32(int i, int j32) const {
    uint32_t bits = 0;
    for (int u = 0; u < 4; ++u) {
      const uint32_t b8 = keep_bits(i, j32 + 2 * u);
      for (int t = 0; t < 4; ++t) bits |= ((b8 >> (2 * t)) & 3u) << (8 * t + 2 * u);
    }
    return bits;
  }
};

// The dropout of batch entry b, query head h. rng_state must be readable where
// this runs (device memory on CUDA); with dropout off nothing is read.
FAE_HOST_DEVICE Dropout make_dropout(const AttentionFwdParams& p, int b, int h) {
  Dropout d;
  if (p.dropout_threshold == 0) return d;
  const uint64_t seed = static_cast<uint64_t>(p.rng_state[0]);
  d.seed_lo = static_cast<uint32_t>(seed);
  d.seed_hi = static_cast<uint32_t>(seed >> 32);
  d.offset = static_cast<uint32_t>(static_cast<uint64_t>(p.rng_state[1]));
  d.bh = static_cast<uint32_t>(b) * static_cast<uint32_t>(p.heads) + static_cast<uint32_t>(h);
  d.threshold = p.dropout_threshold;
  d.scale = p.dropout_scale;
  return d;
}

// dropout_p -> (threshold, scale) as the kernels use them; p in [0, 1).
inline void dropout_threshold_and_scale(double p, uint32_t& threshold, float& scale) {
  double t = p * 65536.0 + 0.5;
  threshold = t >= 65535.0 ? 65535u : static_cast<uint32_t>(t);
  scale = threshold == 0 ? 1.f : static_cast<float>(65536.0 / (65536.0 - threshold));
}

}  // namespace flash_attn_ext
