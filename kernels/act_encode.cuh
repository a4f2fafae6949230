/* Device pieces of dynamic activation quantization, shared by every kernel that writes
 * activation codes (act_quant.cu, and the fused norm + modulation of norm_modulate.cu): the
 * code of one value and of a 16-byte vector of values, and that vector's elements as fp32 (and
 * back, rounded to the element type).
 * Codes are bit-identical to the C reference (cq_numerics.h); see act_quant.cu. */
#ifndef CQ_KERNELS_ACT_ENCODE_CUH
#define CQ_KERNELS_ACT_ENCODE_CUH

#include <cuda_fp8.h>

#include "common.cuh"

namespace cq_act {

/* Code of v = x * inv for the three dynamic activation formats. */
template <int FMT>
__device__ __forceinline__ uint32_t encode1(float v) {
  if (FMT == CQ_FORMAT_INT8) return (uint32_t)(uint8_t)(int8_t)cq_int8_encode(v);
  if (FMT == CQ_FORMAT_FP8_E4M3) return cq_float_encode(v, 4, 3, 7, 448.0f, 0x7eu);
  return cq_float_encode(v, 5, 2, 15, 57344.0f, 0x7bu);
}

/* Two codes in the low 16 bits (first value in the low byte). The hardware
 * conversion (sm_89+) rounds to nearest even and saturates to the largest
 * finite value, which for finite inputs is exactly cq_float_encode. */
template <int FMT>
__device__ __forceinline__ uint32_t encode2(float v0, float v1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (FMT == CQ_FORMAT_FP8_E4M3)
    return (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(v0, v1), __NV_SATFINITE, __NV_E4M3);
  if (FMT == CQ_FORMAT_FP8_E5M2)
    return (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(v0, v1), __NV_SATFINITE, __NV_E5M2);
#endif
  return encode1<FMT>(v0) | (encode1<FMT>(v1) << 8);
}

/* A 16-byte vector (uint4) of kElems elements of T. */
template <typename T> struct vec_traits;
template <> struct vec_traits<float> {
  static constexpr int kElems = 4;
  /* max |x| bits of the 4 floats */
  __device__ static uint32_t absmax(uint4 v, uint32_t m) {
    m = max(m, v.x & 0x7fffffffu), m = max(m, v.y & 0x7fffffffu);
    m = max(m, v.z & 0x7fffffffu), m = max(m, v.w & 0x7fffffffu);
    return m;
  }
  __device__ static float amax_value(uint32_t m) { return __uint_as_float(m); }
  __device__ static void to_float(uint4 v, float *f) {
    f[0] = __uint_as_float(v.x), f[1] = __uint_as_float(v.y), f[2] = __uint_as_float(v.z), f[3] = __uint_as_float(v.w);
  }
  /* the inverse: kElems fp32 values rounded (to nearest even) into one vector */
  __device__ static uint4 from_float(const float *f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
  }
};
/* 16-bit floats: two |x| maxima at once in the halves of a word. */
__device__ __forceinline__ uint32_t absmax16x8(uint4 v, uint32_t m) {
  m = __vmaxu2(m, v.x & 0x7fff7fffu), m = __vmaxu2(m, v.y & 0x7fff7fffu);
  m = __vmaxu2(m, v.z & 0x7fff7fffu), m = __vmaxu2(m, v.w & 0x7fff7fffu);
  return m;
}
template <> struct vec_traits<__nv_bfloat16> {
  static constexpr int kElems = 8;
  __device__ static uint32_t absmax(uint4 v, uint32_t m) { return absmax16x8(v, m); }
  __device__ static float amax_value(uint32_t m) { return cq_bf16_to_f32((uint16_t)max(m & 0xffffu, m >> 16)); }
  __device__ static void to_float(uint4 v, float *f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) f[2 * i] = __uint_as_float(w[i] << 16), f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
  __device__ static uint4 from_float(const float *f) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]); /* .x, the first, in the low half */
      w[i] = *reinterpret_cast<const uint32_t *>(&h);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};
template <> struct vec_traits<__half> {
  static constexpr int kElems = 8;
  __device__ static uint32_t absmax(uint4 v, uint32_t m) { return absmax16x8(v, m); }
  __device__ static float amax_value(uint32_t m) { return cq_f16_to_f32((uint16_t)max(m & 0xffffu, m >> 16)); }
  __device__ static void to_float(uint4 v, float *f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 p = __half22float2(*reinterpret_cast<const __half2 *>(&w[i]));
      f[2 * i] = p.x, f[2 * i + 1] = p.y;
    }
  }
  __device__ static uint4 from_float(const float *f) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __half2 h = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t *>(&h);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

/* Encode one vector of kElems values; store kElems code bytes. */
template <typename T, int FMT>
__device__ __forceinline__ void encode_store(uint4 v, float inv, uint8_t *dst) {
  constexpr int E = vec_traits<T>::kElems;
  float f[E];
  vec_traits<T>::to_float(v, f);
  uint32_t w[E / 4];
#pragma unroll
  for (int i = 0; i < E / 4; ++i) {
    uint32_t lo = encode2<FMT>(f[4 * i] * inv, f[4 * i + 1] * inv);
    uint32_t hi = encode2<FMT>(f[4 * i + 2] * inv, f[4 * i + 3] * inv);
    w[i] = lo | (hi << 16);
  }
  if (inv == 0.0f) { /* group held NaN or Inf: every code 0 */
#pragma unroll
    for (int i = 0; i < E / 4; ++i) w[i] = 0;
  }
  if (E == 8) *reinterpret_cast<uint2 *>(dst) = make_uint2(w[0], w[E / 4 - 1]);
  else *reinterpret_cast<uint32_t *>(dst) = w[0];
}

}  // namespace cq_act

#endif /* CQ_KERNELS_ACT_ENCODE_CUH */
