/* 8-bit GEMM with the scale/bias epilogue on warp-level tensor cores
 * (mma.sync m16n8k32): int8 x int8 -> int32 on sm_80+, fp8 x fp8 -> fp32 on
 * sm_89+. y[M, N] = (A[M, K] . B[N, K]^T) * sa[m] * sb[n] + bias[n] (then the activation and,
 * for a gated layer, residual + gate * that: cq_gemm8_args).
 *
 * Block tile 128 x 128 x 128 bytes, 8 warps of 64 x 32, a 3-stage cp.async
 * pipeline (96 KiB of shared memory, which sm_86/89 can give one block), rows
 * and columns past M, N read as zeros and are not stored. */
#include "gemm8_common.cuh"

using namespace cq_gemm8;

namespace {

constexpr int BM = 128, BN = 128, BK = 128, STAGES = 3, THREADS = 256;
constexpr int TILE_A = BM * BK, TILE_B = BN * BK;
constexpr int SMEM_BYTES = STAGES * (TILE_A + TILE_B);

template <int AF, int BF> struct mma_op {
  typedef float acc_t;
  __device__ static void run(acc_t (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    cq_mma_f8_16832<AF == CQ_FORMAT_FP8_E4M3, BF == CQ_FORMAT_FP8_E4M3>(c, a, b[0], b[1]);
  }
};
template <> struct mma_op<CQ_FORMAT_INT8, CQ_FORMAT_INT8> {
  typedef int32_t acc_t;
  __device__ static void run(acc_t (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    cq_mma_s8_16832(c, a, b[0], b[1]);
  }
};

/* Rows [row0, row0 + 128) x bytes [k0, k0 + 128) of a K-contiguous operand
 * into a swizzled stage; 4 chunks of 16 B per thread. */
__device__ __forceinline__ void load_tile(uint32_t dst, const uint8_t *src, int64_t ld, int64_t rows, int64_t row0,
                                          int64_t k0, int64_t kpad) {
#pragma unroll
  for (int i = 0; i < (128 * 8) / THREADS; ++i) {
    const int c = threadIdx.x + i * THREADS, row = c >> 3, chunk = c & 7;
    const int64_t gr = row0 + row, gk = k0 + chunk * 16;
    const bool p = gr < rows && gk < kpad;
    cq_cp_async16(dst + swizzle(row, chunk), p ? src + gr * ld + gk : src, p);
  }
}

struct mma_params {
  const uint8_t *a, *b;
  int64_t m, n, kpad, lda, ldb;
  int64_t tiles_m, tiles_n;
  epilogue e;
};

template <int AF, int BF, typename OutT>
__global__ void __launch_bounds__(THREADS, 1) gemm8_mma_kernel(const mma_params p) {
  typedef typename mma_op<AF, BF>::acc_t acc_t;
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t s_base = cq_smem_addr(smem);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp >> 2, wn = warp & 3; /* 2 x 4 warps of 64 x 32 */

  int64_t tm, tn;
  tile_of(blockIdx.x, p.tiles_m, p.tiles_n, &tm, &tn);
  const int64_t m0 = tm * BM, n0 = tn * BN;
  const int ktiles = (int)((p.kpad + BK - 1) / BK);

  auto stage_a = [&](int s) { return s_base + (uint32_t)(s * (TILE_A + TILE_B)); };
  auto stage_b = [&](int s) { return s_base + (uint32_t)(s * (TILE_A + TILE_B) + TILE_A); };
  auto load_stage = [&](int s, int kt) {
    load_tile(stage_a(s), p.a, p.lda, p.m, m0, (int64_t)kt * BK, p.kpad);
    load_tile(stage_b(s), p.b, p.ldb, p.n, n0, (int64_t)kt * BK, p.kpad);
  };

  acc_t acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][j][r] = 0;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ktiles) load_stage(s, s);
    cq_cp_async_commit();
  }

  for (int kt = 0; kt < ktiles; ++kt) {
    cq_cp_async_wait<STAGES - 2>(); /* tile kt has landed (this thread's part) */
    __syncthreads();             /* ... everyone's, and stage kt-1 is free */
    const int nk = kt + STAGES - 1;
    if (nk < ktiles) load_stage(nk % STAGES, nk);
    cq_cp_async_commit();

    const uint32_t sa = stage_a(kt % STAGES), sb = stage_b(kt % STAGES);
#pragma unroll
    for (int kk = 0; kk < BK / 32; ++kk) {
      uint32_t af[4][4], bf[4][2];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        cq_ldsm_x4(af[i], sa + swizzle(wm * 64 + i * 16 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        uint32_t r[4];
        cq_ldsm_x4(r, sb + swizzle(wn * 32 + jj * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)));
        bf[2 * jj][0] = r[0], bf[2 * jj][1] = r[1], bf[2 * jj + 1][0] = r[2], bf[2 * jj + 1][1] = r[3];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_op<AF, BF>::run(acc[i][j], af[i], bf[j]);
    }
  }
  cq_cp_async_wait<0>();

  /* accumulator (i, j): rows +g and +g+8, columns 2t and 2t+1 of an m16n8 tile */
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t col = n0 + wn * 32 + j * 8 + 2 * t;
    float sb0, sb1, b0, b1;
    column_terms(p.e, col, &sb0, &b0);
    column_terms(p.e, col + 1, &sb1, &b1);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t row = m0 + wm * 64 + i * 16 + g + 8 * h;
        const float s_a = row < p.m ? p.e.sa[row] : 0.0f;
        store_pair<OutT>(p.e, row, col, (float)acc[i][j][2 * h], (float)acc[i][j][2 * h + 1], s_a, sb0, sb1, b0, b1);
      }
    }
  }
}

template <int AF, int BF, typename OutT>
cq_status launch(const mma_params &p, cudaStream_t s) {
  auto kernel = gemm8_mma_kernel<AF, BF, OutT>;
  CQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES));
  const int64_t blocks = p.tiles_m * p.tiles_n;
  if (blocks > 0x7fffffffLL) return cq_fail(CQ_ERR_UNSUPPORTED, "8-bit GEMM: %lld tiles is too many", (long long)blocks);
  kernel<<<(unsigned)blocks, THREADS, SMEM_BYTES, s>>>(p);
  CQ_LAUNCH_CHECK(gemm8_mma_kernel);
  return CQ_OK;
}

template <int AF, int BF>
cq_status launch_out(const mma_params &p, cq_dtype y_dtype, cudaStream_t s) {
  switch (y_dtype) {
    case CQ_DTYPE_F32: return launch<AF, BF, float>(p, s);
    case CQ_DTYPE_F16: return launch<AF, BF, __half>(p, s);
    case CQ_DTYPE_BF16: return launch<AF, BF, __nv_bfloat16>(p, s);
    default: break;
  }
  return cq_fail(CQ_ERR_INTERNAL, "8-bit GEMM: output dtype %s", cq_dtype_name(y_dtype));
}

}  // namespace

cq_status cq_gemm8_mma_cuda(const cq_gemm8_args *g, cudaStream_t stream) {
  mma_params p;
  p.a = g->a, p.b = g->b, p.m = g->m, p.n = g->n, p.kpad = g->kpad, p.lda = g->lda, p.ldb = g->ldb;
  p.tiles_m = (g->m + BM - 1) / BM, p.tiles_n = (g->n + BN - 1) / BN;
  p.e = epilogue_of(g);
  const int af = g->a_format, bf = g->b_format;
  if (af == CQ_FORMAT_INT8 && bf == CQ_FORMAT_INT8) return launch_out<CQ_FORMAT_INT8, CQ_FORMAT_INT8>(p, g->y_dtype, stream);
  if (af == CQ_FORMAT_FP8_E4M3 && bf == CQ_FORMAT_FP8_E4M3)
    return launch_out<CQ_FORMAT_FP8_E4M3, CQ_FORMAT_FP8_E4M3>(p, g->y_dtype, stream);
  if (af == CQ_FORMAT_FP8_E4M3 && bf == CQ_FORMAT_FP8_E5M2)
    return launch_out<CQ_FORMAT_FP8_E4M3, CQ_FORMAT_FP8_E5M2>(p, g->y_dtype, stream);
  if (af == CQ_FORMAT_FP8_E5M2 && bf == CQ_FORMAT_FP8_E4M3)
    return launch_out<CQ_FORMAT_FP8_E5M2, CQ_FORMAT_FP8_E4M3>(p, g->y_dtype, stream);
  if (af == CQ_FORMAT_FP8_E5M2 && bf == CQ_FORMAT_FP8_E5M2)
    return launch_out<CQ_FORMAT_FP8_E5M2, CQ_FORMAT_FP8_E5M2>(p, g->y_dtype, stream);
  return cq_fail(CQ_ERR_INTERNAL, "8-bit GEMM: formats %d x %d", af, bf);
}
