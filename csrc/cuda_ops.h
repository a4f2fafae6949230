/* CUDA launchers behind the public ops (kernels/ and csrc/cuda_*.c). Arguments
 * are already checked by ops_check.c; each launcher checks what only the GPU
 * path needs (compute capability, alignment) before it launches anything. */
#ifndef CQ_CUDA_OPS_H
#define CQ_CUDA_OPS_H

#include "cquant-impl.h"

#ifdef __cplusplus
extern "C" {
#endif

cq_status cq_quantize_cuda(const cq_tensor *x, const cq_quant_params *p, const cq_format_info *f,
                           cq_tensor *q, cq_tensor *scale, void *stream);
cq_status cq_dequantize_cuda(const cq_tensor *q, const cq_tensor *scale, const cq_quant_params *p,
                             const cq_format_info *f, cq_tensor *y, void *stream);
cq_status cq_pack_cuda(const cq_tensor *codes, int bits, cq_tensor *packed, void *stream);
cq_status cq_unpack_cuda(const cq_tensor *packed, int bits, cq_tensor *codes, void *stream);
cq_status cq_linear_workspace_cuda(const cq_linear_params *p, int64_t m, int64_t n, size_t *bytes);
cq_status cq_linear_cuda(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale,
                         const cq_tensor *bias, const cq_linear_params *p, const cq_format_info *wf,
                         const cq_format_info *af, cq_tensor *workspace, cq_tensor *y, void *stream);
cq_status cq_linear_quantized_cuda(const cq_tensor *x_codes, const cq_tensor *x_scale, const cq_tensor *w,
                                   const cq_tensor *w_scale, const cq_tensor *bias, const cq_linear_params *p,
                                   const cq_format_info *wf, const cq_format_info *af, cq_tensor *workspace,
                                   cq_tensor *y, void *stream);

/* Weight-only linear for small batches (kernels/gemv_wo.cu): y = x W^T * sw + b
 * with x [M, K], M <= CQ_GEMV_MAX_M, reading the stored weight once. Any weight
 * format (int8, fp8, packed fpX), row or tensor scale, x/y in f32, f16 or bf16. */
#define CQ_GEMV_MAX_M 16
cq_status cq_gemv_wo_cuda(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale,
                          const cq_tensor *bias, const cq_linear_params *p, const cq_format_info *wf,
                          cq_tensor *y, void *stream);

/* Dequantize stored weight rows [row0, row0 + rows) of w (any format, K codes a
 * row) into out, a dense row-major [rows, K] buffer of `out_dtype` (f16 or bf16),
 * scale applied (kernels/gemv_wo.cu). For the large-batch weight-only path. */
cq_status cq_dequant_rows_cuda(const cq_tensor *w, const cq_tensor *w_scale, const cq_linear_params *p,
                               const cq_format_info *wf, int64_t row0, int64_t rows, cq_dtype out_dtype,
                               void *out, void *stream);

/* Fused attention (kernels/attention*.cu); dims from cq_check_attention. */
cq_status cq_attention_workspace_cuda(const cq_attention_params *p, const cq_attention_dims *dims, size_t *bytes);
cq_status cq_attention_cuda(const cq_tensor *q, const cq_tensor *k, const cq_tensor *v, const cq_attention_params *p,
                            const cq_attention_dims *dims, cq_tensor *workspace, cq_tensor *out, cq_tensor *lse,
                            void *stream);

/* Make tensor t's device current for the duration of a launch; *prev gets the
 * device to restore with cq_cuda_restore_device. */
cq_status cq_cuda_enter_device(int device_id, int *prev);
void cq_cuda_restore_device(int prev);

#ifdef __cplusplus
}
#endif

#endif /* CQ_CUDA_OPS_H */
