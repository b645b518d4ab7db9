// Host helpers of the Hopper kernels (sm90_host.h): env, device queries, tensor maps.
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <stdexcept>
#include <string>

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
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {};  // 0 unknown, 1 yes, 2 no
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0) return false;
  if (device < kMaxDevices && cached[device] != 0) return cached[device] == 1;
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    return false;
  }
  const bool yes = major == 9 && minor == 0;
  if (device < kMaxDevices) cached[device] = yes ? 1 : 2;
  return yes;
}

int device_sm_count() {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0) return 1;
  if (device < kMaxDevices && cached[device] > 0) return cached[device];
  int count = 0;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      count <= 0) {
    return 1;
  }
  if (device < kMaxDevices) cached[device] = count;
  return count;
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

CUtensorMap make_attention_tensor_map(const void* base, bool bf16, int head_dim, int seqlen,
                                      int heads, int batch, const TensorStrides& strides,
                                      int box_rows) {
  constexpr uint64_t kElem = 2;
  // A size-1 dimension may carry stride 0 (packed tensors, params.h); TMA
  // wants a positive multiple of 16 there, and never steps along it.
  auto stride_bytes = [&](int64_t elems, int extent) -> uint64_t {
    if (extent > 1 || elems > 0) return static_cast<uint64_t>(elems) * kElem;
    return 16;
  };
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(seqlen),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t byte_strides[3] = {stride_bytes(strides.row, seqlen),
                                      stride_bytes(strides.head, heads),
                                      stride_bytes(strides.batch, batch)};
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  CUtensorMap map;
  const CUresult res = tensor_map_encoder()(
      &map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
      const_cast<void*>(base), dims, byte_strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (res != CUDA_SUCCESS) {
    tensor_map_failed(res, "a tensor of [batch " + std::to_string(batch) + ", seqlen " +
                               std::to_string(seqlen) + ", heads " + std::to_string(heads) +
                               ", head_dim " + std::to_string(head_dim) + "] with element strides (" +
                               std::to_string(strides.batch) + ", " + std::to_string(strides.row) +
                               ", " + std::to_string(strides.head) + ")");
  }
  return map;
}

CUtensorMap make_dq_accum_tensor_map(float* base, int accum_dim, int seqlen_q, int heads_total,
                                     int box_rows) {
  constexpr uint64_t kElem = 4;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(accum_dim), static_cast<cuuint64_t>(seqlen_q),
                              static_cast<cuuint64_t>(heads_total)};
  const cuuint64_t byte_strides[2] = {static_cast<cuuint64_t>(accum_dim) * kElem,
                                      static_cast<cuuint64_t>(seqlen_q) * accum_dim * kElem};
  const cuuint32_t box[3] = {32, static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  CUtensorMap map;
  const CUresult res = tensor_map_encoder()(
      &map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, base, dims, byte_strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (res != CUDA_SUCCESS) {
    tensor_map_failed(res, "the dQ accumulator [" + std::to_string(heads_total) + ", " +
                               std::to_string(seqlen_q) + ", " + std::to_string(accum_dim) + "]");
  }
  return map;
}

}  // namespace cuda
}  // namespace flash_attn_ext
