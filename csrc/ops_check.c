/* Argument checks of every op, shared by the C reference and the CUDA dispatch,
 * so both reject the same inputs with the same messages. */
#include <math.h>
#include <string.h>

#include "cquant-impl.h"

static const cq_dtype float_dtypes[] = {CQ_DTYPE_F32, CQ_DTYPE_F16, CQ_DTYPE_BF16};

static cq_status check_input(const cq_tensor *t, const char *name) {
  CQ_TRY(cq_check_contiguous(t, name));
  if (t->ndim < 1) return cq_fail(CQ_ERR_INVALID_ARG, "%s is a scalar; expected at least 1 dimension", name);
  return CQ_OK;
}

static cq_status check_output(const cq_tensor *t, const char *name, const cq_tensor *ref, const char *ref_name) {
  CQ_TRY(check_input(t, name));
  CQ_TRY(cq_check_writable(t, name));
  return cq_check_same_device(ref, ref_name, t, name);
}

static cq_status check_granularity(cq_granularity g, const char *name) {
  if (g != CQ_GRANULARITY_ROW && g != CQ_GRANULARITY_TENSOR && !cq_granularity_grouped(g))
    return cq_fail(CQ_ERR_INVALID_ARG, "%s = %d; expected CQ_GRANULARITY_ROW (1), CQ_GRANULARITY_TENSOR (2), "
                   "CQ_GRANULARITY_GROUP (3) or CQ_GRANULARITY_TWO_LEVEL (4)", name, (int)g);
  return CQ_OK;
}

/* Name of a granularity with groups, for messages. */
static const char *grouped_name(cq_granularity g) {
  return g == CQ_GRANULARITY_GROUP ? "CQ_GRANULARITY_GROUP (3)" : "CQ_GRANULARITY_TWO_LEVEL (4)";
}

/* Granularity and group size of format f: the 4-bit formats take CQ_GRANULARITY_GROUP (int4 also
 * CQ_GRANULARITY_TWO_LEVEL) with a power-of-two group size in [CQ_GROUP_SIZE_MIN,
 * CQ_GROUP_SIZE_MAX]; every other format takes ROW or TENSOR with group size 0. */
static cq_status check_format_granularity(const cq_format_info *f, cq_granularity g, int64_t group_size,
                                          const char *g_name, const char *gs_name) {
  CQ_TRY(check_granularity(g, g_name));
  if (cq_format_grouped(f)) {
    if (g == CQ_GRANULARITY_TWO_LEVEL && f->id != CQ_FORMAT_INT4)
      return cq_fail(CQ_ERR_INVALID_ARG, "%s = CQ_GRANULARITY_TWO_LEVEL (4) with format %s; two-level scales are "
                     "for int4 only (expected CQ_GRANULARITY_GROUP (3))", g_name, f->name);
    if (!cq_granularity_grouped(g))
      return cq_fail(CQ_ERR_INVALID_ARG, "%s = %d with format %s; the 4-bit formats take only CQ_GRANULARITY_GROUP "
                     "(3) or, int4, CQ_GRANULARITY_TWO_LEVEL (4): scales per group of %s columns", g_name, (int)g,
                     f->name, gs_name);
    if (group_size < CQ_GROUP_SIZE_MIN || group_size > CQ_GROUP_SIZE_MAX || (group_size & (group_size - 1)))
      return cq_fail(CQ_ERR_INVALID_ARG, "%s = %lld; expected a power of two from %d to %d (columns per scale group "
                     "of %s)", gs_name, (long long)group_size, CQ_GROUP_SIZE_MIN, CQ_GROUP_SIZE_MAX, f->name);
    return CQ_OK;
  }
  if (cq_granularity_grouped(g))
    return cq_fail(CQ_ERR_INVALID_ARG, "%s = %s with format %s; groups are for the 4-bit formats int4 and uint4 "
                   "(expected CQ_GRANULARITY_ROW (1) or CQ_GRANULARITY_TENSOR (2))", g_name, grouped_name(g), f->name);
  if (group_size != 0)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s = %lld with %s = %d; expected 0 (a group size is only for "
                   "CQ_GRANULARITY_GROUP and CQ_GRANULARITY_TWO_LEVEL)", gs_name, (long long)group_size, g_name,
                   (int)g);
  return CQ_OK;
}

/* Groups of `cols` columns (whole groups only: tails are refused). */
static cq_status groups_of(int64_t cols, int64_t group_size, const char *gs_name, const char *cols_name,
                           int64_t *groups) {
  if (cols % group_size)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s = %lld does not divide %s = %lld; expected whole groups (group tails are "
                   "not supported)", gs_name, (long long)group_size, cols_name, (long long)cols);
  *groups = cols / group_size;
  return CQ_OK;
}

/* Codes of format f: int8 for int8, float8 (or raw uint8) for fp8, uint8 when packed. */
static cq_status check_code_dtype(const cq_tensor *t, const char *name, const cq_format_info *f) {
  cq_dtype allowed[2] = {f->code_dtype, CQ_DTYPE_U8};
  int n = (f->code_dtype == CQ_DTYPE_F8_E4M3FN || f->code_dtype == CQ_DTYPE_F8_E5M2) ? 2 : 1;
  return cq_check_dtype(t, name, allowed, n);
}

static cq_status check_2d_shape(const cq_tensor *t, const char *name, int64_t rows, int64_t cols, const char *what) {
  if (cq_rows(t) != rows || cq_cols(t) != cols)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s has %lld rows of %lld; expected %lld rows of %lld (%s)", name,
                   (long long)cq_rows(t), (long long)cq_cols(t), (long long)rows, (long long)cols, what);
  return CQ_OK;
}

/* Bytes of a stored row of `cols` codes (`bits` > 0: a packed row of that width; else the
 * format's row), failing when they overflow int64 (a hostile shape). */
static cq_status row_bytes_of(const cq_format_info *f, int bits, int64_t cols, const char *name, int64_t *bytes) {
  *bytes = f ? cq_packed_row_bytes(f, cols) : cq_pack_row_bytes_bits(bits, cols);
  if (*bytes < 0)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s has %lld columns: a stored row of them has more bytes than int64 counts",
                   name, (long long)cols);
  return CQ_OK;
}

/* fp32 scales: `rows` (row), 1 (tensor), rows x groups x width (group: width 2 holds uint4's
 * (scale, zero point) pairs) or rows x (1 + groups) (two-level: s1, then each group's s2),
 * contiguous. */
static cq_status check_scale(const cq_tensor *scale, const char *name, cq_granularity g, int64_t rows, int64_t groups,
                             int width, const cq_tensor *ref, const char *ref_name, int written) {
  static const cq_dtype f32[] = {CQ_DTYPE_F32};
  CQ_TRY(written ? check_output(scale, name, ref, ref_name) : check_input(scale, name));
  CQ_TRY(cq_check_same_device(ref, ref_name, scale, name));
  CQ_TRY(cq_check_dtype(scale, name, f32, 1));
  if (cq_granularity_grouped(g)) {
    /* [rows, G], [rows, G, 2] or [rows, 1 + G] (leading dims count as rows, as x's do): a
     * [G, rows] tensor of the same size would read every scale from the wrong group */
    const int two_level = g == CQ_GRANULARITY_TWO_LEVEL;
    if (two_level) groups += 1;
    const int trail = width == 2 ? 2 : 1;
    int64_t lead = 1;
    int ok = scale->ndim >= trail;
    for (int d = 0; ok && d < scale->ndim - trail; ++d) ok = cq_mul_ok(lead, scale->shape[d], &lead);
    ok = ok && lead == rows && scale->shape[scale->ndim - trail] == groups &&
         (width == 1 || scale->shape[scale->ndim - 1] == 2);
    if (!ok) {
      char shape[160];
      cq_format_shape(scale, shape, sizeof shape);
      if (two_level)
        return cq_fail(CQ_ERR_INVALID_ARG, "%s has shape %s; expected fp32 [%lld, %lld] (two-level: the row scale s1, "
                       "then one multiplier s2 per group of each row)", name, shape, (long long)rows,
                       (long long)groups);
      return cq_fail(CQ_ERR_INVALID_ARG, "%s has shape %s; expected fp32 [%lld, %lld%s] (%s per group of each row)",
                     name, shape, (long long)rows, (long long)groups, width == 2 ? ", 2" : "",
                     width == 2 ? "scale and zero point" : "one scale");
    }
    return CQ_OK;
  }
  int64_t want = g == CQ_GRANULARITY_ROW ? rows : 1;
  if (cq_tensor_numel(scale) != want)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s has %lld elements; expected %lld (one fp32 per %s)", name,
                   (long long)cq_tensor_numel(scale), (long long)want, g == CQ_GRANULARITY_ROW ? "row" : "tensor");
  return CQ_OK;
}

static cq_status get_format(int id, const char *name, const cq_format_info **f) {
  *f = cq_format_get(id);
  if (!*f)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s = %d is not a cquant format (int8, fp8_e4m3, fp8_e5m2, int4, uint4 or "
                   "fpX with 1 sign, E >= 1 exponent and M mantissa bits, 3 <= 1+E+M <= 7)", name, id);
  return CQ_OK;
}

cq_status cq_check_quantize(const cq_tensor *x, const cq_quant_params *p, const cq_tensor *q,
                            const cq_tensor *scale, const cq_format_info **f) {
  if (!p) return cq_fail(CQ_ERR_INVALID_ARG, "params is required");
  CQ_TRY(get_format(p->format, "format", f));
  CQ_TRY(check_format_granularity(*f, p->granularity, p->group_size, "granularity", "group_size"));
  if (p->static_scale && cq_granularity_grouped(p->granularity))
    return cq_fail(CQ_ERR_INVALID_ARG, "static_scale with granularity %s; group scales (uint4 zero points, "
                   "two-level multipliers) are computed from the data only", grouped_name(p->granularity));
  CQ_TRY(check_input(x, "x"));
  CQ_TRY(cq_check_dtype(x, "x", float_dtypes, 3));
  CQ_TRY(check_output(q, "q", x, "x"));
  CQ_TRY(check_code_dtype(q, "q", *f));
  int64_t row_bytes;
  CQ_TRY(row_bytes_of(*f, 0, cq_cols(x), "x", &row_bytes));
  CQ_TRY(check_2d_shape(q, "q", cq_rows(x), row_bytes,
                        (*f)->packed ? "one packed row of codes per row of x" : "one code per element of x"));
  int64_t groups = 0;
  if (cq_granularity_grouped(p->granularity))
    CQ_TRY(groups_of(cq_cols(x), p->group_size, "group_size", "x's columns", &groups));
  CQ_TRY(check_scale(scale, "scale", p->granularity, cq_rows(x), groups, cq_group_scale_width(*f), x, "x",
                     !p->static_scale));
  CQ_TRY(cq_check_no_overlap(q, "q", x, "x"));
  CQ_TRY(cq_check_no_overlap(q, "q", scale, "scale"));
  return p->static_scale ? CQ_OK : cq_check_no_overlap(scale, "scale", x, "x");
}

cq_status cq_check_dequantize(const cq_tensor *q, const cq_tensor *scale, const cq_quant_params *p,
                              const cq_tensor *y, const cq_format_info **f) {
  if (!p) return cq_fail(CQ_ERR_INVALID_ARG, "params is required");
  CQ_TRY(get_format(p->format, "format", f));
  CQ_TRY(check_format_granularity(*f, p->granularity, p->group_size, "granularity", "group_size"));
  CQ_TRY(check_input(q, "q"));
  CQ_TRY(check_code_dtype(q, "q", *f));
  CQ_TRY(check_output(y, "y", q, "q"));
  CQ_TRY(cq_check_dtype(y, "y", float_dtypes, 3));
  int64_t row_bytes;
  CQ_TRY(row_bytes_of(*f, 0, cq_cols(y), "y", &row_bytes));
  CQ_TRY(check_2d_shape(q, "q", cq_rows(y), row_bytes,
                        (*f)->packed ? "one packed row of codes per row of y" : "one code per element of y"));
  int64_t groups = 0;
  if (cq_granularity_grouped(p->granularity))
    CQ_TRY(groups_of(cq_cols(y), p->group_size, "group_size", "y's columns", &groups));
  CQ_TRY(check_scale(scale, "scale", p->granularity, cq_rows(y), groups, cq_group_scale_width(*f), q, "q", 0));
  CQ_TRY(cq_check_no_overlap(y, "y", q, "q"));
  return cq_check_no_overlap(y, "y", scale, "scale");
}

cq_status cq_check_pack(const cq_tensor *codes, int bits, const cq_tensor *packed, int unpack) {
  static const cq_dtype u8[] = {CQ_DTYPE_U8};
  if (bits < 1 || bits > 8) return cq_fail(CQ_ERR_INVALID_ARG, "bits = %d; expected 1..8", bits);
  const cq_tensor *in = unpack ? packed : codes, *out = unpack ? codes : packed;
  const char *in_name = unpack ? "packed" : "codes", *out_name = unpack ? "codes" : "packed";
  CQ_TRY(check_input(in, in_name));
  CQ_TRY(cq_check_dtype(in, in_name, u8, 1));
  CQ_TRY(check_output(out, out_name, in, in_name));
  CQ_TRY(cq_check_dtype(out, out_name, u8, 1));
  int64_t row_bytes;
  CQ_TRY(row_bytes_of(NULL, bits, cq_cols(codes), "codes", &row_bytes));
  CQ_TRY(check_2d_shape(packed, "packed", cq_rows(codes), row_bytes, "one padded packed row per row of codes"));
  return cq_check_no_overlap(out, out_name, in, in_name);
}

cq_status cq_check_copy_rows(const cq_tensor *src, const cq_tensor *dst) {
  CQ_TRY(cq_check_present(src, "src"));
  CQ_TRY(cq_check_present(dst, "dst"));
  CQ_TRY(cq_check_writable(dst, "dst"));
  CQ_TRY(cq_check_same_device(src, "src", dst, "dst"));
  if (src->ndim < 1 || src->ndim > 4)
    return cq_fail(CQ_ERR_INVALID_ARG, "src has %d dimensions; expected 1 to 4", (int)src->ndim);
  if (dst->dtype != src->dtype)
    return cq_fail(CQ_ERR_TYPE, "dst has dtype %s but src %s; expected the same dtype", cq_dtype_name(dst->dtype),
                   cq_dtype_name(src->dtype));
  char a[96], b[96];
  cq_format_shape(src, a, sizeof a);
  cq_format_shape(dst, b, sizeof b);
  if (dst->ndim != src->ndim || memcmp(dst->shape, src->shape, (size_t)src->ndim * sizeof src->shape[0]))
    return cq_fail(CQ_ERR_INVALID_ARG, "dst has shape %s but src %s; expected the same shape", b, a);
  const cq_tensor *ts[2] = {src, dst};
  const char *names[2] = {"src", "dst"};
  for (int i = 0; i < 2; ++i) {
    const cq_tensor *t = ts[i];
    for (int d = 0; d < t->ndim; ++d) {
      if (t->shape[d] < 1)
        return cq_fail(CQ_ERR_INVALID_ARG, "%s has shape %s; expected no zero-size dimension", names[i], i ? b : a);
      if (t->strides[d] < 0)
        return cq_fail(CQ_ERR_INVALID_ARG, "%s has stride %lld in dim %d; expected non-negative strides", names[i],
                       (long long)t->strides[d], d);
    }
    const int last = t->ndim - 1;
    if (t->shape[last] > 1 && t->strides[last] != 1)
      return cq_fail(CQ_ERR_INVALID_ARG, "%s has stride %lld in its last dim; expected 1 (contiguous rows)", names[i],
                     (long long)t->strides[last]);
    if (last > 0 && t->shape[last - 1] > 1 && t->strides[last - 1] < t->shape[last])
      return cq_fail(CQ_ERR_INVALID_ARG, "%s has rows %lld elements apart but %lld columns; expected rows apart "
                     "(a row stride >= the last dim)", names[i], (long long)t->strides[last - 1],
                     (long long)t->shape[last]);
  }
  CQ_TRY(cq_check_no_self_overlap(dst, "dst"));
  return cq_check_no_overlap(dst, "dst", src, "src");
}

/* Weight and activation formats of a linear scheme. */
static cq_status check_linear_formats(const cq_linear_params *p, const cq_format_info **wf, const cq_format_info **af) {
  if (!p) return cq_fail(CQ_ERR_INVALID_ARG, "params is required");
  if (p->activation != CQ_ACTIVATION_NONE && p->activation != CQ_ACTIVATION_GELU_TANH)
    return cq_fail(CQ_ERR_INVALID_ARG, "activation = %d; expected CQ_ACTIVATION_NONE (0) or "
                   "CQ_ACTIVATION_GELU_TANH (1)", p->activation);
  CQ_TRY(get_format(p->weight_format, "weight_format", wf));
  CQ_TRY(check_format_granularity(*wf, p->weight_granularity, p->weight_group_size, "weight_granularity",
                                  "weight_group_size"));
  *af = NULL;
  if (p->weight_granularity == CQ_GRANULARITY_TWO_LEVEL) {
    /* s2 * code is an int8 value: an int8 x int8 GEMM, so only int8 activations per token */
    if (p->act_format == CQ_FORMAT_NONE)
      return cq_fail(CQ_ERR_UNSUPPORTED, "act_format none with weight_granularity CQ_GRANULARITY_TWO_LEVEL (4); "
                     "two-level int4 weights take only int8 activations per row (int4dq_2l), not weight-only layers");
    CQ_TRY(get_format(p->act_format, "act_format", af));
    if ((*af)->id != CQ_FORMAT_INT8)
      return cq_fail(CQ_ERR_UNSUPPORTED, "act_format %s with weight_granularity CQ_GRANULARITY_TWO_LEVEL (4); "
                     "two-level int4 weights take only int8 activations per row (int4dq_2l)", (*af)->name);
    if (p->act_granularity != CQ_GRANULARITY_ROW)
      return cq_fail(CQ_ERR_UNSUPPORTED, "act_granularity = %d with weight_granularity CQ_GRANULARITY_TWO_LEVEL (4); "
                     "expected CQ_GRANULARITY_ROW (1): int8 activations per token", (int)p->act_granularity);
    return CQ_OK;
  }
  if (p->act_format != CQ_FORMAT_NONE) {
    CQ_TRY(get_format(p->act_format, "act_format", af));
    const int a_id = (*af)->id, w_id = (*wf)->id;
    if (w_id == CQ_FORMAT_UINT4)
      return cq_fail(CQ_ERR_INVALID_ARG, "act_format %s with weight_format uint4 is not a scheme; dynamic "
                     "activations with 4-bit weights need symmetric int4 weights (uint4's zero points are for "
                     "weight-only layers)", (*af)->name);
    if (w_id == CQ_FORMAT_INT4) {
      if (a_id != CQ_FORMAT_INT8 && a_id != CQ_FORMAT_FP8_E4M3)
        return cq_fail(CQ_ERR_INVALID_ARG, "act_format %s with weight_format int4 is not a scheme; int4 weights "
                       "take int8 (int4dq) or fp8_e4m3 (fp8da_int4w) activations", (*af)->name);
      if (p->act_granularity != CQ_GRANULARITY_ROW)
        return cq_fail(CQ_ERR_INVALID_ARG, "act_granularity = %d with int4 weights; expected CQ_GRANULARITY_ROW (1): "
                       "activations of 4-bit weights are quantized per token", (int)p->act_granularity);
      return CQ_OK;
    }
    int int_pair = a_id == CQ_FORMAT_INT8 && w_id == CQ_FORMAT_INT8;
    int fp8_pair = (a_id == CQ_FORMAT_FP8_E4M3 || a_id == CQ_FORMAT_FP8_E5M2) &&
                   (w_id == CQ_FORMAT_FP8_E4M3 || w_id == CQ_FORMAT_FP8_E5M2);
    if (!int_pair && !fp8_pair)
      return cq_fail(CQ_ERR_INVALID_ARG, "act_format %s with weight_format %s is not a scheme; dynamic "
                     "activations need int8 with int8 weights, fp8 with fp8 weights, or int8 / fp8_e4m3 with int4 "
                     "weights", (*af)->name, (*wf)->name);
    if (cq_granularity_grouped(p->act_granularity))
      return cq_fail(CQ_ERR_INVALID_ARG, "act_granularity = %s; activations are quantized per row (token) or per "
                     "tensor", grouped_name(p->act_granularity));
    CQ_TRY(check_granularity(p->act_granularity, "act_granularity"));
  }
  return CQ_OK;
}

cq_status cq_linear_min_compute_capability(const cq_linear_params *p, int *cc) {
  const cq_format_info *wf, *af;
  if (!cc) return cq_fail(CQ_ERR_INVALID_ARG, "cc is required");
  CQ_TRY(check_linear_formats(p, &wf, &af));
  *cc = !af ? CQ_MIN_CC_WEIGHT_ONLY : af->id == CQ_FORMAT_INT8 ? CQ_MIN_CC_INT8_DYNAMIC : CQ_MIN_CC_FP8_DYNAMIC;
  return CQ_OK;
}

/* Weight, scales, bias and output of a linear layer whose activation x_name has
 * k features in `rows` rows; y has dtype out_dtype. */
static cq_status check_linear_rest(const cq_tensor *x, const char *x_name, const cq_tensor *w, const cq_tensor *w_scale,
                                   const cq_tensor *bias, const cq_linear_params *p, const cq_tensor *y,
                                   const cq_format_info *wf, const cq_format_info *af, cq_dtype out_dtype) {
  int64_t k = cq_cols(x);
  if (p->in_features > 0 && p->in_features != k)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s has %lld features in its last dim; expected in_features = %lld", x_name,
                   (long long)k, (long long)p->in_features);
  const int int8_gemm = wf->id == CQ_FORMAT_INT8 || p->weight_granularity == CQ_GRANULARITY_TWO_LEVEL;
  if (af && af->id == CQ_FORMAT_INT8 && int8_gemm && k > CQ_LINEAR_INT8_MAX_K)
    return cq_fail(CQ_ERR_UNSUPPORTED, "%s has %lld features; int8 activations with int8 (or two-level int4) weights "
                   "take at most %d (CQ_LINEAR_INT8_MAX_K: their int32 sums could overflow beyond)", x_name,
                   (long long)k, CQ_LINEAR_INT8_MAX_K);
  int64_t w_row_bytes, groups = 0;
  if (cq_granularity_grouped(p->weight_granularity))
    CQ_TRY(groups_of(k, p->weight_group_size, "weight_group_size", "in_features", &groups));
  CQ_TRY(row_bytes_of(wf, 0, k, x_name, &w_row_bytes));
  CQ_TRY(check_input(w, "w"));
  CQ_TRY(cq_check_same_device(x, x_name, w, "w"));
  if (w->ndim != 2) return cq_fail(CQ_ERR_INVALID_ARG, "w has %d dims; expected 2 ([out_features, stored row])", (int)w->ndim);
  CQ_TRY(check_code_dtype(w, "w", wf));
  int64_t n = w->shape[0];
  CQ_TRY(check_2d_shape(w, "w", n, w_row_bytes,
                        wf->packed ? "a packed row of in_features codes per output" : "in_features codes per output"));
  CQ_TRY(check_scale(w_scale, "w_scale", p->weight_granularity, n, groups, cq_group_scale_width(wf), x, x_name, 0));
  if (bias) {
    const cq_dtype bias_dtypes[] = {out_dtype, CQ_DTYPE_F32};
    CQ_TRY(check_input(bias, "bias"));
    CQ_TRY(cq_check_same_device(x, x_name, bias, "bias"));
    CQ_TRY(cq_check_dtype(bias, "bias", bias_dtypes, out_dtype == CQ_DTYPE_F32 ? 1 : 2));
    if (cq_tensor_numel(bias) != n)
      return cq_fail(CQ_ERR_INVALID_ARG, "bias has %lld elements; expected out_features = %lld",
                     (long long)cq_tensor_numel(bias), (long long)n);
  }
  int64_t ldy;
  CQ_TRY(cq_check_row_strided(y, "y", &ldy));
  CQ_TRY(cq_check_writable(y, "y"));
  CQ_TRY(cq_check_same_device(x, x_name, y, "y"));
  if (y->dtype != out_dtype)
    return cq_fail(CQ_ERR_TYPE, "y has dtype %s; expected %s", cq_dtype_name(y->dtype), cq_dtype_name(out_dtype));
  CQ_TRY(check_2d_shape(y, "y", cq_rows(x), n, "one row of out_features per row of the activations"));
  CQ_TRY(cq_check_no_overlap(y, "y", x, x_name));
  CQ_TRY(cq_check_no_overlap(y, "y", w, "w"));
  CQ_TRY(cq_check_no_overlap(y, "y", w_scale, "w_scale"));
  return bias ? cq_check_no_overlap(y, "y", bias, "bias") : CQ_OK;
}

cq_status cq_check_linear(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale,
                          const cq_tensor *bias, const cq_linear_params *p, const cq_tensor *y,
                          const cq_format_info **wf, const cq_format_info **af) {
  CQ_TRY(check_linear_formats(p, wf, af));
  CQ_TRY(check_input(x, "x"));
  CQ_TRY(cq_check_dtype(x, "x", float_dtypes, 3));
  return check_linear_rest(x, "x", w, w_scale, bias, p, y, *wf, *af, x->dtype);
}

cq_status cq_check_linear_quantized(const cq_tensor *x_codes, const cq_tensor *x_scale, const cq_tensor *w,
                                    const cq_tensor *w_scale, const cq_tensor *bias, const cq_linear_params *p,
                                    const cq_tensor *y, const cq_format_info **wf, const cq_format_info **af) {
  CQ_TRY(check_linear_formats(p, wf, af));
  if (!*af)
    return cq_fail(CQ_ERR_INVALID_ARG, "act_format is none; pre-quantized activations need the dynamic scheme's "
                   "activation format (int8 or fp8)");
  CQ_TRY(check_input(x_codes, "x_codes"));
  CQ_TRY(check_code_dtype(x_codes, "x_codes", *af));
  CQ_TRY(check_scale(x_scale, "x_scale", p->act_granularity, cq_rows(x_codes), 0, 1, x_codes, "x_codes", 0));
  CQ_TRY(cq_check_present(y, "y"));
  CQ_TRY(cq_check_dtype(y, "y", float_dtypes, 3));
  CQ_TRY(check_linear_rest(x_codes, "x_codes", w, w_scale, bias, p, y, *wf, *af, y->dtype));
  return cq_check_no_overlap(y, "y", x_scale, "x_scale");
}

cq_status cq_check_linear_gated(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale, const cq_tensor *bias,
                                const cq_tensor *gate, const cq_tensor *residual, const cq_linear_params *p,
                                const cq_tensor *y, const cq_format_info **wf, const cq_format_info **af,
                                cq_gate_layout *gl) {
  CQ_TRY(cq_check_linear(x, w, w_scale, bias, p, y, wf, af));
  const int64_t m = cq_rows(x), n = w->shape[0];
  /* gate [G, N]: one row per sample, the last dim contiguous, any row stride */
  CQ_TRY(cq_check_present(gate, "gate"));
  CQ_TRY(cq_check_same_device(x, "x", gate, "gate"));
  CQ_TRY(cq_check_dtype(gate, "gate", float_dtypes, 3));
  if (gate->ndim != 2)
    return cq_fail(CQ_ERR_INVALID_ARG, "gate has %d dims; expected 2 ([samples, out_features])", (int)gate->ndim);
  const int64_t g = gate->shape[0];
  if (gate->shape[1] != n)
    return cq_fail(CQ_ERR_INVALID_ARG, "gate has %lld columns; expected out_features = %lld", (long long)gate->shape[1],
                   (long long)n);
  if (g < 1 || m % g)
    return cq_fail(CQ_ERR_INVALID_ARG, "gate has %lld rows (samples), which do not divide the %lld rows of x; expected "
                   "x's rows to hold the samples one after another, the same number each", (long long)g, (long long)m);
  if (gate->strides[0] < 0 || (n > 1 && gate->strides[1] != 1))
    return cq_fail(CQ_ERR_INVALID_ARG, "gate has strides (%lld, %lld); expected its last dim contiguous and a "
                   "non-negative row stride", (long long)gate->strides[0], (long long)gate->strides[1]);
  if (!gate->data) return cq_fail(CQ_ERR_INVALID_ARG, "gate has a NULL data pointer");
  if ((uintptr_t)gate->data % cq_dtype_size(gate->dtype))
    return cq_fail(CQ_ERR_INVALID_ARG, "gate data address %p is not aligned to its %zu-byte elements", gate->data,
                   cq_dtype_size(gate->dtype));
  CQ_TRY(cq_check_no_overlap(y, "y", gate, "gate"));
  /* residual: y's shape and dtype; y itself (updated in place) or apart from it */
  int64_t ldr;
  CQ_TRY(cq_check_row_strided(residual, "residual", &ldr));
  CQ_TRY(cq_check_same_device(x, "x", residual, "residual"));
  if (residual->dtype != y->dtype)
    return cq_fail(CQ_ERR_TYPE, "residual has dtype %s; expected y's dtype %s", cq_dtype_name(residual->dtype),
                   cq_dtype_name(y->dtype));
  int same_shape = residual->ndim == y->ndim;
  for (int d = 0; same_shape && d < y->ndim; ++d) same_shape = residual->shape[d] == y->shape[d];
  if (!same_shape)
    return cq_fail(CQ_ERR_INVALID_ARG, "residual has %d dims and %lld rows of %lld; expected y's shape (%d dims, "
                   "%lld rows of %lld)", (int)residual->ndim, (long long)cq_rows(residual), (long long)cq_cols(residual),
                   (int)y->ndim, (long long)cq_rows(y), (long long)cq_cols(y));
  int same = residual->data == y->data;
  for (int d = 0; same && d < y->ndim; ++d) same = y->shape[d] == 1 || residual->strides[d] == y->strides[d];
  if (!same && cq_check_no_overlap(y, "y", residual, "residual") != CQ_OK)
    return cq_fail(CQ_ERR_INVALID_ARG, "residual overlaps y without being y; expected y itself (same address and "
                   "strides: the residual updated in place) or a separate tensor");
  gl->samples = g;
  gl->rows_per_sample = m / g;
  gl->ldg = g > 1 ? gate->strides[0] : n;
  gl->ldr = ldr;
  gl->in_place = same;
  return CQ_OK;
}

cq_status cq_check_workspace_apart(const cq_tensor *workspace, const cq_tensor *const *args, const char *const *names,
                                   int n) {
  if (!workspace) return CQ_OK;
  for (int i = 0; i < n; ++i)
    if (args[i]) CQ_TRY(cq_check_no_overlap(workspace, "workspace", args[i], names[i]));
  return CQ_OK;
}

/* ---- attention ---- */

/* A [B, S, H, D] tensor read with strides: 4 dims, D >= 1 (B, S and H may be 0: nothing to
 * do), non-negative strides, last dim contiguous. */
cq_status cq_check_bshd(const cq_tensor *t, const char *name, const char *layout) {
  CQ_TRY(cq_check_present(t, name));
  if (t->ndim != 4)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s has %d dims; expected 4 (%s)", name, (int)t->ndim, layout);
  if (t->shape[3] < 1)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s has head_dim %lld; expected head_dim >= 1 (%s)", name,
                   (long long)t->shape[3], layout);
  if (cq_tensor_numel(t) == 0) return CQ_OK; /* no element is read or written: any strides, any address */
  for (int d = 0; d < 4; ++d)
    if (t->strides[d] < 0)
      return cq_fail(CQ_ERR_INVALID_ARG, "%s has a negative stride in dim %d; expected non-negative strides", name, d);
  if (t->shape[3] > 1 && t->strides[3] != 1)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s has stride %lld in its last dim; expected the head dim contiguous (stride 1)",
                   name, (long long)t->strides[3]);
  if (!t->data) return cq_fail(CQ_ERR_INVALID_ARG, "%s has a NULL data pointer", name);
  size_t align = cq_dtype_size(t->dtype);
  if (align > 1 && ((uintptr_t)t->data % align) != 0)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s data address %p is not aligned to its %zu-byte elements", name, t->data, align);
  return CQ_OK;
}

static cq_status check_attention_params(const cq_attention_params *p) {
  if (!p) return cq_fail(CQ_ERR_INVALID_ARG, "params is required");
  if (p->mode != CQ_ATTENTION_FULL && p->mode != CQ_ATTENTION_INT8)
    return cq_fail(CQ_ERR_INVALID_ARG, "mode = %d; expected CQ_ATTENTION_FULL (0) or CQ_ATTENTION_INT8 (1)", (int)p->mode);
  if (!isfinite(p->scale)) return cq_fail(CQ_ERR_INVALID_ARG, "scale = %g; expected a finite softmax scale", (double)p->scale);
  if (p->q_block < 0 || p->k_block < 0)
    return cq_fail(CQ_ERR_INVALID_ARG, "q_block = %d, k_block = %d; expected block sizes >= 1 (or 0 for the defaults)",
                   (int)p->q_block, (int)p->k_block);
  return CQ_OK;
}

/* q and k of one call (layouts and dtypes checked): one device, matching batch, heads and head_dim. */
static cq_status check_attention_qk(const cq_tensor *q, const cq_tensor *k) {
  CQ_TRY(cq_check_same_device(q, "q", k, "k"));
  const int64_t b = q->shape[0], h = q->shape[2], d = q->shape[3];
  if (k->shape[0] != b || k->shape[2] != h || k->shape[3] != d)
    return cq_fail(CQ_ERR_INVALID_ARG, "k has shape (%lld, %lld, %lld, %lld); expected (%lld, seq_kv, %lld, %lld) "
                   "to match q's batch, heads and head_dim", (long long)k->shape[0], (long long)k->shape[1],
                   (long long)k->shape[2], (long long)k->shape[3], (long long)b, (long long)h, (long long)d);
  return CQ_OK;
}

cq_status cq_check_attention(const cq_tensor *q, const cq_tensor *k, const cq_tensor *v,
                             const cq_attention_params *p, const cq_tensor *out, const cq_tensor *lse,
                             cq_attention_dims *dims) {
  CQ_TRY(check_attention_params(p));
  CQ_TRY(cq_check_bshd(q, "q", "[batch, seq_q, heads, head_dim]"));
  CQ_TRY(cq_check_bshd(k, "k", "[batch, seq_kv, heads, head_dim]"));
  CQ_TRY(cq_check_bshd(v, "v", "[batch, seq_kv, heads, head_dim]"));
  CQ_TRY(cq_check_dtype(q, "q", float_dtypes, 3));
  if (k->dtype != q->dtype || v->dtype != q->dtype)
    return cq_fail(CQ_ERR_TYPE, "q, k, v have dtypes %s, %s, %s; expected one dtype", cq_dtype_name(q->dtype),
                   cq_dtype_name(k->dtype), cq_dtype_name(v->dtype));
  CQ_TRY(check_attention_qk(q, k));
  CQ_TRY(cq_check_same_device(q, "q", v, "v"));
  const int64_t b = q->shape[0], sq = q->shape[1], h = q->shape[2], d = q->shape[3], skv = k->shape[1];
  for (int i = 0; i < 4; ++i)
    if (v->shape[i] != k->shape[i])
      return cq_fail(CQ_ERR_INVALID_ARG, "v has shape (%lld, %lld, %lld, %lld); expected k's shape (%lld, %lld, %lld, %lld)",
                     (long long)v->shape[0], (long long)v->shape[1], (long long)v->shape[2], (long long)v->shape[3],
                     (long long)k->shape[0], (long long)k->shape[1], (long long)k->shape[2], (long long)k->shape[3]);
  CQ_TRY(cq_check_bshd(out, "out", "[batch, seq_q, heads, head_dim]"));
  CQ_TRY(cq_check_writable(out, "out"));
  CQ_TRY(cq_check_same_device(q, "q", out, "out"));
  if (out->dtype != q->dtype)
    return cq_fail(CQ_ERR_TYPE, "out has dtype %s; expected q's dtype %s", cq_dtype_name(out->dtype), cq_dtype_name(q->dtype));
  for (int i = 0; i < 4; ++i)
    if (out->shape[i] != q->shape[i])
      return cq_fail(CQ_ERR_INVALID_ARG, "out has shape (%lld, %lld, %lld, %lld); expected q's shape (%lld, %lld, %lld, %lld)",
                     (long long)out->shape[0], (long long)out->shape[1], (long long)out->shape[2], (long long)out->shape[3],
                     (long long)b, (long long)sq, (long long)h, (long long)d);
  CQ_TRY(cq_check_no_overlap(out, "out", q, "q"));
  CQ_TRY(cq_check_no_overlap(out, "out", k, "k"));
  CQ_TRY(cq_check_no_overlap(out, "out", v, "v"));
  CQ_TRY(cq_check_no_self_overlap(out, "out"));
  if (lse) {
    static const cq_dtype f32[] = {CQ_DTYPE_F32};
    if (cq_tensor_numel(out) > 0) CQ_TRY(cq_check_contiguous(lse, "lse")); /* an empty lse is never written */
    CQ_TRY(cq_check_writable(lse, "lse"));
    CQ_TRY(cq_check_same_device(q, "q", lse, "lse"));
    CQ_TRY(cq_check_dtype(lse, "lse", f32, 1));
    if (lse->ndim != 3 || lse->shape[0] != b || lse->shape[1] != h || lse->shape[2] != sq)
      return cq_fail(CQ_ERR_INVALID_ARG, "lse must have shape (%lld, %lld, %lld) = [batch, heads, seq_q]", (long long)b,
                     (long long)h, (long long)sq);
    CQ_TRY(cq_check_no_overlap(lse, "lse", out, "out"));
    CQ_TRY(cq_check_no_overlap(lse, "lse", q, "q"));
    CQ_TRY(cq_check_no_overlap(lse, "lse", k, "k"));
    CQ_TRY(cq_check_no_overlap(lse, "lse", v, "v"));
  }
  dims->batch = b, dims->heads = h, dims->seq_q = sq, dims->seq_kv = skv, dims->head_dim = d;
  return CQ_OK;
}

cq_status cq_check_attention_int8_bound(const cq_tensor *q, const cq_tensor *k, const cq_attention_params *p,
                                        const cq_tensor *bound, cq_attention_dims *dims) {
  static const cq_dtype f32[] = {CQ_DTYPE_F32};
  CQ_TRY(check_attention_params(p));
  if (p->mode != CQ_ATTENTION_INT8)
    return cq_fail(CQ_ERR_INVALID_ARG, "mode = %d; the logit-error estimate is the 8-bit mode's: expected "
                   "CQ_ATTENTION_INT8 (1)", (int)p->mode);
  CQ_TRY(cq_check_bshd(q, "q", "[batch, seq_q, heads, head_dim]"));
  CQ_TRY(cq_check_bshd(k, "k", "[batch, seq_kv, heads, head_dim]"));
  CQ_TRY(cq_check_dtype(q, "q", float_dtypes, 3));
  if (k->dtype != q->dtype)
    return cq_fail(CQ_ERR_TYPE, "q, k have dtypes %s, %s; expected one dtype", cq_dtype_name(q->dtype),
                   cq_dtype_name(k->dtype));
  CQ_TRY(check_attention_qk(q, k));
  CQ_TRY(cq_check_present(bound, "bound"));
  CQ_TRY(cq_check_dtype(bound, "bound", f32, 1));
  if (bound->ndim != 2 || bound->shape[0] != q->shape[0] || bound->shape[1] != q->shape[2])
    return cq_fail(CQ_ERR_INVALID_ARG, "bound must have shape (%lld, %lld) = [batch, heads]", (long long)q->shape[0],
                   (long long)q->shape[2]);
  CQ_TRY(cq_check_contiguous(bound, "bound"));
  CQ_TRY(cq_check_writable(bound, "bound"));
  if (q->device_type != CQ_DEVICE_CPU || bound->device_type != CQ_DEVICE_CPU)
    return cq_fail(CQ_ERR_INVALID_ARG, "cq_attention_int8_logit_error_ref runs on CPU tensors; got a CUDA tensor "
                   "(copy q and k to the host)");
  if (cq_tensor_numel(bound) > 0) {
    CQ_TRY(cq_check_no_overlap(bound, "bound", q, "q"));
    CQ_TRY(cq_check_no_overlap(bound, "bound", k, "k"));
  }
  dims->batch = q->shape[0], dims->heads = q->shape[2], dims->seq_q = q->shape[1], dims->seq_kv = k->shape[1];
  dims->head_dim = q->shape[3];
  return CQ_OK;
}
