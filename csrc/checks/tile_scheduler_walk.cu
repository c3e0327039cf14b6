// Host-side walk of a plan through the split kernel's tile scheduler (run by tests/test_tile_scheduler_walk.py).
//
// Every SM part's CTA is replayed with the PieceRange calls of mainloop.h, in its order, without the math: the
// prologue's first Q tile and first fill of each page buffer; then per piece, per pair of pages, the consumption
// of page a (buffer 0) and page b (buffer 1), the refills computed for the pair (next_block_in_batch, from the
// warp's batch of block-table entries, read when the kernel reads it), and the next Q tile after the last pair. The
// trace goes to stdout; the test checks it against the plan's pieces and the block table, so a wrong look-ahead (a
// buffer fed the wrong block, a page never fed, a stray copy at the end, a Q tile for the wrong sequence, a batch read
// too late or for the wrong pages) fails on any machine with nvcc, before a kernel runs.
//
// stdin, whitespace-separated integers:
//   batch num_parts max_blocks
//   seqlens[batch]  num_splits[batch + 1]  metadata[num_parts * 8]  block_table[batch * max_blocks]
// stdout, one event a line, per part in order:
//   part P
//   q SEQ                                     a Q tile load is issued (SEQ = -1: none)
//   fill STAGE BLOCK | fill STAGE none        buffer STAGE is sent its next page (none: nothing is left for it)
//   piece SEQ BEGIN END SPLIT SLOT            the CTA starts a piece (also one with no pages: L = 0)
//   page SEQ K STAGE                          page K of the piece is consumed from buffer STAGE
#include <cstdio>
#include <vector>

#include "tile_scheduler.h"

namespace {

void print_fill(int stage, flash_mla::PageBlock block) {
  if (block.valid) printf("fill %d %d\n", stage, block.block);
  else printf("fill %d none\n", stage);
}

// One CTA's calls, as mainloop.h's prologue / run / attend_piece make them.
void walk_part(const flash_mla::DecodeParams& p, int part) {
  const flash_mla::PieceRange range(p, part);
  printf("part %d\n", part);
  // ---- prologue -------------------------------------------------------------------------------------------
  printf("q %d\n", range.next_seq_using(range.first_seq(), 0));
  for (int stage = 0; stage < 2; ++stage) print_fill(stage, range.first_block(stage));
  // ---- pieces ---------------------------------------------------------------------------------------------
  for (int seq = range.first_seq(); seq <= range.last_seq(); ++seq) {
    const flash_mla::Piece piece = range.piece(seq);
    printf("piece %d %d %d %d %d\n", piece.seq, piece.begin, piece.end, int(piece.split), piece.slot);
    const int num_pages = piece.num_pages();
    const flash_mla::PageBlock after_piece[2] = {range.first_block_after(piece, 0), range.first_block_after(piece, 1)};
    constexpr int kBatch = flash_mla::PieceRange<>::kBatchPages;
    int lane_blocks[kBatch];    // a warp's batch (the kernel: one per lane)
    const auto read_batch = [&](int first) {
      for (int lane = 0; lane < kBatch; ++lane) lane_blocks[lane] = range.batch_block(piece, first, lane);
    };
    const auto lane_value = [&](int lane) { return lane_blocks[lane]; };
    read_batch(0);
    for (int page = 0; page < num_pages; page += 2) {
      const bool has_b = page + 1 < num_pages;
      const flash_mla::PageBlock next_a = range.next_block_in_batch(piece, page, 0, after_piece[0], lane_value);
      const flash_mla::PageBlock next_b = range.next_block_in_batch(piece, page, 1, after_piece[1], lane_value);
      if (page % kBatch == kBatch - 2) read_batch(page + 2);
      printf("page %d %d 0\n", seq, page);
      if (has_b) printf("page %d %d 1\n", seq, page + 1);
      if (page + 2 >= num_pages) printf("q %d\n", range.next_seq_using(piece.seq + 1, 0));
      print_fill(0, next_a);              // both warpgroups refill buffer 0 once the pair is done with it
      if (has_b) print_fill(1, next_b);   // buffer 1 only when it held page b
    }
  }
}

bool read_ints(std::vector<int32_t>& v, size_t n) {
  v.resize(n);
  for (size_t i = 0; i < n; ++i)
    if (scanf("%d", &v[i]) != 1) return false;
  return true;
}

}  // namespace

int main() {
  int batch = 0, parts = 0, max_blocks = 0;
  if (scanf("%d %d %d", &batch, &parts, &max_blocks) != 3 || batch < 1 || parts < 1 || max_blocks < 1) {
    fprintf(stderr, "expected: batch num_parts max_blocks, then the tensors\n");
    return 2;
  }
  std::vector<int32_t> seqlens, num_splits, metadata, block_table;
  if (!read_ints(seqlens, batch) || !read_ints(num_splits, batch + 1) ||
      !read_ints(metadata, size_t(parts) * flash_mla::kMetadataWidth) ||
      !read_ints(block_table, size_t(batch) * max_blocks)) {
    fprintf(stderr, "input ended early\n");
    return 2;
  }
  flash_mla::DecodeParams p{};
  p.batch = batch;
  p.num_sm_parts = parts;
  p.seqlens = seqlens.data();
  p.num_splits = num_splits.data();
  p.metadata = metadata.data();
  p.block_table = block_table.data();
  p.block_table_stride = max_blocks;
  for (int part = 0; part < parts; ++part) walk_part(p, part);
  return 0;
}
