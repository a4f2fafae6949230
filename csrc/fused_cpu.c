/* CPU reference of the fused DiT block ops (cquant.h, "fused DiT block ops"), written plainly:
 * every sum in index order, every step one fp32 operation, so the math reads as the header
 * states it. Rows (tokens and heads) run in parallel. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cquant-impl.h"

/* ---- norm_modulate ---- */

/* Element d of row b of a [B, D] modulation vector (NULL: 0). */
static float modulation(const cq_tensor *t, int64_t b, int64_t d) {
  return t ? cq_load_float(t->data, t->dtype, b * t->strides[0] + d) : 0.0f;
}

/* t = round(n * (1 + scale) + shift) of row r of x, written into row r of t_data (x's dtype). */
static void modulate_row(const cq_tensor *x, const cq_tensor *scale, const cq_tensor *shift,
                         const cq_norm_modulate_params *p, int64_t r, void *t_data) {
  const int64_t d_len = x->shape[2], b = r / x->shape[1], base = r * d_len;
  const float dn = (float)d_len;
  float mu = 0.0f, ss = 0.0f;
  if (p->norm == CQ_NORM_LAYER) {
    float sum = 0.0f;
    for (int64_t d = 0; d < d_len; ++d) sum += cq_load_float(x->data, x->dtype, base + d);
    mu = sum / dn;
  }
  /* LayerNorm: the squares of x - mu (mu = 0 for RMSNorm, where x - 0 is x exactly) */
  for (int64_t d = 0; d < d_len; ++d) {
    const float c = cq_load_float(x->data, x->dtype, base + d) - mu;
    ss += c * c;
  }
  const float rstd = 1.0f / sqrtf(ss / dn + p->eps);
  for (int64_t d = 0; d < d_len; ++d) {
    const float n = (cq_load_float(x->data, x->dtype, base + d) - mu) * rstd;
    const float v = n * (1.0f + modulation(scale, b, d)) + modulation(shift, b, d);
    cq_store_float(t_data, x->dtype, base + d, v);
  }
}

cq_status cq_norm_modulate_cpu(const cq_tensor *x, const cq_tensor *scale, const cq_tensor *shift,
                               const cq_norm_modulate_params *p, const cq_format_info *f, cq_tensor *out,
                               cq_tensor *out_scale) {
  const int64_t rows = x->shape[0] * x->shape[1], numel = rows * x->shape[2];
  /* A quantized out_format encodes t as cq_quantize does, by running it on t: the codes and
   * scales are those of cq_quantize(t) by construction. t then needs a temporary. */
  void *t_data = out->data;
  if (f) {
    t_data = cq_alloc(numel, cq_dtype_size(x->dtype));
    if (!t_data) return cq_fail(CQ_ERR_OOM, "norm_modulate: no host memory for %lld modulated values", (long long)numel);
  }
#pragma omp parallel for schedule(static) if (numel >= CQ_OMP_MIN_WORK)
  for (int64_t r = 0; r < rows; ++r) modulate_row(x, scale, shift, p, r, t_data);
  if (!f) return CQ_OK;
  cq_tensor t = *x;
  t.data = t_data;
  const cq_quant_params qp = {.format = f->id, .granularity = CQ_GRANULARITY_ROW, .static_scale = 0};
  const cq_status st = cq_quantize_cpu(&t, &qp, f, out, out_scale);
  free(t_data);
  return st;
}

/* ---- qk_norm_rope ---- */

/* Element d of one head (at element offset `off` of `in`) after the RMSNorm, if any. */
static float normed(const cq_tensor *in, int64_t off, int64_t d, int rms_norm, float r, const cq_tensor *w) {
  float a = cq_load_float(in->data, in->dtype, off + d);
  if (rms_norm) {
    a = a * r;
    if (w) a = a * cq_load_float(w->data, w->dtype, d);
  }
  return a;
}

/* One head of q or k: RMSNorm over the head dim, then the rotation of its pairs by row p of
 * cos / sin (cos_row NULL: no rotation). */
static void norm_rope_head(const cq_tensor *in, int64_t in_off, const cq_tensor *w, const float *cos_row,
                           const float *sin_row, const cq_qk_norm_rope_params *p, int64_t d_len, cq_tensor *out,
                           int64_t out_off) {
  float r = 1.0f;
  if (p->rms_norm) {
    float ss = 0.0f;
    for (int64_t d = 0; d < d_len; ++d) {
      const float a = cq_load_float(in->data, in->dtype, in_off + d);
      ss += a * a;
    }
    r = 1.0f / sqrtf(ss / (float)d_len + p->eps);
  }
  if (!cos_row) {
    for (int64_t d = 0; d < d_len; ++d)
      cq_store_float(out->data, out->dtype, out_off + d, normed(in, in_off, d, p->rms_norm, r, w));
    return;
  }
  for (int64_t i = 0; i < d_len / 2; ++i) {
    const float a0 = normed(in, in_off, 2 * i, p->rms_norm, r, w);
    const float a1 = normed(in, in_off, 2 * i + 1, p->rms_norm, r, w);
    const float c = cos_row[i], z = sin_row[i];
    cq_store_float(out->data, out->dtype, out_off + 2 * i, a0 * c - a1 * z);
    cq_store_float(out->data, out->dtype, out_off + 2 * i + 1, a0 * z + a1 * c);
  }
}

/* Element offset of [b, s, h, 0] in a 4-D tensor. */
static int64_t offset_of(const cq_tensor *t, int64_t b, int64_t s, int64_t h) {
  return b * t->strides[0] + s * t->strides[1] + h * t->strides[2];
}

cq_status cq_qk_norm_rope_cpu(const cq_tensor *q_in, const cq_tensor *k_in, const cq_tensor *v_in,
                              const cq_tensor *q_weight, const cq_tensor *k_weight, const cq_tensor *cos,
                              const cq_tensor *sin, const cq_qk_norm_rope_params *p, const cq_qk_norm_rope_dims *dims,
                              cq_tensor *q_out, cq_tensor *k_out, cq_tensor *v_out) {
  const int64_t seq = dims->seq, heads = dims->heads, d_len = dims->head_dim;
  const int64_t units = dims->batch * seq * heads; /* (token, head) pairs */
  const size_t v_bytes = (size_t)d_len * cq_dtype_size(q_in->dtype);
#pragma omp parallel for schedule(static) if (units * d_len >= CQ_OMP_MIN_WORK)
  for (int64_t u = 0; u < units; ++u) {
    const int64_t b = u / (seq * heads), s = u / heads % seq, h = u % heads, pos = p->seq_offset + s;
    const float *cos_row = cos ? (const float *)cos->data + pos * (d_len / 2) : NULL;
    const float *sin_row = sin ? (const float *)sin->data + pos * (d_len / 2) : NULL;
    norm_rope_head(q_in, offset_of(q_in, b, s, h), q_weight, cos_row, sin_row, p, d_len, q_out,
                   offset_of(q_out, b, pos, h));
    norm_rope_head(k_in, offset_of(k_in, b, s, h), k_weight, cos_row, sin_row, p, d_len, k_out,
                   offset_of(k_out, b, pos, h));
    if (v_in) {
      const size_t es = cq_dtype_size(q_in->dtype);
      memcpy((char *)v_out->data + offset_of(v_out, b, pos, h) * (int64_t)es,
             (const char *)v_in->data + offset_of(v_in, b, s, h) * (int64_t)es, v_bytes);
    }
  }
  return CQ_OK;
}
