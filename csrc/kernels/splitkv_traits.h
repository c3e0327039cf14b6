// Compile-time configuration of the split-KV kernel: tile sizes, shared-memory layouts, WGMMA shapes.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include "params.h"

namespace flash_mla {

enum class WarpgroupRole : int {
  // Both warpgroups compute half of S (32 of the page's 64 keys) and half of O (256 of 512 columns); the
  // row statistics and P are exchanged through shared memory, so every WGMMA has real work to do.
  kLowHalf = 0,
  kHighHalf = 1,
};

template <class Element_>
struct SplitKvTraits {
  using Element = Element_;
  static constexpr int kBlockM = kRowsPerTile;              // 64 query rows
  static constexpr int kBlockN = kPageBlockSize;            // 64 keys: one page per main-loop step
  static constexpr int kNumWarpgroups = 2;
  static constexpr int kThreads = kNumWarpgroups * 128;
  static constexpr int kKeysPerWarpgroup = kBlockN / kNumWarpgroups;      // 32: N of S = Q K^T
  static constexpr int kColsPerWarpgroup = kHeadDimV / kNumWarpgroups;    // 256: N of O = P V (WGMMA max)
  static constexpr int kStages = 2;                                       // K pages in flight
  static constexpr int kVecElems = 16 / sizeof(Element);                  // one cp.async moves 16 bytes
  static_assert(kHeadDimQK % 64 == 0 && kHeadDimV % 64 == 0, "128-byte swizzle atoms tile the head dims");
  static_assert(kColsPerWarpgroup <= 256, "WGMMA N is at most 256");

  using BlockM = cute::Int<kBlockM>;
  using BlockN = cute::Int<kBlockN>;
  using HeadQK = cute::Int<kHeadDimQK>;
  using HeadV = cute::Int<kHeadDimV>;

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
  using SmemLayoutP = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                   cute::Shape<BlockM, BlockN>{}));                 // (BLK_M, BLK_N)

  // S_half = Q K_half^T : (64 x 32) += (64 x 576) (32 x 576)^T, both operands from shared memory.
  using TiledMmaS = decltype(cute::make_tiled_mma(cute::GMMA::ss_op_selector<
      Element, Element, float, cute::Shape<BlockM, cute::Int<kKeysPerWarpgroup>, HeadQK>>()));
  // O_half += P V_half : (64 x 256) += (64 x 64) (64 x 256); V^T is MN-major.
  using TiledMmaO = decltype(cute::make_tiled_mma(cute::GMMA::ss_op_selector<
      Element, Element, float, cute::Shape<BlockM, cute::Int<kColsPerWarpgroup>, BlockN>,
      cute::GMMA::Major::K, cute::GMMA::Major::MN>()));

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>> k[kStages];
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutP>> p;
    float row_max[kNumWarpgroups][kBlockM];   // per-warpgroup maxima of the current page's raw scores
    float row_sum[kNumWarpgroups][kBlockM];   // per-warpgroup softmax denominators, at the end of a piece
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "Q + 2 K pages + P must fit in one SM's shared memory");
};

}  // namespace flash_mla
