/* The 8-bit attention kernel on wgmma (sm_90a; attention_int8.cuh), warp-specialized like the
 * bf16 kernel (attention_sm90.cu): one producer thread loads the Q codes once and, per step, a
 * tile of 128 keys (two k_block = 64 blocks of the math) of K codes and of V^T codes with TMA
 * into rings of A8_STAGES stages, 128-byte swizzled (each code row is one 128-byte slab: head
 * dims below 128 read as zeros past dp). Two consumer warpgroups of 64 query rows (BM = 128, as
 * the workspace's padding).
 *
 * A step of a consumer warpgroup: int8 S = Q K^T for the 128 keys (m64n128k32, both operands
 * from shared memory: N = 128 keeps the tensor cores ahead of the shared-memory reads), then the
 * reference's online softmax of its two 64-key blocks a and b (running max, alpha_a, alpha_b, P
 * quantized to e4m3 at each block's max; both blocks' maxima reduced first), then with P in
 * registers and V^T K-major (8-bit wgmma takes K-major operands only):
 *   acc = P_a [V_a | 1]  (fresh fp32 accumulators);  acc = acc * alpha_b + P_b [V_b | 1];
 *   O = O * (alpha_a * alpha_b) + acc
 * which is the reference's O = (O alpha_a + P_a V_a) alpha_b + P_b V_b, with tensor-core sums of
 * at most 64 products before each fp32 step (accumulating onto O across all keys instead lost
 * accuracy on long sequences; the scaling of acc is skipped for a warp whose rows kept their
 * max). The columns of ones give l, the sums of the P codes, in the same fp32 steps.
 * S of step j is issued beside P_{j-1,a} V_{j-1,a}; the softmax of step j runs once the step's
 * wgmma are done, while the other warpgroup's run. Switched like the bf16 kernel
 * (cq_attn_sm90_mode). */

#include "attention_int8.cuh"
#include "attention_wgmma.cuh"
#include "tensor_map.cuh"

namespace {

#define A8_STAGES 4 /* K and V^T tiles of 128 keys in the rings */
constexpr int A8_KT = 2 * KB;  /* keys per step */
constexpr int A8_BM = 128;     /* query rows per CTA */
constexpr uint32_t A8_ROW = 128; /* bytes per code row in shared memory (one swizzle slab) */

/* A V^T stage is DP rows of codes (TMA) and 8 rows of e4m3 ones (written once): the P V wgmma's
 * last 8 columns are then the row sums of P's codes, the l of cquant.h. */
template <int DP> struct a8_cfg {
  static constexpr uint32_t Q_BYTES = A8_BM * A8_ROW, K_BYTES = A8_KT * A8_ROW, V_TMA_BYTES = DP * A8_ROW,
                            V_BYTES = (DP + 8) * A8_ROW;
  static constexpr uint32_t BAR_OFFSET = Q_BYTES + A8_STAGES * (K_BYTES + V_BYTES);
  /* mbarriers: Q full, then K full, K empty, V full, V empty per stage; + 1 KB for alignment */
  static constexpr size_t SMEM = BAR_OFFSET + 8 * (1 + 4 * A8_STAGES) + 1024;
  static_assert(SMEM <= 232448, "shared memory");
};

/* acc (+)= P [V | ones]: DP / 2 accumulators of O and 4 of l a thread */
template <int DP> struct cq_attn8_pv_sm90;
#ifdef CQ_SM90A_DEVICE
template <> struct cq_attn8_pv_sm90<64> {
  static __device__ __forceinline__ void run(float (&d)[36], uint32_t (&a)[4], uint64_t b, int acc) {
    cq_wgmma_m64n72k32_e4m3_rs(d, a, b, acc);
  }
};
template <> struct cq_attn8_pv_sm90<96> {
  static __device__ __forceinline__ void run(float (&d)[52], uint32_t (&a)[4], uint64_t b, int acc) {
    cq_wgmma_m64n104k32_e4m3_rs(d, a, b, acc);
  }
};
template <> struct cq_attn8_pv_sm90<128> {
  static __device__ __forceinline__ void run(float (&d)[68], uint32_t (&a)[4], uint64_t b, int acc) {
    cq_wgmma_m64n136k32_e4m3_rs(d, a, b, acc);
  }
};

/* P of one 64-key block (softmax fragment p) as the two k32 A operands of P V. */
__device__ __forceinline__ void a8_pack(uint32_t (&pa)[2][4], const float (&p)[32]) {
#pragma unroll
  for (int ks = 0; ks < 2; ++ks) {
    const int n0 = 4 * ks; /* element (n, e) of the accumulators is p[4 n + e] */
    pa[ks][0] = cq_p_fp8x4(p[4 * n0 + 0], p[4 * n0 + 1], p[4 * (n0 + 1) + 0], p[4 * (n0 + 1) + 1]);
    pa[ks][1] = cq_p_fp8x4(p[4 * n0 + 2], p[4 * n0 + 3], p[4 * (n0 + 1) + 2], p[4 * (n0 + 1) + 3]);
    pa[ks][2] = cq_p_fp8x4(p[4 * (n0 + 2) + 0], p[4 * (n0 + 2) + 1], p[4 * (n0 + 3) + 0], p[4 * (n0 + 3) + 1]);
    pa[ks][3] = cq_p_fp8x4(p[4 * (n0 + 2) + 2], p[4 * (n0 + 2) + 3], p[4 * (n0 + 3) + 2], p[4 * (n0 + 3) + 3]);
  }
}
#endif

template <typename T, int DP>
__global__ void __launch_bounds__(384, 1)
    cq_attn8_fwd_sm90(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                      const __grid_constant__ CUtensorMap map_v, const cq_attn_args a, const cq_attn8_ptrs w) {
#ifdef CQ_SM90A_DEVICE
  using C = a8_cfg<DP>;
  constexpr int NO = DP / 8;
  extern __shared__ unsigned char cq_attn8_sm90_smem[];
  const uint32_t raw = cq_smem_addr(cq_attn8_sm90_smem);
  const uint32_t sQ = (raw + 1023u) & ~1023u, sK = sQ + C::Q_BYTES, sV = sK + A8_STAGES * C::K_BYTES;
  const uint32_t bars = sQ + C::BAR_OFFSET; /* Q full, then K full, K empty, V full, V empty per stage */
  const uint32_t q_full = bars, k_full = bars + 8, k_empty = k_full + 8 * A8_STAGES;
  const uint32_t v_full = k_empty + 8 * A8_STAGES, v_empty = v_full + 8 * A8_STAGES;

  const int q0 = blockIdx.x * A8_BM, h = blockIdx.y, b = blockIdx.z;
  if (cq_attn8_head_skipped(a, b, h)) return; /* the full-precision kernel's head; before any barrier */
  const int64_t bh = (int64_t)b * a.heads + h;
  const int n_blocks = (a.seq_kv + KB - 1) / KB, n_steps = (n_blocks + 1) / 2;

  if (threadIdx.x == 0) {
    cq_mbar_init(q_full, 1);
    for (int st = 0; st < A8_STAGES; ++st) {
      cq_mbar_init(k_full + 8 * st, 1);
      cq_mbar_init(v_full + 8 * st, 1);
      cq_mbar_init(k_empty + 8 * st, 8); /* lane 0 of every consumer warp */
      cq_mbar_init(v_empty + 8 * st, 8);
    }
    cq_mbar_init_fence();
  }
  if (threadIdx.x < 64 * A8_STAGES) { /* the ones rows below each stage's V^T codes, 16 bytes a thread */
    const uint32_t at = sV + (threadIdx.x / 64) * C::V_BYTES + C::V_TMA_BYTES + (threadIdx.x % 64) * 16;
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(at), "r"(CQ_E4M3_ONES) : "memory");
  }
  cq_fence_proxy_async(); /* visible to the wgmma's reads */
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
        cq_tma_load_3d(sK + st * C::K_BYTES, &map_k, k_full + 8u * st, 0, j * A8_KT, (int32_t)bh);
        cq_mbar_wait(v_empty + 8u * st, phase);
        cq_mbar_arrive_expect_tx(v_full + 8u * st, C::V_TMA_BYTES);
        cq_tma_load_3d(sV + st * C::V_BYTES, &map_v, v_full + 8u * st, j * A8_KT, 0, (int32_t)bh);
      }
    }
  } else {
    /* ------------------------------------------------------------ consumers */
    cq_setmaxnreg_inc<240>();
    const int wg = threadIdx.x / 128 - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;

    float o[DP / 2], acc[DP / 2 + 4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, qs[2];
    int si[A8_KT / 2];
    uint32_t pa[2][4], pb[2][4]; /* P of the step's blocks a and b, the A operands of P V */
#pragma unroll
    for (int i = 0; i < DP / 2; ++i) o[i] = 0.f;
    const int row_base = q0 + wg * 64 + warp * 16 + g;
    qs[0] = w.sq[bh * w.sq_pad + row_base], qs[1] = w.sq[bh * w.sq_pad + row_base + 8];
    const float *sk = w.sk + bh * (w.skv_pad / KB);

    const uint64_t dq = cq_wgmma_desc_sw128(sQ + (uint32_t)wg * 64 * A8_ROW, 16), dk0 = cq_wgmma_desc_sw128(sK, 16), dv0 = cq_wgmma_desc_sw128(sV, 16);
    auto release = [&](uint32_t bar) {
      if (lane == 0) cq_mbar_arrive(bar);
    };
    auto issue_s = [&](int st) {
      const uint64_t dk = dk0 + st * (C::K_BYTES >> 4);
      cq_fence_regs(si);
      cq_wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < DP / 32; ++kk) cq_wgmma_m64n128k32_s8_ss(si, dq + kk * 2, dk + kk * 2, kk > 0);
      cq_wgmma_commit();
    };
    /* acc (+)= P [V | ones] for one 64-key block (half 0 or 1 of stage st's tile); block a starts afresh */
    auto issue_pv = [&](int st, int half, uint32_t (&p)[2][4]) {
      const uint64_t dv = dv0 + st * (C::V_BYTES >> 4) + half * 4;
      cq_fence_regs(acc);
      cq_fence_regs(p[0]);
      cq_fence_regs(p[1]);
      cq_wgmma_fence();
      cq_attn8_pv_sm90<DP>::run(acc, p[0], dv, half);
      cq_attn8_pv_sm90<DP>::run(acc, p[1], dv + 2, 1);
      cq_wgmma_commit();
    };
    /* acc *= alpha per row (O's and l's), skipped when no row of the warp changed its max */
    auto rescale = [&](const float (&alpha)[2]) {
      if (!__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) return;
#pragma unroll
      for (int n = 0; n <= NO; ++n)
        acc[4 * n] *= alpha[0], acc[4 * n + 1] *= alpha[0], acc[4 * n + 2] *= alpha[1], acc[4 * n + 3] *= alpha[1];
    };
    /* O = O * (alpha_a * alpha_b) + acc: the step's two blocks folded into O and l in fp32 */
    auto fold = [&](const float (&alpha_a)[2], const float (&alpha_b)[2]) {
      const float f0 = alpha_a[0] * alpha_b[0], f1 = alpha_a[1] * alpha_b[1];
      l[0] = fmaf(l[0], f0, acc[4 * NO]), l[1] = fmaf(l[1], f1, acc[4 * NO + 2]);
#pragma unroll
      for (int n = 0; n < NO; ++n) {
        o[4 * n] = fmaf(o[4 * n], f0, acc[4 * n]);
        o[4 * n + 1] = fmaf(o[4 * n + 1], f0, acc[4 * n + 1]);
        o[4 * n + 2] = fmaf(o[4 * n + 2], f1, acc[4 * n + 2]);
        o[4 * n + 3] = fmaf(o[4 * n + 3], f1, acc[4 * n + 3]);
      }
    };
    /* the reference's online softmax of the step's blocks in order: P_a into pa, P_b into pb */
    auto softmax = [&](int j, float ska, float skb, float (&alpha_a)[2], float (&alpha_b)[2]) {
      const int blk = 2 * j;
      const bool ragged = a.seq_kv % KB != 0, has_b = blk + 1 < n_blocks;
      float p[32];
      auto half = [&](int hf, int bl, float skj, float (&alpha)[2]) {
        const int kv_left = a.seq_kv - bl * KB - 2 * t;
        if (ragged && bl == n_blocks - 1)
          cq_attn8_softmax<true, 8>(*reinterpret_cast<const int(*)[32]>(&si[32 * hf]), p, qs, skj, kv_left, m, alpha);
        else
          cq_attn8_softmax<false, 8>(*reinterpret_cast<const int(*)[32]>(&si[32 * hf]), p, qs, skj, kv_left, m, alpha);
      };
      if (has_b && !(ragged && blk + 1 == n_blocks - 1)) { /* both blocks full: maxima first */
        float p2[32];
        cq_attn8_softmax2<8>(*reinterpret_cast<const int(*)[32]>(&si[0]), *reinterpret_cast<const int(*)[32]>(&si[32]), p,
                             p2, qs, ska, skb, m, alpha_a, alpha_b);
        a8_pack(pa, p);
        a8_pack(pb, p2);
        return;
      }
      half(0, blk, ska, alpha_a);
      a8_pack(pa, p);
      alpha_b[0] = alpha_b[1] = 1.f;
      if (has_b) {
        half(1, blk + 1, skb, alpha_b);
        a8_pack(pb, p);
      }
    };
    auto has_b = [&](int j) { return 2 * j + 1 < n_blocks; };

    /* step 0: S_0 and its softmax */
    float alpha_a[2], alpha_b[2], prev_a[2], prev_b[2];
    cq_mbar_wait(q_full, 0);
    cq_mbar_wait(k_full, 0);
    issue_s(0);
    cq_wgmma_wait<0>();
    cq_fence_regs(si);
    release(k_empty);
    softmax(0, sk[0], has_b(0) ? sk[1] : 0.f, alpha_a, alpha_b);

    /* step j: P_{j-1,a} V_{j-1,a} (fresh accumulators) and S_j issued together; once the first is
     * done, acc * alpha_{j-1,b} and P_{j-1,b} V_{j-1,b} onto it; once all are done, step j-1 folded
     * into O and the softmax of step j. No wgmma is in flight while the softmax writes registers:
     * a wgmma reads its P registers until its wait, and ptxas may give registers whose values are
     * dead to the softmax's temporaries (the other warpgroup's softmax overlaps these wgmma). */
    for (int j = 1; j < n_steps; ++j) {
      const int st = j % A8_STAGES, sp = (j - 1) % A8_STAGES;
      const float ska = sk[2 * j], skb = has_b(j) ? sk[2 * j + 1] : 0.f;
      prev_a[0] = alpha_a[0], prev_a[1] = alpha_a[1], prev_b[0] = alpha_b[0], prev_b[1] = alpha_b[1];
      cq_mbar_wait(v_full + 8u * sp, ((j - 1) / A8_STAGES) & 1);
      issue_pv(sp, 0, pa);
      cq_mbar_wait(k_full + 8u * st, (j / A8_STAGES) & 1);
      issue_s(st);
      cq_wgmma_wait<1>(); /* P_{j-1,a} V_{j-1,a} done */
      cq_fence_regs(acc);
      rescale(prev_b);
      issue_pv(sp, 1, pb); /* step j-1 has its block b: only the last step may lack it */
      cq_wgmma_wait<0>();  /* S_j and P_{j-1,b} V_{j-1,b} done */
      cq_fence_regs(si);
      cq_fence_regs(acc);
      release(k_empty + 8u * st);
      release(v_empty + 8u * sp);
      fold(prev_a, prev_b);
      softmax(j, ska, skb, alpha_a, alpha_b);
    }
    const int sl = (n_steps - 1) % A8_STAGES;
    cq_mbar_wait(v_full + 8u * sl, ((n_steps - 1) / A8_STAGES) & 1);
    issue_pv(sl, 0, pa);
    cq_wgmma_wait<0>();
    cq_fence_regs(acc);
    if (has_b(n_steps - 1)) {
      rescale(alpha_b);
      issue_pv(sl, 1, pb);
      cq_wgmma_wait<0>();
      cq_fence_regs(acc);
    }
    release(v_empty + 8u * sl);
    fold(alpha_a, alpha_b);

    /* out = o / l * sv; lse = (m + log2 l - log2 448 + q'.kmean) / log2(e) */
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
      if (a.lse && t == 0) a.lse[(int64_t)b * a.lse_sb + (int64_t)h * a.seq_q + row] = (m[hh] + (__log2f(lsum) - CQ_LOG2_448) + w.qbias[bh * w.sq_pad + row]) / CQ_LOG2E;
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
  CQ_TRY(a8_map(&mq, w.qc, DP, DP, w.sq_pad, bh, A8_ROW, A8_BM, "Q codes"));
  CQ_TRY(a8_map(&mk, w.kc, DP, DP, w.skv_pad, bh, A8_ROW, A8_KT, "K codes"));
  CQ_TRY(a8_map(&mv, w.vt, w.skv_pad, w.skv_pad, DP, bh, A8_KT, DP, "V^T codes"));
  auto kernel = cq_attn8_fwd_sm90<T, DP>;
  CQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::SMEM));
  dim3 grid((unsigned)((a.seq_q + A8_BM - 1) / A8_BM), (unsigned)a.heads, (unsigned)a.batch);
  kernel<<<grid, 384, C::SMEM, stream>>>(mq, mk, mv, a, w);
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
