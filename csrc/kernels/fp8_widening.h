// FP8 cache: e4m3 pages, and the Q tile of a bf16 q, widened to fp16 in shared memory for the split kernel's 16-bit
// WGMMAs (e4m3 -> fp16 is exact: cvt.rn.f16x2.e4m3x2). Who widens what, and when, is drawn in mainloop.h ("FP8
// cache"): with a 16-bit q the warpgroup that computes S on a page widens each unit just before its WGMMAs; with an
// e4m3 q (Traits::kE4m3Scores) S reads the bytes and only V is widened, in place, after S: three of a pair's four V
// halves by a third warpgroup (kWiden), page b's left half by kPageA.
//   widen_unit     one copy unit of a page buffer, in place (both kernels)
//   widen_q_bf16   a bf16 Q tile rounded to fp16, once per piece (16-bit-q kernel)
//   widen_v_half   one V half of a page buffer, each unit once S has read it (e4m3-scores kernel)
//   widen_pages    the widening warpgroup's walk over the CTA's pages (e4m3-scores kernel)
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "named_barriers.h"
#include "params.h"
#include "splitkv_traits.h"
#include "tile_scheduler.h"
#include "utils.h"
#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN

template <class Traits>
struct Fp8Widening {
  using Element = typename Traits::Element;
  using SharedStorage = typename Traits::SharedStorage;
  using Range = PieceRange<Traits::kSparse>;
  using Barrier = cutlass::arch::ClusterBarrier;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kWgThreads = Traits::kWarpgroupThreads;
  static constexpr int kVHalfUnits = Traits::kUnitsPerVHalf;

  // Widens unit `unit` of page buffer `tile` in place: its 64 e4m3 rows (128 bytes each, swizzled, at the start
  // of the unit's first segment) become the fp16 rows of its segments.
  // Lane group t / 8 of the warpgroup owns rows t / 8 + 16 pass and lane t % 8 its 16-byte chunk i
  // (columns 16 i .. 16 i + 15 of the unit), which widens to chunks 2 (i % 4) and 2 (i % 4) + 1 of segment i / 4.
  // Rows at or past `valid_rows` (the slots past a piece's end, maybe NaN) become zeros: P = 0 times NaN would
  // be NaN in O += P V. Every row is widened as it is, and only a partial page stores zeros over its tail rows
  // afterwards (a per-row test among the conversions cost each chunk a branch; zeroing the loaded bytes, a select
  // per loaded register). Passes are loaded two at a time before they are stored (the loads overlap). A row's
  // writes overwrite only that row's bytes, all of which its own eight lanes have read before the __syncwarp: no
  // other thread is involved, and a unit's bytes are only ever written by the warpgroup that widens it. Lanes
  // 4..7 store their second chunk first, so that a row's eight first stores hit eight different bank groups;
  // they load their chunk's two 8-byte halves swapped (two 8-byte loads, same bandwidth) so that the first
  // widened chunk is always the one stored first, with no per-lane select of registers. The caller fences the
  // writes into the async proxy and synchronises the readers.
  __device__ static void widen_unit(Element* tile, int unit, int valid_rows) {
    static_assert(Traits::kFp8Cache, "only an fp8 unit is widened");
    constexpr int kPasses = kBlockN / 16;                           // 16 rows a pass (eight lanes a row)
    const int t = threadIdx.x % kWgThreads, i = t % 8, row0 = t / 8;
    const bool valid = i / 4 < Traits::unit_segments(unit);        // the RoPE unit's chunks 4..7 are padding
    char* tile_bytes = reinterpret_cast<char*>(tile);
    // The raw rows carry TMA's 128-byte swizzle (chunk i of row r at chunk i ^ (r % 8)): 16 rows further on is
    // the same permutation.
    const char* src = tile_bytes + Traits::first_segment(unit) * int(Traits::kSegmentBytes) + row0 * 128 +
                      (i ^ (row0 % 8)) * 16;
    const int seg = Traits::first_segment(unit) + i / 4;
    const int first = (i / 4) & 1;                                  // 0: chunk 2 (i % 4) first, 1: the other
    // 16 rows further on is two whole swizzle atoms: the same chunk permutation, a constant offset.
    char* dst_first = tile_bytes + Traits::swizzled_chunk_offset(seg, row0, 2 * (i % 4) + first);
    char* dst_second = tile_bytes + Traits::swizzled_chunk_offset(seg, row0, 2 * (i % 4) + 1 - first);
    const char* src_first = src + 8 * first;
    const int second_offset = 8 - 16 * first;
    // Two passes are loaded at a time (their loads overlap). Four at once spilled 12 bytes when the e4m3 kernel's S
    // warpgroups widened, and measured the same as two in its widening warpgroup (given 56 registers).
    constexpr int kPassesAtOnce = 2;
    CUTE_UNROLL
    for (int pass0 = 0; pass0 < kPasses; pass0 += kPassesAtOnce) {
      uint4 bytes[kPassesAtOnce];                                  // the half stored first, then the other
      CUTE_UNROLL
      for (int k = 0; k < kPassesAtOnce; ++k) {
        const int pass = pass0 + k;
        bytes[k] = load_halves(src_first + pass * 16 * 128, src_first + second_offset + pass * 16 * 128);
      }
      __syncwarp();
      if (valid) {
        CUTE_UNROLL
        for (int k = 0; k < kPassesAtOnce; ++k) {
          const int pass = pass0 + k;
          uint4 chunk_first, chunk_second;
          widen_e4m3x16(bytes[k], chunk_first, chunk_second);
          *reinterpret_cast<uint4*>(dst_first + pass * 16 * 128) = chunk_first;
          *reinterpret_cast<uint4*>(dst_second + pass * 16 * 128) = chunk_second;
        }
      }
    }
    if (valid && valid_rows < kBlockN) {               // a piece's partial last page: its tail rows become zeros
      CUTE_UNROLL
      for (int pass = 0; pass < kPasses; ++pass) {
        if (row0 + 16 * pass >= valid_rows) {
          *reinterpret_cast<uint4*>(dst_first + pass * 16 * 128) = make_uint4(0, 0, 0, 0);
          *reinterpret_cast<uint4*>(dst_second + pass * 16 * 128) = make_uint4(0, 0, 0, 0);
        }
      }
    }
  }

  // The Q tile after q_full, a bf16 q (16-bit-q kernel): rounded to fp16 chunk by chunk (each thread rewrites the
  // chunks it read); then both computing warpgroups wait for each other. Every row's bytes are in place (rows past
  // rows_per_kv are zeros). Nothing to do for an fp16 q.
  __device__ static void widen_q_bf16(const DecodeParams& p, SharedStorage& smem) {
    if (p.q_format != kQBf16) return;
    constexpr int kChunks = Traits::kBlockM * kHeadDimQK / 8;
    uint4* chunks = reinterpret_cast<uint4*>(smem.q.data());
    for (int c = threadIdx.x; c < kChunks; c += Traits::kMathThreads) chunks[c] = bf16x8_to_f16x8(chunks[c]);
    cutlass::arch::fence_view_async_shared();    // generic-proxy writes before WGMMA (async proxy) reads
    // Both warpgroups; the non-.aligned form, since warps may arrive here unconverged (synccheck).
    asm volatile("barrier.sync %0, %1;\n" ::"r"(static_cast<uint32_t>(CtaBarrier::kQWidened)),
                 "r"(Traits::kMathThreads) : "memory");
  }

  // kE4m3Scores: V half `half` of buffer `stage`, unit by unit as soon as S has read it (v_unit_read), in place; the
  // caller fences the writes into the async proxy and tells the P V that reads them.
  __device__ static void widen_v_half(SharedStorage& smem, int stage, int half, uint32_t phase, int valid_rows) {
#pragma unroll 1
    for (int u = kVHalfUnits * half; u < kVHalfUnits * (half + 1); ++u) {
      Barrier::wait(&smem.v_unit_read[stage][u], phase);
      widen_unit(smem.k[stage].data(), u, valid_rows);
    }
  }

  // kE4m3Scores: who widens each V half. Page b's left half is read only by kPageA's P_b V_b, and kPageA waits for
  // P_b anyway (~350 cycles a page): it widens that half itself in the wait (mainloop.h), which took it off kWiden's
  // path to kPageB's P V (FP8 compute-bound rows +2.5 %, docs/PERF.md). kWiden widens the other three.
  static constexpr bool widened_by_page_a(int stage, int half) { return stage == 1 && half == 0; }

  // kE4m3Scores, the widening warpgroup (kWiden): walks the pages of the CTA's pieces in the computing warpgroups'
  // order (page k of a piece in buffer k % 2) and widens its V halves in place as soon as S has read them,
  // announcing each (v_half_widened) to the P V that reads it. Rows past a piece's end become zeros.
  __device__ static void widen_pages(SharedStorage& smem, const Range& range) {
    uint32_t phase_0 = 0, phase_1 = 0;    // pages taken by each buffer so far, mod 2 (scalars: no local memory)
    for (int seq = range.first_seq(); seq <= range.last_seq(); ++seq) {
      const Piece piece = range.piece(seq);
      const int num_pages = piece.num_pages();
#pragma unroll 1
      for (int page = 0; page < num_pages; ++page) {
        const int stage = page % 2;
        const uint32_t phase = stage == 0 ? phase_0 : phase_1;
        const int valid_rows = piece.end - (piece.begin + page * kBlockN);
#pragma unroll 1
        for (int half = 0; half < 2; ++half) {
          if (widened_by_page_a(stage, half)) continue;
          widen_v_half(smem, stage, half, phase, valid_rows);
          cutlass::arch::fence_view_async_shared();    // generic-proxy writes before the P V WGMMAs read them
          Barrier::arrive(&smem.v_half_widened[stage][half]);
        }
        if (stage == 0) phase_0 ^= 1;
        else phase_1 ^= 1;
      }
    }
  }
};

FLASH_MLA_NAMESPACE_END  // flash_mla
