// fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert (vLLM's op, its 13-argument schema), one launch:
//   q [T, H, 512] bf16 -> q_out [T, Hp, 512] bf16: per-head weightless RMSNorm (unless apply_q_norm is 0, as
//   DeepSeek-V4.1 runs it), RoPE on dims 448..511 (unless apply_q_rope is 0; vLLM's fma rounding), one bf16 rounding; heads
//   H..Hp-1 are zeros; with q_interleaved both hold a token's heads in 16-dim chunks (value (h, d) at
//   (d / 16) * H * 16 + h * 16 + d % 16 of the token's row), which puts lane l's 16 values at chunk l; Hp 0:
//   no q work;
//   kv [T, 512] bf16 -> RoPE (fp32) -> bf16 -> UE8M0 record (V40_584, or V41_528; OCP or, with a.fnuz, the
//   FNUZ flavour) at slots[t] for t < n_slots.
// A token whose position is outside the cos/sin table gets zero q rows and no record; a slot < 0 or past
// the cache is skipped. Groups 0 .. T*Hp-1 do the q heads, groups T*Hp .. T*Hp+n_slots-1 the kv rows.
#include "dsv4/args.h"
#include "dsv4/record.h"

template <class F>
__global__ void DSV4_LAUNCH_BOUNDS(256) dsv4_qnorm_rope_kv_insert_kernel(dsv4_qnorm_insert_args a) {
  int64_t g = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / DSV4_GROUP;
  int lane = threadIdx.x % DSV4_GROUP;
  int64_t nq = (int64_t)a.T * a.Hp;
  float v[16];
  if (g < nq) {
    int64_t t = g / a.Hp;
    int h = (int)(g % a.Hp);
    int64_t pos = dsv4_index(a.positions, t, a.pos64);
    // head-major: the lane's 16 values at lane * 16 of the head's row; chunk-interleaved: at chunk `lane`
    int64_t qo_off = a.q_interleaved ? (int64_t)lane * a.Hp * 16 + h * 16 : h * a.qo_sh + lane * 16;
    uint16_t* dst = (uint16_t*)a.q_out + t * a.qo_st + qo_off;
    if (h >= a.H || pos < 0 || pos >= a.max_pos) {    // padding head or invalid token: zeros
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = 0.0f;
      dsv4_store_bf16x16(dst, v);
      return;
    }
    int64_t q_off = a.q_interleaved ? (int64_t)lane * a.H * 16 + h * 16 : h * a.q_sh + lane * 16;
    dsv4_load_bf16x16((const uint16_t*)a.q + t * a.q_st + q_off, v);
    if (a.apply_q_norm) dsv4_rmsnorm512(v, a.eps);
    if (a.apply_q_rope) dsv4_rope_lane_fma(v, lane, a.cos_sin, pos, a.cs_bf16);   // vLLM's q rounding
    dsv4_store_bf16x16(dst, v);
    return;
  }
  int64_t t = g - nq;
  if (t >= a.n_slots) return;
  int64_t slot = dsv4_index(a.slots, t, a.slots64);
  int64_t pos = dsv4_index(a.positions, t, a.pos64);
  if (slot < 0 || slot >= a.num_blocks * a.bs || pos < 0 || pos >= a.max_pos) return;
  dsv4_load_bf16x16((const uint16_t*)a.kv + t * a.kv_stride + lane * 16, v);
  dsv4_rope_lane(v, lane, a.cos_sin, pos, a.cs_bf16);
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = dsv4_bf16_to_float(dsv4_float_to_bf16(v[i]));
  dsv4_write_record<F>(v, lane, (uint8_t*)a.cache + (slot / a.bs) * a.page_stride, slot % a.bs, a.bs, a.interleaved);
}

extern "C" int dsv4_fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(const dsv4_qnorm_insert_args* a,
                                                                      void* stream) {
  int64_t groups_total = (int64_t)a->T * a->Hp + a->n_slots;
  if (groups_total <= 0) return 0;
  const int threads = 256, groups = threads / DSV4_GROUP;
  auto kernel = DSV4_FP8_FORMAT_KERNEL(dsv4_qnorm_rope_kv_insert_kernel, a);
  hipLaunchKernelGGL(kernel, dim3((unsigned)((groups_total + groups - 1) / groups)), dim3(threads), 0,
                     (hipStream_t)stream, *a);
  return (int)hipGetLastError();
}
