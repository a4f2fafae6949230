/* Quantized linear layers on the GPU. */
#include "common.cuh"

extern "C" cq_status cq_linear_workspace_cuda(const cq_linear_params *p, int64_t m, int64_t n, size_t *bytes) {
  (void)p, (void)m, (void)n;
  *bytes = 0;
  return CQ_OK;
}

extern "C" cq_status cq_linear_cuda(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale,
                                    const cq_tensor *bias, const cq_linear_params *p, const cq_format_info *wf,
                                    const cq_format_info *af, cq_tensor *workspace, cq_tensor *y, void *stream) {
  /* Weight-only layers with few rows of x: the GEMV reads the weight once (gemv_wo.cu). */
  if (!af && cq_rows(x) <= CQ_GEMV_MAX_M) return cq_gemv_wo_cuda(x, w, w_scale, bias, p, wf, y, stream);

  (void)x, (void)w, (void)w_scale, (void)bias, (void)p, (void)wf, (void)af, (void)workspace, (void)y, (void)stream;
  return cq_fail(CQ_ERR_UNSUPPORTED, "linear: the CUDA kernels of the quantized linear layer are not in this build yet");
}
