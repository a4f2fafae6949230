/* Quantize / dequantize / pack / unpack on the GPU, bit-identical to the C
 * reference (the scalar math is the shared cq_numerics.h).
 *
 * Per-row quantization is one block per row: a max-reduction of |x|, then the
 * encode pass over the same row (in L1/L2). Per-tensor dynamic quantization
 * takes three launches: a grid-wide atomic max into scale[0], the encode pass,
 * and a one-thread kernel that turns the amax in scale[0] into the scale.
 * Dynamic per-row int8/fp8 runs the vectorized activation kernel of the
 * linear layer (act_quant.cu), which gives the same codes. */
#include "linear_impl.cuh"
#include "quantize_group.cuh"

namespace {

constexpr int kThreads = 256;

/* Codes of stored byte b of a row: every code whose bits touch the byte.
 * Bytes past the last code (row padding) come out zero. */
template <typename T>
__device__ __forceinline__ uint8_t encode_packed_byte(const cq_format_params &f, const T *x, int64_t cols, float inv,
                                                      int64_t b) {
  int64_t first = (8 * b) / f.bits, last = (8 * b + 7) / f.bits;
  uint32_t byte = 0;
  for (int64_t j = first; j <= last && j < cols; ++j) {
    uint32_t code = cq_encode(f, cq_to_float(x[j]) * inv) & ((1u << f.bits) - 1u);
    int64_t shift = j * f.bits - 8 * b; /* may be negative for a code that started in the previous byte */
    byte |= shift >= 0 ? (code << shift) : (code >> -shift);
  }
  return (uint8_t)byte;
}

/* Encode one row with a known inverse scale; inv == 0 stores all-zero codes. */
template <typename T>
__device__ void encode_row(const cq_format_params &f, const T *x, int64_t cols, int64_t row_bytes, float inv,
                           uint8_t *q) {
  if (inv == 0.0f) {
    for (int64_t b = threadIdx.x; b < row_bytes; b += blockDim.x) q[b] = 0;
    return;
  }
  if (f.packed) {
    for (int64_t b = threadIdx.x; b < row_bytes; b += blockDim.x) q[b] = encode_packed_byte(f, x, cols, inv, b);
  } else {
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) q[j] = (uint8_t)cq_encode(f, cq_to_float(x[j]) * inv);
  }
}

/* A given scale that is not finite and > 0 marks its group as bad (inv 0). A valid scale
 * below 2^-128 gives inv = +inf: nonzero elements saturate, zeros (0 * inf = NaN) encode to 0. */
__device__ __forceinline__ float inverse_of_static(float s) {
  return (s > 0.0f && cq_isfinite(s)) ? 1.0f / s : 0.0f;
}

template <typename T>
__global__ void quantize_rows_kernel(cq_format_params f, const T *x, int64_t rows, int64_t cols, int64_t row_bytes,
                                     uint8_t *q, float *scale, int static_scale) {
  __shared__ uint32_t smem[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T *xr = x + r * cols;
    float s, inv;
    if (static_scale) {
      s = scale[r];
      inv = inverse_of_static(s);
    } else {
      uint32_t m = 0;
      for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) m = max(m, cq_abs_bits(cq_to_float(xr[j])));
      m = cq_block_max_u32(m, smem);
      cq_scale_from_amax(cq_amax_from_bits(m), f.max_value, &s, &inv);
      if (threadIdx.x == 0) scale[r] = s;
    }
    encode_row(f, xr, cols, row_bytes, inv, q + r * row_bytes);
  }
}

template <typename T>
__global__ void amax_kernel(const T *x, int64_t n, uint32_t *amax_bits) {
  __shared__ uint32_t smem[32];
  uint32_t m = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    m = max(m, cq_abs_bits(cq_to_float(x[i])));
  m = cq_block_max_u32(m, smem);
  if (threadIdx.x == 0) atomicMax(amax_bits, m);
}

/* Per-tensor encode: scale[0] holds the amax bits (dynamic) or the scale (static). */
template <typename T>
__global__ void quantize_tensor_kernel(cq_format_params f, const T *x, int64_t rows, int64_t cols, int64_t row_bytes,
                                       uint8_t *q, const float *scale, int static_scale) {
  float s, inv;
  if (static_scale) {
    inv = inverse_of_static(scale[0]);
  } else {
    cq_scale_from_amax(cq_amax_from_bits(__float_as_uint(scale[0])), f.max_value, &s, &inv);
  }
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) encode_row(f, x + r * cols, cols, row_bytes, inv, q + r * row_bytes);
}

__global__ void finish_tensor_scale_kernel(float max_value, float *scale) {
  float s, inv;
  cq_scale_from_amax(cq_amax_from_bits(__float_as_uint(scale[0])), max_value, &s, &inv);
  scale[0] = s;
}

template <typename T>
__global__ void dequantize_kernel(cq_format_params f, const uint8_t *q, const float *scale, int per_row, int64_t rows,
                                  int64_t cols, int64_t row_bytes, T *y) {
  int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t r = i / cols, j = i - r * cols;
    float v = cq_decode(f, cq_load_code_dev(f, q + r * row_bytes, j)) * scale[per_row ? r : 0];
    y[i] = cq_from_float<T>(v);
  }
}

__global__ void pack_kernel(const uint8_t *codes, int bits, int64_t rows, int64_t cols, int64_t row_bytes,
                            uint8_t *packed) {
  int64_t n = rows * row_bytes;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t r = i / row_bytes, b = i - r * row_bytes;
    const uint8_t *c = codes + r * cols;
    int64_t first = (8 * b) / bits, last = (8 * b + 7) / bits;
    uint32_t byte = 0;
    for (int64_t j = first; j <= last && j < cols; ++j) {
      uint32_t code = c[j] & ((1u << bits) - 1u);
      int64_t shift = j * bits - 8 * b;
      byte |= shift >= 0 ? (code << shift) : (code >> -shift);
    }
    packed[i] = (uint8_t)byte;
  }
}

__global__ void unpack_kernel(const uint8_t *packed, int bits, int64_t rows, int64_t cols, int64_t row_bytes,
                              uint8_t *codes) {
  cq_format_params f{};
  f.packed = 1, f.bits = bits;
  int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t r = i / cols, j = i - r * cols;
    codes[i] = (uint8_t)cq_load_code_dev(f, packed + r * row_bytes, j);
  }
}

int grid_for(int64_t work, int64_t per_block) {
  int64_t g = (work + per_block - 1) / per_block;
  return (int)(g < 1 ? 1 : g > 65535 * 8 ? 65535 * 8 : g);
}

}  // namespace

extern "C" cq_status cq_quantize_cuda(const cq_tensor *x, const cq_quant_params *p, const cq_format_info *fi,
                                      cq_tensor *q, cq_tensor *scale, void *stream) {
  const int64_t rows = cq_rows(x), cols = cq_cols(x), row_bytes = cq_packed_row_bytes(fi, cols);
  cq_format_params f = cq_format_params_of(fi);
  cudaStream_t s = cq_stream(stream);
  uint8_t *qd = (uint8_t *)q->data;
  float *sd = (float *)scale->data;
  int grid = grid_for(rows, 1);
  if (cq_granularity_grouped(p->granularity)) return cq_quantize_group_cuda(x, p, fi, q, scale, s);
  if (p->granularity == CQ_GRANULARITY_ROW && !p->static_scale &&
      (fi->id == CQ_FORMAT_INT8 || fi->id == CQ_FORMAT_FP8_E4M3 || fi->id == CQ_FORMAT_FP8_E5M2))
    return cq_act_quant_cuda(x->data, x->dtype, rows, cols, fi, CQ_GRANULARITY_ROW, qd, cols, sd, NULL, s);
  if (p->granularity == CQ_GRANULARITY_ROW) {
    CQ_DISPATCH_FLOAT(x->dtype, T, {
      quantize_rows_kernel<T><<<grid, kThreads, 0, s>>>(f, (const T *)x->data, rows, cols, row_bytes, qd, sd,
                                                        p->static_scale);
    });
    CQ_LAUNCH_CHECK(quantize_rows_kernel);
    return CQ_OK;
  }
  if (!p->static_scale) {
    CQ_CUDA_CHECK(cudaMemsetAsync(sd, 0, sizeof(float), s));
    CQ_DISPATCH_FLOAT(x->dtype, T, {
      amax_kernel<T><<<grid_for(rows * cols, 4 * kThreads), kThreads, 0, s>>>((const T *)x->data, rows * cols,
                                                                            (uint32_t *)sd);
    });
    CQ_LAUNCH_CHECK(amax_kernel);
  }
  CQ_DISPATCH_FLOAT(x->dtype, T, {
    quantize_tensor_kernel<T><<<grid, kThreads, 0, s>>>(f, (const T *)x->data, rows, cols, row_bytes, qd, sd,
                                                        p->static_scale);
  });
  CQ_LAUNCH_CHECK(quantize_tensor_kernel);
  if (!p->static_scale) {
    finish_tensor_scale_kernel<<<1, 1, 0, s>>>(f.max_value, sd);
    CQ_LAUNCH_CHECK(finish_tensor_scale_kernel);
  }
  return CQ_OK;
}

extern "C" cq_status cq_dequantize_cuda(const cq_tensor *q, const cq_tensor *scale, const cq_quant_params *p,
                                        const cq_format_info *fi, cq_tensor *y, void *stream) {
  const int64_t rows = cq_rows(y), cols = cq_cols(y), row_bytes = cq_packed_row_bytes(fi, cols);
  if (p->granularity == CQ_GRANULARITY_TWO_LEVEL)
    return cq_dequant_two_level_cuda((const uint8_t *)q->data, row_bytes, (const float *)scale->data, p->group_size,
                                     rows, cols, y->dtype, y->data, cq_stream(stream));
  if (p->granularity == CQ_GRANULARITY_GROUP)
    return cq_dequant_group_rows_cuda((const uint8_t *)q->data, row_bytes, (const float *)scale->data, fi,
                                      p->group_size, 0, rows, cols, y->dtype, y->data, cq_stream(stream));
  if (y->dtype == CQ_DTYPE_F16 || y->dtype == CQ_DTYPE_BF16) {
    /* 16-bit outputs take the unit-wise row decoder of the weight-only path (wo_dequant_rows.cu) */
    cq_linear_params lp = {};
    lp.weight_format = fi->id, lp.weight_granularity = p->granularity, lp.act_format = CQ_FORMAT_NONE;
    lp.in_features = cols;
    return cq_dequant_rows_cuda(q, scale, &lp, fi, 0, rows, y->dtype, y->data, stream);
  }
  cq_format_params f = cq_format_params_of(fi);
  CQ_DISPATCH_FLOAT(y->dtype, T, {
    dequantize_kernel<T><<<grid_for(rows * cols, kThreads), kThreads, 0, cq_stream(stream)>>>(
        f, (const uint8_t *)q->data, (const float *)scale->data, p->granularity == CQ_GRANULARITY_ROW, rows, cols,
        row_bytes, (T *)y->data);
  });
  CQ_LAUNCH_CHECK(dequantize_kernel);
  return CQ_OK;
}

extern "C" cq_status cq_pack_cuda(const cq_tensor *codes, int bits, cq_tensor *packed, void *stream) {
  const int64_t rows = cq_rows(codes), cols = cq_cols(codes), row_bytes = cq_pack_row_bytes_bits(bits, cols);
  pack_kernel<<<grid_for(rows * row_bytes, kThreads), kThreads, 0, cq_stream(stream)>>>(
      (const uint8_t *)codes->data, bits, rows, cols, row_bytes, (uint8_t *)packed->data);
  CQ_LAUNCH_CHECK(pack_kernel);
  return CQ_OK;
}

extern "C" cq_status cq_unpack_cuda(const cq_tensor *packed, int bits, cq_tensor *codes, void *stream) {
  const int64_t rows = cq_rows(codes), cols = cq_cols(codes), row_bytes = cq_pack_row_bytes_bits(bits, cols);
  unpack_kernel<<<grid_for(rows * cols, kThreads), kThreads, 0, cq_stream(stream)>>>(
      (const uint8_t *)packed->data, bits, rows, cols, row_bytes, (uint8_t *)codes->data);
  CQ_LAUNCH_CHECK(unpack_kernel);
  return CQ_OK;
}
