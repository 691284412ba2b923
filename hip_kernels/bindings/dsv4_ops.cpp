// Torch glue for the HIP kernels: registers dsv4_rocm::* ops (CUDA dispatch key, which is also the
// ROCm one). Arguments are validated in dsv4_rocm/ops.py before these run; here only the launch.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

extern "C" {
int dsv4_quantize_and_insert_k_cache(const void* k, int64_t k_stride, void* cache, int64_t page_stride,
                                     const int64_t* slots, int n, int bs, void* stream);
int dsv4_fused_qnorm_rope_kv_insert(const void* q, int64_t q_stride_t, int64_t q_stride_h, int H, void* q_out, int Hp,
                                    const void* kv, int64_t kv_stride, void* cache, int64_t page_stride,
                                    const int64_t* slots, int n_slots, const int64_t* positions, const float* cos_sin,
                                    int T, float eps, int bs, void* stream);
int dsv4_fused_q_kv_rmsnorm(const void* qr, int64_t qr_stride, const void* qw, void* qr_out, int Dq, const void* kv,
                            int64_t kv_stride, const void* kw, void* kv_out, int Dkv, int T, float eps, void* stream);
int dsv4_dequantize_and_gather_k_cache(const void* cache, int64_t page_stride, const int64_t* slots, void* out, int n,
                                       int bs, void* stream);
}

static void* current_stream() { return (void*)at::cuda::getCurrentCUDAStream().stream(); }

static void check(int rc, const char* what) { TORCH_CHECK(rc == 0, "dsv4_rocm: ", what, " launch failed, error ", rc); }

void quantize_and_insert_k_cache(const at::Tensor& k, at::Tensor& k_cache, const at::Tensor& slot_mapping,
                                 int64_t block_size) {
  const c10::cuda::OptionalCUDAGuard guard(k.device());
  check(dsv4_quantize_and_insert_k_cache(k.data_ptr(), k.stride(0), k_cache.data_ptr(), k_cache.stride(0),
                                         slot_mapping.data_ptr<int64_t>(), (int)slot_mapping.size(0),
                                         (int)block_size, current_stream()),
        "quantize_and_insert_k_cache");
}

at::Tensor fused_qnorm_rope_kv_rope_quant_insert(const at::Tensor& q, const at::Tensor& kv, at::Tensor& k_cache,
                                                 const at::Tensor& slot_mapping, const at::Tensor& positions,
                                                 const at::Tensor& cos_sin_cache, int64_t padded_heads, double eps,
                                                 int64_t block_size) {
  const c10::cuda::OptionalCUDAGuard guard(q.device());
  auto out = at::empty({q.size(0), padded_heads, 512}, q.options());
  check(dsv4_fused_qnorm_rope_kv_insert(q.data_ptr(), q.stride(0), q.stride(1), (int)q.size(1), out.data_ptr(),
                                        (int)padded_heads, kv.data_ptr(), kv.stride(0), k_cache.data_ptr(),
                                        k_cache.stride(0), slot_mapping.data_ptr<int64_t>(),
                                        (int)slot_mapping.size(0), positions.data_ptr<int64_t>(),
                                        cos_sin_cache.data_ptr<float>(), (int)q.size(0), (float)eps,
                                        (int)block_size, current_stream()),
        "fused_qnorm_rope_kv_rope_quant_insert");
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_q_kv_rmsnorm(const at::Tensor& qr, const at::Tensor& kv,
                                                      const at::Tensor& q_weight, const at::Tensor& kv_weight,
                                                      double eps) {
  const c10::cuda::OptionalCUDAGuard guard(qr.device());
  auto qo = at::empty({qr.size(0), qr.size(1)}, qr.options());
  auto ko = at::empty({kv.size(0), kv.size(1)}, kv.options());
  check(dsv4_fused_q_kv_rmsnorm(qr.data_ptr(), qr.stride(0), q_weight.data_ptr(), qo.data_ptr(), (int)qr.size(1),
                                kv.data_ptr(), kv.stride(0), kv_weight.data_ptr(), ko.data_ptr(), (int)kv.size(1),
                                (int)qr.size(0), (float)eps, current_stream()),
        "fused_q_kv_rmsnorm");
  return {qo, ko};
}

at::Tensor dequantize_and_gather_k_cache(const at::Tensor& k_cache, const at::Tensor& slots, int64_t block_size) {
  const c10::cuda::OptionalCUDAGuard guard(k_cache.device());
  auto out = at::empty({slots.size(0), 512}, k_cache.options().dtype(at::kBFloat16));
  check(dsv4_dequantize_and_gather_k_cache(k_cache.data_ptr(), k_cache.stride(0), slots.data_ptr<int64_t>(),
                                           out.data_ptr(), (int)slots.size(0), (int)block_size, current_stream()),
        "dequantize_and_gather_k_cache");
  return out;
}

TORCH_LIBRARY(dsv4_rocm, m) {
  m.def("quantize_and_insert_k_cache(Tensor k, Tensor(a!) k_cache, Tensor slot_mapping, int block_size) -> ()");
  m.def("fused_qnorm_rope_kv_rope_quant_insert(Tensor q, Tensor kv, Tensor(a!) k_cache, Tensor slot_mapping, "
        "Tensor positions, Tensor cos_sin_cache, int padded_heads, float eps, int block_size) -> Tensor");
  m.def("fused_q_kv_rmsnorm(Tensor qr, Tensor kv, Tensor q_weight, Tensor kv_weight, float eps) -> (Tensor, Tensor)");
  m.def("dequantize_and_gather_k_cache(Tensor k_cache, Tensor slots, int block_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsv4_rocm, CUDA, m) {
  m.impl("quantize_and_insert_k_cache", &quantize_and_insert_k_cache);
  m.impl("fused_qnorm_rope_kv_rope_quant_insert", &fused_qnorm_rope_kv_rope_quant_insert);
  m.impl("fused_q_kv_rmsnorm", &fused_q_kv_rmsnorm);
  m.impl("dequantize_and_gather_k_cache", &dequantize_and_gather_k_cache);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
