/* Mixed-input GEMM on warp-level tensor cores (mma.sync) for 4-bit weights per group
 * (cquant.h, "4-bit weights per group"; operands in cq_mixed_args, linear_impl.cuh):
 *
 *   weight-only  a = x bf16/f16, m16n8k16: the packed nibbles are decoded in registers to
 *                w' = x' rounded to x's type, y = act(sum_k x w' + b)
 *   dynamic      a = int8 (m16n8k32, int32) or fp8 e4m3 (m16n8k32, fp32) codes, int4 weights as
 *                int8 / e4m3 bytes; each group's sum acc_g is scaled by sw[n, g] and added to an
 *                fp32 accumulator (group order), y = act(acc * sa[m] + b)
 *
 * then the gated residual of cq_linear_out where the layer has a gate, stored rounded once.
 *
 * Few output tiles (small M) split K: blockIdx.y takes one range of whole groups and k-tiles,
 * writes its fp32 sum (weight-only: sum x w'; dynamic: sum_g acc_g sw over its groups) to the
 * caller's scratch, and a second kernel adds the ranges in order and runs the epilogue.
 *
 * Fragments (PTX ISA, mma.m16n8k16 / m16n8k32; lane = 4 g + c): A from ldmatrix.x4 of the
 * swizzled x tile, matrix q from lanes 8q..8q+7 (rows lane & 15, 16-byte chunk 2t + (lane >> 4)),
 * so a0 / a1 = rows g / g+8 at the step's first 16 bytes of K and a2 / a3 the same rows at its
 * last 16: 16-bit elements 2c, 2c+1 (+8), or 8-bit codes 4c..4c+3 (+16). B (decoded here): b0 and
 * b1 hold weight row g at the same K as a0 and a2. Accumulator: c0, c1 = row g, columns 2c, 2c+1;
 * c2, c3 = row g+8.
 *
 * Block tile BM (64 or 128) x 128 x BK, 8 warps as 2 x 4 of (BM / 2) x 32, a cp.async pipeline of
 * STAGES stages, each holding a swizzled x tile (128 bytes of K a row: BK = 64 16-bit values or
 * 128 codes), the packed weight tile (BK / 2 bytes a row) and the scales (and zero points) of the
 * groups the tile touches. Rows past M, weight rows past N and K past k read as zeros (scales of
 * missing groups as 0, so such weights decode to 0 even under a NaN scale) and are not stored. */
#include "gemm8_common.cuh"
#include "int4_decode.cuh"

using cq_gemm8::swizzle;
using cq_gemm8::tile_of;

namespace {

constexpr int BN = 128, THREADS = 256;

enum AKind { kABf16 = 0, kAF16 = 1, kAInt8 = 2, kAE4M3 = 3 };

/* Tile sizes of each kind of operand a. */
template <int AK>
struct Cfg {
  static constexpr bool kWeightOnly = AK == kABf16 || AK == kAF16;
  static constexpr int BK = kWeightOnly ? 64 : 128;         /* codes of K a stage */
  static constexpr int WB = BK / 2;                          /* packed weight bytes a row and stage */
  static constexpr int WS = kWeightOnly ? WB : WB + 16;      /* their row stride in shared memory:
                                                                80 keeps the dynamic kernel's
                                                                4-byte reads free of bank conflicts */
  static constexpr int GMAX = BK / 32;                       /* groups a stage can touch */
  static constexpr int SPR = 2 * GMAX;                       /* scale floats a row (room for zp) */
  static constexpr int STAGES = kWeightOnly ? 4 : 3;
};

template <int AK, int MI>
struct Smem {
  static constexpr int BM = 32 * MI;
  static constexpr int A = BM * 128, W = BN * Cfg<AK>::WS, S = BN * Cfg<AK>::SPR * 4;
  static constexpr int STAGE = A + W + S;
  static constexpr int BYTES = Cfg<AK>::STAGES * STAGE;
};

struct mixed_params {
  const uint8_t *a;     /* row r at a + r * lda_bytes */
  int64_t lda_bytes;
  const float *sa;      /* dynamic: [m] */
  const uint8_t *w;     /* packed rows ldw bytes apart */
  int64_t ldw;
  const float *sw;      /* [n, groups, E] */
  int64_t groups;
  int gs_log2;          /* log2(group size), 5..10 */
  int64_t m, n, k;
  int64_t tiles_m, tiles_n;
  const void *bias;
  cq_dtype bias_dtype;
  int activation;
  int pair_ok;          /* y rows take 2-element stores */
  cq_linear_out out;
  int splits;           /* K ranges (gridDim.y); 1: no split */
  int64_t k_split;      /* K of a range: a multiple of the k-tile and of the group size */
  float *part;          /* splits > 1: [splits][m][n] fp32 sums of the ranges */
};

/* (row, col) and (row, col + 1) of y from their fp32 values before the activation; col even. */
__device__ __forceinline__ void store_pair(const mixed_params &p, int64_t row, int64_t col, float v0, float v1) {
  if (row >= p.m || col >= p.n) return;
  const int64_t i = row * p.out.ldy + col;
  const float r0 = cq_out_value(p.out, row, col, cq_activate(v0, p.activation));
  if (col + 1 < p.n) {
    const float r1 = cq_out_value(p.out, row, col + 1, cq_activate(v1, p.activation));
    if (p.pair_ok) {
      cq_store_any2(p.out.y, p.out.y_dtype, i, r0, r1);
      return;
    }
    cq_store_any(p.out.y, p.out.y_dtype, i + 1, r1);
  }
  cq_store_any(p.out.y, p.out.y_dtype, i, r0);
}

/* The mma of one k-step: m16n8k16 (16-bit a) or m16n8k32 (8-bit a). */
template <int AK, typename Acc>
__device__ __forceinline__ void mma(Acc (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (AK == kABf16) cq_mma_16816_f32<true>(d, a, b0, b1);
  else if constexpr (AK == kAF16) cq_mma_16816_f32<false>(d, a, b0, b1);
  else if constexpr (AK == kAInt8) cq_mma_s8_16832(d, a, b0, b1);
  else cq_mma_f8_16832<true, true>(d, a, b0, b1);
}

template <int AK, bool U4, int MI>
__global__ void __launch_bounds__(THREADS, 1) gemm_mixed_kernel(const mixed_params p) {
  typedef Cfg<AK> C;
  typedef Smem<AK, MI> S;
  constexpr bool WO = C::kWeightOnly;
  constexpr int BK = C::BK, E = U4 ? 2 : 1;
  typedef typename std::conditional<AK == kAInt8, int32_t, float>::type acc_t;

  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t s_base = cq_smem_addr(smem);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp >> 2, wn = warp & 3;
  const int g = lane >> 2, c = lane & 3; /* fragment coordinates: group and thread in group */

  int64_t tm, tn;
  tile_of(blockIdx.x, p.tiles_m, p.tiles_n, &tm, &tn);
  const int64_t m0 = tm * S::BM, n0 = tn * BN;
  const int64_t kbeg = (int64_t)blockIdx.y * p.k_split;
  const int64_t kend_all = kbeg + p.k_split < p.k ? kbeg + p.k_split : p.k;
  const int kt0 = (int)(kbeg / BK);
  const int ktiles = (int)((kend_all - kbeg + BK - 1) / BK); /* k-tiles of this range */
  const int gs = 1 << p.gs_log2;
  const int gt = gs < BK ? BK >> p.gs_log2 : 1; /* groups one stage touches */
  const int64_t a_bytes = p.k * (WO ? 2 : 1), w_bytes = p.k / 2;

  auto stage_a = [&](int s) { return s_base + (uint32_t)(s * S::STAGE); };
  auto stage_w = [&](int s) { return s_base + (uint32_t)(s * S::STAGE + S::A); };
  auto stage_s = [&](int s) { return s_base + (uint32_t)(s * S::STAGE + S::A + S::W); };

  auto load_stage = [&](int s, int kt) {
    const int64_t k0 = (int64_t)kt * BK;
    /* x: 128 bytes of K a row, in 16-byte chunks, swizzled */
    const int64_t kb0 = k0 * (WO ? 2 : 1);
#pragma unroll
    for (int i = 0; i < S::BM * 8 / THREADS; ++i) {
      const int ch = threadIdx.x + i * THREADS, row = ch >> 3, part = ch & 7;
      const int64_t gr = m0 + row, gk = kb0 + part * 16;
      const bool ok = gr < p.m && gk < a_bytes;
      cq_cp_async16(stage_a(s) + swizzle(row, part), ok ? p.a + gr * p.lda_bytes + gk : p.a, ok);
    }
    /* packed weights: WB bytes a row */
    constexpr int WCH = C::WB / 16;
#pragma unroll
    for (int i = 0; i < BN * WCH / THREADS; ++i) {
      const int ch = threadIdx.x + i * THREADS, row = ch / WCH, part = ch % WCH;
      const int64_t gn = n0 + row, gb = k0 / 2 + part * 16;
      const bool ok = gn < p.n && gb < w_bytes;
      cq_cp_async16(stage_w(s) + (uint32_t)(row * C::WS + part * 16), ok ? p.w + gn * p.ldw + gb : p.w, ok);
    }
    /* scales (and zero points) of the groups of the stage: [row][group][E] */
    const int per_row = gt * E, cnt = BN * per_row;
    const int64_t g0 = k0 >> p.gs_log2;
    for (int i = threadIdx.x; i < cnt; i += THREADS) {
      const int row = i / per_row, rem = i - row * per_row, gi = rem / E, e = rem - gi * E;
      const int64_t gn = n0 + row, gg = g0 + gi;
      const bool ok = gn < p.n && gg < p.groups;
      cq_cp_async4(stage_s(s) + (uint32_t)((row * C::SPR + gi * E + e) * 4), ok ? p.sw + (gn * p.groups + gg) * E + e : p.sw,
                ok);
    }
  };

  acc_t acc[MI][4][4];
  float facc[WO ? 1 : MI][4][4]; /* dynamic: the scaled sum over finished groups */
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        acc[i][j][r] = 0;
        if constexpr (!WO) facc[i][j][r] = 0.0f;
      }

#pragma unroll
  for (int s = 0; s < C::STAGES - 1; ++s) {
    if (s < ktiles) load_stage(s, kt0 + s);
    cq_cp_async_commit();
  }

  for (int kt = 0; kt < ktiles; ++kt) {
    cq_cp_async_wait<C::STAGES - 2>();
    __syncthreads();
    const int nk = kt + C::STAGES - 1;
    if (nk < ktiles) load_stage(nk % C::STAGES, kt0 + nk);
    cq_cp_async_commit();

    const int st = kt % C::STAGES;
    const uint32_t sa = stage_a(st), sw = stage_w(st), ss = stage_s(st);
    const int64_t k0 = (int64_t)(kt0 + kt) * BK;
    if constexpr (WO) {
      /* k-step t covers k0 + 16t .. +15. B fragment of weight row n (= g of an n8 tile):
       * b0 = k 2c, 2c+1 and b1 = k 2c+8, 2c+9 of the step, i.e. byte c of packed bytes 8t..8t+3
       * (word 2t) and of 8t+4..8t+7 (word 2t+1): the lane shifts its byte to the bottom. */
      const int sh = 8 * c;
#pragma unroll
      for (int t = 0; t < BK / 16; ++t) {
        uint32_t af[MI][4];
#pragma unroll
        for (int i = 0; i < MI; ++i)
          cq_ldsm_x4(af[i], sa + swizzle(wm * 16 * MI + i * 16 + (lane & 15), 2 * t + (lane >> 4)));
        const int gi = gs < BK ? (16 * t) >> p.gs_log2 : 0;
        uint32_t bf[4][2];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int row = wn * 32 + j * 8 + g;
          const uint2 wv = cq_lds64(sw + (uint32_t)(row * C::WS + 8 * t));
          const uint32_t sp = ss + (uint32_t)((row * C::SPR + gi * E) * 4);
          const float s = cq_ldsf(sp), zp = U4 ? cq_ldsf(sp + 4) : 0.0f;
          bf[j][0] = cq_int4::byte_to_pair<AK == kABf16, U4>(wv.x >> sh, s, zp);
          bf[j][1] = cq_int4::byte_to_pair<AK == kABf16, U4>(wv.y >> sh, s, zp);
        }
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) mma<AK>(acc[i][j], af[i], bf[j][0], bf[j][1]);
      }
    } else {
      /* k-step t covers k0 + 32t .. +31. B fragment of weight row n: b0 = k 4c..4c+3 and
       * b1 = k 4c+16..4c+19 of the step: packed halfwords 8t + c and 8t + 4 + c, i.e. half c & 1
       * of words 4t + (c >> 1) and 4t + 2 + (c >> 1). */
      const int sh = 16 * (c & 1);
      const uint32_t wofs = 4u * (uint32_t)(c >> 1);
#pragma unroll
      for (int t = 0; t < BK / 32; ++t) {
        if (k0 + 32 * t >= p.k) break; /* block-uniform: K past k */
        uint32_t af[MI][4];
#pragma unroll
        for (int i = 0; i < MI; ++i)
          cq_ldsm_x4(af[i], sa + swizzle(wm * 16 * MI + i * 16 + (lane & 15), 2 * t + (lane >> 4)));
        uint32_t bf[4][2];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t base = sw + (uint32_t)((wn * 32 + j * 8 + g) * C::WS + 16 * t) + wofs;
          const uint32_t w0 = cq_lds32(base) >> sh, w1 = cq_lds32(base + 8) >> sh;
          if constexpr (AK == kAInt8) {
            bf[j][0] = cq_int4::int4x4_to_s8(w0), bf[j][1] = cq_int4::int4x4_to_s8(w1);
          } else {
            bf[j][0] = cq_int4::int4x4_to_e4m3(w0), bf[j][1] = cq_int4::int4x4_to_e4m3(w1);
          }
        }
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) mma<AK>(acc[i][j], af[i], bf[j][0], bf[j][1]);
        /* a group ends with this step: acc_g * sw[n, g] into the fp32 sum, acc reset */
        const int64_t kend = k0 + 32 * (t + 1);
        if ((kend & (gs - 1)) == 0) {
          const int gi = gs < BK ? (32 * t) >> p.gs_log2 : 0;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            /* accumulator columns 2c, 2c+1 of n8 tile j */
            const uint32_t sp = ss + (uint32_t)(((wn * 32 + j * 8 + 2 * c) * C::SPR + gi) * 4);
            const float s0 = cq_ldsf(sp), s1 = cq_ldsf(sp + C::SPR * 4);
#pragma unroll
            for (int i = 0; i < MI; ++i)
#pragma unroll
              for (int r = 0; r < 4; ++r) {
                facc[i][j][r] = __fadd_rn(facc[i][j][r], __fmul_rn((float)acc[i][j][r], (r & 1) ? s1 : s0));
                acc[i][j][r] = 0;
              }
          }
        }
      }
    }
  }
  cq_cp_async_wait<0>();

  /* accumulator (i, j): rows g and g+8 of m16 tile i, columns 2c and 2c+1 of n8 tile j */
  if (p.splits > 1) { /* this range's sums, for split_reduce_kernel */
    float *part = p.part + (int64_t)blockIdx.y * p.m * p.n;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int64_t row = m0 + wm * 16 * MI + i * 16 + g + 8 * (r >> 1);
          const int64_t col = n0 + wn * 32 + j * 8 + 2 * c + (r & 1);
          if (row < p.m && col < p.n) {
            if constexpr (WO) part[row * p.n + col] = (float)acc[i][j][r];
            else part[row * p.n + col] = facc[i][j][r];
          }
        }
    return;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t col = n0 + wn * 32 + j * 8 + 2 * c;
    const float b0 = p.bias && col < p.n ? cq_load_any(p.bias, p.bias_dtype, col) : 0.0f;
    const float b1 = p.bias && col + 1 < p.n ? cq_load_any(p.bias, p.bias_dtype, col + 1) : 0.0f;
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t row = m0 + wm * 16 * MI + i * 16 + g + 8 * h;
        if (row >= p.m) continue;
        float v0, v1;
        if constexpr (WO) {
          v0 = __fadd_rn((float)acc[i][j][2 * h], b0), v1 = __fadd_rn((float)acc[i][j][2 * h + 1], b1);
        } else {
          const float s = p.sa[row];
          v0 = __fadd_rn(__fmul_rn(facc[i][j][2 * h], s), b0);
          v1 = __fadd_rn(__fmul_rn(facc[i][j][2 * h + 1], s), b1);
        }
        store_pair(p, row, col, v0, v1);
      }
  }
}

/* The ranges of a split GEMM added in order, then the epilogue (weight-only: v = sum + b;
 * dynamic: v = sum * sa[row] + b). */
template <bool WO>
__global__ void split_reduce_kernel(const mixed_params p) {
  const int64_t total = p.m * p.n;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t row = i / p.n, col = i - row * p.n;
    float v = 0.0f;
    for (int sp = 0; sp < p.splits; ++sp) v = __fadd_rn(v, p.part[sp * total + i]);
    if (!WO) v = __fmul_rn(v, p.sa[row]);
    v = __fadd_rn(v, p.bias ? cq_load_any(p.bias, p.bias_dtype, col) : 0.0f);
    cq_store_any(p.out.y, p.out.y_dtype, row * p.out.ldy + col, cq_out_value(p.out, row, col, cq_activate(v, p.activation)));
  }
}

template <int AK, bool U4, int MI>
cq_status launch(const mixed_params &p, cudaStream_t s) {
  auto kernel = gemm_mixed_kernel<AK, U4, MI>;
  constexpr int bytes = Smem<AK, MI>::BYTES;
  CQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  const int64_t blocks = p.tiles_m * p.tiles_n;
  if (blocks > 0x7fffffffLL)
    return cq_fail(CQ_ERR_UNSUPPORTED, "mixed-input GEMM: %lld tiles is too many", (long long)blocks);
  kernel<<<dim3((unsigned)blocks, (unsigned)p.splits), THREADS, bytes, s>>>(p);
  CQ_LAUNCH_CHECK(gemm_mixed_kernel);
  if (p.splits > 1) {
    int64_t grid = (p.m * p.n + 255) / 256;
    grid = grid < 1 ? 1 : grid > 4096 ? 4096 : grid;
    split_reduce_kernel<Cfg<AK>::kWeightOnly><<<(unsigned)grid, 256, 0, s>>>(p);
    CQ_LAUNCH_CHECK(split_reduce_kernel);
  }
  return CQ_OK;
}

/* Split K where the output tiles leave SMs idle: as many ranges as fill the SMs once, each at
 * least kMinSplitTiles k-tiles of whole groups, within the scratch (p.splits = 1 otherwise). */
constexpr int kMinSplitTiles = 4, kMaxSplits = 16;

void plan_split(mixed_params &p, int bk, const cq_mixed_args *g) {
  p.splits = 1, p.k_split = p.k, p.part = NULL;
  const int64_t tiles = p.tiles_m * p.tiles_n;
  cq_device_info info;
  if (!g->split_ws || cq_device_info_get(g->device, &info) != CQ_OK || tiles >= info.sms) return;
  const int64_t unit = bk > (1 << p.gs_log2) ? bk : (1 << p.gs_log2); /* whole k-tiles and groups */
  const int64_t units = (p.k + unit - 1) / unit;
  int64_t want = (info.sms + tiles - 1) / tiles;
  const int64_t by_k = units * unit / (kMinSplitTiles * (int64_t)bk);
  const int64_t by_ws = (int64_t)(g->split_ws_bytes / ((size_t)p.m * (size_t)p.n * sizeof(float)));
  if (want > by_k) want = by_k;
  if (want > by_ws) want = by_ws;
  if (want > kMaxSplits) want = kMaxSplits;
  if (want < 2) return;
  const int64_t per = (units + want - 1) / want * unit;
  p.k_split = per;
  p.splits = (int)((p.k + per - 1) / per);
  if (p.splits < 2) p.splits = 1, p.k_split = p.k;
  else p.part = g->split_ws;
}

/* The block height: 64 rows where 128 would leave most of the tile empty. */
template <int AK, bool U4>
cq_status launch_mi(mixed_params p, const cq_mixed_args *g, cudaStream_t s) {
  if (p.m <= 64) {
    p.tiles_m = (p.m + 63) / 64;
    plan_split(p, Cfg<AK>::BK, g);
    return launch<AK, U4, 2>(p, s);
  }
  p.tiles_m = (p.m + 127) / 128;
  plan_split(p, Cfg<AK>::BK, g);
  return launch<AK, U4, 4>(p, s);
}

int log2_exact(int64_t v) {
  int l = 0;
  while (((int64_t)1 << l) < v) ++l;
  return ((int64_t)1 << l) == v ? l : -1;
}

}  // namespace

cq_status cq_gemm_mixed_mma_cuda(const cq_mixed_args *g, cudaStream_t stream) {
  if (g->w_granularity != CQ_GRANULARITY_GROUP || (g->w_format != CQ_FORMAT_INT4 && g->w_format != CQ_FORMAT_UINT4))
    return cq_fail(CQ_ERR_UNSUPPORTED, "mixed-input mma GEMM: weight format %d; it takes int4 / uint4 weights "
                   "per group", g->w_format);
  const int gl = log2_exact(g->group_size);
  if (gl < 5 || gl > 10 || g->k % g->group_size)
    return cq_fail(CQ_ERR_INVALID_ARG, "mixed-input GEMM: group_size = %lld with K = %lld; expected a power of two "
                   "in [%d, %d] that divides K", (long long)g->group_size, (long long)g->k, CQ_GROUP_SIZE_MIN,
                   CQ_GROUP_SIZE_MAX);
  const bool wo = g->a_format == CQ_FORMAT_NONE;
  const size_t asize = wo ? 2 : 1;
  if (wo ? (g->a_dtype != CQ_DTYPE_BF16 && g->a_dtype != CQ_DTYPE_F16) || g->out.y_dtype != g->a_dtype
         : (g->a_format != CQ_FORMAT_INT8 && g->a_format != CQ_FORMAT_FP8_E4M3) || g->w_format != CQ_FORMAT_INT4 ||
               !g->sa)
    return cq_fail(CQ_ERR_UNSUPPORTED, "mixed-input mma GEMM: activations %s (format %d) with weight format %d and "
                   "y %s; it takes bf16/f16 x (y alike) with int4/uint4, int8 or fp8 e4m3 codes with int4",
                   cq_dtype_name(g->a_dtype), g->a_format, g->w_format, cq_dtype_name(g->out.y_dtype));
  if ((uintptr_t)g->a % 16 || (uintptr_t)g->w % 16 || (g->lda * (int64_t)asize) % 16 || g->ldw % 16 ||
      g->ldw < g->k / 2 || g->lda < g->k)
    return cq_fail(CQ_ERR_UNSUPPORTED, "mixed-input GEMM: x and w must start on 16-byte boundaries with rows a "
                   "multiple of 16 bytes apart (x at %p, w at %p)", g->a, (const void *)g->w);
  if (g->m <= 0 || g->n <= 0) return CQ_OK;
  mixed_params p;
  p.a = static_cast<const uint8_t *>(g->a), p.lda_bytes = g->lda * (int64_t)asize, p.sa = g->sa;
  p.w = g->w, p.ldw = g->ldw, p.sw = g->sw, p.groups = g->k / g->group_size, p.gs_log2 = gl;
  p.m = g->m, p.n = g->n, p.k = g->k;
  p.tiles_m = 0, p.tiles_n = (g->n + BN - 1) / BN;
  p.bias = g->bias, p.bias_dtype = g->bias_dtype, p.activation = g->activation;
  p.out = g->out;
  p.pair_ok = g->out.ldy % 2 == 0 && (uintptr_t)g->out.y % (2 * cq_dtype_size(g->out.y_dtype)) == 0;
  const bool u4 = g->w_format == CQ_FORMAT_UINT4;
  if (wo) {
    if (g->a_dtype == CQ_DTYPE_BF16)
      return u4 ? launch_mi<kABf16, true>(p, g, stream) : launch_mi<kABf16, false>(p, g, stream);
    return u4 ? launch_mi<kAF16, true>(p, g, stream) : launch_mi<kAF16, false>(p, g, stream);
  }
  if (g->out.y_dtype != CQ_DTYPE_F32 && g->out.y_dtype != CQ_DTYPE_F16 && g->out.y_dtype != CQ_DTYPE_BF16)
    return cq_fail(CQ_ERR_INTERNAL, "mixed-input GEMM: output dtype %s", cq_dtype_name(g->out.y_dtype));
  if (g->a_format == CQ_FORMAT_INT8) return launch_mi<kAInt8, false>(p, g, stream);
  return launch_mi<kAE4M3, false>(p, g, stream);
}

size_t cq_gemm_mixed_split_bytes(int64_t m, int64_t n) {
  if (m <= 0 || n <= 0 || m > 256) return 0; /* larger M fills the SMs with tiles */
  const size_t cap = (size_t)16 << 20, want = (size_t)kMaxSplits * (size_t)m * (size_t)n * sizeof(float);
  return want < cap ? want : cap;
}
