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

/* Thread t reads 16-byte chunk t % C8 of rows t / C8, t / C8 + G, ... of its KB keys. */
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

/* The key blocks' partials of 32 columns (blockIdx.y) of a head: each of the 8 warps sums every
 * 8th block in double, then warp 0 adds the 8 sums in order (loads in flight on 8 warps, not one
 * chain of nkb). Also zeroes the head's bound slots, before quant_q and quant_k raise them, and the
 * main kernel's split counters. */
__global__ void __launch_bounds__(256) cq_attn8_stats_reduce(int seq_kv, int nkb, int dp, const float *psum,
                                                            const float *pamax, float *kmean, float *vamax,
                                                            uint32_t *bound, uint32_t *split_cnt, int split_max) {
  __shared__ double s_sum[8][32];
  __shared__ float s_max[8][32];
  const int64_t bh = blockIdx.x;
  const int lane = threadIdx.x % 32, slice = threadIdx.x / 32, d = blockIdx.y * 32 + lane;
  if (blockIdx.y == 0 && threadIdx.x < CQ_ATTN8_BOUND_SLOTS) bound[bh * CQ_ATTN8_BOUND_SLOTS + threadIdx.x] = 0u;
  if (bh == 0 && blockIdx.y == 0) /* the main kernel's split counters start at 0 (workspace is not zeroed) */
    for (int i = threadIdx.x; i < split_max; i += blockDim.x) split_cnt[i] = 0u;
  double su = 0.0;
  float mx = 0.f;
  if (d < dp)
    for (int kb = slice; kb < nkb; kb += 8) {
      su += psum[(bh * nkb + kb) * dp + d];
      mx = cq_amax_step(mx, pamax[(bh * nkb + kb) * dp + d]);
    }
  s_sum[slice][lane] = su, s_max[slice][lane] = mx;
  __syncthreads();
  if (slice != 0 || d >= dp) return;
  su = 0.0, mx = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) su += s_sum[i][lane], mx = cq_amax_step(mx, s_max[i][lane]);
  kmean[bh * dp + d] = (float)(su / (double)seq_kv);
  vamax[bh * dp + d] = mx;
}

/* One warp a group of rows (a CTA of kQkWarps warps from 128 rows on), L lanes a row (L = dp / 8 rounded up to a power of two, so the warp
 * takes 32 / L rows at once), lane l of a row holding elements 8l .. 8l+7: amax of the transformed
 * values (q * scale * log2e, or k - kmean), then their codes (a second read, from L1 or L2). The
 * group's scale and the largest scaled norm of its rows' codes raise the head's bound slots
 * (Q: slots MAX_SQ and MAX_QNORM, K: MAX_SK and MAX_KNORM) as the reference computes them
 * (cq_attn8_row_norm); groups of padding rows only do not count. Reductions over a row's lanes
 * run in a fixed order: each lane's elements in turn, then a butterfly over the lanes (lanes past
 * the head dim add zeros). */
constexpr int kQkWarps = 4; /* warps a CTA */

/* int8 code of v (|v| <= 127 after rounding, NaN excluded by the caller) as 2^23 * 1.5 + code:
 * the fp32 add rounds to nearest even, as cq_int8_encode does; the low byte is the code's. */
__device__ __forceinline__ float cq_attn8_code_f(float v) { return __fadd_rn(v, 12582912.0f); }

template <typename T, bool IS_Q, int L>
__global__ void __launch_bounds__(32 * kQkWarps) cq_attn8_quant_qk(const cq_attn_args a, int dp, int rows_per_group,
                                                                   int groups, int wpg, int seq, int64_t seq_pad,
                                                                   float qmul, const float *kmean, int8_t *codes,
                                                                   float *scales, float *qbias, uint32_t *bound) {
  constexpr int R = 32 / L; /* rows a warp takes at once */
  __shared__ uint32_t s_amax[kQkWarps];
  const int64_t bh = blockIdx.y;
  /* wpg warps a group (1, or kQkWarps: then the CTA is the group): warp wi of the group takes row
   * slots wi, wi + wpg, ... */
  const int lane = threadIdx.x % 32, group = blockIdx.x * (kQkWarps / wpg) + threadIdx.x / 32 / wpg;
  const int wi = threadIdx.x / 32 % wpg;
  if (group >= groups) return; /* uniform over the group's warps */
  const int sub = lane / L, d0 = (lane % L) * 8;
  const int r0 = group * rows_per_group;
  const bool has = d0 < a.head_dim;
  const T *head = IS_Q ? cq_head<T>(a.q, a.q_sb, a.q_sh, a.heads, bh) : cq_head<T>(a.k, a.k_sb, a.k_sh, a.heads, bh);
  const int64_t ss = IS_Q ? a.q_ss : a.k_ss;
  float km[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) km[i] = has ? kmean[bh * dp + d0 + i] : 0.f;
  const int rows = min(rows_per_group, (int)(seq_pad - r0)); /* includes padding rows */
  const int data_rows = min(rows, seq - r0);                  /* rows with values */
  auto load = [&](int r) { return *reinterpret_cast<const uint4 *>(head + (int64_t)(r0 + r) * ss + d0); };
  auto values = [&](uint4 u, float (&x)[8]) {
    const T *e = reinterpret_cast<const T *>(&u);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float v = cq_to_float(e[i]);
      x[i] = IS_Q ? v * qmul : v - km[i];
    }
  };

  uint32_t amax_bits = 0;
  if (has)
#pragma unroll 4
    for (int r = wi * R + sub; r < data_rows; r += R * wpg) {
      float x[8];
      values(load(r), x);
#pragma unroll
      for (int i = 0; i < 8; ++i) amax_bits = max(amax_bits, cq_abs_bits(x[i]));
    }
  amax_bits = cq_warp_max_u32(amax_bits);
  if (wpg > 1) { /* kernel-uniform: the CTA is one group */
    if (lane == 0) s_amax[wi] = amax_bits;
    __syncthreads();
    for (int i = 0; i < wpg; ++i) amax_bits = max(amax_bits, s_amax[i]);
  }
  float scale, inv;
  cq_scale_from_amax(cq_amax_from_bits(amax_bits), 127.0f, &scale, &inv);

  uint32_t norm_bits = 0; /* largest scaled code-row norm of this lane's rows */
  /* row r of the group from its 16 bytes u; every lane of the warp runs every row slot (the
   * butterflies), slots past the group store nothing */
  auto encode_row = [&](int r, uint4 u) {
    const int row = r0 + r;
    float dot = 0.f, sum_sq = 0.f; /* sum_sq: integers below 2^24, exact */
    uint32_t lo = 0, hi = 0;
    if (has && r < data_rows) {
      float x[8];
      values(u, x);
#pragma unroll
      for (int i = 0; i < 8; ++i) dot += x[i] * km[i];
      if (inv != 0.f) { /* inv = 0: a non-finite amax, whose codes are all 0 */
        float t[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          t[i] = cq_attn8_code_f(x[i] * inv);
          const float c = __fsub_rn(t[i], 12582912.0f);
          sum_sq = __fmaf_rn(c, c, sum_sq);
        }
        lo = cq_low_bytes4(t[0], t[1], t[2], t[3]), hi = cq_low_bytes4(t[4], t[5], t[6], t[7]);
      }
    }
#pragma unroll
    for (int o = L / 2; o > 0; o >>= 1) sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, o);
    if (IS_Q)
#pragma unroll
      for (int o = L / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (r >= rows) return;
    if (row < seq) norm_bits = max(norm_bits, cq_abs_bits(cq_attn8_row_norm(scale, (int64_t)sum_sq)));
    if (d0 < dp) *reinterpret_cast<uint2 *>(codes + (bh * seq_pad + row) * dp + d0) = make_uint2(lo, hi);
    if (IS_Q && d0 == 0) {
      scales[bh * seq_pad + row] = row < seq ? scale : 0.f;
      qbias[bh * seq_pad + row] = row < seq ? dot : 0.f;
    }
  };
  /* kBatch rows a lane at a time: their loads in flight together */
  constexpr int kBatch = 4;
  for (int base = wi * kBatch * R; base < rows; base += wpg * kBatch * R) {
    uint4 u[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int r = base + j * R + sub;
      u[j] = has && r < data_rows ? load(r) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j)
      if (base + j * R < rows) encode_row(base + j * R + sub, u[j]); /* warp-uniform */
  }
  if (!IS_Q && wi == 0 && lane == 0) scales[bh * groups + group] = scale;
  norm_bits = cq_warp_max_u32(norm_bits);
  if (lane == 0 && r0 < seq) {
    uint32_t *slots = bound + bh * CQ_ATTN8_BOUND_SLOTS;
    atomicMax(slots + (IS_Q ? CQ_ATTN8_MAX_SQ : CQ_ATTN8_MAX_SK), cq_abs_bits(scale));
    atomicMax(slots + (IS_Q ? CQ_ATTN8_MAX_QNORM : CQ_ATTN8_MAX_KNORM), norm_bits);
  }
}

/* Key of slot s (0..15) of a 16-key group in V^T: the order in which a thread's S accumulators
 * (keys 2t, 2t+1 of n-tiles 0 and 1) fill the 4 bytes of its 8-bit A operand register. */
__device__ __forceinline__ int cq_attn8_slot_key(int s) { return 2 * (s / 4) + (s % 2) + 8 * ((s % 4) / 2); }

/* Also decides the head (its first block, after quant_q and quant_k have raised the bound slots):
 * full[bh] = 1 where E > CQ_ATTENTION_INT8_MAX_LOGIT_ERROR or E is NaN, as the reference does. */
constexpr int kVKeys = 64; /* keys a CTA of quant_v (a divisor of KB): twice the CTAs of KB */

template <typename T>
__global__ void __launch_bounds__(PREP_THREADS) cq_attn8_quant_v(const cq_attn_args a, int dp, int64_t skv_pad,
                                                                const float *vamax, uint8_t *vt, float *sv,
                                                                const uint32_t *bound, uint8_t *full) {
  __shared__ __align__(16) uint8_t tile[kVKeys][256 + 16];
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
    float scale = 0.f, inv = 0.f;
    if (d < a.head_dim) cq_scale_from_amax(vamax[bh * dp + d], 127.0f, &scale, &inv);
    s_inv[d] = inv;
    if (kb == 0) sv[bh * dp + d] = scale;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kVKeys * c8; idx += blockDim.x) {
    const int j = idx / c8, c = idx % c8, key = kb * kVKeys + j;
    uint32_t lo = 0, hi = 0;
    if (key < a.seq_kv && c * 8 < a.head_dim) {
      float x[8];
      cq_ld8(vh + (int64_t)key * a.v_ss + c * 8, x);
      /* int8 codes as quant_qk's: RNE of x * inv by the fp32 add (|x * inv| <= 127 up to rounding,
       * clamped as cq_quantize does); a column of non-finite amax has inv = 0 and all-zero codes */
      float t[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float inv = s_inv[c * 8 + i];
        t[i] = cq_attn8_code_f(inv != 0.f ? fminf(fmaxf(x[i] * inv, -127.f), 127.f) : 0.f);
      }
      lo = cq_low_bytes4(t[0], t[1], t[2], t[3]), hi = cq_low_bytes4(t[4], t[5], t[6], t[7]);
    }
    *reinterpret_cast<uint2 *>(&tile[j][c * 8]) = make_uint2(lo, hi);
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < dp * (kVKeys / 16); idx += blockDim.x) {
    const int d = idx / (kVKeys / 16), grp = idx % (kVKeys / 16);
    uint32_t w[4];
#pragma unroll
    for (int q4 = 0; q4 < 4; ++q4) {
      uint32_t v = 0;
#pragma unroll
      for (int byte = 0; byte < 4; ++byte) v |= (uint32_t)tile[grp * 16 + cq_attn8_slot_key(q4 * 4 + byte)][d] << (8 * byte);
      w[q4] = v;
    }
    *reinterpret_cast<uint4 *>(vt + (bh * dp + d) * skv_pad + kb * kVKeys + grp * 16) = make_uint4(w[0], w[1], w[2], w[3]);
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

/* The Q or K code pass over `groups` groups of `rows` rows of each of bh heads, with as many lanes
 * a row as the padded head dim needs, and a CTA a group from 128 rows on (one warp a group left
 * 7 warps an SM on K at Flux sizes, latency-bound). */
template <typename T, bool IS_Q, typename... Args>
static void cq_attn8_quant(int dp, int groups, int rows, unsigned bh, cudaStream_t stream, const cq_attn_args &a,
                           Args... args) {
  const int wpg = rows >= 128 ? kQkWarps : 1;
  const dim3 grid((unsigned)((groups + kQkWarps / wpg - 1) / (kQkWarps / wpg)), bh);
  if (dp <= 64) cq_attn8_quant_qk<T, IS_Q, 8><<<grid, 32 * kQkWarps, 0, stream>>>(a, dp, rows, groups, wpg, args...);
  else if (dp <= 128) cq_attn8_quant_qk<T, IS_Q, 16><<<grid, 32 * kQkWarps, 0, stream>>>(a, dp, rows, groups, wpg, args...);
  else cq_attn8_quant_qk<T, IS_Q, 32><<<grid, 32 * kQkWarps, 0, stream>>>(a, dp, rows, groups, wpg, args...);
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
  uint32_t *split_cnt = (uint32_t *)(ws + L.split_cnt);
  cq_attn8_stats_reduce<<<dim3(bh, (unsigned)(L.dp / 32)), 256, 0, stream>>>(a.seq_kv, nkb, L.dp, psum, pamax, kmean,
                                                                           vamax, bound, split_cnt, (int)L.split_max);
  CQ_LAUNCH_CHECK("cq_attn8_stats_reduce");
  /* q_block groups cover [0, sq_pad): the padding rows get zero codes and scales */
  const unsigned nqg = (unsigned)((L.sq_pad + qb - 1) / qb);
  const float qscale = p->scale * CQ_LOG2E; /* the reference's q' = q * (scale * log2e), fp32 */
  cq_attn8_quant<T, true>(L.dp, (int)nqg, qb, bh, stream, a, a.seq_q, L.sq_pad, qscale, kmean,
                          (int8_t *)(ws + L.qc), (float *)(ws + L.sq), (float *)(ws + L.qbias), bound);
  CQ_LAUNCH_CHECK("cq_attn8_quant_q");
  cq_attn8_quant<T, false>(L.dp, nkb, KB, bh, stream, a, a.seq_kv, L.skv_pad, 1.f, kmean,
                           (int8_t *)(ws + L.kc), (float *)(ws + L.sk), (float *)NULL, bound);
  CQ_LAUNCH_CHECK("cq_attn8_quant_k");
  cq_attn8_quant_v<T><<<dim3((unsigned)(L.skv_pad / kVKeys), bh), PREP_THREADS, 0, stream>>>(a, L.dp, L.skv_pad, vamax,
                                                                            ws + L.vt, (float *)(ws + L.sv), bound,
                                                                            full);
  CQ_LAUNCH_CHECK("cq_attn8_quant_v");
  /* both main kernels read the flags of this slice: head (b, h) at b * heads + h */
  cq_attn_args a8 = a;
  a8.full_heads = full, a8.full_heads_sb = a.heads;
  cq_attn8_ptrs w;
  w.qc = (const int8_t *)(ws + L.qc), w.kc = (const int8_t *)(ws + L.kc), w.vt = ws + L.vt;
  w.sq = (const float *)(ws + L.sq), w.sk = (const float *)(ws + L.sk), w.sv = (const float *)(ws + L.sv);
  w.qbias = (const float *)(ws + L.qbias);
  w.sq_pad = L.sq_pad, w.skv_pad = L.skv_pad;
  w.split_max = L.split_max, w.split_cnt = split_cnt, w.split_part = (float *)(ws + L.split_part);
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

