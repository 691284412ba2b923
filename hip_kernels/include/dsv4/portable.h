// Portable device helpers for the dsv4_rocm HIP kernels (docs/platforms.md#fp8).
//
// Written in HIP; build_tools/hip2cuda.py translates the kernels for nvcc, and this header itself is
// valid for hipcc/clang (AMD) and nvcc (NVIDIA). Kernels never use the literal 64 or warpSize for the
// wave, never use hip_bf16.h / hip_fp8.h structs: bf16 is raw uint16_t, fp8 is raw uint8_t holding OCP
// e4m3fn bytes (-0 flushed to 0x00) on every vendor.
#pragma once
#include <stdint.h>

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#include <cuda_fp8.h>
#define DSV4_NVIDIA 1
#define DSV4_WAVE 32
typedef unsigned int dsv4_lanemask_t;
#else
#include <hip/hip_runtime.h>
#define DSV4_AMD 1
#define DSV4_WAVE 64
typedef unsigned long long dsv4_lanemask_t;
#endif

// libm names: the compiler builtins on AMD (no HIP math header needed), CUDA's device functions on NVIDIA.
#if defined(DSV4_AMD)
#define dsv4_fmaxf __builtin_fmaxf
#define dsv4_fminf __builtin_fminf
#define dsv4_fabsf __builtin_fabsf
#define dsv4_rintf __builtin_rintf
#define dsv4_sqrtf __builtin_sqrtf
#define dsv4_isfinite __builtin_isfinite
#else
#define dsv4_fmaxf fmaxf
#define dsv4_fminf fminf
#define dsv4_fabsf fabsf
#define dsv4_rintf rintf
#define dsv4_sqrtf sqrtf
#define dsv4_isfinite isfinite
#endif

// One-argument launch bounds: the second argument means different things on the two vendors.
#define DSV4_LAUNCH_BOUNDS(threads) __launch_bounds__(threads)

// Kernels work in groups of 32 lanes ("a row group"): a whole warp on NVIDIA, half a wave on AMD.
// Xor-shuffles with offsets < 32 stay inside the group on both.
#define DSV4_GROUP 32

__device__ __forceinline__ float dsv4_shfl_xor(float v, int lane_mask) {
#if defined(DSV4_NVIDIA)
  return __shfl_xor_sync(0xffffffffu, v, lane_mask, DSV4_WAVE);
#else
  return __shfl_xor(v, lane_mask, DSV4_WAVE);
#endif
}

__device__ __forceinline__ int dsv4_shfl_xor_int(int v, int lane_mask) {
#if defined(DSV4_NVIDIA)
  return __shfl_xor_sync(0xffffffffu, v, lane_mask, DSV4_WAVE);
#else
  return __shfl_xor(v, lane_mask, DSV4_WAVE);
#endif
}

// Value of lane `src` of this lane's 32-lane group.
__device__ __forceinline__ int dsv4_group_shfl_int(int v, int src) {
#if defined(DSV4_NVIDIA)
  return __shfl_sync(0xffffffffu, v, src, DSV4_GROUP);
#else
  return __shfl(v, src, DSV4_GROUP);
#endif
}

// Reductions over `width` consecutive lanes (width a power of two <= 32, aligned).
__device__ __forceinline__ float dsv4_group_sum(float v, int width) {
  for (int m = width >> 1; m > 0; m >>= 1) v += dsv4_shfl_xor(v, m);
  return v;
}
__device__ __forceinline__ float dsv4_group_max(float v, int width) {
  for (int m = width >> 1; m > 0; m >>= 1) v = dsv4_fmaxf(v, dsv4_shfl_xor(v, m));
  return v;
}
__device__ __forceinline__ int dsv4_group_or(int v, int width) {
  for (int m = width >> 1; m > 0; m >>= 1) v |= dsv4_shfl_xor_int(v, m);
  return v;
}

// ---- IEEE arithmetic without contraction --------------------------------------------------------
// The reference computes a*b - c*d as three rounded operations; a fused multiply-add would round
// differently and change cache bytes. NVIDIA: the _rn intrinsics are never contracted. AMD: the build
// passes -ffp-contract=off and the pragma below keeps it off for anything including this header.
#if defined(DSV4_AMD)
#pragma clang fp contract(off)
#endif
__device__ __forceinline__ float dsv4_mul(float a, float b) {
#if defined(DSV4_NVIDIA)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
__device__ __forceinline__ float dsv4_add(float a, float b) {
#if defined(DSV4_NVIDIA)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
__device__ __forceinline__ float dsv4_sub(float a, float b) {
#if defined(DSV4_NVIDIA)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
// a * b + c rounded once (an explicit fused multiply-add, never split by the contraction setting)
__device__ __forceinline__ float dsv4_fma(float a, float b, float c) {
#if defined(DSV4_NVIDIA)
  return __fmaf_rn(a, b, c);
#else
  return __builtin_fmaf(a, b, c);
#endif
}
// IEEE division (the AMD build passes -fhip-fp32-correctly-rounded-divide-sqrt)
__device__ __forceinline__ float dsv4_div(float a, float b) {
#if defined(DSV4_NVIDIA)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// ---- bf16 as raw bits ---------------------------------------------------------------------------
__device__ __forceinline__ float dsv4_bf16_to_float(uint16_t h) {
  return __uint_as_float(((uint32_t)h) << 16);
}
__device__ __forceinline__ uint16_t dsv4_float_to_bf16(float f) {  // round to nearest even
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;              // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

// ---- fp8 e4m3fn (OCP) bytes -----------------------------------------------------------------------
// Software encoder (targets without a hardware convert): |v| <= 448, RNE, sign kept, 0 for +-0.
__device__ __forceinline__ uint8_t dsv4_fp8_encode_soft(float v) {
  float a = dsv4_fabsf(v);
  uint32_t bits;
  if (a < 0.015625f) {                                   // below 2^-6: subnormal step 2^-9
    bits = (uint32_t)dsv4_rintf(a * 512.0f);                  // 8 rounds up into the first normal (0x08)
  } else {
    int e = (int)((__float_as_uint(a) >> 23) & 0xff) - 127;
    uint32_t q = (uint32_t)dsv4_rintf(a * __uint_as_float((uint32_t)(127 + 3 - e) << 23));  // 8..16
    bits = ((uint32_t)(e + 7) << 3) + (q - 8);           // q == 16 carries into the exponent
  }
  if (bits == 0) return 0;
  return (uint8_t)(bits | ((__float_as_uint(v) >> 24) & 0x80));
}

// Encode: RNE, saturating at +-448, never 0x80 (-0 is written 0x00). gfx942 has only the fnuz convert:
// the fnuz byte of x/2 equals the OCP byte of x for every value the cache holds (docs/cache_format.md#fp8-bytes).
__device__ __forceinline__ uint8_t dsv4_fp8_encode(float v) {
  v = dsv4_fminf(dsv4_fmaxf(v, -448.0f), 448.0f);
  uint8_t b;
#if defined(DSV4_NVIDIA)
  b = (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
#elif defined(__gfx942__)
  b = (uint8_t)(__builtin_amdgcn_cvt_pk_fp8_f32(v * 0.5f, 0.0f, 0, false) & 0xff);
#elif defined(__gfx950__)
  b = (uint8_t)(__builtin_amdgcn_cvt_pk_fp8_f32(v, 0.0f, 0, false) & 0xff);
#else
  b = dsv4_fp8_encode_soft(v);
#endif
  return b == 0x80 ? 0 : b;
}

// Exact decode of an OCP e4m3fn byte (integer path: the same on every target).
__device__ __forceinline__ float dsv4_fp8_decode(uint8_t b) {
  uint32_t e = (b >> 3) & 0xf, m = b & 7;
  float mag;
  if ((b & 0x7f) == 0x7f) return __uint_as_float(0x7fc00000u);     // NaN
  if (e == 0) mag = (float)m * 0.001953125f;                       // m * 2^-9
  else mag = __uint_as_float(((e + 120u) << 23) | (m << 20));      // (1 + m/8) * 2^(e-7)
  return (b & 0x80) ? -mag : mag;
}

// ---- e2m1 (fp4) nibbles ----------------------------------------------------------------------------
// Nearest e2m1 code of x (magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6): the count of midpoints below |x|, a tie
// going to the even code (> or >= by the parity of the code above the midpoint); saturating at 6; sign
// in bit 3 (-0 keeps it). NaN gives 0 (a poisoned block's nibbles are written 0 by the caller anyway).
__device__ __forceinline__ uint32_t dsv4_e2m1_encode(float x) {
  float a = dsv4_fabsf(x);
  uint32_t c = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return c | ((__float_as_uint(x) >> 28) & 8u);
}
// Value of an e2m1 code (the low 4 bits of c): the magnitude's bits built from the code (exponent from its
// two high bits, mantissa from the low one), exact.
__device__ __forceinline__ float dsv4_e2m1_decode(uint32_t c) {
  uint32_t m = c & 7u;
  uint32_t bits = m >= 2 ? (((m >> 1) + 126u) << 23) | ((m & 1u) << 22) : (m == 1 ? (126u << 23) : 0u);
  return __uint_as_float(bits | ((c & 8u) << 28));
}

// ---- UE8M0 scales -----------------------------------------------------------------------------------
// e = ceil(log2(x)) of a positive normal float, exactly, from its bits (no log2f: vendors differ).
__device__ __forceinline__ int dsv4_ceil_log2(float x) {
  uint32_t u = __float_as_uint(x);
  int e = (int)((u >> 23) & 0xff) - 127;
  return (u & 0x7fffff) ? e + 1 : e;
}
// 2^e as a float for -126 <= e <= 127.
__device__ __forceinline__ float dsv4_exp2i(int e) { return __uint_as_float((uint32_t)(e + 127) << 23); }
