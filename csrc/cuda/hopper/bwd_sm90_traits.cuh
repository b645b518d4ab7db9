// Tile shapes, shared-memory layout and register budget of the Hopper
// backward (bwd_sm90_kernel.cuh has the kernel and its data flow).
//
// Grid: one CTA per (key tile, head, batch). The head is the query head, or
// for GQA (heads > heads_k) the kv head: its CTA walks the query tiles of
// every query head of the group in turn (the kernel's kWalkGroup), keeping
// dK / dV in registers across them and writing them once per kv head. The
// walk's steps go through the Q/dO ring, the dS^T and dQ buffers and the
// mbarriers exactly as one head's steps do; only the step words below are
// its own.
//
// How the two consumers share the work depends on the head dim (the dK + dV
// accumulators cost kHeadDim fp32 registers per thread for 64 keys):
//
//   D = 64, 128 ("key split", 128 keys per CTA): consumer w owns keys
//     [64w, 64w + 64) and runs every product above for them. dQ = dS K sums
//     over keys, so dS^T of both consumers is shared through shared memory
//     (stmatrix; one 256-thread barrier per step, dS double-buffered) and
//     each consumer sums its part of dQ_i over all 128 keys: D = 128 (64-query
//     steps) one 64-column half, D = 64 (128-query steps) its 64 query rows,
//     all columns. Each consumer's dQ_i partial goes to its own
//     shared-memory buffer (two used in turn; one at D = 64, where shared
//     memory is full) for its dQ writer.
//
//   D = 256 ("head-dim split", 64 keys per CTA): 256 accumulator registers
//     would not fit, so both consumers work on the same 64 keys and consumer w
//     owns head-dim columns [128w, 128w + 128) of dK, dV and dQ. The two
//     64 x 64 x 256 score products are split instead of duplicated:
//
//       consumer 0:  S^T -> P^T --(fp32 P^T, smem)--> | dV_0 | <-- dS^T -- | dK_0 dQ_0
//       consumer 1:  dP^T ------------------ wait P^T | dS^T -> smem, dV_1 | dK_1 dQ_1
//
//     (named barriers kPReady and kDsReady, both consumers sync on each.)
//     A consumer's dQ_i chunks (2 x 64 columns) are staged in its own column
//     half of the step's Q and dO tiles, which nothing else reads by then; the
//     stage returns to the producer once the TMA has read them.
//
//   D = 192 / D_v = 128 (DeepSeek MLA's training shape; kHeadDimV): the
//     head-dim split on 64 keys. S^T reads K / Q in 3 chunks; dP^T the same 3
//     k-chunks of V / dO, whose third is zeroed once (the TMA loads two), so
//     both consumers issue the same wgmmas. dV: consumer w owns columns
//     [64w, 64w + 64). dK and dQ (96 columns each) go as a 64- and a 32-column
//     piece: consumer 0 [0, 64) + [64, 96), consumer 1 [128, 192) + [96, 128)
//     (a 32-column piece may start 32 columns into a swizzle atom). dQ is
//     staged in a 24 KB buffer per consumer (3 boxes), not in the Q / dO
//     stage. 226 KB of shared memory. The variants keep the padded D = 256
//     kernel (bwd_kernel_head_dim).
//
// Measured (H100 SXM, bf16, ours / cuDNN geomean, S 512/2k/8k, causal and not,
// cuDNN in the same process; docs/PERFORMANCE.md has the tables and A/B runs):
//
//   dQ and row statistics                         D=64   D=128  D=256
//   fp32 atomics from the math warps               0.71   0.78   0.78
//   TMA reduce-adds (this kernel's dQ path)        0.80   0.93   1.05
//   + lse / D rows in shared memory, bulk-copied   0.95   0.99   1.07
//   + dQ writer threads, one CTA per key tile      0.94   0.99   1.09
//   + 128-query steps at D = 64                    1.03   0.99   1.09
//   (the last two rows: 6-12 configs per head dim, S 512-16k)
//   dS^T by stmatrix (key split; same process,
//     S 2k-16k, 6 configs): D=64 0.99 -> 1.02, D=128 0.96 -> 0.96
//   dQ issued before dK, staged under dK's wgmma
//     (key split; same process, 12 configs per
//     head dim, S 512-16k):  D=64 1.07 -> 1.10, D=128 1.01 -> 1.04
//   docs/PERFORMANCE.md has the tables.
//
//   deterministic mode: the same kernel, the key tiles' dQ adds into each
//   query tile ordered through counters (the dQ writer; 1.08x the time of
//   the default mode, geomean of 18 configs, at most 1.26x).
//
//   tried and dropped (same process):
//   D=64 (64-query steps): 3 Q/dO stages           0.79 against 0.80
//   dQ over a consumer's own 64 keys (all columns,
//     no 256-thread barrier, 2x the reduce bytes)  0.73 against 0.79
//   dQ staged / sent under the next step's wgmmas  0.90 against 0.93
//   all: grid (batch * heads, key tiles), the
//     causal grid's longest tiles first globally   0.72 against 0.99 (L2)
//   non-causal: each CTA's query walk rotated by
//     its key tile (dQ adds spread over rows)      no gain beyond +-2% noise
//   D=256: dS^T by stmatrix / ldmatrix             1-6% slower
//   key split, 12 configs per head dim, S 512-16k (before "dQ before dK"):
//   dQ of step i - 1 issued behind step i's S^T /
//     dP^T (two 32-column halves: all 64 columns
//     under the softmax spill)   D=64 1.07 -> 1.01, D=128 1.01 -> 0.98
//   D=128: 3 Q/dO stages, one dQ buffer per
//     consumer (shared memory)   1.005 -> 0.989; with dQ before dK
//                                1.043 -> 1.003
//   (H200, 2026-11-27, same-machine builds, 12 configs S 1k-16k; time ratios)
//   causal mask test under a branch (diagonal
//     steps only; ptxas predicated it on all)  D=64 0.99-1.02, D=128 causal 1.03-1.06
//   row statistics in reading order, 16-byte
//     loads (half the LDS)        D=64 causal 0.98, full 1.01; D=128 full 0.99,
//                                 causal 1.02-1.03; geomean vs cuDNN unchanged
//   (wgmma descriptors advanced by one add, kept: D=64 0.97-0.99, D=128 noise;
//   30% fewer consumer instructions: the step is latency-bound, not issue-bound)
//   (H100, 2026-11-28, the same method)
//   main kernel as the preprocess kernel's
//     programmatic dependent launch             -1.5% .. +1.5%, geomean unchanged
//   (dV before the dP^T wait: not measured yet, the build that ran was
//   main's; branch exp/overlap)
//   dQ staging without its 2-way bank conflict (H100, 2026-11-28, measured
//   again against the commit before it): D=128 1-5% faster, D=64 noise,
//   D=256 0.90x, so kept where dQ is staged once per step
//   (kDqStagingAlternatesRows)
//   D = 192 / 128 with a kernel of its own instead of padded to 256: 1.8x
//   (0.81-0.85x FlashAttention-4, S = 8k, causal and not)
//   D = 128 non-causal, 80-query steps (dQ transposed) against 64-query
//   steps (H100, 2026-12-07, one build, S 1k-16k, two rounds): 1.032x
//   geomean, 1.04-1.08x at 16k; causal (same method, one round): 0.98x at
//   1k, 1.015x at 4k, 1.05x at 16k, so from 4096 query rows on
//   D = 128 variant kernels (window, softcap, ALiBi, attn_mask, dropout)
//   with the flat dQ accumulator instead of the boxes (H100, 2026-12-07,
//   one round): softcap / dropout backward 1.02-1.05x
//
// Shared memory (tiles in 64-column chunks of [rows x 128 B], TMA's 128-byte
// swizzle; every tile 1024-byte aligned):
//   | K [kChunks][kBlockN][64] | V | Q [kStages][kChunks][64][64] | dO [...] |
//   | dS^T [kDsBuffers][kBlockM / 64][kBlockN keys][64 queries] | dQ [consumers][kDqBuffers][boxes][64][32] fp32
//     (key split) | P^T (head-dim split) | lse (log2), D [kStages][2][64] fp32 | mbarriers, step words |
//   80-query steps (kDqTransposed): Q / dO stages [kChunks][80][64]; dS (not
//   dS^T) [kDsBuffers][kBlockN / 64 key chunks][80 queries][64 keys]; dQ^T
//   [consumers][80 x 64 fp32 in fragment order]: 231,792 of 232,448 bytes.
#pragma once
#include "sm90_primitives.cuh"

namespace flash_attn_ext {
namespace cuda {

// kHeadDimV_: v's (and dO's, dV's) head dim where it is not q's (DeepSeek
// MLA's 192 / 128 training shape, head-dim split only): see the MLA note in
// the file comment. kBlockM_: the queries per step where not the head dim's
// default (kBlockM below); 80 at D = 128 (kDqTransposed).
template <typename T_, int kHeadDim_, int kHeadDimV_ = kHeadDim_, int kBlockM_ = 0>
struct BwdSm90Traits {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr bool kSplitHeadDim = kHeadDim > 128;  // see the file comment
  static constexpr int kBlockN = kSplitHeadDim ? 64 : 64 * kConsumerWarpgroups;  // keys
  // Queries per step (wgmma N of S^T). D = 64: 128, as FlashAttention-3
  // takes: twice the GEMM work per step's fixed costs (the dS barrier, the
  // waits, the dQ hand-over), and the registers allow it there (S^T and dP^T
  // 64 each, dK + dV 64 per thread); at D = 128 dK + dV alone take 128.
  // D = 128 plain calls with the flat dQ accumulator take 80-query steps
  // (kBlockM_ = 80, bwd_sm90.h bwd_sm90_flat_dq_rows), as
  // FlashAttention-3 / -4 do there: 25% more GEMM work per step's fixed
  // latencies (the waits, the dS^T barrier, the dQ hand-over). 80 is not a
  // multiple of wgmma's M, so dQ is computed transposed (kDqTransposed):
  // dQ^T = K^T dS^T with the head dim on M (each consumer its 64-column half
  // over all 128 keys), dS stored query-major (keys contiguous, stmatrix
  // .trans) as its K-major B operand, and the fp32 dQ^T fragments staged flat
  // for the convert kernel to un-permute. Causal calls take them only from
  // kBwdSm90CausalQ80MinRows query rows on (the diagonal's masked work grows
  // with the step).
  static constexpr int kBlockM = kBlockM_ != 0 ? kBlockM_ : kHeadDim == 64 ? 128 : 64;
  static constexpr bool kDqTransposed = kBlockM == 80;
  // Q/dO ring depth. 3 stages at D = 64 (64-query steps) measured no faster
  // (H100, 6 configs: 0.79x against 0.80x cuDNN geomean); D = 128 has no room
  // for a third.
  static constexpr int kStages = 2;
  static constexpr int kNThreads = 128 * (1 + kConsumerWarpgroups);

  static constexpr int kChunkCols = 64;
  static constexpr int kChunks = kHeadDim / kChunkCols;
  // V and dO carry kChunksV chunks; their tiles keep kChunks chunks of room,
  // the ones past kChunksV zeroed once, so that dP^T runs the same k-steps as
  // S^T (the head-dim split's consumers issue the same wgmmas).
  static constexpr int kChunksV = kHeadDimV / kChunkCols;
  // dK (and dQ) / dV columns per consumer (each owns 64 keys of them).
  static constexpr int kGradCols = kSplitHeadDim ? kHeadDim / kConsumerWarpgroups : kHeadDim;
  static constexpr int kGradColsV = kSplitHeadDim ? kHeadDimV / kConsumerWarpgroups : kHeadDimV;
  // A consumer's dK / dQ columns as wgmma pieces: kGradColsA (whole 64-column
  // chunks) and kGradColsB (0, or 32 at D = 192). dK and dQ read Q and K
  // MN-major, and a descriptor can start a piece only at a 64-column swizzle
  // atom or 32 columns into one for at most 32 columns (issue_dq_chunk). So
  // 96-column halves go as 64 + 32: consumer 0 columns [0, 64) + [64, 96),
  // consumer 1 [128, 192) + [96, 128); the same wgmma shapes on both
  // consumers (wgmmas under a warpgroup branch would be serialised).
  static constexpr int kGradColsA = kGradCols / 64 * 64;
  static constexpr int kGradColsB = kGradCols - kGradColsA;
  static FAE_DEVICE int grad_col_a(int w) { return w * (kHeadDim - kGradColsA); }
  static FAE_DEVICE int grad_col_b(int w) { return kGradColsA + w * (kGradCols - kGradColsA); }
  static FAE_DEVICE int grad_col_v(int w) { return kSplitHeadDim ? w * kGradColsV : 0; }
  // A step's dQ rows, each summed over all kBlockN keys, by wgmmas of kDqRows
  // queries x kDqCols columns (one sum over the CTA's keys has half the
  // reduce-add traffic of one per consumer). 128-query steps (kDqByRows):
  // consumer w takes query rows [64w, 64w + 64), every column; 64-query
  // steps: every row, its half of the columns, in kDqChunks chunks.
  // kDqTransposed: 80 rows x 64 columns per consumer, one dQ^T wgmma of
  // M = 64 columns, N = 80 queries.
  static constexpr bool kDqByRows = kBlockM == 128;
  static constexpr int kDqRows = kDqTransposed ? kBlockM : 64;
  static constexpr int kDqCols = 64;
  static constexpr int kDqChunks = (kDqByRows ? kHeadDim : kHeadDim / kConsumerWarpgroups) / kDqCols;
  // A consumer's dQ chunk accumulator: [kDqAccN / 8][4] fp32 (wgmma's N: the
  // columns, or the queries of dQ^T).
  static constexpr int kDqAccN = kDqTransposed ? kBlockM : kDqCols;

  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;  // one Q (or dO) stage
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;
  // dS^T double-buffered (the key split then needs one barrier per step).
  static constexpr int kDsBuffers = 2;
  // Head-dim split: consumer 0 hands P^T to consumer 1 in fp32 (dS = P o (dP - D)
  // keeps full precision), 8 float4 per thread, thread-major: conflict-free.
  static constexpr int kPBytes = kSplitHeadDim ? 64 * kBlockM * 4 : 0;
  // dQ leaves through shared memory and TMA reduce-adds: each consumer's
  // 64 x kDqCols fp32 chunk in boxes of 32 columns (128 bytes, one swizzle
  // row). Key split: two buffers per consumer, used in turn, so that a step's
  // writes never wait for the TMA to finish reading the previous step's; one
  // with 128-query steps (no room for two; the TMA has read the chunk long
  // before the next step's is ready).
  // Head-dim split (no shared memory left): a consumer's two chunks go into
  // its own column half of the step's Q tile and dO tile (16 KB each), which
  // only its own dK / dV products still read by then; the stage is released
  // to the producer once the TMA has read them (kDqInQdoStage).
  // D = 192 / 128 (kGradColsB > 0): the dQ pieces (64 + 32 columns) go to a
  // buffer of its own per consumer (3 boxes, 24 KB), one per consumer (the
  // Q / dO halves do not hold 96 columns in whole boxes).
  static constexpr bool kDqPieces = kSplitHeadDim && kGradColsB > 0;
  static constexpr bool kDqInQdoStage = kSplitHeadDim && !kDqPieces;
  static constexpr int kDqBoxCols = 32;
  // Odd rows stage column group j ^ 2 (stage_dq: no 2-way bank conflict, at
  // the price of a select per value). Where dQ is staged once per step, off
  // the wgmma chain, that wins (D = 128: 1-5%); with kDqInQdoStage (D = 256)
  // each chunk is issued, waited for and staged in turn, so the selects sit
  // on the step's critical path: 0.90x there (H100, 2026-11-28).
  static constexpr bool kDqStagingAlternatesRows = !kDqInQdoStage;
  static constexpr int kDqBuffers = kDqByRows || kDqPieces || kDqTransposed ? 1 : 2;
  static constexpr int kDqBufferCols = kDqPieces ? kGradCols : kDqCols;
  static constexpr int kDqBufferBytes = kDqRows * kDqBufferCols * 4;
  static constexpr int kDqBoxes = kDqBufferCols / kDqBoxCols;  // per buffer
  static constexpr int kDqSmemBytes =
      kDqInQdoStage ? 0 : kConsumerWarpgroups * kDqBuffers * kDqBufferBytes;
  // Arrivals that release a Q/dO stage: every consumer thread, after its last
  // read of it, and with kDqInQdoStage the two dQ writers after the TMA read.
  // One per warp would do as well, but compute-sanitizer racecheck then
  // reports the lanes' row-stat reads as racing with the next TMA write.
  static constexpr int kQdoReleases = 128 * kConsumerWarpgroups + (kDqInQdoStage ? 2 : 0);
  // One stage's lse (log2) and D rows (kBlockM floats each), bulk copies from
  // the padded row statistics (params.h) that complete with Q and dO.
  static constexpr int kRowStatBytes = 2 * kBlockM * 4;
  // GQA walk (kWalkGroup): the loader publishes each step's query tile and
  // head (a word pair: m_block, g) for the consumers and dQ writers, in a ring of
  // kStepWords pairs. The loader writes step j's pair after qdo_empty of step
  // j - kStages, i.e. after the consumers' last arrive of that step, which
  // comes after their dq_empty wait for step j - kStages - kDqBuffers (key
  // split; head-dim split: qdo_empty also waits for the dQ writers of step
  // j - kStages): so every reader of step j - kStepWords is done with it.
  static constexpr int kStepWords = 4;
  static_assert(kStepWords >= kStages + kDqBuffers, "step words outlive their readers");
  // kv_full, qdo_full / qdo_empty per stage, dq_full / dq_empty per consumer
  // and dQ buffer; then a word per stage (attn_mask kernels: which consumers
  // read the mask on the step) and the step words.
  static constexpr int kBarrierBytes =
      8 * (1 + 2 * kStages + 2 * kConsumerWarpgroups * kDqBuffers) + 4 * kStages + 8 * kStepWords;
  // +1024: the dynamic shared memory base is only 16-byte aligned.
  static constexpr int kSmemBytes = 2 * kKVBytes + 2 * kStages * kQBytes + kDsBuffers * kDsBytes +
                                    kDqSmemBytes + kPBytes + kStages * kRowStatBytes + kBarrierBytes +
                                    1024;

  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  static_assert(sizeof(T) == 2, "16-bit inputs only");
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256 || kHeadDim == 192,
                "dK + dV accumulators (2 kGradCols / 2 fp32 registers per thread) must leave "
                "room for S^T, dP^T and dQ within 240 registers");
  static_assert(kHeadDimV == kHeadDim || (kSplitHeadDim && kHeadDimV < kHeadDim &&
                                          kGradColsV % 64 == 0),
                "v's own head dim: head-dim split only, dV in whole 64-column chunks");
  static_assert(kHeadDim != 192 || kHeadDimV == 128,
                "D = 192 only as MLA's 192 / 128 (shared memory: 226 KB)");
  static_assert(kGradColsB == 0 || kGradColsB == 32, "a 32-column piece at most");
  static_assert(kGradCols <= 128, "at most 128 dK/dV columns per consumer (register budget)");
  static_assert(kBlockM == 64 || (kBlockM == 128 && !kSplitHeadDim) ||
                    (kBlockM == 80 && kHeadDim == 128 && kHeadDimV == 128),
                "dS^T holds 64-query chunks of 128-byte swizzle rows; 128-query steps only "
                "with the key split; 80-query steps (dQ transposed) only at D = 128");
  static_assert(!kDqTransposed || (kDqBuffers == 1 && kDqChunks == 1 && kBlockM % 16 == 0),
                "80-query steps: one 80 x 64 dQ^T chunk per consumer, one buffer (shared "
                "memory), whole 16-query k-steps for dV / dK");
  static_assert(kDqPieces ||
                    (kDqByRows ? kDqRows * kConsumerWarpgroups == kBlockM && kDqChunks * kDqCols == kHeadDim
                               : kDqRows == kBlockM && kDqChunks * kDqCols * kConsumerWarpgroups == kHeadDim),
                "dQ rows or columns split evenly between the consumers");
  static_assert(kDqCols % kDqBoxCols == 0, "dQ chunks are whole 32-column boxes");
  static_assert(kDqPieces || (kDqInQdoStage ? kDqChunks == 2 &&
                                                 kDqBufferBytes == kGradCols / 64 * kBlockM * 128
                                           : kDqChunks == 1),
                "dQ staging: one chunk per key-split consumer and step; a head-dim-split "
                "consumer's two chunks each fill its column half of the Q or dO tile");
  static_assert(!kDqInQdoStage || kDqBuffers == kStages, "head-dim split: one dQ buffer per stage");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory budget of one CTA per SM");
  static_assert(128 * kProducerRegs + 128 * kConsumerWarpgroups * kConsumerRegs <= 65536,
                "register file split between producer and consumers");
};

}  // namespace cuda
}  // namespace flash_attn_ext
