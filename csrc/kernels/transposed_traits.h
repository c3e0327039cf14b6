// Compile-time configuration of the transposed FP8 kernel (splitkv_fp8_transposed.cu): an e4m3 cache and an e4m3 q
// with at most 32 packed query rows per KV head, the memory-bound shapes where the 64-row tile of the split-KV
// kernel leaves three quarters of every WGMMA empty and its V widening starves for shared-memory bandwidth
// (docs/PERF.md "FP8 cache").
//
// The tile is transposed: the page's 64 keys are WGMMA's M and the query rows its N (kRows: 16 or 32), so
//   S^T = K Q^T      e4m3 SS m64nNk32    A = the page as TMA lands it (keys x columns, K-major), B = the Q tile
//   O^T += V^T P^T   fp16 RS m64nNk16    A = V^T (dims x keys) built in registers from the page's e4m3 bytes
//                                        (ldmatrix.trans, byte permutes, cvt), B = P^T (rows x keys) in shared memory
// and V is never written back to shared memory in fp16. Each computing warpgroup holds the whole 512 x kRows O^T
// (4 kRows registers a thread) and takes every other page of the CTA's stream; a producer warp issues the copies.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/numeric_types.h>

#include "params.h"
#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN

// The CTA's warpgroups: two computing (pages 2 j and 2 j + 1 of the CTA's stream), then the producer (one warp of it
// issues the copies).
enum class TransposedRole : int { kEvenPages = 0, kOddPages = 1, kProducer = 2 };

template <int kRows_, bool kWideQ_ = false>
struct TransposedTraits {
  using E4m3 = cutlass::float_e4m3_t;
  using Half = cutlass::half_t;

  static constexpr int kRows = kRows_;                 // query rows of a tile: N of both GEMMs
  // A 16-bit q (kWideQ: bf16 or fp16): the computing warpgroups quantise each Q tile to three e4m3 terms with one
  // descale per tile, q / d = t0 + t1 / 16 + t2 / 256 (t_i+1 = e4m3(kQLoScale (the rest after t_i))); the three
  // terms of 16 query rows are the rows of one B operand (N = 48), so that S^T reads each K block once for all three
  // and each term's sum is a column block of its own. Two terms left scores ~2^-8 |q| |k| off (GPU: lse max error
  // 1.2-2.6e-3, against tests/test_fp8.py's 1e-3); three pass the e4m3 q's tolerances.
  static constexpr bool kWideQ = kWideQ_;
  static constexpr int kQTerms = kWideQ ? 3 : 1;
  static constexpr int kQRows = kQTerms * kRows;       // rows of a Q tile
  // S^T's WGMMAs take kSTileCols rows of the Q tile as their N: an e4m3 q the whole tile, a 16-bit q 16 query rows'
  // three terms. So a 16-bit q at 32 rows has two S tiles, taken one after the other through S^T, the softmax and
  // P^T (tile-major), so that one tile's 24-value part and 8 scores are live at a time (one N = 96 part spilled
  // beside O^T's 128 registers, and so did two tiles unit by unit: ptxas overlapped their parts).
  static constexpr int kSTileCols = kWideQ ? 16 * kQTerms : kRows;
  static constexpr int kSTiles = kQRows / kSTileCols;
  // Who fills a Q slot: an e4m3 q, warp 0 of the producer warpgroup (cp.async beside its page copies, into the slot
  // the piece after next will use); a 16-bit q, the two computing warpgroups at the start of each piece, in one slot
  // (mainloop quantise_q). Producer warps did it first, off the computing path, but at 24 registers a thread held
  // one load in flight and a 32-row tile took ~30 us in series with its piece (H200: 254 us on L=4096v h32 s1 against
  // 160 us fixed; with the computing warpgroups 172 and 135).
  static constexpr int kQThreads = kWideQ ? 256 : 32;
  static_assert(kQThreads / 32 <= 8, "SharedStorage::q_amax holds 8 warps' maxima");
  // The rest after a term is at most half an e4m3 step of it, 16 where |q / d| nears 448, so 16 times it stays
  // within e4m3's range (256 <= 448) and small values keep 4 more bits above e4m3's subnormals.
  static constexpr float kQLoScale = 16.f;
  static_assert(kRows == 16 || kRows == 32, "O^T is 4 kRows registers a thread");
  // Page buffers (H200, the 16-row pipeline modelled before this kernel: 4 pages 4.51 TB/s, 3 4.43, 2 3.49). At 32
  // rows 3 (with a 16 KiB hand-over area) ran 3 % faster than 4 (an 8 KiB one, four rounds; H200, same process,
  // 13 rows of h_q x s_q 16 and 32, 4 rotations: 1.537 vs 1.492 of the anchors' bf16); so did a 16-bit q's at 16
  // rows beside its Q tile of three terms (48 rows; 96 at 32): 1.629 vs 1.615, the 6 h16 s1 table rows, 4 rotations.
  static constexpr int kRing = kRows == 16 && !kWideQ ? 4 : 3;
  // Q tiles: an e4m3 q's next piece lands while this one's is read; a 16-bit q's is made when its piece starts
  static constexpr int kQSlots = kWideQ ? 1 : 2;
  static constexpr int kWarpgroupThreads = 128;
  static constexpr int kComputeWarpgroups = 2;
  // A whole producer warpgroup (one warp of it works) so that setmaxnreg can move its registers to the computing
  // warpgroups: with 9 warps one SM sub-partition holds 3 and ptxas allows 168 registers a thread (28 bytes spilled).
  static constexpr int kThreads = (kComputeWarpgroups + 1) * kWarpgroupThreads;
  // Registers a thread after setmaxnreg (multiples of 8). The split may use no more than the CTA got at launch
  // (168 a thread at 384 threads): setmaxnreg.inc takes registers from the CTA's own pool, which only the producer's
  // setmaxnreg.dec fills, and waits forever for any it cannot get (32 / 240 / 240 hung every call).
  static constexpr int kLaunchRegisters = 64 * 1024 / kThreads / 8 * 8;
  static constexpr int kProducerRegisters = 24;
  static constexpr int kComputeRegisters = 240;
  static_assert(kComputeWarpgroups * kComputeRegisters + kProducerRegisters <=
                    (kComputeWarpgroups + 1) * kLaunchRegisters,
                "the registers setmaxnreg hands out are those the CTA was launched with");
  static constexpr int kSlots = kRows / 4;             // query columns a thread holds in S^T and O^T
  static constexpr int kValues = kRows / 2;            // accumulator values a thread holds per 64-row block

  // A page in shared memory: five units of 64 keys x 128 e4m3 columns, one TMA box each (kv_cache_tma.h); units
  // 0-3 are V (and K's latent part), unit 4 RoPE, whose columns 576..639 TMA fills with zeros and S never reads.
  static constexpr int kUnits = 5;
  static constexpr int kUnitCols = 128;
  static constexpr int kUnitBytes = kPageBlockSize * kUnitCols;
  static constexpr int kPageBytes = kUnits * kUnitBytes;
  static constexpr int kQBytes = kQRows * kUnits * kUnitCols;
  static constexpr int kQChunksPerRow = kHeadDimQK / 16;          // 16-byte cp.async chunks of a q row
  static constexpr int kDimBlocks = kHeadDimV / 64;               // M blocks of O^T
  static constexpr int kKeyBlocks = kPageBlockSize / 16;          // K blocks of O^T
  static constexpr int kExchangeBlocks = kDimBlocks / kComputeWarpgroups;    // dim blocks a warpgroup hands over
  // The hand-over goes through 16 KiB a warpgroup (8 float4 a thread), in rounds of kRoundBlocks dim blocks.
  static constexpr int kExchangeFloat4s = 8;
  static constexpr int kRoundBlocks = kExchangeFloat4s * 4 / kValues;
  static constexpr int kExchangeRounds = kExchangeBlocks / kRoundBlocks;
  // O^T's WGMMAs go in batches of kBatchBlocks dim blocks (one key block), their V^T fragments loaded one batch
  // ahead: two sets of 4 kBatchBlocks registers a thread (at 32 rows O^T's 128 leave room for two sets of 16).
  static constexpr int kBatchBlocks = kRows == 16 ? 8 : 4;

  // Byte offset in a page buffer of 16-byte chunk `chunk` (< 8) of unit `unit` of key `key`, i.e. of e4m3 columns
  // 128 unit + 16 chunk .. + 15: units of 64 keys x 128 bytes with the 128-byte swizzle (SmemLayoutPage, as TMA
  // lands a box; csrc/checks/smem_layout_check.cu).
  __host__ __device__ static constexpr int page_chunk_offset(int key, int unit, int chunk) {
    return unit * kUnitBytes + key * 128 + ((chunk ^ (key % 8)) * 16);
  }
  // The O^T WGMMAs' V^T fragments (mainloop's VtAddresses): lane `lane` of warp `warp` in warpgroup w reads, for
  // dim block mb (O^T's order: dims 64 ((mb + 4 w) mod 8) + 16 warp ..) and key block kb, the ldmatrix row of key
  // 16 kb + lane % 16, 16-byte chunk 4 (mb & 1) + warp of unit ((mb >> 1) + 2 w) mod 4. Its page_chunk_offset is
  // vt_lane_offset(mb & 1, warp, lane) + vt_block_offset(mb, kb, w): the 128-byte swizzle's key % 8 is lane % 8 for
  // every kb, and ((mb >> 1) + 2 w) mod 4 = (mb >> 1) ^ 2 w (csrc/checks/smem_layout_check.cu checks the sum).
  __host__ __device__ static constexpr int vt_lane_offset(int parity, int warp, int lane) {
    return (lane & 15) * 128 + (((4 * parity + warp) ^ (lane % 8)) * 16);
  }
  __host__ __device__ static constexpr uint32_t vt_unit_flip(int warpgroup) {
    return static_cast<uint32_t>(2 * warpgroup * kUnitBytes);
  }
  __host__ __device__ static constexpr uint32_t vt_block_offset(int mb, int kb, uint32_t unit_flip) {
    return (static_cast<uint32_t>((mb >> 1) * kUnitBytes) ^ unit_flip) + kb * 16 * 128;
  }
  // Byte offset in a P^T buffer of the 16-byte chunk holding keys [8 k, 8 k + 8) of row (query column) `row`
  // (SmemLayoutPt: rows of 64 fp16 keys, the 128-byte swizzle).
  __host__ __device__ static constexpr int pt_chunk_offset(int row, int key_chunk) {
    return row * 128 + (key_chunk ^ (row % 8)) * 16;
  }

  using SmemLayoutPage = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<E4m3>{},
                                                      cute::Shape<cute::Int<kPageBlockSize>, cute::Int<kUnits * kUnitCols>>{}));
  // (kSTileCols, 640, kSTiles): S tile j's rows are 16 j .. 16 j + 15 of the tile's query rows (a 16-bit q: term t
  // at rows 16 t .. of it; an e4m3 q: one S tile of all kRows)
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<E4m3>{},
      cute::Shape<cute::Int<kSTileCols>, cute::Int<kUnits * kUnitCols>, cute::Int<kSTiles>>{}));
  using SmemLayoutPt = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Half>{},
                                                    cute::Shape<cute::Int<kRows>, cute::Int<kPageBlockSize>>{}));
  using TiledMmaS = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<E4m3, E4m3, float, cute::Shape<cute::_64, cute::Int<kSTileCols>, cute::_128>>()));
  static_assert(cute::size<1>(typename TiledMmaS::AtomShape_MNK{}) == kSTileCols,
                "S^T in one WGMMA per K block (N = 48 for a 16-bit q: CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED before CuTe)");
  using TiledMmaO = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Half, Half, float, cute::Shape<cute::_64, cute::Int<kRows>, cute::_16>>()));

  struct SharedStorage {
    alignas(1024) uint8_t page[kRing][kPageBytes];
    alignas(1024) uint8_t q[kQSlots][kQBytes];
    alignas(1024) Half pt[kComputeWarpgroups][kRows * kPageBlockSize];    // each warpgroup's P^T
    // End of a piece: each warpgroup hands the other the dim blocks that one finishes, scaled to the common
    // reference (thread-major float4s: thread t of one warpgroup holds what thread t of the other reads).
    alignas(16) float4 exchange[kComputeWarpgroups][kExchangeFloat4s][kWarpgroupThreads];
    float col_max[kComputeWarpgroups][4][kRows];    // a warp's column maxima, when a reference moves
    float piece_sum[kComputeWarpgroups][4][kRows];  // a warp's column sums at the end of a piece
    float piece_ref[kComputeWarpgroups][kRows];     // a warpgroup's references at the end of a piece
    // Where packed row r's results go within a sequence's block of out and of lse, and its query head: the same for
    // every piece of the CTA, so computed once (per slot and piece, the divisions by heads_per_kv and 64-bit offsets
    // took ~2.5 % of the kernel's warp samples, H200)
    int row_out[kRows];
    int row_lse[kRows];
    int row_head[kRows];
    // A 16-bit q: each computing warp's maximum of |q|, then the tile's descale
    alignas(16) float q_amax[8];
    float q_descale;
    alignas(8) uint64_t page_full[kRing];
    alignas(8) uint64_t page_empty[kRing];
    alignas(8) uint64_t q_full[kQSlots];
    alignas(8) uint64_t q_empty[kQSlots];
    alignas(8) uint64_t stats_posted;       // the epilogue's hand-offs (transposed_epilogue.h), 256 arrivals each
    alignas(8) uint64_t exchange_posted;
    alignas(8) uint64_t exchange_read;
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "one CTA per SM");
};

// Named barriers of one warpgroup (bar.sync / bar.red ids; 0 is __syncthreads), by the event they signal. The two
// warpgroups' hand-offs are mbarriers (SharedStorage).
enum class TransposedBarrier : uint32_t {
  kPtWritten = 1,          // + warpgroup: the warpgroup's P^T of this page is in shared memory (128 threads)
  kReferenceVote = 3,      // + warpgroup: bar.red.or over "some column's maximum passed its reference"
  kColMaxWritten = 5,      // + warpgroup: the warps' column maxima are in shared memory
  kColMaxRead = 7,         // + warpgroup: every warp read them (they may be written again)
  kQAmaxWritten = 9,       // a 16-bit q: the computing warps' maxima of |q| are in shared memory (256 threads)
  kQTermsWritten = 10,     // a 16-bit q: the Q tile's terms are in shared memory (256 threads)
};
static_assert(static_cast<uint32_t>(TransposedBarrier::kQTermsWritten) < 16, "bar.sync ids are 0..15");

// The hardware id of `barrier` (+ the warpgroup for the per-warpgroup ones).
__device__ __forceinline__ constexpr uint32_t barrier_id(TransposedBarrier barrier, int warpgroup) {
  return static_cast<uint32_t>(barrier) + warpgroup;
}

// barrier.sync on hardware barrier `id` by `threads` threads.
__device__ __forceinline__ void named_sync(uint32_t id, int threads) {
  asm volatile("barrier.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

FLASH_MLA_NAMESPACE_END  // flash_mla
