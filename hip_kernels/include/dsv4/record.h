// The KV record writers and readers shared by the cache kernels (docs/cache_format.md#record).
//
// A 512-d vector is held by a group of 32 lanes, 16 consecutive values per lane. A record format is a
// compile-time parameter (the structs below, the numbers of dsv4_rocm/layout.py's RecordFormat); a kernel
// is a template on it and its launcher picks the instance from the format code of its arguments (args.h).
// The page layout is a runtime flag: page-split (record o's data at o * DATA_BYTES, its scales at
// bs * DATA_BYTES + o * SCALE_BYTES) or interleaved (record o whole at o * TOKEN_BYTES).
//   V40_584: lanes 0..27 hold the 448 NoPE dims (4 lanes = one 64-value UE8M0 block), lanes 28..31 the 64
//            bf16 RoPE dims; 7 UE8M0 bytes and a pad byte 0.
//   V41_528: every lane 16 e4m3 values (2 lanes = one 32-value UE8M0 block); 16 UE8M0 bytes.
//   V41_FP4_288: every lane 16 e2m1 values (8 bytes, one e4m3 scale); 32 scale bytes.
// FNUZ (a member of the e4m3 formats' structs: dsv4_v40_fnuz, dsv4_v41_fnuz; the format's `fnuz` launch
// flag): the FNUZ flavour of the record, vLLM's gfx942 sliding-window cache (docs/cache_format.md#fnuz-flavour,
// dsv4_rocm/layout.py with_fnuz). Its e4m3fnuz bytes are the OCP bytes of the same block and each scale byte
// is one higher, so the writer and the reader differ from the OCP ones only in the scale byte, a poisoned
// block's fill byte (0x80, fnuz NaN) and the bytes fnuz reads differently (0x80 NaN; 0x7F / 0xFF +-240,
// which an FNUZ writer never emits).
#pragma once
#include "dsv4/portable.h"

#define DSV4_NOPE_LANES 28
#define DSV4_KV_EPS 1e-4f

// Format codes of the launch arguments (dsv4_rocm/hip_ops.py FORMAT_CODES).
#define DSV4_FMT_V40 0
#define DSV4_FMT_V41 1
#define DSV4_FMT_V41_FP4 2

template <int CODE, int TOKEN_BYTES_, int DATA_BYTES_, int QUANT_DIMS_, int ELEM_BITS_, int QUANT_BLOCK_,
          bool FNUZ_ = false>
struct dsv4_format {
  static constexpr int CODE_ = CODE;
  static constexpr bool FNUZ = FNUZ_;                             // e4m3fnuz bytes, scale bytes one higher
  static constexpr int TOKEN_BYTES = TOKEN_BYTES_, DATA_BYTES = DATA_BYTES_, SCALE_BYTES = TOKEN_BYTES_ - DATA_BYTES_;
  static constexpr int QUANT_DIMS = QUANT_DIMS_, ELEM_BITS = ELEM_BITS_, QUANT_BLOCK = QUANT_BLOCK_;
  static constexpr int LANES_PER_BLOCK = QUANT_BLOCK_ / 16;      // 4 (V40), 2 (V41), 1 (FP4)
  static constexpr int QUANT_LANES = QUANT_DIMS_ / 16;           // lanes holding quantized values
  static constexpr int LANE_BYTES = 16 * ELEM_BITS_ / 8;         // data bytes of a quantized lane
};
template <bool FNUZ = false> struct dsv4_v40_t : dsv4_format<DSV4_FMT_V40, 584, 576, 448, 8, 64, FNUZ> {};
template <bool FNUZ = false> struct dsv4_v41_t : dsv4_format<DSV4_FMT_V41, 528, 512, 512, 8, 32, FNUZ> {};
typedef dsv4_v40_t<false> dsv4_v40;
typedef dsv4_v40_t<true> dsv4_v40_fnuz;
typedef dsv4_v41_t<false> dsv4_v41;
typedef dsv4_v41_t<true> dsv4_v41_fnuz;
struct dsv4_v41_fp4 : dsv4_format<DSV4_FMT_V41_FP4, 288, 256, 512, 4, 16> {};

// KERNEL<F> for the e4m3 format (V40_584 or V41_528, OCP or FNUZ) that launch arguments `a` name (a->fmt,
// a->fnuz); with the V41_FP4_288 reader as well for DSV4_ANY_FORMAT_KERNEL. Every instance has the same
// function type, so the launcher picks one pointer and launches it.
#define DSV4_FP8_FORMAT_KERNEL(KERNEL, a)                                                               \
  ((a)->fmt == DSV4_FMT_V41 ? ((a)->fnuz ? KERNEL<dsv4_v41_fnuz> : KERNEL<dsv4_v41>)                   \
                            : ((a)->fnuz ? KERNEL<dsv4_v40_fnuz> : KERNEL<dsv4_v40>))
#define DSV4_ANY_FORMAT_KERNEL(KERNEL, a) \
  ((a)->fmt == DSV4_FMT_V41_FP4 ? KERNEL<dsv4_v41_fp4> : DSV4_FP8_FORMAT_KERNEL(KERNEL, a))

// Byte offsets inside a page of record `off`'s data and scale bytes.
template <class F>
__device__ __forceinline__ int64_t dsv4_data_off(int64_t off, int interleaved) {
  return off * (interleaved ? F::TOKEN_BYTES : F::DATA_BYTES);
}
template <class F>
__device__ __forceinline__ int64_t dsv4_scale_off(int64_t off, int bs, int interleaved) {
  return interleaved ? off * F::TOKEN_BYTES + F::DATA_BYTES : (int64_t)bs * F::DATA_BYTES + off * F::SCALE_BYTES;
}

__device__ __forceinline__ void dsv4_load_bf16x16(const uint16_t* p, float v[16]) {
  const uint4* p4 = reinterpret_cast<const uint4*>(p);
  uint4 a = p4[0], b = p4[1];
  uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[2 * i] = dsv4_bf16_to_float((uint16_t)(w[i] & 0xffff));
    v[2 * i + 1] = dsv4_bf16_to_float((uint16_t)(w[i] >> 16));
  }
}

__device__ __forceinline__ void dsv4_store_bf16x16(uint16_t* p, const float v[16]) {
  uint32_t w[8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
    w[i] = (uint32_t)dsv4_float_to_bf16(v[2 * i]) | ((uint32_t)dsv4_float_to_bf16(v[2 * i + 1]) << 16);
  uint4* p4 = reinterpret_cast<uint4*>(p);
  p4[0] = make_uint4(w[0], w[1], w[2], w[3]);
  p4[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

// Entry i of an index tensor stored as int32 or int64 (the engine's dtype, read without a conversion copy).
__device__ __forceinline__ int64_t dsv4_index(const void* p, int64_t i, int is64) {
  return is64 ? reinterpret_cast<const int64_t*>(p)[i] : (int64_t)reinterpret_cast<const int32_t*>(p)[i];
}

// Value j (0..63) of row `pos` of a cos/sin table [max_pos, 64] stored as fp32 or bf16 (cos | sin).
__device__ __forceinline__ float dsv4_cos_sin(const void* cs, int64_t pos, int j, int bf16) {
  return bf16 ? dsv4_bf16_to_float(reinterpret_cast<const uint16_t*>(cs)[pos * 64 + j])
              : reinterpret_cast<const float*>(cs)[pos * 64 + j];
}

// GPT-J rotation of this lane's 8 (even, odd) pairs when it holds RoPE dims (lanes 28..31), by the angles
// of table row `pos`: e' = e c - o s, o' = e s + o c, each product and sum rounded separately.
__device__ __forceinline__ void dsv4_rope_lane(float v[16], int lane, const void* cs, int64_t pos, int cs_bf16) {
  if (lane < DSV4_NOPE_LANES) return;
  int pair0 = (lane - DSV4_NOPE_LANES) * 8;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    float c = dsv4_cos_sin(cs, pos, pair0 + k, cs_bf16), s = dsv4_cos_sin(cs, pos, 32 + pair0 + k, cs_bf16);
    float e = v[2 * k], o = v[2 * k + 1];
    v[2 * k] = dsv4_sub(dsv4_mul(e, c), dsv4_mul(o, s));
    v[2 * k + 1] = dsv4_add(dsv4_mul(e, s), dsv4_mul(o, c));
  }
}

// The same rotation with vLLM's q rounding (reference.rope.rope_fwd_fma): e' = fma(e, c, -(o s)),
// o' = fma(e, s, o c), the other product rounded first. The q path of the fused insert rotates so.
__device__ __forceinline__ void dsv4_rope_lane_fma(float v[16], int lane, const void* cs, int64_t pos, int cs_bf16) {
  if (lane < DSV4_NOPE_LANES) return;
  int pair0 = (lane - DSV4_NOPE_LANES) * 8;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    float c = dsv4_cos_sin(cs, pos, pair0 + k, cs_bf16), s = dsv4_cos_sin(cs, pos, 32 + pair0 + k, cs_bf16);
    float e = v[2 * k], o = v[2 * k + 1];
    v[2 * k] = dsv4_fma(e, c, -dsv4_mul(o, s));
    v[2 * k + 1] = dsv4_fma(e, s, dsv4_mul(o, c));
  }
}

// Weightless RMSNorm of the group's 512 values (16 per lane), fp32: v * (1 / sqrt(sum(v^2) / 512 + eps)).
// All 32 lanes must call this.
__device__ __forceinline__ void dsv4_rmsnorm512(float v[16], float eps) {
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) ss = dsv4_add(ss, dsv4_mul(v[i], v[i]));
  ss = dsv4_group_sum(ss, DSV4_GROUP);
  float r = 1.0f / dsv4_sqrtf(dsv4_add(ss * (1.0f / 512.0f), eps));
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = dsv4_mul(v[i], r);
}

// This lane's 16 values: their largest magnitude and whether any is NaN or +-inf.
__device__ __forceinline__ void dsv4_amax16(const float v[16], float& amax, int& bad) {
  amax = 0.0f;
  bad = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    amax = dsv4_fmaxf(amax, dsv4_fabsf(v[i]));
    bad |= !dsv4_isfinite(v[i]);
  }
}

// This lane's 16 values times inv (a power of two: exact) as e4m3 bytes, four a word; a poisoned block
// (bad) is NaN throughout: 0x7F, or 0x80 in the FNUZ flavour.
template <bool FNUZ>
__device__ __forceinline__ void dsv4_fp8_words16(const float v[16], float inv, int bad, uint32_t w[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t word = 0;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      uint8_t q = bad ? (uint8_t)(FNUZ ? 0x80 : 0x7f) : dsv4_fp8_encode(dsv4_mul(v[4 * j + b], inv));
      word |= (uint32_t)q << (8 * b);
    }
    w[j] = word;
  }
}

// v: bf16-exact values of the whole group's vector (16 per lane). All 32 lanes must call this.
template <bool FNUZ>
__device__ __forceinline__ void dsv4_write_record_v40(const float v[16], int lane, uint8_t* page, int64_t off,
                                                      int bs, int interleaved) {
  float amax;
  int bad;
  dsv4_amax16(v, amax, bad);
  amax = dsv4_group_max(amax, 4);          // 4 lanes = one 64-value block
  bad = dsv4_group_or(bad, 4);
  uint8_t* data = page + dsv4_data_off<dsv4_v40>(off, interleaved);
  int e = dsv4_ceil_log2(dsv4_fmaxf(amax, DSV4_KV_EPS) / 448.0f);
  // the 8 scale bytes (7 UE8M0 + pad 0) leave in one 8-byte store from lane 0, not 8 byte stores
  int sbyte = lane < DSV4_NOPE_LANES ? (bad ? 0xff : e + 127 + FNUZ) : 0;
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    lo |= (uint32_t)(dsv4_group_shfl_int(sbyte, 4 * b) & 0xff) << (8 * b);
    hi |= (uint32_t)(dsv4_group_shfl_int(sbyte, 16 + 4 * b) & 0xff) << (8 * b);
  }
  if (lane < DSV4_NOPE_LANES) {
    uint32_t w[4];
    dsv4_fp8_words16<FNUZ>(v, dsv4_exp2i(-e), bad, w);
    *reinterpret_cast<uint4*>(data + lane * 16) = make_uint4(w[0], w[1], w[2], w[3]);
    if (lane == 0)
      *reinterpret_cast<uint2*>(page + dsv4_scale_off<dsv4_v40>(off, bs, interleaved)) = make_uint2(lo, hi & 0x00ffffffu);
  } else {
    dsv4_store_bf16x16(reinterpret_cast<uint16_t*>(data + 448 + (lane - DSV4_NOPE_LANES) * 32), v);
  }
}

// V41_528: every lane quantizes its 16 values against the UE8M0 scale of its 32-value block (lanes 2b, 2b+1);
// the even lane of a block writes its scale byte. A block holding NaN or +-inf: bytes 0x7F (0x80 FNUZ), scale 0xFF.
template <bool FNUZ>
__device__ __forceinline__ void dsv4_write_record_v41(const float v[16], int lane, uint8_t* page, int64_t off,
                                                      int bs, int interleaved) {
  float amax;
  int bad;
  dsv4_amax16(v, amax, bad);
  amax = dsv4_group_max(amax, 2);
  bad = dsv4_group_or(bad, 2);
  int e = dsv4_ceil_log2(dsv4_fmaxf(amax, DSV4_KV_EPS) / 448.0f);
  uint32_t w[4];
  dsv4_fp8_words16<FNUZ>(v, dsv4_exp2i(-e), bad, w);
  *reinterpret_cast<uint4*>(page + dsv4_data_off<dsv4_v41>(off, interleaved) + lane * 16) = make_uint4(w[0], w[1], w[2], w[3]);
  if ((lane & 1) == 0)
    page[dsv4_scale_off<dsv4_v41>(off, bs, interleaved) + (lane >> 1)] = (uint8_t)(bad ? 0xff : e + 127 + FNUZ);
}

// V41_FP4_288: each lane is one 16-value block: scale sc = e4m3(clamp(amax * fp32(1/6), 2^-9, 448)), codes
// e2m1(v / sc) (IEEE division), 8 data bytes (dim 2i in the low nibble), one scale byte. A block holding NaN
// or +-inf: scale 0x7F (e4m3 NaN), nibbles 0.
__device__ __forceinline__ void dsv4_write_record_fp4(const float v[16], int lane, uint8_t* page, int64_t off,
                                                      int bs, int interleaved) {
  float amax;
  int bad;
  dsv4_amax16(v, amax, bad);
  float sc_in = dsv4_fminf(dsv4_fmaxf(dsv4_mul(amax, 1.0f / 6.0f), 0.001953125f), 448.0f);
  uint8_t sb = bad ? (uint8_t)0x7f : dsv4_fp8_encode(sc_in);
  float sc = dsv4_fp8_decode(sb);
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    uint32_t c = bad ? 0u : dsv4_e2m1_encode(dsv4_div(v[i], sc));
    w[i / 8] |= c << (4 * (i % 8));
  }
  *reinterpret_cast<uint2*>(page + dsv4_data_off<dsv4_v41_fp4>(off, interleaved) + lane * 8) = make_uint2(w[0], w[1]);
  page[dsv4_scale_off<dsv4_v41_fp4>(off, bs, interleaved) + lane] = sb;
}

// The record of format F at (page, off). All 32 lanes must call this.
template <class F>
__device__ __forceinline__ void dsv4_write_record(const float v[16], int lane, uint8_t* page, int64_t off, int bs,
                                                  int interleaved) {
  if (F::CODE_ == DSV4_FMT_V40) dsv4_write_record_v40<F::FNUZ>(v, lane, page, off, bs, interleaved);
  else if (F::CODE_ == DSV4_FMT_V41) dsv4_write_record_v41<F::FNUZ>(v, lane, page, off, bs, interleaved);
  else dsv4_write_record_fp4(v, lane, page, off, bs, interleaved);
}

// ---- reading records back -------------------------------------------------------------------------
// This lane's part of the record of format F at (page, off): V40_584 lanes 0..27 load 16 fp8 bytes and their
// block's UE8M0 byte, lanes 28..31 16 bf16 RoPE values (32 bytes); V41_528 lanes 16 fp8 bytes and their block's
// UE8M0 byte; V41_FP4_288 lanes 8 bytes of e2m1 pairs and their e4m3 scale byte. `valid` false: zeros,
// nothing read.
template <class F>
__device__ __forceinline__ void dsv4_load_record_lane(const uint8_t* page, int64_t off, int bs, int interleaved,
                                                      int lane, bool valid, uint4 p[2], uint8_t& sb) {
  p[0] = p[1] = make_uint4(0, 0, 0, 0);
  sb = 0;
  if (!valid) return;
  const uint8_t* data = page + dsv4_data_off<F>(off, interleaved);
  const uint8_t* scales = page + dsv4_scale_off<F>(off, bs, interleaved);
  if (F::ELEM_BITS == 4) {
    uint2 d = *reinterpret_cast<const uint2*>(data + lane * 8);
    p[0] = make_uint4(d.x, d.y, 0, 0);
    sb = scales[lane];
  } else if (lane < F::QUANT_LANES) {
    p[0] = *reinterpret_cast<const uint4*>(data + lane * 16);
    sb = scales[lane / F::LANES_PER_BLOCK];
  } else {
    const uint4* src = reinterpret_cast<const uint4*>(data + F::QUANT_DIMS + (lane - F::QUANT_LANES) * 32);
    p[0] = src[0];
    p[1] = src[1];
  }
}

// Twice the value of an e4m3fnuz byte (integer path): the OCP value of the same byte, except 0x80 (fnuz
// NaN) and 0x7F / 0xFF (fnuz +-240, twice that 480 where OCP has NaN).
__device__ __forceinline__ float dsv4_fp8_decode_fnuz_x2(uint8_t b) {
  if (b == 0x80) return __uint_as_float(0x7fc00000u);
  uint32_t e = (b >> 3) & 0xf, m = b & 7;
  float mag = e == 0 ? (float)m * 0.001953125f : __uint_as_float(((e + 120u) << 23) | (m << 20));
  return (b & 0x80) ? -mag : mag;
}

// Store this lane's 16 bf16 values of a row loaded by dsv4_load_record_lane (dst = the row's first value):
// fp8 lanes dequantize (fp8 * 2^(sb - 127), exact in bf16; sb 0xFF gives NaN; FNUZ: fnuz(byte) * 2^(sb - 127),
// computed as 2 fnuz(byte) * 2^(sb - 128)), e2m1 lanes multiply each code's value by the e4m3 scale (exact;
// a NaN scale gives NaN), bf16 lanes copy verbatim; an invalid row is all zeros (its loads were zero).
template <class F>
__device__ __forceinline__ void dsv4_store_record_lane(uint16_t* dst, const uint4 p[2], uint8_t sb, int lane,
                                                       bool valid) {
  uint4* d4 = reinterpret_cast<uint4*>(dst + lane * 16);
  if (!valid || (F::ELEM_BITS == 8 && lane >= F::QUANT_LANES)) {
    d4[0] = p[0];
    d4[1] = p[1];
    return;
  }
  float v[16];
  if (F::ELEM_BITS == 4) {
    float scale = dsv4_fp8_decode(sb);
    uint32_t w[2] = {p[0].x, p[0].y};
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = dsv4_mul(dsv4_e2m1_decode(w[i / 8] >> (4 * (i % 8))), scale);
  } else {
    uint32_t w[4] = {p[0].x, p[0].y, p[0].z, p[0].w};
    // 2^(sb - 127 - FNUZ): the scales below 2^-126 are subnormal (sb 0, and sb 1 for FNUZ); sb 0xFF is UE8M0 NaN
    const int se = (int)sb - 127 - F::FNUZ;
    float scale = sb == 0xff ? __uint_as_float(0x7fc00000u) : se < -126 ? __uint_as_float(1u << (se + 149))
                                                                         : dsv4_exp2i(se);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      uint8_t b = (uint8_t)(w[i / 4] >> (8 * (i % 4)));
      v[i] = dsv4_mul(F::FNUZ ? dsv4_fp8_decode_fnuz_x2(b) : dsv4_fp8_decode(b), scale);
    }
  }
  dsv4_store_bf16x16(dst + lane * 16, v);
}

// ---- per-tensor fp8 (the full-cache form) -----------------------------------------------------------
// e4m3 byte of x * s (RNE, saturating at +-448); a non-finite x, or a NaN product, gives 0x7F (NaN).
__device__ __forceinline__ uint8_t dsv4_fp8_scaled(float x, float s) {
  float y = dsv4_mul(x, s);
  return (!dsv4_isfinite(x) || y != y) ? (uint8_t)0x7f : dsv4_fp8_encode(y);
}

__device__ __forceinline__ uint4 dsv4_fp8_scaled_x16(const float v[16], float s) {
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t word = 0;
#pragma unroll
    for (int b = 0; b < 4; ++b) word |= (uint32_t)dsv4_fp8_scaled(v[4 * j + b], s) << (8 * b);
    w[j] = word;
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}
