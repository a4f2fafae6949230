/* The 8-bit attention kernel on mma.sync (sm_89+; attention_int8.cuh): int8 m16n8k32 for
 * Q K^T, u8 x s8 m16n8k32 for P V (P's u8 codes times V's int8 codes, exact int32 sums of a
 * tile's KB keys, folded into fp32 O once a tile), K and V^T code tiles through shared memory
 * with cp.async. */
#include "attention_int8.cuh"

namespace {

/* Row slices of 16 a warp: with KB = 128 a slice's scores take 64 registers, so two slices
 * would spill next to the O of a wider head (checked with -Xptxas -v). BM = 64 MT divides the
 * workspace's q padding (int8_layout.bm) as long as MT <= int8_mt. */
constexpr int a8_mt(int dp) { return dp <= 64 ? 2 : 1; }

/* The thread's and CTA's indices, read anew (volatile) where used: addresses built from them in
 * the tile loop and after it are recomputed there, not held in registers through the loop (at
 * DP = 256, O and a tile's scores take 192 of the 255). */
struct a8_ids {
  int tid, qb, h, b;
};
__device__ __forceinline__ a8_ids a8_ids_now() {
  a8_ids r;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(r.tid));
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(r.qb));
  asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(r.h));
  asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(r.b));
  return r;
}

/* Thread-independent sizes of one specialisation, and its shared-memory layout (byte offsets):
 * sQ BM rows and sK KB rows of DP + 16 bytes, sV DP rows of KB + 16 (the 16 bytes: ldmatrix rows
 * in distinct banks). */
template <int DP, int MT>
struct a8_cfg {
  static constexpr int BM = 16 * MT * 4, LDQ = DP + 16, LDV = KB + 16, NS = KB / 8, NO = DP / 8, NK = KB / 32;
  static constexpr int SQ = 0, SK = BM * LDQ, SV = SK + KB * LDQ, SMEM = SV + DP * LDV;
};

/* rows x row_bytes of global codes (row stride src_stride) into shared rows of ld_dst bytes,
 * 16 bytes a cp.async, the CTA's 128 threads in whole passes. */
template <int ROWS, int ROW_BYTES>
__device__ __forceinline__ void a8_load_rows(uint32_t dst, const uint8_t *src, int ld_dst, int64_t src_stride, int tid) {
  constexpr int CH = ROW_BYTES / 16;
  static_assert(ROWS * CH % 128 == 0, "whole passes of the CTA");
  if constexpr (128 % CH == 0) { /* the same thread offset every pass: one address pair */
    constexpr int RSTEP = 128 / CH;
    dst += tid / CH * ld_dst + tid % CH * 16;
    src += tid / CH * src_stride + tid % CH * 16;
#pragma unroll
    for (int it = 0; it < ROWS * CH / 128; ++it) cq_cp_async16(dst + it * RSTEP * ld_dst, src + it * RSTEP * src_stride, true);
  } else {
#pragma unroll
    for (int it = 0; it < ROWS * CH / 128; ++it) {
      const int idx = it * 128 + tid, r = idx / CH, c = idx % CH;
      cq_cp_async16(dst + r * ld_dst + c * 16, src + r * src_stride + c * 16, true);
    }
  }
}

template <typename T, int DP, int MT>
__global__ void __launch_bounds__(128, 2) cq_attn8_fwd(const cq_attn_args a, const cq_attn8_ptrs w) {
  using C = a8_cfg<DP, MT>;
  constexpr int BM = C::BM, LDQ = C::LDQ, LDV = C::LDV, NS = C::NS, NO = C::NO, NK = C::NK;
  extern __shared__ __align__(16) unsigned char cq_attn8_smem[];
  /* shared addresses as 32-bit offsets: a thread's base plus constants, folded into immediates */
  const uint32_t s0 = cq_smem_addr(cq_attn8_smem);

  {
    const a8_ids id = a8_ids_now();
    if (cq_attn8_head_skipped(a, id.b, id.h)) return; /* the full-precision kernel's head */
  }
  {
    const a8_ids id = a8_ids_now();
    const int64_t bh = (int64_t)id.b * a.heads + id.h;
    a8_load_rows<BM, DP>(s0 + C::SQ, (const uint8_t *)w.qc + (bh * w.sq_pad + id.qb * BM) * DP, LDQ, DP, id.tid);
    a8_load_rows<KB, DP>(s0 + C::SK, (const uint8_t *)w.kc + bh * w.skv_pad * DP, LDQ, DP, id.tid);
    cq_cp_async_commit();
  }
  /* held through the loop: O, m and l only */
  float o[MT][NO][4], m[MT][2], l[MT][2];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int n = 0; n < NO; ++n) o[i][n][0] = o[i][n][1] = o[i][n][2] = o[i][n][3] = 0.f;
    m[i][0] = m[i][1] = -INFINITY, l[i][0] = l[i][1] = 0.f;
  }

  /* tiles by k0 against a.seq_kv (a kernel parameter): no tile count held in a register */
  for (int k0 = 0; k0 < a.seq_kv; k0 += KB) {
    const bool more = k0 + KB < a.seq_kv;
    const a8_ids id = a8_ids_now();
    const int64_t bh = (int64_t)id.b * a.heads + id.h;
    const int lane = id.tid % 32, warp = id.tid / 32, g = lane / 4, t = lane % 4, mi = lane / 8;
    /* ldmatrix row addresses: Q rows of the warp's slices; K and V^T 8-row groups (x4: matrices
     * 0, 1 rows 0-7 bytes 0-15, 16-31; 2, 3 rows 8-15) */
    const uint32_t qa_at = s0 + C::SQ + (warp * 16 * MT + lane % 16) * LDQ + (lane / 16) * 16;
    const uint32_t kb_at = s0 + C::SK + ((mi / 2) * 8 + lane % 8) * LDQ + (mi % 2) * 16;
    const uint32_t vb_at = s0 + C::SV + ((mi / 2) * 8 + lane % 8) * LDV + (mi % 2) * 16;

    cq_cp_async_wait<0>();
    __syncthreads();
    a8_load_rows<DP, KB>(s0 + C::SV, w.vt + bh * DP * w.skv_pad + k0, LDV, w.skv_pad, id.tid);
    cq_cp_async_commit();

    int si[MT][NS][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int n = 0; n < NS; ++n) si[i][n][0] = si[i][n][1] = si[i][n][2] = si[i][n][3] = 0;
#pragma unroll
    for (int kk = 0; kk < DP / 32; ++kk) {
      uint32_t qa[MT][4];
#pragma unroll
      for (int i = 0; i < MT; ++i) cq_ldsm_x4(qa[i], qa_at + i * 16 * LDQ + kk * 32);
#pragma unroll
      for (int n = 0; n < NS; n += 2) {
        uint32_t bk[4];
        cq_ldsm_x4(bk, kb_at + n * 8 * LDQ + kk * 32);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          cq_mma_s8_16832(si[i][n], qa[i], bk[0], bk[1]);
          cq_mma_s8_16832(si[i][n + 1], qa[i], bk[2], bk[3]);
        }
      }
    }
    __syncthreads();
    if (more) {
      a8_load_rows<KB, DP>(s0 + C::SK, (const uint8_t *)w.kc + (bh * w.skv_pad + k0 + KB) * DP, LDQ, DP, id.tid);
      cq_cp_async_commit();
    }

    /* the tile's softmax step while V^T lands: P's u8 codes as A operands, l folded at once;
     * the row scales are (cached) loads again each tile, not registers held through the loop */
    const float skj = w.sk[bh * (w.skv_pad / KB) + k0 / KB];
    const float *sq = w.sq + bh * w.sq_pad + id.qb * BM + warp * 16 * MT + g;
    const bool tail = k0 + KB > a.seq_kv;
    const int kv_left = a.seq_kv - k0 - 2 * t;
    uint32_t pa[MT][NK][4];
    float alpha[MT][2], beta[MT][2];
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      int ls[2];
      const float qs[2] = {sq[i * 16], sq[i * 16 + 8]};
      auto &sif = reinterpret_cast<const int(&)[4 * NS]>(si[i]);
      if (tail) cq_attn8_tile_softmax<true, NS>(sif, pa[i], qs, skj, kv_left, m[i], alpha[i], beta[i], ls);
      else cq_attn8_tile_softmax<false, NS>(sif, pa[i], qs, skj, kv_left, m[i], alpha[i], beta[i], ls);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) l[i][hh] = cq_attn8_fold(l[i][hh], alpha[i][hh], beta[i][hh], ls[hh]);
      if constexpr (DP > 128) {
        /* wide heads: O times alpha here, the same product the fold would round, and alpha 1 in
         * the fold, so that alpha is not held through P V */
#pragma unroll
        for (int n = 0; n < NO; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[i][n][e] *= alpha[i][e / 2];
        alpha[i][0] = alpha[i][1] = 1.f;
      }
    }

    if (more) cq_cp_async_wait<1>();
    else cq_cp_async_wait<0>();
    __syncthreads();

    /* P V per pair of dim n-tiles: a fresh int32 sum over the tile's KB keys (exact, below
     * 2^22), folded into O with the tile's alpha and beta */
#pragma unroll
    for (int n = 0; n < NO; n += 2) {
      int acc[MT][2][4];
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int x = 0; x < 2; ++x) acc[i][x][0] = acc[i][x][1] = acc[i][x][2] = acc[i][x][3] = 0;
#pragma unroll
      for (int ks = 0; ks < NK; ++ks) {
        uint32_t bv[4];
        cq_ldsm_x4(bv, vb_at + n * 8 * LDV + ks * 32);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          cq_mma_u8s8_16832(acc[i][0], pa[i][ks], bv[0], bv[1]);
          cq_mma_u8s8_16832(acc[i][1], pa[i][ks], bv[2], bv[3]);
        }
      }
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int x = 0; x < 2; ++x)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            o[i][n + x][e] = cq_attn8_fold(o[i][n + x][e], alpha[i][e / 2], beta[i][e / 2], acc[i][x][e]);
      /* wide heads: a scheduling fence every 64 dims, or ptxas overlaps so many pairs that O spills */
      if constexpr (DP > 128)
        if (n % 8 == 6) __syncwarp();
    }
  }

  /* out = o / l * sv; lse = (m + log2 l - log2 255 + q'.kmean) / log2(e) */
  const a8_ids id = a8_ids_now();
  const int64_t bh = (int64_t)id.b * a.heads + id.h;
  const int lane = id.tid % 32, g = lane / 4, t = lane % 4, r0 = id.qb * BM + id.tid / 32 * 16 * MT + g;
  T *og = static_cast<T *>(a.out) + id.b * a.o_sb + id.h * a.o_sh;
  const float *sv = w.sv + bh * DP;
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float lsum = l[i][hh];
      const float inv = 1.f / lsum;
      const int row = r0 + i * 16 + hh * 8;
      if (row >= a.seq_q) continue;
#pragma unroll
      for (int n = 0; n < NO; ++n) {
        const int col = n * 8 + 2 * t;
        if (col < a.head_dim)
          *reinterpret_cast<uint32_t *>(og + (int64_t)row * a.o_ss + col) =
              cq_pack2<T>(o[i][n][2 * hh] * inv * sv[col], o[i][n][2 * hh + 1] * inv * sv[col + 1]);
      }
      if (a.lse && t == 0)
        a.lse[(int64_t)id.b * a.lse_sb + (int64_t)id.h * a.seq_q + row] =
            (m[i][hh] + (__log2f(lsum) - CQ_LOG2_255) + w.qbias[bh * w.sq_pad + row]) / CQ_LOG2E;
    }
  }
}

template <typename T, int DP>
cq_status launch(const cq_attn_args &a, const cq_attn8_ptrs &w, cudaStream_t stream) {
  constexpr int MT = a8_mt(DP), BM = a8_cfg<DP, MT>::BM;
  constexpr size_t smem = a8_cfg<DP, MT>::SMEM; /* 89088 bytes at DP = 256 */
  static_assert(smem <= 99 * 1024, "within the opt-in shared memory of sm_89 (99 KiB a block)");
  auto kernel = cq_attn8_fwd<T, DP, MT>;
  CQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  dim3 grid((unsigned)((a.seq_q + BM - 1) / BM), (unsigned)a.heads, (unsigned)a.batch);
  kernel<<<grid, 128, smem, stream>>>(a, w);
  CQ_LAUNCH_CHECK("cq_attn8_fwd");
  return CQ_OK;
}

template <typename T>
cq_status launch_dp(int dp, const cq_attn_args &a, const cq_attn8_ptrs &w, cudaStream_t stream) {
  switch (dp) {
    case 64: return launch<T, 64>(a, w, stream);
    case 96: return launch<T, 96>(a, w, stream);
    case 128: return launch<T, 128>(a, w, stream);
    case 256: return launch<T, 256>(a, w, stream);
    default: return cq_fail(CQ_ERR_INTERNAL, "8-bit attention: no kernel for padded head dim %d", dp);
  }
}

}  // namespace

/* The one place where a padded head dim picks the mma.sync kernel's specialisation (int8_dp). */
cq_status cq_attn8_mma_launch(int is_bf16, int dp, const cq_attn_args &a, const cq_attn8_ptrs &w, cudaStream_t stream) {
  return is_bf16 ? launch_dp<__nv_bfloat16>(dp, a, w, stream) : launch_dp<__half>(dp, a, w, stream);
}
