/* Dynamic activation quantization (int8, fp8 e4m3/e5m2), bit-identical to the
 * C reference: the same amax, the same fp32 scale and inverse
 * (cq_scale_from_amax), the same product x * inv, then the format's rounding.
 *
 * Fast path: one block per row (rows of at most 32 vectors: a few threads a
 * row), 16-byte loads, the row held in registers between the max reduction
 * and the encode, so x is read once. |x| is reduced as integer bits (for
 * non-negative floats the bit order is the value order, and NaN patterns sort
 * above Inf, so NaN propagates like cq_amax_step). */
#include "act_encode.cuh"
#include "linear_impl.cuh"

namespace {

using cq_act::encode1;
using cq_act::encode_store;
using cq_act::vec_traits;

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

/* Short rows (at most 32 vectors: attention heads' rows of 64-256 values): TPR threads a row and
 * 256 / TPR rows a block, the max reduced by warp shuffles. A block a row would leave most of its
 * threads idle (a 128-value bf16 row is 16 vectors) and run at a fraction of the memory rate. */
template <typename T, int FMT, int TPR>
__global__ void __launch_bounds__(256) act_quant_rows_short(const T *__restrict__ x, int64_t rows, int64_t cols,
                                                            uint8_t *__restrict__ q, int64_t ldq,
                                                            float *__restrict__ sx, const uint32_t *amax_word,
                                                            float max_value) {
  constexpr int E = vec_traits<T>::kElems;
  const int lane = threadIdx.x % TPR;
  const int64_t r = (int64_t)blockIdx.x * (256 / TPR) + threadIdx.x / TPR;
  const bool live = r < rows; /* every lane takes part in the shuffles */
  uint4 v = make_uint4(0, 0, 0, 0);
  if (live && lane < cols / E) v = __ldg(reinterpret_cast<const uint4 *>(x + r * cols) + lane);
  float amax;
  if (amax_word) {
    amax = __uint_as_float(*amax_word);
  } else {
    /* fp32 bits keep the order */
    uint32_t mb = __float_as_uint(vec_traits<T>::amax_value(vec_traits<T>::absmax(v, 0u)));
#pragma unroll
    for (int o = TPR / 2; o > 0; o /= 2) mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, o));
    amax = __uint_as_float(mb);
  }
  if (!live) return;
  float s, inv;
  cq_scale_from_amax(amax, max_value, &s, &inv);
  if (lane == 0) sx[r] = s;
  uint8_t *qr = q + r * ldq;
  if (lane < cols / E) encode_store<T, FMT>(v, inv, qr + (int64_t)lane * E);
  for (int64_t j = cols + lane; j < ldq; j += TPR) qr[j] = 0;
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
  if (vec_ok && nvec <= 32) {
    const int tpr = nvec <= 4 ? 4 : nvec <= 8 ? 8 : nvec <= 16 ? 16 : 32;
    const unsigned short_grid = (unsigned)((rows * tpr + 255) / 256);
    if (tpr == 4)
      act_quant_rows_short<T, FMT, 4><<<short_grid, 256, 0, s>>>(x, rows, cols, q, ldq, sx, amax_word, max_value);
    else if (tpr == 8)
      act_quant_rows_short<T, FMT, 8><<<short_grid, 256, 0, s>>>(x, rows, cols, q, ldq, sx, amax_word, max_value);
    else if (tpr == 16)
      act_quant_rows_short<T, FMT, 16><<<short_grid, 256, 0, s>>>(x, rows, cols, q, ldq, sx, amax_word, max_value);
    else
      act_quant_rows_short<T, FMT, 32><<<short_grid, 256, 0, s>>>(x, rows, cols, q, ldq, sx, amax_word, max_value);
  } else if (vec_ok && nvec <= 128) {
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
