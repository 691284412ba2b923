// qnorm_rope_and_insert_full_k_cache (vLLM's full-cache fp8 form, torch.ops._C's
// fused_deepseek_v4_qnorm_rope_kv_rope_full_cache_fp8_insert), one launch:
//   q [T, H, 512] bf16 -> q_fp8 [T, H, 512] e4m3: weightless RMSNorm per head (unless !apply_q_norm), RoPE on
//   dims 448..511 (fp32),
//   times q_scale_inv[0], one e4m3 rounding;
//   kv [T, 512] bf16 -> RoPE (fp32) -> times 1 / fp8_scale[0] -> e4m3 row of 512 bytes at
//   cache + (slot / bs) * block_stride + (slot % bs) * token_stride, for t < n_slots.
// e4m3 bytes are RNE, saturating at +-448; a non-finite value gives 0x7F (NaN). A token whose position is
// outside the cos/sin table gets zero q bytes and no row; a slot < 0 or past the cache is skipped.
// Groups 0 .. T*H-1 do the q heads, groups T*H .. T*H+n_slots-1 the kv rows (32 lanes x 16 values each).
#include "dsv4/args.h"
#include "dsv4/record.h"

__global__ void DSV4_LAUNCH_BOUNDS(256) dsv4_full_cache_kernel(dsv4_full_cache_args a) {
  int64_t g = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / DSV4_GROUP;
  int lane = threadIdx.x % DSV4_GROUP;
  int64_t nq = (int64_t)a.T * a.H;
  float v[16];
  if (g < nq) {
    int64_t t = g / a.H;
    int h = (int)(g % a.H);
    int64_t pos = dsv4_index(a.positions, t, a.pos64);
    uint4* dst = reinterpret_cast<uint4*>((uint8_t*)a.q_fp8 + t * a.qf_st + h * a.qf_sh + lane * 16);
    if (pos < 0 || pos >= a.max_pos) {
      *dst = make_uint4(0, 0, 0, 0);
      return;
    }
    dsv4_load_bf16x16((const uint16_t*)a.q + t * a.q_st + h * a.q_sh + lane * 16, v);
    if (a.apply_q_norm) dsv4_rmsnorm512(v, a.eps);
    dsv4_rope_lane(v, lane, a.cos_sin, pos, a.cs_bf16);
    *dst = dsv4_fp8_scaled_x16(v, a.q_scale_inv[0]);
    return;
  }
  int64_t t = g - nq;
  if (t >= a.n_slots) return;
  int64_t slot = dsv4_index(a.slots, t, a.slots64);
  int64_t pos = dsv4_index(a.positions, t, a.pos64);
  if (slot < 0 || slot >= a.num_blocks * a.bs || pos < 0 || pos >= a.max_pos) return;
  dsv4_load_bf16x16((const uint16_t*)a.kv + t * a.kv_stride + lane * 16, v);
  dsv4_rope_lane(v, lane, a.cos_sin, pos, a.cs_bf16);
  float inv = 1.0f / a.fp8_scale[0];
  uint8_t* row = (uint8_t*)a.cache + (slot / a.bs) * a.block_stride + (slot % a.bs) * a.token_stride;
  *reinterpret_cast<uint4*>(row + lane * 16) = dsv4_fp8_scaled_x16(v, inv);
}

extern "C" int dsv4_qnorm_rope_and_insert_full_k_cache(const dsv4_full_cache_args* a, void* stream) {
  int64_t groups_total = (int64_t)a->T * a->H + a->n_slots;
  if (groups_total <= 0) return 0;
  const int threads = 256, groups = threads / DSV4_GROUP;
  hipLaunchKernelGGL(dsv4_full_cache_kernel, dim3((unsigned)((groups_total + groups - 1) / groups)), dim3(threads), 0,
                     (hipStream_t)stream, *a);
  return (int)hipGetLastError();
}
