// The two small kernels around the main backward kernel, shared by the 16-bit
// and the fp32 paths (T = __half, __nv_bfloat16 or float):
//   * bwd_preprocess_kernel: D_i = sum_d dO[i,d] * O[i,d]  (fp32), the row term
//     of dS = P o (dP - D) (since sum_j P_ij dP_ij = dO_i . O_i), and the
//     zeroed dQ accumulator row(s) of query i (one launch instead of a memset
//     and a kernel; the writes overlap the reads); for the Hopper backward
//     also padded copies of lse (as log2) and D (with dropout: lse - log2 scale
//     and D / scale, see below), and the zeroed dQ order
//     counters of its deterministic mode (params.h).
//   * bwd_convert_dq_kernel: dq = softmax_scale * sum_{split} dq_accum[split]
//     in input dtype, with dq's own strides. Splits are summed in the fixed
//     order 0, 1, ..., so the deterministic mode is bit-reproducible.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "../../params.h"
#include "ptx.cuh"

namespace flash_attn_ext {
namespace cuda {

// Every CUDA call of the backward launchers (mma.sync and Hopper) goes through this.
inline void bwd_check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("flash_attn_ext: backward ") + what + " failed: " +
                             cudaGetErrorString(err));
  }
}

// ---- 8 consecutive elements <-> 8 floats ----------------------------------
template <typename T>
FAE_DEVICE void load8(const T* src, float (&out)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = unpack2<T>(w[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
template <>
FAE_DEVICE void load8<float>(const float* src, float (&out)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(src);
  const float4 b = *reinterpret_cast<const float4*>(src + 4);
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
  out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

template <typename T>
FAE_DEVICE void store8(T* dst, const float (&v)[8]) {
  uint4 raw;
  raw.x = pack2<T>(v[0], v[1]);
  raw.y = pack2<T>(v[2], v[3]);
  raw.z = pack2<T>(v[4], v[5]);
  raw.w = pack2<T>(v[6], v[7]);
  *reinterpret_cast<uint4*>(dst) = raw;
}
template <>
FAE_DEVICE void store8<float>(float* dst, const float (&v)[8]) {
  *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
  *reinterpret_cast<float4*>(dst + 4) = make_float4(v[4], v[5], v[6], v[7]);
}

// ---- the learnable sink's gradient, per block -----------------------------
// d_sink[h] = -sum over the rows of head h of exp(sink[h] - lse) * D (params.h
// learnable_sink): each row's term is formed where its D is, summed over the
// block's 32 rows in a fixed order (lanes 0, 8, 16, 24 of each warp, then the
// 8 warps through shared memory) and written as the block's partial, which
// the op layer adds up (ops_outputs.h add_sink_grad_partials). Rows past the
// sequence and rows without keys (lse = -inf) add 0. All 256 threads call it.
FAE_DEVICE void add_sink_grad_rows(const AttentionBwdParams& params, float d, int row, int h,
                                   int b, const SeqBounds& seq) {
  __shared__ float warp_sums[8];
  float term = 0.f;
  if (threadIdx.x % 8 == 0 && row < seq.seqlen_q) {
    const float lse = params.lse[seq.lse_index(params, b, h, row)];
    if (lse != -INFINITY) term = expf(params.learnable_sink[h] - lse) * d;
  }
  term += __shfl_xor_sync(0xffffffff, term, 8);
  term += __shfl_xor_sync(0xffffffff, term, 16);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = term;
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0.f;
    for (int w = 0; w < 8; ++w) sum += warp_sums[w];
    params.dsink_partials[(static_cast<int64_t>(b) * params.heads + h) *
                              params.dsink_partials_stride + blockIdx.x] = -sum;
  }
}

// ---- D = rowsum(dO o O); dq_accum rows = 0 ---------------------------------
// 8 threads per row (each a strided set of 8-element chunks), 32 rows per
// 256-thread block. grid = (ceil(rows / 32), heads, batch), rows = seqlen_q, or
// seqlen_q_padded with padded_row_stats. Every accumulator row is some
// (batch, head, query)'s, so all of them are zeroed.
constexpr int kDotThreadsPerRow = 8;
constexpr int kDotRowsPerBlock = 256 / kDotThreadsPerRow;

template <typename T>
__global__ void __launch_bounds__(256)
    bwd_preprocess_kernel(const AttentionBwdParams params, int accum_dim, int num_splits,
                          bool padded_row_stats) {
  const int row = blockIdx.x * kDotRowsPerBlock + threadIdx.x / kDotThreadsPerRow;
  const int sub = threadIdx.x % kDotThreadsPerRow;
  const int h = blockIdx.y, b = blockIdx.z;
  const SeqBounds seq = seq_bounds(params, b);
  const int64_t packed_row = seq.row0_q + row;
  float acc = 0.f;
  if (row < seq.seqlen_q) {
    const T* o = static_cast<const T*>(params.out) + b * params.out_strides.batch +
                 packed_row * params.out_strides.row + h * params.out_strides.head;
    const T* d_o = static_cast<const T*>(params.dout) + b * params.dout_strides.batch +
                   packed_row * params.dout_strides.row + h * params.dout_strides.head;
    for (int c = sub * 8; c < params.head_dim_v; c += kDotThreadsPerRow * 8) {
      float ov[8], dov[8];
      load8<T>(o + c, ov);
      load8<T>(d_o + c, dov);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc = fmaf(ov[i], dov[i], acc);
    }
  }
  // The 8 threads of a row are 8 consecutive lanes: reduce with xor 1, 2, 4.
  acc += __shfl_xor_sync(0xffffffff, acc, 1);
  acc += __shfl_xor_sync(0xffffffff, acc, 2);
  acc += __shfl_xor_sync(0xffffffff, acc, 4);
  if (params.dsink_partials != nullptr) add_sink_grad_rows(params, acc, row, h, b, seq);
  if (padded_row_stats && row < params.seqlen_q_padded && sub == 0) {
    // Padded batch: lse_index is (b * heads + h) * seqlen_q + row.
    constexpr float kLog2e = 1.4426950408889634f;
    const int64_t padded = (static_cast<int64_t>(b) * params.heads + h) * params.seqlen_q_padded + row;
    const float lse = row < seq.seqlen_q ? params.lse[seq.lse_index(params, b, h, row)] : -INFINITY;
    // Dropout: lse - log2(scale) makes the Hopper backward's exp2 give P * scale
    // and D / scale pairs with it (bwd_sm90_kernel.cuh): no per-element
    // multiply by the scale there, nor a register for it.
    const bool dropout = params.dropout_threshold > 0;
    const float lse_shift = dropout ? log2f(params.dropout_scale) : 0.f;
    const float dsum_factor = dropout ? 1.f / params.dropout_scale : 1.f;
    params.lse_log2_padded[padded] = lse == -INFINITY ? INFINITY : lse * kLog2e - lse_shift;
    params.dsum_padded[padded] = row < seq.seqlen_q ? acc * dsum_factor : 0.f;
    // Two counters per 64 rows (params.h), zeroed by the first of the rows.
    if (params.dq_semaphore != nullptr && row % 64 == 0) {
      int* counters = params.dq_semaphore + 2 * (padded / 64);
      counters[0] = counters[1] = 0;
    }
  }
  // The Hopper backward's flat dQ accumulator (bwd_sm90.h): its blocks hold
  // no rows, so the sequence's blocks (params.h flat_dq_block_row0) are zeroed
  // whole, dq_flat_rows x accum_dim floats per block row, as rows of that pitch.
  const bool flat = params.dq_accum_flat;
  const int block_rows = params.dq_flat_rows;
  const int flat_rows = params.cu_seqlens_q != nullptr
                            ? (seq.seqlen_q + block_rows - 1) / block_rows * block_rows
                            : params.seqlen_q_padded;
  if (flat && num_splits > 0 && row < flat_rows) {
    float* accum_row =
        params.dq_accum +
        (static_cast<int64_t>(flat_dq_block_row0(params, b, h, seq.row0_q, block_rows)) *
             block_rows +
         row) *
            accum_dim;
    for (int c = sub * 4; c < accum_dim; c += kDotThreadsPerRow * 4) {
      *reinterpret_cast<float4*>(accum_row + c) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  if (row >= seq.seqlen_q) return;
  const int64_t index = seq.lse_index(params, b, h, row);
  if (sub == 0) params.dsoftmax_sum[index] = acc;
  // The row's 8 threads write consecutive float4s (accum_dim is a multiple of 32).
  const int64_t split_stride = params.q_rows_total * accum_dim;
  for (int s = 0; s < (flat ? 0 : num_splits); ++s) {
    float* accum_row = params.dq_accum + s * split_stride + index * accum_dim;
    for (int c = sub * 4; c < accum_dim; c += kDotThreadsPerRow * 4) {
      *reinterpret_cast<float4*>(accum_row + c) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
}

// ---- dq = scale * sum_split dq_accum[split] ---------------------------------
// dq_accum layout: [num_splits][q_rows_total][accum_dim] fp32, rows indexed
// like lse (params.h), where accum_dim (>= head_dim, multiple of 8) is the row
// pitch the main kernel used.
// One thread per 8 columns. grid = (ceil(seqlen_q * head_dim/8 / 256), heads, batch).
template <typename T>
__global__ void __launch_bounds__(256)
    bwd_convert_dq_kernel(const AttentionBwdParams params, int accum_dim, int num_splits) {
  const int chunks_per_row = params.head_dim / 8;
  const int idx = blockIdx.x * 256 + threadIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const SeqBounds seq = seq_bounds(params, b);
  if (idx >= seq.seqlen_q * chunks_per_row) return;
  const int row = idx / chunks_per_row;
  const int col = (idx % chunks_per_row) * 8;
  const int64_t split_stride = params.q_rows_total * accum_dim;
  const float* src = params.dq_accum + seq.lse_index(params, b, h, row) * accum_dim + col;
  float sum[8];
  load8<float>(src, sum);
  for (int s = 1; s < num_splits; ++s) {  // fixed order: deterministic
    float part[8];
    load8<float>(src + s * split_stride, part);
#pragma unroll
    for (int i = 0; i < 8; ++i) sum[i] += part[i];
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) sum[i] *= params.softmax_scale;
  T* dst = static_cast<T*>(params.dq) + b * params.dq_strides.batch +
           (seq.row0_q + row) * params.dq_strides.row + h * params.dq_strides.head + col;
  store8<T>(dst, sum);
}

// The Hopper backward's flat dQ accumulator (bwd_sm90.h bwd_sm90_flat_dq)
// to dq: one block of kRows x 64 per CTA of 128 threads. Thread t reads the
// kRows / 8 float4s that consumer thread t added (coalesced: float4 k of all
// threads is 2 KB in a row), puts them at their rows and columns in shared
// memory, and then stores 8 columns of a row kRows / 16 times (rows past
// seqlen_q, columns past head_dim skipped; blocks past the sequence exit).
// kRows = 64: the fragments of a 64 x 64 dQ chunk (row 16 (t / 32) +
// (t % 32) / 4 + 8 (e / 2), column 8 k + 2 (t % 4) + e % 2); kRows = 80: of a
// 64 x 80 dQ^T chunk (the 80-query steps), the same with row and column
// swapped. One accumulator.
// grid = (seqlen_q_padded / kRows * accum_dim / 64, heads, batch).
template <typename T, int kRows>
__global__ void __launch_bounds__(128)
    bwd_convert_dq_flat_kernel(const AttentionBwdParams params, int accum_dim) {
  static_assert(kRows == 64 || kRows == 80, "64 x 64 dQ or 64 x 80 dQ^T fragments");
  constexpr bool kTransposed = kRows == 80;
  constexpr int kPitch = 64 + 4;  // floats per staged row; 16-byte aligned rows
  __shared__ __align__(16) float tile[kRows * kPitch];
  const int chunks = accum_dim / 64;
  const int r = blockIdx.x / chunks, c = blockIdx.x % chunks;
  const int h = blockIdx.y, b = blockIdx.z, t = threadIdx.x;
  const SeqBounds seq = seq_bounds(params, b);
  if (r * kRows >= seq.seqlen_q) return;
  const float* block =
      params.dq_accum +
      (static_cast<int64_t>(flat_dq_block_row0(params, b, h, seq.row0_q, kRows) + r) * chunks + c) *
          (kRows * 64);
  const int frag_row = 16 * (t / 32) + (t % 32) / 4, frag_col = 2 * (t % 4);
#pragma unroll
  for (int k = 0; k < kRows / 8; ++k) {
    const float4 x = *reinterpret_cast<const float4*>(block + (k * 128 + t) * 4);
    if constexpr (kTransposed) {  // fragment rows are dQ columns, its columns queries
      float* upper = tile + (8 * k + frag_col) * kPitch + frag_row;
      upper[0] = x.x;
      upper[kPitch] = x.y;
      upper[8] = x.z;
      upper[kPitch + 8] = x.w;
    } else {
      float* upper = tile + frag_row * kPitch + 8 * k + frag_col;
      upper[0] = x.x;
      upper[1] = x.y;
      upper[8 * kPitch] = x.z;
      upper[8 * kPitch + 1] = x.w;
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kRows / 16; ++i) {
    const int item = i * 128 + t, tile_row = item / 8, group = item % 8;
    const int row = r * kRows + tile_row, col = c * 64 + 8 * group;
    if (row >= seq.seqlen_q || col >= params.head_dim) continue;
    float v[8];
    load8<float>(tile + tile_row * kPitch + 8 * group, v);
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] *= params.softmax_scale;
    T* dst = static_cast<T*>(params.dq) + b * params.dq_strides.batch +
             (seq.row0_q + row) * params.dq_strides.row + h * params.dq_strides.head + col;
    store8<T>(dst, v);
  }
}

// Host helpers: launch both with the shapes above. accum_dim and num_splits
// describe the dQ accumulator(s) (the main kernel's row pitch and count; the
// preprocess zeroes num_splits of them, none for the caller's accumulator);
// padded_row_stats also writes params.lse_log2_padded / dsum_padded (Hopper).
template <typename T>
inline void launch_bwd_preprocess(const AttentionBwdParams& params, int accum_dim, int num_splits,
                                  cudaStream_t stream, bool padded_row_stats = false) {
  const int rows = padded_row_stats ? params.seqlen_q_padded : params.seqlen_q;
  const dim3 grid((rows + kDotRowsPerBlock - 1) / kDotRowsPerBlock, params.heads, params.batch);
  bwd_preprocess_kernel<T><<<grid, 256, 0, stream>>>(params, accum_dim, num_splits,
                                                     padded_row_stats);
}

template <typename T>
inline void launch_bwd_convert_dq(const AttentionBwdParams& params, int accum_dim, int num_splits,
                                  cudaStream_t stream) {
  if (params.dq_accum_flat) {  // the Hopper backward's flat dQ accumulator
    const int rows = params.dq_flat_rows;
    const dim3 grid(params.seqlen_q_padded / rows * (accum_dim / 64), params.heads, params.batch);
    if (rows == 80) {
      bwd_convert_dq_flat_kernel<T, 80><<<grid, 128, 0, stream>>>(params, accum_dim);
    } else {
      bwd_convert_dq_flat_kernel<T, 64><<<grid, 128, 0, stream>>>(params, accum_dim);
    }
    return;
  }
  const int64_t chunks = static_cast<int64_t>(params.seqlen_q) * (params.head_dim / 8);
  const dim3 grid(static_cast<unsigned>((chunks + 255) / 256), params.heads, params.batch);
  bwd_convert_dq_kernel<T><<<grid, 256, 0, stream>>>(params, accum_dim, num_splits);
}

}  // namespace cuda
}  // namespace flash_attn_ext
