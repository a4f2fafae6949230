/* CPU reference of the quantized linear layer y = x W^T + b (see cquant.h).
 * Activations are turned into fp32 (or int8 codes) once; output channels run
 * in parallel, each decoding its weight row once and dotting it with every row. */
#include <stdlib.h>
#include <string.h>

#include "cq_numerics.h"
#include "cquant-impl.h"

/* Fixed 8-way partial sums: vectorizes, and the order never depends on threads. */
static float dot_f32(const float *a, const float *b, int64_t k) {
  float acc[8] = {0};
  int64_t j = 0;
  for (; j + 8 <= k; j += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[j + l] * b[j + l];
  for (; j < k; ++j) acc[0] += a[j] * b[j];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* The int32 sum of int8 products, exact: K <= CQ_LINEAR_INT8_MAX_K (checked) keeps it in range
 * for any codes, -128 included. */
static int32_t dot_i8(const int8_t *a, const int8_t *b, int64_t k) {
  int32_t acc = 0;
  for (int64_t j = 0; j < k; ++j) acc += (int32_t)a[j] * (int32_t)b[j];
  return acc;
}

/* Activation rows of a dynamic scheme from their codes: a = decode(codes), or
 * the int8 codes themselves when both operands are int8 (exact int32 dots);
 * sx gets one scale per row. */
static void expand_codes(const uint8_t *codes, const float *scale, cq_granularity g, const cq_format_info *af,
                         int64_t m, int64_t k, float *a, int8_t *a_i8, float *sx) {
  for (int64_t i = 0; i < m; ++i) sx[i] = scale[g == CQ_GRANULARITY_ROW ? i : 0];
  float lut[256];
  for (uint32_t c = 0; c < 256; ++c) lut[c] = af->decode(af, c);
  for (int64_t i = 0; i < m * k; ++i) {
    if (a_i8) a_i8[i] = (int8_t)codes[i];
    else a[i] = lut[codes[i]];
  }
}

/* Activation rows as fp32 values a[m, :] and scales sx[m] (1 for weight-only):
 * either x itself or decode(quantize(x)) with the math of cq_quantize. */
static cq_status prepare_activations(const cq_tensor *x, const cq_linear_params *p, const cq_format_info *af,
                                     float *a, int8_t *a_i8, float *sx) {
  const int64_t m = cq_rows(x), k = cq_cols(x);
  if (!af) {
#pragma omp parallel for schedule(static) if (m * k >= CQ_OMP_MIN_WORK)
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < k; ++j) a[i * k + j] = cq_load_float(x->data, x->dtype, i * k + j);
      sx[i] = 1.0f;
    }
    return CQ_OK;
  }
  uint8_t *codes = (uint8_t *)cq_alloc(m * k, 1);
  if (!codes) return cq_fail(CQ_ERR_OOM, "linear: no host memory for %lld activation codes", (long long)(m * k));
  cq_tensor q = *x, s = *x;
  q.data = codes;
  q.dtype = af->code_dtype;
  q.readonly = 0;
  s.data = sx;
  s.dtype = CQ_DTYPE_F32;
  s.ndim = 1;
  s.shape[0] = p->act_granularity == CQ_GRANULARITY_ROW ? m : 1;
  s.strides[0] = 1;
  s.readonly = 0;
  cq_quant_params qp = {.format = af->id, .granularity = p->act_granularity, .static_scale = 0};
  cq_status st = cq_quantize_cpu(x, &qp, af, &q, &s);
  if (st == CQ_OK) expand_codes(codes, sx, p->act_granularity, af, m, k, a, a_i8, sx);
  free(codes);
  return st;
}

/* Where the results go: rows of y ldy elements apart and, for a gated layer, the gate and
 * residual its epilogue folds in (gate NULL: a plain layer). */
typedef struct {
  void *y;
  cq_dtype y_dtype;
  int64_t ldy;
  const void *gate;
  cq_dtype gate_dtype;
  int64_t ldg, rows_per_sample;
  const void *residual; /* y's dtype, may be y itself */
  int64_t ldr;
} out_rows;

static out_rows plain_out(cq_tensor *y) {
  out_rows o = {.y = y->data, .y_dtype = y->dtype, .ldy = cq_cols(y)};
  (void)cq_check_row_strided(y, "y", &o.ldy); /* checked by the caller: cannot fail */
  return o;
}

/* How linear_core reads a weight row. */
typedef enum {
  W_DECODED,   /* fp32 values decode(code), one scale per row or tensor (8-bit and fpX weights) */
  W_INT8,      /* int8 codes dotted with int8 activation codes (int8dq) */
  W_GROUP_WO,  /* 4-bit weight-only: dequantized, rounded to x's dtype, scale 1 */
  W_GROUP_I8,  /* int4 codes with int8 activations: exact int32 sums per group (int4dq) */
  W_GROUP_F32, /* int4 codes with fp8 activations: fp32 sums per group (fp8da_int4w) */
  W_TWO_LEVEL, /* two-level int4 decoded to int8 q8 = s2 * code, then as W_INT8 with sw = s1 (int4dq_2l) */
} w_mode;

static w_mode weight_mode(const cq_format_info *wf, const cq_format_info *af, cq_granularity wg) {
  if (wg == CQ_GRANULARITY_TWO_LEVEL) return W_TWO_LEVEL;
  if (cq_format_grouped(wf)) return !af ? W_GROUP_WO : af->id == CQ_FORMAT_INT8 ? W_GROUP_I8 : W_GROUP_F32;
  return af && af->id == CQ_FORMAT_INT8 ? W_INT8 : W_DECODED;
}

/* v rounded to a 16-bit dtype and back (f32: v itself), as the tensor cores take weights. */
static float round_to_dtype(float v, cq_dtype dtype) {
  if (dtype == CQ_DTYPE_BF16) return cq_bf16_to_f32(cq_f32_to_bf16(v));
  if (dtype == CQ_DTYPE_F16) return cq_f16_to_f32(cq_f32_to_f16(v));
  return v;
}

/* Weight row o of a 4-bit format: w' (dequantized, rounded to x_dtype) for weight-only layers,
 * else the int4 codes as fp32 values or int8. */
static void decode_group_row(const cq_format_info *wf, const uint8_t *qrow, const float *sw, int64_t o, int64_t k,
                             int64_t gs, w_mode mode, cq_dtype x_dtype, float *wrow, int8_t *wi8) {
  const int64_t groups = k / gs;
  const int uint4 = wf->id == CQ_FORMAT_UINT4;
  for (int64_t j = 0; j < k; ++j) {
    const uint32_t c = cq_load_bits(qrow, j, 4);
    if (mode == W_GROUP_I8) {
      wi8[j] = (int8_t)cq_int4_decode(c);
    } else if (mode == W_GROUP_F32) {
      wrow[j] = cq_int4_decode(c);
    } else {
      const int64_t g = o * groups + j / gs;
      const float v = uint4 ? cq_uint4_decode(c, sw[2 * g], sw[2 * g + 1]) : cq_int4_decode(c) * sw[g];
      wrow[j] = round_to_dtype(v, x_dtype);
    }
  }
}

/* Two-level weight row o as int8 q8[j] = s2 * code; returns its sw: s1, or NaN when any s2 is
 * not an integer in [0, 16] (that group's q8 are left 0: the whole output column is NaN anyway). */
static float decode_two_level_row(const uint8_t *qrow, const float *sw, int64_t o, int64_t k, int64_t gs, int8_t *q8) {
  const float *s = sw + o * (1 + k / gs);
  int ok = 1;
  for (int64_t j = 0; j < k; ++j) {
    const float s2 = s[1 + j / gs];
    const int good = cq_two_level_s2_ok(s2);
    ok &= good;
    q8[j] = good ? (int8_t)cq_two_level_q8(cq_load_bits(qrow, j, 4), s2) : 0;
  }
  return ok ? s[0] : cq_f32_from_bits(0x7fc00000u);
}

/* y = act((a W^T) * sx * sw + b), or residual + gate * that, over prepared activation rows;
 * x_dtype is the dtype the activations came in (4-bit weight-only layers round w' to it). */
static cq_status linear_core(const float *a, const int8_t *a_i8, const float *sx, int64_t m, int64_t k,
                             const cq_tensor *w, const cq_tensor *w_scale, const cq_tensor *bias,
                             const cq_linear_params *p, const cq_format_info *wf, const cq_format_info *af,
                             cq_dtype x_dtype, const out_rows *out) {
  const int64_t n = w->shape[0];
  const int64_t w_row_bytes = cq_packed_row_bytes(wf, k);
  const w_mode mode = weight_mode(wf, af, p->weight_granularity);
  const int grouped = mode == W_GROUP_WO || mode == W_GROUP_I8 || mode == W_GROUP_F32;
  const int64_t gs = grouped || mode == W_TWO_LEVEL ? p->weight_group_size : k, groups = k / gs;
  const int need_f32 = mode != W_INT8 && mode != W_GROUP_I8 && mode != W_TWO_LEVEL;
  const int need_i8 = mode == W_GROUP_I8 || mode == W_TWO_LEVEL;
  const float *sw = (const float *)w_scale->data;
  float lut[256];
  for (uint32_t c = 0; c < 256; ++c) lut[c] = c < (1u << wf->bits) ? wf->decode(wf, c) : 0.0f;

  int oom = 0;
#pragma omp parallel if (m * n * k >= CQ_OMP_MIN_WORK)
  {
    /* one decoded weight row per thread */
    float *wrow = need_f32 ? (float *)cq_alloc(k, sizeof(float)) : NULL;
    int8_t *wi8 = need_i8 ? (int8_t *)cq_alloc(k, 1) : NULL;
    const int have = (!need_f32 || wrow) && (!need_i8 || wi8);
    if (!have) {
#pragma omp atomic write
      oom = 1;
    }
#pragma omp for schedule(dynamic, 4)
    for (int64_t o = 0; o < n; ++o) {
      if (!have) continue;
      const uint8_t *qrow = (const uint8_t *)w->data + o * w_row_bytes;
      /* 4-bit weight-only rows carry their scales; dynamic ones apply them per group below */
      float s_w = grouped ? 1.0f : mode == W_TWO_LEVEL ? 0.0f : sw[p->weight_granularity == CQ_GRANULARITY_ROW ? o : 0];
      if (grouped)
        decode_group_row(wf, qrow, sw, o, k, gs, mode, x_dtype, wrow, wi8);
      else if (mode == W_TWO_LEVEL)
        s_w = decode_two_level_row(qrow, sw, o, k, gs, wi8);
      else if (mode == W_DECODED)
        for (int64_t j = 0; j < k; ++j) wrow[j] = lut[cq_load_code(wf, qrow, j)];
      float b = bias ? cq_load_float(bias->data, bias->dtype, o) : 0.0f;
      for (int64_t i = 0; i < m; ++i) {
        float acc;
        if (mode == W_INT8 || mode == W_TWO_LEVEL) {
          acc = (float)dot_i8(a_i8 + i * k, mode == W_INT8 ? (const int8_t *)qrow : wi8, k);
        } else if (mode == W_GROUP_I8 || mode == W_GROUP_F32) {
          /* sum_g acc_g * sw[o, g], in group order */
          acc = 0.0f;
          for (int64_t g = 0; g < groups; ++g) {
            const float acc_g = mode == W_GROUP_I8 ? (float)dot_i8(a_i8 + i * k + g * gs, wi8 + g * gs, gs)
                                                   : dot_f32(a + i * k + g * gs, wrow + g * gs, gs);
            acc += acc_g * sw[o * groups + g];
          }
        } else {
          acc = dot_f32(a + i * k, wrow, k);
        }
        float v = cq_activate(acc * sx[i] * s_w + b, p->activation);
        if (out->gate) { /* one fp32 product and sum, rounded once below (contraction is off: ISO C) */
          const float g = cq_load_float(out->gate, out->gate_dtype, (i / out->rows_per_sample) * out->ldg + o);
          v = cq_load_float(out->residual, out->y_dtype, i * out->ldr + o) + g * v;
        }
        cq_store_float(out->y, out->y_dtype, i * out->ldy + o, v);
      }
    }
    free(wrow);
    free(wi8);
  }
  if (oom) return cq_fail(CQ_ERR_OOM, "linear: no host memory for a weight row of %lld", (long long)k);
  return CQ_OK;
}

/* Host buffers of m x k activation rows (fp32 values or int8 codes) and m scales. */
typedef struct {
  float *a;
  int8_t *a_i8;
  float *sx;
} act_rows;

static cq_status alloc_rows(act_rows *r, int64_t m, int64_t k, int int8_pair) {
  r->a = int8_pair ? NULL : (float *)cq_alloc(m * k, sizeof(float));
  r->a_i8 = int8_pair ? (int8_t *)cq_alloc(m * k, 1) : NULL;
  r->sx = (float *)cq_alloc(m, sizeof(float));
  if ((r->a || r->a_i8) && r->sx) return CQ_OK;
  free(r->a), free(r->a_i8), free(r->sx);
  return cq_fail(CQ_ERR_OOM, "linear: no host memory for %lld x %lld activations", (long long)m, (long long)k);
}

static void free_rows(act_rows *r) { free(r->a), free(r->a_i8), free(r->sx); }

/* int8 activations dotted as codes: with int8 weights, or with int4 weights per group. */
static int is_int8_pair(const cq_format_info *wf, const cq_format_info *af) {
  return af && af->id == CQ_FORMAT_INT8 && (wf->id == CQ_FORMAT_INT8 || wf->id == CQ_FORMAT_INT4);
}

cq_status cq_linear_cpu(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale,
                        const cq_tensor *bias, const cq_linear_params *p,
                        const cq_format_info *wf, const cq_format_info *af, cq_tensor *y) {
  const int64_t m = cq_rows(x), k = cq_cols(x);
  act_rows r;
  CQ_TRY(alloc_rows(&r, m, k, is_int8_pair(wf, af)));
  cq_status st = prepare_activations(x, p, af, r.a, r.a_i8, r.sx);
  const out_rows out = plain_out(y);
  if (st == CQ_OK) st = linear_core(r.a, r.a_i8, r.sx, m, k, w, w_scale, bias, p, wf, af, x->dtype, &out);
  free_rows(&r);
  return st;
}

cq_status cq_linear_quantized_cpu(const cq_tensor *x_codes, const cq_tensor *x_scale, const cq_tensor *w,
                                  const cq_tensor *w_scale, const cq_tensor *bias, const cq_linear_params *p,
                                  const cq_format_info *wf, const cq_format_info *af, cq_tensor *y) {
  const int64_t m = cq_rows(x_codes), k = cq_cols(x_codes);
  act_rows r;
  CQ_TRY(alloc_rows(&r, m, k, is_int8_pair(wf, af)));
  expand_codes((const uint8_t *)x_codes->data, (const float *)x_scale->data, p->act_granularity, af, m, k, r.a,
               r.a_i8, r.sx);
  const out_rows out = plain_out(y);
  cq_status st = linear_core(r.a, r.a_i8, r.sx, m, k, w, w_scale, bias, p, wf, af, y->dtype, &out);
  free_rows(&r);
  return st;
}

cq_status cq_linear_gated_cpu(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale, const cq_tensor *bias,
                              const cq_tensor *gate, const cq_tensor *residual, const cq_gate_layout *gl,
                              const cq_linear_params *p, const cq_format_info *wf, const cq_format_info *af,
                              cq_tensor *y) {
  const int64_t m = cq_rows(x), k = cq_cols(x);
  act_rows r;
  CQ_TRY(alloc_rows(&r, m, k, is_int8_pair(wf, af)));
  cq_status st = prepare_activations(x, p, af, r.a, r.a_i8, r.sx);
  out_rows out = plain_out(y);
  out.gate = gate->data, out.gate_dtype = gate->dtype, out.ldg = gl->ldg, out.rows_per_sample = gl->rows_per_sample;
  out.residual = residual->data, out.ldr = gl->ldr;
  if (st == CQ_OK) st = linear_core(r.a, r.a_i8, r.sx, m, k, w, w_scale, bias, p, wf, af, x->dtype, &out);
  free_rows(&r);
  return st;
}
