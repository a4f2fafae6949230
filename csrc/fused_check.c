/* Argument checks of the fused DiT block ops (cq_norm_modulate, cq_qk_norm_rope), shared by the C
 * reference and the CUDA dispatch, so both reject the same inputs with the same messages. */
#include <math.h>

#include "cquant-impl.h"

static const cq_dtype float_dtypes[] = {CQ_DTYPE_F32, CQ_DTYPE_F16, CQ_DTYPE_BF16};
static const cq_dtype f32_only[] = {CQ_DTYPE_F32};

static cq_status check_eps(float eps) {
  if (!isfinite(eps) || eps < 0.0f)
    return cq_fail(CQ_ERR_INVALID_ARG, "eps = %g; expected a finite eps >= 0", (double)eps);
  return CQ_OK;
}

/* A contiguous output on x's device. */
static cq_status check_output(const cq_tensor *t, const char *name, const cq_tensor *x, const char *x_name) {
  CQ_TRY(cq_check_contiguous(t, name));
  CQ_TRY(cq_check_writable(t, name));
  return cq_check_same_device(x, x_name, t, name);
}

/* ---- norm_modulate ---- */

/* scale / shift: [B, D] float, last dim contiguous, any non-negative row stride. */
static cq_status check_modulation(const cq_tensor *t, const char *name, const cq_tensor *x) {
  if (!t) return CQ_OK;
  const int64_t b = x->shape[0], d = x->shape[2];
  CQ_TRY(cq_check_same_device(x, "x", t, name));
  CQ_TRY(cq_check_dtype(t, name, float_dtypes, 3));
  if (t->ndim != 2 || t->shape[0] != b || t->shape[1] != d)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s has %d dims of extents (%lld, %lld, ...); expected shape (%lld, %lld) = "
                   "[batch, dim] of x", name, (int)t->ndim, t->ndim > 0 ? (long long)t->shape[0] : 0LL,
                   t->ndim > 1 ? (long long)t->shape[1] : 0LL, (long long)b, (long long)d);
  if (d > 1 && t->strides[1] != 1)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s has stride %lld in its last dim; expected it contiguous (stride 1)", name,
                   (long long)t->strides[1]);
  if (b > 1 && t->strides[0] < 0)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s has a negative row stride; expected a non-negative one", name);
  if (!t->data) return cq_fail(CQ_ERR_INVALID_ARG, "%s has a NULL data pointer", name);
  const size_t align = cq_dtype_size(t->dtype);
  if ((uintptr_t)t->data % align != 0)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s data address %p is not aligned to its %zu-byte elements", name, t->data,
                   align);
  return CQ_OK;
}

cq_status cq_check_norm_modulate(const cq_tensor *x, const cq_tensor *scale, const cq_tensor *shift,
                                 const cq_norm_modulate_params *p, const cq_tensor *out, const cq_tensor *out_scale,
                                 const cq_format_info **f) {
  if (!p) return cq_fail(CQ_ERR_INVALID_ARG, "params is required");
  if (p->norm != CQ_NORM_LAYER && p->norm != CQ_NORM_RMS)
    return cq_fail(CQ_ERR_INVALID_ARG, "norm = %d; expected CQ_NORM_LAYER (1) or CQ_NORM_RMS (2)", (int)p->norm);
  CQ_TRY(check_eps(p->eps));
  *f = NULL;
  if (p->out_format != CQ_FORMAT_NONE) {
    if (p->out_format != CQ_FORMAT_INT8 && p->out_format != CQ_FORMAT_FP8_E4M3)
      return cq_fail(CQ_ERR_INVALID_ARG, "out_format = %d; expected CQ_FORMAT_NONE (0), CQ_FORMAT_INT8 (1) or "
                     "CQ_FORMAT_FP8_E4M3 (2)", p->out_format);
    *f = cq_format_get(p->out_format);
    if (!*f) return cq_fail(CQ_ERR_INTERNAL, "format %d is missing from the format table", p->out_format);
  }
  CQ_TRY(cq_check_contiguous(x, "x"));
  if (x->ndim != 3) return cq_fail(CQ_ERR_INVALID_ARG, "x has %d dims; expected 3 ([batch, seq, dim])", (int)x->ndim);
  CQ_TRY(cq_check_dtype(x, "x", float_dtypes, 3));
  CQ_TRY(check_modulation(scale, "scale", x));
  CQ_TRY(check_modulation(shift, "shift", x));

  CQ_TRY(check_output(out, "out", x, "x"));
  if (out->ndim != 3)
    return cq_fail(CQ_ERR_INVALID_ARG, "out has %d dims; expected 3, x's shape (%lld, %lld, %lld)", (int)out->ndim,
                   (long long)x->shape[0], (long long)x->shape[1], (long long)x->shape[2]);
  if (out->shape[0] != x->shape[0] || out->shape[1] != x->shape[1] || out->shape[2] != x->shape[2])
    return cq_fail(CQ_ERR_INVALID_ARG, "out has shape (%lld, %lld, %lld); expected x's shape (%lld, %lld, %lld)",
                   (long long)out->shape[0], (long long)out->shape[1], (long long)out->shape[2],
                   (long long)x->shape[0], (long long)x->shape[1], (long long)x->shape[2]);
  if (!*f) {
    if (out->dtype != x->dtype)
      return cq_fail(CQ_ERR_TYPE, "out has dtype %s; expected x's dtype %s (out_format none)",
                     cq_dtype_name(out->dtype), cq_dtype_name(x->dtype));
    if (out_scale)
      return cq_fail(CQ_ERR_INVALID_ARG, "out_scale is given but out_format is none; expected NULL (no scales)");
  } else {
    const cq_dtype codes[] = {(*f)->code_dtype, CQ_DTYPE_U8};
    CQ_TRY(cq_check_dtype(out, "out", codes, (*f)->code_dtype == CQ_DTYPE_F8_E4M3FN ? 2 : 1));
    if (!out_scale)
      return cq_fail(CQ_ERR_INVALID_ARG, "out_scale is required for out_format %s (one fp32 scale per row)",
                     (*f)->name);
    CQ_TRY(check_output(out_scale, "out_scale", x, "x"));
    CQ_TRY(cq_check_dtype(out_scale, "out_scale", f32_only, 1));
    const int64_t rows = x->shape[0] * x->shape[1];
    if (cq_tensor_numel(out_scale) != rows)
      return cq_fail(CQ_ERR_INVALID_ARG, "out_scale has %lld elements; expected batch * seq = %lld (one per row)",
                     (long long)cq_tensor_numel(out_scale), (long long)rows);
    CQ_TRY(cq_check_no_overlap(out_scale, "out_scale", x, "x"));
    CQ_TRY(cq_check_no_overlap(out_scale, "out_scale", scale, "scale"));
    CQ_TRY(cq_check_no_overlap(out_scale, "out_scale", shift, "shift"));
    CQ_TRY(cq_check_no_overlap(out, "out", out_scale, "out_scale"));
  }
  CQ_TRY(cq_check_no_overlap(out, "out", x, "x"));
  CQ_TRY(cq_check_no_overlap(out, "out", scale, "scale"));
  return cq_check_no_overlap(out, "out", shift, "shift");
}

/* ---- qk_norm_rope ---- */

static cq_status same_shape(const cq_tensor *t, const char *name, const cq_tensor *ref, const char *ref_name) {
  for (int i = 0; i < 4; ++i)
    if (t->shape[i] != ref->shape[i])
      return cq_fail(CQ_ERR_INVALID_ARG, "%s has shape (%lld, %lld, %lld, %lld); expected %s's shape (%lld, %lld, %lld, %lld)",
                     name, (long long)t->shape[0], (long long)t->shape[1], (long long)t->shape[2], (long long)t->shape[3],
                     ref_name, (long long)ref->shape[0], (long long)ref->shape[1], (long long)ref->shape[2],
                     (long long)ref->shape[3]);
  return CQ_OK;
}

/* An input of q_in's dtype, device and shape. */
static cq_status check_like_q(const cq_tensor *t, const char *name, const cq_tensor *q_in) {
  CQ_TRY(cq_check_bshd(t, name, "[batch, seq, heads, head_dim]"));
  CQ_TRY(cq_check_same_device(q_in, "q_in", t, name));
  if (t->dtype != q_in->dtype)
    return cq_fail(CQ_ERR_TYPE, "%s has dtype %s; expected q_in's dtype %s", name, cq_dtype_name(t->dtype),
                   cq_dtype_name(q_in->dtype));
  return same_shape(t, name, q_in, "q_in");
}

static cq_status check_norm_weight(const cq_tensor *w, const char *name, const cq_tensor *q_in, int rms_norm) {
  if (!w) return CQ_OK;
  if (!rms_norm)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s is given but rms_norm is 0; norm weights are only read by the RMSNorm",
                   name);
  CQ_TRY(cq_check_contiguous(w, name));
  CQ_TRY(cq_check_same_device(q_in, "q_in", w, name));
  CQ_TRY(cq_check_dtype(w, name, float_dtypes, 3));
  if (w->ndim != 1 || w->shape[0] != q_in->shape[3])
    return cq_fail(CQ_ERR_INVALID_ARG, "%s has %d dims and %lld elements; expected shape (%lld,) = [head_dim]", name,
                   (int)w->ndim, (long long)cq_tensor_numel(w), (long long)q_in->shape[3]);
  return CQ_OK;
}

/* cos / sin: f32 [seq_total, head_dim / 2], contiguous. */
static cq_status check_table(const cq_tensor *t, const char *name, const cq_tensor *q_in, int64_t seq_total) {
  const int64_t half = q_in->shape[3] / 2;
  CQ_TRY(cq_check_present(t, name));
  CQ_TRY(cq_check_same_device(q_in, "q_in", t, name));
  CQ_TRY(cq_check_dtype(t, name, f32_only, 1));
  if (t->ndim != 2 || t->shape[0] != seq_total || t->shape[1] != half)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s has %d dims of extents (%lld, %lld, ...); expected shape (%lld, %lld) = "
                   "[seq_total, head_dim / 2]", name, (int)t->ndim, t->ndim > 0 ? (long long)t->shape[0] : 0LL,
                   t->ndim > 1 ? (long long)t->shape[1] : 0LL, (long long)seq_total, (long long)half);
  return cq_tensor_numel(t) > 0 ? cq_check_contiguous(t, name) : CQ_OK;
}

/* An output [batch, seq_total, heads, head_dim] in q_in's dtype; seq_total from q_out. */
static cq_status check_out(const cq_tensor *t, const char *name, const cq_tensor *q_in, const cq_tensor *q_out) {
  CQ_TRY(cq_check_bshd(t, name, "[batch, seq_total, heads, head_dim]"));
  CQ_TRY(cq_check_writable(t, name));
  CQ_TRY(cq_check_same_device(q_in, "q_in", t, name));
  if (t->dtype != q_in->dtype)
    return cq_fail(CQ_ERR_TYPE, "%s has dtype %s; expected q_in's dtype %s", name, cq_dtype_name(t->dtype),
                   cq_dtype_name(q_in->dtype));
  if (t == q_out) {
    if (t->shape[0] != q_in->shape[0] || t->shape[2] != q_in->shape[2] || t->shape[3] != q_in->shape[3])
      return cq_fail(CQ_ERR_INVALID_ARG, "q_out has shape (%lld, %lld, %lld, %lld); expected (%lld, seq_total, %lld, "
                     "%lld) to match q_in's batch, heads and head_dim", (long long)t->shape[0], (long long)t->shape[1],
                     (long long)t->shape[2], (long long)t->shape[3], (long long)q_in->shape[0],
                     (long long)q_in->shape[2], (long long)q_in->shape[3]);
  } else {
    CQ_TRY(same_shape(t, name, q_out, "q_out"));
  }
  return cq_check_no_self_overlap(t, name);
}

cq_status cq_check_qk_norm_rope(const cq_tensor *q_in, const cq_tensor *k_in, const cq_tensor *v_in,
                                const cq_tensor *q_weight, const cq_tensor *k_weight, const cq_tensor *cos,
                                const cq_tensor *sin, const cq_qk_norm_rope_params *p, const cq_tensor *q_out,
                                const cq_tensor *k_out, const cq_tensor *v_out, cq_qk_norm_rope_dims *dims) {
  if (!p) return cq_fail(CQ_ERR_INVALID_ARG, "params is required");
  CQ_TRY(check_eps(p->eps));
  CQ_TRY(cq_check_bshd(q_in, "q_in", "[batch, seq, heads, head_dim]"));
  CQ_TRY(cq_check_dtype(q_in, "q_in", float_dtypes, 3));
  CQ_TRY(check_like_q(k_in, "k_in", q_in));
  if (v_in) CQ_TRY(check_like_q(v_in, "v_in", q_in));
  if (!v_in != !v_out)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s is given without %s; expected both v_in and v_out, or neither",
                   v_in ? "v_in" : "v_out", v_in ? "v_out" : "v_in");
  CQ_TRY(check_norm_weight(q_weight, "q_weight", q_in, p->rms_norm));
  CQ_TRY(check_norm_weight(k_weight, "k_weight", q_in, p->rms_norm));

  CQ_TRY(check_out(q_out, "q_out", q_in, q_out));
  CQ_TRY(check_out(k_out, "k_out", q_in, q_out));
  if (v_out) CQ_TRY(check_out(v_out, "v_out", q_in, q_out));
  const int64_t seq = q_in->shape[1], seq_total = q_out->shape[1], d = q_in->shape[3];
  if (p->seq_offset < 0 || p->seq_offset > seq_total || seq > seq_total - p->seq_offset)
    return cq_fail(CQ_ERR_INVALID_ARG, "seq_offset = %lld with %lld tokens does not fit the %lld rows of the outputs; "
                   "expected 0 <= seq_offset and seq_offset + seq <= seq_total", (long long)p->seq_offset,
                   (long long)seq, (long long)seq_total);

  if (!cos != !sin)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s is given without %s; expected both cos and sin (rotation), or neither",
                   cos ? "cos" : "sin", cos ? "sin" : "cos");
  if (cos) {
    if (d % 2)
      return cq_fail(CQ_ERR_INVALID_ARG, "head_dim = %lld is odd; the rotation turns pairs (2i, 2i+1), so it needs "
                     "an even head_dim", (long long)d);
    CQ_TRY(check_table(cos, "cos", q_in, seq_total));
    CQ_TRY(check_table(sin, "sin", q_in, seq_total));
  }

  const cq_tensor *outs[] = {q_out, k_out, v_out};
  const char *out_names[] = {"q_out", "k_out", "v_out"};
  const cq_tensor *ins[] = {q_in, k_in, v_in, q_weight, k_weight, cos, sin};
  const char *in_names[] = {"q_in", "k_in", "v_in", "q_weight", "k_weight", "cos", "sin"};
  for (int o = 0; o < 3; ++o) {
    if (!outs[o]) continue;
    for (int i = 0; i < 7; ++i) CQ_TRY(cq_check_no_overlap(outs[o], out_names[o], ins[i], in_names[i]));
    for (int j = o + 1; j < 3; ++j) CQ_TRY(cq_check_no_overlap(outs[o], out_names[o], outs[j], out_names[j]));
  }
  dims->batch = q_in->shape[0], dims->seq = seq, dims->heads = q_in->shape[2], dims->head_dim = d;
  dims->seq_total = seq_total;
  return CQ_OK;
}
