// Mask helpers of the fp32 SIMT kernels (fwd_fp32.cu, bwd_fp32.cu): windows,
// softcap and ALiBi (csrc/mask.h) at fp32 accuracy.
//
// Mask::score computes the softcap with tanhf, which the extension's
// --use_fast_math turns into tanh.approx.f32 (~2^-11 relative error: with
// softcap 30 an error of ~1e-2 in the score). That is fine next to 16-bit
// inputs but not for the fp32 path, whose point is fp32 accuracy, so these
// kernels pass Mask::score TanhAccurate below: libdevice's accurate tanhf
// (__nv_tanhf, ~2 ulp), which fast math does not replace.
#pragma once
#include "../../mask.h"

extern "C" __device__ float __nv_tanhf(float);

namespace flash_attn_ext {
namespace cuda {

struct TanhAccurate {
  __device__ __forceinline__ float operator()(float x) const { return __nv_tanhf(x); }
};

// Key tiles [begin, end) of width kBlockN that rows [row0, row0 + rows) of the
// sequence may see (rows >= 1; Mask's bounds are non-decreasing in the row).
template <int kBlockN>
__device__ __forceinline__ void mask_key_tiles(const Mask& m, int row0, int rows, int& begin,
                                               int& end) {
  const int key_begin = m.key_begin(row0), key_end = m.key_end(row0 + rows - 1);
  begin = key_begin / kBlockN;
  end = key_end <= key_begin ? begin : (key_end + kBlockN - 1) / kBlockN;
}

// Query tiles [begin, end) of height kBlockM that see some key of
// [key0, key0 + keys) (keys >= 1; bounds non-decreasing in the key).
template <int kBlockM>
__device__ __forceinline__ void mask_query_tiles(const Mask& m, int key0, int keys, int& begin,
                                                 int& end) {
  const int q_begin = m.query_begin(key0), q_end = m.query_end(key0 + keys - 1);
  begin = q_begin / kBlockM;
  end = q_end <= q_begin ? begin : (q_end + kBlockM - 1) / kBlockM;
}

// Whether every row of [row0, row0 + rows) sees every key of [key0, key0 + keys):
// then the tile needs no element mask.
__device__ __forceinline__ bool mask_tile_full(const Mask& m, int row0, int rows, int key0,
                                               int keys) {
  return m.key_begin(row0 + rows - 1) <= key0 && key0 + keys <= m.key_end(row0);
}

}  // namespace cuda
}  // namespace flash_attn_ext
