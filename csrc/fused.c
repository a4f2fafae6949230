/* Fused DiT block op entries: check the arguments once (fused_check.c), then run the CPU
 * reference (fused_cpu.c) or the CUDA launcher. */
#include "cquant-impl.h"
#ifdef CQ_WITH_CUDA
#include "cquant-cuda.h"
#endif

cq_status cq_norm_modulate_ref(const cq_tensor *x, const cq_tensor *scale, const cq_tensor *shift,
                               const cq_norm_modulate_params *p, cq_tensor *out, cq_tensor *out_scale) {
  const cq_format_info *f;
  CQ_TRY(cq_check_norm_modulate(x, scale, shift, p, out, out_scale, &f));
  CQ_TRY(cq_require_cpu(x, "cq_norm_modulate"));
  return cq_norm_modulate_cpu(x, scale, shift, p, f, out, out_scale);
}

cq_status cq_norm_modulate(const cq_tensor *x, const cq_tensor *scale, const cq_tensor *shift,
                           const cq_norm_modulate_params *p, cq_tensor *out, cq_tensor *out_scale, void *stream) {
  const cq_format_info *f;
  CQ_TRY(cq_check_norm_modulate(x, scale, shift, p, out, out_scale, &f));
  if (x->device_type == CQ_DEVICE_CPU) return cq_norm_modulate_cpu(x, scale, shift, p, f, out, out_scale);
  (void)stream;
  CQ_CUDA_OR_UNSUPPORTED(x, "norm_modulate", cq_norm_modulate_cuda(x, scale, shift, p, f, out, out_scale, stream));
}

cq_status cq_qk_norm_rope_ref(const cq_tensor *q_in, const cq_tensor *k_in, const cq_tensor *v_in,
                              const cq_tensor *q_weight, const cq_tensor *k_weight, const cq_tensor *cos,
                              const cq_tensor *sin, const cq_qk_norm_rope_params *p, cq_tensor *q_out,
                              cq_tensor *k_out, cq_tensor *v_out) {
  cq_qk_norm_rope_dims dims;
  CQ_TRY(cq_check_qk_norm_rope(q_in, k_in, v_in, q_weight, k_weight, cos, sin, p, q_out, k_out, v_out, &dims));
  CQ_TRY(cq_require_cpu(q_in, "cq_qk_norm_rope"));
  return cq_qk_norm_rope_cpu(q_in, k_in, v_in, q_weight, k_weight, cos, sin, p, &dims, q_out, k_out, v_out);
}

cq_status cq_qk_norm_rope(const cq_tensor *q_in, const cq_tensor *k_in, const cq_tensor *v_in,
                          const cq_tensor *q_weight, const cq_tensor *k_weight, const cq_tensor *cos,
                          const cq_tensor *sin, const cq_qk_norm_rope_params *p, cq_tensor *q_out, cq_tensor *k_out,
                          cq_tensor *v_out, void *stream) {
  cq_qk_norm_rope_dims dims;
  CQ_TRY(cq_check_qk_norm_rope(q_in, k_in, v_in, q_weight, k_weight, cos, sin, p, q_out, k_out, v_out, &dims));
  if (q_in->device_type == CQ_DEVICE_CPU)
    return cq_qk_norm_rope_cpu(q_in, k_in, v_in, q_weight, k_weight, cos, sin, p, &dims, q_out, k_out, v_out);
  if (dims.batch == 0 || dims.seq == 0 || dims.heads == 0) return CQ_OK; /* nothing to write */
  (void)stream;
  CQ_CUDA_OR_UNSUPPORTED(q_in, "qk_norm_rope", cq_qk_norm_rope_cuda(q_in, k_in, v_in, q_weight, k_weight, cos, sin, p,
                                                                    &dims, q_out, k_out, v_out, stream));
}
