// quantize_and_insert_k_cache (vLLM's op): UE8M0-quantize bf16 k [T, 512] (RoPE already applied) into
// fp8_ds_mla records at slot_mapping; slots < 0 are skipped. One 32-lane group handles TOKENS tokens and
// issues all their loads before the first store (more bytes in flight per lane: the op is memory-bound).
#include "dsv4/record.h"

#define TOKENS 2

__global__ void DSV4_LAUNCH_BOUNDS(256)
dsv4_quantize_insert_kernel(const uint16_t* __restrict__ k, int64_t k_stride, uint8_t* __restrict__ cache,
                            int64_t page_stride, const int64_t* __restrict__ slots, int n, int bs) {
  int64_t g0 = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / DSV4_GROUP * TOKENS;
  int lane = threadIdx.x % DSV4_GROUP;
  float v[TOKENS][16];
  int64_t slot[TOKENS];
#pragma unroll
  for (int i = 0; i < TOKENS; ++i) {
    slot[i] = g0 + i < n ? slots[g0 + i] : -1;
    if (slot[i] >= 0) dsv4_load_bf16x16(k + (g0 + i) * k_stride + lane * 16, v[i]);
  }
#pragma unroll
  for (int i = 0; i < TOKENS; ++i)      // slot[i] is the same for the whole group: shuffles stay converged
    if (slot[i] >= 0) dsv4_write_record(v[i], lane, cache + (slot[i] / bs) * page_stride, slot[i] % bs, bs);
}

extern "C" int dsv4_quantize_and_insert_k_cache(const void* k, int64_t k_stride, void* cache, int64_t page_stride,
                                                const int64_t* slots, int n, int bs, void* stream) {
  if (n <= 0) return 0;
  const int threads = 256, per_block = threads / DSV4_GROUP * TOKENS;
  hipLaunchKernelGGL(dsv4_quantize_insert_kernel, dim3((n + per_block - 1) / per_block), dim3(threads), 0,
                     (hipStream_t)stream, (const uint16_t*)k, k_stride, (uint8_t*)cache, page_stride, slots, n, bs);
  return (int)hipGetLastError();
}
