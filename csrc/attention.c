/* Attention entries: workspace size, the C reference and the dispatch to the CUDA launcher
 * (argument checks in ops_check.c, the CPU body in attention_cpu.c). */
#include "cquant-impl.h"
#ifdef CQ_WITH_CUDA
#include "cquant-cuda.h"
#endif

cq_status cq_attention_workspace_size(const cq_attention_params *p, int64_t batch, int64_t heads, int64_t seq_q,
                                      int64_t seq_kv, int64_t head_dim, cq_device_type device, size_t *bytes) {
  if (!p || !bytes) return cq_fail(CQ_ERR_INVALID_ARG, "params and bytes are required");
  if (batch < 0 || heads < 0 || seq_q < 0 || seq_kv < 0 || head_dim < 1)
    return cq_fail(CQ_ERR_INVALID_ARG, "batch = %lld, heads = %lld, seq_q = %lld, seq_kv = %lld, head_dim = %lld; "
                   "expected sizes >= 0 and head_dim >= 1", (long long)batch, (long long)heads, (long long)seq_q,
                   (long long)seq_kv, (long long)head_dim);
  if (p->mode != CQ_ATTENTION_FULL && p->mode != CQ_ATTENTION_INT8)
    return cq_fail(CQ_ERR_INVALID_ARG, "mode = %d; expected CQ_ATTENTION_FULL (0) or CQ_ATTENTION_INT8 (1)", (int)p->mode);
  *bytes = 0;
  if (device == CQ_DEVICE_CPU || p->mode == CQ_ATTENTION_FULL) return CQ_OK;
#ifdef CQ_WITH_CUDA
  cq_attention_dims dims = {batch, heads, seq_q, seq_kv, head_dim};
  return cq_attention_workspace_cuda(p, &dims, bytes);
#else
  return cq_fail(CQ_ERR_UNSUPPORTED, "attention on CUDA tensors needs cquant built with CUDA (this build is CPU-only)");
#endif
}

cq_status cq_attention_ref(const cq_tensor *q, const cq_tensor *k, const cq_tensor *v, const cq_attention_params *p,
                           cq_tensor *out, cq_tensor *lse) {
  cq_attention_dims dims;
  CQ_TRY(cq_check_attention(q, k, v, p, out, lse, &dims));
  CQ_TRY(cq_require_cpu(q, "cq_attention"));
  return cq_attention_cpu(q, k, v, p, &dims, out, lse);
}

cq_status cq_attention_int8_logit_error_ref(const cq_tensor *q, const cq_tensor *k, const cq_attention_params *p,
                                            cq_tensor *bound) {
  cq_attention_dims dims;
  CQ_TRY(cq_check_attention_int8_bound(q, k, p, bound, &dims));
  return cq_attention_int8_logit_error_cpu(q, k, p, &dims, bound);
}

cq_status cq_attention(const cq_tensor *q, const cq_tensor *k, const cq_tensor *v, const cq_attention_params *p,
                       cq_tensor *workspace, cq_tensor *out, cq_tensor *lse, void *stream) {
  cq_attention_dims dims;
  CQ_TRY(cq_check_attention(q, k, v, p, out, lse, &dims));
  if (q->device_type == CQ_DEVICE_CPU) return cq_attention_cpu(q, k, v, p, &dims, out, lse);
  if (dims.batch == 0 || dims.heads == 0 || dims.seq_q == 0) return CQ_OK; /* nothing to write */
  const cq_tensor *args[] = {q, k, v, out, lse};
  const char *names[] = {"q", "k", "v", "out", "lse"};
  CQ_TRY(cq_check_workspace_apart(workspace, args, names, 5));
#ifdef CQ_WITH_CUDA
  int prev;
  CQ_TRY(cq_cuda_enter_device(q->device_id, &prev));
  cq_status st = cq_attention_cuda(q, k, v, p, &dims, workspace, out, lse, stream);
  cq_cuda_restore_device(prev);
  return st;
#else
  (void)workspace, (void)stream;
  return cq_fail(CQ_ERR_UNSUPPORTED, "attention on CUDA tensors needs cquant built with CUDA (this build is CPU-only)");
#endif
}
