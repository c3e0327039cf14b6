// Per-CTA timeline of the split kernel, for diagnostic builds only (nvcc -DFLASH_MLA_PROBE; read back and summarised
// by benchmarks/probe_timeline.py). Thread 0 of each warpgroup writes %globaltimer (ns) or a value into
// p.probe[(cta * 3 + warpgroup) * kProbeSlots + slot], cta = the linear block index, and sums the clock64 cycles it
// spends in the pair loop's waits (probe_timed). Without the macro, or with p.probe null, nothing is written: every
// call below compiles to nothing (probe_timed to the wait alone) in a product build.
#pragma once

#include "params.h"
#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN

#ifdef FLASH_MLA_PROBE
constexpr bool kProbeBuild = true;
#else
constexpr bool kProbeBuild = false;
#endif

// Slots of one warpgroup's record; a piece's slots start at kProbeFirstPiece + kProbeSlotsPerPiece * k (k < 7).
enum ProbeSlot : int {
  kProbeEntry = 0,        // the kernel's first instruction
  kProbeSm = 1,           // %smid (a value)
  kProbeRoleStart = 2,    // after the CTA's barrier set-up
  kProbeExit = 3,         // the warpgroup's last instruction
  kProbePieceCount = 4,   // pieces with pages (a value)
  kProbeUnitWaits = 5,    // cycles (clock64) thread 0 waited in S for page units to land (dense kernels; a value)
  kProbeMailboxWaits = 6, // cycles it waited for the other warpgroup's mailbox post (a value)
  kProbePvWaits = 7,      // cycles it waited for its own P V WGMMAs to complete (a value)
  kProbeFirstPiece = 8,
};
enum ProbePieceSlot : int {
  kProbeQLanded = 0,      // the piece's Q tile waited for
  kProbeFirstS = 1,       // S of the piece's first page complete (kPageA: page a, kPageB: page b)
  kProbeMainloopEnd = 2,  // the last pair done, before the epilogue
  kProbeEpilogueEnd = 3,  // the epilogue's stores issued
  kProbePages = 4,        // the piece's pages (a value)
  kProbeSeq = 5,          // its sequence (a value)
  kProbeSplit = 6,        // 1 if split (fp32 partials), 0 if written to out (a value)
};
constexpr int kProbeSlotsPerPiece = 8;
constexpr int kProbeMaxPieces = 7;
constexpr int kProbeSlots = kProbeFirstPiece + kProbeSlotsPerPiece * kProbeMaxPieces;    // 64
static_assert(kProbeSlots == 64, "benchmarks/probe_timeline.py reads 64 slots a warpgroup");

__device__ __forceinline__ void probe_put(const DecodeParams& p, int slot, unsigned long long value) {
  if constexpr (kProbeBuild) {
    if (p.probe == nullptr || threadIdx.x % 128 != 0) return;
    const int cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    p.probe[(cta * 3 + threadIdx.x / 128) * kProbeSlots + slot] = value;
  }
}

__device__ __forceinline__ void probe_time(const DecodeParams& p, int slot) {
  if constexpr (kProbeBuild) {
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    probe_put(p, slot, now);
  }
}

__device__ __forceinline__ void probe_sm(const DecodeParams& p) {
  if constexpr (kProbeBuild) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    probe_put(p, kProbeSm, sm);
  }
}

// Cycles a warpgroup's thread 0 spent in each kind of wait, summed over the CTA's pieces (kProbe*Waits).
struct ProbeWaits {
  unsigned long long units = 0, mailbox = 0, pv = 0;
};

// Runs wait(); in a probe build also adds the clock64 cycles it took to `total`.
template <class Wait>
__device__ __forceinline__ void probe_timed(unsigned long long& total, Wait&& wait) {
  if constexpr (kProbeBuild) {
    const long long start = clock64();
    wait();
    total += static_cast<unsigned long long>(clock64() - start);
  } else {
    wait();
  }
}

// Slot `slot` (ProbePieceSlot) of the warpgroup's piece `piece` (pieces past the seventh share its slots).
__device__ __forceinline__ int probe_piece_slot(int piece, int slot) {
  return kProbeFirstPiece + kProbeSlotsPerPiece * (piece < kProbeMaxPieces ? piece : kProbeMaxPieces - 1) + slot;
}

FLASH_MLA_NAMESPACE_END  // flash_mla
