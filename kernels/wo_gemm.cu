/* Weight-only linear layers with more than CQ_GEMV_MAX_M rows of x: the math of cquant.h,
 *   y = act(acc * sw + b), acc = sum_k x[m, k] * decode(q[n, k]) in fp32 (for a gated layer
 *   residual + gate * that), rounded once, on cuBLASLt's tensor-core GEMM.
 *
 * Decoded codes are exact in bf16 (every format) and in f16 (every format up to E = 5 after an
 * exact power-of-two shift, wo_f16_shift), so the weight operand holds decode(q) * 2^shift with
 * no rounding, and the scale never enters a 16-bit value. Chunk by chunk of weight rows, the
 * codes are decoded into the workspace in x's type (f32 for f32 x, and for f16 x with a format
 * no shift fits f16, whose x rows are then widened to f32 too), then multiplied with x in one of
 * two ways:
 *
 *   direct   cuBLASLt writes y itself with its bias and GELU epilogue, one rounding to y's type.
 *            That is the math above where sw = 1 (4-bit weights, below), y is 16-bit of x's type,
 *            there is no gate, the bias has y's type (cuBLASLt reads it so) or is absent, and y
 *            and the bias are 16-byte aligned (direct_aligned).
 *            Per-channel scales would need cuBLASLt's alpha vector or outer-vector scales, which
 *            cuBLASLt 13.1 has no bf16 algorithm for (asked on an H200: the heuristic offers none).
 *   fp32 D   everything else: cuBLASLt writes fp32 D (the workspace, or y itself for f32 y), and a
 *            pass of ours applies (D * 2^-shift) * sw + b, the activation and the rounding in
 *            fp32. It costs D's round trip (8 bytes per output more than y's 2) and GEMMs of
 *            fewer rows when D would not fit the workspace.
 *
 * The workspace holds at most CQUANT_WO_CHUNK_MB MiB of decoded rows and half that of fp32 D
 * (M is split into GEMMs of m_rows rows when D would not fit).
 *
 * 4-bit weights per group (int4, uint4): the operand is w' itself, each weight dequantized with its
 * group's scale (and zero point) and rounded to x's dtype (f32 x: not rounded), which is the math
 * of cquant.h for them; so no widening and no shift, and sw = 1, which the direct GEMM needs.
 * This path serves f32 x, and bf16 / f16 x where it is faster than the mixed-input
 * GEMMs (linear.cu). */
#include "cublaslt.h"
#include "linear_impl.cuh"
#include "wo_decode.cuh"

namespace {

constexpr size_t kAlign = 256;

size_t align_up(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

/* Multiples of 64 rows keep the chunks' column offsets in y 128-byte aligned. */
int64_t round_rows(int64_t rows, int64_t limit) {
  if (rows >= 64) rows = rows / 64 * 64;
  if (rows < 1) rows = 1;
  return rows < limit ? rows : limit;
}

/* Whether the format's values are exact in f16 after a power of two: *shift gets it. 4-bit
 * grouped weights are dequantized into x's dtype itself (shift 0: they never widen). */
bool f16_shift_of(const cq_format_info *f, int *shift) {
  if (cq_format_grouped(f)) {
    *shift = 0;
    return true;
  }
  return wo_f16_shift(f->kind == CQ_KIND_INT, f->bits, f->ebits, f->mbits, f->bias, (int)f->specials, shift);
}

/* The geometry of one call, a function of the scheme and the sizes only (not of x's dtype or
 * any address), so cq_linear_workspace_size and the call agree. */
struct wo_plan {
  int64_t w_rows16, w_rows32; /* weight rows per chunk for 16-bit and f32 operands */
  int64_t m_rows;             /* x rows per GEMM */
  size_t lt, wchunk, dout, xwide, total; /* workspace offsets; total bytes */
};

wo_plan plan_of(const cq_format_info *wf, int64_t m, int64_t n, int64_t k) {
  wo_plan P = {};
  const int64_t cap = cq_settings_now().wo_chunk_mib << 20, dcap = cap / 2;
  P.w_rows16 = round_rows(cap / (2 * k), n);
  const int64_t wchunk = P.w_rows16 * k * 2 > k * 4 ? P.w_rows16 * k * 2 : k * 4; /* at least one f32 row */
  P.w_rows32 = round_rows(wchunk / (4 * k), n);
  P.m_rows = round_rows(dcap / (P.w_rows16 * 4), m);
  int shift;
  const bool widen = !f16_shift_of(wf, &shift); /* f16 x is widened to f32, m_rows rows at a time */
  if (widen) P.m_rows = round_rows(dcap / (4 * k) < P.m_rows ? dcap / (4 * k) : P.m_rows, m);
  size_t off = 0;
  auto take = [&](size_t bytes) {
    size_t at = off;
    off += align_up(bytes);
    return at;
  };
  P.lt = take(CQ_LT_WORKSPACE_BYTES);
  P.wchunk = take((size_t)wchunk);
  P.dout = take((size_t)(P.m_rows * P.w_rows16 * 4));
  P.xwide = widen ? take((size_t)(P.m_rows * k * 4)) : off;
  P.total = off;
  return P;
}

unsigned grid_for(int64_t work) {
  int64_t g = (work + 255) / 256;
  return (unsigned)(g < 1 ? 1 : g > 8192 ? 8192 : g);
}

/* f16 rows [rows, k] -> f32 (exact). */
__global__ void widen_kernel(const __half *__restrict__ x, int64_t n, float *__restrict__ out) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = __half2float(x[i]);
}

/* y[m0 + i, c0 + j] = act((d[i, j] * unshift) * sw[c0 + j] + b[c0 + j]) in fp32 (for a gated
 * layer residual + gate * that), rounded once; d [rows, cols] with row stride ldd (d may be y's own
 * block: each element is read, then written). out, sw and bias start at column c0; m0 is the
 * first row of the block (the gate's sample is that of the layer's row m0 + i). */
struct epilogue_args {
  const float *d;
  int64_t ldd, rows, cols, m0;
  float unshift;
  const float *sw; /* NULL: sw = 1 (grouped weights carry their scales in w') */
  int sw_per_row;
  const void *bias;
  cq_dtype bias_dtype;
  cq_linear_out out; /* y, gate and residual offset to column c0 (rows are the layer's) */
  int activation;
};

/* The value of output (row m0 + r, column c) from its fp32 sum acc, scale sw and bias b. */
template <typename T>
__device__ __forceinline__ float epilogue_value(const epilogue_args &e, float acc, float sw, float b, int64_t r,
                                                int64_t c) {
  acc = __fmul_rn(acc, e.unshift); /* exact: a power of two */
  const float v = cq_activate(__fadd_rn(__fmul_rn(acc, sw), b), e.activation);
  return cq_out_value(e.out, e.m0 + r, c, v);
}

__device__ __forceinline__ float scale_at(const epilogue_args &e, int64_t c) {
  return e.sw ? e.sw[e.sw_per_row ? c : 0] : 1.0f;
}

template <typename T>
__device__ __forceinline__ float bias_at(const epilogue_args &e, int64_t c) {
  if (!e.bias) return 0.0f;
  return e.bias_dtype == CQ_DTYPE_F32 ? static_cast<const float *>(e.bias)[c] : cq_to_float(static_cast<const T *>(e.bias)[c]);
}

/* Eight consecutive floats from p + c (c a multiple of 8): 16-byte loads where p is 16-byte aligned. */
__device__ __forceinline__ void load8(const float *p, int64_t c, float (&v)[8]) {
  if ((uintptr_t)p % 16 == 0) {
    const float4 a = *reinterpret_cast<const float4 *>(p + c), b = *reinterpret_cast<const float4 *>(p + c + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
#pragma unroll
    for (int t = 0; t < 8; ++t) v[t] = p[c + t];
  }
}

/* Eight columns of one row a thread. VEC (16-bit y without a gate, rows of d and y 16-byte aligned,
 * cols a multiple of 8): two 16-byte loads of d and one 16-byte store of y; else element by element. */
template <typename T, bool VEC>
__global__ void epilogue_kernel(const epilogue_args e) {
  const int64_t octets = (e.cols + 7) / 8;
  for (int64_t r = blockIdx.y; r < e.rows; r += gridDim.y) {
    const float *d = e.d + r * e.ldd;
    T *y = static_cast<T *>(e.out.y) + (e.m0 + r) * e.out.ldy;
    for (int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; j < octets; j += (int64_t)gridDim.x * blockDim.x) {
      const int64_t c0 = 8 * j;
      if constexpr (VEC) {
        float acc[8], sw[8], b[8];
        load8(d, c0, acc);
        if (e.sw && e.sw_per_row) {
          load8(e.sw, c0, sw);
        } else {
#pragma unroll
          for (int t = 0; t < 8; ++t) sw[t] = scale_at(e, c0 + t);
        }
        if (e.bias && e.bias_dtype == CQ_DTYPE_F32) {
          load8(static_cast<const float *>(e.bias), c0, b);
        } else if (e.bias && (uintptr_t)e.bias % 16 == 0) { /* y's 16-bit type */
          alignas(16) T h[8];
          *reinterpret_cast<uint4 *>(h) = *reinterpret_cast<const uint4 *>(static_cast<const T *>(e.bias) + c0);
#pragma unroll
          for (int t = 0; t < 8; ++t) b[t] = cq_to_float(h[t]);
        } else {
#pragma unroll
          for (int t = 0; t < 8; ++t) b[t] = bias_at<T>(e, c0 + t);
        }
        alignas(16) T v[8];
#pragma unroll
        for (int t = 0; t < 8; ++t) v[t] = cq_from_float<T>(epilogue_value<T>(e, acc[t], sw[t], b[t], r, c0 + t));
        *reinterpret_cast<uint4 *>(y + c0) = *reinterpret_cast<const uint4 *>(v);
      } else {
        for (int64_t c = c0; c < c0 + 8 && c < e.cols; ++c)
          y[c] = cq_from_float<T>(epilogue_value<T>(e, d[c], scale_at(e, c), bias_at<T>(e, c), r, c));
      }
    }
  }
}

cq_status run_epilogue(const epilogue_args &e, cq_dtype y_dtype, cudaStream_t s) {
  const int64_t octets = (e.cols + 7) / 8;
  const dim3 grid((unsigned)((octets + 255) / 256), (unsigned)(e.rows < 65535 ? e.rows : 65535));
  const bool vec = y_dtype != CQ_DTYPE_F32 && !e.out.gate && e.cols % 8 == 0 && e.ldd % 4 == 0 &&
                   (uintptr_t)e.d % 16 == 0 && e.out.ldy % 8 == 0 && (uintptr_t)e.out.y % 16 == 0;
  if (vec) {
    if (y_dtype == CQ_DTYPE_BF16)
      epilogue_kernel<__nv_bfloat16, true><<<grid, 256, 0, s>>>(e);
    else
      epilogue_kernel<__half, true><<<grid, 256, 0, s>>>(e);
  } else {
    CQ_DISPATCH_FLOAT(y_dtype, T, (epilogue_kernel<T, false><<<grid, 256, 0, s>>>(e)));
  }
  CQ_LAUNCH_CHECK(epilogue_kernel);
  return CQ_OK;
}

/* What one chunk of decoded weight rows [row0, row0 + cnt) is multiplied with. */
struct chunk_args {
  const cq_tensor *x, *w_scale, *bias;
  const cq_linear_params *p;
  const cq_linear_out *out;
  const wo_plan *P;
  uint8_t *ws;
  const void *chunk; /* the decoded rows, of type op */
  cq_dtype op;
  float unshift;
  int grouped, device;
};

/* The GEMM of a chunk of cnt decoded rows with all rows of x, in cuBLASLt's column-major terms:
 * D^T [cnt, M] = W_chunk [cnt, k] . x^T; the caller sets D and the epilogue. */
cq_lt_gemm gemm_of(const chunk_args &c, int64_t cnt) {
  cq_lt_gemm g = {};
  g.m = cnt, g.n = cq_rows(c.x), g.k = cq_cols(c.x);
  g.a_type = c.op, g.b_type = c.op;
  g.trans_a = 1, g.trans_b = 0;
  g.lda = g.k, g.ldb = g.k;
  g.a = c.chunk, g.b = c.x->data;
  g.scale_mode = CQ_LT_SCALE_NONE;
  g.workspace = c.ws + c.P->lt, g.workspace_bytes = CQ_LT_WORKSPACE_BYTES;
  g.device = c.device;
  return g;
}

/* Whether every chunk's y columns (and bias) start 16-byte aligned, with y's rows 16-byte strided.
 * cuBLASLt's bias epilogue is not the documented math on other outputs: at M = 40, N = 1500 it
 * measured up to 255 bf16 ulps off float64 of the same w' with a bias (0.5 without one), as if
 * it rounded the product before adding the bias; the fp32-D path takes those. */
bool direct_aligned(const cq_linear_out *out, const cq_tensor *bias, int64_t w_rows) {
  const int64_t ysize = (int64_t)cq_dtype_size(out->y_dtype);
  return (uintptr_t)out->y % 16 == 0 && (out->ldy * ysize) % 16 == 0 && (w_rows * ysize) % 16 == 0 &&
         (!bias || (uintptr_t)bias->data % 16 == 0);
}

/* The direct GEMM: y's columns [row0, row0 + cnt) straight from cuBLASLt's epilogue.
 * CQ_ERR_UNSUPPORTED (nothing launched) where cuBLASLt has no algorithm for it. */
cq_status chunk_direct(const chunk_args &c, int64_t row0, int64_t cnt, cudaStream_t s) {
  cq_lt_gemm g = gemm_of(c, cnt);
  const int64_t ysize = (int64_t)cq_dtype_size(c.out->y_dtype);
  g.d_type = c.out->y_dtype;
  g.d = static_cast<char *>(c.out->y) + row0 * ysize, g.ldd = c.out->ldy;
  if (c.bias) g.bias = static_cast<const char *>(c.bias->data) + row0 * ysize, g.bias_type = c.out->y_dtype;
  g.gelu = c.p->activation == CQ_ACTIVATION_GELU_TANH;
  return cq_lt_matmul(&g, s);
}

/* The fp32-D GEMMs of one chunk, m_rows rows of x at a time, each followed by our epilogue. */
cq_status chunk_fp32(const chunk_args &c, int64_t row0, int64_t cnt, cudaStream_t s) {
  const cq_tensor *x = c.x;
  const cq_linear_out *out = c.out;
  const int64_t m = cq_rows(x), k = cq_cols(x), xsize = (int64_t)cq_dtype_size(x->dtype);
  const int64_t m_rows = c.P->m_rows;
  const bool widen = c.op != x->dtype;
  for (int64_t m0 = 0; m0 < m; m0 += m_rows) {
    const int64_t mc = m - m0 < m_rows ? m - m0 : m_rows;
    const void *xb = static_cast<const char *>(x->data) + m0 * k * xsize;
    if (widen) {
      widen_kernel<<<grid_for(mc * k), 256, 0, s>>>(static_cast<const __half *>(xb), mc * k, (float *)(c.ws + c.P->xwide));
      CQ_LAUNCH_CHECK(widen_kernel);
      xb = c.ws + c.P->xwide;
    }
    /* fp32 D: y's own block when y is f32 (and no residual, which may be y, is still to be read),
     * else the workspace */
    const bool into_y = out->y_dtype == CQ_DTYPE_F32 && !out->gate;
    float *d = into_y ? static_cast<float *>(out->y) + m0 * out->ldy + row0 : (float *)(c.ws + c.P->dout);
    const int64_t ldd = into_y ? out->ldy : cnt;
    cq_lt_gemm g = gemm_of(c, cnt);
    g.n = mc, g.b = xb;
    g.d_type = CQ_DTYPE_F32, g.d = d, g.ldd = ldd;
    CQ_TRY(cq_lt_matmul(&g, s));
    epilogue_args e;
    e.d = d, e.ldd = ldd, e.rows = mc, e.cols = cnt, e.unshift = c.unshift;
    e.sw_per_row = c.p->weight_granularity == CQ_GRANULARITY_ROW;
    e.sw = c.grouped ? NULL : static_cast<const float *>(c.w_scale->data) + (e.sw_per_row ? row0 : 0);
    e.bias = c.bias ? static_cast<const char *>(c.bias->data) + row0 * (int64_t)cq_dtype_size(c.bias->dtype) : NULL;
    e.bias_dtype = c.bias ? c.bias->dtype : CQ_DTYPE_F32;
    e.m0 = m0;
    e.out = *out; /* columns from row0 on */
    const int64_t ysize = (int64_t)cq_dtype_size(out->y_dtype);
    e.out.y = static_cast<char *>(out->y) + row0 * ysize;
    if (out->gate) {
      e.out.gate = static_cast<const char *>(out->gate) + row0 * (int64_t)cq_dtype_size(out->gate_dtype);
      e.out.residual = static_cast<const char *>(out->residual) + row0 * ysize;
    }
    e.activation = c.p->activation;
    CQ_TRY(run_epilogue(e, out->y_dtype, s));
  }
  return CQ_OK;
}

}  // namespace

size_t cq_wo_gemm_workspace(const cq_format_info *wf, int64_t m, int64_t n, int64_t k) {
  return plan_of(wf, m, n, k).total;
}

cq_status cq_wo_gemm_cuda(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale, const cq_tensor *bias,
                          const cq_linear_params *p, const cq_format_info *wf, uint8_t *ws, const cq_linear_out *out,
                          int device, cudaStream_t s) {
  /* ws is 16-byte aligned (checked by the caller); the regions inside it sit at multiples of 256 */
  const int64_t m = cq_rows(x), k = cq_cols(x), n = w->shape[0];
  const wo_plan P = plan_of(wf, m, n, k);
  int shift = 0;
  /* the GEMM's operand type: x's, but f32 for f16 x with a format that f16 cannot hold */
  cq_dtype op = x->dtype;
  if (x->dtype == CQ_DTYPE_F16 && !f16_shift_of(wf, &shift)) op = CQ_DTYPE_F32;
  const int64_t w_rows = op == CQ_DTYPE_F32 ? P.w_rows32 : P.w_rows16;
  const float mult = cq_exp2i(shift);
  const bool grouped = cq_format_grouped(wf);
  CQ_TRY(cq_lt_load(NULL));

  chunk_args c;
  c.x = x, c.w_scale = w_scale, c.bias = bias, c.p = p, c.out = out, c.P = &P, c.ws = ws;
  c.chunk = ws + P.wchunk, c.op = op, c.unshift = cq_exp2i(-shift);
  c.grouped = grouped, c.device = device;
  /* 4-bit weights only: their scales are inside w' (see the top of this file) */
  bool direct = grouped && out->y_dtype == x->dtype && op == x->dtype && op != CQ_DTYPE_F32 && !out->gate &&
                (!bias || bias->dtype == out->y_dtype) &&
                (p->activation == CQ_ACTIVATION_NONE || p->activation == CQ_ACTIVATION_GELU_TANH) &&
                direct_aligned(out, bias, w_rows);
  for (int64_t row0 = 0; row0 < n; row0 += w_rows) {
    const int64_t cnt = n - row0 < w_rows ? n - row0 : w_rows;
    if (grouped)
      CQ_TRY(cq_dequant_rows_cuda(w, w_scale, p, wf, row0, cnt, op, ws + P.wchunk, s));
    else
      CQ_TRY(cq_decode_rows_cuda(w, p, wf, row0, cnt, mult, op, ws + P.wchunk, s));
    if (direct) {
      const cq_status st = chunk_direct(c, row0, cnt, s);
      if (st == CQ_OK) continue;
      if (st != CQ_ERR_UNSUPPORTED) return st;
      direct = false; /* no algorithm: this chunk and the rest take the fp32 D */
    }
    CQ_TRY(chunk_fp32(c, row0, cnt, s));
  }
  return CQ_OK;
}
