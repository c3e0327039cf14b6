// Torch binding of the Hopper kernels: flash_mla._cuda.{get_mla_metadata, mla_decode, sparse_decode}.
// The TORCH_CHECKs mirror flash_mla/_validation.py (which runs first); they guard direct callers of the
// extension. Kernels launch on the current stream, workspace comes from the caching allocator, no host syncs.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <type_traits>

#include "kernels/params.h"
#include "kernels/variant.h"

FLASH_MLA_NAMESPACE_BEGIN
namespace {

#define CHECK_DEVICE(x, dev) TORCH_CHECK((x).device() == (dev), #x ": expected a tensor on ", dev, ", got ", (x).device())
#define CHECK_DTYPE(x, dt) TORCH_CHECK((x).scalar_type() == (dt), #x ": expected dtype ", dt, ", got ", (x).scalar_type())
// Check messages get only strings, devices and dtypes: a number formatted by the extension's own std::ostream (the
// c10::str inside TORCH_CHECK) crashed a torch 2.11 process instead of raising. std::to_string and snprintf are safe.
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
std::string str_of(T v) { return std::to_string(v); }
std::string str_of(double v) {    // "%g": what the ostream printed (0.5, 0.0416667, 1e-08, inf, nan)
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}
std::string shape_of(at::IntArrayRef sizes) {    // as c10's operator<< for ArrayRef: [2, 3, 576]
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i > 0 ? ", " : "") + std::to_string(sizes[i]);
  return out + "]";
}

#define CHECK_SHAPE(x, ...)                                                                                    \
  TORCH_CHECK((x).sizes() == at::IntArrayRef({__VA_ARGS__}), #x ": expected shape ",                           \
              shape_of(at::IntArrayRef({__VA_ARGS__})), ", got ", shape_of((x).sizes()))

constexpr int kMaxSmParts = 1024;   // metadata kernel's shared-memory bound (csrc/kernels/metadata.cu)

int num_sm_parts_for(int num_sms, int num_heads_per_head_k, int num_heads_k) {
  const int tiles = (num_heads_per_head_k + kRowsPerTile - 1) / kRowsPerTile;
  return std::max(num_sms / num_heads_k / tiles, 1);
}

// min_payload: floor on each SM part's payload, in pages (0: SPEC.md's rule, the dense plan; sparse plans pass
// flash_mla/_geometry.py's SPARSE_MIN_PAYLOAD); tight_payload: the smallest payload that covers the batch instead
// of SPEC.md's (sparse plans; flash_mla/scheduler.py plan_payload).
std::vector<at::Tensor> get_mla_metadata(const at::Tensor& seqlens, int64_t num_heads_per_head_k,
                                         int64_t num_heads_k, int64_t num_sms, int64_t min_payload,
                                         bool tight_payload) {
  TORCH_CHECK(seqlens.is_cuda(), "cache_seqlens: expected a CUDA tensor, got one on ", seqlens.device());
  CHECK_DTYPE(seqlens, at::kInt);
  TORCH_CHECK(seqlens.dim() == 1 && seqlens.size(0) > 0, "cache_seqlens: expected shape (batch_size,), got ",
              shape_of(seqlens.sizes()));
  TORCH_CHECK(num_heads_per_head_k >= 1 && num_heads_k >= 1 && num_sms >= 1,
              "num_heads_per_head_k, num_heads_k, num_sms: expected >= 1, got ", str_of(num_heads_per_head_k), ", ",
              str_of(num_heads_k), ", ", str_of(num_sms));
  // num_sm_parts_for takes int: a larger value would wrap (to 0: a division by zero on the host).
  TORCH_CHECK(num_heads_per_head_k <= INT32_MAX && num_heads_k <= INT32_MAX && num_sms <= INT32_MAX,
              "num_heads_per_head_k, num_heads_k, num_sms: expected < 2^31, got ", str_of(num_heads_per_head_k), ", ",
              str_of(num_heads_k), ", ", str_of(num_sms));
  TORCH_CHECK(min_payload >= 0 && min_payload <= INT32_MAX, "min_payload: expected an int in [0, 2^31), got ",
              str_of(min_payload));
  const int parts = num_sm_parts_for(num_sms, num_heads_per_head_k, num_heads_k);
  TORCH_CHECK(parts <= kMaxSmParts, "num_sms: at most ", str_of(kMaxSmParts), " SM parts are supported, got ",
              str_of(parts));
  const c10::cuda::CUDAGuard guard(seqlens.device());
  const auto seqlens_c = seqlens.contiguous();
  const int batch = seqlens.size(0);
  const auto opts = seqlens.options();
  at::Tensor metadata = at::empty({parts, kMetadataWidth}, opts);
  at::Tensor num_splits = at::empty({batch + 1}, opts);
  at::Tensor cost_prefix = at::empty({batch + 1}, opts);
  MetadataParams p{seqlens_c.data_ptr<int32_t>(), metadata.data_ptr<int32_t>(), num_splits.data_ptr<int32_t>(),
                   cost_prefix.data_ptr<int32_t>(), batch, parts, static_cast<int>(min_payload), tight_payload};
  launch_mla_metadata(p, at::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {metadata, num_splits};
}

void check_rows_16_byte_aligned(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.stride(-1) == 1, name, ": expected a contiguous last dimension, got strides ", shape_of(x.strides()));
  const int64_t vector = 16 / x.element_size();    // elements per 16 bytes
  for (int d = 0; d + 1 < x.dim(); ++d)
    TORCH_CHECK(x.stride(d) % vector == 0, name, ": expected strides that are multiples of ", str_of(vector),
                " elements (16 bytes), got ", shape_of(x.strides()));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, name, ": expected a 16-byte aligned data pointer");
}

// The arguments dense and sparse decoding share: the plan, the softmax scale and the optional attention sink (one
// float32 logit per query head, any stride: made contiguous by the caller).
void check_plan_scale_sink(const c10::Device& dev, int batch, int num_heads_q, const at::Tensor& metadata,
                           const at::Tensor& num_splits, double softmax_scale,
                           const std::optional<at::Tensor>& attn_sink) {
  CHECK_DEVICE(metadata, dev); CHECK_DTYPE(metadata, at::kInt);
  TORCH_CHECK(metadata.dim() == 2 && metadata.size(1) == kMetadataWidth && metadata.size(0) >= 1 && metadata.is_contiguous(),
              "tile_scheduler_metadata: expected contiguous (num_sm_parts, 8), got ", shape_of(metadata.sizes()));
  CHECK_DEVICE(num_splits, dev); CHECK_DTYPE(num_splits, at::kInt); CHECK_SHAPE(num_splits, batch + 1);
  TORCH_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0,
              "softmax_scale: expected a finite positive float, got ", str_of(softmax_scale));
  if (attn_sink.has_value()) {
    const at::Tensor& sink = *attn_sink;
    TORCH_CHECK(sink.device() == dev, "attn_sink: expected a tensor on ", dev, ", got ", sink.device());
    TORCH_CHECK(sink.scalar_type() == at::kFloat, "attn_sink: expected dtype float32, got ", sink.scalar_type());
    TORCH_CHECK(sink.dim() == 1 && sink.size(0) == num_heads_q,
                "attn_sink: expected shape (num_heads_q,) = (", str_of(num_heads_q), "), got ", shape_of(sink.sizes()));
  }
}

// The timeline buffer of kernels built with -DFLASH_MLA_PROBE (kernels/probe.h), set by set_probe for the calls
// that follow (benchmarks/probe_timeline.py); product builds never write it.
unsigned long long* g_probe = nullptr;

// What dense and sparse decoding set up alike: the shapes of the packed query rows (seqlen_q * heads_per_kv per KV
// head), the plan, the score scale, q, the outputs (out in out_dtype, lse), the workspace of split pieces (one slot
// per piece: at most batch + num_sm_parts, SPEC.md "Scheduler") and the attention sink. The tensors live here until
// the launches are queued; the caching allocator orders their reuse after them on this stream.
struct DecodeSetup {
  DecodeParams params{};
  at::Tensor out, lse, o_partial, lse_partial, num_splits, sink;

  DecodeSetup(const at::Tensor& q, int num_heads_k, at::ScalarType out_dtype, const at::Tensor& metadata,
              const at::Tensor& num_splits_in, double softmax_scale, const std::optional<at::Tensor>& attn_sink) {
    const int batch = q.size(0), seqlen_q = q.size(1), num_heads_q = q.size(2);
    const int num_sm_parts = metadata.size(0);
    const int heads_per_kv = num_heads_q / num_heads_k;
    const int rows_per_kv = seqlen_q * heads_per_kv;
    num_splits = num_splits_in.contiguous();
    sink = attn_sink.has_value() ? attn_sink->contiguous() : at::Tensor();
    out = at::empty({batch, seqlen_q, num_heads_q, kHeadDimV}, q.options().dtype(out_dtype));
    lse = at::empty({batch, num_heads_q, seqlen_q}, q.options().dtype(at::kFloat));
    const int64_t slots = int64_t(batch) + num_sm_parts;
    o_partial = at::empty({slots, num_heads_k, rows_per_kv, kHeadDimV}, q.options().dtype(at::kFloat));
    lse_partial = at::empty({slots, num_heads_k, rows_per_kv}, q.options().dtype(at::kFloat));

    DecodeParams& p = params;
    p.batch = batch; p.seqlen_q = seqlen_q; p.num_heads_q = num_heads_q; p.num_heads_k = num_heads_k;
    p.heads_per_kv = heads_per_kv; p.rows_per_kv = rows_per_kv;
    p.num_row_tiles = (rows_per_kv + kRowsPerTile - 1) / kRowsPerTile;
    p.num_sm_parts = num_sm_parts;
    p.scale_log2 = static_cast<float>(softmax_scale * M_LOG2E);
    p.q = q.data_ptr(); p.q_batch_stride = q.stride(0); p.q_token_stride = q.stride(1); p.q_head_stride = q.stride(2);
    p.metadata = metadata.data_ptr<int32_t>();
    p.num_splits = num_splits.data_ptr<int32_t>();
    p.out = out.data_ptr(); p.lse = lse.data_ptr<float>();
    p.attn_sink = sink.defined() ? sink.data_ptr<float>() : nullptr;
    p.o_partial = o_partial.data_ptr<float>(); p.lse_partial = lse_partial.data_ptr<float>();
    p.probe = g_probe;
  }
};

std::vector<at::Tensor> mla_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& block_table,
                                   const at::Tensor& seqlens, int64_t head_dim_v, const at::Tensor& metadata,
                                   const at::Tensor& num_splits, double softmax_scale, bool causal,
                                   const std::optional<at::Tensor>& attn_sink,
                                   const std::optional<at::Tensor>& descale_q,
                                   const std::optional<at::Tensor>& descale_k) {
  TORCH_CHECK(q.is_cuda(), "q: expected a CUDA tensor, got one on ", q.device());
  const auto dev = q.device();
  const auto dtype = q.scalar_type();
  // An e4m3 cache (SPEC.md "FP8 KV cache") takes an e4m3 q with descale_q, or a bf16 / fp16 q; both descales are
  // float32 (1,) on q's device. A 16-bit cache takes q of its own dtype and no descale.
  const bool fp8_cache = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  const bool fp8_q = dtype == at::kFloat8_e4m3fn;
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || (fp8_q && fp8_cache),
              "q: expected dtype bfloat16 or float16 (or float8_e4m3fn with a float8_e4m3fn k_cache), got ", dtype);
  if (fp8_cache) {
    TORCH_CHECK(descale_k.has_value(), "descale_k: expected a float32 tensor of shape (1,) with a float8_e4m3fn k_cache");
    TORCH_CHECK(descale_q.has_value() == fp8_q, "descale_q: expected ", fp8_q ? "a float32 tensor of shape (1,) with" : "None with",
                " a ", dtype, " q");
  } else {
    TORCH_CHECK(!descale_q.has_value() && !descale_k.has_value(), "descale_q, descale_k: expected None with a ",
                k_cache.scalar_type(), " k_cache");
  }
  auto check_descale = [&](const std::optional<at::Tensor>& descale, const char* name) {
    if (!descale.has_value()) return;
    const at::Tensor& d = descale.value();
    TORCH_CHECK(d.device() == dev, name, ": expected a tensor on ", dev, ", got ", d.device());
    TORCH_CHECK(d.scalar_type() == at::kFloat, name, ": expected dtype float32, got ", d.scalar_type());
    if (d.dim() != 1 || d.size(0) != 1) {
      std::string shape = "(";
      for (int64_t i = 0; i < d.dim(); ++i) shape += std::to_string(d.size(i)) + (i + 1 < d.dim() ? ", " : "");
      TORCH_CHECK(false, name, ": expected shape (1,), got ", shape + (d.dim() == 1 ? ",)" : ")"));
    }
  };
  check_descale(descale_q, "descale_q");
  check_descale(descale_k, "descale_k");
  TORCH_CHECK(q.dim() == 4, "q: expected (batch, seqlen_q, num_heads_q, 576), got ", shape_of(q.sizes()));
  TORCH_CHECK(k_cache.dim() == 4, "k_cache: expected (num_blocks, 64, num_heads_k, 576), got ",
              shape_of(k_cache.sizes()));
  const int batch = q.size(0), seqlen_q = q.size(1), num_heads_q = q.size(2), num_heads_k = k_cache.size(2);
  TORCH_CHECK(batch >= 1 && seqlen_q >= 1 && num_heads_q >= 1, "q: expected non-empty dimensions, got ",
              shape_of(q.sizes()));
  TORCH_CHECK(q.size(3) == kHeadDimQK, "q: expected head_dim ", str_of(kHeadDimQK), ", got ", str_of(q.size(3)));
  CHECK_DEVICE(k_cache, dev);
  if (!fp8_cache) CHECK_DTYPE(k_cache, dtype);
  TORCH_CHECK(k_cache.size(1) == kPageBlockSize && k_cache.size(3) == kHeadDimQK && k_cache.size(0) >= 1,
              "k_cache: expected (num_blocks, 64, num_heads_k, 576), got ", shape_of(k_cache.sizes()));
  TORCH_CHECK(num_heads_k >= 1 && num_heads_q % num_heads_k == 0,
              "k_cache: expected num_heads_k dividing num_heads_q = ", str_of(num_heads_q), ", got ",
              str_of(num_heads_k));
  TORCH_CHECK(head_dim_v == kHeadDimV, "head_dim_v: expected ", str_of(kHeadDimV), ", got ", str_of(head_dim_v));
  check_rows_16_byte_aligned(q, "q");
  check_rows_16_byte_aligned(k_cache, "k_cache");
  CHECK_DEVICE(block_table, dev); CHECK_DTYPE(block_table, at::kInt);
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == batch,
              "block_table: expected (batch_size, max_blocks_per_seq), got ", shape_of(block_table.sizes()));
  TORCH_CHECK(block_table.size(1) == 0 || block_table.stride(1) == 1, "block_table: expected a contiguous last dimension");
  CHECK_DEVICE(seqlens, dev); CHECK_DTYPE(seqlens, at::kInt); CHECK_SHAPE(seqlens, batch);
  check_plan_scale_sink(dev, batch, num_heads_q, metadata, num_splits, softmax_scale, attn_sink);

  const c10::cuda::CUDAGuard guard(dev);
  const auto seqlens_c = seqlens.contiguous();
  const auto out_dtype = fp8_q ? at::kBFloat16 : dtype;
  DecodeSetup setup(q, num_heads_k, out_dtype, metadata, num_splits, softmax_scale, attn_sink);
  DecodeParams& p = setup.params;
  p.causal = causal;
  p.q_format = !fp8_cache ? kQAsMath : fp8_q ? kQFp8 : dtype == at::kBFloat16 ? kQBf16 : kQAsMath;
  p.out_bf16 = out_dtype == at::kBFloat16;
  p.descale_q = descale_q.has_value() ? descale_q->data_ptr<float>() : nullptr;
  p.descale_k = descale_k.has_value() ? descale_k->data_ptr<float>() : nullptr;
  p.k_cache = k_cache.data_ptr();
  p.k_block_stride = k_cache.stride(0); p.k_token_stride = k_cache.stride(1); p.k_head_stride = k_cache.stride(2);
  p.num_kv_blocks = k_cache.size(0);
  p.block_table = block_table.data_ptr<int32_t>(); p.block_table_stride = block_table.stride(0);
  p.seqlens = seqlens_c.data_ptr<int32_t>();

  void* stream = at::cuda::getCurrentCUDAStream().stream();
  if (fp8_cache && p.rows_per_kv <= kTransposedMaxRows) {
    launch_mla_splitkv_fp8_transposed(p, stream);
  } else if (fp8_cache && fp8_q) {
    launch_mla_splitkv_fp8_e4m3_scores(p, stream);
  } else if (fp8_cache) {
    launch_mla_splitkv_fp8(p, stream);
  } else if (dtype == at::kBFloat16) {
    launch_mla_splitkv_bf16(p, stream);
  } else {
    launch_mla_splitkv_fp16(p, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // The combine kernel reads fp32 partials and writes out's dtype.
  if (out_dtype == at::kBFloat16) {
    launch_mla_combine_bf16(p, stream);
  } else {
    launch_mla_combine_fp16(p, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {setup.out, setup.lse};
}

// Sparse FP8 decoding (DeepSeek-V3.2; SPEC.md "Sparse FP8 decoding", flash_mla/_sparse_validation.py runs first):
// q (b, s_q, h_q, 576) bf16 with h_q a multiple of 64 (a row tile holds heads of one query token), k_cache
// (num_blocks, page_block_size, 1, 656) uint8 or float8_e4m3fn, indices (b, s_q, topk) int32, topk_length None or
// (b,) int32, the plan for lengths topk_length (or topk), s_q * h_q rows and one KV head. Index values are not
// checked here (the Python layer does on CPU and in debug mode); on the device a slot outside [0, num_tokens)
// counts as -1.
std::vector<at::Tensor> sparse_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& indices,
                                      const std::optional<at::Tensor>& topk_length, const at::Tensor& metadata,
                                      const at::Tensor& num_splits, double softmax_scale,
                                      const std::optional<at::Tensor>& attn_sink) {
  constexpr int kTokenBytes = SparseTokenLayout::kTokenBytes;
  TORCH_CHECK(q.is_cuda(), "q: expected a CUDA tensor, got one on ", q.device());
  const auto dev = q.device();
  CHECK_DTYPE(q, at::kBFloat16);
  TORCH_CHECK(q.dim() == 4 && q.size(3) == kHeadDimQK, "q: expected (batch, seqlen_q, num_heads_q, 576), got ",
              shape_of(q.sizes()));
  const int batch = q.size(0), seqlen_q = q.size(1), num_heads_q = q.size(2);
  TORCH_CHECK(batch >= 1 && seqlen_q >= 1, "q: expected non-empty dimensions, got ", shape_of(q.sizes()));
  TORCH_CHECK(num_heads_q % kRowsPerTile == 0, "q: the cuda sparse kernel needs num_heads_q a multiple of ",
              str_of(kRowsPerTile), ", got ", str_of(num_heads_q));
  check_rows_16_byte_aligned(q, "q");
  CHECK_DEVICE(k_cache, dev);
  TORCH_CHECK(k_cache.scalar_type() == at::kByte || k_cache.scalar_type() == at::kFloat8_e4m3fn,
              "k_cache: expected dtype uint8 or float8_e4m3fn, got ", k_cache.scalar_type());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == 1 && k_cache.size(3) == kTokenBytes && k_cache.size(0) >= 1 &&
                  k_cache.size(1) >= 1,
              "k_cache: expected (num_blocks, page_block_size, 1, 656), got ", shape_of(k_cache.sizes()));
  CHECK_DEVICE(indices, dev); CHECK_DTYPE(indices, at::kInt);
  TORCH_CHECK(indices.dim() == 3 && indices.size(0) == batch && indices.size(1) == seqlen_q && indices.size(2) >= 1,
              "indices: expected (batch_size, seqlen_q, topk), got ", shape_of(indices.sizes()));
  if (topk_length.has_value()) {
    CHECK_DEVICE(*topk_length, dev); CHECK_DTYPE(*topk_length, at::kInt); CHECK_SHAPE(*topk_length, batch);
  }
  check_plan_scale_sink(dev, batch, num_heads_q, metadata, num_splits, softmax_scale, attn_sink);

  const c10::cuda::CUDAGuard guard(dev);
  // Token t at byte 656 t: pages back to back (a copy otherwise), 16-byte aligned for the 16-byte gathers.
  const int64_t page = k_cache.size(1);
  at::Tensor tokens = k_cache.scalar_type() == at::kByte ? k_cache : k_cache.view(at::kByte);
  const bool flat = tokens.stride(3) == 1 && (page == 1 || tokens.stride(1) == kTokenBytes) &&
                    (tokens.size(0) == 1 || tokens.stride(0) == page * kTokenBytes);
  if (!flat || reinterpret_cast<uintptr_t>(tokens.data_ptr()) % 16 != 0) tokens = tokens.contiguous();
  const auto indices_c = indices.stride(2) == 1 ? indices : indices.contiguous();
  const at::Tensor lengths_c = topk_length.has_value() ? topk_length->contiguous() : at::Tensor();
  // The kernel copies its Q tiles by TMA (kv_cache_tma.h, encode_q_tma), whose strides must be nonzero: an expanded
  // q (stride 0 over more than one entry) is copied first.
  at::Tensor q_c = q;
  for (int d = 0; d < 3; ++d) {
    if (q.size(d) > 1 && q.stride(d) == 0) q_c = q.contiguous();
  }
  // One KV head: the packed rows of a batch row are its s_q * h_q (token, head) pairs.
  DecodeSetup setup(q_c, /*num_heads_k=*/1, at::kBFloat16, metadata, num_splits, softmax_scale, attn_sink);
  DecodeParams& p = setup.params;
  p.q_format = kQAsMath;
  p.out_bf16 = true;
  p.k_cache = tokens.data_ptr();
  p.num_tokens = tokens.size(0) * page;
  p.indices = indices_c.data_ptr<int32_t>();
  p.indices_batch_stride = indices_c.stride(0); p.indices_token_stride = indices_c.stride(1);
  p.topk = indices.size(2);
  p.seqlens = lengths_c.defined() ? lengths_c.data_ptr<int32_t>() : nullptr;

  void* stream = at::cuda::getCurrentCUDAStream().stream();
  launch_mla_splitkv_sparse(p, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  launch_mla_combine_bf16(p, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {setup.out, setup.lse};
}

}  // namespace
FLASH_MLA_NAMESPACE_END  // flash_mla

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flash_mla Hopper kernels (sm_90a)";
  m.attr("variant") = FLASH_MLA_VARIANT_NAME;    // kernels/variant.h: this build's inner namespace
  m.def("set_probe", [](const std::optional<at::Tensor>& buffer) {
    flash_mla::g_probe = buffer.has_value() ? reinterpret_cast<unsigned long long*>(buffer->data_ptr()) : nullptr;
  }, "Diagnostic: the int64 timeline buffer of -DFLASH_MLA_PROBE kernels (None: off)", pybind11::arg("buffer"));
  m.def("get_mla_metadata", &flash_mla::get_mla_metadata, "Tile scheduler on the device",
        pybind11::arg("cache_seqlens"), pybind11::arg("num_heads_per_head_k"), pybind11::arg("num_heads_k"),
        pybind11::arg("num_sms"), pybind11::arg("min_payload") = 0, pybind11::arg("tight_payload") = false);
  m.def("mla_decode", &flash_mla::mla_decode, "Split-KV MLA decoding + combine", pybind11::arg("q"),
        pybind11::arg("k_cache"), pybind11::arg("block_table"), pybind11::arg("cache_seqlens"),
        pybind11::arg("head_dim_v"), pybind11::arg("tile_scheduler_metadata"), pybind11::arg("num_splits"),
        pybind11::arg("softmax_scale"), pybind11::arg("causal"), pybind11::arg("attn_sink") = pybind11::none(),
        pybind11::arg("descale_q") = pybind11::none(), pybind11::arg("descale_k") = pybind11::none());
  m.def("sparse_decode", &flash_mla::sparse_decode, "Sparse FP8 (DeepSeek-V3.2) split-KV decoding + combine",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("indices"), pybind11::arg("topk_length"),
        pybind11::arg("tile_scheduler_metadata"), pybind11::arg("num_splits"), pybind11::arg("softmax_scale"),
        pybind11::arg("attn_sink") = pybind11::none());
}
