// Device queries of the CUDA host code (dispatch decisions taken on every
// call), cached per device so that only a device's first call asks the
// runtime.
#pragma once
#include <cuda_runtime.h>

namespace flash_attn_ext {
namespace cuda {

// kAttr of the current device, or `fallback` where the runtime cannot say.
// The cache holds value + 1 (0 = not read yet; attributes are >= 0). Host
// threads may race on a first read; they write the same value.
template <cudaDeviceAttr kAttr>
int current_device_attribute(int fallback) {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0) return fallback;
  if (device < kMaxDevices && cached[device] > 0) return cached[device] - 1;
  int value = 0;
  if (cudaDeviceGetAttribute(&value, kAttr, device) != cudaSuccess || value < 0) return fallback;
  if (device < kMaxDevices) cached[device] = value + 1;
  return value;
}

}  // namespace cuda
}  // namespace flash_attn_ext
