// Ring attention's partial results on CUDA, each in one pass over the rows:
//   merge_partial_  folds up to kMaxMergeBlocks blocks' partial attention
//                   results (out, lse) into a running one (the forward's, per
//                   chunk of rows); with torch ops one merge took five passes
//                   (an fp32 copy of the block, the lerp, logaddexp, ...) and a
//                   final cast, and one block at a time an fp32 pass per block.
//   sum_partial_    adds up to kMaxSumPieces gradient pieces (and a running fp32
//                   sum) into one tensor (the backward's dQ / dK / dV per chunk of
//                   rows): the pieces are read once, instead of one fp32
//                   read-modify-write pass per piece.
//
// merge_partial_'s formula (params.h, MergePartialParams): with every lse
// read, lse' = max + log(sum of exp(lse_j - max)), and out the sum of the
// inputs weighted by exp(lse_j - lse'), in fp32, rounded once on the store.
//
// Thread map (both kernels): a row (b, s, h) of head_dim elements is
// kVec-element vectors, one per thread along x; y picks the row within the block.
//
//      threadIdx.x ->   0        1      ...   head_dim / kVec - 1
//   y = 0  row r0    [d0..d3] [d4..d7]  ...
//   y = 1  row r0+1  ...
//
// merge_partial_: every thread reads its row's lse values; after a barrier,
// x = 0 writes the merged one (lse is updated in place, and another
// warp of the same row may not have read it yet).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "flash_api.h"

namespace flash_attn_ext {
namespace cuda {

namespace {

constexpr int kThreadsPerBlock = 256;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// kVec elements moved as one load / store (the op layer checks the alignment).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Vec {
  T v[kVec];
};

template <typename T, int kVec>
__device__ __forceinline__ void load(const void* base, int64_t offset, float (&x)[kVec]) {
  const Vec<T, kVec> v = *reinterpret_cast<const Vec<T, kVec>*>(static_cast<const T*>(base) + offset);
#pragma unroll
  for (int i = 0; i < kVec; ++i) x[i] = to_float(v.v[i]);
}

template <typename T, int kVec>
__device__ __forceinline__ void store(void* base, int64_t offset, const float (&x)[kVec]) {
  Vec<T, kVec> v;
#pragma unroll
  for (int i = 0; i < kVec; ++i) v.v[i] = from_float<T>(x[i]);
  *reinterpret_cast<Vec<T, kVec>*>(static_cast<T*>(base) + offset) = v;
}

// (batch, head, position) of a row; rows run heads fastest, like the
// [batch, seqlen, heads, head_dim] tensors.
struct RowCoords {
  int b, h, s;
};
__device__ __forceinline__ RowCoords row_coords(const PartialRows& p, int64_t row) {
  return {int(row / (int64_t(p.heads) * p.seqlen)), int(row % p.heads),
          int((row / p.heads) % p.seqlen)};
}

template <typename Out, typename Prev, typename Block, int kVec>
__global__ void __launch_bounds__(kThreadsPerBlock)
    merge_partial_kernel(MergePartialParams p) {
  static_assert(kVec == 1 || kVec == 4, "vectors of 1 or 4 elements");
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool active = row < p.rows();
  const auto [b, h, s] = row_coords(p, row);

  // The weights of the running result and of every block: exp(lse_j - lse').
  // Loops over kMaxMergeBlocks with a guard keep the arrays in registers.
  float merged = -INFINITY, prev_weight = 0.f, weights[kMaxMergeBlocks];
  float* lse = nullptr;
  if (active) {
    lse = p.lse + b * p.lse_strides[0] + h * p.lse_strides[1] + s * p.lse_strides[2];
    const float running = *lse;
    float hi = running;
#pragma unroll
    for (int j = 0; j < kMaxMergeBlocks; ++j) {
      const int64_t* st = p.block_lse_strides[j];
      weights[j] =
          j < p.num_blocks ? p.block_lses[j][b * st[0] + h * st[1] + s * st[2]] : -INFINITY;
      hi = fmaxf(hi, weights[j]);
    }
    if (hi != -INFINITY) {  // else no key anywhere: every weight 0, out 0
      float total = expf(running - hi);
#pragma unroll
      for (int j = 0; j < kMaxMergeBlocks; ++j) total += expf(weights[j] - hi);
      merged = hi + logf(total);
      prev_weight = expf(running - merged);
    }
#pragma unroll
    for (int j = 0; j < kMaxMergeBlocks; ++j) {
      weights[j] = merged == -INFINITY ? 0.f : expf(weights[j] - merged);
    }
  }
  __syncthreads();  // every thread of the row has read *lse before it changes
  if (!active) return;
  if (threadIdx.x == 0) *lse = merged;

  const int d = threadIdx.x * kVec;
  if (d >= p.head_dim) return;
  float out[kVec], x[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) out[i] = 0.f;
  // Terms of weight 0 are not read: a fresh running result (lse -inf) may hold NaNs.
  if (prev_weight > 0.f) {
    load<Prev, kVec>(p.prev_out, row_offset(p.prev_strides, b, h, s) + d, x);
#pragma unroll
    for (int i = 0; i < kVec; ++i) out[i] = prev_weight * x[i];
  }
#pragma unroll
  for (int j = 0; j < kMaxMergeBlocks; ++j) {
    if (j < p.num_blocks && weights[j] > 0.f) {
      load<Block, kVec>(p.block_outs[j], row_offset(p.block_strides[j], b, h, s) + d, x);
#pragma unroll
      for (int i = 0; i < kVec; ++i) out[i] += weights[j] * x[i];
    }
  }
  store<Out, kVec>(p.out, row_offset(p.out_strides, b, h, s) + d, out);
}

template <typename Out, typename Prev, typename Piece, int kVec>
__global__ void __launch_bounds__(kThreadsPerBlock) sum_partial_kernel(SumPartialParams p) {
  static_assert(kVec == 1 || kVec == 4, "vectors of 1 or 4 elements");
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const int d = threadIdx.x * kVec;
  if (row >= p.rows() || d >= p.head_dim) return;
  const auto [b, h, s] = row_coords(p, row);
  float sum[kVec], piece[kVec];
  if (p.prev != nullptr) {
    load<Prev, kVec>(p.prev, row_offset(p.prev_strides, b, h, s) + d, sum);
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) sum[i] = 0.f;
  }
  // In the pieces' order: the same rounding as adding them one by one in fp32.
  for (int j = 0; j < p.num_pieces; ++j) {
    load<Piece, kVec>(p.pieces[j], row_offset(p.piece_strides[j], b, h, s) + d, piece);
#pragma unroll
    for (int i = 0; i < kVec; ++i) sum[i] += piece[i];
  }
  store<Out, kVec>(p.out, row_offset(p.out_strides, b, h, s) + d, sum);
}

// One launch of a row-mapped kernel (the thread map above): kVec = 4 or 1.
template <typename Params>
void launch_rows(const Params& p, bool vectorized, const char* op, void (*kernel_vec4)(Params),
                 void (*kernel_vec1)(Params), cudaStream_t stream) {
  const int vec = vectorized ? 4 : 1;
  const int threads_per_row = (p.head_dim + vec - 1) / vec;
  if (threads_per_row > kThreadsPerBlock) {
    throw std::runtime_error(std::string("flash_attn_ext: ") + op +
                             " supports head_dim <= 256, or <= 1024 when every row starts "
                             "4-element aligned");
  }
  const int rows_per_block = kThreadsPerBlock / threads_per_row;
  const dim3 grid(static_cast<unsigned>((p.rows() + rows_per_block - 1) / rows_per_block));
  const dim3 block(threads_per_row, rows_per_block);
  (vectorized ? kernel_vec4 : kernel_vec1)<<<grid, block, 0, stream>>>(p);
}

template <typename T>
struct Type {
  using type = T;
};

// Calls launch(Type<Out>, Type<Prev>, Type<In>) for the inputs' dtype In and
// the output / running result Out, Prev: float32 or In (the op layer checks),
// the combinations instantiated here.
template <typename Launch>
void with_types(DType in, bool out_fp32, bool prev_fp32, const char* op, Launch&& launch) {
  auto with_in = [&](auto in_tag) {
    using In = typename decltype(in_tag)::type;
    if (out_fp32 && prev_fp32) return launch(Type<float>{}, Type<float>{}, in_tag);
    if (out_fp32) return launch(Type<float>{}, Type<In>{}, in_tag);
    if (prev_fp32) return launch(Type<In>{}, Type<float>{}, in_tag);
    return launch(Type<In>{}, Type<In>{}, in_tag);
  };
  switch (in) {
    case DType::kFloat32: return with_in(Type<float>{});
    case DType::kFloat16: return with_in(Type<__half>{});
    case DType::kBFloat16: return with_in(Type<__nv_bfloat16>{});
    default: throw std::runtime_error(std::string("flash_attn_ext: ") + op + ": unsupported dtype");
  }
}

}  // namespace

void merge_partial(const MergePartialParams& p, bool vectorized, cudaStream_t stream) {
  if (p.rows() == 0 || p.head_dim == 0) return;
  with_types(p.block_dtype, p.out_dtype == DType::kFloat32, p.prev_dtype == DType::kFloat32,
             "merge_partial_", [&](auto out, auto prev, auto in) {
               using Out = typename decltype(out)::type;
               using Prev = typename decltype(prev)::type;
               using In = typename decltype(in)::type;
               launch_rows(p, vectorized, "merge_partial_", merge_partial_kernel<Out, Prev, In, 4>,
                           merge_partial_kernel<Out, Prev, In, 1>, stream);
             });
}

void sum_partial(const SumPartialParams& p, bool vectorized, cudaStream_t stream) {
  if (p.rows() == 0 || p.head_dim == 0) return;
  const bool prev_fp32 = p.prev == nullptr || p.prev_dtype == DType::kFloat32;
  with_types(p.piece_dtype, p.out_dtype == DType::kFloat32, prev_fp32, "sum_partial_",
             [&](auto out, auto prev, auto in) {
               using Out = typename decltype(out)::type;
               using Prev = typename decltype(prev)::type;
               using In = typename decltype(in)::type;
               launch_rows(p, vectorized, "sum_partial_", sum_partial_kernel<Out, Prev, In, 4>,
                           sum_partial_kernel<Out, Prev, In, 1>, stream);
             });
}

}  // namespace cuda
}  // namespace flash_attn_ext
