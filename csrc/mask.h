// Mask: which keys a query row sees and how its scores are modified, for one
// (sequence, head). The single definition of causal masking, sliding windows,
// key padding, softcap and ALiBi that kernels call from their tile loops
// (host and device; plain ints and floats, no torch):
//
//   visible keys of row i:   [key_begin(i), key_end(i))      (both non-decreasing in i)
//   rows that see key j:     [query_begin(j), query_end(j))  (both non-decreasing in j)
//   score seen by softmax:   f(s) = softcap * tanh(s / softcap) - slope * |i + diag - j|
//                                   + bias(i, j)
//                            with s = softmax_scale * q_i . k_j (softcap 0: no tanh) and
//                            bias the attn_mask (additive; boolean: 0 or -inf)
//   its derivative:          df/ds = 1 - tanh^2(s / softcap)   (1 without softcap)
//
// This is flash-attn 2's order (csrc/flash_attn/src: apply_softcap on the
// scaled scores, then Mask::apply_mask adds the ALiBi bias). Tiles that lie
// outside [key_begin, key_end) of all their rows are skipped by the callers,
// so the work of a window falls with its width.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "params.h"

namespace flash_attn_ext {

// 16-bit floats from their bits, on host and device alike (the CPU code has no
// CUDA headers): bf16 is the top half of an fp32; fp16 is rebuilt field by field.
FAE_HOST_DEVICE float bf16_bits_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
FAE_HOST_DEVICE float fp16_bits_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu, mantissa = bits & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in fp32
    const float f = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  const uint32_t u = exponent == 0x1fu ? (sign | 0x7f800000u | (mantissa << 13))  // inf / nan
                                       : (sign | ((exponent + 112u) << 23) | (mantissa << 13));
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

// Element e of an attn_mask whose element type is known at compile time, in
// natural-log units: a boolean mask gives 0 (attend) or -inf.
template <BiasType kType>
FAE_HOST_DEVICE float bias_value(const unsigned char* bias, int64_t e) {
  if constexpr (kType == BiasType::kBool) {
    return bias[e] ? 0.f : -INFINITY;
  } else if constexpr (kType == BiasType::kFloat32) {
    return reinterpret_cast<const float*>(bias)[e];
  } else if constexpr (kType == BiasType::kFloat16) {
    return fp16_bits_to_float(reinterpret_cast<const uint16_t*>(bias)[e]);
  } else {
    return bf16_bits_to_float(reinterpret_cast<const uint16_t*>(bias)[e]);
  }
}

// The softcap of every path (CPU, fp32 SIMT, mma.sync and Hopper kernels,
// forward and backward): c * tanh(x * in). in = 1 / softcap on a scaled score
// (softmax_scale / softcap where a kernel folds the softmax scale in), c =
// softcap (softcap * log2(e) in the log2 domain, 1 where the caller folds it
// into its exp2). *dfds = 1 - tanh^2, the backward's chain factor. Tanh: how
// the path evaluates tanh: tanhf here (TanhStd), libdevice's accurate tanhf in
// the fp32 SIMT kernels (TanhAccurate, simt/mask_fp32.cuh), one MUFU op in the
// 16-bit kernels (TanhApprox, cuda/common/fwd_softmax.cuh).
struct TanhStd {
  FAE_HOST_DEVICE float operator()(float x) const { return tanhf(x); }
};

template <typename Tanh = TanhStd>
FAE_HOST_DEVICE float softcap_score(float x, float in, float c, float* dfds = nullptr,
                                    Tanh tanh = Tanh()) {
  const float t = tanh(x * in);
  if (dfds != nullptr) *dfds = 1.f - t * t;
  return c * t;
}

struct Mask {
  int seqlen_q = 0;   // query rows of the sequence
  int seqlen_k = 0;   // keys it may attend to (after seqused_k)
  int diag = 0;       // query i "is at" key i + diag (SeqBounds::causal_offset)
  int left = -1;      // window to the left of the diagonal, -1 = unbounded
  int right = -1;     // ... and to its right (causal: 0)
  float softcap = 0.f;       // 0 = off
  float inv_softcap = 0.f;
  float alibi_slope = 0.f;   // 0 = off
  // attn_mask of this (sequence, head): its element (0, 0), strides in
  // elements (params.h, attn_bias); nullptr = off.
  const unsigned char* bias = nullptr;
  BiasType bias_type = BiasType::kNone;
  int64_t bias_row_stride = 0;
  int64_t bias_col_stride = 0;

  FAE_HOST_DEVICE static int clamp(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }

  FAE_HOST_DEVICE int key_begin(int i) const {
    return left < 0 ? 0 : clamp(i + diag - left, 0, seqlen_k);
  }
  FAE_HOST_DEVICE int key_end(int i) const {
    return right < 0 ? seqlen_k : clamp(i + diag + right + 1, 0, seqlen_k);
  }
  FAE_HOST_DEVICE int query_begin(int j) const {
    return right < 0 ? 0 : clamp(j - diag - right, 0, seqlen_q);
  }
  FAE_HOST_DEVICE int query_end(int j) const {
    return left < 0 ? seqlen_q : clamp(j - diag + left + 1, 0, seqlen_q);
  }

  FAE_HOST_DEVICE bool has_softcap() const { return softcap > 0.f; }
  FAE_HOST_DEVICE bool has_score_mod() const {
    return softcap > 0.f || alibi_slope != 0.f || bias != nullptr;
  }

  // The attn_mask term of row i, key j (natural-log units): the additive value,
  // or 0 / -inf for a boolean mask. 0 without a mask, and for a row or key past
  // the sequence: tile loops score padded rows / keys before they mask them,
  // and the mask must not be read there (it may end right after the last row).
  FAE_HOST_DEVICE float bias_at(int i, int j) const {
    if (bias == nullptr || i >= seqlen_q || j >= seqlen_k) return 0.f;
    const int64_t e = i * bias_row_stride + j * bias_col_stride;
    switch (bias_type) {
      case BiasType::kBool: return bias_value<BiasType::kBool>(bias, e);
      case BiasType::kFloat32: return bias_value<BiasType::kFloat32>(bias, e);
      case BiasType::kFloat16: return bias_value<BiasType::kFloat16>(bias, e);
      case BiasType::kBFloat16: return bias_value<BiasType::kBFloat16>(bias, e);
      default: return 0.f;
    }
  }

  // f(s) for row i, key j; with softcap, *dfds = 1 - tanh^2 (the backward's chain
  // factor). Tanh: see softcap_score.
  template <typename Tanh = TanhStd>
  FAE_HOST_DEVICE float score(float s, int i, int j, float* dfds = nullptr,
                              Tanh tanh = Tanh()) const {
    if (softcap > 0.f) s = softcap_score(s, inv_softcap, softcap, dfds, tanh);
    if (alibi_slope != 0.f) {
      const int dist = i + diag - j;
      s -= alibi_slope * static_cast<float>(dist < 0 ? -dist : dist);
    }
    return s + bias_at(i, j);
  }
};

FAE_HOST_DEVICE int bias_element_size(BiasType t) {
  return t == BiasType::kFloat32 ? 4 : (t == BiasType::kBool ? 1 : 2);
}

// The visible-key bounds of batch entry b (bounds s = seq_bounds(p, b)),
// without the score modifiers: what a tile scheduler needs (no memory reads).
FAE_HOST_DEVICE Mask make_window(const AttentionFwdParams& p, const SeqBounds& s) {
  Mask m;
  m.seqlen_q = s.seqlen_q;
  m.seqlen_k = s.seqlen_k;
  m.diag = s.causal_offset;
  m.left = p.window_left;
  m.right = p.causal ? 0 : p.window_right;
  return m;
}

// The mask of batch entry b (bounds s = seq_bounds(p, b)) and query head h.
FAE_HOST_DEVICE Mask make_mask(const AttentionFwdParams& p, const SeqBounds& s, int b, int h) {
  Mask m = make_window(p, s);
  if (p.softcap > 0.f) {
    m.softcap = p.softcap;
    m.inv_softcap = 1.f / p.softcap;
  }
  if (p.alibi_slopes != nullptr) m.alibi_slope = p.alibi_slopes[b * p.alibi_slopes_batch_stride + h];
  if (p.attn_bias != nullptr) {
    const BiasStrides& st = p.attn_bias_strides;
    m.bias = static_cast<const unsigned char*>(p.attn_bias) +
             (b * st.batch + h * st.head) * bias_element_size(p.attn_bias_type);
    m.bias_type = p.attn_bias_type;
    m.bias_row_stride = st.row;
    m.bias_col_stride = st.col;
  }
  return m;
}

}  // namespace flash_attn_ext
