/* Private declarations of the cquant._C extension. */
#ifndef CQPY_H
#define CQPY_H

#define PY_SSIZE_T_CLEAN
/* The stable ABI of CPython 3.10+: one build of the extension serves every later Python. */
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030A0000
#endif
#include <Python.h>

#include "cquant-dlpack.h"
#include "cquant.h"

/* A tensor argument imported through DLPack: the descriptor plus what keeps
 * the producer's memory alive until cqpy_release. */
typedef struct cqpy_tensor {
  cq_tensor t;                          /* what libcquant reads */
  PyObject *capsule;                    /* owned reference, or NULL */
  DLManagedTensor *legacy;              /* set when the capsule was "dltensor" */
  DLManagedTensorVersioned *versioned;  /* set when it was "dltensor_versioned" */
} cqpy_tensor;

/* The CUDA stream an op runs on: given by the caller, or automatic (the
 * producer's current stream, resolved while importing the first CUDA tensor). */
typedef struct cqpy_stream {
  uintptr_t value; /* cudaStream_t as an integer (0: legacy default stream) */
  int automatic;   /* nonzero until resolved */
} cqpy_stream;

/* None or -1: automatic; an int >= 0: that stream. 0, or -1 with an exception. */
int cqpy_parse_stream(PyObject *obj, cqpy_stream *out);

/* Import obj as argument `name`. `writable`: it is an output and must not be
 * read-only. `stream`: the stream the op will run on; an automatic one is
 * resolved from the producer where it can tell. Returns 0, or -1 with a
 * Python exception set. */
int cqpy_import(PyObject *obj, const char *name, int writable, cqpy_stream *stream, cqpy_tensor *out);
/* Give the tensor back to its producer: deleter called exactly once. */
void cqpy_release(cqpy_tensor *t);

/* The name of obj's type for a message: a new reference (None if it cannot be had). */
PyObject *cqpy_type_name(PyObject *obj);

/* Per-module state (multi-phase init, PEP 489): what the module owns. */
typedef struct cqpy_state {
  PyObject *cuda_error; /* cquant._C.CudaError (a RuntimeError) */
} cqpy_state;

/* Set the Python exception for a failed status (CUDA failures raise the CudaError of `module`,
 * the module object a method receives as self); always returns NULL. */
PyObject *cqpy_raise(PyObject *module, cq_status status);

/* The op wrappers (ops.c) and their method-table entries. */
extern PyMethodDef cqpy_op_methods[];
/* Fused attention wrappers (attention.c). */
extern PyMethodDef cqpy_attention_methods[];
/* Fused DiT block op wrappers (fused.c). */
extern PyMethodDef cqpy_fused_methods[];

#endif /* CQPY_H */
