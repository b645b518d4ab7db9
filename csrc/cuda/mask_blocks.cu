// The block summary of a boolean attn_mask (common/mask_blocks.cuh): one CTA
// per kMaskBlock x block_cols block of the mask at its stored (unbroadcast)
// shape, reading it once; a key-padding mask [B, 1, 1, S] costs
// B * S / block_cols tiny CTAs.
#include <stdexcept>
#include <string>

#include "common/mask_blocks.cuh"
#include "flash_api.h"

namespace flash_attn_ext {
namespace cuda {

namespace {

constexpr int kThreads = 256;

// The summary's shape: a broadcast mask dimension (stride 0) has one entry.
struct MaskBlockShape {
  int64_t batch, heads, row_blocks, col_blocks;
};

MaskBlockShape mask_block_shape(const AttentionFwdParams& p, int block_cols) {
  const BiasStrides& st = p.attn_bias_strides;
  return {st.batch == 0 ? 1 : p.batch, st.head == 0 ? 1 : p.heads,
          st.row == 0 ? 1 : (p.seqlen_q + kMaskBlock - 1) / kMaskBlock,
          st.col == 0 ? 1 : (p.seqlen_k + block_cols - 1) / block_cols};
}

// Grid: x = column block, y = row block, z = batch * heads of the summary.
__global__ void attn_mask_blocks_kernel(const AttentionFwdParams p, int heads, int block_cols) {
  const BiasStrides& st = p.attn_bias_strides;
  const int b = blockIdx.z / heads, h = blockIdx.z % heads;
  // A broadcast dimension is read at index 0 only.
  const int rows = st.row == 0 ? 1 : min(kMaskBlock, p.seqlen_q - static_cast<int>(blockIdx.y) * kMaskBlock);
  const int cols = st.col == 0 ? 1 : min(block_cols, p.seqlen_k - static_cast<int>(blockIdx.x) * block_cols);
  const bool* mask = static_cast<const bool*>(p.attn_bias) + b * st.batch + h * st.head +
                     static_cast<int64_t>(blockIdx.y) * kMaskBlock * st.row +
                     static_cast<int64_t>(blockIdx.x) * block_cols * st.col;
  uint32_t bits = 0;
  // Consecutive threads read consecutive keys (coalesced for a row-major mask).
  for (int e = threadIdx.x; e < rows * cols; e += kThreads) {
    bits |= mask[(e / cols) * st.row + (e % cols) * st.col] ? kMaskBlockAttends : kMaskBlockMasks;
  }
  const bool attends = __syncthreads_or(bits & kMaskBlockAttends);
  const bool masks = __syncthreads_or(bits & kMaskBlockMasks);
  if (threadIdx.x == 0) {
    const auto& out = p.attn_mask_block_strides;
    p.attn_mask_blocks[b * out.batch + h * out.head + blockIdx.y * out.row + blockIdx.x * out.col] =
        static_cast<uint8_t>((attends ? kMaskBlockAttends : 0u) | (masks ? kMaskBlockMasks : 0u));
  }
}

}  // namespace

int64_t attn_mask_blocks_bytes(const AttentionFwdParams& params) {
  if (params.attn_bias_type != BiasType::kBool || params.cu_seqlens_q != nullptr ||
      params.seqlen_q <= 0 || params.seqlen_k <= 0) {
    return 0;
  }
  const MaskBlockShape s = mask_block_shape(params, kMaskBlock);  // the finest blocks
  return s.batch * s.heads * s.row_blocks * s.col_blocks;
}

void set_attn_mask_blocks(AttentionFwdParams& params, uint8_t* blocks) {
  params.attn_mask_blocks = blocks;
}

void compute_attn_mask_blocks(AttentionFwdParams& params, int block_cols, cudaStream_t stream) {
  if (params.attn_mask_blocks == nullptr) return;
  if (block_cols < kMaskBlock || block_cols % 16 != 0) {
    throw std::runtime_error("flash_attn_ext: internal error: attn_mask summary of " +
                             std::to_string(block_cols) + "-key blocks");
  }
  const MaskBlockShape s = mask_block_shape(params, block_cols);
  const BiasStrides& st = params.attn_bias_strides;
  if (s.batch * s.heads > 65535 || s.row_blocks > 65535 ||
      s.batch * s.heads * s.row_blocks * s.col_blocks > 0x7fffffff) {
    throw std::runtime_error("flash_attn_ext: attn_mask too large for its block summary");
  }
  auto& out = params.attn_mask_block_strides;
  out.batch = static_cast<int>(st.batch == 0 ? 0 : s.heads * s.row_blocks * s.col_blocks);
  out.head = static_cast<int>(st.head == 0 ? 0 : s.row_blocks * s.col_blocks);
  out.row = static_cast<int>(st.row == 0 ? 0 : s.col_blocks);
  out.col = st.col == 0 ? 0 : 1;
  const dim3 grid(static_cast<unsigned>(s.col_blocks), static_cast<unsigned>(s.row_blocks),
                  static_cast<unsigned>(s.batch * s.heads));
  attn_mask_blocks_kernel<<<grid, kThreads, 0, stream>>>(params, static_cast<int>(s.heads),
                                                         block_cols);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("flash_attn_ext: attn_mask block summary launch: ") +
                             cudaGetErrorString(err));
  }
}

}  // namespace cuda
}  // namespace flash_attn_ext
