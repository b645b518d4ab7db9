// Thin, typed wrappers around the PTX instructions the sm_80+ kernels use.
// Everything here is a single instruction (or a handful); the kernels read as
// tile algorithms on top of these.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace flash_attn_ext {
namespace cuda {

#define FAE_DEVICE __device__ __forceinline__

// Shared-memory address as the 32-bit value PTX wants.
FAE_DEVICE uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// ---- cp.async: global -> shared, 16 bytes, bypassing registers ------------
// When `valid` is false the 16 bytes are zero-filled (src-size 0): this is how
// out-of-range rows / padded head-dim columns become zeros without branches
// around the barrier.
FAE_DEVICE void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem_dst)),
               "l"(gmem_src), "r"(src_bytes));
}
// A full 16-byte copy carrying an L2 cache policy (l2_policy_* below). No
// zero-fill (src-size) form: with src-size and a cache policy together,
// ptxas 13.0 emitted an illegal instruction for sm_90a.
FAE_DEVICE void cp_async_16_l2(void* smem_dst, const void* gmem_src, uint64_t l2_policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(
                   smem_u32(smem_dst)),
               "l"(gmem_src), "l"(l2_policy));
}
FAE_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPendingGroups>
FAE_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPendingGroups));
}

// ---- L2 cache policies (createpolicy, sm_80+) -----------------------------
// evict_first: lines this policy brings into L2 are the first to be replaced,
// for data read once (a decode call's K/V) that should not push anything else
// out of L2, dirty lines of earlier kernels included. Never 0 (0x12f0...0 on
// an H200). Volatile, so that it stays where it is called instead of being
// hoisted into a register that lives across a loop.
FAE_DEVICE uint64_t l2_policy_evict_first() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// ---- ldmatrix: four 8x8 b16 matrices from shared memory into a warp -------
// Thread t supplies the row address of row (t % 8) of matrix (t / 8).
FAE_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(smem_row)));
}
// The same from a shared-memory address (smem_u32).
FAE_DEVICE void ldmatrix_x4_at(uint32_t (&r)[4], uint32_t smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_row)
               : "memory");
}
FAE_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(smem_row)));
}
FAE_DEVICE void ldmatrix_x2(uint32_t (&r)[2], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_u32(smem_row)));
}
FAE_DEVICE void ldmatrix_x2_trans(uint32_t (&r)[2], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_u32(smem_row)));
}

// ---- mma.sync m16n8k16, 16-bit operands, fp32 accumulate (in place) -------
// Fragment layout (PTX ISA "mma.m16n8k16"): with lane = 4*group + quad,
//   A (16x16, row):  a[0]=(g, 2q..2q+1) a[1]=(g+8, 2q..) a[2]=(g, 2q+8..) a[3]=(g+8, 2q+8..)
//   B (16x8,  col):  b[0]=(k=2q..2q+1, n=g) b[1]=(k=2q+8.., n=g)
//   C (16x8):        c[0..1]=(g, 2q..2q+1) c[2..3]=(g+8, 2q..2q+1)
template <typename T>
FAE_DEVICE void mma_16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);

template <>
FAE_DEVICE void mma_16816<__half>(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
FAE_DEVICE void mma_16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ---- packing fp32 pairs into 16-bit pairs ---------------------------------
template <typename T>
FAE_DEVICE uint32_t pack2(float lo, float hi);
template <>
FAE_DEVICE uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
FAE_DEVICE uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <typename T>
FAE_DEVICE float2 unpack2(uint32_t v);
template <>
FAE_DEVICE float2 unpack2<__half>(uint32_t v) {
  return __half22float2(*reinterpret_cast<__half2*>(&v));
}
template <>
FAE_DEVICE float2 unpack2<__nv_bfloat16>(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
}

// ---- fast math ------------------------------------------------------------
FAE_DEVICE float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Butterfly reductions across the 4 lanes of a quad (the lanes that share an
// mma row): after the two shuffles every lane holds the quad's result.
FAE_DEVICE float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
  return x;
}
FAE_DEVICE float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  x += __shfl_xor_sync(0xffffffff, x, 2);
  return x;
}

// 4x4 transpose across the lanes of a quad: lane q's v[i] becomes lane i's
// v[q]. Two exchange rounds: lanes q ^ 2 swap the off-diagonal 2x2 blocks,
// then lanes q ^ 1 transpose inside the blocks (2 shuffles each; the selects
// keep every register index static).
FAE_DEVICE void quad_transpose(uint32_t (&v)[4], int quad_lane) {
  const bool upper = quad_lane & 2;
#pragma unroll
  for (int d = 0; d < 2; ++d) {
    const uint32_t got = __shfl_xor_sync(0xffffffff, upper ? v[d] : v[2 + d], 2);
    if (upper) v[d] = got; else v[2 + d] = got;
  }
  const bool odd = quad_lane & 1;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const uint32_t got = __shfl_xor_sync(0xffffffff, odd ? v[2 * c] : v[2 * c + 1], 1);
    if (odd) v[2 * c] = got; else v[2 * c + 1] = got;
  }
}

// One 16-byte store to global memory (ptr 16-byte aligned). Written as PTX
// because a uint4 store through a pointer was not always kept whole: NVVM
// split the first 16-byte group of store_accumulator_row into four 4-byte
// stores (the Hopper forward's O at D = 64: half of its stores; dK / dV),
// which write each 32-byte sector in pieces.
FAE_DEVICE void st_global_v4(void* ptr, const uint32_t (&v)[4]) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(__cvta_generic_to_global(ptr)),
               "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
               : "memory");
}

// One 8-byte store to global memory (ptr 8-byte aligned), as st_global_v4.
FAE_DEVICE void st_global_v2(void* ptr, uint32_t lo, uint32_t hi) {
  asm volatile("st.global.v2.b32 [%0], {%1, %2};\n" ::"l"(__cvta_generic_to_global(ptr)),
               "r"(lo), "r"(hi)
               : "memory");
}

// Stores row `half` (0: row lane / 4, 1: that row + 8) of an accumulator
// fragment acc[kCols / 8][4] in the mma / wgmma layout (a quad holds columns
// 8j + 2q + {0, 1} of the row, j = 0 .. kCols / 8 - 1), times `scale`, into
// row[col0 ...]. Per 4 j's a quad transpose gives each lane 8 consecutive
// columns, so a warp writes 8 rows x 64 bytes with 16-byte stores: whole
// 32-byte sectors, a quarter of the instructions of 4-byte stores (which
// write every sector in two halves). Columns >= col_end, and everything when
// !row_ok, are skipped; the accumulators are read either way (ptxas
// serialises wgmmas whose results are read under a branch).
template <typename T, int kCols>
FAE_DEVICE void store_accumulator_row(T* row, const float (&acc)[kCols / 8][4], int half,
                                      float scale, int col0, int col_end, bool row_ok, int lane) {
  static_assert(kCols % 32 == 0, "stored in groups of 4 x 8 columns");
#pragma unroll
  for (int c = 0; c < kCols / 32; ++c) {
    uint32_t cols[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      cols[i] = pack2<T>(acc[4 * c + i][2 * half] * scale, acc[4 * c + i][2 * half + 1] * scale);
    }
    quad_transpose(cols, lane % 4);
    const int col = col0 + 8 * (4 * c + lane % 4);
    if (row_ok && col < col_end) st_global_v4(row + col, cols);
  }
}

// ---- thread-block clusters (sm_90+) ----------------------------------------
// Used by the split-KV forward to merge its splits through distributed shared
// memory instead of a second kernel. The bodies exist only in sm_90 code; the
// host launches cluster kernels only on sm_90 devices running that code.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FAE_CLUSTER_PTX 1
#endif

// Every thread of every CTA in the cluster arrives and waits. release/acquire:
// shared-memory writes before the barrier are visible to the cluster's remote
// reads after it.
FAE_DEVICE void cluster_sync() {
#ifdef FAE_CLUSTER_PTX
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}

FAE_DEVICE int cluster_cta_rank() {
  uint32_t rank = 0;
#ifdef FAE_CLUSTER_PTX
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
#endif
  return static_cast<int>(rank);
}

// The shared::cluster address of `smem_ptr`'s twin in CTA `rank` of the cluster.
FAE_DEVICE uint32_t cluster_map_shared(const void* smem_ptr, int rank) {
  uint32_t remote = 0;
#ifdef FAE_CLUSTER_PTX
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
               : "=r"(remote) : "r"(smem_u32(smem_ptr)), "r"(rank));
#endif
  return remote;
}

FAE_DEVICE float ld_cluster_f32(uint32_t addr) {
  float v = 0.f;
#ifdef FAE_CLUSTER_PTX
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
#endif
  return v;
}

FAE_DEVICE float4 ld_cluster_f32x4(uint32_t addr) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#ifdef FAE_CLUSTER_PTX
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
#endif
  return v;
}

// ---- shared-memory swizzle ------------------------------------------------
// Tiles are stored as rows of kRowChunks 16-byte chunks (8 halves each).
// ldmatrix reads 8 rows at the same column chunk; without a swizzle those 8
// addresses are kRowChunks*16 bytes apart and (for rows of >= 128 bytes) all
// fall into the same 4 banks: an 8-way conflict. XOR-ing the chunk index with
// (row % 8) spreads the 8 rows over all 32 banks, for loads (ldmatrix) and for
// the cp.async stores alike. Needs kRowChunks to be a multiple of 8.
template <int kRowChunks>
FAE_DEVICE int swizzled_chunk(int row, int chunk) {
  static_assert(kRowChunks % 8 == 0, "XOR swizzle needs rows of at least 8 x 16 bytes");
  return chunk ^ (row & 7);
}

}  // namespace cuda
}  // namespace flash_attn_ext
