// Host helpers shared by the Hopper forward and backward launchers: which
// implementation the env asks for, device queries, TMA descriptors
// (sm90_host.cu). Compiled only when an sm_90a target is built.
#pragma once
#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include <cstdint>

#include "../../params.h"

namespace flash_attn_ext {
namespace cuda {

// Which implementation an env var (FLASH_ATTN_EXT_FWD_IMPL,
// FLASH_ATTN_EXT_BWD_IMPL) asks for:
//   auto  (default) the Hopper kernel wherever it applies, else mma.sync
//   mma   always the mma.sync kernels (sm_80 code path)
//   wgmma the Hopper kernel wherever it applies (same as auto today; kept
//         separate so benchmarks can name the path they mean)
enum class KernelImpl { kAuto, kMma, kWgmma };
KernelImpl kernel_impl_requested(const char* env_name);  // throws on an unknown value

// Whether the current device is compute capability 9.0 (cached per device).
bool device_is_sm90();
// Multiprocessors of the current device (cached per device).
int device_sm_count();

// A 4-D TMA descriptor over a [batch, seqlen, heads, head_dim] tensor given by
// element strides (any order: [B,S,H,D] and [B,H,S,D] alike), 16-bit
// elements, boxes of [box_rows x 64 columns] stored with the 128-byte swizzle.
// Rows past seqlen and columns past head_dim read as zeros and are not written.
CUtensorMap make_attention_tensor_map(const void* base, bool bf16, int head_dim, int seqlen,
                                      int heads, int batch, const TensorStrides& strides,
                                      int box_rows);

// The same for e4m3 tensors (the FP8 forward): boxes of [box_rows x 128
// columns] (128 bytes).
CUtensorMap make_attention_tensor_map_e4m3(const void* base, int head_dim, int seqlen, int heads,
                                           int batch, const TensorStrides& strides, int box_rows);
// The FP8 forward's transposed V (params.v_transposed: e4m3 [batch, heads_k,
// head_dim, seqlen_padded], contiguous): boxes of [box_rows x box_keys] (128
// keys in the 128-byte swizzle, 32 in the 32-byte one), the rows past head_dim
// read as zeros.
CUtensorMap make_transposed_v_tensor_map_e4m3(const void* base, int head_dim,
                                              int64_t seqlen_padded, int heads_k, int batch,
                                              int box_rows, int box_keys);
// A 3-D TMA descriptor over the backward's fp32 dQ accumulator, [slices][rows]
// [cols] with row and slice pitches in floats (multiples of 4): the workspace's
// [batch * heads][seqlen_q][accum_dim] (params.h: rows indexed like lse;
// packed: [heads][total_q]) or the caller's (params.dq_accum_external), boxes
// of [box_rows x 32 columns] (128 bytes) stored with the 128-byte swizzle. The
// kernel adds tiles into it (tma_reduce_add_3d); rows past `rows` and columns
// past `cols` are skipped.
CUtensorMap make_dq_accum_tensor_map(float* base, int cols, int rows, int slices,
                                     int64_t row_pitch, int64_t slice_pitch, int box_rows);

// Whether TMA can describe a tensor with these strides: every dimension longer
// than 1 needs a positive stride (a broadcast, stride-0 dimension, e.g. from
// expand(), cannot be encoded; such calls stay on the mma.sync kernels, which
// read any strides). 16-byte alignment is ensured by the op layer (ops_cuda.cpp).
inline bool tma_strides_ok(const TensorStrides& st, int64_t seqlen, int heads, int batch) {
  return (seqlen <= 1 || st.row > 0) && (heads <= 1 || st.head > 0) && (batch <= 1 || st.batch > 0);
}

}  // namespace cuda
}  // namespace flash_attn_ext
