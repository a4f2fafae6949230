/* Private launchers of the quantized linear layer (act_quant.cu, gemm_mma.cu, gemm_wgmma.cu,
 * wo_dispatch.cu, wo_dequant_rows.cu), called by linear.cu and quantize.cu. */
#ifndef CQ_KERNELS_LINEAR_IMPL_CUH
#define CQ_KERNELS_LINEAR_IMPL_CUH

#include "common.cuh"

/* Where a linear layer's results go, on every path: y's rows ldy elements apart (a column slice
 * of a wider tensor when ldy > N) and, for a gated layer (gate non-NULL, cq_linear_gated),
 *   y[m, n] = residual[m, n] + gate[m / rows_per_sample, n] * v[m, n]
 * with v the layer's fp32 value before its rounding, one fp32 product and one sum, rounded once. */
struct cq_linear_out {
  void *y;
  cq_dtype y_dtype;
  int64_t ldy;
  const void *gate;        /* [G, N] f32/f16/bf16, or NULL: a plain layer */
  cq_dtype gate_dtype;
  int64_t ldg;             /* elements between gate rows */
  int64_t rows_per_sample; /* M / G: rows of x that share a gate row */
  const void *residual;    /* [M, N] in y's dtype, rows ldr apart; may be y itself */
  int64_t ldr;
};

/* The value stored at (row, col) of out (rows and columns of the whole layer): v itself, or for a
 * gated layer its gated residual (the residual has y's dtype). */
__device__ __forceinline__ float cq_out_value(const cq_linear_out &o, int64_t row, int64_t col, float v) {
  if (!o.gate) return v;
  const float g = cq_load_any(o.gate, o.gate_dtype, (row / o.rows_per_sample) * o.ldg + col);
  return cq_gate_residual(v, g, cq_load_any(o.residual, o.y_dtype, row * o.ldr + col));
}

/* Weight-only linear for small batches (wo_dispatch.cu, gemv_wo.cuh): y = act(x W^T * sw + b)
 * with x [M, K], M <= CQ_GEMV_MAX_M, reading the stored weight once. Any weight
 * format (int8, fp8, packed fpX), row or tensor scale, x/y in f32, f16 or bf16. */
#define CQ_GEMV_MAX_M 16
cq_status cq_gemv_wo_cuda(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale,
                          const cq_tensor *bias, const cq_linear_params *p, const cq_format_info *wf,
                          const cq_linear_out *out, void *stream);

/* The same for 4-bit weights per group (int4, uint4; gemv_group4.cu): w' = x' rounded to x's
 * dtype (f32 x: not rounded), y = act(x w'^T + b), p->weight_group_size columns a group. */
cq_status cq_gemv_group4_cuda(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale,
                              const cq_tensor *bias, const cq_linear_params *p, const cq_format_info *wf,
                              const cq_linear_out *out, void *stream);

/* Dequantize stored weight rows [row0, row0 + rows) of w (any format, K codes a
 * row) into out, a dense row-major [rows, K] buffer of `out_dtype` (f16, bf16 or f32),
 * scale applied (wo_dequant_rows.cu). */
cq_status cq_dequant_rows_cuda(const cq_tensor *w, const cq_tensor *w_scale, const cq_linear_params *p,
                               const cq_format_info *wf, int64_t row0, int64_t rows, cq_dtype out_dtype,
                               void *out, void *stream);
/* The same rows decoded without the scale, times `mult` (a power of two, so each value stays
 * exact where out_dtype holds it): the operand of the large-batch weight-only GEMM. */
cq_status cq_decode_rows_cuda(const cq_tensor *w, const cq_linear_params *p, const cq_format_info *wf, int64_t row0,
                              int64_t rows, float mult, cq_dtype out_dtype, void *out, void *stream);

/* Weight-only layers with more than CQ_GEMV_MAX_M rows of x (wo_gemm.cu): bytes of workspace,
 * and the call into them (ws at least that many bytes, 16-byte aligned). */
size_t cq_wo_gemm_workspace(const cq_format_info *wf, int64_t m, int64_t n, int64_t k);
cq_status cq_wo_gemm_cuda(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale, const cq_tensor *bias,
                          const cq_linear_params *p, const cq_format_info *wf, uint8_t *ws, const cq_linear_out *out,
                          int device, cudaStream_t s);

/* Dynamic quantization of the rows of x [rows, cols] (f32/f16/bf16, row stride
 * cols) to int8 or fp8 codes, bit-identical to cq_quantize_cpu:
 *   q   [rows, ldq] codes (ldq >= cols; bytes [cols, ldq) of each row are zeroed)
 *   sx  [rows] fp32 scales; per tensor every entry holds the tensor's scale
 *   amax_word  per tensor only: 4 bytes of device scratch (NULL per row)
 * One pass over x per row (the row stays in registers between its max and its
 * encode); per tensor, a max pass then the encode pass. */
cq_status cq_act_quant_cuda(const void *x, cq_dtype x_dtype, int64_t rows, int64_t cols, const cq_format_info *f,
                            cq_granularity granularity, uint8_t *q, int64_t ldq, float *sx, uint32_t *amax_word,
                            cudaStream_t stream);

/* Operands of the 8-bit GEMM with the scale epilogue:
 *   y[m, n] = act(float(sum_k a[m, k] * b[n, k]) * sa[m] * sb[n] + bias[n])
 * or, gated (gate non-NULL), residual[m, n] + gate[m / rows_per_sample, n] * that (cq_linear_out)
 * a: activation codes [M, lda], b: weight codes [N, ldb], both K-contiguous,
 * 16-byte aligned rows (lda, ldb multiples of 16), zero-padded past K up to
 * kpad = round_up(K, 16). The float form is evaluated left to right without
 * fused multiply-add, so int8 results equal the C reference bit for bit. */
struct cq_gemm8_args {
  const uint8_t *a;
  const uint8_t *b;
  int64_t m, n, kpad, lda, ldb;
  const float *sa;    /* [M] */
  const float *sb;    /* [N], or [1] when sb_stride = 0 */
  int sb_stride;      /* 1 per output channel, 0 per tensor */
  const void *bias;   /* [N] or NULL */
  cq_dtype bias_dtype;
  void *y;            /* [M, N] row-major, row stride ldy */
  int64_t ldy;        /* elements between rows of y (>= N: a chunk of y's columns) */
  cq_dtype y_dtype;
  int a_format, b_format; /* CQ_FORMAT_INT8 (both) or fp8 e4m3/e5m2 */
  int activation;         /* a cq_activation */
  const void *gate;       /* [M / rows_per_sample, N] rows ldg apart, or NULL: no gated residual */
  cq_dtype gate_dtype;
  int64_t ldg, rows_per_sample;
  const void *residual;   /* [M, N] in y's dtype, row stride ldr (may be y) */
  int64_t ldr;
};

/* mma.sync kernel: int8 on sm_80+, fp8 on sm_89+. */
cq_status cq_gemm8_mma_cuda(const cq_gemm8_args *g, cudaStream_t stream);

/* wgmma kernel for sm_90a (int8). *launched = 0 without an error when this
 * build or device cannot run it (the caller then uses the mma.sync kernel). */
cq_status cq_gemm8_wgmma_cuda(const cq_gemm8_args *g, int device, cudaStream_t stream, int *launched);

/* Operands of the mixed-input GEMM: weights decoded in registers between the shared-memory load
 * and the MMA (cquant.h, "4-bit weights per group"; and the per-row 8-bit weight-only formats).
 *   weight-only (a_format CQ_FORMAT_NONE): a = x [M, lda] bf16/f16; w' = x' of the format rounded
 *     to a's dtype; y = act(acc * sw[n] + bias[n]) with sw = 1 for grouped formats
 *   dynamic 4-bit (a_format CQ_FORMAT_INT8 / CQ_FORMAT_FP8_E4M3, w_format CQ_FORMAT_INT4):
 *     a = activation codes [M, lda], sa [M]; y = act((sum_g acc_g * sw[n, g]) * sa[m] + bias[n])
 * then the gated residual of `out` where it has a gate. w rows are ldw bytes apart (packed
 * nibbles for 4-bit formats, low nibble first). lda and ldw are multiples of 16 bytes and the
 * operands 16-byte aligned; k is a multiple of group_size (grouped) or of 16. */
struct cq_mixed_args {
  const void *a;
  cq_dtype a_dtype;          /* bf16 / f16 (weight-only) or the codes' dtype (i8, f8 e4m3) */
  int a_format;              /* CQ_FORMAT_NONE, CQ_FORMAT_INT8 or CQ_FORMAT_FP8_E4M3 */
  int64_t lda;               /* elements between rows of a */
  const float *sa;           /* [M] activation scales (dynamic), else NULL */
  const uint8_t *w;
  int64_t ldw;               /* bytes between weight rows */
  int w_format;              /* CQ_FORMAT_INT4, CQ_FORMAT_UINT4, or an 8-bit format (weight-only) */
  const float *sw;           /* grouped: [N, G] or [N, G, 2]; two-level: [N, 1 + G]; per row: [N];
                                per tensor: [1] */
  cq_granularity w_granularity;
  int64_t group_size;        /* grouped formats (two-level too); else 0 */
  int64_t m, n, k;
  const void *bias;          /* [N] or NULL */
  cq_dtype bias_dtype;
  int activation;            /* a cq_activation */
  cq_linear_out out;
  float *split_ws;           /* scratch the mma.sync and the sm_90a weight-only kernels may split K
                                into (fp32 partial sums of several K ranges), or NULL */
  size_t split_ws_bytes;
  int device;                /* the device the operands live on (its SM count sizes the split) */
};

/* Bytes of split_ws worth giving the mma.sync kernel for m rows and n outputs (0: it never splits
 * problems that large). */
size_t cq_gemm_mixed_split_bytes(int64_t m, int64_t n);

/* mma.sync mixed-input GEMM (gemm_mixed_mma.cu): bf16/f16 and int8 activations on sm_80+, fp8 on
 * sm_89+. */
cq_status cq_gemm_mixed_mma_cuda(const cq_mixed_args *g, cudaStream_t stream);

/* wgmma mixed-input GEMM for sm_90a (gemm_mixed_sm90.cu). *launched = 0 without an error when this
 * build, the device or the operands do not suit it (the caller then uses the mma.sync kernel). */
cq_status cq_gemm_mixed_sm90_cuda(const cq_mixed_args *g, int device, cudaStream_t stream, int *launched);

/* wgmma weight-only GEMM for sm_90a with per-row or per-tensor weight scales (gemm_wo_sm90.cu):
 * int8, fp8 and 4..6-bit fpX codes decoded exactly into a's bf16 / f16, y = act(acc * sw[n] +
 * bias[n]). *launched = 0 without an error when this build, the device, the format or the operands
 * do not suit it, or (measured nonzero) where the decoded rows were measured faster for the shape;
 * the caller then decodes the weight for cuBLASLt. */
cq_status cq_gemm_wo_sm90_cuda(const cq_mixed_args *g, int device, cudaStream_t stream, int measured, int *launched);

/* wgmma GEMM for two-level 4-bit weights and int8 activations (sm_90a). *launched = 0 without an error when
 * this build, the device or the operands do not suit it (the caller then decodes the rows for the int8 GEMM). */
cq_status cq_gemm_w4a8_2l_sm90_cuda(const cq_mixed_args *g, int device, cudaStream_t stream, int *launched);
/* Bytes of split_ws that kernel may use for m rows and n outputs. */
size_t cq_w4a8_2l_split_bytes(int64_t m, int64_t n);

#endif /* CQ_KERNELS_LINEAR_IMPL_CUH */
