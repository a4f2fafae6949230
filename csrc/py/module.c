/* cquant._C: module definition, the format table, constants. */
#include "cqpy.h"

static const char *code_dtype_name(cq_dtype d) { return cq_dtype_name(d); }

static PyObject *format_dict(const cq_format_info *f) {
  return Py_BuildValue("{s:i,s:s,s:s,s:i,s:i,s:i,s:i,s:d,s:I,s:O,s:s}", "id", (int)f->id, "name", f->name, "kind",
                       f->kind == CQ_KIND_INT ? "int" : f->kind == CQ_KIND_UINT ? "uint" : "float", "bits", f->bits, "ebits", f->ebits, "mbits",
                       f->mbits, "bias", f->bias, "max_value", (double)f->max_value, "max_code",
                       (unsigned)f->max_code, "packed", f->packed ? Py_True : Py_False, "code_dtype",
                       code_dtype_name(f->code_dtype));
}

static PyObject *py_formats(PyObject *self, PyObject *noargs) {
  (void)self, (void)noargs;
  int n = cq_format_count();
  PyObject *list = PyList_New(n);
  for (int i = 0; list && i < n; ++i) {
    PyObject *d = format_dict(cq_format_at(i));
    if (!d) {
      Py_CLEAR(list);
      break;
    }
    if (PyList_SetItem(list, i, d) < 0) { /* steals d */
      Py_CLEAR(list);
      break;
    }
  }
  return list;
}

/* The value of every code 0 .. 2^bits - 1 as native float32 bytes (ops.format_values makes
 * them an array). */
static PyObject *py_format_values(PyObject *self, PyObject *args) {
  int id;
  (void)self;
  if (!PyArg_ParseTuple(args, "i", &id)) return NULL;
  const cq_format_info *f = cq_format_get(id);
  if (!f) return cqpy_raise(self, CQ_ERR_INVALID_ARG);
  float v[256]; /* codes have at most 8 bits */
  const int n = 1 << f->bits;
  for (int c = 0; c < n; ++c) v[c] = f->decode(f, (uint32_t)c);
  return PyBytes_FromStringAndSize((const char *)v, (Py_ssize_t)(n * sizeof(float)));
}

static PyObject *py_packed_row_bytes(PyObject *self, PyObject *args) {
  int id;
  long long cols;
  (void)self;
  if (!PyArg_ParseTuple(args, "iL", &id, &cols)) return NULL;
  const cq_format_info *f = cq_format_get(id);
  if (!f) return cqpy_raise(self, CQ_ERR_INVALID_ARG);
  if (cols < 1) return PyErr_Format(PyExc_ValueError, "cols = %lld; expected >= 1", cols);
  const int64_t bytes = cq_packed_row_bytes(f, cols);
  if (bytes < 0)
    return PyErr_Format(PyExc_ValueError, "cols = %lld: a stored row of them has more bytes than int64 counts", cols);
  return PyLong_FromLongLong(bytes);
}

static PyObject *py_built_with_cuda(PyObject *self, PyObject *noargs) {
  (void)self, (void)noargs;
  return PyBool_FromLong(cq_built_with_cuda());
}

static PyObject *py_cuda_compute_capability(PyObject *self, PyObject *args) {
  int device = 0, cc = 0;
  (void)self;
  if (!PyArg_ParseTuple(args, "|i", &device)) return NULL;
  cq_status st = cq_cuda_compute_capability(device, &cc);
  if (st != CQ_OK) return cqpy_raise(self, st);
  return PyLong_FromLong(cc);
}

static PyObject *tristate(int v) { return PyUnicode_FromString(v == 1 ? "on" : v == 0 ? "off" : "auto"); }

/* libcquant's parsed CQUANT_* switches (cq_settings), so Python asks instead of re-parsing. */
static PyObject *py_settings(PyObject *self, PyObject *noargs) {
  (void)self, (void)noargs;
  cq_settings s;
  cq_status st = cq_settings_get(&s, sizeof s);
  if (st != CQ_OK) return cqpy_raise(self, st);
  static const struct {
    unsigned bit;
    const char *name;
  } kernels[] = {{CQ_ATTN_KERNEL_MMA, "mma"}, {CQ_ATTN_KERNEL_SM90, "sm90"}, {CQ_ATTN_KERNEL_INT8, "int8"}};
  PyObject *disabled = PyList_New(0);
  for (size_t i = 0; disabled && i < sizeof kernels / sizeof kernels[0]; ++i) {
    if (!(s.attn_disabled & kernels[i].bit)) continue;
    PyObject *name = PyUnicode_FromString(kernels[i].name);
    if (!name || PyList_Append(disabled, name) < 0) Py_CLEAR(disabled);
    Py_XDECREF(name);
  }
  PyObject *disabled_tuple = disabled ? PyList_AsTuple(disabled) : NULL;
  Py_XDECREF(disabled);
  PyObject *gemv = tristate(s.gemv_persistent), *sm90 = tristate(s.attn_sm90);
  PyObject *d = (disabled_tuple && gemv && sm90)
                    ? Py_BuildValue("{s:O,s:O,s:L,s:O,s:O,s:O,s:s,s:O,s:L,s:L,s:O,s:O}", "disable_wgmma", s.disable_wgmma ? Py_True : Py_False,
                                    "disable_cublaslt_fp8", s.disable_cublaslt_fp8 ? Py_True : Py_False, "wo_chunk_mib",
                                    (long long)s.wo_chunk_mib, "gemv_persistent", gemv, "attn_sm90", sm90,
                                    "attn_disabled", disabled_tuple, "cublaslt_path", s.cublaslt_path,
                                    "share_activations", s.share_activations ? Py_True : Py_False,
                                    "group4_decode_min_m", (long long)s.group4_decode_min_m, "wo_decode_min_m",
                                    (long long)s.wo_decode_min_m, "wo_split_k", s.wo_split_k ? Py_True : Py_False,
                                    "wo_cluster_pairs", s.wo_cluster_pairs ? Py_True : Py_False)
                    : NULL;
  Py_XDECREF(disabled_tuple), Py_XDECREF(gemv), Py_XDECREF(sm90);
  return d;
}

static PyObject *py_reload_settings(PyObject *self, PyObject *noargs) {
  (void)self, (void)noargs;
  cq_settings_reload();
  Py_RETURN_NONE;
}

static PyObject *py_cuda_device_supported(PyObject *self, PyObject *args) {
  int device = 0;
  (void)self;
  if (!PyArg_ParseTuple(args, "|i", &device)) return NULL;
  cq_status st;
  Py_BEGIN_ALLOW_THREADS st = cq_cuda_device_supported(device);
  Py_END_ALLOW_THREADS
  if (st == CQ_OK) return Py_BuildValue("(Os)", Py_True, "");
  return Py_BuildValue("(Os)", Py_False, cq_last_error());
}

/* cq_build_info as a dict. */
static PyObject *py_build_info(PyObject *self, PyObject *noargs) {
  (void)noargs;
  cq_build_info b;
  cq_status st = cq_build_info_get(&b, sizeof b);
  if (st != CQ_OK) return cqpy_raise(self, st);
  return Py_BuildValue("{s:s,s:O,s:s,s:s,s:i}", "version", b.version, "cuda", b.cuda ? Py_True : Py_False, "archs",
                       b.archs, "ptx", b.ptx, "cuda_version", b.cuda_version);
}

/* cq_cuda_runtime_info as a dict (the GIL released: opening cuBLASLt may take a while). */
static PyObject *py_cuda_runtime_info(PyObject *self, PyObject *noargs) {
  (void)noargs;
  cq_cuda_runtime_info r;
  cq_status st;
  Py_BEGIN_ALLOW_THREADS st = cq_cuda_runtime_info_get(&r, sizeof r);
  Py_END_ALLOW_THREADS
  if (st != CQ_OK) return cqpy_raise(self, st);
  return Py_BuildValue("{s:i,s:i,s:i,s:K,s:s,s:s}", "runtime_version", r.runtime_version, "driver_version",
                       r.driver_version, "device_count", r.device_count, "cublaslt_version",
                       (unsigned long long)r.cublaslt_version, "cublaslt_path", r.cublaslt_path, "cublaslt_error",
                       r.cublaslt_error);
}

/* cq_cuda_device of one device as a dict. */
static PyObject *py_cuda_device(PyObject *self, PyObject *args) {
  int device = 0;
  if (!PyArg_ParseTuple(args, "|i", &device)) return NULL;
  cq_cuda_device d;
  cq_status st;
  Py_BEGIN_ALLOW_THREADS st = cq_cuda_device_get(device, &d, sizeof d);
  Py_END_ALLOW_THREADS
  if (st != CQ_OK) return cqpy_raise(self, st);
  return Py_BuildValue("{s:s,s:i,s:i,s:K,s:O,s:O,s:s}", "name", d.name, "cc", d.cc, "sms", d.sms, "total_memory",
                       (unsigned long long)d.total_memory, "kernels", d.kernels ? Py_True : Py_False, "sm90a",
                       d.sm90a ? Py_True : Py_False, "why_not", d.why_not);
}

static PyMethodDef module_methods[] = {
    {"formats", py_formats, METH_NOARGS, "formats() -> list of dicts: the format table"},
    {"format_values", py_format_values, METH_VARARGS, "format_values(format) -> bytes: every code's value as float32"},
    {"packed_row_bytes", py_packed_row_bytes, METH_VARARGS, "packed_row_bytes(format, cols) -> bytes of a stored row"},
    {"built_with_cuda", py_built_with_cuda, METH_NOARGS, "built_with_cuda() -> bool"},
    {"cuda_compute_capability", py_cuda_compute_capability, METH_VARARGS,
     "cuda_compute_capability(device=0) -> int, e.g. 90"},
    {"cuda_device_supported", py_cuda_device_supported, METH_VARARGS,
     "cuda_device_supported(device=0) -> (bool, reason)\n\nWhether cquant's CUDA kernels run on the device: it is\n"
     "compute capability 8.0+ and this build holds code it can load. reason says why not (\"\" when supported)."},
    {"build_info", py_build_info, METH_NOARGS,
     "build_info() -> dict: version, cuda (bool), archs (';'-separated machine-code arches), ptx (the embedded\n"
     "PTX's arch, '' for none), cuda_version (1000 * major + 10 * minor the kernels were compiled with)"},
    {"cuda_runtime_info", py_cuda_runtime_info, METH_NOARGS,
     "cuda_runtime_info() -> dict: runtime_version, driver_version (0: no driver), device_count,\n"
     "cublaslt_version (0: none opened), cublaslt_path, cublaslt_error. NotImplementedError in a CPU-only build."},
    {"cuda_device", py_cuda_device, METH_VARARGS,
     "cuda_device(device=0) -> dict: name, cc, sms, total_memory, kernels (bool: cquant's kernels run on it),\n"
     "sm90a (bool: this build's sm_90a kernels run on it), why_not"},
    {"settings", py_settings, METH_NOARGS,
     "settings() -> dict: libcquant's parsed CQUANT_* switches (disable_wgmma, disable_cublaslt_fp8,\n"
     "wo_chunk_mib, gemv_persistent and attn_sm90 ('auto', 'off' or 'on'), attn_disabled (a tuple of\n"
     "'mma', 'sm90', 'int8'), cublaslt_path, share_activations, group4_decode_min_m (-1: the measured\n"
     "choice))."},
    {"reload_settings", py_reload_settings, METH_NOARGS,
     "reload_settings()\n\nRead the CQUANT_* environment variables again (they are read once, at first use)."},
    {NULL, NULL, 0, NULL},
};

static int add_constants(PyObject *m) {
  struct {
    const char *name;
    long value;
  } consts[] = {
      {"FORMAT_VERSION", CQ_FORMAT_VERSION},
      {"PACK_ROW_ALIGN", CQ_PACK_ROW_ALIGN},
      {"MAX_DIMS", CQ_MAX_DIMS},
      {"OK", CQ_OK},
      {"ERR_INVALID_ARG", CQ_ERR_INVALID_ARG},
      {"ERR_TYPE", CQ_ERR_TYPE},
      {"ERR_UNSUPPORTED", CQ_ERR_UNSUPPORTED},
      {"ERR_DLPACK", CQ_ERR_DLPACK},
      {"ERR_CUDA", CQ_ERR_CUDA},
      {"ERR_CUBLAS", CQ_ERR_CUBLAS},
      {"ERR_OOM", CQ_ERR_OOM},
      {"ERR_INTERNAL", CQ_ERR_INTERNAL},
      {"GRANULARITY_ROW", CQ_GRANULARITY_ROW},
      {"GRANULARITY_TENSOR", CQ_GRANULARITY_TENSOR},
      {"GRANULARITY_GROUP", CQ_GRANULARITY_GROUP},
      {"GRANULARITY_TWO_LEVEL", CQ_GRANULARITY_TWO_LEVEL},
      {"GROUP_SIZE_MIN", CQ_GROUP_SIZE_MIN},
      {"GROUP_SIZE_MAX", CQ_GROUP_SIZE_MAX},
      {"GROUP_SIZE_DEFAULT", CQ_GROUP_SIZE_DEFAULT},
      {"FORMAT_NONE", CQ_FORMAT_NONE},
      {"FORMAT_INT8", CQ_FORMAT_INT8},
      {"FORMAT_FP8_E4M3", CQ_FORMAT_FP8_E4M3},
      {"FORMAT_FP8_E5M2", CQ_FORMAT_FP8_E5M2},
      {"FORMAT_INT4", CQ_FORMAT_INT4},
      {"FORMAT_UINT4", CQ_FORMAT_UINT4},
      {"ACTIVATION_NONE", CQ_ACTIVATION_NONE},
      {"ACTIVATION_GELU_TANH", CQ_ACTIVATION_GELU_TANH},
      {"MIN_CC_WEIGHT_ONLY", CQ_MIN_CC_WEIGHT_ONLY},
      {"MIN_CC_INT8_DYNAMIC", CQ_MIN_CC_INT8_DYNAMIC},
      {"MIN_CC_FP8_DYNAMIC", CQ_MIN_CC_FP8_DYNAMIC},
      {"LINEAR_INT8_MAX_K", CQ_LINEAR_INT8_MAX_K},
      {"NORM_LAYER", CQ_NORM_LAYER},
      {"NORM_RMS", CQ_NORM_RMS},
      {"ATTENTION_FULL", CQ_ATTENTION_FULL},
      {"ATTENTION_INT8", CQ_ATTENTION_INT8},
      {"ATTENTION_Q_BLOCK", CQ_ATTENTION_Q_BLOCK},
      {"ATTENTION_K_BLOCK", CQ_ATTENTION_K_BLOCK},
      {"ATTENTION_MAX_HEAD_DIM", CQ_ATTENTION_MAX_HEAD_DIM},
      {"MIN_CC_ATTENTION", CQ_MIN_CC_ATTENTION},
      {"MIN_CC_ATTENTION_INT8", CQ_MIN_CC_ATTENTION_INT8},
  };
  for (size_t i = 0; i < sizeof consts / sizeof consts[0]; ++i)
    if (PyModule_AddIntConstant(m, consts[i].name, consts[i].value) < 0) return -1;
  PyObject *tau = PyFloat_FromDouble((double)CQ_ATTENTION_INT8_MAX_LOGIT_ERROR);
  const int added = tau ? PyModule_AddObjectRef(m, "ATTENTION_INT8_MAX_LOGIT_ERROR", tau) : -1;
  Py_XDECREF(tau);
  if (added < 0) return -1;
  cq_build_info b;
  if (cq_build_info_get(&b, sizeof b) != CQ_OK) return -1;
  return PyModule_AddStringConstant(m, "VERSION", b.version);
}

/* Module execution (PEP 489 multi-phase init): functions, constants, the module's own
 * CudaError in its state. */
static int module_exec(PyObject *m) {
  cqpy_state *state = (cqpy_state *)PyModule_GetState(m);
  state->cuda_error = PyErr_NewExceptionWithDoc("cquant.CudaError", "A CUDA or cuBLASLt call inside cquant failed.",
                                                PyExc_RuntimeError, NULL);
  if (!state->cuda_error || PyModule_AddObjectRef(m, "CudaError", state->cuda_error) < 0) return -1;
  if (PyModule_AddFunctions(m, cqpy_op_methods) < 0 || PyModule_AddFunctions(m, cqpy_fused_methods) < 0 ||
      PyModule_AddFunctions(m, cqpy_attention_methods) < 0)
    return -1;
  return add_constants(m);
}

static int module_traverse(PyObject *m, visitproc visit, void *arg) {
  cqpy_state *state = (cqpy_state *)PyModule_GetState(m);
  Py_VISIT(state->cuda_error);
  return 0;
}

static int module_clear(PyObject *m) {
  cqpy_state *state = (cqpy_state *)PyModule_GetState(m);
  Py_CLEAR(state->cuda_error);
  return 0;
}

static void module_free(void *m) { module_clear((PyObject *)m); }

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cquant._C",
    .m_doc = "libcquant bindings (DLPack in, status codes out).",
    .m_size = sizeof(cqpy_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&module_def); }
