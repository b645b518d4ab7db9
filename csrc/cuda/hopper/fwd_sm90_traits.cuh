// Tile configuration and traits of the Hopper forward (fwd_sm90_kernel.cuh
// has the kernel and its data flow): the measured tile shapes per head dim
// (FwdSm90TileConfig, FwdSm90Fp8TileConfig), and FwdSm90Traits: the tile
// sizes the kernel derives from them, the shared-memory layout and budget,
// the attn_mask scratch and the producer / consumer register split.
//
// Shared memory (every tile 1024-byte aligned, in 64-column chunks of
// [rows x 128 bytes] with TMA's 128-byte swizzle, the layout wgmma reads):
//   | Q slices [kQRing][kChunks][64][64] | K [kStages][kChunks][kBlockN][64] |
//   | V [kStages][kChunksV][kBlockN][64] | mbarriers | tile index per Q slot |
#pragma once
#include <type_traits>

#include "../../params.h"
#include "../common/fwd_softmax.cuh"

namespace flash_attn_ext {
namespace cuda {

// Tile shape per (head dim, causal): kBlockM = 128 always (two consumer
// warpgroups of 64 rows); kBlockN and the ring depth were measured (H200,
// bf16, torch 2.11, one build per row, as bench/tune_tiles.sh "sm90 D BLOCK_N
// STAGES" makes them; TFLOP/s as a fraction of cuDNN in the same run,
// S = 512 / 2k / 8k, B = 16384 / S, H = 2048 / D; ping-pong off was a
// run-time switch then, removed since):
//
//   D    kBlockN stages  ping-pong | non-causal          | causal
//   64   128     4       on        | 0.73 0.85 0.88      | 0.71 0.87 0.92
//   64   128     2       on        | 0.74 0.86 0.89  <-  | 0.72 0.87 0.92  <-
//   64   192     3       on        | 0.66 0.83 0.90      | 0.62 0.80 0.91
//   128  128     2       off       | 0.78 0.87 0.90      | 0.76 0.89 0.98
//   128  128     2       on        | 0.81 0.92 0.92      | 0.82 0.93 0.93  <-
//   128  176     2       on        | 0.81 0.88 0.98  <-  | 0.71 0.89 1.00
//   256  64      2       on        | 0.87 0.92 0.93      | 0.91 0.88 0.90
//   256  64      2       off       | 0.89 0.88 0.89      | 0.90 0.87 0.92
//   256  80      2       on        | 0.93 0.98 0.99  <-  | 0.88 0.93 0.99  <-
//
// Since then (scale folded into exp2, Q released after the last Q K^T, the
// dynamic causal scheduler) the full grid measured 0.96x cuDNN; D = 256 at
// seqlen_k <= 512 takes kBlockNShort = 64 keys: 80-key tiles leave the last
// key tile of a 512-key row 60% empty (causal: up to 25% of all visited keys).
// Measured and dropped (24-config sample, same run): the producer claiming the
// next tile when it starts the current one and prefetching that tile's Q and
// first K/V into L2 (cp.async.bulk.prefetch.tensor): 0.88x against 0.92x
// cuDNN (the early claim unbalances the causal tail; non-causal D = 128 lost
// 2-4% too); 64-key D = 256 tiles at seqlen_k = 1024: 0.89-0.90x against 0.94x.
// Session 8 (24 configs S 512-8k, rounds in alternating order): Q as two
// 64-row slices with their own barriers (each warpgroup's next slice loads
// after its own last Q K^T) and the tile's first K sent before its Q: 0.909x
// against 0.889x for one 128-row Q; a deeper Q ring (4 slots at D = 64 and
// D = 128 / 128 keys, 3 at D = 128 / 176 keys and D = 256 / 64 keys, so the
// next tile's slices load a whole tile ahead): 0.934x against 0.944x for 2;
// O stored 16 bytes per lane (store_accumulator_row) instead of 4: 0.976x
// against 0.922x (D = 256, S = 512: 0.96-0.98x from 0.81-0.83x); 176-key
// tiles at D = 64: +1% at S >= 8k, -4 to -14% at S <= 2k. Full grid after
// all of it: 1.01x (bf16), 0.997x (fp16; 1.008x re-measured in session 9 with
// three rotated rounds, as bf16). Session 12 (H100, same-machine builds, D =
// 128, S 1k-16k): 128 keys non-causal 1.008x against 176's 1.009x, 128 keys
// with 3 stages 0.996x; FlashAttention-4's 144-key D = 64 tile spills (96
// bytes, serialised wgmma) within three warpgroups' 160 registers.
// Shared memory bounds the choice: Q + 2 x stages x kBlockN x D x 2 bytes
// must fit 227 KB (D = 256, kBlockN = 80: 64 + 160 KB). FAE_SM90_BLOCK_N /
// FAE_SM90_STAGES / FAE_SM90_Q_RING override every head dim at once
// (bench/tune_tiles.sh "sm90 ...").
//
// Consumer warpgroups: three at D = 64 (192-row query tiles, 160 registers
// each), as FlashAttention 3 / 4 run it. There a warpgroup's GEMMs are short
// (64 x 128 x 64 twice per key tile) against its softmax (one exp2 per 256
// FLOPs, twice D = 128's share), so with two warpgroups the tensor cores wait
// for the softmax; with three, two warpgroups' GEMMs cover one's softmax, and
// a K / V tile feeds 192 rows instead of 128. H200, bf16, same process,
// forward TFLOP/s against FA4 / cuDNN: S = 16k 0.80 / 0.97 (two) -> 0.95 /
// 1.14 (three), causal alike; S = 2k on par with both. Short causal calls
// (seqlen_q <= kShortCausalRows) keep two: 192-row tiles there waste more of
// the last tile and of the diagonal tiles (warpgroup 0 visits the key tiles
// that only the tile's last rows see): S = 512 / 1k causal 0.84 / 0.87 of
// cuDNN with three against 0.94 / 0.95 with two. The variant kernels keep two
// (kHasVariants: their softmax state and score modifiers need the registers;
// the attn_mask summary has two 64-row blocks per tile).
// kHeadDimV: v's head dim where it is not q's (MLA's 192 / 128): 128-key
// tiles as at D = 128, as FA4 runs that shape (its V and O are D = 128's;
// 2 stages of 192-column K and 128-column V tiles fill 208 KB).
template <int kHeadDim, bool kIsCausal, bool kHasVariants = false, int kHeadDimV = kHeadDim>
struct FwdSm90TileConfig {
  static constexpr int kConsumerWarpgroups = kHeadDim <= 64 && !kHasVariants ? 3 : 2;
  static constexpr int kShortCausalRows = kConsumerWarpgroups == 3 && kIsCausal ? 1024 : 0;
#ifdef FAE_SM90_BLOCK_N
  static constexpr int kBlockN = FAE_SM90_BLOCK_N;
#else
  static constexpr int kBlockN = kHeadDim <= 64    ? 128
                                 : kHeadDim <= 128 ? (kIsCausal ? 128 : 176)
                                 : kHeadDimV < kHeadDim && kHeadDimV <= 128 ? 128
                                                                            : 80;
#endif
#ifdef FAE_SM90_STAGES
  static constexpr int kStages = FAE_SM90_STAGES;
#else
  static constexpr int kStages = 2;
#endif
  // Key tile for short key sequences (seqlen_k <= kShortSeqlenK); 0 = none.
  static constexpr int kBlockNShort = kHeadDim == 256 ? 64 : 0;
  static constexpr int kShortSeqlenK = 512;
  // Q ring slots (64-row slices, see FwdSm90Traits): one per consumer
  // warpgroup; deeper rings (3-4 with two warpgroups, where shared memory
  // allows) measured no better.
#ifdef FAE_SM90_Q_RING
  static constexpr int kQRing = FAE_SM90_Q_RING;
#else
  static constexpr int kQRing = kConsumerWarpgroups;
#endif
};

// The FP8 (e4m3) forward's tiles, 2 stages, two consumer warpgroups. D = 128
// as FlashAttention-3 runs it: 256-key tiles (each K / V^T tile feeds twice
// the keys per barrier round trip and softmax pass), P staged in shared
// memory (FwdSm90Traits::kPInSmem: S 128 + O 64 + P 32 registers would not
// fit 240 beside the addressing; shared memory Q 16 + K 64 + V^T 64 + P 32
// KB). Against the three-warpgroup 128-key kernel it replaced (H200, one
// build each, our bf16 and cuDNN in every process, S 1k / 4k / 16k):
// +5.3 / +2.5 / +3.4% non-causal, +4.3 / +6.5% causal at 4k / 16k. Causal
// calls with seqlen_q <= kShortCausalRows keep 128-key tiles on two
// warpgroups (256 keys there: -4.3% at 1k; a short causal row masks more of
// a wide tile). D = 256: 128-key tiles (a whole 128-byte swizzle row of the
// transposed V tile, see FwdSm90Traits::kFp8); its O alone is 128 registers.
template <int kHeadDim>
struct FwdSm90Fp8TileConfig {
  static constexpr int kBlockN = kHeadDim == 128 ? 256 : 128;
  static constexpr int kStages = 2;
  static constexpr int kBlockNShort = 0;
  static constexpr int kShortSeqlenK = 0;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kQRing = kConsumerWarpgroups;
  static constexpr int kShortCausalRows = kBlockN == 256 ? 1024 : 0;
  static constexpr int kShortCausalBlockN = 128;
  // Short calls transpose V in the kernel (fwd_fp8_transposes_v); measured at
  // D = 128 only, so D = 256 keeps the V^T pass.
  static constexpr bool kVtInKernel = kHeadDim == 128;
#ifdef FAE_EXP_FP8_RS224
  // Experiment: calls that read the V^T pass's output at D = 128 run
  // FlashAttention-3's 224-key tile with P in registers (RS P V; V^T in
  // 32-key chunks). 1: non-causal only; 2: causal too.
  static constexpr int kBlockNVtPass = kHeadDim == 128 ? 224 : kBlockN;
  static constexpr bool kVtPassCausal = FAE_EXP_FP8_RS224 >= 2;
#else
  static constexpr int kBlockNVtPass = kBlockN;
  static constexpr bool kVtPassCausal = false;
#endif
};

// T: the element type of q, k, v (16-bit, or e4m3); TOut: of out (T's,
// or a 16-bit type for e4m3 inputs). kConsumerWarpgroups_: 2 or 3 (see
// FwdSm90TileConfig). kHeadDimV_: v's and out's head dim where it is not q's
// and k's (DeepSeek MLA, 192 / 128): V tiles, O and the P V product are
// kHeadDimV wide.
template <typename T_, int kHeadDim_, int kBlockN_, int kStages_, int kQRing_ = 2,
          typename TOut_ = T_, int kConsumerWarpgroups_ = 2, int kHeadDimV_ = kHeadDim_,
          bool kVtInKernel_ = false>
struct FwdSm90Traits {
  using T = T_;
  using TOut = TOut_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kConsumerWarpgroups = kConsumerWarpgroups_;
  static constexpr int kBlockM = 64 * kConsumerWarpgroups;  // one wgmma M per consumer
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kNThreads = 128 * (1 + kConsumerWarpgroups);
  static constexpr int kConsumerWarps = 4 * kConsumerWarpgroups;

  // FP8 (e4m3 inputs): m64nNk32 wgmmas, which read both operands K-major, so
  // V arrives transposed ([head_dim rows x keys], params.v_transposed) and
  // O += P V reads it like K; P goes to e4m3 with an exponent offset
  // (kPExp2Offset); the descales scale the scores and O.
  static constexpr bool kFp8 = sizeof(T) == 1;
  static constexpr int kElemBytes = sizeof(T);
  // 128-byte swizzle atoms hold 64 16-bit or 128 e4m3 columns: tiles are
  // stored as kChunks chunks of [rows x kChunkCols].
  static constexpr int kChunkCols = 128 / kElemBytes;
  static constexpr int kChunks = kHeadDim / kChunkCols;
  static constexpr int kChunksV = kHeadDimV / kChunkCols;
  // One wgmma k-step reads 32 bytes of every row: 16 16-bit or 32 e4m3 columns.
  static constexpr int kKStep = 32 / kElemBytes;
  static constexpr int kKTileBytes = kBlockN * kHeadDim * kElemBytes;
  static constexpr int kVTileBytes = kBlockN * kHeadDimV * kElemBytes;
  // FP8: the transposed V tile is kVtChunks chunks of [kHeadDim x kVtChunkKeys],
  // whole rows of a TMA / wgmma swizzle atom: 128 keys (128-byte swizzle), or
  // 32 keys (32-byte swizzle, one k-step) where the tile is not whole 128-key
  // rows (224 keys: 7 k-steps).
  static constexpr int kVtChunkKeys = !kFp8 ? 0 : kBlockN % 128 == 0 ? 128 : 32;
  static constexpr int kVtChunks = kFp8 ? kBlockN / kVtChunkKeys : 0;
  // FP8: P = exp2(x + 8) (rows sum and O alike, so O / rowsum is unchanged):
  // probabilities in [0, 256] use e4m3's range (max 448) instead of its
  // subnormals below 2^-6; the LSE takes the 8 off again.
  static constexpr int kPExp2Offset = kFp8 ? 8 : 0;
  // FP8 with 256-key tiles (or three consumer warpgroups, whose 160
  // registers have no room for P either): P is staged in shared memory per
  // warpgroup ([kBlockN / 128][64 rows][128 B], the K-major layout of a Q
  // slice) and O += P V is an SS wgmma, which frees P's registers.
  static constexpr bool kPInSmem = kFp8 && (kConsumerWarpgroups == 3 || kBlockN == 256);
  // The softmax's exponentials run under the warpgroup's own P V only where
  // keep_above_next_wait holds ptxas's wgmma wait below them (fwd kernel).
  // Measured on an H200 (S 1k-16k, A/B builds on one machine): D = 256
  // non-causal +2..+3.5% at S >= 4k (otherwise within +-1%), D = 128 within
  // +-2%, D = 64 -2..-6%; so it is on for D = 256 and for the staged-P FP8
  // kernel, which was measured with it (docs/PERFORMANCE.md).
#ifdef FAE_EXP_FP8_RS224_OVERLAP
  static constexpr bool kSoftmaxUnderOwnPv = kHeadDim == 256 || kPInSmem || kFp8;
#else
  static constexpr bool kSoftmaxUnderOwnPv = kHeadDim == 256 || kPInSmem;
#endif
  static constexpr int kPBufferBytes = kPInSmem ? 64 * kBlockN * kElemBytes : 0;
  // kVtInKernel_ (FP8, short calls: fwd_fp8_transposes_v): the producer
  // warpgroup makes V^T from V in shared memory (fwd_sm90_transpose_v.cuh)
  // instead of reading the V^T pass's output; V's tile arrives in one staging
  // buffer laid out like a K tile. Shared memory: 176 + 32 KB at D = 128.
  static constexpr bool kVtInKernel = kVtInKernel_;
  static_assert(!kVtInKernel || kFp8, "only e4m3 V is transposed");
  static constexpr int kVStagingBytes = kVtInKernel ? kKTileBytes : 0;
  // Q travels in 64-row slices, one per consumer warpgroup, through a ring of
  // kQRing slots with a full/empty barrier pair each: slice u = 2 * tile +
  // warpgroup goes to slot u % kQRing. With 2 slots a warpgroup's next slice
  // loads once that warpgroup ran its last Q K^T (not waiting for the other
  // one); every slot beyond 2 lets one more slice load a whole tile ahead.
  static constexpr int kQRing = kQRing_;
  static constexpr int kQSliceRows = 64;
  static_assert(kQSliceRows == kMaskBlock,
                "a warpgroup's rows are one row block of the attn_mask summary");
  static constexpr int kQSliceBytes = kQSliceRows * kHeadDim * kElemBytes;
  // mbarriers, then what the producer hands to the consumers: per Q slot the
  // tile index and its key-tile range (3 ints), per K stage which warpgroups
  // must read the attn_mask there (attn_mask kernels).
  // kVtInKernel: one more mbarrier (the staging buffer's) and its word.
  static constexpr int kBarrierBytes = 8 * (2 * kQRing + 4 * kStages) + 12 * kQRing + 4 * kStages +
                                       (kVtInKernel ? 16 : 0);
  // +1024: the dynamic shared memory base is only 16-byte aligned.
  static constexpr int kSmemBytes = kQRing * kQSliceBytes + kStages * (kKTileBytes + kVTileBytes) +
                                    kConsumerWarpgroups * kPBufferBytes + kVStagingBytes +
                                    kBarrierBytes + 1024;

  // attn_mask kernels: scratch for a 16-bit additive mask's values, staged per
  // consumer warp (fwd_softmax.cuh, stage_attn_mask) where shared memory has
  // room (D = 64 / 128), in kMaskBuffers buffers of one key tile each: tile i's
  // copies are issued kMaskBuffers - 1 tiles ahead, while tile
  // i - kMaskBuffers + 1's GEMMs run. Two at D = 64, whose GEMMs are too short
  // to hide the copies' latency (H100, [1, H, S, S] bf16 bias: 4% faster),
  // one at D = 128 (two measured 2% slower); +16 aligns the scratch after the
  // barriers (16-byte cp.async).
  static constexpr int kMaskBuffers = kHeadDim <= 64 ? 2 : 1;
  static constexpr int kMaskScratchBytes =
      kConsumerWarps * kMaskBuffers * kStagedMaskWarpBytes<kBlockN>;
  static constexpr bool kStageAttnMask =
      kBlockN % 64 == 0 && kSmemBytes + kMaskScratchBytes + 16 <= 227 * 1024;
  static constexpr int kSmemBytesAttnMask =
      kSmemBytes + (kStageAttnMask ? kMaskScratchBytes + 16 : 0);

  // setmaxnreg splits the 64K registers: 24 / 240 with two consumer
  // warpgroups; 32 / 160 with three (24 would leave 162, and the counts
  // must be multiples of 8).
  static constexpr int kProducerRegs = kConsumerWarpgroups == 3 ? 32 : 24;
  static constexpr int kConsumerRegs = kConsumerWarpgroups == 3 ? 160 : 240;

  static_assert(sizeof(T) == 2 || sizeof(T) == 1, "16-bit or e4m3 inputs");
  static_assert(sizeof(TOut) == 2, "16-bit outputs");
  static_assert(kFp8 || std::is_same<T, TOut>::value, "16-bit inputs give their own type");
  static_assert(!kFp8 || kBlockN % 32 == 0,
                "FP8: the transposed V tile is whole 32-key swizzle rows");
  static_assert(!kVtInKernel || kBlockN % 128 == 0,
                "V^T made in the kernel is stored in 128-byte swizzle rows");
  static_assert(kHeadDim % kChunkCols == 0 && kHeadDimV % kChunkCols == 0,
                "head dims must be whole numbers of 128-byte chunks");
  static_assert(!kFp8 || kHeadDimV == kHeadDim, "FP8: V^T tiles are laid out like K's");
  static_assert(kBlockN % 16 == 0 && kBlockN >= 64 && kBlockN <= 256,
                "wgmma N (key tile) must be a multiple of 16 in [64, 256]");
  static_assert(kBlockN % 8 == 0, "swizzle atoms are 8 rows");
  static_assert(kHeadDim <= 256 && kHeadDimV <= 256, "wgmma N (head dim) is at most 256");
  static_assert(kStages >= 2, "the ring needs at least two stages to overlap loads");
  static_assert(kConsumerWarpgroups == 2 || kConsumerWarpgroups == 3,
                "two or three consumer warpgroups (named barriers, register split)");
  static_assert(kQRing >= kConsumerWarpgroups, "one Q slot per consumer warpgroup at least");
  static_assert(kQSliceRows * kConsumerWarpgroups == kBlockM, "a Q slice per warpgroup's rows");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory budget of one CTA per SM");
  static_assert(!kVtInKernel || (12 * kQRing + 4 * kStages) % 8 == 0,
                "the staging buffer's mbarrier (after the words) is 8-byte aligned");
  static_assert(128 * kProducerRegs + 128 * kConsumerWarpgroups * kConsumerRegs <= 65536,
                "register file split between producer and consumers");
};

}  // namespace cuda
}  // namespace flash_attn_ext
