/* DLPack import: any object with __dlpack__ becomes a cq_tensor.
 *
 * Versioned (DLPack >= 1.0) capsules are asked for first and legacy ones
 * accepted; a major version above the one we know is refused without touching
 * anything but the version field. The capsule is renamed to "used_..." only
 * once we own the tensor, and its deleter then runs exactly once, in
 * cqpy_release. Producers with a C exchange table (__dlpack_c_exchange_api__,
 * e.g. torch) hand over the same versioned tensor from C, without Python calls. */
#include "cqpy.h"

PyObject *cqpy_type_name(PyObject *obj) {
  PyObject *name = PyObject_GetAttrString((PyObject *)Py_TYPE(obj), "__qualname__");
  if (!name) {
    PyErr_Clear();
    name = Py_NewRef(Py_None);
  }
  return name;
}

/* (device_type, device_id) from __dlpack_device__, or CPU if the producer has none. */
static int query_device(PyObject *obj, const char *name, int *type, int *id) {
  *type = kDLCPU, *id = 0;
  if (!PyObject_HasAttrString(obj, "__dlpack_device__")) return 0;
  PyObject *dev = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
  if (!dev) return -1;
  int ok = PyArg_ParseTuple(dev, "ii", type, id);
  Py_DECREF(dev);
  if (!ok) {
    PyErr_Format(PyExc_BufferError, "%s: __dlpack_device__() did not return (device_type, device_id)", name);
    return -1;
  }
  return 0;
}

/* Call obj.__dlpack__(stream=..., max_version=(1, minor)); fall back to the
 * legacy signature for producers that predate max_version. */
static PyObject *export_capsule(PyObject *obj, const char *name, int device_type, uintptr_t stream) {
  PyObject *method = PyObject_GetAttrString(obj, "__dlpack__");
  if (!method) return NULL;
  PyObject *stream_arg;
  if (device_type == kDLCUDA)
    /* DLPack: 1 is the legacy default stream; 0 is disallowed as ambiguous */
    stream_arg = PyLong_FromUnsignedLongLong(stream ? (unsigned long long)stream : 1ull);
  else
    stream_arg = Py_NewRef(Py_None);
  PyObject *args = PyTuple_New(0);
  PyObject *kwargs = Py_BuildValue("{s:O,s:(ii)}", "stream", stream_arg, "max_version", CQ_DLPACK_MAJOR_VERSION,
                                   CQ_DLPACK_MINOR_VERSION);
  PyObject *cap = (args && kwargs) ? PyObject_Call(method, args, kwargs) : NULL;
  if (!cap && PyErr_ExceptionMatches(PyExc_TypeError)) {
    PyErr_Clear();
    Py_XDECREF(kwargs);
    kwargs = Py_BuildValue("{s:O}", "stream", stream_arg);
    cap = kwargs ? PyObject_Call(method, args, kwargs) : NULL;
  }
  if (!cap && PyErr_ExceptionMatches(PyExc_BufferError)) {
    /* e.g. NumPy refusing a read-only array through the legacy protocol */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *s = value ? PyObject_Str(value) : NULL;
    const char *text = s ? PyUnicode_AsUTF8AndSize(s, NULL) : NULL;
    PyErr_Format(PyExc_BufferError, "%s: __dlpack__ failed: %s", name, text ? text : "?");
    Py_XDECREF(s), Py_XDECREF(type), Py_XDECREF(value), Py_XDECREF(tb);
  }
  Py_XDECREF(args), Py_XDECREF(kwargs), Py_DECREF(stream_arg), Py_DECREF(method);
  return cap;
}

/* The producer type's C exchange table, or NULL, and (*negatable) whether its tensors can carry
 * a lazy negation (an is_neg method, as torch's). Looked up on the type and cached: the handful
 * of tensor types a process passes stay alive. */
static const DLPackExchangeAPI *exchange_api_of(PyTypeObject *type, int *negatable) {
  enum { SLOTS = 8 };
  static PyTypeObject *types[SLOTS];
  static const DLPackExchangeAPI *apis[SLOTS];
  static int negs[SLOTS];
  static int next;
  for (int i = 0; i < SLOTS; ++i)
    if (types[i] == type) {
      *negatable = negs[i];
      return apis[i];
    }
  *negatable = PyObject_HasAttrString((PyObject *)type, "is_neg");
  const DLPackExchangeAPI *api = NULL;
  PyObject *cap = PyObject_GetAttrString((PyObject *)type, "__dlpack_c_exchange_api__");
  if (cap && PyCapsule_IsValid(cap, "dlpack_exchange_api")) {
    api = (const DLPackExchangeAPI *)PyCapsule_GetPointer(cap, "dlpack_exchange_api");
    if (api && (api->header.version.major != CQ_DLPACK_MAJOR_VERSION || !api->managed_tensor_from_py_object_no_sync ||
                !api->current_work_stream))
      api = NULL;
  }
  Py_XDECREF(cap);
  PyErr_Clear();
  Py_INCREF(type); /* the cache keeps the type alive, so a pointer is never reused */
  Py_XDECREF(types[next]);
  types[next] = type, apis[next] = api, negs[next] = *negatable;
  next = (next + 1) % SLOTS;
  return api;
}

int cqpy_parse_stream(PyObject *obj, cqpy_stream *out) {
  out->value = 0, out->automatic = 1;
  if (!obj || obj == Py_None) return 0;
  long long v = PyLong_AsLongLong(obj);
  if (v == -1 && PyErr_Occurred()) {
    PyObject *type = cqpy_type_name(obj);
    PyErr_Format(PyExc_TypeError, "stream must be an int (a cudaStream_t) or None, got %S", type);
    Py_DECREF(type);
    return -1;
  }
  if (v < -1) {
    PyErr_Format(PyExc_ValueError, "stream = %lld; expected a cudaStream_t value, or None / -1 for the producer's current stream", v);
    return -1;
  }
  if (v >= 0) out->value = (uintptr_t)v, out->automatic = 0;
  return 0;
}

/* Describe the imported tensor and check what the argument needs. */
static int describe(cqpy_tensor *out, const DLTensor *dl, int readonly, const char *name, int writable) {
  cq_status st = cq_tensor_from_dlpack(dl, readonly, &out->t);
  if (st != CQ_OK) {
    PyObject *type = st == CQ_ERR_TYPE ? PyExc_TypeError : st == CQ_ERR_UNSUPPORTED ? PyExc_NotImplementedError : PyExc_BufferError;
    PyErr_Format(type, "%s: %s", name, cq_last_error());
    return -1;
  }
  if (writable && out->t.readonly) {
    PyErr_Format(PyExc_ValueError, "%s is read-only; expected a writable output tensor", name);
    return -1;
  }
  return 0;
}

/* Fast path through the producer's C exchange table: no Python call and no
 * stream synchronisation, which is right because cquant enqueues on the
 * producer's current stream (resolved here when the caller left it automatic). */
static int import_exchange(const DLPackExchangeAPI *api, PyObject *obj, const char *name, int writable,
                           cqpy_stream *stream, cqpy_tensor *out) {
  DLManagedTensorVersioned *mt = NULL;
  if (api->managed_tensor_from_py_object_no_sync(obj, &mt) < 0 || !mt) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_BufferError, "%s: the producer exported no tensor", name);
    return -1;
  }
  out->versioned = mt;
  if (mt->version.major > CQ_DLPACK_MAJOR_VERSION) {
    PyErr_Format(PyExc_BufferError, "%s: DLPack version %u.%u is newer than the %d.x cquant understands", name,
                 (unsigned)mt->version.major, (unsigned)mt->version.minor, CQ_DLPACK_MAJOR_VERSION);
    return -1; /* the caller's release runs the deleter, as the ABI asks */
  }
  const DLTensor *dl = &mt->dl_tensor;
  if (stream->automatic && dl->device.device_type == kDLCUDA) {
    void *s = NULL;
    if (api->current_work_stream(kDLCUDA, dl->device.device_id, &s) != 0) return -1;
    stream->value = (uintptr_t)s, stream->automatic = 0;
  }
  return describe(out, dl, (mt->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0, name, writable);
}

/* torch tensors may hold their values negated lazily (the negative bit of a neg view), which
 * DLPack cannot express: such a tensor exports its stored values, the opposite of what it holds.
 * Refused rather than read with the wrong sign. 0, or -1 with BufferError set. */
static int refuse_lazy_negation(PyObject *obj, const char *name) {
  PyObject *neg = PyObject_CallMethod(obj, "is_neg", NULL);
  if (!neg) {
    PyErr_Clear(); /* not the method we know: nothing to refuse */
    return 0;
  }
  const int is_neg = PyObject_IsTrue(neg);
  Py_DECREF(neg);
  if (is_neg == 0) return 0;
  if (is_neg > 0)
    PyErr_Format(PyExc_BufferError, "%s has torch's negative bit set (a lazily negated view, which DLPack cannot "
                 "express); pass %s.resolve_neg()", name, name);
  return -1;
}

int cqpy_import(PyObject *obj, const char *name, int writable, cqpy_stream *stream, cqpy_tensor *out) {
  memset(out, 0, sizeof *out);
  if (!obj || obj == Py_None) {
    PyErr_Format(PyExc_TypeError, "%s: expected a tensor, got None", name);
    return -1;
  }
  int negatable = 0;
  const DLPackExchangeAPI *api = exchange_api_of(Py_TYPE(obj), &negatable);
  if (negatable && refuse_lazy_negation(obj, name) < 0) return -1;
  if (api) {
    if (import_exchange(api, obj, name, writable, stream, out) == 0) return 0;
    cqpy_release(out);
    return -1;
  }
  if (!PyObject_HasAttrString(obj, "__dlpack__")) {
    PyObject *type = cqpy_type_name(obj);
    PyErr_Format(PyExc_TypeError,
                 "%s: expected an array supporting DLPack (__dlpack__: a NumPy array, torch tensor, CuPy "
                 "array, ...), got %S", name, type);
    Py_DECREF(type);
    return -1;
  }
  int dev_type, dev_id;
  if (query_device(obj, name, &dev_type, &dev_id) < 0) return -1;
  /* an automatic stream with no exchange table: the legacy default stream,
   * which the producer synchronises with its own current stream */
  if (dev_type == kDLCUDA) stream->automatic = 0;
  PyObject *cap = export_capsule(obj, name, dev_type, stream->value);
  if (!cap) return -1;

  const DLTensor *dl;
  int readonly = 0;
  if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
    DLManagedTensorVersioned *mt = (DLManagedTensorVersioned *)PyCapsule_GetPointer(cap, "dltensor_versioned");
    if (!mt) goto fail_unowned;
    if (mt->version.major > CQ_DLPACK_MAJOR_VERSION) {
      /* unknown layout: read nothing else; the capsule's destructor frees it */
      PyErr_Format(PyExc_BufferError, "%s: DLPack version %u.%u is newer than the %d.x cquant understands", name,
                   (unsigned)mt->version.major, (unsigned)mt->version.minor, CQ_DLPACK_MAJOR_VERSION);
      goto fail_unowned;
    }
    if (PyCapsule_SetName(cap, "used_dltensor_versioned") < 0) goto fail_unowned;
    out->versioned = mt;
    dl = &mt->dl_tensor;
    readonly = (mt->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
  } else if (PyCapsule_IsValid(cap, "dltensor")) {
    DLManagedTensor *mt = (DLManagedTensor *)PyCapsule_GetPointer(cap, "dltensor");
    if (!mt) goto fail_unowned;
    if (PyCapsule_SetName(cap, "used_dltensor") < 0) goto fail_unowned;
    out->legacy = mt;
    dl = &mt->dl_tensor;
  } else {
    PyObject *type = cqpy_type_name(cap);
    PyErr_Format(PyExc_BufferError, "%s: __dlpack__ returned %S, not a live DLPack capsule (\"dltensor\" or "
                 "\"dltensor_versioned\"); was it consumed already?", name, type);
    Py_DECREF(type);
    goto fail_unowned;
  }
  out->capsule = cap;

  if ((int)dl->device.device_type != dev_type && !(dev_type == kDLCPU && dl->device.device_type == kDLCUDAHost)) {
    PyErr_Format(PyExc_BufferError, "%s: __dlpack__ gave device type %d but __dlpack_device__ said %d", name,
                 (int)dl->device.device_type, dev_type);
    cqpy_release(out);
    return -1;
  }
  if (describe(out, dl, readonly, name, writable) < 0) {
    cqpy_release(out);
    return -1;
  }
  return 0;

fail_unowned:
  {
    /* the capsule's destructor (the producer's deleter) may run Python code */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    Py_DECREF(cap);
    PyErr_Restore(type, value, tb);
  }
  return -1;
}

void cqpy_release(cqpy_tensor *t) {
  /* Deleters may run Python code (a producer written in Python, an array's
   * finalizer), which must not see the exception of a failed call: keep it aside. */
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  if (t->versioned) {
    if (t->versioned->deleter) t->versioned->deleter(t->versioned);
  } else if (t->legacy) {
    if (t->legacy->deleter) t->legacy->deleter(t->legacy);
  }
  t->versioned = NULL;
  t->legacy = NULL;
  Py_CLEAR(t->capsule);
  PyErr_Restore(type, value, tb);
}
