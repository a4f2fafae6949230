/* The 8-bit attention kernel on wgmma (sm_90a; attention_int8.cuh): the same math with wgmma, warp-specialized like the bf16 kernel (attention_sm90.cu): one
 * producer warpgroup copies the Q codes once and the K code tiles and V^T code tiles of KB = 64
 * keys (so P is quantized at the same running maxima as the reference) into rings of A8_STAGES
 * stages, five tiles in flight; two consumer warpgroups of 64 query rows (BM = 128, as the
 * workspace's padding). Tiles in wgmma's no-swizzle canonical layout (8 rows x 16 bytes per
 * core matrix); int8 S = Q K^T from shared memory, fp8 P V with P in registers and V^T K-major
 * (8-bit wgmma takes K-major operands only, which V^T is). At tile j a consumer warpgroup issues
 * S_j and P_{j-1} V_{j-1} (into fresh fp32 accumulators, so the fp8 tensor-core sums cover 64
 * products) together, runs the softmax of tile j under the second, then folds it into O:
 * O = O * alpha_{j-1} + P_{j-1} V_{j-1}. Switched like the bf16 kernel (cq_attn_sm90_mode). */

#include "attention_int8.cuh"
#include "attention_wgmma.cuh"

namespace {

#define A8_STAGES 6    /* K and V^T tiles of 64 keys in the rings */
#define A8_AHEAD 4     /* tiles a producer thread keeps in flight beyond the one it publishes (< A8_STAGES;
                          one less than that leaves a released slot's consumer a step of slack) */

template <int DP> struct cq_attn8_pv_sm90;
#ifdef CQ_SM90A_DEVICE
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
#ifdef CQ_SM90A_DEVICE
  constexpr int BM = 128, NS = KB / 8, NO = DP / 8;
  constexpr uint32_t Q_BYTES = BM * DP, TILE_BYTES = KB * DP; /* a K tile and a V^T tile are both 64 x DP bytes */
  extern __shared__ __align__(1024) unsigned char cq_attn8_sm90_smem[];
  const uint32_t sQ = cq_smem_addr(cq_attn8_sm90_smem), sK = sQ + Q_BYTES, sV = sK + A8_STAGES * TILE_BYTES;
  const uint32_t bars = sV + A8_STAGES * TILE_BYTES; /* Q full, then K full, K empty, V full, V empty per stage */
  const uint32_t q_full = bars, k_full = bars + 8, k_empty = k_full + 8 * A8_STAGES;
  const uint32_t v_full = k_empty + 8 * A8_STAGES, v_empty = v_full + 8 * A8_STAGES;

  const int q0 = blockIdx.x * BM, h = blockIdx.y, b = blockIdx.z;
  if (cq_attn8_head_skipped(a, b, h)) return; /* the full-precision kernel's head; before any barrier */
  const int64_t bh = (int64_t)b * a.heads + h;
  const int n_tiles = (a.seq_kv + KB - 1) / KB;

  if (threadIdx.x == 0) {
    cq_mbar_init(q_full, 128);
    for (int st = 0; st < A8_STAGES; ++st) {
      cq_mbar_init(k_full + 8 * st, 64);
      cq_mbar_init(v_full + 8 * st, 64);
      cq_mbar_init(k_empty + 8 * st, 8); /* lane 0 of every consumer warp */
      cq_mbar_init(v_empty + 8 * st, 8);
    }
  }
  __syncthreads();

  if (threadIdx.x < 128) {
    /* ------------------------------------------------------------ producer */
    cq_setmaxnreg_dec<40>();
    const int pt = threadIdx.x;
    cq_attn8_copy<BM, DP, 128>(sQ, (const uint8_t *)w.qc + (bh * w.sq_pad + q0) * DP, DP, pt);
    cq_cp_async_commit();
    cq_cp_async_wait<0>();
    cq_fence_proxy_async();
    cq_mbar_arrive(q_full);

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
    cq_setmaxnreg_inc<232>();
    const int wg = threadIdx.x / 128 - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const uint32_t my_turn = 1 + wg, next_turn = 1 + (wg + 1) % 2;
    if (wg == 0) cq_bar_arrive(my_turn, 256); /* the first warpgroup starts */

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
      cq_fence_regs(si);
      cq_wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < DP / 32; ++kk) cq_wgmma_m64n64k32_s8_ss(si, dq + kk * 16, dk + kk * 16, kk > 0);
      cq_wgmma_commit();
    };
    auto issue_pv = [&](int stage) { /* acc = P V (fresh) */
      const uint64_t dv = dv0 + stage * D_STAGE;
      cq_fence_regs(acc);
#pragma unroll
      for (int ks = 0; ks < KB / 32; ++ks) cq_fence_regs(pa[ks]);
      cq_wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < KB / 32; ++ks) cq_attn8_pv_sm90<DP>::run(acc, pa[ks], dv + ks * 16, ks > 0);
      cq_wgmma_commit();
    };
    auto release = [&](uint32_t bar) {
      if (lane == 0) cq_mbar_arrive(bar);
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

    cq_mbar_wait(q_full, 0);
    cq_mbar_wait(k_full, 0);
    issue_s(0);
    cq_wgmma_wait<0>();
    cq_fence_regs(si);
    release(k_empty);
    if (n_tiles == 1 && tail) softmax(0, cq_bool_tag<true>(), alpha_prev);
    else softmax(0, cq_bool_tag<false>(), alpha_prev);
    pack();

    auto step = [&](int j, auto tail_tag) {
      const int sk_ = j % A8_STAGES, sv = (j - 1) % A8_STAGES;
      cq_mbar_wait(k_full + 8u * sk_, (j / A8_STAGES) & 1);
      cq_bar_sync(my_turn, 256);
      issue_s(sk_);
      cq_mbar_wait(v_full + 8u * sv, ((j - 1) / A8_STAGES) & 1);
      issue_pv(sv);
      cq_bar_arrive(next_turn, 256);
      cq_wgmma_wait<1>();
      cq_fence_regs(si);
      release(k_empty + 8u * sk_);
      float alpha[2];
      softmax(j, tail_tag, alpha);
      cq_wgmma_wait<0>();
      cq_fence_regs(acc);
      cq_fence_regs(p);
      release(v_empty + 8u * sv);
      fold();
      alpha_prev[0] = alpha[0], alpha_prev[1] = alpha[1];
      pack();
    };
    const int n_full = tail ? n_tiles - 1 : n_tiles;
    for (int j = 1; j < n_full; ++j) step(j, cq_bool_tag<false>());
    if (tail && n_tiles > 1) step(n_tiles - 1, cq_bool_tag<true>());

    const int sv = (n_tiles - 1) % A8_STAGES;
    cq_mbar_wait(v_full + 8u * sv, ((n_tiles - 1) / A8_STAGES) & 1);
    issue_pv(sv);
    cq_wgmma_wait<0>();
    cq_fence_regs(acc);
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
      if (a.lse && t == 0) a.lse[(int64_t)b * a.lse_sb + (int64_t)h * a.seq_q + row] = (m[hh] + __log2f(lsum) + w.qbias[bh * w.sq_pad + row]) / CQ_LOG2E;
    }
  }
#else
  (void)a, (void)w;
  __trap(); /* built without the sm_90a target: the launcher is not reached on such builds */
#endif
}

template <typename T, int DP>
cq_status launch(const cq_attn_args &a, const cq_attn8_ptrs &w, cudaStream_t stream) {
  const size_t smem = (size_t)128 * DP + 2 * A8_STAGES * (size_t)KB * DP + 8 * (1 + 4 * A8_STAGES);
  auto kernel = cq_attn8_fwd_sm90<T, DP>;
  CQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  dim3 grid((unsigned)((a.seq_q + 127) / 128), (unsigned)a.heads, (unsigned)a.batch);
  kernel<<<grid, 384, smem, stream>>>(a, w);
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
