/* Flash-attention forward with wgmma (sm_90a), bf16/fp16, head dims up to 128:
 * warp-specialized, in the manner of FlashAttention-3.
 *
 * A CTA has one producer warpgroup and NWG consumer warpgroups of 64 query rows each
 * (BM = 64 * NWG; NWG = 3 for head dims up to 64, 2 above). The producer copies Q once and K and V
 * tiles of BN = 128 keys into rings of three stages each (cp.async; warps 0-1 copy K, warps 2-3
 * V); each copying thread waits for its own copies, fences them for the async proxy and
 * arrives on the stage's "full" mbarrier; consumers wait on it and, once their wgmma's are done
 * with a stage, arrive on its "empty" mbarrier. setmaxnreg moves registers from the producer
 * to the consumers.
 *
 * A consumer warpgroup overlaps its own GEMMs with its softmax: at tile j it issues
 * S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to back, waits for S_j, runs the softmax of
 * tile j while P_{j-1} V_{j-1} is still on the tensor cores, then waits for it. The
 * warpgroups take turns to issue their GEMMs (named barriers in a ring), so that one
 * warpgroup's softmax runs while another's GEMMs do.
 *
 * Q, K and V live in shared memory in wgmma's no-swizzle canonical layout: 8 x 16-byte core
 * matrices (8 rows, 8 elements each, 128 contiguous bytes), the core matrices of a row group
 * along the head dim next to each other. S = Q K^T reads both operands from shared memory
 * (K-major descriptors); O += P V takes P from registers (the S accumulators rounded to the
 * input type, same fragment layout as mma.sync) and V through an MN-major descriptor. The
 * softmax is that of the mma.sync kernel (attention.cu): log2 domain, FFMA + EX2, the running
 * max raised only past a slack, keys past Skv masked in the last tile only, a negative scale
 * folded into Q.
 *
 * Switched by cq_attn_sm90_mode (attention_common.cuh): opt-in with CQUANT_ATTN_SM90=1 until
 * validated on the GPU machine. Needs the sm_90a target in the build. */
#include "attention.cuh"
#include "attention_wgmma.cuh"

namespace {

constexpr int WS_BN = 128;    /* keys per tile */
constexpr int WS_STAGES = 3;  /* shared-memory buffers of K and of V (3 x 2 x 32 KB + Q fit in 227 KB at D128) */

template <int DP, int NWG> struct ws_cfg {
  static constexpr int BM = 64 * NWG;
  static constexpr int THREADS = 128 * (NWG + 1);
  static constexpr int CHUNKS = DP / 8; /* 16-byte chunks per row */
  static constexpr int AHEAD = 1;       /* tiles a producer thread keeps in flight beyond the one it publishes */
  static constexpr uint32_t Q_BYTES = (uint32_t)BM * DP * 2;
  static constexpr uint32_t KV_BYTES = (uint32_t)WS_BN * DP * 2;
  static constexpr uint32_t BAR_OFFSET = Q_BYTES + 2 * WS_STAGES * KV_BYTES;
  /* mbarriers: Q full, then K full, K empty, V full, V empty per stage */
  static constexpr size_t SMEM = BAR_OFFSET + 8 * (1 + 4 * WS_STAGES);
  /* register split: 168 x 384 (NWG 2) or 128 x 512 (NWG 3) at launch */
  static constexpr int PRODUCER_REGS = NWG == 2 ? 40 : 32;
  static constexpr int CONSUMER_REGS = NWG == 2 ? 232 : 160;
  static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * 128 * NWG <= 65536, "register file");
  static_assert(AHEAD < WS_STAGES, "a producer publishes a tile before it waits for that tile's slot");
};

#ifdef CQ_SM90A_DEVICE

/* Copy rows [row0, row0 + ROWS) of one head into the canonical layout (chunk idx = ((r / 8) *
 * CHUNKS + c) * 8 + r % 8 at byte idx * 16) with NT threads, ct = this thread's index among
 * them. Chunks past head_dim and rows at or past `limit` are zero-filled. Thread ct owns row
 * r % 8 = ct % 8 and the (row group, chunk) pairs rg * CHUNKS + c = ct / 8 + (NT / 8) * i, so
 * a warp writes 512 contiguous bytes and reads 8 rows x 64 bytes. */
template <typename T, int DP, int ROWS, int NT>
__device__ __forceinline__ void ws_copy(uint32_t dst, const T *head, int64_t ld, int row0, int limit, int head_dim,
                                        int ct) {
  constexpr int CHUNKS = DP / 8, U = NT / 8, PAIRS = ROWS / 8 * CHUNKS;
  static_assert(NT % 8 == 0 && PAIRS % U == 0, "copy split");
  const int r8 = ct % 8, u = ct / 8;
  if constexpr (U % CHUNKS != 0 && CHUNKS % U != 0) { /* head dims 80, 96: row group and chunk per pair */
    const uint32_t d0 = dst + (uint32_t)u * 128u + (uint32_t)r8 * 16u;
#pragma unroll 4
    for (int i = 0; i < PAIRS / U; ++i) {
      const int q = u + U * i, rg = q / CHUNKS, c = q % CHUNKS, row = row0 + rg * 8 + r8;
      const bool ok = row < limit && c * 8 < head_dim;
      cq_cp_async16_n(d0 + (uint32_t)(U * i) * 128u, ok ? head + (int64_t)row * ld + c * 8 : head, ok ? 16 : 0);
    }
    return;
  }
  constexpr bool WIDE = U >= CHUNKS; /* a pass covers whole row groups: fixed chunk */
  const int c0 = WIDE ? u % CHUNKS : u, rg0 = WIDE ? u / CHUNKS : 0;
  const T *p0 = head + (int64_t)(row0 + rg0 * 8 + r8) * ld + c0 * 8;
  const uint32_t d0 = dst + (uint32_t)u * 128u + (uint32_t)r8 * 16u;
  const bool full_rows = row0 + ROWS <= limit;
  if (full_rows && head_dim == DP) { /* every chunk exists: one pointer step per row group */
#pragma unroll
    for (int i = 0; i < PAIRS / U; ++i) {
      const int drg = WIDE ? (U / CHUNKS) * i : i / (CHUNKS / U);
      const int dc = WIDE ? 0 : U * (i % (CHUNKS / U));
      cq_cp_async16_n(d0 + (uint32_t)(U * i) * 128u, p0 + (int64_t)drg * 8 * ld + dc * 8, 16);
    }
    return;
  }
#pragma unroll 2
  for (int i = 0; i < PAIRS / U; ++i) {
    const int drg = WIDE ? (U / CHUNKS) * i : i / (CHUNKS / U);
    const int dc = WIDE ? 0 : U * (i % (CHUNKS / U));
    const bool ok = (full_rows || row0 + (rg0 + drg) * 8 + r8 < limit) && (c0 + dc) * 8 < head_dim;
    const T *src = ok ? p0 + (int64_t)drg * 8 * ld + dc * 8 : head;
    cq_cp_async16_n(d0 + (uint32_t)(U * i) * 128u, src, ok ? 16 : 0);
  }
}

/* Flip the sign of the 16-bit values ws_copy put at this thread's chunks (after they landed). */
template <int DP, int ROWS, int NT> __device__ __forceinline__ void ws_negate(unsigned char *tile, int ct) {
  constexpr int CHUNKS = DP / 8, U = NT / 8, PAIRS = ROWS / 8 * CHUNKS;
  unsigned char *d0 = tile + (ct / 8) * 128 + (ct % 8) * 16;
#pragma unroll 4
  for (int i = 0; i < PAIRS / U; ++i) {
    uint4 *c = reinterpret_cast<uint4 *>(d0 + U * i * 128);
    uint4 v = *c;
    v.x ^= 0x80008000u, v.y ^= 0x80008000u, v.z ^= 0x80008000u, v.w ^= 0x80008000u;
    *c = v;
  }
  (void)CHUNKS;
}

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
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float p = cq_exp2(fmaf(s[4 * n + 2 * hh + e], sl, nc));
        if (TAIL && n * 8 + e >= kv_left) p = 0.f;
        s[4 * n + 2 * hh + e] = p;
        sum += p;
      }
    st.l[hh] += sum;
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
__global__ void __launch_bounds__(128 * (NWG + 1), 1) cq_attn_fwd_ws(const cq_attn_args a) {
#ifdef CQ_SM90A_DEVICE
  using C = ws_cfg<DP, NWG>;
  constexpr int NS = WS_BN / 8, NO = DP / 8;
  extern __shared__ __align__(1024) unsigned char cq_ws_smem[];
  const uint32_t sQ = cq_smem_addr(cq_ws_smem), sK = sQ + C::Q_BYTES, sV = sK + WS_STAGES * C::KV_BYTES;
  const uint32_t bars = sQ + C::BAR_OFFSET;
  const uint32_t q_full = bars;
  auto k_full = [&](int st) { return bars + 8u * (1 + st); };
  auto k_empty = [&](int st) { return bars + 8u * (1 + WS_STAGES + st); };
  auto v_full = [&](int st) { return bars + 8u * (1 + 2 * WS_STAGES + st); };
  auto v_empty = [&](int st) { return bars + 8u * (1 + 3 * WS_STAGES + st); };

  const int q0 = blockIdx.x * C::BM, h = blockIdx.y, b = blockIdx.z;
  if (!cq_attn_head_is_full(a, b, h)) return; /* the 8-bit kernel's head */
  const int n_tiles = (a.seq_kv + WS_BN - 1) / WS_BN;

  if (threadIdx.x == 0) {
    cq_mbar_init(q_full, 128);
#pragma unroll
    for (int st = 0; st < WS_STAGES; ++st) {
      cq_mbar_init(k_full(st), 64);
      cq_mbar_init(v_full(st), 64);
      cq_mbar_init(k_empty(st), 4 * NWG); /* lane 0 of every consumer warp */
      cq_mbar_init(v_empty(st), 4 * NWG);
    }
  }
  __syncthreads();

  if (threadIdx.x < 128) {
    /* ------------------------------------------------------------ producer */
    cq_setmaxnreg_dec<C::PRODUCER_REGS>();
    const int pt = threadIdx.x;
    const T *qh = static_cast<const T *>(a.q) + b * a.q_sb + h * a.q_sh;
    ws_copy<T, DP, C::BM, 128>(sQ, qh, a.q_ss, q0, a.seq_q, a.head_dim, pt);
    cq_cp_async_commit();
    cq_cp_async_wait<0>();
    if (a.scale_log2 < 0.f) ws_negate<DP, C::BM, 128>(cq_ws_smem, pt); /* scores of -Q with |scale| */
    cq_fence_proxy_async();
    cq_mbar_arrive(q_full);

    const bool is_v = pt >= 64; /* warps 0-1 copy K, warps 2-3 copy V */
    const int ct = pt % 64;
    const T *head = is_v ? static_cast<const T *>(a.v) + b * a.v_sb + h * a.v_sh
                         : static_cast<const T *>(a.k) + b * a.k_sb + h * a.k_sh;
    const int64_t ld = is_v ? a.v_ss : a.k_ss;
    const uint32_t ring = is_v ? sV : sK;
    const uint32_t full0 = is_v ? v_full(0) : k_full(0), empty0 = is_v ? v_empty(0) : k_empty(0);
    sm90_produce<WS_STAGES, C::AHEAD>(n_tiles, full0, empty0, [&](int j, int st) {
      ws_copy<T, DP, WS_BN, 64>(ring + st * C::KV_BYTES, head, ld, j * WS_BN, a.seq_kv, a.head_dim, ct);
    });
  } else {
    /* ------------------------------------------------------------ consumers */
    cq_setmaxnreg_inc<C::CONSUMER_REGS>();
    const int wg = threadIdx.x / 128 - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const float sl = fabsf(a.scale_log2);
    /* this warpgroup's 64 rows of Q: 8 row groups of CHUNKS core matrices */
    const uint32_t sQw = sQ + (uint32_t)wg * 8 * C::CHUNKS * 128;
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

    /* descriptors of stage 0; a step of 16 bytes in the address field is 256 bytes of smem */
    const uint64_t dq = sm90_desc_u32(sQw, 128, DP * 16), dk0 = sm90_desc_u32(sK, 128, DP * 16);
    const uint64_t dv0 = sm90_desc_u32(sV, DP * 16, 128);
    constexpr uint64_t D_STAGE = C::KV_BYTES >> 4;
    auto issue_s = [&](int stage) {
      const uint64_t dk = dk0 + stage * D_STAGE;
      cq_fence_regs(s);
      cq_wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < DP / 16; ++kk) cq_wgmma_m64n128k16_ss<T>(s, dq + kk * 16, dk + kk * 16, kk > 0);
      cq_wgmma_commit();
    };
    auto issue_pv = [&](int stage) {
      const uint64_t dv = dv0 + stage * D_STAGE;
      cq_fence_regs(st.o);
#pragma unroll
      for (int kk = 0; kk < WS_BN / 16; ++kk) cq_fence_regs(pa[kk]);
      cq_wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < WS_BN / 16; ++kk) ws_pv<T, DP>::run(st.o, pa[kk], dv + kk * (2 * C::CHUNKS * 128 / 16));
      cq_wgmma_commit();
    };
    auto release = [&](uint32_t bar) {
      if (lane == 0) cq_mbar_arrive(bar);
    };
    const int kv_left_last = a.seq_kv - (n_tiles - 1) * WS_BN - 2 * t;
    const bool tail = a.seq_kv % WS_BN != 0;

    cq_mbar_wait(q_full, 0);
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

    /* normalise; stage the warp's 16 rows in its part of this warpgroup's Q rows (no longer
     * read: every S GEMM of the warpgroup is done), 16-byte chunk c of row r at c ^ (r % 8)
     * against bank conflicts (chunks of a last incomplete group of 8 stay put); then write whole
     * 16-byte chunks */
    unsigned char *stage = cq_ws_smem + (size_t)(wg * 64 + warp * 16) * DP * 2;
    auto slot = [](int c, int r) { return (c | 7) < NO ? c ^ (r % 8) : c; };
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float lsum = cq_quad_sum(st.l[hh]);
      const float inv = 1.f / lsum;
      const int r = hh * 8 + g, row = q0 + wg * 64 + warp * 16 + r;
#pragma unroll
      for (int n = 0; n < NO; ++n)
        *reinterpret_cast<uint32_t *>(stage + r * DP * 2 + slot(n, r) * 16 + t * 4) =
            cq_pack2<T>(st.o[4 * n + 2 * hh] * inv, st.o[4 * n + 2 * hh + 1] * inv);
      if (a.lse && t == 0 && row < a.seq_q)
        a.lse[(int64_t)b * a.lse_sb + (int64_t)h * a.seq_q + row] = (st.c[hh] + __log2f(lsum)) * CQ_LN2;
    }
    __syncwarp();
    T *og = static_cast<T *>(a.out) + b * a.o_sb + h * a.o_sh;
#pragma unroll
    for (int idx = lane; idx < 16 * NO; idx += 32) {
      const int r = idx / NO, ch = idx % NO;
      const int row = q0 + wg * 64 + warp * 16 + r;
      if (row < a.seq_q && ch * 8 < a.head_dim)
        *reinterpret_cast<uint4 *>(og + (int64_t)row * a.o_ss + ch * 8) =
            *reinterpret_cast<const uint4 *>(stage + r * DP * 2 + slot(ch, r) * 16);
    }
    (void)NS;
  }
#else
  static_assert(ws_cfg<DP, NWG>::CHUNKS > 0, "head dim");
  (void)a;
  __trap(); /* built without the sm_90a target: the launcher is not reached on such builds */
#endif
}

template <typename T, int DP, int NWG> cq_status ws_launch(const cq_attn_args &a, cudaStream_t stream) {
  using C = ws_cfg<DP, NWG>;
  auto kernel = cq_attn_fwd_ws<T, DP, NWG>;
  CQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::SMEM));
  dim3 grid((unsigned)((a.seq_q + C::BM - 1) / C::BM), (unsigned)a.heads, (unsigned)a.batch);
  kernel<<<grid, C::THREADS, C::SMEM, stream>>>(a);
  CQ_LAUNCH_CHECK("cq_attn_fwd_ws");
  return CQ_OK;
}

}  // namespace

/* Whether the wgmma kernel takes this call: sm_90, switched on (cq_attn_sm90_mode), a head dim
 * it has. By default only head dims up to 64, where it beats the mma.sync kernel (H100: 0.65 vs
 * 0.80 ms on SD3, 18.0 vs 23.9 ms on CogVideoX); at 72..128 the mma.sync kernel is faster. */
int cq_attention_sm90_applies(const cq_attn_args &a, int cc) {
  const int mode = cq_attn_sm90_mode(cc);
  if (mode == CQ_ATTN_SM90_AUTO) return a.head_dim <= 64;
  return mode == CQ_ATTN_SM90_ON && a.head_dim <= 128;
}

/* The one place where the wgmma kernel's specialisation is chosen: padded head dim 64 (three
 * consumer warpgroups, 192 rows a CTA), 80, 96 or 128 (two, 128 rows). */
cq_status cq_attention_sm90_launch(const cq_attn_args &a, int is_bf16, cudaStream_t stream) {
  if (a.head_dim <= 64)
    return is_bf16 ? ws_launch<__nv_bfloat16, 64, 3>(a, stream) : ws_launch<__half, 64, 3>(a, stream);
  if (a.head_dim <= 80)
    return is_bf16 ? ws_launch<__nv_bfloat16, 80, 2>(a, stream) : ws_launch<__half, 80, 2>(a, stream);
  if (a.head_dim <= 96)
    return is_bf16 ? ws_launch<__nv_bfloat16, 96, 2>(a, stream) : ws_launch<__half, 96, 2>(a, stream);
  return is_bf16 ? ws_launch<__nv_bfloat16, 128, 2>(a, stream) : ws_launch<__half, 128, 2>(a, stream);
}
