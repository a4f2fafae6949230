/* GEMM on Hopper warpgroup tensor cores (sm_90a) for two-level 4-bit weights and int8 activations
 * (cquant.h, CQ_GRANULARITY_TWO_LEVEL): with the weight row's scale s1[n] and its groups' integer
 * multipliers s2[n, g] in [0, 16],
 *   q8[n, k] = s2[n, g(k)] * code[n, k]  (an int8: [-128, 112]),  acc = sum_k a[m, k] q8[n, k]  (int32)
 *   y[m, n] = act(acc * sa[m] * s1[n] + b[n])
 * int8 dynamic math with the weight expanded in registers: the 8-bit tensor cores run over all of K
 * into one int32 accumulator set, with no rescaling between groups.
 *
 * The pipeline is gemm_wo_sm90.cu's (gemm_mixed_sm90.cuh): a producer warpgroup loads by TMA the
 * 128-byte-swizzled tile of BN tokens' codes (128 of K a stage) and the packed codes of 64 WG weight
 * rows (64 bytes a row, 64-byte swizzled). Each consumer warpgroup reads its rows' packed codes of
 * the stage at once, then expands the int8 A fragment of one k32 step at a time into one of four
 * fragment buffers while the wgmma of the three steps before run (one commit group a step).
 *
 * A k32 fragment register holds four neighbouring codes of one of the lane's rows: codes 4q..4q+3
 * (registers 0, 1: rows g, g + 8) and 16 + 4q.. (registers 2, 3), q = lane % 4: the 16-bit half q & 1
 * of words q / 2 and 2 + q / 2 of the step's 16 bytes. One byte permute puts both halves in one
 * word, one AND-XOR each takes its even and odd nibbles as c + 8 in [0, 15] a byte, two permutes
 * interleave them into the four codes of each register, and one multiply-add by s2 gives
 * (c + 8) s2 + 128 - 8 s2 = c s2 + 128 in [0, 240] a byte (no carry between bytes for s2 <= 16),
 * whose top bit flipped is c s2 as a two's complement byte.
 *
 * s2 is read as stored (f32): a value that is not an integer in [0, 16] makes its row's outputs
 * NaN (the row's s1 becomes NaN in the epilogue, its codes expand with s2 = 0), as the C reference
 * computes.
 *
 * CTAs are persistent, one per SM. Where the tiles past the last full wave fill at most half of one
 * (Flux's N = 3072 layers at 4608 tokens: 432 tiles on 132 SMs, 36 past 3 waves), they are cut in
 * two along K, each half in one CTA of a cluster of two; the first half's int32 sums cross to the
 * second through distributed shared memory. Integer sums are exact, so a cut tile computes the
 * same bits as a whole one. */
#include <cuda.h>
#include <string.h>

#include "gemm_mixed_sm90.cuh"
#include "gemm_mixed_wgmma.cuh"
#include "tensor_map.cuh"

using namespace cq_mixed;

namespace {

constexpr int kWG = 2, kBN = 256;   /* consumer warpgroups of 64 weight rows, tokens a tile */
constexpr int kCodes = 128;         /* codes of K a stage: one 128-byte swizzle row of activation codes */
constexpr int kRowBytes = kCodes / 2; /* packed bytes of a weight row a stage */
constexpr int kRows = 64 * kWG;
constexpr int kThreads = 128 * (kWG + 1);
constexpr int kTileX = kBN * kCodes;
constexpr int kTileW = kRows * kRowBytes;
constexpr int kStageBytes = kTileX + kTileW; /* 40 KB, a multiple of 1024 */
/* the TMA epilogue's two 2 KB buffers a warp, or store_tile's staging, a warpgroup */
constexpr int kEpiBytes = 4 * 2 * 2048 > kEpiWarpgroupBytes ? 4 * 2 * 2048 : kEpiWarpgroupBytes;
constexpr int kSaBytes = kBN * 4; /* a warpgroup's token scales of its tile */
constexpr int kStages = (227 * 1024 - 2048 - kWG * (kEpiBytes + kSaBytes)) / kStageBytes; /* 4 */
constexpr int kSmemBytes = kStages * kStageBytes + kWG * (kEpiBytes + kSaBytes) + 1024;
constexpr int kConsumerRegs = 232;
static_assert(kStageBytes % 1024 == 0, "stages keep the 1024-byte alignment of the swizzled tiles");
static_assert(kStages * kStageBytes >= kWG * 64 * kBN * 4, "a cut tile's first half fits in the ring");
constexpr int kMinHalfSteps = 8; /* stages of K a half of a cut tile runs at least */

struct w2l_params {
  int64_t m, n, k;
  work_plan work;
  const float *scales; /* [N, 1 + G]: s1, then s2 of each group */
  int64_t ld_scales;   /* 1 + G */
  int64_t groups;      /* G */
  int group_shift;     /* log2(group_size) */
  const float *sa;     /* [M] */
  epilogue e;
  cq_dtype y_dtype;
  int tma_y, tma_gate; /* as gemm_wo_sm90.cu: y (and a gated layer's residual) through TMA */
};

constexpr uint32_t kConsumersBar = 3; /* named barrier of the 256 consumer threads */

#ifdef CQ_SM90A_DEVICE

/* s2 as stored: its integer value, or 0 with *bad set where it is not an integer in [0, 16]. */
__device__ __forceinline__ uint32_t multiplier(float s2, bool *bad) {
  const int v = __float2int_rz(s2);
  const bool ok = (float)v == s2 && v >= 0 && v <= 16; /* NaN and +-inf fail the comparison */
  *bad |= !ok;
  return ok ? (uint32_t)v : 0u;
}

/* Registers 0 and 2 (or 1 and 3) of a k32 fragment from the half of words w0, w1 the lane takes
 * (sel), times s2: lo gets codes 4q..4q+3, hi codes 16 + 4q.. */
__device__ __forceinline__ void expand(uint32_t w0, uint32_t w1, uint32_t sel, uint32_t s2, uint32_t add,
                                       uint32_t &lo, uint32_t &hi) {
  const uint32_t x = __byte_perm(w0, w1, sel);
  /* (x & 0x0F0F0F0F) ^ 0x08080808 as one three-input op: from C the compiler makes two of it */
  uint32_t t, u;
  asm("lop3.b32 %0, %1, %2, 0x08080808, 0x6a;" : "=r"(t) : "r"(x), "r"(0x0F0F0F0Fu));
  asm("lop3.b32 %0, %1, %2, 0x08080808, 0x6a;" : "=r"(u) : "r"(x >> 4), "r"(0x0F0F0F0Fu));
  lo = (__byte_perm(t, u, 0x5140) * s2 + add) ^ 0x80808080u;
  hi = (__byte_perm(t, u, 0x7362) * s2 + add) ^ 0x80808080u;
}

#endif /* CQ_SM90A_DEVICE */

/* GPS: groups a stage (group_size 128 / GPS for GPS 2, 4; 1: group_size >= 128) */
template <int GPS>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_w4a8_2l_kernel(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w,
                        const __grid_constant__ CUtensorMap map_y, const __grid_constant__ CUtensorMap map_r,
                        const w2l_params p) {
#ifdef CQ_SM90A_DEVICE
  constexpr int S = kStages;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[S], empty_bar[S];
  __shared__ __align__(8) uint64_t residual_bar[kWG * 4][2];

  const uint32_t raw = cq_smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t *const gbase = smem_raw + (base - raw);
  const int wg = threadIdx.x / 128, lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
  const int64_t units = work_units(p.work);

  init_ring(full_bar, empty_bar, 4 * kWG);
  if (wg == 0) {
    cq_setmaxnreg_dec<40>();
    if (threadIdx.x == 0)
      produce_units<S>(&map_x, &map_w, base, full_bar, empty_bar, p.work, kStageBytes, kTileX, kCodes, kBN,
                       kRowBytes, kRows);
    return;
  }

  cq_setmaxnreg_inc<kConsumerRegs>();
  const int c = wg - 1, g = lane >> 2, q = lane & 3, t128 = threadIdx.x & 127;
  const int row_a = c * 64 + warp * 16 + g; /* this thread's weight rows in the tile: row_a, row_a + 8 */
  /* the lane's words of a step: q / 2 and 2 + q / 2 of its 16-byte chunk, which the 64-byte swizzle
   * puts at chunk st ^ ((row >> 1) & 3) (the same for both rows); sel takes half q & 1 of each */
  const uint32_t swz = (uint32_t)((row_a >> 1) & 3), sel = (q & 1) ? 0x7632u : 0x5410u;
  const uint32_t row0 = base + kTileX + (uint32_t)(row_a * kRowBytes) + 4u * (uint32_t)(q >> 1);
  constexpr uint32_t kRowB = 8 * kRowBytes;
  int32_t acc[kBN / 2];
  uint32_t f[4][4]; /* the A fragments of a stage's four k32 steps */
  uint32_t full0 = cq_smem_addr(&full_bar[0]), empty0 = cq_smem_addr(&empty_bar[0]);
  uint64_t desc0 = smem_desc(base);
  uint32_t it = 0;
  float *const sa_tile = reinterpret_cast<float *>(gbase + S * kStageBytes + kWG * kEpiBytes + c * kSaBytes);
  const uint32_t rbars = cq_smem_addr(&residual_bar[c * 4 + warp][0]);
  uint32_t residual_loads = 0;
  if (p.tma_gate) {
    if (lane == 0) cq_mbar_init(rbars, 1), cq_mbar_init(rbars + 8, 1), cq_mbar_init_fence();
    __syncwarp();
  }
  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    const work_unit wu = unit_of(p.work, u);
    const int64_t tm = wu.tm, tn = wu.tn;
    const int64_t na = tn * kRows + row_a, nb = na + 8;
    const int64_t m0 = tm * kBN;
    /* read now, their latency under the main loop: the rows' s1 and bias, the tile's token scales */
    const float *const sc_a = p.scales + (na < p.n ? na : 0) * p.ld_scales, *const sc_b = p.scales + (nb < p.n ? nb : 0) * p.ld_scales;
    const float s1_a = na < p.n ? __ldg(sc_a) : 0.0f, s1_b = nb < p.n ? __ldg(sc_b) : 0.0f;
    const float b_a = na < p.n && p.e.bias ? cq_load_any(p.e.bias, p.e.bias_dtype, na) : 0.0f;
    const float b_b = nb < p.n && p.e.bias ? cq_load_any(p.e.bias, p.e.bias_dtype, nb) : 0.0f;
    bool bad_a = false, bad_b = false;
#pragma unroll
    for (int i = 0; i < kBN / 2; ++i) acc[i] = 0;
    uint32_t prev = 0;
    const int steps = __shfl_sync(0xffffffffu, wu.kt1 - wu.kt0, 0);
    /* a stage's multipliers, read at the top of the stage before (ncu on an H200 at 4608x15360x3072:
     * read in their own stage, or sunk there by the compiler, their latency was 14% of the consumers'
     * stall samples): group gi + i of each row, the index clamped to the row's last group (a group
     * past K multiplies the zeros that TMA reads there; rows past N read row 0's) */
    float s2_a[GPS], s2_b[GPS];
    const int last_group = (int)p.groups - 1;
    auto read_multipliers = [&](int kt) {
      const int gi = (kt * kCodes) >> p.group_shift;
#pragma unroll
      for (int i = 0; i < GPS; ++i) {
        const int at = 1 + (gi + i < last_group ? gi + i : last_group);
        s2_a[i] = cq_ldg_f32_here(sc_a + at), s2_b[i] = cq_ldg_f32_here(sc_b + at);
      }
    };
    read_multipliers(wu.kt0);
    for (int j = 0; j < steps; ++j, ++it) {
      const uint32_t s = it % S, phase = (it / S) & 1u, so = s * (uint32_t)kStageBytes;
      uint32_t m_a[GPS], m_b[GPS];
#pragma unroll
      for (int i = 0; i < GPS; ++i) m_a[i] = multiplier(s2_a[i], &bad_a), m_b[i] = multiplier(s2_b[i], &bad_b);
      read_multipliers(wu.kt0 + j + 1);
      cq_fence_reg(full0), cq_fence_reg(empty0), cq_fence_reg(desc0);
      cq_mbar_wait(full0 + 8u * s, phase);
      const uint64_t dx = desc0 + (uint64_t)(so >> 4);
      /* the stage's packed codes, all read now: no shared-memory latency after a wgmma wait */
      uint32_t raw[4][4];
#pragma unroll
      for (int st = 0; st < 4; ++st) {
        const uint32_t at = row0 + so + 16u * ((uint32_t)st ^ swz);
        raw[st][0] = cq_lds32(at), raw[st][1] = cq_lds32(at + 8u);
        raw[st][2] = cq_lds32(at + kRowB), raw[st][3] = cq_lds32(at + kRowB + 8u);
      }
#pragma unroll
      for (int st = 0; st < 4; ++st) {
        uint32_t(&fb)[4] = f[st];
        cq_wgmma_wait<3>(); /* the wgmma that read fb, four commit groups ago, is done */
        cq_fence_regs(fb);
        if (st == 3 && j > 0 && lane == 0) cq_mbar_arrive(empty0 + 8u * prev); /* the last stage's wgmma are done */
        const int mi = GPS == 1 ? 0 : st / (4 / GPS);
        const uint32_t add_a = 0x80808080u - m_a[mi] * 0x08080808u, add_b = 0x80808080u - m_b[mi] * 0x08080808u;
        expand(raw[st][0], raw[st][1], sel, m_a[mi], add_a, fb[0], fb[2]);
        expand(raw[st][2], raw[st][3], sel, m_b[mi], add_b, fb[1], fb[3]);
        cq_fence_regs(fb);
        cq_wgmma_fence();
        cq_mixed::wgmma_rs8<kBN, int32_t>(acc, fb, dx + (uint64_t)(2 * st), 1);
        cq_wgmma_commit();
      }
      prev = s;
    }
    cq_wgmma_wait<0>();
    cq_fence_regs(acc);
    cq_fence_regs(f[0]), cq_fence_regs(f[1]), cq_fence_regs(f[2]), cq_fence_regs(f[3]);
    if (lane == 0) cq_mbar_arrive(empty0 + 8u * prev);
    if (u >= p.work.whole) { /* half of a tile cut in two: the second half adds both */
      int64_t slot;
      int split;
      split_of(p.work, u, &slot, &split);
      if (!cluster_pair_fixup<kBN>(acc, base + (uint32_t)(c * 64 * kBN * 4), split, kConsumersBar)) continue;
    }

    /* the tile's token scales into shared memory for the TMA epilogue (lane (g, q) holds tokens
     * 8 j + 2 q, + 1), read after the main loop: read before, they cost registers the loop needs */
    sa_tile[t128] = m0 + t128 < p.m ? __ldg(p.sa + m0 + t128) : 0.0f;
    sa_tile[128 + t128] = m0 + 128 + t128 < p.m ? __ldg(p.sa + m0 + 128 + t128) : 0.0f;
    cq_bar_sync(1 + c, 128);
    const float nan = __int_as_float(0x7fc00000);
    const float sw_a = bad_a ? nan : s1_a, sw_b = bad_b ? nan : s1_b;
    uint8_t *const epi = gbase + S * kStageBytes + c * kEpiBytes;
    const epilogue &e = p.e;
    const int64_t n0 = tn * kRows + c * 64, m_last = (m0 + kBN < p.m ? m0 + kBN : p.m) - 1;
    const bool gate_tma = p.tma_gate && m0 / e.rows_per_sample == m_last / e.rows_per_sample;
    if (p.tma_y || gate_tma) {
      const uint32_t buf = cq_smem_addr(epi) + (uint32_t)(warp * 2 * 2048);
      const bool gelu = e.activation == CQ_ACTIVATION_GELU_TANH;
      auto stores = [&](auto y_type) { /* y's 16-bit type */
        typedef decltype(y_type) T;
        if (gate_tma) {
          const int64_t gi = (m0 / e.rows_per_sample) * e.ldg;
          const tma_gate gt{&map_r, na < p.n ? cq_load_any(e.gate, e.gate_dtype, gi + na) : 0.0f,
                            nb < p.n ? cq_load_any(e.gate, e.gate_dtype, gi + nb) : 0.0f, rbars, &residual_loads};
          if (gelu) store_tile_tma<kBN, T, true, true, 2>(&map_y, acc, sw_a, sw_b, b_a, b_b, m0, n0, buf, gt, sa_tile);
          else store_tile_tma<kBN, T, false, true, 2>(&map_y, acc, sw_a, sw_b, b_a, b_b, m0, n0, buf, gt, sa_tile);
        } else if (gelu) {
          store_tile_tma<kBN, T, true, false, 2>(&map_y, acc, sw_a, sw_b, b_a, b_b, m0, n0, buf, tma_gate{}, sa_tile);
        } else {
          store_tile_tma<kBN, T, false, false, 2>(&map_y, acc, sw_a, sw_b, b_a, b_b, m0, n0, buf, tma_gate{}, sa_tile);
        }
      };
      if (p.y_dtype == CQ_DTYPE_BF16) stores(__nv_bfloat16{});
      else stores(__half{});
    } else {
      store_tile<kBN>(e, p.y_dtype, acc, p.sa, sw_a, sw_b, m0, n0, reinterpret_cast<float *>(epi), 1 + c);
    }
  }
  if ((p.tma_y || p.tma_gate) && lane == 0) cq_bulk_wait_read(); /* the shared memory lives until the stores have read it */
#else
  (void)map_x, (void)map_w, (void)map_y, (void)map_r, (void)p;
  __trap(); /* not built for sm_90a: the host never selects this kernel then */
#endif
}

int log2_of(int64_t v) {
  int s = 0;
  while ((int64_t)1 << s < v) ++s;
  return s;
}

/* A launch of `grid` CTAs in clusters of two (its attribute: *pair). */
cudaLaunchConfig_t pair_launch(unsigned grid, cudaStream_t s, cudaLaunchAttribute *pair) {
  pair->id = cudaLaunchAttributeClusterDimension;
  pair->val.clusterDim.x = 2, pair->val.clusterDim.y = 1, pair->val.clusterDim.z = 1;
  cudaLaunchConfig_t lc = {};
  lc.gridDim = dim3(grid), lc.blockDim = dim3(kThreads), lc.dynamicSmemBytes = kSmemBytes, lc.stream = s;
  lc.attrs = pair, lc.numAttrs = 1;
  return lc;
}

/* How many clusters of two CTAs the device holds at once (asked once per kernel and device; 0 where
 * it refuses clusters). */
template <int GPS> int pair_slots(int device) {
  static int slots[64]; /* 0 unknown, else 1 + the count */
  if (device < 0 || device >= 64) return 0;
  if (!slots[device]) {
    cudaLaunchAttribute pair;
    const cudaLaunchConfig_t lc = pair_launch(2, 0, &pair);
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, gemm_w4a8_2l_kernel<GPS>, &lc) != cudaSuccess) clusters = 0;
    (void)cudaGetLastError(); /* a refused query leaves no error behind */
    slots[device] = 1 + clusters;
  }
  return slots[device] - 1;
}

/* Whole tiles, and where the last wave would run under 90% full with at most half the SMs, its
 * tiles cut in two along K (the second half takes the odd stage). */
work_plan plan_work(int64_t tiles_m, int64_t tiles_n, int ktiles, int sms) {
  work_plan w = whole_tiles(tiles_m, tiles_n, ktiles);
  const int64_t rest = w.whole % sms;
  if (rest == 0 || 2 * rest > sms || ktiles < 2 * kMinHalfSteps) return w;
  w.splits = 2, w.per = ktiles / 2, w.rem = 0;
  w.whole -= rest;
  return w;
}

template <int GPS>
cq_status launch(const cq_mixed_args *g, w2l_params p, int sms, cudaStream_t s) {
  const int ktiles = (int)((g->k + kCodes - 1) / kCodes);
  const int64_t tiles_m = (g->m + kBN - 1) / kBN, tiles_n = (g->n + kRows - 1) / kRows;
  auto kernel = gemm_w4a8_2l_kernel<GPS>;
  CQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  /* a cut tile's halves are CTAs 2i, 2i + 1 of one cluster: an even grid whose whole tiles fill
   * whole waves, all of whose pairs the device holds at once */
  p.work = plan_work(tiles_m, tiles_n, ktiles, sms);
  const int64_t units0 = work_units(p.work);
  const unsigned grid0 = (unsigned)(units0 < sms ? units0 : sms);
  const bool pairs = p.work.splits == 2 && grid0 % 2 == 0 && p.work.whole % grid0 == 0 &&
                     2 * pair_slots<GPS>(g->device) >= (int)grid0;
  if (!pairs) p.work = whole_tiles(tiles_m, tiles_n, ktiles);
  CUtensorMap map_x, map_w, map_y = {}, map_r = {};
  const uint64_t xdims[2] = {(uint64_t)g->k, (uint64_t)g->m}, xstrides[1] = {(uint64_t)g->lda};
  const uint32_t xbox[2] = {(uint32_t)kCodes, (uint32_t)kBN};
  CQ_TRY(cq_tensor_map(&map_x, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, g->a, xdims, xstrides, xbox,
                       CU_TENSOR_MAP_SWIZZLE_128B, "activation codes"));
  const uint64_t wdims[2] = {(uint64_t)((g->k + 1) / 2), (uint64_t)g->n}, wstrides[1] = {(uint64_t)g->ldw};
  const uint32_t wbox[2] = {(uint32_t)kRowBytes, (uint32_t)kRows};
  CQ_TRY(cq_tensor_map(&map_w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, g->w, wdims, wstrides, wbox,
                       CU_TENSOR_MAP_SWIZZLE_64B, "weight"));
  const bool y16 = g->out.y_dtype == CQ_DTYPE_BF16 || g->out.y_dtype == CQ_DTYPE_F16;
  p.tma_y = y16 && !g->out.gate && p.e.pair_ok;
  p.tma_gate = y16 && g->out.gate && p.e.pair_ok && (uintptr_t)g->out.residual % 16 == 0 && (g->out.ldr * 2) % 16 == 0;
  const CUtensorMapDataType y_type =
      g->out.y_dtype == CQ_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const uint32_t ybox[2] = {16u, 64u};
  if (p.tma_y || p.tma_gate) {
    const uint64_t ydims[2] = {(uint64_t)g->n, (uint64_t)g->m}, ystrides[1] = {(uint64_t)g->out.ldy * 2};
    CQ_TRY(cq_tensor_map(&map_y, y_type, 2, g->out.y, ydims, ystrides, ybox, CU_TENSOR_MAP_SWIZZLE_32B, "y"));
  }
  if (p.tma_gate) {
    const uint64_t rdims[2] = {(uint64_t)g->n, (uint64_t)g->m}, rstrides[1] = {(uint64_t)g->out.ldr * 2};
    CQ_TRY(cq_tensor_map(&map_r, y_type, 2, g->out.residual, rdims, rstrides, ybox, CU_TENSOR_MAP_SWIZZLE_32B,
                         "residual"));
  }
  const int64_t units = work_units(p.work);
  const unsigned grid = (unsigned)(units < sms ? units : sms);
  if (pairs) {
    cudaLaunchAttribute pair;
    const cudaLaunchConfig_t lc = pair_launch(grid, s, &pair);
    CQ_CUDA_CHECK(cudaLaunchKernelEx(&lc, kernel, map_x, map_w, map_y, map_r, p));
  } else {
    kernel<<<grid, kThreads, kSmemBytes, s>>>(map_x, map_w, map_y, map_r, p);
  }
  CQ_LAUNCH_CHECK(gemm_w4a8_2l_kernel);
  return CQ_OK;
}

bool usable(int device, int *sms) {
  static signed char image_ok[64];
  const void *kernel = reinterpret_cast<const void *>(gemm_w4a8_2l_kernel<1>);
  return cq_wgmma_usable(device, kernel, image_ok, sms);
}

}  // namespace

size_t cq_w4a8_2l_split_bytes(int64_t m, int64_t n) {
  (void)m, (void)n;
  return 0; /* a cut tile's halves add through the cluster, not the workspace */
}

cq_status cq_gemm_w4a8_2l_sm90_cuda(const cq_mixed_args *g, int device, cudaStream_t stream, int *launched) {
  *launched = 0;
  if (cq_settings_now().disable_wgmma) return CQ_OK; /* CQUANT_DISABLE_WGMMA: int8 GEMMs keep off wgmma */
  const int64_t gs = g->group_size;
  if (g->w_granularity != CQ_GRANULARITY_TWO_LEVEL || g->w_format != CQ_FORMAT_INT4 || g->a_format != CQ_FORMAT_INT8 ||
      !g->sa || gs < 32 || (gs & (gs - 1)) || g->k % gs || g->m < 1 || g->n < 1)
    return CQ_OK;
  if (g->out.y_dtype != CQ_DTYPE_F32 && g->out.y_dtype != CQ_DTYPE_F16 && g->out.y_dtype != CQ_DTYPE_BF16) return CQ_OK;
  /* TMA: 16-byte aligned bases and row strides, coordinates within int32 (K within 2^30: the
   * multipliers' index, stage * 128, is an int) */
  if (((uintptr_t)g->a & 15) || ((uintptr_t)g->w & 15) || (g->lda & 15) || (g->ldw & 15) || g->m > 0x7fffffffLL ||
      g->n > 0x7fffffffLL || g->k > (1LL << 30))
    return CQ_OK;
  int sms = 0;
  if (!usable(device, &sms)) return CQ_OK;
  w2l_params p = {};
  p.m = g->m, p.n = g->n, p.k = g->k;
  p.groups = g->k / gs, p.ld_scales = 1 + p.groups, p.group_shift = log2_of(gs);
  p.scales = g->sw, p.sa = g->sa;
  p.e = epilogue_of(g), p.y_dtype = g->out.y_dtype;
  CQ_TRY(gs >= 128 ? launch<1>(g, p, sms, stream) : gs == 64 ? launch<2>(g, p, sms, stream) : launch<4>(g, p, sms, stream));
  *launched = 1;
  return CQ_OK;
}
