/* 8-bit attention (see cquant.h for the math): a pre-pass quantizes Q, K (smoothed) and V into
 * the caller's workspace, then a flash-attention kernel runs Q K^T with int8 mma (m16n8k32,
 * exact int32 sums) and P V with fp8 e4m3 mma (sm_89+), fp32 online softmax in registers. The
 * same P V product also sums the P codes of each row (l, cquant.h): one more n-tile whose B
 * operand is all ones.
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
 *                  operand can be built from the S accumulators without shuffles.
 * Accuracy bound (cquant.h): stats_reduce zeroes each head's four maxima (max sq, max sq |Qcode|,
 * max sk, max sk |Kcode|, as float bits: non-negative floats order like their bits, NaN above
 * all), quant_q and quant_k raise them with atomicMax, and quant_v's first block of each head
 * turns them into E and the head's flag (full precision where E > the threshold). The 8-bit
 * kernel then skips the flagged heads and the full-precision kernel, launched after it with
 * cq_attn_args.full_heads, computes only those (its CTAs of other heads exit at once: one
 * extra launch per call, a few microseconds when no head is flagged).
 *
 * Files: this header (workspace layout, what the kernels share), attention_int8_prep.cu (the
 * pre-pass and the host side of the mode), attention_int8_mma.cu (the mma.sync kernel, sm_89+),
 * attention_int8_sm90.cu (the wgmma kernel, sm_90a). */
#ifndef CQ_KERNELS_ATTENTION_INT8_CUH
#define CQ_KERNELS_ATTENTION_INT8_CUH

#include <cuda_fp8.h>
#include <limits.h>

#include <type_traits>

#include "attention.cuh"

#define KB 64          /* keys per tile = per K scale (k_block) */
#define PREP_THREADS 256

/* Workspace layout of one call (byte offsets, each region 256-byte aligned). */
struct int8_layout {
  int dp;        /* padded head dim of the specialisation */
  int bm;        /* query rows per CTA */
  int64_t sq_pad, skv_pad, bh;
  size_t qc, kc, vt, sq, sk, sv, kmean, vamax, qbias, psum, pamax, bound, full, total;
};

/* The four maxima of a head's bound slots (int8_layout.bound, CQ_ATTN8_BOUND_SLOTS per head). */
enum { CQ_ATTN8_MAX_SQ = 0, CQ_ATTN8_MAX_QNORM = 1, CQ_ATTN8_MAX_SK = 2, CQ_ATTN8_MAX_KNORM = 3, CQ_ATTN8_BOUND_SLOTS = 4 };

static inline int int8_dp(int d) { return d <= 64 ? 64 : d <= 96 ? 96 : d <= 128 ? 128 : 256; }
static inline int int8_mt(int dp) { return dp <= 128 ? 2 : 1; }

static inline int8_layout int8_layout_of(const cq_attention_dims *n) {
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
  L.sv = take(bh * (size_t)L.dp * 4);
  L.kmean = take(bh * (size_t)L.dp * 4);
  L.vamax = take(bh * (size_t)L.dp * 4);
  L.qbias = take(bh * (size_t)L.sq_pad * 4);
  L.psum = take(bh * nkb * (size_t)L.dp * 4);
  L.pamax = take(bh * nkb * (size_t)L.dp * 4);
  L.bound = take(bh * CQ_ATTN8_BOUND_SLOTS * 4); /* uint32 float bits */
  L.full = take(bh);                             /* uint8 per head: 1 = full precision */
  L.total = off;
  return L;
}

/* log2(448): the softmax produces 448 p = 2^(s - m + log2 448), which e4m3 codes directly. */
#define CQ_LOG2_448 8.807354922057604f
/* Four e4m3 ones (0 0111 000): the B operand that turns a P V product into the sum of P's codes. */
#define CQ_E4M3_ONES 0x38383838u

/* fp8 e4m3 codes of 4 probabilities already scaled by 448 (RNE, saturating), slot order x0..x3. */
__device__ __forceinline__ uint32_t cq_p_fp8x4(float x0, float x1, float x2, float x3) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(x0, x1), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(x2, x3), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

/* x + 1.5 * 2^23 as fp32, exact for |x| < 2^22 (a score of int8 codes over up to 256 dims is below
 * 127^2 * 256): an integer add instead of I2F, which would share the 16-per-clock pipe with the
 * EX2 of each score. The softmax folds the subtraction of 1.5 * 2^23 into its fma. */
#define CQ_I2F_MAGIC 12582912.0f
__device__ __forceinline__ float cq_i2f22_biased(int x) { return __int_as_float(x + 0x4B400000); }

/* The reference's online softmax step for the two rows (g, g + 8) a thread holds of one tile of
 * int8 scores si (mma fragment order: element e of n-tile n of row half hh at 4 n + 2 hh + e):
 * s = dot * (sq * sk), m' = max(m, max s), alpha = 2^(m - m'), p = 448 * 2^(s - m') (P's e4m3
 * scale applied: the caller codes p as is). l is not summed here: the P V product sums the
 * codes (cquant.h). The max is taken on the integer dots (sq * sk >= 0, and rounding is
 * monotonic); with TAIL, keys at or past kv_left (relative to 2 t) are left out and get p = 0.
 * One fma a score: (dot + 1.5 * 2^23) * sqk - c with c = 1.5 * 2^23 * sqk + m' - log2 448 rounded
 * once, an error in the exponent below 2^-24 |c| (about sqk: one step of the integer dot). */

/* This thread's max of row half hh of the tile (independent chains: the max is on the critical path). */
template <bool TAIL, int NS>
__device__ __forceinline__ int cq_attn8_thread_max(const int (&si)[4 * NS], int hh, int kv_left) {
  static_assert(NS % 2 == 0, "two independent chains per reduction");
  int mx[4] = {INT_MIN, INT_MIN, INT_MIN, INT_MIN};
#pragma unroll
  for (int n = 0; n < NS; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e)
      if (!TAIL || n * 8 + e < kv_left) mx[2 * (n % 2) + e] = max(mx[2 * (n % 2) + e], si[4 * n + 2 * hh + e]);
  return max(max(mx[0], mx[1]), max(mx[2], mx[3]));
}

/* m' from the row's integer max mi, alpha = 2^(m - m'); returns the fma constant c. */
__device__ __forceinline__ float cq_attn8_raise(float &m, float &alpha, int mi, float sqk) {
  const float m_new = fmaxf(m, (float)mi * sqk);
  const float m_use = m_new == -INFINITY ? 0.f : m_new;
  alpha = cq_exp2(m - m_use);
  m = m_new;
  return fmaf(CQ_I2F_MAGIC, sqk, m_use - CQ_LOG2_448);
}

/* p = 448 * 2^(s - m') of row half hh of the tile. */
template <bool TAIL, int NS>
__device__ __forceinline__ void cq_attn8_exp(const int (&si)[4 * NS], float (&p)[4 * NS], int hh, float sqk, float c,
                                             int kv_left) {
#pragma unroll
  for (int n = 0; n < NS; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float pe = cq_exp2(fmaf(cq_i2f22_biased(si[4 * n + 2 * hh + e]), sqk, -c));
      if (TAIL && n * 8 + e >= kv_left) pe = 0.f;
      p[4 * n + 2 * hh + e] = pe;
    }
}

template <bool TAIL, int NS>
__device__ __forceinline__ void cq_attn8_softmax(const int (&si)[4 * NS], float (&p)[4 * NS], const float (&qs)[2],
                                                 float skj, int kv_left, float (&m)[2], float (&alpha)[2]) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    int mi = cq_attn8_thread_max<TAIL, NS>(si, hh, kv_left);
    mi = max(mi, __shfl_xor_sync(0xffffffffu, mi, 1));
    mi = max(mi, __shfl_xor_sync(0xffffffffu, mi, 2));
    const float sqk = qs[hh] * skj;
    const float c = cq_attn8_raise(m[hh], alpha[hh], mi, sqk);
    cq_attn8_exp<TAIL, NS>(si, p, hh, sqk, c, kv_left);
  }
}

/* cq_attn8_softmax over two consecutive full tiles a and b (no tail), both maxima reduced before
 * any exponential: the same operations and roundings as two calls in order, more of them
 * independent. */
template <int NS>
__device__ __forceinline__ void cq_attn8_softmax2(const int (&sa)[4 * NS], const int (&sb)[4 * NS], float (&pa)[4 * NS],
                                                  float (&pb)[4 * NS], const float (&qs)[2], float ska, float skb,
                                                  float (&m)[2], float (&alpha_a)[2], float (&alpha_b)[2]) {
  int mi[2][2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh)
    mi[hh][0] = cq_attn8_thread_max<false, NS>(sa, hh, 0), mi[hh][1] = cq_attn8_thread_max<false, NS>(sb, hh, 0);
#pragma unroll
  for (int sh = 1; sh <= 2; sh *= 2)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int x = 0; x < 2; ++x) mi[hh][x] = max(mi[hh][x], __shfl_xor_sync(0xffffffffu, mi[hh][x], sh));
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const float sqa = qs[hh] * ska, sqb = qs[hh] * skb;
    const float ca = cq_attn8_raise(m[hh], alpha_a[hh], mi[hh][0], sqa);
    const float cb = cq_attn8_raise(m[hh], alpha_b[hh], mi[hh][1], sqb);
    cq_attn8_exp<false, NS>(sa, pa, hh, sqa, ca, 0);
    cq_attn8_exp<false, NS>(sb, pb, hh, sqb, cb, 0);
  }
}

/* Whether head (b, h) went to the full-precision kernel (cq_attn_args.full_heads): its 8-bit
 * CTAs return before any barrier (b and h come from blockIdx, so the whole CTA returns). */
__device__ __forceinline__ bool cq_attn8_head_skipped(const cq_attn_args &a, int b, int h) {
  return a.full_heads != NULL && a.full_heads[(int64_t)b * a.full_heads_sb + h] != 0;
}

struct cq_attn8_ptrs {
  const int8_t *qc, *kc;
  const uint8_t *vt;
  const float *sq, *sk, *sv, *qbias;
  int64_t sq_pad, skv_pad;
};

/* The main kernel of padded head dim dp (int8_dp) for T = bf16 (is_bf16) or fp16:
 * mma.sync (attention_int8_mma.cu) or wgmma (attention_int8_sm90.cu, dp <= 128). */
cq_status cq_attn8_mma_launch(int is_bf16, int dp, const cq_attn_args &a, const cq_attn8_ptrs &w, cudaStream_t stream);
cq_status cq_attn8_sm90_launch(int is_bf16, int dp, const cq_attn_args &a, const cq_attn8_ptrs &w,
                               cudaStream_t stream);

#endif /* CQ_KERNELS_ATTENTION_INT8_CUH */
