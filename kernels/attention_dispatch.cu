/* The CUDA entry of cq_attention: what only the GPU path needs checked, the kernel arguments,
 * and which kernel runs (attention_mma.cu, attention_sm90.cu, attention_int8_*.cu). */
#include "attention.cuh"

static cq_status check_kernel_layout(const cq_tensor *t, const char *name) {
  if (cq_tensor_numel(t) == 0) return CQ_OK; /* read or written by nothing */
  if ((uintptr_t)t->data % 16)
    return cq_fail(CQ_ERR_INVALID_ARG, "%s data address %p is not 16-byte aligned (the CUDA attention kernels read "
                   "16-byte rows)", name, t->data);
  for (int d = 0; d < 3; ++d)
    if (t->shape[d] > 1 && t->strides[d] % 8)
      return cq_fail(CQ_ERR_INVALID_ARG, "%s has stride %lld in dim %d; the CUDA attention kernels need strides that "
                     "are multiples of 8 elements (pass a contiguous tensor)", name, (long long)t->strides[d], d);
  return CQ_OK;
}

/* The 8-bit mode's workspace holds one slice of at most 65535 (batch, head) pairs (see below). */
extern "C" cq_status cq_attention_workspace_cuda(const cq_attention_params *p, const cq_attention_dims *n,
                                                 size_t *bytes) {
  *bytes = 0;
  if (p->mode != CQ_ATTENTION_INT8 || n->batch == 0 || n->heads == 0 || n->seq_q == 0 || n->seq_kv == 0) return CQ_OK;
  cq_attention_dims slice = *n;
  slice.heads = n->heads < 65535 ? n->heads : 65535;
  const int64_t bs_max = 65535 / slice.heads;
  slice.batch = n->batch < bs_max ? n->batch : bs_max;
  return cq_attention_int8_workspace(p, &slice, bytes);
}

/* The grids take the heads in y and the batch in z, at most 65535 each, and the 8-bit pre-pass
 * batch * heads in y: larger calls run as slices of the batch and of the heads, each launched
 * on the same stream one after the other (the 8-bit ones reuse the workspace in turn). */
constexpr int64_t kGridDimMax = 65535;

/* Arguments of the slice of batches [b0, b0 + bs) and heads [h0, h0 + hs) of a. */
static cq_attn_args slice_of(const cq_attn_args &a, size_t esize, int64_t b0, int64_t bs, int64_t h0, int64_t hs) {
  cq_attn_args s = a;
  s.q = static_cast<const char *>(a.q) + (b0 * a.q_sb + h0 * a.q_sh) * (int64_t)esize;
  s.k = static_cast<const char *>(a.k) + (b0 * a.k_sb + h0 * a.k_sh) * (int64_t)esize;
  s.v = static_cast<const char *>(a.v) + (b0 * a.v_sb + h0 * a.v_sh) * (int64_t)esize;
  s.out = static_cast<char *>(a.out) + (b0 * a.o_sb + h0 * a.o_sh) * (int64_t)esize;
  s.lse = a.lse ? a.lse + b0 * a.lse_sb + h0 * (int64_t)a.seq_q : NULL;
  s.full_heads = a.full_heads ? a.full_heads + b0 * a.full_heads_sb + h0 : NULL;
  s.batch = (int)bs, s.heads = (int)hs;
  return s;
}

/* out = 0 and lse = -inf: attention over no keys (seq_kv = 0; cquant.h). */
template <typename T>
__global__ void empty_keys_kernel(const cq_attn_args a, int64_t rows) {
  const int64_t total = rows * a.head_dim;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t d = i % a.head_dim, r = i / a.head_dim; /* r = (b * seq_q + s) * heads + h */
    const int64_t h = r % a.heads, bs = r / a.heads, s = bs % a.seq_q, b = bs / a.seq_q;
    static_cast<T *>(a.out)[b * a.o_sb + s * a.o_ss + h * a.o_sh + d] = cq_from_float<T>(0.0f);
    if (a.lse && d == 0) a.lse[b * a.lse_sb + h * (int64_t)a.seq_q + s] = -INFINITY;
  }
}

static cq_status fill_empty_keys(const cq_attn_args &a, int is_bf16, cudaStream_t s) {
  const int64_t rows = (int64_t)a.batch * a.seq_q * a.heads, blocks = (rows * a.head_dim + 255) / 256;
  const unsigned grid = (unsigned)(blocks < 1 ? 1 : blocks > 8192 ? 8192 : blocks);
  if (is_bf16) empty_keys_kernel<__nv_bfloat16><<<grid, 256, 0, s>>>(a, rows);
  else empty_keys_kernel<__half><<<grid, 256, 0, s>>>(a, rows);
  CQ_LAUNCH_CHECK(empty_keys_kernel);
  return CQ_OK;
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
  if (n->batch > INT32_MAX || n->heads > INT32_MAX || n->seq_q > INT32_MAX - 256 || n->seq_kv > INT32_MAX - 256)
    return cq_fail(CQ_ERR_UNSUPPORTED, "attention on CUDA takes batch, heads and sequences below 2^31");
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
  a.lse_sb = n->heads * n->seq_q;
  a.q_sb = q->strides[0], a.q_ss = q->strides[1], a.q_sh = q->strides[2];
  a.k_sb = k->strides[0], a.k_ss = k->strides[1], a.k_sh = k->strides[2];
  a.v_sb = v->strides[0], a.v_ss = v->strides[1], a.v_sh = v->strides[2];
  a.o_sb = out->strides[0], a.o_ss = out->strides[1], a.o_sh = out->strides[2];
  a.batch = (int)n->batch, a.heads = (int)n->heads, a.seq_q = (int)n->seq_q, a.seq_kv = (int)n->seq_kv;
  a.head_dim = (int)n->head_dim;
  a.scale_log2 = p->scale * CQ_LOG2E;
  a.full_heads = NULL, a.full_heads_sb = 0;
  const int is_bf16 = q->dtype == CQ_DTYPE_BF16;
  const size_t esize = cq_dtype_size(q->dtype);
  cudaStream_t s = cq_stream(stream);

  const int int8 = p->mode == CQ_ATTENTION_INT8;
  void *ws = NULL;
  size_t have = 0;
  if (int8) {
    if (cq_attn_kernel_disabled(CQ_ATTN_KERNEL_INT8))
      return cq_fail(CQ_ERR_UNSUPPORTED, "the 8-bit attention kernel is disabled by CQUANT_ATTN_DISABLE");
    size_t need = 0;
    CQ_TRY(cq_attention_workspace_cuda(p, n, &need));
    have = workspace ? (size_t)cq_tensor_numel(workspace) * cq_dtype_size(workspace->dtype) : 0;
    if (have < need)
      return cq_fail(CQ_ERR_INVALID_ARG, "workspace has %zu bytes; the 8-bit attention needs %zu "
                     "(cq_attention_workspace_size)", have, need);
    if (workspace && need) {
      CQ_TRY(cq_check_contiguous(workspace, "workspace"));
      CQ_TRY(cq_check_writable(workspace, "workspace"));
      CQ_TRY(cq_check_same_device(q, "q", workspace, "workspace"));
      ws = workspace->data;
    }
  } else if (!cq_attention_sm90_applies(a, cc) && cq_attn_kernel_disabled(CQ_ATTN_KERNEL_MMA)) {
    return cq_fail(CQ_ERR_UNSUPPORTED, "the mma.sync attention kernel is disabled by CQUANT_ATTN_DISABLE");
  }
  if (n->seq_kv == 0) return fill_empty_keys(a, is_bf16, s);

  const int64_t hs = n->heads < kGridDimMax ? n->heads : kGridDimMax;
  const int64_t bs_max = int8 ? (kGridDimMax / hs) : kGridDimMax; /* the 8-bit pre-pass: batch * heads */
  const int64_t bs = n->batch < bs_max ? n->batch : bs_max;
  for (int64_t b0 = 0; b0 < n->batch; b0 += bs) {
    for (int64_t h0 = 0; h0 < n->heads; h0 += hs) {
      const cq_attn_args sl = slice_of(a, esize, b0, n->batch - b0 < bs ? n->batch - b0 : bs, h0,
                                       n->heads - h0 < hs ? n->heads - h0 : hs);
      if (int8) CQ_TRY(cq_attention_int8_launch(sl, p, ws, have, cc, is_bf16, s));
      else if (cq_attention_sm90_applies(sl, cc)) CQ_TRY(cq_attention_sm90_launch(sl, is_bf16, s));
      else CQ_TRY(cq_attention_mma_launch(sl, is_bf16, s));
    }
  }
  return CQ_OK;
}
