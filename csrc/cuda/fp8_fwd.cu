// The FP8 (e4m3) forward: V's transpose, then the Hopper kernel
// (hopper/fwd_sm90_kernel.cuh with e4m3 traits).
//
// Why V is transposed first: e4m3 wgmmas read both operands K-major, and in
// O += P V the K dimension is the keys, so V's tile must be [head_dim x keys]
// with the keys contiguous, which V [batch, seqlen_k, heads_k, head_dim] is
// not. One pass over V (read + write seqlen_k * head_dim bytes per kv head)
// costs ~150 / seqlen_k of the attention's time at equal heads (H100,
// ~3.3 TB/s and ~1 PFLOP/s: 1.8% at 8k keys, less with GQA), which buys a
// kernel whose producer stays a single TMA thread. The pass also writes each
// 32-key block in the order the kernel's P fragments hold the keys
// (fp8_p_key_of_column, sm90_primitives.cuh), so P needs no shuffles.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "flash_api.h"
#include "hopper/sm90_host.h"
#include "hopper/sm90_primitives.cuh"

namespace flash_attn_ext {
namespace cuda {

#ifdef FAE_HAS_SM90A
template <typename TOut, int kHeadDim, bool kIsCausal>
void run_fwd_fp8_sm90_impl(const AttentionFwdParams& params, cudaStream_t stream);
#endif

namespace {

constexpr int kTransposeKeys = 64;  // keys per block (two 32-key permutation blocks)
constexpr int kTransposeDims = 64;  // head-dim rows per block

// Block (key block, head-dim block, batch * heads_k): 64 keys x 64 dims of V
// through shared memory. Reads: a quad of lanes covers one key's 64 bytes.
// Writes: a quad covers one V^T row's 64 keys, 16 bytes per lane. Keys at or
// past the sequence's seqlen_k (up to the padded length) are written as zeros:
// P is 0 there, and 0 * (uninitialised NaN) would not be. Varlen: V^T is
// padded per sequence ([sequences, heads_k, head_dim, max_seqlen_k padded]),
// read from the sequence's packed rows, so the kernel's V tiles start at key 0
// of their sequence and find zeros past its end.
__global__ void __launch_bounds__(256) transpose_v_e4m3_kernel(const AttentionFwdParams params) {
  __shared__ uint8_t tile[kTransposeKeys][kTransposeDims + 16];
  const int key0 = blockIdx.x * kTransposeKeys;
  const int dim0 = blockIdx.y * kTransposeDims;
  const int b = blockIdx.z / params.heads_k;
  const int h = blockIdx.z % params.heads_k;
  const int t = threadIdx.x;
  const SeqBounds seq = seq_bounds<true>(params, b);

  {
    const int key = key0 + t / 4;
    const int col = (t % 4) * 16;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (key < seq.seqlen_k && dim0 + col < params.head_dim) {
      const uint8_t* src = static_cast<const uint8_t*>(params.v) +
                           row_offset(params.v_strides, b, h, seq.row0_k + key) + dim0 + col;
      v = *reinterpret_cast<const uint4*>(src);
    }
    *reinterpret_cast<uint4*>(&tile[t / 4][col]) = v;
  }
  __syncthreads();

  const int dim = dim0 + t / 4;
  const int pos = (t % 4) * 16;  // first of this lane's 16 positions in the key block
  if (dim >= params.head_dim || key0 + pos >= params.v_transposed_seqlen) return;
  uint32_t words[4];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    uint32_t word = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = pos + 4 * w + i;  // position within the 64-key block
      const int key = 32 * (c / 32) + sm90::fp8_p_key_of_column(c % 32);
      word |= static_cast<uint32_t>(tile[key][t / 4]) << (8 * i);
    }
    words[w] = word;
  }
  uint8_t* dst = static_cast<uint8_t*>(params.v_transposed) +
                 ((static_cast<int64_t>(b) * params.heads_k + h) * params.head_dim + dim) *
                     params.v_transposed_seqlen +
                 key0 + pos;
  *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
}

}  // namespace

int64_t fwd_fp8_v_transposed_seqlen(int seqlen_k) { return (seqlen_k + 31) / 32 * 32; }

bool fwd_fp8_supported(int head_dim, std::string* why) {
#ifdef FAE_HAS_SM90A
  if (!device_is_sm90()) {
    *why = "it runs on Hopper (sm_90) GPUs only: it uses FP8 wgmma";
    return false;
  }
  const int kernel_dim = head_dim <= 128 ? 128 : 256;
  bool compiled = false;
#if defined(FAE_HAS_HDIM_128)
  compiled = compiled || kernel_dim == 128;
#endif
#if defined(FAE_HAS_HDIM_256)
  compiled = compiled || kernel_dim == 256;
#endif
  if (!compiled || head_dim > 256 || head_dim % 16 != 0) {
    *why = "head_dim must be a multiple of 16 up to 256 and its kernel (head dim " +
           std::to_string(kernel_dim) + ") compiled in";
    return false;
  }
  return true;
#else
  (void)head_dim;
  *why = "this build has no sm_90a code (FLASH_ATTN_EXT_CUDA_ARCHS without 90a)";
  return false;
#endif
}

// The pass above costs a fixed ~20-30 us per 32 MB of V (H100); V^T made by the
// kernel's producer warpgroup in shared memory (fwd_sm90_transpose_v.cuh) costs
// none of that but 5-9% of a long kernel's time (its shared-memory traffic
// beside the wgmmas' operand reads). Both scale with the kernel's query rows
// per kv head (the pass with none), so short calls transpose in the kernel.
// Measured (H100, D = 128, B x S = 16k tokens, equal heads), speed with V
// transposed in the kernel over the pass, non-causal / causal: S = 1k 1.16x /
// 1.26x, 4k 0.98x / 1.05x, 16k 0.93x / 0.95x; hence in the kernel up to 2048
// query rows per kv head (causal rows count half).
// D = 256 (not measured) and varlen / seqused_k calls (whose V^T the pass pads
// per sequence) keep the pass.
bool fwd_fp8_transposes_v(const AttentionFwdParams& params) {
  constexpr int64_t kMaxRowsPerKvHead = 2048;
  if (params.head_dim > 128 || has_var_seqs(params) || params.heads_k <= 0) return false;
  const int64_t rows = static_cast<int64_t>(params.seqlen_q) * (params.heads / params.heads_k);
  return (params.causal ? rows / 2 : rows) <= kMaxRowsPerKvHead;
}

void run_fwd_fp8(const AttentionFwdParams& params, cudaStream_t stream) {
  if (params.v_transposed == nullptr && !fwd_fp8_transposes_v(params)) {
    throw std::runtime_error("flash_attn_ext: internal error: FP8 forward without V^T scratch");
  }
  if (params.v_transposed != nullptr && (params.v_transposed_seqlen % 32 != 0 ||
                                         params.v_transposed_seqlen < params.seqlen_k)) {
    throw std::runtime_error("flash_attn_ext: internal error: FP8 forward's V^T scratch too short");
  }
  // Without a V^T scratch the kernel transposes V itself (fwd_fp8_transposes_v).
  if (params.v_transposed != nullptr) {
    const dim3 grid(static_cast<unsigned>((params.v_transposed_seqlen + kTransposeKeys - 1) /
                                          kTransposeKeys),
                    static_cast<unsigned>((params.head_dim + kTransposeDims - 1) / kTransposeDims),
                    static_cast<unsigned>(params.batch * params.heads_k));
    transpose_v_e4m3_kernel<<<grid, 256, 0, stream>>>(params);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
      throw std::runtime_error(std::string("flash_attn_ext: FP8 V transpose launch: ") +
                               cudaGetErrorString(err));
    }
  }
#ifdef FAE_HAS_SM90A
  const bool causal = params.causal;
  auto run = [&](auto out_tag) {
    using TOut = decltype(out_tag);
    if (params.head_dim <= 128) {
#if defined(FAE_HAS_HDIM_128)
      return causal ? run_fwd_fp8_sm90_impl<TOut, 128, true>(params, stream)
                    : run_fwd_fp8_sm90_impl<TOut, 128, false>(params, stream);
#endif
    } else {
#if defined(FAE_HAS_HDIM_256)
      return causal ? run_fwd_fp8_sm90_impl<TOut, 256, true>(params, stream)
                    : run_fwd_fp8_sm90_impl<TOut, 256, false>(params, stream);
#endif
    }
    throw std::runtime_error("flash_attn_ext: FP8 forward: head_dim " +
                             std::to_string(params.head_dim) + " is not compiled in");
  };
  if (params.out_dtype == DType::kBFloat16) {
#ifdef FAE_HAS_BF16
    return run(__nv_bfloat16{});
#endif
  } else if (params.out_dtype == DType::kFloat16) {
#ifdef FAE_HAS_FP16
    return run(__half{});
#endif
  }
  throw std::runtime_error("flash_attn_ext: FP8 forward: this output dtype is not compiled in");
#else
  throw std::runtime_error("flash_attn_ext: FP8 forward: no sm_90a code in this build");
#endif
}

}  // namespace cuda
}  // namespace flash_attn_ext
