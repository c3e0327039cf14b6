// Tile scheduler of the split-KV kernel: which sequence pieces a CTA owns, and which page fills which buffer.
//
// CTA (row tile, KV head, SM part) walks the pieces of its SM part's metadata row (SPEC.md "Scheduler"), one
// sequence at a time. A piece's pages go to the two page buffers alternately, page k to buffer k % 2; pages
// are consumed in pairs (a, b) = (2j, 2j + 1) within a piece. Looking ahead across pieces is what lets a
// warpgroup refill a buffer with the next piece's first pages while the current piece is still being computed.
#pragma once

#include "params.h"
#include "variant.h"

// Host-callable as well, so that csrc/checks/tile_scheduler_walk.cu can walk a plan on the CPU the way the
// mainloop does (tests/test_tile_scheduler_walk.py; nvcc or a plain C++ compiler).
#ifdef __CUDACC__
#define FLASH_MLA_HOST_DEVICE __host__ __device__
#else
#define FLASH_MLA_HOST_DEVICE
#endif

FLASH_MLA_NAMESPACE_BEGIN

// min() for host and device alike (CUDA's int min() is not declared for a host compiler).
FLASH_MLA_HOST_DEVICE constexpr int smaller(int a, int b) { return a < b ? a : b; }

// One unit of a CTA's work: keys [begin, end) of sequence `seq` and where its result goes.
struct Piece {
  int seq;
  int begin, end;     // token range; begin is a multiple of 64
  int length;         // the sequence's full length (the causal rule counts from its end)
  bool split;         // true: fp32 partial to workspace slot `slot`; false: final result to out/lse
  int slot;

  FLASH_MLA_HOST_DEVICE int num_pages() const {
    return end > begin ? (end - begin + kPageBlockSize - 1) / kPageBlockSize : 0;
  }
};

// The page a buffer receives next: its physical cache block, unless no page is left for that buffer. The flag
// is separate so that no block-table entry (even a bad one, which the TMA copy turns into zeros) means "none",
// and the entry stays a plain 32-bit load whose latency hides behind the pair's work. `split`: the page belongs
// to a split piece, whose result goes to the fp32 workspace (the page copies' L2 policy depends on it).
// Sparse decoding: `block` is the index that this thread's copy row of the page holds (-1 past the piece's end);
// the gather treats one outside [0, num_tokens) as none (a bad index is never dereferenced).
struct PageBlock {
  int block;
  bool valid;
  bool split;
};
constexpr PageBlock kNoBlock{0, false, false};

// kSparse: a "sequence" is a batch row of sparse decoding, its keys the index slots of the row tile's query token
// (SPEC.md "Sparse FP8 decoding"), and a page's block is the token of this thread's copy row (copy_row; -1 for the
// computing warpgroups, which only need to know whether a page comes).
template <bool kSparse = false>
class PieceRange {
 public:
  // The pieces of SM part `part`. begin_seq == batch marks a part with no work; the clamps only guard
  // against foreign metadata.
  FLASH_MLA_HOST_DEVICE PieceRange(const DecodeParams& p, int part, int m_tile = 0, int copy_row = 0)
      : p_(p), meta_(p.metadata + part * kMetadataWidth), copy_row_(copy_row) {
    if (kSparse) {     // a row tile holds heads of one query token (heads_per_kv is a multiple of 64)
      indices_ = p.indices + int64_t(m_tile) * kRowsPerTile / p.heads_per_kv * p.indices_token_stride;
    }
    begin_seq_ = meta_[kBeginSeq];
    end_seq_ = meta_[kEndSeq];
    last_seq_ = (begin_seq_ < 0 || begin_seq_ >= p.batch) ? begin_seq_ - 1 : smaller(end_seq_, p.batch - 1);
  }

  FLASH_MLA_HOST_DEVICE int first_seq() const { return begin_seq_; }
  FLASH_MLA_HOST_DEVICE int last_seq() const { return last_seq_; }

  FLASH_MLA_HOST_DEVICE Piece piece(int seq) const {
    Piece piece;
    piece.seq = seq;
    // Sparse: topk_length (at most topk), or topk without it.
    piece.length = kSparse ? (p_.seqlens != nullptr ? smaller(p_.seqlens[seq], p_.topk) : p_.topk) : p_.seqlens[seq];
    // The part's first and last pieces' bounds are re-read from the metadata row (L1-resident) rather than
    // kept in registers, which the mainloop needs more.
    piece.begin = seq == begin_seq_ ? meta_[kBeginToken] : 0;
    piece.end = seq == end_seq_ ? smaller(meta_[kEndToken], piece.length) : piece.length;
    const int first_slot = p_.num_splits[seq];
    piece.split = p_.num_splits[seq + 1] - first_slot > 1;
    piece.slot = first_slot + (seq == begin_seq_ ? meta_[kBeginSplit] : 0);
    return piece;
  }

  // The first sequence at or after `seq` whose piece has a page that goes to buffer `stage` (more than
  // `stage` pages), or -1.
  FLASH_MLA_HOST_DEVICE int next_seq_using(int seq, int stage) const {
    for (; seq <= last_seq_; ++seq) {
      if (piece(seq).num_pages() > stage) return seq;
    }
    return -1;
  }

  // Physical block of the first page buffer `stage` receives (or kNoBlock).
  FLASH_MLA_HOST_DEVICE PageBlock first_block(int stage) const {
    return block_of(next_seq_using(begin_seq_, stage), stage);
  }

  // Physical block of the first page buffer `stage` receives after the pages of `current` (or kNoBlock).
  FLASH_MLA_HOST_DEVICE PageBlock first_block_after(const Piece& current, int stage) const {
    return block_of(next_seq_using(current.seq + 1, stage), stage);
  }

  // Page `page` of `current` (sparse: the index of this thread's copy row of it).
  FLASH_MLA_HOST_DEVICE PageBlock page_of(const Piece& current, int page) const {
    return page_block(current.seq, current.begin / kPageBlockSize + page, current.split, current.end);
  }

  // Dense, the pair loop's lookups a warp at a time: lane l reads batch_block(current, first, l), the block of page
  // first + 2 + l (0 past the piece's pages), for first = 0 before the loop and first = page + 2 after the pair
  // `page` with page % kBatchPages == kBatchPages - 2 took its blocks; pair `page` takes buffer `stage`'s block from
  // lane page % kBatchPages + stage (`lane_value`: a shuffle in the kernel) by next_block_in_batch, which equals
  // next_block(current, page + stage, stage, after).
  static constexpr int kBatchPages = 32;
  FLASH_MLA_HOST_DEVICE int batch_block(const Piece& current, int first, int lane) const {
    return first + 2 + lane < current.num_pages() ? page_of(current, first + 2 + lane).block : 0;
  }
  template <class LaneValue>
  FLASH_MLA_HOST_DEVICE PageBlock next_block_in_batch(const Piece& current, int page, int stage, PageBlock after,
                                                      LaneValue lane_value) const {
    const int block = lane_value(page % kBatchPages + stage);    // every lane takes part, whichever branch follows
    return page + 2 + stage < current.num_pages() ? PageBlock{block, true, current.split} : after;
  }

  // Physical block of the page buffer `stage` receives after page `page` of `current` (which it holds now);
  // `after` = first_block_after(current, stage), looked up once per piece so that the pair loop holds no
  // search over the following pieces (cold code between its hot blocks costs instruction fetches).
  FLASH_MLA_HOST_DEVICE PageBlock next_block(const Piece& current, int page, int stage, PageBlock after) const {
    if (page + 2 < current.num_pages()) {
      return page_block(current.seq, current.begin / kPageBlockSize + page + 2, current.split, current.end);
    }
    return after;
  }

 private:
  // `end`: the end of seq's piece (sparse: slots at or past it name no token).
  FLASH_MLA_HOST_DEVICE PageBlock page_block(int seq, int page_in_seq, bool split, int end) const {
    if (!kSparse) return PageBlock{p_.block_table[seq * p_.block_table_stride + page_in_seq], true, split};
    if (copy_row_ < 0) return PageBlock{-1, true, split};    // a computing warpgroup: whether a page comes, no index
    const int slot = page_in_seq * kPageBlockSize + copy_row_;
    // The raw index: the gather checks its range where it uses it, so that nothing waits for this load here.
    const int token = slot < end ? load_early(&indices_[seq * p_.indices_batch_stride + slot]) : -1;
    return PageBlock{token, true, split};
  }

  // A load issued where it is written: under register pressure the compiler would otherwise move a plain load
  // down to its use (the page's refill), which then waits the full L2 latency (measured: the sparse kernel's
  // warps stalled on it more than on anything else). A volatile asm keeps its place among the WGMMAs.
  FLASH_MLA_HOST_DEVICE static int load_early(const int32_t* address) {
#ifdef __CUDA_ARCH__
    int value;
    asm volatile("ld.global.nc.b32 %0, [%1];\n" : "=r"(value) : "l"(address));
    return value;
#else
    return *address;
#endif
  }

  // Page `page` of seq's piece.
  FLASH_MLA_HOST_DEVICE PageBlock block_of(int seq, int page) const {
    if (seq < 0) return kNoBlock;
    const Piece next = piece(seq);
    return page_block(seq, next.begin / kPageBlockSize + page, next.split, next.end);
  }

  const DecodeParams& p_;
  const int32_t* meta_;         // this part's metadata row
  int begin_seq_, end_seq_, last_seq_;
  const int32_t* indices_ = nullptr;    // sparse: indices[0, query token of the row tile, :]
  int copy_row_;
};

FLASH_MLA_NAMESPACE_END  // flash_mla
