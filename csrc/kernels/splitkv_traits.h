// Compile-time configuration of the split-KV kernel: tile sizes, shared-memory layouts, WGMMA shapes,
// the page-segment bookkeeping and the shared-memory plan.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include <type_traits>

#include <cutlass/numeric_types.h>

#include "params.h"
#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN

// The two warpgroups of a CTA. Pages of a piece are taken in pairs (a, b) = (2j, 2j + 1):
//   kPageA computes S = Q K_a^T and its softmax, and owns O[:, 0:256];
//   kPageB computes S = Q K_b^T and its softmax, and owns O[:, 256:512].
// Each applies both pages' probabilities to its half of O (see mainloop.h for the schedule).
// Two kernels add a third warpgroup so that the two above only compute: sparse decoding's gathers and dequantises
// the pages (kGather, sparse_gather.h); the FP8 cache with an e4m3 q's widens each V unit to fp16 once S has read
// its bytes (kWiden, mainloop.h "FP8 cache").
enum class WarpgroupRole : int { kPageA = 0, kPageB = 1, kGather = 2, kWiden = 2 };

// The parts of a page buffer the computing warpgroups release to the gather warpgroup (sparse decoding), each once
// its last reader is done with it: the RoPE unit after S, each V half after its last P V.
enum GatherPart : int { kRopePart = 0, kVLeftPart = 1, kVRightPart = 2, kGatherParts = 3 };

// SharedStorage::probs_posted[event] completes (once per pair) when the mailbox holds
enum MailboxEvent : int {
  kPageAPosted = 0,    // P_a, m_a and rowsum_a from kPageA (and its S_a is complete)
  kPageBPosted = 1,    // P_b, m_b and l from kPageB (and its S_b is complete; it has read kPageA's slots)
};

// The "element" of a sparse FP8 cache (DeepSeek-V3.2): 656-byte tokens gathered by index (sparse_gather.h). One
// byte, as an e4m3 latent value is: the page buffers use the FP8 cache's unit geometry.
struct SparseFp8Token {
  uint8_t byte;
};

// Element: the WGMMA operand type of Q, K, V and P (bf16 or fp16). CacheElement: the KV cache's element, the same
// type, e4m3 (an FP8 cache: its pages are copied as bytes and widened to fp16 in shared memory, exactly, by the
// warpgroup that computes S on them, or with kE4m3Scores only V by a third warpgroup; see mainloop.h "FP8 cache"),
// or SparseFp8Token (gathered tokens, dequantised to fp16; mainloop.h "Sparse FP8 cache").
// kE4m3Scores (FP8 cache with an e4m3 q): S = Q K^T runs on the e4m3 tensor cores straight from the copied bytes
// (Q and the page both K-major with the 128-byte swizzle), and only V is widened, after S, by the third warpgroup
// (mainloop.h).
template <class Element_, class CacheElement_ = Element_, bool kE4m3Scores_ = false>
struct SplitKvTraits {
  using Element = Element_;
  using CacheElement = CacheElement_;
  static constexpr bool kSparse = std::is_same_v<CacheElement, SparseFp8Token>;
  static constexpr bool kFp8Cache = sizeof(CacheElement) == 1 && !kSparse;
  static constexpr bool kE4m3Scores = kE4m3Scores_;
  static_assert(!kE4m3Scores || kFp8Cache, "e4m3 scores need the FP8 cache's bytes");
  static_assert(sizeof(Element) == 2 && (!kFp8Cache || std::is_same_v<Element, cutlass::half_t>),
                "16-bit math; an e4m3 cache widens to fp16, which holds every e4m3 value exactly");
  static_assert(!kSparse || std::is_same_v<Element, cutlass::half_t>,
                "sparse decoding: latent dequantised to fp16 (a power of two per page taken out), RoPE bf16");
  static constexpr int kBlockM = kRowsPerTile;              // 64 query rows
  static constexpr int kBlockN = kPageBlockSize;            // 64 keys: one page
  static constexpr int kNumWarpgroups = 2;                                // the computing warpgroups
  static constexpr int kWarpgroupThreads = 128;
  static constexpr int kMathThreads = kNumWarpgroups * kWarpgroupThreads;
  // The third warpgroup: sparse decoding's gather, or the e4m3-scores kernel's V widening.
  static constexpr int kHelperWarpgroups = kSparse || kE4m3Scores ? 1 : 0;
  static constexpr int kThreads = kMathThreads + kHelperWarpgroups * kWarpgroupThreads;
  // With a third warpgroup, registers per thread after setmaxnreg (multiples of 8): the computing warpgroups hold O,
  // S and P, the third copies and dequantises page b (sparse) or widens V. The split may use no more than the CTA
  // got at launch (168 a thread at 384 threads): setmaxnreg.inc waits for registers the other warpgroups gave back,
  // forever if they never can.
  static constexpr int kLaunchRegisters = 64 * 1024 / kThreads / 8 * 8;
  // Sparse: page a's latent units are dequantised by kPageA itself, page b's by the gather warpgroup (measured
  // against page b by kPageB, and each S warpgroup its left V halves: docs/PERF.md). The warpgroup that dequantises
  // gets the registers for it (240: it also keeps the P V frame, sparse_gather.h; 232 spilled), kPageB 192 (no
  // spills from 192 to 216), the gather warpgroup 72 (its second unit's fp16 conversions spilled at 56). 72 / 192
  // against 64 / 200 measured the b = 128 rows 1.5-3 % faster (H200, docs/PERF.md), the small rows the same.
  static constexpr int kSelfDequantisedStage = 0;
  static constexpr bool self_dequantises(int stage) { return stage == kSelfDequantisedStage; }
  // e4m3 scores: both S warpgroups 232 (no spills down to 224), the widening warpgroup 40 (it spilled at 32; 224 /
  // 224 / 56 with four passes of loads in flight measured the same, H200).
  static constexpr int kPageARegisters = kSparse ? 240 : 232;
  static constexpr int kPageBRegisters = kSparse ? 192 : 232;
  static constexpr int kHelperRegisters = kSparse ? 72 : 40;
  static_assert(!kHelperWarpgroups || kWarpgroupThreads * (kPageARegisters + kPageBRegisters + kHelperRegisters) <=
                                kThreads * kLaunchRegisters,
                "the register split fits what the CTA holds");
  static constexpr int kColsPerWarpgroup = kHeadDimV / kNumWarpgroups;    // 256: N of O = P V (WGMMA max)
  static constexpr int kVecElems = 16 / sizeof(Element);                  // one cp.async moves 16 bytes
  static constexpr int kStages = 2;                                       // page buffers: a and b of a pair

  // A page (and the Q tile) is copied and waited for in 64-column segments: one 128-byte swizzle atom row.
  static constexpr int kSegmentCols = 128 / sizeof(Element);                           // 64
  static constexpr int kSegments = kHeadDimQK / kSegmentCols;                          // 9
  static constexpr int kRopeSegment = kSegments - 1;                                   // 8: columns 512..575
  static constexpr int kSegmentsPerVHalf = kColsPerWarpgroup / kSegmentCols;           // 4
  static constexpr int kKBlocksPerSegment = kSegmentCols / 16;                         // 4 WGMMA K steps
  static constexpr uint32_t kSegmentBytes = kBlockN * kSegmentCols * sizeof(Element);     // 8 KiB: 64 rows of 128 bytes
  static_assert(kHeadDimQK % kSegmentCols == 0 && kHeadDimV % kSegmentCols == 0, "whole segments");
  static_assert(kRopeSegment * kSegmentCols == kHeadDimV, "the last segment is exactly the RoPE part");
  static_assert(kColsPerWarpgroup <= 256, "WGMMA N is at most 256");

  // A page is copied (TMA) and waited for in units of 128-byte rows: one unit is 64 columns of a 16-bit cache
  // (exactly one segment) or 128 columns of an fp8 cache (two segments once widened). An fp8 page has 4.5 units:
  // the RoPE unit's box starts at column 512 and its columns 576..639 lie past the cache row, which TMA fills
  // with zeros without reading memory. Every unit lands in the shared memory of its first segment, 8 KiB.
  static constexpr int kUnitCols = 128 / sizeof(CacheElement);                         // 64 or 128
  static constexpr int kSegmentsPerUnit = kUnitCols / kSegmentCols;                    // 1 or 2
  static constexpr int kUnits = (kHeadDimQK + kUnitCols - 1) / kUnitCols;              // 9 or 5
  static constexpr int kRopeUnit = kUnits - 1;                                         // columns 512..
  static constexpr int kUnitsPerVHalf = kColsPerWarpgroup / kUnitCols;                 // 4 or 2
  static constexpr uint32_t kUnitBytes = kBlockN * 128;                                // 8 KiB
  static_assert(kRopeUnit * kUnitCols == kHeadDimV && kRopeUnit * kSegmentsPerUnit == kRopeSegment,
                "the last unit is exactly the RoPE part, in the RoPE segment's shared memory");
  static_assert(kUnitBytes == kSegmentBytes, "a unit fills one segment's bytes");
  // Segments [first_segment(u), + unit_segments(u)) of the page come from unit u.
  static constexpr int first_segment(int unit) { return unit * kSegmentsPerUnit; }
  static constexpr int unit_segments(int unit) {
    return kSegments - first_segment(unit) < kSegmentsPerUnit ? kSegments - first_segment(unit) : kSegmentsPerUnit;
  }

  // Which warpgroup refills a segment of a buffer (mainloop.h): the one whose work reads it last.
  //   V columns [0, 256)   (segments 0-3): read last by kPageA's P V of both pages;
  //   V columns [256, 512) (segments 4-7): read last by kPageB's P V of both pages;
  //   RoPE columns (segment 8): read only by S, i.e. by the warpgroup that computes S for that buffer.

  using BlockM = cute::Int<kBlockM>;
  using BlockN = cute::Int<kBlockN>;
  using HeadQK = cute::Int<kHeadDimQK>;
  using HeadV = cute::Int<kHeadDimV>;
  using ColsPerWg = cute::Int<kColsPerWarpgroup>;

  // Q and K pages are K-major (head dim contiguous) with the 128-byte swizzle WGMMA reads conflict-free.
  using SmemLayoutQ = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                   cute::Shape<BlockM, HeadQK>{}));                 // (BLK_M, D_QK)
  using SmemLayoutK = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                   cute::Shape<BlockN, HeadQK>{}));                 // (BLK_N, D_QK)
  // V^T is the same bytes as the K page, read as (head dim, key) with the head dim contiguous (MN-major).
  // Tiling the MN-major atom key-first (Step<_2,_1>) reproduces exactly the K-major tiling of SmemLayoutK.
  using SmemLayoutVt = decltype(cute::tile_to_shape(cute::GMMA::Layout_MN_SW128_Atom<Element>{},
                                                    cute::Shape<HeadV, BlockN>{},
                                                    cute::Step<cute::_2, cute::_1>{}));             // (D_V, BLK_N)

  // S = Q K^T : (64 x 64) = (64 x 576) (64 x 576)^T, both operands from shared memory.
  using TiledMmaS = decltype(cute::make_tiled_mma(cute::GMMA::ss_op_selector<
      Element, Element, float, cute::Shape<BlockM, BlockN, HeadQK>>()));
  // Sparse: S's RoPE unit on bf16 (q's and the cache's RoPE columns as given) into the same accumulator.
  using TiledMmaSRope = decltype(cute::make_tiled_mma(cute::GMMA::ss_op_selector<
      cutlass::bfloat16_t, cutlass::bfloat16_t, float, cute::Shape<BlockM, BlockN, HeadQK>>()));
  // O_half += P V_half : (64 x 256) += (64 x 64) (64 x 256); P from registers, V^T MN-major in shared memory.
  using TiledMmaO = decltype(cute::make_tiled_mma(cute::GMMA::rs_op_selector<
      Element, Element, float, cute::Shape<BlockM, ColsPerWg, BlockN>,
      cute::GMMA::Major::K, cute::GMMA::Major::MN>()));

  // kE4m3Scores: the e4m3 views of the Q tile and of a page buffer, K-major with the 128-byte swizzle (an 8 KiB
  // atom column per 128 columns, exactly what a SWIZZLE_128B TMA box of 128 bytes x 64 rows writes). Q's five
  // units are consecutive; a page's unit u lies at 16 KiB u (the first of the two fp16 segments it widens to), so
  // the page is viewed as 1152 columns (its 72 KiB) of which unit u is columns [256 u, 256 u + 128).
  using E4m3 = cutlass::float_e4m3_t;
  static constexpr int kE4m3KBlock = 32;                                      // WGMMA K of e4m3
  static constexpr int kE4m3KBlocksPerUnit = 128 / kE4m3KBlock;               // 4
  static constexpr int kE4m3RopeKBlocks = (kHeadDimQK - kHeadDimV) / kE4m3KBlock;    // 2: columns 512..575
  using SmemLayoutQ8 = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<E4m3>{},
                                                    cute::Shape<BlockM, cute::Int<5 * 128>>{}));    // (BLK_M, 640)
  using SmemLayoutK8 = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<E4m3>{},
                                                    cute::Shape<BlockN, cute::Int<9 * 128>>{}));    // (BLK_N, 1152)
  // S = Q K^T in e4m3 (k = 32), both operands from shared memory; the accumulator is laid out as TiledMmaS's.
  using TiledMmaS8 = decltype(cute::make_tiled_mma(cute::GMMA::ss_op_selector<
      E4m3, E4m3, float, cute::Shape<BlockM, BlockN, cute::Int<5 * 128>>>()));

  // Byte offset of 16-byte chunk `chunk` (8 elements) of row `row` of segment `seg` in a Q/K tile: the 128-byte
  // swizzle permutes the chunks of a row by the row's index within its 8-row atom (smem_layout_check.cu checks
  // this against SmemLayoutK). The FP8 widening writes through it.
  CUTE_HOST_DEVICE static constexpr int swizzled_chunk_offset(int seg, int row, int chunk) {
    return seg * kBlockN * 128 + row * 128 + (chunk ^ (row % 8)) * 16;
  }

  // Per-thread register fragments exchanged through the shared-memory mailbox (see mainloop.h).
  static constexpr int kProbsPerThread = kBlockM * kBlockN / kWarpgroupThreads;          // 32 of P
  static constexpr int kProbVectors = kProbsPerThread * int(sizeof(Element)) / 16;        // 4 x 16 bytes

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>> k[kStages];
    // Mailbox between the warpgroups: thread t of one warpgroup hands thread t of the other (which holds the
    // same accumulator rows) its P fragment (vector v at probs[v][t]: a warp's 16-byte stores are contiguous)
    // and its two rows' statistics. kPageA writes (P_a; m_a, rowsum_a), kPageB reads them and then writes
    // (P_b; m_b, l) into the same slots, which kPageA reads before it writes the next pair's: each thread
    // only ever reads and then writes its own slots, so one mailbox serves both directions.
    alignas(16) uint4 probs[kProbVectors][kWarpgroupThreads];
    alignas(16) float4 stats[kWarpgroupThreads];     // (max row 0, max row 1, sum row 0, sum row 1)
    // Completion of each copy unit of each page buffer (TMA transaction bytes) and of the Q tile (cp.async
    // arrivals of the 128 threads that copy it; sparse: TMA transaction bytes).
    alignas(8) uint64_t unit_full[kStages][kUnits];
    alignas(8) uint64_t q_full;
    // Mailbox hand-offs, indexed by MailboxEvent: a warpgroup's 128 threads arrive once they wrote their slots.
    alignas(8) uint64_t probs_posted[2];
    // kE4m3Scores: V unit u of buffer [stage] read by S for the last time (the S warpgroup's 128 threads arrive
    // once its WGMMAs are complete), and each V half of it widened to fp16 (the widening warpgroup's 128 threads).
    alignas(8) uint64_t v_unit_read[kStages][4];
    alignas(8) uint64_t v_half_widened[kStages][2];
    // Sparse cache: the raw bytes of each V half of each buffer landed (the gather warpgroup's cp.async), and
    // each part of each buffer released by its last reader (GatherPart).
    alignas(8) uint64_t raw_full[kStages][2];
    alignas(8) uint64_t part_free[kStages][kGatherParts];
    // Sparse cache: which slots of the page in buffer [stage] hold a token, for the page waited for with phase
    // bit [phase]; word w bit 2 k for row 16 w + k (sparse_gather.h). Written with the RoPE gather by the gather
    // warpgroup, read by the warpgroup that computes S on the buffer after that S.
    alignas(16) uint32_t key_valid[kStages][2][4];
    // Sparse cache: the power of two E taken out of the page in buffer [stage] waited for with phase bit [phase]
    // (its keys are stored as 2^-E times their values; sparse_gather.h), written by the warpgroup that dequantises
    // the page before it announces unit 0; and that warpgroup's per-warp partial maxima of the page's scales.
    alignas(16) float scale_max_partial[kStages][4];
    alignas(8) int page_exponent[kStages][2];
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "Q + 2 K pages + the mailbox must fit in one SM's shared memory");
};

FLASH_MLA_NAMESPACE_END  // flash_mla
