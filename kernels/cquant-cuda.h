/* The CUDA layer as the core sees it: the one header csrc/ includes from kernels/. Plain C
 * (no CUDA headers), so the core compiles against it in every build.
 *
 * Launchers behind the public ops. Arguments are already checked by ops_check.c; each
 * launcher checks what only the GPU path needs (compute capability, alignment, workspace)
 * before it launches anything, and enqueues on the given stream. The caller has made the
 * tensors' device current (cq_cuda_enter_device). */
#ifndef CQ_CUDA_H
#define CQ_CUDA_H

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
cq_status cq_copy_rows_cuda(const cq_tensor *src, cq_tensor *dst, void *stream);
cq_status cq_wire_encode_cuda(const cq_tensor *x, const cq_tensor *mean, cq_tensor *codes, cq_tensor *scales,
                              cq_tensor *norms, const cq_wire_rows *g, void *stream);
cq_status cq_wire_decode_cuda(const cq_tensor *codes, const cq_tensor *scales, const cq_tensor *mean, cq_tensor *y,
                              const cq_wire_rows *g, void *stream);
cq_status cq_linear_workspace_cuda(const cq_linear_params *p, int64_t m, int64_t n, size_t *bytes);
cq_status cq_linear_cuda(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale,
                         const cq_tensor *bias, const cq_linear_params *p, const cq_format_info *wf,
                         const cq_format_info *af, cq_tensor *workspace, cq_tensor *y, void *stream);
cq_status cq_linear_gated_cuda(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale, const cq_tensor *bias,
                               const cq_tensor *gate, const cq_tensor *residual, const cq_gate_layout *gl,
                               const cq_linear_params *p, const cq_format_info *wf, const cq_format_info *af,
                               cq_tensor *workspace, cq_tensor *y, void *stream);
cq_status cq_linear_quantized_cuda(const cq_tensor *x_codes, const cq_tensor *x_scale, const cq_tensor *w,
                                   const cq_tensor *w_scale, const cq_tensor *bias, const cq_linear_params *p,
                                   const cq_format_info *wf, const cq_format_info *af, cq_tensor *workspace,
                                   cq_tensor *y, void *stream);

/* Fused attention (kernels/attention*.cu); dims from cq_check_attention. */
cq_status cq_attention_workspace_cuda(const cq_attention_params *p, const cq_attention_dims *dims, size_t *bytes);
cq_status cq_attention_cuda(const cq_tensor *q, const cq_tensor *k, const cq_tensor *v, const cq_attention_params *p,
                            const cq_attention_dims *dims, cq_tensor *workspace, cq_tensor *out, cq_tensor *lse,
                            void *stream);

/* Fused DiT block ops (kernels/norm_modulate.cu, kernels/qk_norm_rope.cu). f: the quantized
 * out_format's table entry, NULL for CQ_FORMAT_NONE; dims from cq_check_qk_norm_rope. */
cq_status cq_norm_modulate_cuda(const cq_tensor *x, const cq_tensor *scale, const cq_tensor *shift,
                                const cq_norm_modulate_params *p, const cq_format_info *f, cq_tensor *out,
                                cq_tensor *out_scale, void *stream);
cq_status cq_qk_norm_rope_cuda(const cq_tensor *q_in, const cq_tensor *k_in, const cq_tensor *v_in,
                               const cq_tensor *q_weight, const cq_tensor *k_weight, const cq_tensor *cos,
                               const cq_tensor *sin, const cq_qk_norm_rope_params *p, const cq_qk_norm_rope_dims *dims,
                               cq_tensor *q_out, cq_tensor *k_out, cq_tensor *v_out, void *stream);

/* The build and device queries of cquant.h's "build info" (kernels/device.cu): the CUDA version
 * the kernels were compiled with, and the run-time answers written into zeroed structs. */
int cq_cuda_toolkit_version(void);
cq_status cq_cuda_query_runtime(cq_cuda_runtime_info *out);
cq_status cq_cuda_query_device(int device_id, cq_cuda_device *out);

/* Make a device current for the duration of a launch; *prev gets the device to restore with
 * cq_cuda_restore_device (kernels/device.cu). */
cq_status cq_cuda_enter_device(int device_id, int *prev);
void cq_cuda_restore_device(int prev);

#ifdef __cplusplus
}
#endif

#endif /* CQ_CUDA_H */
