/* Quantized linear layers on the GPU: workspace layout and the dispatch of
 * each scheme (see cquant.h for the math).
 *
 *   weight-only, M <= CQ_GEMV_MAX_M   cq_gemv_wo_cuda: reads the stored weight once, scale,
 *                                     bias and activation in its fp32 epilogue
 *   weight-only, larger M             bf16/f16 x on sm_90a, where its measured choice takes the
 *                                     shape: cq_gemm_wo_sm90_cuda (gemm_wo_sm90.cu), codes decoded
 *                                     in registers into wgmma, scale in its fp32 epilogue; else
 *                                     cq_wo_gemm_cuda (wo_gemm.cu): exact decoded rows chunk by
 *                                     chunk, cuBLASLt GEMM into fp32, our fp32 epilogue (4-bit
 *                                     w': cuBLASLt's bias epilogue writes y)
 *   int8dq                            activation quantization, then the int8 GEMM with
 *                                     the scale/bias epilogue (wgmma on sm_90a, else
 *                                     mma.sync on sm_80+)
 *   two-level int4 (int4dq_2l)        activation quantization, then the sm_90a W4A8 GEMM where it
 *                                     takes the problem; else the weight rows decoded to int8
 *                                     q8 = s2 * code (and s1, NaN for a row with a bad s2) into the
 *                                     workspace chunk by chunk, and int8dq's GEMM
 *   4-bit weights per group           weight-only, M <= CQ_GEMV_MAX_M: cq_gemv_group4_cuda;
 *   (int4wo, int4dq, fp8da_int4w)     bf16/f16 x, wide layers and few rows (group4_decodes): the
 *                                     mixed-input GEMM (sm_90a wgmma where it takes the problem,
 *                                     else mma.sync); other layers, and f32 x: the weight-only GEMM
 *                                     (w' dequantized into the workspace, cuBLASLt); dynamic: activation
 *                                     quantization, then the mixed-input GEMM (int8 / fp8 e4m3
 *                                     codes x int4 weights)
 *   fp8 dynamic (fp8dqrow, fp8dq)     activation quantization, then cuBLASLt's fp8 GEMM
 *                                     with outer-vector (or scalar) scales and the bias
 *                                     (and GELU) epilogue on sm_90+; elsewhere, for shapes
 *                                     cuBLASLt does not take, for an f32 bias with a 16-bit y
 *                                     (cuBLASLt would round it to y's type) and where it has no
 *                                     GELU epilogue, the mma.sync fp8 kernel (fp32 epilogue)
 *
 * Gated layers (cq_linear_gated: residual + gate * v) and row-strided y (column slices of a wider
 * tensor) go every way above: cquant's epilogues read gate and residual per element (fp32, one
 * rounding); cuBLASLt's fp8 GEMM gets the gate folded into its per-row weight scales and bias
 * (sw[n] * gate[g, n], b[n] * gate[g, n] in y's type, computed into the workspace) and the
 * residual as its C matrix (beta = 1, C may be y), one GEMM per sample g. cuBLASLt adds C before
 * its GELU, so gated layers with a GELU take the mma.sync kernel.
 *
 * The 8-bit GEMMs read weight rows with 16-byte loads (TMA, cp.async): a weight whose K is not
 * a multiple of 16, or whose address is not 16-byte aligned, is copied into the workspace, at
 * most kPadChunkBytes of rows at a time, and the GEMMs run chunk by chunk over those rows.
 *
 * Everything is enqueued on the caller's stream into the caller's workspace:
 * no allocation, no synchronization (CUDA-graph capturable).
 *
 * Switches (cq_settings, csrc/settings.c): CQUANT_DISABLE_WGMMA, CQUANT_DISABLE_CUBLASLT_FP8,
 * CQUANT_WO_CHUNK_MB, CQUANT_GROUP4_DECODE_M, CQUANT_WO_DECODE_M, CQUANT_CUBLASLT_PATH. */
#include "cublaslt.h"
#include "linear_impl.cuh"
#include "quantize_group.cuh"

namespace {

constexpr size_t kAlign = 256;
/* Bytes of padded 8-bit weight rows the workspace holds (a few GEMM chunks for the largest
 * layers, all rows of most). */
constexpr int64_t kPadChunkBytes = (int64_t)16 << 20;
/* Whether a 4-bit weight-only layer with bf16 / f16 x and m > CQ_GEMV_MAX_M rows dequantizes w' into
 * the workspace and runs cuBLASLt rather than the mixed-input GEMM. The mixed GEMM decodes every
 * weight tile once per tile of rows, so it falls behind as M grows; at few rows its time grows with
 * K (no split of K), the dequantization's with N K, so it stays ahead only for wide layers. Measured
 * on an H200 (benchmarks/results/int4_large_m_h200.md): with 3072 x 12288 the mixed GEMM wins up to
 * 256 rows, with 3072 x 3072, 12288 x 3072 and 15360 x 3072 the dequantized rows win from 32 on.
 * CQUANT_GROUP4_DECODE_M, when set, is the row count alone. */
constexpr int64_t kGroup4DecodeMinM = 384;
bool group4_decodes(int64_t m, int64_t n, int64_t k) {
  const int64_t rows = cq_settings_now().group4_decode_min_m;
  if (rows > 0) return m >= rows;
  return m >= kGroup4DecodeMinM || n < 4 * k;
}

size_t align_up(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }
int64_t round16(int64_t k) { return (k + 15) / 16 * 16; }

/* Offsets of the workspace regions of one call (0 size = region unused). */
struct ws_layout {
  size_t codes, sx, amax, sw_vec, gbias, wpad, s1, lt, wo, split, total;
  size_t wo_bytes;  /* of the wo region */
  int64_t ldq;      /* row stride of activation codes and of padded weight rows */
  int64_t pad_rows; /* weight rows the padded region holds (a multiple of 256, or all of them) */
};

cq_status layout_of(const cq_linear_params *p, int64_t m, int64_t n, ws_layout *L) {
  const int64_t k = p->in_features;
  if (k < 1)
    return cq_fail(CQ_ERR_INVALID_ARG, "in_features = %lld; the CUDA workspace size needs K >= 1", (long long)k);
  const cq_format_info *wf = cq_format_get(p->weight_format);
  if (!wf) return cq_fail(CQ_ERR_INVALID_ARG, "weight_format = %d is not a cquant format", p->weight_format);
  *L = ws_layout{};
  L->ldq = round16(k);
  size_t off = 0;
  auto take = [&](size_t bytes) {
    size_t at = off;
    off += align_up(bytes);
    return at;
  };
  const bool dynamic = p->act_format != CQ_FORMAT_NONE;
  /* padded (or decoded) 8-bit weight rows: kPadChunkBytes at most, a multiple of 256 rows */
  int64_t rows = kPadChunkBytes / L->ldq;
  rows = rows >= 256 ? rows / 256 * 256 : rows < 1 ? 1 : rows;
  if (dynamic && p->weight_granularity == CQ_GRANULARITY_TWO_LEVEL) {
    /* the sm_90a kernel reads the packed weight in place (split region for its split K); the
     * fallback decodes rows q8 and their s1 for int8dq's GEMM */
    L->codes = take((size_t)(m * L->ldq));
    L->sx = take((size_t)m * sizeof(float));
    L->amax = take(sizeof(uint32_t));
    L->split = take(cq_w4a8_2l_split_bytes(m, n));
    L->pad_rows = rows < n ? rows : n;
    L->wpad = take((size_t)(L->pad_rows * L->ldq));
    L->s1 = take((size_t)L->pad_rows * sizeof(float));
  } else if (dynamic && p->weight_granularity == CQ_GRANULARITY_GROUP) {
    /* the mixed-input GEMM reads the packed weight in place: codes and scales of x only */
    L->codes = take((size_t)(m * L->ldq));
    L->sx = take((size_t)m * sizeof(float));
    L->amax = take(sizeof(uint32_t));
    L->split = take(cq_gemm_mixed_split_bytes(m, n));
  } else if (dynamic) {
    const bool fp8 = p->act_format != CQ_FORMAT_INT8;
    L->codes = take((size_t)(m * L->ldq));
    L->sx = take((size_t)m * sizeof(float));
    L->amax = take(sizeof(uint32_t));
    if (fp8) {
      /* per-row weight scales for cuBLASLt (a per-tensor scale spread, or folded with a gate) and
       * a gated layer's folded bias (y's type, at most 4 bytes): the same size function serves
       * cq_linear, cq_linear_quantized and cq_linear_gated */
      L->sw_vec = take((size_t)n * sizeof(float));
      L->gbias = take((size_t)n * sizeof(float));
    }
    /* always there (the weight's address is not known here), bounded */
    L->pad_rows = rows < n ? rows : n;
    L->wpad = take((size_t)(L->pad_rows * L->ldq));
    if (fp8) L->lt = take(CQ_LT_WORKSPACE_BYTES);
  } else if (m > CQ_GEMV_MAX_M) {
    L->wo_bytes = cq_wo_gemm_workspace(wf, m, n, k);
    L->wo = take(L->wo_bytes);
    if (p->weight_granularity == CQ_GRANULARITY_GROUP) L->split = take(cq_gemm_mixed_split_bytes(m, n));
  }
  L->total = off;
  return CQ_OK;
}

/* ---- small helper kernels ---- */

/* Rows [row0, row0 + rows) of W (row stride k) -> [rows, ldq] with zeros in [k, ldq). */
__global__ void pad_rows_kernel(const uint8_t *__restrict__ w, int64_t row0, int64_t rows, int64_t k, int64_t ldq,
                                uint8_t *__restrict__ out) {
  const int64_t total = rows * ldq;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / ldq, j = i - r * ldq;
    out[i] = j < k ? w[(row0 + r) * k + j] : 0;
  }
}

__global__ void fill_kernel(const float *__restrict__ src, int64_t n, float *__restrict__ out) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = src[0];
}

/* The gate of one sample folded into cuBLASLt's per-row weight scales and bias:
 *   scale[j] = sw[j * sw_stride] * gate[j],  bias_out[j] = bias[j] * gate[j] rounded to T (y's type,
 * the type cuBLASLt reads its bias in); bias_out is not written when bias is NULL. */
template <typename T>
__global__ void fold_gate_kernel(const float *__restrict__ sw, int sw_stride, const void *__restrict__ bias,
                                 cq_dtype bias_dtype, const void *__restrict__ gate, cq_dtype gate_dtype, int64_t n,
                                 float *__restrict__ scale, T *__restrict__ bias_out) {
  for (int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; j < n; j += (int64_t)gridDim.x * blockDim.x) {
    const float g = cq_load_any(gate, gate_dtype, j);
    scale[j] = __fmul_rn(sw[j * sw_stride], g);
    if (bias) bias_out[j] = cq_from_float<T>(__fmul_rn(cq_load_any(bias, bias_dtype, j), g));
  }
}

unsigned grid_for(int64_t work) {
  int64_t g = (work + 255) / 256;
  return (unsigned)(g < 1 ? 1 : g > 8192 ? 8192 : g);
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

/* ---- dynamic activations ---- */

/* Rows [r0, m) of a GEMM: the same problem for the rows of x from r0 on (r0 a multiple of
 * rows_per_sample for a gated one). */
cq_gemm8_args rows_from(const cq_gemm8_args &a, int64_t r0) {
  cq_gemm8_args b = a;
  const int64_t ysize = (int64_t)cq_dtype_size(a.y_dtype);
  b.a = a.a + r0 * a.lda;
  b.m = a.m - r0;
  b.sa = a.sa + r0;
  b.y = static_cast<char *>(a.y) + r0 * a.ldy * ysize;
  if (a.gate) {
    b.gate = static_cast<const char *>(a.gate) + (r0 / a.rows_per_sample) * a.ldg * (int64_t)cq_dtype_size(a.gate_dtype);
    b.residual = static_cast<const char *>(a.residual) + r0 * a.ldr * ysize;
  }
  return b;
}

/* fp8 x fp8 through cuBLASLt (sm_90+: outer-vector scales; scalar scales per tensor), for the
 * weight rows of `a` (a chunk: a.n of them, y's row stride a.ldy). A gated layer runs one GEMM
 * per sample, its gate folded into the weight scales and the bias, the residual as C; *rows_done
 * says how many rows of x are finished (their residual may be updated in place already) when a
 * later sample fails. CQ_ERR_UNSUPPORTED when cuBLASLt cannot take the problem exactly as
 * cquant.h says: then the mma.sync kernel runs the rows not done. */
cq_status fp8_cublaslt(const cq_gemm8_args &a, const cq_linear_params *p, const float *sw_vec, uint8_t *ws,
                       const ws_layout &L, int cc, int device, cudaStream_t s, int64_t *rows_done) {
  *rows_done = 0;
  if (a.y_dtype == CQ_DTYPE_F32 || a.n % 16 || a.m > 0x7fffffffLL || cq_settings_now().disable_cublaslt_fp8)
    return cq_fail(CQ_ERR_UNSUPPORTED, "fp8 GEMM shape or dtype outside cuBLASLt's fp8 kernels");
  /* cuBLASLt reads the bias in y's type: it would round an f32 one (a gated layer's folded bias is
   * rounded to y's type anyway: cquant.h allows that one rounding) */
  if (a.bias && a.bias_dtype != a.y_dtype && !a.gate)
    return cq_fail(CQ_ERR_UNSUPPORTED, "cuBLASLt's fp8 GEMM takes a bias in y's dtype only");
  if (a.gate && (a.activation != CQ_ACTIVATION_NONE || cc < CQ_CC_FP8_CUBLASLT_ROW))
    return cq_fail(CQ_ERR_UNSUPPORTED, "cuBLASLt adds C before its GELU, and folds a gate into per-row scales (sm_90+) only");
  /* each sample's activation scales start where the whole vector's did: on a 16-byte boundary */
  if (a.gate && a.rows_per_sample < a.m && (a.rows_per_sample % 4 || (uintptr_t)a.sa % 16))
    return cq_fail(CQ_ERR_UNSUPPORTED, "per-sample fp8 GEMMs need 16-byte aligned activation scales");
  cq_lt_gemm g = {};
  const bool both_tensor = p->act_granularity == CQ_GRANULARITY_TENSOR && p->weight_granularity == CQ_GRANULARITY_TENSOR;
  if (both_tensor && !a.gate) {
    g.scale_mode = CQ_LT_SCALE_SCALAR;
    g.a_scale = a.sb, g.b_scale = a.sa;
  } else {
    if (cc < CQ_CC_FP8_CUBLASLT_ROW) return cq_fail(CQ_ERR_UNSUPPORTED, "cuBLASLt's per-row fp8 scales need sm_90+");
    g.scale_mode = CQ_LT_SCALE_OUTER_VEC; /* sa holds one scale per row of x, per tensor too */
    g.a_scale = a.sb_stride ? a.sb : sw_vec, g.b_scale = a.sa;
  }
  g.m = a.n, g.n = a.m, g.k = a.kpad;
  g.a_type = a.b_format == CQ_FORMAT_FP8_E5M2 ? CQ_DTYPE_F8_E5M2 : CQ_DTYPE_F8_E4M3FN;
  g.b_type = a.a_format == CQ_FORMAT_FP8_E5M2 ? CQ_DTYPE_F8_E5M2 : CQ_DTYPE_F8_E4M3FN;
  g.d_type = a.y_dtype;
  g.trans_a = 1, g.trans_b = 0;
  g.lda = a.ldb, g.ldb = a.lda, g.ldd = a.ldy;
  g.a = a.b, g.b = a.a, g.d = a.y;
  g.bias = a.bias, g.bias_type = a.y_dtype;
  g.gelu = a.activation == CQ_ACTIVATION_GELU_TANH; /* no GELU epilogue for the problem: unsupported */
  g.workspace = ws + L.lt, g.workspace_bytes = CQ_LT_WORKSPACE_BYTES;
  g.device = device;
  if (!a.gate) return cq_lt_matmul(&g, s);

  /* gated: y[rows of sample] = (sw * gate) * sx * acc + residual + b * gate, one GEMM per sample */
  float *scale = (float *)(ws + L.sw_vec);
  void *bias = ws + L.gbias;
  const int64_t rps = a.rows_per_sample;
  for (int64_t r0 = 0; r0 < a.m; r0 += rps) {
    const cq_gemm8_args r = rows_from(a, r0);
    const unsigned grid = grid_for(a.n);
    CQ_DISPATCH_FLOAT(a.y_dtype, T,
                      fold_gate_kernel<T><<<grid, 256, 0, s>>>(a.sb, a.sb_stride, a.bias, a.bias_dtype, r.gate,
                                                               a.gate_dtype, a.n, scale, static_cast<T *>(bias)));
    CQ_LAUNCH_CHECK(fold_gate_kernel);
    g.a_scale = scale, g.b_scale = r.sa;
    g.n = rps, g.b = r.a, g.d = r.y;
    g.c = r.residual, g.ldc = a.ldr;
    g.bias = a.bias ? bias : NULL;
    CQ_TRY(cq_lt_matmul(&g, s));
    *rows_done = r0 + rps;
  }
  return CQ_OK;
}

/* Compute capability of the device, checked against the scheme's floor. */
cq_status dynamic_capability(const cq_format_info *af, int device, int *cc) {
  if (af->id == CQ_FORMAT_INT8)
    return cq_require_cc(device, CQ_MIN_CC_INT8_DYNAMIC, "int8 activations (int8dq: int8 tensor cores)", cc);
  return cq_require_cc(device, CQ_MIN_CC_FP8_DYNAMIC, "fp8 activations (fp8 tensor cores)", cc);
}

/* One GEMM over the weight rows of `a`: cuBLASLt or wgmma where they apply, else mma.sync. */
cq_status gemm8(const cq_gemm8_args &a, const cq_linear_params *p, const float *sw_vec, uint8_t *ws,
                const ws_layout &L, int device, int cc, cudaStream_t s) {
  if (a.a_format != CQ_FORMAT_INT8) {
    int64_t done = 0;
    cq_status st = fp8_cublaslt(a, p, sw_vec, ws, L, cc, device, s, &done);
    if (st != CQ_ERR_UNSUPPORTED) return st; /* done, or a real failure */
    if (done) { /* the samples cuBLASLt did not take */
      const cq_gemm8_args rest = rows_from(a, done);
      return cq_gemm8_mma_cuda(&rest, s);
    }
  } else {
    int launched = 0;
    CQ_TRY(cq_gemm8_wgmma_cuda(&a, device, s, &launched));
    if (launched) return CQ_OK;
  }
  return cq_gemm8_mma_cuda(&a, s);
}

/* y from activation codes [m, ldq] (16-byte aligned rows) and their per-row scales sx [m]. The
 * weight is read in place when its rows are 16-byte aligned, else padded into the workspace
 * and multiplied chunk by chunk of L.pad_rows rows. */
cq_status gemm_dynamic(const uint8_t *codes, int64_t ldq, const float *sx, int64_t m, int64_t k, const cq_tensor *w,
                       const cq_tensor *w_scale, const cq_tensor *bias, const cq_linear_params *p,
                       const cq_format_info *wf, const cq_format_info *af, uint8_t *ws, const ws_layout &L,
                       const cq_linear_out &out, int device, int cc, cudaStream_t s) {
  const int64_t n = w->shape[0];
  const bool two_level = p->weight_granularity == CQ_GRANULARITY_TWO_LEVEL; /* rows decoded to int8 */
  const bool in_place = !two_level && k % 16 == 0 && (uintptr_t)w->data % 16 == 0;
  const float *sw = (const float *)w_scale->data;
  const float *sw_vec = NULL;
  if (af->id != CQ_FORMAT_INT8 && p->weight_granularity == CQ_GRANULARITY_TENSOR) {
    /* cuBLASLt's per-row scales want the per-tensor weight scale as a vector */
    fill_kernel<<<grid_for(n), 256, 0, s>>>(sw, n, (float *)(ws + L.sw_vec));
    CQ_LAUNCH_CHECK(fill_kernel);
    sw_vec = (const float *)(ws + L.sw_vec);
  }
  const int64_t chunk = in_place ? n : L.pad_rows;
  const size_t ysize = cq_dtype_size(out.y_dtype), bsize = bias ? cq_dtype_size(bias->dtype) : 0;
  const size_t gsize = out.gate ? cq_dtype_size(out.gate_dtype) : 0;
  for (int64_t row0 = 0; row0 < n; row0 += chunk) {
    const int64_t cnt = n - row0 < chunk ? n - row0 : chunk;
    cq_gemm8_args a = {};
    if (in_place) {
      a.b = (const uint8_t *)w->data, a.ldb = k;
    } else if (two_level) {
      CQ_TRY(cq_two_level_q8_rows_cuda((const uint8_t *)w->data, cq_packed_row_bytes(wf, k), sw, p->weight_group_size,
                                       row0, cnt, k, L.ldq, (int8_t *)(ws + L.wpad), (float *)(ws + L.s1), s));
      a.b = ws + L.wpad, a.ldb = L.ldq;
    } else {
      pad_rows_kernel<<<grid_for(cnt * L.ldq), 256, 0, s>>>((const uint8_t *)w->data, row0, cnt, k, L.ldq, ws + L.wpad);
      CQ_LAUNCH_CHECK(pad_rows_kernel);
      a.b = ws + L.wpad, a.ldb = L.ldq;
    }
    a.a = codes, a.lda = ldq;
    a.m = m, a.n = cnt, a.kpad = L.ldq;
    a.sa = sx;
    a.sb_stride = p->weight_granularity == CQ_GRANULARITY_TENSOR ? 0 : 1;
    a.sb = two_level ? (const float *)(ws + L.s1) : sw + (a.sb_stride ? row0 : 0);
    a.bias = bias ? (const uint8_t *)bias->data + row0 * bsize : NULL;
    a.bias_dtype = bias ? bias->dtype : CQ_DTYPE_F32;
    a.y = (uint8_t *)out.y + row0 * ysize, a.ldy = out.ldy, a.y_dtype = out.y_dtype;
    a.a_format = af->id, a.b_format = two_level ? CQ_FORMAT_INT8 : wf->id;
    a.activation = p->activation;
    if (out.gate) { /* columns [row0, row0 + cnt) of gate and residual */
      a.gate = (const uint8_t *)out.gate + row0 * gsize, a.gate_dtype = out.gate_dtype;
      a.ldg = out.ldg, a.rows_per_sample = out.rows_per_sample;
      a.residual = (const uint8_t *)out.residual + row0 * ysize, a.ldr = out.ldr;
    }
    CQ_TRY(gemm8(a, p, sw_vec ? sw_vec + row0 : NULL, ws, L, device, cc, s));
  }
  return CQ_OK;
}

/* x's dynamic codes [m, L.ldq] and per-row scales, into the workspace (after the scheme's floor). */
cq_status quantize_x(const cq_tensor *x, const cq_linear_params *p, const cq_format_info *af, uint8_t *ws,
                     const ws_layout &L, int device, cudaStream_t s, int *cc, uint8_t **codes, float **sx) {
  CQ_TRY(dynamic_capability(af, device, cc));
  *codes = ws + L.codes;
  *sx = (float *)(ws + L.sx);
  return cq_act_quant_cuda(x->data, x->dtype, cq_rows(x), cq_cols(x), af, p->act_granularity, *codes, L.ldq, *sx,
                           (uint32_t *)(ws + L.amax), s);
}

cq_status linear_dynamic(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale, const cq_tensor *bias,
                         const cq_linear_params *p, const cq_format_info *wf, const cq_format_info *af, uint8_t *ws,
                         const ws_layout &L, const cq_linear_out &out, int device, cudaStream_t s) {
  int cc = 0;
  uint8_t *codes;
  float *sx;
  CQ_TRY(quantize_x(x, p, af, ws, L, device, s, &cc, &codes, &sx));
  return gemm_dynamic(codes, L.ldq, sx, cq_rows(x), cq_cols(x), w, w_scale, bias, p, wf, af, ws, L, out, device, cc, s);
}

/* ---- 4-bit weights per group ---- */

/* The mixed-input GEMMs' operands for weights w (packed rows) and their scales (per group, per row
 * or per tensor, as p says). */
cq_mixed_args mixed_of(const cq_tensor *w, const cq_tensor *w_scale, const cq_tensor *bias,
                       const cq_linear_params *p, const cq_format_info *wf, int64_t m, int64_t k,
                       const cq_linear_out &out) {
  cq_mixed_args g = {};
  g.w = (const uint8_t *)w->data, g.ldw = cq_packed_row_bytes(wf, k), g.w_format = wf->id;
  g.sw = (const float *)w_scale->data, g.w_granularity = p->weight_granularity;
  g.group_size = cq_granularity_grouped(p->weight_granularity) ? p->weight_group_size : 0;
  g.m = m, g.n = w->shape[0], g.k = k;
  g.bias = bias ? bias->data : NULL, g.bias_dtype = bias ? bias->dtype : CQ_DTYPE_F32;
  g.activation = p->activation;
  g.out = out;
  return g;
}

/* The wgmma kernel where it takes the problem, else mma.sync (which may split K over the
 * workspace's split region). */
cq_status gemm_mixed(cq_mixed_args g, int device, uint8_t *ws, const ws_layout &L, cudaStream_t s) {
  g.device = device;
  g.split_ws = L.split ? (float *)(ws + L.split) : NULL;
  g.split_ws_bytes = L.split ? cq_gemm_mixed_split_bytes(g.m, g.n) : 0;
  int launched = 0;
  CQ_TRY(cq_gemm_mixed_sm90_cuda(&g, device, s, &launched));
  if (launched) return CQ_OK;
  return cq_gemm_mixed_mma_cuda(&g, s);
}

/* The grouped layer from activation codes [m, ldq] (16-byte aligned rows) and scales sx [m]. */
cq_status group4_dynamic(const uint8_t *codes, int64_t ldq, const float *sx, int64_t m, int64_t k,
                         const cq_tensor *w, const cq_tensor *w_scale, const cq_tensor *bias,
                         const cq_linear_params *p, const cq_format_info *wf, const cq_format_info *af,
                         uint8_t *ws, const ws_layout &L, const cq_linear_out &out, int device, cudaStream_t s) {
  cq_mixed_args g = mixed_of(w, w_scale, bias, p, wf, m, k, out);
  g.a = codes, g.lda = ldq, g.sa = sx;
  g.a_format = af->id, g.a_dtype = af->id == CQ_FORMAT_INT8 ? CQ_DTYPE_I8 : CQ_DTYPE_F8_E4M3FN;
  return gemm_mixed(g, device, ws, L, s);
}

/* Two-level int4 from int8 codes [m, ldq] and sx [m]: the sm_90a kernel where it takes the problem,
 * else the rows decoded to int8 for int8dq's GEMM (gemm_dynamic). */
cq_status two_level_dynamic(const uint8_t *codes, int64_t ldq, const float *sx, int64_t m, int64_t k,
                            const cq_tensor *w, const cq_tensor *w_scale, const cq_tensor *bias,
                            const cq_linear_params *p, const cq_format_info *wf, const cq_format_info *af,
                            uint8_t *ws, const ws_layout &L, const cq_linear_out &out, int device, int cc,
                            cudaStream_t s) {
  if (m > 0) {
    cq_mixed_args g = mixed_of(w, w_scale, bias, p, wf, m, k, out);
    g.a = codes, g.lda = ldq, g.sa = sx, g.a_format = CQ_FORMAT_INT8, g.a_dtype = CQ_DTYPE_I8;
    g.device = device;
    g.split_ws = L.split ? (float *)(ws + L.split) : NULL;
    g.split_ws_bytes = L.split ? cq_w4a8_2l_split_bytes(m, g.n) : 0;
    int launched = 0;
    CQ_TRY(cq_gemm_w4a8_2l_sm90_cuda(&g, device, s, &launched));
    if (launched) return CQ_OK;
  }
  return gemm_dynamic(codes, ldq, sx, m, k, w, w_scale, bias, p, wf, af, ws, L, out, device, cc, s);
}

/* cq_linear / cq_linear_gated with 4-bit weights per group. */
cq_status linear_group4(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale, const cq_tensor *bias,
                        const cq_linear_params *p, const cq_format_info *wf, const cq_format_info *af,
                        cq_tensor *workspace, const cq_linear_out &out, cudaStream_t s) {
  const int64_t m = cq_rows(x), k = cq_cols(x), n = w->shape[0];
  const int device = x->device_id;
  if (!af && m <= CQ_GEMV_MAX_M) return cq_gemv_group4_cuda(x, w, w_scale, bias, p, wf, &out, s);
  ws_layout L{};
  CQ_TRY(layout_of(p, m, n, &L));
  uint8_t *ws;
  CQ_TRY(check_workspace(workspace, L.total, x, &ws));
  if (!af) {
    CQ_TRY(cq_require_cc(device, CQ_MIN_CC_WEIGHT_ONLY, "weight-only layers on CUDA", NULL));
    /* f32 x: w' is not rounded, which no 16-bit tensor core takes; operands off their 16-byte
     * boundaries: the mixed-input GEMMs load 16 bytes at a time. Both take the decode path, as do
     * the layers group4_decodes gives it. */
    if (x->dtype == CQ_DTYPE_F32 || (uintptr_t)x->data % 16 || (uintptr_t)w->data % 16 || group4_decodes(m, n, k))
      return cq_wo_gemm_cuda(x, w, w_scale, bias, p, wf, ws + L.wo, &out, device, s);
    cq_mixed_args g = mixed_of(w, w_scale, bias, p, wf, m, k, out);
    g.a = x->data, g.a_dtype = x->dtype, g.lda = k, g.a_format = CQ_FORMAT_NONE;
    return gemm_mixed(g, device, ws, L, s);
  }
  int cc = 0;
  uint8_t *codes;
  float *sx;
  CQ_TRY(quantize_x(x, p, af, ws, L, device, s, &cc, &codes, &sx));
  return group4_dynamic(codes, L.ldq, sx, m, k, w, w_scale, bias, p, wf, af, ws, L, out, device, s);
}

/* y as the epilogues write it: its row stride (checked by ops_check.c), no gate. */
cq_linear_out plain_out(cq_tensor *y) {
  cq_linear_out o = {};
  o.y = y->data, o.y_dtype = y->dtype, o.ldy = cq_cols(y);
  (void)cq_check_row_strided(y, "y", &o.ldy); /* checked before: cannot fail */
  return o;
}

/* Every scheme of cq_linear and cq_linear_gated: the GEMV, the weight-only GEMM or the 8-bit GEMMs. */
cq_status linear_any(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale, const cq_tensor *bias,
                     const cq_linear_params *p, const cq_format_info *wf, const cq_format_info *af,
                     cq_tensor *workspace, const cq_linear_out &out, void *stream) {
  const int64_t m = cq_rows(x), k = cq_cols(x), n = w->shape[0];
  cudaStream_t s = cq_stream(stream);
  cq_linear_params q = *p;
  q.in_features = k; /* C callers may leave it 0 */
  if (q.weight_granularity == CQ_GRANULARITY_GROUP) return linear_group4(x, w, w_scale, bias, &q, wf, af, workspace, out, s);
  if (q.weight_granularity == CQ_GRANULARITY_TWO_LEVEL) {
    ws_layout L{};
    CQ_TRY(layout_of(&q, m, n, &L));
    uint8_t *ws;
    CQ_TRY(check_workspace(workspace, L.total, x, &ws));
    int cc = 0;
    uint8_t *codes;
    float *sx;
    CQ_TRY(quantize_x(x, &q, af, ws, L, x->device_id, s, &cc, &codes, &sx));
    return two_level_dynamic(codes, L.ldq, sx, m, k, w, w_scale, bias, &q, wf, af, ws, L, out, x->device_id, cc, s);
  }
  if (!af && m <= CQ_GEMV_MAX_M) return cq_gemv_wo_cuda(x, w, w_scale, bias, &q, wf, &out, s);

  ws_layout L{};
  CQ_TRY(layout_of(&q, m, n, &L));
  uint8_t *ws;
  CQ_TRY(check_workspace(workspace, L.total, x, &ws));
  const int device = x->device_id;
  if (!af) {
    CQ_TRY(cq_require_cc(device, CQ_MIN_CC_WEIGHT_ONLY, "weight-only layers on CUDA", NULL));
    /* int8 / fp8 / fpX codes: the sm_90a mixed-input GEMM where it takes the layer and its measured
     * choice (gemm_wo_sm90.cu) picks it, else the decoded rows; CQUANT_WO_DECODE_M, when set, is the
     * row count from which the decoded rows run, below it the mixed-input GEMM wherever it can */
    const int64_t decode_rows = cq_settings_now().wo_decode_min_m;
    if (decode_rows <= 0 || m < decode_rows) {
      cq_mixed_args g = mixed_of(w, w_scale, bias, &q, wf, m, k, out);
      g.a = x->data, g.a_dtype = x->dtype, g.lda = k, g.a_format = CQ_FORMAT_NONE, g.device = device;
      /* the decoded rows' region, which this kernel does not use, holds its split K's partial sums */
      g.split_ws = reinterpret_cast<float *>(ws + L.wo), g.split_ws_bytes = L.wo_bytes;
      int launched = 0;
      CQ_TRY(cq_gemm_wo_sm90_cuda(&g, device, s, decode_rows <= 0, &launched));
      if (launched) return CQ_OK;
    }
    return cq_wo_gemm_cuda(x, w, w_scale, bias, &q, wf, ws + L.wo, &out, device, s);
  }
  return linear_dynamic(x, w, w_scale, bias, &q, wf, af, ws, L, out, device, s);
}

}  // namespace

extern "C" cq_status cq_linear_workspace_cuda(const cq_linear_params *p, int64_t m, int64_t n, size_t *bytes) {
  ws_layout L{};
  CQ_TRY(layout_of(p, m, n, &L));
  *bytes = L.total;
  return CQ_OK;
}

extern "C" cq_status cq_linear_cuda(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale,
                                    const cq_tensor *bias, const cq_linear_params *p, const cq_format_info *wf,
                                    const cq_format_info *af, cq_tensor *workspace, cq_tensor *y, void *stream) {
  return linear_any(x, w, w_scale, bias, p, wf, af, workspace, plain_out(y), stream);
}

extern "C" cq_status cq_linear_gated_cuda(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale,
                                          const cq_tensor *bias, const cq_tensor *gate, const cq_tensor *residual,
                                          const cq_gate_layout *gl, const cq_linear_params *p,
                                          const cq_format_info *wf, const cq_format_info *af, cq_tensor *workspace,
                                          cq_tensor *y, void *stream) {
  cq_linear_out out = plain_out(y);
  out.gate = gate->data, out.gate_dtype = gate->dtype, out.ldg = gl->ldg, out.rows_per_sample = gl->rows_per_sample;
  out.residual = residual->data, out.ldr = gl->ldr;
  return linear_any(x, w, w_scale, bias, p, wf, af, workspace, out, stream);
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
  ws_layout L{};
  CQ_TRY(layout_of(&q, m, n, &L));
  uint8_t *ws;
  CQ_TRY(check_workspace(workspace, L.total, x_codes, &ws));
  const float *sx = (const float *)x_scale->data;
  if (p->act_granularity == CQ_GRANULARITY_TENSOR) { /* the GEMMs take one scale per row */
    fill_kernel<<<grid_for(m), 256, 0, s>>>(sx, m, (float *)(ws + L.sx));
    CQ_LAUNCH_CHECK(fill_kernel);
    sx = (const float *)(ws + L.sx);
  }
  if (q.weight_granularity == CQ_GRANULARITY_GROUP)
    return group4_dynamic((const uint8_t *)x_codes->data, k, sx, m, k, w, w_scale, bias, &q, wf, af, ws, L,
                          plain_out(y), x_codes->device_id, s);
  if (q.weight_granularity == CQ_GRANULARITY_TWO_LEVEL)
    return two_level_dynamic((const uint8_t *)x_codes->data, k, sx, m, k, w, w_scale, bias, &q, wf, af, ws, L,
                             plain_out(y), x_codes->device_id, cc, s);
  return gemm_dynamic((const uint8_t *)x_codes->data, k, sx, m, k, w, w_scale, bias, &q, wf, af, ws, L, plain_out(y),
                      x_codes->device_id, cc, s);
}
