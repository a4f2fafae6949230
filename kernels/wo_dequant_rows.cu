/* Stored weight rows decoded into f16 / bf16 / f32: cq_dequantize with 16-bit outputs (times the
 * scale), and the large-batch weight-only GEMM's operand (times a power of two, exact). One
 * thread per octet (8 codes) with the GEMV's decoders (wo_decode.cuh), the product in f32 rounded
 * once, 16-byte stores of consecutive octets. Octets holding fp8 inf/NaN codes, rows with a
 * non-finite multiplier and row tails take an element-wise path that stores the reference's NaN
 * bits. */
#include "gemv_wo.cuh"
#include "linear_impl.cuh"
#include "quantize_group.cuh"

namespace cq_wo {
namespace {

constexpr int kDequantThreads = 128;
constexpr int kDequantOctets = 3; /* octets per thread: a CTA covers 3072 codes of a row */

struct DequantRowsArgs {
  const uint8_t *w;      /* stored rows, row_bytes each */
  const float *scale;    /* per row (indexed by stored row) or 1; NULL: every row takes `mult` */
  float mult;            /* the multiplier of every row when scale is NULL (a power of two) */
  void *out;             /* [rows, k] of the output type */
  int64_t row0, rows, k, row_bytes, octets;
  cq_format_params fmt;
  int scale_per_row, w_vec8, out_vec;
  cq_dtype out_dtype;    /* f16, bf16 or f32: a run-time choice of the stores, not a kernel per type */
};

/* Output types: f16 and bf16 are stored as bits with the reference's NaN, f32 as it is. The
 * kernel picks one at run time (store_one, store8). */
template <typename OutT> struct DequantOut;
template <> struct DequantOut<__half> {
  static __device__ __forceinline__ void store(void *out, int64_t i, float v) {
    static_cast<uint16_t *>(out)[i] = store_bits<false>(v);
  }
  static __device__ __forceinline__ void store8(void *out, int64_t i, const float (&v)[8]) {
    uint32_t h[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const __half2 p = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
      h[j] = *reinterpret_cast<const uint32_t *>(&p);
    }
    *reinterpret_cast<uint4 *>(static_cast<uint16_t *>(out) + i) = make_uint4(h[0], h[1], h[2], h[3]);
  }
};
template <> struct DequantOut<__nv_bfloat16> {
  static __device__ __forceinline__ void store(void *out, int64_t i, float v) {
    static_cast<uint16_t *>(out)[i] = store_bits<true>(v);
  }
  static __device__ __forceinline__ void store8(void *out, int64_t i, const float (&v)[8]) {
    uint32_t h[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const __nv_bfloat162 p = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
      h[j] = *reinterpret_cast<const uint32_t *>(&p);
    }
    *reinterpret_cast<uint4 *>(static_cast<uint16_t *>(out) + i) = make_uint4(h[0], h[1], h[2], h[3]);
  }
};
template <> struct DequantOut<float> {
  static __device__ __forceinline__ void store(void *out, int64_t i, float v) { static_cast<float *>(out)[i] = v; }
  static __device__ __forceinline__ void store8(void *out, int64_t i, const float (&v)[8]) {
    float4 *o = reinterpret_cast<float4 *>(static_cast<float *>(out) + i);
    o[0] = make_float4(v[0], v[1], v[2], v[3]), o[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
};

__device__ __forceinline__ void store_one(cq_dtype t, void *out, int64_t i, float v) {
  switch (t) {
    case CQ_DTYPE_F16: DequantOut<__half>::store(out, i, v); break;
    case CQ_DTYPE_BF16: DequantOut<__nv_bfloat16>::store(out, i, v); break;
    default: DequantOut<float>::store(out, i, v); break;
  }
}

__device__ __forceinline__ void store8(cq_dtype t, void *out, int64_t i, const float (&v)[8]) {
  switch (t) {
    case CQ_DTYPE_F16: DequantOut<__half>::store8(out, i, v); break;
    case CQ_DTYPE_BF16: DequantOut<__nv_bfloat16>::store8(out, i, v); break;
    default: DequantOut<float>::store8(out, i, v); break;
  }
}

template <class Codec>
__device__ __forceinline__ void dequant_octet(const DequantRowsArgs &a, const typename Codec::Consts &cc,
                                              const uint32_t (&w)[2], int64_t o, float s, bool s_finite,
                                              void *out_row) {
  const int64_t k0 = 8 * o;
  /* fp8 NaN codes give NaNs whose bits the fast path does not set, and e5m2
   * infinities NaNs when the scale is 0 */
  bool fast = s_finite && a.out_vec && k0 + 8 <= a.k;
  if (Codec::kNanCodes) fast = fast && ((wo_e4m3_nan_marks(w[0]) | wo_e4m3_nan_marks(w[1])) & 0x80808080u) == 0;
  if (Codec::kInfNanCodes)
    fast = fast && ((wo_e5m2_special_marks(w[0]) | wo_e5m2_special_marks(w[1])) & 0x80808080u) == 0;
  if (fast) {
    float v[8];
    Codec::values8(w, cc, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(v[i], s);
    store8(a.out_dtype, out_row, k0, v);
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (k0 + j < a.k)
      store_one(a.out_dtype, out_row, k0 + j, cq_decode(a.fmt, cq_unit_field(w, j * Codec::kBits, Codec::kBits)) * s);
}

template <class Codec>
__global__ void __launch_bounds__(kDequantThreads) dequant_rows_kernel(const DequantRowsArgs a) {
  const typename Codec::Consts cc(a.fmt.ebits, a.fmt.bias, true); /* values8 decodes into bf16 (or f16 for e5m2) */
  for (int64_t r = blockIdx.y; r < a.rows; r += gridDim.y) {
    const int64_t stored = a.row0 + r;
    const uint8_t *row = a.w + stored * a.row_bytes;
    const float s = a.scale ? a.scale[a.scale_per_row ? stored : 0] : a.mult;
    void *out = static_cast<char *>(a.out) + r * a.k * (int64_t)(a.out_dtype == CQ_DTYPE_F32 ? 4 : 2);
    /* every load of the row first, then the decoding and stores */
    uint32_t w[kDequantOctets][2];
    int64_t o[kDequantOctets];
#pragma unroll
    for (int i = 0; i < kDequantOctets; ++i) {
      o[i] = ((int64_t)blockIdx.x * kDequantOctets + i) * kDequantThreads + threadIdx.x;
      if (o[i] < a.octets) cq_load_octet<Codec::kBits>(row, o[i], a.row_bytes, a.w_vec8 != 0, w[i]);
    }
#pragma unroll
    for (int i = 0; i < kDequantOctets; ++i)
      if (o[i] < a.octets) dequant_octet<Codec>(a, cc, w[i], o[i], s, cq_isfinite(s), out);
  }
}

template <class Codec>
cq_status launch_dequant(const DequantRowsArgs &a, dim3 grid, cudaStream_t s) {
  dequant_rows_kernel<Codec><<<grid, kDequantThreads, 0, s>>>(a);
  CQ_LAUNCH_CHECK(dequant_rows_kernel);
  return CQ_OK;
}

typedef cq_status (*DequantLauncher)(const DequantRowsArgs &, dim3, cudaStream_t);

/* [decoder] */
const DequantLauncher kDequantLaunchers[kCodecs] = {
    launch_dequant<CodecInt8>, launch_dequant<CodecE4M3>, launch_dequant<CodecE5M2>, launch_dequant<CodecFp3>,
    launch_dequant<CodecFp4>,  launch_dequant<CodecFp5>,  launch_dequant<CodecFp6>,  launch_dequant<CodecFp7>,
};

/* Decode rows of a stored weight: the body of both entries below. */
cq_status dequant_rows(const uint8_t *w, int64_t row_bytes, const float *scale, int scale_per_row, float mult,
                       const cq_format_info *wf, int64_t row0, int64_t rows, int64_t k, cq_dtype out_dtype, void *out,
                       cudaStream_t stream) {
  if (out_dtype != CQ_DTYPE_F16 && out_dtype != CQ_DTYPE_BF16 && out_dtype != CQ_DTYPE_F32)
    return cq_fail(CQ_ERR_UNSUPPORTED, "dequantize rows: out dtype %s; expected float16, bfloat16 or float32",
                   cq_dtype_name(out_dtype));
  int codec;
  CQ_TRY(codec_of(wf, "dequantize rows", &codec));
  if (rows == 0) return CQ_OK;
  DequantRowsArgs a;
  a.w = w, a.scale = scale, a.mult = mult, a.out = out;
  a.row0 = row0, a.rows = rows, a.k = k, a.row_bytes = row_bytes;
  a.octets = (k + 7) / 8;
  a.fmt = cq_format_params_of(wf);
  a.scale_per_row = scale_per_row;
  a.w_vec8 = (uintptr_t)w % 8 == 0 && row_bytes % 8 == 0;
  a.out_vec = (uintptr_t)out % 16 == 0 && k % 8 == 0;
  a.out_dtype = out_dtype;
  const int64_t per_cta = (int64_t)kDequantThreads * kDequantOctets;
  const int64_t gx = (a.octets + per_cta - 1) / per_cta;
  if (gx > 0x7fffffff)
    return cq_fail(CQ_ERR_UNSUPPORTED, "dequantize rows: rows of %lld codes are more than one launch covers",
                   (long long)k);
  const dim3 grid((unsigned)gx, (unsigned)(rows < 65535 ? rows : 65535));
  return kDequantLaunchers[codec](a, grid, stream);
}

/* The stored rows [row0, row0 + rows) of w, checked against the format and K. */
cq_status stored_rows(const cq_tensor *w, const cq_linear_params *p, const cq_format_info *wf, int64_t row0,
                      int64_t rows, const void *out, int64_t *k, int64_t *row_bytes) {
  const int64_t n = cq_rows(w);
  *k = p->in_features;
  if (*k <= 0) {
    if (wf->packed)
      return cq_fail(CQ_ERR_INVALID_ARG, "dequantize rows: in_features is required for packed %s rows", wf->name);
    *k = cq_cols(w);
  }
  *row_bytes = cq_packed_row_bytes(wf, *k);
  if (cq_cols(w) != *row_bytes)
    return cq_fail(CQ_ERR_INVALID_ARG, "dequantize rows: w has %lld bytes a row; expected %lld for %lld %s codes",
                   (long long)cq_cols(w), (long long)*row_bytes, (long long)*k, wf->name);
  if (row0 < 0 || rows < 0 || row0 + rows > n)
    return cq_fail(CQ_ERR_INVALID_ARG, "dequantize rows: rows [%lld, %lld) are outside w's %lld rows",
                   (long long)row0, (long long)(row0 + rows), (long long)n);
  if (!out && rows) return cq_fail(CQ_ERR_INVALID_ARG, "dequantize rows: out is NULL");
  return CQ_OK;
}

}  // namespace
}  // namespace cq_wo

using namespace cq_wo;

cq_status cq_dequant_rows_cuda(const cq_tensor *w, const cq_tensor *w_scale, const cq_linear_params *p,
                               const cq_format_info *wf, int64_t row0, int64_t rows, cq_dtype out_dtype, void *out,
                               void *stream) {
  int64_t k, row_bytes;
  CQ_TRY(stored_rows(w, p, wf, row0, rows, out, &k, &row_bytes));
  if (cq_format_grouped(wf)) /* 4-bit per group: x' with its group's scale (and zero point) */
    return cq_dequant_group_rows_cuda(static_cast<const uint8_t *>(w->data), row_bytes,
                                      static_cast<const float *>(w_scale->data), wf, p->weight_group_size, row0, rows,
                                      k, out_dtype, out, cq_stream(stream));
  return dequant_rows(static_cast<const uint8_t *>(w->data), row_bytes, static_cast<const float *>(w_scale->data),
                      p->weight_granularity == CQ_GRANULARITY_ROW, 1.0f, wf, row0, rows, k, out_dtype, out,
                      cq_stream(stream));
}

cq_status cq_decode_rows_cuda(const cq_tensor *w, const cq_linear_params *p, const cq_format_info *wf, int64_t row0,
                              int64_t rows, float mult, cq_dtype out_dtype, void *out, void *stream) {
  int64_t k, row_bytes;
  CQ_TRY(stored_rows(w, p, wf, row0, rows, out, &k, &row_bytes));
  if (cq_format_grouped(wf)) /* codes without their groups' scales and zero points mean nothing */
    return cq_fail(CQ_ERR_INTERNAL, "decode rows: %s weights are decoded with their group scales "
                   "(cq_dequant_rows_cuda)", wf->name);
  return dequant_rows(static_cast<const uint8_t *>(w->data), row_bytes, NULL, 0, mult, wf, row0, rows, k, out_dtype,
                      out, cq_stream(stream));
}
