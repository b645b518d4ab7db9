// FlashAttention on the CPU: exact attention without ever materialising the
// [seqlen_q, seqlen_k] matrix.
//
// Forward (per task = one batch, head and block of kBlockM query rows):
//   load Q_i once; for each visible key tile j (csrc/mask.h: causal, window and
//   key padding bound the keys a row sees; tiles no row sees are skipped):
//     S = f(scale * Q_i K_j^T)                  (BLAS tile GEMM, fp32; f: softcap, ALiBi)
//     m_new = max(m, rowmax(S)); P = exp(S - m_new); l = l*exp(m - m_new) + rowsum(P)
//     O = O*exp(m - m_new) + P V_j              (BLAS tile GEMM)
//   O /= l; lse = m + log(l)
// Backward (recomputation from lse, D = rowsum(dO * O)); every output block
// has exactly one writer (no atomics, deterministic):
//   dV_j = sum_i P_ij^T dO_i, dK_j = scale * sum_i dS_ij^T Q_i, dQ_i = scale * sum_j dS_ij K_j
//   with P_ij = exp(S_ij - lse_i) and dS_ij = P_ij * (dO_i V_j^T - D_i) * f'(.)
//   (f' = 1 - tanh^2 with softcap, else 1).
// One pass where there are enough (batch, kv head) tasks for the threads: a
// task walks its key tiles and adds dQ into its own fp32 buffer. Else two
// passes: task = (batch, kv head, key tile j) for dK_j, dV_j, then task =
// (batch, head, query tile i) for dQ_i, recomputing P and dP.
// Memory beyond inputs/outputs: O(batch*heads*seqlen_q) for lse/D, a few tiles
// per thread, and in one pass a dQ buffer per thread (<= 16 MB).
//
// Tiles are fp32: 16-bit inputs are widened on load (so all arithmetic is
// fp32), fp32 inputs are used in place through their row stride.
//
// Head dims: D (params.head_dim) is q's and k's, Dv (value_head_dim) is v's,
// out's, dout's and dv's (DeepSeek MLA: 192 / 128). Scores, dK and dQ have D
// columns; O, dP = dO V^T's reduction and dV have Dv.
#include "attention_cpu.h"

#include "../dropout.h"
#include "../mask.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace flash_attn_ext {
namespace cpu {
namespace {

constexpr int kBlockM = 64;   // query rows per task / tile
constexpr int kBlockN = 256;  // keys per tile; 32..128 x 256..512 measured within noise (2 cores, D=64)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.69314718055994531f;

// ---- BLAS ------------------------------------------------------------------
// torch ships a BLAS (MKL on x86-64, OpenBLAS elsewhere) inside libtorch_cpu
// and exports its Fortran entry point sgemm_, but not a C++ wrapper we may
// link against across torch versions. So look sgemm_ up at run time, and fall
// back to plain loops (correct, slow) if some build of torch lacks it.
using SgemmFn = void (*)(const char* transa, const char* transb, const int* m, const int* n,
                         const int* k, const float* alpha, const float* a, const int* lda,
                         const float* b, const int* ldb, const float* beta, float* c,
                         const int* ldc);

SgemmFn find_sgemm() {
  static const SgemmFn fn = [] {
    void* torch_cpu = dlopen("libtorch_cpu.so", RTLD_NOW | RTLD_NOLOAD);
    void* sym = dlsym(torch_cpu != nullptr ? torch_cpu : RTLD_DEFAULT, "sgemm_");
    return reinterpret_cast<SgemmFn>(sym);
  }();
  return fn;
}

// Column-major C[m,n] = alpha * op(A)[m,k] * op(B)[k,n] + beta * C (BLAS semantics).
void sgemm_colmajor(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a,
                    int lda, const float* b, int ldb, float beta, float* c, int ldc) {
  if (const SgemmFn fn = find_sgemm()) {
    const char ta = trans_a ? 'T' : 'N', tb = trans_b ? 'T' : 'N';
    fn(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
    return;
  }
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < m; ++i) {
      float sum = 0.f;
      for (int p = 0; p < k; ++p) {
        const float av = trans_a ? a[p + static_cast<int64_t>(i) * lda] : a[i + static_cast<int64_t>(p) * lda];
        const float bv = trans_b ? b[j + static_cast<int64_t>(p) * ldb] : b[p + static_cast<int64_t>(j) * ldb];
        sum += av * bv;
      }
      float& out = c[i + static_cast<int64_t>(j) * ldc];
      out = alpha * sum + (beta == 0.f ? 0.f : beta * out);
    }
  }
}

// ---- row-major tile GEMMs ----------------------------------------------------
// A row-major [M, N] matrix with leading dimension ld is the column-major
// [N, M] matrix with the same ld, so C = op(A) op(B) becomes C^T = op(B)^T op(A)^T.

// C[M,N] = alpha * A[M,K] * B[N,K]^T + beta * C
void gemm_nt(int M, int N, int K, float alpha, const float* A, int64_t lda, const float* B,
             int64_t ldb, float beta, float* C, int64_t ldc) {
  sgemm_colmajor(true, false, N, M, K, alpha, B, ldb, A, lda, beta, C, ldc);
}
// C[M,N] = alpha * A[M,K] * B[K,N] + beta * C
void gemm_nn(int M, int N, int K, float alpha, const float* A, int64_t lda, const float* B,
             int64_t ldb, float beta, float* C, int64_t ldc) {
  sgemm_colmajor(false, false, N, M, K, alpha, B, ldb, A, lda, beta, C, ldc);
}
// C[M,N] = alpha * A[K,M]^T * B[K,N] + beta * C
void gemm_tn(int M, int N, int K, float alpha, const float* A, int64_t lda, const float* B,
             int64_t ldb, float beta, float* C, int64_t ldc) {
  sgemm_colmajor(false, true, N, M, K, alpha, B, ldb, A, lda, beta, C, ldc);
}

// ---- exp, vectorisable ------------------------------------------------------
// std::exp does not vectorise, and the softmax evaluates one exp per score:
// at head_dim 64 that is as much time as the GEMMs. This is exp(x) =
// 2^n * 2^f with n = round(x*log2 e), |f| <= 1/2 and a degree-7 polynomial for
// 2^f (relative error ~2e-8, under fp32 rounding). Inputs below -87 give ~1e-38.
// target_clones compiles AVX-512, AVX2 and baseline versions, picked at load time.
// exp_shifted_sum computes x[i] = exp(x[i] - shift) and returns their sum (the
// softmax needs both). Written so GCC vectorises it: no branches (the clamp is
// a select), no cross-iteration dependence (the sum has 16 independent lanes,
// an in-order float reduction would serialise on the add latency).
__attribute__((target_clones("avx512f", "avx2", "default")))
float exp_shifted_sum(float* x, int n, float shift) {
  constexpr int kLanes = 16;
  float lane_sum[kLanes] = {};
  for (int i = 0; i < n; ++i) {
    float t = (x[i] - shift) * 1.44269504088896341f;  // log2(e)
    t = t < -126.f ? -126.f : t;                       // 2^-126: smallest normal
    const float rounded = (t + 12582912.f) - 12582912.f;  // round to nearest
    const float f = t - rounded;
    // Taylor coefficients of 2^f = e^(f ln2): (ln 2)^k / k!
    float p = 1.5252733804059840e-5f;
    p = p * f + 1.5403530393381609e-4f;
    p = p * f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    p = p * f + 1.0f;
    const int32_t bits = (static_cast<int32_t>(rounded) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    x[i] = p * scale;
  }
  for (int i = 0; i < n; ++i) lane_sum[i % kLanes] += x[i];
  float sum = 0.f;
  for (float s : lane_sum) sum += s;
  return sum;
}

// The row's maximum, over 16 independent lanes in whole groups of 16 (a fixed
// inner loop that GCC turns into vector max instructions; indexing the lanes
// by i % 16 in one loop did not vectorise and cost as much as the exp).
__attribute__((target_clones("avx512f", "avx2", "default")))
float row_max_of(const float* x, int n) {
  constexpr int kLanes = 16;
  float lane_max[kLanes];
  std::fill(lane_max, lane_max + kLanes, -std::numeric_limits<float>::infinity());
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lane_max[l] = x[i + l] > lane_max[l] ? x[i + l] : lane_max[l];
  }
  for (; i < n; ++i) lane_max[0] = x[i] > lane_max[0] ? x[i] : lane_max[0];
  return *std::max_element(lane_max, lane_max + kLanes);
}

// ---- loading tiles ---------------------------------------------------------
template <typename T>
float to_float(T v) {
  return static_cast<float>(v);
}

// e4m3 -> float through a table of the 256 codes (c10's conversion is bit
// arithmetic per element: ~10x the time of the rest of an FP8 cache's tile load).
const std::array<float, 256> kE4M3Table = [] {
  std::array<float, 256> t{};
  for (int c = 0; c < 256; ++c) {
    t[c] = static_cast<float>(
        c10::Float8_e4m3fn(static_cast<uint8_t>(c), c10::Float8_e4m3fn::from_bits()));
  }
  return t;
}();
template <>
float to_float(c10::Float8_e4m3fn v) {
  return kE4M3Table[v.x];
}

// A [rows, cols] fp32 view of a block of a [B,S,H,D] tensor: in place for fp32
// inputs, widened into `buffer` for 16-bit ones.
struct Tile {
  const float* data;
  int64_t ld;
};

template <typename T>
Tile load_tile(const T* base, int64_t row_stride, int rows, int cols, std::vector<float>& buffer) {
  if constexpr (std::is_same_v<T, float>) {
    // In place, unless the rows overlap (e.g. an expanded tensor with row
    // stride 0), which BLAS rejects as a leading dimension.
    if (row_stride >= cols) return Tile{base, row_stride};
  }
  {
    buffer.resize(static_cast<size_t>(rows) * cols);
    for (int r = 0; r < rows; ++r) {
      const T* src = base + r * row_stride;
      float* dst = buffer.data() + static_cast<size_t>(r) * cols;
      for (int c = 0; c < cols; ++c) dst[c] = to_float(src[c]);
    }
    return Tile{buffer.data(), cols};
  }
}

// Key rows [row0, row0 + rows) of batch entry b, kv head kh of K or V (row0:
// SeqBounds::row0_k + first key). Through the KV cache addressing (kv_row,
// params.h: block table or cache_batch_idx) row by row into `buffer`, else as
// load_tile.
template <typename T>
Tile load_kv_tile(const AttentionFwdParams& p, const void* base, const TensorStrides& st, int b,
                  int kh, int64_t row0, int rows, int cols, std::vector<float>& buffer) {
  if (!has_kv_indirection(p)) {
    return load_tile(static_cast<const T*>(base) + row_offset(st, b, kh, row0), st.row, rows, cols,
                     buffer);
  }
  buffer.resize(static_cast<size_t>(rows) * cols);
  for (int r = 0; r < rows; ++r) {
    const T* src = static_cast<const T*>(base) + kv_row_offset(p, st, b, kh, row0 + r);
    float* dst = buffer.data() + static_cast<size_t>(r) * cols;
    for (int c = 0; c < cols; ++c) dst[c] = to_float(src[c]);
  }
  return Tile{buffer.data(), cols};
}

template <typename T>
void store_rows(T* base, int64_t row_stride, const float* src, int rows, int cols, float scale) {
  for (int r = 0; r < rows; ++r) {
    T* dst = base + r * row_stride;
    const float* s = src + static_cast<size_t>(r) * cols;
    for (int c = 0; c < cols; ++c) dst[c] = static_cast<T>(s[c] * scale);
  }
}

template <typename T>
const T* at_row(const void* base, const TensorStrides& st, int b, int h, int64_t row) {
  return static_cast<const T*>(base) + row_offset(st, b, h, row);
}
template <typename T>
T* at_row(void* base, const TensorStrides& st, int b, int h, int64_t row) {
  return static_cast<T*>(base) + row_offset(st, b, h, row);
}

// v's head dim (params.h head_dim_v). A caller that leaves it unset (<= 0)
// means q's, so such params keep working.
int value_head_dim(const AttentionFwdParams& p) {
  return p.head_dim_v > 0 ? p.head_dim_v : p.head_dim;
}

// ---- masking and score modifiers ---------------------------------------------
// Rows and keys below are numbered within one sequence (SeqBounds, params.h:
// varlen offsets, seqused_k and the causal alignment are all in there); Mask
// (csrc/mask.h) says which keys a row sees and modifies the scores (softcap,
// ALiBi). A row's visible keys are one contiguous range, so a tile row is
// split into [0, lo) masked, [lo, hi) visible, [hi, cols) masked.
struct RowRange {
  int lo, hi;  // visible columns of the tile row; lo >= hi: none
};

RowRange visible_cols(const Mask& mask, int i, int n0, int cols) {
  return {std::clamp(mask.key_begin(i) - n0, 0, cols), std::clamp(mask.key_end(i) - n0, 0, cols)};
}

// Applies the score modifier to the visible columns [lo, hi) of row i of a
// tile starting at key n0; with dfds, stores the derivative factor there too.
void modify_scores(const Mask& mask, float* row, int i, int n0, RowRange r, float* dfds) {
  if (!mask.has_score_mod()) return;
  for (int c = r.lo; c < r.hi; ++c) {
    row[c] = mask.score(row[c], i, n0 + c, dfds != nullptr ? dfds + c : nullptr);
  }
}

// Multiplies the [rows, cols] tile at (row m0, key n0) by the dropout factor:
// the scale where the element is kept, 0 where it is dropped (csrc/dropout.h),
// with one Philox call per call group (2 keys x 8 queries) that meets the tile.
void apply_dropout(const Dropout& d, float* tile, int m0, int rows, int n0, int cols) {
  if (!d.active()) return;
  for (int i32 = m0 & ~31; i32 < m0 + rows; i32 += 32) {
    for (int j16 = n0 & ~15; j16 < n0 + cols; j16 += 16) {
      for (int k = 0; k < 8; ++k) {
        for (int v = 0; v < 4; ++v) {
          const uint32_t bits = d.call_keep_bits(i32 + 2 * v, j16 + k);
          for (int b = 0; b < 16; ++b) {
            int i, j;
            dropout_byte_element(i32 + 2 * v, j16 + k, b, i, j);
            if (i < m0 || i >= m0 + rows || j < n0 || j >= n0 + cols) continue;
            float& x = tile[static_cast<size_t>(i - m0) * cols + (j - n0)];
            x = ((bits >> b) & 1u) ? x * d.scale : 0.f;
          }
        }
      }
    }
  }
}

// Key range [begin, end) that some row of query block [m0, m0+rows) sees
// (Mask's bounds are non-decreasing in the row); end <= begin: none.
RowRange keys_for_rows(const Mask& mask, int m0, int rows) {
  return {mask.key_begin(m0), mask.key_end(m0 + rows - 1)};
}
// Query rows [begin, end) that see some key of [n0, n0 + cols).
RowRange rows_for_keys(const Mask& mask, int n0, int cols) {
  return {mask.query_begin(n0), mask.query_end(n0 + cols - 1)};
}

// Computes P = exp(f(scale * Q K^T) - lse) for a [rows, cols] tile (masked -> 0),
// f being the score modifier; its derivative goes to dfds when softcapped.
// `scores` is overwritten. Used by both backward passes.
void recompute_probs(const AttentionFwdParams& p, const Mask& mask, const Tile& q, const Tile& k,
                     int m0, int rows, int n0, int cols, const float* lse, float* scores,
                     float* dfds) {
  gemm_nt(rows, cols, p.head_dim, p.softmax_scale, q.data, q.ld, k.data, k.ld, 0.f, scores, cols);
  for (int r = 0; r < rows; ++r) {
    float* row = scores + static_cast<size_t>(r) * cols;
    const RowRange vis = visible_cols(mask, m0 + r, n0, cols);
    if (lse[r] == kNegInf || vis.hi <= vis.lo) {  // no probability mass in this tile row
      std::fill(row, row + cols, 0.f);
      continue;
    }
    modify_scores(mask, row, m0 + r, n0, vis,
                  mask.has_softcap() ? dfds + static_cast<size_t>(r) * cols : nullptr);
    exp_shifted_sum(row + vis.lo, vis.hi - vis.lo, lse[r]);
    std::fill(row, row + vis.lo, 0.f);
    std::fill(row + vis.hi, row + cols, 0.f);
  }
}

// ---- forward ---------------------------------------------------------------
// TKV: the element type of K and V: T, or c10::Float8_e4m3fn for an FP8 KV
// cache (params.kv_dtype) under a 16-bit q, whose tiles are widened like
// 16-bit ones; its k_descale goes into the score GEMM's alpha and its
// v_descale into the output store (descale_at is 1 without them).
template <typename T, typename TKV = T>
void fwd_impl(const AttentionFwdParams& p) {
  const int D = p.head_dim;          // of Q and K: the score GEMM's reduction
  const int Dv = value_head_dim(p);  // of V and O: the accumulator's columns
  const int m_blocks = (p.seqlen_q + kBlockM - 1) / kBlockM;
  const int64_t tasks = static_cast<int64_t>(p.batch) * p.heads * m_blocks;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_buf, k_buf, v_buf;
    std::vector<float> scores(static_cast<size_t>(kBlockM) * kBlockN);
    std::vector<float> acc(static_cast<size_t>(kBlockM) * Dv);
    float row_max[kBlockM], row_sum[kBlockM];
    for (int64_t task = begin; task < end; ++task) {
      const int m_block = static_cast<int>(task % m_blocks);
      const int h = static_cast<int>((task / m_blocks) % p.heads);
      const int b = static_cast<int>(task / (static_cast<int64_t>(m_blocks) * p.heads));
      const SeqBounds s = seq_bounds<true, /*kKVCache=*/true>(p, b);
      const int m0 = m_block * kBlockM;
      if (m0 >= s.seqlen_q) continue;  // varlen: past this sequence's end
      const int rows = std::min(kBlockM, s.seqlen_q - m0);
      const int kh = h / (p.heads / p.heads_k);
      const int64_t q_row = s.row0_q + m0;  // first row in the (packed) tensor

      const Tile q = load_tile(at_row<T>(p.q, p.q_strides, b, h, q_row), p.q_strides.row, rows, D, q_buf);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(row_max, row_max + rows, kNegInf);
      std::fill(row_sum, row_sum + rows, 0.f);

      const Mask mask = make_mask(p, s, b, h);
      const Dropout dropout = make_dropout(p, b, h);
      const RowRange keys = keys_for_rows(mask, m0, rows);
      const float score_scale = p.softmax_scale * descale_at(p.k_descale, b, kh);
      for (int n0 = keys.lo; n0 < keys.hi; n0 += kBlockN) {
        const int cols = std::min(kBlockN, keys.hi - n0);
        const int64_t k_row = s.row0_k + n0;
        const Tile k = load_kv_tile<TKV>(p, p.k, p.k_strides, b, kh, k_row, cols, D, k_buf);
        const Tile v = load_kv_tile<TKV>(p, p.v, p.v_strides, b, kh, k_row, cols, Dv, v_buf);
        gemm_nt(rows, cols, D, score_scale, q.data, q.ld, k.data, k.ld, 0.f, scores.data(), cols);
        for (int r = 0; r < rows; ++r) {
          float* sc = scores.data() + static_cast<size_t>(r) * cols;
          const RowRange vis = visible_cols(mask, m0 + r, n0, cols);
          if (vis.hi <= vis.lo) {  // this tile is entirely masked for this row
            std::fill(sc, sc + cols, 0.f);
            continue;
          }
          modify_scores(mask, sc, m0 + r, n0, vis, nullptr);
          const int n = vis.hi - vis.lo;
          const float new_max = std::max(row_max[r], row_max_of(sc + vis.lo, n));
          if (new_max == kNegInf) {  // every score so far is -inf (an attn_mask): no mass yet
            std::fill(sc, sc + cols, 0.f);
            continue;
          }
          const float correction = row_max[r] == kNegInf ? 0.f : std::exp(row_max[r] - new_max);
          const float tile_sum = exp_shifted_sum(sc + vis.lo, n, new_max);
          std::fill(sc, sc + vis.lo, 0.f);
          std::fill(sc + vis.hi, sc + cols, 0.f);
          row_sum[r] = row_sum[r] * correction + tile_sum;
          row_max[r] = new_max;
          float* o = acc.data() + static_cast<size_t>(r) * Dv;
          for (int d = 0; d < Dv; ++d) o[d] *= correction;
        }
        apply_dropout(dropout, scores.data(), m0, rows, n0, cols);  // after the row sums
        gemm_nn(rows, Dv, cols, 1.f, scores.data(), cols, v.data, v.ld, 1.f, acc.data(), Dv);
      }

      float* lse = p.lse + s.lse_index(p, b, h, m0);
      const float sink_log2 = sink_log2_of(p, h);
      for (int r = 0; r < rows; ++r) {
        float* o = acc.data() + static_cast<size_t>(r) * Dv;
        float sum = row_sum[r], o_factor = 1.f, lse_max = row_max[r];
        if (sink_log2 != kNegInf) {  // (row_max is natural-log here, the fold's max log2)
          float max_log2 = row_max[r] * kLog2e;
          o_factor = fold_sink_into_row(sink_log2, max_log2, sum);
          lse_max = max_log2 * kLn2;
        }
        if (sum == 0.f) {  // no visible key (and no sink): zeros and lse = -inf, never NaN
          std::fill(o, o + Dv, 0.f);
          lse[r] = kNegInf;
        } else {
          const float inv = o_factor / sum;
          for (int d = 0; d < Dv; ++d) o[d] *= inv;
          lse[r] = lse_max + std::log(sum);
        }
      }
      store_rows(at_row<T>(p.out, p.out_strides, b, h, q_row), p.out_strides.row, acc.data(), rows,
                 Dv, descale_at(p.v_descale, b, kh));
    }
  });
}

// ---- backward --------------------------------------------------------------
template <typename T>
void bwd_impl(const AttentionBwdParams& p) {
  const int D = p.head_dim;          // of Q, K, dQ and dK
  const int Dv = value_head_dim(p);  // of V, O, dO and dV
  const int m_blocks = (p.seqlen_q + kBlockM - 1) / kBlockM;
  const int n_blocks = (p.seqlen_k + kBlockN - 1) / kBlockN;
  const int kv_group = p.heads / p.heads_k;
  // lse / D of row 0 of sequence b, head h.
  auto lse_row = [&](const SeqBounds& s, int b, int h) { return p.lse + s.lse_index(p, b, h, 0); };
  auto dsum_row = [&](const SeqBounds& s, int b, int h) {
    return p.dsoftmax_sum + s.lse_index(p, b, h, 0);
  };

  // D_i = rowsum(dO_i * O_i) over the Dv columns of O, in fp32.
  at::parallel_for(0, static_cast<int64_t>(p.batch) * p.heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int b = static_cast<int>(bh / p.heads), h = static_cast<int>(bh % p.heads);
      const SeqBounds s = seq_bounds(p, b);
      float* dsum = dsum_row(s, b, h);
      for (int i = 0; i < s.seqlen_q; ++i) {
        const T* o = at_row<T>(p.out, p.out_strides, b, h, s.row0_q + i);
        const T* dout = at_row<T>(p.dout, p.dout_strides, b, h, s.row0_q + i);
        float s = 0.f;
        for (int d = 0; d < Dv; ++d) s += to_float(o[d]) * to_float(dout[d]);
        dsum[i] = s;
      }
    }
  });

  // dS = P * (dP - D_i) (times df/ds of the softcap, when given), in place over dP.
  auto softmax_grad = [](float* dp, const float* probs, const float* dsum, int rows, int cols,
                         const float* dfds) {
    for (int r = 0; r < rows; ++r) {
      float* g = dp + static_cast<size_t>(r) * cols;
      const float* pr = probs + static_cast<size_t>(r) * cols;
      for (int c = 0; c < cols; ++c) g[c] = pr[c] * (g[c] - dsum[r]);
      if (dfds == nullptr) continue;
      const float* f = dfds + static_cast<size_t>(r) * cols;
      for (int c = 0; c < cols; ++c) g[c] *= f[c];
    }
  };

  // Per-thread tiles of one (query tile, key tile) pair.
  struct Scratch {
    std::vector<float> q_buf, k_buf, v_buf, do_buf;
    std::vector<float> probs, dprobs, dfds, dropped;  // dropped: P times the dropout factor
    explicit Scratch(const AttentionBwdParams& p)
        : probs(static_cast<size_t>(kBlockM) * kBlockN), dprobs(probs.size()),
          dfds(p.softcap > 0.f ? probs.size() : 0), dropped(has_dropout(p) ? probs.size() : 0) {}
  };
  // Query rows [m0, m0 + rows) of head h: the Q tile (D columns) or the dO
  // tile (Dv columns) (load_tile).
  auto query_rows = [&](const void* base, const TensorStrides& st, const SeqBounds& s, int b,
                        int h, int m0, int rows, int cols, std::vector<float>& buffer) {
    return load_tile(at_row<T>(base, st, b, h, s.row0_q + m0), st.row, rows, cols, buffer);
  };
  // The gradients of query rows [m0, m0 + rows) of head h (tiles q, dout)
  // against keys [n0, n0 + cols): dV += (P o Z)^T dO into the [cols, Dv] and
  // dK += scale dS^T Q into the [cols, D] accumulator (when given), dQ +=
  // scale dS K into the [rows, D] one at dq_acc (when given).
  auto tile_grads = [&](Scratch& t, const SeqBounds& s, int b, int h, const Mask& mask,
                        const Dropout& dropout, const Tile& q, const Tile& dout, const Tile& k,
                        const Tile& v, int m0, int rows, int n0, int cols, float* dk_acc,
                        float* dv_acc, float* dq_acc) {
    recompute_probs(p, mask, q, k, m0, rows, n0, cols, lse_row(s, b, h) + m0, t.probs.data(),
                    t.dfds.data());
    if (dv_acc != nullptr) {
      const float* pv = t.probs.data();  // dV = (P * dropout factor)^T dO
      if (dropout.active()) {
        std::copy(t.probs.begin(), t.probs.end(), t.dropped.begin());
        apply_dropout(dropout, t.dropped.data(), m0, rows, n0, cols);
        pv = t.dropped.data();
      }
      gemm_tn(cols, Dv, rows, 1.f, pv, cols, dout.data, dout.ld, 1.f, dv_acc, Dv);
    }
    gemm_nt(rows, cols, Dv, 1.f, dout.data, dout.ld, v.data, v.ld, 0.f, t.dprobs.data(), cols);
    apply_dropout(dropout, t.dprobs.data(), m0, rows, n0, cols);
    softmax_grad(t.dprobs.data(), t.probs.data(), dsum_row(s, b, h) + m0, rows, cols,
                 mask.has_softcap() ? t.dfds.data() : nullptr);
    if (dk_acc != nullptr) {
      gemm_tn(cols, D, rows, p.softmax_scale, t.dprobs.data(), cols, q.data, q.ld, 1.f, dk_acc, D);
    }
    if (dq_acc != nullptr) {
      gemm_nn(rows, D, cols, p.softmax_scale, t.dprobs.data(), cols, k.data, k.ld, 1.f, dq_acc, D);
    }
  };
  // dK, dV of key tile n_block of kv head kh, summed over the query heads of
  // its group; with dq_ws ([kv_group][seqlen_q][D], fp32) the dQ terms too.
  auto key_tile_grads = [&](Scratch& t, std::vector<float>& dk_acc, std::vector<float>& dv_acc,
                            const SeqBounds& s, int b, int kh, int n_block, float* dq_ws) {
    const int n0 = n_block * kBlockN;
    const int cols = std::min(kBlockN, s.seqlen_k - n0);
    const int64_t k_row = s.row0_k + n0;
    const Tile k = load_tile(at_row<T>(p.k, p.k_strides, b, kh, k_row), p.k_strides.row, cols, D,
                             t.k_buf);
    const Tile v = load_tile(at_row<T>(p.v, p.v_strides, b, kh, k_row), p.v_strides.row, cols,
                             Dv, t.v_buf);
    std::fill(dk_acc.begin(), dk_acc.end(), 0.f);
    std::fill(dv_acc.begin(), dv_acc.end(), 0.f);
    for (int h = kh * kv_group; h < (kh + 1) * kv_group; ++h) {
      const Mask mask = make_mask(p, s, b, h);
      const Dropout dropout = make_dropout(p, b, h);
      const RowRange queries = rows_for_keys(mask, n0, cols);
      for (int m0 = queries.lo; m0 < queries.hi; m0 += kBlockM) {
        const int rows = std::min(kBlockM, queries.hi - m0);
        const Tile q = query_rows(p.q, p.q_strides, s, b, h, m0, rows, D, t.q_buf);
        const Tile dout = query_rows(p.dout, p.dout_strides, s, b, h, m0, rows, Dv, t.do_buf);
        float* dq = dq_ws == nullptr ? nullptr
                                     : dq_ws + (static_cast<size_t>(h - kh * kv_group) *
                                                    s.seqlen_q + m0) * D;
        tile_grads(t, s, b, h, mask, dropout, q, dout, k, v, m0, rows, n0, cols, dk_acc.data(),
                   dv_acc.data(), dq);
      }
    }
    store_rows(at_row<T>(p.dk, p.dk_strides, b, kh, k_row), p.dk_strides.row, dk_acc.data(), cols,
               D, 1.f);
    store_rows(at_row<T>(p.dv, p.dv_strides, b, kh, k_row), p.dv_strides.row, dv_acc.data(), cols,
               Dv, 1.f);
  };

  // One pass when there are enough (batch, kv head) tasks for the threads and
  // their dQ fits a modest buffer: a task walks its key tiles and adds the dQ
  // terms to its own fp32 buffer (5 GEMMs per tile pair). Otherwise two
  // passes, each output tile with one writer: dK / dV per key tile (pass 1),
  // dQ per query tile (pass 2), which recomputes P and dP (7 GEMMs). Both are
  // deterministic; one pass measured 0.7x the two passes' time (2 cores, D=64).
  const int64_t bh_tasks = static_cast<int64_t>(p.batch) * p.heads_k;
  const int64_t threads = at::get_num_threads();
  const int64_t dq_ws_floats = static_cast<int64_t>(kv_group) * p.seqlen_q * D;
  const bool one_pass = dq_ws_floats <= (int64_t{1} << 22) &&
                        (bh_tasks >= 4 * threads || (bh_tasks >= threads && bh_tasks % threads == 0));
  if (one_pass) {
    at::parallel_for(0, bh_tasks, 1, [&](int64_t begin, int64_t end) {
      Scratch t(p);
      std::vector<float> dk_acc(static_cast<size_t>(kBlockN) * D);
      std::vector<float> dv_acc(static_cast<size_t>(kBlockN) * Dv);
      std::vector<float> dq_ws;
      for (int64_t task = begin; task < end; ++task) {
        const int kh = static_cast<int>(task % p.heads_k);
        const int b = static_cast<int>(task / p.heads_k);
        const SeqBounds s = seq_bounds(p, b);
        dq_ws.assign(static_cast<size_t>(kv_group) * s.seqlen_q * D, 0.f);
        for (int n_block = 0; n_block * kBlockN < s.seqlen_k; ++n_block) {
          key_tile_grads(t, dk_acc, dv_acc, s, b, kh, n_block, dq_ws.data());
        }
        for (int g = 0; g < kv_group; ++g) {
          const int h = kh * kv_group + g;
          store_rows(at_row<T>(p.dq, p.dq_strides, b, h, s.row0_q), p.dq_strides.row,
                     dq_ws.data() + static_cast<size_t>(g) * s.seqlen_q * D, s.seqlen_q, D, 1.f);
        }
      }
    });
    return;
  }

  // Pass 1: dK, dV per key tile, summed over the query heads of the kv head's group.
  const int64_t kv_tasks = bh_tasks * n_blocks;
  at::parallel_for(0, kv_tasks, 1, [&](int64_t begin, int64_t end) {
    Scratch t(p);
    std::vector<float> dk_acc(static_cast<size_t>(kBlockN) * D);
    std::vector<float> dv_acc(static_cast<size_t>(kBlockN) * Dv);
    for (int64_t task = begin; task < end; ++task) {
      const int n_block = static_cast<int>(task % n_blocks);
      const int kh = static_cast<int>((task / n_blocks) % p.heads_k);
      const int b = static_cast<int>(task / (static_cast<int64_t>(n_blocks) * p.heads_k));
      const SeqBounds s = seq_bounds(p, b);
      // Past this sequence's (used) keys: dK = dV = 0.
      if (n_block * kBlockN < s.seqlen_k) key_tile_grads(t, dk_acc, dv_acc, s, b, kh, n_block, nullptr);
    }
  });

  // Pass 2: dQ per query tile.
  const int64_t q_tasks = static_cast<int64_t>(p.batch) * p.heads * m_blocks;
  at::parallel_for(0, q_tasks, 1, [&](int64_t begin, int64_t end) {
    Scratch t(p);
    std::vector<float> dq_acc(static_cast<size_t>(kBlockM) * D);
    for (int64_t task = begin; task < end; ++task) {
      const int m_block = static_cast<int>(task % m_blocks);
      const int h = static_cast<int>((task / m_blocks) % p.heads);
      const int b = static_cast<int>(task / (static_cast<int64_t>(m_blocks) * p.heads));
      const int kh = h / kv_group;
      const SeqBounds s = seq_bounds(p, b);
      const int m0 = m_block * kBlockM;
      if (m0 >= s.seqlen_q) continue;
      const int rows = std::min(kBlockM, s.seqlen_q - m0);
      const Tile q = query_rows(p.q, p.q_strides, s, b, h, m0, rows, D, t.q_buf);
      const Tile dout = query_rows(p.dout, p.dout_strides, s, b, h, m0, rows, Dv, t.do_buf);
      std::fill(dq_acc.begin(), dq_acc.end(), 0.f);
      const Mask mask = make_mask(p, s, b, h);
      const Dropout dropout = make_dropout(p, b, h);
      const RowRange keys = keys_for_rows(mask, m0, rows);
      for (int n0 = keys.lo; n0 < keys.hi; n0 += kBlockN) {
        const int cols = std::min(kBlockN, keys.hi - n0);
        const int64_t k_row = s.row0_k + n0;
        const Tile k = load_tile(at_row<T>(p.k, p.k_strides, b, kh, k_row), p.k_strides.row, cols,
                                 D, t.k_buf);
        const Tile v = load_tile(at_row<T>(p.v, p.v_strides, b, kh, k_row), p.v_strides.row, cols,
                                 Dv, t.v_buf);
        tile_grads(t, s, b, h, mask, dropout, q, dout, k, v, m0, rows, n0, cols, nullptr, nullptr,
                   dq_acc.data());
      }
      store_rows(at_row<T>(p.dq, p.dq_strides, b, h, s.row0_q + m0), p.dq_strides.row,
                 dq_acc.data(), rows, D, 1.f);
    }
  });
}

template <template <typename> class Fn, typename Params>
void dispatch_dtype(const Params& p) {
  switch (p.dtype) {
    case DType::kFloat32: Fn<float>::run(p); break;
    case DType::kFloat16: Fn<c10::Half>::run(p); break;
    case DType::kBFloat16: Fn<c10::BFloat16>::run(p); break;
  }
}
template <typename T>
struct FwdRunner {
  static void run(const AttentionFwdParams& p) { fwd_impl<T>(p); }
};
template <typename T>
struct BwdRunner {
  static void run(const AttentionBwdParams& p) { bwd_impl<T>(p); }
};
// An FP8 KV cache (kv_dtype; ops_params.h admits it under a 16-bit q only).
template <typename T>
struct FwdFp8KVRunner {
  static void run(const AttentionFwdParams& p) {
    if constexpr (std::is_same_v<T, float>) {
      TORCH_CHECK(false, "flash_attn_ext: internal error: an FP8 KV cache under a float32 q");
    } else {
      fwd_impl<T, c10::Float8_e4m3fn>(p);
    }
  }
};

}  // namespace

void run_fwd(const AttentionFwdParams& params) {
  if (params.kv_dtype == DType::kFloat8E4M3) {
    dispatch_dtype<FwdFp8KVRunner>(params);
  } else {
    dispatch_dtype<FwdRunner>(params);
  }
}
void run_bwd(const AttentionBwdParams& params) { dispatch_dtype<BwdRunner>(params); }

}  // namespace cpu
}  // namespace flash_attn_ext
