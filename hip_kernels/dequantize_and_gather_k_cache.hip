// dequantize_and_gather_k_cache (vLLM's op): for request b (blockIdx.x) and i < gather_len_b,
//   out[b, offset + i] = bf16 K of the token at position p = seq_len_b - gather_len_b + i, read from page
//   block_table[b, p / bs] of the cache of records a.fmt (exact: the dequantized values are bf16).
// gather_len_b = gather_lens[b], or seq_lens[b] when gather_lens is NULL. Rows past out's `rows` are not
// written; a row whose position is negative or whose block-table entry is missing, negative or past the
// cache is written as zeros. The blocks of one request (gridDim.y of them, 8 row groups each) stride over
// its rows; each 32-lane group gathers ROWS rows with all loads issued before the first store. FNUZ: the
// cache holds records of the FNUZ flavour (dsv4/record.h).
#include "dsv4/args.h"
#include "dsv4/record.h"

#define ROWS 2

template <class F>
__global__ void DSV4_LAUNCH_BOUNDS(256) dsv4_gather_block_table_kernel(dsv4_gather_args a) {
  const int b = blockIdx.x;
  const int lane = threadIdx.x % DSV4_GROUP;
  const int64_t group = (int64_t)blockIdx.y * (blockDim.x / DSV4_GROUP) + threadIdx.x / DSV4_GROUP;
  const int64_t groups = (int64_t)gridDim.y * (blockDim.x / DSV4_GROUP);
  const int64_t seq = dsv4_index(a.seq_lens, b, a.seq64);
  const int64_t gl = a.gather_lens ? dsv4_index(a.gather_lens, b, a.gl64) : seq;
  int64_t n = gl < a.rows - a.offset ? gl : a.rows - a.offset;   // rows of out this request writes
  const uint8_t* cache = (const uint8_t*)a.cache;
  uint16_t* out = (uint16_t*)a.out + (int64_t)b * a.out_s0 + a.offset * a.out_s1;
  for (int64_t i0 = group * ROWS; i0 < n; i0 += groups * ROWS) {
    uint4 p[ROWS][2];
    uint8_t sb[ROWS];
    bool ok[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      int64_t i = i0 + r, pos = seq - gl + i, page = -1;
      if (i < n && pos >= 0 && pos / a.bs < a.bt_cols) page = dsv4_index(a.block_table, b * a.bt_s0 + pos / a.bs, a.bt64);
      ok[r] = page >= 0 && page < a.num_blocks;
      dsv4_load_record_lane<F>(cache + (ok[r] ? page : 0) * a.page_stride, ok[r] ? pos % a.bs : 0, a.bs,
                               a.interleaved, lane, ok[r], p[r], sb[r]);
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
      if (i0 + r < n) dsv4_store_record_lane<F>(out + (i0 + r) * a.out_s1, p[r], sb[r], lane, ok[r]);
  }
}

extern "C" int dsv4_dequantize_and_gather_k_cache(const dsv4_gather_args* a, void* stream) {
  if (a->R <= 0 || a->rows <= a->offset) return 0;
  // enough blocks to fill the GPU whatever the batch (fixed by shapes only: graph-capturable), no more
  // than the rows of out need
  const int threads = 256, per_block = threads / DSV4_GROUP * ROWS;
  int64_t need = (a->rows - a->offset + per_block - 1) / per_block;
  int64_t want = (1024 + a->R - 1) / a->R;
  int64_t y = need < want ? need : want;
  auto kernel = DSV4_ANY_FORMAT_KERNEL(dsv4_gather_block_table_kernel, a);
  hipLaunchKernelGGL(kernel, dim3((unsigned)a->R, (unsigned)(y > 65535 ? 65535 : y)), dim3(threads), 0,
                     (hipStream_t)stream, *a);
  return (int)hipGetLastError();
}
