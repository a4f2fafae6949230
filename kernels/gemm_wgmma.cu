/* 8-bit GEMM with the scale/bias epilogue on Hopper warpgroup tensor cores
 * (sm_90a): y[M, N] = (A[M, K] . B[N, K]^T) * sa[m] * sb[n] + bias[n] (then the activation
 * and, for a gated layer, residual + gate * that), int8 x int8 -> int32 with wgmma.
 *
 * Persistent, warp-specialized: warpgroup 0 is the producer (one thread issues
 * TMA loads of 128 x 128-byte A tiles and BN x 128-byte B tiles into a ring
 * of shared-memory stages, completion tracked by mbarriers); warpgroups 1 and
 * 2 are consumers, each owning 64 rows of the 128-row tile, issuing four
 * wgmma m64nBNk32 per stage from shared memory and keeping one stage of
 * wgmma in flight. The 128-byte swizzle TMA writes is the layout the wgmma
 * descriptors name. Tails: TMA fills rows and K past the tensor with zeros;
 * the epilogue stores only rows < M and columns < N. */
#include <cuda.h>


#include "gemm8_common.cuh"
#include "tensor_map.cuh"

using namespace cq_gemm8;

namespace {

constexpr int BM = 128, BK = 128, THREADS = 384;

template <int BN> struct wg_config {
  static constexpr int kStages = BN == 256 ? 4 : 6;
  static constexpr int kTileA = BM * BK, kTileB = BN * BK;
  static constexpr int kStageBytes = kTileA + kTileB;
  static constexpr int kSmemBytes = kStages * kStageBytes + 1024; /* + slack to align to 1024 */
};

struct wg_params {
  int64_t m, n, kpad;
  int64_t tiles_m, tiles_n;
  epilogue e;
};

#ifdef CQ_SM90A_DEVICE

/* wgmma shared-memory descriptor of a K-major tile with the 128-byte swizzle:
 * start address >> 4, leading byte offset 16 (unused when swizzled), stride
 * byte offset 1024 (between 8-row swizzle atoms), layout type 1 = 128B. */
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

/* D[64 x 128] += A[64 x 32] . B[128 x 32]^T, int8 in, int32 accumulators. */
__device__ __forceinline__ void wgmma_s8_n128(int32_t *d, uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p;\n"
      "}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(1));
}

/* D[64 x 256] += A[64 x 32] . B[256 x 32]^T, int8 in, int32 accumulators. */
__device__ __forceinline__ void wgmma_s8_n256(int32_t *d, uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k32.s32.s8.s8 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, p;\n"
      "}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63]), "+r"(d[64]), "+r"(d[65]), "+r"(d[66]), "+r"(d[67]), "+r"(d[68]), "+r"(d[69]), "+r"(d[70]), "+r"(d[71]), "+r"(d[72]), "+r"(d[73]), "+r"(d[74]), "+r"(d[75]), "+r"(d[76]), "+r"(d[77]), "+r"(d[78]), "+r"(d[79]), "+r"(d[80]), "+r"(d[81]), "+r"(d[82]), "+r"(d[83]), "+r"(d[84]), "+r"(d[85]), "+r"(d[86]), "+r"(d[87]), "+r"(d[88]), "+r"(d[89]), "+r"(d[90]), "+r"(d[91]), "+r"(d[92]), "+r"(d[93]), "+r"(d[94]), "+r"(d[95]), "+r"(d[96]), "+r"(d[97]), "+r"(d[98]), "+r"(d[99]), "+r"(d[100]), "+r"(d[101]), "+r"(d[102]), "+r"(d[103]), "+r"(d[104]), "+r"(d[105]), "+r"(d[106]), "+r"(d[107]), "+r"(d[108]), "+r"(d[109]), "+r"(d[110]), "+r"(d[111]), "+r"(d[112]), "+r"(d[113]), "+r"(d[114]), "+r"(d[115]), "+r"(d[116]), "+r"(d[117]), "+r"(d[118]), "+r"(d[119]), "+r"(d[120]), "+r"(d[121]), "+r"(d[122]), "+r"(d[123]), "+r"(d[124]), "+r"(d[125]), "+r"(d[126]), "+r"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(1));
}

template <int BN>
__device__ __forceinline__ void wgmma_s8(int32_t *d, uint64_t desc_a, uint64_t desc_b) {
  if constexpr (BN == 256) wgmma_s8_n256(d, desc_a, desc_b);
  else wgmma_s8_n128(d, desc_a, desc_b);
}

#endif /* CQ_SM90A_DEVICE */

template <int BN, typename OutT>
__global__ void __launch_bounds__(THREADS, 1)
    gemm8_wgmma_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                       const wg_params p) {
#ifdef CQ_SM90A_DEVICE
  typedef wg_config<BN> cfg;
  constexpr int S = cfg::kStages;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[S], empty_bar[S];
  __shared__ __align__(16) float col_terms[2][2][BN]; /* per consumer: sb, bias of the tile's columns */

  const uint32_t raw = cq_smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u; /* swizzle atoms are 1024-byte aligned */
  const int wg = threadIdx.x / 128, lane = threadIdx.x & 31, warp_in_wg = (threadIdx.x / 32) & 3;
  const int ktiles = (int)((p.kpad + BK - 1) / BK);
  const int64_t tiles = p.tiles_m * p.tiles_n;

  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      cq_mbar_init(cq_smem_addr(&full_bar[s]), 1);   /* the producer's expect_tx */
      cq_mbar_init(cq_smem_addr(&empty_bar[s]), 8);  /* lane 0 of each consumer warp */
    }
    cq_mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    /* producer */
    cq_setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      uint32_t it = 0;
      for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int64_t tm, tn;
        tile_of(tile, p.tiles_m, p.tiles_n, &tm, &tn);
        for (int kt = 0; kt < ktiles; ++kt, ++it) {
          const uint32_t s = it % S, phase = (it / S) & 1u;
          cq_mbar_wait(cq_smem_addr(&empty_bar[s]), phase ^ 1u);
          const uint32_t full = cq_smem_addr(&full_bar[s]);
          cq_mbar_arrive_expect_tx(full, cfg::kStageBytes);
          const uint32_t sa = base + s * cfg::kStageBytes;
          cq_tma_load_2d(sa, &map_a, full, kt * BK, (int32_t)(tm * BM));
          cq_tma_load_2d(sa + cfg::kTileA, &map_b, full, kt * BK, (int32_t)(tn * BN));
        }
      }
    }
    return;
  }

  /* consumers: warpgroup c owns rows [64c, 64c + 64) of each tile */
  cq_setmaxnreg_inc<232>();
  const int c = wg - 1;
  float *sb_s = col_terms[c][0], *bias_s = col_terms[c][1];
  int32_t acc[BN / 2];
  uint32_t it = 0;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    int64_t tm, tn;
    tile_of(tile, p.tiles_m, p.tiles_n, &tm, &tn);
    /* this warpgroup's copy of the columns' scale and bias (after its last tile's epilogue read them) */
    cq_bar_sync(1 + c, 128);
    for (int i = threadIdx.x & 127; i < BN; i += 128) column_terms(p.e, tn * BN + i, &sb_s[i], &bias_s[i]);
    cq_bar_sync(1 + c, 128);
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0;
    cq_fence_regs(acc);
    uint32_t prev = 0;
    for (int kt = 0; kt < ktiles; ++kt, ++it) {
      const uint32_t s = it % S, phase = (it / S) & 1u;
      cq_mbar_wait(cq_smem_addr(&full_bar[s]), phase);
      const uint32_t sa = base + s * cfg::kStageBytes + c * (64 * BK), sb = base + s * cfg::kStageBytes + cfg::kTileA;
      const uint64_t da = smem_desc(sa), db = smem_desc(sb);
      cq_wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BK / 32; ++kk) wgmma_s8<BN>(acc, da + 2 * kk, db + 2 * kk); /* +32 bytes of K */
      cq_wgmma_commit();
      cq_wgmma_wait<1>(); /* the previous stage's wgmma are done: give it back */
      if (kt > 0 && lane == 0) cq_mbar_arrive(cq_smem_addr(&empty_bar[prev]));
      prev = s;
    }
    cq_wgmma_wait<0>();
    cq_fence_regs(acc);
    if (lane == 0) cq_mbar_arrive(cq_smem_addr(&empty_bar[prev]));

    /* accumulator j of n8 block b: row 16 * warp + g (+8 for j = 2, 3), column 8b + 2t (+1) */
    const int g = lane >> 2, t = lane & 3;
    const int64_t row0 = tm * BM + c * 64 + warp_in_wg * 16 + g;
    const float sa0 = row0 < p.m ? p.e.sa[row0] : 0.0f, sa1 = row0 + 8 < p.m ? p.e.sa[row0 + 8] : 0.0f;
    const bool interior = p.e.pair_ok && tm * BM + (c + 1) * 64 <= p.m && (tn + 1) * BN <= p.n;
    if (interior && !p.e.gate) {
      OutT *y0 = static_cast<OutT *>(p.e.y) + row0 * p.e.ldy + tn * BN + 2 * t, *y1 = y0 + 8 * p.e.ldy;
#pragma unroll
      for (int b = 0; b < BN / 8; ++b) {
        const float2 sb = *reinterpret_cast<const float2 *>(&sb_s[b * 8 + 2 * t]);
        const float2 bb = *reinterpret_cast<const float2 *>(&bias_s[b * 8 + 2 * t]);
        const int act = p.e.activation;
        store2(y0 + b * 8, scale_value((float)acc[4 * b], sa0, sb.x, bb.x, act),
               scale_value((float)acc[4 * b + 1], sa0, sb.y, bb.y, act));
        store2(y1 + b * 8, scale_value((float)acc[4 * b + 2], sa1, sb.x, bb.x, act),
               scale_value((float)acc[4 * b + 3], sa1, sb.y, bb.y, act));
      }
    } else if (interior) { /* gated: residual + gate * v, gate and residual read per element */
      OutT *y0 = static_cast<OutT *>(p.e.y) + row0 * p.e.ldy + tn * BN + 2 * t, *y1 = y0 + 8 * p.e.ldy;
      const gate_row g0 = gate_row_of(p.e, row0), g1 = gate_row_of(p.e, row0 + 8);
#pragma unroll
      for (int b = 0; b < BN / 8; ++b) {
        const int64_t col = tn * BN + b * 8 + 2 * t;
        const float2 sb = *reinterpret_cast<const float2 *>(&sb_s[b * 8 + 2 * t]);
        const float2 bb = *reinterpret_cast<const float2 *>(&bias_s[b * 8 + 2 * t]);
        const int act = p.e.activation;
        store2(y0 + b * 8, gated<OutT>(p.e, g0, col, scale_value((float)acc[4 * b], sa0, sb.x, bb.x, act)),
               gated<OutT>(p.e, g0, col + 1, scale_value((float)acc[4 * b + 1], sa0, sb.y, bb.y, act)));
        store2(y1 + b * 8, gated<OutT>(p.e, g1, col, scale_value((float)acc[4 * b + 2], sa1, sb.x, bb.x, act)),
               gated<OutT>(p.e, g1, col + 1, scale_value((float)acc[4 * b + 3], sa1, sb.y, bb.y, act)));
      }
    } else {
#pragma unroll
      for (int b = 0; b < BN / 8; ++b) {
        const int i = b * 8 + 2 * t;
        const int64_t col = tn * BN + i;
        store_pair_edge<OutT>(p.e, row0, col, (float)acc[4 * b], (float)acc[4 * b + 1], sa0, sb_s[i], sb_s[i + 1],
                              bias_s[i], bias_s[i + 1]);
        store_pair_edge<OutT>(p.e, row0 + 8, col, (float)acc[4 * b + 2], (float)acc[4 * b + 3], sa1, sb_s[i],
                              sb_s[i + 1], bias_s[i], bias_s[i + 1]);
      }
    }
  }
#else
  (void)map_a, (void)map_b, (void)p;
  __trap(); /* not built for sm_90a: the host never selects this kernel then */
#endif
}

/* Tensor map of a K-contiguous uint8 operand [rows, kpad] with row stride ld,
 * read in boxes of box_rows x 128 bytes with the 128-byte swizzle. */
cq_status make_map(CUtensorMap *map, const uint8_t *data, int64_t rows, int64_t kpad, int64_t ld, int box_rows,
                   const char *what) {
  const uint64_t dims[2] = {(uint64_t)kpad, (uint64_t)rows}, strides[1] = {(uint64_t)ld};
  const uint32_t box[2] = {(uint32_t)BK, (uint32_t)box_rows};
  return cq_tensor_map(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, data, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B, what);
}

template <int BN, typename OutT>
cq_status launch(const cq_gemm8_args *g, const wg_params &p, int sms, cudaStream_t s) {
  typedef wg_config<BN> cfg;
  CUtensorMap map_a, map_b;
  CQ_TRY(make_map(&map_a, g->a, g->m, g->kpad, g->lda, BM, "activations"));
  CQ_TRY(make_map(&map_b, g->b, g->n, g->kpad, g->ldb, BN, "weight"));
  auto kernel = gemm8_wgmma_kernel<BN, OutT>;
  CQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, cfg::kSmemBytes));
  const int64_t tiles = p.tiles_m * p.tiles_n;
  const unsigned grid = (unsigned)(tiles < sms ? tiles : sms);
  kernel<<<grid, THREADS, cfg::kSmemBytes, s>>>(map_a, map_b, p);
  CQ_LAUNCH_CHECK(gemm8_wgmma_kernel);
  return CQ_OK;
}

template <int BN>
cq_status launch_out(const cq_gemm8_args *g, wg_params p, int sms, cudaStream_t s) {
  p.tiles_n = (g->n + BN - 1) / BN;
  switch (g->y_dtype) {
    case CQ_DTYPE_F32: return launch<BN, float>(g, p, sms, s);
    case CQ_DTYPE_F16: return launch<BN, __half>(g, p, sms, s);
    case CQ_DTYPE_BF16: return launch<BN, __nv_bfloat16>(g, p, sms, s);
    default: break;
  }
  return cq_fail(CQ_ERR_INTERNAL, "8-bit GEMM: output dtype %s", cq_dtype_name(g->y_dtype));
}

/* Whether this build holds the sm_90a kernel and the device runs it (cq_wgmma_usable). */
bool wgmma_usable(int device, int *sms) {
  static signed char image_ok[64];
  const void *kernel = reinterpret_cast<const void *>(gemm8_wgmma_kernel<128, __nv_bfloat16>);
  return cq_wgmma_usable(device, kernel, image_ok, sms);
}

}  // namespace

cq_status cq_gemm8_wgmma_cuda(const cq_gemm8_args *g, int device, cudaStream_t stream, int *launched) {
  *launched = 0;
  int sms = 0;
  if (g->a_format != CQ_FORMAT_INT8 || g->b_format != CQ_FORMAT_INT8 || !wgmma_usable(device, &sms)) return CQ_OK;
  /* TMA: 16-byte aligned bases and row strides, coordinates within int32 */
  if (((uintptr_t)g->a & 15) || ((uintptr_t)g->b & 15) || (g->lda & 15) || (g->ldb & 15) || g->m > 0x7fffffffLL ||
      g->n > 0x7fffffffLL || g->kpad > 0x7fffffffLL)
    return CQ_OK;
  wg_params p;
  p.m = g->m, p.n = g->n, p.kpad = g->kpad;
  p.tiles_m = (g->m + BM - 1) / BM;
  p.e = epilogue_of(g);
  /* The tile width whose last wave is fullest: time ~ waves x BN. */
  const int64_t t256 = p.tiles_m * ((g->n + 255) / 256), t128 = p.tiles_m * ((g->n + 127) / 128);
  const int64_t cost256 = (t256 + sms - 1) / sms * 256, cost128 = (t128 + sms - 1) / sms * 128;
  CQ_TRY(cost256 <= cost128 ? launch_out<256>(g, p, sms, stream) : launch_out<128>(g, p, sms, stream));
  *launched = 1;
  return CQ_OK;
}
