/* Python wrappers of the libcquant ops: import the DLPack arguments, run the
 * op with the GIL released, give every tensor back. No math here. */
#include "cqpy.h"

#define MAX_ARGS 10

/* The imported tensors of one call, released together. */
typedef struct {
  cqpy_tensor t[MAX_ARGS];
  int n;
} arg_set;

static cq_tensor *take(arg_set *a, PyObject *obj, const char *name, int writable, cqpy_stream *stream) {
  cqpy_tensor *t = &a->t[a->n];
  if (cqpy_import(obj, name, writable, stream, t) < 0) return NULL;
  a->n++;
  return &t->t;
}

/* Optional argument: None gives NULL without error. */
static int take_optional(arg_set *a, PyObject *obj, const char *name, int writable, cqpy_stream *stream,
                         cq_tensor **out) {
  *out = NULL;
  if (!obj || obj == Py_None) return 0;
  *out = take(a, obj, name, writable, stream);
  return *out ? 0 : -1;
}

static void release_all(arg_set *a) {
  for (int i = 0; i < a->n; ++i) cqpy_release(&a->t[i]);
  a->n = 0;
}

static PyObject *finish(PyObject *self, arg_set *a, cq_status st) {
  release_all(a);
  if (st != CQ_OK) return cqpy_raise(self, st);
  Py_RETURN_NONE;
}

static cq_granularity granularity_of(int g) { return (cq_granularity)g; }

static PyObject *py_quantize(PyObject *self, PyObject *args, PyObject *kw) {
  static char *names[] = {"x", "q", "scale", "format", "granularity", "static_scale", "stream", "group_size", NULL};
  PyObject *ox, *oq, *os;
  int format, gran, static_scale = 0;
  long long group_size = 0;
  PyObject *stream_obj = Py_None;
  cqpy_stream stream;
  (void)self;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOii|pOL", names, &ox, &oq, &os, &format, &gran, &static_scale,
                                   &stream_obj, &group_size) ||
      cqpy_parse_stream(stream_obj, &stream) < 0)
    return NULL;
  arg_set a = {.n = 0};
  cq_tensor *x, *q, *s;
  if (!(x = take(&a, ox, "x", 0, &stream)) || !(q = take(&a, oq, "q", 1, &stream)) ||
      !(s = take(&a, os, "scale", !static_scale, &stream))) {
    release_all(&a);
    return NULL;
  }
  cq_quant_params p = {.format = format, .granularity = granularity_of(gran), .static_scale = static_scale,
                       .group_size = group_size};
  cq_status st;
  Py_BEGIN_ALLOW_THREADS st = cq_quantize(x, &p, q, s, (void *)stream.value);
  Py_END_ALLOW_THREADS return finish(self, &a, st);
}

static PyObject *py_dequantize(PyObject *self, PyObject *args, PyObject *kw) {
  static char *names[] = {"q", "scale", "y", "format", "granularity", "stream", "group_size", NULL};
  PyObject *oq, *os, *oy;
  int format, gran;
  long long group_size = 0;
  PyObject *stream_obj = Py_None;
  cqpy_stream stream;
  (void)self;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOii|OL", names, &oq, &os, &oy, &format, &gran, &stream_obj,
                                   &group_size) ||
      cqpy_parse_stream(stream_obj, &stream) < 0)
    return NULL;
  arg_set a = {.n = 0};
  cq_tensor *q, *s, *y;
  if (!(q = take(&a, oq, "q", 0, &stream)) || !(s = take(&a, os, "scale", 0, &stream)) ||
      !(y = take(&a, oy, "y", 1, &stream))) {
    release_all(&a);
    return NULL;
  }
  cq_quant_params p = {.format = format, .granularity = granularity_of(gran), .group_size = group_size};
  cq_status st;
  Py_BEGIN_ALLOW_THREADS st = cq_dequantize(q, s, &p, y, (void *)stream.value);
  Py_END_ALLOW_THREADS return finish(self, &a, st);
}

static PyObject *pack_common(PyObject *self, PyObject *args, PyObject *kw, int unpack) {
  static char *pack_names[] = {"codes", "packed", "bits", "stream", NULL};
  static char *unpack_names[] = {"packed", "codes", "bits", "stream", NULL};
  PyObject *oin, *oout;
  int bits;
  PyObject *stream_obj = Py_None;
  cqpy_stream stream;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOi|O", unpack ? unpack_names : pack_names, &oin, &oout, &bits, &stream_obj) ||
      cqpy_parse_stream(stream_obj, &stream) < 0)
    return NULL;
  arg_set a = {.n = 0};
  const char *in_name = unpack ? "packed" : "codes", *out_name = unpack ? "codes" : "packed";
  cq_tensor *in, *out;
  if (!(in = take(&a, oin, in_name, 0, &stream)) || !(out = take(&a, oout, out_name, 1, &stream))) {
    release_all(&a);
    return NULL;
  }
  cq_status st;
  Py_BEGIN_ALLOW_THREADS st = unpack ? cq_unpack(in, bits, out, (void *)stream.value)
                                     : cq_pack(in, bits, out, (void *)stream.value);
  Py_END_ALLOW_THREADS return finish(self, &a, st);
}

static PyObject *py_pack(PyObject *self, PyObject *args, PyObject *kw) {
  return pack_common(self, args, kw, 0);
}

static PyObject *py_unpack(PyObject *self, PyObject *args, PyObject *kw) {
  return pack_common(self, args, kw, 1);
}

static PyObject *py_copy_rows(PyObject *self, PyObject *args, PyObject *kw) {
  static char *names[] = {"src", "dst", "stream", NULL};
  PyObject *osrc, *odst, *stream_obj = Py_None;
  cqpy_stream stream;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|O", names, &osrc, &odst, &stream_obj) ||
      cqpy_parse_stream(stream_obj, &stream) < 0)
    return NULL;
  arg_set a = {.n = 0};
  cq_tensor *src, *dst;
  if (!(src = take(&a, osrc, "src", 0, &stream)) || !(dst = take(&a, odst, "dst", 1, &stream))) {
    release_all(&a);
    return NULL;
  }
  cq_status st;
  Py_BEGIN_ALLOW_THREADS st = cq_copy_rows(src, dst, (void *)stream.value);
  Py_END_ALLOW_THREADS return finish(self, &a, st);
}

static PyObject *py_wire_encode(PyObject *self, PyObject *args, PyObject *kw) {
  static char *names[] = {"x", "codes", "scales", "mean", "norms", "stream", NULL};
  PyObject *ox, *oc, *os, *om = Py_None, *on = Py_None, *stream_obj = Py_None;
  cqpy_stream stream;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|OOO", names, &ox, &oc, &os, &om, &on, &stream_obj) ||
      cqpy_parse_stream(stream_obj, &stream) < 0)
    return NULL;
  arg_set a = {.n = 0};
  cq_tensor *x, *c, *s, *m, *n;
  if (!(x = take(&a, ox, "x", 0, &stream)) || !(c = take(&a, oc, "codes", 1, &stream)) ||
      !(s = take(&a, os, "scales", 1, &stream)) || take_optional(&a, om, "mean", 0, &stream, &m) < 0 ||
      take_optional(&a, on, "norms", 1, &stream, &n) < 0) {
    release_all(&a);
    return NULL;
  }
  cq_status st;
  Py_BEGIN_ALLOW_THREADS st = cq_wire_encode(x, m, c, s, n, (void *)stream.value);
  Py_END_ALLOW_THREADS return finish(self, &a, st);
}

static PyObject *py_wire_decode(PyObject *self, PyObject *args, PyObject *kw) {
  static char *names[] = {"codes", "scales", "y", "mean", "stream", NULL};
  PyObject *oc, *os, *oy, *om = Py_None, *stream_obj = Py_None;
  cqpy_stream stream;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|OO", names, &oc, &os, &oy, &om, &stream_obj) ||
      cqpy_parse_stream(stream_obj, &stream) < 0)
    return NULL;
  arg_set a = {.n = 0};
  cq_tensor *c, *s, *y, *m;
  if (!(c = take(&a, oc, "codes", 0, &stream)) || !(s = take(&a, os, "scales", 0, &stream)) ||
      !(y = take(&a, oy, "y", 1, &stream)) || take_optional(&a, om, "mean", 0, &stream, &m) < 0) {
    release_all(&a);
    return NULL;
  }
  cq_status st;
  Py_BEGIN_ALLOW_THREADS st = cq_wire_decode(c, s, m, y, (void *)stream.value);
  Py_END_ALLOW_THREADS return finish(self, &a, st);
}

/* The layer's parameters from the integers the Python API passes. */
static cq_linear_params linear_params(int wfmt, int wgran, int afmt, int agran, long long in_features,
                                      int activation, long long weight_group_size) {
  cq_linear_params p = {.weight_format = wfmt, .weight_granularity = granularity_of(wgran), .act_format = afmt,
                        .act_granularity = granularity_of(agran), .in_features = in_features,
                        .activation = activation, .weight_group_size = weight_group_size};
  return p;
}

static PyObject *py_linear(PyObject *self, PyObject *args, PyObject *kw) {
  static char *names[] = {"x", "w", "w_scale", "bias", "y", "weight_format", "weight_granularity", "act_format",
                          "act_granularity", "in_features", "workspace", "stream", "activation",
                          "weight_group_size", NULL};
  PyObject *ox, *ow, *ows, *ob, *oy, *owk = Py_None;
  int wfmt, wgran, afmt, agran, activation = 0;
  long long in_features, group_size = 0;
  PyObject *stream_obj = Py_None;
  cqpy_stream stream;
  (void)self;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOiiiiL|OOiL", names, &ox, &ow, &ows, &ob, &oy, &wfmt, &wgran, &afmt,
                                   &agran, &in_features, &owk, &stream_obj, &activation, &group_size) ||
      cqpy_parse_stream(stream_obj, &stream) < 0)
    return NULL;
  arg_set a = {.n = 0};
  cq_tensor *x, *w, *ws, *b, *y, *wk;
  if (!(x = take(&a, ox, "x", 0, &stream)) || !(w = take(&a, ow, "w", 0, &stream)) ||
      !(ws = take(&a, ows, "w_scale", 0, &stream)) || take_optional(&a, ob, "bias", 0, &stream, &b) < 0 ||
      !(y = take(&a, oy, "y", 1, &stream)) || take_optional(&a, owk, "workspace", 1, &stream, &wk) < 0) {
    release_all(&a);
    return NULL;
  }
  cq_linear_params p = linear_params(wfmt, wgran, afmt, agran, in_features, activation, group_size);
  cq_status st;
  Py_BEGIN_ALLOW_THREADS st = cq_linear(x, w, ws, b, &p, wk, y, (void *)stream.value);
  Py_END_ALLOW_THREADS return finish(self, &a, st);
}

static PyObject *py_linear_quantized(PyObject *self, PyObject *args, PyObject *kw) {
  static char *names[] = {"x_codes", "x_scale", "w", "w_scale", "bias", "y", "weight_format", "weight_granularity",
                          "act_format", "act_granularity", "in_features", "workspace", "stream", "activation",
                          "weight_group_size", NULL};
  PyObject *oxc, *oxs, *ow, *ows, *ob, *oy, *owk = Py_None;
  int wfmt, wgran, afmt, agran, activation = 0;
  long long in_features, group_size = 0;
  PyObject *stream_obj = Py_None;
  cqpy_stream stream;
  (void)self;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOiiiiL|OOiL", names, &oxc, &oxs, &ow, &ows, &ob, &oy, &wfmt, &wgran,
                                   &afmt, &agran, &in_features, &owk, &stream_obj, &activation, &group_size) ||
      cqpy_parse_stream(stream_obj, &stream) < 0)
    return NULL;
  arg_set a = {.n = 0};
  cq_tensor *xc, *xs, *w, *ws, *b, *y, *wk;
  if (!(xc = take(&a, oxc, "x_codes", 0, &stream)) || !(xs = take(&a, oxs, "x_scale", 0, &stream)) ||
      !(w = take(&a, ow, "w", 0, &stream)) || !(ws = take(&a, ows, "w_scale", 0, &stream)) ||
      take_optional(&a, ob, "bias", 0, &stream, &b) < 0 || !(y = take(&a, oy, "y", 1, &stream)) ||
      take_optional(&a, owk, "workspace", 1, &stream, &wk) < 0) {
    release_all(&a);
    return NULL;
  }
  cq_linear_params p = linear_params(wfmt, wgran, afmt, agran, in_features, activation, group_size);
  cq_status st;
  Py_BEGIN_ALLOW_THREADS st = cq_linear_quantized(xc, xs, w, ws, b, &p, wk, y, (void *)stream.value);
  Py_END_ALLOW_THREADS return finish(self, &a, st);
}

static PyObject *py_linear_gated(PyObject *self, PyObject *args, PyObject *kw) {
  static char *names[] = {"x", "w", "w_scale", "bias", "gate", "residual", "y", "weight_format", "weight_granularity",
                          "act_format", "act_granularity", "in_features", "workspace", "stream", "activation",
                          "weight_group_size", NULL};
  PyObject *ox, *ow, *ows, *ob, *og, *ores, *oy, *owk = Py_None;
  int wfmt, wgran, afmt, agran, activation = 0;
  long long in_features, group_size = 0;
  PyObject *stream_obj = Py_None;
  cqpy_stream stream;
  (void)self;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOiiiiL|OOiL", names, &ox, &ow, &ows, &ob, &og, &ores, &oy, &wfmt,
                                   &wgran, &afmt, &agran, &in_features, &owk, &stream_obj, &activation, &group_size) ||
      cqpy_parse_stream(stream_obj, &stream) < 0)
    return NULL;
  arg_set a = {.n = 0};
  cq_tensor *x, *w, *ws, *b, *g, *r, *y, *wk;
  if (!(x = take(&a, ox, "x", 0, &stream)) || !(w = take(&a, ow, "w", 0, &stream)) ||
      !(ws = take(&a, ows, "w_scale", 0, &stream)) || take_optional(&a, ob, "bias", 0, &stream, &b) < 0 ||
      !(g = take(&a, og, "gate", 0, &stream)) || !(r = take(&a, ores, "residual", 0, &stream)) ||
      !(y = take(&a, oy, "y", 1, &stream)) || take_optional(&a, owk, "workspace", 1, &stream, &wk) < 0) {
    release_all(&a);
    return NULL;
  }
  cq_linear_params p = linear_params(wfmt, wgran, afmt, agran, in_features, activation, group_size);
  cq_status st;
  Py_BEGIN_ALLOW_THREADS st = cq_linear_gated(x, w, ws, b, g, r, &p, wk, y, (void *)stream.value);
  Py_END_ALLOW_THREADS return finish(self, &a, st);
}

static PyObject *py_linear_workspace_size(PyObject *self, PyObject *args, PyObject *kw) {
  static char *names[] = {"weight_format", "weight_granularity", "act_format", "act_granularity", "in_features",
                          "m", "n", "cuda", "weight_group_size", NULL};
  int wfmt, wgran, afmt, agran, cuda;
  long long in_features, m, n, group_size = 0;
  (void)self;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "iiiiLLLp|L", names, &wfmt, &wgran, &afmt, &agran, &in_features, &m, &n,
                                   &cuda, &group_size))
    return NULL;
  cq_linear_params p = linear_params(wfmt, wgran, afmt, agran, in_features, CQ_ACTIVATION_NONE, group_size);
  size_t bytes = 0;
  cq_status st = cq_linear_workspace_size(&p, m, n, cuda ? CQ_DEVICE_CUDA : CQ_DEVICE_CPU, &bytes);
  if (st != CQ_OK) return cqpy_raise(self, st);
  return PyLong_FromSize_t(bytes);
}

/* What cquant sees of a DLPack object; for tests and debugging. */
static PyObject *py_linear_min_compute_capability(PyObject *self, PyObject *args, PyObject *kw) {
  static char *names[] = {"weight_format", "weight_granularity", "act_format", "act_granularity", "weight_group_size",
                          NULL};
  int wfmt, wgran, afmt, agran, cc = 0;
  long long group_size = 0;
  (void)self;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "iiii|L", names, &wfmt, &wgran, &afmt, &agran, &group_size)) return NULL;
  cq_linear_params p = linear_params(wfmt, wgran, afmt, agran, 0, CQ_ACTIVATION_NONE, group_size);
  cq_status st = cq_linear_min_compute_capability(&p, &cc);
  if (st != CQ_OK) return cqpy_raise(self, st);
  return PyLong_FromLong(cc);
}

static PyObject *py_dlpack_info(PyObject *self, PyObject *args, PyObject *kw) {
  static char *names[] = {"obj", "writable", "stream", NULL};
  PyObject *obj;
  int writable = 0;
  PyObject *stream_obj = Py_None;
  cqpy_stream stream;
  (void)self;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|pO", names, &obj, &writable, &stream_obj) ||
      cqpy_parse_stream(stream_obj, &stream) < 0)
    return NULL;
  cqpy_tensor t;
  if (cqpy_import(obj, "obj", writable, &stream, &t) < 0) return NULL;
  PyObject *shape = PyTuple_New(t.t.ndim), *strides = PyTuple_New(t.t.ndim);
  for (int d = 0; shape && strides && d < t.t.ndim; ++d) /* PyTuple_SetItem steals (and checks) the item */
    if (PyTuple_SetItem(shape, d, PyLong_FromLongLong(t.t.shape[d])) < 0 ||
        PyTuple_SetItem(strides, d, PyLong_FromLongLong(t.t.strides[d])) < 0)
      Py_CLEAR(shape);
  PyObject *info = (shape && strides)
                       ? Py_BuildValue("{s:s,s:s,s:i,s:O,s:O,s:O,s:O,s:K,s:K}", "dtype", cq_dtype_name(t.t.dtype), "device",
                                       t.t.device_type == CQ_DEVICE_CUDA ? "cuda" : "cpu", "device_id",
                                       (int)t.t.device_id, "shape", shape, "strides", strides, "readonly",
                                       t.t.readonly ? Py_True : Py_False, "versioned",
                                       t.versioned ? Py_True : Py_False, "data", (unsigned long long)(uintptr_t)t.t.data,
                                       "stream", (unsigned long long)stream.value)
                       : NULL;
  Py_XDECREF(shape), Py_XDECREF(strides);
  cqpy_release(&t);
  return info;
}

#define KW(fn) (PyCFunction)(void (*)(void))(fn), METH_VARARGS | METH_KEYWORDS

PyMethodDef cqpy_op_methods[] = {
    {"quantize", KW(py_quantize),
     "quantize(x, q, scale, format, granularity, static_scale=False, stream=None, group_size=0)\n\n"
     "Quantize x [..., cols] (f32/f16/bf16) into codes q and fp32 scales (see cquant.h); group_size: columns\n"
     "per scale group of the 4-bit formats (GRANULARITY_GROUP, GRANULARITY_TWO_LEVEL)."},
    {"dequantize", KW(py_dequantize),
     "dequantize(q, scale, y, format, granularity, stream=None, group_size=0)\n\ny = decode(q) * scale."},
    {"pack", KW(py_pack), "pack(codes, packed, bits, stream=None)\n\nBit-pack uint8 codes [rows, cols] along rows."},
    {"unpack", KW(py_unpack), "unpack(packed, codes, bits, stream=None)\n\nInverse of pack."},
    {"copy_rows", KW(py_copy_rows), "copy_rows(src, dst, stream=None)\n\ndst = src through the copy engines "
     "(views of one shape, last dim contiguous)."},
    {"wire_encode", KW(py_wire_encode), "wire_encode(x, codes, scales, mean=None, norms=None, stream=None)\n\n"
     "Rows of x (- mean) as int8 codes and fp32 scales (and decoded norms); strided views (see cquant.h)."},
    {"wire_decode", KW(py_wire_decode), "wire_decode(codes, scales, y, mean=None, stream=None)\n\n"
     "y = codes * scales (+ mean); strided views (see cquant.h)."},
    {"linear", KW(py_linear),
     "linear(x, w, w_scale, bias, y, weight_format, weight_granularity, act_format, act_granularity,\n"
     "       in_features, workspace=None, stream=None, activation=0, weight_group_size=0)\n\n"
     "y = act(x W^T + b) with a quantized W (see cquant.h)."},
    {"linear_quantized", KW(py_linear_quantized),
     "linear_quantized(x_codes, x_scale, w, w_scale, bias, y, weight_format, weight_granularity, act_format,\n"
     "                 act_granularity, in_features, workspace=None, stream=None, activation=0,\n"
     "                 weight_group_size=0)\n\n"
     "linear for activations already quantized by quantize (one input shared by several layers)."},
    {"linear_gated", KW(py_linear_gated),
     "linear_gated(x, w, w_scale, bias, gate, residual, y, weight_format, weight_granularity, act_format,\n"
     "             act_granularity, in_features, workspace=None, stream=None, activation=0, weight_group_size=0)\n\n"
     "y = residual + gate[sample] * act(x W^T + b) (see cq_linear_gated in cquant.h); residual may be y."},
    {"linear_workspace_size", KW(py_linear_workspace_size),
     "linear_workspace_size(weight_format, weight_granularity, act_format, act_granularity, in_features, m, n, "
     "cuda, weight_group_size=0)\n\nBytes of workspace linear needs."},
    {"linear_min_compute_capability", KW(py_linear_min_compute_capability),
     "linear_min_compute_capability(weight_format, weight_granularity, act_format, act_granularity,\n"
     "                              weight_group_size=0)\n\n"
     "Oldest CUDA compute capability (e.g. 89) whose kernels run this scheme."},
    {"dlpack_info", KW(py_dlpack_info), "dlpack_info(obj, writable=False, stream=None)\n\nWhat cquant reads of obj."},
    {NULL, NULL, 0, NULL},
};
