// Sparse FP8 decoding (DeepSeek-V3.2, SPEC.md "Sparse FP8 decoding") in the split-KV kernel: gathering the
// 656-byte tokens a page's index slots name, and dequantising them in shared memory.
//
// A "page" of a sparse row is 64 index slots; slot k of page j names cache token indices[seq, s, 64 j + k] (or
// none: -1, past the piece's end, or outside [0, num_tokens)). A token is 512 e4m3 latent values, 4 float32 group
// scales (one per 128 values: true value = stored * scale) and 64 bf16 RoPE values. Its bytes land in a page
// buffer in the FP8 cache's unit layout (splitkv_traits.h), by V half: V half v (latent units 2 v and 2 v + 1,
// columns 256 v .. 256 v + 255, scale groups 2 v and 2 v + 1) as 256 raw bytes per row packed into the segments
// of its second unit (raw_row), the row's two scales at the start of its line in the first unit's second segment
// (scale_pair); the dequantisation turns both units into bf16 rows in place (dequantize_unit says in which order).
// The RoPE unit goes straight into segment 8 in its swizzled bf16 layout. Slots that name no token are zero-filled
// (latent, scales and RoPE): their V rows are zero and S masks them through key_valid, so whatever the cache holds
// elsewhere never enters the result.
//
// Copies, issued by the gather warpgroup (WarpgroupRole::kGather, the CTA's third; run() draws its schedule) once
// the computing warpgroups released the buffer part (part_free): thread t serves row t / 2, whose index PieceRange
// looked up for it (copy_row). Everything goes by cp.async (the LSU path), a slot with no token zero-filling: a
// V half's latent bytes two rows per warp instruction (gather_v_half), the scales 8 bytes per row, the RoPE unit four
// rows per warp instruction. Measured on the b = 128 rows (docs/PERF.md): one 256-byte bulk copy per row and V half
// (the TMA unit) costs the issuing warp a serial loop over its lanes, ~30 % of the gather warpgroup's time, and was
// 5 % slower; with the S warpgroups gathering (before this warpgroup existed), bulk copies had been the faster.
// Each thread arrives (count 128) once its copies have landed (cp.async.mbarrier.arrive.noinc). The RoPE gather
// also records which slots hold a token (key_valid, one ballot word per warp, plain stores), which the S warpgroup
// reads after its S: a plain (release) arrival orders them, on a latent unit's unit_full (unit 0's for the page
// whose S warpgroup dequantises it itself, which waits for it with its raw bytes).
//
// Dequantisation: bf16(stored * scale * 2^-60), in place, unit by unit: page b's by the gather warpgroup (fenced into
// the async proxy, then unit_full), page a's by kPageA just before its WGMMAs (as the FP8 cache's widening): a third
// warpgroup dequantising both pages was slower than the S warpgroups dequantising one each (docs/PERF.md). An e4m3 byte
// s.eeee.mmm becomes the bf16 s.0000eeee.mmm0000, exactly stored * 2^-120 (subnormals included), multiplied by C =
// bf16(scale * 2^60): one bf16 multiply per pair of values, so the key is rounded twice (C and the product), at most
// one unit in the last place from the once-rounded value (C split into two bf16 to round once cost 4 % more on the
// sparse rows; tests/test_sparse_dequant.py models the arithmetic bit for bit). The 2^-60 keeps C a finite normal
// number from the quantiser's smallest scale (2^-126) to just below 2^68 (latent values up to ~10^23); the kernel
// multiplies Q's latent columns by 2^60 (exact) and the output by 2^60 (SplitKvScales::out), so S and O come out
// unscaled.
#pragma once

#include <cuda_bf16.h>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "named_barriers.h"
#include "params.h"
#include "splitkv_traits.h"
#include "tile_scheduler.h"
#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN

// 2^60 (see the file comment).
constexpr float kSparseKScale = 1.152921504606846976e18f;

__device__ __forceinline__ void cp_async_8_zfill(void* smem_dst, const void* gmem_src, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(valid ? 8 : 0));
}

// e4m3 bytes b0, b1 (the low two bytes of `word` after the byte selection `select`) -> the bf16 pair stored * 2^-120.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2_scaled(uint32_t word, uint32_t select) {
  uint32_t t;     // b0 << 8 | b1 << 24
  asm("prmt.b32 %0, %1, 0, %2;\n" : "=r"(t) : "r"(word), "r"(select));
  return (t & 0x80008000u) | ((t >> 4) & 0x07F007F0u);
}

// Bit 7 of each byte of the result is set where that byte of `word` is an e4m3 NaN (s.1111.111): its low seven bits
// are all ones, so they carry into bit 7 once incremented.
__device__ __forceinline__ uint32_t e4m3x4_nan_flags(uint32_t word) {
  return ((word & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
}

// 16 e4m3 values -> 16 bf16 values bf16(stored * 2^-120 * C) (0..7 in lo, 8..15 in hi), C = bf16(scale * 2^60) in
// both halves of `c`: one multiply per pair. NaN stays NaN (as the reference's float32 dequantisation has it).
__device__ __forceinline__ void dequantize_e4m3x16(const uint4& in, __nv_bfloat162 c, uint4& lo, uint4& hi) {
  const uint32_t words[4] = {in.x, in.y, in.z, in.w};
  uint32_t out[8];
  CUTE_UNROLL
  for (int w = 0; w < 4; ++w) {
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      const uint32_t bits = e4m3x2_to_bf16x2_scaled(words[w], half == 0 ? 0x1404u : 0x3424u);
      const __nv_bfloat162 y = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&bits), c);
      out[2 * w + half] = *reinterpret_cast<const uint32_t*>(&y);
    }
  }
  // An e4m3 NaN would come out finite. Rare: the common path only tests for one, and the fix is short (a short
  // fix measured 6 % faster on the sparse rows than a per-value loop, whose code crowded the instruction cache):
  // the flag bit of byte 2 k + i, replicated into a 16-bit mask by prmt's sign mode, makes half i of out[k] NaN.
  const uint32_t any_nan = e4m3x4_nan_flags(words[0]) | e4m3x4_nan_flags(words[1]) | e4m3x4_nan_flags(words[2]) |
                           e4m3x4_nan_flags(words[3]);
  if (any_nan != 0) {
    CUTE_UNROLL
    for (int w = 0; w < 4; ++w) {
      const uint32_t flags = e4m3x4_nan_flags(words[w]);
      uint32_t mask_low, mask_high;     // bytes 0, 1 -> out[2 w]; bytes 2, 3 -> out[2 w + 1]
      asm("prmt.b32 %0, %1, 0, 0x9988;\n" : "=r"(mask_low) : "r"(flags));
      asm("prmt.b32 %0, %1, 0, 0xBBAA;\n" : "=r"(mask_high) : "r"(flags));
      out[2 * w] |= mask_low & 0x7FFF7FFFu;
      out[2 * w + 1] |= mask_high & 0x7FFF7FFFu;
    }
  }
  lo = make_uint4(out[0], out[1], out[2], out[3]);
  hi = make_uint4(out[4], out[5], out[6], out[7]);
}

template <class Traits>
struct SparseGather {
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kWgThreads = Traits::kWarpgroupThreads;
  static constexpr int kRopeUnit = Traits::kRopeUnit;
  static constexpr int kSegmentBytes = kBlockN * 128;                // 8 KiB
  static_assert(Traits::kUnitCols == 128 && Traits::kUnits == 5 && kRopeUnit == 4,
                "4 latent units of 128 e4m3 columns (one scale group each) and the bf16 RoPE unit");
  static_assert(2 * kBlockN == kWgThreads, "two threads per row of a page");

  // A V half v (latent units 2 v and 2 v + 1, columns 256 v .. 256 v + 255) travels as 256 raw bytes per row:
  // raw row r at byte 256 r of the half's second unit's segments, which that unit's dequantisation overwrites
  // in place last. The row's two scales (8 bytes) land at the start of its line in the first unit's second
  // segment, which the first unit's dequantisation overwrites after reading them.
  __device__ static char* raw_row(char* tile, int v_half, int row) {
    return tile + Traits::first_segment(2 * v_half + 1) * kSegmentBytes + row * 256;
  }
  __device__ static char* scale_pair(char* tile, int v_half, int row) {
    return tile + (Traits::first_segment(2 * v_half) + 1) * kSegmentBytes + row * 128;
  }

  using SharedStorage = typename Traits::SharedStorage;
  using Barrier = cutlass::arch::ClusterBarrier;

  // ============================================ gather warpgroup ===========================================
  //
  // The schedule, per pair of pages (a, b) the computing warpgroups take next (mainloop.h), b in buffer 1 only
  // when the piece has it; a buffer's first page waits for nothing, a later one for each part's release:
  //   1. RoPE unit of a, then of b (released right after S on the buffer): cp.async, arrival on unit_full.
  //   2. V halves a-left, b-left, a-right, b-right (each released after its last P V): cp.async onto raw_full.
  //   3. b's latent units, in the order S takes them: wait for the half's raw bytes, dequantise, fence into the
  //      async proxy, arrive on the unit's unit_full (kPageA dequantises a's itself, after raw_full).
  // kPageB's S waits for each unit's unit_full as it would for a TMA copy. Copying b before a (a's S comes first in
  // the pair) measured 7 % slower.
  __device__ static void run(const DecodeParams& p, SharedStorage& smem, const PieceRange<true>& range) {
    // Pages put into each buffer so far: the parity of their barriers' phases. Scalars, not an array: the stage
    // loops stay rolled (one copy of the dequantisation), and a runtime-indexed array would live in local memory.
    uint32_t pages_0 = 0, pages_1 = 0;
    for (int seq = range.first_seq(); seq <= range.last_seq(); ++seq) {
      const Piece piece = range.piece(seq);
      const int num_pages = piece.num_pages();
#pragma unroll 1
      for (int page = 0; page < num_pages; page += 2) {
        const int buffers = page + 1 < num_pages ? 2 : 1;
        const int token_0 = range.page_of(piece, page).block;
        const int token_1 = buffers == 2 ? range.page_of(piece, page + 1).block : -1;
        // This thread's row's token of the page in buffer `stage`, and the pages that buffer took before it.
        auto token_in = [&](int stage) { return stage == 0 ? token_0 : token_1; };
        auto pages_before = [&](int stage) { return stage == 0 ? pages_0 : pages_1; };
#pragma unroll 1
        for (int stage = 0; stage < buffers; ++stage) {
          const uint32_t pages = pages_before(stage);
          if (pages > 0) Barrier::wait(&smem.part_free[stage][kRopePart], (pages - 1) & 1);
          gather_rope(p, tile_of(smem, stage), &smem.unit_full[stage][kRopeUnit], smem.key_valid[stage][pages & 1],
                      token_in(stage));
          // key_valid is a plain store and the RoPE arrival a cp.async one: page a's release for it is unit 0's
          // barrier, which kPageA (dequantising a's units itself) waits for instead; page b's latent arrivals.
          if (Traits::self_dequantises(stage)) Barrier::arrive(&smem.unit_full[stage][0]);
        }
        // V halves in the order their buffers are released: a's left (after kPageA's P_b V_b issue), b's left
        // (kPageA's P_b V_b done), a's right (kPageB's P_a V_a done), b's right (kPageB's P_b V_b done), so that
        // page b's dequantisation (this warpgroup's, on the pair's critical path) starts a copy earlier.
#pragma unroll 1
        for (int k = 0; k < 2 * buffers; ++k) {
          const int stage = buffers == 2 ? (k == 1 || k == 3) : 0;
          const int v_half = buffers == 2 ? k / 2 : k;
          const uint32_t pages = pages_before(stage);
          if (pages > 0) Barrier::wait(&smem.part_free[stage][kVLeftPart + v_half], (pages - 1) & 1);
          gather_v_half(p, tile_of(smem, stage), &smem.raw_full[stage][v_half], token_in(stage), v_half);
        }
        // The latent units no S warpgroup dequantises itself (Traits::self_dequantises), V half by V half.
#pragma unroll 1
        for (int stage = 0; stage < buffers; ++stage) {
          const uint32_t pages = pages_before(stage);
#pragma unroll 1
          for (int v_half = 0; v_half < 2; ++v_half) {
            if (Traits::self_dequantises(stage)) continue;
            Barrier::wait(&smem.raw_full[stage][v_half], pages & 1);
            dequantize_unit(tile_of(smem, stage), 2 * v_half, WarpgroupBarrier::kRawRowsRead, 0);
            cutlass::arch::fence_view_async_shared();    // generic-proxy writes before WGMMA (async proxy) reads
            Barrier::arrive(&smem.unit_full[stage][2 * v_half]);
            dequantize_unit(tile_of(smem, stage), 2 * v_half + 1, WarpgroupBarrier::kRawRowsRead, 0);
            cutlass::arch::fence_view_async_shared();
            Barrier::arrive(&smem.unit_full[stage][2 * v_half + 1]);
          }
        }
        ++pages_0;
        if (buffers == 2) ++pages_1;
      }
    }
  }

  __device__ static char* tile_of(SharedStorage& smem, int stage) {
    return reinterpret_cast<char*>(smem.k[stage].data());
  }

  // Whether a slot's `token` names one (an index outside [0, num_tokens) counts as none), and the first of its
  // 656 bytes in the cache: token 0's for none, which a zero-filling copy then never reads.
  __device__ static bool names_token(const DecodeParams& p, int token) { return token >= 0 && token < p.num_tokens; }
  __device__ static const char* token_bytes(const DecodeParams& p, int token) {
    return static_cast<const char*>(p.k_cache) +
           (names_token(p, token) ? int64_t(token) : 0) * SparseTokenLayout::kTokenBytes;
  }

  // The RoPE unit of the page whose slot for this thread's row holds `token` (< 0: none) into `tile`, arriving on
  // `full` (count 128) once this thread's copies have landed; which slots hold a token goes to key_valid (4
  // words, word w bit 2 k for row 16 w + k). A warp copies its 16 rows four at a time: lane l takes chunk l % 8
  // of row 4 i + l / 8, so that one instruction touches four tokens' lines (not sixteen); a row's token comes from
  // the lane that looked it up (lane 2 k holds row k of the warp's 16).
  __device__ static void gather_rope(const DecodeParams& p, char* tile, uint64_t* full, uint32_t* key_valid,
                                     int token) {
    const int t = threadIdx.x % kWgThreads;
    const int lane = t % 32, warp_row0 = t / 32 * 16;
    CUTE_UNROLL
    for (int i = 0; i < 4; ++i) {
      const int r = 4 * i + lane / 8;
      const int row_token = __shfl_sync(0xffffffffu, token, 2 * r);
      cp_async_16_zfill(tile + Traits::swizzled_chunk_offset(Traits::kRopeSegment, warp_row0 + r, lane % 8),
                        token_bytes(p, row_token) + SparseTokenLayout::kRopeOffset + lane % 8 * 16,
                        names_token(p, row_token));
    }
    const uint32_t ballot = __ballot_sync(0xffffffffu, names_token(p, token));
    if (threadIdx.x % 32 == 0) key_valid[t / 32] = ballot;
    cutlass::arch::cpasync_barrier_arrive_noinc(full);
  }

  // V half `v_half` of the page whose slot for this thread's row holds `token`: the 256 latent bytes of the warp's
  // 16 rows by 16-byte cp.async, two rows per warp instruction (lanes 16 k + c: chunk c of row 2 i + k; a row's token
  // by shuffle from the lane that looked it up), the row's two scales by an 8-byte cp.async of its second thread;
  // everything completes on `raw` (count 128).
  __device__ static void gather_v_half(const DecodeParams& p, char* tile, uint64_t* raw, int token, int v_half) {
    const int t = threadIdx.x % kWgThreads, lane = t % 32, warp_row0 = t / 32 * 16;
    CUTE_UNROLL
    for (int i = 0; i < 8; ++i) {
      const int r = 2 * i + lane / 16;
      const int row_token = __shfl_sync(0xffffffffu, token, 2 * r);
      cp_async_16_zfill(raw_row(tile, v_half, warp_row0 + r) + lane % 16 * 16,
                        token_bytes(p, row_token) + v_half * 256 + lane % 16 * 16, names_token(p, row_token));
    }
    if (t % 2 == 1) {
      cp_async_8_zfill(scale_pair(tile, v_half, t / 2),
                       token_bytes(p, token) + SparseTokenLayout::kScalesOffset + 8 * v_half, names_token(p, token));
    }
    cutlass::arch::cpasync_barrier_arrive_noinc(raw);
  }

  // Dequantises latent unit `unit` of `tile` (after its V half's mbarrier) into the bf16 rows of its two segments.
  // The mapping is the FP8 cache's widen_unit (mainloop.h): lane group t / 8 owns rows t / 8 + 16 pass, lane t % 8
  // its 16-byte chunk i of the unit's 128 raw bytes of the row, which becomes chunks 2 (i % 4), 2 (i % 4) + 1 of
  // segment 2 u + i / 4.
  // - The half's first unit reads the first 128 bytes of each raw row and writes segments that hold no raw row; a
  //   row's scale pair lies in the row's own line, read by the row's eight lanes (one warp) before the __syncwarp
  //   that precedes the stores; the pair's second scale then goes into the raw row's first 4 bytes (read already).
  // - The second unit writes over the raw rows themselves, across warps (row r's lines hold raw rows r / 2 and
  //   32 + r / 2): every thread loads all four passes, the warpgroup syncs, then they store.
  // The caller fences the writes into the async proxy before it announces the unit.
  __device__ static void dequantize_unit(char* tile, int unit, WarpgroupBarrier raw_read, int warpgroup) {
    constexpr int kPasses = kBlockN / 16;
    const int t = threadIdx.x % kWgThreads, i = t % 8, row0 = t / 8;
    const int v_half = unit / 2, second = unit % 2;
    const int seg = Traits::first_segment(unit) + i / 4;
    const int first = (i / 4) & 1;     // lanes 4..7 store their second chunk first (bank spread, as widen_unit)
    char* dst_first = tile + Traits::swizzled_chunk_offset(seg, row0, 2 * (i % 4) + first);
    char* dst_second = tile + Traits::swizzled_chunk_offset(seg, row0, 2 * (i % 4) + 1 - first);
    auto store = [&](int pass, const uint4& bytes, float scale) {
      uint4 chunk_first, chunk_second;
      dequantize_e4m3x16(bytes, __float2bfloat162_rn(scale * kSparseKScale), chunk_first, chunk_second);
      *reinterpret_cast<uint4*>(dst_first + pass * 16 * 128) = chunk_first;
      *reinterpret_cast<uint4*>(dst_second + pass * 16 * 128) = chunk_second;
    };
    if (!second) {
      constexpr int kPassesAtOnce = 2;    // their loads overlap; fewer registers live than with all four
      CUTE_UNROLL
      for (int pass0 = 0; pass0 < kPasses; pass0 += kPassesAtOnce) {
        uint4 bytes[kPassesAtOnce];
        float2 scales[kPassesAtOnce];
        CUTE_UNROLL
        for (int k = 0; k < kPassesAtOnce; ++k) {
          const int row = row0 + 16 * (pass0 + k);
          const char* chunk = raw_row(tile, v_half, row) + i * 16;    // the chunk's half stored first, then the other
          bytes[k] = load_halves(chunk + 8 * first, chunk + 8 * (1 - first));
          scales[k] = *reinterpret_cast<const float2*>(scale_pair(tile, v_half, row));
        }
        __syncwarp();
        CUTE_UNROLL
        for (int k = 0; k < kPassesAtOnce; ++k) {
          store(pass0 + k, bytes[k], scales[k].x);
          if (i == 0) *reinterpret_cast<float*>(raw_row(tile, v_half, row0 + 16 * (pass0 + k))) = scales[k].y;
        }
      }
    } else {
      __syncwarp();    // the first unit's lane 0 of each row stashed the row's second scale; its lanes read it
      uint4 bytes[kPasses];
      float scale[kPasses];
      CUTE_UNROLL
      for (int pass = 0; pass < kPasses; ++pass) {
        const char* row_bytes = raw_row(tile, v_half, row0 + 16 * pass);
        const char* chunk = row_bytes + 128 + i * 16;
        bytes[pass] = load_halves(chunk + 8 * first, chunk + 8 * (1 - first));
        scale[pass] = *reinterpret_cast<const float*>(row_bytes);
      }
      warpgroup_sync(raw_read, warpgroup);    // every raw byte read before any is overwritten
      CUTE_UNROLL
      for (int pass = 0; pass < kPasses; ++pass) store(pass, bytes[pass], scale[pass]);
    }
  }

  // Q's latent columns (segments 0..7 of the tile) times 2^60, exact: S = (2^60 Q) (2^-60 K)^T. Each warpgroup
  // takes half of the 16-byte chunks; the caller fences and syncs both warpgroups.
  __device__ static void scale_q_latent(char* q_tile, int warpgroup) {
    constexpr int kChunks = Traits::kRopeSegment * kSegmentBytes / 16;
    const __nv_bfloat162 factor = __float2bfloat162_rn(kSparseKScale);
    uint4* chunks = reinterpret_cast<uint4*>(q_tile);
    for (int c = warpgroup * kWgThreads + threadIdx.x % kWgThreads; c < kChunks; c += 2 * kWgThreads) {
      uint4 v = chunks[c];
      __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&v);
      CUTE_UNROLL
      for (int k = 0; k < 4; ++k) pairs[k] = __hmul2(pairs[k], factor);
      chunks[c] = v;
    }
  }
};

FLASH_MLA_NAMESPACE_END  // flash_mla
