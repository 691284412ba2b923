// The fp8_ds_mla record writer shared by the cache-writing kernels (docs/cache_format.md#record).
//
// A 512-d vector is held by a group of 32 lanes, 16 consecutive values per lane: lanes 0..27 hold the
// 448 NoPE dims (4 lanes = one 64-value quant block), lanes 28..31 the 64 RoPE dims. The record goes to
// page + off*576 (448 e4m3 bytes, then 64 bf16) and page + bs*576 + off*8 (7 UE8M0 bytes, 1 pad byte 0).
//
// FNUZ (template parameter of the writer and the reader, false by default): the FNUZ flavour of the record,
// vLLM's gfx942 sliding-window cache (docs/cache_format.md#fnuz-flavour). Its e4m3fnuz bytes are the OCP
// bytes of the same block and each scale byte is one higher, so the writer and the reader differ from the
// OCP ones only in the scale byte, a poisoned block's fill byte (0x80, fnuz NaN) and the bytes fnuz reads
// differently (0x80 NaN; 0x7F / 0xFF +-240, which an FNUZ writer never emits).
#pragma once
#include "dsv4/portable.h"

#define DSV4_NOPE_LANES 28
#define DSV4_KV_EPS 1e-4f

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

// v: bf16-exact values of the whole group's vector (16 per lane). All 32 lanes must call this.
template <bool FNUZ = false>
__device__ __forceinline__ void dsv4_write_record(const float v[16], int lane, uint8_t* page, int64_t off,
                                                  int bs) {
  float amax = 0.0f;
  int bad = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    amax = dsv4_fmaxf(amax, dsv4_fabsf(v[i]));
    bad |= !dsv4_isfinite(v[i]);
  }
  amax = dsv4_group_max(amax, 4);          // 4 lanes = one 64-value block
  bad = dsv4_group_or(bad, 4);
  uint8_t* data = page + off * 576;
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
    float inv = dsv4_exp2i(-e);
    uint32_t w[4];
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
    *reinterpret_cast<uint4*>(data + lane * 16) = make_uint4(w[0], w[1], w[2], w[3]);
    if (lane == 0) *reinterpret_cast<uint2*>(page + (int64_t)bs * 576 + off * 8) = make_uint2(lo, hi & 0x00ffffffu);
  } else {
    dsv4_store_bf16x16(reinterpret_cast<uint16_t*>(data + 448 + (lane - DSV4_NOPE_LANES) * 32), v);
  }
}

// ---- reading records back -------------------------------------------------------------------------
// This lane's part of the record at (page, off): lanes 0..27 load 16 fp8 NoPE bytes and their block's
// UE8M0 byte, lanes 28..31 load 16 bf16 RoPE values (32 bytes). `valid` false: zeros, nothing read.
__device__ __forceinline__ void dsv4_load_record_lane(const uint8_t* page, int64_t off, int bs, int lane, bool valid,
                                                      uint4 p[2], uint8_t& sb) {
  p[0] = p[1] = make_uint4(0, 0, 0, 0);
  sb = 0;
  if (!valid) return;
  if (lane < DSV4_NOPE_LANES) {
    p[0] = *reinterpret_cast<const uint4*>(page + off * 576 + lane * 16);
    sb = page[(int64_t)bs * 576 + off * 8 + (lane >> 2)];
  } else {
    const uint4* src = reinterpret_cast<const uint4*>(page + off * 576 + 448 + (lane - DSV4_NOPE_LANES) * 32);
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
// NoPE lanes dequantize (fp8 * 2^(sb - 127), exact in bf16; sb 0xFF gives NaN), RoPE lanes copy their bf16
// verbatim; an invalid row is all zeros (its loads were zero). FNUZ: fnuz(byte) * 2^(sb - 127), computed
// as 2 fnuz(byte) * 2^(sb - 128).
template <bool FNUZ = false>
__device__ __forceinline__ void dsv4_store_record_lane(uint16_t* dst, const uint4 p[2], uint8_t sb, int lane,
                                                       bool valid) {
  uint4* d4 = reinterpret_cast<uint4*>(dst + lane * 16);
  if (!valid || lane >= DSV4_NOPE_LANES) {
    d4[0] = p[0];
    d4[1] = p[1];
    return;
  }
  uint32_t w[4] = {p[0].x, p[0].y, p[0].z, p[0].w};
  // 2^(sb - 127 - FNUZ): the scales below 2^-126 are subnormal (sb 0, and sb 1 for FNUZ); sb 0xFF is UE8M0 NaN
  const int se = (int)sb - 127 - FNUZ;
  float scale = sb == 0xff ? __uint_as_float(0x7fc00000u) : se < -126 ? __uint_as_float(1u << (se + 149))
                                                                       : dsv4_exp2i(se);
  float v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    uint8_t b = (uint8_t)(w[i / 4] >> (8 * (i % 4)));
    v[i] = dsv4_mul(FNUZ ? dsv4_fp8_decode_fnuz_x2(b) : dsv4_fp8_decode(b), scale);
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
