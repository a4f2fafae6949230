/* Mixed-input GEMM on Hopper warpgroup tensor cores (sm_90a): 4-bit weights per group (int4,
 * uint4) times bf16/fp16 activations, the weights decoded in registers between the shared-memory
 * load and the MMA (cquant.h, "4-bit weights per group": w' = x' of the format, fp32, rounded to
 * the activations' type).
 *
 * wgmma takes only its A operand from registers, so the weights are A: each tile computes
 * D[64 WG weights x 128 tokens] = W'[64 WG, K] . X[128, K]^T and the epilogue writes D transposed
 * into y [M, N]. Also the W4A8 kernel (int4dq, fp8da_int4w), further down. Persistent and warp-specialized like gemm_wgmma.cu: warpgroup 0 is the producer
 * (one thread issues TMA loads of a 128 x 64 activation tile, 128-byte swizzled, and of the
 * packed weight tile into a ring of stages tracked by mbarriers); each consumer warpgroup owns 64
 * weight rows: per stage it reads its packed rows, decodes them (int4_decode.cuh, the math of the
 * C reference; on the 16-bit path in tiles whose scales all allow it) into the A fragments of
 * four k16 steps and issues the four wgmma, so the decode of stage k+1 runs under the MMAs of
 * stage k (the fragments are double-buffered: wgmma reads its register operands asynchronously).
 *
 * Stored nibbles are plain (code 2i in the low nibble of byte i): fragment register r of a
 * k16 step needs codes (2q, 2q+1) or (2q+8, 2q+9) of a row, q = lane % 4, i.e. byte q of the
 * step's two 4-byte words; one byte permute gathers both for a row. */
#include <cuda.h>

#include <type_traits>

#include "gemm8_common.cuh"
#include "gemm_mixed_sm90.cuh"
#include "gemm_mixed_wgmma.cuh"
#include "int4_decode.cuh"
#include "tensor_map.cuh"

using namespace cq_gemm8;
using namespace cq_mixed;

namespace {

constexpr int BM = 128;          /* weight rows a tile of the W4A8 kernel: two consumer warpgroups of 64 */
constexpr int BK = 64;           /* codes of K a stage: one 128-byte swizzle row of 16-bit activations */
constexpr int kWRowBytes = BK / 2; /* packed bytes of one weight row a stage */
constexpr int THREADS = 384;

/* The W4A16 kernel: WG consumer warpgroups of 64 weight rows each and BN tokens a tile. Weights
 * are cheap to load (half a byte a code) and the activations dear (two bytes), so tiles are tall:
 * 3 x 64 weights x 128 tokens reads 22 KB a stage for 3/4 of the MMA work 2 x 64 x 256 does with
 * 36 KB (four warpgroups would spill: 640 threads leave 96 registers a thread at launch). */
template <int WG, int BN> struct mx_config {
  static constexpr int kRows = 64 * WG;                  /* weight rows a tile */
  static constexpr int kThreads = 128 * (WG + 1);
  static constexpr int kTileX = BN * BK * 2;             /* 1024-byte multiple: stages stay swizzle-aligned */
  static constexpr int kTileW = kRows * kWRowBytes;
  static constexpr int kStageBytes = kTileX + kTileW;
  static constexpr int kEpilogueBytes = WG * kEpiWarpgroupBytes;
  static constexpr int kStages = (227 * 1024 - 2048 - kEpilogueBytes) / kStageBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes + kEpilogueBytes + 1024; /* + slack to align */
  /* registers: the producer gives back to 40, the consumers share the rest (multiple of 8) */
  static constexpr int kConsumerRegs = ((65536 - 128 * 40) / (128 * WG) / 8 * 8) > 232 ? 232
                                       : (65536 - 128 * 40) / (128 * WG) / 8 * 8;
};
constexpr int kMixedWG = 3, kMixedBN = 128;
static_assert(mx_config<kMixedWG, kMixedBN>::kConsumerRegs >= 65536 / mx_config<kMixedWG, kMixedBN>::kThreads / 8 * 8,
              "the consumer warpgroups grow, not shrink, their registers");

struct mx_params {
  int64_t m, n, k;
  int64_t tiles_m, tiles_n; /* token tiles (BN) and weight tiles (BM) */
  const float *sw;          /* [N, G] or [N, G, 2] */
  int64_t groups;           /* G */
  int group_shift;          /* log2(group_size) */
  int passes;               /* 1: decode passes a stage (see the consumer loop) */
  epilogue e;               /* y [M, N]; sa, sb unused (1) */
  cq_dtype y_dtype;         /* y's dtype (the epilogue's stores choose it at run time) */
};

#ifdef CQ_SM90A_DEVICE

/* Scale and zero point of weight row n, group gi (int4: zero point unused); rows or groups past
 * the tensor get scale 0, so the zero-filled tiles there add exact zeros. */
template <bool UINT4>
__device__ __forceinline__ float2 group_terms(const mx_params &p, int64_t n, int64_t gi) {
  if (n >= p.n || gi >= p.groups) return make_float2(0.0f, 0.0f);
  if constexpr (UINT4) return __ldg(reinterpret_cast<const float2 *>(p.sw) + n * p.groups + gi);
  return make_float2(__ldg(p.sw + n * p.groups + gi), 0.0f);
}

/* Whether every group of this consumer warpgroup's 64 weight rows takes the 16-bit decode exactly
 * (cq_int4::exact16), decided once a tile for the whole warpgroup (named barrier bar_id), so the
 * tile runs one decode path, no register holds both, and the warpgroup's four warps issue the
 * same wgmma instructions (.aligned asks for that). Each thread checks its rows na and nb in
 * every fourth group. */
template <bool BF16, bool UINT4>
__device__ __forceinline__ bool tile_exact16(const mx_params &p, int64_t na, int64_t nb, int q, int bar_id) {
  bool ok = true;
  for (int64_t gi = q; gi < p.groups; gi += 4) {
    const float2 a = group_terms<UINT4>(p, na, gi), b = group_terms<UINT4>(p, nb, gi);
    ok = ok & cq_int4::exact16<BF16, UINT4>(a.x, a.y) & cq_int4::exact16<BF16, UINT4>(b.x, b.y);
  }
  return cq_bar_sync_and(bar_id, 128, ok);
}

/* The four k16 steps of a stage. wa/wb: the 8 words of rows A (g) and B (g + 8); ta/tb the terms
 * of the stage's first and second 32 codes (one group unless group_size is 32). Register r of a
 * step holds two neighbouring codes of one row: byte q of the step's first word (codes 2q, 2q+1)
 * or of its second (codes 2q+8, 2q+9), which one byte permute gathers for both. */
template <typename T, bool UINT4, bool FAST>
__device__ __forceinline__ void decode_stage(const uint32_t (&wa)[8], const uint32_t (&wb)[8], uint32_t sel,
                                             uint32_t sel16, const float2 (&ta)[2], const float2 (&tb)[2],
                                             uint32_t (&f)[4][4]) {
  constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
  if constexpr (FAST) {
    /* the 16-bit path (int4_decode.cuh): byte q of a word and byte q of the word shifted down a
     * nibble put its two codes in bits [0, 4) and [16, 20), as Decoder16::at takes them */
#pragma unroll
    for (int st = 0; st < 4; ++st) {
      const cq_int4::Decoder16<kBf16, UINT4> a(ta[st / 2].x, ta[st / 2].y), b(tb[st / 2].x, tb[st / 2].y);
      f[st][0] = a.at(__byte_perm(wa[2 * st], wa[2 * st] >> 4, sel16));         /* row A: codes 2q, 2q+1 */
      f[st][1] = b.at(__byte_perm(wb[2 * st], wb[2 * st] >> 4, sel16));         /* row B */
      f[st][2] = a.at(__byte_perm(wa[2 * st + 1], wa[2 * st + 1] >> 4, sel16)); /* row A: codes 2q+8, 2q+9 */
      f[st][3] = b.at(__byte_perm(wb[2 * st + 1], wb[2 * st + 1] >> 4, sel16)); /* row B */
    }
  } else {
#pragma unroll
    for (int st = 0; st < 4; ++st) {
      const uint32_t pa = __byte_perm(wa[2 * st], wa[2 * st + 1], sel);
      const uint32_t pb = __byte_perm(wb[2 * st], wb[2 * st + 1], sel);
      const float2 a = ta[st / 2], b = tb[st / 2];
      f[st][0] = cq_int4::byte_to_pair<kBf16, UINT4>(pa, a.x, a.y);      /* row A: codes 2q, 2q+1 */
      f[st][1] = cq_int4::byte_to_pair<kBf16, UINT4>(pb, b.x, b.y);      /* row B */
      f[st][2] = cq_int4::byte_to_pair<kBf16, UINT4>(pa >> 8, a.x, a.y); /* row A: codes 2q+8, 2q+9 */
      f[st][3] = cq_int4::byte_to_pair<kBf16, UINT4>(pb >> 8, b.x, b.y); /* row B */
    }
  }
}

#endif /* CQ_SM90A_DEVICE */

template <int WG, int BN, typename T, bool UINT4>
__global__ void __launch_bounds__(mx_config<WG, BN>::kThreads, 1)
    gemm_mixed_kernel(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w,
                      const mx_params p) {
#ifdef CQ_SM90A_DEVICE
  typedef mx_config<WG, BN> cfg;
  constexpr int BMW = cfg::kRows;
  constexpr int S = cfg::kStages;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[S], empty_bar[S];

  const uint32_t raw = cq_smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u; /* swizzle atoms are 1024-byte aligned */
  uint8_t *const gbase = smem_raw + (base - raw);
  const int wg = threadIdx.x / 128, lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
  const int ktiles = (int)((p.k + BK - 1) / BK);
  const int64_t tiles = p.tiles_m * p.tiles_n;

  init_ring(full_bar, empty_bar, 4 * WG);
  if (wg == 0) {
    cq_setmaxnreg_dec<40>();
    if (threadIdx.x == 0)
      produce(&map_x, &map_w, base, full_bar, empty_bar, p.tiles_m, p.tiles_n, ktiles, cfg::kStageBytes, cfg::kTileX,
              BK, BN, kWRowBytes, BMW);
    return;
  }

  cq_setmaxnreg_inc<cfg::kConsumerRegs>();
  const int c = wg - 1, g = lane >> 2, q = lane & 3;
  const int row_a = c * 64 + warp * 16 + g; /* this thread's weight rows in the tile: row_a, row_a + 8 */
  const uint32_t sel = (uint32_t)q | ((uint32_t)(q + 4) << 4);
  const uint32_t sel16 = (uint32_t)q * 0x11u | (uint32_t)(q + 4) * 0x1100u; /* bytes q, q, 4 + q, 4 + q */
  constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
  float acc[BN / 2];
  uint32_t it = 0;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    int64_t tm, tn;
    tile_of(tile, p.tiles_m, p.tiles_n, &tm, &tn);
    const int64_t na = tn * BMW + row_a, nb = na + 8;
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
    cq_fence_regs(acc);
    uint32_t prev = 0;

    /* the group terms of stage kt: its first and second 32 codes, rows na and nb */
    auto terms = [&](int kt, float2 (&t)[4]) {
      const int64_t g0 = ((int64_t)kt * BK) >> p.group_shift, g1 = ((int64_t)kt * BK + 32) >> p.group_shift;
      t[0] = group_terms<UINT4>(p, na, g0), t[1] = group_terms<UINT4>(p, na, g1);
      t[2] = group_terms<UINT4>(p, nb, g0), t[3] = group_terms<UINT4>(p, nb, g1);
    };
    float2 next[4]; /* loaded a stage ahead: global latency stays off the decode's path */
    terms(0, next);

    /* One stage: wait for its tiles, read the packed rows, decode them into f while this
     * warpgroup's previous wgmma (reading f_prev) run, wait for those (the previous stage's tiles
     * then go back to the producer) and issue four wgmma. */
    auto stage = [&](auto fast, int kt, uint32_t(&f)[4][4], uint32_t(&f_prev)[4][4]) {
      const float2 ta[2] = {next[0], next[1]}, tb[2] = {next[2], next[3]};
      if (kt + 1 < ktiles) terms(kt + 1, next);
      const uint32_t s = it % S, phase = (it / S) & 1u;
      cq_mbar_wait(cq_smem_addr(&full_bar[s]), phase);
      const uint8_t *wt = gbase + s * cfg::kStageBytes + cfg::kTileX;
      const uint4 a0 = *reinterpret_cast<const uint4 *>(wt + row_a * kWRowBytes);
      const uint4 a1 = *reinterpret_cast<const uint4 *>(wt + row_a * kWRowBytes + 16);
      const uint4 b0 = *reinterpret_cast<const uint4 *>(wt + (row_a + 8) * kWRowBytes);
      const uint4 b1 = *reinterpret_cast<const uint4 *>(wt + (row_a + 8) * kWRowBytes + 16);
      const uint32_t wa[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const uint32_t wb[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
      /* The decode sits in a loop of p.passes (= 1) iterations, a count the compiler cannot
       * know: it then cannot move decode work past the loop into the wgmma below, where each
       * wgmma would wait for the decode of its operands (serialized wgmma); a barrier or an
       * operand fence does not stop it. */
      for (int pass = 0; pass < p.passes; ++pass)
        decode_stage<T, UINT4, decltype(fast)::value>(wa, wb, sel, sel16, ta, tb, f);
      cq_fence_regs(f[0]), cq_fence_regs(f[1]), cq_fence_regs(f[2]), cq_fence_regs(f[3]);
      cq_wgmma_wait<0>();
      /* wgmma reads its register operands asynchronously, but to the compiler a fragment is dead
       * once its wgmma is issued, and the decode above could reuse its registers. A use after the
       * wait (a store never taken: passes is 1) keeps f_prev's registers its own until then. */
      if (p.passes != 1) {
        uint4 *sink = reinterpret_cast<uint4 *>(gbase + S * cfg::kStageBytes);
#pragma unroll
        for (int i = 0; i < 4; ++i) sink[i] = make_uint4(f_prev[i][0], f_prev[i][1], f_prev[i][2], f_prev[i][3]);
      }
      if (kt > 0 && lane == 0) cq_mbar_arrive(cq_smem_addr(&empty_bar[prev]));
      const uint64_t dx = smem_desc(base + s * cfg::kStageBytes);
      cq_wgmma_fence();
#pragma unroll
      for (int st = 0; st < 4; ++st) cq_mixed::wgmma_rs<BN, T>(acc, f[st], dx + 2 * st); /* +32 bytes of K */
      cq_wgmma_commit();
      prev = s;
      ++it;
    };
    uint32_t f0[4][4], f1[4][4];
    if (tile_exact16<kBf16, UINT4>(p, na, nb, q, 1 + c)) { /* store_tile's barrier, in turn */
      for (int kt = 0; kt < ktiles; kt += 2) {
        stage(std::true_type(), kt, f0, f1);
        if (kt + 1 < ktiles) stage(std::true_type(), kt + 1, f1, f0);
      }
    } else {
      for (int kt = 0; kt < ktiles; kt += 2) {
        stage(std::false_type(), kt, f0, f1);
        if (kt + 1 < ktiles) stage(std::false_type(), kt + 1, f1, f0);
      }
    }
    cq_wgmma_wait<0>();
    cq_fence_regs(acc);
    if (lane == 0) cq_mbar_arrive(cq_smem_addr(&empty_bar[prev]));

    store_tile<BN>(p.e, p.y_dtype, acc, nullptr, 1.0f, 1.0f, tm * BN, tn * BMW + c * 64,
                      reinterpret_cast<float *>(gbase + S * cfg::kStageBytes + c * kEpiWarpgroupBytes), 1 + c);
  }
#else
  (void)map_x, (void)map_w, (void)p;
  __trap(); /* not built for sm_90a: the host never selects this kernel then */
#endif
}

/* ---------------------------------------------------------------- 8-bit activations x int4
 *
 * int4dq and fp8da_int4w: the activations' int8 or e4m3 codes are the wgmma's B tile (TMA, BN x
 * 128 codes a stage), the int4 codes become int8 or e4m3 A fragments exactly (|code| <= 7), and
 * each group of group_size codes is summed in accumulators of its own (k32 wgmma, int32 or fp32)
 * that are then scaled by sw[n, g] into the fp32 ones: y = act((sum_g acc_g sw[n, g]) sa[m] + b). */

constexpr int BK8 = 128;            /* codes of K a stage: one 128-byte swizzle row of 8-bit codes */
constexpr int kW8RowBytes = BK8 / 2; /* packed bytes of one weight row a stage */
constexpr int BN8 = 128;            /* tokens a tile (two accumulator sets must fit the registers) */

struct w8_config {
  static constexpr int kTileX = BN8 * BK8; /* 1024-byte multiple */
  static constexpr int kTileW = BM * kW8RowBytes;
  static constexpr int kStageBytes = kTileX + kTileW;
  static constexpr int kEpilogueBytes = 2 * kEpiWarpgroupBytes;
  static constexpr int kStages = (227 * 1024 - 2048 - kEpilogueBytes) / kStageBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes + kEpilogueBytes + 1024;
};

struct w8_params {
  int64_t m, n, k;
  int64_t tiles_m, tiles_n;
  const float *sw;  /* [N, G] */
  const float *sa;  /* [M] */
  int64_t groups;
  int group_shift;
  epilogue e;
  cq_dtype y_dtype; /* y's dtype (the epilogue's stores choose it at run time) */
};

#ifdef CQ_SM90A_DEVICE

/* Four int4 codes (16 bits, two's complement nibbles, first code lowest) as four int8 bytes in
 * the same order. t, u: the codes (flipped to code + 8) of nibbles 0, 2 and 1, 3 in bytes 0, 1. */
__device__ __forceinline__ void nibbles_to_bytes(uint32_t h, uint32_t *t, uint32_t *u) {
  *t = (h & 0x0F0Fu) ^ 0x0808u;
  *u = ((h >> 4) & 0x0F0Fu) ^ 0x0808u;
}
__device__ __forceinline__ uint32_t codes_s8(uint32_t h) {
  uint32_t t, u;
  nibbles_to_bytes(h, &t, &u);
  return (__byte_perm(t, u, 0x5140) + 0x78787878u) ^ 0x80808080u; /* (c + 8) - 8 a byte, no carries */
}
/* The same four codes as e4m3 bytes: code + 1024 exact in f16 (0x6400 | (c + 8), minus 1032), then
 * the exact conversion of small integers to e4m3. */
__device__ __forceinline__ uint32_t codes_e4m3(uint32_t h) {
  uint32_t t, u;
  nibbles_to_bytes(h, &t, &u);
  const uint32_t x01 = __byte_perm(t, u, 0x3420) | 0x64006400u, x23 = __byte_perm(t, u, 0x3521) | 0x64006400u;
  const __half2 off = __halves2half2(__ushort_as_half(0x6408), __ushort_as_half(0x6408)); /* 1032 */
  __half2 a = __hsub2(*reinterpret_cast<const __half2 *>(&x01), off);
  __half2 b = __hsub2(*reinterpret_cast<const __half2 *>(&x23), off);
  uint32_t out;
  asm("{\n.reg .b16 lo, hi;\ncvt.rn.satfinite.e4m3x2.f16x2 lo, %1;\ncvt.rn.satfinite.e4m3x2.f16x2 hi, %2;\n"
      "mov.b32 %0, {lo, hi};\n}\n"
      : "=r"(out)
      : "r"(*reinterpret_cast<uint32_t *>(&a)), "r"(*reinterpret_cast<uint32_t *>(&b)));
  return out;
}

template <bool FP8> __device__ __forceinline__ uint32_t codes8(uint32_t h) {
  if constexpr (FP8) return codes_e4m3(h);
  return codes_s8(h);
}

#endif /* CQ_SM90A_DEVICE */

template <bool FP8, int GPS>
__global__ void __launch_bounds__(THREADS, 1)
    gemm_w4a8_kernel(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w,
                     const w8_params p) {
#ifdef CQ_SM90A_DEVICE
  typedef w8_config cfg;
  typedef typename std::conditional<FP8, float, int32_t>::type Acc;
  constexpr int S = cfg::kStages;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[S], empty_bar[S];

  const uint32_t raw = cq_smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t *const gbase = smem_raw + (base - raw);
  const int wg = threadIdx.x / 128, lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
  const int ktiles = (int)((p.k + BK8 - 1) / BK8);
  const int64_t tiles = p.tiles_m * p.tiles_n;
  const int64_t gmask = ((int64_t)1 << p.group_shift) - 1;

  init_ring(full_bar, empty_bar, 8);
  if (wg == 0) {
    cq_setmaxnreg_dec<40>();
    if (threadIdx.x == 0)
      produce(&map_x, &map_w, base, full_bar, empty_bar, p.tiles_m, p.tiles_n, ktiles, cfg::kStageBytes, cfg::kTileX,
              BK8, BN8, kW8RowBytes, BM);
    return;
  }

  cq_setmaxnreg_inc<232>();
  const int c = wg - 1, g = lane >> 2, q = lane & 3;
  const int row_a = c * 64 + warp * 16 + g;
  /* this thread's 16-bit pieces of a row: word 4st + q/2 (+2), half q & 1 */
  const int word0 = q >> 1, half_shift = 16 * (q & 1);
  float acc[BN8 / 2];
  Acc accg[BN8 / 2];
  uint32_t it = 0;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    int64_t tm, tn;
    tile_of(tile, p.tiles_m, p.tiles_n, &tm, &tn);
    const int64_t na = tn * BM + row_a, nb = na + 8;
#pragma unroll
    for (int i = 0; i < BN8 / 2; ++i) acc[i] = 0.0f;
    float s_a = 0.0f, s_b = 0.0f;
    for (int kt = 0; kt < ktiles; ++kt, ++it) {
      const uint32_t s = it % S, phase = (it / S) & 1u;
      cq_mbar_wait(cq_smem_addr(&full_bar[s]), phase);
      const uint32_t *wa = reinterpret_cast<const uint32_t *>(gbase + s * cfg::kStageBytes + cfg::kTileX +
                                                               row_a * kW8RowBytes) + word0;
      const uint32_t *wb = wa + 8 * kW8RowBytes / 4;
      uint32_t f[4][4];
#pragma unroll
      for (int st = 0; st < 4; ++st) {
        f[st][0] = codes8<FP8>(wa[4 * st] >> half_shift);
        f[st][1] = codes8<FP8>(wb[4 * st] >> half_shift);
        f[st][2] = codes8<FP8>(wa[4 * st + 2] >> half_shift);
        f[st][3] = codes8<FP8>(wb[4 * st + 2] >> half_shift);
      }
      const uint64_t dx = smem_desc(base + s * cfg::kStageBytes);
      /* GPS groups a stage (group_size 128 / GPS), or GPS = 0: groups of several stages */
      constexpr int kSteps = GPS ? 4 / GPS : 4;
#pragma unroll
      for (int gl = 0; gl < (GPS ? GPS : 1); ++gl) {
        const int64_t k0 = (int64_t)kt * BK8 + gl * 32 * kSteps;
        const bool fresh = GPS || (k0 & gmask) == 0, ends = GPS || ((k0 + BK8) & gmask) == 0 || k0 + BK8 >= p.k;
        if (fresh) { /* the group's scales, read while its wgmma run */
          const int64_t gi = k0 >> p.group_shift;
          s_a = na < p.n && gi < p.groups ? __ldg(p.sw + na * p.groups + gi) : 0.0f;
          s_b = nb < p.n && gi < p.groups ? __ldg(p.sw + nb * p.groups + gi) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < kSteps; ++j) {
          const int st = gl * kSteps + j;
          cq_fence_regs(f[st]);
          cq_wgmma_fence();
          cq_mixed::wgmma_rs8<BN8, Acc>(accg, f[st], dx + 2 * st, j == 0 && fresh ? 0 : 1);
          cq_wgmma_commit();
        }
        if (ends) {
          cq_wgmma_wait<0>();
          cq_fence_regs(accg);
#pragma unroll
          for (int j = 0; j < BN8 / 8; ++j) {
            acc[4 * j] = fmaf((float)accg[4 * j], s_a, acc[4 * j]);
            acc[4 * j + 1] = fmaf((float)accg[4 * j + 1], s_a, acc[4 * j + 1]);
            acc[4 * j + 2] = fmaf((float)accg[4 * j + 2], s_b, acc[4 * j + 2]);
            acc[4 * j + 3] = fmaf((float)accg[4 * j + 3], s_b, acc[4 * j + 3]);
          }
        }
      }
      cq_wgmma_wait<0>(); /* the stage's wgmma are done (a group may go on into the next stage) */
      cq_fence_regs(accg);
      if (lane == 0) cq_mbar_arrive(cq_smem_addr(&empty_bar[s]));
    }

    store_tile<BN8>(p.e, p.y_dtype, acc, p.sa, 1.0f, 1.0f, tm * BN8, tn * BM + c * 64,
                          reinterpret_cast<float *>(gbase + S * cfg::kStageBytes + c * kEpiWarpgroupBytes), 1 + c);
  }
#else
  (void)map_x, (void)map_w, (void)p;
  __trap();
#endif
}

template <bool FP8, int GPS>
cq_status launch_w4a8(const cq_mixed_args *g, w8_params p, int sms, cudaStream_t s) {
  typedef w8_config cfg;
  p.tiles_m = (g->m + BN8 - 1) / BN8;
  p.tiles_n = (g->n + BM - 1) / BM;
  CUtensorMap map_x, map_w;
  const uint64_t xdims[2] = {(uint64_t)g->k, (uint64_t)g->m}, xstrides[1] = {(uint64_t)g->lda};
  const uint32_t xbox[2] = {(uint32_t)BK8, (uint32_t)BN8};
  CQ_TRY(cq_tensor_map(&map_x, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, g->a, xdims, xstrides, xbox,
                       CU_TENSOR_MAP_SWIZZLE_128B, "activation codes"));
  const uint64_t wdims[2] = {(uint64_t)(g->k / 2), (uint64_t)g->n}, wstrides[1] = {(uint64_t)g->ldw};
  const uint32_t wbox[2] = {(uint32_t)kW8RowBytes, (uint32_t)BM};
  CQ_TRY(cq_tensor_map(&map_w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, g->w, wdims, wstrides, wbox,
                       CU_TENSOR_MAP_SWIZZLE_NONE, "weight"));
  auto kernel = gemm_w4a8_kernel<FP8, GPS>;
  CQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, cfg::kSmemBytes));
  const int64_t tiles = p.tiles_m * p.tiles_n;
  const unsigned grid = (unsigned)(tiles < sms ? tiles : sms);
  kernel<<<grid, THREADS, cfg::kSmemBytes, s>>>(map_x, map_w, p);
  CQ_LAUNCH_CHECK(gemm_w4a8_kernel);
  return CQ_OK;
}

/* Groups a stage as a compile-time count: 128 / group_size, or 0 for groups of whole stages. */
template <bool FP8>
cq_status launch_w4a8_groups(const cq_mixed_args *g, const w8_params &p, int sms, cudaStream_t s) {
  switch (g->group_size) {
    case 32: return launch_w4a8<FP8, 4>(g, p, sms, s);
    case 64: return launch_w4a8<FP8, 2>(g, p, sms, s);
    case 128: return launch_w4a8<FP8, 1>(g, p, sms, s);
    default: return launch_w4a8<FP8, 0>(g, p, sms, s);
  }
}

template <typename T, bool UINT4>
cq_status launch(const cq_mixed_args *g, mx_params p, int sms, cudaStream_t s) {
  typedef mx_config<kMixedWG, kMixedBN> cfg;
  p.tiles_m = (g->m + kMixedBN - 1) / kMixedBN;
  p.tiles_n = (g->n + cfg::kRows - 1) / cfg::kRows;
  CUtensorMap map_x, map_w;
  const uint64_t xdims[2] = {(uint64_t)g->k, (uint64_t)g->m}, xstrides[1] = {(uint64_t)g->lda * 2};
  const uint32_t xbox[2] = {(uint32_t)BK, (uint32_t)kMixedBN};
  CQ_TRY(cq_tensor_map(&map_x, g->a_dtype == CQ_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                       2, g->a, xdims, xstrides, xbox, CU_TENSOR_MAP_SWIZZLE_128B, "activations"));
  /* the codes of K only: bytes past them (row padding) read as zeros */
  const uint64_t wdims[2] = {(uint64_t)(g->k / 2), (uint64_t)g->n}, wstrides[1] = {(uint64_t)g->ldw};
  const uint32_t wbox[2] = {(uint32_t)kWRowBytes, (uint32_t)cfg::kRows};
  CQ_TRY(cq_tensor_map(&map_w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, g->w, wdims, wstrides, wbox,
                       CU_TENSOR_MAP_SWIZZLE_NONE, "weight"));
  auto kernel = gemm_mixed_kernel<kMixedWG, kMixedBN, T, UINT4>;
  CQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, cfg::kSmemBytes));
  const int64_t tiles = p.tiles_m * p.tiles_n;
  const unsigned grid = (unsigned)(tiles < sms ? tiles : sms);
  kernel<<<grid, cfg::kThreads, cfg::kSmemBytes, s>>>(map_x, map_w, p);
  CQ_LAUNCH_CHECK(gemm_mixed_kernel);
  return CQ_OK;
}

template <typename T>
cq_status launch_format(const cq_mixed_args *g, const mx_params &p, int sms, cudaStream_t s) {
  return g->w_format == CQ_FORMAT_UINT4 ? launch<T, true>(g, p, sms, s) : launch<T, false>(g, p, sms, s);
}

/* Whether this build holds the sm_90a kernel and the device runs it (cq_wgmma_usable). */
bool usable(int device, int *sms) {
  static signed char image_ok[64];
  const void *kernel = reinterpret_cast<const void *>(gemm_mixed_kernel<kMixedWG, kMixedBN, __nv_bfloat16, false>);
  return cq_wgmma_usable(device, kernel, image_ok, sms);
}

int log2_of(int64_t v) {
  int s = 0;
  while ((int64_t)1 << s < v) ++s;
  return s;
}

}  // namespace

cq_status cq_gemm_mixed_sm90_cuda(const cq_mixed_args *g, int device, cudaStream_t stream, int *launched) {
  *launched = 0;
  const int64_t gs = g->group_size;
  if (g->w_granularity != CQ_GRANULARITY_GROUP || gs < 32 || (gs & (gs - 1)) || g->k % gs || g->m < 1 || g->n < 1)
    return CQ_OK;
  /* TMA: 16-byte aligned bases and row strides, coordinates within int32 */
  const int64_t a_row_bytes = g->lda * (int64_t)cq_dtype_size(g->a_dtype);
  if (((uintptr_t)g->a & 15) || ((uintptr_t)g->w & 15) || (a_row_bytes & 15) || (g->ldw & 15) ||
      g->m > 0x7fffffffLL || g->n > 0x7fffffffLL || g->k > 0x7fffffffLL)
    return CQ_OK;
  if (g->a_format == CQ_FORMAT_NONE) { /* weight-only int4 / uint4 */
    if (g->w_format != CQ_FORMAT_INT4 && g->w_format != CQ_FORMAT_UINT4) return CQ_OK;
    if ((g->a_dtype != CQ_DTYPE_BF16 && g->a_dtype != CQ_DTYPE_F16) || g->out.y_dtype != g->a_dtype) return CQ_OK;
  } else if (g->w_format != CQ_FORMAT_INT4 || !g->sa ||
             (g->a_format != CQ_FORMAT_INT8 && g->a_format != CQ_FORMAT_FP8_E4M3) ||
             (g->out.y_dtype != CQ_DTYPE_F32 && g->out.y_dtype != CQ_DTYPE_F16 && g->out.y_dtype != CQ_DTYPE_BF16)) {
    return CQ_OK;
  }
  int sms = 0;
  if (!usable(device, &sms)) return CQ_OK;

  if (g->a_format != CQ_FORMAT_NONE) {
    /* At most 64 rows and tiles for under a quarter of the SMs: this kernel walks all of K in each
     * tile, while the mma.sync one splits K over the idle SMs. Measured on an H200 at 32 rows,
     * N = 3072: int4dq 19 / 53 / 64 us there against 31 / 104 / 127 us here at K = 3072 / 12288 /
     * 15360 (fp8 activations 24 / 71 / 86 against 30 / 99 / 122); with N = 12288 (96 tiles) this
     * one is ahead. */
    const int64_t tiles = (g->n + BM - 1) / BM * ((g->m + BN8 - 1) / BN8);
    if (g->m <= 64 && g->split_ws && 4 * tiles < sms) return CQ_OK;
    w8_params p = {};
    p.m = g->m, p.n = g->n, p.k = g->k;
    p.sw = g->sw, p.sa = g->sa;
    p.groups = g->k / gs;
    p.group_shift = log2_of(gs);
    p.e = epilogue_of(g), p.y_dtype = g->out.y_dtype;
    CQ_TRY(g->a_format == CQ_FORMAT_FP8_E4M3 ? launch_w4a8_groups<true>(g, p, sms, stream)
                                             : launch_w4a8_groups<false>(g, p, sms, stream));
    *launched = 1;
    return CQ_OK;
  }
  mx_params p = {};
  p.m = g->m, p.n = g->n, p.k = g->k;
  p.sw = g->sw;
  p.groups = g->k / gs;
  p.group_shift = log2_of(gs);
  p.passes = 1;
  p.e = epilogue_of(g), p.y_dtype = g->out.y_dtype;
  CQ_TRY(g->a_dtype == CQ_DTYPE_BF16 ? launch_format<__nv_bfloat16>(g, p, sms, stream)
                                     : launch_format<__half>(g, p, sms, stream));
  *launched = 1;
  return CQ_OK;
}
