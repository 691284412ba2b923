// dequantize_and_gather_k_cache: fp8_ds_mla records at slots -> bf16 rows [N, 512] (exact: the
// dequantized values are bf16). Negative slots give zero rows; slots are checked against the cache
// capacity by the caller. One 32-lane group per row: lanes 0..27 decode 16 NoPE bytes with their
// block's UE8M0 scale, lanes 28..31 copy 16 RoPE bf16 values.
#include "dsv4/record.h"

__global__ void DSV4_LAUNCH_BOUNDS(256)
dsv4_gather_kernel(const uint8_t* __restrict__ cache, int64_t page_stride, const int64_t* __restrict__ slots,
                   uint16_t* __restrict__ out, int n, int bs) {
  int64_t g = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / DSV4_GROUP;
  int lane = threadIdx.x % DSV4_GROUP;
  if (g >= n) return;
  int64_t slot = slots[g];
  float v[16];
  uint16_t* dst = out + g * 512 + lane * 16;
  if (slot < 0) {
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = 0.0f;
    dsv4_store_bf16x16(dst, v);
    return;
  }
  const uint8_t* page = cache + (slot / bs) * page_stride;
  int64_t off = slot % bs;
  const uint8_t* data = page + off * 576;
  if (lane < DSV4_NOPE_LANES) {
    uint4 p = *reinterpret_cast<const uint4*>(data + lane * 16);
    uint32_t w[4] = {p.x, p.y, p.z, p.w};
    uint8_t sb = page[(int64_t)bs * 576 + off * 8 + (lane >> 2)];
    float scale = sb == 0xff ? __uint_as_float(0x7fc00000u) : dsv4_exp2i((int)sb - 127);
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = dsv4_mul(dsv4_fp8_decode((uint8_t)(w[i / 4] >> (8 * (i % 4)))), scale);
    dsv4_store_bf16x16(dst, v);
  } else {
    const uint4* src = reinterpret_cast<const uint4*>(data + 448 + (lane - DSV4_NOPE_LANES) * 32);
    uint4* d4 = reinterpret_cast<uint4*>(dst);
    d4[0] = src[0];
    d4[1] = src[1];
  }
}

extern "C" int dsv4_dequantize_and_gather_k_cache(const void* cache, int64_t page_stride, const int64_t* slots,
                                                  void* out, int n, int bs, void* stream) {
  if (n <= 0) return 0;
  const int threads = 256, groups = threads / DSV4_GROUP;
  hipLaunchKernelGGL(dsv4_gather_kernel, dim3((n + groups - 1) / groups), dim3(threads), 0, (hipStream_t)stream,
                     (const uint8_t*)cache, page_stride, slots, (uint16_t*)out, n, bs);
  return (int)hipGetLastError();
}
