// Sparse FP8 decoding (DeepSeek-V3.2, SPEC.md "Sparse FP8 decoding") in the split-KV kernel: gathering the
// 656-byte tokens a page's index slots name, and dequantising them in shared memory.
//
// A "page" of a sparse row is 64 index slots; slot k of page j names cache token indices[seq, s, 64 j + k] (or
// none: -1, past the piece's end, or outside [0, num_tokens)). A token is 512 e4m3 latent values, 4 float32 group
// scales (one per 128 values: true value = stored * scale) and 64 bf16 RoPE values. Its bytes land in a page
// buffer in the FP8 cache's unit layout (splitkv_traits.h), by V half: V half v (latent units 2 v and 2 v + 1,
// columns 256 v .. 256 v + 255, scale groups 2 v and 2 v + 1) as 256 raw bytes per row packed into the segments
// of its second unit (raw_row, chunks bank-spread by raw_chunk), the row's scales in its line of the first unit's
// second segment (scale_pair); the dequantisation turns both units into fp16 rows in place (dequantize_unit says in
// which order).
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
// Dequantisation: fp16(stored * fp16(scale * 2^-E)), in place, unit by unit: page b's by the gather warpgroup
// (fenced into the async proxy, then unit_full), page a's by kPageA just before its WGMMAs (as the FP8 cache's
// widening): a third warpgroup dequantising both pages was slower than the S warpgroups dequantising one each
// (docs/PERF.md). E is one power of two per page: the exponent of the page's largest scale, rounded up
// (page_exponent: every scale times 2^-E is at most 1), from all 64 tokens' four scales, which the left V half's copy
// brings along (16 bytes; the right half's brings its two again). An e4m3 byte widens to fp16 exactly
// (`cvt.rn.f16x2.e4m3x2`, NaN included), then one fp16 multiply per pair of values: the key is rounded twice (the
// factor and the product; tests/test_sparse_dequant.py models the arithmetic bit for bit). The keys are thus 2^-E
// times their values: S's RoPE unit (bf16, as gathered) is computed first and its accumulator multiplied by 2^-E
// before the latent units add to it, S by 2^E after; P V takes P times 2^(E - E_ref) for the running largest E_ref
// of the piece and O comes out times 2^E_ref (mainloop.h). Q's latent columns are rounded to fp16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "named_barriers.h"
#include "params.h"
#include "splitkv_traits.h"
#include "tile_scheduler.h"
#include "utils.h"
#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN

__device__ __forceinline__ void cp_async_8_zfill(void* smem_dst, const void* gmem_src, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(valid ? 8 : 0));
}

// 2^e as a float, e in [-126, 127].
__device__ __forceinline__ float pow2(int e) { return __uint_as_float(static_cast<uint32_t>(127 + e) << 23); }

// The frames of P and O (the file comment, mainloop.h): 2^d for an exponent difference d <= 0, 0 past fp32's normal
// range (a page with no exponent yet: kNoFrame).
constexpr int kNoFrame = -1000;
__device__ __forceinline__ float frame_factor(int d) { return d < -126 ? 0.f : pow2(d); }

// Every element of a register tensor times f (nothing to do for f == 1, the common case).
template <class TensorX>
__device__ __forceinline__ void scale_all(TensorX&& x, float f) {
  if (f == 1.f) return;
  CUTE_UNROLL
  for (int j = 0; j < cute::size(x); ++j) x(j) *= f;
}

// The power of two a page's keys are stored without (the file comment): the exponent of its largest scale magnitude
// (a float >= 0; zero for a page with no token), rounded up, within [kMinPageExponent, 126]: 2^E is a normal float
// (an infinite scale stays infinite in its factor, as in the reference's dequantisation), and S's RoPE part times
// 2^-E stays finite for any |S_rope| < 2^68 (the quantiser's smallest scale, 2^-126 for a group of zeros, would
// otherwise put it at 2^126 times its size). A page whose scales all lie below 2^-60 (latent values below ~2^-51)
// keeps its latent keys only to fp16's subnormal range there.
constexpr int kMinPageExponent = -60;
__device__ __forceinline__ int page_exponent(float max_scale) {
  const uint32_t bits = __float_as_uint(max_scale);
  const int biased = static_cast<int>(bits >> 23);
  const int e = biased - 127 + ((bits & 0x7FFFFFu) != 0);
  return min(max(e, kMinPageExponent), 126);
}

// 16 e4m3 values -> 16 fp16 values fp16(stored * c) (0..7 in lo, 8..15 in hi): exact widening (NaN stays NaN),
// then one fp16 multiply per pair.
__device__ __forceinline__ uint32_t hmul2_bits(uint32_t x, __half2 c) {
  const __half2 y = __hmul2(*reinterpret_cast<const __half2*>(&x), c);
  return *reinterpret_cast<const uint32_t*>(&y);
}
// Bytes 0, 1 (high = false) or 2, 3 of `word`, two e4m3 values, as the fp16 pair fp16(stored * c).
__device__ __forceinline__ uint32_t dequantize_e4m3x2(uint32_t word, bool high, __half2 c) {
  uint32_t wide;
  if (high) {
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 %0, h;\n}\n" : "=r"(wide) : "r"(word));
  } else {
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 %0, l;\n}\n" : "=r"(wide) : "r"(word));
  }
  return hmul2_bits(wide, c);
}
__device__ __forceinline__ void dequantize_e4m3x16(const uint4& in, __half2 c, uint4& lo, uint4& hi) {
  lo = make_uint4(dequantize_e4m3x2(in.x, false, c), dequantize_e4m3x2(in.x, true, c),
                  dequantize_e4m3x2(in.y, false, c), dequantize_e4m3x2(in.y, true, c));
  hi = make_uint4(dequantize_e4m3x2(in.z, false, c), dequantize_e4m3x2(in.z, true, c),
                  dequantize_e4m3x2(in.w, false, c), dequantize_e4m3x2(in.w, true, c));
}

template <class Traits>
struct SparseGather {
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kWgThreads = Traits::kWarpgroupThreads;
  static constexpr int kRopeUnit = Traits::kRopeUnit;
  static constexpr int kSegmentBytes = int(Traits::kSegmentBytes);    // 8 KiB
  static_assert(Traits::kUnitCols == 128 && Traits::kUnits == 5 && kRopeUnit == 4,
                "4 latent units of 128 e4m3 columns (one scale group each) and the bf16 RoPE unit");
  static_assert(2 * kBlockN == kWgThreads, "two threads per row of a page");

  // A V half v (latent units 2 v and 2 v + 1, columns 256 v .. 256 v + 255) travels as 256 raw bytes per row:
  // raw row r at byte 256 r of the half's second unit's segments, which that unit's dequantisation overwrites
  // in place last. The row's scales land in its line of the first unit's second segment, which the first unit's
  // dequantisation overwrites after reading them.
  // Bank spread: rows start 256 (raw) or 128 (scales) bytes apart, i.e. on the same bank, and a warp's loads
  // take four rows at once. So a raw row's 16-byte chunk c sits at slot (c % 8) ^ 4 (r % 2) of its 128-byte half
  // (with the lanes' half-swapped 8-byte loads, an even and an odd row together cover all 32 banks), and row r's
  // scales, and the second scale the first unit stashes for the second, at the row's 16-byte slot r % 8.
  __device__ static char* raw_row(char* tile, int v_half, int row) {
    return tile + Traits::first_segment(2 * v_half + 1) * kSegmentBytes + row * 256;
  }
  __device__ static int raw_chunk(int row, int chunk) { return chunk / 8 * 128 + ((chunk % 8) ^ (row % 2 * 4)) * 16; }
  __device__ static float* scale_stash(char* tile, int v_half, int row) {
    return reinterpret_cast<float*>(raw_row(tile, v_half, row) + row % 8 * 16);
  }
  __device__ static char* scale_pair(char* tile, int v_half, int row) {
    return tile + (Traits::first_segment(2 * v_half) + 1) * kSegmentBytes + row * 128 + row % 8 * 16;
  }

  using SharedStorage = typename Traits::SharedStorage;
  using Barrier = cutlass::arch::ClusterBarrier;

  // ============================================ gather warpgroup ===========================================
  //
  // The schedule, per pair of pages (a, b) the computing warpgroups take next (mainloop.h), b in buffer 1 only
  // when the piece has it; a buffer's first page waits for nothing, a later one for each part's release:
  //   1. RoPE unit of a, then of b (released right after S on the buffer): cp.async, arrival on unit_full.
  //   2. V halves a-left, b-left, a-right, b-right (each released after its last P V): cp.async onto raw_full.
  //   3. b's latent units, in the order S takes them: wait for the half's raw bytes (the left half's first: the
  //      page's exponent), dequantise, fence into the async proxy, arrive on the unit's unit_full (kPageA
  //      dequantises a's itself, after raw_full).
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
          int exponent = 0;
#pragma unroll 1
          for (int v_half = 0; v_half < 2; ++v_half) {
            if (Traits::self_dequantises(stage)) continue;
            Barrier::wait(&smem.raw_full[stage][v_half], pages & 1);
            if (v_half == 0) {
              exponent = page_exponent_of(tile_of(smem, stage), WarpgroupBarrier::kRawRowsRead, 0,
                                          smem.scale_max_partial[stage]);
            }
            dequantize_unit(tile_of(smem, stage), 2 * v_half, WarpgroupBarrier::kRawRowsRead, 0, exponent);
            cutlass::arch::fence_view_async_shared();    // generic-proxy writes before WGMMA (async proxy) reads
            // kPageB reads the page's exponent after unit 0's arrival
            if (v_half == 0 && threadIdx.x % kWgThreads == 0) smem.page_exponent[stage][pages & 1] = exponent;
            Barrier::arrive(&smem.unit_full[stage][2 * v_half]);
            dequantize_unit(tile_of(smem, stage), 2 * v_half + 1, WarpgroupBarrier::kRawRowsRead, 0, exponent);
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
  // by shuffle from the lane that looked it up), the row's scales by one cp.async of its second thread (all four
  // with the left half, the right half's two with it); everything completes on `raw` (count 128).
  __device__ static void gather_v_half(const DecodeParams& p, char* tile, uint64_t* raw, int token, int v_half) {
    const int t = threadIdx.x % kWgThreads, lane = t % 32, warp_row0 = t / 32 * 16;
    CUTE_UNROLL
    for (int i = 0; i < 8; ++i) {
      const int r = 2 * i + lane / 16;
      const int row_token = __shfl_sync(0xffffffffu, token, 2 * r);
      cp_async_16_zfill(raw_row(tile, v_half, warp_row0 + r) + raw_chunk(warp_row0 + r, lane % 16),
                        token_bytes(p, row_token) + v_half * 256 + lane % 16 * 16, names_token(p, row_token));
    }
    if (t % 2 == 1) {    // the left half brings all four scales (the page's exponent needs them), the right its two
      if (v_half == 0) {
        cp_async_16_zfill(scale_pair(tile, 0, t / 2), token_bytes(p, token) + SparseTokenLayout::kScalesOffset,
                          names_token(p, token));
      } else {
        cp_async_8_zfill(scale_pair(tile, 1, t / 2), token_bytes(p, token) + SparseTokenLayout::kScalesOffset + 8,
                         names_token(p, token));
      }
    }
    cutlass::arch::cpasync_barrier_arrive_noinc(raw);
  }

  // Dequantises latent unit `unit` of `tile` (after its V half's mbarrier) into the fp16 rows of its two segments.
  // The mapping is the FP8 cache's widen_unit (fp8_widening.h): lane group t / 8 owns rows t / 8 + 16 pass, lane t % 8
  // its 16-byte chunk i of the unit's 128 raw bytes of the row, which becomes chunks 2 (i % 4), 2 (i % 4) + 1 of
  // segment 2 u + i / 4.
  // - The half's first unit reads the first 128 bytes of each raw row and writes segments that hold no raw row; a
  //   row's scale pair lies in the row's own line, read by the row's eight lanes (one warp) before the __syncwarp
  //   that precedes the stores; the pair's second scale then goes into the raw row's first 128 bytes (read
  //   already; scale_stash).
  // - The second unit writes over the raw rows themselves, across warps (row r's lines hold raw rows r / 2 and
  //   32 + r / 2): passes 0 and 2 loaded, a warpgroup barrier, pass 0 stored, pass 1 loaded and stored, pass 3
  //   loaded, a barrier, passes 2 and 3 stored.
  // The caller fences the writes into the async proxy before it announces the unit. `exponent`: the page's
  // (page_exponent_of, before the first unit).
  __device__ static void dequantize_unit(char* tile, int unit, WarpgroupBarrier raw_read, int warpgroup,
                                        int exponent) {
    constexpr int kPasses = kBlockN / 16;
    const int t = threadIdx.x % kWgThreads, i = t % 8, row0 = t / 8;
    const int v_half = unit / 2, second = unit % 2;
    const int seg = Traits::first_segment(unit) + i / 4;
    const int first = (i / 4) & 1;     // lanes 4..7 store their second chunk first (bank spread, as widen_unit)
    char* dst_first = tile + Traits::swizzled_chunk_offset(seg, row0, 2 * (i % 4) + first);
    char* dst_second = tile + Traits::swizzled_chunk_offset(seg, row0, 2 * (i % 4) + 1 - first);
    const float unscale = pow2(-exponent);
    auto store = [&](int pass, const uint4& bytes, float scale) {
      uint4 chunk_first, chunk_second;
      dequantize_e4m3x16(bytes, __float2half2_rn(scale * unscale), chunk_first, chunk_second);
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
          const char* chunk = raw_row(tile, v_half, row) + raw_chunk(row, i);    // the half stored first, then the rest
          bytes[k] = load_halves(chunk + 8 * first, chunk + 8 * (1 - first));
          scales[k] = *reinterpret_cast<const float2*>(scale_pair(tile, v_half, row));
        }
        __syncwarp();
        CUTE_UNROLL
        for (int k = 0; k < kPassesAtOnce; ++k) {
          store(pass0 + k, bytes[k], scales[k].x);
          if (i == 0) *scale_stash(tile, v_half, row0 + 16 * (pass0 + k)) = scales[k].y;
        }
      }
    } else {
      __syncwarp();    // the first unit's lane 0 of each row stashed the row's second scale; its lanes read it
      uint4 bytes[kPasses];
      float scale[kPasses];
      auto load = [&](int pass) {
        const int row = row0 + 16 * pass;
        const char* chunk = raw_row(tile, v_half, row) + raw_chunk(row, 8 + i);
        bytes[pass] = load_halves(chunk + 8 * first, chunk + 8 * (1 - first));
        scale[pass] = *scale_stash(tile, v_half, row);
      };
      // Output rows [0, 32) (passes 0, 1) overwrite the raw rows passes 0 and 2 read, rows [32, 64) those of passes
      // 1 and 3: two rounds, each after a warpgroup barrier, hold fewer raw chunks in registers than all four.
      load(0);
      load(2);
      warpgroup_sync(raw_read, warpgroup);    // raw rows of passes 0 and 2 read everywhere
      store(0, bytes[0], scale[0]);
      load(1);
      store(1, bytes[1], scale[1]);
      load(3);
      warpgroup_sync(raw_read, warpgroup);    // raw rows of passes 1 and 3 read everywhere
      store(2, bytes[2], scale[2]);
      store(3, bytes[3], scale[3]);
    }
  }

  // The page's exponent (page_exponent) from its 64 rows' four scales, once the left V half's raw bytes landed and
  // before its first unit is dequantised: each lane takes the rows of its dequantisation passes, the warps' maxima
  // meet in `partial` (4 floats of this buffer) across a warpgroup barrier. Every thread returns it; the caller's
  // thread 0 stores it in SharedStorage::page_exponent for the other warpgroups before it announces unit 0.
  __device__ static int page_exponent_of(char* tile, WarpgroupBarrier barrier, int warpgroup, float* partial) {
    constexpr int kPasses = kBlockN / 16;
    const int t = threadIdx.x % kWgThreads, row0 = t / 8;
    float m = 0.f;
    CUTE_UNROLL    // the four loads in flight at once: each waits behind the other warpgroups' shared-memory traffic
    for (int pass = 0; pass < kPasses; ++pass) {
      const float4 sc = *reinterpret_cast<const float4*>(scale_pair(tile, 0, row0 + 16 * pass));
      m = fmaxf(m, fmaxf(fmaxf(fabsf(sc.x), fabsf(sc.y)), fmaxf(fabsf(sc.z), fabsf(sc.w))));
    }
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));     // the warp's four row groups (lanes t / 8)
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
    if (t % 32 == 0) partial[t / 32] = m;
    warpgroup_sync(barrier, warpgroup);
    const float4 all = *reinterpret_cast<const float4*>(partial);
    return page_exponent(fmaxf(fmaxf(all.x, all.y), fmaxf(all.z, all.w)));
  }

  // Q's latent columns (segments 0..7 of the tile) rounded to fp16 (the RoPE segment stays bf16 for S's RoPE unit);
  // each warpgroup takes half of the 16-byte chunks; the caller fences and syncs both warpgroups.
  __device__ static void q_latent_to_fp16(char* q_tile, int warpgroup) {
    constexpr int kChunks = Traits::kRopeSegment * kSegmentBytes / 16;
    uint4* chunks = reinterpret_cast<uint4*>(q_tile);
    for (int c = warpgroup * kWgThreads + threadIdx.x % kWgThreads; c < kChunks; c += 2 * kWgThreads) {
      chunks[c] = bf16x8_to_f16x8(chunks[c]);
    }
  }
};

FLASH_MLA_NAMESPACE_END  // flash_mla
