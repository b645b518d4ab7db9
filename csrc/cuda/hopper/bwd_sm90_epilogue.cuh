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
// key_row + 8 of the key tile (first key n0): dK as the consumer's pieces
// (dk: kGradColsA columns from Traits::grad_col_a(wg), dk_b: kGradColsB from
// grad_col_b, at D = 192 only), dV's kGradColsV columns from grad_col_v; keys
// past seqlen_k and padded head-dim columns (past head_dim, head_dim_v) are
// not written (keys no query sees get zeros). grad_head: the gradients' head
// (kWalkGroup: the kv head, the group summed in registers; else the query
// head, GQA there summed by the op layer); k_row0: the sequence's first key
// row. Scalars by reference, as in bwd_sm90_producer.cuh (by value they
// compiled to different SASS).
template <typename Traits, int kColsKB>
FAE_DEVICE void bwd_sm90_store_dk_dv(const AttentionBwdParams& params,
                                     const float (&dk)[Traits::kGradColsA / 8][4],
                                     const float (&dk_b)[kColsKB / 8][4],
                                     const float (&dv)[Traits::kGradColsV / 8][4], const int& b,
                                     const int& grad_head, const int& k_row0, const int& n0,
                                     const int& key_row, const int& seqlen_k, const int& wg,
                                     const int& lane) {
  using T = typename Traits::T;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int key = n0 + key_row + 8 * hh;
    const bool key_ok = key < seqlen_k;
    const int64_t row = k_row0 + (key_ok ? key : 0);
    T* dk_row = static_cast<T*>(params.dk) + row_offset(params.dk_strides, b, grad_head, row);
    T* dv_row = static_cast<T*>(params.dv) + row_offset(params.dv_strides, b, grad_head, row);
    store_accumulator_row<T, Traits::kGradColsA>(dk_row, dk, hh, params.softmax_scale,
                                                 Traits::grad_col_a(wg), params.head_dim, key_ok,
                                                 lane);
    if constexpr (Traits::kGradColsB > 0) {
      store_accumulator_row<T, Traits::kGradColsB>(dk_row, dk_b, hh, params.softmax_scale,
                                                   Traits::grad_col_b(wg), params.head_dim,
                                                   key_ok, lane);
    }
    store_accumulator_row<T, Traits::kGradColsV>(dv_row, dv, hh, 1.f, Traits::grad_col_v(wg),
                                                 params.head_dim_v, key_ok, lane);
  }
}

}  // namespace cuda
}  // namespace flash_attn_ext
