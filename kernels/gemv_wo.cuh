/* Device code shared by the weight-only kernels (gemv_wo_tile.cu, gemv_wo_persistent.cu,
 * wo_dequant_rows.cu) and their host policy (wo_dispatch.cu).
 *
 * GEMV (M <= CQ_GEMV_MAX_M). The stored weight is read once, at memory speed, and decoded on
 * the fly into the A operand of mma.m16n8k16 (f32 accumulation); x^T is the B operand, M
 * padded to 8 or 16. Decoding takes a few integer and half2 instructions per pair of codes and
 * no tables (wo_decode.cuh). A CTA owns 16 weight rows and its warps split K. Lane (g, c) =
 * (lane / 4, lane % 4) decodes rows g and g + 8, unit 4q + c of each (wo_unit.cuh), so the 4
 * lanes of a group read neighbouring units. A unit's codes enter the k-tiles in the pairing its
 * decoder makes cheapest (WoTile); x is loaded 16 bytes at a time and permuted to match, since
 * mma only needs A and B to agree on the order of k.
 *
 * Decoded values are exact in the mma type, so every product is exact. x in bf16 (f16) is
 * used as it is; x in f32 (or f16 with a format that f16 cannot hold) is split into bf16
 * pieces whose sum is x exactly (3 for f32, 2 for f16), one mma per piece. The partial sums of
 * the warps meet in shared memory and are added in a fixed order (deterministic), then scale,
 * bias and activation in fp32, rounded once. Rows holding an e4m3 NaN code come out NaN, as in
 * the reference.
 *
 * Two kernels run this: one CTA per tile of 16 rows (gemv_wo_tile.cuh) and a persistent one
 * (gemv_wo_persistent.cu). Each is instantiated per decoder (CodecId) and x mode (XMode), and
 * reached through its launcher table. */
#ifndef CQ_KERNELS_GEMV_WO_CUH
#define CQ_KERNELS_GEMV_WO_CUH

#include "wo_unit.cuh"

namespace cq_wo {

constexpr int kGemvWarps = 8;
constexpr int kGemvThreads = 32 * kGemvWarps;
constexpr int kStreamWarps = 16; /* warps of a persistent CTA */

/* ---------------------------------------------------------------- f16 / bf16 bits */

template <bool BF16>
__device__ __forceinline__ uint32_t elem_bits(float v) {
  if (BF16) return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  return __half_as_ushort(__float2half_rn(v));
}

/* f32 -> f16/bf16 bits exactly as the C reference stores them (RNE; a NaN
 * keeps the reference's quiet-NaN pattern so results compare bit for bit). */
template <bool BF16>
__device__ __forceinline__ uint16_t store_bits(float v) {
  if (v != v) return BF16 ? cq_f32_to_bf16(v) : cq_f32_to_f16(v);
  return (uint16_t)elem_bits<BF16>(v);
}

template <typename T> __device__ __forceinline__ void store_out(T *y, int64_t i, float v);
template <> __device__ __forceinline__ void store_out<float>(float *y, int64_t i, float v) { y[i] = v; }
template <> __device__ __forceinline__ void store_out<__half>(__half *y, int64_t i, float v) {
  reinterpret_cast<uint16_t *>(y)[i] = store_bits<false>(v);
}
template <> __device__ __forceinline__ void store_out<__nv_bfloat16>(__nv_bfloat16 *y, int64_t i, float v) {
  reinterpret_cast<uint16_t *>(y)[i] = store_bits<true>(v);
}

/* ---------------------------------------------------------------- decoders */

/* The compile-time decoders, one per code layout (formats of one layout share
 * a decoder; E and M of fpX are run-time constants). */
typedef WoCodec<kWoInt8, 8> CodecInt8;
typedef WoCodec<kWoE4M3, 8> CodecE4M3;
typedef WoCodec<kWoE5M2, 8> CodecE5M2;
typedef WoCodec<kWoFpX, 3> CodecFp3;
typedef WoCodec<kWoFpX, 4> CodecFp4;
typedef WoCodec<kWoFpX, 5> CodecFp5;
typedef WoCodec<kWoFpX, 6> CodecFp6;
typedef WoCodec<kWoFpX, 7> CodecFp7;

enum CodecId {
  kCodecInt8, kCodecE4M3, kCodecE5M2, kCodecFp3, kCodecFp4, kCodecFp5, kCodecFp6, kCodecFp7, kCodecs
};

/* ---------------------------------------------------------------- GEMV */

/* How x enters the mma: bf16 or f16 as it is, or (kXSplit) f32 -- or f16 with
 * a format f16 cannot hold -- as 3 bf16 pieces. */
enum XMode { kXBf16 = 0, kXF16 = 1, kXSplit = 2, kXModes = 3 };

template <int XM>
struct XTraits {
  static constexpr bool kBf16 = XM != kXF16; /* mma input type, and the decoders' target */
  static constexpr int kPieces = XM == kXSplit ? 3 : 1;
};

struct GemvWoArgs {
  const void *x;          /* [m, k] */
  const uint8_t *w;       /* [n, row_bytes] stored codes */
  const float *w_scale;   /* n (per row) or 1 */
  const void *bias;       /* n elements (x dtype or f32) or NULL */
  void *y;                /* [m, n], x dtype, rows ldy apart */
  int64_t ldy;
  int64_t m, n, k, row_bytes;
  int quads;              /* groups of 4 units per row */
  int fast_quads;         /* leading quads whose x loads need no bounds checks (16-bit x, aligned) */
  cq_format_params fmt;
  cq_dtype x_dtype;
  int scale_per_row, bias_f32, w_vec;
  int activation;         /* a cq_activation, applied in fp32 before the rounding to y's dtype */
  int kw;                 /* warps splitting K (per-tile kernel: blockDim.x = 32 kw; persistent: per group) */
  int groups;             /* persistent kernel: warp groups per CTA, each with its own row tiles */
  const void *gate;       /* gated layer (cq_linear_out): [m / rows_per_sample, n] rows ldg apart, or NULL */
  cq_dtype gate_dtype;
  int64_t ldg, rows_per_sample;
  const void *residual;   /* [m, n] in y's dtype, rows ldr apart (may be y) */
  int64_t ldr;
};

/* x in pieces of bf16 whose sum is x: truncating to bf16 leaves a remainder
 * that is exact in f32 and has 8 fewer significant bits, so 3 pieces hold an
 * f32 (and 2 an f16, whose third piece is 0). Inf and NaN go whole into the
 * first piece. */
__device__ __forceinline__ void split_bf16(float f, uint32_t (&piece)[3]) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7f800000u) == 0x7f800000u) {
    piece[0] = (u & 0x007fffffu) ? ((u >> 16) | 0x0040u) : (u >> 16);
    piece[1] = piece[2] = 0u;
    return;
  }
  float rem = f;
#pragma unroll
  for (int p = 0; p < 3; ++p) {
    const uint32_t head = __float_as_uint(rem) & 0xffff0000u;
    piece[p] = head >> 16;
    rem = __fsub_rn(rem, __uint_as_float(head));
  }
}

/* B fragments (one per piece) of x values f[0..3]: b[p][0] = f[0], f[1] and
 * b[p][1] = f[2], f[3], the first of each pair in the low half. */
template <int XM>
__device__ __forceinline__ void b_from_floats(const float (&f)[4], uint32_t (&b)[XTraits<XM>::kPieces][2]) {
  uint32_t pc[4][3];
#pragma unroll
  for (int i = 0; i < 4; ++i) split_bf16(f[i], pc[i]);
#pragma unroll
  for (int p = 0; p < XTraits<XM>::kPieces; ++p)
    b[p][0] = pc[0][p] | (pc[1][p] << 16), b[p][1] = pc[2][p] | (pc[3][p] << 16);
}


/* x[k] of a row as f32 (k relative to the row pointer); 0 when !ok. */
__device__ __forceinline__ float x_float(const void *xrow, int64_t k, bool ok, bool x_f32) {
  if (!ok) return 0.0f;
  return x_f32 ? __ldg(static_cast<const float *>(xrow) + k)
               : cq_f16_to_f32(__ldg(static_cast<const unsigned short *>(xrow) + k));
}

/* N 16-bit x values from k (two per word, lower k in the low half): 16-byte
 * loads, kept in L1 (every CTA reads all of x), when FAST (k .. k+N-1 in range
 * and 16-byte aligned), else element loads of the first `rem` values and
 * zeros after them. Zeros for a padding row (xrow NULL). */
template <int N, bool FAST>
__device__ __forceinline__ void load_x16(const void *xrow, int64_t k, int rem, uint32_t (&xr)[N / 2]) {
  const unsigned short *xs = static_cast<const unsigned short *>(xrow);
  if (FAST) {
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
      const uint4 v = cq_load_stream16<true>(xs + k + 8 * i, xs != nullptr);
      xr[4 * i] = v.x, xr[4 * i + 1] = v.y, xr[4 * i + 2] = v.z, xr[4 * i + 3] = v.w;
    }
    return;
  }
  if (!xs) rem = 0;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const uint32_t lo = 2 * i < rem ? __ldg(xs + k + 2 * i) : 0u;
    const uint32_t hi = 2 * i + 1 < rem ? __ldg(xs + k + 2 * i + 1) : 0u;
    xr[i] = lo | (hi << 16);
  }
}

/* Which rows of x a unit is multiplied with: rows 0-7, rows 0-15, or either
 * (decided at run time; the element-wise path, which is not worth two copies). */
enum XRows { kRows8 = 0, kRows16 = 1, kRowsAny = 2 };

__device__ __forceinline__ bool uses_rows16(int xrows, bool two) { return xrows == kRows16 || (xrows == kRowsAny && two); }

/* One k-tile: A (16 rows x 16 k) against x rows 0-7 and, when two, 8-15. The
 * third piece of a split x is zero unless x is f32. */
template <int XM>
__device__ __forceinline__ void mma_tile(const uint32_t (&a)[4], const uint32_t (&b)[2][XTraits<XM>::kPieces][2],
                                         bool two, bool third, float (&acc)[2][4]) {
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
    if (nb == 0 || two)
#pragma unroll
      for (int p = 0; p < XTraits<XM>::kPieces; ++p)
        if (p < 2 || third) cq_mma_16816_f32<XTraits<XM>::kBf16>(acc[nb], a, b[nb][p][0], b[nb][p][1]);
}

/* Per-lane state of the GEMV: the x rows of B (NULL for padding rows), K. */
struct GemvLane {
  const void *xrow[2];
  int64_t kmax;
  bool two, third, x_f32;
};

/* One unit of rows g and g+8 (words w0, w1) against x[k0 .. k0 + codes).
 * FAST: x[k0 ..] is in range and 16-byte aligned; else x[k0 + i] is read for
 * i < xrem only. XROWS: an XRows. */
template <class Codec, int XM, bool FAST, int XROWS>
__device__ __forceinline__ void mma_unit(const uint32_t (&w0)[WoUnit<Codec::kBits>::kWords],
                                         const uint32_t (&w1)[WoUnit<Codec::kBits>::kWords], const GemvLane &L,
                                         const typename Codec::Consts &cc, int64_t k0, int xrem,
                                         float (&acc)[2][4]) {
  using U = WoUnit<Codec::kBits>;
  constexpr int P = Codec::kPair, kPieces = XTraits<XM>::kPieces;
  constexpr bool kBf16 = XTraits<XM>::kBf16;
  constexpr int kXBlock = 8; /* codes whose x one 16-byte load covers */
  static_assert(2 * P <= kXBlock, "a pair's codes lie in one block of x");
  constexpr int kTiles = kXBlock / 4;
  const bool two = uses_rows16(XROWS, L.two);
#pragma unroll
  for (int xb = 0; xb < U::kCodes / kXBlock; ++xb) {
    const int base = xb * kXBlock;
    uint32_t xr[2][kXBlock / 2];
    if constexpr (XM != kXSplit) {
#pragma unroll
      for (int nb = 0; nb < 2; ++nb)
        if (nb == 0 || two) load_x16<kXBlock, FAST>(L.xrow[nb], k0 + base, xrem - base, xr[nb]);
    }
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
      const int v = xb * kTiles + t;
      const int ka = WoTile<P>::k0(v), kc = WoTile<P>::k2(v);
      uint32_t a[4];
      a[0] = Codec::template pair<kBf16>(w0, ka, ka + P, cc); /* row g,   k-slots 2c, 2c+1 */
      a[1] = Codec::template pair<kBf16>(w1, ka, ka + P, cc); /* row g+8, k-slots 2c, 2c+1 */
      a[2] = Codec::template pair<kBf16>(w0, kc, kc + P, cc); /* row g,   k-slots 2c+8, 2c+9 */
      a[3] = Codec::template pair<kBf16>(w1, kc, kc + P, cc); /* row g+8, k-slots 2c+8, 2c+9 */
      uint32_t b[2][kPieces][2];
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) {
        if (nb == 1 && !two) continue;
        if constexpr (XM != kXSplit) {
          b[nb][0][0] = wo_pick2(xr[nb], ka - base, ka + P - base);
          b[nb][0][1] = wo_pick2(xr[nb], kc - base, kc + P - base);
        } else {
          const void *xr_nb = L.xrow[nb];
          const float f[4] = {x_float(xr_nb, k0 + ka, xr_nb && ka < xrem, L.x_f32),
                              x_float(xr_nb, k0 + ka + P, xr_nb && ka + P < xrem, L.x_f32),
                              x_float(xr_nb, k0 + kc, xr_nb && kc < xrem, L.x_f32),
                              x_float(xr_nb, k0 + kc + P, xr_nb && kc + P < xrem, L.x_f32)};
          b_from_floats<XM>(f, b[nb]);
        }
      }
      mma_tile<XM>(a, b, two, L.third, acc);
    }
    /* keep the scheduler from hoisting the x loads (and their registers) of
     * the whole unit to its start */
    if (xb % 2 == 1) asm volatile("" ::: "memory");
  }
}

template <typename T>
__device__ __forceinline__ float bias_at(const void *bias, int bias_f32, int64_t n) {
  return bias_f32 ? static_cast<const float *>(bias)[n] : cq_to_float(static_cast<const T *>(bias)[n]);
}

/* Units a lane loads per row and step: two of the 16-byte ones, one of the
 * longer (48-112 bytes). */
template <int BITS>
struct GemvStep {
  static constexpr int kUnits = WoUnit<BITS>::kBytes == 16 ? 2 : 1;
};

template <class Codec>
using StepBuf = uint32_t[GemvStep<Codec::kBits>::kUnits][2][WoUnit<Codec::kBits>::kWords];

/* Request the units of the step starting at the warp's quad q. */
template <class Codec>
__device__ __forceinline__ void gemv_load(StepBuf<Codec> &buf, const GemvWoArgs &a, const uint8_t *row0,
                                          const uint8_t *row1, int c, int q) {
#pragma unroll
  for (int i = 0; i < GemvStep<Codec::kBits>::kUnits; ++i) {
    const int qi = q + i * a.kw;
    if (qi < a.quads) {
      cq_load_unit<Codec::kBits>(row0, 4 * (int64_t)qi + c, a.row_bytes, a.w_vec != 0, buf[i][0]);
      cq_load_unit<Codec::kBits>(row1, 4 * (int64_t)qi + c, a.row_bytes, a.w_vec != 0, buf[i][1]);
    }
  }
}

/* Quad qi of rows g and g+8 (lane unit 4 qi + c, words w0 and w1) into acc:
 * e4m3 NaN codes are marked, then the unit is multiplied with x. */
template <class Codec, int XM>
__device__ __forceinline__ void gemv_unit(const uint32_t (&w0)[WoUnit<Codec::kBits>::kWords],
                                          const uint32_t (&w1)[WoUnit<Codec::kBits>::kWords], const GemvWoArgs &a,
                                          const GemvLane &L, const typename Codec::Consts &cc, int c, int qi,
                                          float (&acc)[2][4], uint32_t (&nan_marks)[2]) {
  using U = WoUnit<Codec::kBits>;
  if (Codec::kNanCodes) {
#pragma unroll
    for (int j = 0; j < U::kWords; ++j) nan_marks[0] |= wo_e4m3_nan_marks(w0[j]), nan_marks[1] |= wo_e4m3_nan_marks(w1[j]);
  }
  const int64_t k0 = (4 * (int64_t)qi + c) * U::kCodes;
  /* warp-uniform branches; split x is read element by element anyway */
  if (XM != kXSplit && qi < a.fast_quads) {
    if (L.two)
      mma_unit<Codec, XM, true, kRows16>(w0, w1, L, cc, k0, U::kCodes, acc);
    else
      mma_unit<Codec, XM, true, kRows8>(w0, w1, L, cc, k0, U::kCodes, acc);
  } else {
    const int64_t rem = L.kmax - k0;
    const int xrem = (int)(rem < 0 ? 0 : rem > U::kCodes ? U::kCodes : rem);
    mma_unit<Codec, XM, false, kRowsAny>(w0, w1, L, cc, k0, xrem, acc);
  }
}

template <class Codec, int XM>
__device__ __forceinline__ void gemv_compute(const StepBuf<Codec> &buf, const GemvWoArgs &a, const GemvLane &L,
                                             const typename Codec::Consts &cc, int c, int q,
                                             float (&acc)[2][4], uint32_t (&nan_marks)[2]) {
#pragma unroll
  for (int i = 0; i < GemvStep<Codec::kBits>::kUnits; ++i) {
    const int qi = q + i * a.kw;
    if (qi >= a.quads) continue; /* warp-uniform: mma needs the whole warp */
    gemv_unit<Codec, XM>(buf[i][0], buf[i][1], a, L, cc, c, qi, acc, nan_marks);
  }
}

/* The lane's x rows (padding rows NULL), K and x mode. */
__device__ __forceinline__ GemvLane gemv_lane(const GemvWoArgs &a, int g) {
  const size_t xsize = a.x_dtype == CQ_DTYPE_F32 ? 4 : 2;
  GemvLane L;
#pragma unroll
  for (int nb = 0; nb < 2; ++nb) {
    const int m = g + 8 * nb;
    L.xrow[nb] = m < a.m ? static_cast<const char *>(a.x) + (size_t)m * a.k * xsize : nullptr;
  }
  L.kmax = a.k;
  L.two = a.m > 8, L.x_f32 = a.x_dtype == CQ_DTYPE_F32, L.third = L.x_f32;
  return L;
}

/* y[m, n] = act(sum * sw + b) (sum already NaN for a row holding a NaN code), left to right, no
 * contraction, the activation in fp32, for a gated layer residual + gate * that, then rounded once
 * to y's dtype (cquant.h). */
template <typename T>
__device__ __forceinline__ void gemv_store_as(const GemvWoArgs &a, int64_t m, int64_t n, float sum) {
  const float sw = a.w_scale[a.scale_per_row ? n : 0];
  const float b = a.bias ? bias_at<T>(a.bias, a.bias_f32, n) : 0.0f;
  float v = cq_activate(__fadd_rn(__fmul_rn(sum, sw), b), a.activation);
  if (a.gate)
    v = cq_gate_residual(v, cq_load_any(a.gate, a.gate_dtype, (m / a.rows_per_sample) * a.ldg + n),
                         cq_to_float(static_cast<const T *>(a.residual)[m * a.ldr + n]));
  store_out(static_cast<T *>(a.y), m * a.ldy + n, v);
}

__device__ __forceinline__ void gemv_store(const GemvWoArgs &a, int64_t m, int64_t n, float sum) {
  switch (a.x_dtype) {
    case CQ_DTYPE_BF16: gemv_store_as<__nv_bfloat16>(a, m, n, sum); break;
    case CQ_DTYPE_F16: gemv_store_as<__half>(a, m, n, sum); break;
    default: gemv_store_as<float>(a, m, n, sum); break;
  }
}

typedef cq_status (*GemvLauncher)(const GemvWoArgs &, unsigned, cudaStream_t);

/* Launch the per-tile kernel (gemv_wo_tile_*.cu) or the persistent one (gemv_wo_persistent.cu)
 * of decoder `codec` and x mode `xmode`: `grid` CTAs, a.kw warps splitting K (and, persistent,
 * a.groups groups of them per CTA). */
cq_status gemv_tile_launch_8bit(int codec, int xmode, const GemvWoArgs &a, unsigned grid, cudaStream_t s);
cq_status gemv_tile_launch_fp46(int codec, int xmode, const GemvWoArgs &a, unsigned grid, cudaStream_t s);
cq_status gemv_tile_launch_fp357(int codec, int xmode, const GemvWoArgs &a, unsigned grid, cudaStream_t s);
inline cq_status gemv_tile_launch(int codec, int xmode, const GemvWoArgs &a, unsigned grid, cudaStream_t s) {
  if (codec < kCodecFp3) return gemv_tile_launch_8bit(codec, xmode, a, grid, s);
  if (codec == kCodecFp4 || codec == kCodecFp6) return gemv_tile_launch_fp46(codec, xmode, a, grid, s);
  return gemv_tile_launch_fp357(codec, xmode, a, grid, s);
}
cq_status gemv_persistent_launch(int codec, int xmode, const GemvWoArgs &a, unsigned grid, cudaStream_t s);
/* Whether the persistent kernel is built for a decoder and x mode (bf16 / f16 x, not fp4). */
bool gemv_persistent_built(int codec, int xmode);
/* Shared memory of the persistent kernel for `bits`-bit codes, `warps` warps, kw per group. */
size_t gemv_persistent_smem(int bits, int warps, int kw);
/* The decoder of a format (CQ_ERR_UNSUPPORTED for one the kernels have none for). */
cq_status codec_of(const cq_format_info *f, const char *op, int *codec);

}  // namespace cq_wo

#endif /* CQ_KERNELS_GEMV_WO_CUH */
