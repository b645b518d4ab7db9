// Compile-time shape of one forward kernel configuration (tile sizes, warp
// split, shared-memory layout) plus the table that picks a configuration per
// head dim. Everything the kernel derives from the tile shape lives here, with
// a static_assert for every assumption the kernel makes about it.
#pragma once
#include <type_traits>
#include "../../params.h"
#include "../common/ptx.cuh"

namespace flash_attn_ext {
namespace cuda {

// ---------------------------------------------------------------------------
// Shared-memory layout of one [kRows x kCols] tile of 16-bit elements.
//
// ldmatrix reads 8 rows at the same 16-byte column chunk. To keep those 8
// addresses in 8 different 16-byte bank groups we either
//   * XOR-swizzle the chunk index with (row % 8) when a row holds a multiple of
//     8 chunks (head dims 64, 128, 192, 256): no wasted memory, or
//   * pad every row by one chunk otherwise (head dims 32, 96, 160, 224 have
//     an even number of chunks, so the padded row stride is an odd number of
//     chunks and rows r = 0..7 land on 8 distinct chunk positions mod 8).
// Both layouts are conflict-free for ldmatrix (8 rows, same chunk), for the
// cp.async stores (consecutive threads fill consecutive chunks of a row) and
// for the epilogue's 32-bit fragment stores (row g, chunk j, word q).
// ---------------------------------------------------------------------------
template <int kRows, int kCols>
struct SmemTileLayout {
  static constexpr int kChunks = kCols / 8;  // 16-byte chunks per row
  static constexpr bool kSwizzled = kChunks % 8 == 0;
  static constexpr int kRowStride = kSwizzled ? kCols : kCols + 8;  // in elements
  static constexpr int kElems = kRows * kRowStride;

  static_assert(kCols % 16 == 0, "tile columns must be a multiple of 16 (one mma k-step)");
  static_assert(kSwizzled || kChunks % 2 == 0,
                "padded layout needs an even chunk count so the padded stride is odd");

  // Element offset of 16-byte chunk `chunk` of row `row`.
  static FAE_DEVICE int offset(int row, int chunk) {
    if constexpr (kSwizzled) {
      return row * kRowStride + swizzled_chunk<kChunks>(row, chunk) * 8;
    } else {
      return row * kRowStride + chunk * 8;
    }
  }
};

// ---------------------------------------------------------------------------
// Kernel traits.
//
//   T          __half or __nv_bfloat16
//   kHeadDim   instantiated head dim (multiple of 16); the real head dim may be
//              smaller (multiple of 8), extra columns are zero-filled
//   kBlockM    query rows per CTA
//   kBlockN    key rows per K/V tile
//   kNWarps    warps per CTA; warp w owns query rows [w*kRowsPerWarp, +kRowsPerWarp)
//   kStages    K/V tiles resident in shared memory (>= 2): tile n+kStages-1 is
//              loaded while tile n is computed
//   kQInRegs   keep Q's mma A-fragments in registers for the whole kernel
//              (else re-read them from shared memory with ldmatrix each tile:
//              saves kMmaM*kHeadDim/4 registers, costs shared-memory bandwidth)
//
// Warp map of one CTA (example kBlockM=128, kNWarps=4, kRowsPerWarp=32):
//
//            K/V tile columns 0 .. kBlockN-1 (shared by all warps)
//          +------------------------------------------+
//   rows   | warp 0: m-tile 0 (rows   0..15)          |  each warp computes
//   0..31  |         m-tile 1 (rows  16..31)          |  S = Q K^T for all
//          +------------------------------------------+  kBlockN columns of
//  32..63  | warp 1: rows 32..63                      |  its own rows, keeps
//          +------------------------------------------+  its own softmax
//  64..95  | warp 2: rows 64..95                      |  statistics and O rows:
//          +------------------------------------------+  no inter-warp
//  96..127 | warp 3: rows 96..127                     |  reduction (FA2 split)
//          +------------------------------------------+
//
// Inside one 16x8 mma accumulator (lane = 4*g + q):
//      cols  2q 2q+1
//   row g    c0  c1      row g+8   c2  c3
// so each lane holds 2 rows per m-tile and the 4 lanes of a quad share a row.
// ---------------------------------------------------------------------------
// kKVL2Policy_: K/V copies may carry an L2 evict_first policy
// (params.kv_evict_first); only the decode tile, where each K/V byte can have
// a single reading CTA, instantiates it.
// kKeyWarps_: warps that share the same query rows and split every K/V tile's
// keys between them (the decode tile; 1 elsewhere). Each keeps its own online
// softmax over its key slices; merge_key_warps combines them at the end.
// Decode map (kBlockM=16, kBlockN=64, kNWarps=kKeyWarps=4):
//
//            K/V tile keys  0..15 | 16..31 | 32..47 | 48..63   (one tile, loaded by all)
//   rows 0..15             warp 0 | warp 1 | warp 2 | warp 3
// kKVFp8_: K / V are FP8 (e4m3) in global memory (an FP8 KV cache under a
// 16-bit q; the KV cache kernels only, run_fwd_kvcache_fp8_impl). Their tiles
// stream into shared-memory staging tiles of kStages x (K, V) x kBlockN x
// kHeadDim bytes (KVFp8Layout) with the same cp.async pipeline, and the MMA
// code reads them straight into registers: ldmatrix of the e4m3 bytes as
// 16-bit pairs, widened to 16 bits in the fragment (fwd_mma.cuh, "FP8 tiles
// straight into mma fragments"). No 16-bit K / V tiles (kKVSlots = 0): the
// global traffic and the shared-memory stages are half of a 16-bit tile's.
template <typename T_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kStages_,
          bool kQInRegs_, bool kKVL2Policy_ = false, int kKeyWarps_ = 1, bool kKVFp8_ = false>
struct FwdKernelTraits {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kStages = kStages_;
  static constexpr bool kQInRegs = kQInRegs_;
  static constexpr bool kKVL2Policy = kKVL2Policy_;
  static constexpr int kKeyWarps = kKeyWarps_;
  static constexpr bool kKVFp8 = kKVFp8_;
  // The MMAs' 16-bit type: T, or fp16 for FP8 K / V (fwd_mma.cuh, "FP8
  // tiles straight into mma fragments").
  using MmaT = std::conditional_t<kKVFp8, __half, T>;

  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kRowWarps = kNWarps / kKeyWarps;   // warps along the query rows
  static constexpr int kRowsPerWarp = kBlockM / kRowWarps;
  static constexpr int kWarpKeys = kBlockN / kKeyWarps;   // keys of a tile one warp computes
  static constexpr int kMmaM = kRowsPerWarp / 16;  // 16-row m-tiles per warp
  static constexpr int kTilesN = kWarpKeys / 8;    // 8-col n-tiles of the warp's S per m-tile
  static constexpr int kTilesD = kHeadDim / 8;     // 8-col n-tiles of O per m-tile
  static constexpr int kStepsD = kHeadDim / 16;    // k-steps of Q K^T
  static constexpr int kStepsN = kWarpKeys / 16;   // k-steps of P V

  using QLayout = SmemTileLayout<kBlockM, kHeadDim>;   // also stages the O tile
  using KVLayout = SmemTileLayout<kBlockN, kHeadDim>;  // one K or V tile

  static constexpr int kSmemQElems = QLayout::kElems;
  static constexpr int kSmemKVElems = KVLayout::kElems;
  // 16-bit K (and V) tiles in shared memory: one per stage (none with kKVFp8).
  static constexpr int kKVSlots = kKVFp8 ? 0 : kStages;
  // kKVFp8: the FP8 staging tiles after Q (kStages K tiles, then kStages V
  // tiles), rows of kHeadDim bytes addressed as rows of kHeadDim / 2 16-bit
  // pairs: SmemTileLayout's swizzle (or padding) of 16-byte chunks keeps the
  // 8 row addresses of an ldmatrix in 8 different bank groups.
  using KVFp8Layout = SmemTileLayout<kBlockN, kHeadDim / 2>;
  static constexpr int kSmemKVFp8Bytes = KVFp8Layout::kElems * 2;
  static constexpr int kSmemBytes =
      (kSmemQElems + 2 * kKVSlots * kSmemKVElems) * static_cast<int>(sizeof(T)) +
      (kKVFp8 ? 2 * kStages * kSmemKVFp8Bytes : 0);

  static_assert(sizeof(T) == 2, "the tensor-core kernel handles 16-bit types only");
  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256,
                "kHeadDim must be a multiple of 16 (mma k-step) and <= 256");
  static_assert(kKeyWarps >= 1 && kNWarps % kKeyWarps == 0,
                "the warps must form whole groups of kKeyWarps");
  static_assert(kBlockM % kRowWarps == 0, "kBlockM must split evenly over the row warps");
  static_assert(kWarpKeys % 16 == 0 && kWarpKeys * kKeyWarps == kBlockN,
                "each key warp takes whole 16-key P V k-steps of every tile");
  static_assert(kRowsPerWarp % 16 == 0, "each warp must own whole 16-row mma tiles");
  static_assert(kMmaM >= 1 && kMmaM <= 4, "1..4 m-tiles per warp");
  static_assert(kBlockN % 16 == 0, "kBlockN must be a multiple of 16 (P V k-step)");
  static_assert(kHeadDim % 16 == 0, "ldmatrix.x4 on V loads pairs of 8-column O tiles");
  static_assert(kStages >= 2, "the K/V pipeline needs at least double buffering");
  static_assert((kRowsPerWarp * (kHeadDim / 8)) % 32 == 0,
                "the epilogue's warp-local store needs whole 16-byte chunks per lane");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory exceeds the 227 KB per-CTA limit");
};

// ---------------------------------------------------------------------------
// Configuration table: which traits each (head dim, causal) uses.
//
//  kHeadDim | BlockM | BlockN | warps | rows/warp | stages | Q in regs | smem (KB) | regs sm80/sm90
//  ---------+--------+--------+-------+-----------+--------+-----------+-----------+---------------
//     32    |  128   |   64   |   4   |    32     |   2    |    yes    |    30     |  195 / 198
//     64    |  128   |   64   |   4   |    32     |   2    |    yes    |    48     |  248 / 250
//     96    |  128   |   64   |   8   |    16     |   2    |    yes    |    78     |  198 / 198
//    128    |  128   |   64   |   4   |    32     |   2    |    no     |    96     |  255 (56 B spill)
//    160    |  128   |   64   |   8   |    16     |   2    |    no     |   126     |  237 / 234
//    192    |  128   |   64   |   8   |    16     |   2    |    no     |   144     |  253 / 253
//    224    |  128   |   64   |   8   |    16     |   2    |    no     |   175     |  ~250-255
//    256    |  128   |   64   |   8   |    16     |   2    |    no     |   192     |  251 / 253
// (register counts from ptxas -v, CUDA 13.0, no spills; see the report in the
// commit message for causal variants.)
//
// Why:
//  * 32 rows per warp (2 m-tiles) for D <= 64: every K/V fragment read from
//    shared memory feeds two mma's, halving shared-memory traffic per flop vs
//    16 rows per warp (FA2's choice for all head dims). The cost is registers
//    (O = D floats/lane, S = BlockN floats/lane, Q = D/2 words/lane): at
//    BlockN=128 both D=32 and D=64 spilled (ptxas schedules K fragment loads
//    of a whole k-loop ahead), so BlockN=64.
//  * D >= 96: 2 m-tiles per warp spilled at every BlockN >= 64 with the
//    causal mask (D=128: 128x64 -> ~60 B, 128x32 causal -> ~40 B of spills),
//    so 8 warps x 16 rows, except at D=128 where 4 warps x 32 rows with Q
//    re-read from shared memory measured faster despite ~56 B of spills (the
//    halved K/V fragment traffic outweighs them). Q stays in registers for
//    D=96 (saves re-reading it every key tile); from D=160 it no longer fits
//    next to O (D/2 floats) and is re-read with ldmatrix.
//  * All configurations run one 8-warp CTA or two 4-warp CTAs per SM
//    (registers are the limit, not shared memory), i.e. 8 warps per SM.
//  * 2 stages: K/V tile n+1 streams in during the whole of tile n (both the
//    Q K^T and the P V halves); a third stage would not fit at D >= 224.
// Measured on an H200 (2026-11-21, bf16, bench/tune_tiles.sh: geomean of
// ours/torch-flash forward TFLOP/s over S in {2k, 8k} x causal {0, 1}):
//   D=64 : 128x64x4w 1.030 (chosen) | 128x128x8w 0.848 | 64x64x4w 0.928
//   D=128: 128x128x8w 0.942 | 128x64x8w 0.864 | 128x96x8w 0.898 |
//          128x64x8w 3 stages 0.871 | 64x64x4w 0.897 | 64x128x4w 0.793 | 128x32x4w 0.777
//          second round, same run: 128x64x4w Q from smem 0.957 (min 0.95; chosen: FA2's
//          tile, 56 B of spills) | 128x128x8w 0.946 (min 0.90) | 128x64x4w 3 stages 0.766
//   D=256: 128x64x8w 0.956 (chosen) | 64x64x4w 0.753 | 128x32x8w 0.793
// These are starting points: every column is a template parameter of
// FwdKernelTraits, so alternatives can be measured by editing one line.
// ---------------------------------------------------------------------------
template <int kHeadDim, bool kIsCausal>
struct FwdTileConfigDefault;

#define FAE_FWD_CONFIG_BODY(D, BM, BN, WARPS, STAGES, QREGS)                       \
  static constexpr int kBlockM = BM, kBlockN = BN, kNWarps = WARPS;                \
  static constexpr int kStages = STAGES;                                           \
  static constexpr bool kQInRegs = QREGS;                                          \
  template <typename T>                                                            \
  using Traits = FwdKernelTraits<T, D, BM, BN, WARPS, STAGES, QREGS>;
#define FAE_FWD_CONFIG(D, ...)                                                     \
  template <bool kIsCausal>                                                        \
  struct FwdTileConfigDefault<D, kIsCausal> {                                      \
    FAE_FWD_CONFIG_BODY(D, __VA_ARGS__)                                            \
  };

FAE_FWD_CONFIG(32, 128, 64, 4, 2, true)
FAE_FWD_CONFIG(64, 128, 64, 4, 2, true)
FAE_FWD_CONFIG(96, 128, 64, 8, 2, true)
FAE_FWD_CONFIG(128, 128, 64, 4, 2, false)
FAE_FWD_CONFIG(160, 128, 64, 8, 2, false)
FAE_FWD_CONFIG(192, 128, 64, 8, 2, false)
FAE_FWD_CONFIG(224, 128, 64, 8, 2, false)
FAE_FWD_CONFIG(256, 128, 64, 8, 2, false)
#undef FAE_FWD_CONFIG

// Tuning builds (bench/tune_tiles.sh) replace one head dim's entry without
// editing this table (nvcc splits -D values at commas, hence one define each):
//   -DFAE_FWD_TUNE_D=128 -DFAE_FWD_TUNE_BM=128 -DFAE_FWD_TUNE_BN=128
//   -DFAE_FWD_TUNE_WARPS=8 -DFAE_FWD_TUNE_STAGES=2 -DFAE_FWD_TUNE_QREGS=true
#if defined(FAE_FWD_TUNE_D)
struct FwdTileConfigTune {
  FAE_FWD_CONFIG_BODY(FAE_FWD_TUNE_D, FAE_FWD_TUNE_BM, FAE_FWD_TUNE_BN, FAE_FWD_TUNE_WARPS,
                      FAE_FWD_TUNE_STAGES, FAE_FWD_TUNE_QREGS)
};
template <int kHeadDim, bool kIsCausal>
struct FwdTileConfig
    : std::conditional_t<kHeadDim == FAE_FWD_TUNE_D, FwdTileConfigTune,
                         FwdTileConfigDefault<kHeadDim, kIsCausal>> {};
#else
template <int kHeadDim, bool kIsCausal>
struct FwdTileConfig : FwdTileConfigDefault<kHeadDim, kIsCausal> {};
#endif

// ---------------------------------------------------------------------------
// Decode configuration: used instead of the table above when seqlen_q <= 16
// (token-by-token generation, speculative decoding).
//
// The 128-row tiles above would spend 8x (D <= 64: 4x) the tensor-core work
// of the real rows on padding, which made decode compute-bound at ~2.5 TB/s of
// K/V traffic. Here one warp owns one 16-row m-tile (the mma minimum) and a CTA
// is that single warp, so many small CTAs (6 per SM at D=128) stream disjoint
// key ranges (split-KV fills the GPU) and each SM keeps several K/V tiles in
// flight, which is what a bandwidth-bound kernel needs.
//
// Two variants (params.h FwdTile; fwd_choose_tile in fwd_dispatch.cu picks):
//  * one warp per CTA (kFwdTileSmallM): many small CTAs; grids too small to
//    fill the GPU (few heads, GQA regrouped) split the keys over CTAs and
//    merge the splits (in a cluster on sm_90, else the combine kernel);
//  * 4 key warps per CTA (kFwdTileSmallMKeyWarps): the warps share each
//    64-key tile, 16 keys each, and merge in shared memory at the end
//    (merge_key_warps), for grids that need at most 3 splits of it.
//
//  variant   | kHeadDim | BlockM | BlockN | warps | stages | Q in regs | smem (KB)
//  ----------+----------+--------+--------+-------+--------+-----------+----------
//  one warp  |  <= 64   |   16   |   64   |   1   |   2    |    yes    |  34 (D=64)
//  one warp  |  96, 128 |   16   |   32   |   1   |   2    |    yes    |  36 (D=128)
//  one warp  |  >= 160  |   16   |   32   |   1   |   2    |    no     |  72 (D=256)
//  key warps |  <= 64   |   16   |  128   |   4   |   2    |    yes    |  66 (D=64)
//  key warps |  96, 128 |   16   |   64   |   4   |   2    |    yes    |  68 (D=128)
//  key warps |  >= 160  |   16   |   64   |   4   |   2    |    no     |  136 (D=256)
// Q leaves registers from D=160 on for the same reason as in the table above
// (O alone is D/2 floats per lane).
//
// Measured (H200, bf16, D=128, B=8 H=32 Sq=1, Sk 8k/16k/32k/64k, ours / cuDNN,
// same process, triton do_bench): one warp with 2 splits in 2-CTA clusters
// 0.994 / 0.994 / 0.997 / 0.994; 4 key warps x 16 keys, unsplit 1.007 /
// 1.005 / 1.006 / 1.003 (cuDNN's own kernel is also 4 warps x 256 CTAs); 2
// key warps x 32 keys 0.89 / 0.89 / 0.99 / 0.99. The table at fwd_choose_tile
// (fwd_dispatch.cu) has the other shapes: 4-CTA clusters of the key-warp tile
// ran at 0.78-0.91 (3-CTA ones at 1.03-1.05), so it takes grids that need at
// most 3 splits.
// D <= 64 takes twice the keys per tile: with 32 / 64 keys a tile carried half
// the bytes of D=128's, too few in flight (B=8 H=32 Sk=16k: 2.1 TB/s, 0.96x
// cuDNN). Same process, ours (auto) / cuDNN, D=64, rows as in fwd_choose_tile's
// table (B=8 H_kv=32 16k, B=8 H_kv=8 4k/16k/64k, B=1 H_kv=8 16k, B=2 H_kv=32
// 16k, B=4 H_kv=32 8k): 32 / 64 keys 0.959 1.135 0.915 0.898 1.040 0.921
// 1.033; 64 / 128 keys 0.998 1.152 1.023 1.013 1.064 1.024 1.073; 32 / 64 keys
// with 4 stages 0.990 1.223 1.015 1.006 1.049 1.019 1.060; 64 / 128 keys with
// 3 stages 0.997-1.067, 4 stages 0.996-1.159 (the one-warp tile alone 0.79-1.03).
// ---------------------------------------------------------------------------
inline constexpr int kFwdDecodeMaxSeqlenQ = 16;
inline constexpr int kFwdDecodeKeyWarps = 4;

// Tuning builds (bench/tune_tiles.sh "dec") replace one head dim's decode
// tiles: -DFAE_FWD_DECODE_TUNE_D=64 -DFAE_FWD_DECODE_TUNE_BN=64 (one warp)
// -DFAE_FWD_DECODE_KW_TUNE_BN=128 (key warps) -DFAE_FWD_DECODE_TUNE_STAGES=3.
#ifndef FAE_FWD_DECODE_TUNE_D
#define FAE_FWD_DECODE_TUNE_D 0
#endif
#ifndef FAE_FWD_DECODE_TUNE_BN
#define FAE_FWD_DECODE_TUNE_BN 32
#endif
#ifndef FAE_FWD_DECODE_KW_TUNE_BN
#define FAE_FWD_DECODE_KW_TUNE_BN 64
#endif
#ifndef FAE_FWD_DECODE_TUNE_STAGES
#define FAE_FWD_DECODE_TUNE_STAGES 2
#endif
// The FP8 KV cache's pipeline depth (its staging tiles; -D to tune, all head dims).
#ifndef FAE_FWD_DECODE_FP8_STAGES
#define FAE_FWD_DECODE_FP8_STAGES 4
#endif
template <int kHeadDim, int kKeyWarps = 1>
struct FwdTileConfigDecode {
  static constexpr bool kTuned = kHeadDim == FAE_FWD_DECODE_TUNE_D;
  static constexpr int kBlockM = 16, kNWarps = kKeyWarps;
  // D <= 64: twice the keys, so a tile still carries 8 KB of K (see above).
  static constexpr int kDefaultBlockN = (kHeadDim <= 64 ? 2 : 1) * (kKeyWarps == 1 ? 32 : 64);
  static constexpr int kBlockN =
      kTuned ? (kKeyWarps == 1 ? FAE_FWD_DECODE_TUNE_BN : FAE_FWD_DECODE_KW_TUNE_BN)
             : kDefaultBlockN;
  static constexpr int kStages = kTuned ? FAE_FWD_DECODE_TUNE_STAGES : 2;
  static constexpr bool kQInRegs = kHeadDim <= 128;
  // kKVFp8: an FP8 (e4m3) KV cache (FwdKernelTraits), same tile. A tile
  // carries half the bytes of a 16-bit one, so it prefetches further ahead:
  // kFp8Stages staging tiles (kFp8Stages - 1 tiles in flight), e.g. one warp
  // at D=128 keeps 24 KB in flight in 36 KB of shared memory (16-bit: 16 KB
  // in 36 KB); key warps 48 KB in 68 KB. (6 stages measured no faster, H100
  // 2026-11-26: docs/PERFORMANCE.md.)
  static constexpr int kFp8Stages = FAE_FWD_DECODE_FP8_STAGES;
  template <typename T, bool kKVFp8 = false>
  using Traits = FwdKernelTraits<T, kHeadDim, kBlockM, kBlockN, kNWarps,
                                 kKVFp8 ? kFp8Stages : kStages, kQInRegs,
                                 /*kKVL2Policy=*/true, kKeyWarps, kKVFp8>;
};
static_assert(FwdTileConfigDecode<128>::kBlockM >= kFwdDecodeMaxSeqlenQ,
              "one decode tile must hold every query row");

// Split-KV calls on this tile merge their splits inside a thread-block cluster
// on sm_90 (fwd_launch.h) when there are at most this many. The portable
// cluster size is 8, but 8-CTA clusters place worse: H200, B=8 H=32 H_kv=8
// decode, cache 8k/16k/32k, ours / cuDNN (same process): 6 splits in 6-CTA
// clusters 1.021 / 1.015 / 0.998, 8 splits in 8-CTA clusters 1.005 / 0.984 /
// 0.955, 7 in 7-CTA clusters 1.011 / 1.002 / 0.984. fwd_num_splits rounds the
// heuristic's 7-8 splits down to this where the cluster can take them.
inline constexpr int kMaxClusterSplits = 6;

// Host and kernel-launch side agree on the tile through this one predicate.
// The decode tile is a plain 16-row tile, correct for any seqlen_q; forcing it
// (params.fwd_tile) lets the autotuner try it on other small-grid shapes.
inline bool fwd_uses_decode_tile(const AttentionFwdParams& params) {
  if (params.fwd_tile == kFwdTileSmallM || params.fwd_tile == kFwdTileSmallMKeyWarps) return true;
  if (params.fwd_tile == kFwdTileLarge) return false;
  return params.seqlen_q <= kFwdDecodeMaxSeqlenQ;
}

// Which decode variant: the key-warp one only where fwd_choose_tile (or the
// caller) set it; kFwdTileAuto stays on the one-warp tile.
inline bool fwd_uses_key_warp_tile(const AttentionFwdParams& params) {
  return params.fwd_tile == kFwdTileSmallMKeyWarps;
}

// Smallest instantiated head dim >= head_dim (head dims are multiples of 32).
inline constexpr int fwd_rounded_head_dim(int head_dim) {
  return head_dim <= 32 ? 32 : (head_dim + 31) / 32 * 32;
}

}  // namespace cuda
}  // namespace flash_attn_ext
