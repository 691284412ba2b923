// dequantize_global_slots_k_cache: out[n, k] = bf16 K of the record (format a.fmt) at slot slots[n, k]
// (exact: the dequantized values are bf16); a slot < 0 or past the cache gives a zero row. Rows r = n*K + k
// in [0, N*K); each 32-lane group gathers ROWS rows with all loads issued before the first store.
#include "dsv4/args.h"
#include "dsv4/record.h"

#define ROWS 2

template <class F>
__global__ void DSV4_LAUNCH_BOUNDS(256) dsv4_gather_global_slots_kernel(dsv4_global_gather_args a) {
  const int64_t r0 = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / DSV4_GROUP * ROWS;
  const int lane = threadIdx.x % DSV4_GROUP;
  const int64_t total = a.N * a.K, cap = a.num_blocks * a.bs;
  const uint8_t* cache = (const uint8_t*)a.cache;
  uint4 p[ROWS][2];
  uint8_t sb[ROWS];
  bool ok[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    int64_t row = r0 + r, slot = -1;
    if (row < total) slot = dsv4_index(a.slots, (row / a.K) * a.s_s0 + (row % a.K) * a.s_s1, a.slots64);
    ok[r] = slot >= 0 && slot < cap;
    dsv4_load_record_lane<F>(cache + (ok[r] ? slot / a.bs : 0) * a.page_stride, ok[r] ? slot % a.bs : 0, a.bs,
                             a.interleaved, lane, ok[r], p[r], sb[r]);
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    int64_t row = r0 + r;
    if (row >= total) break;
    dsv4_store_record_lane<F>((uint16_t*)a.out + (row / a.K) * a.out_s0 + (row % a.K) * a.out_s1, p[r], sb[r], lane,
                           ok[r]);
  }
}

extern "C" int dsv4_dequantize_global_slots_k_cache(const dsv4_global_gather_args* a, void* stream) {
  int64_t total = a->N * a->K;
  if (total <= 0) return 0;
  const int threads = 256, per_block = threads / DSV4_GROUP * ROWS;
  auto kernel = DSV4_ANY_FORMAT_KERNEL(dsv4_gather_global_slots_kernel, a);
  hipLaunchKernelGGL(kernel, dim3((unsigned)((total + per_block - 1) / per_block)), dim3(threads), 0,
                     (hipStream_t)stream, *a);
  return (int)hipGetLastError();
}
