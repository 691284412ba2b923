// The fp8_ds_mla record writer shared by the cache-writing kernels (DSV4_SPEC §4, layout.py).
//
// A 512-d vector is held by a group of 32 lanes, 16 consecutive values per lane: lanes 0..27 hold the
// 448 NoPE dims (4 lanes = one 64-value quant block), lanes 28..31 the 64 RoPE dims. The record goes to
// page + off*576 (448 e4m3 bytes, then 64 bf16) and page + bs*576 + off*8 (7 UE8M0 bytes, 1 pad byte 0).
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

// GPT-J rotation of this lane's 8 (even, odd) pairs when it holds RoPE dims (lanes 28..31);
// inverse = false: e' = e c - o s, o' = e s + o c. Each product and sum rounded separately.
__device__ __forceinline__ void dsv4_rope_lane(float v[16], int lane, const float* cs_row) {
  if (lane < DSV4_NOPE_LANES) return;
  int pair0 = (lane - DSV4_NOPE_LANES) * 8;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    float c = cs_row[pair0 + k], s = cs_row[32 + pair0 + k];
    float e = v[2 * k], o = v[2 * k + 1];
    v[2 * k] = dsv4_sub(dsv4_mul(e, c), dsv4_mul(o, s));
    v[2 * k + 1] = dsv4_add(dsv4_mul(e, s), dsv4_mul(o, c));
  }
}

// v: bf16-exact values of the whole group's vector (16 per lane). All 32 lanes must call this.
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
  int sbyte = lane < DSV4_NOPE_LANES ? (bad ? 0xff : e + 127) : 0;
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
        uint8_t q = bad ? (uint8_t)0x7f : dsv4_fp8_encode(dsv4_mul(v[4 * j + b], inv));
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
