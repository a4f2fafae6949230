/* The CUDA entry of cq_attention: what only the GPU path needs checked, the kernel arguments,
 * and which kernel runs (attention_mma.cu, attention_sm90.cu, attention_int8_*.cu). */
#include "attention.cuh"

static cq_status check_kernel_layout(const cq_tensor *t, const char *name) {
  if ((uintptr_t)t->data % 16)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s data address %p is not 16-byte aligned (the CUDA attention kernels read "
                   "16-byte rows)", name, t->data);
  for (int d = 0; d < 3; ++d)
    if (t->shape[d] > 1 && t->strides[d] % 8)
      return cq_fail(CQ_ERR_INVALID_ARG, "%s has stride %lld in dim %d; the CUDA attention kernels need strides that "
                     "are multiples of 8 elements (pass a contiguous tensor)", name, (long long)t->strides[d], d);
  return CQ_OK;
}

extern "C" cq_status cq_attention_workspace_cuda(const cq_attention_params *p, const cq_attention_dims *n,
                                                 size_t *bytes) {
  *bytes = 0;
  if (p->mode != CQ_ATTENTION_INT8) return CQ_OK;
  return cq_attention_int8_workspace(p, n, bytes);
}

extern "C" cq_status cq_attention_cuda(const cq_tensor *q, const cq_tensor *k, const cq_tensor *v,
                                       const cq_attention_params *p, const cq_attention_dims *n, cq_tensor *workspace,
                                       cq_tensor *out, cq_tensor *lse, void *stream) {
  if (q->dtype != CQ_DTYPE_BF16 && q->dtype != CQ_DTYPE_F16)
    return cq_fail(CQ_ERR_UNSUPPORTED, "attention on CUDA takes bfloat16 or float16 q, k, v; got %s "
                   "(float32 runs on the CPU reference only)", cq_dtype_name(q->dtype));
  if (n->head_dim % 8 || n->head_dim > CQ_ATTENTION_MAX_HEAD_DIM)
    return cq_fail(CQ_ERR_UNSUPPORTED, "attention on CUDA takes head dims that are multiples of 8 up to %d; got %lld",
                   CQ_ATTENTION_MAX_HEAD_DIM, (long long)n->head_dim);
  if (n->batch > 65535 || n->heads > 65535 || n->seq_q > INT32_MAX - 256 || n->seq_kv > INT32_MAX - 256)
    return cq_fail(CQ_ERR_UNSUPPORTED, "attention on CUDA takes batch and heads up to 65535 and sequences below 2^31");
  CQ_TRY(check_kernel_layout(q, "q"));
  CQ_TRY(check_kernel_layout(k, "k"));
  CQ_TRY(check_kernel_layout(v, "v"));
  CQ_TRY(check_kernel_layout(out, "out"));
  int cc = 0;
  CQ_TRY(cq_require_cc(q->device_id, p->mode == CQ_ATTENTION_INT8 ? CQ_MIN_CC_ATTENTION_INT8 : CQ_MIN_CC_ATTENTION,
                       p->mode == CQ_ATTENTION_INT8 ? "8-bit attention (fp8 mma)" : "attention on CUDA (mma.sync)",
                       &cc));

  cq_attn_args a;
  a.q = q->data, a.k = k->data, a.v = v->data, a.out = out->data;
  a.lse = lse ? (float *)lse->data : NULL;
  a.q_sb = q->strides[0], a.q_ss = q->strides[1], a.q_sh = q->strides[2];
  a.k_sb = k->strides[0], a.k_ss = k->strides[1], a.k_sh = k->strides[2];
  a.v_sb = v->strides[0], a.v_ss = v->strides[1], a.v_sh = v->strides[2];
  a.o_sb = out->strides[0], a.o_ss = out->strides[1], a.o_sh = out->strides[2];
  a.batch = (int)n->batch, a.heads = (int)n->heads, a.seq_q = (int)n->seq_q, a.seq_kv = (int)n->seq_kv;
  a.head_dim = (int)n->head_dim;
  a.scale_log2 = p->scale * CQ_LOG2E;
  cudaStream_t s = cq_stream(stream);

  if (p->mode == CQ_ATTENTION_INT8) {
    if (cq_attn_kernel_disabled(CQ_ATTN_KERNEL_INT8))
      return cq_fail(CQ_ERR_UNSUPPORTED, "the 8-bit attention kernel is disabled by CQUANT_ATTN_DISABLE");
    size_t need = 0;
    CQ_TRY(cq_attention_int8_workspace(p, n, &need));
    size_t have = workspace ? (size_t)cq_tensor_numel(workspace) * cq_dtype_size(workspace->dtype) : 0;
    if (have < need)
      return cq_fail(CQ_ERR_INVALID_ARG, "workspace has %zu bytes; the 8-bit attention needs %zu "
                     "(cq_attention_workspace_size)", have, need);
    if (workspace) {
      CQ_TRY(cq_check_contiguous(workspace, "workspace"));
      CQ_TRY(cq_check_writable(workspace, "workspace"));
      CQ_TRY(cq_check_same_device(q, "q", workspace, "workspace"));
    }
    return cq_attention_int8_launch(a, p, workspace ? workspace->data : NULL, have, cc, q->dtype == CQ_DTYPE_BF16, s);
  }
  if (cq_attention_sm90_applies(a, cc)) return cq_attention_sm90_launch(a, q->dtype == CQ_DTYPE_BF16, s);
  if (cq_attn_kernel_disabled(CQ_ATTN_KERNEL_MMA))
    return cq_fail(CQ_ERR_UNSUPPORTED, "the mma.sync attention kernel is disabled by CQUANT_ATTN_DISABLE");
  return cq_attention_mma_launch(a, q->dtype == CQ_DTYPE_BF16, s);
}
