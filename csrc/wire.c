/* The 8-bit wire (cq_wire_encode / cq_wire_decode): argument checks, the C reference, dispatch. */
#include <math.h>
#include <string.h>

#include "cq_numerics.h"
#include "cquant-impl.h"
#ifdef CQ_WITH_CUDA
#include "cquant-cuda.h"
#endif

#define WIRE_MAX_COLS 65536 /* sum code^2 of a row stays below 2^31 */

static const char *const arg_names[2][CQ_WIRE_ARGS] = {{"x", "mean", "codes", "scales", "norms"},
                                                       {"y", "mean", "codes", "scales", "norms"}};

/* t has the shape of the values (rows and cols, want_cols) or of their rows only, no zero-size
 * dim, non-negative strides, and (with cols) a contiguous last dim; its row strides go to out. */
static cq_status check_view(const cq_tensor *t, const char *name, const cq_tensor *values, const char *values_name,
                            int want_cols, int64_t out[4]) {
  const int nd = want_cols ? values->ndim : values->ndim - 1;
  if (t->ndim != nd || memcmp(t->shape, values->shape, (size_t)nd * sizeof t->shape[0])) {
    char got[96], want[96], whole[96];
    cq_tensor rows = *values;
    rows.ndim = nd;
    cq_format_shape(t, got, sizeof got);
    cq_format_shape(&rows, want, sizeof want);
    cq_format_shape(values, whole, sizeof whole);
    return cq_fail(CQ_ERR_INVALID_ARG, "%s has shape %s; expected %s, a value per %s of %s %s", name, got, want,
                   want_cols ? "element" : "row", values_name, whole);
  }
  for (int d = 0; d < t->ndim; ++d)
    if (t->strides[d] < 0)
      return cq_fail(CQ_ERR_INVALID_ARG, "%s has stride %lld in dim %d; expected non-negative strides", name,
                     (long long)t->strides[d], d);
  if (want_cols && t->shape[nd - 1] > 1 && t->strides[nd - 1] != 1)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s has stride %lld in its last dim; expected 1 (contiguous rows)", name,
                   (long long)t->strides[nd - 1]);
  const int rdims = values->ndim - 1;
  for (int k = 0; k < 4; ++k) out[k] = k < 4 - rdims ? 0 : t->strides[k - (4 - rdims)];
  return CQ_OK;
}

/* Bytes from the first element of t's sub-view at dims >= from to past its last one. */
static int64_t span_bytes(const cq_tensor *t, int from) {
  const int64_t esize = (int64_t)cq_dtype_size(t->dtype);
  int64_t bytes = esize;
  for (int d = from; d < t->ndim; ++d) bytes += (t->shape[d] - 1) * t->strides[d] * esize;
  return bytes;
}

/* Two outputs whose spans meet may still be apart: the 8-bit wire's send buffers hold, for each
 * destination, its codes and then its scales, so both views step through dim 0 by one period P
 * and, within a period, fill disjoint byte ranges. */
static int apart_in_periods(const cq_tensor *a, const cq_tensor *b) {
  const int64_t pa = a->strides[0] * (int64_t)cq_dtype_size(a->dtype);
  if (a->shape[0] < 2 || b->shape[0] < 2 || pa != b->strides[0] * (int64_t)cq_dtype_size(b->dtype) || pa <= 0)
    return 0;
  const int64_t wa = span_bytes(a, 1), wb = span_bytes(b, 1);
  const int64_t ob = (((char *)b->data - (char *)a->data) % pa + pa) % pa; /* b's start within a's period */
  return ob >= wa && ob + wb <= pa;
}

cq_status cq_check_wire(const cq_tensor *values, const cq_tensor *mean, const cq_tensor *codes, const cq_tensor *scales,
                        const cq_tensor *norms, int decode, cq_wire_rows *g) {
  static const cq_dtype floats[] = {CQ_DTYPE_F32, CQ_DTYPE_F16, CQ_DTYPE_BF16}, f32[] = {CQ_DTYPE_F32},
                        i8[] = {CQ_DTYPE_I8};
  const char *const *names = arg_names[decode != 0];
  const cq_tensor *args[CQ_WIRE_ARGS] = {values, mean, codes, scales, decode ? NULL : norms};
  const cq_dtype *dtypes[CQ_WIRE_ARGS] = {floats, f32, i8, f32, f32};
  const int ndtypes[CQ_WIRE_ARGS] = {3, 1, 1, 1, 1};
  CQ_TRY(cq_check_present(values, names[CQ_WIRE_VALUES]));
  CQ_TRY(cq_check_present(codes, "codes"));
  CQ_TRY(cq_check_present(scales, "scales"));
  if (values->ndim < 2 || values->ndim > 5)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s has %d dimensions; expected 2 to 5 (up to 4 row dims, then the columns)",
                   names[CQ_WIRE_VALUES], (int)values->ndim);
  for (int d = 0; d < values->ndim; ++d)
    if (values->shape[d] < 1) {
      char a[96];
      cq_format_shape(values, a, sizeof a);
      return cq_fail(CQ_ERR_INVALID_ARG, "%s has shape %s; expected no zero-size dimension", names[CQ_WIRE_VALUES], a);
    }
  if (cq_tensor_numel(values) < 0) /* a broadcast view can describe more rows than int64 counts */
    return cq_fail(CQ_ERR_INVALID_ARG, "%s has more elements than int64 counts", names[CQ_WIRE_VALUES]);
  memset(g, 0, sizeof *g);
  g->cols = values->shape[values->ndim - 1];
  if (g->cols > WIRE_MAX_COLS)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s has rows of %lld values; expected at most %d", names[CQ_WIRE_VALUES],
                   (long long)g->cols, WIRE_MAX_COLS);
  g->rows = 1;
  const int rdims = values->ndim - 1;
  for (int k = 0; k < 4; ++k) {
    g->shape[k] = k < 4 - rdims ? 1 : values->shape[k - (4 - rdims)];
    g->rows *= g->shape[k];
  }
  for (int a = 0; a < CQ_WIRE_ARGS; ++a) {
    if (!args[a]) continue;
    CQ_TRY(cq_check_same_device(values, names[CQ_WIRE_VALUES], args[a], names[a]));
    CQ_TRY(cq_check_dtype(args[a], names[a], dtypes[a], ndtypes[a]));
    CQ_TRY(check_view(args[a], names[a], values, names[CQ_WIRE_VALUES], a <= CQ_WIRE_CODES, g->strides[a]));
  }
  /* outputs: writable, elements apart, apart from the inputs and from each other */
  const int outs_encode[] = {CQ_WIRE_CODES, CQ_WIRE_SCALES, CQ_WIRE_NORMS}, outs_decode[] = {CQ_WIRE_VALUES};
  const int *outs = decode ? outs_decode : outs_encode, nout = decode ? 1 : 3;
  for (int i = 0; i < nout; ++i) {
    const cq_tensor *o = args[outs[i]];
    if (!o) continue;
    CQ_TRY(cq_check_writable(o, names[outs[i]]));
    CQ_TRY(cq_check_no_self_overlap(o, names[outs[i]]));
    for (int a = 0; a < CQ_WIRE_ARGS; ++a) {
      if (!args[a] || a == outs[i]) continue;
      const int both_out = !decode && a != CQ_WIRE_VALUES && a != CQ_WIRE_MEAN;
      if (!(both_out && apart_in_periods(o, args[a]))) CQ_TRY(cq_check_no_overlap(o, names[outs[i]], args[a], names[a]));
    }
  }
  return CQ_OK;
}

/* Element offset of row r's first value in an argument. */
static int64_t row_offset(const cq_wire_rows *g, int arg, int64_t r) {
  int64_t off = 0;
  for (int k = 3; k >= 0; --k) {
    off += (r % g->shape[k]) * g->strides[arg][k];
    r /= g->shape[k];
  }
  return off;
}

static cq_status encode_cpu(const cq_tensor *x, const cq_tensor *mean, cq_tensor *codes, cq_tensor *scales,
                            cq_tensor *norms, const cq_wire_rows *g) {
#pragma omp parallel for schedule(static) if (g->rows * g->cols >= CQ_OMP_MIN_WORK)
  for (int64_t r = 0; r < g->rows; ++r) {
    const int64_t xo = row_offset(g, CQ_WIRE_VALUES, r), mo = mean ? row_offset(g, CQ_WIRE_MEAN, r) : 0;
    const float *m = mean ? (const float *)mean->data + mo : NULL;
    float amax = 0.0f, s, inv;
    for (int64_t j = 0; j < g->cols; ++j) {
      float v = cq_load_float(x->data, x->dtype, xo + j);
      if (m) v -= m[j];
      amax = cq_amax_step(amax, v);
    }
    cq_scale_from_amax(amax, 127.0f, &s, &inv);
    int8_t *c = (int8_t *)codes->data + row_offset(g, CQ_WIRE_CODES, r);
    int64_t sumsq = 0;
    for (int64_t j = 0; j < g->cols; ++j) {
      float v = cq_load_float(x->data, x->dtype, xo + j);
      if (m) v -= m[j];
      const int32_t code = inv == 0.0f ? 0 : cq_int8_encode(v * inv);
      c[j] = (int8_t)code;
      sumsq += code * code;
    }
    ((float *)scales->data)[row_offset(g, CQ_WIRE_SCALES, r)] = s;
    if (norms) ((float *)norms->data)[row_offset(g, CQ_WIRE_NORMS, r)] = s * sqrtf((float)sumsq);
  }
  return CQ_OK;
}

static cq_status decode_cpu(const cq_tensor *codes, const cq_tensor *scales, const cq_tensor *mean, cq_tensor *y,
                            const cq_wire_rows *g) {
#pragma omp parallel for schedule(static) if (g->rows * g->cols >= CQ_OMP_MIN_WORK)
  for (int64_t r = 0; r < g->rows; ++r) {
    const int8_t *c = (const int8_t *)codes->data + row_offset(g, CQ_WIRE_CODES, r);
    const float s = ((const float *)scales->data)[row_offset(g, CQ_WIRE_SCALES, r)];
    const float *m = mean ? (const float *)mean->data + row_offset(g, CQ_WIRE_MEAN, r) : NULL;
    const int64_t yo = row_offset(g, CQ_WIRE_VALUES, r);
    for (int64_t j = 0; j < g->cols; ++j) {
      float v = (float)c[j] * s;
      if (m) v += m[j];
      cq_store_float(y->data, y->dtype, yo + j, v);
    }
  }
  return CQ_OK;
}

cq_status cq_wire_encode_ref(const cq_tensor *x, const cq_tensor *mean, cq_tensor *codes, cq_tensor *scales,
                             cq_tensor *norms) {
  cq_wire_rows g;
  CQ_TRY(cq_check_wire(x, mean, codes, scales, norms, 0, &g));
  CQ_TRY(cq_require_cpu(x, "cq_wire_encode"));
  return encode_cpu(x, mean, codes, scales, norms, &g);
}

cq_status cq_wire_encode(const cq_tensor *x, const cq_tensor *mean, cq_tensor *codes, cq_tensor *scales,
                         cq_tensor *norms, void *stream) {
  cq_wire_rows g;
  CQ_TRY(cq_check_wire(x, mean, codes, scales, norms, 0, &g));
  if (x->device_type == CQ_DEVICE_CPU) return encode_cpu(x, mean, codes, scales, norms, &g);
  (void)stream;
  CQ_CUDA_OR_UNSUPPORTED(x, "wire_encode", cq_wire_encode_cuda(x, mean, codes, scales, norms, &g, stream));
}

cq_status cq_wire_decode_ref(const cq_tensor *codes, const cq_tensor *scales, const cq_tensor *mean, cq_tensor *y) {
  cq_wire_rows g;
  CQ_TRY(cq_check_wire(y, mean, codes, scales, NULL, 1, &g));
  CQ_TRY(cq_require_cpu(y, "cq_wire_decode"));
  return decode_cpu(codes, scales, mean, y, &g);
}

cq_status cq_wire_decode(const cq_tensor *codes, const cq_tensor *scales, const cq_tensor *mean, cq_tensor *y,
                         void *stream) {
  cq_wire_rows g;
  CQ_TRY(cq_check_wire(y, mean, codes, scales, NULL, 1, &g));
  if (y->device_type == CQ_DEVICE_CPU) return decode_cpu(codes, scales, mean, y, &g);
  (void)stream;
  CQ_CUDA_OR_UNSUPPORTED(y, "wire_decode", cq_wire_decode_cuda(codes, scales, mean, y, &g, stream));
}
