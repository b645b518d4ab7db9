// AttentionParams: everything a kernel needs, and nothing from torch.
//
// The C++ op layer (csrc/ops.cpp) validates tensors and fills these structs;
// the CPU kernels (csrc/cpu) and the CUDA kernels (csrc/cuda) only ever see
// raw pointers, sizes and element strides. Keeping torch types out of the
// kernels keeps the .cu files fast to compile and independent of torch's ABI.
//
// Layout convention: every [batch, seqlen, heads, head_dim] tensor is addressed
// as  base + b*batch_stride + s*row_stride + h*head_stride + d  (the last dim is
// contiguous, which ops.cpp checks). Both flash-attn's [B,S,H,D] and torch
// SDPA's [B,H,S,D] layouts are expressed by these strides, so neither needs a
// copy.
#pragma once
#include <cstdint>

namespace flash_attn_ext {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Strides (in elements) of one [B, S, H, D] tensor.
struct TensorStrides {
  int64_t batch = 0;
  int64_t row = 0;   // seqlen dimension
  int64_t head = 0;
};

enum FwdTile : int { kFwdTileAuto = 0, kFwdTileLarge = 1, kFwdTileSmallM = 2 };

struct AttentionFwdParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // [batch, heads, seqlen_q], contiguous, natural log

  TensorStrides q_strides, k_strides, v_strides, out_strides;

  int batch = 0;
  int heads = 0;     // query heads
  int heads_k = 0;   // key/value heads (== heads until GQA lands)
  int seqlen_q = 0;
  int seqlen_k = 0;
  int head_dim = 0;  // true head dim (kernels may pad internally)

  DType dtype = DType::kFloat32;

  float softmax_scale = 1.f;
  float scale_log2 = 1.f;  // softmax_scale * log2(e): kernels use exp2

  // Causal masking with a single offset: key j is visible to query i iff
  //   j <= i + causal_offset.
  // Top-left alignment (torch SDPA) is offset 0; bottom-right alignment
  // (flash-attn, when seqlen_q != seqlen_k) is offset seqlen_k - seqlen_q.
  bool causal = false;
  int causal_offset = 0;

  // Split-KV (CUDA): 0 = heuristic, 1 = off, n > 1 = force n splits.
  int num_splits = 0;
  // Forward tile family (CUDA 16-bit kernels): kFwdTileAuto picks by shape
  // (the small-M "decode" tile when seqlen_q <= 16), the others force one;
  // the autotuner (flash_attn_ext/autotune.py) times both.
  int fwd_tile = 0;
  // Scratch for split-KV partial results, owned by the caller (fp32):
  //   out_accum [num_splits, batch, heads, seqlen_q, head_dim_rounded]
  //   lse_accum [num_splits, batch, heads, seqlen_q]
  float* out_accum = nullptr;
  float* lse_accum = nullptr;
};

struct AttentionBwdParams : AttentionFwdParams {
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  TensorStrides dout_strides, dq_strides, dk_strides, dv_strides;

  // D_i = rowsum(dO_i * O_i), fp32 [batch, heads, seqlen_q] (scratch).
  float* dsoftmax_sum = nullptr;
  // fp32 dQ accumulator (CUDA) [batch, heads, seqlen_q_rounded, head_dim_rounded].
  float* dq_accum = nullptr;
  bool deterministic = false;
};

}  // namespace flash_attn_ext
