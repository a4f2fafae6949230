/* Python wrappers of the fused DiT block ops: import the DLPack arguments, run the op with the
 * GIL released, give every tensor back. No math here. */
#include "cqpy.h"

#define MAX_ARGS 10

typedef struct {
  cqpy_tensor t[MAX_ARGS];
  int n;
} fused_args;

/* Import obj (None gives NULL without error when optional). Returns 0 or -1. */
static int take(fused_args *a, PyObject *obj, const char *name, int writable, int optional, cqpy_stream *stream,
                cq_tensor **out) {
  *out = NULL;
  if (optional && (!obj || obj == Py_None)) return 0;
  if (cqpy_import(obj, name, writable, stream, &a->t[a->n]) < 0) return -1;
  *out = &a->t[a->n++].t;
  return 0;
}

static void release_all(fused_args *a) {
  for (int i = 0; i < a->n; ++i) cqpy_release(&a->t[i]);
  a->n = 0;
}

static PyObject *finish(PyObject *self, fused_args *a, cq_status st) {
  release_all(a);
  if (st != CQ_OK) return cqpy_raise(self, st);
  Py_RETURN_NONE;
}

static PyObject *py_norm_modulate(PyObject *self, PyObject *args, PyObject *kw) {
  static char *names[] = {"x", "scale", "shift", "out", "out_scale", "norm", "eps", "out_format", "stream", NULL};
  PyObject *ox, *osc, *osh, *oout, *oos;
  int norm, out_format;
  float eps;
  PyObject *stream_obj = Py_None;
  cqpy_stream stream;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOifi|O", names, &ox, &osc, &osh, &oout, &oos, &norm, &eps,
                                   &out_format, &stream_obj) ||
      cqpy_parse_stream(stream_obj, &stream) < 0)
    return NULL;
  fused_args a = {.n = 0};
  cq_tensor *x, *sc, *sh, *out, *os;
  if (take(&a, ox, "x", 0, 0, &stream, &x) < 0 || take(&a, osc, "scale", 0, 1, &stream, &sc) < 0 ||
      take(&a, osh, "shift", 0, 1, &stream, &sh) < 0 || take(&a, oout, "out", 1, 0, &stream, &out) < 0 ||
      take(&a, oos, "out_scale", 1, 1, &stream, &os) < 0) {
    release_all(&a);
    return NULL;
  }
  cq_norm_modulate_params p = {.norm = (cq_norm_kind)norm, .eps = eps, .out_format = out_format};
  cq_status st;
  Py_BEGIN_ALLOW_THREADS st = cq_norm_modulate(x, sc, sh, &p, out, os, (void *)stream.value);
  Py_END_ALLOW_THREADS return finish(self, &a, st);
}

static PyObject *py_qk_norm_rope(PyObject *self, PyObject *args, PyObject *kw) {
  static char *names[] = {"q_in", "k_in", "v_in", "q_weight", "k_weight", "cos", "sin", "q_out", "k_out", "v_out",
                          "rms_norm", "eps", "seq_offset", "stream", NULL};
  PyObject *oq, *ok, *ov, *oqw, *okw, *ocos, *osin, *oqo, *oko, *ovo;
  int rms_norm;
  float eps;
  long long seq_offset;
  PyObject *stream_obj = Py_None;
  cqpy_stream stream;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOOOOpfL|O", names, &oq, &ok, &ov, &oqw, &okw, &ocos, &osin, &oqo,
                                   &oko, &ovo, &rms_norm, &eps, &seq_offset, &stream_obj) ||
      cqpy_parse_stream(stream_obj, &stream) < 0)
    return NULL;
  fused_args a = {.n = 0};
  cq_tensor *q, *k, *v, *qw, *kw_, *c, *s, *qo, *ko, *vo;
  if (take(&a, oq, "q_in", 0, 0, &stream, &q) < 0 || take(&a, ok, "k_in", 0, 0, &stream, &k) < 0 ||
      take(&a, ov, "v_in", 0, 1, &stream, &v) < 0 || take(&a, oqw, "q_weight", 0, 1, &stream, &qw) < 0 ||
      take(&a, okw, "k_weight", 0, 1, &stream, &kw_) < 0 || take(&a, ocos, "cos", 0, 1, &stream, &c) < 0 ||
      take(&a, osin, "sin", 0, 1, &stream, &s) < 0 || take(&a, oqo, "q_out", 1, 0, &stream, &qo) < 0 ||
      take(&a, oko, "k_out", 1, 0, &stream, &ko) < 0 || take(&a, ovo, "v_out", 1, 1, &stream, &vo) < 0) {
    release_all(&a);
    return NULL;
  }
  cq_qk_norm_rope_params p = {.rms_norm = rms_norm, .eps = eps, .seq_offset = seq_offset};
  cq_status st;
  Py_BEGIN_ALLOW_THREADS st = cq_qk_norm_rope(q, k, v, qw, kw_, c, s, &p, qo, ko, vo, (void *)stream.value);
  Py_END_ALLOW_THREADS return finish(self, &a, st);
}

#define KW(fn) (PyCFunction)(void (*)(void))(fn), METH_VARARGS | METH_KEYWORDS

PyMethodDef cqpy_fused_methods[] = {
    {"norm_modulate", KW(py_norm_modulate),
     "norm_modulate(x, scale, shift, out, out_scale, norm, eps, out_format, stream=None)\n\n"
     "LayerNorm / RMSNorm (NORM_LAYER, NORM_RMS) of x [B, S, D] with adaLN modulation by scale, shift [B, D]\n"
     "(None: 0), into out [B, S, D]: x's dtype (out_format FORMAT_NONE, out_scale None) or the codes of\n"
     "FORMAT_INT8 / FORMAT_FP8_E4M3 with fp32 per-row scales out_scale [B * S] (see cq_norm_modulate)."},
    {"qk_norm_rope", KW(py_qk_norm_rope),
     "qk_norm_rope(q_in, k_in, v_in, q_weight, k_weight, cos, sin, q_out, k_out, v_out, rms_norm, eps,\n"
     "             seq_offset, stream=None)\n\n"
     "RMSNorm (rms_norm, weights q_weight / k_weight [D] or None) and rotary embedding (cos, sin fp32\n"
     "[S_total, D / 2], or None) of q_in, k_in [B, S, H, D], and a copy of v_in (or None), into rows\n"
     "seq_offset .. seq_offset + S of q_out, k_out, v_out [B, S_total, H, D] (see cq_qk_norm_rope)."},
    {NULL, NULL, 0, NULL},
};
