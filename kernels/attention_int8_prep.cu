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

/* The grids of the passes over q, k and v run the heads fastest: CTA c takes head c % nbh of its
 * block of rows c / nbh, so that the CTAs resident at once read the same rows of every head, long
 * stretches of a [B, S, H, D] tensor, rather than rows H D elements apart (H200, Flux 1024: the
 * statistics pass 26.0 -> 23.2 us, the K codes 28.8 -> 24.3 us). */
__device__ __forceinline__ int64_t cq_prep_head(unsigned nbh) { return blockIdx.x % nbh; }
__device__ __forceinline__ int cq_prep_block(unsigned nbh) { return (int)(blockIdx.x / nbh); }

/* Packed pairs of T (bf16x2, half2), and a pair of one value. */
template <typename T> struct cq_pair_of;
template <> struct cq_pair_of<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ type fill(float f) { return __float2bfloat162_rn(f); }
};
template <> struct cq_pair_of<__half> {
  using type = __half2;
  static __device__ __forceinline__ type fill(float f) { return __float2half2_rn(f); }
};

/* Thread t reads 16-byte chunk t % C8 of rows t / C8, t / C8 + G, ... of its KB keys: K's column
 * sums in fp32 in row order, V's column amax on the packed values. */
template <typename T>
__global__ void __launch_bounds__(PREP_THREADS) cq_attn8_stats_partial(const cq_attn_args a, int dp, unsigned nbh,
                                                                      float *psum, float *pamax) {
  using T2 = typename cq_pair_of<T>::type;
  __shared__ float s_sum[PREP_THREADS][8], s_max[PREP_THREADS][8];
  const int64_t bh = cq_prep_head(nbh);
  const int kb = cq_prep_block(nbh), nkb = (int)(gridDim.x / nbh), c8 = a.head_dim / 8, groups = PREP_THREADS / c8;
  const int c = threadIdx.x % c8, grp = threadIdx.x / c8;
  const T *kh = cq_head<T>(a.k, a.k_sb, a.k_sh, a.heads, bh), *vh = cq_head<T>(a.v, a.v_sb, a.v_sh, a.heads, bh);
  float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  T2 vmax[4];
#pragma unroll
  for (int w = 0; w < 4; ++w) vmax[w] = cq_pair_of<T>::fill(0.f);
  if (grp < groups) {
    /* kStatRows rows' loads of K and V in flight at once: unconditional (rows past the block read
     * its last row again and are left out), or the compiler issues them one or two at a time */
    constexpr int kStatRows = 8;
    const int j1 = min(a.seq_kv, (kb + 1) * KB);
    for (int j0 = kb * KB + grp; j0 < j1; j0 += kStatRows * groups) {
      uint4 ku[kStatRows], vu[kStatRows];
#pragma unroll
      for (int i = 0; i < kStatRows; ++i) {
        const int j = min(j0 + i * groups, j1 - 1);
        ku[i] = *reinterpret_cast<const uint4 *>(kh + (int64_t)j * a.k_ss + c * 8);
        vu[i] = *reinterpret_cast<const uint4 *>(vh + (int64_t)j * a.v_ss + c * 8);
      }
#pragma unroll
      for (int i = 0; i < kStatRows; ++i)
        if (j0 + i * groups < j1) {
          const T *ke = reinterpret_cast<const T *>(&ku[i]);
          const T2 *ve = reinterpret_cast<const T2 *>(&vu[i]);
#pragma unroll
          for (int e = 0; e < 8; ++e) sum[e] += cq_to_float(ke[e]);
#pragma unroll
          for (int w = 0; w < 4; ++w) vmax[w] = __hmax2_nan(vmax[w], __habs2(ve[w]));
        }
    }
  }
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    s_sum[threadIdx.x][2 * w] = sum[2 * w], s_sum[threadIdx.x][2 * w + 1] = sum[2 * w + 1];
    s_max[threadIdx.x][2 * w] = __low2float(vmax[w]), s_max[threadIdx.x][2 * w + 1] = __high2float(vmax[w]);
  }
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

/* The Q or K code pass: per group of rows (q_block query rows, or KB keys) of a head, the amax of
 * the transformed values (q * scale * log2e, or k - kmean), their int8 codes, and the group's scale
 * and largest scaled norm of its rows' codes, which raise the head's bound slots (Q: MAX_SQ and
 * MAX_QNORM, K: MAX_SK and MAX_KNORM) as the reference computes them (cq_attn8_row_norm); groups
 * of padding rows only do not count. Q also gives each row's scale, and q' . kmean (for the
 * log-sum-exp) where qbias is not NULL.
 *
 * A warp takes R = 32 / L rows at once, L lanes a row, lane l holding its CPL 16-byte chunks
 * l % L + L k (so that the L lanes of a row read 16 L contiguous bytes a load); a group is one
 * warp, or a CTA of kQkWarps warps from 128 rows on (wpg). Two steps over the group's rows, which
 * a group that the lanes' registers hold (RESIDENT below) reads once, and others read twice (the
 * second time mostly from L2):
 *   1. the amax, on the raw values as packed pairs: Q's max |q| (max |q * c| is that times |c|:
 *      fp32 rounding is monotonic), K's per-channel max and min (max |k - kmean| is at one of
 *      them), NaN-propagating;
 *   2. the codes, each value's ops as the reference's (q * c, or k - kmean, times 1 / scale,
 *      rounded to nearest even), with the sums of squared codes by dp4a on the packed codes. A
 *      group's largest row norm is its scale times the square root of its largest sum (the same
 *      as the largest of the rows' norms: both steps are monotonic).
 * Reductions over a row's lanes are butterflies (integer sums exact; the dot of Q's rows with
 * kmean in that order). */
constexpr int kQkWarps = 4; /* warps a CTA */

/* int8 code of v (|v| <= 127 after rounding, NaN excluded by the caller) as 2^23 * 1.5 + code:
 * the fp32 add rounds to nearest even, as cq_int8_encode does; the low byte is the code's. */
__device__ __forceinline__ float cq_attn8_code_f(float v) { return __fadd_rn(v, 12582912.0f); }

template <typename T, bool IS_Q, int L, int CPL>
__global__ void __launch_bounds__(32 * kQkWarps) cq_attn8_quant_qk(const cq_attn_args a, int dp, unsigned nbh,
                                                                   int rows_per_group, int groups, int wpg, int seq,
                                                                   int64_t seq_pad,
                                                                   float qmul, const float *kmean, int8_t *codes,
                                                                   float *scales, float *qbias, uint32_t *bound) {
  using T2 = typename cq_pair_of<T>::type;
  constexpr int R = 32 / L; /* rows a warp takes at once */
  __shared__ uint32_t s_amax[kQkWarps];
  __shared__ __align__(16) float s_km[256]; /* the head's kmean (K, or Q's dot): one head a CTA */
  const int64_t bh = cq_prep_head(nbh);
  const int lane = threadIdx.x % 32, group = cq_prep_block(nbh) * (kQkWarps / wpg) + threadIdx.x / 32 / wpg;
  const int wi = threadIdx.x / 32 % wpg; /* warp wi of the group takes row slots wi R + sub, + R wpg, ... */
  const bool dot = IS_Q && qbias != NULL;
  if (!IS_Q || dot) {
    for (int d = threadIdx.x; d < dp; d += blockDim.x) s_km[d] = kmean[bh * dp + d];
    __syncthreads();
  }
  if (group >= groups) return; /* uniform over the group's warps */
  const int sub = lane / L, cl = lane % L;
  const int r0 = group * rows_per_group;
  const T *head = IS_Q ? cq_head<T>(a.q, a.q_sb, a.q_sh, a.heads, bh) : cq_head<T>(a.k, a.k_sb, a.k_sh, a.heads, bh);
  const int64_t ss = IS_Q ? a.q_ss : a.k_ss;
  const int rows = min(rows_per_group, (int)(seq_pad - r0)); /* includes padding rows */
  const int data_rows = min(rows, seq - r0);                  /* rows with values */
  bool has[CPL];
#pragma unroll
  for (int k = 0; k < CPL; ++k) has[k] = (cl + L * k) * 8 < a.head_dim;
  /* the 8 means of chunk k (read from shared memory where used, not held) */
  auto km8 = [&](int k, float (&m)[8]) {
    *reinterpret_cast<float4 *>(m) = *reinterpret_cast<const float4 *>(s_km + (cl + L * k) * 8);
    *reinterpret_cast<float4 *>(m + 4) = *reinterpret_cast<const float4 *>(s_km + (cl + L * k) * 8 + 4);
  };
  const T *lane_base = head + (int64_t)r0 * ss + cl * 8;
  auto load = [&](int r, int k) { return *reinterpret_cast<const uint4 *>(lane_base + (int64_t)r * ss + L * 8 * k); };

  /* RESIDENT: a group of whole rows and head dims that a lane's registers hold (at most kRes row
   * slots of CPL chunks, 64 registers: every Q group of the default q_block and every K group at
   * head dims <= 128) is read once, all its loads in flight together, and coded from the registers
   * (H200, Flux 1024: Q codes 24.1 -> 16.1 us, K codes 25.0 -> 17.6 us) */
  constexpr int kRes = 16 / CPL;
  const int nslot = rows / (R * wpg);
  const bool resident = data_rows == rows && rows == nslot * R * wpg && nslot <= kRes && a.head_dim == dp;
  uint4 held[kRes][CPL];
  if (resident)
#pragma unroll
    for (int s = 0; s < kRes; ++s)
#pragma unroll
      for (int k = 0; k < CPL; ++k)
        if (s < nslot) held[s][k] = load(wi * R + sub + s * R * wpg, k);

  /* 1. amax */
  T2 hi[CPL][4], lo[CPL][4]; /* Q: max |q|; K: max and min of k, per channel */
#pragma unroll
  for (int k = 0; k < CPL; ++k)
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      hi[k][w] = cq_pair_of<T>::fill(IS_Q ? 0.f : -INFINITY);
      lo[k][w] = cq_pair_of<T>::fill(INFINITY);
    }
  auto amax_chunk = [&](int k, const uint4 &u) {
    const T2 *e = reinterpret_cast<const T2 *>(&u);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      if (IS_Q) hi[k][w] = __hmax2_nan(hi[k][w], __habs2(e[w]));
      else hi[k][w] = __hmax2_nan(hi[k][w], e[w]), lo[k][w] = __hmin2_nan(lo[k][w], e[w]);
    }
  };
  const bool seen = wi * R + sub < data_rows;
  if (resident) {
#pragma unroll
    for (int s = 0; s < kRes; ++s)
#pragma unroll
      for (int k = 0; k < CPL; ++k)
        if (s < nslot) amax_chunk(k, held[s][k]);
  } else {
#pragma unroll 4
    for (int r = wi * R + sub; r < data_rows; r += R * wpg)
#pragma unroll
      for (int k = 0; k < CPL; ++k)
        if (has[k]) amax_chunk(k, load(r, k));
  }
  uint32_t amax_bits = 0;
  if (seen)
#pragma unroll
    for (int k = 0; k < CPL; ++k)
      if (has[k])
#pragma unroll
        for (int w = 0; w < 4; ++w)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float h = e ? __high2float(hi[k][w]) : __low2float(hi[k][w]);
            if (IS_Q) {
              amax_bits = max(amax_bits, cq_abs_bits(h * qmul));
            } else {
              const float l = e ? __high2float(lo[k][w]) : __low2float(lo[k][w]), m = s_km[(cl + L * k) * 8 + 2 * w + e];
              amax_bits = max(amax_bits, max(cq_abs_bits(h - m), cq_abs_bits(l - m)));
            }
          }
  amax_bits = cq_warp_max_u32(amax_bits);
  if (wpg > 1) { /* kernel-uniform: the CTA is one group */
    if (lane == 0) s_amax[wi] = amax_bits;
    __syncthreads();
    for (int i = 0; i < wpg; ++i) amax_bits = max(amax_bits, s_amax[i]);
  }
  float scale, inv;
  cq_scale_from_amax(cq_amax_from_bits(amax_bits), 127.0f, &scale, &inv);

  /* 2. codes */
  constexpr int kBatch = 2; /* row slots a lane at a time: their loads in flight together */
  int max_sum = -1;         /* largest sum of squared codes of this warp's rows (-1: none) */
  /* CHECK: the general path, which tests each row against the data and padding rows and each
   * chunk against the head dim; a group of kBatch R wpg data rows per pass, whole head dims and a
   * finite amax (every group of typical calls) skips the tests */
  auto encode = [&](auto check, int r, const uint4 (&u)[CPL]) {
    constexpr bool CHECK = decltype(check)::value;
    const int row = r0 + r;
    const bool live = !CHECK || r < data_rows;
    int sum = 0;
    float d = 0.f;
#pragma unroll
    for (int k = 0; k < CPL; ++k) {
      uint32_t w0 = 0, w1 = 0;
      if (!CHECK || (has[k] && live)) {
        const T *e = reinterpret_cast<const T *>(&u[k]);
        float x[8], km[8];
        if (!IS_Q || dot) km8(k, km);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float v = cq_to_float(e[i]);
          x[i] = IS_Q ? v * qmul : v - km[i];
        }
        if (dot)
#pragma unroll
          for (int i = 0; i < 8; ++i) d += x[i] * km[i];
        if (!CHECK || inv != 0.f) { /* inv = 0: a non-finite amax, whose codes are all 0 */
          float t[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) t[i] = cq_attn8_code_f(x[i] * inv);
          w0 = cq_low_bytes4(t[0], t[1], t[2], t[3]), w1 = cq_low_bytes4(t[4], t[5], t[6], t[7]);
          sum = __dp4a((int)w0, (int)w0, __dp4a((int)w1, (int)w1, sum));
        }
      }
      if (!CHECK || (r < rows && (cl + L * k) * 8 < dp))
        *reinterpret_cast<uint2 *>(codes + (bh * seq_pad + row) * dp + (cl + L * k) * 8) = make_uint2(w0, w1);
    }
#pragma unroll
    for (int o = L / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (dot)
#pragma unroll
      for (int o = L / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
    if (CHECK && r >= rows) return;
    if (!CHECK || row < seq) max_sum = max(max_sum, sum);
    if (IS_Q && cl == 0) {
      scales[bh * seq_pad + row] = !CHECK || row < seq ? scale : 0.f;
      if (dot) qbias[bh * seq_pad + row] = !CHECK || row < seq ? d : 0.f;
    }
  };
  auto pass2 = [&](auto check) {
    constexpr bool CHECK = decltype(check)::value;
    /* every lane runs every slot (the butterflies); slots past the group store nothing */
    for (int base = wi * R; base < rows; base += kBatch * R * wpg) {
      uint4 u[kBatch][CPL];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int r = base + j * R * wpg + sub;
#pragma unroll
        for (int k = 0; k < CPL; ++k)
          u[j][k] = !CHECK || (has[k] && r < data_rows) ? load(r, k) : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j)
        if (!CHECK || base + j * R * wpg < rows) encode(check, base + j * R * wpg + sub, u[j]); /* warp-uniform */
    }
  };
  if (resident) {
#pragma unroll
    for (int s = 0; s < kRes; ++s)
      if (s < nslot) {
        if (inv != 0.f) encode(std::false_type(), wi * R + sub + s * R * wpg, held[s]);
        else encode(std::true_type(), wi * R + sub + s * R * wpg, held[s]);
      }
  } else if (data_rows == rows && rows % (kBatch * R * wpg) == 0 && a.head_dim == dp && inv != 0.f) {
    pass2(std::false_type());
  } else {
    pass2(std::true_type());
  }
  if (!IS_Q && wi == 0 && lane == 0) scales[bh * groups + group] = scale;
  max_sum = (int)cq_warp_max_u32((uint32_t)(max_sum + 1)) - 1;
  if (lane == 0 && r0 < seq) {
    uint32_t *slots = bound + bh * CQ_ATTN8_BOUND_SLOTS;
    atomicMax(slots + (IS_Q ? CQ_ATTN8_MAX_SQ : CQ_ATTN8_MAX_SK), cq_abs_bits(scale));
    if (max_sum >= 0)
      atomicMax(slots + (IS_Q ? CQ_ATTN8_MAX_QNORM : CQ_ATTN8_MAX_KNORM),
                cq_abs_bits(cq_attn8_row_norm(scale, (int64_t)max_sum)));
  }
}

/* Key of slot s (0..15) of a 16-key group in V^T: the order in which a thread's S accumulators
 * (keys 2t, 2t+1 of n-tiles 0 and 1) fill the 4 bytes of its 8-bit A operand register. */
__device__ __forceinline__ int cq_attn8_slot_key(int s) { return 2 * (s / 4) + (s % 2) + 8 * ((s % 4) / 2); }

/* Also decides the head (its first block, after quant_q and quant_k have raised the bound slots):
 * full[bh] = 1 where E > CQ_ATTENTION_INT8_MAX_LOGIT_ERROR or E is NaN, as the reference does. */
constexpr int kVKeys = 64; /* keys a CTA of quant_v (a divisor of KB): twice the CTAs of KB */

/* A 4 x 4 transpose of bytes: word i of the result holds byte i of w0, w1, w2, w3 (in that order). */
__device__ __forceinline__ void cq_transpose4x4_bytes(uint32_t (&w)[4]) {
  const uint32_t t0 = __byte_perm(w[0], w[1], 0x5140u), t1 = __byte_perm(w[0], w[1], 0x7362u);
  const uint32_t t2 = __byte_perm(w[2], w[3], 0x5140u), t3 = __byte_perm(w[2], w[3], 0x7362u);
  w[0] = __byte_perm(t0, t2, 0x5410u), w[1] = __byte_perm(t0, t2, 0x7632u);
  w[2] = __byte_perm(t1, t3, 0x5410u), w[3] = __byte_perm(t1, t3, 0x7632u);
}

template <typename T, int DP>
__global__ void __launch_bounds__(PREP_THREADS) cq_attn8_quant_v(const cq_attn_args a, unsigned nbh, int64_t skv_pad,
                                                                const float *vamax, uint8_t *vt, float *sv,
                                                                const uint32_t *bound, uint8_t *full) {
  /* codes of kVKeys keys, key-major; rows of 65 words: the transpose's 4-byte reads of 4 keys
   * fall in distinct banks but for a factor of 2 */
  constexpr int kRowWords = 256 / 4 + 1;
  __shared__ uint32_t tile[kVKeys][kRowWords];
  __shared__ __align__(16) float s_inv[256];
  const int64_t bh = cq_prep_head(nbh);
  const int kb = cq_prep_block(nbh), c8 = DP / 8;
  if (kb == 0 && threadIdx.x == 0) {
    const uint32_t *slot = bound + bh * CQ_ATTN8_BOUND_SLOTS;
    const float e = cq_attn8_logit_error(__uint_as_float(slot[CQ_ATTN8_MAX_SQ]), __uint_as_float(slot[CQ_ATTN8_MAX_QNORM]),
                                         __uint_as_float(slot[CQ_ATTN8_MAX_SK]), __uint_as_float(slot[CQ_ATTN8_MAX_KNORM]),
                                         a.head_dim);
    full[bh] = !(e <= CQ_ATTENTION_INT8_MAX_LOGIT_ERROR);
  }
  const T *vh = cq_head<T>(a.v, a.v_sb, a.v_sh, a.heads, bh);
  for (int d = threadIdx.x; d < DP; d += blockDim.x) {
    float scale = 0.f, inv = 0.f;
    if (d < a.head_dim) cq_scale_from_amax(vamax[bh * DP + d], 127.0f, &scale, &inv);
    s_inv[d] = inv;
    if (kb == 0) sv[bh * DP + d] = scale;
  }
  __syncthreads();
  /* every chunk's load in flight at once (DP / 32 a thread): unconditional, chunks past the keys
   * or the head dim read the last one again and code as zeros (a loop with a bound check instead
   * had the compiler issue them one at a time) */
  constexpr int kVLoads = kVKeys * DP / 8 / PREP_THREADS;
  static_assert(kVLoads * PREP_THREADS == kVKeys * DP / 8, "whole chunks a thread");
  const int keys = a.seq_kv - kb * kVKeys, c8v = a.head_dim / 8;
  const T *vb = vh + (int64_t)kb * kVKeys * a.v_ss;
  {
    uint4 u[kVLoads];
    uint32_t words[kVLoads][2];
#pragma unroll
    for (int i = 0; i < kVLoads; ++i) {
      const int idx = threadIdx.x + i * PREP_THREADS, j = min(idx / c8, keys - 1), c = min(idx % c8, c8v - 1);
      u[i] = *reinterpret_cast<const uint4 *>(vb + (int64_t)j * a.v_ss + c * 8);
    }
#pragma unroll
    for (int i = 0; i < kVLoads; ++i) {
      const int idx = threadIdx.x + i * PREP_THREADS, c = idx % c8;
      const bool live = idx / c8 < keys && c < c8v;
      const T *e = reinterpret_cast<const T *>(&u[i]);
      float inv[8];
      *reinterpret_cast<float4 *>(inv) = *reinterpret_cast<const float4 *>(s_inv + c * 8);
      *reinterpret_cast<float4 *>(inv + 4) = *reinterpret_cast<const float4 *>(s_inv + c * 8 + 4);
      /* int8 codes as quant_qk's: RNE of x * inv by the fp32 add (|x| <= amax, so |x * inv| <= 127
       * up to two roundings, below 127.5: no clamp); a column of non-finite amax has inv = 0 and
       * all-zero codes */
      float t[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) t[k] = cq_attn8_code_f(live && inv[k] != 0.f ? cq_to_float(e[k]) * inv[k] : 0.f);
      words[i][0] = cq_low_bytes4(t[0], t[1], t[2], t[3]), words[i][1] = cq_low_bytes4(t[4], t[5], t[6], t[7]);
    }
#pragma unroll
    for (int i = 0; i < kVLoads; ++i) {
      const int idx = threadIdx.x + i * PREP_THREADS, j = idx / c8, c = idx % c8;
      tile[j][2 * c] = words[i][0], tile[j][2 * c + 1] = words[i][1];
    }
  }
  __syncthreads();
  /* word q4 of a 16-key group's row of V^T holds its slots 4 q4 .. 4 q4 + 3, keys 2 q4, 2 q4 + 1,
   * 2 q4 + 8, 2 q4 + 9 (cq_attn8_slot_key): a thread reads them for 4 dims, transposes, and
   * writes that word of the 4 dims' rows (16 threads: 64 contiguous bytes of a row) */
  constexpr int kGroups = kVKeys / 16;
  for (int idx = threadIdx.x; idx < DP * kGroups; idx += blockDim.x) {
    const int q4 = idx % 4, grp = idx / 4 % kGroups, d4 = idx / (4 * kGroups);
    uint32_t w[4];
#pragma unroll
    for (int b = 0; b < 4; ++b) w[b] = tile[grp * 16 + cq_attn8_slot_key(q4 * 4 + b)][d4];
    cq_transpose4x4_bytes(w);
#pragma unroll
    for (int dd = 0; dd < 4; ++dd)
      *reinterpret_cast<uint32_t *>(vt + (bh * DP + d4 * 4 + dd) * skv_pad + kb * kVKeys + grp * 16 + q4 * 4) = w[dd];
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
  const unsigned grid = (unsigned)((groups + kQkWarps / wpg - 1) / (kQkWarps / wpg)) * bh;
  /* L lanes a row times CPL chunks of 8 dims cover dp */
  if (dp <= 64) cq_attn8_quant_qk<T, IS_Q, 2, 4><<<grid, 32 * kQkWarps, 0, stream>>>(a, dp, bh, rows, groups, wpg, args...);
  else if (dp <= 96) cq_attn8_quant_qk<T, IS_Q, 4, 3><<<grid, 32 * kQkWarps, 0, stream>>>(a, dp, bh, rows, groups, wpg, args...);
  else if (dp <= 128) cq_attn8_quant_qk<T, IS_Q, 4, 4><<<grid, 32 * kQkWarps, 0, stream>>>(a, dp, bh, rows, groups, wpg, args...);
  else cq_attn8_quant_qk<T, IS_Q, 8, 4><<<grid, 32 * kQkWarps, 0, stream>>>(a, dp, bh, rows, groups, wpg, args...);
}

template <typename T>
static cq_status cq_attn8_run(const cq_attn_args &a, const cq_attention_params *p, const int8_layout &L,
                              unsigned char *ws, int cc, cudaStream_t stream) {
  const int nkb = (int)(L.skv_pad / KB), qb = cq_attention_q_block(p);
  const unsigned bh = (unsigned)L.bh;
  /* the pre-pass grids are 1-d, heads fastest: at most a group of q_block rows or kVKeys keys a CTA */
  const int64_t most = (L.sq_pad + qb - 1) / qb > L.skv_pad / kVKeys ? (L.sq_pad + qb - 1) / qb : L.skv_pad / kVKeys;
  if (most * L.bh > INT_MAX)
    return cq_fail(CQ_ERR_UNSUPPORTED, "8-bit attention: %lld (batch, head) pairs of %lld query rows (q_block %d) and "
                   "%lld keys take more CTAs than a grid holds", (long long)L.bh, (long long)a.seq_q, qb, (long long)a.seq_kv);
  float *psum = (float *)(ws + L.psum), *pamax = (float *)(ws + L.pamax);
  float *kmean = (float *)(ws + L.kmean), *vamax = (float *)(ws + L.vamax);
  uint32_t *bound = (uint32_t *)(ws + L.bound);
  uint8_t *full = ws + L.full;
  cq_attn8_stats_partial<T><<<(unsigned)nkb * bh, PREP_THREADS, 0, stream>>>(a, L.dp, bh, psum, pamax);
  CQ_LAUNCH_CHECK("cq_attn8_stats_partial");
  uint32_t *split_cnt = (uint32_t *)(ws + L.split_cnt);
  cq_attn8_stats_reduce<<<dim3(bh, (unsigned)(L.dp / 32)), 256, 0, stream>>>(a.seq_kv, nkb, L.dp, psum, pamax, kmean,
                                                                           vamax, bound, split_cnt, (int)L.split_max);
  CQ_LAUNCH_CHECK("cq_attn8_stats_reduce");
  /* q_block groups cover [0, sq_pad): the padding rows get zero codes and scales */
  const unsigned nqg = (unsigned)((L.sq_pad + qb - 1) / qb);
  const float qscale = p->scale * CQ_LOG2E; /* the reference's q' = q * (scale * log2e), fp32 */
  cq_attn8_quant<T, true>(L.dp, (int)nqg, qb, bh, stream, a, a.seq_q, L.sq_pad, qscale, kmean,
                          (int8_t *)(ws + L.qc), (float *)(ws + L.sq), a.lse ? (float *)(ws + L.qbias) : (float *)NULL,
                          bound); /* q' . kmean only for the log-sum-exp */
  CQ_LAUNCH_CHECK("cq_attn8_quant_q");
  cq_attn8_quant<T, false>(L.dp, nkb, KB, bh, stream, a, a.seq_kv, L.skv_pad, 1.f, kmean,
                           (int8_t *)(ws + L.kc), (float *)(ws + L.sk), (float *)NULL, bound);
  CQ_LAUNCH_CHECK("cq_attn8_quant_k");
  const unsigned vgrid = (unsigned)(L.skv_pad / kVKeys) * bh;
  auto quant_v = L.dp <= 64 ? cq_attn8_quant_v<T, 64> : L.dp <= 96 ? cq_attn8_quant_v<T, 96>
                 : L.dp <= 128 ? cq_attn8_quant_v<T, 128> : cq_attn8_quant_v<T, 256>;
  quant_v<<<vgrid, PREP_THREADS, 0, stream>>>(a, bh, L.skv_pad, vamax, ws + L.vt, (float *)(ws + L.sv), bound, full);
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

