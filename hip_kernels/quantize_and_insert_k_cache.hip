// quantize_and_insert_k_cache (vLLM's op): UE8M0-quantize bf16 k [T, 512] (RoPE already applied) into
// fp8_ds_mla records at slot_mapping; slots < 0 are skipped. One 32-lane group per token.
#include "dsv4/record.h"

__global__ void DSV4_LAUNCH_BOUNDS(256)
dsv4_quantize_insert_kernel(const uint16_t* __restrict__ k, int64_t k_stride, uint8_t* __restrict__ cache,
                            int64_t page_stride, const int64_t* __restrict__ slots, int n, int bs) {
  int64_t g = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / DSV4_GROUP;
  int lane = threadIdx.x % DSV4_GROUP;
  if (g >= n) return;
  int64_t slot = slots[g];
  if (slot < 0) return;
  float v[16];
  dsv4_load_bf16x16(k + g * k_stride + lane * 16, v);
  dsv4_write_record(v, lane, cache + (slot / bs) * page_stride, slot % bs, bs);
}

extern "C" int dsv4_quantize_and_insert_k_cache(const void* k, int64_t k_stride, void* cache, int64_t page_stride,
                                                const int64_t* slots, int n, int bs, void* stream) {
  if (n <= 0) return 0;
  const int threads = 256, groups = threads / DSV4_GROUP;
  hipLaunchKernelGGL(dsv4_quantize_insert_kernel, dim3((n + groups - 1) / groups), dim3(threads), 0,
                     (hipStream_t)stream, (const uint16_t*)k, k_stride, (uint8_t*)cache, page_stride, slots, n, bs);
  return (int)hipGetLastError();
}
