/* CPU reference of quantize / dequantize / pack / unpack: the math of cquant.h,
 * written plainly; rows run in parallel. */
#include <stdlib.h>
#include <string.h>

#include "cq_numerics.h"
#include "cquant-impl.h"

static float row_amax(const cq_tensor *x, int64_t r, int64_t cols) {
  float amax = 0.0f;
  for (int64_t j = 0; j < cols; ++j) amax = cq_amax_step(amax, cq_load_float(x->data, x->dtype, r * cols + j));
  return amax;
}

/* One row of a 4-bit format, group by group (cquant.h "4-bit integer formats"): int4 takes a
 * scale from the group's amax, uint4 a scale and zero point from the group's range, both scales
 * rounded to 8 significant bits. The row is zeroed first, so a group without a usable scale keeps
 * all-zero codes. */
static void quantize_group_row(const cq_tensor *x, const cq_format_info *f, int64_t r, int64_t cols,
                               int64_t group_size, uint8_t *row, float *scales) {
  const int64_t groups = cols / group_size;
  const int uint4 = f->id == CQ_FORMAT_UINT4;
  const int64_t base = r * cols;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t j0 = g * group_size;
    float s, inv, zp = 0.0f;
    if (uint4) {
      float lo = 0.0f, hi = 0.0f;
      for (int64_t j = j0; j < j0 + group_size; ++j)
        cq_range_step(&lo, &hi, cq_load_float(x->data, x->dtype, base + j));
      cq_uint4_params(lo, hi, &s, &inv, &zp);
      scales[2 * (r * groups + g)] = s;
      scales[2 * (r * groups + g) + 1] = zp;
    } else {
      float amax = 0.0f;
      for (int64_t j = j0; j < j0 + group_size; ++j)
        amax = cq_amax_step(amax, cq_load_float(x->data, x->dtype, base + j));
      cq_int4_scale_from_amax(amax, &s, &inv);
      scales[r * groups + g] = s;
    }
    if (!cq_isfinite(s) || !(s == s)) continue; /* NaN/Inf in the group: codes stay 0 */
    for (int64_t j = j0; j < j0 + group_size; ++j) {
      float v = cq_load_float(x->data, x->dtype, base + j);
      cq_store_bits(row, j, 4, uint4 ? cq_uint4_encode(v, inv, zp) : cq_int4_encode(v * inv));
    }
  }
}

/* One row of two-level int4 (cquant.h "Two-level int4"): the row's s1, then per group its s2 and
 * codes with inv = 1 / (s1 * s2). A row holding NaN/Inf gets s1 = NaN, every s2 = 1 and all-zero
 * codes (the row was zeroed first). */
static void quantize_two_level_row(const cq_tensor *x, int64_t r, int64_t cols, int64_t group_size, uint8_t *row,
                                   float *scales) {
  const int64_t groups = cols / group_size, base = r * cols;
  float *s = scales + r * (1 + groups);
  const float s1 = cq_two_level_s1(row_amax(x, r, cols));
  s[0] = s1;
  const int bad = !(s1 == s1);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t j0 = g * group_size;
    s[1 + g] = 1.0f;
    if (bad) continue;
    float ag = 0.0f;
    for (int64_t j = j0; j < j0 + group_size; ++j) ag = cq_amax_step(ag, cq_load_float(x->data, x->dtype, base + j));
    const float s2 = cq_two_level_s2(ag, s1), inv = 1.0f / (s1 * s2);
    s[1 + g] = s2;
    for (int64_t j = j0; j < j0 + group_size; ++j)
      cq_store_bits(row, j, 4, cq_int4_encode(cq_load_float(x->data, x->dtype, base + j) * inv));
  }
}

cq_status cq_quantize_cpu(const cq_tensor *x, const cq_quant_params *p, const cq_format_info *f,
                          cq_tensor *q, cq_tensor *scale) {
  const int64_t rows = cq_rows(x), cols = cq_cols(x), row_bytes = cq_packed_row_bytes(f, cols);
  float *scales = (float *)scale->data;
  float tensor_scale = 0.0f, tensor_inv = 0.0f;

  if (p->granularity == CQ_GRANULARITY_GROUP) {
#pragma omp parallel for schedule(static) if (rows * cols >= CQ_OMP_MIN_WORK)
    for (int64_t r = 0; r < rows; ++r) {
      uint8_t *row = (uint8_t *)q->data + r * row_bytes;
      memset(row, 0, (size_t)row_bytes);
      quantize_group_row(x, f, r, cols, p->group_size, row, scales);
    }
    return CQ_OK;
  }
  if (p->granularity == CQ_GRANULARITY_TWO_LEVEL) {
#pragma omp parallel for schedule(static) if (rows * cols >= CQ_OMP_MIN_WORK)
    for (int64_t r = 0; r < rows; ++r) {
      uint8_t *row = (uint8_t *)q->data + r * row_bytes;
      memset(row, 0, (size_t)row_bytes);
      quantize_two_level_row(x, r, cols, p->group_size, row, scales);
    }
    return CQ_OK;
  }

  if (p->granularity == CQ_GRANULARITY_TENSOR) {
    if (p->static_scale) {
      tensor_scale = scales[0];
      tensor_inv = 1.0f / tensor_scale;
    } else {
      float *amax = (float *)cq_alloc(rows, sizeof(float));
      if (!amax) return cq_fail(CQ_ERR_OOM, "quantize: no host memory for %lld row maxima", (long long)rows);
#pragma omp parallel for schedule(static) if (rows * cols >= CQ_OMP_MIN_WORK)
      for (int64_t r = 0; r < rows; ++r) amax[r] = row_amax(x, r, cols);
      float a = 0.0f;
      for (int64_t r = 0; r < rows; ++r) a = cq_amax_step(a, amax[r]);
      free(amax);
      cq_scale_from_amax(a, f->max_value, &tensor_scale, &tensor_inv);
      scales[0] = tensor_scale;
    }
  }

#pragma omp parallel for schedule(static) if (rows * cols >= CQ_OMP_MIN_WORK)
  for (int64_t r = 0; r < rows; ++r) {
    float s = tensor_scale, inv = tensor_inv;
    if (p->granularity == CQ_GRANULARITY_ROW) {
      if (p->static_scale) {
        s = scales[r];
        inv = 1.0f / s;
      } else {
        cq_scale_from_amax(row_amax(x, r, cols), f->max_value, &s, &inv);
        scales[r] = s;
      }
    }
    /* a group holding NaN/Inf (scale NaN), or a given scale that is not finite and > 0,
     * stores all-zero codes; a valid scale below 2^-128 has inv = +inf, which saturates */
    int bad = !(s > 0.0f) || !cq_isfinite(s);
    uint8_t *row = (uint8_t *)q->data + r * row_bytes;
    memset(row, 0, (size_t)row_bytes);
    if (bad) continue;
    for (int64_t j = 0; j < cols; ++j) {
      float v = cq_load_float(x->data, x->dtype, r * cols + j) * inv;
      cq_store_code(f, row, j, f->encode(f, v));
    }
  }
  return CQ_OK;
}

/* Value of every code of a format (at most 8 bits). */
static void decode_table(const cq_format_info *f, float lut[256]) {
  for (uint32_t c = 0; c < 256; ++c) lut[c] = c < (1u << f->bits) ? f->decode(f, c) : 0.0f;
}

cq_status cq_dequantize_cpu(const cq_tensor *q, const cq_tensor *scale, const cq_quant_params *p,
                            const cq_format_info *f, cq_tensor *y) {
  const int64_t rows = cq_rows(y), cols = cq_cols(y), row_bytes = cq_packed_row_bytes(f, cols);
  const float *scales = (const float *)scale->data;
  float lut[256];
  decode_table(f, lut);
  if (p->granularity == CQ_GRANULARITY_GROUP) {
    const int64_t gs = p->group_size, groups = cols / gs;
    const int uint4 = f->id == CQ_FORMAT_UINT4;
#pragma omp parallel for schedule(static) if (rows * cols >= CQ_OMP_MIN_WORK)
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t *row = (const uint8_t *)q->data + r * row_bytes;
      for (int64_t j = 0; j < cols; ++j) {
        const int64_t g = r * groups + j / gs;
        const uint32_t c = cq_load_bits(row, j, 4);
        const float v = uint4 ? cq_uint4_decode(c, scales[2 * g], scales[2 * g + 1]) : cq_int4_decode(c) * scales[g];
        cq_store_float(y->data, y->dtype, r * cols + j, v);
      }
    }
    return CQ_OK;
  }
  if (p->granularity == CQ_GRANULARITY_TWO_LEVEL) {
    const int64_t gs = p->group_size, width = 1 + cols / gs;
#pragma omp parallel for schedule(static) if (rows * cols >= CQ_OMP_MIN_WORK)
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t *row = (const uint8_t *)q->data + r * row_bytes;
      const float *s = scales + r * width;
      for (int64_t j = 0; j < cols; ++j)
        cq_store_float(y->data, y->dtype, r * cols + j, cq_two_level_decode(cq_load_bits(row, j, 4), s[0], s[1 + j / gs]));
    }
    return CQ_OK;
  }
#pragma omp parallel for schedule(static) if (rows * cols >= CQ_OMP_MIN_WORK)
  for (int64_t r = 0; r < rows; ++r) {
    float s = scales[p->granularity == CQ_GRANULARITY_ROW ? r : 0];
    const uint8_t *row = (const uint8_t *)q->data + r * row_bytes;
    for (int64_t j = 0; j < cols; ++j) cq_store_float(y->data, y->dtype, r * cols + j, lut[cq_load_code(f, row, j)] * s);
  }
  return CQ_OK;
}

cq_status cq_pack_cpu(const cq_tensor *codes, int bits, cq_tensor *packed) {
  const int64_t rows = cq_rows(codes), cols = cq_cols(codes), row_bytes = cq_pack_row_bytes_bits(bits, cols);
#pragma omp parallel for schedule(static) if (rows * cols >= CQ_OMP_MIN_WORK)
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t *out = (uint8_t *)packed->data + r * row_bytes;
    const uint8_t *in = (const uint8_t *)codes->data + r * cols;
    memset(out, 0, (size_t)row_bytes);
    for (int64_t j = 0; j < cols; ++j) cq_store_bits(out, j, bits, in[j]);
  }
  return CQ_OK;
}

cq_status cq_unpack_cpu(const cq_tensor *packed, int bits, cq_tensor *codes) {
  const int64_t rows = cq_rows(codes), cols = cq_cols(codes), row_bytes = cq_pack_row_bytes_bits(bits, cols);
#pragma omp parallel for schedule(static) if (rows * cols >= CQ_OMP_MIN_WORK)
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t *in = (const uint8_t *)packed->data + r * row_bytes;
    uint8_t *out = (uint8_t *)codes->data + r * cols;
    for (int64_t j = 0; j < cols; ++j) out[j] = (uint8_t)cq_load_bits(in, j, bits);
  }
  return CQ_OK;
}
