/* cuBLASLt, opened at run time (private to libcquant).
 *
 * libcquant links cudart statically and must import where no CUDA toolkit or
 * driver is installed, so libcublasLt is not a link dependency: it is found
 * with dlopen on first use, in this order: "libcublasLt.so.<major>" (already
 * loaded by torch, or on the loader path), $CQUANT_CUBLASLT_PATH (files or
 * directories, ':'-separated; cq_settings), $CUDA_HOME/lib64, $CUDA_HOME/lib, /usr/local/cuda/lib64 and
 * /usr/local/cuda/lib. The Python package exports CQUANT_CUBLASLT_PATH for the
 * nvidia-cublas wheel's directory when it finds one.
 *
 * One GEMM in cuBLASLt's column-major terms:
 *   D[m x n] = act(a_scale . b_scale . op(A)[m x k] . op(B)[k x n] + C[m x n] + bias[m])
 * with act the identity or cuBLASLt's GELU epilogue (the tanh form) and C optional (beta = 1;
 * it may be D itself: an in-place update). cuBLASLt adds C before the bias and the activation.
 * (a row-major y[M, N] = x[M, K] W[N, K]^T is m = N, n = M, A = W with
 * trans_a, B = x, ldd = N). */
#ifndef CQ_KERNELS_CUBLASLT_H
#define CQ_KERNELS_CUBLASLT_H

#include "cquant-impl.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum cq_lt_scale_mode {
  CQ_LT_SCALE_NONE = 0,      /* no A/B scales */
  CQ_LT_SCALE_SCALAR = 1,    /* a_scale, b_scale: one fp32 each, in device memory */
  CQ_LT_SCALE_OUTER_VEC = 2, /* a_scale: m fp32, b_scale: n fp32 (cuBLASLt 12.9+, sm_90+) */
} cq_lt_scale_mode;

typedef struct cq_lt_gemm {
  int64_t m, n, k;             /* column-major problem size */
  cq_dtype a_type, b_type;     /* f32/f16/bf16, or fp8 e4m3/e5m2 */
  cq_dtype d_type;             /* f32/f16/bf16, also the type of C */
  int trans_a, trans_b;        /* nonzero: op = transpose */
  int64_t lda, ldb, ldd;       /* leading dimensions in elements */
  const void *a, *b;           /* operands */
  void *d;                     /* output */
  const void *c;               /* C added to the product (beta = 1), or NULL (beta = 0); may be d */
  int64_t ldc;                 /* leading dimension of c (ldd when c is d) */
  const void *bias;            /* m elements of bias_type, or NULL */
  cq_dtype bias_type;          /* must equal d_type for 16-bit outputs */
  cq_lt_scale_mode scale_mode; /* how a_scale / b_scale are read */
  const float *a_scale, *b_scale;
  void *workspace;             /* cuBLASLt workspace (may be NULL when bytes = 0) */
  size_t workspace_bytes;
  int device;                  /* device ordinal (current during the call) */
  int gelu;                    /* nonzero: GELU (tanh form) after the bias */
} cq_lt_gemm;

/* Bytes of cuBLASLt workspace libcquant hands to every GEMM. */
#define CQ_LT_WORKSPACE_BYTES ((size_t)32 << 20)

/* Open the library (once) and check it: CQ_ERR_UNSUPPORTED with a message
 * naming every path tried when it cannot be found. *version may be NULL. */
cq_status cq_lt_load(size_t *version);

/* What cq_cuda_runtime_info_get reports of cuBLASLt: its version and file, or (version 0) why it
 * could not be opened. */
cq_status cq_lt_describe(size_t *version, char *path, size_t path_cap, char *error, size_t error_cap);

/* Enqueue one GEMM on `stream`. The algorithm of each problem (shapes, types,
 * leading dimensions, pointer alignments, epilogue, scale modes) is chosen by
 * cuBLASLt's heuristic once and cached. CQ_ERR_UNSUPPORTED when cuBLASLt has
 * no algorithm for the problem (nothing is launched then). */
cq_status cq_lt_matmul(const cq_lt_gemm *g, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* CQ_KERNELS_CUBLASLT_H */
