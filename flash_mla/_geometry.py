"""Fixed geometry of DeepSeek MLA decoding after weight absorption, in one place.

Imported by the validation, the scheduler twin, the backends and the test helpers; it imports nothing from the
package, so no import circle can run through it. The CUDA side keeps the same numbers in csrc/kernels/params.h.
"""
HEAD_DIM_QK = 576          # 512 latent ("NoPE") + 64 RoPE columns
HEAD_DIM_V = 512           # V is the first 512 columns of the cache
PAGE_BLOCK_SIZE = 64       # tokens per KV-cache page, also the scheduler's unit of work
METADATA_WIDTH = 8         # int32 words per SM part in tile_scheduler_metadata
FIXED_OVERHEAD = 5         # scheduler cost of one sequence piece, in pages (reading Q, writing out, combining)
ROWS_PER_TILE = 64         # query rows one CTA processes (the WGMMA M dimension)
DEFAULT_SOFTMAX_SCALE = HEAD_DIM_QK ** -0.5
