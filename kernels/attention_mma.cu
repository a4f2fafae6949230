/* Flash-attention forward with mma.sync (sm_80+), bf16/fp16.
 *
 * One CTA computes BM = 16 * MT * NWARPS query rows of one (batch, head); each warp owns
 * 16 * MT rows, so every K/V fragment read from shared memory feeds MT mma's. Per tile of BN
 * keys: S = Q K^T (ldmatrix from smem, fp32 accumulators), online softmax in registers
 * (log2 domain: p = 2^(s * scale * log2e - c) in one FFMA and one MUFU), P rounded to the input
 * type and fed straight from the S accumulators as the A operand of O += P V (V through
 * ldmatrix.trans). K and V have one shared-memory buffer each, loaded with cp.async so that
 * V_j arrives during Q K_j^T and K_{j+1} during the softmax and P V_j (two barriers a tile).
 *
 * The running max c of a row is raised only when a tile's max exceeds it by more than
 * CQ_ATTN_RESCALE_SLACK (and then for every row of the warp): the probabilities stay below
 * 2^SLACK, and the O rescale (DP / 2 multiplies per row pair) is skipped on most tiles. Every
 * p, l and O of a row is taken against the same c, so the result is the same softmax.
 *
 * Head dims are padded in shared memory to the specialisation's DP with zeros (cp.async
 * zero-fill), as are the rows past Sq and Skv; keys past Skv are masked in the last tile only
 * (a separate instantiation of the tile step). A negative scale is folded into Q (its sign bits
 * flipped in shared memory once), so the max of the raw scores is the max of the scaled ones.
 * Rows are padded by 16 bytes against bank conflicts. */
#include "attention.cuh"

template <typename T, int DP, int MT, int BN, int NWARPS>
struct cq_attn_cfg {
  static constexpr int BM = 16 * MT * NWARPS;
  static constexpr int THREADS = 32 * NWARPS;
  static constexpr int LD = DP + 8;          /* smem row stride in elements */
  static constexpr int NS = BN / 8;          /* n-tiles of S */
  static constexpr int NO = DP / 8;          /* n-tiles of O */
  static constexpr size_t SMEM = (size_t)(BM + 2 * BN) * LD * sizeof(T);
  static_assert(DP % 16 == 0 && BN % 16 == 0 && NO % 2 == 0, "tiles are multiples of 16");
};

/* This thread's share of copying rows of one head into shared memory [rows][DP + 8]: the
 * 16-byte chunk `col` of rows r0, r0 + RSTEP, ... of each tile. Rows are spread over CP >= DP / 8
 * (a power of two) threads so that a thread's row and chunk are shifts of its index; threads
 * with col >= DP / 8 copy nothing. Chunks past head_dim are zero-filled. */
template <typename T, int DP, int THREADS>
struct cq_attn_copier {
  static constexpr int CHUNKS = DP / 8;
  static constexpr int CP = CHUNKS <= 8 ? 8 : CHUNKS <= 16 ? 16 : 32;
  static constexpr int RSTEP = THREADS / CP;
  static constexpr uint32_t ROW_BYTES = (DP + 8) * sizeof(T);
  const T *src;     /* row r0, chunk col of the head (chunk 0 when col is past head_dim) */
  uint32_t dst;     /* byte offset of (r0, col) in a tile */
  int r0, bytes;    /* bytes: 16, or 0 for a chunk past head_dim */
  bool active;

  __device__ __forceinline__ cq_attn_copier(const T *head, int64_t ld, int head_dim) {
    const int col = threadIdx.x % CP;
    r0 = threadIdx.x / CP;
    active = col < CHUNKS;
    bytes = col * 8 < head_dim ? 16 : 0;
    src = head + (int64_t)r0 * ld + (bytes ? col * 8 : 0);
    dst = (uint32_t)r0 * ROW_BYTES + (uint32_t)col * 16u;
  }

  /* Rows [row0, row0 + ROWS) (row stride ld) into the tile at shared address `tile`; with TAIL,
   * rows at or past `limit` are zero-filled (without it every row must exist). */
  template <int ROWS, bool TAIL>
  __device__ __forceinline__ void copy(uint32_t tile, int row0, int limit, int64_t ld) const {
    static_assert(ROWS % RSTEP == 0, "a tile is a whole number of row steps");
    if (!active) return;
    const T *p = src + (int64_t)row0 * ld;
    const T *head = src - (int64_t)r0 * ld; /* row 0: a readable address for zero-filled rows */
#pragma unroll
    for (int i = 0; i < ROWS / RSTEP; ++i) {
      const bool ok = !TAIL || row0 + r0 + i * RSTEP < limit;
      cq_cp_async16_n(tile + dst + i * RSTEP * ROW_BYTES, ok ? p + (int64_t)i * RSTEP * ld : head, ok ? bytes : 0);
    }
  }
  template <int ROWS> __device__ __forceinline__ void copy_rows(uint32_t tile, int row0, int limit, int64_t ld) const {
    if (row0 + ROWS <= limit) copy<ROWS, false>(tile, row0, limit, ld);
    else copy<ROWS, true>(tile, row0, limit, ld);
  }

  /* Flip the sign of the 16-bit values this thread copied into a tile of ROWS rows (after its
   * copies completed). */
  template <int ROWS> __device__ __forceinline__ void negate(unsigned char *tile) const {
    if (!active) return;
#pragma unroll
    for (int i = 0; i < ROWS / RSTEP; ++i) {
      uint4 *c = reinterpret_cast<uint4 *>(tile + dst + i * RSTEP * ROW_BYTES);
      uint4 v = *c;
      v.x ^= 0x80008000u, v.y ^= 0x80008000u, v.z ^= 0x80008000u, v.w ^= 0x80008000u;
      *c = v;
    }
  }
};

template <typename T, int DP, int MT, int BN, int NWARPS>
__global__ void __launch_bounds__(32 * NWARPS, 2) cq_attn_fwd_mma(const cq_attn_args a) {
  using C = cq_attn_cfg<T, DP, MT, BN, NWARPS>;
  using Copier = cq_attn_copier<T, DP, C::THREADS>;
  constexpr int NS = C::NS, NO = C::NO;
  constexpr uint32_t ROW = C::LD * sizeof(T); /* bytes per smem row */
  extern __shared__ __align__(16) unsigned char cq_attn_smem[];
  const uint32_t sQ = cq_smem_addr(cq_attn_smem), sK = sQ + C::BM * ROW, sV = sK + BN * ROW;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4, mi = lane / 8;
  const int q0 = blockIdx.x * C::BM, h = blockIdx.y, b = blockIdx.z;
  if (!cq_attn_head_is_full(a, b, h)) return; /* the 8-bit kernel's head */
  const Copier cpq(static_cast<const T *>(a.q) + b * a.q_sb + h * a.q_sh, a.q_ss, a.head_dim);
  const Copier cpk(static_cast<const T *>(a.k) + b * a.k_sb + h * a.k_sh, a.k_ss, a.head_dim);
  const Copier cpv(static_cast<const T *>(a.v) + b * a.v_sb + h * a.v_sh, a.v_ss, a.head_dim);
  const int n_tiles = (a.seq_kv + BN - 1) / BN, n_full = a.seq_kv / BN;

  cpq.template copy<C::BM, true>(sQ, q0, a.seq_q, a.q_ss);
  cpk.template copy_rows<BN>(sK, 0, a.seq_kv, a.k_ss);
  cq_cp_async_commit();
  if (a.scale_log2 < 0.f) { /* scores of -Q with |scale|: the row max stays a max */
    cq_cp_async_wait<0>();
    cpq.template negate<C::BM>(cq_attn_smem);
  }
  const float sl = fabsf(a.scale_log2);

  /* per-lane ldmatrix addresses: A (Q rows), B of S (K rows), B of O (V rows, transposed) */
  const uint32_t aQ = sQ + (warp * 16 * MT + lane % 16) * ROW + (lane / 16) * 16;
  const uint32_t aK = sK + ((mi / 2) * 8 + lane % 8) * ROW + (mi % 2) * 16;
  const uint32_t aV = sV + ((mi % 2) * 8 + lane % 8) * ROW + (mi / 2) * 16;

  /* Small head dims keep the warp's Q fragments in registers: a fifth less shared-memory traffic */
  constexpr bool QREG = MT * (DP / 16) * 4 <= 40;
  uint32_t qf[QREG ? MT : 1][QREG ? DP / 16 : 1][4];
  if constexpr (QREG) {
    cq_cp_async_wait<0>();
    __syncthreads(); /* Q landed (and was negated where the scale is negative) */
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int kk = 0; kk < DP / 16; ++kk) cq_ldsm_x4(qf[i][kk], aQ + i * 16 * ROW + kk * 32);
  }

  float o[MT][NO][4];
  float c[MT][2], l[MT][2]; /* running max (scaled, log2 units; -inf before the first key) and thread-partial sum */
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int n = 0; n < NO; ++n) o[i][n][0] = o[i][n][1] = o[i][n][2] = o[i][n][3] = 0.f;
    c[i][0] = c[i][1] = -INFINITY;
    l[i][0] = l[i][1] = 0.f;
  }

  auto tile = [&](const int j, auto tail_tag) {
    constexpr bool TAIL = decltype(tail_tag)::value;
    const int k0 = j * BN;
    cq_cp_async_wait<0>();
    __syncthreads(); /* K_j landed; every warp is done with V_{j-1} */
    cpv.template copy<BN, TAIL>(sV, k0, a.seq_kv, a.v_ss);
    cq_cp_async_commit();

    float s[MT][NS][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int n = 0; n < NS; ++n) s[i][n][0] = s[i][n][1] = s[i][n][2] = s[i][n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
      uint32_t qa[MT][4];
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        if constexpr (QREG) qa[i][0] = qf[i][kk][0], qa[i][1] = qf[i][kk][1], qa[i][2] = qf[i][kk][2], qa[i][3] = qf[i][kk][3];
        else cq_ldsm_x4(qa[i], aQ + i * 16 * ROW + kk * 32);
      }
#pragma unroll
      for (int n = 0; n < NS; n += 2) {
        uint32_t kb[4];
        cq_ldsm_x4(kb, aK + n * 8 * ROW + kk * 32);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          cq_mma_16816<T>(s[i][n], qa[i], kb[0], kb[1]);
          cq_mma_16816<T>(s[i][n + 1], qa[i], kb[2], kb[3]);
        }
      }
    }

    /* keys past Skv (last tile only): -inf for the max, p = 0 below */
    const int kv_left = a.seq_kv - k0 - 2 * t;
    if (TAIL) {
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (n * 8 + (e & 1) >= kv_left) s[i][n][e] = -INFINITY;
    }
    float mx[MT][2];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float m0 = s[i][0][2 * hh], m1 = s[i][0][2 * hh + 1];
#pragma unroll
        for (int n = 1; n < NS; ++n) m0 = fmaxf(m0, s[i][n][2 * hh]), m1 = fmaxf(m1, s[i][n][2 * hh + 1]);
        mx[i][hh] = cq_quad_max(fmaxf(m0, m1)) * sl;
      }

    cq_cp_async_wait<0>();
    __syncthreads(); /* V_j landed; every warp is done with K_j */
    if (j + 1 < n_tiles) {
      cpk.template copy_rows<BN>(sK, k0 + BN, a.seq_kv, a.k_ss);
      cq_cp_async_commit();
    }

    /* raise the running max only where a row's tile max passed it by more than the slack */
    bool grow = false;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) grow |= mx[i][hh] > c[i][hh] + CQ_ATTN_RESCALE_SLACK;
    if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const float cn = fmaxf(c[i][hh], mx[i][hh]);
          const float alpha = cq_exp2(c[i][hh] - (cn == -INFINITY ? 0.f : cn)); /* 0 before the first key */
          c[i][hh] = cn;
          l[i][hh] *= alpha;
#pragma unroll
          for (int n = 0; n < NO; ++n) o[i][n][2 * hh] *= alpha, o[i][n][2 * hh + 1] *= alpha;
        }
    }

    /* p = 2^(s * sl - c), summed into l, then P in the input type as the A operand of P V */
    uint32_t pa[MT][BN / 16][4];
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const float nc = c[i][hh] == -INFINITY ? 0.f : -c[i][hh];
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float p = cq_exp2(fmaf(s[i][n][2 * hh + e], sl, nc));
            if (TAIL && n * 8 + e >= kv_left) p = 0.f;
            s[i][n][2 * hh + e] = p;
            sum += p;
          }
        l[i][hh] += sum;
      }
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        pa[i][kk][0] = cq_pack2<T>(s[i][2 * kk][0], s[i][2 * kk][1]);
        pa[i][kk][1] = cq_pack2<T>(s[i][2 * kk][2], s[i][2 * kk][3]);
        pa[i][kk][2] = cq_pack2<T>(s[i][2 * kk + 1][0], s[i][2 * kk + 1][1]);
        pa[i][kk][3] = cq_pack2<T>(s[i][2 * kk + 1][2], s[i][2 * kk + 1][3]);
      }
    }

#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
      for (int n = 0; n < NO; n += 2) {
        uint32_t vb[4];
        cq_ldsm_x4_trans(vb, aV + kk * 16 * ROW + n * 16);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          cq_mma_16816<T>(o[i][n], pa[i][kk], vb[0], vb[1]);
          cq_mma_16816<T>(o[i][n + 1], pa[i][kk], vb[2], vb[3]);
        }
      }
    }
  };

  for (int j = 0; j < n_full; ++j) tile(j, cq_bool_tag<false>());
  if (n_full < n_tiles) tile(n_full, cq_bool_tag<true>());

  /* normalise, stage the warp's rows in its own part of sQ, write 16-byte chunks */
  T *stage = reinterpret_cast<T *>(cq_attn_smem) + warp * 16 * MT * C::LD;
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float lsum = cq_quad_sum(l[i][hh]);
      const float inv = 1.f / lsum;
      const int r = i * 16 + hh * 8 + g;
#pragma unroll
      for (int n = 0; n < NO; ++n)
        *reinterpret_cast<uint32_t *>(stage + r * C::LD + n * 8 + 2 * t) =
            cq_pack2<T>(o[i][n][2 * hh] * inv, o[i][n][2 * hh + 1] * inv);
      const int row = q0 + warp * 16 * MT + r;
      if (a.lse && t == 0 && row < a.seq_q)
        a.lse[(int64_t)b * a.lse_sb + (int64_t)h * a.seq_q + row] = (c[i][hh] + __log2f(lsum)) * CQ_LN2;
    }
  }
  __syncwarp();
  T *og = static_cast<T *>(a.out) + b * a.o_sb + h * a.o_sh;
  constexpr int CHUNKS = DP / 8;
#pragma unroll
  for (int idx = lane; idx < 16 * MT * CHUNKS; idx += 32) {
    const int r = idx / CHUNKS, ch = idx % CHUNKS;
    const int row = q0 + warp * 16 * MT + r;
    if (row < a.seq_q && ch * 8 < a.head_dim)
      *reinterpret_cast<uint4 *>(og + (int64_t)row * a.o_ss + ch * 8) =
          *reinterpret_cast<const uint4 *>(stage + r * C::LD + ch * 8);
  }
}

template <typename T, int DP, int MT, int BN, int NWARPS>
static cq_status cq_attn_launch_mma(const cq_attn_args &a, cudaStream_t stream) {
  using C = cq_attn_cfg<T, DP, MT, BN, NWARPS>;
  auto kernel = cq_attn_fwd_mma<T, DP, MT, BN, NWARPS>;
  CQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::SMEM));
  /* two CTAs per SM need the shared-memory side of the L1 carve-out */
  CQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     (int)cudaSharedmemCarveoutMaxShared));
  dim3 grid((unsigned)((a.seq_q + C::BM - 1) / C::BM), (unsigned)a.heads, (unsigned)a.batch);
  kernel<<<grid, C::THREADS, C::SMEM, stream>>>(a);
  CQ_LAUNCH_CHECK("cq_attn_fwd_mma");
  return CQ_OK;
}

/* The one place where a head dim picks its compile-time specialisation (padded dim DP,
 * rows per warp 16 * MT, keys per tile BN, warps). */
template <typename T>
static cq_status dispatch_typed(const cq_attn_args &a, cudaStream_t stream) {
  const int d = a.head_dim;
  if (d <= 64) return cq_attn_launch_mma<T, 64, 2, 64, 4>(a, stream);
  if (d <= 80) return cq_attn_launch_mma<T, 80, 2, 64, 4>(a, stream);
  if (d <= 96) return cq_attn_launch_mma<T, 96, 2, 64, 4>(a, stream);
  if (d <= 128) return cq_attn_launch_mma<T, 128, 2, 64, 4>(a, stream);
  if (d <= 160) return cq_attn_launch_mma<T, 160, 1, 64, 4>(a, stream);
  if (d <= 192) return cq_attn_launch_mma<T, 192, 1, 64, 4>(a, stream);
  return cq_attn_launch_mma<T, 256, 1, 64, 4>(a, stream);
}

cq_status cq_attention_mma_launch(const cq_attn_args &a, int is_bf16, cudaStream_t stream) {
  return is_bf16 ? dispatch_typed<__nv_bfloat16>(a, stream) : dispatch_typed<__half>(a, stream);
}
