/* Weight-only GEMM on Hopper warpgroup tensor cores (sm_90a) for weights with a scale per row or
 * per tensor: int8, fp8 e4m3 / e5m2 and packed fpX codes of 4 to 6 bits, times bf16 / fp16
 * activations, with the math of cquant.h:
 *   acc[m, n] = sum_k x[m, k] * decode(q[n, k])  (fp32),  y[m, n] = act(acc[m, n] * sw[n] + b[n])
 * (gated where the layer is), rounded once, in one kernel.
 *
 * Every code decodes exactly into x's 16-bit type (wo_decode.cuh: bf16 holds every format, f16
 * those this path takes), so the operand is the code's value itself and the scale enters in the
 * fp32 epilogue. The pipeline is gemm_mixed_sm90.cuh's: a producer warpgroup loads by TMA the
 * 128-byte-swizzled activation tile (BN tokens) and the codes of WG x 64 weight rows a stage;
 * each consumer warpgroup decodes its 64 rows into wgmma A fragments two k16 steps at a time,
 * while the wgmma of the two steps before run (fragments double-buffered: at most two groups in
 * flight). wgmma takes only A from registers, so the tile computes y^T; the epilogue writes it
 * back transposed, by TMA stores where y allows them (store_tile_tma), else through store_tile.
 *
 * CTAs are persistent, one per SM. Where whole tiles would leave SMs idle (fewer tiles than SMs,
 * or a last wave under 90% full: 432 tiles on 132 SMs run as 4 waves for 3.3 waves of work), the
 * tiles past the last full wave are cut along K (plan_work); the ranges' fp32 partial sums go
 * through the workspace and the last range to finish adds them in their order (split_fixup),
 * then runs the epilogue. CQUANT_WO_SPLIT_K=0 keeps every tile whole.
 *
 * Fragment register r of a k16 step holds two neighbouring codes of one of the lane's two rows:
 * codes (2q, 2q+1) or (2q+8, 2q+9), q = lane % 4. From 8-bit rows a lane reads the two words of
 * a step holding its codes (the weight tile 64-byte swizzled, so a warp's eight rows fall in
 * distinct banks) and one byte permute gathers its four codes; from 4-bit rows a step's 8 bytes,
 * one byte of each word holding a pair; from 5- and 6-bit rows a group's words, each pair cut
 * out of two of them at the lane's bit offset with one 64-bit shift. fp8 pairs go through the
 * hardware's conversion to f16 (exact: NaN codes to NaN, e5m2's infinities to infinities), so a
 * NaN code makes its row's outputs NaN in the MMA itself, as cquant.h's math has it. */
#include <cuda.h>
#include <cuda_fp8.h>
#include <string.h>

#include <type_traits>

#include "gemm_mixed_sm90.cuh"
#include "gemm_mixed_wgmma.cuh"
#include "tensor_map.cuh"
#include "wo_decode.cuh"

using namespace cq_mixed;

namespace {

/* 64 codes of K a stage, one activation box of 64 columns (128 bytes, the swizzle's span). A
 * row's codes of stage kt are its kBytes bytes from kt kBytes. TMA boxes start and end on 16-byte
 * units (a box starting elsewhere faults), so where kBytes is not a multiple of 16 (5 bits: 40)
 * the box starts at the unit holding the stage's first byte and spans kPitch bytes; the codes lie
 * lead(kt) = kt kBytes % 16 bytes in (5 bits: 0 or 8, in a 48-byte box). With 128 codes a stage
 * instead, 5-bit rows filled a ring of two stages (74 KB each) where they now fill five. */
template <int BITS> struct wo_row {
  static_assert(BITS == 4 || BITS == 5 || BITS == 6 || BITS == 8, "codes of 4, 5, 6 or 8 bits");
  static constexpr int kCodes = 64;
  static constexpr int kBytes = kCodes * BITS / 8; /* of one weight row a stage */
  static constexpr int kPitch = (kBytes + kBytes % 16 + 15) / 16 * 16;
  static constexpr int kSteps = kCodes / 16; /* k16 steps a stage */
  static __device__ __forceinline__ uint32_t lead(int kt) { return kBytes % 16 ? (uint32_t)(kt * kBytes) & 15u : 0u; }
};

#ifndef CQ_WO_SM90_EPI_BUFFERS_8BIT /* 8-bit rows leave room for 4 (a tile's four passes, no wait on a
                                       store within it) at the same 4 stages; not yet measured */
#define CQ_WO_SM90_EPI_BUFFERS_8BIT 2
#endif

/* WG consumer warpgroups of 64 weight rows, BN tokens a tile. Two warpgroups x 256 tokens give
 * each decoded weight 256 tokens of MMA (a quarter of the issue slots goes to decoding, against
 * half at 128 tokens) and the shared-memory reads of 5- and 6-bit rows stay under the port's rate. */
template <int WG, int BN, int BITS> struct wo_config {
  typedef wo_row<BITS> R;
  static constexpr int kRows = 64 * WG;
  static constexpr int kThreads = 128 * (WG + 1);
  static constexpr int kTileX = BN * 128;
  static constexpr int kTileW = kRows * R::kPitch;
  static constexpr int kStageBytes = kTileX + kTileW; /* a multiple of 1024: stages stay swizzle-aligned */
  /* the TMA epilogue's buffers a warp (store_tile_tma), and a warpgroup's epilogue staging */
  static constexpr int kEpiBuffers = BITS == 8 ? CQ_WO_SM90_EPI_BUFFERS_8BIT : 2;
  static constexpr int kEpiBytes = 4 * kEpiBuffers * 2048 > kEpiWarpgroupBytes ? 4 * kEpiBuffers * 2048 : kEpiWarpgroupBytes;
  static constexpr int kEpilogueBytes = WG * kEpiBytes;
  static constexpr int kStages = (227 * 1024 - 2048 - kEpilogueBytes) / kStageBytes; /* 8-bit rows: 4, else 5 */
  static constexpr int kSmemBytes = kStages * kStageBytes + kEpilogueBytes + 1024; /* + slack to align */
  /* registers: the producer gives back to 40, the consumers share the rest (multiple of 8) */
  static constexpr int kConsumerRegs = ((65536 - 128 * 40) / (128 * WG) / 8 * 8) > 232 ? 232
                                       : (65536 - 128 * 40) / (128 * WG) / 8 * 8;
  static_assert(kStageBytes % 1024 == 0, "stages keep the 1024-byte alignment of the swizzled tiles");
  static_assert(kStages >= 2, "a ring of at least two stages");
};

#ifndef CQ_WO_SM90_WG /* the tile; an experiment may build another (3 x 128 and 2 x 128 measured behind on an H200) */
#define CQ_WO_SM90_WG 2
#define CQ_WO_SM90_BN 256
#endif
constexpr int kWoWG = CQ_WO_SM90_WG, kWoBN = CQ_WO_SM90_BN;

struct wo_params {
  int64_t m, n, k;
  work_plan work;           /* token tiles (BN) x weight tiles (64 WG rows), split K's share */
  float *part;              /* split tiles' partial sums: [split tile][warpgroup][split][64 BN] */
  unsigned *count;          /* [split tile][warpgroup] ranges arrived and written, zeroed before the launch */
  const float *sw;          /* [N] per row, [1] per tensor */
  int sw_stride;            /* 1 per row, 0 per tensor */
  int ebits, bias;          /* fpX: the format's exponent bits and bias */
  epilogue e;               /* y [M, N]; sa, sb unused */
  cq_dtype y_dtype;
  int tma_y;                /* y through map_y (store_tile_tma), else store_tile */
  int tma_gate;             /* a gated layer's y through map_y, its residual through map_r, for the
                               tiles whose tokens are of one sample (the others: store_tile) */
  int cluster_pairs;        /* tiles cut in two run as clusters of two CTAs (cluster_pair_fixup) */
};

#ifdef CQ_SM90A_DEVICE

/* What a lane decodes: the two fragment registers of each of its rows in each k16 step of a group
 * of two (codes (2q, 2q+1) and (2q+8, 2q+9) of a step), from its rows' codes in the stage's shared
 * memory. The lane keeps kAddrs shared addresses of its row A's codes in stage 0 (addresses(row_a)),
 * and reads stage s at those plus s's offset, so = s * stage bytes: warp-uniform, an [R+UR] operand
 * of the loads, with row B's codes (8 rows on) at an immediate offset. group(a, so, grp, f) decodes
 * a group. */
template <int CODEC, int BITS, bool BF16> struct wo_lane;

/* 8-bit codes: the step's 16 bytes of a row are chunk st of a 64-byte-swizzled row (chunk c of row
 * r sits at c ^ ((r >> 1) & 3)); the lane reads the two words holding its codes, q / 2 and 2 +
 * q / 2 (a 16-byte read of the whole chunk takes four shared-memory wavefronts a warp, these one
 * each). fp8 gathers bytes (2q, 2q+1, 2q+8, 2q+9) into one word, and its pairs take one cvt to
 * f16x2 each (and for bf16 two widenings and a packing cvt): an e4m3 stage is 131 instructions, 157
 * through wo_decode.cuh's bit operations and the NaN marks those need. int8 moves each pair's two
 * bytes of a word to bytes 0 and 2, the codec's from_bytes02 form: a stage of 115
 * instructions, 148 with the gathered word's codes through the f32 magic number. Its addresses:
 * those of its first word in each of the stage's four steps. */
template <int CODEC, bool BF16> struct wo_lane<CODEC, 8, BF16> {
  typedef WoCodec<CODEC, 8> Codec;
  static constexpr int kAddrs = 4;
  static constexpr uint32_t kRowB = 8 * wo_row<8>::kPitch;
  const typename Codec::Consts consts;
  uint32_t sel;         /* fp8: bytes 2(q&1), +1 of the low and the high word; int8: of one word, to bytes 0 and 2 */
  const int word;       /* q / 2 */
  const int swz;        /* the row's swizzle (the same for rows g and g + 8) */
  __device__ __forceinline__ wo_lane(int q, int g, int ebits, int bias)
      : consts(ebits, bias, BF16),
        sel(CODEC == kWoInt8 ? 0x0100u + 0x0202u * (uint32_t)(q & 1) : 0x5410u + 0x2222u * (uint32_t)(q & 1)),
        word(q >> 1), swz((g >> 1) & 3) {}

  __device__ __forceinline__ void addresses(uint32_t row, uint32_t (&a)[kAddrs]) const {
#pragma unroll
    for (int st = 0; st < 4; ++st) a[st] = row + (uint32_t)(16 * (st ^ swz) + 4 * word);
  }
  /* the selector stays in its register (else rebuilt every stage) */
  __device__ __forceinline__ void keep() { cq_fence_reg(sel); }
  __device__ __forceinline__ uint32_t codes(uint32_t at) const { return __byte_perm(cq_lds32(at), cq_lds32(at + 8), sel); }
  /* the fp8 pair in the low half of w, converted by the hardware */
  static __device__ __forceinline__ uint32_t fp8_pair(uint32_t w) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w & 0xffffu),
                                                     CODEC == kWoE4M3 ? __NV_E4M3 : __NV_E5M2);
    uint32_t r;
    if constexpr (BF16) {
      const float2 v = __half22float2(__half2(h));
      const __nv_bfloat162 b = __floats2bfloat162_rn(v.x, v.y); /* exact: bf16 holds every fp8 value */
      memcpy(&r, &b, 4);
    } else {
      memcpy(&r, &h, 4);
    }
    return r;
  }
  /* an int8 pair of word w */
  __device__ __forceinline__ uint32_t int8_pair(uint32_t w) const {
    return Codec::template from_bytes02<BF16>(__byte_perm(w, 0u, sel));
  }
  /* f[0], f[2]: row A; f[1], f[3]: row B (the wgmma A fragment's order). The group's words are read
   * first (rows A and B of its first step, then of its second), then decoded. */
  __device__ __forceinline__ void group(const uint32_t (&a)[kAddrs], uint32_t so, int grp, uint32_t (&f)[2][4]) const {
    if constexpr (CODEC == kWoInt8) {
      uint32_t c[2][4]; /* [step]: row A's low and high word, row B's */
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t at = a[2 * grp + h] + so;
        c[h][0] = cq_lds32(at), c[h][1] = cq_lds32(at + 8), c[h][2] = cq_lds32(at + kRowB), c[h][3] = cq_lds32(at + kRowB + 8);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h)
        f[h][0] = int8_pair(c[h][0]), f[h][1] = int8_pair(c[h][2]), f[h][2] = int8_pair(c[h][1]), f[h][3] = int8_pair(c[h][3]);
    } else {
      uint32_t c[2][2]; /* [step]: rows A and B's gathered words */
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t at = a[2 * grp + h] + so;
        c[h][0] = codes(at), c[h][1] = codes(at + kRowB);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h)
        f[h][0] = fp8_pair(c[h][0]), f[h][1] = fp8_pair(c[h][1]), f[h][2] = fp8_pair(c[h][0] >> 16),
        f[h][3] = fp8_pair(c[h][1] >> 16);
    }
  }
};

/* 4-bit codes: byte q of the step's first word holds codes 2q, 2q+1, of its second 2q+8, 2q+9.
 * One byte permute takes byte q of the word shifted up a nibble as byte 1 (code 2q's sign at bit
 * 15) and byte q of the word as byte 3 (code 2q+1's at bit 31), the codec's from_tops form: 146
 * instructions a stage, against 162 with the pair gathered by a permute and two shifts. Its
 * address: its row's first code. */
template <bool BF16> struct wo_lane<kWoFpX, 4, BF16> {
  typedef WoCodec<kWoFpX, 4> Codec;
  static constexpr int kAddrs = 1;
  static constexpr uint32_t kRowB = 8 * wo_row<4>::kPitch;
  const typename Codec::Consts consts;
  const uint32_t sel; /* byte 1: 4 + q (of word << 4), byte 3: q (of word); bytes 0 and 2 unused */
  __device__ __forceinline__ wo_lane(int q, int g, int ebits, int bias)
      : consts(ebits, bias, BF16), sel((uint32_t)(4 + q) << 4 | (uint32_t)q << 12) {
    (void)g;
  }
  __device__ __forceinline__ void addresses(uint32_t row, uint32_t (&a)[kAddrs]) const { a[0] = row; }
  /* its constants left to the compiler: held in registers (137 instructions a stage, not 146), they
   * measured 0-3% slower on an H200 */
  __device__ __forceinline__ void keep() {}
  __device__ __forceinline__ uint32_t pair(uint32_t word) const {
    return Codec::template from_tops<BF16>(__byte_perm(word, word << 4, sel), consts);
  }
  __device__ __forceinline__ void group(const uint32_t (&a)[kAddrs], uint32_t so, int grp, uint32_t (&f)[2][4]) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t at = a[0] + so + 8 * (2 * grp + h);
      const uint2 ca = cq_lds64(at), cb = cq_lds64(at + kRowB);
      f[h][0] = pair(ca.x), f[h][1] = pair(cb.x), f[h][2] = pair(ca.y), f[h][3] = pair(cb.y);
    }
  }
};

/* 5- and 6-bit codes: codes (2q, 2q+1) of step st start at bit (16 st + 2q) BITS of the row's bit
 * stream (LSB first), codes (2q+8, 2q+9) 8 BITS further. A group of two steps is 32 codes, BITS
 * words: the lane reads them once (each an 8-byte read where the group's start allows). Each pair
 * lies within two neighbouring words, i0 and i0 + 1 (i0 a constant), and one 64-bit shift of them
 * puts its first code's sign at bit 15 (right by bit - (16 - BITS), or where that could be
 * negative, left into the high word); one more shift brings the second code's sign to bit 31,
 * and a byte permute keeps each where it is, as the codec's from_tops takes them. With a
 * lane-dependent choice of words and a 32-bit funnel shift, a 6-bit stage took 212 instructions
 * against 166 this way (156 with the lane's four shift counts kept in registers). Its address:
 * its row's first code. */
template <int BITS, bool BF16> struct wo_lane<kWoFpX, BITS, BF16> {
  typedef WoCodec<kWoFpX, BITS> Codec;
  static_assert(BITS == 5 || BITS == 6, "a pair within words i0 and i0 + 1");
  static constexpr int kAddrs = 1;
  static constexpr uint32_t kRowB = 8 * wo_row<BITS>::kPitch;
  /* window J (0..3: step J / 2, codes 2q + 8 (J % 2) on) of a group's words: the pair's first bit,
   * kBase + 2q BITS, lies in [kBase, kBase + 6 BITS] past word i0's */
  template <int J> struct window {
    static constexpr int kAt = 8 * BITS * J, i0 = kAt >> 5, kBase = kAt & 31, kTop = 16 - BITS;
    static constexpr bool kLeft = kBase + 6 * BITS <= 32 + kTop; /* else kBase >= kTop: a right shift */
    static_assert(i0 + 1 < BITS && kBase + 8 * BITS <= 64 && (kLeft || kBase >= kTop), "a pair within words i0, i0 + 1");
    /* the shift of words i0, i0 + 1 that puts the first code's sign at bit 15 */
    static __device__ __forceinline__ uint32_t shift(int q) {
      const int bit = kBase + 2 * q * BITS;
      return (uint32_t)(kLeft ? 32 + kTop - bit : bit - kTop);
    }
  };
  typename Codec::Consts consts;
  uint32_t sh[4]; /* window J's shift */
  __device__ __forceinline__ wo_lane(int q, int g, int ebits, int bias)
      : consts(ebits, bias, BF16), sh{window<0>::shift(q), window<1>::shift(q), window<2>::shift(q), window<3>::shift(q)} {
    (void)g;
  }
  __device__ __forceinline__ void addresses(uint32_t row, uint32_t (&a)[kAddrs]) const { a[0] = row; }
  /* its constants stay in their registers (else rebuilt every stage) */
  __device__ __forceinline__ void keep() { cq_fence_regs(sh), cq_fence_reg(consts.rs), cq_fence_reg(consts.scale); }
  /* the BITS words of the group at shared address at */
  __device__ __forceinline__ void words(uint32_t at, uint32_t (&w)[BITS]) const {
    if constexpr (BITS % 2 == 0) {
#pragma unroll
      for (int i = 0; i < BITS / 2; ++i) {
        const uint2 v = cq_lds64(at + 8 * i);
        w[2 * i] = v.x, w[2 * i + 1] = v.y;
      }
    } else {
#pragma unroll
      for (int i = 0; i < BITS; ++i) w[i] = cq_lds32(at + 4 * i);
    }
  }
  /* window J's pair */
  template <int J> __device__ __forceinline__ uint32_t pair(const uint32_t (&w)[BITS]) const {
    typedef window<J> W;
    const uint64_t v = ((uint64_t)w[W::i0 + 1] << 32) | w[W::i0];
    const uint32_t t = W::kLeft ? (uint32_t)((v << sh[J]) >> 32) : (uint32_t)(v >> sh[J]);
    return Codec::template from_tops<BF16>(wo_prmt(t, t << W::kTop, 0x7610u), consts);
  }
  __device__ __forceinline__ void group(const uint32_t (&a)[kAddrs], uint32_t so, int grp, uint32_t (&f)[2][4]) const {
    uint32_t wa[BITS], wb[BITS];
    const uint32_t at = a[0] + so + (uint32_t)(grp * BITS * 4);
    words(at, wa), words(at + kRowB, wb);
    f[0][0] = pair<0>(wa), f[0][1] = pair<0>(wb), f[0][2] = pair<1>(wa), f[0][3] = pair<1>(wb);
    f[1][0] = pair<2>(wa), f[1][1] = pair<2>(wb), f[1][2] = pair<3>(wa), f[1][3] = pair<3>(wb);
  }
};

#endif /* CQ_SM90A_DEVICE */

constexpr uint32_t kConsumersBar = 3; /* named barrier of the consumer warpgroups (1 + c: of warpgroup c) */

template <int WG, int BN, int CODEC, int BITS, typename T>
__global__ void __launch_bounds__(wo_config<WG, BN, BITS>::kThreads, 1)
    gemm_wo_kernel(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w,
                   const __grid_constant__ CUtensorMap map_y, const __grid_constant__ CUtensorMap map_r,
                   const wo_params p) {
#ifdef CQ_SM90A_DEVICE
  typedef wo_config<WG, BN, BITS> cfg;
  typedef wo_row<BITS> R;
  constexpr int S = cfg::kStages;
  static_assert(S * cfg::kStageBytes >= WG * 64 * BN * 4, "a cluster pair's partial sums fit in the ring");
  constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[S], empty_bar[S];
  __shared__ __align__(8) uint64_t residual_bar[WG * 4][2]; /* a consumer warp's residual loads, one per buffer */

  const uint32_t raw = cq_smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u; /* swizzle atoms are 1024-byte aligned */
  uint8_t *const gbase = smem_raw + (base - raw);
  const int wg = threadIdx.x / 128, lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
  const int64_t units = work_units(p.work);

  init_ring(full_bar, empty_bar, 4 * WG);
  if (wg == 0) {
    cq_setmaxnreg_dec<40>();
    if (threadIdx.x == 0)
      produce_units<S>(&map_x, &map_w, base, full_bar, empty_bar, p.work, cfg::kStageBytes, cfg::kTileX,
                                   R::kCodes, BN, R::kBytes, cfg::kRows);
    return;
  }

  cq_setmaxnreg_inc<cfg::kConsumerRegs>();
  const int c = wg - 1, g = lane >> 2, q = lane & 3;
  const int row_a = c * 64 + warp * 16 + g; /* this thread's weight rows in the tile: row_a, row_a + 8 */
  wo_lane<CODEC, BITS, kBf16> dec(q, g, p.ebits, p.bias);
  float acc[BN / 2];
  uint32_t f[2][2][4]; /* [group parity][step of the group]: the A fragments of two k16 steps */
  /* Shared addresses the main loop keeps in registers: the ring's barriers, stage 0's activation
   * descriptor and this lane's code words in stage 0. Left to itself, the compiler rebuilt them from
   * the CTA's shared window every stage: an int8 stage took 176 instructions, 148 this way (e4m3
   * 237, with its codes then read a group ahead, against 157), and the consumer warps, not the
   * tensor cores, set the pace (ncu on an H200: few samples wait on wgmma). */
  uint32_t full0 = cq_smem_addr(&full_bar[0]), empty0 = cq_smem_addr(&empty_bar[0]);
  uint64_t desc0 = smem_desc(base);
  uint32_t at[wo_lane<CODEC, BITS, kBf16>::kAddrs];
  dec.addresses(base + cfg::kTileX + row_a * R::kPitch, at);
  uint32_t it = 0;
  const uint32_t rbars = cq_smem_addr(&residual_bar[c * 4 + warp][0]);
  uint32_t residual_loads = 0;
  if (p.tma_gate) {
    if (lane == 0) cq_mbar_init(rbars, 1), cq_mbar_init(rbars + 8, 1), cq_mbar_init_fence();
    __syncwarp();
  }
  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    const work_unit wu = unit_of(p.work, u);
    const int64_t tm = wu.tm, tn = wu.tn;
    const int64_t na = tn * cfg::kRows + row_a, nb = na + 8;
    /* the epilogue's scales and biases of this lane's rows, read now: their latency passes under
     * the main loop (read after it, ncu saw their wait in 2% of the warps' samples) */
    const float sw_a = na < p.n ? __ldg(p.sw + na * p.sw_stride) : 0.0f, sw_b = nb < p.n ? __ldg(p.sw + nb * p.sw_stride) : 0.0f;
    const float b_a = na < p.n && p.e.bias ? cq_load_any(p.e.bias, p.e.bias_dtype, na) : 0.0f;
    const float b_b = nb < p.n && p.e.bias ? cq_load_any(p.e.bias, p.e.bias_dtype, nb) : 0.0f;
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
    uint32_t prev = 0;
    /* the unit's k-steps, broadcast so the compiler knows them warp-uniform: the ring's indices
     * and the wgmma descriptors then stay on the uniform datapath (no R2UR in the loop) */
    const int steps = __shfl_sync(0xffffffffu, wu.kt1 - wu.kt0, 0);
    for (int j = 0; j < steps; ++j, ++it) {
      const uint32_t s = it % S, phase = (it / S) & 1u, so = s * (uint32_t)cfg::kStageBytes;
      /* an opaque redefinition each stage: kept in registers, not rebuilt */
      cq_fence_regs(at), cq_fence_reg(full0), cq_fence_reg(empty0), cq_fence_reg(desc0), dec.keep();
      cq_mbar_wait(full0 + 8u * s, phase);
      const uint64_t dx = desc0 + (uint64_t)(so >> 4);
#pragma unroll
      for (int grp = 0; grp < R::kSteps / 2; ++grp) { /* an even count: the parity of grp is the group's */
        uint32_t(&fb)[2][4] = f[grp & 1];
        /* the wgmma that read fb (two groups back) are done once at most one group is pending;
         * until then fb's registers stay theirs (wgmma reads its A operand asynchronously, and to
         * the compiler a fragment is dead once its wgmma is issued) */
        cq_wgmma_wait<1>();
        cq_fence_regs(fb[0]), cq_fence_regs(fb[1]);
        if (grp == 1 && j > 0 && lane == 0) cq_mbar_arrive(empty0 + 8u * prev); /* its wgmma are done */
        dec.group(at, so + R::lead(wu.kt0 + j), grp, fb);
        cq_fence_regs(fb[0]), cq_fence_regs(fb[1]); /* decoded before the wgmma are issued */
        cq_wgmma_fence();
#pragma unroll
        for (int h = 0; h < 2; ++h) /* step 2 grp + h: 32 bytes of K on */
          cq_mixed::wgmma_rs<BN, T>(acc, fb[h], dx + (uint64_t)(2 * (2 * grp + h)));
        cq_wgmma_commit();
      }
      prev = s;
    }
    cq_wgmma_wait<0>();
    cq_fence_regs(acc);
    cq_fence_regs(f[0][0]), cq_fence_regs(f[0][1]), cq_fence_regs(f[1][0]), cq_fence_regs(f[1][1]);
    if (lane == 0) cq_mbar_arrive(empty0 + 8u * prev);

    if (u >= p.work.whole) { /* a K range of a split tile: the last range to finish adds them all */
      int64_t slot; /* recomputed here rather than kept live through the main loop */
      int split;
      split_of(p.work, u, &slot, &split);
      if (p.cluster_pairs) {
        if (!cluster_pair_fixup<BN>(acc, base + (uint32_t)(c * 64 * BN * 4), split, kConsumersBar)) continue;
      } else {
        const int64_t at = slot * WG + c;
        if (!split_fixup<BN>(acc, p.part + at * p.work.splits * (64 * BN), 64 * BN, split, p.work.splits,
                             p.count + at, 1 + c))
          continue;
      }
    }
    uint8_t *const epi = gbase + S * cfg::kStageBytes + c * cfg::kEpiBytes;
    const epilogue &e = p.e;
    const int64_t m0 = tm * BN, n0 = tn * cfg::kRows + c * 64, m_last = (m0 + BN < p.m ? m0 + BN : p.m) - 1;
    const bool gate_tma = p.tma_gate && m0 / e.rows_per_sample == m_last / e.rows_per_sample;
    if (p.tma_y || gate_tma) {
      const uint32_t buf = cq_smem_addr(epi) + (uint32_t)(warp * cfg::kEpiBuffers * 2048);
      const bool gelu = e.activation == CQ_ACTIVATION_GELU_TANH;
      if (gate_tma) {
        const int64_t gi = (m0 / e.rows_per_sample) * e.ldg;
        const tma_gate gt{&map_r, na < p.n ? cq_load_any(e.gate, e.gate_dtype, gi + na) : 0.0f,
                          nb < p.n ? cq_load_any(e.gate, e.gate_dtype, gi + nb) : 0.0f, rbars, &residual_loads};
        if (gelu) store_tile_tma<BN, T, true, true>(&map_y, acc, sw_a, sw_b, b_a, b_b, m0, n0, buf, gt);
        else store_tile_tma<BN, T, false, true>(&map_y, acc, sw_a, sw_b, b_a, b_b, m0, n0, buf, gt);
      } else if (gelu) {
        store_tile_tma<BN, T, true, false, cfg::kEpiBuffers>(&map_y, acc, sw_a, sw_b, b_a, b_b, m0, n0, buf);
      } else {
        store_tile_tma<BN, T, false, false, cfg::kEpiBuffers>(&map_y, acc, sw_a, sw_b, b_a, b_b, m0, n0, buf);
      }
    } else {
      store_tile<BN>(e, p.y_dtype, acc, nullptr, sw_a, sw_b, m0, n0, reinterpret_cast<float *>(epi), 1 + c);
    }
  }
  if ((p.tma_y || p.tma_gate) && lane == 0) cq_bulk_wait_read(); /* the shared memory lives until the stores have read it */
#else
  (void)map_x, (void)map_w, (void)map_y, (void)map_r, (void)p;
  __trap(); /* not built for sm_90a: the host never selects this kernel then */
#endif
}

/* Split K where whole tiles would leave SMs idle: the tiles past the last full wave, when they fill
 * less than 90% of one (all tiles, when they are fewer than the SMs), each cut into as many K
 * ranges as keep them within one wave, at least kMinSplitSteps stages a range, within the
 * workspace (ws: counters, then kPartBytes of partial sums a range). A tile cut in two gives its
 * second range kLastExtra stages more than its first: the first finishes earlier and writes its
 * partial sums (6-7k cycles on an H200, about as many stages) while the second still computes,
 * which then adds them to its own, kept in its registers. With cluster_pairs (a tile cut in two
 * runs as a cluster of two CTAs, the sums crossing through distributed shared memory) the second
 * range gets kPairExtra stages more (measured: even ranges; a build may try others). */
#ifndef CQ_WO_SM90_PAIR_EXTRA
#define CQ_WO_SM90_PAIR_EXTRA 0
#endif
constexpr int kMinSplitSteps = 8, kMaxSplits = 8, kLastExtra = 6, kPairExtra = CQ_WO_SM90_PAIR_EXTRA;
constexpr size_t kPartBytes = (size_t)64 * kWoWG * kWoBN * sizeof(float);

size_t counter_bytes(int64_t split_tiles) { return ((size_t)split_tiles * kWoWG * sizeof(unsigned) + 255) / 256 * 256; }

work_plan plan_work(int64_t tiles_m, int64_t tiles_n, int ktiles, int sms, size_t ws_bytes, bool cluster_pairs) {
  work_plan w = whole_tiles(tiles_m, tiles_n, ktiles);
  const int64_t rest = w.whole % sms;
  if (!cq_settings_now().wo_split_k || rest == 0 || 10 * rest >= 9 * (int64_t)sms || ws_bytes < counter_bytes(rest))
    return w;
  int64_t splits = sms / rest;
  const int64_t by_k = ktiles / kMinSplitSteps, by_ws = (int64_t)((ws_bytes - counter_bytes(rest)) / (rest * kPartBytes));
  if (splits > by_k) splits = by_k;
  if (splits > by_ws) splits = by_ws;
  if (splits > kMaxSplits) splits = kMaxSplits;
  if (splits < 2) return w;
  const int even = ktiles - (splits == 2 ? (cluster_pairs ? kPairExtra : kLastExtra) : 0); /* ktiles >= 8 splits: a range >= 5 */
  w.splits = (int)splits, w.per = even / (int)splits, w.rem = even % (int)splits;
  w.whole -= rest;
  return w;
}

/* A launch of `grid` CTAs of the kernel for BITS-bit codes in clusters of two (its attribute: *pair). */
template <int BITS>
cudaLaunchConfig_t pair_launch(unsigned grid, cudaStream_t s, cudaLaunchAttribute *pair) {
  typedef wo_config<kWoWG, kWoBN, BITS> cfg;
  pair->id = cudaLaunchAttributeClusterDimension;
  pair->val.clusterDim.x = 2, pair->val.clusterDim.y = 1, pair->val.clusterDim.z = 1;
  cudaLaunchConfig_t lc = {};
  lc.gridDim = dim3(grid), lc.blockDim = dim3(cfg::kThreads), lc.dynamicSmemBytes = cfg::kSmemBytes, lc.stream = s;
  lc.attrs = pair, lc.numAttrs = 1;
  return lc;
}

/* How many clusters of two CTAs of the kernel the device holds at once (asked once per kernel and
 * device; 0 where it refuses clusters). A grid of more CTAs than that would run in two waves. */
template <int CODEC, int BITS, typename T> int pair_slots(int device) {
  static int slots[64]; /* 0 unknown, else 1 + the count */
  if (device < 0 || device >= 64) return 0;
  if (!slots[device]) {
    cudaLaunchAttribute pair;
    const cudaLaunchConfig_t lc = pair_launch<BITS>(2, 0, &pair);
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, gemm_wo_kernel<kWoWG, kWoBN, CODEC, BITS, T>, &lc) != cudaSuccess)
      clusters = 0;
    (void)cudaGetLastError(); /* a refused query leaves no error behind */
    slots[device] = 1 + clusters;
  }
  return slots[device] - 1;
}

template <int CODEC, int BITS, typename T>
cq_status launch(const cq_mixed_args *g, wo_params p, int sms, cudaStream_t s) {
  typedef wo_config<kWoWG, kWoBN, BITS> cfg;
  typedef wo_row<BITS> R;
  const int ktiles = (int)((g->k + R::kCodes - 1) / R::kCodes);
  const int64_t tiles_m = (g->m + kWoBN - 1) / kWoBN, tiles_n = (g->n + cfg::kRows - 1) / cfg::kRows;
  const size_t ws_bytes = g->split_ws ? g->split_ws_bytes : 0;
  auto kernel = gemm_wo_kernel<kWoWG, kWoBN, CODEC, BITS, T>;
  CQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, cfg::kSmemBytes));
  p.work = plan_work(tiles_m, tiles_n, ktiles, sms, ws_bytes, false);
  /* tiles cut in two as clusters of two CTAs: the split units are the last wave, so with an even
   * grid whose whole tiles fill whole waves, CTAs 2i and 2i + 1 run the two ranges of one tile */
  const int64_t units = work_units(p.work);
  const unsigned grid = (unsigned)(units < sms ? units : sms);
  p.cluster_pairs = cq_settings_now().wo_cluster_pairs && p.work.splits == 2 && grid % 2 == 0 &&
                    p.work.whole % grid == 0 && 2 * pair_slots<CODEC, BITS, T>(g->device) >= (int)grid;
  if (p.cluster_pairs) p.work = plan_work(tiles_m, tiles_n, ktiles, sms, ws_bytes, true);
  CUtensorMap map_x, map_w;
  const uint64_t xdims[2] = {(uint64_t)g->k, (uint64_t)g->m}, xstrides[1] = {(uint64_t)g->lda * 2};
  const uint32_t xbox[2] = {64u, (uint32_t)kWoBN};
  CQ_TRY(cq_tensor_map(&map_x, g->a_dtype == CQ_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                       2, g->a, xdims, xstrides, xbox, CU_TENSOR_MAP_SWIZZLE_128B, "activations"));
  /* the bytes holding K's codes: past them (row padding, K tails) the tiles read zeros */
  const uint64_t wdims[2] = {(uint64_t)((g->k * BITS + 7) / 8), (uint64_t)g->n}, wstrides[1] = {(uint64_t)g->ldw};
  const uint32_t wbox[2] = {(uint32_t)R::kPitch, (uint32_t)cfg::kRows};
  CQ_TRY(cq_tensor_map(&map_w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, g->w, wdims, wstrides, wbox,
                       BITS == 8 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_NONE, "weight"));
  /* y through TMA stores where its base and rows allow them (16-byte aligned), and a gated layer's
   * residual (y's type) through TMA loads where its own do */
  CUtensorMap map_y = {}, map_r = {};
  p.tma_y = !g->out.gate && p.e.pair_ok;
  p.tma_gate = g->out.gate && p.e.pair_ok && (uintptr_t)g->out.residual % 16 == 0 && (g->out.ldr * 2) % 16 == 0;
  const CUtensorMapDataType y_type = g->a_dtype == CQ_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
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
  if (p.work.splits > 1 && !p.cluster_pairs) {
    const int64_t split_tiles = p.work.tiles_m * p.work.tiles_n - p.work.whole;
    uint8_t *ws = reinterpret_cast<uint8_t *>(g->split_ws);
    p.count = reinterpret_cast<unsigned *>(ws);
    p.part = reinterpret_cast<float *>(ws + counter_bytes(split_tiles));
    CQ_CUDA_CHECK(cudaMemsetAsync(p.count, 0, (size_t)split_tiles * kWoWG * sizeof(unsigned), s));
  }
  if (p.cluster_pairs) {
    cudaLaunchAttribute pair;
    const cudaLaunchConfig_t lc = pair_launch<BITS>(grid, s, &pair);
    CQ_CUDA_CHECK(cudaLaunchKernelEx(&lc, kernel, map_x, map_w, map_y, map_r, p));
  } else {
    kernel<<<grid, cfg::kThreads, cfg::kSmemBytes, s>>>(map_x, map_w, map_y, map_r, p);
  }
  CQ_LAUNCH_CHECK(gemm_wo_kernel);
  return CQ_OK;
}

template <typename T>
cq_status launch_codec(const cq_mixed_args *g, const cq_format_info *f, const wo_params &p, int sms, cudaStream_t s) {
  switch (f->id) {
    case CQ_FORMAT_INT8: return launch<kWoInt8, 8, T>(g, p, sms, s);
    case CQ_FORMAT_FP8_E4M3: return launch<kWoE4M3, 8, T>(g, p, sms, s);
    case CQ_FORMAT_FP8_E5M2: return launch<kWoE5M2, 8, T>(g, p, sms, s);
    default: break;
  }
  switch (f->bits) {
    case 4: return launch<kWoFpX, 4, T>(g, p, sms, s);
    case 5: return launch<kWoFpX, 5, T>(g, p, sms, s);
    default: return launch<kWoFpX, 6, T>(g, p, sms, s);
  }
}

/* The formats this kernel decodes: int8, fp8 and fpX of 4 to 6 bits whose every value x's
 * 16-bit type holds (bf16: all of them; f16: those wo_f16_shift leaves unshifted). fp3 and fp7,
 * and the formats f16 needs a shift for, keep the decoded rows of wo_gemm.cu. */
bool takes_format(const cq_format_info *f, cq_dtype x) {
  const bool eight = f->id == CQ_FORMAT_INT8 || f->id == CQ_FORMAT_FP8_E4M3 || f->id == CQ_FORMAT_FP8_E5M2;
  const bool fpx = f->kind == CQ_KIND_FLOAT && f->specials == CQ_SPECIALS_NONE && f->packed && f->bits >= 4 && f->bits <= 6;
  if (!eight && !fpx) return false;
  if (x == CQ_DTYPE_BF16) return true;
  int shift = 1;
  return wo_f16_shift(f->kind == CQ_KIND_INT, f->bits, f->ebits, f->mbits, f->bias, (int)f->specials, &shift) && shift == 0;
}

/* Where the decoded rows and cuBLASLt (wo_gemm.cu) beat this kernel, measured on an H200 with GPU
 * time on Flux's layer shapes and 32 to 1024 rows of them (benchmarks/results/wo_gemm_sm90_h200.md),
 * split K included:
 * - N under one weight tile (N = 64);
 * - a small weight (N K <= 16 Mi codes: 3072 x 3072, 4096 x 3072) with at most 256 rows:
 *   cuBLASLt spreads the little work over more SMs than these 128 x 256 tiles and K ranges.
 * 5- and 6-bit codes with K >= 4 N took the decoded rows from 1024 rows until their pairs came out
 * of one 64-bit shift; since, this kernel is 2-5% ahead there too (512 to 4608 rows). */
bool decoded_rows_win(int64_t m, int64_t n, int64_t k) {
  return n < 64 * kWoWG || (n * k <= ((int64_t)16 << 20) && m <= 256);
}

/* Whether this build holds the sm_90a kernel and the device runs it (cq_wgmma_usable). */
bool usable(int device, int *sms) {
  static signed char image_ok[64];
  const void *kernel = reinterpret_cast<const void *>(gemm_wo_kernel<kWoWG, kWoBN, kWoInt8, 8, __nv_bfloat16>);
  return cq_wgmma_usable(device, kernel, image_ok, sms);
}

}  // namespace

cq_status cq_gemm_wo_sm90_cuda(const cq_mixed_args *g, int device, cudaStream_t stream, int measured, int *launched) {
  *launched = 0;
  const cq_format_info *f = cq_format_get(g->w_format);
  if (!f || g->a_format != CQ_FORMAT_NONE || g->m < 1 || g->n < 1 || g->k < 1 ||
      (g->w_granularity != CQ_GRANULARITY_ROW && g->w_granularity != CQ_GRANULARITY_TENSOR))
    return CQ_OK;
  if ((g->a_dtype != CQ_DTYPE_BF16 && g->a_dtype != CQ_DTYPE_F16) || g->out.y_dtype != g->a_dtype ||
      !takes_format(f, g->a_dtype))
    return CQ_OK;
  /* TMA: 16-byte aligned bases and row strides, coordinates within int32 */
  if (((uintptr_t)g->a & 15) || ((uintptr_t)g->w & 15) || ((g->lda * 2) & 15) || (g->ldw & 15) || g->m > 0x7fffffffLL ||
      g->n > 0x7fffffffLL || g->k > 0x7fffffffLL)
    return CQ_OK;
  int sms = 0;
  if (!usable(device, &sms) || (measured && decoded_rows_win(g->m, g->n, g->k))) return CQ_OK;
  wo_params p = {};
  p.m = g->m, p.n = g->n, p.k = g->k;
  p.sw = g->sw, p.sw_stride = g->w_granularity == CQ_GRANULARITY_ROW ? 1 : 0;
  p.ebits = f->ebits, p.bias = f->bias;
  p.e = epilogue_of(g), p.y_dtype = g->out.y_dtype;
  CQ_TRY(g->a_dtype == CQ_DTYPE_BF16 ? launch_codec<__nv_bfloat16>(g, f, p, sms, stream)
                                     : launch_codec<__half>(g, f, p, sms, stream));
  *launched = 1;
  return CQ_OK;
}
