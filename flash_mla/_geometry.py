"""Fixed geometry of DeepSeek MLA decoding after weight absorption, in one place.

Imported by the validation, the scheduler twin, the backends and the test helpers; it imports nothing from the
package, so no import circle can run through it. The CUDA side keeps the same numbers in csrc/kernels/params.h.
"""
HEAD_DIM_QK = 576          # 512 latent ("NoPE") + 64 RoPE columns
HEAD_DIM_V = 512           # V is the first 512 columns of the cache
PAGE_BLOCK_SIZE = 64       # tokens per KV-cache page, also the scheduler's unit of work
METADATA_WIDTH = 8         # int32 words per SM part in tile_scheduler_metadata
FIXED_OVERHEAD = 5         # scheduler cost of one sequence piece, in pages (reading Q, writing out, combining)
# Payload floor of sparse FP8 plans (flash_mla_with_kvcache(..., indices=...)), in pages, FIXED_OVERHEAD included:
# each SM part gets room for a pair of pages besides one piece's fixed cost. The sparse Hopper kernel works on
# pages in pairs, one to each of its two computing warpgroups, so a part holding a one-page piece leaves one of them
# idle while it pays a piece's costs (Q load, fp32 partial write, combine). Dense plans keep SPEC.md's rule (no
# floor); docs/PERF.md "Scheduler" has the measurement.
SPARSE_MIN_PAYLOAD = FIXED_OVERHEAD + 2
# The sparse plan's rules, as keyword arguments of the scheduler (scheduler.schedule, the metadata op and kernel):
# the floor above, and the smallest payload that covers the batch instead of SPEC.md's (scheduler.plan_payload), so
# that no part carries a page more than the walk needs (16 rows of 32 pages over 66 parts: 64 parts of 8 pages, not
# 48 of 9 and 16 of 5). docs/PERF.md "Scheduler" has the measurements.
SPARSE_PLAN = {"min_payload": SPARSE_MIN_PAYLOAD, "tight_payload": True}
ROWS_PER_TILE = 64         # query rows one CTA processes (the WGMMA M dimension)
DEFAULT_SOFTMAX_SCALE = HEAD_DIM_QK ** -0.5
