// fused_qnorm_rope_kv_rope_quant_insert (vLLM's op), one launch:
//   q [T, H, 512] bf16 -> q_out [T, Hp, 512]: per-head weightless RMSNorm, RoPE on dims 448..511, one
//   bf16 rounding; heads H..Hp-1 are written as zeros;
//   kv [T, 512] bf16 -> RoPE (fp32) -> bf16 -> UE8M0 fp8_ds_mla record at slot_mapping[t] for
//   t < n_slots (slots < 0 skipped).
// Groups 0 .. T*Hp-1 do the q heads, groups T*Hp .. T*Hp+T-1 the kv rows (32 lanes each).
#include "dsv4/record.h"

__global__ void DSV4_LAUNCH_BOUNDS(256)
dsv4_qnorm_rope_kv_insert_kernel(const uint16_t* __restrict__ q, int64_t q_stride_t, int64_t q_stride_h, int H,
                                 uint16_t* __restrict__ q_out, int Hp, const uint16_t* __restrict__ kv,
                                 int64_t kv_stride, uint8_t* __restrict__ cache, int64_t page_stride,
                                 const int64_t* __restrict__ slots, int n_slots,
                                 const int64_t* __restrict__ positions, const float* __restrict__ cos_sin, int T,
                                 float eps, int bs) {
  int64_t g = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / DSV4_GROUP;
  int lane = threadIdx.x % DSV4_GROUP;
  int64_t nq = (int64_t)T * Hp;
  float v[16];
  if (g < nq) {
    int64_t t = g / Hp;
    int h = (int)(g % Hp);
    uint16_t* dst = q_out + g * 512 + lane * 16;
    if (h >= H) {
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = 0.0f;
      dsv4_store_bf16x16(dst, v);
      return;
    }
    dsv4_load_bf16x16(q + t * q_stride_t + h * q_stride_h + lane * 16, v);
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) ss = dsv4_add(ss, dsv4_mul(v[i], v[i]));
    ss = dsv4_group_sum(ss, DSV4_GROUP);
    float r = 1.0f / dsv4_sqrtf(dsv4_add(ss * (1.0f / 512.0f), eps));
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = dsv4_mul(v[i], r);
    dsv4_rope_lane(v, lane, cos_sin + positions[t] * 64);
    dsv4_store_bf16x16(dst, v);
    return;
  }
  int64_t t = g - nq;
  if (t >= n_slots) return;
  int64_t slot = slots[t];
  if (slot < 0) return;
  dsv4_load_bf16x16(kv + t * kv_stride + lane * 16, v);
  dsv4_rope_lane(v, lane, cos_sin + positions[t] * 64);
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = dsv4_bf16_to_float(dsv4_float_to_bf16(v[i]));
  dsv4_write_record(v, lane, cache + (slot / bs) * page_stride, slot % bs, bs);
}

extern "C" int dsv4_fused_qnorm_rope_kv_insert(const void* q, int64_t q_stride_t, int64_t q_stride_h, int H,
                                               void* q_out, int Hp, const void* kv, int64_t kv_stride, void* cache,
                                               int64_t page_stride, const int64_t* slots, int n_slots,
                                               const int64_t* positions, const float* cos_sin, int T, float eps,
                                               int bs, void* stream) {
  int64_t groups_total = (int64_t)T * Hp + n_slots;
  if (groups_total <= 0) return 0;
  const int threads = 256, groups = threads / DSV4_GROUP;
  hipLaunchKernelGGL(dsv4_qnorm_rope_kv_insert_kernel, dim3((unsigned)((groups_total + groups - 1) / groups)),
                     dim3(threads), 0, (hipStream_t)stream, (const uint16_t*)q, q_stride_t, q_stride_h, H,
                     (uint16_t*)q_out, Hp, (const uint16_t*)kv, kv_stride, (uint8_t*)cache, page_stride, slots,
                     n_slots, positions, cos_sin, T, eps, bs);
  return (int)hipGetLastError();
}
