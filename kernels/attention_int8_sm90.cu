/* The 8-bit attention kernel on wgmma (sm_90a; attention_int8.cuh), warp-specialized like the
 * bf16 kernel (attention_sm90.cu): one producer thread loads the Q codes once and, per step, a
 * tile of KB = 128 keys (one softmax tile of the math) of K codes and of V^T codes with TMA into
 * rings of A8_STAGES stages, 128-byte swizzled (each code row is one 128-byte slab: head dims
 * below 128 read as zeros past dp). Three consumer warpgroups of 64 query rows (BM = 192; rows
 * past the workspace's padding of 128 read as zeros and are never stored).
 *
 * A step of a consumer warpgroup, in order: int8 S = Q K^T for the tile (m64n128k32, both
 * operands from shared memory: N = 128 keeps the tensor cores ahead of the shared-memory reads),
 * the reference's online softmax of the tile (cq_attn8_tile_softmax: u8 P codes at the tile's
 * max in registers, alpha, beta and the exact sum of the codes), the exact int32 sums A = P V
 * with V^T K-major (8-bit wgmma takes K-major operands only; m64nDPk32 u8 x s8, fresh each tile),
 * and the fold into O in fp32: O = O alpha + beta A (cq_attn8_fold). S and A share registers
 * (each is dead while the other lives), which is what fits a step in 160 registers; the other
 * two warpgroups' wgmma run under a warpgroup's softmax and fold. A last wave of CTAs at most half
 * full runs as twice the CTAs, each over half of its block's keys; the second half to finish
 * merges the two (cquant.h). Switched like the bf16 kernel (cq_attn_sm90_mode). */

#include "attention_int8.cuh"
#include "attention_wgmma.cuh"
#include "tensor_map.cuh"

namespace {

#define A8_STAGES 4 /* K and V^T tiles of 128 keys in the rings */
constexpr int A8_KT = KB;        /* keys per step: one softmax tile */
/* Consumer warpgroups of 64 query rows a CTA. Three at 160 registers, each running its steps in
 * order, kept the tensor cores busier than two at 240 that overlapped one step's P V with the next
 * one's S (H200: 402 against 448 us at Flux 1024, 4229 against 4931 us at 2048). */
constexpr int A8_WGS = 3;
static_assert(64 * A8_WGS == CQ_ATTN8_SM90_BM, "the workspace's split partials assume this CTA");
constexpr uint32_t A8_ROW = 128; /* bytes per code row in shared memory (one swizzle slab) */

template <int DP> struct a8_cfg {
  static constexpr int BM = 64 * A8_WGS; /* query rows per CTA */
  static constexpr uint32_t Q_BYTES = BM * A8_ROW, K_BYTES = A8_KT * A8_ROW, V_BYTES = DP * A8_ROW;
  static constexpr uint32_t BAR_OFFSET = Q_BYTES + A8_STAGES * (K_BYTES + V_BYTES);
  /* mbarriers: Q full, then K full, K empty, V full, V empty per stage; + 1 KB for alignment */
  static constexpr size_t SMEM = BAR_OFFSET + 8 * (1 + 4 * A8_STAGES) + 1024;
  static_assert(SMEM <= 232448, "shared memory");
};

template <typename T, int DP>
__global__ void __launch_bounds__(128 * (A8_WGS + 1), 1)
    cq_attn8_fwd_sm90(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                      const __grid_constant__ CUtensorMap map_v, const cq_attn_args a, const cq_attn8_ptrs w,
                      int split_from) {
#ifdef CQ_SM90A_DEVICE
  using C = a8_cfg<DP>;
  constexpr int NO = DP / 8, NS = A8_KT / 8;
  extern __shared__ unsigned char cq_attn8_sm90_smem[];
  const uint32_t raw = cq_smem_addr(cq_attn8_sm90_smem);
  const uint32_t sQ = (raw + 1023u) & ~1023u, sK = sQ + C::Q_BYTES, sV = sK + A8_STAGES * C::K_BYTES;
  const uint32_t bars = sQ + C::BAR_OFFSET; /* Q full, then K full, K empty, V full, V empty per stage */
  const uint32_t q_full = bars, k_full = bars + 8, k_empty = k_full + 8 * A8_STAGES;
  const uint32_t v_full = k_empty + 8 * A8_STAGES, v_empty = v_full + 8 * A8_STAGES;

  /* CTA c < split_from: query block c, all keys; past it, two CTAs a block, each half of its
   * steps (the last wave of blocks, so that it takes half the time; merged below) */
  const int nq = (a.seq_q + C::BM - 1) / C::BM, c = blockIdx.x;
  const int blk = c < split_from ? c : split_from + (c - split_from) / 2, half = c < split_from ? -1 : (c - split_from) % 2;
  const int q0 = blk % nq * C::BM, h = blk / nq % a.heads, b = blk / nq / a.heads;
  if (cq_attn8_head_skipped(a, b, h)) return; /* the full-precision kernel's head; before any barrier */
  const int64_t bh = (int64_t)b * a.heads + h;
  const int n_total = (a.seq_kv + A8_KT - 1) / A8_KT, mid = (n_total + 1) / 2;
  const int j0 = half == 1 ? mid : 0, n_steps = half < 0 ? n_total : half == 0 ? mid : n_total - mid;

  if (threadIdx.x == 0) {
    cq_mbar_init(q_full, 1);
    for (int st = 0; st < A8_STAGES; ++st) {
      cq_mbar_init(k_full + 8 * st, 1);
      cq_mbar_init(v_full + 8 * st, 1);
      cq_mbar_init(k_empty + 8 * st, 4 * A8_WGS); /* lane 0 of every consumer warp */
      cq_mbar_init(v_empty + 8 * st, 4 * A8_WGS);
    }
    cq_mbar_init_fence();
  }
  __syncthreads();

  if (threadIdx.x < 128) {
    /* ------------------------------------------------------------ producer */
    cq_setmaxnreg_dec<24>();
    if (threadIdx.x == 0) {
      cq_mbar_arrive_expect_tx(q_full, C::Q_BYTES);
      cq_tma_load_3d(sQ, &map_q, q_full, 0, q0, (int32_t)bh);
      for (int j = 0; j < n_steps; ++j) {
        const int st = j % A8_STAGES;
        const uint32_t phase = ((j / A8_STAGES) & 1) ^ 1; /* a fresh slot counts as released */
        cq_mbar_wait(k_empty + 8u * st, phase);
        cq_mbar_arrive_expect_tx(k_full + 8u * st, C::K_BYTES);
        cq_tma_load_3d(sK + st * C::K_BYTES, &map_k, k_full + 8u * st, 0, (j0 + j) * A8_KT, (int32_t)bh);
        cq_mbar_wait(v_empty + 8u * st, phase);
        cq_mbar_arrive_expect_tx(v_full + 8u * st, C::V_BYTES);
        cq_tma_load_3d(sV + st * C::V_BYTES, &map_v, v_full + 8u * st, (j0 + j) * A8_KT, 0, (int32_t)bh);
      }
    }
  } else {
    /* ------------------------------------------------------------ consumers */
    cq_setmaxnreg_inc<160>(); /* 128 x 24 + 384 x 160 <= 65536 */
    const int wg = threadIdx.x / 128 - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;

    float o[DP / 2], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, qs[2];
    int si[4 * NS], acc[DP / 2];
    uint32_t pa[NS / 4][4]; /* P's codes, the A operands of P V */
#pragma unroll
    for (int i = 0; i < DP / 2; ++i) o[i] = 0.f;
    const int row_base = q0 + wg * 64 + warp * 16 + g;
    /* rows past the workspace's padding (BM = 192 against its 128) are never stored */
    qs[0] = row_base < w.sq_pad ? w.sq[bh * w.sq_pad + row_base] : 0.f;
    qs[1] = row_base + 8 < w.sq_pad ? w.sq[bh * w.sq_pad + row_base + 8] : 0.f;
    const float *sk = w.sk + bh * (w.skv_pad / KB) + j0; /* step j's K scale: sk[j] */

    const uint64_t dq = cq_wgmma_desc_sw128(sQ + (uint32_t)wg * 64 * A8_ROW, 16), dk0 = cq_wgmma_desc_sw128(sK, 16),
                   dv0 = cq_wgmma_desc_sw128(sV, 16);
    auto release = [&](uint32_t bar) {
      if (lane == 0) cq_mbar_arrive(bar);
    };
    auto issue_s = [&](int st) {
      const uint64_t dk = dk0 + st * (C::K_BYTES >> 4);
      cq_wgmma_fence();
      cq_wgmma_m64n128k32_s8_ss_fresh(si, dq, dk); /* si's old values are dead: no fence keeps them */
#pragma unroll
      for (int kk = 1; kk < DP / 32; ++kk) cq_wgmma_m64n128k32_s8_ss(si, dq + kk * 2, dk + kk * 2, 1);
      cq_wgmma_commit();
    };
    /* acc = P V over stage st's tile: 4 k32 steps of 32 keys (each 32 bytes into the swizzled rows) */
    auto issue_pv = [&](int st, uint32_t (&p)[NS / 4][4]) {
      const uint64_t dv = dv0 + st * (C::V_BYTES >> 4);
#pragma unroll
      for (int ks = 0; ks < NS / 4; ++ks) cq_fence_regs(p[ks]);
      cq_wgmma_fence();
      cq_wgmma_u8s8_rs_fresh<DP>(acc, p[0], dv);
#pragma unroll
      for (int ks = 1; ks < NS / 4; ++ks) cq_wgmma_u8s8_rs<DP>(acc, p[ks], dv + ks * 2, 1);
      cq_wgmma_commit();
    };
    /* O = O alpha + beta acc, l = l alpha + beta ls; O * alpha skipped where every row of the warp
     * kept its max (alpha = 1: the same value) */
    auto fold = [&](const float (&alpha)[2], const float (&beta)[2], const int (&ls)[2]) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) l[hh] = fmaf(beta[hh], (float)ls[hh], l[hh] * alpha[hh]);
      if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int i = 0; i < DP / 2; ++i) o[i] = cq_attn8_fold(o[i], alpha[(i >> 1) & 1], beta[(i >> 1) & 1], acc[i]);
      } else {
#pragma unroll
        for (int i = 0; i < DP / 2; ++i) o[i] = fmaf(beta[(i >> 1) & 1], cq_i2f22(acc[i]), o[i]);
      }
    };
    auto softmax = [&](int j, uint32_t (&p)[NS / 4][4], float (&alpha)[2], float (&beta)[2], int (&ls)[2]) {
      if (j0 + j == n_total - 1 && a.seq_kv % A8_KT != 0)
        cq_attn8_tile_softmax<true, NS>(si, p, qs, sk[j], a.seq_kv - (j0 + j) * A8_KT - 2 * t, m, alpha, beta, ls);
      else
        cq_attn8_tile_softmax<false, NS>(si, p, qs, sk[j], 0, m, alpha, beta, ls);
    };

    float alpha[2], beta[2];
    int ls[2];
    cq_mbar_wait(q_full, 0);
    /* each step in order: S_j, its softmax, P_j V_j, the fold */
    for (int j = 0; j < n_steps; ++j) {
      const int st = j % A8_STAGES;
      const uint32_t phase = (j / A8_STAGES) & 1;
      cq_mbar_wait(k_full + 8u * st, phase);
      issue_s(st);
      cq_wgmma_wait<0>();
      cq_fence_regs(si);
      release(k_empty + 8u * st);
      softmax(j, pa, alpha, beta, ls);
      cq_mbar_wait(v_full + 8u * st, phase);
      issue_pv(st, pa);
      cq_wgmma_wait<0>();
      cq_fence_regs(acc);
#pragma unroll
      for (int ks = 0; ks < NS / 4; ++ks) cq_fence_regs(pa[ks]);
      release(v_empty + 8u * st);
      fold(alpha, beta, ls);
    }

    if (half >= 0) {
      /* a split block: each half leaves its O, m and l; the second to finish merges them as two
       * partial softmaxes, m = max(m_0, m_1), O = O_0 2^(m_0 - m) + O_1 2^(m_1 - m), l likewise */
      __shared__ uint32_t s_done;
      const int ct = threadIdx.x - 128, sb = blk - split_from;
      const int64_t words = int8_split_words(DP);
      float *mine = w.split_part + (2 * sb + half) * words + ct, *other = w.split_part + (2 * sb + 1 - half) * words + ct;
#pragma unroll
      for (int i = 0; i < DP / 2; ++i) mine[i * 384] = o[i];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) mine[(DP / 2 + hh) * 384] = m[hh], mine[(DP / 2 + 2 + hh) * 384] = l[hh];
      __threadfence();
      asm volatile("bar.sync 1, 384;" ::: "memory"); /* the consumers' partials written */
      if (ct == 0) s_done = atomicAdd(w.split_cnt + sb, 1u);
      asm volatile("bar.sync 1, 384;" ::: "memory");
      if (s_done == 0) return; /* the other half merges */
      __threadfence();
      if (ct == 0) w.split_cnt[sb] = 0u; /* ready for the next call */
      /* the same roundings whichever half merges (O = O_1 f_1 + O_0 f_0 as one fma): the result
       * does not depend on which CTA finished first */
      auto merge = [&](float mine, float theirs, float f_mine, float f_theirs) {
        return half == 0 ? fmaf(theirs, f_theirs, mine * f_mine) : fmaf(mine, f_mine, theirs * f_theirs);
      };
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const float m1 = __ldcg(other + (DP / 2 + hh) * 384), l1 = __ldcg(other + (DP / 2 + 2 + hh) * 384);
        const float mm = fmaxf(m[hh], m1), f0 = cq_exp2(m[hh] - mm), f1 = cq_exp2(m1 - mm);
#pragma unroll
        for (int n = 0; n < NO; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int i = 4 * n + 2 * hh + e;
            o[i] = merge(o[i], __ldcg(other + i * 384), f0, f1);
          }
        l[hh] = merge(l[hh], l1, f0, f1);
        m[hh] = mm;
      }
    }

    /* out = o / l * sv; lse = (m + log2 l - log2 255 + q'.kmean) / log2(e) */
    T *og = static_cast<T *>(a.out) + b * a.o_sb + h * a.o_sh;
    const float *sv = w.sv + bh * DP;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float lsum = l[hh];
      const float inv = 1.f / lsum;
      const int row = row_base + hh * 8;
      if (row >= a.seq_q) continue;
#pragma unroll
      for (int n = 0; n < NO; ++n) {
        const int col = n * 8 + 2 * t;
        if (col < a.head_dim)
          *reinterpret_cast<uint32_t *>(og + (int64_t)row * a.o_ss + col) =
              cq_pack2<T>(o[4 * n + 2 * hh] * inv * sv[col], o[4 * n + 2 * hh + 1] * inv * sv[col + 1]);
      }
      if (a.lse && t == 0) a.lse[(int64_t)b * a.lse_sb + (int64_t)h * a.seq_q + row] = (m[hh] + (__log2f(lsum) - CQ_LOG2_255) + w.qbias[bh * w.sq_pad + row]) / CQ_LOG2E;
    }
  }
#else
  (void)map_q, (void)map_k, (void)map_v, (void)a, (void)w;
  __trap(); /* built without the sm_90a target: the launcher is not reached on such builds */
#endif
}

/* A 3-d tensor map over the workspace's codes: rows of `inner` bytes (row stride `ld`), `rows`
 * rows per (batch, head), bh of them; boxes of box_inner x box_rows, 128-byte swizzle. */
cq_status a8_map(CUtensorMap *map, const void *data, int64_t inner, int64_t ld, int64_t rows, int64_t bh,
                 int box_inner, int box_rows, const char *what) {
  const uint64_t dims[3] = {(uint64_t)inner, (uint64_t)rows, (uint64_t)bh};
  const uint64_t strides[2] = {(uint64_t)ld, (uint64_t)(ld * rows)};
  const uint32_t box[3] = {(uint32_t)box_inner, (uint32_t)box_rows, 1};
  return cq_tensor_map(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, data, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B,
                       what);
}

template <typename T, int DP>
cq_status launch(const cq_attn_args &a, const cq_attn8_ptrs &w, cudaStream_t stream) {
  using C = a8_cfg<DP>;
  const int64_t bh = (int64_t)a.batch * a.heads;
  CUtensorMap mq, mk, mv;
  CQ_TRY(a8_map(&mq, w.qc, DP, DP, w.sq_pad, bh, A8_ROW, C::BM, "Q codes"));
  CQ_TRY(a8_map(&mk, w.kc, DP, DP, w.skv_pad, bh, A8_ROW, A8_KT, "K codes"));
  CQ_TRY(a8_map(&mv, w.vt, w.skv_pad, w.skv_pad, DP, bh, A8_KT, DP, "V^T codes"));
  auto kernel = cq_attn8_fwd_sm90<T, DP>;
  CQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::SMEM));
  /* One CTA a query block, in waves of one a SM. A last wave at most half full runs twice the CTAs
   * for half the keys each (H200, Flux 1024: 4.36 waves took 399 us where 4.00 took 325). */
  const int64_t blocks = (a.seq_q + C::BM - 1) / C::BM * bh;
  int64_t split = 0;
  int dev = 0;
  cq_device_info info; /* a failed query (no error left behind) means no split */
  if (cudaGetDevice(&dev) != cudaSuccess) cudaGetLastError();
  else if (cq_device_info_get(dev, &info) == CQ_OK && info.sms > 0) {
    const int64_t rest = blocks % info.sms;
    if (2 * rest <= info.sms && rest <= w.split_max && a.seq_kv > A8_KT) split = rest;
  }
  const int64_t ctas = blocks + split;
  if (ctas > INT_MAX) return cq_fail(CQ_ERR_INTERNAL, "8-bit attention (sm_90a): %lld CTAs", (long long)ctas);
  kernel<<<(unsigned)ctas, 128 * (A8_WGS + 1), C::SMEM, stream>>>(mq, mk, mv, a, w, (int)(blocks - split));
  CQ_LAUNCH_CHECK("cq_attn8_fwd_sm90");
  return CQ_OK;
}

template <typename T>
cq_status launch_dp(int dp, const cq_attn_args &a, const cq_attn8_ptrs &w, cudaStream_t stream) {
  switch (dp) {
    case 64: return launch<T, 64>(a, w, stream);
    case 96: return launch<T, 96>(a, w, stream);
    case 128: return launch<T, 128>(a, w, stream);
    default: return cq_fail(CQ_ERR_INTERNAL, "8-bit attention (sm_90a): no kernel for padded head dim %d", dp);
  }
}

}  // namespace

/* The one place where a padded head dim picks the wgmma kernel's specialisation (int8_dp). */
cq_status cq_attn8_sm90_launch(int is_bf16, int dp, const cq_attn_args &a, const cq_attn8_ptrs &w,
                               cudaStream_t stream) {
  return is_bf16 ? launch_dp<__nv_bfloat16>(dp, a, w, stream) : launch_dp<__half>(dp, a, w, stream);
}
