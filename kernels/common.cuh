/* Shared pieces of the CUDA kernels: error checks, dtype dispatch, loads. */
#ifndef CQ_KERNELS_COMMON_CUH
#define CQ_KERNELS_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cq_numerics.h"
#include "arch.cuh"

/* Check a CUDA runtime call; on failure record call, file and line and return. */
#define CQ_CUDA_CHECK(call)                                                                       \
  do {                                                                                            \
    cudaError_t cq_e_ = (call);                                                                   \
    if (cq_e_ != cudaSuccess)                                                                     \
      return cq_fail(CQ_ERR_CUDA, "%s failed: %s (%s:%d)", #call, cudaGetErrorString(cq_e_), __FILE__, \
                     __LINE__);                                                                   \
  } while (0)

/* After a launch: configuration errors show up here, not in the launch itself. */
#define CQ_LAUNCH_CHECK(kernel_name) CQ_CUDA_CHECK(cudaGetLastError())

static inline cudaStream_t cq_stream(void *s) { return (cudaStream_t)s; }

/* fp32 view of a 16/32-bit float element. */
__device__ __forceinline__ float cq_to_float(float v) { return v; }
__device__ __forceinline__ float cq_to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float cq_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T cq_from_float(float v);
template <> __device__ __forceinline__ float cq_from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half cq_from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 cq_from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

/* Element i of an f32/f16/bf16 array as fp32. */
__device__ __forceinline__ float cq_load_any(const void *p, cq_dtype t, int64_t i) {
  switch (t) {
    case CQ_DTYPE_F16: return __half2float(static_cast<const __half *>(p)[i]);
    case CQ_DTYPE_BF16: return __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[i]);
    default: return static_cast<const float *>(p)[i];
  }
}

/* Two fp32 as one register of two 16-bit values (lo in the low half), each rounded
 * to nearest even. */
template <typename T> __device__ __forceinline__ uint32_t cq_pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t cq_pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&v);
}
template <> __device__ __forceinline__ uint32_t cq_pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&v);
}
/* The two values of a packed pair (cq_pack2's layout), exactly. */
template <typename T> __device__ __forceinline__ float2 cq_unpack2(uint32_t v);
template <> __device__ __forceinline__ float2 cq_unpack2<__nv_bfloat16>(uint32_t v) {
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}
template <> __device__ __forceinline__ float2 cq_unpack2<__half>(uint32_t v) {
  return __half22float2(*reinterpret_cast<const __half2 *>(&v));
}

/* v rounded once to an f32/f16/bf16 array's type (round to nearest even, cq_from_float's
 * rounding) and stored as element i. Output dtypes are a run-time switch of the epilogues rather
 * than a template parameter of each kernel: the branch is uniform and costs nothing next to a
 * GEMM's main loop, while a template would compile every main loop three times. */
__device__ __forceinline__ uint16_t cq_bits16(__half h) { return __half_as_ushort(h); }
__device__ __forceinline__ uint16_t cq_bits16(__nv_bfloat16 h) { return __bfloat16_as_ushort(h); }

__device__ __forceinline__ void cq_store_any(void *p, cq_dtype t, int64_t i, float v) {
  switch (t) {
    case CQ_DTYPE_F16: static_cast<__half *>(p)[i] = __float2half_rn(v); break;
    case CQ_DTYPE_BF16: static_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn(v); break;
    default: static_cast<float *>(p)[i] = v; break;
  }
}

/* Two neighbouring elements in one store (y aligned to two elements), each rounded as
 * cq_from_float rounds it. */
template <typename T>
__device__ __forceinline__ void cq_store2(T *y, float v0, float v1) {
  if constexpr (sizeof(T) == 2) {
    *reinterpret_cast<uint32_t *>(y) =
        (uint32_t)cq_bits16(cq_from_float<T>(v0)) | ((uint32_t)cq_bits16(cq_from_float<T>(v1)) << 16);
  } else {
    *reinterpret_cast<float2 *>(y) = make_float2(v0, v1);
  }
}

/* Elements i and i + 1 of an f32/f16/bf16 array in one store (element i aligned to two). */
__device__ __forceinline__ void cq_store_any2(void *p, cq_dtype t, int64_t i, float v0, float v1) {
  switch (t) {
    case CQ_DTYPE_F16: cq_store2(static_cast<__half *>(p) + i, v0, v1); break;
    case CQ_DTYPE_BF16: cq_store2(static_cast<__nv_bfloat16 *>(p) + i, v0, v1); break;
    default: cq_store2(static_cast<float *>(p) + i, v0, v1); break;
  }
}

/* residual + gate * v: the product and the sum each rounded in fp32, never contracted (cquant.h). */
__device__ __forceinline__ float cq_gate_residual(float v, float gate, float residual) {
  return __fadd_rn(residual, __fmul_rn(gate, v));
}

/* Call f.template operator()<T>() with T the element type of a float dtype. */
#define CQ_DISPATCH_FLOAT(dtype, T, ...)                                       \
  switch (dtype) {                                                             \
    case CQ_DTYPE_F32: { typedef float T; __VA_ARGS__; break; }                \
    case CQ_DTYPE_F16: { typedef __half T; __VA_ARGS__; break; }               \
    case CQ_DTYPE_BF16: { typedef __nv_bfloat16 T; __VA_ARGS__; break; }       \
    default: return cq_fail(CQ_ERR_INTERNAL, "unexpected dtype %d", (int)(dtype)); \
  }

/* Format parameters as plain values a kernel can take by value. */
struct cq_format_params {
  int kind;        /* CQ_KIND_INT or CQ_KIND_FLOAT */
  int bits, ebits, mbits, bias, specials, packed;
  float max_value;
  uint32_t max_code;
};

static inline cq_format_params cq_format_params_of(const cq_format_info *f) {
  cq_format_params p;
  p.kind = f->kind, p.bits = f->bits, p.ebits = f->ebits, p.mbits = f->mbits, p.bias = f->bias;
  p.specials = (int)f->specials, p.packed = f->packed, p.max_value = f->max_value, p.max_code = f->max_code;
  return p;
}

__device__ __forceinline__ uint32_t cq_encode(const cq_format_params &f, float v) {
  if (f.kind == CQ_KIND_INT) return (uint32_t)(uint8_t)(int8_t)cq_int8_encode(v);
  return cq_float_encode(v, f.ebits, f.mbits, f.bias, f.max_value, f.max_code);
}

__device__ __forceinline__ float cq_decode(const cq_format_params &f, uint32_t code) {
  if (f.kind == CQ_KIND_INT) return (float)(int8_t)(uint8_t)code;
  return cq_float_decode(code, f.ebits, f.mbits, f.bias, f.specials);
}

/* Code j of a stored row (packed LSB-first bit stream or one byte per code). */
__device__ __forceinline__ uint32_t cq_load_code_dev(const cq_format_params &f, const uint8_t *row, int64_t j) {
  if (!f.packed) return row[j];
  int64_t bit = j * f.bits;
  int shift = (int)(bit & 7);
  uint32_t v = row[bit >> 3];
  if (shift + f.bits > 8) v |= (uint32_t)row[(bit >> 3) + 1] << 8;
  return (v >> shift) & ((1u << f.bits) - 1u);
}

/* NaN-propagating max of |v| as ordered bits: for non-negative floats the
 * integer order is the float order, and NaN (>= 0x7f800001) beats everything. */
__device__ __forceinline__ uint32_t cq_abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

__device__ __forceinline__ uint32_t cq_warp_max_u32(uint32_t v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/* Block-wide max; every thread gets the result. `smem` holds 32 words. */
__device__ __forceinline__ uint32_t cq_block_max_u32(uint32_t v, uint32_t *smem) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = cq_warp_max_u32(v);
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  int nwarps = (blockDim.x + 31) >> 5;
  v = lane < nwarps ? smem[lane] : 0u;
  return cq_warp_max_u32(v);
}

/* amax as a float from ordered bits (a NaN pattern stays NaN). */
__device__ __forceinline__ float cq_amax_from_bits(uint32_t b) { return __uint_as_float(b); }

#endif /* CQ_KERNELS_COMMON_CUH */
