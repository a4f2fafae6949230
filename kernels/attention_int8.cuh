/* 8-bit attention (see cquant.h for the math): a pre-pass quantizes Q, K (smoothed) and V into
 * the caller's workspace, then a flash-attention kernel runs Q K^T with int8 mma (exact int32
 * sums) and P V with u8 x s8 mma (exact int32 sums of a tile's 128 keys), the softmax and the
 * fold into O in fp32 registers. P is coded at each tile's own max; the row sums of its codes
 * (l) come from dp4a on the packed codes.
 *
 * Pre-pass (all reads of q, k, v are strided [B, S, H, D]; outputs dense, zero-padded):
 * (16-byte loads: rows are 16-byte aligned and head_dim is a multiple of 8)
 *   stats_partial  per (head, KB keys): fp32 column sums of K and column amax of V
 *   stats_reduce   per head: kmean (fp64 sum of the partials / Skv), V amax
 *   quant_q        per (head, q_block rows): int8 codes of q * scale * log2(e), per-row scale
 *                  and, when the call returns the log-sum-exp, q' . kmean
 *   quant_k        per (head, KB keys): int8 codes of k - kmean, one scale
 *   quant_v        per (head, 64 keys): int8 codes of v / sv, written transposed (V^T rows
 *                  are head dims) with the keys of every 16 permuted so that the 8-bit A
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

#include <limits.h>

#include <type_traits>

#include "attention.cuh"

#define KB 128         /* keys per tile = per K scale = per softmax tile (k_block) */
#define PREP_THREADS 256

/* Workspace layout of one call (byte offsets, each region 256-byte aligned). */
struct int8_layout {
  int dp;        /* padded head dim of the specialisation */
  int bm;        /* query rows per CTA */
  int64_t sq_pad, skv_pad, bh;
  int64_t split_max; /* query blocks of the wgmma kernel whose keys may be split in two halves */
  size_t qc, kc, vt, sq, sk, sv, kmean, vamax, qbias, psum, pamax, bound, full, split_cnt, split_part, total;
};

/* The four maxima of a head's bound slots (int8_layout.bound, CQ_ATTN8_BOUND_SLOTS per head). */
enum { CQ_ATTN8_MAX_SQ = 0, CQ_ATTN8_MAX_QNORM = 1, CQ_ATTN8_MAX_SK = 2, CQ_ATTN8_MAX_KNORM = 3, CQ_ATTN8_BOUND_SLOTS = 4 };

static inline int int8_dp(int d) { return d <= 64 ? 64 : d <= 96 ? 96 : d <= 128 ? 128 : 256; }

/* Query rows of a CTA of the wgmma kernel (three warpgroups of 64), and the most of its query
 * blocks a call splits (attention_int8_sm90.cu: those of a last wave no more than half full, so
 * at most half the SMs: 66 on an H100 / H200; a device with more leaves larger remainders whole).
 * Each split block takes 2 x (dp / 2 + 4) x 384 fp32 words of workspace, 204 KB at dp = 128. */
#define CQ_ATTN8_SM90_BM 192
#define CQ_ATTN8_SPLIT_MAX 66
/* fp32 words a consumer thread of the wgmma kernel keeps for a split block's merge: O (dp / 2),
 * m and l of its two rows; 384 consumer threads. */
__host__ __device__ inline int64_t int8_split_words(int dp) { return (int64_t)(dp / 2 + 4) * 384; }
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
  const int64_t blocks = (n->seq_q + CQ_ATTN8_SM90_BM - 1) / CQ_ATTN8_SM90_BM * L.bh;
  L.split_max = L.dp <= 128 ? (blocks < CQ_ATTN8_SPLIT_MAX ? blocks : CQ_ATTN8_SPLIT_MAX) : 0;
  L.split_cnt = take((size_t)L.split_max * 4);                            /* uint32 per split block */
  L.split_part = take((size_t)L.split_max * 2 * int8_split_words(L.dp) * 4); /* both halves' partials */
  L.total = off;
  return L;
}

/* log2(255): the softmax forms 255 p = 2^(s - mt + log2 255), whose nearest integer is P's code. */
#define CQ_LOG2_255 7.994353436858858f

/* x + 1.5 * 2^23 as fp32, exact for |x| < 2^22 (a score of int8 codes over up to 256 dims is below
 * 127^2 * 256; a tile's P V sum below 128 * 255 * 127): an integer add instead of I2F, which would
 * share the 16-per-clock pipe with the EX2 of each score. */
#define CQ_I2F_MAGIC 12582912.0f
__device__ __forceinline__ float cq_i2f22_biased(int x) { return __int_as_float(x + 0x4B400000); }
/* x as fp32, exactly, for |x| < 2^22 (two ALU instructions: the fold of P V with I2FP instead
 * issued 8% fewer instructions yet ran no faster on an H200, IPC 2.10 against 2.32). */
__device__ __forceinline__ float cq_i2f22(int x) { return __fsub_rn(cq_i2f22_biased(x), CQ_I2F_MAGIC); }

/* The low bytes of four codes held as x + 1.5 * 2^23 in fp32 (the fp32 add rounds x to nearest
 * even and leaves the integer's two's complement low byte in the word), t0 lowest. */
__device__ __forceinline__ uint32_t cq_low_bytes4(float t0, float t1, float t2, float t3) {
  return __byte_perm(__byte_perm(__float_as_uint(t0), __float_as_uint(t1), 0x0040u),
                     __byte_perm(__float_as_uint(t2), __float_as_uint(t3), 0x0040u), 0x5410u);
}

/* The u8 codes RNE(x0) .. RNE(x3) (each x in [0, 255.5)) as the bytes of a word, x0 lowest. */
__device__ __forceinline__ uint32_t cq_p_u8x4(float x0, float x1, float x2, float x3) {
  return cq_low_bytes4(__fadd_rn(x0, CQ_I2F_MAGIC), __fadd_rn(x1, CQ_I2F_MAGIC), __fadd_rn(x2, CQ_I2F_MAGIC),
                       __fadd_rn(x3, CQ_I2F_MAGIC));
}

/* This thread's max of row half hh of a tile of int8 scores si (mma fragment order: element e
 * of n-tile n of row half hh at 4 n + 2 hh + e); with TAIL, keys at or past kv_left (relative to
 * 2 t) are left out. Independent chains: the max is on the critical path. */
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

/* The reference's online softmax step (cquant.h) for one tile of k_block = 8 NS keys, rows g and
 * g + 8 of a thread's quad (row half hh): s = dot * (sq * sk),
 *   mt = max s over the tile (taken on the integer dots: sq * sk >= 0, rounding is monotonic),
 *   m' = max(m, mt), alpha = 2^(m - m'), beta = 2^(mt - m'), m = m',
 *   P's codes RNE(255 * 2^(s - mt)) (u8), packed as the A operands of P V: k32 step ks holds
 *   n-tiles 4 ks .. 4 ks + 3, words 0 and 2 row g, 1 and 3 row g + 8, each word keys 2t, 2t+1 of
 *   two n-tiles (the key order of V^T, cq_attn8_slot_key),
 *   ls = the row's sum of codes (an exact integer, the same in the whole quad).
 * With TAIL, keys at or past kv_left (relative to 2 t) get code 0 and stay out of the max.
 * One fma a score: (dot + 1.5 * 2^23) * sqk - c with c = 1.5 * 2^23 * sqk + mt - log2 255 rounded
 * once, an error in the exponent below 2^-24 |c| (about sqk: one step of the integer dot). */
template <bool TAIL, int NS>
__device__ __forceinline__ void cq_attn8_tile_softmax(const int (&si)[4 * NS], uint32_t (&pa)[NS / 4][4],
                                                      const float (&qs)[2], float sk, int kv_left, float (&m)[2],
                                                      float (&alpha)[2], float (&beta)[2], int (&ls)[2]) {
  static_assert(NS % 4 == 0, "whole k32 steps");
  int mi[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) mi[hh] = cq_attn8_thread_max<TAIL, NS>(si, hh, kv_left);
#pragma unroll
  for (int sh = 1; sh <= 2; sh *= 2)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) mi[hh] = max(mi[hh], __shfl_xor_sync(0xffffffffu, mi[hh], sh));
  float sqk[2], c[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    sqk[hh] = qs[hh] * sk;
    const float mt = (float)mi[hh] * sqk[hh], m_new = fmaxf(m[hh], mt);
    alpha[hh] = cq_exp2(m[hh] - m_new);
    beta[hh] = cq_exp2(mt - m_new);
    m[hh] = m_new;
    c[hh] = fmaf(CQ_I2F_MAGIC, sqk[hh], mt - CQ_LOG2_255);
  }
  auto code = [&](int n, int hh, int e) {
    const float x = cq_exp2(fmaf(cq_i2f22_biased(si[4 * n + 2 * hh + e]), sqk[hh], -c[hh]));
    return TAIL && n * 8 + e >= kv_left ? 0.f : x;
  };
#pragma unroll
  for (int ks = 0; ks < NS / 4; ++ks)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int n0 = 4 * ks;
      pa[ks][hh] = cq_p_u8x4(code(n0, hh, 0), code(n0, hh, 1), code(n0 + 1, hh, 0), code(n0 + 1, hh, 1));
      pa[ks][2 + hh] = cq_p_u8x4(code(n0 + 2, hh, 0), code(n0 + 2, hh, 1), code(n0 + 3, hh, 0), code(n0 + 3, hh, 1));
    }
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    unsigned sum = 0;
#pragma unroll
    for (int ks = 0; ks < NS / 4; ++ks) sum = __dp4a(pa[ks][hh], 0x01010101u, __dp4a(pa[ks][2 + hh], 0x01010101u, sum));
    int v = (int)sum;
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    ls[hh] = v;
  }
}

/* O and l after a tile (cquant.h): o = o * alpha + beta * A, l = l * alpha + beta * ls, in this
 * rounding (the C reference's): A the tile's exact integer P V sums, converted exactly. */
__device__ __forceinline__ float cq_attn8_fold(float o, float alpha, float beta, int acc) {
  return fmaf(beta, cq_i2f22(acc), o * alpha);
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
  int64_t split_max;     /* the wgmma kernel's: at most this many split blocks */
  uint32_t *split_cnt;   /* per split block: halves done (zeroed by the pre-pass, back to 0 after) */
  float *split_part;     /* per split block and half: the consumers' O, m and l */
};

/* The main kernel of padded head dim dp (int8_dp) for T = bf16 (is_bf16) or fp16:
 * mma.sync (attention_int8_mma.cu) or wgmma (attention_int8_sm90.cu, dp <= 128). */
cq_status cq_attn8_mma_launch(int is_bf16, int dp, const cq_attn_args &a, const cq_attn8_ptrs &w, cudaStream_t stream);
cq_status cq_attn8_sm90_launch(int is_bf16, int dp, const cq_attn_args &a, const cq_attn8_ptrs &w,
                               cudaStream_t stream);

#endif /* CQ_KERNELS_ATTENTION_INT8_CUH */
