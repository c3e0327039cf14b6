"""flash_mla: MLA (multi-head latent attention) decoding kernels over a paged KV cache.

    tile_scheduler_metadata, num_splits = get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv)
    out, lse = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512,
                                      tile_scheduler_metadata, num_splits, causal=True)

or upstream's current form, planned by the first call that uses the schedule:

    schedule, _ = get_mla_metadata()
    out, lse = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, schedule, None, causal=True)

FP8 KV cache (float8_e4m3fn, per-tensor scales, true value = stored value * descale):

    k_fp8, descale_k = quantize_kv_cache_fp8(k_cache)
    q_fp8, descale_q = quantize_q_fp8(q)
    out, lse = flash_mla_with_kvcache_fp8(q_fp8, k_fp8, block_table, cache_seqlens, 512,
                                          tile_scheduler_metadata, num_splits, causal=True,
                                          descale_q=descale_q, descale_k=descale_k)

Sparse FP8 decoding (DeepSeek-V3.2): a 656-byte-per-token cache and per-query token indices:

    k_v32 = quantize_kv_cache_v32(latent_and_rope)            # (num_blocks, page_block_size, 1, 656) uint8
    schedule, _ = get_mla_metadata()
    out, lse = flash_mla_with_kvcache(q, k_v32, None, None, 512, schedule, None, causal=False,
                                      is_fp8_kvcache=True, indices=indices)   # indices (b, s_q, topk) int32
"""
from .fp8 import quantize_kv_cache_fp8, quantize_q_fp8
from .interface import (FlashMLASchedMeta, MLASchedule, flash_mla_with_kvcache, flash_mla_with_kvcache_fp8,
                        get_mla_metadata)
from .reference import mla_decode_reference
from .sparse_fp8 import dequantize_kv_cache_v32, quantize_kv_cache_v32, sparse_decode_reference

__all__ = ["get_mla_metadata", "flash_mla_with_kvcache", "flash_mla_with_kvcache_fp8", "quantize_kv_cache_fp8",
           "quantize_q_fp8", "quantize_kv_cache_v32", "dequantize_kv_cache_v32", "MLASchedule", "FlashMLASchedMeta",
           "mla_decode_reference", "sparse_decode_reference"]
__version__ = "0.1.0"
