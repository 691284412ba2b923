// quantize_and_insert_k_cache (vLLM's op): UE8M0-quantize bf16 k [n, 512] (RoPE already applied) into
// records of the format a.fmt (V40_584 or V41_528) at slots[t]; a slot < 0 or past the cache (num_blocks *
// bs) is skipped. One 32-lane group handles TOKENS tokens and issues all their loads before the first store
// (more bytes in flight per lane: the op is memory-bound). a.fnuz: the FNUZ flavour (dsv4/record.h).
#include "dsv4/args.h"
#include "dsv4/record.h"

#define TOKENS 2

template <class F>
__global__ void DSV4_LAUNCH_BOUNDS(256) dsv4_quantize_insert_kernel(dsv4_insert_args a) {
  int64_t g0 = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / DSV4_GROUP * TOKENS;
  int lane = threadIdx.x % DSV4_GROUP;
  const int64_t cap = a.num_blocks * a.bs;
  float v[TOKENS][16];
  int64_t slot[TOKENS];
#pragma unroll
  for (int i = 0; i < TOKENS; ++i) {
    slot[i] = g0 + i < a.n ? dsv4_index(a.slots, g0 + i, a.slots64) : -1;
    if (slot[i] >= cap) slot[i] = -1;
    if (slot[i] >= 0) dsv4_load_bf16x16((const uint16_t*)a.k + (g0 + i) * a.k_stride + lane * 16, v[i]);
  }
#pragma unroll
  for (int i = 0; i < TOKENS; ++i)      // slot[i] is the same for the whole group: shuffles stay converged
    if (slot[i] >= 0)
      dsv4_write_record<F>(v[i], lane, (uint8_t*)a.cache + (slot[i] / a.bs) * a.page_stride, slot[i] % a.bs, a.bs,
                           a.interleaved);
}

extern "C" int dsv4_quantize_and_insert_k_cache(const dsv4_insert_args* a, void* stream) {
  if (a->n <= 0) return 0;
  const int threads = 256, per_block = threads / DSV4_GROUP * TOKENS;
  auto kernel = DSV4_FP8_FORMAT_KERNEL(dsv4_quantize_insert_kernel, a);
  hipLaunchKernelGGL(kernel, dim3((a->n + per_block - 1) / per_block), dim3(threads), 0, (hipStream_t)stream, *a);
  return (int)hipGetLastError();
}
