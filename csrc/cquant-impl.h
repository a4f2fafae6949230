/* Private declarations of libcquant shared by its C files (not installed). */
#ifndef CQUANT_IMPL_H
#define CQUANT_IMPL_H

#include "cquant.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Record a failure for cq_last_error() and return `status`. */
cq_status cq_fail(cq_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Return from the enclosing function on any error. */
#define CQ_TRY(expr)                   \
  do {                                 \
    cq_status cq_try_s_ = (expr);      \
    if (cq_try_s_ != CQ_OK) return cq_try_s_; \
  } while (0)

/* The CUDA branch of a public op (the file includes cquant-cuda.h when CQ_WITH_CUDA): run the
 * launcher with the tensor's device made current and return its status; in a CPU-only build,
 * fail with CQ_ERR_UNSUPPORTED naming the op. */
#ifdef CQ_WITH_CUDA
#define CQ_CUDA_OR_UNSUPPORTED(t, op, call)                        \
  do {                                                             \
    int cq_prev_dev_;                                              \
    CQ_TRY(cq_cuda_enter_device((t)->device_id, &cq_prev_dev_));   \
    cq_status cq_dev_s_ = (call);                                  \
    cq_cuda_restore_device(cq_prev_dev_);                          \
    return cq_dev_s_;                                              \
  } while (0)
#else
#define CQ_CUDA_OR_UNSUPPORTED(t, op, call) \
  return cq_fail(CQ_ERR_UNSUPPORTED, "%s on CUDA tensors needs cquant built with CUDA (this build is CPU-only)", op)
#endif

/* a * b and a + b when they fit int64 (nonzero), else 0: every size that comes from a caller is
 * computed through these. */
static inline int cq_mul_ok(int64_t a, int64_t b, int64_t *r) { return !__builtin_mul_overflow(a, b, r); }
static inline int cq_add_ok(int64_t a, int64_t b, int64_t *r) { return !__builtin_add_overflow(a, b, r); }

/* The 4-bit formats (int4, uint4): packed, one scale (uint4: scale and zero point) per group of
 * columns, CQ_GRANULARITY_GROUP only. */
static inline int cq_format_grouped(const cq_format_info *f) {
  return f->id == CQ_FORMAT_INT4 || f->id == CQ_FORMAT_UINT4;
}
/* fp32 values a group stores: (scale, zero point) for uint4, the scale alone for int4. */
static inline int cq_group_scale_width(const cq_format_info *f) { return f->id == CQ_FORMAT_UINT4 ? 2 : 1; }
/* Granularities with scales per group of columns: GROUP and int4's TWO_LEVEL. */
static inline int cq_granularity_grouped(cq_granularity g) {
  return g == CQ_GRANULARITY_GROUP || g == CQ_GRANULARITY_TWO_LEVEL;
}

/* malloc of count elements of `size` bytes; NULL (no allocation) when the byte count overflows. */
void *cq_alloc(int64_t count, size_t size);

/* CPU loops with less work than this (elements, or multiply-adds for linear) run on one
 * thread: opening an OpenMP parallel region costs more than small ops take, and far more
 * when the cores are shared with other processes. */
#define CQ_OMP_MIN_WORK ((int64_t)1 << 18)

/* The settings in effect (settings.c), read from the environment on first use. */
cq_settings cq_settings_now(void);

/* ---- argument checks (tensor.c); `name` is the argument's name in messages ---- */

cq_status cq_check_present(const cq_tensor *t, const char *name);
/* The C reference (op "cq_x" as op_ref) runs on CPU tensors only. */
cq_status cq_require_cpu(const cq_tensor *t, const char *op);
/* Row-major contiguous (size-1 dims may have any stride), no zero-size dims. */
cq_status cq_check_contiguous(const cq_tensor *t, const char *name);
/* [..., cols] with the last dim contiguous and the flattened rows one stride apart (a contiguous
 * tensor or a column slice of a wider one), the stride >= cols (rows apart), no zero-size dims,
 * aligned elements: *ld gets the row stride in elements (cols for a single row). */
cq_status cq_check_row_strided(const cq_tensor *t, const char *name, int64_t *ld);
cq_status cq_check_writable(const cq_tensor *t, const char *name);
cq_status cq_check_same_device(const cq_tensor *a, const char *name_a, const cq_tensor *b,
                               const char *name_b);
/* The bytes an output spans do not meet those of another argument (inputs, other outputs,
 * workspace): an op never reads what it has begun to write. */
cq_status cq_check_no_overlap(const cq_tensor *out, const char *out_name, const cq_tensor *other,
                              const char *other_name);
/* Distinct elements of an output occupy distinct memory: sorted by stride, each stride passes the
 * span of the smaller ones (no zero strides, no interleaving that makes elements alias). */
cq_status cq_check_no_self_overlap(const cq_tensor *t, const char *name);
/* dtype is one of the `n` listed. */
cq_status cq_check_dtype(const cq_tensor *t, const char *name, const cq_dtype *allowed, int n);
/* t's shape as Python writes a tuple, "(2, 3)", cut to len bytes. */
void cq_format_shape(const cq_tensor *t, char *buf, size_t len);
/* Number of rows of t viewed as [rows, last dim]. */
int64_t cq_rows(const cq_tensor *t);
int64_t cq_cols(const cq_tensor *t);

/* Load element i of an f32/f16/bf16 tensor as fp32; store fp32 rounded (RNE). */
float cq_load_float(const void *data, cq_dtype dtype, int64_t i);
void cq_store_float(void *data, cq_dtype dtype, int64_t i, float v);

/* ---- validated op arguments (ops_check.c), shared by _ref and dispatch ---- */

cq_status cq_check_quantize(const cq_tensor *x, const cq_quant_params *p, const cq_tensor *q,
                            const cq_tensor *scale, const cq_format_info **f);
cq_status cq_check_dequantize(const cq_tensor *q, const cq_tensor *scale,
                              const cq_quant_params *p, const cq_tensor *y,
                              const cq_format_info **f);
cq_status cq_check_pack(const cq_tensor *codes, int bits, const cq_tensor *packed, int unpack);
cq_status cq_check_copy_rows(const cq_tensor *src, const cq_tensor *dst);
/* The rows of the 8-bit wire's views (cq_check_wire): the row dims padded in front to 4 (outer
 * first), and each argument's strides of them, in elements (0 for an absent one). */
enum { CQ_WIRE_VALUES, CQ_WIRE_MEAN, CQ_WIRE_CODES, CQ_WIRE_SCALES, CQ_WIRE_NORMS, CQ_WIRE_ARGS };
typedef struct cq_wire_rows {
  int64_t shape[4], rows, cols;
  int64_t strides[CQ_WIRE_ARGS][4];
} cq_wire_rows;
/* decode: values is the output y, else the input x */
cq_status cq_check_wire(const cq_tensor *values, const cq_tensor *mean, const cq_tensor *codes, const cq_tensor *scales,
                        const cq_tensor *norms, int decode, cq_wire_rows *g);
cq_status cq_check_linear(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale,
                          const cq_tensor *bias, const cq_linear_params *p, const cq_tensor *y,
                          const cq_format_info **wf, const cq_format_info **af);
/* What the epilogue of a gated linear layer reads (cq_linear_gated): G samples of
 * rows_per_sample rows, gate rows ldg elements apart, residual rows ldr apart. */
typedef struct cq_gate_layout {
  int64_t samples, rows_per_sample, ldg, ldr;
  int in_place; /* residual is y itself */
} cq_gate_layout;
cq_status cq_check_linear_gated(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale, const cq_tensor *bias,
                                const cq_tensor *gate, const cq_tensor *residual, const cq_linear_params *p,
                                const cq_tensor *y, const cq_format_info **wf, const cq_format_info **af,
                                cq_gate_layout *gl);
/* A workspace (written by the op) that overlaps none of the n other arguments (NULL ones skipped). */
cq_status cq_check_workspace_apart(const cq_tensor *workspace, const cq_tensor *const *args, const char *const *names,
                                   int n);
cq_status cq_check_linear_quantized(const cq_tensor *x_codes, const cq_tensor *x_scale, const cq_tensor *w,
                                    const cq_tensor *w_scale, const cq_tensor *bias, const cq_linear_params *p,
                                    const cq_tensor *y, const cq_format_info **wf, const cq_format_info **af);

/* ---- CPU bodies (arguments already checked) ---- */

cq_status cq_quantize_cpu(const cq_tensor *x, const cq_quant_params *p, const cq_format_info *f,
                          cq_tensor *q, cq_tensor *scale);
cq_status cq_dequantize_cpu(const cq_tensor *q, const cq_tensor *scale, const cq_quant_params *p,
                            const cq_format_info *f, cq_tensor *y);
cq_status cq_pack_cpu(const cq_tensor *codes, int bits, cq_tensor *packed);
cq_status cq_unpack_cpu(const cq_tensor *packed, int bits, cq_tensor *codes);
cq_status cq_linear_cpu(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale,
                        const cq_tensor *bias, const cq_linear_params *p,
                        const cq_format_info *wf, const cq_format_info *af, cq_tensor *y);
cq_status cq_linear_quantized_cpu(const cq_tensor *x_codes, const cq_tensor *x_scale, const cq_tensor *w,
                                  const cq_tensor *w_scale, const cq_tensor *bias, const cq_linear_params *p,
                                  const cq_format_info *wf, const cq_format_info *af, cq_tensor *y);
cq_status cq_linear_gated_cpu(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale, const cq_tensor *bias,
                              const cq_tensor *gate, const cq_tensor *residual, const cq_gate_layout *gl,
                              const cq_linear_params *p, const cq_format_info *wf, const cq_format_info *af,
                              cq_tensor *y);

/* ---- attention: checks (ops_check.c), CPU body (attention_cpu.c) ---- */

/* Sizes of a validated attention call. */
typedef struct cq_attention_dims {
  int64_t batch, heads, seq_q, seq_kv, head_dim;
} cq_attention_dims;

/* 8-bit block sizes with the defaults applied. */
static inline int32_t cq_attention_q_block(const cq_attention_params *p) {
  return p->q_block > 0 ? p->q_block : CQ_ATTENTION_Q_BLOCK;
}
static inline int32_t cq_attention_k_block(const cq_attention_params *p) {
  return p->k_block > 0 ? p->k_block : CQ_ATTENTION_K_BLOCK;
}
cq_status cq_check_attention(const cq_tensor *q, const cq_tensor *k, const cq_tensor *v,
                             const cq_attention_params *p, const cq_tensor *out, const cq_tensor *lse,
                             cq_attention_dims *dims);
cq_status cq_attention_cpu(const cq_tensor *q, const cq_tensor *k, const cq_tensor *v,
                           const cq_attention_params *p, const cq_attention_dims *dims, cq_tensor *out,
                           cq_tensor *lse);
cq_status cq_check_attention_int8_bound(const cq_tensor *q, const cq_tensor *k, const cq_attention_params *p,
                                        const cq_tensor *bound, cq_attention_dims *dims);
cq_status cq_attention_int8_logit_error_cpu(const cq_tensor *q, const cq_tensor *k, const cq_attention_params *p,
                                            const cq_attention_dims *dims, cq_tensor *bound);

/* A [B, S, H, D] tensor read or written with strides (ops_check.c): 4 dims, D >= 1, non-negative
 * strides, last dim contiguous; B, S and H may be 0. `layout` names the dims in messages. */
cq_status cq_check_bshd(const cq_tensor *t, const char *name, const char *layout);

/* ---- fused DiT block ops: checks (fused_check.c), CPU bodies (fused_cpu.c) ---- */

/* *f is the table entry of a quantized out_format, NULL for CQ_FORMAT_NONE. */
cq_status cq_check_norm_modulate(const cq_tensor *x, const cq_tensor *scale, const cq_tensor *shift,
                                 const cq_norm_modulate_params *p, const cq_tensor *out, const cq_tensor *out_scale,
                                 const cq_format_info **f);
cq_status cq_norm_modulate_cpu(const cq_tensor *x, const cq_tensor *scale, const cq_tensor *shift,
                               const cq_norm_modulate_params *p, const cq_format_info *f, cq_tensor *out,
                               cq_tensor *out_scale);

/* Sizes of a validated qk_norm_rope call: inputs [batch, seq, heads, head_dim], outputs
 * [batch, seq_total, heads, head_dim]. */
typedef struct cq_qk_norm_rope_dims {
  int64_t batch, seq, heads, head_dim, seq_total;
} cq_qk_norm_rope_dims;

cq_status cq_check_qk_norm_rope(const cq_tensor *q_in, const cq_tensor *k_in, const cq_tensor *v_in,
                                const cq_tensor *q_weight, const cq_tensor *k_weight, const cq_tensor *cos,
                                const cq_tensor *sin, const cq_qk_norm_rope_params *p, const cq_tensor *q_out,
                                const cq_tensor *k_out, const cq_tensor *v_out, cq_qk_norm_rope_dims *dims);
cq_status cq_qk_norm_rope_cpu(const cq_tensor *q_in, const cq_tensor *k_in, const cq_tensor *v_in,
                              const cq_tensor *q_weight, const cq_tensor *k_weight, const cq_tensor *cos,
                              const cq_tensor *sin, const cq_qk_norm_rope_params *p, const cq_qk_norm_rope_dims *dims,
                              cq_tensor *q_out, cq_tensor *k_out, cq_tensor *v_out);

/* Bytes of a packed row of `cols` codes of `bits` bits (padded, see cquant.h); -1 when cols is
 * negative or the bytes overflow int64. */
int64_t cq_pack_row_bytes_bits(int bits, int64_t cols);
/* Bit-stream store/load of code j of a packed row (LSB first). */
void cq_store_bits(uint8_t *row, int64_t j, int bits, uint32_t code);
uint32_t cq_load_bits(const uint8_t *row, int64_t j, int bits);
/* Write the code of one element into a stored row (packed or not). */
void cq_store_code(const cq_format_info *f, void *row, int64_t j, uint32_t code);
/* Read the code of one element of a stored row. */
uint32_t cq_load_code(const cq_format_info *f, const void *row, int64_t j);

#ifdef __cplusplus
}
#endif

#endif /* CQUANT_IMPL_H */
