// Hopper backward: the epilogue of bwd_sm90_kernel.cuh's consumers, dK and dV
// from the accumulator registers straight to global memory (dQ leaves per
// step instead, through the producer's dQ writers: bwd_sm90_producer.cuh).
#pragma once
#include <cstdint>

#include "../../params.h"
#include "../common/ptx.cuh"

namespace flash_attn_ext {
namespace cuda {

// dK = softmax_scale * sum dS^T Q and dV, the thread's rows key_row and
// key_row + 8 of the key tile (first key n0) and the consumer's
// kGradCols columns from col0; keys past seqlen_k and padded head-dim
// columns are not written (keys no query sees get zeros). grad_head: the
// gradients' head (kWalkGroup: the kv head, the group summed in registers;
// else the query head, GQA there summed by the op layer); k_row0: the
// sequence's first key row. Scalars by reference, as in
// bwd_sm90_producer.cuh (by value they compiled to different SASS).
template <typename Traits>
FAE_DEVICE void bwd_sm90_store_dk_dv(const AttentionBwdParams& params,
                                     const float (&dk)[Traits::kGradCols / 8][4],
                                     const float (&dv)[Traits::kGradCols / 8][4], const int& b,
                                     const int& grad_head, const int& k_row0, const int& n0,
                                     const int& key_row, const int& seqlen_k, const int& col0,
                                     const int& lane) {
  using T = typename Traits::T;
  constexpr int kGradCols = Traits::kGradCols;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int key = n0 + key_row + 8 * hh;
    const bool key_ok = key < seqlen_k;
    const int64_t row = k_row0 + (key_ok ? key : 0);
    T* dk_row = static_cast<T*>(params.dk) + row_offset(params.dk_strides, b, grad_head, row);
    T* dv_row = static_cast<T*>(params.dv) + row_offset(params.dv_strides, b, grad_head, row);
    store_accumulator_row<T, kGradCols>(dk_row, dk, hh, params.softmax_scale, col0,
                                        params.head_dim, key_ok, lane);
    store_accumulator_row<T, kGradCols>(dv_row, dv, hh, 1.f, col0, params.head_dim, key_ok, lane);
  }
}

}  // namespace cuda
}  // namespace flash_attn_ext
