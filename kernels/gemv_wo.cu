/* Weight-only quantized linear layer for small batches (M <= 16), and the
 * decoding of stored weight rows into f16/bf16 for the large-batch path.
 *
 * GEMV. The stored weight is read once, at memory speed, and decoded on the
 * fly into the A operand of mma.m16n8k16 (f32 accumulation); x^T is the B
 * operand, M padded to 8 or 16. A warp owns 16 weight rows: lane (g, c) =
 * (lane / 4, lane % 4) reads units 4q + c (wo_unit.cuh) of rows g and g + 8,
 * so the 4 lanes of a group read 4 neighbouring units of one row. Lane c's
 * share of k-tile t of a unit is its codes 4t .. 4t+3: mma only needs the k
 * order of A and B to agree, not to be the natural one.
 *
 * Decoding is a table lookup in shared memory, one copy of the table per lane
 * (word e*32 + lane, so every lookup of a warp is bank-conflict free); the
 * table holds decode(code) as f16 or bf16, which represent every code of the
 * format exactly (checked on the host), so the decode is exact and the
 * products are exact. Codes of up to 4 bits are looked up in pairs.
 * x in bf16 (f16) is used as it is; x in f32 (or f16 with a format that f16
 * cannot hold) is split into bf16 pieces whose sum is x exactly (3 for f32, 2
 * for f16), one mma per piece. The M tile (8 or 16 rows of x) is a run-time
 * branch: the specialisations are bits x x mode (kGemvLaunchers). The 8 warps of a CTA split K (and rows when K is short);
 * their partial sums meet in shared memory before scale and bias.
 *
 * Dequantize rows: one thread per unit, an fp32 value table, the fp32 product
 * with the scale rounded once to f16/bf16, 16-byte stores. */
#include <atomic>

#include "wo_unit.cuh"

namespace {

constexpr int kGemvWarps = 8;
constexpr int kGemvThreads = 32 * kGemvWarps;
constexpr int kDequantThreads = 256;

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

/* ---------------------------------------------------------------- GEMV */

/* How x enters the mma: bf16 or f16 as it is, or (kXSplit) f32 -- or f16 with
 * a format f16 cannot hold -- as 3 bf16 pieces. */
enum XMode { kXBf16 = 0, kXF16 = 1, kXSplit = 2, kXModes = 3 };

template <int XM>
struct XTraits {
  static constexpr bool kBf16 = XM != kXF16;    /* mma input type */
  static constexpr int kPieces = XM == kXSplit ? 3 : 1;
};

struct GemvWoArgs {
  const void *x;          /* [m, k] */
  const uint8_t *w;       /* [n, row_bytes] stored codes */
  const float *w_scale;   /* n (per row) or 1 */
  const void *bias;       /* n elements (x dtype or f32) or NULL */
  void *y;                /* [m, n], x dtype */
  int64_t m, n, k, row_bytes;
  int64_t quads;          /* groups of 4 units per row */
  int64_t full_quads;     /* leading quads decoded on the fast path (see gemv_wo_kernel) */
  cq_format_params fmt;
  cq_dtype x_dtype;
  int scale_per_row, bias_f32, w_vec;
  int kw, rw;             /* warps splitting K per row block, row blocks per CTA (kw * rw = 8) */
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

/* B fragments (one per piece) of x[k .. k+3]: b[p][0] = x[k], x[k+1] and
 * b[p][1] = x[k+2], x[k+3], the lower k in the low half. */
template <int XM>
__device__ __forceinline__ void b_from_floats(const float (&f)[4], uint32_t (&b)[XTraits<XM>::kPieces][2]) {
  uint32_t pc[4][3];
#pragma unroll
  for (int i = 0; i < 4; ++i) split_bf16(f[i], pc[i]);
#pragma unroll
  for (int p = 0; p < XTraits<XM>::kPieces; ++p)
    b[p][0] = pc[0][p] | (pc[1][p] << 16), b[p][1] = pc[2][p] | (pc[3][p] << 16);
}

/* 8 bytes of x. volatile: kept in its group of k-tiles by the barrier in
 * mma_unit instead of being hoisted, with its registers, to the unit start. */
__device__ __forceinline__ uint2 ldg_x8(const void *p) {
  uint2 v;
  asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

__device__ __forceinline__ float4 ldg_x16(const void *p) {
  float4 v;
  asm volatile("ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}

/* Fast path: x[k .. k+3] in range and 8/16-byte aligned. xrow NULL: zeros. */
template <int XM>
__device__ __forceinline__ void load_b(const void *xrow, int64_t k, bool x_f32,
                                       uint32_t (&b)[XTraits<XM>::kPieces][2]) {
  if constexpr (XM != kXSplit) {
    uint2 v = make_uint2(0u, 0u);
    if (xrow) v = ldg_x8(static_cast<const uint16_t *>(xrow) + k);
    b[0][0] = v.x, b[0][1] = v.y;
  } else {
    float f[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (xrow) {
      if (x_f32) {
        const float4 v = ldg_x16(static_cast<const float *>(xrow) + k);
        f[0] = v.x, f[1] = v.y, f[2] = v.z, f[3] = v.w;
      } else {
        const uint2 v = ldg_x8(static_cast<const uint16_t *>(xrow) + k);
        f[0] = cq_f16_to_f32((uint16_t)v.x), f[1] = cq_f16_to_f32((uint16_t)(v.x >> 16));
        f[2] = cq_f16_to_f32((uint16_t)v.y), f[3] = cq_f16_to_f32((uint16_t)(v.y >> 16));
      }
    }
    b_from_floats<XM>(f, b);
  }
}

/* Any k, any alignment: element loads, zeros past kmax. */
template <int XM>
__device__ __forceinline__ void load_b_guarded(const void *xrow, int64_t k, int64_t kmax, bool x_f32,
                                               uint32_t (&b)[XTraits<XM>::kPieces][2]) {
  if constexpr (XM != kXSplit) {
    uint32_t e[4] = {0u, 0u, 0u, 0u};
    const uint16_t *xr = static_cast<const uint16_t *>(xrow);
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (xr && k + i < kmax) e[i] = __ldg(xr + k + i);
    b[0][0] = e[0] | (e[1] << 16), b[0][1] = e[2] | (e[3] << 16);
  } else {
    float f[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (xrow && k + i < kmax)
        f[i] = x_f32 ? __ldg(static_cast<const float *>(xrow) + k + i)
                     : cq_f16_to_f32(__ldg(static_cast<const uint16_t *>(xrow) + k + i));
    b_from_floats<XM>(f, b);
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

/* Table word at a byte offset (entry * 128 + lane * 4). */
__device__ __forceinline__ uint32_t lut_word(const uint32_t *lut, uint32_t byte_offset) {
  return *reinterpret_cast<const uint32_t *>(reinterpret_cast<const char *>(lut) + byte_offset);
}

/* Codes 2p and 2p+1 of a unit as an f16x2/bf16x2 register (code 2p low);
 * p must be a compile-time constant after unrolling. */
template <int BITS, int NW>
__device__ __forceinline__ uint32_t decode_pair(const uint32_t (&w)[NW], int p, const uint32_t *lut, uint32_t lane4) {
  if (WoUnit<BITS>::kPairIndex) return lut_word(lut, cq_unit_field(w, 2 * p * BITS, 2 * BITS, 7) | lane4);
  const uint32_t lo = lut_word(lut, cq_unit_field(w, 2 * p * BITS, BITS, 7) | lane4);
  const uint32_t hi = lut_word(lut, cq_unit_field(w, (2 * p + 1) * BITS, BITS, 7) | lane4);
  return __byte_perm(lo, hi, 0x5410);
}

/* The same with a run-time p: w has a zero word past the unit. */
template <int BITS>
__device__ __forceinline__ uint32_t decode_pair_rt(const uint32_t *w, int p, const uint32_t *lut, uint32_t lane4) {
  const auto field = [&](int pos, int width) {
    const uint32_t v = __funnelshift_r(w[pos >> 5], w[(pos >> 5) + 1], pos & 31);
    return ((v & ((1u << width) - 1u)) << 7) | lane4;
  };
  if (WoUnit<BITS>::kPairIndex) return lut_word(lut, field(2 * p * BITS, 2 * BITS));
  return __byte_perm(lut_word(lut, field(2 * p * BITS, BITS)), lut_word(lut, field((2 * p + 1) * BITS, BITS)), 0x5410);
}

/* Every lane's copy of the value table: word e*32 + lane = value(s) of index e. */
template <int BITS, bool BF16>
__device__ void build_mma_lut(const cq_format_params &f, uint32_t *lut) {
  using U = WoUnit<BITS>;
  constexpr int kWordsTotal = 32 << U::kIndexBits;
  for (int i = threadIdx.x; i < kWordsTotal; i += blockDim.x) {
    const uint32_t e = (uint32_t)i >> 5;
    uint32_t v;
    if (U::kPairIndex)
      v = elem_bits<BF16>(cq_decode(f, e & ((1u << BITS) - 1u))) | (elem_bits<BF16>(cq_decode(f, e >> BITS)) << 16);
    else
      v = elem_bits<BF16>(cq_decode(f, e));
    lut[i] = v;
  }
}

/* Per-lane state of the GEMV: the x rows of B (NULL for padding rows). */
struct GemvLane {
  const void *xrow[2];
  const uint32_t *lut;
  uint32_t lane4;
  bool two, third, x_f32;
};

/* One unit of rows g and g+8 (words w0, w1) against x[k0 .. k0 + codes),
 * everything in range and aligned (or the unit wholly past k: zeros). */
template <int BITS, int XM>
__device__ __forceinline__ void mma_unit(const uint32_t (&w0)[WoUnit<BITS>::kWords],
                                         const uint32_t (&w1)[WoUnit<BITS>::kWords], const GemvLane &L, int64_t k0,
                                         bool in_range, float (&acc)[2][4]) {
  constexpr int P = XTraits<XM>::kPieces;
  const void *xr[2] = {in_range ? L.xrow[0] : nullptr, in_range ? L.xrow[1] : nullptr};
#pragma unroll
  for (int t = 0; t < WoUnit<BITS>::kCodes / 4; ++t) {
    uint32_t a[4];
    a[0] = decode_pair<BITS>(w0, 2 * t, L.lut, L.lane4);     /* row g,   k-slots 2c, 2c+1 */
    a[1] = decode_pair<BITS>(w1, 2 * t, L.lut, L.lane4);     /* row g+8, k-slots 2c, 2c+1 */
    a[2] = decode_pair<BITS>(w0, 2 * t + 1, L.lut, L.lane4); /* row g,   k-slots 2c+8, 2c+9 */
    a[3] = decode_pair<BITS>(w1, 2 * t + 1, L.lut, L.lane4); /* row g+8, k-slots 2c+8, 2c+9 */
    uint32_t b[2][P][2];
    load_b<XM>(xr[0], k0 + 4 * t, L.x_f32, b[0]);
    if (L.two) load_b<XM>(xr[1], k0 + 4 * t, L.x_f32, b[1]);
    mma_tile<XM>(a, b, L.two, L.third, acc);
    /* keep the scheduler from hoisting the lookups of all 32 tiles of a long
     * unit (3/5/7 bits) into registers at once */
    if (t % 8 == 7) asm volatile("" ::: "memory");
  }
}

/* The same for any k and alignment (the last units of rows of odd length). */
template <int BITS, int XM>
__device__ __forceinline__ void mma_unit_guarded(const uint32_t (&w0)[WoUnit<BITS>::kWords],
                                                 const uint32_t (&w1)[WoUnit<BITS>::kWords], const GemvLane &L,
                                                 int64_t k0, int64_t kmax, float (&acc)[2][4]) {
  constexpr int NW = WoUnit<BITS>::kWords, P = XTraits<XM>::kPieces;
  uint32_t u0[NW + 1], u1[NW + 1];
#pragma unroll
  for (int i = 0; i < NW; ++i) u0[i] = w0[i], u1[i] = w1[i];
  u0[NW] = u1[NW] = 0u;
#pragma unroll 1
  for (int t = 0; t < WoUnit<BITS>::kCodes / 4; ++t) {
    uint32_t a[4];
    a[0] = decode_pair_rt<BITS>(u0, 2 * t, L.lut, L.lane4);
    a[1] = decode_pair_rt<BITS>(u1, 2 * t, L.lut, L.lane4);
    a[2] = decode_pair_rt<BITS>(u0, 2 * t + 1, L.lut, L.lane4);
    a[3] = decode_pair_rt<BITS>(u1, 2 * t + 1, L.lut, L.lane4);
    uint32_t b[2][P][2];
    load_b_guarded<XM>(L.xrow[0], k0 + 4 * t, kmax, L.x_f32, b[0]);
    load_b_guarded<XM>(L.two ? L.xrow[1] : nullptr, k0 + 4 * t, kmax, L.x_f32, b[1]);
    mma_tile<XM>(a, b, L.two, L.third, acc);
  }
}

template <typename T>
__device__ __forceinline__ float bias_at(const void *bias, int bias_f32, int64_t n) {
  return bias_f32 ? static_cast<const float *>(bias)[n] : cq_to_float(static_cast<const T *>(bias)[n]);
}

template <int BITS, int XM>
__global__ void __launch_bounds__(kGemvThreads, 2) gemv_wo_kernel(const GemvWoArgs a) {
  using U = WoUnit<BITS>;
  /* units in flight: 4 of the 16-byte units (128 bytes a lane over two rows;
   * half as many for split x, whose pieces take the registers), one of the
   * longer ones (48-112 bytes) */
  constexpr int kUnroll = U::kBytes == 16 ? (XM == kXSplit ? 2 : 4) : 1;
  constexpr int kPerWarp = 8 * 32; /* two 16x8 accumulator tiles */
  __shared__ uint32_t lut[32 << U::kIndexBits];
  __shared__ float partial[kGemvWarps * kPerWarp];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int ks = warp % a.kw, wr = warp / a.kw;
  const int64_t n0 = ((int64_t)blockIdx.x * a.rw + wr) * 16 + g;
  const uint8_t *row0 = n0 < a.n ? a.w + n0 * a.row_bytes : nullptr;
  const uint8_t *row1 = n0 + 8 < a.n ? a.w + (n0 + 8) * a.row_bytes : nullptr;
  const bool w_vec = a.w_vec != 0;
  const size_t xsize = a.x_dtype == CQ_DTYPE_F32 ? 4 : 2;
  GemvLane L;
#pragma unroll
  for (int nb = 0; nb < 2; ++nb) {
    const int m = g + 8 * nb;
    L.xrow[nb] = m < a.m ? static_cast<const char *>(a.x) + (size_t)m * a.k * xsize : nullptr;
  }
  L.lut = lut, L.lane4 = (uint32_t)lane << 2;
  L.two = a.m > 8, L.x_f32 = a.x_dtype == CQ_DTYPE_F32, L.third = L.x_f32;
  float acc[2][4];
#pragma unroll
  for (int nb = 0; nb < 2; ++nb) acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.0f;

  /* The first weights are requested before the table is built, so the table
   * build hides under their latency. */
  uint32_t wv[kUnroll][2][U::kWords];
  int64_t q = ks;
#pragma unroll
  for (int i = 0; i < kUnroll; ++i) {
    const int64_t qi = q + (int64_t)i * a.kw;
    if (qi < a.quads) {
      cq_load_unit<BITS>(row0, 4 * qi + c, a.row_bytes, w_vec, wv[i][0]);
      cq_load_unit<BITS>(row1, 4 * qi + c, a.row_bytes, w_vec, wv[i][1]);
    }
  }
  build_mma_lut<BITS, XTraits<XM>::kBf16>(a.fmt, lut);
  __syncthreads();

  for (;;) {
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      const int64_t qi = q + (int64_t)i * a.kw;
      const int64_t k0 = (4 * qi + c) * U::kCodes;
      /* warp-uniform branches: mma needs the whole warp */
      if (qi < a.full_quads)
        mma_unit<BITS, XM>(wv[i][0], wv[i][1], L, k0, k0 < a.k, acc);
      else if (qi < a.quads)
        mma_unit_guarded<BITS, XM>(wv[i][0], wv[i][1], L, k0, a.k, acc);
    }
    q += (int64_t)kUnroll * a.kw;
    if (q >= a.quads) break;
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      const int64_t qi = q + (int64_t)i * a.kw;
      if (qi < a.quads) {
        cq_load_unit<BITS>(row0, 4 * qi + c, a.row_bytes, w_vec, wv[i][0]);
        cq_load_unit<BITS>(row1, 4 * qi + c, a.row_bytes, w_vec, wv[i][1]);
      }
    }
  }

  /* Partial sums of the warps that split K meet here, in a fixed order. */
  float *mine = partial + warp * kPerWarp;
#pragma unroll
  for (int j = 0; j < 8; ++j) mine[j * 32 + lane] = acc[j >> 2][j & 3];
  __syncthreads();
  for (int v = threadIdx.x; v < a.rw * kPerWarp; v += blockDim.x) {
    const int rbi = v / kPerWarp, j = (v / 32) & 7, ln = v & 31;
    /* accumulator element i of tile nb, lane ln: row g (+8 for i >= 2), x row 8nb + 2c + (i & 1) */
    const int nb = j >> 2, i = j & 3;
    const int64_t n = ((int64_t)blockIdx.x * a.rw + rbi) * 16 + (ln >> 2) + ((i & 2) ? 8 : 0);
    const int64_t m = 8 * nb + 2 * (ln & 3) + (i & 1);
    if (n >= a.n || m >= a.m) continue;
    float sum = 0.0f;
    for (int s = 0; s < a.kw; ++s) sum += partial[(rbi * a.kw + s) * kPerWarp + j * 32 + ln];
    const float sw = a.w_scale[a.scale_per_row ? n : 0];
    /* y = acc * sx * sw + b with sx = 1, left to right, no contraction */
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
}

template <int BITS, int XM>
cq_status launch_gemv(const GemvWoArgs &a, unsigned grid, cudaStream_t s) {
  gemv_wo_kernel<BITS, XM><<<grid, kGemvThreads, 0, s>>>(a);
  CQ_LAUNCH_CHECK(gemv_wo_kernel);
  return CQ_OK;
}

typedef cq_status (*GemvLauncher)(const GemvWoArgs &, unsigned, cudaStream_t);

/* The compile-time specialisations: [bits - 3][x mode]. The M tile (8 or 16
 * rows of x) is a run-time branch: it changes no register layout. */
#define CQ_GEMV_BITS(B) { launch_gemv<B, kXBf16>, launch_gemv<B, kXF16>, launch_gemv<B, kXSplit> }
const GemvLauncher kGemvLaunchers[6][kXModes] = {
    CQ_GEMV_BITS(3), CQ_GEMV_BITS(4), CQ_GEMV_BITS(5), CQ_GEMV_BITS(6), CQ_GEMV_BITS(7), CQ_GEMV_BITS(8),
};
#undef CQ_GEMV_BITS

/* ---------------------------------------------------------------- dequantize rows */

struct DequantRowsArgs {
  const uint8_t *w;      /* stored rows, row_bytes each */
  const float *scale;    /* per row (indexed by stored row) or 1 */
  uint16_t *out;         /* [rows, k] f16/bf16 bits */
  int64_t row0, rows, k, row_bytes, units;
  cq_format_params fmt;
  int scale_per_row, w_vec, out_vec;
};

template <int BITS, bool BF16>
__global__ void __launch_bounds__(kDequantThreads) dequant_rows_kernel(const DequantRowsArgs a) {
  using U = WoUnit<BITS>;
  __shared__ float lut[1 << BITS];
  for (int i = threadIdx.x; i < (1 << BITS); i += blockDim.x) lut[i] = cq_decode(a.fmt, (uint32_t)i);
  __syncthreads();
  const int64_t total = a.rows * a.units;
  for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = idx / a.units, u = idx - r * a.units;
    const int64_t stored = a.row0 + r;
    uint32_t w[U::kWords];
    cq_load_unit<BITS>(a.w + stored * a.row_bytes, u, a.row_bytes, a.w_vec != 0, w);
    const float s = a.scale[a.scale_per_row ? stored : 0];
    uint16_t *out = a.out + r * a.k;
    const int64_t k0 = u * U::kCodes;
    if (a.out_vec && k0 + U::kCodes <= a.k) {
#pragma unroll
      for (int j8 = 0; j8 < U::kCodes / 8; ++j8) {
        uint32_t h[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = 8 * j8 + 2 * e;
          const uint32_t lo = store_bits<BF16>(lut[cq_unit_field(w, j * BITS, BITS, 0)] * s);
          const uint32_t hi = store_bits<BF16>(lut[cq_unit_field(w, (j + 1) * BITS, BITS, 0)] * s);
          h[e] = lo | (hi << 16);
        }
        *reinterpret_cast<uint4 *>(out + k0 + 8 * j8) = make_uint4(h[0], h[1], h[2], h[3]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < U::kCodes; ++j)
        if (k0 + j < a.k) out[k0 + j] = store_bits<BF16>(lut[cq_unit_field(w, j * BITS, BITS, 0)] * s);
    }
  }
}

template <int BITS, bool BF16>
cq_status launch_dequant(const DequantRowsArgs &a, unsigned grid, cudaStream_t s) {
  dequant_rows_kernel<BITS, BF16><<<grid, kDequantThreads, 0, s>>>(a);
  CQ_LAUNCH_CHECK(dequant_rows_kernel);
  return CQ_OK;
}

typedef cq_status (*DequantLauncher)(const DequantRowsArgs &, unsigned, cudaStream_t);

/* [bits - 3][f16, bf16] */
#define CQ_DEQUANT_BITS(B) { launch_dequant<B, false>, launch_dequant<B, true> }
const DequantLauncher kDequantLaunchers[6][2] = {
    CQ_DEQUANT_BITS(3), CQ_DEQUANT_BITS(4), CQ_DEQUANT_BITS(5), CQ_DEQUANT_BITS(6), CQ_DEQUANT_BITS(7), CQ_DEQUANT_BITS(8),
};
#undef CQ_DEQUANT_BITS

/* ---------------------------------------------------------------- host side */

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

/* Codes of one unit (WoUnit<bits>::kCodes) for a run-time bit width. */
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

unsigned grid_for(int64_t work, int64_t per_block) {
  int64_t g = (work + per_block - 1) / per_block;
  return (unsigned)(g < 1 ? 1 : g > 65535 * 8 ? 65535 * 8 : g);
}

/* Decode rows of a stored weight into f16/bf16: the body of both entries below. */
cq_status dequant_rows(const uint8_t *w, int64_t row_bytes, const float *scale, int scale_per_row,
                       const cq_format_info *wf, int64_t row0, int64_t rows, int64_t k, cq_dtype out_dtype, void *out,
                       cudaStream_t stream) {
  if (out_dtype != CQ_DTYPE_F16 && out_dtype != CQ_DTYPE_BF16)
    return cq_fail(CQ_ERR_UNSUPPORTED, "dequantize rows: out dtype %s; expected float16 or bfloat16",
                   cq_dtype_name(out_dtype));
  if (wf->bits < 3 || wf->bits > 8)
    return cq_fail(CQ_ERR_UNSUPPORTED, "dequantize rows: %s has %d-bit codes; the kernel takes 3..8 bits", wf->name,
                   wf->bits);
  if (rows == 0) return CQ_OK;
  const int64_t codes_per_unit = unit_codes(wf->bits);
  DequantRowsArgs a;
  a.w = w, a.scale = scale, a.out = static_cast<uint16_t *>(out);
  a.row0 = row0, a.rows = rows, a.k = k, a.row_bytes = row_bytes;
  a.units = (k + codes_per_unit - 1) / codes_per_unit;
  a.fmt = cq_format_params_of(wf);
  a.scale_per_row = scale_per_row;
  a.w_vec = (uintptr_t)w % 16 == 0 && row_bytes % 16 == 0;
  a.out_vec = (uintptr_t)out % 16 == 0 && k % 8 == 0;
  return kDequantLaunchers[wf->bits - 3][out_dtype == CQ_DTYPE_BF16](a, grid_for(rows * a.units, kDequantThreads),
                                                                      stream);
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
  if (wf->bits < 3 || wf->bits > 8)
    return cq_fail(CQ_ERR_UNSUPPORTED, "gemv: %s has %d-bit codes; the GEMV takes 3..8 bits", wf->name, wf->bits);
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

  const int bits = wf->bits;
  const int64_t codes_per_unit = unit_codes(bits);
  const int64_t units = (k + codes_per_unit - 1) / codes_per_unit;
  GemvWoArgs a;
  a.x = x->data, a.w = static_cast<const uint8_t *>(w->data), a.w_scale = static_cast<const float *>(w_scale->data);
  a.bias = bias ? bias->data : nullptr, a.y = y->data;
  a.m = m, a.n = n, a.k = k, a.row_bytes = cq_packed_row_bytes(wf, k);
  a.quads = (units + 3) / 4;
  /* The fast path loads x in 4-element vectors with no bounds checks: every
   * unit of a fast quad lies wholly inside or wholly past k. */
  const size_t xsize = cq_dtype_size(x->dtype);
  const bool x_vec = (uintptr_t)x->data % (4 * xsize) == 0 && k % 4 == 0;
  a.full_quads = !x_vec ? 0 : (k % codes_per_unit == 0 ? a.quads : k / (4 * codes_per_unit));
  a.fmt = cq_format_params_of(wf);
  a.x_dtype = x->dtype;
  a.scale_per_row = p->weight_granularity == CQ_GRANULARITY_ROW;
  a.bias_f32 = bias && bias->dtype == CQ_DTYPE_F32;
  a.w_vec = (uintptr_t)w->data % 16 == 0 && a.row_bytes % 16 == 0;
  /* split K over as many warps as there are quads of units (at most 8); the rest split rows */
  a.kw = kGemvWarps;
  while (a.kw > 1 && a.kw > a.quads) a.kw >>= 1;
  a.rw = kGemvWarps / a.kw;
  const int64_t row_blocks = (n + 15) / 16, grid = (row_blocks + a.rw - 1) / a.rw;
  if (grid > 0x7fffffff)
    return cq_fail(CQ_ERR_UNSUPPORTED, "gemv: %lld output features is more than one launch covers", (long long)n);
  return kGemvLaunchers[bits - 3][xmode](a, (unsigned)grid, cq_stream(stream));
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
