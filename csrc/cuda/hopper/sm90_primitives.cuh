// Hopper (sm_90a) building blocks: mbarriers, TMA (cp.async.bulk.tensor loads and
// reduce-adds),
// wgmma shared-memory descriptors and fences, named barriers, setmaxnreg.
// Each wrapper is one or two PTX instructions; the kernel (fwd_sm90_kernel.cuh)
// reads as a pipeline on top of them.
//
// Only compiled into device code for sm_90a (FAE_SM90_ENABLED); for other
// targets the kernels that use these are compiled with empty bodies.
#pragma once
#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include <cuda_fp8.h>

#include <cstdint>

#include "../common/ptx.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FAE_SM90_ENABLED 1
#endif

namespace flash_attn_ext {
namespace cuda {
namespace sm90 {

// ---- mbarrier: a 64-bit shared-memory barrier with a phase bit -------------
// Producers arrive (optionally announcing the bytes a TMA copy will deliver,
// expect_tx); waiters spin on the parity of the phase they need completed. A
// freshly initialised barrier counts as having completed the phase of parity
// 1, so a producer's first wait on an "empty" barrier (parity 1) passes.
FAE_DEVICE void mbar_init(uint32_t bar, int arrive_count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrive_count));
}
// Makes the initialised barriers visible to the async proxy (TMA) before use.
FAE_DEVICE void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
FAE_DEVICE void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
FAE_DEVICE void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
FAE_DEVICE bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
FAE_DEVICE void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

// ---- TMA: 4-D tiles (head_dim, seqlen, heads, batch) ------------------------
FAE_DEVICE void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// Global -> shared; completes `bytes` of the barrier's expected transaction
// count. Out-of-bounds elements (rows past seqlen, columns past head_dim) are
// written as zeros and still count.
FAE_DEVICE void tma_load_4d(uint32_t smem_dst, const CUtensorMap* map, uint32_t bar, int c0,
                            int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(smem_dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
// Global -> shared, `bytes` contiguous bytes (16-byte aligned, a multiple of
// 16), completing on `bar` like the tensor copies.
FAE_DEVICE void bulk_load(uint32_t smem_dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_dst),
      "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(bar)
      : "memory");
}
// One [rows x kChunkCols kChunks] tile: kChunks boxes of kChunkCols columns
// (64 16-bit or 128 e4m3 ones), each stored as [rows x 128 B] (the 128-byte
// swizzle atom width), all completing on `full`. `rows` is the shared-memory
// tile's height (the chunk stride); the map's box may hold fewer rows, which
// fills a row slice of the tile starting at smem_dst (a multiple of 8 rows
// keeps the swizzle pattern).
template <int kChunks, int kChunkCols = 64>
FAE_DEVICE void tma_load_tile(const CUtensorMap* map, uint32_t smem_dst, int rows, uint32_t full,
                              int row, int head, int batch) {
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    tma_load_4d(smem_dst + c * rows * 128, map, full, c * kChunkCols, row, head, batch);
  }
}
// Shared -> global element-wise add through TMA (fp32 tiles of the backward's
// dQ accumulator): the L2 adds whole lines, the issuing thread only hands over
// the tile. Out-of-bounds elements (rows past seqlen_q) are skipped. Completion
// is tracked per thread with bulk groups (commit / wait below).
FAE_DEVICE void tma_reduce_add_3d(const CUtensorMap* map, uint32_t smem_src, int c0, int c1, int c2) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group"
      " [%0, {%2, %3, %4}], [%1];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(smem_src), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
// Shared -> global element-wise fp32 add of `bytes` contiguous bytes (a
// multiple of 16, both addresses 16-byte aligned): a 1-D bulk reduce, tracked
// by the same bulk groups (the flat dQ accumulator, bwd_sm90.h).
FAE_DEVICE void bulk_reduce_add_f32(float* gmem_dst, uint32_t smem_src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(
                   __cvta_generic_to_global(gmem_dst)),
               "r"(smem_src), "r"(bytes)
               : "memory");
}
FAE_DEVICE void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// The shared-memory sources of all but the newest kPending groups were read
// (their buffers may be written again).
template <int kPending>
FAE_DEVICE void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// All but the newest kPending groups completed, global writes included.
template <int kPending>
FAE_DEVICE void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}
// ---- ordered hand-over between CTAs (the deterministic backward's dQ) --------
// Spins until *flag == value (acquire: what the CTA that set it wrote before
// its release is visible afterwards, to the async proxy included).
FAE_DEVICE void wait_flag_equal(const int* flag, int value) {
  int seen;
  while (true) {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(flag) : "memory");
    if (seen == value) break;
    __nanosleep(32);
  }
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
// *flag += 1 after everything this thread wrote, the async proxy's completed
// bulk copies included (wait for them first).
FAE_DEVICE void release_flag_increment(int* flag) {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(flag) : "memory");
}
// Generic-proxy writes to shared memory (st.shared) become visible to the
// async proxy (TMA store, wgmma) only after this fence in the writing thread.
FAE_DEVICE void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// The first 1024-byte-aligned address of dynamic shared memory (whose base is
// only 16-byte aligned; kernels reserve 1024 bytes more): 128-byte-swizzle
// atoms must be 1024-byte aligned.
FAE_DEVICE uint32_t smem_align_1024(const void* smem_raw) {
  return (smem_u32(smem_raw) + 1023u) & ~1023u;
}
// Shared memory by 32-bit address (the kernels keep tile addresses as
// integers, as the TMA and wgmma descriptors want them).
FAE_DEVICE void st_shared_b32(uint32_t addr, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(value) : "memory");
}
FAE_DEVICE uint32_t ld_shared_b32(uint32_t addr) {
  uint32_t value;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(value) : "r"(addr) : "memory");
  return value;
}
// Four 8x8 matrices of 16-bit elements per warp: lane l gives the 16-byte
// row (l % 8) of matrix l / 8; each lane's register i holds row lane / 4,
// columns 2 (lane % 4) + {0, 1} of matrix i (an m16n8k16 A fragment).
FAE_DEVICE void stmatrix_x4(uint32_t row_addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(row_addr),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}
// The transposed store: lane l gives the 16-byte row (l % 8) of stored
// matrix l / 8, which receives register i's matrix transposed: element
// (row lane / 4, column 2 (lane % 4) + e) lands in stored row 2 (lane % 4) + e,
// column lane / 4.
FAE_DEVICE void stmatrix_x4_trans(uint32_t row_addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                   row_addr),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}
// The transposed load: lane l gives the 16-byte row (l % 8) of matrix l / 8;
// its register i holds rows 2 (lane % 4) + {0, 1}, column lane / 4 of matrix i.
FAE_DEVICE void ldmatrix_x4_trans_at(uint32_t row_addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row_addr)
               : "memory");
}
FAE_DEVICE void ld_shared_v2_f32(uint32_t addr, float& x, float& y) {
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(x), "=f"(y) : "r"(addr) : "memory");
}
FAE_DEVICE void st_shared_v2_f32(uint32_t addr, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x), "f"(y) : "memory");
}
FAE_DEVICE void st_shared_v4_f32(uint32_t addr, float x, float y, float z, float w) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(x), "f"(y), "f"(z),
               "f"(w)
               : "memory");
}
// Zeroes rows [row_begin, tile_rows) of a tile stored as kChunks chunks of
// [tile_rows x 128 bytes] with the 128-byte swizzle (whole rows: the swizzle
// only permutes a row's 16-byte units), 16 bytes per store, the stores spread
// over `threads` threads of which this is `thread`. The caller fences
// (fence_proxy_async_smem) and syncs before a wgmma / TMA reads the tile.
template <int kChunks>
FAE_DEVICE void zero_swizzled_tile_rows(uint32_t tile, int tile_rows, int row_begin, int thread,
                                        int threads) {
  const int units_per_chunk = (tile_rows - row_begin) * 8;  // 16-byte units
  for (int u = thread; u < kChunks * units_per_chunk; u += threads) {
    const int chunk = u / units_per_chunk, row = row_begin + (u % units_per_chunk) / 8;
    st_shared_v4_f32(tile + chunk * tile_rows * 128 + row * 128 + (u % 8) * 16, 0.f, 0.f, 0.f,
                     0.f);
  }
}
FAE_DEVICE void ld_shared_v4_f32(uint32_t addr, float& x, float& y, float& z, float& w) {
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(x), "=f"(y), "=f"(z), "=f"(w)
               : "r"(addr)
               : "memory");
}

// ---- wgmma ------------------------------------------------------------------
// Shared-memory matrix descriptor for a tile stored in 128-byte-swizzled
// atoms (8 rows x 128 bytes = 1024 bytes, the layout TMA's SWIZZLE_128B
// writes). The swizzle is applied to absolute address bits, so atoms must be
// 1024-byte aligned.
//   K-major operand (Q, K):  SBO = 1024 (next 8 rows); LBO unused. The k-th
//     16-element step inside a 64-column chunk starts 32 bytes further.
//   MN-major operand (V):    SBO = 1024 (next 8 rows along K), LBO = bytes
//     between 64-column chunks along N. The k-th step starts 2048 bytes
//     (16 rows) further.
FAE_DEVICE uint64_t smem_desc_sw128(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((lbo_bytes & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((sbo_bytes & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}
// A K-major operand in 32-byte swizzle atoms (8 rows x 32 bytes, one e4m3
// k-step wide): rows 32 bytes apart, 8-row groups 256; the leading offset is
// unused (a wgmma's k-step never leaves its atom).
FAE_DEVICE uint64_t smem_desc_sw32_kmajor(uint32_t smem_addr) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) | (1ull << 16) |
         (static_cast<uint64_t>(256 >> 4) << 32) | (3ull << 62);
}
// The descriptor of the same operand layout `byte_offset` bytes further (the
// next k-step or 64-column chunk): an add to the start-address field (bits
// 0-13, address >> 4) instead of rebuilding the descriptor (4 uniform
// instructions per wgmma, issued from the consumer warps). A shared memory
// address stays below 2^18, so the field never carries into the LBO bits and
// the add may span all 64 bits: ptxas then emits one UIADD3.64 per wgmma,
// where a 32-bit add with the high word put back took a UIADD3 and a UMOV
// (88 UMOVs per 80-query backward step, against FA4's 20; backward 1.01x).
FAE_DEVICE uint64_t smem_desc_advance(uint64_t desc, uint32_t byte_offset) {
  return desc + (byte_offset >> 4);
}
// Orders register accesses before the next wgmma (accumulators, A fragments).
FAE_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
FAE_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPendingGroups>
FAE_DEVICE void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPendingGroups) : "memory");
}
// Keeps the compiler from moving reads/writes of accumulator registers across
// an in-flight wgmma (which writes them behind the compiler's back).
template <int kN>
FAE_DEVICE void fence_registers(float (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// Same for A fragments read from registers: keeps them live (unclobbered)
// until after the wgmma.wait that retires the MMA reading them.
template <int kN>
FAE_DEVICE void fence_registers(uint32_t (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// ptxas schedules a wgmma wait (WARPGROUP.DEPBAR) at the top of its basic
// block, above ALU work that does not need it: the forward's softmax
// exponentials, written between the waits for S_i and for P_{i-1} V_{i-1},
// ended up after both (0 of 66 MUFU.EX2 between them at D = 64), so a
// warpgroup's softmax never overlapped its own P V. A branch ends the block:
// the wait that follows stays below everything `v` depends on. The branch is
// never taken: 0xffffffff is a NaN that no arithmetic produces (the GPU's
// NaN results are 0x7fffffff), so `v` (a row sum) is never that.
FAE_DEVICE void keep_above_next_wait(float v) {
  if (__float_as_uint(v) == 0xffffffffu) __trap();
}
// The same with a warp-uniform branch (a vote): a per-thread branch made
// ptxas move the loop's wgmma descriptor arithmetic off the uniform datapath.
FAE_DEVICE void keep_above_next_wait_uniform(float v) {
  if (__any_sync(0xffffffffu, __float_as_uint(v) == 0xffffffffu)) __trap();
}

// The fp32 accumulators of an m64nN wgmma (kN / 8 n-tiles of 4 values) as the
// register A operand of the next wgmma, whose K is that N: the accumulator pair
// of n-tiles (2k, 2k+1) is exactly the A fragment of k-step k (as with mma.sync).
template <typename T, int kN>
FAE_DEVICE void accumulators_to_a_fragments(const float (&acc)[kN / 8][4],
                                            uint32_t (&a)[kN / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
    a[kk][0] = pack2<T>(acc[2 * kk][0], acc[2 * kk][1]);
    a[kk][1] = pack2<T>(acc[2 * kk][2], acc[2 * kk][3]);
    a[kk][2] = pack2<T>(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
    a[kk][3] = pack2<T>(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
  }
}

// Four floats as e4m3 bytes of one register, the first in the lowest byte
// (round to nearest, saturating at +-448).
FAE_DEVICE uint32_t pack4_e4m3(float x0, float x1, float x2, float x3) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(x0, x1), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(x2, x3), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

// The e4m3 form: an m64nNk32 A fragment (mma.sync's 8-bit k32 layout) gives
// lane 4g + q the columns 4q .. 4q + 3 and 16 + 4q .. 16 + 4q + 3 of each
// 32-column k-step (rows g, g + 8), while the accumulators hold columns
// 8j + 2q + {0, 1}. Instead of moving bytes between lanes, each lane packs
// its own accumulators in order, so A's column 4q + i holds key
// 8 * (i / 2) + 2q + i % 2 (and 16 more for the second half): within every
// 32-key block, A's column c holds key fp8_p_key_of_column(c), and V^T is
// stored with its keys in that same order (fp8_v_transpose.cu), which leaves
// the product P V unchanged.
__host__ __device__ constexpr int fp8_p_key_of_column(int c) {
  return 16 * (c / 16) + 8 * ((c % 4) / 2) + 2 * ((c % 16) / 4) + c % 2;
}

template <int kN>
FAE_DEVICE void accumulators_to_a_fragments_e4m3(const float (&acc)[kN / 8][4],
                                                 uint32_t (&a)[kN / 32][4]) {
#pragma unroll
  for (int kk = 0; kk < kN / 32; ++kk) {
    const float(&t0)[4] = acc[4 * kk];
    const float(&t1)[4] = acc[4 * kk + 1];
    const float(&t2)[4] = acc[4 * kk + 2];
    const float(&t3)[4] = acc[4 * kk + 3];
    a[kk][0] = pack4_e4m3(t0[0], t0[1], t1[0], t1[1]);  // row g, columns 4q ..
    a[kk][1] = pack4_e4m3(t0[2], t0[3], t1[2], t1[3]);  // row g + 8
    a[kk][2] = pack4_e4m3(t2[0], t2[1], t3[0], t3[1]);  // row g, columns 16 + 4q ..
    a[kk][3] = pack4_e4m3(t2[2], t2[3], t3[2], t3[3]);  // row g + 8
  }
}

// ---- warpgroup coordination ---------------------------------------------------
// bar.sync with an id > 0 syncs only `threads` threads (e.g. one warpgroup),
// leaving barrier 0 (__syncthreads) to the whole CTA.
FAE_DEVICE void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The same where the threads reach the barrier from different instructions
// (bar.sync is barrier.sync.aligned: one instruction for all of them, which
// compute-sanitizer's synccheck enforces).
FAE_DEVICE void named_barrier_sync_unaligned(int id, int threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Counts the caller's warp towards barrier `id` without waiting.
FAE_DEVICE void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
template <int kRegs>
FAE_DEVICE void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
FAE_DEVICE void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

}  // namespace sm90
}  // namespace cuda
}  // namespace flash_attn_ext
