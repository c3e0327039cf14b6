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
// The pair timeline: clock64 (cycles of the SM's clock, the same counter for both warpgroups) at the pair loop's
// events of pairs [kProbeFirstPair, + kProbePairs) of the CTA's first piece that has that many, at slot
// kProbeFirstPairSlot + kProbePairEvents * (pair - kProbeFirstPair) + event. Events are named by what has just
// happened; each warpgroup's run through them is in mainloop.h's schedule order.
enum ProbePairEvent : int {
  kProbePairStart = 0,      // the pair's top
  kProbeUnitsLanded = 1,    // S's wait for its page's last unit returned (dense kernels)
  kProbeSDone = 2,          // S complete
  kProbeProbsReady = 3,     // this warpgroup's page's P exponentiated (kPageB: against its own reference)
  kProbeTaken = 4,          // the other warpgroup's post taken (kPageA: P_b; kPageB: P_a)
  kProbePosted = 5,         // this warpgroup's post (kPageA: P_a; kPageB: P_b and l)
  kProbePvIssued = 6,       // kPageA: P_b V_b issued; kPageB: both its P V issued
  kProbePairEnd = 7,        // the last P V complete and the refills issued
  kProbeVRefillIssued = 8,  // page a's V half refilled (kPageA: V_a[:, 0:256] after P_b V_b's issue; kPageB: V_a[:,
                            // 256:512] once its P_a V_a is complete), by this thread's share of the copies
  kProbePaVaIssuing = 9,    // about to issue its P_a V_a (operands ready: the WGMMA issue's own wait follows)
  kProbePaVaIssued = 10,    // its P_a V_a issued
  kProbePaVaDone = 11,      // its P_a V_a complete (kPageA: waited for before P_b V_b; kPageB: before V_a's refill)
  kProbePbVbIssuing = 12,   // about to issue its P_b V_b
};
constexpr int kProbePairEvents = 13;
constexpr int kProbeFirstPair = 4;
constexpr int kProbePairs = 4;
constexpr int kProbeFirstPairSlot = kProbeFirstPiece + kProbeSlotsPerPiece * kProbeMaxPieces;    // 64
constexpr int kProbeSlots = 128;
static_assert(kProbeFirstPairSlot + kProbePairEvents * kProbePairs <= kProbeSlots, "the pair timeline fits");
static_assert(kProbeSlots == 128, "benchmarks/probe_timeline.py reads 128 slots a warpgroup");

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

__device__ __forceinline__ long long probe_clock() {
  if constexpr (kProbeBuild) return clock64();
  return 0;
}

// Event `event` (ProbePairEvent) of pair `pair` of the timed piece at cycle `when` (probe_clock()); only where
// `timed` (the CTA's timed piece) and the pair is in the window.
__device__ __forceinline__ void probe_pair(const DecodeParams& p, bool timed, int pair, int event,
                                           long long when) {
  if constexpr (kProbeBuild) {
    if (!timed || pair < kProbeFirstPair || pair >= kProbeFirstPair + kProbePairs) return;
    probe_put(p, kProbeFirstPairSlot + kProbePairEvents * (pair - kProbeFirstPair) + event,
              static_cast<unsigned long long>(when));
  }
}

// Slot `slot` (ProbePieceSlot) of the warpgroup's piece `piece` (pieces past the seventh share its slots).
__device__ __forceinline__ int probe_piece_slot(int piece, int slot) {
  return kProbeFirstPiece + kProbeSlotsPerPiece * (piece < kProbeMaxPieces ? piece : kProbeMaxPieces - 1) + slot;
}

FLASH_MLA_NAMESPACE_END  // flash_mla
