// Host helpers of the Hopper kernels (sm90_host.h): env, device queries, tensor maps.
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <stdexcept>
#include <string>

#include "../common/device_attribute.h"
#include "../common/env.h"
#include "sm90_host.h"

namespace flash_attn_ext {
namespace cuda {

KernelImpl kernel_impl_requested(const char* env_name) {
  switch (env_choice(env_name, {"auto", "mma", "wgmma"})) {
    case 1: return KernelImpl::kMma;
    case 2: return KernelImpl::kWgmma;
    default: return KernelImpl::kAuto;
  }
}

bool device_is_sm90() {
  return current_device_attribute<cudaDevAttrComputeCapabilityMajor>(0) == 9 &&
         current_device_attribute<cudaDevAttrComputeCapabilityMinor>(-1) == 0;
}

int device_sm_count() {
  return std::max(1, current_device_attribute<cudaDevAttrMultiProcessorCount>(1));
}

namespace {

// cuTensorMapEncodeTiled lives in the driver (libcuda); fetching it through
// the runtime avoids linking libcuda into the extension.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &query) == cudaSuccess &&
        query == cudaDriverEntryPointSuccess) {
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
    }
  });
  if (fn == nullptr) {
    throw std::runtime_error(
        "flash_attn_ext: the CUDA driver has no cuTensorMapEncodeTiled (driver too old for the "
        "Hopper kernels); set FLASH_ATTN_EXT_FWD_IMPL=mma and FLASH_ATTN_EXT_BWD_IMPL=mma");
  }
  return fn;
}

[[noreturn]] void tensor_map_failed(CUresult res, const std::string& what) {
  throw std::runtime_error("flash_attn_ext: cuTensorMapEncodeTiled failed (error " +
                           std::to_string(res) + ") for " + what +
                           "; set FLASH_ATTN_EXT_FWD_IMPL=mma / FLASH_ATTN_EXT_BWD_IMPL=mma to use "
                           "the mma.sync kernels");
}

}  // namespace

namespace {

// A 4-D map (innermost first) over elements of `elem_bytes` bytes, element
// strides of dims 1..3, 128-byte swizzle. A size-1 dimension may carry stride
// 0 (packed tensors, params.h); TMA wants a positive multiple of 16 there, and
// never steps along it.
CUtensorMap encode_4d(const void* base, CUtensorMapDataType type, uint64_t elem_bytes,
                      const uint64_t (&dims)[4], const int64_t (&strides)[3],
                      const uint32_t (&box)[4], const char* what,
                      CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B) {
  cuuint64_t byte_strides[3];
  for (int i = 0; i < 3; ++i) {
    byte_strides[i] = dims[i + 1] > 1 || strides[i] > 0
                          ? static_cast<cuuint64_t>(strides[i]) * elem_bytes
                          : 16;
  }
  const cuuint64_t map_dims[4] = {dims[0], dims[1], dims[2], dims[3]};
  const cuuint32_t map_box[4] = {box[0], box[1], box[2], box[3]};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  CUtensorMap map;
  const CUresult res = tensor_map_encoder()(
      &map, type, 4, const_cast<void*>(base), map_dims, byte_strides, map_box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (res != CUDA_SUCCESS) {
    tensor_map_failed(res, std::string(what) + " of [" + std::to_string(dims[3]) + ", " +
                               std::to_string(dims[2]) + ", " + std::to_string(dims[1]) + ", " +
                               std::to_string(dims[0]) + "] (outermost first) with element "
                               "strides (" + std::to_string(strides[2]) + ", " +
                               std::to_string(strides[1]) + ", " + std::to_string(strides[0]) +
                               ")");
  }
  return map;
}

}  // namespace

CUtensorMap make_attention_tensor_map(const void* base, bool bf16, int head_dim, int seqlen,
                                      int heads, int batch, const TensorStrides& strides,
                                      int box_rows) {
  return encode_4d(base, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                   2, {uint64_t(head_dim), uint64_t(seqlen), uint64_t(heads), uint64_t(batch)},
                   {strides.row, strides.head, strides.batch},
                   {64, static_cast<uint32_t>(box_rows), 1, 1}, "a tensor");
}

CUtensorMap make_attention_tensor_map_e4m3(const void* base, int head_dim, int seqlen, int heads,
                                           int batch, const TensorStrides& strides,
                                           int box_rows) {
  return encode_4d(base, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1,
                   {uint64_t(head_dim), uint64_t(seqlen), uint64_t(heads), uint64_t(batch)},
                   {strides.row, strides.head, strides.batch},
                   {128, static_cast<uint32_t>(box_rows), 1, 1}, "an e4m3 tensor");
}

CUtensorMap make_transposed_v_tensor_map_e4m3(const void* base, int head_dim,
                                              int64_t seqlen_padded, int heads_k, int batch,
                                              int box_rows, int box_keys) {
  // The swizzle whose row is the box's keys: a 128-byte or a 32-byte one.
  if (box_keys != 128 && box_keys != 32) {
    throw std::runtime_error("flash_attn_ext: internal error: V^T boxes of " +
                             std::to_string(box_keys) + " keys (128 or 32)");
  }
  return encode_4d(base, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1,
                   {uint64_t(seqlen_padded), uint64_t(head_dim), uint64_t(heads_k), uint64_t(batch)},
                   {seqlen_padded, seqlen_padded * head_dim, seqlen_padded * head_dim * heads_k},
                   {static_cast<uint32_t>(box_keys), static_cast<uint32_t>(box_rows), 1, 1},
                   "the transposed e4m3 V",
                   box_keys == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_32B);
}

CUtensorMap make_dq_accum_tensor_map(float* base, int cols, int rows, int slices,
                                     int64_t row_pitch, int64_t slice_pitch, int box_rows) {
  constexpr uint64_t kElem = 4;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(slices)};
  const cuuint64_t byte_strides[2] = {static_cast<cuuint64_t>(row_pitch) * kElem,
                                      static_cast<cuuint64_t>(slice_pitch) * kElem};
  const cuuint32_t box[3] = {32, static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  CUtensorMap map;
  const CUresult res = tensor_map_encoder()(
      &map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, base, dims, byte_strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (res != CUDA_SUCCESS) {
    tensor_map_failed(res, "the dQ accumulator [" + std::to_string(slices) + ", " +
                               std::to_string(rows) + ", " + std::to_string(cols) + "]");
  }
  return map;
}

}  // namespace cuda
}  // namespace flash_attn_ext
