// Varlen outputs: the packed rows past the last sequence belong to none, so
// the forward gives them zeros in out and -inf in lse (the attention kernels
// write every row of every sequence, and nothing else). Where those rows begin,
// cu_seqlens_q[batch], is read here on the device: knowing it on the host
// would take a device-to-host copy per call (ops_checks.h, check_cu_seqlens).
#include <cstdint>

#include "flash_api.h"

namespace flash_attn_ext {
namespace cuda {

namespace {

// One block per row, striding over the rows past the sequences (usually none:
// then every block returns at once). Elem: an unsigned integer of the output
// element's size (zero bits are +0 in every float format).
template <typename Elem>
__global__ void rows_past_sequences_kernel(AttentionFwdParams params, int cols) {
  const int64_t total = params.total_q;
  int64_t first = params.cu_seqlens_q[params.batch];
  first = first < 0 ? 0 : (first < total ? first : total);
  Elem* out = static_cast<Elem*>(params.out);
  const int elements = params.heads * cols;
  for (int64_t row = first + blockIdx.x; row < total; row += gridDim.x) {
    for (int i = threadIdx.x; i < elements; i += blockDim.x) {
      const int h = i / cols, c = i % cols;
      out[row * params.out_strides.row + h * params.out_strides.head + c] = Elem(0);
    }
    for (int h = threadIdx.x; h < params.heads; h += blockDim.x) {
      params.lse[h * params.lse_head_stride + row] = -INFINITY;
    }
  }
}

}  // namespace

void finish_rows_past_sequences(const AttentionFwdParams& params, int cols, cudaStream_t stream) {
  if (params.cu_seqlens_q == nullptr || params.total_q == 0) return;
  constexpr int64_t kMaxBlocks = 1024;
  const dim3 grid(static_cast<unsigned>(params.total_q < kMaxBlocks ? params.total_q : kMaxBlocks));
  const dim3 block(128);
  if (params.out_dtype == DType::kFloat32) {
    rows_past_sequences_kernel<uint32_t><<<grid, block, 0, stream>>>(params, cols);
  } else {
    rows_past_sequences_kernel<uint16_t><<<grid, block, 0, stream>>>(params, cols);
  }
}

}  // namespace cuda
}  // namespace flash_attn_ext
