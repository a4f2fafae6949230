/* Weight-only quantized linear layer for small batches (M <= 16), and the
 * decoding of stored weight rows into f16/bf16 for the large-batch path.
 *
 * GEMV. The stored weight is read once, at memory speed, and decoded on the
 * fly into the A operand of mma.m16n8k16 (f32 accumulation); x^T is the B
 * operand, M padded to 8 or 16. Decoding takes a few integer and half2
 * instructions per pair of codes and no tables (wo_decode.cuh). A CTA owns 16
 * weight rows and its warps split K. Lane (g, c) = (lane / 4, lane % 4)
 * decodes rows g and g + 8, unit 4q + c of each (wo_unit.cuh), so the 4 lanes
 * of a group read neighbouring units. A unit's codes enter the k-tiles in the
 * pairing its decoder makes cheapest (WoTile); x is loaded 16 bytes at a time
 * and permuted to match, since mma only needs A and B to agree on the order of
 * k. The units of the next step are requested before the current ones are
 * decoded (two register buffers), so every lane keeps 64-112 bytes (two rows)
 * in flight.
 *
 * Decoded values are exact in the mma type, so every product is exact. x in
 * bf16 (f16) is used as it is; x in f32 (or f16 with a format that f16 cannot
 * hold) is split into bf16 pieces whose sum is x exactly (3 for f32, 2 for
 * f16), one mma per piece. The partial sums of the warps meet in shared memory
 * and are added in a fixed order (deterministic), then scale and bias. Rows
 * holding an e4m3 NaN code come out NaN, as in the reference.
 *
 * Dequantize rows: one thread per octet (8 codes) with the same decoders, the
 * product with the scale in f32 rounded once to f16/bf16, 16-byte stores of
 * consecutive octets. Octets holding fp8 inf/NaN codes, rows with a
 * non-finite scale and row tails take an element-wise path that stores the
 * reference's NaN bits. */
#include <atomic>
#include <cstdlib>

#include "wo_unit.cuh"

namespace {

constexpr int kGemvWarps = 8;
constexpr int kGemvThreads = 32 * kGemvWarps;
constexpr int kDequantThreads = 128;
constexpr int kDequantOctets = 3; /* octets per thread: a CTA covers 3072 codes of a row */

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
  void *y;                /* [m, n], x dtype */
  int64_t m, n, k, row_bytes;
  int quads;              /* groups of 4 units per row */
  int fast_quads;         /* leading quads whose x loads need no bounds checks (16-bit x, aligned) */
  cq_format_params fmt;
  cq_dtype x_dtype;
  int scale_per_row, bias_f32, w_vec;
  int kw;                 /* warps splitting K (per-tile kernel: blockDim.x = 32 kw; persistent: per group) */
  int groups;             /* persistent kernel: warp groups per CTA, each with its own row tiles */
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

template <bool BF16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (BF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
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
        if (p < 2 || third) mma_16816<XTraits<XM>::kBf16>(acc[nb], a, b[nb][p][0], b[nb][p][1]);
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

/* y[m, n] = sum * sw + b (sum already NaN for a row holding a NaN code), left
 * to right, no contraction, rounded once to y's dtype. */
__device__ __forceinline__ void gemv_store(const GemvWoArgs &a, int64_t m, int64_t n, float sum) {
  const float sw = a.w_scale[a.scale_per_row ? n : 0];
  const int64_t at = m * a.n + n;
  switch (a.x_dtype) {
    case CQ_DTYPE_BF16: {
      const float b = a.bias ? bias_at<__nv_bfloat16>(a.bias, a.bias_f32, n) : 0.0f;
      store_out(static_cast<__nv_bfloat16 *>(a.y), at, __fadd_rn(__fmul_rn(sum, sw), b));
      break;
    }
    case CQ_DTYPE_F16: {
      const float b = a.bias ? bias_at<__half>(a.bias, a.bias_f32, n) : 0.0f;
      store_out(static_cast<__half *>(a.y), at, __fadd_rn(__fmul_rn(sum, sw), b));
      break;
    }
    default: {
      const float b = a.bias ? bias_at<float>(a.bias, a.bias_f32, n) : 0.0f;
      store_out(static_cast<float *>(a.y), at, __fadd_rn(__fmul_rn(sum, sw), b));
      break;
    }
  }
}

template <class Codec, int XM>
__global__ void __launch_bounds__(kGemvThreads, 2) gemv_wo_kernel(const GemvWoArgs a) {
  constexpr int kPerWarp = 8 * 32; /* two 16x8 accumulator tiles */
  __shared__ float partial[kGemvWarps * kPerWarp];
  __shared__ uint32_t nan_rows[kGemvWarps * 16];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int64_t n0 = (int64_t)blockIdx.x * 16 + g;
  const uint8_t *row0 = n0 < a.n ? a.w + n0 * a.row_bytes : nullptr;
  const uint8_t *row1 = n0 + 8 < a.n ? a.w + (n0 + 8) * a.row_bytes : nullptr;
  const GemvLane L = gemv_lane(a, g);
  const typename Codec::Consts cc(a.fmt.ebits, a.fmt.bias, XTraits<XM>::kBf16);
  float acc[2][4];
#pragma unroll
  for (int nb = 0; nb < 2; ++nb) acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.0f;
  uint32_t nan_marks[2] = {0u, 0u};

  /* Warp `warp` takes quads warp, warp + kw, ...; kw <= quads, so every warp
   * has one. Two buffers: the next step's units are in flight while this
   * step's are decoded. */
  StepBuf<Codec> wa, wb;
  const int step = GemvStep<Codec::kBits>::kUnits * a.kw;
  int q = warp;
  gemv_load<Codec>(wa, a, row0, row1, c, q);
  for (;;) {
    gemv_load<Codec>(wb, a, row0, row1, c, q + step);
    gemv_compute<Codec, XM>(wa, a, L, cc, c, q, acc, nan_marks);
    q += step;
    if (q >= a.quads) break;
    gemv_load<Codec>(wa, a, row0, row1, c, q + step);
    gemv_compute<Codec, XM>(wb, a, L, cc, c, q, acc, nan_marks);
    q += step;
    if (q >= a.quads) break;
  }

  /* Partial sums of the warps that split K meet here, in a fixed order. */
  float *mine = partial + warp * kPerWarp;
#pragma unroll
  for (int j = 0; j < 8; ++j) mine[j * 32 + lane] = acc[j >> 2][j & 3];
  if (Codec::kNanCodes) {
    uint32_t m0 = nan_marks[0] & 0x80808080u, m1 = nan_marks[1] & 0x80808080u;
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
      m0 |= __shfl_xor_sync(0xffffffffu, m0, o);
      m1 |= __shfl_xor_sync(0xffffffffu, m1, o);
    }
    if (c == 0) nan_rows[warp * 16 + g] = m0, nan_rows[warp * 16 + g + 8] = m1;
  }
  __syncthreads();
  for (int v = threadIdx.x; v < kPerWarp; v += blockDim.x) {
    const int j = v / 32, ln = v & 31;
    /* accumulator element i of tile nb, lane ln: row g (+8 for i >= 2), x row 8nb + 2c + (i & 1) */
    const int nb = j >> 2, i = j & 3;
    const int r16 = (ln >> 2) + ((i & 2) ? 8 : 0);
    const int64_t n = (int64_t)blockIdx.x * 16 + r16;
    const int64_t m = 8 * nb + 2 * (ln & 3) + (i & 1);
    if (n >= a.n || m >= a.m) continue;
    float sum = 0.0f;
    for (int s = 0; s < a.kw; ++s) sum += partial[s * kPerWarp + j * 32 + ln];
    if (Codec::kNanCodes) {
      uint32_t any = 0;
      for (int s = 0; s < a.kw; ++s) any |= nan_rows[s * 16 + r16];
      if (any) sum = __uint_as_float(0x7fc00000u); /* decode(NaN code) * x is NaN for every x */
    }
    gemv_store(a, m, n, sum);
  }
}

template <class Codec, int XM>
cq_status launch_gemv(const GemvWoArgs &a, unsigned grid, cudaStream_t s) {
  gemv_wo_kernel<Codec, XM><<<grid, 32 * a.kw, 0, s>>>(a);
  CQ_LAUNCH_CHECK(gemv_wo_kernel);
  return CQ_OK;
}

/* ---------------------------------------------------------------- persistent GEMV */

/* One CTA per SM runs until the weight is read. Its warps form groups of kw
 * warps (kw = min(16, quads)); a group owns row tiles gid, gid + groups, ...
 * and walks the (tile, quad) items of its tiles in order, warp w of the group
 * taking items w, w + kw, ... (kw <= quads, so every warp has an item in every
 * tile and the quads of a tile differ by at most one between warps). A warp
 * copies each item -- 16 rows x one quad, 64-224 contiguous bytes a row --
 * into its own shared-memory ring with 16-byte cp.async, kStages - 1 items
 * ahead of the one it decodes, across tile boundaries: the loads hold no
 * registers and keep streaming through the per-tile reduction. A tile's
 * partial sums meet in shared memory (double buffered, one group barrier a
 * tile) and are added in warp order, as in the per-tile kernel. */
constexpr int kStreamWarps = 16;
constexpr int kStreamThreads = 32 * kStreamWarps;
constexpr int kStreamLaneBytes = 128; /* weight bytes a lane keeps in flight, at least */
constexpr int kStreamPerWarp = 8 * 32; /* accumulator floats of a warp */

template <int BITS>
struct StreamItem {
  using U = WoUnit<BITS>;
  static constexpr int kSegBytes = 4 * U::kBytes;      /* one row's bytes of an item */
  static constexpr int kSegVecs = kSegBytes / 16;
  static constexpr int kBytes = 16 * kSegBytes;        /* a ring slot: 16 rows, kSegBytes apart */
  static constexpr int kVecsPerLane = kBytes / 16 / 32;
  static constexpr int kStages = 1 + (kStreamLaneBytes + 2 * U::kBytes - 1) / (2 * U::kBytes);
  static_assert(kSegBytes % 16 == 0 && kVecsPerLane * 32 * 16 == kBytes, "items are whole 16-byte vectors per lane");
};

/* Shared memory of the persistent kernel: the rings, then (kw > 1) the
 * partial sums and NaN marks, two buffers each. */
template <int BITS>
constexpr size_t stream_smem_bytes(int warps, int kw) {
  return (size_t)warps * StreamItem<BITS>::kStages * StreamItem<BITS>::kBytes +
         (kw > 1 ? (size_t)2 * warps * (kStreamPerWarp + 16) * 4 : 0);
}

/* 16 bytes global -> shared, bypassing L1 (x lives there); zeros when !ok. */
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, bool ok) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* Unit c of slot row `row` (see StreamItem) as words. The rows of a slot are
 * 4 units apart: 64 or 192 bytes (even widths, 16-byte reads by quarter warps)
 * and 32 * BITS bytes (odd widths, 8-byte reads by half warps) put the lanes
 * of one read on distinct banks. */
template <int BITS>
__device__ __forceinline__ void ring_unit(const unsigned char *slot, int row, int c,
                                          uint32_t (&w)[WoUnit<BITS>::kWords]) {
  using U = WoUnit<BITS>;
  const unsigned char *p = slot + row * (4 * U::kBytes) + c * U::kBytes;
#pragma unroll
  for (int v = 0; v < U::kVecs; ++v) {
    if (U::kVecBytes == 16) {
      const uint4 q = *reinterpret_cast<const uint4 *>(p + 16 * v);
      w[4 * v] = q.x, w[4 * v + 1] = q.y, w[4 * v + 2] = q.z, w[4 * v + 3] = q.w;
    } else {
      const uint2 q = *reinterpret_cast<const uint2 *>(p + 8 * v);
      w[2 * v] = q.x, w[2 * v + 1] = q.y;
    }
  }
}

template <class Codec, int XM>
__global__ void __launch_bounds__(kStreamThreads, 1) gemv_wo_stream_kernel(const GemvWoArgs a) {
  using U = WoUnit<Codec::kBits>;
  using I = StreamItem<Codec::kBits>;
  constexpr int S = I::kStages;
  extern __shared__ __align__(16) unsigned char gemv_smem[];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int kw = a.kw, grp = warp / kw, wg = warp - grp * kw;
  const int64_t ngroups = (int64_t)gridDim.x * a.groups, gid = (int64_t)blockIdx.x * a.groups + grp;
  const int64_t tiles = (a.n + 15) / 16;
  const int64_t my_tiles = gid < tiles ? (tiles - 1 - gid) / ngroups + 1 : 0;
  const int64_t group_items = my_tiles * a.quads;
  const int64_t my_items = group_items > wg ? (group_items - 1 - wg) / kw + 1 : 0;

  unsigned char *ring = gemv_smem + (size_t)warp * S * I::kBytes;
  const uint32_t ring_s = (uint32_t)__cvta_generic_to_shared(ring);
  float *partial = reinterpret_cast<float *>(gemv_smem + (size_t)warps * S * I::kBytes); /* [2][warps][256] */
  uint32_t *nan_rows = reinterpret_cast<uint32_t *>(partial + 2 * warps * kStreamPerWarp); /* [2][warps][16] */

  const GemvLane L = gemv_lane(a, g);
  const typename Codec::Consts cc(a.fmt.ebits, a.fmt.bias, XTraits<XM>::kBf16);
  float acc[2][4];
#pragma unroll
  for (int nb = 0; nb < 2; ++nb) acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.0f;
  uint32_t nan_marks[2] = {0u, 0u};

  /* the next item of this warp: tile j of the group, quad seg */
  auto advance = [&](int64_t &j, int &seg) {
    seg += kw;
    if (seg >= a.quads) seg -= a.quads, ++j;
  };
  /* copy item (j, seg) into ring slot `slot`; an empty group when !valid keeps the count */
  auto issue = [&](int slot, bool valid, int64_t j, int seg) {
    if (valid) {
      const int64_t n0 = (gid + j * ngroups) * 16;
      const int64_t seg0 = (int64_t)seg * I::kSegBytes;
#pragma unroll
      for (int v = 0; v < I::kVecsPerLane; ++v) {
        const int vi = lane + 32 * v;
        const int r = vi / I::kSegVecs, col = vi - r * I::kSegVecs;
        const int64_t row = n0 + r, off = seg0 + 16 * col;
        const bool ok = row < a.n && off < a.row_bytes;
        cp_async16(ring_s + (uint32_t)(slot * I::kBytes + 16 * vi), ok ? a.w + row * a.row_bytes + off : a.w, ok);
      }
    }
    cp_async_commit();
  };
  /* tile j of the group is complete in every warp: add the warps' sums in order and store */
  auto flush = [&](int64_t j) {
    const int64_t n0 = (gid + j * ngroups) * 16;
    uint32_t m0 = 0u, m1 = 0u;
    if (Codec::kNanCodes) {
      m0 = nan_marks[0] & 0x80808080u, m1 = nan_marks[1] & 0x80808080u;
#pragma unroll
      for (int o = 1; o < 4; o <<= 1) {
        m0 |= __shfl_xor_sync(0xffffffffu, m0, o);
        m1 |= __shfl_xor_sync(0xffffffffu, m1, o);
      }
    }
    if (kw == 1) {
      /* accumulator element i of tile nb: row g (+8 for i >= 2), x row 8nb + 2c + (i & 1) */
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int nb = e >> 2, i = e & 3;
        const int64_t n = n0 + g + ((i & 2) ? 8 : 0), m = 8 * nb + 2 * c + (i & 1);
        if (n >= a.n || m >= a.m) continue;
        float sum = 0.0f + acc[nb][i];
        if (Codec::kNanCodes && ((i & 2) ? m1 : m0)) sum = __uint_as_float(0x7fc00000u);
        gemv_store(a, m, n, sum);
      }
    } else {
      const int buf = (int)(j & 1);
      float *mine = partial + ((size_t)buf * warps + warp) * kStreamPerWarp;
#pragma unroll
      for (int e = 0; e < 8; ++e) mine[e * 32 + lane] = acc[e >> 2][e & 3];
      if (Codec::kNanCodes && c == 0)
        nan_rows[(buf * warps + warp) * 16 + g] = m0, nan_rows[(buf * warps + warp) * 16 + g + 8] = m1;
      /* the group's warps only (barrier 0 is __syncthreads) */
      asm volatile("bar.sync %0, %1;" ::"r"(1 + grp), "r"(32 * kw) : "memory");
      const float *part0 = partial + ((size_t)buf * warps + grp * kw) * kStreamPerWarp;
      const uint32_t *nan0 = nan_rows + (buf * warps + grp * kw) * 16;
      const int entries = L.two ? kStreamPerWarp : kStreamPerWarp / 2;
      for (int v = wg * 32 + lane; v < entries; v += 32 * kw) {
        const int e = v >> 5, ln = v & 31, nb = e >> 2, i = e & 3;
        const int r16 = (ln >> 2) + ((i & 2) ? 8 : 0);
        const int64_t n = n0 + r16, m = 8 * nb + 2 * (ln & 3) + (i & 1);
        if (n >= a.n || m >= a.m) continue;
        float sum = 0.0f;
#pragma unroll
        for (int s = 0; s < kStreamWarps; ++s)
          if (s < kw) sum += part0[s * kStreamPerWarp + v];
        if (Codec::kNanCodes) {
          uint32_t any = 0u;
#pragma unroll
          for (int s = 0; s < kStreamWarps; ++s)
            if (s < kw) any |= nan0[s * 16 + r16];
          if (any) sum = __uint_as_float(0x7fc00000u); /* decode(NaN code) * x is NaN for every x */
        }
        gemv_store(a, m, n, sum);
      }
    }
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.0f;
    nan_marks[0] = nan_marks[1] = 0u;
  };

  int64_t ld_i = 0, ld_j = 0;
  int ld_seg = wg;
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    issue(s, ld_i < my_items, ld_j, ld_seg);
    advance(ld_j, ld_seg), ++ld_i;
  }
  int64_t cj = 0;
  int cseg = wg, slot = 0;
  for (int64_t i = 0; i < my_items; ++i) {
    cp_async_wait<S - 2>(); /* this lane's copies of item i have landed */
    __syncwarp();           /* ... and every lane's; the slot refilled below was read by all */
    uint32_t w0[U::kWords], w1[U::kWords];
    ring_unit<Codec::kBits>(ring + slot * I::kBytes, g, c, w0);
    ring_unit<Codec::kBits>(ring + slot * I::kBytes, g + 8, c, w1);
    issue(slot == 0 ? S - 1 : slot - 1, ld_i < my_items, ld_j, ld_seg);
    advance(ld_j, ld_seg), ++ld_i;
    gemv_unit<Codec, XM>(w0, w1, a, L, cc, c, cseg, acc, nan_marks);
    int64_t nj = cj;
    advance(nj, cseg);
    const int64_t next_tile = i + 1 < my_items ? nj : my_tiles;
    while (cj < next_tile) flush(cj++);
    slot = slot + 1 == S ? 0 : slot + 1;
  }
  while (cj < my_tiles) flush(cj++); /* (no warp gets here with tiles left: each has an item in every tile) */
  cp_async_wait<0>();
}

template <class Codec, int XM>
cq_status launch_gemv_stream(const GemvWoArgs &a, unsigned grid, cudaStream_t s) {
  const int warps = a.kw * a.groups;
  const size_t smem = stream_smem_bytes<Codec::kBits>(warps, a.kw);
  auto kernel = gemv_wo_stream_kernel<Codec, XM>;
  CQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  kernel<<<grid, 32 * warps, smem, s>>>(a);
  CQ_LAUNCH_CHECK(gemv_wo_stream_kernel);
  return CQ_OK;
}

typedef cq_status (*GemvLauncher)(const GemvWoArgs &, unsigned, cudaStream_t);

/* The compile-time specialisations: [decoder][x mode]. The M tile (8 or 16
 * rows of x) is a run-time branch: it changes no register layout. */
#define CQ_GEMV_CODEC(C, L) { L<C, kXBf16>, L<C, kXF16>, L<C, kXSplit> }
#define CQ_GEMV_TABLE(L)                                                                                    \
  {                                                                                                         \
    CQ_GEMV_CODEC(CodecInt8, L), CQ_GEMV_CODEC(CodecE4M3, L), CQ_GEMV_CODEC(CodecE5M2, L),                  \
        CQ_GEMV_CODEC(CodecFp3, L), CQ_GEMV_CODEC(CodecFp4, L), CQ_GEMV_CODEC(CodecFp5, L),                 \
        CQ_GEMV_CODEC(CodecFp6, L), CQ_GEMV_CODEC(CodecFp7, L),                                             \
  }
const GemvLauncher kGemvLaunchers[kCodecs][kXModes] = CQ_GEMV_TABLE(launch_gemv);
const GemvLauncher kGemvStreamLaunchers[kCodecs][kXModes] = CQ_GEMV_TABLE(launch_gemv_stream);
#undef CQ_GEMV_TABLE
#undef CQ_GEMV_CODEC


/* ---------------------------------------------------------------- dequantize rows */

struct DequantRowsArgs {
  const uint8_t *w;      /* stored rows, row_bytes each */
  const float *scale;    /* per row (indexed by stored row) or 1 */
  uint16_t *out;         /* [rows, k] f16/bf16 bits */
  int64_t row0, rows, k, row_bytes, octets;
  cq_format_params fmt;
  int scale_per_row, w_vec8, out_vec;
};

template <class Codec, bool BF16>
__device__ __forceinline__ void dequant_octet(const DequantRowsArgs &a, const typename Codec::Consts &cc,
                                              const uint32_t (&w)[2], int64_t o, float s, bool s_finite,
                                              uint16_t *out) {
  const int64_t k0 = 8 * o;
  /* fp8 NaN codes give NaNs whose bits the fast path does not set, and e5m2
   * infinities NaNs when the scale is 0 */
  bool fast = s_finite && a.out_vec && k0 + 8 <= a.k;
  if (Codec::kNanCodes) fast = fast && ((wo_e4m3_nan_marks(w[0]) | wo_e4m3_nan_marks(w[1])) & 0x80808080u) == 0;
  if (Codec::kInfNanCodes)
    fast = fast && ((wo_e5m2_special_marks(w[0]) | wo_e5m2_special_marks(w[1])) & 0x80808080u) == 0;
  if (fast) {
    float v[8];
    Codec::values8(w, cc, v);
    uint32_t h[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float lo = __fmul_rn(v[2 * i], s), hi = __fmul_rn(v[2 * i + 1], s);
      if (BF16) {
        const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
        h[i] = *reinterpret_cast<const uint32_t *>(&p);
      } else {
        const __half2 p = __floats2half2_rn(lo, hi);
        h[i] = *reinterpret_cast<const uint32_t *>(&p);
      }
    }
    *reinterpret_cast<uint4 *>(out + k0) = make_uint4(h[0], h[1], h[2], h[3]);
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (k0 + j < a.k) out[k0 + j] = store_bits<BF16>(cq_decode(a.fmt, cq_unit_field(w, j * Codec::kBits, Codec::kBits)) * s);
}

template <class Codec, bool BF16>
__global__ void __launch_bounds__(kDequantThreads) dequant_rows_kernel(const DequantRowsArgs a) {
  const typename Codec::Consts cc(a.fmt.ebits, a.fmt.bias, true); /* values8 decodes into bf16 (or f16 for e5m2) */
  for (int64_t r = blockIdx.y; r < a.rows; r += gridDim.y) {
    const int64_t stored = a.row0 + r;
    const uint8_t *row = a.w + stored * a.row_bytes;
    const float s = a.scale[a.scale_per_row ? stored : 0];
    uint16_t *out = a.out + r * a.k;
    /* every load of the row first, then the decoding and stores */
    uint32_t w[kDequantOctets][2];
    int64_t o[kDequantOctets];
#pragma unroll
    for (int i = 0; i < kDequantOctets; ++i) {
      o[i] = ((int64_t)blockIdx.x * kDequantOctets + i) * kDequantThreads + threadIdx.x;
      if (o[i] < a.octets) cq_load_octet<Codec::kBits>(row, o[i], a.row_bytes, a.w_vec8 != 0, w[i]);
    }
#pragma unroll
    for (int i = 0; i < kDequantOctets; ++i)
      if (o[i] < a.octets) dequant_octet<Codec, BF16>(a, cc, w[i], o[i], s, cq_isfinite(s), out);
  }
}

template <class Codec, bool BF16>
cq_status launch_dequant(const DequantRowsArgs &a, dim3 grid, cudaStream_t s) {
  dequant_rows_kernel<Codec, BF16><<<grid, kDequantThreads, 0, s>>>(a);
  CQ_LAUNCH_CHECK(dequant_rows_kernel);
  return CQ_OK;
}

typedef cq_status (*DequantLauncher)(const DequantRowsArgs &, dim3, cudaStream_t);

/* [decoder][f16, bf16] */
#define CQ_DEQUANT_CODEC(C) { launch_dequant<C, false>, launch_dequant<C, true> }
const DequantLauncher kDequantLaunchers[kCodecs][2] = {
    CQ_DEQUANT_CODEC(CodecInt8), CQ_DEQUANT_CODEC(CodecE4M3), CQ_DEQUANT_CODEC(CodecE5M2),
    CQ_DEQUANT_CODEC(CodecFp3),  CQ_DEQUANT_CODEC(CodecFp4),  CQ_DEQUANT_CODEC(CodecFp5),
    CQ_DEQUANT_CODEC(CodecFp6),  CQ_DEQUANT_CODEC(CodecFp7),
};
#undef CQ_DEQUANT_CODEC

/* ---------------------------------------------------------------- host side */

/* The decoder of a format: the one place formats map to specialisations. */
cq_status codec_of(const cq_format_info *f, const char *op, int *codec) {
  switch (f->id) {
    case CQ_FORMAT_INT8: *codec = kCodecInt8; return CQ_OK;
    case CQ_FORMAT_FP8_E4M3: *codec = kCodecE4M3; return CQ_OK;
    case CQ_FORMAT_FP8_E5M2: *codec = kCodecE5M2; return CQ_OK;
    default: break;
  }
  if (f->kind == CQ_KIND_FLOAT && f->specials == CQ_SPECIALS_NONE && f->packed && f->bits >= 3 && f->bits <= 7) {
    *codec = kCodecFp3 + (f->bits - 3);
    return CQ_OK;
  }
  return cq_fail(CQ_ERR_UNSUPPORTED, "%s: %s (%d-bit codes) has no CUDA decoder; the kernels take int8, fp8 and "
                 "fpX with 3..7 bits", op, f->name, f->bits);
}

/* Codes of one unit for a run-time bit width. */
int64_t unit_codes(int bits) {
  switch (bits) {
    case 3: return WoUnit<3>::kCodes;
    case 4: return WoUnit<4>::kCodes;
    case 5: return WoUnit<5>::kCodes;
    case 6: return WoUnit<6>::kCodes;
    case 7: return WoUnit<7>::kCodes;
    default: return WoUnit<8>::kCodes;
  }
}

/* Shared memory of the persistent kernel for a run-time bit width. */
size_t stream_smem(int bits, int warps, int kw) {
  switch (bits) {
    case 3: return stream_smem_bytes<3>(warps, kw);
    case 4: return stream_smem_bytes<4>(warps, kw);
    case 5: return stream_smem_bytes<5>(warps, kw);
    case 6: return stream_smem_bytes<6>(warps, kw);
    case 7: return stream_smem_bytes<7>(warps, kw);
    default: return stream_smem_bytes<8>(warps, kw);
  }
}

/* Whether every value of a format is exact in f16 (bf16 = 0, f16 = 1); cached
 * per format id, since the answer never changes. */
bool format_fits(const cq_format_info *f, int half) {
  static std::atomic<signed char> cache[2][0x200];
  const int id = (int)f->id;
  if (id >= 0 && id < 0x200) {
    const signed char known = cache[half][id].load(std::memory_order_relaxed);
    if (known) return known > 0;
  }
  bool fits = true;
  for (uint32_t code = 0; code < (1u << f->bits) && fits; ++code) {
    const float v = f->decode(f, code);
    if (v != v) continue; /* NaN stays NaN in both */
    const float back = half ? cq_f16_to_f32(cq_f32_to_f16(v)) : cq_bf16_to_f32(cq_f32_to_bf16(v));
    fits = back == v;
  }
  if (id >= 0 && id < 0x200) cache[half][id].store(fits ? 1 : -1, std::memory_order_relaxed);
  return fits;
}

cq_status require_sm80(int device_id, const char *op) {
  int cc = 0;
  CQ_TRY(cq_cuda_compute_capability(device_id, &cc));
  if (cc < 80)
    return cq_fail(CQ_ERR_UNSUPPORTED, "%s needs a GPU of compute capability 8.0 or newer (device %d is %d.%d)", op,
                   device_id, cc / 10, cc % 10);
  return CQ_OK;
}

/* The persistent kernel runs on compute capability 9.0, where it was measured
 * (its shared memory fits the 227 KB a block may take there); other GPUs run
 * the per-tile kernel, as does every GPU with CQUANT_GEMV_PERSISTENT=0. SM
 * count and opt-in shared memory are kept per device. *forced is set by
 * CQUANT_GEMV_PERSISTENT=1 (take it for every shape it can run). */
int stream_usable(int device, int *sms, int *smem_optin, int *forced) {
  const char *env = getenv("CQUANT_GEMV_PERSISTENT");
  if (env && env[0] == '0') return 0;
  *forced = env && env[0] == '1';
  static std::atomic<int> state[64], sm_count[64], smem_max[64]; /* state: 0 unknown, 1 yes, 2 no */
  if (device < 0 || device >= 64) return 0;
  int st = state[device].load(std::memory_order_acquire);
  if (!st) {
    int major = 0, minor = 0, n = 0, smem = 0;
    const bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
                    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess &&
                    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) == cudaSuccess &&
                    cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) == cudaSuccess &&
                    major == 9 && minor == 0 && n > 0;
    cudaGetLastError(); /* a failed query leaves no sticky error behind */
    sm_count[device].store(n, std::memory_order_relaxed);
    smem_max[device].store(smem, std::memory_order_relaxed);
    st = ok ? 1 : 2;
    state[device].store(st, std::memory_order_release);
  }
  *sms = sm_count[device].load(std::memory_order_relaxed);
  *smem_optin = smem_max[device].load(std::memory_order_relaxed);
  return st == 1;
}

/* Warps splitting K: as many as there are quads, up to 8, preferring a count
 * that divides the quads evenly (no warp idles while another finishes). */
int gemv_k_warps(int64_t quads) {
  if (quads <= kGemvWarps) return (int)quads;
  int best = kGemvWarps;
  double best_use = 0.0;
  for (int kw = kGemvWarps; kw >= kGemvWarps / 2; --kw) {
    const int64_t per_warp = (quads + kw - 1) / kw;
    const double use = (double)quads / (double)(per_warp * kw);
    if (use > best_use + 1e-9) best = kw, best_use = use;
  }
  return best;
}

/* Decode rows of a stored weight into f16/bf16: the body of both entries below. */
cq_status dequant_rows(const uint8_t *w, int64_t row_bytes, const float *scale, int scale_per_row,
                       const cq_format_info *wf, int64_t row0, int64_t rows, int64_t k, cq_dtype out_dtype, void *out,
                       cudaStream_t stream) {
  if (out_dtype != CQ_DTYPE_F16 && out_dtype != CQ_DTYPE_BF16)
    return cq_fail(CQ_ERR_UNSUPPORTED, "dequantize rows: out dtype %s; expected float16 or bfloat16",
                   cq_dtype_name(out_dtype));
  int codec;
  CQ_TRY(codec_of(wf, "dequantize rows", &codec));
  if (rows == 0) return CQ_OK;
  DequantRowsArgs a;
  a.w = w, a.scale = scale, a.out = static_cast<uint16_t *>(out);
  a.row0 = row0, a.rows = rows, a.k = k, a.row_bytes = row_bytes;
  a.octets = (k + 7) / 8;
  a.fmt = cq_format_params_of(wf);
  a.scale_per_row = scale_per_row;
  a.w_vec8 = (uintptr_t)w % 8 == 0 && row_bytes % 8 == 0;
  a.out_vec = (uintptr_t)out % 16 == 0 && k % 8 == 0;
  const int64_t per_cta = (int64_t)kDequantThreads * kDequantOctets;
  const int64_t gx = (a.octets + per_cta - 1) / per_cta;
  if (gx > 0x7fffffff)
    return cq_fail(CQ_ERR_UNSUPPORTED, "dequantize rows: rows of %lld codes are more than one launch covers",
                   (long long)k);
  const dim3 grid((unsigned)gx, (unsigned)(rows < 65535 ? rows : 65535));
  return kDequantLaunchers[codec][out_dtype == CQ_DTYPE_BF16](a, grid, stream);
}

}  // namespace

extern "C" cq_status cq_gemv_wo_cuda(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale,
                                     const cq_tensor *bias, const cq_linear_params *p, const cq_format_info *wf,
                                     cq_tensor *y, void *stream) {
  const int64_t m = cq_rows(x), k = cq_cols(x), n = w->shape[0];
  if (p->act_format != CQ_FORMAT_NONE)
    return cq_fail(CQ_ERR_INVALID_ARG, "gemv: act_format %d; the weight-only GEMV takes unquantized activations",
                   p->act_format);
  if (m > CQ_GEMV_MAX_M)
    return cq_fail(CQ_ERR_UNSUPPORTED, "gemv: x has %lld rows; the weight-only GEMV takes at most %d",
                   (long long)m, CQ_GEMV_MAX_M);
  int codec;
  CQ_TRY(codec_of(wf, "gemv", &codec));
  int xmode;
  switch (x->dtype) {
    case CQ_DTYPE_BF16: xmode = kXBf16; break;
    case CQ_DTYPE_F16: xmode = format_fits(wf, 1) ? kXF16 : kXSplit; break;
    case CQ_DTYPE_F32: xmode = kXSplit; break;
    default:
      return cq_fail(CQ_ERR_TYPE, "gemv: x has dtype %s; expected float32, float16 or bfloat16",
                     cq_dtype_name(x->dtype));
  }
  if (xmode != kXF16 && !format_fits(wf, 0))
    return cq_fail(CQ_ERR_UNSUPPORTED, "gemv: the values of %s are not all exact in bfloat16", wf->name);
  CQ_TRY(require_sm80(x->device_id, "gemv"));

  const int64_t codes_per_unit = unit_codes(wf->bits);
  const int64_t units = (k + codes_per_unit - 1) / codes_per_unit;
  GemvWoArgs a;
  a.x = x->data, a.w = static_cast<const uint8_t *>(w->data), a.w_scale = static_cast<const float *>(w_scale->data);
  a.bias = bias ? bias->data : nullptr, a.y = y->data;
  a.m = m, a.n = n, a.k = k, a.row_bytes = cq_packed_row_bytes(wf, k);
  if ((units + 3) / 4 > 0x3fffffff)
    return cq_fail(CQ_ERR_UNSUPPORTED, "gemv: rows of %lld codes are more than the kernel indexes", (long long)k);
  a.quads = (int)((units + 3) / 4);
  /* 16-bit x is loaded 16 bytes at a time with no bounds checks in the quads
   * that lie wholly inside K; the last, partial one checks every element */
  const bool x_vec = x->dtype != CQ_DTYPE_F32 && (uintptr_t)x->data % 16 == 0 && k % 8 == 0;
  a.fast_quads = x_vec ? (int)(k / (4 * codes_per_unit)) : 0;
  a.fmt = cq_format_params_of(wf);
  a.x_dtype = x->dtype;
  a.scale_per_row = p->weight_granularity == CQ_GRANULARITY_ROW;
  a.bias_f32 = bias && bias->dtype == CQ_DTYPE_F32;
  a.w_vec = (uintptr_t)w->data % 16 == 0 && a.row_bytes % 16 == 0;
  a.groups = 1;
  const int64_t tiles = (n + 15) / 16;
  int sms = 0, smem_optin = 0, forced = 0;
  /* Measured on H100 (benchmarks/results/gemv_h100.md): the persistent kernel
   * wins where every SM gets two or more row tiles of at least 8 quads; with
   * fewer tiles it leaves SMs idle or unbalanced, with short rows its ring
   * barely fills, and fp4's 1.5 items a warp per tile lose to the per-tile
   * kernel's simpler loop. */
  if (a.w_vec && a.quads > 0 && tiles > 0 && stream_usable(x->device_id, &sms, &smem_optin, &forced) &&
      (forced || (tiles >= 2 * (int64_t)sms && a.quads >= 8 && wf->bits != 4))) {
    /* groups of kw warps split K (kw <= quads); 16 warps a CTA, one CTA an SM */
    a.kw = (int)(a.quads < kStreamWarps ? a.quads : kStreamWarps);
    a.groups = kStreamWarps / a.kw;
    if (stream_smem(wf->bits, a.kw * a.groups, a.kw) <= (size_t)smem_optin) {
      const int64_t ctas = (tiles + a.groups - 1) / a.groups;
      return kGemvStreamLaunchers[codec][xmode](a, (unsigned)(ctas < sms ? ctas : sms), cq_stream(stream));
    }
    a.groups = 1;
  }
  a.kw = gemv_k_warps(a.quads);
  const int64_t grid = tiles;
  if (grid > 0x7fffffff)
    return cq_fail(CQ_ERR_UNSUPPORTED, "gemv: %lld output features is more than one launch covers", (long long)n);
  return kGemvLaunchers[codec][xmode](a, (unsigned)grid, cq_stream(stream));
}

extern "C" cq_status cq_dequant_rows_cuda(const cq_tensor *w, const cq_tensor *w_scale, const cq_linear_params *p,
                                          const cq_format_info *wf, int64_t row0, int64_t rows, cq_dtype out_dtype,
                                          void *out, void *stream) {
  const int64_t n = cq_rows(w);
  int64_t k = p->in_features;
  if (k <= 0) {
    if (wf->packed)
      return cq_fail(CQ_ERR_INVALID_ARG, "dequantize rows: in_features is required for packed %s rows", wf->name);
    k = cq_cols(w);
  }
  const int64_t row_bytes = cq_packed_row_bytes(wf, k);
  if (cq_cols(w) != row_bytes)
    return cq_fail(CQ_ERR_INVALID_ARG, "dequantize rows: w has %lld bytes a row; expected %lld for %lld %s codes",
                   (long long)cq_cols(w), (long long)row_bytes, (long long)k, wf->name);
  if (row0 < 0 || rows < 0 || row0 + rows > n)
    return cq_fail(CQ_ERR_INVALID_ARG, "dequantize rows: rows [%lld, %lld) are outside w's %lld rows",
                   (long long)row0, (long long)(row0 + rows), (long long)n);
  if (!out && rows) return cq_fail(CQ_ERR_INVALID_ARG, "dequantize rows: out is NULL");
  return dequant_rows(static_cast<const uint8_t *>(w->data), row_bytes, static_cast<const float *>(w_scale->data),
                      p->weight_granularity == CQ_GRANULARITY_ROW, wf, row0, rows, k, out_dtype, out, cq_stream(stream));
}
