/* 8-bit attention (see cquant.h for the math): a pre-pass quantizes Q, K (smoothed) and V into
 * the caller's workspace, then a flash-attention kernel runs Q K^T with int8 mma (m16n8k32,
 * exact int32 sums) and P V with fp8 e4m3 mma (sm_89+), fp32 online softmax in registers.
 *
 * Pre-pass (all reads of q, k, v are strided [B, S, H, D]; outputs dense, zero-padded):
 * (16-byte loads: rows are 16-byte aligned and head_dim is a multiple of 8)
 *   stats_partial  per (head, 64 keys): fp32 column sums of K and column amax of V
 *   stats_reduce   per head: kmean (fp64 sum of the partials / Skv), V amax
 *   quant_q        per (head, q_block rows): int8 codes of q * scale * log2(e), per-row scale
 *                  and q' . kmean (for the log-sum-exp)
 *   quant_k        per (head, 64 keys): int8 codes of k - kmean, one scale
 *   quant_v        per (head, 64 keys): fp8 codes of v / sv, written transposed (V^T rows
 *                  are head dims) with the keys of every 16 permuted so that the fp8 A
 *                  operand can be built from the S accumulators without shuffles. */
#include <cuda_fp8.h>
#include <limits.h>

#include "attention_common.cuh"
#include "attention_wgmma.cuh"

#define KB 64          /* keys per tile = per K scale (k_block) */
#define PREP_THREADS 256

/* Workspace layout of one call (byte offsets, each region 256-byte aligned). */
struct int8_layout {
  int dp;        /* padded head dim of the specialisation */
  int bm;        /* query rows per CTA */
  int64_t sq_pad, skv_pad, bh;
  size_t qc, kc, vt, sq, sk, svd, kmean, vamax, qbias, psum, pamax, total;
};

static int int8_dp(int d) { return d <= 64 ? 64 : d <= 96 ? 96 : d <= 128 ? 128 : 256; }
static int int8_mt(int dp) { return dp <= 128 ? 2 : 1; }

static int8_layout int8_layout_of(const cq_attention_dims *n) {
  int8_layout L;
  L.dp = int8_dp((int)n->head_dim);
  L.bm = 16 * int8_mt(L.dp) * 4;
  L.bh = n->batch * n->heads;
  L.sq_pad = (n->seq_q + L.bm - 1) / L.bm * L.bm;
  L.skv_pad = (n->seq_kv + KB - 1) / KB * KB;
  size_t off = 0;
  auto take = [&off](size_t bytes) {
    size_t at = off;
    off += (bytes + 255) / 256 * 256;
    return at;
  };
  const size_t bh = (size_t)L.bh, nkb = (size_t)(L.skv_pad / KB);
  L.qc = take(bh * (size_t)L.sq_pad * L.dp);
  L.kc = take(bh * (size_t)L.skv_pad * L.dp);
  L.vt = take(bh * (size_t)L.dp * (size_t)L.skv_pad);
  L.sq = take(bh * (size_t)L.sq_pad * 4);
  L.sk = take(bh * nkb * 4);
  L.svd = take(bh * (size_t)L.dp * 4);
  L.kmean = take(bh * (size_t)L.dp * 4);
  L.vamax = take(bh * (size_t)L.dp * 4);
  L.qbias = take(bh * (size_t)L.sq_pad * 4);
  L.psum = take(bh * nkb * (size_t)L.dp * 4);
  L.pamax = take(bh * nkb * (size_t)L.dp * 4);
  L.total = off;
  return L;
}

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

__global__ void __launch_bounds__(PREP_THREADS) cq_attn8_stats_reduce(int seq_kv, int nkb, int dp, const float *psum,
                                                                     const float *pamax, float *kmean, float *vamax) {
  const int64_t bh = blockIdx.x;
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
 * transformed values (q * scale * log2e, or k - kmean), then their codes. */
template <typename T, bool IS_Q>
__global__ void __launch_bounds__(PREP_THREADS) cq_attn8_quant_qk(const cq_attn_args a, int dp, int rows_per_group,
                                                                 int seq, int64_t seq_pad, float qmul,
                                                                 const float *kmean, int8_t *codes, float *scales,
                                                                 float *qbias) {
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
  for (int r = warp; r < rows; r += nwarps) {
    const int row = r0 + r;
    float dot = 0.f;
    uint32_t lo = 0, hi = 0;
    if (has && row < seq) {
      float x[8];
      values(row, x);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint32_t code = (uint32_t)(uint8_t)(int8_t)cq_int8_encode(x[i] * inv);
        if (i < 4) lo |= code << (8 * i);
        else hi |= code << (8 * (i - 4));
        dot += x[i] * km[i];
      }
    }
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
}

/* Key of slot s (0..15) of a 16-key group in V^T: the order in which a thread's S accumulators
 * (keys 2t, 2t+1 of n-tiles 0 and 1) fill the 4 bytes of its fp8 A operand register. */
__device__ __forceinline__ int cq_attn8_slot_key(int s) { return 2 * (s / 4) + (s % 2) + 8 * ((s % 4) / 2); }

template <typename T>
__global__ void __launch_bounds__(PREP_THREADS) cq_attn8_quant_v(const cq_attn_args a, int dp, int64_t skv_pad,
                                                                const float *vamax, uint8_t *vt, float *svd) {
  __shared__ __align__(16) uint8_t tile[KB][256 + 16];
  __shared__ float s_inv[256];
  const int64_t bh = blockIdx.y;
  const int kb = blockIdx.x, c8 = dp / 8;
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

/* ---------------------------------------------------------------- main kernel */

__device__ __forceinline__ void cq_mma_i8(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void cq_mma_fp8(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  (void)d, (void)a, (void)b0, (void)b1;
  __trap(); /* the launcher never runs this kernel below sm_89 */
#endif
}

/* fp8 e4m3 codes of 4 probabilities times 448 (RNE, saturating), slot order x0..x3. */
__device__ __forceinline__ uint32_t cq_p_fp8x4(float x0, float x1, float x2, float x3) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(x0 * 448.f, x1 * 448.f), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(x2 * 448.f, x3 * 448.f), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

/* x as fp32, exact for |x| < 2^22 (a score of int8 codes over up to 256 dims is below 127^2 * 256),
 * with integer and fp32 adds: I2F would share the 16-per-clock pipe with the EX2 of each score. */
__device__ __forceinline__ float cq_i2f22(int x) { return __int_as_float(x + 0x4B400000) - 12582912.0f; }

/* The reference's online softmax step for the two rows (g, g + 8) a thread holds of one tile of
 * int8 scores si (mma fragment order: element e of n-tile n of row half hh at 4 n + 2 hh + e):
 * s = dot * (sq * sk), m' = max(m, max s), alpha = 2^(m - m'), p = 2^(s - m'), l = l alpha + sum p.
 * The max is taken on the integer dots (sq * sk >= 0, and rounding is monotonic); with TAIL,
 * keys at or past kv_left (relative to 2 t) are left out and get p = 0. */
template <bool TAIL, int NS>
__device__ __forceinline__ void cq_attn8_softmax(const int (&si)[4 * NS], float (&p)[4 * NS], const float (&qs)[2],
                                                 float skj, int kv_left, float (&m)[2], float (&l)[2],
                                                 float (&alpha)[2]) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const float sqk = qs[hh] * skj;
    int mi = INT_MIN;
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (!TAIL || n * 8 + e < kv_left) mi = max(mi, si[4 * n + 2 * hh + e]);
    mi = max(mi, __shfl_xor_sync(0xffffffffu, mi, 1));
    mi = max(mi, __shfl_xor_sync(0xffffffffu, mi, 2));
    const float m_new = fmaxf(m[hh], (float)mi * sqk);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    alpha[hh] = cq_exp2(m[hh] - m_use);
    m[hh] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float pe = cq_exp2(fmaf(cq_i2f22(si[4 * n + 2 * hh + e]), sqk, -m_use));
        if (TAIL && n * 8 + e >= kv_left) pe = 0.f;
        p[4 * n + 2 * hh + e] = pe;
        sum += pe;
      }
    l[hh] = l[hh] * alpha[hh] + sum;
  }
}

struct cq_attn8_ptrs {
  const int8_t *qc, *kc;
  const uint8_t *vt;
  const float *sq, *sk, *svd, *qbias;
  int64_t sq_pad, skv_pad;
};

template <typename T, int DP, int MT>
__global__ void __launch_bounds__(128, 2) cq_attn8_fwd(const cq_attn_args a, const cq_attn8_ptrs w) {
  constexpr int NWARPS = 4, BM = 16 * MT * NWARPS, LDQ = DP + 16, LDV = KB + 16, NS = KB / 8, NO = DP / 8;
  extern __shared__ __align__(16) unsigned char cq_attn8_smem[];
  uint8_t *sQ = cq_attn8_smem, *sK = sQ + BM * LDQ, *sV = sK + KB * LDQ;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int q0 = blockIdx.x * BM, h = blockIdx.y, b = blockIdx.z;
  const int64_t bh = (int64_t)b * a.heads + h;
  const uint8_t *qg = (const uint8_t *)w.qc + (bh * w.sq_pad + q0) * DP;
  const uint8_t *kg = (const uint8_t *)w.kc + bh * w.skv_pad * DP;
  const uint8_t *vg = w.vt + bh * DP * w.skv_pad;
  const int n_tiles = (a.seq_kv + KB - 1) / KB;

  auto load_rows = [&](uint8_t *dst, const uint8_t *src, int rows, int ld_dst, int row_bytes, int64_t src_stride) {
    const int chunks = row_bytes / 16;
    for (int idx = threadIdx.x; idx < rows * chunks; idx += 128) {
      const int r = idx / chunks, c = idx % chunks;
      cq_cp_async16(dst + r * ld_dst + c * 16, src + r * src_stride + c * 16, true);
    }
  };
  load_rows(sQ, qg, BM, LDQ, DP, DP);
  load_rows(sK, kg, KB, LDQ, DP, DP);
  cq_cp_async_commit();

  float o[MT][NO][4], m[MT][2], l[MT][2], qs[MT][2];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int n = 0; n < NO; ++n) o[i][n][0] = o[i][n][1] = o[i][n][2] = o[i][n][3] = 0.f;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      m[i][hh] = -INFINITY, l[i][hh] = 0.f;
      qs[i][hh] = w.sq[bh * w.sq_pad + q0 + warp * 16 * MT + i * 16 + hh * 8 + g];
    }
  }
  const uint8_t *sQw = sQ + warp * 16 * MT * LDQ;
  const int mi = lane / 8;

  for (int j = 0; j < n_tiles; ++j) {
    const int k0 = j * KB;
    cq_cp_async_wait<0>();
    __syncthreads();
    load_rows(sV, vg + k0, DP, LDV, KB, w.skv_pad);
    cq_cp_async_commit();

    int si[MT][NS][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int n = 0; n < NS; ++n) si[i][n][0] = si[i][n][1] = si[i][n][2] = si[i][n][3] = 0;
#pragma unroll
    for (int kk = 0; kk < DP / 32; ++kk) {
      uint32_t qa[MT][4];
#pragma unroll
      for (int i = 0; i < MT; ++i)
        cq_ldsm_x4(qa[i][0], qa[i][1], qa[i][2], qa[i][3], sQw + (i * 16 + lane % 16) * LDQ + kk * 32 + (lane / 16) * 16);
#pragma unroll
      for (int n = 0; n < NS; n += 2) {
        uint32_t b0, b1, b2, b3;
        cq_ldsm_x4(b0, b1, b2, b3, sK + (n * 8 + (mi / 2) * 8 + lane % 8) * LDQ + kk * 32 + (mi % 2) * 16);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          cq_mma_i8(si[i][n], qa[i], b0, b1);
          cq_mma_i8(si[i][n + 1], qa[i], b2, b3);
        }
      }
    }
    __syncthreads();
    if (j + 1 < n_tiles) {
      load_rows(sK, kg + (int64_t)(k0 + KB) * DP, KB, LDQ, DP, DP);
      cq_cp_async_commit();
    }

    const float skj = w.sk[bh * (w.skv_pad / KB) + j];
    const bool tail = k0 + KB > a.seq_kv;
    uint32_t pa[MT][KB / 32][4];
    const int kv_left = a.seq_kv - k0 - 2 * t;
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      float p[NS][4], alpha[2];
      auto &sif = reinterpret_cast<const int(&)[4 * NS]>(si[i]);
      auto &pf = reinterpret_cast<float(&)[4 * NS]>(p);
      if (tail) cq_attn8_softmax<true, NS>(sif, pf, qs[i], skj, kv_left, m[i], l[i], alpha);
      else cq_attn8_softmax<false, NS>(sif, pf, qs[i], skj, kv_left, m[i], l[i], alpha);
#pragma unroll
      for (int n = 0; n < NO; ++n)
        o[i][n][0] *= alpha[0], o[i][n][1] *= alpha[0], o[i][n][2] *= alpha[1], o[i][n][3] *= alpha[1];
#pragma unroll
      for (int ks = 0; ks < KB / 32; ++ks) {
        const int n0 = ks * 4;
        pa[i][ks][0] = cq_p_fp8x4(p[n0][0], p[n0][1], p[n0 + 1][0], p[n0 + 1][1]);
        pa[i][ks][1] = cq_p_fp8x4(p[n0][2], p[n0][3], p[n0 + 1][2], p[n0 + 1][3]);
        pa[i][ks][2] = cq_p_fp8x4(p[n0 + 2][0], p[n0 + 2][1], p[n0 + 3][0], p[n0 + 3][1]);
        pa[i][ks][3] = cq_p_fp8x4(p[n0 + 2][2], p[n0 + 2][3], p[n0 + 3][2], p[n0 + 3][3]);
      }
    }

    if (j + 1 < n_tiles) cq_cp_async_wait<1>();
    else cq_cp_async_wait<0>();
    __syncthreads();

    /* P V per pair of dim n-tiles: fresh fp32 partials per tile, added to O in fp32, so
     * the fp8 mma accumulates only KB products at a time */
#pragma unroll
    for (int n = 0; n < NO; n += 2) {
      float acc[MT][2][4];
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int x = 0; x < 2; ++x) acc[i][x][0] = acc[i][x][1] = acc[i][x][2] = acc[i][x][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KB / 32; ++ks) {
        uint32_t b0, b1, b2, b3;
        cq_ldsm_x4(b0, b1, b2, b3, sV + (n * 8 + (mi / 2) * 8 + lane % 8) * LDV + ks * 32 + (mi % 2) * 16);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          cq_mma_fp8(acc[i][0], pa[i][ks], b0, b1);
          cq_mma_fp8(acc[i][1], pa[i][ks], b2, b3);
        }
      }
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int x = 0; x < 2; ++x)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[i][n + x][e] += acc[i][x][e];
    }
  }

  /* out = o / l * sv / 448; lse = (m + log2 l + q'.kmean) / log2(e) */
  T *og = static_cast<T *>(a.out) + b * a.o_sb + h * a.o_sh;
  const float *svd = w.svd + bh * DP;
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float lsum = cq_quad_sum(l[i][hh]);
      const float inv = 1.f / lsum;
      const int row = q0 + warp * 16 * MT + i * 16 + hh * 8 + g;
      if (row >= a.seq_q) continue;
#pragma unroll
      for (int n = 0; n < NO; ++n) {
        const int col = n * 8 + 2 * t;
        if (col < a.head_dim)
          *reinterpret_cast<uint32_t *>(og + (int64_t)row * a.o_ss + col) =
              cq_pack2<T>(o[i][n][2 * hh] * inv * svd[col], o[i][n][2 * hh + 1] * inv * svd[col + 1]);
      }
      if (a.lse && t == 0)
        a.lse[bh * a.seq_q + row] = (m[i][hh] + __log2f(lsum) + w.qbias[bh * w.sq_pad + row]) / CQ_LOG2E;
    }
  }
}

template <typename T, int DP, int MT>
static cq_status cq_attn8_launch(const cq_attn_args &a, const cq_attn8_ptrs &w, cudaStream_t stream) {
  constexpr int BM = 16 * MT * 4;
  const size_t smem = (size_t)(BM + KB) * (DP + 16) + (size_t)DP * (KB + 16);
  auto kernel = cq_attn8_fwd<T, DP, MT>;
  CQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  dim3 grid((unsigned)((a.seq_q + BM - 1) / BM), (unsigned)a.heads, (unsigned)a.batch);
  kernel<<<grid, 128, smem, stream>>>(a, w);
  CQ_LAUNCH_CHECK("cq_attn8_fwd");
  return CQ_OK;
}

/* ---------------------------------------------------------------- sm_90a variant
 * The same math with wgmma, warp-specialized like the bf16 kernel (attention_sm90.cu): one
 * producer warpgroup copies the Q codes once and the K code tiles and V^T code tiles of KB = 64
 * keys (so P is quantized at the same running maxima as the reference) into rings of A8_STAGES
 * stages, five tiles in flight; two consumer warpgroups of 64 query rows (BM = 128, as the
 * workspace's padding). Tiles in wgmma's no-swizzle canonical layout (8 rows x 16 bytes per
 * core matrix); int8 S = Q K^T from shared memory, fp8 P V with P in registers and V^T K-major
 * (8-bit wgmma takes K-major operands only, which V^T is). At tile j a consumer warpgroup issues
 * S_j and P_{j-1} V_{j-1} (into fresh fp32 accumulators, so the fp8 tensor-core sums cover 64
 * products) together, runs the softmax of tile j under the second, then folds it into O:
 * O = O * alpha_{j-1} + P_{j-1} V_{j-1}. Switched like the bf16 kernel (cq_attn_sm90_mode). */

#define A8_STAGES 6    /* K and V^T tiles of 64 keys in the rings */
#define A8_AHEAD 4     /* tiles a producer thread keeps in flight beyond the one it publishes (< A8_STAGES;
                          one less than that leaves a released slot's consumer a step of slack) */

template <int DP> struct cq_attn8_pv_sm90;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <> struct cq_attn8_pv_sm90<64> {
  static __device__ __forceinline__ void run(float (&d)[32], const uint32_t (&a)[4], uint64_t b, int acc) {
    cq_wgmma_m64n64k32_e4m3_rs(d, a, b, acc);
  }
};
template <> struct cq_attn8_pv_sm90<96> {
  static __device__ __forceinline__ void run(float (&d)[48], const uint32_t (&a)[4], uint64_t b, int acc) {
    cq_wgmma_m64n96k32_e4m3_rs(d, a, b, acc);
  }
};
template <> struct cq_attn8_pv_sm90<128> {
  static __device__ __forceinline__ void run(float (&d)[64], const uint32_t (&a)[4], uint64_t b, int acc) {
    cq_wgmma_m64n128k32_e4m3_rs(d, a, b, acc);
  }
};

/* ROWS rows of ROW_BYTES from a dense source (row stride ld bytes) into the canonical layout
 * (chunk idx = ((r / 8) * CHUNKS + c) * 8 + r % 8 at byte idx * 16), with NT threads; ct is
 * this thread's index among them. Thread ct owns row r % 8 = ct % 8 and the (row group, chunk)
 * pairs rg * CHUNKS + c = ct / 8 + (NT / 8) * i. */
template <int ROWS, int ROW_BYTES, int NT>
__device__ __forceinline__ void cq_attn8_copy(uint32_t dst, const uint8_t *src, int64_t ld, int ct) {
  constexpr int CHUNKS = ROW_BYTES / 16, U = NT / 8, PAIRS = ROWS / 8 * CHUNKS;
  static_assert(NT % 8 == 0 && PAIRS % U == 0, "copy split");
  const int r8 = ct % 8, u = ct / 8;
  if constexpr (U % CHUNKS != 0 && CHUNKS % U != 0) { /* 96-byte rows: row group and chunk per pair */
    const uint32_t d0 = dst + (uint32_t)u * 128u + (uint32_t)r8 * 16u;
#pragma unroll 2
    for (int i = 0; i < PAIRS / U; ++i) {
      const int q = u + U * i;
      cq_cp_async16_n(d0 + (uint32_t)(U * i) * 128u, src + (int64_t)((q / CHUNKS) * 8 + r8) * ld + (q % CHUNKS) * 16, 16);
    }
    return;
  }
  constexpr bool WIDE = U >= CHUNKS;
  const int c0 = WIDE ? u % CHUNKS : u, rg0 = WIDE ? u / CHUNKS : 0;
  const uint8_t *p0 = src + (int64_t)(rg0 * 8 + r8) * ld + c0 * 16;
  const uint32_t d0 = dst + (uint32_t)u * 128u + (uint32_t)r8 * 16u;
#pragma unroll
  for (int i = 0; i < PAIRS / U; ++i) {
    const int drg = WIDE ? (U / CHUNKS) * i : i / (CHUNKS / U);
    const int dc = WIDE ? 0 : U * (i % (CHUNKS / U));
    cq_cp_async16_n(d0 + (uint32_t)(U * i) * 128u, p0 + (int64_t)drg * 8 * ld + dc * 16, 16);
  }
}
#endif

template <typename T, int DP>
__global__ void __launch_bounds__(384, 1) cq_attn8_fwd_sm90(const cq_attn_args a, const cq_attn8_ptrs w) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BM = 128, NS = KB / 8, NO = DP / 8;
  constexpr uint32_t Q_BYTES = BM * DP, TILE_BYTES = KB * DP; /* a K tile and a V^T tile are both 64 x DP bytes */
  extern __shared__ __align__(1024) unsigned char cq_attn8_sm90_smem[];
  const uint32_t sQ = cq_smem_addr(cq_attn8_sm90_smem), sK = sQ + Q_BYTES, sV = sK + A8_STAGES * TILE_BYTES;
  const uint32_t bars = sV + A8_STAGES * TILE_BYTES; /* Q full, then K full, K empty, V full, V empty per stage */
  const uint32_t q_full = bars, k_full = bars + 8, k_empty = k_full + 8 * A8_STAGES;
  const uint32_t v_full = k_empty + 8 * A8_STAGES, v_empty = v_full + 8 * A8_STAGES;

  const int q0 = blockIdx.x * BM, h = blockIdx.y, b = blockIdx.z;
  const int64_t bh = (int64_t)b * a.heads + h;
  const int n_tiles = (a.seq_kv + KB - 1) / KB;

  if (threadIdx.x == 0) {
    sm90_mbar_init(q_full, 128);
    for (int st = 0; st < A8_STAGES; ++st) {
      sm90_mbar_init(k_full + 8 * st, 64);
      sm90_mbar_init(v_full + 8 * st, 64);
      sm90_mbar_init(k_empty + 8 * st, 8); /* lane 0 of every consumer warp */
      sm90_mbar_init(v_empty + 8 * st, 8);
    }
  }
  __syncthreads();

  if (threadIdx.x < 128) {
    /* ------------------------------------------------------------ producer */
    sm90_setmaxnreg_dec<40>();
    const int pt = threadIdx.x;
    cq_attn8_copy<BM, DP, 128>(sQ, (const uint8_t *)w.qc + (bh * w.sq_pad + q0) * DP, DP, pt);
    cq_cp_async_commit();
    cq_cp_async_wait<0>();
    sm90_fence_proxy();
    sm90_mbar_arrive(q_full);

    /* warps 0-1 copy K code tiles (64 keys x DP), warps 2-3 V^T tiles (DP dims x 64 keys) */
    const bool is_v = pt >= 64;
    const int ct = pt % 64;
    const uint8_t *kg = (const uint8_t *)w.kc + bh * w.skv_pad * DP, *vg = w.vt + bh * DP * w.skv_pad;
    const uint32_t ring = is_v ? sV : sK, full0 = is_v ? v_full : k_full, empty0 = is_v ? v_empty : k_empty;
    sm90_produce<A8_STAGES, A8_AHEAD>(n_tiles, full0, empty0, [&](int j, int st) {
      if (is_v) cq_attn8_copy<DP, KB, 64>(ring + st * TILE_BYTES, vg + (int64_t)j * KB, w.skv_pad, ct);
      else cq_attn8_copy<KB, DP, 64>(ring + st * TILE_BYTES, kg + (int64_t)j * KB * DP, DP, ct);
    });
  } else {
    /* ------------------------------------------------------------ consumers */
    sm90_setmaxnreg_inc<232>();
    const int wg = threadIdx.x / 128 - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const uint32_t my_turn = 1 + wg, next_turn = 1 + (wg + 1) % 2;
    if (wg == 0) sm90_bar_arrive(my_turn, 256); /* the first warpgroup starts */

    float o[DP / 2], acc[DP / 2], p[KB / 2], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, qs[2];
    float alpha_prev[2] = {0.f, 0.f};
    int si[KB / 2];
    uint32_t pa[KB / 32][4];
#pragma unroll
    for (int i = 0; i < DP / 2; ++i) o[i] = 0.f;
    const int row_base = q0 + wg * 64 + warp * 16 + g;
    qs[0] = w.sq[bh * w.sq_pad + row_base], qs[1] = w.sq[bh * w.sq_pad + row_base + 8];
    const float *sk = w.sk + bh * (w.skv_pad / KB);

    /* descriptors of stage 0; a step of 16 in the address field is 256 bytes of smem */
    const uint64_t dq = sm90_desc_u32(sQ + (uint32_t)wg * 64 * DP, 128, DP * 8);
    const uint64_t dk0 = sm90_desc_u32(sK, 128, DP * 8), dv0 = sm90_desc_u32(sV, 128, (KB / 16) * 128);
    constexpr uint64_t D_STAGE = TILE_BYTES >> 4;
    auto issue_s = [&](int stage) {
      const uint64_t dk = dk0 + stage * D_STAGE;
      sm90_fence_regs(si);
      sm90_wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < DP / 32; ++kk) cq_wgmma_m64n64k32_s8_ss(si, dq + kk * 16, dk + kk * 16, kk > 0);
      sm90_wgmma_commit();
    };
    auto issue_pv = [&](int stage) { /* acc = P V (fresh) */
      const uint64_t dv = dv0 + stage * D_STAGE;
      sm90_fence_regs(acc);
#pragma unroll
      for (int ks = 0; ks < KB / 32; ++ks) sm90_fence_regs(pa[ks]);
      sm90_wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < KB / 32; ++ks) cq_attn8_pv_sm90<DP>::run(acc, pa[ks], dv + ks * 16, ks > 0);
      sm90_wgmma_commit();
    };
    auto release = [&](uint32_t bar) {
      if (lane == 0) sm90_mbar_arrive(bar);
    };
    /* the reference's online softmax of tile j (scores si): p, m, l, and alpha_j into alpha */
    auto softmax = [&](int j, auto tail_tag, float (&alpha)[2]) {
      constexpr bool TAIL = decltype(tail_tag)::value;
      cq_attn8_softmax<TAIL, NS>(si, p, qs, sk[j], a.seq_kv - j * KB - 2 * t, m, l, alpha);
    };
    auto pack = [&]() {
#pragma unroll
      for (int ks = 0; ks < KB / 32; ++ks) {
        const int n0 = 4 * ks; /* element (n, e) of the accumulators is p[4 n + e] */
        pa[ks][0] = cq_p_fp8x4(p[4 * n0 + 0], p[4 * n0 + 1], p[4 * (n0 + 1) + 0], p[4 * (n0 + 1) + 1]);
        pa[ks][1] = cq_p_fp8x4(p[4 * n0 + 2], p[4 * n0 + 3], p[4 * (n0 + 1) + 2], p[4 * (n0 + 1) + 3]);
        pa[ks][2] = cq_p_fp8x4(p[4 * (n0 + 2) + 0], p[4 * (n0 + 2) + 1], p[4 * (n0 + 3) + 0], p[4 * (n0 + 3) + 1]);
        pa[ks][3] = cq_p_fp8x4(p[4 * (n0 + 2) + 2], p[4 * (n0 + 2) + 3], p[4 * (n0 + 3) + 2], p[4 * (n0 + 3) + 3]);
      }
    };
    auto fold = [&]() { /* O = O * alpha_{j-1} + P_{j-1} V_{j-1} */
#pragma unroll
      for (int n = 0; n < NO; ++n) {
        o[4 * n] = fmaf(o[4 * n], alpha_prev[0], acc[4 * n]);
        o[4 * n + 1] = fmaf(o[4 * n + 1], alpha_prev[0], acc[4 * n + 1]);
        o[4 * n + 2] = fmaf(o[4 * n + 2], alpha_prev[1], acc[4 * n + 2]);
        o[4 * n + 3] = fmaf(o[4 * n + 3], alpha_prev[1], acc[4 * n + 3]);
      }
    };
    const bool tail = a.seq_kv % KB != 0;

    sm90_mbar_wait(q_full, 0);
    sm90_mbar_wait(k_full, 0);
    issue_s(0);
    sm90_wgmma_wait<0>();
    sm90_fence_regs(si);
    release(k_empty);
    if (n_tiles == 1 && tail) softmax(0, cq_bool_tag<true>(), alpha_prev);
    else softmax(0, cq_bool_tag<false>(), alpha_prev);
    pack();

    auto step = [&](int j, auto tail_tag) {
      const int sk_ = j % A8_STAGES, sv = (j - 1) % A8_STAGES;
      sm90_mbar_wait(k_full + 8u * sk_, (j / A8_STAGES) & 1);
      sm90_bar_sync(my_turn, 256);
      issue_s(sk_);
      sm90_mbar_wait(v_full + 8u * sv, ((j - 1) / A8_STAGES) & 1);
      issue_pv(sv);
      sm90_bar_arrive(next_turn, 256);
      sm90_wgmma_wait<1>();
      sm90_fence_regs(si);
      release(k_empty + 8u * sk_);
      float alpha[2];
      softmax(j, tail_tag, alpha);
      sm90_wgmma_wait<0>();
      sm90_fence_regs(acc);
      sm90_fence_regs(p);
      release(v_empty + 8u * sv);
      fold();
      alpha_prev[0] = alpha[0], alpha_prev[1] = alpha[1];
      pack();
    };
    const int n_full = tail ? n_tiles - 1 : n_tiles;
    for (int j = 1; j < n_full; ++j) step(j, cq_bool_tag<false>());
    if (tail && n_tiles > 1) step(n_tiles - 1, cq_bool_tag<true>());

    const int sv = (n_tiles - 1) % A8_STAGES;
    sm90_mbar_wait(v_full + 8u * sv, ((n_tiles - 1) / A8_STAGES) & 1);
    issue_pv(sv);
    sm90_wgmma_wait<0>();
    sm90_fence_regs(acc);
    release(v_empty + 8u * sv);
    fold();

    /* out = o / l * sv / 448; lse = (m + log2 l + q'.kmean) / log2(e) */
    T *og = static_cast<T *>(a.out) + b * a.o_sb + h * a.o_sh;
    const float *svd = w.svd + bh * DP;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float lsum = cq_quad_sum(l[hh]);
      const float inv = 1.f / lsum;
      const int row = row_base + hh * 8;
      if (row >= a.seq_q) continue;
#pragma unroll
      for (int n = 0; n < NO; ++n) {
        const int col = n * 8 + 2 * t;
        if (col < a.head_dim)
          *reinterpret_cast<uint32_t *>(og + (int64_t)row * a.o_ss + col) =
              cq_pack2<T>(o[4 * n + 2 * hh] * inv * svd[col], o[4 * n + 2 * hh + 1] * inv * svd[col + 1]);
      }
      if (a.lse && t == 0) a.lse[bh * a.seq_q + row] = (m[hh] + __log2f(lsum) + w.qbias[bh * w.sq_pad + row]) / CQ_LOG2E;
    }
  }
#else
  (void)a, (void)w;
  __trap(); /* built without the sm_90a target: the launcher is not reached on such builds */
#endif
}

template <typename T, int DP>
static cq_status cq_attn8_launch_sm90(const cq_attn_args &a, const cq_attn8_ptrs &w, cudaStream_t stream) {
  const size_t smem = (size_t)128 * DP + 2 * A8_STAGES * (size_t)KB * DP + 8 * (1 + 4 * A8_STAGES);
  auto kernel = cq_attn8_fwd_sm90<T, DP>;
  CQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  dim3 grid((unsigned)((a.seq_q + 127) / 128), (unsigned)a.heads, (unsigned)a.batch);
  kernel<<<grid, 384, smem, stream>>>(a, w);
  CQ_LAUNCH_CHECK("cq_attn8_fwd_sm90");
  return CQ_OK;
}

/* On by default (CQ_ATTN_SM90_AUTO): faster than the mma.sync 8-bit kernel on every H100 shape. */
static int cq_attn8_sm90_applies(int dp, int cc) { return cq_attn_sm90_mode(cc) != CQ_ATTN_SM90_OFF && dp <= 128; }

/* The one place where a head dim picks the 8-bit kernel's specialisation (see int8_dp). */
template <typename T>
static cq_status cq_attn8_dispatch(const cq_attn_args &a, const cq_attn8_ptrs &w, int dp, int cc, cudaStream_t stream) {
  if (cq_attn8_sm90_applies(dp, cc)) switch (dp) {
      case 64: return cq_attn8_launch_sm90<T, 64>(a, w, stream);
      case 96: return cq_attn8_launch_sm90<T, 96>(a, w, stream);
      default: return cq_attn8_launch_sm90<T, 128>(a, w, stream);
    }
  switch (dp) {
    case 64: return cq_attn8_launch<T, 64, 2>(a, w, stream);
    case 96: return cq_attn8_launch<T, 96, 2>(a, w, stream);
    case 128: return cq_attn8_launch<T, 128, 2>(a, w, stream);
    case 256: return cq_attn8_launch<T, 256, 1>(a, w, stream);
    default: return cq_fail(CQ_ERR_INTERNAL, "8-bit attention: no kernel for padded head dim %d", dp);
  }
}

template <typename T>
static cq_status cq_attn8_run(const cq_attn_args &a, const cq_attention_params *p, const int8_layout &L,
                              unsigned char *ws, int cc, cudaStream_t stream) {
  const int nkb = (int)(L.skv_pad / KB), qb = cq_attention_q_block(p);
  const unsigned bh = (unsigned)L.bh;
  float *psum = (float *)(ws + L.psum), *pamax = (float *)(ws + L.pamax);
  float *kmean = (float *)(ws + L.kmean), *vamax = (float *)(ws + L.vamax);
  cq_attn8_stats_partial<T><<<dim3((unsigned)nkb, bh), PREP_THREADS, 0, stream>>>(a, L.dp, psum, pamax);
  CQ_LAUNCH_CHECK("cq_attn8_stats_partial");
  cq_attn8_stats_reduce<<<bh, PREP_THREADS, 0, stream>>>(a.seq_kv, nkb, L.dp, psum, pamax, kmean, vamax);
  CQ_LAUNCH_CHECK("cq_attn8_stats_reduce");
  /* q_block groups cover [0, sq_pad): the padding rows get zero codes and scales */
  const unsigned nqg = (unsigned)((L.sq_pad + qb - 1) / qb);
  const float qscale = p->scale * CQ_LOG2E; /* the reference's q' = q * (scale * log2e), fp32 */
  cq_attn8_quant_qk<T, true><<<dim3(nqg, bh), PREP_THREADS, 0, stream>>>(
      a, L.dp, qb, a.seq_q, L.sq_pad, qscale, kmean, (int8_t *)(ws + L.qc), (float *)(ws + L.sq),
      (float *)(ws + L.qbias));
  CQ_LAUNCH_CHECK("cq_attn8_quant_q");
  cq_attn8_quant_qk<T, false><<<dim3((unsigned)nkb, bh), PREP_THREADS, 0, stream>>>(
      a, L.dp, KB, a.seq_kv, L.skv_pad, 1.f, kmean, (int8_t *)(ws + L.kc), (float *)(ws + L.sk), NULL);
  CQ_LAUNCH_CHECK("cq_attn8_quant_k");
  cq_attn8_quant_v<T><<<dim3((unsigned)nkb, bh), PREP_THREADS, 0, stream>>>(a, L.dp, L.skv_pad, vamax,
                                                                            ws + L.vt, (float *)(ws + L.svd));
  CQ_LAUNCH_CHECK("cq_attn8_quant_v");
  cq_attn8_ptrs w;
  w.qc = (const int8_t *)(ws + L.qc), w.kc = (const int8_t *)(ws + L.kc), w.vt = ws + L.vt;
  w.sq = (const float *)(ws + L.sq), w.sk = (const float *)(ws + L.sk), w.svd = (const float *)(ws + L.svd);
  w.qbias = (const float *)(ws + L.qbias);
  w.sq_pad = L.sq_pad, w.skv_pad = L.skv_pad;
  return cq_attn8_dispatch<T>(a, w, L.dp, cc, stream);
}

cq_status cq_attention_int8_launch(const cq_attn_args &a, const cq_attention_params *p, void *workspace,
                                   size_t workspace_bytes, int cc, int dtype_is_bf16, cudaStream_t stream) {
  if (cc < 89)
    return cq_fail(CQ_ERR_UNSUPPORTED, "8-bit attention needs fp8 mma (compute capability 8.9 or newer); this GPU "
                   "has compute capability %d.%d", cc / 10, cc % 10);
  if (cq_attention_k_block(p) != KB)
    return cq_fail(CQ_ERR_UNSUPPORTED, "the CUDA 8-bit attention kernel takes k_block = %d; got %d", KB,
                   (int)cq_attention_k_block(p));
  if ((int64_t)a.batch * a.heads > 65535)
    return cq_fail(CQ_ERR_UNSUPPORTED, "the CUDA 8-bit attention takes batch * heads up to 65535; got %lld",
                   (long long)a.batch * a.heads);
  cq_attention_dims n = {a.batch, a.heads, a.seq_q, a.seq_kv, a.head_dim};
  const int8_layout L = int8_layout_of(&n);
  if (workspace_bytes < L.total || (uintptr_t)workspace % 256)
    return cq_fail(CQ_ERR_INVALID_ARG, "workspace must hold %zu bytes at a 256-byte aligned address; got %zu bytes "
                   "at %p", L.total, workspace_bytes, workspace);
  if (dtype_is_bf16) return cq_attn8_run<__nv_bfloat16>(a, p, L, (unsigned char *)workspace, cc, stream);
  return cq_attn8_run<__half>(a, p, L, (unsigned char *)workspace, cc, stream);
}
