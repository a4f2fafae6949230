/* Quantized linear layers on the GPU: workspace layout and the dispatch of
 * each scheme (see cquant.h for the math).
 *
 *   weight-only, M <= CQ_GEMV_MAX_M   cq_gemv_wo_cuda (reads the stored weight once)
 *                                     and the activation (if any) as a pass over y
 *   weight-only, larger M             weight rows dequantized chunk by chunk into the
 *                                     workspace, cuBLASLt GEMM per chunk straight into
 *                                     y's columns with the bias (and GELU) epilogue
 *   int8dq                            activation quantization, then the int8 GEMM with
 *                                     the scale/bias epilogue (wgmma on sm_90a, else
 *                                     mma.sync on sm_80+)
 *   fp8 dynamic (fp8dqrow, fp8dq)     activation quantization, then cuBLASLt's fp8 GEMM
 *                                     with outer-vector (or scalar) scales and the bias
 *                                     (and GELU) epilogue on sm_90+; elsewhere, or for shapes
 *                                     cuBLASLt does not take, the mma.sync fp8 kernel
 *
 * Everything is enqueued on the caller's stream into the caller's workspace:
 * no allocation, no synchronization (CUDA-graph capturable).
 *
 * Switches (cq_settings, csrc/settings.c): CQUANT_DISABLE_WGMMA, CQUANT_DISABLE_CUBLASLT_FP8,
 * CQUANT_WO_CHUNK_MB, CQUANT_CUBLASLT_PATH. */
#include <stdlib.h>

#include "cublaslt.h"
#include "linear_impl.cuh"

namespace {

constexpr size_t kAlign = 256;

size_t align_up(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }
int64_t round16(int64_t k) { return (k + 15) / 16 * 16; }

/* Bytes of dequantized weight one weight-only chunk may hold (CQUANT_WO_CHUNK_MB, read once
 * with the other settings, so sizing and running agree). */
int64_t chunk_cap_bytes() { return cq_settings_now().wo_chunk_mib << 20; }

/* Bytes of the dequantized-weight chunk of the workspace: as many 16-bit rows
 * as the cap allows (all of them when the weight fits), at least one f32 row. */
int64_t chunk_region_bytes(int64_t n, int64_t k) {
  int64_t rows = chunk_cap_bytes() / (k * 2);
  if (rows >= 64) rows = rows / 64 * 64; /* keeps y's column offsets 128-byte aligned */
  if (rows > n) rows = n;
  int64_t bytes = (rows < 1 ? 1 : rows) * k * 2;
  return bytes < k * 4 ? k * 4 : bytes;
}

/* Weight rows per chunk for an element size (2: f16/bf16, 4: f32). */
int64_t chunk_rows(int64_t n, int64_t k, int64_t elem) {
  int64_t rows = chunk_region_bytes(n, k) / (k * elem);
  if (rows >= 64) rows = rows / 64 * 64;
  if (rows < 1) rows = 1;
  return rows < n ? rows : n;
}

/* Offsets of the workspace regions of one call (0 size = region unused). */
struct ws_layout {
  size_t codes, sx, amax, sw_vec, bias16, wpad, lt, chunk, total;
  int64_t ldq; /* row stride of activation codes and of a padded weight */
};

cq_status layout_of(const cq_linear_params *p, int64_t m, int64_t n, ws_layout *L) {
  const int64_t k = p->in_features;
  if (k < 1)
    return cq_fail(CQ_ERR_INVALID_ARG, "in_features = %lld; the CUDA workspace size needs K >= 1", (long long)k);
  *L = ws_layout{};
  L->ldq = round16(k);
  size_t off = 0;
  auto take = [&](size_t bytes) {
    size_t at = off;
    off += align_up(bytes);
    return at;
  };
  const bool dynamic = p->act_format != CQ_FORMAT_NONE;
  if (dynamic) {
    const bool fp8 = p->act_format != CQ_FORMAT_INT8;
    L->codes = take((size_t)(m * L->ldq));
    L->sx = take((size_t)m * sizeof(float));
    L->amax = take(sizeof(uint32_t));
    if (fp8) {
      L->sw_vec = take((size_t)n * sizeof(float));
      L->bias16 = take((size_t)n * 2);
    }
    if (k % 16) L->wpad = take((size_t)(n * L->ldq));
    if (fp8) L->lt = take(CQ_LT_WORKSPACE_BYTES);
  } else if (m > CQ_GEMV_MAX_M) {
    L->bias16 = take((size_t)n * 2);
    L->lt = take(CQ_LT_WORKSPACE_BYTES);
    L->chunk = take((size_t)chunk_region_bytes(n, k));
  }
  L->total = off;
  return CQ_OK;
}

/* ---- small helper kernels ---- */

/* W [n, k] (row stride k) -> [n, ldq] with zeros in [k, ldq). */
__global__ void pad_rows_kernel(const uint8_t *__restrict__ w, int64_t n, int64_t k, int64_t ldq,
                                uint8_t *__restrict__ out) {
  const int64_t total = n * ldq;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / ldq, j = i - r * ldq;
    out[i] = j < k ? w[r * k + j] : 0;
  }
}

__global__ void fill_kernel(const float *__restrict__ src, int64_t n, float *__restrict__ out) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = src[0];
}

template <typename T>
__global__ void bias_to_16bit_kernel(const float *__restrict__ b, int64_t n, T *__restrict__ out) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = cq_from_float<T>(b[i]);
}

unsigned grid_for(int64_t work) {
  int64_t g = (work + 255) / 256;
  return (unsigned)(g < 1 ? 1 : g > 8192 ? 8192 : g);
}

/* The bias as cuBLASLt takes it with a 16-bit output (same dtype as y). */
cq_status bias_for_lt(const cq_tensor *bias, cq_dtype y_dtype, uint8_t *ws, const ws_layout &L, int64_t n,
                      cudaStream_t s, const void **out) {
  *out = NULL;
  if (!bias) return CQ_OK;
  if (bias->dtype == y_dtype) {
    *out = bias->data;
    return CQ_OK;
  }
  /* f32 bias with a 16-bit y: cuBLASLt reads bias in y's dtype, so it is
   * rounded once to it (a half-ulp of y, below the output's own rounding) */
  void *dst = ws + L.bias16;
  if (y_dtype == CQ_DTYPE_BF16)
    bias_to_16bit_kernel<<<grid_for(n), 256, 0, s>>>((const float *)bias->data, n, (__nv_bfloat16 *)dst);
  else
    bias_to_16bit_kernel<<<grid_for(n), 256, 0, s>>>((const float *)bias->data, n, (__half *)dst);
  CQ_LAUNCH_CHECK(bias_to_16bit_kernel);
  *out = dst;
  return CQ_OK;
}

/* One cuBLASLt GEMM followed by the layer's activation: in the GELU epilogue
 * when cuBLASLt has one for the problem, else as a pass over D (row-major y:
 * g.n rows of g.m outputs, row stride g.ldd). */
cq_status lt_matmul_act(cq_lt_gemm g, int activation, cudaStream_t s) {
  if (activation == CQ_ACTIVATION_GELU_TANH) {
    g.gelu = 1;
    cq_status st = cq_lt_matmul(&g, s);
    if (st != CQ_ERR_UNSUPPORTED) return st;
    g.gelu = 0;
  }
  CQ_TRY(cq_lt_matmul(&g, s));
  return cq_activation_cuda(g.d, g.d_type, g.n, g.m, g.ldd, activation, s);
}

cq_status check_workspace(const cq_tensor *workspace, size_t need, const cq_tensor *x, uint8_t **ws) {
  *ws = NULL;
  if (!need) return CQ_OK;
  if (!workspace)
    return cq_fail(CQ_ERR_INVALID_ARG, "workspace is required: this call needs %zu bytes (cq_linear_workspace_size)",
                   need);
  CQ_TRY(cq_check_contiguous(workspace, "workspace"));
  CQ_TRY(cq_check_writable(workspace, "workspace"));
  CQ_TRY(cq_check_same_device(x, "x", workspace, "workspace"));
  const size_t have = (size_t)cq_tensor_numel(workspace) * cq_dtype_size(workspace->dtype);
  if (have < need)
    return cq_fail(CQ_ERR_INVALID_ARG, "workspace has %zu bytes; expected at least %zu (cq_linear_workspace_size)",
                   have, need);
  if ((uintptr_t)workspace->data % 16)
    return cq_fail(CQ_ERR_INVALID_ARG, "workspace must start on a 16-byte boundary");
  *ws = (uint8_t *)workspace->data;
  return CQ_OK;
}

/* ---- weight-only, M > CQ_GEMV_MAX_M ---- */

cq_status linear_weight_only(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale,
                             const cq_tensor *bias, const cq_linear_params *p, const cq_format_info *wf, uint8_t *ws,
                             const ws_layout &L, cq_tensor *y, int device, cudaStream_t s) {
  const int64_t m = cq_rows(x), k = cq_cols(x), n = w->shape[0];
  const cq_dtype t = x->dtype;
  const int64_t esize = (int64_t)cq_dtype_size(t);
  const int64_t rows = t == CQ_DTYPE_F32 ? chunk_rows(n, k, 4) : chunk_rows(n, k, 2);
  CQ_TRY(cq_lt_load(NULL));
  const void *b = NULL;
  if (t == CQ_DTYPE_F32) b = bias ? bias->data : NULL; /* f32 y takes an f32 bias */
  else CQ_TRY(bias_for_lt(bias, t, ws, L, n, s, &b));
  void *chunk = ws + L.chunk;
  const int64_t w_row_bytes = cq_packed_row_bytes(wf, k);
  for (int64_t row0 = 0; row0 < n; row0 += rows) {
    const int64_t cnt = n - row0 < rows ? n - row0 : rows;
    if (t == CQ_DTYPE_F32) {
      /* fp32 activations: dequantize to fp32 rows (the GEMM then runs in fp32) */
      cq_tensor qv = *w, sv = *w_scale, dv = *x;
      qv.data = (uint8_t *)w->data + row0 * w_row_bytes;
      qv.shape[0] = cnt;
      if (p->weight_granularity == CQ_GRANULARITY_ROW) {
        sv.data = (float *)w_scale->data + row0;
        sv.ndim = 1, sv.shape[0] = cnt, sv.strides[0] = 1;
      }
      dv.data = chunk, dv.ndim = 2, dv.shape[0] = cnt, dv.shape[1] = k, dv.strides[0] = k, dv.strides[1] = 1;
      dv.readonly = 0;
      cq_quant_params qp = {.format = wf->id, .granularity = p->weight_granularity, .static_scale = 1};
      CQ_TRY(cq_dequantize_cuda(&qv, &sv, &qp, wf, &dv, s));
    } else {
      CQ_TRY(cq_dequant_rows_cuda(w, w_scale, p, wf, row0, cnt, t, chunk, s));
    }
    cq_lt_gemm g = {};
    g.m = cnt, g.n = m, g.k = k;
    g.a_type = t, g.b_type = t, g.d_type = t;
    g.trans_a = 1, g.trans_b = 0;
    g.lda = k, g.ldb = k, g.ldd = n;
    g.a = chunk, g.b = x->data, g.d = (uint8_t *)y->data + row0 * esize;
    g.bias = b ? (const uint8_t *)b + row0 * (int64_t)(t == CQ_DTYPE_F32 ? sizeof(float) : 2) : NULL;
    g.bias_type = t;
    g.scale_mode = CQ_LT_SCALE_NONE;
    g.workspace = ws + L.lt, g.workspace_bytes = CQ_LT_WORKSPACE_BYTES;
    g.device = device;
    CQ_TRY(lt_matmul_act(g, p->activation, s));
  }
  return CQ_OK;
}

/* ---- dynamic activations ---- */

/* Weight codes with 16-byte aligned rows: the stored weight, or a zero-padded
 * copy in the workspace when K is not a multiple of 16. */
cq_status weight_rows_16(const cq_tensor *w, int64_t n, int64_t k, uint8_t *ws, const ws_layout &L, cudaStream_t s,
                         const uint8_t **wq, int64_t *ldw) {
  if (k % 16 == 0) {
    if ((uintptr_t)w->data % 16)
      return cq_fail(CQ_ERR_INVALID_ARG, "w must start on a 16-byte boundary for the CUDA 8-bit GEMM (its address "
                     "ends in 0x%x); pass a tensor that does not start inside another one", (unsigned)((uintptr_t)w->data & 15));
    *wq = (const uint8_t *)w->data, *ldw = k;
    return CQ_OK;
  }
  pad_rows_kernel<<<grid_for(n * L.ldq), 256, 0, s>>>((const uint8_t *)w->data, n, k, L.ldq, ws + L.wpad);
  CQ_LAUNCH_CHECK(pad_rows_kernel);
  *wq = ws + L.wpad, *ldw = L.ldq;
  return CQ_OK;
}

/* fp8 x fp8 through cuBLASLt (sm_90+: outer-vector scales; scalar scales per
 * tensor). CQ_ERR_UNSUPPORTED when cuBLASLt cannot take the problem. */
cq_status fp8_cublaslt(const cq_gemm8_args &a, const cq_linear_params *p, const cq_tensor *bias, uint8_t *ws,
                       const ws_layout &L, int cc, int device, cudaStream_t s) {
  if (a.y_dtype == CQ_DTYPE_F32 || a.n % 16 || a.m > 0x7fffffffLL || cq_settings_now().disable_cublaslt_fp8)
    return cq_fail(CQ_ERR_UNSUPPORTED, "fp8 GEMM shape or dtype outside cuBLASLt's fp8 kernels");
  cq_lt_gemm g = {};
  const bool both_tensor = p->act_granularity == CQ_GRANULARITY_TENSOR && p->weight_granularity == CQ_GRANULARITY_TENSOR;
  if (both_tensor) {
    g.scale_mode = CQ_LT_SCALE_SCALAR;
    g.a_scale = a.sb, g.b_scale = a.sa;
  } else {
    if (cc < CQ_CC_FP8_CUBLASLT_ROW) return cq_fail(CQ_ERR_UNSUPPORTED, "cuBLASLt's per-row fp8 scales need sm_90+");
    g.scale_mode = CQ_LT_SCALE_OUTER_VEC;
    const float *sw = a.sb;
    if (a.sb_stride == 0) { /* per-tensor weight scale as a vector */
      fill_kernel<<<grid_for(a.n), 256, 0, s>>>(a.sb, a.n, (float *)(ws + L.sw_vec));
      CQ_LAUNCH_CHECK(fill_kernel);
      sw = (const float *)(ws + L.sw_vec);
    }
    g.a_scale = sw, g.b_scale = a.sa;
  }
  const void *b = NULL;
  CQ_TRY(bias_for_lt(bias, a.y_dtype, ws, L, a.n, s, &b));
  g.m = a.n, g.n = a.m, g.k = a.kpad;
  g.a_type = a.b_format == CQ_FORMAT_FP8_E5M2 ? CQ_DTYPE_F8_E5M2 : CQ_DTYPE_F8_E4M3FN;
  g.b_type = a.a_format == CQ_FORMAT_FP8_E5M2 ? CQ_DTYPE_F8_E5M2 : CQ_DTYPE_F8_E4M3FN;
  g.d_type = a.y_dtype;
  g.trans_a = 1, g.trans_b = 0;
  g.lda = a.ldb, g.ldb = a.lda, g.ldd = a.n;
  g.a = a.b, g.b = a.a, g.d = a.y;
  g.bias = b, g.bias_type = a.y_dtype;
  g.workspace = ws + L.lt, g.workspace_bytes = CQ_LT_WORKSPACE_BYTES;
  g.device = device;
  return lt_matmul_act(g, p->activation, s);
}

/* Compute capability of the device, checked against the scheme's floor. */
cq_status dynamic_capability(const cq_format_info *af, int device, int *cc) {
  if (af->id == CQ_FORMAT_INT8)
    return cq_require_cc(device, CQ_MIN_CC_INT8_DYNAMIC, "int8 activations (int8dq: int8 tensor cores)", cc);
  return cq_require_cc(device, CQ_MIN_CC_FP8_DYNAMIC, "fp8 activations (fp8 tensor cores)", cc);
}

/* y from activation codes [m, ldq] (16-byte aligned rows) and their per-row scales sx [m]. */
cq_status gemm_dynamic(const uint8_t *codes, int64_t ldq, const float *sx, int64_t m, int64_t k, const cq_tensor *w,
                       const cq_tensor *w_scale, const cq_tensor *bias, const cq_linear_params *p,
                       const cq_format_info *wf, const cq_format_info *af, uint8_t *ws, const ws_layout &L,
                       cq_tensor *y, int device, int cc, cudaStream_t s) {
  const int64_t n = w->shape[0];
  cq_gemm8_args a = {};
  CQ_TRY(weight_rows_16(w, n, k, ws, L, s, &a.b, &a.ldb));
  a.a = codes, a.lda = ldq;
  a.m = m, a.n = n, a.kpad = L.ldq;
  a.sa = sx;
  a.sb = (const float *)w_scale->data;
  a.sb_stride = p->weight_granularity == CQ_GRANULARITY_ROW ? 1 : 0;
  a.bias = bias ? bias->data : NULL;
  a.bias_dtype = bias ? bias->dtype : CQ_DTYPE_F32;
  a.y = y->data, a.y_dtype = y->dtype;
  a.a_format = af->id, a.b_format = wf->id;
  a.activation = p->activation;

  if (af->id != CQ_FORMAT_INT8) {
    cq_status st = fp8_cublaslt(a, p, bias, ws, L, cc, device, s);
    if (st != CQ_ERR_UNSUPPORTED) return st; /* done, or a real failure */
  } else {
    int launched = 0;
    CQ_TRY(cq_gemm8_wgmma_cuda(&a, device, s, &launched));
    if (launched) return CQ_OK;
  }
  return cq_gemm8_mma_cuda(&a, s);
}

cq_status linear_dynamic(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale, const cq_tensor *bias,
                         const cq_linear_params *p, const cq_format_info *wf, const cq_format_info *af, uint8_t *ws,
                         const ws_layout &L, cq_tensor *y, int device, cudaStream_t s) {
  const int64_t m = cq_rows(x), k = cq_cols(x);
  int cc = 0;
  CQ_TRY(dynamic_capability(af, device, &cc));
  uint8_t *codes = ws + L.codes;
  float *sx = (float *)(ws + L.sx);
  CQ_TRY(cq_act_quant_cuda(x->data, x->dtype, m, k, af, p->act_granularity, codes, L.ldq, sx,
                           (uint32_t *)(ws + L.amax), s));
  return gemm_dynamic(codes, L.ldq, sx, m, k, w, w_scale, bias, p, wf, af, ws, L, y, device, cc, s);
}

}  // namespace

extern "C" cq_status cq_linear_workspace_cuda(const cq_linear_params *p, int64_t m, int64_t n, size_t *bytes) {
  ws_layout L;
  CQ_TRY(layout_of(p, m, n, &L));
  *bytes = L.total;
  return CQ_OK;
}

extern "C" cq_status cq_linear_cuda(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale,
                                    const cq_tensor *bias, const cq_linear_params *p, const cq_format_info *wf,
                                    const cq_format_info *af, cq_tensor *workspace, cq_tensor *y, void *stream) {
  const int64_t m = cq_rows(x), k = cq_cols(x), n = w->shape[0];
  cudaStream_t s = cq_stream(stream);
  cq_linear_params q = *p;
  q.in_features = k; /* C callers may leave it 0 */
  if (!af && m <= CQ_GEMV_MAX_M) { /* at most CQ_GEMV_MAX_M rows of y: the activation pass costs nothing */
    CQ_TRY(cq_gemv_wo_cuda(x, w, w_scale, bias, &q, wf, y, s));
    return cq_activation_cuda(y->data, y->dtype, m, n, n, q.activation, s);
  }

  ws_layout L;
  CQ_TRY(layout_of(&q, m, n, &L));
  uint8_t *ws;
  CQ_TRY(check_workspace(workspace, L.total, x, &ws));
  const int device = x->device_id;
  if (!af) return linear_weight_only(x, w, w_scale, bias, &q, wf, ws, L, y, device, s);
  return linear_dynamic(x, w, w_scale, bias, &q, wf, af, ws, L, y, device, s);
}

extern "C" cq_status cq_linear_quantized_cuda(const cq_tensor *x_codes, const cq_tensor *x_scale, const cq_tensor *w,
                                              const cq_tensor *w_scale, const cq_tensor *bias,
                                              const cq_linear_params *p, const cq_format_info *wf,
                                              const cq_format_info *af, cq_tensor *workspace, cq_tensor *y,
                                              void *stream) {
  const int64_t m = cq_rows(x_codes), k = cq_cols(x_codes), n = w->shape[0];
  cudaStream_t s = cq_stream(stream);
  /* the GEMMs read activation rows with 16-byte loads straight from x_codes */
  if (k % 16 || (uintptr_t)x_codes->data % 16)
    return cq_fail(CQ_ERR_UNSUPPORTED, "linear_quantized on CUDA needs in_features %% 16 == 0 and x_codes on a "
                   "16-byte boundary (in_features = %lld); use linear, which pads", (long long)k);
  cq_linear_params q = *p;
  q.in_features = k;
  int cc = 0;
  CQ_TRY(dynamic_capability(af, x_codes->device_id, &cc));
  ws_layout L;
  CQ_TRY(layout_of(&q, m, n, &L));
  uint8_t *ws;
  CQ_TRY(check_workspace(workspace, L.total, x_codes, &ws));
  const float *sx = (const float *)x_scale->data;
  if (p->act_granularity == CQ_GRANULARITY_TENSOR) { /* the GEMMs take one scale per row */
    fill_kernel<<<grid_for(m), 256, 0, s>>>(sx, m, (float *)(ws + L.sx));
    CQ_LAUNCH_CHECK(fill_kernel);
    sx = (const float *)(ws + L.sx);
  }
  return gemm_dynamic((const uint8_t *)x_codes->data, k, sx, m, k, w, w_scale, bias, &q, wf, af, ws, L, y,
                      x_codes->device_id, cc, s);
}
