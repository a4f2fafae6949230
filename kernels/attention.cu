/* Flash-attention forward with mma.sync (sm_80+), bf16/fp16, and the CUDA entry of cq_attention.
 *
 * One CTA computes BM = 16 * MT * NWARPS query rows of one (batch, head); each warp owns
 * 16 * MT rows, so every K/V fragment read from shared memory feeds MT mma's. Per tile of BN
 * keys: S = Q K^T (ldmatrix from smem, fp32 accumulators), online softmax in registers
 * (log2 domain, scale folded in), P rounded to the input type and fed straight from the S
 * accumulators as the A operand of O += P V (V through ldmatrix.trans). K and V have one
 * shared-memory buffer each, loaded with cp.async so that V_j arrives during Q K_j^T and
 * K_{j+1} during the softmax and P V_j. Head dims are padded in shared memory to the
 * specialisation's DP with zeros (cp.async zero-fill), as are the rows past Sq and Skv;
 * keys past Skv are masked to -inf. Rows are padded by 16 bytes against bank conflicts. */
#include "attention_common.cuh"

template <typename T, int DP, int MT, int BN, int NWARPS>
struct cq_attn_cfg {
  static constexpr int BM = 16 * MT * NWARPS;
  static constexpr int THREADS = 32 * NWARPS;
  static constexpr int LD = DP + 8;          /* smem row stride in elements */
  static constexpr int CHUNKS = DP / 8;      /* 16-byte chunks per row */
  static constexpr int NS = BN / 8;          /* n-tiles of S */
  static constexpr int NO = DP / 8;          /* n-tiles of O */
  static constexpr size_t SMEM = (size_t)(BM + 2 * BN) * LD * sizeof(T);
  static_assert(DP % 16 == 0 && BN % 16 == 0, "tiles are multiples of 16");
};

/* Rows [row0, row0 + rows) of one head of a [B, S, H, D] tensor into smem [rows][LD], zero
 * past `limit` rows and past head_dim columns. */
template <typename T, int DP, int ROWS, int THREADS>
__device__ __forceinline__ void cq_attn_load_tile(T *smem, const T *base, int64_t row_stride, int row0, int limit,
                                                  int head_dim) {
  constexpr int CHUNKS = DP / 8, LD = DP + 8;
#pragma unroll
  for (int idx = threadIdx.x; idx < ROWS * CHUNKS; idx += THREADS) {
    const int r = idx / CHUNKS, c = idx % CHUNKS;
    const bool valid = row0 + r < limit && c * 8 < head_dim;
    const T *src = valid ? base + (int64_t)(row0 + r) * row_stride + c * 8 : base;
    cq_cp_async16(smem + r * LD + c * 8, src, valid);
  }
}

template <typename T, int DP, int MT, int BN, int NWARPS>
__global__ void __launch_bounds__(32 * NWARPS, 2) cq_attn_fwd_mma(const cq_attn_args a) {
  using C = cq_attn_cfg<T, DP, MT, BN, NWARPS>;
  constexpr int LD = C::LD;
  extern __shared__ __align__(16) unsigned char cq_attn_smem[];
  T *sQ = reinterpret_cast<T *>(cq_attn_smem);
  T *sK = sQ + C::BM * LD;
  T *sV = sK + BN * LD;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int q0 = blockIdx.x * C::BM, h = blockIdx.y, b = blockIdx.z;
  const T *qg = static_cast<const T *>(a.q) + b * a.q_sb + h * a.q_sh;
  const T *kg = static_cast<const T *>(a.k) + b * a.k_sb + h * a.k_sh;
  const T *vg = static_cast<const T *>(a.v) + b * a.v_sb + h * a.v_sh;
  const int n_tiles = (a.seq_kv + BN - 1) / BN;

  cq_attn_load_tile<T, DP, C::BM, C::THREADS>(sQ, qg, a.q_ss, q0, a.seq_q, a.head_dim);
  cq_attn_load_tile<T, DP, BN, C::THREADS>(sK, kg, a.k_ss, 0, a.seq_kv, a.head_dim);
  cq_cp_async_commit();

  float o[MT][C::NO][4];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int n = 0; n < C::NO; ++n) o[i][n][0] = o[i][n][1] = o[i][n][2] = o[i][n][3] = 0.f;
    m[i][0] = m[i][1] = -INFINITY;
    l[i][0] = l[i][1] = 0.f;
  }
  const T *sQw = sQ + warp * 16 * MT * LD;

  for (int j = 0; j < n_tiles; ++j) {
    const int k0 = j * BN;
    cq_cp_async_wait<0>();
    __syncthreads(); /* K_j landed; every warp is done with V_{j-1} */
    cq_attn_load_tile<T, DP, BN, C::THREADS>(sV, vg, a.v_ss, k0, a.seq_kv, a.head_dim);
    cq_cp_async_commit();

    float s[MT][C::NS][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int n = 0; n < C::NS; ++n) s[i][n][0] = s[i][n][1] = s[i][n][2] = s[i][n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
      uint32_t qa[MT][4];
#pragma unroll
      for (int i = 0; i < MT; ++i)
        cq_ldsm_x4(qa[i][0], qa[i][1], qa[i][2], qa[i][3], sQw + (i * 16 + lane % 16) * LD + kk * 16 + (lane / 16) * 8);
#pragma unroll
      for (int n = 0; n < C::NS; n += 2) {
        uint32_t b0, b1, b2, b3;
        const int mi = lane / 8;
        cq_ldsm_x4(b0, b1, b2, b3, sK + (n * 8 + (mi / 2) * 8 + lane % 8) * LD + kk * 16 + (mi % 2) * 8);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          cq_mma_16816<T>(s[i][n], qa[i], b0, b1);
          cq_mma_16816<T>(s[i][n + 1], qa[i], b2, b3);
        }
      }
    }
    __syncthreads(); /* every warp is done with K_j */
    if (j + 1 < n_tiles) {
      cq_attn_load_tile<T, DP, BN, C::THREADS>(sK, kg, a.k_ss, k0 + BN, a.seq_kv, a.head_dim);
      cq_cp_async_commit();
    }

    /* online softmax, log2 domain */
    const bool tail = k0 + BN > a.seq_kv;
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < C::NS; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float x = s[i][n][2 * hh + e] * a.scale_log2;
            if (tail && k0 + n * 8 + 2 * t + e >= a.seq_kv) x = -INFINITY;
            s[i][n][2 * hh + e] = x;
            mx = fmaxf(mx, x);
          }
        mx = cq_quad_max(mx);
        const float m_new = fmaxf(m[i][hh], mx);
        const float m_use = m_new == -INFINITY ? 0.f : m_new; /* no inf - inf */
        const float alpha = cq_exp2(m[i][hh] - m_use);
        m[i][hh] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < C::NS; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = cq_exp2(s[i][n][2 * hh + e] - m_use);
            s[i][n][2 * hh + e] = p;
            sum += p;
          }
        l[i][hh] = l[i][hh] * alpha + sum;
#pragma unroll
        for (int n = 0; n < C::NO; ++n) o[i][n][2 * hh] *= alpha, o[i][n][2 * hh + 1] *= alpha;
      }
    }

    /* P in the input type, as the A operand of P V (frees the fp32 S registers) */
    uint32_t pa[MT][BN / 16][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        pa[i][kk][0] = cq_pack2<T>(s[i][2 * kk][0], s[i][2 * kk][1]);
        pa[i][kk][1] = cq_pack2<T>(s[i][2 * kk][2], s[i][2 * kk][3]);
        pa[i][kk][2] = cq_pack2<T>(s[i][2 * kk + 1][0], s[i][2 * kk + 1][1]);
        pa[i][kk][3] = cq_pack2<T>(s[i][2 * kk + 1][2], s[i][2 * kk + 1][3]);
      }

    if (j + 1 < n_tiles) cq_cp_async_wait<1>();
    else cq_cp_async_wait<0>();
    __syncthreads(); /* V_j landed */

#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
      for (int n = 0; n < C::NO; n += 2) {
        uint32_t b0, b1, b2, b3;
        const int mi = lane / 8;
        cq_ldsm_x4_trans(b0, b1, b2, b3, sV + (kk * 16 + (mi % 2) * 8 + lane % 8) * LD + n * 8 + (mi / 2) * 8);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          cq_mma_16816<T>(o[i][n], pa[i][kk], b0, b1);
          cq_mma_16816<T>(o[i][n + 1], pa[i][kk], b2, b3);
        }
      }
    }
  }

  /* normalise, stage the warp's rows in its own part of sQ, write 16-byte chunks */
  T *stage = sQ + warp * 16 * MT * LD;
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float lsum = cq_quad_sum(l[i][hh]);
      const float inv = 1.f / lsum;
      const int r = i * 16 + hh * 8 + g;
#pragma unroll
      for (int n = 0; n < C::NO; ++n)
        *reinterpret_cast<uint32_t *>(stage + r * LD + n * 8 + 2 * t) =
            cq_pack2<T>(o[i][n][2 * hh] * inv, o[i][n][2 * hh + 1] * inv);
      const int row = q0 + warp * 16 * MT + r;
      if (a.lse && t == 0 && row < a.seq_q)
        a.lse[((int64_t)b * a.heads + h) * a.seq_q + row] = (m[i][hh] + __log2f(lsum)) * CQ_LN2;
    }
  }
  __syncwarp();
  T *og = static_cast<T *>(a.out) + b * a.o_sb + h * a.o_sh;
  for (int idx = lane; idx < 16 * MT * C::CHUNKS; idx += 32) {
    const int r = idx / C::CHUNKS, c = idx % C::CHUNKS;
    const int row = q0 + warp * 16 * MT + r;
    if (row < a.seq_q && c * 8 < a.head_dim)
      *reinterpret_cast<uint4 *>(og + (int64_t)row * a.o_ss + c * 8) = *reinterpret_cast<const uint4 *>(stage + r * LD + c * 8);
  }
}

template <typename T, int DP, int MT, int BN, int NWARPS>
static cq_status cq_attn_launch_mma(const cq_attn_args &a, cudaStream_t stream) {
  using C = cq_attn_cfg<T, DP, MT, BN, NWARPS>;
  auto kernel = cq_attn_fwd_mma<T, DP, MT, BN, NWARPS>;
  CQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::SMEM));
  dim3 grid((unsigned)((a.seq_q + C::BM - 1) / C::BM), (unsigned)a.heads, (unsigned)a.batch);
  kernel<<<grid, C::THREADS, C::SMEM, stream>>>(a);
  CQ_LAUNCH_CHECK("cq_attn_fwd_mma");
  return CQ_OK;
}

/* The one place where a head dim picks its compile-time specialisation (padded dim DP,
 * rows per warp 16 * MT, keys per tile BN, warps). */
template <typename T>
static cq_status cq_attn_dispatch_mma(const cq_attn_args &a, cudaStream_t stream) {
  const int d = a.head_dim;
  if (d <= 64) return cq_attn_launch_mma<T, 64, 2, 64, 4>(a, stream);
  if (d <= 80) return cq_attn_launch_mma<T, 80, 2, 64, 4>(a, stream);
  if (d <= 96) return cq_attn_launch_mma<T, 96, 2, 64, 4>(a, stream);
  if (d <= 128) return cq_attn_launch_mma<T, 128, 2, 64, 4>(a, stream);
  if (d <= 160) return cq_attn_launch_mma<T, 160, 1, 64, 4>(a, stream);
  if (d <= 192) return cq_attn_launch_mma<T, 192, 1, 64, 4>(a, stream);
  return cq_attn_launch_mma<T, 256, 1, 64, 4>(a, stream);
}

/* ---------------------------------------------------------------- entry */

int cq_attention_sm90_applies(const cq_attn_args &a, int cc);
cq_status cq_attention_sm90_launch(const cq_attn_args &a, int is_bf16, cudaStream_t stream);
cq_status cq_attention_int8_workspace(const cq_attention_params *p, const cq_attention_dims *n, size_t *bytes);
cq_status cq_attention_int8_launch(const cq_attn_args &a, const cq_attention_params *p, void *workspace,
                                   size_t workspace_bytes, int cc, int dtype_is_bf16, cudaStream_t stream);

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
  CQ_TRY(cq_cuda_compute_capability(q->device_id, &cc));
  if (cc < 80)
    return cq_fail(CQ_ERR_UNSUPPORTED, "attention on CUDA needs compute capability 8.0 or newer (mma.sync bf16); "
                   "device %d has %d.%d", (int)q->device_id, cc / 10, cc % 10);

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
    if (cq_attn_kernel_disabled("int8"))
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
  if (cq_attn_kernel_disabled("mma"))
    return cq_fail(CQ_ERR_UNSUPPORTED, "the mma.sync attention kernel is disabled by CQUANT_ATTN_DISABLE");
  if (q->dtype == CQ_DTYPE_BF16) return cq_attn_dispatch_mma<__nv_bfloat16>(a, s);
  return cq_attn_dispatch_mma<__half>(a, s);
}
