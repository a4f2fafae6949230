/* Attention: argument checks shared by the reference and the CUDA path, and dispatch. */
#include <math.h>

#include "cquant-impl.h"
#ifdef CQ_WITH_CUDA
#include "cuda_ops.h"
#endif

static const cq_dtype float_dtypes[] = {CQ_DTYPE_F32, CQ_DTYPE_F16, CQ_DTYPE_BF16};

int32_t cq_attention_q_block(const cq_attention_params *p) {
  return p->q_block > 0 ? p->q_block : CQ_ATTENTION_Q_BLOCK;
}

int32_t cq_attention_k_block(const cq_attention_params *p) {
  return p->k_block > 0 ? p->k_block : CQ_ATTENTION_K_BLOCK;
}

/* A [B, S, H, D] tensor read with strides: 4 dims, every dim >= 1, last dim contiguous. */
static cq_status check_bshd(const cq_tensor *t, const char *name, const char *layout) {
  CQ_TRY(cq_check_present(t, name));
  if (t->ndim != 4)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s has %d dims; expected 4 (%s)", name, (int)t->ndim, layout);
  for (int d = 0; d < 4; ++d) {
    if (t->shape[d] < 1)
      return cq_fail(CQ_ERR_INVALID_ARG, "%s has extent %lld in dim %d; expected every dimension >= 1 (%s)", name,
                     (long long)t->shape[d], d, layout);
    if (t->strides[d] < 0)
      return cq_fail(CQ_ERR_INVALID_ARG, "%s has a negative stride in dim %d; expected non-negative strides", name, d);
  }
  if (t->shape[3] > 1 && t->strides[3] != 1)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s has stride %lld in its last dim; expected the head dim contiguous (stride 1)",
                   name, (long long)t->strides[3]);
  if (!t->data) return cq_fail(CQ_ERR_INVALID_ARG, "%s has a NULL data pointer", name);
  size_t align = cq_dtype_size(t->dtype);
  if (align > 1 && ((uintptr_t)t->data % align) != 0)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s data address %p is not aligned to its %zu-byte elements", name, t->data, align);
  return CQ_OK;
}

/* [first byte, one past the last byte] that a tensor's elements occupy. */
static void byte_extent(const cq_tensor *t, uintptr_t *lo, uintptr_t *hi) {
  int64_t last = 0;
  for (int d = 0; d < t->ndim; ++d) last += (t->shape[d] - 1) * t->strides[d];
  *lo = (uintptr_t)t->data;
  *hi = *lo + (uintptr_t)((last + 1) * (int64_t)cq_dtype_size(t->dtype));
}

static cq_status check_no_overlap(const cq_tensor *out, const char *out_name, const cq_tensor *in, const char *in_name) {
  uintptr_t a0, a1, b0, b1;
  byte_extent(out, &a0, &a1);
  byte_extent(in, &b0, &b1);
  if (a0 < b1 && b0 < a1)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s overlaps %s in memory; expected a separate output buffer", out_name, in_name);
  return CQ_OK;
}

cq_status cq_check_attention(const cq_tensor *q, const cq_tensor *k, const cq_tensor *v,
                             const cq_attention_params *p, const cq_tensor *out, const cq_tensor *lse,
                             cq_attention_dims *dims) {
  if (!p) return cq_fail(CQ_ERR_INVALID_ARG, "params is required");
  if (p->mode != CQ_ATTENTION_FULL && p->mode != CQ_ATTENTION_INT8)
    return cq_fail(CQ_ERR_INVALID_ARG, "mode = %d; expected CQ_ATTENTION_FULL (0) or CQ_ATTENTION_INT8 (1)", (int)p->mode);
  if (!isfinite(p->scale)) return cq_fail(CQ_ERR_INVALID_ARG, "scale = %g; expected a finite softmax scale", (double)p->scale);
  if (p->q_block < 0 || p->k_block < 0)
    return cq_fail(CQ_ERR_INVALID_ARG, "q_block = %d, k_block = %d; expected block sizes >= 1 (or 0 for the defaults)",
                   (int)p->q_block, (int)p->k_block);
  CQ_TRY(check_bshd(q, "q", "[batch, seq_q, heads, head_dim]"));
  CQ_TRY(check_bshd(k, "k", "[batch, seq_kv, heads, head_dim]"));
  CQ_TRY(check_bshd(v, "v", "[batch, seq_kv, heads, head_dim]"));
  CQ_TRY(cq_check_dtype(q, "q", float_dtypes, 3));
  if (k->dtype != q->dtype || v->dtype != q->dtype)
    return cq_fail(CQ_ERR_TYPE, "q, k, v have dtypes %s, %s, %s; expected one dtype", cq_dtype_name(q->dtype),
                   cq_dtype_name(k->dtype), cq_dtype_name(v->dtype));
  CQ_TRY(cq_check_same_device(q, "q", k, "k"));
  CQ_TRY(cq_check_same_device(q, "q", v, "v"));
  const int64_t b = q->shape[0], sq = q->shape[1], h = q->shape[2], d = q->shape[3], skv = k->shape[1];
  if (k->shape[0] != b || k->shape[2] != h || k->shape[3] != d)
    return cq_fail(CQ_ERR_INVALID_ARG, "k has shape (%lld, %lld, %lld, %lld); expected (%lld, seq_kv, %lld, %lld) "
                   "to match q's batch, heads and head_dim", (long long)k->shape[0], (long long)k->shape[1],
                   (long long)k->shape[2], (long long)k->shape[3], (long long)b, (long long)h, (long long)d);
  for (int i = 0; i < 4; ++i)
    if (v->shape[i] != k->shape[i])
      return cq_fail(CQ_ERR_INVALID_ARG, "v has shape (%lld, %lld, %lld, %lld); expected k's shape (%lld, %lld, %lld, %lld)",
                     (long long)v->shape[0], (long long)v->shape[1], (long long)v->shape[2], (long long)v->shape[3],
                     (long long)k->shape[0], (long long)k->shape[1], (long long)k->shape[2], (long long)k->shape[3]);
  CQ_TRY(check_bshd(out, "out", "[batch, seq_q, heads, head_dim]"));
  CQ_TRY(cq_check_writable(out, "out"));
  CQ_TRY(cq_check_same_device(q, "q", out, "out"));
  if (out->dtype != q->dtype)
    return cq_fail(CQ_ERR_TYPE, "out has dtype %s; expected q's dtype %s", cq_dtype_name(out->dtype), cq_dtype_name(q->dtype));
  for (int i = 0; i < 4; ++i)
    if (out->shape[i] != q->shape[i])
      return cq_fail(CQ_ERR_INVALID_ARG, "out has shape (%lld, %lld, %lld, %lld); expected q's shape (%lld, %lld, %lld, %lld)",
                     (long long)out->shape[0], (long long)out->shape[1], (long long)out->shape[2], (long long)out->shape[3],
                     (long long)b, (long long)sq, (long long)h, (long long)d);
  CQ_TRY(check_no_overlap(out, "out", q, "q"));
  CQ_TRY(check_no_overlap(out, "out", k, "k"));
  CQ_TRY(check_no_overlap(out, "out", v, "v"));
  if (lse) {
    static const cq_dtype f32[] = {CQ_DTYPE_F32};
    CQ_TRY(cq_check_contiguous(lse, "lse"));
    CQ_TRY(cq_check_writable(lse, "lse"));
    CQ_TRY(cq_check_same_device(q, "q", lse, "lse"));
    CQ_TRY(cq_check_dtype(lse, "lse", f32, 1));
    if (lse->ndim != 3 || lse->shape[0] != b || lse->shape[1] != h || lse->shape[2] != sq)
      return cq_fail(CQ_ERR_INVALID_ARG, "lse must have shape (%lld, %lld, %lld) = [batch, heads, seq_q]", (long long)b,
                     (long long)h, (long long)sq);
    CQ_TRY(check_no_overlap(lse, "lse", out, "out"));
  }
  dims->batch = b, dims->heads = h, dims->seq_q = sq, dims->seq_kv = skv, dims->head_dim = d;
  return CQ_OK;
}

cq_status cq_attention_workspace_size(const cq_attention_params *p, int64_t batch, int64_t heads, int64_t seq_q,
                                      int64_t seq_kv, int64_t head_dim, cq_device_type device, size_t *bytes) {
  if (!p || !bytes) return cq_fail(CQ_ERR_INVALID_ARG, "params and bytes are required");
  if (batch < 1 || heads < 1 || seq_q < 1 || seq_kv < 1 || head_dim < 1)
    return cq_fail(CQ_ERR_INVALID_ARG, "batch = %lld, heads = %lld, seq_q = %lld, seq_kv = %lld, head_dim = %lld; "
                   "expected every size >= 1", (long long)batch, (long long)heads, (long long)seq_q, (long long)seq_kv,
                   (long long)head_dim);
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
  if (q->device_type != CQ_DEVICE_CPU)
    return cq_fail(CQ_ERR_INVALID_ARG, "cq_attention_ref runs on CPU tensors; got a CUDA tensor (use cq_attention)");
  return cq_attention_cpu(q, k, v, p, &dims, out, lse);
}

cq_status cq_attention(const cq_tensor *q, const cq_tensor *k, const cq_tensor *v, const cq_attention_params *p,
                       cq_tensor *workspace, cq_tensor *out, cq_tensor *lse, void *stream) {
  cq_attention_dims dims;
  CQ_TRY(cq_check_attention(q, k, v, p, out, lse, &dims));
  if (q->device_type == CQ_DEVICE_CPU) return cq_attention_cpu(q, k, v, p, &dims, out, lse);
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
