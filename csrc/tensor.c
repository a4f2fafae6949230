/* Tensor descriptors: built from DLPack, checked by name, read and written as fp32. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cq_numerics.h"
#include "cquant-dlpack.h"
#include "cquant-impl.h"

size_t cq_dtype_size(cq_dtype dtype) {
  switch (dtype) {
    case CQ_DTYPE_F64: return 8;
    case CQ_DTYPE_F32:
    case CQ_DTYPE_I32: return 4;
    case CQ_DTYPE_F16:
    case CQ_DTYPE_BF16: return 2;
    case CQ_DTYPE_I8:
    case CQ_DTYPE_U8:
    case CQ_DTYPE_F8_E4M3FN:
    case CQ_DTYPE_F8_E5M2: return 1;
    case CQ_DTYPE_INVALID: break;
  }
  return 0;
}

const char *cq_dtype_name(cq_dtype dtype) {
  switch (dtype) {
    case CQ_DTYPE_F32: return "float32";
    case CQ_DTYPE_F16: return "float16";
    case CQ_DTYPE_BF16: return "bfloat16";
    case CQ_DTYPE_F64: return "float64";
    case CQ_DTYPE_I8: return "int8";
    case CQ_DTYPE_U8: return "uint8";
    case CQ_DTYPE_I32: return "int32";
    case CQ_DTYPE_F8_E4M3FN: return "float8_e4m3fn";
    case CQ_DTYPE_F8_E5M2: return "float8_e5m2";
    case CQ_DTYPE_INVALID: break;
  }
  return "invalid";
}

static cq_dtype dtype_from_dlpack(DLDataType t) {
  if (t.lanes != 1) return CQ_DTYPE_INVALID;
  switch (t.code) {
    case kDLFloat:
      return t.bits == 32 ? CQ_DTYPE_F32 : t.bits == 16 ? CQ_DTYPE_F16 : t.bits == 64 ? CQ_DTYPE_F64 : CQ_DTYPE_INVALID;
    case kDLBfloat: return t.bits == 16 ? CQ_DTYPE_BF16 : CQ_DTYPE_INVALID;
    case kDLInt: return t.bits == 8 ? CQ_DTYPE_I8 : t.bits == 32 ? CQ_DTYPE_I32 : CQ_DTYPE_INVALID;
    case kDLUInt: return t.bits == 8 ? CQ_DTYPE_U8 : CQ_DTYPE_INVALID;
    case kDLFloat8_e4m3fn: return t.bits == 8 ? CQ_DTYPE_F8_E4M3FN : CQ_DTYPE_INVALID;
    case kDLFloat8_e5m2: return t.bits == 8 ? CQ_DTYPE_F8_E5M2 : CQ_DTYPE_INVALID;
    default: return CQ_DTYPE_INVALID;
  }
}

cq_status cq_tensor_from_dlpack(const struct DLTensor *t, int readonly, cq_tensor *out) {
  if (!t || !out) return cq_fail(CQ_ERR_INVALID_ARG, "cq_tensor_from_dlpack: NULL argument");
  memset(out, 0, sizeof *out);
  if (t->dtype.lanes != 1)
    return cq_fail(CQ_ERR_TYPE, "vector dtypes are not supported (lanes = %u, expected 1)",
                   (unsigned)t->dtype.lanes);
  out->dtype = dtype_from_dlpack(t->dtype);
  if (out->dtype == CQ_DTYPE_INVALID)
    return cq_fail(CQ_ERR_TYPE,
                   "DLPack dtype (code %u, %u bits) is not one cquant takes (float32, float16, "
                   "bfloat16, int8, uint8, int32, float8_e4m3fn, float8_e5m2)",
                   (unsigned)t->dtype.code, (unsigned)t->dtype.bits);
  switch (t->device.device_type) {
    case kDLCPU:
    case kDLCUDAHost: out->device_type = CQ_DEVICE_CPU; out->device_id = 0; break;
    case kDLCUDA: out->device_type = CQ_DEVICE_CUDA; out->device_id = t->device.device_id; break;
    default:
      return cq_fail(CQ_ERR_UNSUPPORTED, "DLPack device type %d is not supported (CPU or CUDA)",
                     (int)t->device.device_type);
  }
  if (t->ndim < 0 || t->ndim > CQ_MAX_DIMS)
    return cq_fail(CQ_ERR_DLPACK, "ndim %d is outside 0..%d", (int)t->ndim, CQ_MAX_DIMS);
  if (t->ndim > 0 && !t->shape) return cq_fail(CQ_ERR_DLPACK, "DLPack tensor has no shape");
  out->ndim = t->ndim;
  /* A producer's sizes are not trusted: the element count, and the bytes the strides reach
   * (from the first element to the last), must fit int64 and the address space, or every
   * size computed from them later could wrap. */
  int64_t stride = 1, numel = 1, span = 0;
  for (int d = t->ndim - 1; d >= 0; --d) {
    if (t->shape[d] < 0) return cq_fail(CQ_ERR_DLPACK, "negative extent %lld in dim %d", (long long)t->shape[d], d);
    out->shape[d] = t->shape[d];
    out->strides[d] = t->strides ? t->strides[d] : stride;
    if (!cq_mul_ok(numel, t->shape[d], &numel))
      return cq_fail(CQ_ERR_DLPACK, "shape has more elements than int64 counts (dim %d of extent %lld)", d,
                     (long long)t->shape[d]);
    if (t->shape[d] > 0 && !cq_mul_ok(stride, t->shape[d], &stride)) stride = 0; /* overflow: refused below */
  }
  const int64_t itemsize = (int64_t)cq_dtype_size(out->dtype);
  int64_t bytes;
  if (!cq_mul_ok(numel, itemsize, &bytes))
    return cq_fail(CQ_ERR_DLPACK, "%lld elements of %lld bytes are more bytes than int64 counts", (long long)numel,
                   (long long)itemsize);
  if (numel > 0) {
    for (int d = 0; d < t->ndim; ++d) {
      const int64_t st = out->strides[d] == INT64_MIN ? INT64_MAX : out->strides[d] < 0 ? -out->strides[d] : out->strides[d];
      int64_t reach;
      if (out->strides[d] == INT64_MIN || !cq_mul_ok(out->shape[d] - 1, st, &reach) || !cq_add_ok(span, reach, &span))
        return cq_fail(CQ_ERR_DLPACK, "strides reach more elements than int64 counts (stride %lld in dim %d)",
                       (long long)out->strides[d], d);
    }
    int64_t span_bytes;
    if (!cq_add_ok(span, 1, &span_bytes) || !cq_mul_ok(span_bytes, itemsize, &span_bytes))
      return cq_fail(CQ_ERR_DLPACK, "strides reach more bytes than int64 counts");
  }
  if (t->byte_offset > (uint64_t)INT64_MAX ||
      (t->data && (uintptr_t)t->data > UINTPTR_MAX - (uintptr_t)t->byte_offset))
    return cq_fail(CQ_ERR_DLPACK, "byte_offset %llu is past the end of the address space",
                   (unsigned long long)t->byte_offset);
  out->data = t->data ? (char *)t->data + t->byte_offset : NULL;
  out->readonly = readonly ? 1 : 0;
  return CQ_OK;
}

void *cq_alloc(int64_t count, size_t size) {
  if (count < 0 || (size && (uint64_t)count > SIZE_MAX / size)) return NULL;
  return malloc(count ? (size_t)count * size : 1);
}

int64_t cq_tensor_numel(const cq_tensor *t) {
  for (int d = 0; d < t->ndim; ++d)
    if (t->shape[d] == 0) return 0; /* before multiplying: the other extents of an empty tensor may be huge */
  int64_t n = 1;
  for (int d = 0; d < t->ndim; ++d)
    if (!cq_mul_ok(n, t->shape[d], &n)) return -1; /* only a descriptor cquant did not import */
  return n;
}

int64_t cq_cols(const cq_tensor *t) { return t->ndim ? t->shape[t->ndim - 1] : 1; }

int64_t cq_rows(const cq_tensor *t) {
  int64_t n = 1;
  for (int d = 0; d + 1 < t->ndim; ++d)
    if (!cq_mul_ok(n, t->shape[d], &n)) return -1; /* only an empty tensor's dims can overflow */
  return n;
}

void cq_format_shape(const cq_tensor *t, char *buf, size_t len) {
  size_t off = (size_t)snprintf(buf, len, "(");
  for (int d = 0; d < t->ndim && off < len; ++d)
    off += (size_t)snprintf(buf + off, len - off, d ? ", %lld" : "%lld", (long long)t->shape[d]);
  if (off < len) snprintf(buf + off, len - off, t->ndim == 1 ? ",)" : ")");
}

cq_status cq_require_cpu(const cq_tensor *t, const char *op) {
  if (t->device_type != CQ_DEVICE_CPU)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s_ref runs on CPU tensors; got a CUDA tensor (use %s)", op, op);
  return CQ_OK;
}

cq_status cq_check_present(const cq_tensor *t, const char *name) {
  if (!t) return cq_fail(CQ_ERR_INVALID_ARG, "%s is required", name);
  return CQ_OK;
}

cq_status cq_check_contiguous(const cq_tensor *t, const char *name) {
  CQ_TRY(cq_check_present(t, name));
  char shape[160];
  /* first, so an empty tensor is not reported as non-contiguous (producers give it any strides) */
  for (int d = 0; d < t->ndim; ++d) {
    if (t->shape[d] == 0) {
      cq_format_shape(t, shape, sizeof shape);
      return cq_fail(CQ_ERR_INVALID_ARG, "%s has a zero-size dimension (shape %s); expected every dimension >= 1", name, shape);
    }
  }
  int64_t expect = 1;
  for (int d = t->ndim - 1; d >= 0; --d) {
    if (t->strides[d] < 0)
      return cq_fail(CQ_ERR_INVALID_ARG, "%s has a negative stride in dim %d; expected a contiguous row-major tensor", name, d);
    if (t->shape[d] != 1 && t->strides[d] != expect)
      return cq_fail(CQ_ERR_INVALID_ARG, "%s is not contiguous (stride %lld in dim %d, expected %lld); pass a contiguous row-major tensor", name, (long long)t->strides[d], d, (long long)expect);
    expect *= t->shape[d];
  }
  if (!t->data) return cq_fail(CQ_ERR_INVALID_ARG, "%s has a NULL data pointer", name);
  size_t align = cq_dtype_size(t->dtype);
  if (align > 1 && ((uintptr_t)t->data % align) != 0)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s data address %p is not aligned to its %zu-byte elements", name, t->data, align);
  return CQ_OK;
}

cq_status cq_check_row_strided(const cq_tensor *t, const char *name, int64_t *ld) {
  CQ_TRY(cq_check_present(t, name));
  char shape[160];
  if (t->ndim < 1) return cq_fail(CQ_ERR_INVALID_ARG, "%s is a scalar; expected at least 1 dimension", name);
  for (int d = 0; d < t->ndim; ++d) {
    if (t->shape[d] == 0) {
      cq_format_shape(t, shape, sizeof shape);
      return cq_fail(CQ_ERR_INVALID_ARG, "%s has a zero-size dimension (shape %s); expected every dimension >= 1", name, shape);
    }
    if (t->strides[d] < 0)
      return cq_fail(CQ_ERR_INVALID_ARG, "%s has a negative stride in dim %d; expected non-negative strides", name, d);
  }
  const int last = t->ndim - 1;
  const int64_t cols = t->shape[last];
  if (cols > 1 && t->strides[last] != 1)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s has stride %lld in its last dim; expected the last dim contiguous (stride 1)",
                   name, (long long)t->strides[last]);
  /* walk the row dims from the inside: each must step over the rows inside it by one stride */
  int64_t row_stride = -1, inner = 1;
  for (int d = last - 1; d >= 0; --d) {
    if (t->shape[d] == 1) continue;
    if (row_stride < 0) {
      row_stride = t->strides[d]; /* the innermost row dim of extent > 1: inner is 1 here */
    } else {
      int64_t want;
      if (!cq_mul_ok(row_stride, inner, &want) || t->strides[d] != want) {
        row_stride = -2;
        break;
      }
    }
    inner *= t->shape[d]; /* the element count was checked against overflow */
  }
  if (row_stride == -2) {
    cq_format_shape(t, shape, sizeof shape);
    return cq_fail(CQ_ERR_INVALID_ARG, "%s (shape %s) has rows that are not one stride apart; expected a contiguous "
                   "tensor or a column slice of one (one row stride over the flattened rows)", name, shape);
  }
  if (row_stride < 0) row_stride = cols; /* a single row: no stride to speak of */
  if (row_stride < cols && inner > 1)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s has rows %lld elements apart but %lld columns: its rows overlap; expected "
                   "a row stride >= the last dim", name, (long long)row_stride, (long long)cols);
  if (!t->data) return cq_fail(CQ_ERR_INVALID_ARG, "%s has a NULL data pointer", name);
  size_t align = cq_dtype_size(t->dtype);
  if (align > 1 && ((uintptr_t)t->data % align) != 0)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s data address %p is not aligned to its %zu-byte elements", name, t->data, align);
  *ld = inner > 1 ? row_stride : cols;
  return CQ_OK;
}

/* [first byte, one past the last byte] that a non-empty tensor's elements occupy (the sizes
 * were checked against overflow by cq_tensor_from_dlpack). */
static void byte_extent(const cq_tensor *t, uintptr_t *lo, uintptr_t *hi) {
  int64_t first = 0, last = 0; /* element offsets from data */
  for (int d = 0; d < t->ndim; ++d) {
    const int64_t reach = (t->shape[d] - 1) * t->strides[d];
    if (reach < 0) first += reach;
    else last += reach;
  }
  const int64_t size = (int64_t)cq_dtype_size(t->dtype);
  *lo = (uintptr_t)t->data + (uintptr_t)(first * size); /* wraps downwards for negative strides */
  *hi = (uintptr_t)t->data + (uintptr_t)((last + 1) * size);
}

cq_status cq_check_no_overlap(const cq_tensor *out, const char *out_name, const cq_tensor *other,
                              const char *other_name) {
  if (!out || !other || !out->data || !other->data || cq_tensor_numel(out) == 0 || cq_tensor_numel(other) == 0)
    return CQ_OK;
  uintptr_t a0, a1, b0, b1;
  byte_extent(out, &a0, &a1);
  byte_extent(other, &b0, &b1);
  if (a0 < b1 && b0 < a1)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s overlaps %s in memory; expected a separate output buffer", out_name,
                   other_name);
  return CQ_OK;
}

cq_status cq_check_no_self_overlap(const cq_tensor *t, const char *name) {
  if (cq_tensor_numel(t) == 0) return CQ_OK;
  /* dims of extent > 1 by increasing stride: each stride must pass the span of those before */
  int order[CQ_MAX_DIMS], n = 0;
  for (int d = 0; d < t->ndim; ++d)
    if (t->shape[d] > 1) order[n++] = d;
  for (int i = 1; i < n; ++i)
    for (int j = i; j > 0 && t->strides[order[j]] < t->strides[order[j - 1]]; --j) {
      const int tmp = order[j];
      order[j] = order[j - 1], order[j - 1] = tmp;
    }
  int64_t span = 0; /* elements spanned by the dims so far, minus one */
  for (int i = 0; i < n; ++i) {
    const int d = order[i];
    if (t->strides[d] <= span)
      return cq_fail(CQ_ERR_INVALID_ARG, "%s has stride %lld in dim %d, under which different elements share memory; "
                     "expected an output whose elements do not alias (no zero or overlapping strides)", name,
                     (long long)t->strides[d], d);
    span += (t->shape[d] - 1) * t->strides[d];
  }
  return CQ_OK;
}

cq_status cq_check_writable(const cq_tensor *t, const char *name) {
  if (t->readonly) return cq_fail(CQ_ERR_INVALID_ARG, "%s is read-only; expected a writable output tensor", name);
  return CQ_OK;
}

static const char *device_name(cq_device_type d) { return d == CQ_DEVICE_CUDA ? "cuda" : "cpu"; }

cq_status cq_check_same_device(const cq_tensor *a, const char *name_a, const cq_tensor *b, const char *name_b) {
  if (a->device_type != b->device_type || a->device_id != b->device_id)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s is on %s:%d but %s is on %s:%d; expected all tensors on one device",
                   name_b, device_name(b->device_type), (int)b->device_id, name_a, device_name(a->device_type), (int)a->device_id);
  return CQ_OK;
}

cq_status cq_check_dtype(const cq_tensor *t, const char *name, const cq_dtype *allowed, int n) {
  for (int i = 0; i < n; ++i)
    if (t->dtype == allowed[i]) return CQ_OK;
  char list[160];
  size_t off = 0;
  list[0] = 0;
  for (int i = 0; i < n && off < sizeof list; ++i)
    off += (size_t)snprintf(list + off, sizeof list - off, "%s%s", i ? (i + 1 == n ? " or " : ", ") : "", cq_dtype_name(allowed[i]));
  return cq_fail(CQ_ERR_TYPE, "%s has dtype %s; expected %s", name, cq_dtype_name(t->dtype), list);
}

float cq_load_float(const void *data, cq_dtype dtype, int64_t i) {
  switch (dtype) {
    case CQ_DTYPE_F32: return ((const float *)data)[i];
    case CQ_DTYPE_F16: return cq_f16_to_f32(((const uint16_t *)data)[i]);
    case CQ_DTYPE_BF16: return cq_bf16_to_f32(((const uint16_t *)data)[i]);
    default: return 0.0f; /* callers check the dtype first */
  }
}

void cq_store_float(void *data, cq_dtype dtype, int64_t i, float v) {
  switch (dtype) {
    case CQ_DTYPE_F32: ((float *)data)[i] = v; break;
    case CQ_DTYPE_F16: ((uint16_t *)data)[i] = cq_f32_to_f16(v); break;
    case CQ_DTYPE_BF16: ((uint16_t *)data)[i] = cq_f32_to_bf16(v); break;
    default: break; /* callers check the dtype first */
  }
}
