// Host-side proof of the shared-memory layout facts the split-KV kernel relies on (run by the CPU tests):
//  1. V^T (SmemLayoutVt) addresses exactly the bytes of the K page (SmemLayoutK) transposed.
//  2. Moving 16 rows or one 64-column segment in a Q/K tile adds a constant (the copy mapping's shortcut).
//  3. Each 16-byte chunk (8 elements) stays contiguous under the swizzle.
//  4. Value i of a thread's S accumulator (64 x 64) is the same (row, key) as value i of its P operand for
//     O += P V (RS WGMMA, 4 K blocks of 16): P is S converted element by element, no shuffle.
//  5. Traits::swizzled_chunk_offset, where the FP8 widening stores a chunk, is where SmemLayoutK has it.
//  6. e4m3 scores: SmemLayoutQ8 / SmemLayoutK8 put e4m3 element (r, 128 u + j) of Q unit u / page unit u where
//     load_q_bytes / a SWIZZLE_128B TMA box put it (unit base + 128 r + 16 ((j / 16) ^ (r % 8)) + j % 16), and S's
//     accumulator is laid out as the 16-bit S's (the softmax and P are shared).
//  7. The transposed FP8 kernel (transposed_traits.h, 16 and 32 rows): page_chunk_offset / pt_chunk_offset (where
//     the V^T ldmatrix and the P^T stmatrix address) are where SmemLayoutPage / SmemLayoutPt hold those chunks, and
//     the V^T ldmatrix rows' split form (vt_lane_offset + vt_block_offset, mainloop VtAddresses) is page_chunk_offset
//     of each warpgroup's, warp's, lane's, dim block's and key block's row; S^T's
//     and O^T's accumulator value i of thread t is (row 16 w + g + 8 ((i >> 1) & 1), column 2 q + (i & 1) +
//     8 (i >> 2)) (w = t / 32, g = t % 32 / 4, q = t % 4: slot_of / column_of); and O^T's register-A value 2 j + e
//     is (row 16 w + g + 8 (j & 1), key 2 q + e + 8 (j >> 1)), the order load_vt_fragment fills a[j] in (dims 2 g
//     and 2 g + 1 as rows g and g + 8).
// For the bf16, fp16 and FP8-cache (fp16 math) traits.
// S^T of a 16-bit q's three Q terms is one m64n48k32 WGMMA, a shape CUTLASS declares among its extended ones
// (transposed_traits.h checks that the atom is that wide); before any CuTe header.
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include <cstdio>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "splitkv_traits.h"
#include "transposed_traits.h"

template <class Element, class CacheElement = Element>
int check() {
  using namespace cute;
  using T = flash_mla::SplitKvTraits<Element, CacheElement>;
  // Byte address (from a 1024-byte aligned base) of element (i, j): the swizzle acts on byte addresses.
  auto address = [](auto layout, int i, int j) { return int(layout.layout_a()(int(sizeof(Element)) * int(layout.layout_b()(i, j)))); };
  auto k = [&](int i, int j) { return address(typename T::SmemLayoutK{}, i, j) / int(sizeof(Element)); };
  auto vt = [&](int i, int j) { return address(typename T::SmemLayoutVt{}, i, j) / int(sizeof(Element)); };
  auto q = [&](int i, int j) { return address(typename T::SmemLayoutQ{}, i, j) / int(sizeof(Element)); };
  int errors = 0;
  if (k(1, 0) != 72 || k(0, 8) != 8 || k(1, 8) != 64) errors++, printf("the 128-byte swizzle is not in effect\n");
  for (int t = 0; t < T::kBlockN; ++t)
    for (int d = 0; d < flash_mla::kHeadDimV; ++d)
      if (vt(d, t) != k(t, d) && errors++ < 5) printf("Vt(%d,%d)=%d != K(%d,%d)=%d\n", d, t, vt(d, t), t, d, k(t, d));
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 64; c += 8)
      for (int h = 0; h < 4; ++h)
        for (int s = 0; s < 9; ++s) {
          const int expect = k(r, c) + h * 16 * 64 + s * 64 * 64;
          if ((k(r + 16 * h, c + 64 * s) != expect || q(r + 16 * h, c + 64 * s) != expect) && errors++ < 10)
            printf("copy shortcut fails at r=%d c=%d h=%d s=%d\n", r, c, h, s);
          for (int e = 1; e < 8; ++e)
            if (k(r + 16 * h, c + 64 * s + e) != expect + e && errors++ < 10) printf("chunk not contiguous\n");
        }
  // 5.
  for (int r = 0; r < T::kBlockN; ++r)
    for (int c = 0; c < flash_mla::kHeadDimQK / 8; ++c) {
      const int seg = c / 8, bytes = T::swizzled_chunk_offset(seg, r, c % 8);
      if (bytes != k(r, 8 * c) * int(sizeof(Element)) && errors++ < 10)
        printf("swizzled_chunk_offset(%d, %d, %d) = %d, SmemLayoutK has %d\n", seg, r, c % 8, bytes,
               k(r, 8 * c) * int(sizeof(Element)));
    }
  // (thread, value) -> column-major index in the (64 x 64) S tile / the (64 x 16) A tile of one K block.
  auto s_tv = typename T::TiledMmaS{}.get_layoutC_TV();
  auto p_tv = typename T::TiledMmaO{}.get_layoutA_TV();
  constexpr int kPerBlock = 8;   // P values of one thread per 16-wide K block
  if (int(size<1>(s_tv)) != 4 * kPerBlock || int(size<1>(p_tv)) != kPerBlock) errors++, printf("unexpected TV sizes\n");
  for (int t = 0; t < 128; ++t)
    for (int i = 0; i < 4 * kPerBlock; ++i) {
      const int s_idx = s_tv(t, i), p_idx = p_tv(t, i % kPerBlock) + 64 * 16 * (i / kPerBlock);
      if (s_idx != p_idx && errors++ < 10) printf("S value %d of thread %d is (%d,%d), P's is (%d,%d)\n", i, t,
                                                  s_idx % 64, s_idx / 64, p_idx % 64, p_idx / 64);
    }
  printf("%s: %d errors; smem bytes %d\n", T::kFp8Cache ? "fp8 cache" : "16-bit", errors, T::kSmemBytes);
  return errors;
}

// 6.
int check_e4m3_scores() {
  using namespace cute;
  using T = flash_mla::SplitKvTraits<cutlass::half_t, cutlass::float_e4m3_t, true>;
  auto bytes = [](auto layout, int i, int j) { return int(layout.layout_a()(int(layout.layout_b()(i, j)))); };
  auto swizzled = [](int unit_base, int r, int j) { return unit_base + 128 * r + 16 * ((j / 16) ^ (r % 8)) + j % 16; };
  int errors = 0;
  for (int r = 0; r < T::kBlockM; ++r)
    for (int u = 0; u < T::kUnits; ++u)
      for (int j = 0; j < 128; ++j) {
        const int q = bytes(typename T::SmemLayoutQ8{}, r, 128 * u + j), q_want = swizzled(8192 * u, r, j);
        const int k = bytes(typename T::SmemLayoutK8{}, r, 256 * u + j), k_want = swizzled(16384 * u, r, j);
        if (q != q_want && errors++ < 5) printf("Q8(%d, %d) at %d, load_q_bytes writes %d\n", r, 128 * u + j, q, q_want);
        if (k != k_want && errors++ < 5) printf("K8(%d, %d) at %d, TMA writes %d\n", r, 256 * u + j, k, k_want);
      }
  auto s8 = typename T::TiledMmaS8{}.get_layoutC_TV();
  auto s16 = typename T::TiledMmaS{}.get_layoutC_TV();
  for (int t = 0; t < 128; ++t)
    for (int i = 0; i < int(size<1>(s16)); ++i)
      if (s8(t, i) != s16(t, i) && errors++ < 5) printf("e4m3 S value %d of thread %d differs\n", i, t);
  if (int(size<1>(s8)) != int(size<1>(s16))) errors++, printf("e4m3 S has another accumulator size\n");
  printf("fp8 cache, e4m3 scores: %d errors; smem bytes %d\n", errors, T::kSmemBytes);
  return errors;
}

// 7.
template <int kRows, bool kWideQ = false>
int check_transposed() {
  using namespace cute;
  using T = flash_mla::TransposedTraits<kRows, kWideQ>;
  auto bytes = [](auto layout, int i, int j, int element_bytes) {
    return int(layout.layout_a()(element_bytes * int(layout.layout_b()(i, j))));
  };
  int errors = 0;
  for (int key = 0; key < flash_mla::kPageBlockSize; ++key)
    for (int unit = 0; unit < T::kUnits; ++unit)
      for (int chunk = 0; chunk < 8; ++chunk)
        for (int e = 0; e < 16; ++e) {
          const int have = bytes(typename T::SmemLayoutPage{}, key, 128 * unit + 16 * chunk + e, 1);
          const int want = T::page_chunk_offset(key, unit, chunk) + e;
          if (have != want && errors++ < 5) printf("page (%d, %d) at %d, not %d\n", key, 128 * unit + 16 * chunk + e, have, want);
        }
  // The V^T fragments' ldmatrix rows (mainloop VtAddresses): warpgroup w's dim block mb holds dims
  // 64 ((mb + 4 w) mod 8), warp `warp` its 16 dims from + 16 warp, lane l the row of key 16 kb + l % 16.
  for (int w = 0; w < 2; ++w)
    for (int warp = 0; warp < 4; ++warp)
      for (int lane = 0; lane < 32; ++lane)
        for (int mb = 0; mb < T::kDimBlocks; ++mb)
          for (int kb = 0; kb < T::kKeyBlocks; ++kb) {
            const int dim = 64 * ((mb + 4 * w) % T::kDimBlocks) + 16 * warp;
            const int want = T::page_chunk_offset(16 * kb + lane % 16, dim / T::kUnitCols, dim % T::kUnitCols / 16);
            const int have = T::vt_lane_offset(mb & 1, warp, lane) + int(T::vt_block_offset(mb, kb, T::vt_unit_flip(w)));
            if (have != want && errors++ < 5) printf("V^T w %d warp %d lane %d block %d/%d at %d, not %d\n", w, warp, lane, mb, kb, have, want);
          }
  for (int row = 0; row < kRows; ++row)
    for (int kc = 0; kc < 8; ++kc)
      for (int e = 0; e < 8; ++e) {
        const int have = bytes(typename T::SmemLayoutPt{}, row, 8 * kc + e, 2), want = T::pt_chunk_offset(row, kc) + 2 * e;
        if (have != want && errors++ < 5) printf("P^T (%d, %d) at %d, not %d\n", row, 8 * kc + e, have, want);
      }
  // quantise_q stores a 16-bit q's 8 e4m3 values (bytes) at once: each run of 8 columns of a Q row is contiguous.
  // S tile j is a (kSTileCols, 640) tile of its own, kSTileCols x 640 bytes after tile j - 1.
  auto q_bytes = [](int row, int col, int tile) {
    typename T::SmemLayoutQ layout;
    return int(layout.layout_a()(int(layout.layout_b()(row, col, tile))));
  };
  for (int tile = 0; tile < T::kSTiles; ++tile)
    for (int row = 0; row < T::kSTileCols; ++row)
      for (int col = 0; col < flash_mla::kHeadDimQK; col += 8)
        for (int e = 0; e < 8; ++e) {
          const int have = q_bytes(row, col + e, tile), want = q_bytes(row, col, tile) + e;
          const int base = q_bytes(row, col, 0) + tile * T::kSTileCols * T::kUnits * T::kUnitCols;
          if ((have != want || e == 0 && (want % 8 != 0 || want != base)) && errors++ < 5)
            printf("Q (%d, %d, tile %d) at %d, not %d\n", row, col + e, tile, have, want);
        }
  auto check_c = [&](auto tv, int cols, const char* what) {
    if (int(size<1>(tv)) != cols / 2) errors++, printf("%s: %d values a thread\n", what, int(size<1>(tv)));
    for (int t = 0; t < 128; ++t)
      for (int i = 0; i < cols / 2; ++i) {
        const int row = 16 * (t / 32) + t % 32 / 4 + 8 * ((i >> 1) & 1), col = 2 * (t % 4) + (i & 1) + 8 * (i >> 2);
        if (int(tv(t, i)) != row + 64 * col && errors++ < 5) printf("%s value %d of thread %d\n", what, i, t);
      }
  };
  // S^T over an S tile (a 16-bit q: value i + 8 t is term t's value i, column + 16 t)
  check_c(typename T::TiledMmaS{}.get_layoutC_TV(), T::kSTileCols, "S^T");
  check_c(typename T::TiledMmaO{}.get_layoutC_TV(), kRows, "O^T");
  auto a_tv = typename T::TiledMmaO{}.get_layoutA_TV();
  if (int(size<1>(a_tv)) != 8) errors++, printf("O^T's A: %d values a thread\n", int(size<1>(a_tv)));
  for (int t = 0; t < 128; ++t)
    for (int v = 0; v < 8; ++v) {
      const int j = v / 2, e = v % 2;
      const int row = 16 * (t / 32) + t % 32 / 4 + 8 * (j & 1), key = 2 * (t % 4) + e + 8 * (j >> 1);
      if (int(a_tv(t, v)) != row + 64 * key && errors++ < 5) printf("O^T's A value %d of thread %d\n", v, t);
    }
  printf("transposed FP8, %d rows%s: %d errors; smem bytes %d\n", kRows, kWideQ ? ", 16-bit q" : "", errors,
         T::kSmemBytes);
  return errors;
}

int main() {
  const int errors = check<cutlass::bfloat16_t>() + check<cutlass::half_t>() +
                     check<cutlass::half_t, cutlass::float_e4m3_t>() + check_e4m3_scores() + check_transposed<16>() +
                     check_transposed<32>() + check_transposed<16, true>() +
                     check_transposed<32, true>();
  printf(errors ? "FAILED\n" : "OK\n");
  return errors ? 1 : 0;
}
