/* Flash-attention forward with wgmma (sm_90a), bf16/fp16, head dims up to 128, in the manner
 * of FlashAttention-3.
 *
 * A CTA has one producer warpgroup and NWG consumer warpgroups of 64 query rows each
 * (BM = 64 * NWG; NWG = 3 for head dims up to 64, 2 above). One producer thread loads Q once
 * and K and V tiles of BN = 128 keys into rings of WS_STAGES stages with the bulk tensor copy
 * engine (TMA), each tile completing its stage's "full" mbarrier; consumers wait on it and, once
 * their wgmma's are done with a stage, arrive on its "empty" mbarrier. setmaxnreg moves
 * registers from the producer to the consumers.
 *
 * Shared memory holds each tile as 64-column slabs (128-byte rows) in the 128-byte swizzle
 * that TMA writes and the wgmma descriptors name: 16-byte chunk c of row r at c ^ (r % 8), the
 * slabs of one tile one after the other. Head dims between the specialisations' read as zeros
 * past D (TMA fills them), as do rows past the sequence.
 *
 * A consumer warpgroup overlaps its own GEMMs with its softmax: at tile j it issues
 * S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to back, waits for S_j, runs the softmax of
 * tile j while P_{j-1} V_{j-1} is still on the tensor cores, then waits for it. The
 * warpgroups take turns to issue their GEMMs (named barriers in a ring), so that one
 * warpgroup's softmax runs while another's GEMMs do. S = Q K^T reads both operands from shared
 * memory (K-major); O += P V takes P from registers (the S accumulators rounded to the input
 * type, the fragment layout of mma.sync) and V through an MN-major descriptor. The softmax is
 * that of the mma.sync kernel (attention_mma.cu): log2 domain, FFMA + EX2, the running max
 * raised only past a slack, keys past Skv masked in the last tile only, a negative scale folded
 * into Q (negated in shared memory by a producer warp).
 *
 * Epilogue: each warp writes its 16 normalised rows over its own rows of Q (no longer read) in
 * the same swizzled layout and stores them with TMA, which leaves out rows and columns past the
 * output. Switched by cq_attn_sm90_mode (attention.cuh); needs the sm_90a target. */
#include "attention.cuh"
#include "attention_wgmma.cuh"
#include "tensor_map.cuh"

namespace {

constexpr int WS_BN = 128;    /* keys per tile */
constexpr int WS_STAGES = 3;  /* K and V tiles in the rings (3 x 2 x 32 KB + 32 KB of Q fit in 227 KB at D128) */
constexpr int WS_SLAB = 64;   /* columns per 128-byte swizzle slab */

template <int DP, int NWG> struct ws_cfg {
  static constexpr int BM = 64 * NWG;
  static constexpr int THREADS = 128 * (NWG + 1);
  static constexpr int SLABS = (DP + WS_SLAB - 1) / WS_SLAB;
  static constexpr uint32_t Q_SLAB = (uint32_t)BM * 128, KV_SLAB = (uint32_t)WS_BN * 128;
  static constexpr uint32_t Q_BYTES = Q_SLAB * SLABS, KV_BYTES = KV_SLAB * SLABS;
  static constexpr uint32_t BAR_OFFSET = Q_BYTES + 2 * WS_STAGES * KV_BYTES;
  /* mbarriers: Q loaded, Q ready, then K full, K empty, V full, V empty per stage; + 1 KB to
   * align the base to the 1024-byte swizzle atoms */
  static constexpr size_t SMEM = BAR_OFFSET + 8 * (2 + 4 * WS_STAGES) + 1024;
  /* register split: 168 x 384 (NWG 2) or 128 x 512 (NWG 3) at launch */
  static constexpr int PRODUCER_REGS = NWG == 2 ? 40 : 32;
  static constexpr int CONSUMER_REGS = NWG == 2 ? 232 : 160;
  static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * 128 * NWG <= 65536, "register file");
  static_assert(SMEM <= 232448, "shared memory");
};

#ifdef CQ_SM90A_DEVICE

template <typename T, int DP> struct ws_pv;
template <typename T> struct ws_pv<T, 64> {
  static __device__ __forceinline__ void run(float (&o)[32], const uint32_t (&a)[4], uint64_t b) {
    cq_wgmma_m64n64k16_rs<T>(o, a, b, 1);
  }
};
template <typename T> struct ws_pv<T, 80> {
  static __device__ __forceinline__ void run(float (&o)[40], const uint32_t (&a)[4], uint64_t b) {
    cq_wgmma_m64n80k16_rs<T>(o, a, b, 1);
  }
};
template <typename T> struct ws_pv<T, 96> {
  static __device__ __forceinline__ void run(float (&o)[48], const uint32_t (&a)[4], uint64_t b) {
    cq_wgmma_m64n96k16_rs<T>(o, a, b, 1);
  }
};
template <typename T> struct ws_pv<T, 128> {
  static __device__ __forceinline__ void run(float (&o)[64], const uint32_t (&a)[4], uint64_t b) {
    cq_wgmma_m64n128k16_rs<T>(o, a, b, 1);
  }
};

/* The state one consumer thread carries through the loop. */
template <int DP> struct ws_rows {
  float o[DP / 2];     /* O accumulators (wgmma fragment of 64 x DP) */
  float c[2], l[2];    /* running max (scaled, log2 units) and thread-partial sum of rows g, g + 8 */
  float alpha[2];      /* rescale factors of the last softmax */
  bool grow;           /* whether the last softmax raised a max (then O needs alpha) */
};

/* Online softmax of one tile of scores s (fragment of 64 x BN), in place: s becomes p. */
template <bool FIRST, bool TAIL, int DP>
__device__ __forceinline__ void ws_softmax(float (&s)[WS_BN / 2], ws_rows<DP> &st, float sl, int kv_left) {
  constexpr int NS = WS_BN / 8;
  if (TAIL) {
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (n * 8 + (e & 1) >= kv_left) s[4 * n + e] = -INFINITY;
  }
  float mx[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float m0 = s[2 * hh], m1 = s[2 * hh + 1];
#pragma unroll
    for (int n = 1; n < NS; ++n) m0 = fmaxf(m0, s[4 * n + 2 * hh]), m1 = fmaxf(m1, s[4 * n + 2 * hh + 1]);
    mx[hh] = cq_quad_max(fmaxf(m0, m1)) * sl;
  }
  bool grow = FIRST;
  if (!FIRST) grow = __any_sync(0xffffffffu, mx[0] > st.c[0] + CQ_ATTN_RESCALE_SLACK || mx[1] > st.c[1] + CQ_ATTN_RESCALE_SLACK);
  st.grow = grow;
  if (grow) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float cn = fmaxf(st.c[hh], mx[hh]);
      st.alpha[hh] = cq_exp2(st.c[hh] - (cn == -INFINITY ? 0.f : cn)); /* 0 before the first key */
      st.c[hh] = cn;
      st.l[hh] *= st.alpha[hh];
    }
  }
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const float nc = st.c[hh] == -INFINITY ? 0.f : -st.c[hh];
    float sum[4] = {0.f, 0.f, 0.f, 0.f}; /* independent chains, off the critical path */
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float p = cq_exp2(fmaf(s[4 * n + 2 * hh + e], sl, nc));
        if (TAIL && n * 8 + e >= kv_left) p = 0.f;
        s[4 * n + 2 * hh + e] = p;
        sum[2 * (n % 2) + e] += p;
      }
    st.l[hh] += (sum[0] + sum[1]) + (sum[2] + sum[3]);
  }
}

/* P in the input type, as the A operand of P V (the S accumulator layout is mma.sync's). */
template <typename T> __device__ __forceinline__ void ws_pack(uint32_t (&pa)[WS_BN / 16][4], const float (&s)[WS_BN / 2]) {
#pragma unroll
  for (int kk = 0; kk < WS_BN / 16; ++kk) {
    pa[kk][0] = cq_pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
    pa[kk][1] = cq_pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
    pa[kk][2] = cq_pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
    pa[kk][3] = cq_pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
  }
}

#endif

template <typename T, int DP, int NWG>
__global__ void __launch_bounds__(128 * (NWG + 1), 1)
    cq_attn_fwd_ws(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                   const __grid_constant__ CUtensorMap map_v, const __grid_constant__ CUtensorMap map_o,
                   const cq_attn_args a) {
#ifdef CQ_SM90A_DEVICE
  using C = ws_cfg<DP, NWG>;
  constexpr int NO = DP / 8;
  extern __shared__ unsigned char cq_ws_smem[];
  const uint32_t raw = cq_smem_addr(cq_ws_smem);
  const uint32_t sQ = (raw + 1023u) & ~1023u, sK = sQ + C::Q_BYTES, sV = sK + WS_STAGES * C::KV_BYTES;
  unsigned char *const smem = cq_ws_smem + (sQ - raw);
  const uint32_t bars = sQ + C::BAR_OFFSET;
  const uint32_t q_loaded = bars, q_ready = bars + 8;
  auto k_full = [&](int st) { return bars + 8u * (2 + st); };
  auto k_empty = [&](int st) { return bars + 8u * (2 + WS_STAGES + st); };
  auto v_full = [&](int st) { return bars + 8u * (2 + 2 * WS_STAGES + st); };
  auto v_empty = [&](int st) { return bars + 8u * (2 + 3 * WS_STAGES + st); };

  const int q0 = blockIdx.x * C::BM, h = blockIdx.y, b = blockIdx.z;
  if (!cq_attn_head_is_full(a, b, h)) return; /* the 8-bit kernel's head */
  const int n_tiles = (a.seq_kv + WS_BN - 1) / WS_BN;
  const bool negate = a.scale_log2 < 0.f;

  if (threadIdx.x == 0) {
    cq_mbar_init(q_loaded, 1);
    cq_mbar_init(q_ready, 32);
#pragma unroll
    for (int st = 0; st < WS_STAGES; ++st) {
      cq_mbar_init(k_full(st), 1);
      cq_mbar_init(v_full(st), 1);
      cq_mbar_init(k_empty(st), 4 * NWG); /* lane 0 of every consumer warp */
      cq_mbar_init(v_empty(st), 4 * NWG);
    }
    cq_mbar_init_fence();
  }
  __syncthreads();

  if (threadIdx.x < 128) {
    /* ------------------------------------------------------------ producer */
    cq_setmaxnreg_dec<C::PRODUCER_REGS>();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
      cq_mbar_arrive_expect_tx(q_loaded, C::Q_BYTES);
#pragma unroll
      for (int sl = 0; sl < C::SLABS; ++sl) cq_tma_load_4d(sQ + sl * C::Q_SLAB, &map_q, q_loaded, sl * WS_SLAB, q0, h, b);
      for (int j = 0; j < n_tiles; ++j) {
        const int st = j % WS_STAGES;
        const uint32_t phase = ((j / WS_STAGES) & 1) ^ 1; /* a fresh slot counts as released */
        cq_mbar_wait(k_empty(st), phase);
        cq_mbar_arrive_expect_tx(k_full(st), C::KV_BYTES);
#pragma unroll
        for (int sl = 0; sl < C::SLABS; ++sl)
          cq_tma_load_4d(sK + st * C::KV_BYTES + sl * C::KV_SLAB, &map_k, k_full(st), sl * WS_SLAB, j * WS_BN, h, b);
        cq_mbar_wait(v_empty(st), phase);
        cq_mbar_arrive_expect_tx(v_full(st), C::KV_BYTES);
#pragma unroll
        for (int sl = 0; sl < C::SLABS; ++sl)
          cq_tma_load_4d(sV + st * C::KV_BYTES + sl * C::KV_SLAB, &map_v, v_full(st), sl * WS_SLAB, j * WS_BN, h, b);
      }
    } else if (warp == 1 && negate) { /* scores of -Q with |scale| */
      cq_mbar_wait(q_loaded, 0);
      for (uint32_t i = lane; i < C::Q_BYTES / 16; i += 32) {
        uint4 *c = reinterpret_cast<uint4 *>(smem + i * 16);
        uint4 v = *c;
        v.x ^= 0x80008000u, v.y ^= 0x80008000u, v.z ^= 0x80008000u, v.w ^= 0x80008000u;
        *c = v;
      }
      cq_fence_proxy_async();
      cq_mbar_arrive(q_ready);
    }
  } else {
    /* ------------------------------------------------------------ consumers */
    cq_setmaxnreg_inc<C::CONSUMER_REGS>();
    const int wg = threadIdx.x / 128 - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const float sl = fabsf(a.scale_log2);
    /* turn-taking ring over named barriers 1..NWG: wait for ours, then pass to the next */
    const uint32_t my_turn = 1 + wg, next_turn = 1 + (wg + 1) % NWG;
    if (wg == 0) cq_bar_arrive(my_turn, 256); /* the first warpgroup starts */

    ws_rows<DP> st;
#pragma unroll
    for (int i = 0; i < DP / 2; ++i) st.o[i] = 0.f;
    st.c[0] = st.c[1] = -INFINITY;
    st.l[0] = st.l[1] = 0.f;
    st.alpha[0] = st.alpha[1] = 1.f;
    st.grow = false;
    float s[WS_BN / 2];
    uint32_t pa[WS_BN / 16][4];

    /* descriptors of this warpgroup's 64 rows of Q and of stage 0 of K and V; a k-step of 16
     * columns is 32 bytes into a slab (2 in the address field), 16 keys of V are 2048 bytes */
    const uint64_t dq = cq_wgmma_desc_sw128(sQ + (uint32_t)wg * 64 * 128, 16), dk0 = cq_wgmma_desc_sw128(sK, 16);
    const uint64_t dv0 = cq_wgmma_desc_sw128(sV, C::KV_SLAB);
    constexpr uint64_t D_STAGE = C::KV_BYTES >> 4, D_QSLAB = C::Q_SLAB >> 4, D_KSLAB = C::KV_SLAB >> 4;
    auto issue_s = [&](int stage) {
      const uint64_t dk = dk0 + stage * D_STAGE;
      cq_fence_regs(s);
      cq_wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < DP / 16; ++kk)
        cq_wgmma_m64n128k16_ss<T>(s, dq + (kk / 4) * D_QSLAB + (kk % 4) * 2, dk + (kk / 4) * D_KSLAB + (kk % 4) * 2,
                                  kk > 0);
      cq_wgmma_commit();
    };
    auto issue_pv = [&](int stage) {
      const uint64_t dv = dv0 + stage * D_STAGE;
      cq_fence_regs(st.o);
#pragma unroll
      for (int kk = 0; kk < WS_BN / 16; ++kk) cq_fence_regs(pa[kk]);
      cq_wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < WS_BN / 16; ++kk) ws_pv<T, DP>::run(st.o, pa[kk], dv + kk * (16 * 128 / 16));
      cq_wgmma_commit();
    };
    auto release = [&](uint32_t bar) {
      if (lane == 0) cq_mbar_arrive(bar);
    };
    const int kv_left_last = a.seq_kv - (n_tiles - 1) * WS_BN - 2 * t;
    const bool tail = a.seq_kv % WS_BN != 0;

    cq_mbar_wait(negate ? q_ready : q_loaded, 0);
    /* tile 0: S_0 alone */
    cq_mbar_wait(k_full(0), 0);
    issue_s(0);
    cq_wgmma_wait<0>();
    cq_fence_regs(s);
    release(k_empty(0));
    if (n_tiles == 1 && tail) ws_softmax<true, true>(s, st, sl, kv_left_last);
    else ws_softmax<true, false>(s, st, sl, 0);
    ws_pack<T>(pa, s);

    /* tile j: S_j and P_{j-1} V_{j-1} in flight together, the softmax of S_j under the latter */
    auto step = [&](int j, auto tail_tag) {
      constexpr bool TAIL = decltype(tail_tag)::value;
      const int sk = j % WS_STAGES, sv = (j - 1) % WS_STAGES;
      cq_mbar_wait(k_full(sk), (j / WS_STAGES) & 1);
      cq_bar_sync(my_turn, 256);
      issue_s(sk);
      cq_mbar_wait(v_full(sv), ((j - 1) / WS_STAGES) & 1);
      issue_pv(sv);
      cq_bar_arrive(next_turn, 256);
      cq_wgmma_wait<1>();
      cq_fence_regs(s);
      release(k_empty(sk));
      ws_softmax<false, TAIL>(s, st, sl, kv_left_last);
      cq_wgmma_wait<0>();
      cq_fence_regs(st.o);
      cq_fence_regs(s);
      release(v_empty(sv));
      if (st.grow) {
#pragma unroll
        for (int n = 0; n < NO; ++n)
          st.o[4 * n] *= st.alpha[0], st.o[4 * n + 1] *= st.alpha[0], st.o[4 * n + 2] *= st.alpha[1],
              st.o[4 * n + 3] *= st.alpha[1];
      }
      ws_pack<T>(pa, s);
    };
    const int n_full = tail ? n_tiles - 1 : n_tiles;
    for (int j = 1; j < n_full; ++j) step(j, cq_bool_tag<false>());
    if (tail && n_tiles > 1) step(n_tiles - 1, cq_bool_tag<true>());

    /* the last P V */
    const int sv = (n_tiles - 1) % WS_STAGES;
    cq_mbar_wait(v_full(sv), ((n_tiles - 1) / WS_STAGES) & 1);
    issue_pv(sv);
    cq_wgmma_wait<0>();
    cq_fence_regs(st.o);
    release(v_empty(sv));

    /* normalise into this warp's 16 rows of Q (every S GEMM of the warpgroup is done), in Q's
     * swizzled slabs, then one TMA store per slab */
    const int wrow = wg * 64 + warp * 16; /* the warp's first row in the CTA */
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float lsum = cq_quad_sum(st.l[hh]);
      const float inv = 1.f / lsum;
      const int r = wrow + hh * 8 + g, row = q0 + r;
#pragma unroll
      for (int n = 0; n < NO; ++n)
        *reinterpret_cast<uint32_t *>(smem + (n / 8) * C::Q_SLAB + r * 128 + ((n % 8) ^ (r % 8)) * 16 + t * 4) =
            cq_pack2<T>(st.o[4 * n + 2 * hh] * inv, st.o[4 * n + 2 * hh + 1] * inv);
      if (a.lse && t == 0 && row < a.seq_q)
        a.lse[(int64_t)b * a.lse_sb + (int64_t)h * a.seq_q + row] = (st.c[hh] + __log2f(lsum)) * CQ_LN2;
    }
    cq_fence_proxy_async();
    __syncwarp();
    if (lane == 0) {
#pragma unroll
      for (int slab = 0; slab < C::SLABS; ++slab)
        cq_tma_store_4d(&map_o, sQ + slab * C::Q_SLAB + wrow * 128, slab * WS_SLAB, q0 + wrow, h, b);
      cq_bulk_commit();
      cq_bulk_wait_read();
    }
  }
#else
  static_assert(ws_cfg<DP, NWG>::SLABS > 0, "head dim");
  (void)map_q, (void)map_k, (void)map_v, (void)map_o, (void)a;
  __trap(); /* built without the sm_90a target: the launcher is not reached on such builds */
#endif
}

/* The 4-d tensor map of a [B, S, H, D] operand of the slice a describes (strides in elements),
 * read in boxes of one 64-column slab of `rows` rows of one head. Strides of dims of size 1 are
 * never stepped over: any valid value does. */
cq_status ws_map(CUtensorMap *map, const void *data, int is_bf16, const cq_attn_args &a, int64_t seq, int64_t ss,
                 int64_t sh, int64_t sb, int rows, const char *what) {
  const uint64_t dims[4] = {(uint64_t)a.head_dim, (uint64_t)seq, (uint64_t)a.heads, (uint64_t)a.batch};
  auto stride = [](int64_t n, int64_t s) { return (uint64_t)(n > 1 ? s * 2 : 16); };
  const uint64_t strides[3] = {stride(seq, ss), stride(a.heads, sh), stride(a.batch, sb)};
  const uint32_t box[4] = {(uint32_t)WS_SLAB, (uint32_t)rows, 1, 1};
  return cq_tensor_map(map, is_bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4, data,
                       dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B, what);
}

template <typename T, int DP, int NWG> cq_status ws_launch(const cq_attn_args &a, int is_bf16, cudaStream_t stream) {
  using C = ws_cfg<DP, NWG>;
  CUtensorMap mq, mk, mv, mo;
  CQ_TRY(ws_map(&mq, a.q, is_bf16, a, a.seq_q, a.q_ss, a.q_sh, a.q_sb, C::BM, "q"));
  CQ_TRY(ws_map(&mk, a.k, is_bf16, a, a.seq_kv, a.k_ss, a.k_sh, a.k_sb, WS_BN, "k"));
  CQ_TRY(ws_map(&mv, a.v, is_bf16, a, a.seq_kv, a.v_ss, a.v_sh, a.v_sb, WS_BN, "v"));
  CQ_TRY(ws_map(&mo, a.out, is_bf16, a, a.seq_q, a.o_ss, a.o_sh, a.o_sb, 16, "out"));
  auto kernel = cq_attn_fwd_ws<T, DP, NWG>;
  CQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::SMEM));
  dim3 grid((unsigned)((a.seq_q + C::BM - 1) / C::BM), (unsigned)a.heads, (unsigned)a.batch);
  kernel<<<grid, C::THREADS, C::SMEM, stream>>>(mq, mk, mv, mo, a);
  CQ_LAUNCH_CHECK("cq_attn_fwd_ws");
  return CQ_OK;
}

}  // namespace

/* Whether the wgmma kernel takes this call: sm_90, switched on (cq_attn_sm90_mode), a head dim
 * it has (up to 128). By default it does: on an H200 it beats the mma.sync kernel on every
 * shape of bench_attention (Flux 1024: 0.38 against 0.75 ms; PixArt cross attention with 300
 * keys: 0.086 against 0.100 ms). */
int cq_attention_sm90_applies(const cq_attn_args &a, int cc) {
  /* tensor maps step forward: a dim of more than one element with a stride <= 0 (a flipped or
   * broadcast view) goes to the mma.sync kernel */
  const int64_t n[12] = {a.batch, a.seq_q, a.heads, a.batch, a.seq_kv, a.heads,
                         a.batch, a.seq_kv, a.heads, a.batch, a.seq_q, a.heads};
  const int64_t st[12] = {a.q_sb, a.q_ss, a.q_sh, a.k_sb, a.k_ss, a.k_sh, a.v_sb, a.v_ss, a.v_sh, a.o_sb, a.o_ss, a.o_sh};
  for (int i = 0; i < 12; ++i)
    if (n[i] > 1 && st[i] <= 0) return 0;
  const int mode = cq_attn_sm90_mode(cc);
  if (mode == CQ_ATTN_SM90_AUTO) return a.head_dim <= 128;
  return mode == CQ_ATTN_SM90_ON && a.head_dim <= 128;
}

/* The one place where the wgmma kernel's specialisation is chosen: padded head dim 64 (three
 * consumer warpgroups, 192 rows a CTA), 80, 96 or 128 (two, 128 rows). */
cq_status cq_attention_sm90_launch(const cq_attn_args &a, int is_bf16, cudaStream_t stream) {
  if (a.head_dim <= 64)
    return is_bf16 ? ws_launch<__nv_bfloat16, 64, 3>(a, 1, stream) : ws_launch<__half, 64, 3>(a, 0, stream);
  if (a.head_dim <= 80)
    return is_bf16 ? ws_launch<__nv_bfloat16, 80, 2>(a, 1, stream) : ws_launch<__half, 80, 2>(a, 0, stream);
  if (a.head_dim <= 96)
    return is_bf16 ? ws_launch<__nv_bfloat16, 96, 2>(a, 1, stream) : ws_launch<__half, 96, 2>(a, 0, stream);
  return is_bf16 ? ws_launch<__nv_bfloat16, 128, 2>(a, 1, stream) : ws_launch<__half, 128, 2>(a, 0, stream);
}
