// dequantize_and_gather_k_cache: fp8_ds_mla records at slots -> bf16 rows [N, 512] (exact: the
// dequantized values are bf16). Negative slots give zero rows; slots are checked against the cache
// capacity by the caller. One 32-lane group per row: lanes 0..27 decode 16 NoPE bytes with their
// block's UE8M0 scale, lanes 28..31 copy 16 RoPE bf16 values.
#include "dsv4/record.h"

#define ROWS 2

__device__ __forceinline__ void dsv4_decode_row(const uint4& p, uint8_t sb, float v[16]) {
  uint32_t w[4] = {p.x, p.y, p.z, p.w};
  float scale = sb == 0xff ? __uint_as_float(0x7fc00000u) : dsv4_exp2i((int)sb - 127);
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = dsv4_mul(dsv4_fp8_decode((uint8_t)(w[i / 4] >> (8 * (i % 4)))), scale);
}

// Each group gathers ROWS rows, all loads issued before the first store.
__global__ void DSV4_LAUNCH_BOUNDS(256)
dsv4_gather_kernel(const uint8_t* __restrict__ cache, int64_t page_stride, const int64_t* __restrict__ slots,
                   uint16_t* __restrict__ out, int n, int bs) {
  int64_t g0 = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / DSV4_GROUP * ROWS;
  int lane = threadIdx.x % DSV4_GROUP;
  uint4 p[ROWS][2];
  uint8_t sb[ROWS];
  int64_t slot[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    slot[r] = g0 + r < n ? slots[g0 + r] : -1;
    p[r][0] = p[r][1] = make_uint4(0, 0, 0, 0);
    sb[r] = 0;
    if (slot[r] < 0) continue;
    const uint8_t* page = cache + (slot[r] / bs) * page_stride;
    int64_t off = slot[r] % bs;
    if (lane < DSV4_NOPE_LANES) {
      p[r][0] = *reinterpret_cast<const uint4*>(page + off * 576 + lane * 16);
      sb[r] = page[(int64_t)bs * 576 + off * 8 + (lane >> 2)];
    } else {
      const uint4* src = reinterpret_cast<const uint4*>(page + off * 576 + 448 + (lane - DSV4_NOPE_LANES) * 32);
      p[r][0] = src[0];
      p[r][1] = src[1];
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (g0 + r >= n) break;
    uint16_t* dst = out + (g0 + r) * 512 + lane * 16;
    uint4* d4 = reinterpret_cast<uint4*>(dst);
    if (slot[r] < 0 || lane >= DSV4_NOPE_LANES) {       // zero row, or RoPE bf16 copied verbatim
      d4[0] = p[r][0];
      d4[1] = p[r][1];
    } else {
      float v[16];
      dsv4_decode_row(p[r][0], sb[r], v);
      dsv4_store_bf16x16(dst, v);
    }
  }
}

extern "C" int dsv4_dequantize_and_gather_k_cache(const void* cache, int64_t page_stride, const int64_t* slots,
                                                  void* out, int n, int bs, void* stream) {
  if (n <= 0) return 0;
  const int threads = 256, per_block = threads / DSV4_GROUP * ROWS;
  hipLaunchKernelGGL(dsv4_gather_kernel, dim3((n + per_block - 1) / per_block), dim3(threads), 0, (hipStream_t)stream,
                     (const uint8_t*)cache, page_stride, slots, (uint16_t*)out, n, bs);
  return (int)hipGetLastError();
}
