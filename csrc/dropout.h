// Dropout on the attention probabilities: which elements are kept, as a pure
// function of (seed, offset, batch entry, query head, row, key), so that the
// forward never stores a mask and the backward regenerates it, on the CPU and
// on CUDA alike (host and device; plain integers, no torch).
//
// The random numbers are Philox-4x32-10 (Salmon et al., "Parallel random
// numbers: as easy as 1, 2, 3", SC'11; the generator behind torch's and
// cuRAND's CUDA dropout): key = seed, 128-bit counter below. One call gives
// 16 bytes = 16 8-bit numbers (flash-attn's and so torch's flash backend's
// resolution), for a *call group* of 2 keys x 8 queries (i = query, j = key):
//
//   counter = { (j / 16) * 32 + (j % 8) * 4 + (i / 2) % 4,  i / 32,  b * heads + h,  offset }
//   byte of element (i, j) = 8 * ((j / 8) % 2) + 2 * ((i / 8) % 4) + i % 2
//
// i.e. keys {16a + k, 16a + k + 8} x queries {32c + 2v + e + 8t : t < 4, e < 2}
// share a call. That is exactly what one lane of a *transposed* (rows = keys)
// mma / wgmma accumulator holds of a 16-key x 32-query slice (keys g, g + 8;
// queries 8t + 2v + e with v = lane % 4), so the backward kernels, whose score
// GEMMs run transposed, use all 16 numbers of each call: one call per 16
// elements, the part of dropout that bounds the backward. A forward lane (rows
// = queries g, g + 8; keys 8t + 2v + e) holds 4 numbers of a call and its
// partner lane (g ^ 1, lane ^ 4) 4 more: they make one call each and swap.
// Rows and keys are numbered within the sequence (varlen: per sequence b).
//
// An element is kept iff its number >= threshold (= round(p * 256), at least 1
// for p > 0), with probability 1 - threshold / 256; kept probabilities are
// scaled by 256 / (256 - threshold). The forward's row sums (and so lse) are of
// the probabilities before dropout, as in torch and flash-attn.
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

// The call group of element (i, j) and the element's byte in it (header).
FAE_HOST_DEVICE uint32_t dropout_call_counter(int i, int j) {
  const uint32_t ui = static_cast<uint32_t>(i), uj = static_cast<uint32_t>(j);
  return (uj >> 4) * 32u + (uj & 7u) * 4u + ((ui >> 1) & 3u);
}
FAE_HOST_DEVICE int dropout_byte(int i, int j) {
  return 8 * ((j >> 3) & 1) + 2 * ((i >> 3) & 3) + (i & 1);
}
// The inverse: element (i, j) of byte b of the group whose first query is
// query0 (= 32c + 2v) and first key key0 (= 16a + k, k < 8).
FAE_HOST_DEVICE void dropout_byte_element(int query0, int key0, int b, int& i, int& j) {
  i = query0 + 8 * ((b >> 1) & 3) + (b & 1);
  j = key0 + 8 * (b >> 3);
}

// Bit 7 of each byte of the result: byte of x >= byte of y (unsigned), for
// four bytes at once. (x | 0x80) - (y & 0x7f) per byte cannot borrow across
// bytes, and its bit 7 says x mod 128 >= y mod 128; the top bits decide
// where they differ (one LOP3 after the subtraction).
FAE_HOST_DEVICE uint32_t bytes_ge(uint32_t x, uint32_t y) {
  const uint32_t low_ge = (x | 0x80808080u) - (y & 0x7f7f7f7fu);
  return ((x & ~y) | (~(x ^ y) & low_ge)) & 0x80808080u;
}

// Bits 7, 15, 23, 31 of x (the others 0) -> bits 0..3: the four products of
// the multiply land on bits 28..31 without carries.
FAE_HOST_DEVICE uint32_t gather_byte_tops(uint32_t x) { return (x * 0x00204081u) >> 28; }

// Dropout of one (sequence b, query head h): built once per tile loop.
struct Dropout {
  uint32_t seed_lo = 0, seed_hi = 0, offset = 0;
  uint32_t bh = 0;                  // b * heads + h
  uint32_t threshold = 0;  // 0 = off; else 1..255
  float scale = 1.f;       // applied to kept probabilities

  FAE_HOST_DEVICE bool active() const { return threshold > 0; }

  // The 16 numbers of the call group holding element (i, j).
  FAE_HOST_DEVICE PhiloxWords call(int i, int j) const {
    return philox4x32_10(dropout_call_counter(i, j), static_cast<uint32_t>(i) >> 5, bh, offset,
                         seed_lo, seed_hi);
  }

  // Keep bits of the four numbers (bytes) of one word of a call: bit k = byte k.
  FAE_HOST_DEVICE uint32_t keep_nibble(uint32_t word) const {
    return gather_byte_tops(bytes_ge(word, threshold * 0x01010101u));
  }

  // Keep bits of the call group holding (i, j): bit b = byte b kept, i.e. bit
  // 8 h + 2 t + e is key 16 (j / 16) + j % 8 + 8 h, query 32 (i / 32) +
  // 2 ((i / 2) % 4) + 8 t + e.
  FAE_HOST_DEVICE uint32_t call_keep_bits(int i, int j) const {
    const PhiloxWords r = call(i, j);
    uint32_t bits = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int w = 0; w < 4; ++w) bits |= keep_nibble(r.w[w]) << (4 * w);
    return bits;
  }

  // Whether byte k (0..3) of a call's word is kept: byte k at the top of a
  // word compares as the byte alone (the bytes below it cannot reach the
  // next multiple of 2^24): one shift and one compare, no extraction.
  FAE_HOST_DEVICE bool keep_byte(uint32_t word, int k) const {
    return (word << (24 - 8 * k)) >= (threshold << 24);
  }

  // Whether element (i, j) is kept (one Philox call: per element only where
  // speed does not matter).
  FAE_HOST_DEVICE bool keep(int i, int j) const {
    return (call_keep_bits(i, j) >> dropout_byte(i, j)) & 1u;
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

// dropout_p -> (threshold, scale) as the kernels use them; p in [0, 1). p > 0
// never rounds to "off" (flash-attn's rule too: at least 1/256 is dropped).
inline void dropout_threshold_and_scale(double p, uint32_t& threshold, float& scale) {
  const double t = p * 256.0 + 0.5;
  threshold = t >= 255.0 ? 255u : static_cast<uint32_t>(t);
  if (threshold == 0 && p > 0.0) threshold = 1;
  scale = threshold == 0 ? 1.f : static_cast<float>(256.0 / (256.0 - threshold));
}

}  // namespace flash_attn_ext
