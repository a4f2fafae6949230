/* Python wrappers of fused attention: import the DLPack arguments, run the op
 * with the GIL released, give every tensor back. No math here. */
#include "cqpy.h"

#define MAX_ARGS 6

typedef struct {
  cqpy_tensor t[MAX_ARGS];
  int n;
} attn_args;

/* Import obj (None gives NULL without error when optional). Returns 0 or -1. */
static int take(attn_args *a, PyObject *obj, const char *name, int writable, int optional, cqpy_stream *stream,
                cq_tensor **out) {
  *out = NULL;
  if (optional && (!obj || obj == Py_None)) return 0;
  if (cqpy_import(obj, name, writable, stream, &a->t[a->n]) < 0) return -1;
  *out = &a->t[a->n++].t;
  return 0;
}

static void release_all(attn_args *a) {
  for (int i = 0; i < a->n; ++i) cqpy_release(&a->t[i]);
  a->n = 0;
}

static PyObject *py_attention(PyObject *self, PyObject *args, PyObject *kw) {
  static char *names[] = {"q", "k", "v", "out", "scale", "mode", "lse", "workspace", "q_block", "k_block", "stream", NULL};
  PyObject *oq, *ok, *ov, *oout, *olse = Py_None, *owk = Py_None;
  float scale;
  int mode, q_block = 0, k_block = 0;
  PyObject *stream_obj = Py_None;
  cqpy_stream stream;
  (void)self;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOfi|OOiiO", names, &oq, &ok, &ov, &oout, &scale, &mode, &olse, &owk,
                                   &q_block, &k_block, &stream_obj) ||
      cqpy_parse_stream(stream_obj, &stream) < 0)
    return NULL;
  attn_args a = {.n = 0};
  cq_tensor *q, *k, *v, *out, *lse, *wk;
  if (take(&a, oq, "q", 0, 0, &stream, &q) < 0 || take(&a, ok, "k", 0, 0, &stream, &k) < 0 ||
      take(&a, ov, "v", 0, 0, &stream, &v) < 0 || take(&a, oout, "out", 1, 0, &stream, &out) < 0 ||
      take(&a, olse, "lse", 1, 1, &stream, &lse) < 0 || take(&a, owk, "workspace", 1, 1, &stream, &wk) < 0) {
    release_all(&a);
    return NULL;
  }
  cq_attention_params p = {.mode = (cq_attention_mode)mode, .scale = scale, .q_block = q_block, .k_block = k_block};
  cq_status st;
  Py_BEGIN_ALLOW_THREADS st = cq_attention(q, k, v, &p, wk, out, lse, (void *)stream.value);
  Py_END_ALLOW_THREADS release_all(&a);
  if (st != CQ_OK) return cqpy_raise(self, st);
  Py_RETURN_NONE;
}

static PyObject *py_attention_workspace_size(PyObject *self, PyObject *args, PyObject *kw) {
  static char *names[] = {"mode", "batch", "heads", "seq_q", "seq_kv", "head_dim", "cuda", "q_block", "k_block", NULL};
  int mode, cuda, q_block = 0, k_block = 0;
  long long b, h, sq, skv, d;
  (void)self;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "iLLLLLp|ii", names, &mode, &b, &h, &sq, &skv, &d, &cuda, &q_block,
                                   &k_block))
    return NULL;
  cq_attention_params p = {.mode = (cq_attention_mode)mode, .scale = 1.0f, .q_block = q_block, .k_block = k_block};
  size_t bytes = 0;
  cq_status st = cq_attention_workspace_size(&p, b, h, sq, skv, d, cuda ? CQ_DEVICE_CUDA : CQ_DEVICE_CPU, &bytes);
  if (st != CQ_OK) return cqpy_raise(self, st);
  return PyLong_FromSize_t(bytes);
}

static PyObject *py_attention_int8_logit_error(PyObject *self, PyObject *args, PyObject *kw) {
  static char *names[] = {"q", "k", "bound", "scale", "q_block", "k_block", NULL};
  PyObject *oq, *ok, *obound;
  float scale;
  int q_block = 0, k_block = 0;
  (void)self;
  cqpy_stream stream; /* CPU tensors: no stream, but a CUDA one imports cleanly and is refused by libcquant */
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOf|ii", names, &oq, &ok, &obound, &scale, &q_block, &k_block) ||
      cqpy_parse_stream(Py_None, &stream) < 0)
    return NULL;
  attn_args a = {.n = 0};
  cq_tensor *q, *k, *bound;
  if (take(&a, oq, "q", 0, 0, &stream, &q) < 0 || take(&a, ok, "k", 0, 0, &stream, &k) < 0 ||
      take(&a, obound, "bound", 1, 0, &stream, &bound) < 0) {
    release_all(&a);
    return NULL;
  }
  cq_attention_params p = {.mode = CQ_ATTENTION_INT8, .scale = scale, .q_block = q_block, .k_block = k_block};
  cq_status st;
  Py_BEGIN_ALLOW_THREADS st = cq_attention_int8_logit_error_ref(q, k, &p, bound);
  Py_END_ALLOW_THREADS release_all(&a);
  if (st != CQ_OK) return cqpy_raise(self, st);
  Py_RETURN_NONE;
}

#define KW(fn) (PyCFunction)(void (*)(void))(fn), METH_VARARGS | METH_KEYWORDS

PyMethodDef cqpy_attention_methods[] = {
    {"attention", KW(py_attention),
     "attention(q, k, v, out, scale, mode, lse=None, workspace=None, q_block=0, k_block=0, stream=None)\n\n"
     "Fused attention: q [B, Sq, H, D], k/v [B, Skv, H, D] -> out [B, Sq, H, D], lse fp32 [B, H, Sq]\n"
     "(mode ATTENTION_FULL: full precision, ATTENTION_INT8: 8-bit; see cquant.h)."},
    {"attention_workspace_size", KW(py_attention_workspace_size),
     "attention_workspace_size(mode, batch, heads, seq_q, seq_kv, head_dim, cuda, q_block=0, k_block=0)\n\n"
     "Bytes of workspace attention needs."},
    {"attention_int8_logit_error", KW(py_attention_int8_logit_error),
     "attention_int8_logit_error(q, k, bound, scale, q_block=0, k_block=0)\n\n"
     "The 8-bit mode's logit-error estimate E of every head into bound fp32 [B, H] (CPU tensors; cquant.h):\n"
     "heads with E > ATTENTION_INT8_MAX_LOGIT_ERROR run in full precision."},
    {NULL, NULL, 0, NULL},
};
