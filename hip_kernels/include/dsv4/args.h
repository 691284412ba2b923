// Launch arguments of the cache and Q/KV kernels, one struct per kernel, shared by the kernels and the torch
// bindings (plain C types only: the bindings include this from a host compiler).
//
// Conventions: strides are in elements of the tensor they describe (bytes for uint8 caches); an index
// tensor (slots, positions, lengths, block table) is int32 or int64 as the engine passes it, and its
// `*64` flag says which; a cache is a `[num_blocks, block_size * record]` byte view whose page stride is
// `page_stride` (dsv4_rocm/cache_views.py), whose records are of the format `fmt` (DSV4_FMT_*, dsv4/record.h),
// its e4m3 bytes of the FNUZ flavour when `fnuz` (V40_584, V41_528 only), in the page layout `interleaved`
// (0: page-split). Every index is bounds-checked in the kernels against these.
#pragma once
#include <stdint.h>

typedef struct {
  const void* k; int64_t k_stride;                       // bf16 [n, 512] rows
  void* cache; int64_t page_stride, num_blocks; int bs;  // record pages
  int fmt, fnuz, interleaved;
  const void* slots; int slots64; int n;                 // [n] slots, < 0 or past the cache: skipped
} dsv4_insert_args;

typedef struct {
  const void* q; int64_t q_st, q_sh; int H;              // bf16 [T, H, 512]
  void* q_out; int64_t qo_st, qo_sh; int Hp;             // bf16 [T, Hp, 512]
  const void* kv; int64_t kv_stride;                     // bf16 [T, 512]
  void* cache; int64_t page_stride, num_blocks; int bs;  // record pages
  int fmt, fnuz, interleaved;
  const void* slots; int slots64; int n_slots;           // first n_slots tokens are inserted
  const void* positions; int pos64;                      // [T]
  const void* cos_sin; int cs_bf16; int64_t max_pos;     // [max_pos, 64] fp32 or bf16, rows contiguous
  int T; float eps;
  int apply_q_norm, apply_q_rope, q_interleaved;         // q_interleaved: q / q_out rows in 16-dim chunks
} dsv4_qnorm_insert_args;

typedef struct {
  const void* q; int64_t q_st, q_sh; int H;              // bf16 [T, H, 512]
  void* q_fp8; int64_t qf_st, qf_sh;                     // e4m3 [T, H, 512]
  const void* kv; int64_t kv_stride;                     // bf16 [T, 512]
  void* cache; int64_t block_stride, token_stride, num_blocks; int bs;  // e4m3 [num_blocks, bs, 512]
  const float* fp8_scale; const float* q_scale_inv;     // one fp32 each, read on the device
  const void* slots; int slots64; int n_slots;
  const void* positions; int pos64;
  const void* cos_sin; int cs_bf16; int64_t max_pos;
  int T; float eps;
  int apply_q_norm;                                      // 0: q is not RMS-normed (vLLM's DeepSeek-V4.1 layer)
} dsv4_full_cache_args;

typedef struct {
  const void* cache; int64_t page_stride, num_blocks; int bs;
  int fmt, fnuz, interleaved;
  void* out; int64_t out_s0, out_s1, rows;               // bf16 [R, rows, 512], rows 16-byte aligned
  const void* seq_lens; int seq64;                       // [R]
  const void* gather_lens; int gl64;                     // [R] or NULL (= seq_lens)
  const void* block_table; int bt64; int64_t bt_s0, bt_cols;  // [R, bt_cols]
  int R; int64_t offset;
} dsv4_gather_args;

typedef struct {
  const void* cache; int64_t page_stride, num_blocks; int bs;
  int fmt, fnuz, interleaved;
  void* out; int64_t out_s0, out_s1;                     // bf16 [N, K, 512], rows 16-byte aligned
  const void* slots; int slots64; int64_t s_s0, s_s1;    // [N, K]
  int64_t N, K;
} dsv4_global_gather_args;

typedef struct {
  const void* qr; int64_t qr_stride; const void* qw; void* qr_out; int Dq;
  const void* kv; int64_t kv_stride; const void* kw; void* kv_out; int Dkv;
  int T; float eps;
} dsv4_rmsnorm_args;

#ifdef __cplusplus
extern "C" {
#endif
int dsv4_quantize_and_insert_k_cache(const dsv4_insert_args* a, void* stream);
int dsv4_fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(const dsv4_qnorm_insert_args* a, void* stream);
int dsv4_qnorm_rope_and_insert_full_k_cache(const dsv4_full_cache_args* a, void* stream);
int dsv4_dequantize_and_gather_k_cache(const dsv4_gather_args* a, void* stream);
int dsv4_dequantize_global_slots_k_cache(const dsv4_global_gather_args* a, void* stream);
int dsv4_fused_q_kv_rmsnorm(const dsv4_rmsnorm_args* a, void* stream);
#ifdef __cplusplus
}
#endif
