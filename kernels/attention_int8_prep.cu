/* 8-bit attention (attention_int8.cuh): the pre-pass that quantizes Q, K and V into the
 * workspace, and the host side of the mode (checks, workspace, which main kernel). */
#include "attention_int8.cuh"

cq_status cq_attention_int8_workspace(const cq_attention_params *p, const cq_attention_dims *n, size_t *bytes) {
  (void)p;
  *bytes = int8_layout_of(n).total;
  return CQ_OK;
}


/* ---------------------------------------------------------------- pre-pass */

/* Start of head bh = b * heads + h of a strided [B, S, H, D] tensor. */
template <typename T>
__device__ __forceinline__ const T *cq_head(const void *base, int64_t sb, int64_t sh, int heads, int64_t bh) {
  return static_cast<const T *>(base) + (bh / heads) * sb + (bh % heads) * sh;
}

/* 8 consecutive elements (one 16-byte load; rows are 16-byte aligned, head_dim % 8 == 0) as fp32. */
template <typename T> __device__ __forceinline__ void cq_ld8(const T *p, float (&x)[8]) {
  const uint4 u = *reinterpret_cast<const uint4 *>(p);
  const T *e = reinterpret_cast<const T *>(&u);
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = cq_to_float(e[i]);
}

/* Thread t reads 16-byte chunk t % C8 of rows t / C8, t / C8 + G, ... of its 64 keys. */
template <typename T>
__global__ void __launch_bounds__(PREP_THREADS) cq_attn8_stats_partial(const cq_attn_args a, int dp, float *psum,
                                                                      float *pamax) {
  __shared__ float s_sum[PREP_THREADS][8], s_max[PREP_THREADS][8];
  const int64_t bh = blockIdx.y;
  const int kb = blockIdx.x, nkb = gridDim.x, c8 = a.head_dim / 8, groups = PREP_THREADS / c8;
  const int c = threadIdx.x % c8, grp = threadIdx.x / c8;
  const T *kh = cq_head<T>(a.k, a.k_sb, a.k_sh, a.heads, bh), *vh = cq_head<T>(a.v, a.v_sb, a.v_sh, a.heads, bh);
  float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, amax[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (grp < groups) {
    const int j1 = min(a.seq_kv, (kb + 1) * KB);
    for (int j = kb * KB + grp; j < j1; j += groups) {
      float kx[8], vx[8];
      cq_ld8(kh + (int64_t)j * a.k_ss + c * 8, kx);
      cq_ld8(vh + (int64_t)j * a.v_ss + c * 8, vx);
#pragma unroll
      for (int i = 0; i < 8; ++i) sum[i] += kx[i], amax[i] = cq_amax_step(amax[i], vx[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) s_sum[threadIdx.x][i] = sum[i], s_max[threadIdx.x][i] = amax[i];
  __syncthreads();
  for (int d = threadIdx.x; d < dp; d += blockDim.x) {
    float su = 0.f, mx = 0.f;
    if (d < a.head_dim)
      for (int g2 = 0; g2 < groups; ++g2)
        su += s_sum[g2 * c8 + d / 8][d % 8], mx = cq_amax_step(mx, s_max[g2 * c8 + d / 8][d % 8]);
    psum[(bh * nkb + kb) * dp + d] = su;
    pamax[(bh * nkb + kb) * dp + d] = mx;
  }
}

/* Also zeroes the head's bound slots, before quant_q and quant_k raise them. */
__global__ void __launch_bounds__(PREP_THREADS) cq_attn8_stats_reduce(int seq_kv, int nkb, int dp, const float *psum,
                                                                     const float *pamax, float *kmean, float *vamax,
                                                                     uint32_t *bound) {
  const int64_t bh = blockIdx.x;
  if (threadIdx.x < CQ_ATTN8_BOUND_SLOTS) bound[bh * CQ_ATTN8_BOUND_SLOTS + threadIdx.x] = 0u;
  for (int d = threadIdx.x; d < dp; d += blockDim.x) {
    double su = 0.0;
    float mx = 0.f;
    for (int kb = 0; kb < nkb; ++kb) {
      su += psum[(bh * nkb + kb) * dp + d];
      mx = cq_amax_step(mx, pamax[(bh * nkb + kb) * dp + d]);
    }
    kmean[bh * dp + d] = (float)(su / (double)seq_kv);
    vamax[bh * dp + d] = mx;
  }
}

/* Warp-per-row passes over a group of rows, lane l holding elements 8l .. 8l+7: amax of the
 * transformed values (q * scale * log2e, or k - kmean), then their codes. The group's scale and
 * the largest scaled norm of its rows' codes raise the head's bound slots (Q: slots MAX_SQ and
 * MAX_QNORM, K: MAX_SK and MAX_KNORM) as the reference computes them (cq_attn8_row_norm); groups
 * of padding rows only do not count. */
template <typename T, bool IS_Q>
__global__ void __launch_bounds__(PREP_THREADS) cq_attn8_quant_qk(const cq_attn_args a, int dp, int rows_per_group,
                                                                 int seq, int64_t seq_pad, float qmul,
                                                                 const float *kmean, int8_t *codes, float *scales,
                                                                 float *qbias, uint32_t *bound) {
  __shared__ uint32_t red[32];
  const int64_t bh = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = PREP_THREADS / 32;
  const int r0 = blockIdx.x * rows_per_group, d0 = lane * 8;
  const bool has = d0 < a.head_dim;
  const T *head = IS_Q ? cq_head<T>(a.q, a.q_sb, a.q_sh, a.heads, bh) : cq_head<T>(a.k, a.k_sb, a.k_sh, a.heads, bh);
  const int64_t ss = IS_Q ? a.q_ss : a.k_ss;
  float km[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) km[i] = has ? kmean[bh * dp + d0 + i] : 0.f;
  const int rows = min(rows_per_group, (int)(seq_pad - r0)); /* includes padding rows */
  auto values = [&](int row, float (&x)[8]) {
    cq_ld8(head + (int64_t)row * ss + d0, x);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = IS_Q ? x[i] * qmul : x[i] - km[i];
  };
  uint32_t amax_bits = 0;
  if (has)
    for (int r = warp; r < rows && r0 + r < seq; r += nwarps) {
      float x[8];
      values(r0 + r, x);
#pragma unroll
      for (int i = 0; i < 8; ++i) amax_bits = max(amax_bits, cq_abs_bits(x[i]));
    }
  float scale, inv;
  cq_scale_from_amax(cq_amax_from_bits(cq_block_max_u32(amax_bits, red)), 127.0f, &scale, &inv);
  uint32_t norm_bits = 0; /* largest scaled code-row norm of this warp's rows (lane-uniform) */
  for (int r = warp; r < rows; r += nwarps) {
    const int row = r0 + r;
    float dot = 0.f;
    int sum_sq = 0;
    uint32_t lo = 0, hi = 0;
    if (has && row < seq) {
      float x[8];
      values(row, x);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int32_t c = cq_int8_encode(x[i] * inv);
        const uint32_t code = (uint32_t)(uint8_t)(int8_t)c;
        if (i < 4) lo |= code << (8 * i);
        else hi |= code << (8 * (i - 4));
        dot += x[i] * km[i];
        sum_sq += c * c;
      }
    }
    for (int o = 16; o > 0; o >>= 1) sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, o);
    if (row < seq) norm_bits = max(norm_bits, cq_abs_bits(cq_attn8_row_norm(scale, sum_sq)));
    if (d0 < dp) *reinterpret_cast<uint2 *>(codes + (bh * seq_pad + row) * dp + d0) = make_uint2(lo, hi);
    if (IS_Q) {
      for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      if (lane == 0) {
        scales[bh * seq_pad + row] = row < seq ? scale : 0.f;
        qbias[bh * seq_pad + row] = row < seq ? dot : 0.f;
      }
    }
  }
  if (!IS_Q && threadIdx.x == 0) scales[bh * gridDim.x + blockIdx.x] = scale;
  norm_bits = cq_block_max_u32(norm_bits, red);
  if (threadIdx.x == 0 && r0 < seq) {
    uint32_t *slots = bound + bh * CQ_ATTN8_BOUND_SLOTS;
    atomicMax(slots + (IS_Q ? CQ_ATTN8_MAX_SQ : CQ_ATTN8_MAX_SK), cq_abs_bits(scale));
    atomicMax(slots + (IS_Q ? CQ_ATTN8_MAX_QNORM : CQ_ATTN8_MAX_KNORM), norm_bits);
  }
}

/* Key of slot s (0..15) of a 16-key group in V^T: the order in which a thread's S accumulators
 * (keys 2t, 2t+1 of n-tiles 0 and 1) fill the 4 bytes of its fp8 A operand register. */
__device__ __forceinline__ int cq_attn8_slot_key(int s) { return 2 * (s / 4) + (s % 2) + 8 * ((s % 4) / 2); }

/* Also decides the head (its first block, after quant_q and quant_k have raised the bound slots):
 * full[bh] = 1 where E > CQ_ATTENTION_INT8_MAX_LOGIT_ERROR or E is NaN, as the reference does. */
template <typename T>
__global__ void __launch_bounds__(PREP_THREADS) cq_attn8_quant_v(const cq_attn_args a, int dp, int64_t skv_pad,
                                                                const float *vamax, uint8_t *vt, float *svd,
                                                                const uint32_t *bound, uint8_t *full) {
  __shared__ __align__(16) uint8_t tile[KB][256 + 16];
  __shared__ float s_inv[256];
  const int64_t bh = blockIdx.y;
  const int kb = blockIdx.x, c8 = dp / 8;
  if (kb == 0 && threadIdx.x == 0) {
    const uint32_t *slot = bound + bh * CQ_ATTN8_BOUND_SLOTS;
    const float e = cq_attn8_logit_error(__uint_as_float(slot[CQ_ATTN8_MAX_SQ]), __uint_as_float(slot[CQ_ATTN8_MAX_QNORM]),
                                         __uint_as_float(slot[CQ_ATTN8_MAX_SK]), __uint_as_float(slot[CQ_ATTN8_MAX_KNORM]),
                                         a.head_dim);
    full[bh] = !(e <= CQ_ATTENTION_INT8_MAX_LOGIT_ERROR);
  }
  const T *vh = cq_head<T>(a.v, a.v_sb, a.v_sh, a.heads, bh);
  for (int d = threadIdx.x; d < dp; d += blockDim.x) {
    float sv = 0.f, inv = 0.f;
    if (d < a.head_dim) cq_scale_from_amax(vamax[bh * dp + d], 448.0f, &sv, &inv);
    s_inv[d] = inv;
    if (kb == 0) svd[bh * dp + d] = sv / 448.0f;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < KB * c8; idx += blockDim.x) {
    const int j = idx / c8, c = idx % c8, key = kb * KB + j;
    uint32_t lo = 0, hi = 0;
    if (key < a.seq_kv && c * 8 < a.head_dim) {
      float x[8];
      cq_ld8(vh + (int64_t)key * a.v_ss + c * 8, x);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint32_t code = cq_float_encode(x[i] * s_inv[c * 8 + i], 4, 3, 7, 448.0f, 0x7eu);
        if (i < 4) lo |= code << (8 * i);
        else hi |= code << (8 * (i - 4));
      }
    }
    *reinterpret_cast<uint2 *>(&tile[j][c * 8]) = make_uint2(lo, hi);
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < dp * (KB / 16); idx += blockDim.x) {
    const int d = idx / (KB / 16), grp = idx % (KB / 16);
    uint32_t w[4];
#pragma unroll
    for (int q4 = 0; q4 < 4; ++q4) {
      uint32_t v = 0;
#pragma unroll
      for (int byte = 0; byte < 4; ++byte) v |= (uint32_t)tile[grp * 16 + cq_attn8_slot_key(q4 * 4 + byte)][d] << (8 * byte);
      w[q4] = v;
    }
    *reinterpret_cast<uint4 *>(vt + (bh * dp + d) * skv_pad + kb * KB + grp * 16) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

/* On by default (CQ_ATTN_SM90_AUTO): faster than the mma.sync 8-bit kernel on every H100 shape. */
static int cq_attn8_sm90_applies(int dp, int cc) { return cq_attn_sm90_mode(cc) != CQ_ATTN_SM90_OFF && dp <= 128; }

/* The heads the pre-pass flagged, in full precision (and their lse), with the kernel the full
 * mode would pick (attention_dispatch.cu). The CQUANT_ATTN_DISABLE switch of the mma.sync
 * kernel does not apply here: these heads have no other kernel that keeps the accuracy bound. */
static cq_status cq_attn8_fallback(const cq_attn_args &a8, int is_bf16, int cc, cudaStream_t stream) {
  if (cq_attention_sm90_applies(a8, cc)) return cq_attention_sm90_launch(a8, is_bf16, stream);
  return cq_attention_mma_launch(a8, is_bf16, stream);
}

template <typename T>
static cq_status cq_attn8_run(const cq_attn_args &a, const cq_attention_params *p, const int8_layout &L,
                              unsigned char *ws, int cc, cudaStream_t stream) {
  const int nkb = (int)(L.skv_pad / KB), qb = cq_attention_q_block(p);
  const unsigned bh = (unsigned)L.bh;
  float *psum = (float *)(ws + L.psum), *pamax = (float *)(ws + L.pamax);
  float *kmean = (float *)(ws + L.kmean), *vamax = (float *)(ws + L.vamax);
  uint32_t *bound = (uint32_t *)(ws + L.bound);
  uint8_t *full = ws + L.full;
  cq_attn8_stats_partial<T><<<dim3((unsigned)nkb, bh), PREP_THREADS, 0, stream>>>(a, L.dp, psum, pamax);
  CQ_LAUNCH_CHECK("cq_attn8_stats_partial");
  cq_attn8_stats_reduce<<<bh, PREP_THREADS, 0, stream>>>(a.seq_kv, nkb, L.dp, psum, pamax, kmean, vamax, bound);
  CQ_LAUNCH_CHECK("cq_attn8_stats_reduce");
  /* q_block groups cover [0, sq_pad): the padding rows get zero codes and scales */
  const unsigned nqg = (unsigned)((L.sq_pad + qb - 1) / qb);
  const float qscale = p->scale * CQ_LOG2E; /* the reference's q' = q * (scale * log2e), fp32 */
  cq_attn8_quant_qk<T, true><<<dim3(nqg, bh), PREP_THREADS, 0, stream>>>(
      a, L.dp, qb, a.seq_q, L.sq_pad, qscale, kmean, (int8_t *)(ws + L.qc), (float *)(ws + L.sq),
      (float *)(ws + L.qbias), bound);
  CQ_LAUNCH_CHECK("cq_attn8_quant_q");
  cq_attn8_quant_qk<T, false><<<dim3((unsigned)nkb, bh), PREP_THREADS, 0, stream>>>(
      a, L.dp, KB, a.seq_kv, L.skv_pad, 1.f, kmean, (int8_t *)(ws + L.kc), (float *)(ws + L.sk), NULL, bound);
  CQ_LAUNCH_CHECK("cq_attn8_quant_k");
  cq_attn8_quant_v<T><<<dim3((unsigned)nkb, bh), PREP_THREADS, 0, stream>>>(a, L.dp, L.skv_pad, vamax,
                                                                            ws + L.vt, (float *)(ws + L.svd), bound,
                                                                            full);
  CQ_LAUNCH_CHECK("cq_attn8_quant_v");
  /* both main kernels read the flags of this slice: head (b, h) at b * heads + h */
  cq_attn_args a8 = a;
  a8.full_heads = full, a8.full_heads_sb = a.heads;
  cq_attn8_ptrs w;
  w.qc = (const int8_t *)(ws + L.qc), w.kc = (const int8_t *)(ws + L.kc), w.vt = ws + L.vt;
  w.sq = (const float *)(ws + L.sq), w.sk = (const float *)(ws + L.sk), w.svd = (const float *)(ws + L.svd);
  w.qbias = (const float *)(ws + L.qbias);
  w.sq_pad = L.sq_pad, w.skv_pad = L.skv_pad;
  const int is_bf16 = std::is_same<T, __nv_bfloat16>::value;
  if (cq_attn8_sm90_applies(L.dp, cc)) CQ_TRY(cq_attn8_sm90_launch(is_bf16, L.dp, a8, w, stream));
  else CQ_TRY(cq_attn8_mma_launch(is_bf16, L.dp, a8, w, stream));
  return cq_attn8_fallback(a8, is_bf16, cc, stream);
}

cq_status cq_attention_int8_launch(const cq_attn_args &a, const cq_attention_params *p, void *workspace,
                                   size_t workspace_bytes, int cc, int dtype_is_bf16, cudaStream_t stream) {
  if (cq_attention_k_block(p) != KB)
    return cq_fail(CQ_ERR_UNSUPPORTED, "the CUDA 8-bit attention kernel takes k_block = %d; got %d", KB,
                   (int)cq_attention_k_block(p));
  if ((int64_t)a.batch * a.heads > 65535) /* attention_dispatch.cu slices larger calls */
    return cq_fail(CQ_ERR_INTERNAL, "8-bit attention: a slice of %lld (batch, head) pairs; at most 65535",
                   (long long)a.batch * a.heads);
  cq_attention_dims n = {a.batch, a.heads, a.seq_q, a.seq_kv, a.head_dim};
  const int8_layout L = int8_layout_of(&n);
  if (workspace_bytes < L.total || (uintptr_t)workspace % 256)
    return cq_fail(CQ_ERR_INVALID_ARG, "workspace must hold %zu bytes at a 256-byte aligned address; got %zu bytes "
                   "at %p", L.total, workspace_bytes, workspace);
  if (dtype_is_bf16) return cq_attn8_run<__nv_bfloat16>(a, p, L, (unsigned char *)workspace, cc, stream);
  return cq_attn8_run<__half>(a, p, L, (unsigned char *)workspace, cc, stream);
}

