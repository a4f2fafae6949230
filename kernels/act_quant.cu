/* Dynamic activation quantization (int8, fp8 e4m3/e5m2), bit-identical to the
 * C reference: the same amax, the same fp32 scale and inverse
 * (cq_scale_from_amax), the same product x * inv, then the format's rounding.
 *
 * Fast path: one block per row, 16-byte loads, the row held in registers
 * between the max reduction and the encode, so x is read once. |x| is reduced
 * as integer bits (for non-negative floats the bit order is the value order,
 * and NaN patterns sort above Inf, so NaN propagates like cq_amax_step). */
#include <cuda_fp8.h>

#include "linear_impl.cuh"

namespace {

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

/* Row kernel: x [rows, cols] with cols % kElems == 0 and 16-byte aligned rows.
 * amax_word == NULL: per row; else the tensor's amax bits (fp32) are read. */
template <typename T, int FMT, int THREADS, int VPT>
__global__ void __launch_bounds__(THREADS) act_quant_rows_vec(const T *__restrict__ x, int64_t cols,
                                                              uint8_t *__restrict__ q, int64_t ldq,
                                                              float *__restrict__ sx, const uint32_t *amax_word,
                                                              float max_value) {
  constexpr int E = vec_traits<T>::kElems;
  __shared__ uint32_t red[32];
  const int64_t r = blockIdx.x;
  const uint4 *xr = reinterpret_cast<const uint4 *>(x + r * cols);
  const int nvec = (int)(cols / E);
  uint4 v[VPT];
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    int idx = threadIdx.x + i * THREADS;
    v[i] = idx < nvec ? __ldg(xr + idx) : make_uint4(0, 0, 0, 0);
    m = vec_traits<T>::absmax(v[i], m);
  }
  float amax;
  if (amax_word) {
    amax = __uint_as_float(*amax_word);
  } else {
    uint32_t mb = __float_as_uint(vec_traits<T>::amax_value(m)); /* fp32 bits keep the order */
    amax = __uint_as_float(cq_block_max_u32(mb, red));
  }
  float s, inv;
  cq_scale_from_amax(amax, max_value, &s, &inv);
  if (threadIdx.x == 0) sx[r] = s;
  uint8_t *qr = q + r * ldq;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    int idx = threadIdx.x + i * THREADS;
    if (idx < nvec) encode_store<T, FMT>(v[i], inv, qr + (int64_t)idx * E);
  }
  for (int64_t j = cols + threadIdx.x; j < ldq; j += THREADS) qr[j] = 0;
}

/* Any alignment and length: scalar loads, the row read twice (L1/L2-hot). */
template <typename T, int FMT>
__global__ void __launch_bounds__(256) act_quant_rows_scalar(const T *__restrict__ x, int64_t cols,
                                                             uint8_t *__restrict__ q, int64_t ldq,
                                                             float *__restrict__ sx, const uint32_t *amax_word,
                                                             float max_value) {
  __shared__ uint32_t red[32];
  const int64_t r = blockIdx.x;
  const T *xr = x + r * cols;
  float amax;
  if (amax_word) {
    amax = __uint_as_float(*amax_word);
  } else {
    uint32_t m = 0;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) m = max(m, cq_abs_bits(cq_to_float(xr[j])));
    amax = __uint_as_float(cq_block_max_u32(m, red));
  }
  float s, inv;
  cq_scale_from_amax(amax, max_value, &s, &inv);
  if (threadIdx.x == 0) sx[r] = s;
  uint8_t *qr = q + r * ldq;
  for (int64_t j = threadIdx.x; j < ldq; j += blockDim.x)
    qr[j] = (j < cols && inv != 0.0f) ? (uint8_t)encode1<FMT>(cq_to_float(xr[j]) * inv) : (uint8_t)0;
}

/* Per-tensor amax as fp32 bits, atomically maxed into *amax_word (zeroed first). */
template <typename T>
__global__ void __launch_bounds__(256) act_amax(const T *__restrict__ x, int64_t n, int vec_ok,
                                                uint32_t *amax_word) {
  constexpr int E = vec_traits<T>::kElems;
  __shared__ uint32_t red[32];
  uint32_t mb = 0;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x, t0 = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  int64_t tail = 0;
  if (vec_ok) {
    const uint4 *xv = reinterpret_cast<const uint4 *>(x);
    uint32_t m = 0;
    for (int64_t i = t0; i < n / E; i += stride) m = vec_traits<T>::absmax(__ldg(xv + i), m);
    mb = __float_as_uint(vec_traits<T>::amax_value(m));
    tail = n / E * E;
  }
  for (int64_t i = tail + t0; i < n; i += stride) mb = max(mb, cq_abs_bits(cq_to_float(x[i])));
  mb = cq_block_max_u32(mb, red);
  if (threadIdx.x == 0) atomicMax(amax_word, mb);
}

template <typename T, int FMT>
cq_status launch_rows(const T *x, int64_t rows, int64_t cols, uint8_t *q, int64_t ldq, float *sx,
                      const uint32_t *amax_word, float max_value, cudaStream_t s) {
  constexpr int E = vec_traits<T>::kElems;
  const int64_t nvec = cols / E;
  const bool vec_ok = cols % E == 0 && ((uintptr_t)x & 15) == 0 && ((uintptr_t)q & (E - 1)) == 0 && ldq % E == 0;
  const unsigned grid = (unsigned)rows;
  if (vec_ok && nvec <= 128) {
    act_quant_rows_vec<T, FMT, 128, 1><<<grid, 128, 0, s>>>(x, cols, q, ldq, sx, amax_word, max_value);
  } else if (vec_ok && nvec <= 256) {
    act_quant_rows_vec<T, FMT, 128, 2><<<grid, 128, 0, s>>>(x, cols, q, ldq, sx, amax_word, max_value);
  } else if (vec_ok && nvec <= 1024) {
    act_quant_rows_vec<T, FMT, 256, 4><<<grid, 256, 0, s>>>(x, cols, q, ldq, sx, amax_word, max_value);
  } else if (vec_ok && nvec <= 2048) {
    act_quant_rows_vec<T, FMT, 256, 8><<<grid, 256, 0, s>>>(x, cols, q, ldq, sx, amax_word, max_value);
  } else {
    act_quant_rows_scalar<T, FMT><<<grid, 256, 0, s>>>(x, cols, q, ldq, sx, amax_word, max_value);
  }
  CQ_LAUNCH_CHECK(act_quant_rows);
  return CQ_OK;
}

template <typename T>
cq_status launch_typed(const T *x, int64_t rows, int64_t cols, const cq_format_info *f, cq_granularity g,
                       uint8_t *q, int64_t ldq, float *sx, uint32_t *amax_word, cudaStream_t s) {
  if (g == CQ_GRANULARITY_TENSOR) {
    constexpr int E = vec_traits<T>::kElems;
    const int64_t n = rows * cols;
    const int vec_ok = ((uintptr_t)x & 15) == 0;
    int64_t blocks = (n / E + 255) / 256;
    const int grid = (int)(blocks < 1 ? 1 : blocks > 2048 ? 2048 : blocks);
    CQ_CUDA_CHECK(cudaMemsetAsync(amax_word, 0, sizeof(uint32_t), s));
    act_amax<T><<<grid, 256, 0, s>>>(x, n, vec_ok, amax_word);
    CQ_LAUNCH_CHECK(act_amax);
  } else {
    amax_word = NULL;
  }
  switch ((int)f->id) {
    case CQ_FORMAT_INT8: return launch_rows<T, CQ_FORMAT_INT8>(x, rows, cols, q, ldq, sx, amax_word, f->max_value, s);
    case CQ_FORMAT_FP8_E4M3:
      return launch_rows<T, CQ_FORMAT_FP8_E4M3>(x, rows, cols, q, ldq, sx, amax_word, f->max_value, s);
    case CQ_FORMAT_FP8_E5M2:
      return launch_rows<T, CQ_FORMAT_FP8_E5M2>(x, rows, cols, q, ldq, sx, amax_word, f->max_value, s);
  }
  return cq_fail(CQ_ERR_INTERNAL, "activation quantization: format %s is not int8 or fp8", f->name);
}

}  // namespace

cq_status cq_act_quant_cuda(const void *x, cq_dtype x_dtype, int64_t rows, int64_t cols, const cq_format_info *f,
                            cq_granularity granularity, uint8_t *q, int64_t ldq, float *sx, uint32_t *amax_word,
                            cudaStream_t stream) {
  if (rows > 0x7fffffffLL)
    return cq_fail(CQ_ERR_UNSUPPORTED, "activation quantization: %lld rows is more than the 2^31 - 1 a grid holds",
                   (long long)rows);
  if (granularity == CQ_GRANULARITY_TENSOR && !amax_word)
    return cq_fail(CQ_ERR_INTERNAL, "activation quantization per tensor needs a scratch word");
  switch (x_dtype) {
    case CQ_DTYPE_F32:
      return launch_typed((const float *)x, rows, cols, f, granularity, q, ldq, sx, amax_word, stream);
    case CQ_DTYPE_F16:
      return launch_typed((const __half *)x, rows, cols, f, granularity, q, ldq, sx, amax_word, stream);
    case CQ_DTYPE_BF16:
      return launch_typed((const __nv_bfloat16 *)x, rows, cols, f, granularity, q, ldq, sx, amax_word, stream);
    default: break;
  }
  return cq_fail(CQ_ERR_INTERNAL, "activation quantization: unexpected dtype %s", cq_dtype_name(x_dtype));
}
