/* Flash-attention forward with wgmma (sm_90a), bf16/fp16, head dims up to 64 and 97..128.
 *
 * One or two warpgroups per CTA, 64 query rows each, tiles of BN = 128 keys. Q, K and V
 * live in shared memory in wgmma's no-swizzle canonical layout: 8 x 16-byte "core matrices"
 * (8 rows, 8 elements each, 128 contiguous bytes), the core matrices of a row group along
 * the head dim next to each other. A cp.async chunk index maps to that layout one to one, so
 * a warp's copies land in 512 contiguous bytes. S = Q K^T reads both operands from shared
 * memory (K-major descriptors); O += P V takes P from registers (the S accumulators rounded
 * to the input type, same fragment layout as mma.sync) and V through an MN-major descriptor.
 * Online softmax in registers as in the mma.sync kernel; loads overlap the GEMMs the same way
 * (V_j during Q K_j^T, K_{j+1} during softmax and P V_j).
 *
 * Opt-in (CQUANT_ATTN_SM90=1) until validated on the GPU machine; "sm90" in
 * CQUANT_ATTN_DISABLE switches it off as well. Needs the sm_90a target in the build. */
#include "attention_common.cuh"
#include "attention_wgmma.cuh"

namespace {

constexpr int SM90_BN = 128;

/* NWG warpgroups of 64 query rows per CTA. */
template <int DP, int NWG> struct sm90_cfg {
  static constexpr int BM = 64 * NWG, THREADS = 128 * NWG;
  static constexpr int CHUNKS = DP / 8;                     /* 16-byte chunks per row */
  static constexpr size_t Q_BYTES = (size_t)BM * DP * 2;
  static constexpr size_t KV_BYTES = (size_t)SM90_BN * DP * 2;
  static constexpr size_t SMEM = Q_BYTES + 2 * KV_BYTES;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

/* Rows [row0, row0 + ROWS) of one head into the canonical layout: chunk idx = ((r / 8) * CHUNKS
 * + c) * 8 + r % 8 sits at byte idx * 16. Rows past `limit` and columns past head_dim are zero. */
template <typename T, int DP, int ROWS, int THREADS>
__device__ __forceinline__ void sm90_load(unsigned char *smem, const T *base, int64_t row_stride, int row0, int limit,
                                          int head_dim) {
  constexpr int CHUNKS = DP / 8;
#pragma unroll 4
  for (int idx = threadIdx.x; idx < ROWS * CHUNKS; idx += THREADS) {
    const int r = (idx / (8 * CHUNKS)) * 8 + idx % 8, c = (idx / 8) % CHUNKS;
    const bool valid = row0 + r < limit && c * 8 < head_dim;
    const T *src = valid ? base + (int64_t)(row0 + r) * row_stride + c * 8 : base;
    cq_cp_async16(smem + (size_t)idx * 16, src, valid);
  }
}

template <typename T, int DP> struct sm90_pv;
template <typename T> struct sm90_pv<T, 64> {
  static __device__ __forceinline__ void run(float (&o)[32], const uint32_t (&a)[4], uint64_t b) {
    cq_wgmma_m64n64k16_rs<T>(o, a, b, 1);
  }
};
template <typename T> struct sm90_pv<T, 128> {
  static __device__ __forceinline__ void run(float (&o)[64], const uint32_t (&a)[4], uint64_t b) {
    cq_wgmma_m64n128k16_rs<T>(o, a, b, 1);
  }
};

#endif

template <typename T, int DP, int NWG>
__global__ void __launch_bounds__(128 * NWG, NWG == 1 ? 2 : 1) cq_attn_fwd_sm90(const cq_attn_args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = sm90_cfg<DP, NWG>;
  constexpr int NS = SM90_BN / 8, NO = DP / 8;
  extern __shared__ __align__(1024) unsigned char cq_sm90_smem[];
  unsigned char *sQ = cq_sm90_smem, *sK = sQ + C::Q_BYTES, *sV = sK + C::KV_BYTES;

  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int q0 = blockIdx.x * C::BM, h = blockIdx.y, b = blockIdx.z;
  const T *qg = static_cast<const T *>(a.q) + b * a.q_sb + h * a.q_sh;
  const T *kg = static_cast<const T *>(a.k) + b * a.k_sb + h * a.k_sh;
  const T *vg = static_cast<const T *>(a.v) + b * a.v_sb + h * a.v_sh;
  const int n_tiles = (a.seq_kv + SM90_BN - 1) / SM90_BN;

  sm90_load<T, DP, C::BM, C::THREADS>(sQ, qg, a.q_ss, q0, a.seq_q, a.head_dim);
  sm90_load<T, DP, SM90_BN, C::THREADS>(sK, kg, a.k_ss, 0, a.seq_kv, a.head_dim);
  cq_cp_async_commit();

  float o[DP / 2];
#pragma unroll
  for (int i = 0; i < DP / 2; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  /* this warpgroup's 64 rows of Q: 8 row groups of CHUNKS core matrices */
  const unsigned char *sQw = sQ + (size_t)wg * 8 * C::CHUNKS * 128;

  for (int j = 0; j < n_tiles; ++j) {
    const int k0 = j * SM90_BN;
    cq_cp_async_wait<0>();
    sm90_fence_proxy();
    __syncthreads(); /* K_j landed and is visible to wgmma; everyone is done with V_{j-1} */
    sm90_load<T, DP, SM90_BN, C::THREADS>(sV, vg, a.v_ss, k0, a.seq_kv, a.head_dim);
    cq_cp_async_commit();

    float s[SM90_BN / 2];
    sm90_fence_regs(s);
    sm90_wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk)
      cq_wgmma_m64n128k16_ss<T>(s, sm90_desc(sQw + kk * 256, 128, DP * 16), sm90_desc(sK + kk * 256, 128, DP * 16),
                                kk > 0);
    sm90_wgmma_commit();
    sm90_wgmma_wait0();
    sm90_fence_regs(s);
    __syncthreads(); /* both warpgroups are done reading K_j */
    if (j + 1 < n_tiles) {
      sm90_load<T, DP, SM90_BN, C::THREADS>(sK, kg, a.k_ss, k0 + SM90_BN, a.seq_kv, a.head_dim);
      cq_cp_async_commit();
    }

    const bool tail = k0 + SM90_BN > a.seq_kv;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < NS; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float x = s[4 * n + 2 * hh + e] * a.scale_log2;
          if (tail && k0 + n * 8 + 2 * t + e >= a.seq_kv) x = -INFINITY;
          s[4 * n + 2 * hh + e] = x;
          mx = fmaxf(mx, x);
        }
      mx = cq_quad_max(mx);
      const float m_new = fmaxf(m[hh], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = cq_exp2(m[hh] - m_use);
      m[hh] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < NS; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p = cq_exp2(s[4 * n + 2 * hh + e] - m_use);
          s[4 * n + 2 * hh + e] = p;
          sum += p;
        }
      l[hh] = l[hh] * alpha + sum;
#pragma unroll
      for (int n = 0; n < NO; ++n) o[4 * n + 2 * hh] *= alpha, o[4 * n + 2 * hh + 1] *= alpha;
    }
    uint32_t pa[SM90_BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < SM90_BN / 16; ++kk) {
      pa[kk][0] = cq_pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
      pa[kk][1] = cq_pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
      pa[kk][2] = cq_pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
      pa[kk][3] = cq_pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
    }

    if (j + 1 < n_tiles) cq_cp_async_wait<1>();
    else cq_cp_async_wait<0>();
    sm90_fence_proxy();
    __syncthreads(); /* V_j landed and is visible to wgmma */

    sm90_fence_regs(o);
    sm90_wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < SM90_BN / 16; ++kk)
      sm90_pv<T, DP>::run(o, pa[kk], sm90_desc(sV + (size_t)kk * 2 * C::CHUNKS * 128, DP * 16, 128));
    sm90_wgmma_commit();
    sm90_wgmma_wait0();
    sm90_fence_regs(o);
  }

  T *og = static_cast<T *>(a.out) + b * a.o_sb + h * a.o_sh;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const float lsum = cq_quad_sum(l[hh]);
    const float inv = 1.f / lsum;
    const int row = q0 + wg * 64 + warp * 16 + hh * 8 + g;
    if (row >= a.seq_q) continue;
#pragma unroll
    for (int n = 0; n < NO; ++n) {
      const int col = n * 8 + 2 * t;
      if (col < a.head_dim)
        *reinterpret_cast<uint32_t *>(og + (int64_t)row * a.o_ss + col) =
            cq_pack2<T>(o[4 * n + 2 * hh] * inv, o[4 * n + 2 * hh + 1] * inv);
    }
    if (a.lse && t == 0) a.lse[((int64_t)b * a.heads + h) * a.seq_q + row] = (m[hh] + __log2f(lsum)) * CQ_LN2;
  }
#else
  static_assert(sm90_cfg<DP, NWG>::CHUNKS > 0, "head dim");
  (void)a;
  __trap(); /* built without the sm_90a target: the launcher is not reached on such builds */
#endif
}

template <typename T, int DP, int NWG> cq_status sm90_launch(const cq_attn_args &a, cudaStream_t stream) {
  using C = sm90_cfg<DP, NWG>;
  auto kernel = cq_attn_fwd_sm90<T, DP, NWG>;
  const size_t smem = C::SMEM;
  CQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  dim3 grid((unsigned)((a.seq_q + C::BM - 1) / C::BM), (unsigned)a.heads, (unsigned)a.batch);
  kernel<<<grid, C::THREADS, smem, stream>>>(a);
  CQ_LAUNCH_CHECK("cq_attn_fwd_sm90");
  return CQ_OK;
}

}  // namespace

/* Whether the wgmma kernel takes this call: sm_90, opted in, not disabled, a head dim it has. */
int cq_attention_sm90_applies(const cq_attn_args &a, int cc) {
  const char *on = getenv("CQUANT_ATTN_SM90");
  if (cc != 90 || !on || strcmp(on, "1") != 0 || cq_attn_kernel_disabled("sm90")) return 0;
  return a.head_dim <= 64 || (a.head_dim > 96 && a.head_dim <= 128);
}

/* The one place where the wgmma kernel's specialisation is chosen: padded head dim 64 or 128,
 * and one or two warpgroups per CTA (CQUANT_ATTN_SM90_WG=1 gives two independent 64-row CTAs
 * per SM instead of one 128-row CTA of two warpgroups; the benchmark times both). */
cq_status cq_attention_sm90_launch(const cq_attn_args &a, int is_bf16, cudaStream_t stream) {
  const char *wg_env = getenv("CQUANT_ATTN_SM90_WG");
  const int one = wg_env && strcmp(wg_env, "1") == 0;
  const int key = (a.head_dim <= 64 ? 0 : 4) + (one ? 0 : 2) + (is_bf16 ? 1 : 0);
  switch (key) {
    case 0: return sm90_launch<__half, 64, 1>(a, stream);
    case 1: return sm90_launch<__nv_bfloat16, 64, 1>(a, stream);
    case 2: return sm90_launch<__half, 64, 2>(a, stream);
    case 3: return sm90_launch<__nv_bfloat16, 64, 2>(a, stream);
    case 4: return sm90_launch<__half, 128, 1>(a, stream);
    case 5: return sm90_launch<__nv_bfloat16, 128, 1>(a, stream);
    case 6: return sm90_launch<__half, 128, 2>(a, stream);
    default: return sm90_launch<__nv_bfloat16, 128, 2>(a, stream);
  }
}
