/*
 * Scalar numerics shared by the C reference and the CUDA kernels, so that both
 * produce bit-identical codes and scales. Header-only; every function is
 * static inline and compiles as host code (C11) or host+device code (nvcc).
 * Uses no libm calls whose rounding could differ between host and device,
 * except the GELU of linear outputs (see cq_gelu_tanh).
 */
#ifndef CQ_NUMERICS_H
#define CQ_NUMERICS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define CQ_HD __host__ __device__ __forceinline__
#else
#define CQ_HD static inline
#endif

CQ_HD uint32_t cq_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

CQ_HD float cq_f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

CQ_HD int cq_isfinite(float f) { return (cq_f32_bits(f) & 0x7f800000u) != 0x7f800000u; }

CQ_HD float cq_fabs(float f) { return cq_f32_from_bits(cq_f32_bits(f) & 0x7fffffffu); }

/* Round to nearest integer, ties to even (the default rounding mode, which
 * libcquant never changes): rintf is exact on host and device. */
CQ_HD float cq_rint(float v) { return rintf(v); }

/* 2^e as fp32 for -126 <= e <= 127. */
CQ_HD float cq_exp2i(int e) { return cq_f32_from_bits((uint32_t)(e + 127) << 23); }

/* ---- 16-bit floats (storage types of activations) ---- */

CQ_HD float cq_bf16_to_f32(uint16_t h) { return cq_f32_from_bits((uint32_t)h << 16); }

CQ_HD uint16_t cq_f32_to_bf16(float f) {
  uint32_t u = cq_f32_bits(f);
  /* NaN: one canonical quiet NaN, since NaN sign and payload after arithmetic
   * differ between CPU and GPU */
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
  return (uint16_t)(u >> 16);
}

/* A finite fp32 value rounded to nearest-even to 8 significant bits (the nearest bfloat16
 * value), kept as fp32. Only for finite values whose rounding cannot overflow (below 2^128 minus
 * half a bf16 ulp): the 4-bit quantizer's scales, far below that. */
CQ_HD float cq_round_f32_to_bf16_value(float f) {
  uint32_t u = cq_f32_bits(f);
  u += 0x7fffu + ((u >> 16) & 1u);
  return cq_f32_from_bits(u & 0xffff0000u);
}

CQ_HD float cq_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return cq_f32_from_bits(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    /* zero or subnormal: man * 2^-24, exact in fp32 */
    float v = (float)man * cq_exp2i(-24);
    return sign ? -v : v;
  }
  return cq_f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

CQ_HD uint16_t cq_f32_to_f16(float f) {
  uint32_t u = cq_f32_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7e00u; /* NaN: canonical, as for bf16 */
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf */
  if (a < 0x38800000u) {
    /* below 2^-14: subnormal half, in units of 2^-24 (exact scaling, then RNE) */
    float units = cq_rint(cq_f32_from_bits(a) * cq_exp2i(24));
    return (uint16_t)(sign | (uint16_t)units);
  }
  /* normal: drop 13 mantissa bits with round to nearest even */
  a += 0xfffu + ((a >> 13) & 1u);
  return (uint16_t)(sign | (uint16_t)((a - 0x38000000u) >> 13));
}

/* ---- quantization codes ---- */

/* Symmetric int8 code of v (already multiplied by 1/scale): RNE, saturate at
 * +-127; NaN gives 0 (groups holding NaN are handled by the caller). */
CQ_HD int32_t cq_int8_encode(float v) {
  if (!(v == v)) return 0;
  if (v >= 127.0f) return 127;
  if (v <= -127.0f) return -127;
  return (int32_t)cq_rint(v);
}

/* Code of v in a float format with `ebits`, `mbits`, `bias`: round to nearest
 * even, saturate at max_value (whose code is max_code); NaN gives 0 (groups
 * holding NaN or Inf are handled by the caller). Returns sign | magnitude code.
 *
 * With e the exponent of |v| clamped below at the smallest normal exponent
 * emin = 1 - bias, |v| / 2^(e - mbits) is exact and rounds to an integer r in
 * [0, 2^(mbits+1)]; the code is then ((e - emin) << mbits) + r, which carries
 * correctly into the exponent field for subnormals and at mantissa overflow. */
CQ_HD uint32_t cq_float_encode(float v, int ebits, int mbits, int bias, float max_value,
                               uint32_t max_code) {
  uint32_t u = cq_f32_bits(v);
  uint32_t sign = (u >> 31) << (ebits + mbits);
  float a = cq_fabs(v);
  if (a != a) return 0;
  if (!(a < max_value)) return sign | max_code;
  int emin = 1 - bias;
  int e = (int)((cq_f32_bits(a) >> 23) & 0xffu) - 127; /* fp32 subnormals give -127 */
  if (e < emin) e = emin;
  float t = a * cq_exp2i(mbits - e);
  float r = cq_rint(t);
  uint32_t code = ((uint32_t)(e - emin) << mbits) + (uint32_t)r;
  /* rint sends a tie to the even r, which is the even code unless mbits == 0:
   * there the code's last bit is the exponent's, so step to the even neighbour */
  if (mbits == 0 && (code & 1u) && cq_fabs(t - r) == 0.5f) code = r > t ? code - 1u : code + 1u;
  return sign | code;
}

/* Value of a float-format code; specials: 0 none, 1 NaN-only (e4m3fn), 2 IEEE. */
CQ_HD float cq_float_decode(uint32_t code, int ebits, int mbits, int bias, int specials) {
  uint32_t emask = (1u << ebits) - 1u, mmask = (1u << mbits) - 1u;
  uint32_t sign = (code >> (ebits + mbits)) & 1u;
  uint32_t exp = (code >> mbits) & emask;
  uint32_t man = code & mmask;
  float v;
  if (specials == 1 && exp == emask && man == mmask) {
    v = cq_f32_from_bits(0x7fc00000u);
  } else if (specials == 2 && exp == emask) {
    v = cq_f32_from_bits(man ? 0x7fc00000u : 0x7f800000u);
  } else if (exp == 0) {
    v = (float)man * cq_exp2i(1 - bias - mbits);
  } else {
    v = (float)((1u << mbits) + man) * cq_exp2i((int)exp - bias - mbits);
  }
  return sign ? -v : v;
}

/* scale and 1/scale of a group from its amax (see cquant.h). A non-finite
 * amax gives scale = NaN and inv = 0, so every code of the group is 0. */
CQ_HD void cq_scale_from_amax(float amax, float max_value, float *scale, float *inv) {
  if (!cq_isfinite(amax) || !(amax == amax)) {
    *scale = cq_f32_from_bits(0x7fc00000u);
    *inv = 0.0f;
    return;
  }
  float a = amax > 0x1p-90f ? amax : 0x1p-90f; /* CQ_AMAX_FLOOR */
  *scale = a / max_value;
  *inv = max_value / a;
}

/* max(a, |v|) that propagates NaN (a NaN anywhere makes the group NaN). */
CQ_HD float cq_amax_step(float a, float v) {
  float b = cq_fabs(v);
  if (!(b == b) || !(a == a)) return cq_f32_from_bits(0x7fc00000u);
  return b > a ? b : a;
}

/* ---- 4-bit formats per group (cquant.h "4-bit integer formats") ---- */

/* Value of an int4 nibble (two's complement: 0x8 reads -8, which the quantizer never writes). */
CQ_HD float cq_int4_decode(uint32_t code) { return (float)((int32_t)((code & 0xfu) ^ 0x8u) - 8); }

/* scale and 1/scale of an int4 group from its amax (cquant.h "4-bit integer formats"): scale =
 * RN_bf16(a / 7), inv = 1 / scale. The scale has at most 8 significant bits, so (code - zp) *
 * scale (a 4- or 5-bit integer times it) is exact in fp32 and equals the bf16 product rounded
 * once (fp16 too, when the scale is in fp16's normal range): kernels may decode weights with
 * packed 16-bit instructions and still compute exactly the documented math. A non-finite amax
 * gives scale = NaN and inv = 0, so every code of the group is 0. */
CQ_HD void cq_int4_scale_from_amax(float amax, float *scale, float *inv) {
  if (!cq_isfinite(amax) || !(amax == amax)) {
    *scale = cq_f32_from_bits(0x7fc00000u);
    *inv = 0.0f;
    return;
  }
  float a = amax > 0x1p-90f ? amax : 0x1p-90f; /* CQ_AMAX_FLOOR: the scale stays normal */
  *scale = cq_round_f32_to_bf16_value(a / 7.0f);
  *inv = 1.0f / *scale;
}

/* int4 code of v (already multiplied by the group's inv = 1 / scale): RNE, saturated at +-7, NaN 0; as a nibble. */
CQ_HD uint32_t cq_int4_encode(float v) {
  int32_t c = cq_int8_encode(v);
  c = c > 7 ? 7 : c < -7 ? -7 : c;
  return (uint32_t)c & 0xfu;
}

/* Running lo = min(0, min x), hi = max(0, max x) of a uint4 group, started at 0, 0; a NaN makes
 * both NaN (and keeps them so). */
CQ_HD void cq_range_step(float *lo, float *hi, float v) {
  if (!(v == v) || !(*lo == *lo)) {
    *lo = *hi = cq_f32_from_bits(0x7fc00000u);
    return;
  }
  if (v < *lo) *lo = v;
  if (v > *hi) *hi = v;
}

/* scale, 1/scale and zero point of a uint4 group from its lo and hi: scale = RN_bf16(r / 15)
 * (8 significant bits, as cq_int4_scale_from_amax says why), inv = 1 / scale, zp = RNE(-lo *
 * inv) in [0, 15]. A group holding NaN or +-Inf, or whose hi - lo overflows fp32, gets scale NaN,
 * inv 0 and zp 0: all-zero codes. */
CQ_HD void cq_uint4_params(float lo, float hi, float *scale, float *inv, float *zp) {
  float r = hi - lo;
  if (!cq_isfinite(r) || !(r == r)) {
    *scale = cq_f32_from_bits(0x7fc00000u);
    *inv = 0.0f;
    *zp = 0.0f;
    return;
  }
  r = r > 0x1p-90f ? r : 0x1p-90f; /* CQ_AMAX_FLOOR */
  *scale = cq_round_f32_to_bf16_value(r / 15.0f);
  *inv = 1.0f / *scale;
  float z = cq_rint(-lo * *inv);
  *zp = z <= 0.0f ? 0.0f : z > 15.0f ? 15.0f : z; /* +0 for -lo = 0 */
}

/* uint4 code of x with its group's inv and zp: min(max(RNE(x * inv) + zp, 0), 15). */
CQ_HD uint32_t cq_uint4_encode(float x, float inv, float zp) {
  float v = cq_rint(x * inv) + zp; /* |x * inv| < 16 (at most about 15 / (1 - 2^-8)): the sum is exact */
  if (!(v == v) || v <= 0.0f) return 0u;
  return v >= 15.0f ? 15u : (uint32_t)v;
}

/* Dequantized value of a uint4 code: (code - zp) * scale, in fp32. */
CQ_HD float cq_uint4_decode(uint32_t code, float scale, float zp) { return ((float)(code & 0xfu) - zp) * scale; }

/* ---- two-level int4 (cquant.h "Two-level int4") ---- */

/* Row scale s1 = max(amax, CQ_AMAX_FLOOR) / 112 (112 = 7 * 16: |s2 * code| stays an int8);
 * NaN when amax is not finite (the row then stores s2 = 1 and all-zero codes). */
CQ_HD float cq_two_level_s1(float amax) {
  if (!cq_isfinite(amax) || !(amax == amax)) return cq_f32_from_bits(0x7fc00000u);
  float a = amax > 0x1p-90f ? amax : 0x1p-90f; /* CQ_AMAX_FLOOR */
  return a / 112.0f;
}

/* A group's multiplier from its amax ag and the row's finite s1: ceil(ag / (7 s1)) in [1, 16].
 * ceilf is exact on host and device. */
CQ_HD float cq_two_level_s2(float ag, float s1) {
  const float t = ceilf(ag / (7.0f * s1));
  return t > 16.0f ? 16.0f : t > 1.0f ? t : 1.0f;
}

/* Whether a stored s2 is one the layout holds: an integer in [0, 16] (NaN and +-Inf fail). */
CQ_HD int cq_two_level_s2_ok(float s2) { return s2 >= 0.0f && s2 <= 16.0f && (float)(int32_t)s2 == s2; }

/* q8 = s2 * code of a nibble, for a valid s2: an integer in [-128, 112]. */
CQ_HD int32_t cq_two_level_q8(uint32_t code, float s2) { return (int32_t)s2 * (int32_t)cq_int4_decode(code); }

/* x' = (float)(s2 * code) * s1; NaN for an s2 that is not an integer in [0, 16]. */
CQ_HD float cq_two_level_decode(uint32_t code, float s1, float s2) {
  if (!cq_two_level_s2_ok(s2)) return cq_f32_from_bits(0x7fc00000u);
  return (float)cq_two_level_q8(code, s2) * s1;
}

/* The 8-bit attention's logit-error estimate E of a head (cquant.h) from the maxima its pre-pass
 * keeps: a = max sq, bq = max sq |Qcode|_2, c = max sk, bk = max sk |Kcode|_2, d the head dim.
 * The same fp32 operations in the same order on host and device (the one sum of products is an
 * explicit fmaf, so no compiler contracts another; the divisions and sqrtf are IEEE), so the
 * reference and the kernels decide every head alike. NaN inputs give NaN. */
CQ_HD float cq_attn8_logit_error(float a, float bq, float c, float bk, int d) {
  const float x = c * bq, y = a * bk, z = a * c;
  const float zz = z * z;
  const float sum = fmaf(x, x, y * y);
  return sqrtf(sum / 12.0f + ((float)d * zz) / 144.0f);
}

/* Row norm of int8 codes times its block's scale: sq |Qcode_i|_2 (cq_attn8_logit_error's bq, bk). */
CQ_HD float cq_attn8_row_norm(float scale, int64_t sum_sq) { return scale * sqrtf((float)sum_sq); }

/* torch's gelu(approximate="tanh") in fp32. The one libm call here: tanhf may
 * differ by an ulp between host and device, which only GEMM outputs (compared
 * within tolerances, never bit for bit) see. */
CQ_HD float cq_gelu_tanh(float v) {
  const float sqrt_2_over_pi = 0.7978845608028654f, c = 0.044715f;
  return 0.5f * v * (1.0f + tanhf(sqrt_2_over_pi * (v + c * v * v * v)));
}

/* The output activation of a linear layer (a cq_activation; 1 = GELU tanh). */
CQ_HD float cq_activate(float v, int activation) { return activation == 1 ? cq_gelu_tanh(v) : v; }

#endif /* CQ_NUMERICS_H */
