// fused_q_kv_rmsnorm (vLLM's op): qr [T, Dq] and kv [T, Dkv] bf16 rows -> bf(x * rsqrt(mean(x^2) + eps) * w),
// fp32 inside, one launch for both. One 32-lane group per row, 8 values (16 bytes) per lane per step.
// Row lengths must be multiples of 8 (q_lora 1024/1536 and 512 are).
#include "dsv4/args.h"
#include "dsv4/portable.h"

__device__ __forceinline__ void dsv4_rmsnorm_row(const uint16_t* x, const uint16_t* w, uint16_t* y, int D,
                                                 float eps, int lane) {
  float ss = 0.0f;
  for (int c = lane * 8; c < D; c += DSV4_GROUP * 8) {
    uint4 p = *reinterpret_cast<const uint4*>(x + c);
    uint32_t u[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float a = dsv4_bf16_to_float((uint16_t)(u[i] & 0xffff)), b = dsv4_bf16_to_float((uint16_t)(u[i] >> 16));
      ss = dsv4_add(ss, dsv4_add(dsv4_mul(a, a), dsv4_mul(b, b)));
    }
  }
  ss = dsv4_group_sum(ss, DSV4_GROUP);
  float r = 1.0f / dsv4_sqrtf(dsv4_add(ss / (float)D, eps));
  for (int c = lane * 8; c < D; c += DSV4_GROUP * 8) {
    uint4 p = *reinterpret_cast<const uint4*>(x + c), q = *reinterpret_cast<const uint4*>(w + c);
    uint32_t u[4] = {p.x, p.y, p.z, p.w}, wv[4] = {q.x, q.y, q.z, q.w}, o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float a = dsv4_mul(dsv4_mul(dsv4_bf16_to_float((uint16_t)(u[i] & 0xffff)), r),
                         dsv4_bf16_to_float((uint16_t)(wv[i] & 0xffff)));
      float b = dsv4_mul(dsv4_mul(dsv4_bf16_to_float((uint16_t)(u[i] >> 16)), r),
                         dsv4_bf16_to_float((uint16_t)(wv[i] >> 16)));
      o[i] = (uint32_t)dsv4_float_to_bf16(a) | ((uint32_t)dsv4_float_to_bf16(b) << 16);
    }
    *reinterpret_cast<uint4*>(y + c) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

__global__ void DSV4_LAUNCH_BOUNDS(256) dsv4_q_kv_rmsnorm_kernel(dsv4_rmsnorm_args a) {
  int64_t g = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / DSV4_GROUP;
  int lane = threadIdx.x % DSV4_GROUP;
  if (g < a.T)
    dsv4_rmsnorm_row((const uint16_t*)a.qr + g * a.qr_stride, (const uint16_t*)a.qw, (uint16_t*)a.qr_out + g * a.Dq,
                     a.Dq, a.eps, lane);
  else if (g < 2 * (int64_t)a.T)
    dsv4_rmsnorm_row((const uint16_t*)a.kv + (g - a.T) * a.kv_stride, (const uint16_t*)a.kw,
                     (uint16_t*)a.kv_out + (g - a.T) * a.Dkv, a.Dkv, a.eps, lane);
}

extern "C" int dsv4_fused_q_kv_rmsnorm(const dsv4_rmsnorm_args* a, void* stream) {
  if (a->T <= 0) return 0;
  const int threads = 256, groups = threads / DSV4_GROUP;
  hipLaunchKernelGGL(dsv4_q_kv_rmsnorm_kernel, dim3((unsigned)((2 * (int64_t)a->T + groups - 1) / groups)),
                     dim3(threads), 0, (hipStream_t)stream, *a);
  return (int)hipGetLastError();
}
