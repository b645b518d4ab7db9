// Varlen outputs: the packed rows past the last sequence belong to none, so
// the forward gives them zeros in out and -inf in lse (the attention kernels
// write every row of every sequence, and nothing else); the backward gives
// every row outside a sequence (those, and keys past seqused_k) zero
// gradients. Where those rows begin, cu_seqlens_q[batch], is read here on the
// device: knowing it on the host would take a device-to-host copy per call
// (ops_checks.h, check_cu_seqlens).
#include <climits>
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

// The backward's dQ, dK, dV (blockIdx.z = 0, 1, 2): the rows that no
// sequence covers, which the backward kernels leave unwritten. blockIdx.x = b
// < batch: rows [used, full) of sequence b (keys past seqused_k; queries and
// keys past max_seqlen, which only a bad max_seqlen leaves); b = batch: the
// packed rows past the last sequence (x: no 65535 limit on the batch).
// blockIdx.y strides over the rows. A zero-filled allocation did this before,
// at the cost of a pass over all three gradients (2.6-2.8% of a varlen
// backward, H200).
template <typename Elem>
__global__ void grad_rows_outside_sequences_kernel(AttentionBwdParams params, GradRows rows) {
  const int which = blockIdx.z, b = blockIdx.x;
  Elem* grad = static_cast<Elem*>(rows.ptr[which]);
  if (grad == nullptr) return;
  const TensorStrides st = rows.strides[which];
  const bool is_q = which == 0;
  const bool packed = params.cu_seqlens_q != nullptr;
  const int64_t total = is_q ? params.total_q : params.total_k;
  int64_t begin = 0, end = 0;  // rows [begin, end) of batch entry `batch` (packed: 0)
  int batch = 0;
  if (b < params.batch) {
    const SeqBounds seq = seq_bounds(params, b);
    const int used = is_q ? seq.seqlen_q : seq.seqlen_k;
    if (packed) {  // the sequence's rows, clamped as seq_bounds clamps them but to no max_len
      int64_t first;
      int full;
      packed_sequence(is_q ? params.cu_seqlens_q : params.cu_seqlens_k, b, total, INT_MAX, first,
                      full);
      begin = first + used;
      end = first + full;
    } else {
      begin = used;
      end = is_q ? params.seqlen_q : params.seqlen_k;
      batch = b;
    }
  } else if (packed) {
    begin = is_q ? params.cu_seqlens_q[params.batch] : params.cu_seqlens_k[params.batch];
    begin = begin < 0 ? 0 : (begin < total ? begin : total);
    end = total;
  }
  const int heads = rows.heads[which], cols = rows.cols[which];
  for (int64_t row = begin + blockIdx.y; row < end; row += gridDim.y) {
    for (int i = threadIdx.x; i < heads * cols; i += blockDim.x) {
      grad[row_offset(st, batch, i / cols, row) + i % cols] = Elem(0);
    }
  }
}

}  // namespace

void finish_grad_rows_outside_sequences(const AttentionBwdParams& params, const GradRows& rows,
                                        int elem_bytes, cudaStream_t stream) {
  if (!has_var_seqs(params)) return;
  const dim3 grid(static_cast<unsigned>(params.batch) + 1, 4, 3);
  const dim3 block(128);
  if (elem_bytes == 4) {
    grad_rows_outside_sequences_kernel<uint32_t><<<grid, block, 0, stream>>>(params, rows);
  } else {
    grad_rows_outside_sequences_kernel<uint16_t><<<grid, block, 0, stream>>>(params, rows);
  }
}

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
