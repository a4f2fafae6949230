/* The one place where a cq_status becomes a Python exception. */
#include "cqpy.h"

PyObject *cqpy_raise(PyObject *module, cq_status status) {
  const char *msg = cq_last_error();
  PyObject *type;
  switch (status) {
    case CQ_ERR_INVALID_ARG: type = PyExc_ValueError; break;
    case CQ_ERR_TYPE: type = PyExc_TypeError; break;
    case CQ_ERR_UNSUPPORTED: type = PyExc_NotImplementedError; break;
    case CQ_ERR_DLPACK: type = PyExc_BufferError; break;
    case CQ_ERR_CUDA:
    case CQ_ERR_CUBLAS: {
      cqpy_state *state = module ? (cqpy_state *)PyModule_GetState(module) : NULL;
      type = state && state->cuda_error ? state->cuda_error : PyExc_RuntimeError;
      break;
    }
    case CQ_ERR_OOM: type = PyExc_MemoryError; break;
    default: type = PyExc_RuntimeError; break;
  }
  PyErr_Format(type, "%s", msg && *msg ? msg : cq_status_name(status));
  return NULL;
}
