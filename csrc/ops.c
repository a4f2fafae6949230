/* Public ops: check arguments once, then run the CPU reference or the CUDA launcher. */
#include <string.h>

#include "cquant-impl.h"
#ifdef CQ_WITH_CUDA
#include "cquant-cuda.h"
#endif

cq_status cq_quantize_ref(const cq_tensor *x, const cq_quant_params *p, cq_tensor *q, cq_tensor *scale) {
  const cq_format_info *f;
  CQ_TRY(cq_check_quantize(x, p, q, scale, &f));
  CQ_TRY(cq_require_cpu(x, "cq_quantize"));
  return cq_quantize_cpu(x, p, f, q, scale);
}

cq_status cq_quantize(const cq_tensor *x, const cq_quant_params *p, cq_tensor *q, cq_tensor *scale, void *stream) {
  const cq_format_info *f;
  CQ_TRY(cq_check_quantize(x, p, q, scale, &f));
  if (x->device_type == CQ_DEVICE_CPU) return cq_quantize_cpu(x, p, f, q, scale);
  (void)stream;
  CQ_CUDA_OR_UNSUPPORTED(x, "quantize", cq_quantize_cuda(x, p, f, q, scale, stream));
}

cq_status cq_dequantize_ref(const cq_tensor *q, const cq_tensor *scale, const cq_quant_params *p, cq_tensor *y) {
  const cq_format_info *f;
  CQ_TRY(cq_check_dequantize(q, scale, p, y, &f));
  CQ_TRY(cq_require_cpu(q, "cq_dequantize"));
  return cq_dequantize_cpu(q, scale, p, f, y);
}

cq_status cq_dequantize(const cq_tensor *q, const cq_tensor *scale, const cq_quant_params *p, cq_tensor *y,
                        void *stream) {
  const cq_format_info *f;
  CQ_TRY(cq_check_dequantize(q, scale, p, y, &f));
  if (q->device_type == CQ_DEVICE_CPU) return cq_dequantize_cpu(q, scale, p, f, y);
  (void)stream;
  CQ_CUDA_OR_UNSUPPORTED(q, "dequantize", cq_dequantize_cuda(q, scale, p, f, y, stream));
}

cq_status cq_pack_ref(const cq_tensor *codes, int bits, cq_tensor *packed) {
  CQ_TRY(cq_check_pack(codes, bits, packed, 0));
  CQ_TRY(cq_require_cpu(codes, "cq_pack"));
  return cq_pack_cpu(codes, bits, packed);
}

cq_status cq_pack(const cq_tensor *codes, int bits, cq_tensor *packed, void *stream) {
  CQ_TRY(cq_check_pack(codes, bits, packed, 0));
  if (codes->device_type == CQ_DEVICE_CPU) return cq_pack_cpu(codes, bits, packed);
  (void)stream;
  CQ_CUDA_OR_UNSUPPORTED(codes, "pack", cq_pack_cuda(codes, bits, packed, stream));
}

cq_status cq_unpack_ref(const cq_tensor *packed, int bits, cq_tensor *codes) {
  CQ_TRY(cq_check_pack(codes, bits, packed, 1));
  CQ_TRY(cq_require_cpu(packed, "cq_unpack"));
  return cq_unpack_cpu(packed, bits, codes);
}

cq_status cq_unpack(const cq_tensor *packed, int bits, cq_tensor *codes, void *stream) {
  CQ_TRY(cq_check_pack(codes, bits, packed, 1));
  if (packed->device_type == CQ_DEVICE_CPU) return cq_unpack_cpu(packed, bits, codes);
  (void)stream;
  CQ_CUDA_OR_UNSUPPORTED(packed, "unpack", cq_unpack_cuda(packed, bits, codes, stream));
}

/* One memcpy a row: the last dim is contiguous in both (cq_check_copy_rows). */
static cq_status copy_rows_cpu(const cq_tensor *src, cq_tensor *dst) {
  const size_t row = (size_t)src->shape[src->ndim - 1] * cq_dtype_size(src->dtype);
  const int64_t n = cq_tensor_numel(src) / src->shape[src->ndim - 1];
  for (int64_t i = 0; i < n; ++i) {
    int64_t s = 0, d = 0, rest = i;
    for (int k = src->ndim - 2; k >= 0; --k) {
      const int64_t at = rest % src->shape[k];
      rest /= src->shape[k];
      s += at * src->strides[k], d += at * dst->strides[k];
    }
    memcpy((char *)dst->data + d * (int64_t)cq_dtype_size(dst->dtype),
           (const char *)src->data + s * (int64_t)cq_dtype_size(src->dtype), row);
  }
  return CQ_OK;
}

cq_status cq_copy_rows_ref(const cq_tensor *src, cq_tensor *dst) {
  CQ_TRY(cq_check_copy_rows(src, dst));
  CQ_TRY(cq_require_cpu(src, "cq_copy_rows"));
  return copy_rows_cpu(src, dst);
}

cq_status cq_copy_rows(const cq_tensor *src, cq_tensor *dst, void *stream) {
  CQ_TRY(cq_check_copy_rows(src, dst));
  if (src->device_type == CQ_DEVICE_CPU) return copy_rows_cpu(src, dst);
  (void)stream;
  CQ_CUDA_OR_UNSUPPORTED(src, "copy_rows", cq_copy_rows_cuda(src, dst, stream));
}

cq_status cq_linear_workspace_size(const cq_linear_params *p, int64_t m, int64_t n, cq_device_type device,
                                   size_t *bytes) {
  if (!p || !bytes) return cq_fail(CQ_ERR_INVALID_ARG, "params and bytes are required");
  if (m < 1 || n < 1) return cq_fail(CQ_ERR_INVALID_ARG, "m = %lld, n = %lld; expected both >= 1", (long long)m, (long long)n);
  *bytes = 0;
  if (device == CQ_DEVICE_CPU) return CQ_OK;
#ifdef CQ_WITH_CUDA
  return cq_linear_workspace_cuda(p, m, n, bytes);
#else
  return cq_fail(CQ_ERR_UNSUPPORTED, "linear on CUDA tensors needs cquant built with CUDA (this build is CPU-only)");
#endif
}

cq_status cq_linear_ref(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale, const cq_tensor *bias,
                        const cq_linear_params *p, cq_tensor *y) {
  const cq_format_info *wf, *af;
  CQ_TRY(cq_check_linear(x, w, w_scale, bias, p, y, &wf, &af));
  CQ_TRY(cq_require_cpu(x, "cq_linear"));
  return cq_linear_cpu(x, w, w_scale, bias, p, wf, af, y);
}

cq_status cq_linear(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale, const cq_tensor *bias,
                    const cq_linear_params *p, cq_tensor *workspace, cq_tensor *y, void *stream) {
  const cq_format_info *wf, *af;
  CQ_TRY(cq_check_linear(x, w, w_scale, bias, p, y, &wf, &af));
  if (x->device_type == CQ_DEVICE_CPU) return cq_linear_cpu(x, w, w_scale, bias, p, wf, af, y);
  const cq_tensor *args[] = {x, w, w_scale, bias, y};
  const char *names[] = {"x", "w", "w_scale", "bias", "y"};
  CQ_TRY(cq_check_workspace_apart(workspace, args, names, 5));
  (void)workspace, (void)stream;
  CQ_CUDA_OR_UNSUPPORTED(x, "linear", cq_linear_cuda(x, w, w_scale, bias, p, wf, af, workspace, y, stream));
}

cq_status cq_linear_quantized_ref(const cq_tensor *x_codes, const cq_tensor *x_scale, const cq_tensor *w,
                                  const cq_tensor *w_scale, const cq_tensor *bias, const cq_linear_params *p,
                                  cq_tensor *y) {
  const cq_format_info *wf, *af;
  CQ_TRY(cq_check_linear_quantized(x_codes, x_scale, w, w_scale, bias, p, y, &wf, &af));
  CQ_TRY(cq_require_cpu(x_codes, "cq_linear_quantized"));
  return cq_linear_quantized_cpu(x_codes, x_scale, w, w_scale, bias, p, wf, af, y);
}

cq_status cq_linear_quantized(const cq_tensor *x_codes, const cq_tensor *x_scale, const cq_tensor *w,
                              const cq_tensor *w_scale, const cq_tensor *bias, const cq_linear_params *p,
                              cq_tensor *workspace, cq_tensor *y, void *stream) {
  const cq_format_info *wf, *af;
  CQ_TRY(cq_check_linear_quantized(x_codes, x_scale, w, w_scale, bias, p, y, &wf, &af));
  if (x_codes->device_type == CQ_DEVICE_CPU) return cq_linear_quantized_cpu(x_codes, x_scale, w, w_scale, bias, p, wf, af, y);
  const cq_tensor *args[] = {x_codes, x_scale, w, w_scale, bias, y};
  const char *names[] = {"x_codes", "x_scale", "w", "w_scale", "bias", "y"};
  CQ_TRY(cq_check_workspace_apart(workspace, args, names, 6));
  (void)workspace, (void)stream;
  CQ_CUDA_OR_UNSUPPORTED(x_codes, "linear_quantized",
                         cq_linear_quantized_cuda(x_codes, x_scale, w, w_scale, bias, p, wf, af, workspace, y, stream));
}

cq_status cq_linear_gated_ref(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale, const cq_tensor *bias,
                              const cq_tensor *gate, const cq_tensor *residual, const cq_linear_params *p,
                              cq_tensor *y) {
  const cq_format_info *wf, *af;
  cq_gate_layout gl;
  CQ_TRY(cq_check_linear_gated(x, w, w_scale, bias, gate, residual, p, y, &wf, &af, &gl));
  CQ_TRY(cq_require_cpu(x, "cq_linear_gated"));
  return cq_linear_gated_cpu(x, w, w_scale, bias, gate, residual, &gl, p, wf, af, y);
}

cq_status cq_linear_gated(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale, const cq_tensor *bias,
                          const cq_tensor *gate, const cq_tensor *residual, const cq_linear_params *p,
                          cq_tensor *workspace, cq_tensor *y, void *stream) {
  const cq_format_info *wf, *af;
  cq_gate_layout gl;
  CQ_TRY(cq_check_linear_gated(x, w, w_scale, bias, gate, residual, p, y, &wf, &af, &gl));
  if (x->device_type == CQ_DEVICE_CPU) return cq_linear_gated_cpu(x, w, w_scale, bias, gate, residual, &gl, p, wf, af, y);
  const cq_tensor *args[] = {x, w, w_scale, bias, gate, residual, y};
  const char *names[] = {"x", "w", "w_scale", "bias", "gate", "residual", "y"};
  CQ_TRY(cq_check_workspace_apart(workspace, args, names, 7));
  (void)workspace, (void)stream, (void)gl;
  CQ_CUDA_OR_UNSUPPORTED(x, "linear_gated",
                         cq_linear_gated_cuda(x, w, w_scale, bias, gate, residual, &gl, p, wf, af, workspace, y, stream));
}
