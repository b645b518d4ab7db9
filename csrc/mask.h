// Mask: which keys a query row sees and how its scores are modified, for one
// (sequence, head). The single definition of causal masking, sliding windows,
// key padding, softcap and ALiBi that kernels call from their tile loops
// (host and device; plain ints and floats, no torch):
//
//   visible keys of row i:   [key_begin(i), key_end(i))      (both non-decreasing in i)
//   rows that see key j:     [query_begin(j), query_end(j))  (both non-decreasing in j)
//   score seen by softmax:   f(s) = softcap * tanh(s / softcap) - slope * |i + diag - j|
//                            with s = softmax_scale * q_i . k_j (softcap 0: no tanh)
//   its derivative:          df/ds = 1 - tanh^2(s / softcap)   (1 without softcap)
//
// This is flash-attn 2's order (csrc/flash_attn/src: apply_softcap on the
// scaled scores, then Mask::apply_mask adds the ALiBi bias). Tiles that lie
// outside [key_begin, key_end) of all their rows are skipped by the callers,
// so the work of a window falls with its width.
#pragma once
#include <cmath>

#include "params.h"

namespace flash_attn_ext {

struct Mask {
  int seqlen_q = 0;   // query rows of the sequence
  int seqlen_k = 0;   // keys it may attend to (after seqused_k)
  int diag = 0;       // query i "is at" key i + diag (SeqBounds::causal_offset)
  int left = -1;      // window to the left of the diagonal, -1 = unbounded
  int right = -1;     // ... and to its right (causal: 0)
  float softcap = 0.f;       // 0 = off
  float inv_softcap = 0.f;
  float alibi_slope = 0.f;   // 0 = off

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
  FAE_HOST_DEVICE bool has_score_mod() const { return softcap > 0.f || alibi_slope != 0.f; }

  // f(s) for row i, key j; with softcap, *dfds = 1 - tanh^2 (the backward's chain factor).
  FAE_HOST_DEVICE float score(float s, int i, int j, float* dfds = nullptr) const {
    if (softcap > 0.f) {
      const float t = tanhf(s * inv_softcap);
      if (dfds != nullptr) *dfds = 1.f - t * t;
      s = softcap * t;
    }
    if (alibi_slope != 0.f) {
      const int dist = i + diag - j;
      s -= alibi_slope * static_cast<float>(dist < 0 ? -dist : dist);
    }
    return s;
  }
};

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
  return m;
}

}  // namespace flash_attn_ext
