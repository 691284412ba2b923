// Torch glue for the HIP kernels: the launchers as torch.ops.dsv4_rocm_hip.* (CUDA dispatch key, which is
// also the ROCm one). Their callers (dsv4_rocm/hip_ops.py) pass validated arguments in the kernels' layout
// (cache page views, 16-byte aligned rows, caller-allocated outputs); here only the launch. The public
// custom ops of vLLM's schemas are torch.ops.dsv4_rocm.* (dsv4_rocm/ops/library.py).
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "dsv4/args.h"

static void* current_stream() { return (void*)at::cuda::getCurrentCUDAStream().stream(); }

static void check(int rc, const char* what) { TORCH_CHECK(rc == 0, "dsv4_rocm: ", what, " launch failed, error ", rc); }

static int is64(const at::Tensor& t) { return t.scalar_type() == at::kLong ? 1 : 0; }

// an fp32 or bf16 cos/sin table, rows contiguous
static int cs_bf16(const at::Tensor& cs) {
  TORCH_CHECK(cs.stride(1) == 1 && cs.stride(0) == 64, "dsv4_rocm: cos_sin_cache rows must be contiguous");
  return cs.scalar_type() == at::kBFloat16 ? 1 : 0;
}

void quantize_and_insert_k_cache(const at::Tensor& k, at::Tensor& pages, const at::Tensor& slots, int64_t block_size,
                                 int64_t fmt, bool fnuz, bool interleaved) {
  const c10::cuda::OptionalCUDAGuard guard(k.device());
  dsv4_insert_args a = {k.data_ptr(), k.stride(0), pages.data_ptr(), pages.stride(0), pages.size(0), (int)block_size,
                        (int)fmt, fnuz ? 1 : 0, interleaved ? 1 : 0, slots.data_ptr(), is64(slots), (int)slots.size(0)};
  check(dsv4_quantize_and_insert_k_cache(&a, current_stream()), "quantize_and_insert_k_cache");
}

void fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(const at::Tensor& q, const at::Tensor& kv, at::Tensor& q_out,
                                                       at::Tensor& pages, const at::Tensor& slots,
                                                       const at::Tensor& positions, const at::Tensor& cos_sin,
                                                       double eps, int64_t block_size, int64_t fmt, bool fnuz,
                                                       bool interleaved,
                                                       bool apply_q_norm, bool apply_q_rope, bool q_interleaved) {
  const c10::cuda::OptionalCUDAGuard guard(q.device());
  dsv4_qnorm_insert_args a = {q.data_ptr(), q.stride(0), q.stride(1), (int)q.size(1),
                              q_out.data_ptr(), q_out.stride(0), q_out.stride(1), (int)q_out.size(1),
                              kv.data_ptr(), kv.stride(0),
                              pages.data_ptr(), pages.stride(0), pages.size(0), (int)block_size,
                              (int)fmt, fnuz ? 1 : 0, interleaved ? 1 : 0,
                              slots.data_ptr(), is64(slots), (int)slots.size(0),
                              positions.data_ptr(), is64(positions),
                              cos_sin.data_ptr(), cs_bf16(cos_sin), cos_sin.size(0),
                              (int)q.size(0), (float)eps,
                              apply_q_norm ? 1 : 0, apply_q_rope ? 1 : 0, q_interleaved ? 1 : 0};
  check(dsv4_fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(&a, current_stream()),
        "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert");
}

void qnorm_rope_and_insert_full_k_cache(const at::Tensor& q, const at::Tensor& kv, at::Tensor& q_fp8,
                                        at::Tensor& k_cache, const at::Tensor& slots, const at::Tensor& positions,
                                        const at::Tensor& cos_sin, const at::Tensor& fp8_scale,
                                        const at::Tensor& q_scale_inv, double eps, int64_t block_size,
                                        bool apply_q_norm) {
  const c10::cuda::OptionalCUDAGuard guard(q.device());
  dsv4_full_cache_args a = {q.data_ptr(), q.stride(0), q.stride(1), (int)q.size(1),
                            q_fp8.data_ptr(), q_fp8.stride(0), q_fp8.stride(1),
                            kv.data_ptr(), kv.stride(0),
                            k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.size(0), (int)block_size,
                            fp8_scale.data_ptr<float>(), q_scale_inv.data_ptr<float>(),
                            slots.data_ptr(), is64(slots), (int)slots.size(0),
                            positions.data_ptr(), is64(positions),
                            cos_sin.data_ptr(), cs_bf16(cos_sin), cos_sin.size(0),
                            (int)q.size(0), (float)eps, apply_q_norm ? 1 : 0};
  check(dsv4_qnorm_rope_and_insert_full_k_cache(&a, current_stream()), "qnorm_rope_and_insert_full_k_cache");
}

void dequantize_and_gather_k_cache(at::Tensor& out, const at::Tensor& pages, const at::Tensor& seq_lens,
                                   const c10::optional<at::Tensor>& gather_lens, const at::Tensor& block_table,
                                   int64_t block_size, int64_t offset, int64_t fmt, bool fnuz, bool interleaved) {
  const c10::cuda::OptionalCUDAGuard guard(out.device());
  const bool has_gl = gather_lens.has_value();
  dsv4_gather_args a = {pages.data_ptr(), pages.stride(0), pages.size(0), (int)block_size, (int)fmt, fnuz ? 1 : 0,
                        interleaved ? 1 : 0,
                        out.data_ptr(), out.stride(0), out.stride(1), out.size(1),
                        seq_lens.data_ptr(), is64(seq_lens),
                        has_gl ? gather_lens->data_ptr() : nullptr, has_gl ? is64(*gather_lens) : 0,
                        block_table.data_ptr(), is64(block_table), block_table.stride(0), block_table.size(1),
                        (int)seq_lens.size(0), offset};
  check(dsv4_dequantize_and_gather_k_cache(&a, current_stream()), "dequantize_and_gather_k_cache");
}

void dequantize_global_slots_k_cache(at::Tensor& out, const at::Tensor& pages, const at::Tensor& slot_ids,
                                     int64_t block_size, int64_t fmt, bool fnuz, bool interleaved) {
  const c10::cuda::OptionalCUDAGuard guard(out.device());
  dsv4_global_gather_args a = {pages.data_ptr(), pages.stride(0), pages.size(0), (int)block_size, (int)fmt,
                               fnuz ? 1 : 0, interleaved ? 1 : 0,
                               out.data_ptr(), out.stride(0), out.stride(1),
                               slot_ids.data_ptr(), is64(slot_ids), slot_ids.stride(0), slot_ids.stride(1),
                               slot_ids.size(0), slot_ids.size(1)};
  check(dsv4_dequantize_global_slots_k_cache(&a, current_stream()), "dequantize_global_slots_k_cache");
}

void fused_q_kv_rmsnorm(const at::Tensor& qr, const at::Tensor& kv, const at::Tensor& q_weight,
                        const at::Tensor& kv_weight, at::Tensor& qr_out, at::Tensor& kv_out, double eps) {
  const c10::cuda::OptionalCUDAGuard guard(qr.device());
  dsv4_rmsnorm_args a = {qr.data_ptr(), qr.stride(0), q_weight.data_ptr(), qr_out.data_ptr(), (int)qr.size(1),
                         kv.data_ptr(), kv.stride(0), kv_weight.data_ptr(), kv_out.data_ptr(), (int)kv.size(1),
                         (int)qr.size(0), (float)eps};
  check(dsv4_fused_q_kv_rmsnorm(&a, current_stream()), "fused_q_kv_rmsnorm");
}

TORCH_LIBRARY(dsv4_rocm_hip, m) {
  m.def("quantize_and_insert_k_cache(Tensor k, Tensor(a!) pages, Tensor slots, int block_size, int fmt, "
        "bool fnuz, bool interleaved) -> ()");
  m.def("fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(Tensor q, Tensor kv, Tensor(a!) q_out, "
        "Tensor(b!) pages, Tensor slots, Tensor positions, Tensor cos_sin_cache, float eps, int block_size, "
        "int fmt, bool fnuz, bool interleaved, bool apply_q_norm, bool apply_q_rope, bool q_interleaved) -> ()");
  m.def("qnorm_rope_and_insert_full_k_cache(Tensor q, Tensor kv, Tensor(a!) q_fp8, Tensor(b!) k_cache, "
        "Tensor slots, Tensor positions, Tensor cos_sin_cache, Tensor fp8_scale, Tensor q_fp8_scale_inv, "
        "float eps, int block_size, bool apply_q_norm) -> ()");
  m.def("dequantize_and_gather_k_cache(Tensor(a!) out, Tensor pages, Tensor seq_lens, Tensor? gather_lens, "
        "Tensor block_table, int block_size, int offset, int fmt, bool fnuz, bool interleaved) -> ()");
  m.def("dequantize_global_slots_k_cache(Tensor(a!) out, Tensor pages, Tensor slot_ids, int block_size, int fmt, "
        "bool fnuz, bool interleaved) -> ()");
  m.def("fused_q_kv_rmsnorm(Tensor qr, Tensor kv, Tensor q_weight, Tensor kv_weight, Tensor(a!) qr_out, "
        "Tensor(b!) kv_out, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(dsv4_rocm_hip, CUDA, m) {
  m.impl("quantize_and_insert_k_cache", &quantize_and_insert_k_cache);
  m.impl("fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert", &fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert);
  m.impl("qnorm_rope_and_insert_full_k_cache", &qnorm_rope_and_insert_full_k_cache);
  m.impl("dequantize_and_gather_k_cache", &dequantize_and_gather_k_cache);
  m.impl("dequantize_global_slots_k_cache", &dequantize_global_slots_k_cache);
  m.impl("fused_q_kv_rmsnorm", &fused_q_kv_rmsnorm);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
