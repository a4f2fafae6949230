/* int4 / uint4 per group on the GPU, bit-identical to csrc/quantize_cpu.c: the scalar steps are
 * cq_numerics.h's (cq_amax_step's maximum, cq_range_step's comparisons, cq_int4_scale_from_amax,
 * cq_uint4_params, the encoders and decoders), and the reductions are order-independent (a
 * maximum of |x| bits, where any NaN is above +inf; strict min / max comparisons from 0, with a
 * NaN flag), so every order gives the reference's scale and zero point.
 *
 * Quantize: one warp per group (groups are 32 to 1024 columns); lanes read the group's columns
 * coalesced for the reduction, then each writes whole bytes (two codes, low nibble first: a group
 * starts on a byte, its columns are a multiple of 32). Dequantize to 16-bit types: one thread per
 * word of 8 codes, decoded in packed 16-bit arithmetic where that is exact (it feeds the large-batch
 * weight-only GEMM, so it must run at memory speed); f32 outputs and rows off a 4-byte boundary: one
 * thread per byte.
 *
 * Two-level int4 (quantize_two_level_kernel): one warp per row, the row's amax and then each
 * group's with the same order-independent maximum of |x| bits; the scalar steps are cq_numerics.h's
 * cq_two_level_*. Its dequantize and the int8 rows q8 = s2 * code the int8 GEMM reads (with each
 * row's s1, NaN for a row with a bad s2): one thread per byte of codes. */
#include <type_traits>

#include "int4_decode.cuh"
#include "quantize_group.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

/* A group's (lo, hi) from the lanes' own: NaN if any lane saw one, else the min and max. */
__device__ __forceinline__ void warp_range(float *lo, float *hi) {
  for (int o = 16; o > 0; o >>= 1) {
    const float l = __shfl_xor_sync(0xffffffffu, *lo, o), h = __shfl_xor_sync(0xffffffffu, *hi, o);
    if (!(l == l) || !(*lo == *lo)) {
      *lo = *hi = __uint_as_float(0x7fc00000u);
    } else {
      if (l < *lo) *lo = l;
      if (h > *hi) *hi = h;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_group_kernel(const T *__restrict__ x, int64_t rows, int64_t cols,
                                                                  int64_t gs, int64_t row_bytes, int uint4,
                                                                  uint8_t *__restrict__ q, float *__restrict__ scale) {
  const int lane = threadIdx.x & 31;
  const int64_t groups = cols / gs, total = rows * groups;
  for (int64_t gi = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5); gi < total; gi += (int64_t)gridDim.x * kWarps) {
    const int64_t r = gi / groups, g = gi - r * groups;
    const T *xg = x + r * cols + g * gs;
    float s, inv, zp = 0.0f;
    if (uint4) {
      float lo = 0.0f, hi = 0.0f;
      for (int64_t j = lane; j < gs; j += 32) cq_range_step(&lo, &hi, cq_to_float(xg[j]));
      warp_range(&lo, &hi);
      cq_uint4_params(lo, hi, &s, &inv, &zp);
      if (lane == 0) scale[2 * gi] = s, scale[2 * gi + 1] = zp;
    } else {
      uint32_t m = 0;
      for (int64_t j = lane; j < gs; j += 32) m = max(m, cq_abs_bits(cq_to_float(xg[j])));
      m = cq_warp_max_u32(m);
      cq_int4_scale_from_amax(cq_amax_from_bits(m), &s, &inv);
      if (lane == 0) scale[gi] = s;
    }
    const bool bad = !cq_isfinite(s) || !(s == s); /* NaN / Inf in the group: all-zero codes */
    uint8_t *qg = q + r * row_bytes + g * (gs / 2);
    for (int64_t b = lane; b < gs / 2; b += 32) {
      uint32_t byte = 0;
      if (!bad) {
        const float v0 = cq_to_float(xg[2 * b]), v1 = cq_to_float(xg[2 * b + 1]);
        const uint32_t c0 = uint4 ? cq_uint4_encode(v0, inv, zp) : cq_int4_encode(v0 * inv);
        const uint32_t c1 = uint4 ? cq_uint4_encode(v1, inv, zp) : cq_int4_encode(v1 * inv);
        byte = c0 | (c1 << 4);
      }
      qg[b] = (uint8_t)byte;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_two_level_kernel(const T *__restrict__ x, int64_t rows,
                                                                      int64_t cols, int64_t gs, int64_t row_bytes,
                                                                      uint8_t *__restrict__ q, float *__restrict__ scale) {
  const int lane = threadIdx.x & 31;
  const int64_t groups = cols / gs;
  for (int64_t r = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5); r < rows; r += (int64_t)gridDim.x * kWarps) {
    const T *xr = x + r * cols;
    float *sr = scale + r * (1 + groups);
    uint32_t m = 0;
    for (int64_t j = lane; j < cols; j += 32) m = max(m, cq_abs_bits(cq_to_float(xr[j])));
    const float s1 = cq_two_level_s1(cq_amax_from_bits(cq_warp_max_u32(m)));
    const bool bad = !(s1 == s1); /* NaN / Inf in the row: s2 = 1, all-zero codes */
    if (lane == 0) sr[0] = s1;
    for (int64_t g = 0; g < groups; ++g) {
      const T *xg = xr + g * gs;
      float s2 = 1.0f, inv = 0.0f;
      if (!bad) {
        uint32_t mg = 0;
        for (int64_t j = lane; j < gs; j += 32) mg = max(mg, cq_abs_bits(cq_to_float(xg[j])));
        s2 = cq_two_level_s2(cq_amax_from_bits(cq_warp_max_u32(mg)), s1);
        inv = 1.0f / (s1 * s2);
      }
      if (lane == 0) sr[1 + g] = s2;
      uint8_t *qg = q + r * row_bytes + g * (gs / 2);
      for (int64_t b = lane; b < gs / 2; b += 32) {
        uint32_t byte = 0;
        if (!bad) byte = cq_int4_encode(cq_to_float(xg[2 * b]) * inv) | cq_int4_encode(cq_to_float(xg[2 * b + 1]) * inv) << 4;
        qg[b] = (uint8_t)byte;
      }
    }
  }
}

/* Bytes past the codes of a row (the padding to CQ_PACK_ROW_ALIGN; none when cols is a multiple
 * of 32, as whole groups make it) are zero, as the reference writes them. */
__global__ void zero_row_tails_kernel(uint8_t *q, int64_t rows, int64_t used, int64_t row_bytes) {
  const int64_t tail = row_bytes - used, n = rows * tail;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    q[(i / tail) * row_bytes + used + i % tail] = 0;
}

/* Output stores with the C reference's rounding and NaN bits (cq_store_float). */
template <typename OutT> struct GroupOut;
template <> struct GroupOut<float> {
  static __device__ __forceinline__ void store(void *o, int64_t i, float v) { static_cast<float *>(o)[i] = v; }
};
template <> struct GroupOut<__half> {
  static __device__ __forceinline__ void bits(float v, uint32_t *b) { *b = cq_f32_to_f16(v); }
  static __device__ __forceinline__ void store(void *o, int64_t i, float v) {
    static_cast<uint16_t *>(o)[i] = cq_f32_to_f16(v);
  }
};
template <> struct GroupOut<__nv_bfloat16> {
  static __device__ __forceinline__ void bits(float v, uint32_t *b) { *b = cq_f32_to_bf16(v); }
  static __device__ __forceinline__ void store(void *o, int64_t i, float v) {
    static_cast<uint16_t *>(o)[i] = cq_f32_to_bf16(v);
  }
};

template <typename OutT>
__global__ void dequant_group_kernel(const uint8_t *__restrict__ w, int64_t row_bytes, const float *__restrict__ scale,
                                     int uint4, int64_t gs, int64_t row0, int64_t rows, int64_t k, void *out) {
  const int64_t half_k = k / 2, groups = k / gs, n = rows * half_k;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / half_k, b = i - r * half_k, stored = row0 + r;
    const uint32_t byte = w[stored * row_bytes + b];
    const int64_t g = stored * groups + (2 * b) / gs; /* both codes of a byte share a group */
    float v0, v1;
    if (uint4) {
      const float s = scale[2 * g], zp = scale[2 * g + 1];
      v0 = cq_uint4_decode(byte & 0xfu, s, zp), v1 = cq_uint4_decode(byte >> 4, s, zp);
    } else {
      const float s = scale[g];
      v0 = cq_int4_decode(byte) * s, v1 = cq_int4_decode(byte >> 4) * s;
    }
    GroupOut<OutT>::store(out, r * k + 2 * b, v0);
    GroupOut<OutT>::store(out, r * k + 2 * b + 1, v1);
  }
}

template <typename OutT>
__global__ void dequant_two_level_kernel(const uint8_t *__restrict__ w, int64_t row_bytes,
                                         const float *__restrict__ scale, int64_t gs, int64_t rows, int64_t k,
                                         void *out) {
  const int64_t half_k = k / 2, width = 1 + k / gs, n = rows * half_k;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / half_k, b = i - r * half_k;
    const uint32_t byte = w[r * row_bytes + b];
    const float s1 = scale[r * width], s2 = scale[r * width + 1 + (2 * b) / gs]; /* one group for both codes */
    GroupOut<OutT>::store(out, r * k + 2 * b, cq_two_level_decode(byte & 0xfu, s1, s2));
    GroupOut<OutT>::store(out, r * k + 2 * b + 1, cq_two_level_decode(byte >> 4, s1, s2));
  }
}

/* q8 = s2 * code of rows [row0, row0 + rows), two codes a thread; a bad s2 writes 0 (its row's
 * s1 copy is NaN, which poisons the row's outputs). */
__global__ void two_level_q8_kernel(const uint8_t *__restrict__ w, int64_t row_bytes, const float *__restrict__ scale,
                                    int64_t gs, int64_t row0, int64_t rows, int64_t k, int64_t ldq,
                                    int8_t *__restrict__ q8) {
  const int64_t half_k = k / 2, width = 1 + k / gs, n = rows * half_k;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / half_k, b = i - r * half_k, stored = row0 + r;
    const uint32_t byte = w[stored * row_bytes + b];
    const float s2 = scale[stored * width + 1 + (2 * b) / gs];
    const bool ok = cq_two_level_s2_ok(s2);
    q8[r * ldq + 2 * b] = ok ? (int8_t)cq_two_level_q8(byte & 0xfu, s2) : 0;
    q8[r * ldq + 2 * b + 1] = ok ? (int8_t)cq_two_level_q8(byte >> 4, s2) : 0;
  }
}

/* s1 of rows [row0, row0 + rows), NaN for a row with an s2 that is not an integer in [0, 16]. */
__global__ void two_level_s1_kernel(const float *__restrict__ scale, int64_t groups, int64_t row0, int64_t rows,
                                    float *__restrict__ s1) {
  for (int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < rows; r += (int64_t)gridDim.x * blockDim.x) {
    const float *s = scale + (row0 + r) * (1 + groups);
    bool ok = true;
    for (int64_t g = 0; g < groups; ++g) ok = ok && cq_two_level_s2_ok(s[1 + g]);
    s1[r] = ok ? s[0] : __uint_as_float(0x7fc00000u);
  }
}

unsigned grid_for(int64_t work, int64_t per_block) {
  const int64_t g = (work + per_block - 1) / per_block;
  return (unsigned)(g < 1 ? 1 : g > 65535 * 8 ? 65535 * 8 : g);
}

/* One 32-bit word of codes (8 columns of one group: the group size is a multiple of 8) per thread,
 * so a warp's loads read 128 consecutive bytes and its 16-byte stores 512; threads of blockIdx.x run
 * along a row, blockIdx.y picks the row. A group whose scale and zero point pass exact16 is decoded
 * with packed 16-bit fmas, bit for bit the fp32 math (int4_decode.cuh); any other group element by
 * element in fp32. Rows of out are k elements of 16-byte aligned storage. */
template <typename OutT, bool U4>
__global__ void dequant_group_word_kernel(const uint8_t *__restrict__ w, int64_t row_bytes,
                                          const float *__restrict__ scale, int64_t gs, int64_t row0, int64_t rows,
                                          int64_t k, void *out) {
  constexpr bool BF16 = std::is_same<OutT, __nv_bfloat16>::value;
  const int64_t words = k / 8, groups = k / gs;
  const int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (j >= words) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const int64_t stored = row0 + r;
    const uint32_t word = *reinterpret_cast<const uint32_t *>(w + stored * row_bytes + 4 * j);
    const int64_t g = stored * groups + (8 * j) / gs;
    const float s = U4 ? scale[2 * g] : scale[g], zp = U4 ? scale[2 * g + 1] : 0.0f;
    uint32_t o[4]; /* w' of columns 2i, 2i + 1 in o[i] */
    if (cq_int4::exact16<BF16, U4>(s, zp)) {
      const cq_int4::Decoder16<BF16, U4> d(s, zp);
      /* pair(word, c): columns c and c + 4 */
      const uint32_t p04 = d.pair(word, 0), p15 = d.pair(word, 1), p26 = d.pair(word, 2), p37 = d.pair(word, 3);
      o[0] = cq_int4::prmt(p04, p15, 0x5410u), o[1] = cq_int4::prmt(p26, p37, 0x5410u);
      o[2] = cq_int4::prmt(p04, p15, 0x7632u), o[3] = cq_int4::prmt(p26, p37, 0x7632u);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) { /* byte i: columns 2i (low nibble) and 2i + 1 */
        const uint32_t byte = (word >> (8 * i)) & 0xffu;
        const float v0 = U4 ? cq_uint4_decode(byte & 0xfu, s, zp) : cq_int4_decode(byte) * s;
        const float v1 = U4 ? cq_uint4_decode(byte >> 4, s, zp) : cq_int4_decode(byte >> 4) * s;
        uint32_t lo, hi;
        GroupOut<OutT>::bits(v0, &lo), GroupOut<OutT>::bits(v1, &hi);
        o[i] = lo | hi << 16;
      }
    }
    *reinterpret_cast<uint4 *>(static_cast<uint16_t *>(out) + r * k + 8 * j) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

template <typename OutT, bool U4>
cq_status launch_dequant_words(const uint8_t *w, int64_t row_bytes, const float *scale, int64_t gs, int64_t row0,
                               int64_t rows, int64_t k, void *out, cudaStream_t stream) {
  constexpr int kWordThreads = 128;
  const dim3 grid((unsigned)((k / 8 + kWordThreads - 1) / kWordThreads), (unsigned)(rows < 65535 ? rows : 65535));
  dequant_group_word_kernel<OutT, U4><<<grid, kWordThreads, 0, stream>>>(w, row_bytes, scale, gs, row0, rows, k, out);
  CQ_LAUNCH_CHECK(dequant_group_word_kernel);
  return CQ_OK;
}

}  // namespace

cq_status cq_quantize_group_cuda(const cq_tensor *x, const cq_quant_params *p, const cq_format_info *f, cq_tensor *q,
                                 cq_tensor *scale, cudaStream_t stream) {
  const int64_t rows = cq_rows(x), cols = cq_cols(x), gs = p->group_size, row_bytes = cq_packed_row_bytes(f, cols);
  if (f->id != CQ_FORMAT_INT4 && f->id != CQ_FORMAT_UINT4)
    return cq_fail(CQ_ERR_INTERNAL, "quantize per group: format %s is not a 4-bit format", f->name);
  const int uint4 = f->id == CQ_FORMAT_UINT4;
  uint8_t *qd = static_cast<uint8_t *>(q->data);
  float *sd = static_cast<float *>(scale->data);
  if (p->granularity == CQ_GRANULARITY_TWO_LEVEL) {
    CQ_DISPATCH_FLOAT(x->dtype, T, {
      quantize_two_level_kernel<T><<<grid_for(rows, kWarps), kThreads, 0, stream>>>(
          static_cast<const T *>(x->data), rows, cols, gs, row_bytes, qd, sd);
    });
    CQ_LAUNCH_CHECK(quantize_two_level_kernel);
  } else {
    const unsigned grid = grid_for(rows * (cols / gs), kWarps);
    CQ_DISPATCH_FLOAT(x->dtype, T, {
      quantize_group_kernel<T><<<grid, kThreads, 0, stream>>>(static_cast<const T *>(x->data), rows, cols, gs,
                                                              row_bytes, uint4, qd, sd);
    });
    CQ_LAUNCH_CHECK(quantize_group_kernel);
  }
  if (row_bytes > cols / 2) {
    zero_row_tails_kernel<<<grid_for(rows * (row_bytes - cols / 2), kThreads), kThreads, 0, stream>>>(
        qd, rows, cols / 2, row_bytes);
    CQ_LAUNCH_CHECK(zero_row_tails_kernel);
  }
  return CQ_OK;
}

cq_status cq_dequant_group_rows_cuda(const uint8_t *w, int64_t row_bytes, const float *scale, const cq_format_info *f,
                                     int64_t group_size, int64_t row0, int64_t rows, int64_t k, cq_dtype out_dtype,
                                     void *out, cudaStream_t stream) {
  if (f->id != CQ_FORMAT_INT4 && f->id != CQ_FORMAT_UINT4)
    return cq_fail(CQ_ERR_INTERNAL, "dequantize per group: format %s is not a 4-bit format", f->name);
  if (group_size < 2 || group_size % 2 || k % group_size)
    return cq_fail(CQ_ERR_INTERNAL, "dequantize per group: group size %lld with %lld columns",
                   (long long)group_size, (long long)k);
  if (rows == 0) return CQ_OK;
  const int uint4 = f->id == CQ_FORMAT_UINT4;
  /* 16-bit outputs from rows on 4-byte boundaries: a word of 8 codes a thread */
  if (out_dtype != CQ_DTYPE_F32 && group_size % 8 == 0 && row_bytes % 4 == 0 && (uintptr_t)w % 4 == 0 &&
      (uintptr_t)out % 16 == 0) {
    if (out_dtype == CQ_DTYPE_BF16)
      return uint4 ? launch_dequant_words<__nv_bfloat16, true>(w, row_bytes, scale, group_size, row0, rows, k, out, stream)
                   : launch_dequant_words<__nv_bfloat16, false>(w, row_bytes, scale, group_size, row0, rows, k, out, stream);
    return uint4 ? launch_dequant_words<__half, true>(w, row_bytes, scale, group_size, row0, rows, k, out, stream)
                 : launch_dequant_words<__half, false>(w, row_bytes, scale, group_size, row0, rows, k, out, stream);
  }
  const unsigned grid = grid_for(rows * (k / 2), kThreads);
  CQ_DISPATCH_FLOAT(out_dtype, T, {
    dequant_group_kernel<T><<<grid, kThreads, 0, stream>>>(w, row_bytes, scale, uint4, group_size, row0, rows, k, out);
  });
  CQ_LAUNCH_CHECK(dequant_group_kernel);
  return CQ_OK;
}

cq_status cq_dequant_two_level_cuda(const uint8_t *w, int64_t row_bytes, const float *scale, int64_t group_size,
                                    int64_t rows, int64_t k, cq_dtype out_dtype, void *out, cudaStream_t stream) {
  if (rows == 0) return CQ_OK;
  CQ_DISPATCH_FLOAT(out_dtype, T, {
    dequant_two_level_kernel<T><<<grid_for(rows * (k / 2), kThreads), kThreads, 0, stream>>>(w, row_bytes, scale,
                                                                                           group_size, rows, k, out);
  });
  CQ_LAUNCH_CHECK(dequant_two_level_kernel);
  return CQ_OK;
}

cq_status cq_two_level_q8_rows_cuda(const uint8_t *w, int64_t row_bytes, const float *scale, int64_t group_size,
                                    int64_t row0, int64_t rows, int64_t k, int64_t ldq, int8_t *q8, float *s1,
                                    cudaStream_t stream) {
  if (rows == 0) return CQ_OK;
  two_level_q8_kernel<<<grid_for(rows * (k / 2), kThreads), kThreads, 0, stream>>>(w, row_bytes, scale, group_size,
                                                                                 row0, rows, k, ldq, q8);
  CQ_LAUNCH_CHECK(two_level_q8_kernel);
  two_level_s1_kernel<<<grid_for(rows, kThreads), kThreads, 0, stream>>>(scale, k / group_size, row0, rows, s1);
  CQ_LAUNCH_CHECK(two_level_s1_kernel);
  return CQ_OK;
}
