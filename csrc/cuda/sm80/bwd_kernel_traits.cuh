// Tile configuration and shared-memory layout of the 16-bit backward kernel
// (bwd_kernel.cuh). Host code (bwd_dispatch.cu) includes this header too, for
// the block sizes that size the dQ workspace.
//
// ---------------------------------------------------------------------------
// Work decomposition ("key-major", one thread block per K/V tile):
//
//   block (n_block, h, b) owns keys [n_block*kBlockN, +kBlockN) and loops over
//   query tiles of kBlockM rows. 8 warps; three layouts (BwdLayout, chosen per
//   head dim in the table below):
//
//   kRegisters (D <= 96), kBlockN = 128:
//       keys  0..15 | 16..31 | ... | 112..127      x  all head-dim columns
//       warp    0   |   1    | ... |    7
//     Each warp computes S^T = K Q^T and dP^T = V dO^T for its 16 keys and all
//     kBlockM queries. The accumulator layout of S^T (rows = keys) *is* the
//     A-operand layout of dV += P^T dO and dK += dS^T Q, so P^T and dS^T
//     never leave registers for those two products (dS^T also goes to smem
//     for dQ).
//
//   kTiled (D = 128), kBlockN = 128:
//       S^T / dP^T:  keys 0..31 | 32..63 | 64..95 | 96..127
//         queries [0, BM/2)      warp 0 |   1    |   2    |   3
//         queries [BM/2, BM)     warp 4 |   5    |   6    |   7
//       dK / dV:     same key groups; warps 0-3 cols [0, D/2), 4-7 [D/2, D)
//     A 32 x 32 S^T tile per warp makes every ldmatrix fragment feed two
//     mma's (kRegisters: one), which matters once D is large enough for
//     shared-memory bandwidth to limit; the price is P^T / dS^T through
//     shared memory (the dK/dV warp grid differs from the S^T one).
//
//   kSplit (D > 128), kBlockN = 64:
//       keys  0..15 | 16..31 | 32..47 | 48..63
//       warp    0   |   1    |   2    |   3     (S^T,  dK/dV cols [0, D/2))
//       warp    4   |   5    |   6    |   7     (dP^T, dK/dV cols [D/2, D))
//     Holding 16 x D fp32 dK and dV per warp would need D registers per
//     thread (256 at D = 256), so the head dim of dK/dV is split over two
//     warp groups. Group 0 computes S^T, group 1 computes dP^T (same cost), group
//     1 hands dP^T to group 0 through shared memory, group 0 forms P and dS and
//     writes both (16-bit) to shared memory, from where every warp reads its
//     A operands for dV and dK.
//
//   dQ_tile = dS K (contraction over the kBlockN keys of this block) uses a
//   different warp grid over the kBlockM x kHeadDim output:
//       kWarpsMdQ warps along queries x kWarpsDdQ along the head dim,
//     with dS^T read from shared memory (ldmatrix.trans) and added to the fp32
//     dQ accumulator in global memory (atomics, or plain read-modify-write per
//     split in deterministic mode).
//
// Register budget (fp32 accumulators per thread, 255 max, 1 block of 256
// threads per SM): dK + dV = 2 * kKeysPerWarp * kDimPerWarp / 32, S^T + dP^T
// = kKeysPerWarp * kQueriesPerWarpS / 16 (kSplit: half, plus the dP^T copy),
// dQ tile (only live after dK/dV) = kBlockM*kHeadDim/256. ptxas adds ~60-90
// registers of addresses / fragments on top; all configs land at 150-255
// registers (D=128 causal: 48 B of spills).
//
// Configuration table (smem: H100/H200 allow up to 227 KB per block):
//   D    BM  BN  layout     MdQ  smem      why
//   32   64  128 registers  4    59 KB    big BN halves the dQ atomics
//   64   64  128 registers  4    91 KB    FA2's 64x128 tile
//   96   64  128 registers  4   123 KB
//   128  64  128 tiled      2   177 KB    see the measurements below
//   160  64   64 split      4   161 KB    head dim of dK/dV split over 2 groups
//   192  64   64 split      4   185 KB
//   224  64   64 split      4   209 KB    (MdQ = 4 is the only legal dQ grid)
//   256  32   64 split      1   151 KB    BM = 64 would need 237 KB of smem
// (Exact numbers: BwdKernelTraits::kSmemBytes.)
// ---------------------------------------------------------------------------
#pragma once
#include <type_traits>
#include <cstdint>

#include "../common/ptx.cuh"

namespace flash_attn_ext {
namespace cuda {

// Measured on an H200 (2026-11-21, bf16, bench/tune_tiles.sh: geomean of
// ours/torch-flash backward TFLOP/s over S in {2k, 8k} x causal {0, 1}),
// as (kBlockM, kBlockN, kWarpsD, kWarpsMdQ):
//   D=64 : (64,128,1,4) 0.841 (chosen) | (128,128,1,8) 0.854, spills | (32,128,1,2) 0.664
//   D=128: (64,128,1,2) 0.828 (ptxas reports small spills, still the fastest) |
//          (64,128,1,4) 0.805 | (32,128,1,2) 0.707
// Layouts (full bench grid, bf16, ours/FA2 geomean over S 512..16k x causal):
//   D=64 : registers 0.88 (chosen) | tiled 0.80
//   D=128: tiled 0.88 (chosen)     | registers ~0.83 (tune set above)
//   D=256: (32,64,2,1) 0.677 (chosen) | (32,64,2,2) 0.671; (64,64,2,4) exceeds 227 KB smem
// How the 8 warps split the S^T / dP^T work and the dK / dV accumulators.
enum class BwdLayout {
  kRegisters,  // 8 key groups of 16 keys x the whole head dim; S^T, dP^T, P^T, dS^T
               // of a warp's keys stay in its registers (dS^T also to smem for dQ)
  kTiled,      // 4 key groups of 32 keys x 2 head-dim halves; each warp computes
               // S^T and dP^T for 32 keys x kBlockM/2 queries, P^T / dS^T via smem
  kSplit,      // 4 key groups of 16 keys x 2 head-dim halves; half the warps compute
               // S^T, half dP^T (hand-off through smem), P^T / dS^T via smem
};

template <int kHeadDim>
struct BwdTileConfigDefault;
// clang-format off
//                                    kBlockM        kBlockN         kWarpsMdQ       layout
template <> struct BwdTileConfigDefault<32>  { static constexpr int kBlockM = 64, kBlockN = 128,  kWarpsMdQ = 4; static constexpr BwdLayout kLayout = BwdLayout::kRegisters; };
template <> struct BwdTileConfigDefault<64>  { static constexpr int kBlockM = 64, kBlockN = 128,  kWarpsMdQ = 4; static constexpr BwdLayout kLayout = BwdLayout::kRegisters; };
template <> struct BwdTileConfigDefault<96>  { static constexpr int kBlockM = 64, kBlockN = 128,  kWarpsMdQ = 4; static constexpr BwdLayout kLayout = BwdLayout::kRegisters; };
template <> struct BwdTileConfigDefault<128> { static constexpr int kBlockM = 64, kBlockN = 128,  kWarpsMdQ = 2; static constexpr BwdLayout kLayout = BwdLayout::kTiled; };
template <> struct BwdTileConfigDefault<160> { static constexpr int kBlockM = 64, kBlockN = 64,   kWarpsMdQ = 4; static constexpr BwdLayout kLayout = BwdLayout::kSplit; };
template <> struct BwdTileConfigDefault<192> { static constexpr int kBlockM = 64, kBlockN = 64,   kWarpsMdQ = 4; static constexpr BwdLayout kLayout = BwdLayout::kSplit; };
template <> struct BwdTileConfigDefault<224> { static constexpr int kBlockM = 64, kBlockN = 64,   kWarpsMdQ = 4; static constexpr BwdLayout kLayout = BwdLayout::kSplit; };
template <> struct BwdTileConfigDefault<256> { static constexpr int kBlockM = 32, kBlockN = 64,   kWarpsMdQ = 1; static constexpr BwdLayout kLayout = BwdLayout::kSplit; };

// Tuning builds (bench/tune_tiles.sh) replace one head dim's entry:
//   -DFAE_BWD_TUNE_D=128 -DFAE_BWD_TUNE_BM=64 -DFAE_BWD_TUNE_BN=128
//   -DFAE_BWD_TUNE_WARPS_M_DQ=4 -DFAE_BWD_TUNE_LAYOUT=kTiled
#if defined(FAE_BWD_TUNE_D)
struct BwdTileConfigTune {
  static constexpr int kBlockM = FAE_BWD_TUNE_BM, kBlockN = FAE_BWD_TUNE_BN,
                       kWarpsMdQ = FAE_BWD_TUNE_WARPS_M_DQ;
#if defined(FAE_BWD_TUNE_LAYOUT)
  static constexpr BwdLayout kLayout = BwdLayout::FAE_BWD_TUNE_LAYOUT;
#else
  static constexpr BwdLayout kLayout = BwdTileConfigDefault<FAE_BWD_TUNE_D>::kLayout;
#endif
};
template <int kHeadDim>
struct BwdTileConfig : std::conditional_t<kHeadDim == FAE_BWD_TUNE_D, BwdTileConfigTune,
                                          BwdTileConfigDefault<kHeadDim>> {};
#else
template <int kHeadDim>
struct BwdTileConfig : BwdTileConfigDefault<kHeadDim> {};
#endif
// clang-format on

// Smallest instantiated head dim >= head_dim (head_dim % 8 == 0, <= 256).
inline int bwd_rounded_head_dim(int head_dim) {
  return head_dim <= 32 ? 32 : head_dim <= 64 ? 64 : (head_dim + 31) / 32 * 32;
}

// kBlockN of the 16-bit kernel for a rounded head dim (host side).
inline int bwd_block_n(int rounded_head_dim) { return rounded_head_dim <= 128 ? 128 : 64; }

template <typename T_, int kHeadDim_>
struct BwdKernelTraits {
  using T = T_;
  using Cfg = BwdTileConfig<kHeadDim_>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = Cfg::kBlockM;
  static constexpr int kBlockN = Cfg::kBlockN;
  static constexpr int kNWarps = 8;
  static constexpr int kNThreads = kNWarps * 32;

  // dK / dV warp grid: kWarpsKeys key groups x kWarpsD head-dim slices.
  static constexpr BwdLayout kLayout = Cfg::kLayout;
  static constexpr int kWarpsKeys = kLayout == BwdLayout::kRegisters ? 8 : 4;
  static constexpr int kWarpsD = kNWarps / kWarpsKeys;
  static constexpr int kKeysPerWarp = kBlockN / kWarpsKeys;
  static constexpr int kMmaKeys = kKeysPerWarp / 16;      // 16-key m-tiles per warp
  static constexpr int kDimPerWarp = kHeadDim / kWarpsD;  // dK/dV columns per warp
  static_assert(kWarpsKeys * kWarpsD == kNWarps, "warp grid must use all warps");
  static_assert(kKeysPerWarp == (kLayout == BwdLayout::kTiled ? 32 : 16),
                "kRegisters / kSplit own 16 keys per warp (kBlockN = 128 / 64), kTiled 32 "
                "(kBlockN = 128)");
  static_assert(kHeadDim % 16 == 0 && kDimPerWarp % 16 == 0,
                "head-dim slices are walked 16 columns at a time (ldmatrix x4)");

  // Unroll factor of the k-loops of the S^T / dP^T and dQ products (the
  // ldmatrix of step k+1 can then issue under the mma's of step k). Measured
  // (H200 bf16, S 2k/8k x causal, ours/FA2 backward geomean):
  //   D=64   1: 0.836   2: 0.852   4: 0.826
  //   D=128  1: 0.836   2: 0.861
  //   D=256  1: 0.678   2: 0.700
  // D=160..224 are unmeasured; with 2 their register and spill counts stay
  // within a few bytes of 1. Tune builds override it (FAE_BWD_GEMM_UNROLL).
#if defined(FAE_BWD_GEMM_UNROLL)
  static constexpr int kGemmUnroll = FAE_BWD_GEMM_UNROLL;
#else
  static constexpr int kGemmUnroll = 2;
#endif

  // S^T / dP^T phase: queries per warp (kTiled: half the tile, else all).
  static constexpr bool kTiledSdP = kLayout == BwdLayout::kTiled;
  static constexpr int kQueriesPerWarpS = kTiledSdP ? kBlockM / 2 : kBlockM;
  static constexpr int kQTiles = kQueriesPerWarpS / 8;  // 8-query n-tiles of S^T per warp
  static_assert(kQueriesPerWarpS % 16 == 0, "queries are walked 16 at a time (ldmatrix x4)");
  static_assert(kBlockM % 16 == 0, "queries are the K dim of dV/dK mmas: multiples of 16");
  static_assert(kBlockM <= 128, "one bit per query in the masks below");

  // dQ warp grid.
  static constexpr int kWarpsMdQ = Cfg::kWarpsMdQ;
  static constexpr int kWarpsDdQ = kNWarps / kWarpsMdQ;
  static constexpr int kRowsdQ = kBlockM / kWarpsMdQ;
  static constexpr int kColsdQ = kHeadDim / kWarpsDdQ;
  static_assert(kWarpsMdQ * kWarpsDdQ == kNWarps, "dQ warp grid must use all warps");
  static_assert(kRowsdQ % 16 == 0 && kColsdQ % 16 == 0, "dQ warp tile: multiples of 16x16");

  // ---- shared memory ----------------------------------------------------
  // Every [rows][kHeadDim] tile is stored with a row pitch of kHeadDim + 8
  // elements (one spare 16-byte chunk). ldmatrix reads 8 rows at the same
  // column chunk; with a pitch of C+1 chunks (C = kHeadDim/8, even) the 8 rows
  // land on 8 distinct 16-byte bank groups ((C+1) odd), so both ldmatrix and
  // ldmatrix.trans are conflict-free for every head dim, including the ones
  // that are not multiples of 64 (where the XOR swizzle does not apply).
  static constexpr int kRowPitch = kHeadDim + 8;
  static_assert((kRowPitch / 8) % 2 == 1, "padded pitch must be an odd number of chunks");
  // dS^T / P^T tiles [kBlockN keys][kBlockM queries], same padding argument.
  static constexpr int kKeyRowPitch = kBlockM + 8;
  static_assert((kKeyRowPitch / 8) % 2 == 1, "padded pitch must be an odd number of chunks");

  static constexpr int kStages = 2;  // Q/dO double buffer: load tile m+1 while computing m
  static constexpr int kKBytes = kBlockN * kRowPitch * 2;
  static constexpr int kQBytes = kBlockM * kRowPitch * 2;
  static constexpr int kdSBytes = kBlockN * kKeyRowPitch * 2;
  // P^T (16-bit, same layout as dS^T) unless it stays in registers; kSplit
  // only: dP^T hand-off (fp32, fragment order).
  static constexpr int kPBytes = kLayout == BwdLayout::kRegisters ? 0 : kdSBytes;
  static constexpr int kdPBytes = kLayout == BwdLayout::kSplit ? kBlockN * kBlockM * 4 : 0;

  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + kKBytes;
  static constexpr int kOffQ = kOffV + kKBytes;                 // [kStages]
  static constexpr int kOffdO = kOffQ + kStages * kQBytes;      // [kStages]
  static constexpr int kOffdS = kOffdO + kStages * kQBytes;
  static constexpr int kOffP = kOffdS + kdSBytes;
  static constexpr int kOffdP = kOffP + kPBytes;
  static constexpr int kOffLse = kOffdP + kdPBytes;             // float [kStages][kBlockM]
  static constexpr int kOffDsum = kOffLse + kStages * kBlockM * 4;  // float [kStages][kBlockM]
  static constexpr int kSmemBytes = kOffDsum + kStages * kBlockM * 4;
  static_assert(kSmemBytes <= 227 * 1024, "exceeds the 227 KB opt-in shared memory of sm_90");
  static_assert(kOffQ % 16 == 0 && kOffdS % 16 == 0 && kOffdP % 16 == 0 && kOffLse % 16 == 0,
                "16-byte aligned tiles (cp.async / float4)");

  // Global -> shared copy of one [rows][kHeadDim] tile: 16-byte chunks.
  static constexpr int kChunksPerRow = kHeadDim / 8;
};

}  // namespace cuda
}  // namespace flash_attn_ext
