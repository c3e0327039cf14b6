// Mainloop of the split-KV kernel: page copies, their barriers, and the two warpgroups' "seesaw" schedule.
//
// Per pair of pages (a, b) of a piece, with m the rows' reference before the pair and ref(m, x) the lazy
// reference of softmax.h (m, unless the page maximum x passes it by more than a factor 2^8 of P):
//
//   kPageA (warpgroup 0, owns O_L = O[:, 0:256])      kPageB (warpgroup 1, owns O_R = O[:, 256:512])
//   ------------------------------------------------  ------------------------------------------------
//   S_a = Q K_a^T                       (WGMMA SS)     S_b = Q K_b^T                       (WGMMA SS)
//   m_a = ref(m, rowmax S_a)                           m_b' = ref(m, rowmax S_b)
//   P_a = exp2(S_a - m_a)                              P_b = exp2(S_b - m_b')
//   post P_a, m_a, rowsum P_a ------- probs_posted[A] -> take P_a, m_a, rowsum P_a
//   O_L = O_L * e^(m - m_a)                            m_b = max(m_a, m_b'),  P_b = P_b * e^(m_b' - m_b)
//   O_L += P_a V_a[:, 0:256]            (WGMMA RS)     l = l e^(m - m_b) + rowsum P_a e^(m_a - m_b)
//                                                            + rowsum P_b e^(m_b' - m_b)
//   take P_b, m_b, l <------------- probs_posted[B] -- post P_b, m_b, l
//   O_L = O_L * e^(m_a - m_b)                          O_R = O_R * e^(m - m_b),  P_a = P_a * e^(m_a - m_b)
//   O_L += P_b V_b[:, 0:256]            (WGMMA RS)     O_R += P_a V_a[:, 256:512]          (WGMMA RS)
//                                                      O_R += P_b V_b[:, 256:512]          (WGMMA RS)
//
// (e^x here means exp2 of x times the softmax scale.) So one warpgroup's softmax runs while the other's WGMMAs
// do, S_b overlaps everything kPageA does between S_a and its wait for P_b, and kPageB's softmax of b runs
// while it waits for P_a: only the max of two references and the post lie between P_a and P_b. Every factor
// above is 1 unless a reference moved, which lazy references make rare after a row's first page (a random-score
// row's first page sets a reference its later pages do not pass by a factor 256); rescales are skipped by warps
// whose factors are all 1. kPageB, which moves P_a to m_b instead of rescaling O_R twice, issues both of its P V
// back to back. kPageA always waits for P_a V_a before P_b V_b (all four warps alike: a wait taken by only some
// warps of a warpgroup puts its WGMMA instructions at different PCs, wgmma being .aligned), then each warp
// rescales O_L only if one of its factors is not 1: P_a V_a is complete by the time P_b arrives, and the wait
// measured faster than a warpgroup vote on skipping it (docs/PERF.md). Measured by a clock64() probe of one
// CTA's pairs (H100, b = 128, L = 8192, h_q 128, s_q 2): 6,315 cycles per pair (6,550 before lazy references), of
// which the tensor pipe is busy ~4,350; the pipe idles ~900 cycles between the end of S_b and the issue of P_a V_a
// (kPageA's softmax) (docs/PERF.md "The ncu picture", timeline; probed with the vote, before this wait).
// A piece with an odd number of pages ends with a pair without b: kPageB then only applies P_a and posts
// m_b = m_a.
//
// Hand-offs: mbarriers probs_posted[A|B] (count 128, one arrival per thread; release/acquire per thread:
// thread t of one warpgroup reads exactly the mailbox slots thread t of the other wrote before arriving).
// bar.arrive / bar.sync pairs are as correct by the PTX memory model and faster, but racecheck cannot follow
// them (docs/HARDENING.md).
//
// Copies: each copy unit of a page (8 KiB: a 64-column segment of a 16-bit cache, 128 columns of an fp8 one) is one
// TMA copy (kv_cache_tma.h) issued by lane 0 of one warp and tracked by its own transaction mbarrier. Page k of a
// piece lives in buffer k % 2; the warpgroup whose work reads a unit last refills it with the next page for that
// buffer (possibly the next piece's) once it is done with it (listed in splitkv_traits.h): the RoPE unit after the
// warpgroup has issued its P V, or right after S in the sparse and e4m3-scores kernels (kRopeRefillAfterS), each
// V half after its last P V. S takes its K blocks in the order the units are refilled (RoPE first), so it starts
// before the page has landed. Only S waits for units: the other warpgroup's P V (and its zeroing of tail rows)
// reads a V half after taking the mailbox that S's warpgroup posted after its waits, and the PTX memory model
// orders the copy's writes before those reads by causality (the unit's phase completion is observed by the S
// thread, whose release arrive the reader's acquire wait observes). The re-waits were polls of phases long
// complete: dropping them took 1.5-2.5 % on the compute-bound rows (docs/PERF.md).
// Slots past a sequence's end arrive as the cache holds them (maybe NaN): S masks those keys and, for a 16-bit
// cache, each warpgroup zeroes those V rows of a piece's partial last page before its P V (zero_tail_rows).
// kPageB loads the next piece's Q tile once both S of the piece's last pair are done.
// Epilogue of an unsplit piece with p.out_by_tma (epilogue.h): each warpgroup stages its half of the result in its
// V half of the buffer of the piece's last page, which it alone reads after S, and stores it by TMA; the pair loop
// is then told that no page comes for that buffer (after_piece), and the epilogue issues the warpgroup's refills of
// it for the next piece instead: the RoPE unit at once if the buffer is its own, each V unit once the stores have
// read it.
//
// FP8 cache (Traits::kFp8Cache): a page is copied as bytes in 4.5 units of 128 columns (splitkv_traits.h), each
// with TMA's 128-byte swizzle into the first half of the 16 KiB its two fp16 segments occupy, 128 bytes per row.
// With a 16-bit q, the warpgroup that computes S on the page widens each unit just before its WGMMAs
// (fp8_widening.h widen_unit: e4m3 -> fp16 is exact), so S, the softmax and P V run exactly as for an fp16 cache; a
// bf16 q is rounded to fp16 once per piece (widen_q_bf16). With an e4m3 q (Traits::kE4m3Scores), S runs on the e4m3
// tensor cores straight from Q's and the page's bytes (both K-major with the swizzle, k = 32; the RoPE unit's two
// real K blocks only), one commit group per unit, and only the four V units are widened: three of a pair's four V
// halves by a third warpgroup (kWiden, fp8_widening.h widen_pages), page b's left half (read only by kPageA's
// P_b V_b) by kPageA in its wait for P_b, so that no widening sits between a page's S and its P V:
//
//   S warpgroup of the page (compute_s_e4m3)          kWiden (40 registers)
//   ---------------------------------------------     ---------------------------------------------------------
//   S: RoPE unit, unit 0, ..., unit 3 (a commit       for each page of the CTA's pieces, in the pairs' order:
//   group each); as each V unit's WGMMAs complete,      for each V half but page b's left: wait v_unit_read of its
//   arrive v_unit_read[stage][u]                           two units, widen them in place (tail rows zeroed),
//   softmax, mailbox (as above)                            fence into the async proxy, arrive
//   wait v_half_widened before each P V on that half       v_half_widened[stage][half]
//   kPageA, after P_a V_a's issue: wait v_unit_read of page b's units 0, 1, widen them, fence, warpgroup barrier
//
// Widening in place overwrites bytes S reads, hence v_unit_read; a buffer is refilled only after both P V on it,
// which follow the widening, so neither barrier can be a phase ahead of its waiter (v_half_widened[1][0] is never
// used). Against the S warpgroups widening themselves (kPageB page b's four units during S_b, kPageA page a's during
// S_a and after P_a V_a's issue): FP8 rows +13 % memory-bound, +12 % compute-bound (H200, docs/PERF.md); without
// any widening (timing only) +28 %; page b's left half by kPageA rather than kWiden: compute-bound +2.5 %.
// The widening writes zeros for the slots past a piece's end (zero_tail_rows' job for a 16-bit cache), so each
// V half of a page buffer is only ever written by TMA and by the one warpgroup that widens it. descale_q * descale_k
// scale the scores and descale_k the output (SplitKvScales): each scale enters once.
//
// Sparse FP8 cache (Traits::kSparse, DeepSeek-V3.2; sparse_gather.h): a page is 64 index slots of a row, its
// tokens gathered into the FP8 cache's unit layout by a third warpgroup (kGather) in the order the pairs take
// them; "refill" here releases a buffer part to it (part_free, count 128) at the moment a TMA refill would be
// issued, and only when a page comes for the part. It dequantises page b's latent units; kPageA dequantises page
// a's itself, each V half once its raw bytes landed (raw_full), just before its WGMMAs. S masks the slots that hold
// no token (key_valid). The latent keys are fp16 and 2^-E times their values, E per page (sparse_gather.h): S
// takes the RoPE unit on bf16 first, multiplies its accumulator by 2^-E once unit 0 is there, adds the latent units
// on fp16 (Q's latent columns rounded to fp16 once per piece) and multiplies S by 2^E. P V and O then run in a
// frame: O holds 2^-frame times its value, frame the largest E of the piece so far (the same in both warpgroups
// after each pair); a page's P enters P V times 2^(E - frame) (kPageA's P_a inside exp2, the row sums without it),
// and O moves with the softmax's rescale factors when the frame does; O is multiplied by 2^frame at the end.
// setmaxnreg splits the registers (splitkv_traits.h).
#pragma once

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "epilogue.h"
#include "fp8_widening.h"
#include "named_barriers.h"
#include "params.h"
#include "probe.h"
#include "softmax.h"
#include "sparse_gather.h"
#include "splitkv_traits.h"
#include "tile_scheduler.h"
#include "utils.h"
#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN

// Phase bits of the mbarriers, tracked identically by both warpgroups.
struct PipelinePhases {
  uint32_t page[2] = {0, 0};    // unit_full[stage][*]: flips each time a page of that buffer is consumed
  uint32_t q = 0;               // q_full: flips each time a piece with pages is done
  uint32_t mailbox = 0;         // probs_posted[*]: flips each pair (both warpgroups post once per pair)
  int pieces = 0;               // pieces with pages so far (probe.h builds only)
  ProbeWaits waits;             // cycles spent in the pair loop's waits (probe.h builds only)
  bool pair_timeline_pending = true;    // no piece has had its pairs timed yet (probe.h builds only)
  long long units_landed = 0;           // when S's wait for its page's last unit returned (probe.h builds only)
};

template <class Traits>
struct SplitKvMainloop {
  using Element = typename Traits::Element;
  using SharedStorage = typename Traits::SharedStorage;
  using Epilogue = SplitKvEpilogue<Traits>;
  using Range = PieceRange<Traits::kSparse>;
  using Gather = SparseGather<Traits>;
  using Widening = Fp8Widening<Traits>;
  using BlockM = typename Traits::BlockM;
  using BlockN = typename Traits::BlockN;
  using ColsPerWg = typename Traits::ColsPerWg;
  using Barrier = cutlass::arch::ClusterBarrier;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kSegments = Traits::kSegments;
  static constexpr int kSegmentCols = Traits::kSegmentCols;
  static constexpr int kVHalf = Traits::kSegmentsPerVHalf;
  static constexpr int kUnits = Traits::kUnits;
  static constexpr int kRopeUnit = Traits::kRopeUnit;
  static constexpr int kVHalfUnits = Traits::kUnitsPerVHalf;
  static constexpr int kWgThreads = Traits::kWarpgroupThreads;
  static constexpr int kSegmentElems = Traits::kBlockN * kSegmentCols;                   // 64 x 64
  static constexpr uint32_t kSegmentBytes = Traits::kSegmentBytes;                      // 8 KiB
  // When the RoPE unit is refilled: right after S frees it, or after the warpgroup has issued its P V (off the path
  // to the post). Measured per kernel (docs/PERF.md): after the P V issue for the 16-bit kernels and the fp8 one with
  // a 16-bit q (compute-bound rows +0.5 %); right after S for a sparse page (its cp.async gather has a long latency:
  // sparse rows 0.605 vs 0.583) and for the e4m3-scores kernel (fp8 memory-bound rows 1.458 vs 1.443).
  static constexpr bool kRopeRefillAfterS = Traits::kSparse || Traits::kE4m3Scores;

  // L2 policy of the page copies. Evict-first by default: the cache is streamed once and must not displace what
  // else is in L2, above all the fp32 partials of split pieces, which the combine reads next. With several row
  // tiles per KV head (h_q * s_q > 64) the tiles of an SM part read the same pages at nearly the same time, and
  // evict-first lines were often gone before the later tiles' reads (ncu, b = 128, L = 8192, h_q 128, s_q 2:
  // DRAM bytes 1.39x the cache, 1.04x with evict-normal). Evict-normal everywhere then cost the split pieces of
  // small batches up to +13 % (b = 1, h_q 128; the speculative rows +11 %) while it saved up to 5 % on the unsplit
  // ones, so it applies to pages of unsplit pieces only (docs/PERF.md, "L2 policy of the page copies").
  static constexpr uint64_t kEvictFirst = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_FIRST);
  static constexpr uint64_t kEvictNormal = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
  __device__ static uint64_t page_cache_hint(const DecodeParams& p, PageBlock block) {
    return p.num_row_tiles > 1 && !block.split ? kEvictNormal : kEvictFirst;
  }

  // ===================================== copies (global -> shared) ===========================================

  // The Q tile goes by cp.async (rows past rows_per_kv are zero-filled; the sparse kernel's by TMA, load_q): a
  // warpgroup copies a 64 x 64 segment in 16-byte chunks: thread t owns chunk t % 8 of rows t / 8 + 16 i.
  // Moving by 16 rows (two 8-row swizzle atoms) or by one segment adds a constant that leaves the swizzle
  // bits alone, so only the first address goes through the swizzled layout.
  static constexpr int kCopyRowStep = kWgThreads / 8;                 // 16 rows
  static constexpr int kCopyRowIters = kBlockN / kCopyRowStep;        // 4
  static_assert(Traits::kBlockM == kBlockN, "Q tiles and K pages share the copy mapping");
  static_assert(kSegmentCols == 8 * Traits::kVecElems, "8 chunks of 16 bytes per swizzle atom row");
  static_assert(kCopyRowStep % 8 == 0, "row steps are whole swizzle atoms");

  __device__ static Element* copy_dst(Element* tile, int wg_thread, int row_iter, int seg) {
    using namespace cute;
    static_assert(decltype(cosize(typename Traits::SmemLayoutK{}))::value == kBlockN * kHeadDimQK, "dense tile");
    Tensor sX = make_tensor(make_smem_ptr(tile), typename Traits::SmemLayoutK{});     // (BLK_N, D_QK)
    const int r = wg_thread / 8, c = wg_thread % 8 * Traits::kVecElems;
    return &sX(r, c) + row_iter * kCopyRowStep * kSegmentCols + seg * kBlockN * kSegmentCols;
  }

  // Copy units [first_unit, first_unit + num_units) of the page in cache block `block` into buffer `stage`: one
  // thread arms each unit's barrier with the unit's bytes and issues its TMA copy (L2 policy: page_cache_hint).
  // Nothing to do when no page is left for the buffer.
  // Sparse cache: the whole warpgroup gathers the units (sparse_gather.h); the RoPE unit's refill records which
  // slots hold a token in key_valid[stage][key_phase], key_phase being the phase bit the page will be waited with.
  __device__ static void refill(const DecodeParams& p, SharedStorage& smem, int stage, PageBlock block, int kv_head,
                                int first_unit, int num_units, uint32_t key_phase = 0) {
    if constexpr (Traits::kSparse) {
      // The gather warpgroup fills the part once all 128 threads released it (only if a page comes for it: it
      // waits for exactly one release per page after a buffer's first).
      const int part = first_unit == kRopeUnit ? kRopePart : first_unit == 0 ? kVLeftPart : kVRightPart;
      if (block.valid) Barrier::arrive(&smem.part_free[stage][part]);
      return;
    }
    // A refill's units go round the warpgroup's warps (lane 0 of warp w issues units w, w + 4, ...): no warp is
    // held up by more than one copy's issue (memory-bound rows +0.3 %, docs/PERF.md). Not in the e4m3-scores
    // kernel: at 255 registers it spilled 20 bytes with it.
    constexpr int kIssuingWarps = Traits::kE4m3Scores ? 1 : kWgThreads / 32;
    // warp is 0 in the e4m3-scores kernel by construction (only thread 0 passes), but ptxas spilled 12 bytes
    // there when it was computed from threadIdx: the constant keeps that kernel's code as it was.
    const int warp = Traits::kE4m3Scores ? 0 : threadIdx.x % kWgThreads / 32;
    if (!block.valid || threadIdx.x % (kWgThreads / kIssuingWarps) != 0) return;
    for (int u = warp; u < num_units; u += kIssuingWarps) {
      const int unit = first_unit + u;
      uint64_t* full = &smem.unit_full[stage][unit];
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(full, Traits::kUnitBytes);
      cute::SM90_TMA_LOAD_4D::copy(p.k_cache_tma, full, page_cache_hint(p, block),
                                   smem.k[stage].data() + Traits::first_segment(unit) * kSegmentElems,
                                   unit * Traits::kUnitCols, 0, kv_head, block.block);
    }
  }

  // The Q tile after q_full: a bf16 q for the FP8 cache's fp16 math is rounded to fp16 (fp8_widening.h); nothing to
  // do for an fp16 q, nor for an e4m3 one (kE4m3Scores: S reads its bytes).
  // Sparse cache: Q's latent columns are rounded to fp16 (sparse_gather.h, dequantisation), its RoPE ones stay bf16.
  __device__ static void widen_q(const DecodeParams& p, SharedStorage& smem, int warpgroup) {
    if constexpr (Traits::kSparse) {
      Gather::q_latent_to_fp16(reinterpret_cast<char*>(smem.q.data()), warpgroup);
      cutlass::arch::fence_view_async_shared();
      asm volatile("barrier.sync %0, %1;\n" ::"r"(static_cast<uint32_t>(CtaBarrier::kQWidened)),
                   "r"(Traits::kMathThreads) : "memory");
    }
    if constexpr (Traits::kFp8Cache && !Traits::kE4m3Scores) Widening::widen_q_bf16(p, smem);
  }

  // V rows at or past the piece's end, in this warpgroup's four V segments of buffer `stage`, become zero.
  // TMA copies whole pages, so the slots past a sequence's end arrive as they are in the cache (possibly
  // NaN); S masks those keys, but P = 0 times NaN would still be NaN in O += P V. Only a piece's last page
  // can be partial; the segments must have landed and no WGMMA of the other warpgroup may still read them.
  __device__ static void zero_tail_rows(SharedStorage& smem, int stage, int warpgroup, int valid_rows) {
    // An fp8 page's tail is zeroed as it is widened, a sparse page's slots past the end are zero-filled copies.
    if (Traits::kFp8Cache || Traits::kSparse || valid_rows >= kBlockN) return;
    constexpr int kChunksPerRow = kSegmentCols * int(sizeof(Element)) / 16;    // a row is 128 bytes
    const int tail_chunks = (kBlockN - valid_rows) * kChunksPerRow;           // per segment
    // The swizzle permutes 16-byte chunks within a 128-byte row, so rows >= valid_rows are one byte range per
    // segment. A rolled loop, no division: this rare path sits inside the pair loop's code.
    uint4* tail = reinterpret_cast<uint4*>(smem.k[stage].data()) + warpgroup * kVHalf * (kSegmentBytes / 16) +
                  valid_rows * kChunksPerRow;
#pragma unroll 1
    for (int i = threadIdx.x % kWgThreads; i < tail_chunks; i += kWgThreads) {
      CUTE_UNROLL
      for (int seg = 0; seg < kVHalf; ++seg) tail[seg * (kSegmentBytes / 16) + i] = make_uint4(0, 0, 0, 0);
    }
    cutlass::arch::fence_view_async_shared();    // generic-proxy writes before WGMMA (async proxy) reads
    warpgroup_sync(WarpgroupBarrier::kVSegmentsWritten, warpgroup);
  }

  // Q tile of `seq`: rows [64 * m_tile, + 64) of the KV head's packed rows; rows past rows_per_kv are zero.
  // Issued by one warpgroup; arrives on q_full. An e4m3 q (kE4m3Scores) is copied as bytes in SmemLayoutQ8, a
  // bf16 q for fp16 math as it is (widen_q rounds it).
  // Sparse cache: nine TMA copies (one per segment, p.q_tma) issued by the warpgroup's first thread, which arms
  // q_full with their bytes: the tile is 64 heads of one query token (num_heads_q is a multiple of 64 there, one KV
  // head), and no load/store instruction of the CTA waits behind the gather warpgroup's cp.async in the start's
  // crowded memory pipe.
  __device__ static void load_q(const DecodeParams& p, SharedStorage& smem, int seq, int kv_head, int m_tile) {
    if constexpr (Traits::kE4m3Scores) {
      load_q_bytes(p, smem, seq, kv_head, m_tile);
      return;
    }
    if constexpr (Traits::kSparse) {
      if (threadIdx.x % kWgThreads != 0) return;
      const int row0 = m_tile * Traits::kBlockM, token = row0 / p.heads_per_kv, head0 = row0 % p.heads_per_kv;
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&smem.q_full, kSegments * kSegmentBytes);
      CUTE_UNROLL
      for (int seg = 0; seg < kSegments; ++seg) {
        cute::SM90_TMA_LOAD_4D::copy(p.q_tma, &smem.q_full, kEvictNormal, smem.q.data() + seg * kSegmentElems,
                                     seg * kSegmentCols, head0, token, seq);
      }
      return;
    }
    const int wg_thread = threadIdx.x % kWgThreads;
    const Element* q = static_cast<const Element*>(p.q);
#pragma unroll 1    // once per piece, inside kPageB's pair loop: its code is kept short
    for (int i = 0; i < kCopyRowIters; ++i) {
      const int row = m_tile * Traits::kBlockM + wg_thread / 8 + i * kCopyRowStep;
      const bool valid = row < p.rows_per_kv;
      const int token = row / p.heads_per_kv, head = kv_head * p.heads_per_kv + row % p.heads_per_kv;
      const Element* src = valid ? q + seq * p.q_batch_stride + token * p.q_token_stride + head * p.q_head_stride +
                                       wg_thread % 8 * Traits::kVecElems
                                 : q;
      CUTE_UNROLL
      for (int seg = 0; seg < kSegments; ++seg) {
        cp_async_16_zfill(copy_dst(smem.q.data(), wg_thread, i, seg), src + seg * kSegmentCols, valid);
      }
    }
    cutlass::arch::cpasync_barrier_arrive_noinc(&smem.q_full);
  }

  // An e4m3 Q tile in SmemLayoutQ8: 16-byte chunk i of unit j of row r goes to byte 8192 j + 128 r + 16 (i ^ r % 8)
  // (the 128-byte swizzle); thread t copies chunk t % 8 of rows t / 8 + 16 i of every unit. The RoPE unit has 4
  // chunks; its columns 576..639 are never read (S skips those K blocks).
  __device__ static void load_q_bytes(const DecodeParams& p, SharedStorage& smem, int seq, int kv_head, int m_tile) {
    const int wg_thread = threadIdx.x % kWgThreads, chunk = wg_thread % 8;
    const uint8_t* q = static_cast<const uint8_t*>(p.q);
    char* tile = reinterpret_cast<char*>(smem.q.data());
    CUTE_UNROLL
    for (int i = 0; i < kCopyRowIters; ++i) {
      const int tile_row = wg_thread / 8 + i * kCopyRowStep;
      const int row = m_tile * Traits::kBlockM + tile_row;
      const bool valid = row < p.rows_per_kv;
      const int token = row / p.heads_per_kv, head = kv_head * p.heads_per_kv + row % p.heads_per_kv;
      const uint8_t* src = valid ? q + seq * p.q_batch_stride + token * p.q_token_stride + head * p.q_head_stride
                                 : q;
      CUTE_UNROLL
      for (int unit = 0; unit < kUnits; ++unit) {
        if (chunk * 16 < kHeadDimQK - unit * Traits::kUnitCols) {
          cp_async_16_zfill(tile + unit * Traits::kUnitBytes + tile_row * 128 + (chunk ^ (tile_row % 8)) * 16,
                            src + unit * Traits::kUnitCols + chunk * 16, valid);
        }
      }
    }
    cutlass::arch::cpasync_barrier_arrive_noinc(&smem.q_full);
  }

  // ============================================ WGMMA =======================================================

  // S = Q K^T over the page in buffer `stage`, K blocks in unit-refill order (RoPE first), each unit waited for
  // (and, for an fp8 cache with a 16-bit q, widened by this warpgroup) just before its WGMMAs are issued; the
  // widening of a unit overlaps the WGMMAs of the one before. Waited for before return.
  template <class FragQ, class FragK, class FragS>
  __device__ __forceinline__ static void compute_s(SharedStorage& smem, int stage, uint32_t phase, int warpgroup,
                                                   int valid_rows, const FragQ& tSrQ, const FragK& tSrK,
                                                   FragS& tSrS, unsigned long long& unit_waits,
                                                   long long& units_landed, int* exponent = nullptr) {
    using namespace cute;
    if constexpr (Traits::kE4m3Scores) {
      compute_s_e4m3(smem, stage, phase, tSrQ, tSrK, tSrS, unit_waits, units_landed);
    } else if constexpr (Traits::kSparse) {
      *exponent = compute_s_sparse(smem, stage, phase, warpgroup, tSrQ, tSrK, tSrS);
    } else {
      typename Traits::TiledMmaS mma;
      warpgroup_fence_operand(tSrS);
      CUTE_UNROLL
      for (int i = 0; i < kUnits; ++i) {
        const int unit = (i + kRopeUnit) % kUnits;
        probe_timed(unit_waits, [&] { Barrier::wait(&smem.unit_full[stage][unit], phase); });
        if (i == kUnits - 1) units_landed = probe_clock();
        if constexpr (Traits::kFp8Cache) {
          Widening::widen_unit(smem.k[stage].data(), unit, valid_rows);
          cutlass::arch::fence_view_async_shared();    // generic-proxy writes before WGMMA (async proxy) reads
          __syncwarp();                                 // bar.sync is .aligned: reconverge the padding lanes first
          warpgroup_sync(WarpgroupBarrier::kUnitWidened, warpgroup);
        }
        warpgroup_arrive();
        CUTE_UNROLL
        for (int kk = 0; kk < Traits::unit_segments(unit) * Traits::kKBlocksPerSegment; ++kk) {
          const int k = Traits::first_segment(unit) * Traits::kKBlocksPerSegment + kk;
          mma.accumulate_ = (i == 0 && kk == 0) ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
          gemm(mma, tSrQ(_, _, k), tSrK(_, _, k), tSrS);
        }
      }
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);
    }
  }

  // Sparse: S = Q K^T over the page in buffer `stage`, whose latent keys are 2^-E times their values (sparse_gather.h):
  // the RoPE unit first on bf16 (as gathered; its bytes land first), then, with unit 0 (dequantised here for page a,
  // by the gather warpgroup for page b) the page's exponent E, the accumulator times 2^-E (the RoPE WGMMAs are long
  // complete by then), the latent units on fp16 into it, each waited for (and, for page a, dequantised) just before
  // its WGMMAs, and S times 2^E once complete. Returns E.
  template <class FragQ, class FragK, class FragS>
  __device__ __forceinline__ static int compute_s_sparse(SharedStorage& smem, int stage, uint32_t phase,
                                                         int warpgroup, const FragQ& tSrQ, const FragK& tSrK,
                                                         FragS& tSrS) {
    using namespace cute;
    typename Traits::TiledMmaS mma;
    typename Traits::TiledMmaSRope mma_rope;
    const bool dequantises = Traits::self_dequantises(stage);
    char* tile = Gather::tile_of(smem, stage);
    // ---- RoPE unit: S = Q_rope K_rope^T (bf16) ---------------------------------------------------------------
    Barrier::wait(&smem.unit_full[stage][kRopeUnit], phase);
    cutlass::arch::fence_view_async_shared();    // its cp.async bytes, landed, into the async proxy
    warpgroup_fence_operand(tSrS);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kk = 0; kk < Traits::unit_segments(kRopeUnit) * Traits::kKBlocksPerSegment; ++kk) {
      const int k = Traits::first_segment(kRopeUnit) * Traits::kKBlocksPerSegment + kk;
      mma_rope.accumulate_ = kk == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
      gemm(mma_rope, tSrQ(_, _, k), tSrK(_, _, k), tSrS);
    }
    warpgroup_commit_batch();
    // ---- latent units: S += Q_lat (2^-E K_lat)^T (fp16), S = 2^-E S_rope first ------------------------------
    int exponent = 0;
    CUTE_UNROLL
    for (int unit = 0; unit < kRopeUnit; ++unit) {
      // unit 0's barrier: its dequantisation (page b) or key_valid and the RoPE bytes' order (page a)
      if (!dequantises || unit == 0) Barrier::wait(&smem.unit_full[stage][unit], phase);
      if (dequantises && unit % 2 == 0) Barrier::wait(&smem.raw_full[stage][unit / 2], phase);
      if (dequantises) {
        if (unit == 0) {
          exponent = Gather::page_exponent_of(tile, WarpgroupBarrier::kUnitWidened, warpgroup,
                                              smem.scale_max_partial[stage]);
          // kPageB reads it after taking P_a
          if (threadIdx.x % kWgThreads == 0) smem.page_exponent[stage][phase] = exponent;
        }
        Gather::dequantize_unit(tile, unit, WarpgroupBarrier::kUnitWidened, warpgroup, exponent);
        cutlass::arch::fence_view_async_shared();
        warpgroup_sync(WarpgroupBarrier::kUnitWidened, warpgroup);
      } else if (unit == 0) {
        exponent = smem.page_exponent[stage][phase];    // written before unit 0's arrival
      }
      if (unit == 0) {
        warpgroup_wait<0>();
        warpgroup_fence_operand(tSrS);
        const float unscale = pow2(-exponent);
        CUTE_UNROLL
        for (int j = 0; j < size(tSrS); ++j) tSrS(j) *= unscale;
        warpgroup_fence_operand(tSrS);
      }
      warpgroup_arrive();
      CUTE_UNROLL
      for (int kk = 0; kk < Traits::unit_segments(unit) * Traits::kKBlocksPerSegment; ++kk) {
        const int k = Traits::first_segment(unit) * Traits::kKBlocksPerSegment + kk;
        mma.accumulate_ = GMMA::ScaleOut::One;
        gemm(mma, tSrQ(_, _, k), tSrK(_, _, k), tSrS);
      }
    }
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);
    const float rescale = pow2(exponent);
    CUTE_UNROLL
    for (int j = 0; j < size(tSrS); ++j) tSrS(j) *= rescale;
    return exponent;
  }

  // kE4m3Scores: S = Q K^T over the page in buffer `stage` on the e4m3 tensor cores, straight from the copied
  // bytes, K blocks in unit-refill order (RoPE first: its two K blocks of real columns only). Hopper's e4m3
  // WGMMA accumulates with reduced precision (about 14 bits kept; DeepSeek-V3's report, and the Triton backend's
  // FP8_ACC_CHUNK measured lse errors of 2.6e-3 without float32 steps), so each V unit's 128 products go to a
  // partial accumulator U that is added to S in float32 once complete (DeepSeek's interval of 128) before the
  // next unit's WGMMAs reuse U. Each V unit is handed to the widening warpgroup (v_unit_read) as soon as its
  // WGMMAs are complete, so that it can widen the unit in place while S runs on. Waited for before return.
  template <class FragQ, class FragK, class FragS>
  __device__ __forceinline__ static void compute_s_e4m3(SharedStorage& smem, int stage, uint32_t phase,
                                                        const FragQ& tSrQ, const FragK& tSrK, FragS& tSrS,
                                                        unsigned long long& unit_waits, long long& units_landed) {
    using namespace cute;
    typename Traits::TiledMmaS8 mma;
    static_assert(kRopeUnit == 4 && kVHalfUnits == 2, "four V units of 128 columns, then the RoPE unit");
    Tensor tSrU = make_fragment_like(tSrS);                                                    // (MMA, 1, 1)
    // K blocks of unit `unit` into `acc`, the first one overwriting it; one commit group.
    auto issue_unit = [&](int unit, auto& acc) {
      probe_timed(unit_waits, [&] { Barrier::wait(&smem.unit_full[stage][unit], phase); });
      if (unit == kVHalfUnits * 2 - 1) units_landed = probe_clock();
      warpgroup_fence_operand(acc);
      warpgroup_arrive();
      const int k_blocks = unit == kRopeUnit ? Traits::kE4m3RopeKBlocks : Traits::kE4m3KBlocksPerUnit;
      CUTE_UNROLL
      for (int kk = 0; kk < k_blocks; ++kk) {
        mma.accumulate_ = kk == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
        // Q's unit j is its columns [128 j, + 128); the page's unit j is columns [256 j, + 128) of SmemLayoutK8.
        gemm(mma, tSrQ(_, _, unit * Traits::kE4m3KBlocksPerUnit + kk),
             tSrK(_, _, 2 * unit * Traits::kE4m3KBlocksPerUnit + kk), acc);
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(acc);
    };
    auto add_unit = [&] {                  // S += U, once every group issued so far is complete
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);
      warpgroup_fence_operand(tSrU);
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); ++i) tSrS(i) += tSrU(i);
    };
    issue_unit(kRopeUnit, tSrS);
    issue_unit(0, tSrU);
    CUTE_UNROLL
    for (int v = 1; v < 4; ++v) {
      add_unit();                          // unit v - 1 (and the RoPE unit) complete; U is free
      Barrier::arrive(&smem.v_unit_read[stage][v - 1]);
      issue_unit(v, tSrU);
    }
    add_unit();
    Barrier::arrive(&smem.v_unit_read[stage][3]);
  }

  // O += P V over this warpgroup's 256 columns; issued, not waited for.
  template <class FragP, class FragV, class FragO>
  __device__ static void issue_pv(const FragP& tOrP, const FragV& tOrV, FragO& tOrO) {
    using namespace cute;
    typename Traits::TiledMmaO mma;
    warpgroup_fence_operand(tOrO);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tOrP); ++k) gemm(mma, tOrP(_, _, k), tOrV(_, _, k), tOrO);
    warpgroup_commit_batch();
  }

  template <class FragO>
  __device__ static void wait_pv(FragO& tOrO) {
    cute::warpgroup_wait<0>();
    cute::warpgroup_fence_operand(tOrO);
  }

  // ============================================ mailbox =====================================================

  // The S accumulator's value order equals the RS A operand's ((2,2,2),1,4): value i of both is the same
  // (row, key), so P is S converted element by element.
  template <class FragS, class FragP>
  __device__ static void to_operand(const FragS& tSrS, FragP& tOrP) {
    using namespace cute;
    static_assert(decltype(size(tSrS))::value == decltype(size(tOrP))::value, "one P value per S value");
    CUTE_UNROLL
    for (int i = 0; i < size(tSrS); ++i) tOrP(i) = static_cast<Element>(tSrS(i));
  }

  template <class FragP>
  __device__ static void post_probs(SharedStorage& smem, const FragP& tOrP) {
    using namespace cute;
    const int t = threadIdx.x % kWgThreads;
    Tensor words = recast<uint4>(tOrP);
    static_assert(decltype(size(words))::value == Traits::kProbVectors, "P fragment is 4 x 16 bytes");
    CUTE_UNROLL
    for (int v = 0; v < Traits::kProbVectors; ++v) smem.probs[v][t] = words(v);
  }

  template <class FragP>
  __device__ static void take_probs(const SharedStorage& smem, FragP& tOrP) {
    using namespace cute;
    const int t = threadIdx.x % kWgThreads;
    Tensor words = recast<uint4>(tOrP);
    CUTE_UNROLL
    for (int v = 0; v < Traits::kProbVectors; ++v) words(v) = smem.probs[v][t];
  }

  // ============================================ one piece ===================================================

  // Both warpgroups run this with their own role; the mailbox hand-offs keep them one pair apart at most.
  template <WarpgroupRole kRole>
  __device__ __forceinline__ static void attend_piece(const DecodeParams& p, const SplitKvScales& scales,
                                                      SharedStorage& smem, const Range& range,
                                                      const Piece& piece, int kv_head, int m_tile,
                                                      PipelinePhases& phases) {
    using namespace cute;
    constexpr int kWarpgroup = static_cast<int>(kRole);
    const int wg_thread = threadIdx.x % kWgThreads;

    typename Traits::TiledMmaS mma_s;
    typename Traits::TiledMmaO mma_o;
    auto thr_mma_s = mma_s.get_slice(wg_thread);
    auto thr_mma_o = mma_o.get_slice(wg_thread);

    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});     // (BLK_M, D_QK)
    Tensor sK = make_tensor(make_smem_ptr(smem.k[kWarpgroup].data()),
                            typename Traits::SmemLayoutK{});                                   // (BLK_N, D_QK)
    Tensor sVa = make_tensor(make_smem_ptr(smem.k[0].data()), typename Traits::SmemLayoutVt{});  // (D_V, BLK_N)
    Tensor sVb = make_tensor(make_smem_ptr(smem.k[1].data()), typename Traits::SmemLayoutVt{});  // (D_V, BLK_N)
    // S's operands: 16-bit (MMA, 1, 36) K blocks of 16 columns, or e4m3 ones (kE4m3Scores) of 32 columns:
    // Q (MMA, 1, 20) and the page's 1152-column view (MMA, 1, 36), of which S reads 18.
    auto score_operand = [&](auto a_operand, auto* base, auto layout, auto&& tensor16) {
      if constexpr (Traits::kE4m3Scores) {
        using E4m3 = typename Traits::E4m3;
        auto thr_mma_s8 = typename Traits::TiledMmaS8{}.get_slice(wg_thread);
        Tensor s8 = make_tensor(make_smem_ptr(reinterpret_cast<E4m3*>(base)), layout);
        if constexpr (decltype(a_operand)::value) return thr_mma_s8.partition_fragment_A(s8);
        else return thr_mma_s8.partition_fragment_B(s8);
      } else if constexpr (decltype(a_operand)::value) {
        return thr_mma_s.partition_fragment_A(tensor16);
      } else {
        return thr_mma_s.partition_fragment_B(tensor16);
      }
    };
    auto tSrQ = score_operand(true_type{}, smem.q.data(), typename Traits::SmemLayoutQ8{}, sQ);
    auto tSrK = score_operand(false_type{}, smem.k[kWarpgroup].data(), typename Traits::SmemLayoutK8{}, sK);
    Tensor tOrVa = thr_mma_o.partition_fragment_B(
        local_tile(sVa, Shape<ColsPerWg, BlockN>{}, make_coord(kWarpgroup, 0)));               // (MMA, 1, 4)
    Tensor tOrVb = thr_mma_o.partition_fragment_B(
        local_tile(sVb, Shape<ColsPerWg, BlockN>{}, make_coord(kWarpgroup, 0)));               // (MMA, 1, 4)
    Tensor tOrO = partition_fragment_C(mma_o, Shape<BlockM, ColsPerWg>{});                     // (MMA, 1, 1)
    Tensor tOrPa = make_tensor<Element>(partition_shape_A(mma_o, Shape<BlockM, BlockN>{}));   // (MMA, 1, 4)
    Tensor tOrPb = make_tensor<Element>(partition_shape_A(mma_o, Shape<BlockM, BlockN>{}));   // (MMA, 1, 4)
    Tensor O = as_rows_cols(tOrO);                                                             // (ROW, COL)
    // (row in tile, key in page) of each S element, and (row, column in this half) of each O element.
    Tensor tScS = as_rows_cols(thr_mma_s.partition_C(make_identity_tensor(Shape<BlockM, BlockN>{})));
    Tensor tOcO = as_rows_cols(thr_mma_o.partition_C(make_identity_tensor(Shape<BlockM, ColsPerWg>{})));
    clear(tOrO);

    RowStats stats;
    // Sparse: O's power of two (O holds 2^-frame times its value; sparse_gather.h): the largest page exponent so
    // far, the same in both warpgroups after each pair (kNoFrame: no page yet).
    int frame = kNoFrame;
    int last_visible[kRowsPerThread];     // the last key index each row may see
    CUTE_UNROLL
    for (int r = 0; r < kRowsPerThread; ++r) {
      stats.max[r] = -INFINITY;
      stats.sum[r] = 0.f;
      const int token = (m_tile * Traits::kBlockM + get<0>(tScS(r, 0))) / p.heads_per_kv;
      last_visible[r] = p.causal ? piece.length - p.seqlen_q + token : piece.length - 1;
    }

    const int num_pages = piece.num_pages();
    const float scale_log2 = scales.score_log2;
    Barrier::wait(&smem.q_full, phases.q);
    probe_time(p, probe_piece_slot(phases.pieces, kProbeQLanded));
    probe_put(p, probe_piece_slot(phases.pieces, kProbePages), num_pages);
    probe_put(p, probe_piece_slot(phases.pieces, kProbeSeq), piece.seq);
    probe_put(p, probe_piece_slot(phases.pieces, kProbeSplit), piece.split);
    widen_q(p, smem, kWarpgroup);
    // probe.h builds: this piece's pairs are timed if it is the CTA's first with the timeline's window of pairs.
    const bool timed = kProbeBuild && phases.pair_timeline_pending &&
                       num_pages >= 2 * (kProbeFirstPair + kProbePairs);
    // (the pair's event stamps: probe.h ProbePairEvent)
    auto stamp = [&](int page, int event, long long when) { probe_pair(p, timed, page / 2, event, when); };

    // An unsplit piece's out goes through this warpgroup's V half of the buffer of the piece's last page, which it
    // read last (epilogue.h): the refills of that buffer by this warpgroup for the next piece (that half, and the
    // RoPE unit if it is this warpgroup's) wait for the epilogue, so the pair loop is told that no page comes.
    const bool out_by_tma = !Traits::kSparse && p.out_by_tma && !piece.split;
    const int last_stage = (num_pages - 1) % 2;
    const PageBlock after_piece[2] = {
        out_by_tma && last_stage == 0 ? kNoBlock : range.first_block_after(piece, 0),
        out_by_tma && last_stage == 1 ? kNoBlock : range.first_block_after(piece, 1)};
    // Dense: the block table is read a warp at a time (tile_scheduler.h batch_block: lane l the block of page
    // first + 2 + l), a pair before the batch is first used: before the loop, then at the top of each pair whose
    // page % 32 is 30, after that pair's own blocks were taken. Each pair takes its two blocks by one shuffle each
    // at its top (pinned there by shuffle_here, off the refills' path), instead of every thread's own
    // ~12-instruction lookup per buffer and pair.
    int lane_blocks = Traits::kSparse ? 0 : range.batch_block(piece, 0, threadIdx.x % 32);
    for (int page = 0; page < num_pages; page += 2) {
      const bool has_b = page + 1 < num_pages;
      const int key0 = piece.begin + page * kBlockN;    // first key of page a
      // What the two buffers receive once this pair is done with them: pages page + 2 and page + 3 of the piece, or
      // the next piece's first page for that buffer (sparse: this thread's index of it, its load issued here).
      auto next_block = [&](int stage) {
        if constexpr (Traits::kSparse) {
          return range.next_block(piece, page + stage, stage, after_piece[stage]);
        } else {
          return range.next_block_in_batch(piece, page, stage, after_piece[stage],
                                           [&](int lane) { return shuffle_here(lane_blocks, lane); });
        }
      };
      const PageBlock next_a = next_block(0), next_b = next_block(1);
      if (!Traits::kSparse && page % Range::kBatchPages == Range::kBatchPages - 2) {
        lane_blocks = range.batch_block(piece, page + 2, threadIdx.x % 32);
      }
      stamp(page, kProbePairStart, probe_clock());

      if constexpr (kRole == WarpgroupRole::kPageA) {
        // ---- S_a = Q K_a^T, softmax, post P_a --------------------------------------------------------------
        Tensor tSrS = partition_fragment_C(mma_s, Shape<BlockM, BlockN>{});                   // (MMA, 1, 1)
        int exponent_a = 0;
        compute_s(smem, 0, phases.page[0], kWarpgroup, piece.end - key0, tSrQ, tSrK, tSrS, phases.waits.units,
                  phases.units_landed, &exponent_a);
        if (page == 0) probe_time(p, probe_piece_slot(phases.pieces, kProbeFirstS));
        stamp(page, kProbeUnitsLanded, phases.units_landed);
        stamp(page, kProbeSDone, probe_clock());
        // The RoPE unit is free once S is; its refill goes out now or after P_a V_a's issue (kRopeRefillAfterS).
        if constexpr (kRopeRefillAfterS) refill(p, smem, 0, next_a, kv_head, kRopeUnit, 1, phases.page[0] ^ 1);
        Tensor S = as_rows_cols(tSrS);                                                         // (ROW, COL)
        float m_a[kRowsPerThread], scale[kRowsPerThread], rowsum_a[kRowsPerThread];
        if constexpr (Traits::kSparse) mask_empty_slots(S, tScS, smem.key_valid[0][phases.page[0]]);
        mask_and_row_max(S, tScS, key0, piece.end, last_visible, m_a);
        CUTE_UNROLL
        for (int r = 0; r < kRowsPerThread; ++r) {
          m_a[r] = lazy_reference(stats.max[r], m_a[r], scale_log2);
          scale[r] = rescale_factor(stats.max[r], m_a[r], scale_log2);
        }
        if constexpr (Traits::kSparse) {
          // P V takes P_a times 2^(E_a - frame') into O, which moves to frame' = max(frame, E_a); the sums stay true.
          const int frame_a = max(frame, exponent_a);
          // (2^(E_a - frame') in exp2 itself, at least 2^-100: a page that much below the frame adds nothing to O that
          // fp16 could hold, and the sums, taken back by 2^(frame' - E_a), keep P's larger values.)
          const int offset = max(exponent_a - frame_a, -100);
          exponentiate(S, m_a, scale_log2, rowsum_a, static_cast<float>(offset));
          CUTE_UNROLL
          for (int r = 0; r < kRowsPerThread; ++r) {
            rowsum_a[r] *= pow2(-offset);
            scale[r] *= frame_factor(frame - frame_a);
          }
          frame = frame_a;
        } else {
          exponentiate(S, m_a, scale_log2, rowsum_a);
        }
        to_operand(tSrS, tOrPa);
        stamp(page, kProbeProbsReady, probe_clock());
        post_probs(smem, tOrPa);
        smem.stats[wg_thread] = make_float4(m_a[0], m_a[1], rowsum_a[0], rowsum_a[1]);
        Barrier::arrive(&smem.probs_posted[kPageAPosted]);
        stamp(page, kProbePosted, probe_clock());

        // ---- O_L = O_L e^(m - m_a) + P_a V_a ----------------------------------------------------------------
        scale_rows(O, scale);
        zero_tail_rows(smem, 0, kWarpgroup, piece.end - key0);
        if constexpr (Traits::kE4m3Scores) {
          probe_timed(phases.waits.units, [&] { Barrier::wait(&smem.v_half_widened[0][0], phases.page[0]); });
        }
        stamp(page, kProbePaVaIssuing, probe_clock());
        issue_pv(tOrPa, tOrVa, tOrO);
        stamp(page, kProbePaVaIssued, probe_clock());
        if constexpr (!kRopeRefillAfterS) refill(p, smem, 0, next_a, kv_head, kRopeUnit, 1, phases.page[0] ^ 1);
        if constexpr (Traits::kE4m3Scores) {
          static_assert(Widening::widened_by_page_a(1, 0), "page b's left V half is kPageA's to widen");
          if (has_b) {    // page b's left V half, which only P_b V_b reads: widened here, in the wait for P_b
            Widening::widen_v_half(smem, 1, 0, phases.page[1], piece.end - key0 - kBlockN);
            cutlass::arch::fence_view_async_shared();    // generic-proxy writes before WGMMA (async proxy) reads
            __syncwarp();                                 // bar.sync is .aligned: reconverge the tail-row lanes first
            warpgroup_sync(WarpgroupBarrier::kUnitWidened, kWarpgroup);
          }
        }

        // ---- take P_b, m_b, l; O_L = O_L e^(m_a - m_b) + P_b V_b ---------------------------------------------
        probe_timed(phases.waits.mailbox, [&] { Barrier::wait(&smem.probs_posted[kPageBPosted], phases.mailbox); });
        stamp(page, kProbeTaken, probe_clock());
        const float4 from_b = smem.stats[wg_thread];
        const float m_b[kRowsPerThread] = {from_b.x, from_b.y};
        if (has_b) {
          take_probs(smem, tOrPb);
          CUTE_UNROLL
          for (int r = 0; r < kRowsPerThread; ++r) scale[r] = rescale_factor(m_a[r], m_b[r], scale_log2);
          if constexpr (Traits::kSparse) {    // P_b comes in frame max(frame, E_b) (kPageB's): O_L moves there
            const int frame_b = max(frame, smem.page_exponent[1][phases.page[1]]);
            CUTE_UNROLL
            for (int r = 0; r < kRowsPerThread; ++r) scale[r] *= frame_factor(frame - frame_b);
            frame = frame_b;
          }
          // O_L may be rescaled only once P_a V_a is done (long done by now in the common case).
          probe_timed(phases.waits.pv, [&] { wait_pv(tOrO); });
          stamp(page, kProbePaVaDone, probe_clock());
          scale_rows(O, scale);
          zero_tail_rows(smem, 1, kWarpgroup, piece.end - key0 - kBlockN);
          stamp(page, kProbePbVbIssuing, probe_clock());
          issue_pv(tOrPb, tOrVb, tOrO);                     // V_b landed: kPageB's S_b waited for it
          stamp(page, kProbePvIssued, probe_clock());
          // P_a V_a is complete (waited for above): V_a[:, 0:256] is free. Refilled only now, after P_b V_b's issue:
          // one thread's TMA issues before it cost 3 % (docs/PERF.md).
          refill(p, smem, 0, next_a, kv_head, 0, kVHalfUnits);
          stamp(page, kProbeVRefillIssued, probe_clock());
          probe_timed(phases.waits.pv, [&] { wait_pv(tOrO); });
          refill(p, smem, 1, next_b, kv_head, 0, kVHalfUnits);
        } else {
          probe_timed(phases.waits.pv, [&] { wait_pv(tOrO); });
          refill(p, smem, 0, next_a, kv_head, 0, kVHalfUnits);
        }
        stamp(page, kProbePairEnd, probe_clock());
        stats.max[0] = m_b[0];
        stats.max[1] = m_b[1];
        stats.sum[0] = from_b.z;
        stats.sum[1] = from_b.w;
      } else {
        // ---- S_b = Q K_b^T (overlaps kPageA's softmax and P_a V_a) ---------------------------------------
        Tensor tSrS = partition_fragment_C(mma_s, Shape<BlockM, BlockN>{});                   // (MMA, 1, 1)
        Tensor S = as_rows_cols(tSrS);                                                         // (ROW, COL)
        // ---- softmax of b against its own reference m_b' (no wait for kPageA's) -----------------------------
        float ref_b[kRowsPerThread] = {stats.max[0], stats.max[1]};    // m_b'
        float rowsum_b[kRowsPerThread] = {0.f, 0.f};
        int exponent_b = kNoFrame;
        if (has_b) {
          compute_s(smem, 1, phases.page[1], kWarpgroup, piece.end - key0 - kBlockN, tSrQ, tSrK, tSrS,
                    phases.waits.units, phases.units_landed, &exponent_b);
          if (page == 0) probe_time(p, probe_piece_slot(phases.pieces, kProbeFirstS));
          stamp(page, kProbeUnitsLanded, phases.units_landed);
          stamp(page, kProbeSDone, probe_clock());
          if constexpr (kRopeRefillAfterS) refill(p, smem, 1, next_b, kv_head, kRopeUnit, 1, phases.page[1] ^ 1);
          if constexpr (Traits::kSparse) mask_empty_slots(S, tScS, smem.key_valid[1][phases.page[1]]);
          float page_max[kRowsPerThread];
          mask_and_row_max(S, tScS, key0 + kBlockN, piece.end, last_visible, page_max);
          CUTE_UNROLL
          for (int r = 0; r < kRowsPerThread; ++r) ref_b[r] = lazy_reference(stats.max[r], page_max[r], scale_log2);
          exponentiate(S, ref_b, scale_log2, rowsum_b);
          to_operand(tSrS, tOrPb);
          stamp(page, kProbeProbsReady, probe_clock());
        }

        // ---- take P_a, m_a, rowsum_a; the pair's reference m_b = max(m_a, m_b'); post P_b, m_b, l ----------
        probe_timed(phases.waits.mailbox, [&] { Barrier::wait(&smem.probs_posted[kPageAPosted], phases.mailbox); });
        stamp(page, kProbeTaken, probe_clock());
        const float4 from_a = smem.stats[wg_thread];
        take_probs(smem, tOrPa);
        const float m_a[kRowsPerThread] = {from_a.x, from_a.y};
        const float rowsum_a[kRowsPerThread] = {from_a.z, from_a.w};
        float m_b[kRowsPerThread], scale_ab[kRowsPerThread], scale_b[kRowsPerThread], scale_own[kRowsPerThread];
        CUTE_UNROLL
        for (int r = 0; r < kRowsPerThread; ++r) {
          m_b[r] = fmaxf(m_a[r], ref_b[r]);
          const float scale_a = rescale_factor(stats.max[r], m_a[r], scale_log2);    // m -> m_a
          scale_b[r] = rescale_factor(m_a[r], m_b[r], scale_log2);                   // m_a -> m_b
          scale_ab[r] = rescale_factor(stats.max[r], m_b[r], scale_log2);            // m -> m_b
          scale_own[r] = rescale_factor(ref_b[r], m_b[r], scale_log2);               // m_b' -> m_b
          stats.sum[r] = (stats.sum[r] * scale_a + rowsum_a[r]) * scale_b[r] + rowsum_b[r] * scale_own[r];
          stats.max[r] = m_b[r];
        }
        if constexpr (Traits::kSparse) {
          // The pair's frame: P_a comes in frame max(frame, E_a) (kPageA's), P_b moves from E_b, O_R from frame.
          const int frame_a = max(frame, smem.page_exponent[0][phases.page[0]]);
          const int frame_ab = max(frame_a, exponent_b);
          CUTE_UNROLL
          for (int r = 0; r < kRowsPerThread; ++r) {
            scale_own[r] *= frame_factor(exponent_b - frame_ab);
            scale_b[r] *= frame_factor(frame_a - frame_ab);
            scale_ab[r] *= frame_factor(frame - frame_ab);
          }
          frame = frame_ab;
        }
        if (has_b) {
          // P_b moves to m_b only where kPageA's reference passed this one (rare once the rows have references).
          Tensor Pb = as_rows_cols(make_tensor(tOrPb.data(), tSrS.layout()));                 // (ROW, COL)
          scale_probs(Pb, scale_own);
          post_probs(smem, tOrPb);
        }
        smem.stats[wg_thread] = make_float4(m_b[0], m_b[1], stats.sum[0], stats.sum[1]);
        Barrier::arrive(&smem.probs_posted[kPageBPosted]);
        stamp(page, kProbePosted, probe_clock());
        if (page + 2 >= num_pages) {
          // Both S of the piece's last pair are done (S_a before kPageAProbsReady): Q can take the next piece's
          // tile. Issued after P_b is posted, off kPageA's path.
          const int next_seq = range.next_seq_using(piece.seq + 1, 0);
          if (next_seq >= 0) load_q(p, smem, next_seq, kv_head, m_tile);
        }

        // ---- O_R = O_R e^(m - m_b) + (P_a e^(m_a - m_b)) V_a + P_b V_b: both WGMMAs back to back ------------
        scale_rows(O, scale_ab);
        Tensor Pa = as_rows_cols(make_tensor(tOrPa.data(), tSrS.layout()));                   // (ROW, COL)
        scale_probs(Pa, scale_b);
        zero_tail_rows(smem, 0, kWarpgroup, piece.end - key0);
        if constexpr (Traits::kE4m3Scores) {
          probe_timed(phases.waits.units, [&] { Barrier::wait(&smem.v_half_widened[0][1], phases.page[0]); });
        }
        stamp(page, kProbePaVaIssuing, probe_clock());
        issue_pv(tOrPa, tOrVa, tOrO);                       // V_a landed: kPageA's S_a waited for it
        stamp(page, kProbePaVaIssued, probe_clock());
        if (has_b) {
          zero_tail_rows(smem, 1, kWarpgroup, piece.end - key0 - kBlockN);
          if constexpr (Traits::kE4m3Scores) {
            probe_timed(phases.waits.units, [&] { Barrier::wait(&smem.v_half_widened[1][1], phases.page[1]); });
          }
          stamp(page, kProbePbVbIssuing, probe_clock());
          issue_pv(tOrPb, tOrVb, tOrO);
          stamp(page, kProbePvIssued, probe_clock());
          if constexpr (!kRopeRefillAfterS) refill(p, smem, 1, next_b, kv_head, kRopeUnit, 1, phases.page[1] ^ 1);
          probe_timed(phases.waits.pv, [] { warpgroup_wait<1>(); });    // P_a V_a done: V_a[:, 256:512] is free
          stamp(page, kProbePaVaDone, probe_clock());
          refill(p, smem, 0, next_a, kv_head, kVHalfUnits, kVHalfUnits);
          stamp(page, kProbeVRefillIssued, probe_clock());
          probe_timed(phases.waits.pv, [&] { wait_pv(tOrO); });
          refill(p, smem, 1, next_b, kv_head, kVHalfUnits, kVHalfUnits);
        } else {
          probe_timed(phases.waits.pv, [&] { wait_pv(tOrO); });
          refill(p, smem, 0, next_a, kv_head, kVHalfUnits, kVHalfUnits);
        }
        stamp(page, kProbePairEnd, probe_clock());
      }
      phases.page[0] ^= 1;
      if (has_b) phases.page[1] ^= 1;
      phases.mailbox ^= 1;
    }
    phases.q ^= 1;
    if (timed) phases.pair_timeline_pending = false;

    if constexpr (Traits::kSparse) {    // O's true value (a piece with no page has O = 0 and no frame)
      if (frame != kNoFrame) scale_all(O, pow2(frame));
    }
    probe_time(p, probe_piece_slot(phases.pieces, kProbeMainloopEnd));
    // The buffer's next page, which the pair loop did not refill (out_by_tma): its RoPE unit (if this warpgroup's)
    // at once, this warpgroup's V half unit by unit as the TMA store frees it.
    const PageBlock next = out_by_tma ? range.first_block_after(piece, last_stage) : kNoBlock;
    if (last_stage == kWarpgroup) refill(p, smem, last_stage, next, kv_head, kRopeUnit, 1);
    Epilogue::write(p, scales, piece, kv_head, m_tile, kWarpgroup, stats, O, tOcO,
                    out_by_tma ? smem.k[last_stage].data() : nullptr, [&](int unit) {
                      // (by the storing thread alone: with one unit, refill has warp 0 issue it)
                      refill(p, smem, last_stage, next, kv_head, kWarpgroup * kVHalfUnits + unit, 1);
                    });
    probe_time(p, probe_piece_slot(phases.pieces, kProbeEpilogueEnd));
    ++phases.pieces;
  }

  // ============================================ CTA ==========================================================

  // The first Q tile (kPageB, cp.async) and every unit of both page buffers, issued by one thread of kPageA:
  // page a's units (RoPE first, the order S takes them) before any of page b's, so that page a can land
  // first and S_a, its softmax and P_a V_a run while page b is still arriving (alone, within noise on the H100;
  // measured together with the split kernel's PDL, docs/PERF.md "Split kernel"). Later refills are the
  // unit owners' (the mbarriers are per unit; who issues a copy does not matter to them).
  template <WarpgroupRole kRole>
  __device__ static void prologue(const DecodeParams& p, SharedStorage& smem, const Range& range, int kv_head,
                                  int m_tile) {
    if (kRole == WarpgroupRole::kPageB) {
      const int first_seq = range.next_seq_using(range.first_seq(), 0);
      if (first_seq >= 0) load_q(p, smem, first_seq, kv_head, m_tile);
    } else if constexpr (!Traits::kSparse) {    // sparse: the gather warpgroup fills the page buffers
      CUTE_UNROLL
      for (int stage = 0; stage < 2; ++stage) {
        const PageBlock block = range.first_block(stage);
        refill(p, smem, stage, block, kv_head, kRopeUnit, 1);
        refill(p, smem, stage, block, kv_head, 0, kRopeUnit);
      }
    }
  }

  template <WarpgroupRole kRole>
  __device__ __forceinline__ static void run(const DecodeParams& p, const SplitKvScales& scales,
                                             SharedStorage& smem, const Range& range, int kv_head,
                                             int m_tile) {
    prologue<kRole>(p, smem, range, kv_head, m_tile);
    PipelinePhases phases;
    for (int seq = range.first_seq(); seq <= range.last_seq(); ++seq) {
      const Piece piece = range.piece(seq);
      if (piece.num_pages() == 0) {    // L = 0: nothing to read, not even Q or the block table
        Epilogue::write_empty(p, piece, kv_head, m_tile, static_cast<int>(kRole));
        continue;
      }
      attend_piece<kRole>(p, scales, smem, range, piece, kv_head, m_tile, phases);
    }
    probe_put(p, kProbePieceCount, phases.pieces);
    probe_put(p, kProbeUnitWaits, phases.waits.units);
    probe_put(p, kProbeMailboxWaits, phases.waits.mailbox);
    probe_put(p, kProbePvWaits, phases.waits.pv);
  }
};

FLASH_MLA_NAMESPACE_END  // flash_mla
