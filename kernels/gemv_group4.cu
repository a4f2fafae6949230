/* Weight-only GEMV for 4-bit weights per group (int4, uint4) and M <= CQ_GEMV_MAX_M rows of x:
 * the packed weight is read once with 16-byte loads and decoded in registers.
 *
 * bf16 / f16 x: the decoded weights w' (x' of the format rounded to x's type, cquant.h) are the
 * A operand of mma.m16n8k16 and x^T its B operand (fp32 accumulation). A CTA owns 16 weight rows;
 * its kw warps split K in blocks of 8 units, a unit being 32 codes (16 bytes) of a row. In each
 * step, lane (g, c) = (lane / 4, lane % 4) decodes units u_c and u_c + 2, u_c = (c & 1) + 4 (c >> 1),
 * of a block of rows g and g + 8, so a group of 128 or more codes needs one scale a row per step,
 * and loads the same 64 values of x rows g (and g + 8 when M > 8). So each 16-byte load of a warp
 * reads whole 32-byte sectors of a row (units 0, 1, 4, 5, then 2, 3, 6, 7), and a lane's x values
 * lie in 2 lines of 128 bytes a row instead of 4 (x's loads are what bound L1 from M = 8 on).
 * mma only needs A and B to agree on the order of k, so each lane's k-slots (2c, 2c+1 in
 * a0/a1/b0, 2c+8, 2c+9 in a2/a3/b1) hold codes of its own unit, in the order below, and the
 * accumulator holds c0 = y[2c][g], c1 = y[2c+1][g], c2 = y[2c][g+8], c3 = y[2c+1][g+8]
 * (x rows 8.. in the second n8 block). Each lane keeps its next kDepth steps' units and scales in
 * flight in registers (16-byte loads that bypass L1; none in the wide launch, where more warps
 * hide the latency instead). The warps' partial sums meet in shared
 * memory in a fixed order; bias, activation and gated residual follow in fp32, rounded once.
 *
 * Decoding pairs nibbles i and i + 4 of a word in one 16-bit pair (one shift and one lop3), so
 * k-tile t = 2j + h takes pairs 2h, 2h + 1 of word j of each lane's unit, and x is paired the same
 * way with two byte permutes per k-tile:
 *   a0 = row g, codes 8j + 2h, 8j + 2h + 4        a2 = row g, codes 8j + 2h + 1, 8j + 2h + 5
 *   a1, a3 = the same codes of row g + 8          b0, b1 = x[g] at the codes of a0, a2
 * Steps whose scales are all exact in x's 16-bit type (the quantizer's are) decode with two
 * packed fmas a pair (int4_decode.cuh, Decoder16: bit for bit the fp32 math); a warp meeting any
 * other scale or zero point takes the fp32 decode of cquant.h written out for that step.
 *
 * f32 x: w' is not rounded, so no 16-bit mma takes it; a warp per weight row decodes units and
 * accumulates x w' in fp32 FMAs (x f32 is rare at these sizes; memory is not its limit). */
#include "arch.cuh"
#include "int4_decode.cuh"
#include "linear_impl.cuh"
#include "ptx.cuh"

namespace {

constexpr int kWarps = 8; /* at most, along K */
constexpr int kDepth = 1; /* steps a warp has in flight beyond the one it computes */
constexpr int kWarpsPerSm = 11; /* the warps along K aim at about this many warps an SM */
constexpr int kCapBlocksPerSm = 5; /* CTAs of at most four warps: registers for this many an SM */
/* Wide launch, where a layer has at least kWideTiles CTAs an SM: no step in flight in registers
 * (72 of them a lane instead of 96), so that about kWideWarpsPerSm warps an SM hide the loads'
 * latency instead. Measured on an H200, 1x3072x18432: 2.09x of bf16 against 1.91x; with fewer
 * tiles (N = 6144, 9216) the in-flight step wins (benchmarks/results/gemv_int4_wide_h200.md). */
constexpr int kWideTiles = 8;
constexpr int kWideWarpsPerSm = 24;
constexpr int kWideCapBlocksPerSm = 7;
/* M > 8 off the wide launch: registers for two CTAs of 8 warps an SM (128 a lane). Without the cap
 * uint4's kernel took 138, one CTA fewer an SM than int4's 128: a second wave at N = 9216 (0.74x
 * of bf16 against int4's 1.18x at M = 16, H200) and half the warps at N = 3072. */
constexpr int kTwoCapBlocksPerSm = 2;

struct Gemv4Args {
  const void *x;        /* [m, k] contiguous */
  const uint8_t *w;     /* [n, ldw] packed */
  const float *sw;      /* [n, groups, E] */
  const void *bias;     /* [n] or NULL */
  cq_dtype bias_dtype;
  int activation;
  int64_t m, n, k, ldw, groups;
  int unit_shift;       /* log2(group_size / 32): unit u lies in group u >> unit_shift */
  int units, blocks, kw; /* units of 32 codes, blocks of 8 units a row; warps along K */
  int x_vec, w_vec;     /* 16-byte loads of x / of weight rows allowed */
  int wide;             /* the wide launch (kWideTiles) */
  int s_vec;            /* 8-byte loads of uint4's (scale, zp) allowed */
  cq_linear_out out;
};

/* Unit j (0, 1) of lane c in a block of 8 (see the top of the file). */
__device__ __forceinline__ int lane_unit(int c, int j) { return (c & 1) + 4 * (c >> 1) + 2 * j; }

/* 16 bytes of a packed row (zeros when !ok). */
__device__ __forceinline__ uint4 load_unit(const uint8_t *p, bool ok, bool vec) {
  if (vec) return cq_load_stream16<false>(p, ok);
  uint32_t w[4] = {0u, 0u, 0u, 0u};
  if (ok)
#pragma unroll
    for (int i = 0; i < 16; ++i) w[i >> 2] |= (uint32_t)p[i] << (8 * (i & 3));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

/* 32 16-bit x values from xrow (or zeros for a padding row), two per word, lower k low. */
__device__ __forceinline__ void load_x32(const uint16_t *xrow, bool vec, uint32_t (&xr)[16]) {
  if (vec) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint4 v = cq_load_stream16<true>(xrow + 8 * i, xrow != nullptr);
      xr[4 * i] = v.x, xr[4 * i + 1] = v.y, xr[4 * i + 2] = v.z, xr[4 * i + 3] = v.w;
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < 16; ++i)
    xr[i] = xrow ? (uint32_t)__ldg(xrow + 2 * i) | ((uint32_t)__ldg(xrow + 2 * i + 1) << 16) : 0u;
}

template <typename T>
__device__ __forceinline__ void store_y(const Gemv4Args &a, int64_t m, int64_t n, float sum) {
  const float b = a.bias ? cq_load_any(a.bias, a.bias_dtype, n) : 0.0f;
  const float v = cq_out_value(a.out, m, n, cq_activate(__fadd_rn(sum, b), a.activation));
  static_cast<T *>(a.out.y)[m * a.out.ldy + n] = cq_from_float<T>(v);
}

template <bool U4>
__device__ __forceinline__ void load_scale(const Gemv4Args &a, int64_t row, int u, bool ok, float &s, float &zp) {
  s = 0.0f, zp = 0.0f;
  if (!ok) return;
  const float *p = a.sw + (row * a.groups + (u >> a.unit_shift)) * (U4 ? 2 : 1);
  s = __ldg(p);
  if (U4) zp = __ldg(p + 1);
}

/* One step's inputs of a lane: its two units of rows g and g + 8 and their groups' scales (NG = 2
 * groups when a group is one or two units, else 1: both units lie in one group). */
template <int NG>
struct StepIn {
  uint4 w[2][2]; /* [row h][unit j] */
  float s[2][NG], zp[2][NG];
};

/* Where a lane's two rows start (row past N: ok false, and the pointers stay in bounds). */
template <bool U4>
struct LaneRows {
  const uint8_t *w[2]; /* the lane's first unit of block 0 of the row */
  const float *s[2];   /* the row's scales */
  bool ok[2];
  __device__ __forceinline__ LaneRows(const Gemv4Args &a, int64_t r0, int c) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = r0 + 8 * h;
      ok[h] = row < a.n;
      w[h] = ok[h] ? a.w + row * a.ldw + 16 * lane_unit(c, 0) : a.w;
      s[h] = ok[h] ? a.sw + row * a.groups * (U4 ? 2 : 1) : a.sw;
    }
  }
};

/* *p as (scale, zp), or zeros when !pred, without a branch. */
__device__ __forceinline__ float2 load_terms_pred(const float *p, bool pred) {
  float2 v;
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %3, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n"
               " @p ld.global.nc.v2.f32 {%0, %1}, [%2];\n}"
               : "=f"(v.x), "=f"(v.y)
               : "l"(p), "r"((int)pred));
  return v;
}
__device__ __forceinline__ float load_scale_pred(const float *p, bool pred) {
  float v;
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n mov.b32 %0, 0;\n @p ld.global.nc.f32 %0, [%1];\n}"
               : "=f"(v)
               : "l"(p), "r"((int)pred));
  return v;
}

/* (scale, zp) of one group of a row, or zeros when !ok. */
template <bool U4, bool VEC>
__device__ __forceinline__ void load_terms(const Gemv4Args &a, const float *sp, bool ok, float &s, float &zp) {
  if constexpr (VEC) {
    if (U4) {
      const float2 v = load_terms_pred(sp, ok);
      s = v.x, zp = v.y;
    } else {
      s = load_scale_pred(sp, ok), zp = 0.0f;
    }
    return;
  }
  s = 0.0f, zp = 0.0f;
  if (!ok) return;
  if (U4 && a.s_vec) {
    const float2 v = __ldg(reinterpret_cast<const float2 *>(sp));
    s = v.x, zp = v.y;
  } else {
    s = __ldg(sp);
    if (U4) zp = __ldg(sp + 1);
  }
}

/* Issue the loads of block b: units 8b + u_c and 8b + u_c + 2 of both rows (zeros where a unit or
 * row does not exist: they decode to 0 * 0). VEC: every operand allows its vector loads
 * (Gemv4Args' *_vec), so the loads are predicated rather than branched around. */
template <bool U4, bool VEC, int NG>
__device__ __forceinline__ void load_step(const Gemv4Args &a, const LaneRows<U4> &lr, int b, int c, StepIn<NG> &in) {
  const int u0 = 8 * b + lane_unit(c, 0);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const bool ok = u0 + 2 * j < a.units && lr.ok[h];
      const uint8_t *p = lr.w[h] + 128 * (int64_t)b + 32 * j;
      in.w[h][j] = VEC ? cq_load_stream16<false>(p, ok) : load_unit(p, ok, a.w_vec);
    }
#pragma unroll
    for (int i = 0; i < NG; ++i) {
      const int u = u0 + 2 * i;
      const bool ok = u < a.units && lr.ok[h];
      load_terms<U4, VEC>(a, lr.s[h] + (u >> a.unit_shift) * (U4 ? 2 : 1), ok, in.s[h][i], in.zp[h][i]);
    }
  }
}

/* The lane's 32 values of x row xr (or zeros) for unit u, paired for the mma as the decoders
 * pair the codes: b[2t] = x of codes (8j + 2h, 8j + 2h + 4), b[2t + 1] = x of codes
 * (8j + 2h + 1, 8j + 2h + 5), t = 2j + h. */
template <bool VEC>
__device__ __forceinline__ void x_operands(const uint16_t *xr, bool vec, uint32_t (&b)[16]) {
  uint32_t v[16]; /* v[r] = x[2r], x[2r + 1] */
  load_x32(xr, VEC || vec, v);
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    const int j = t >> 1, h = t & 1;
    b[2 * t] = cq_int4::prmt(v[4 * j + h], v[4 * j + h + 2], 0x5410u);
    b[2 * t + 1] = cq_int4::prmt(v[4 * j + h], v[4 * j + h + 2], 0x7632u);
  }
}

/* acc += one unit j of the step: k-tile t = 2w + h takes pairs 2h, 2h + 1 of word w of both rows. */
template <bool BF16, bool U4, bool TWO, bool FAST, int NG>
__device__ __forceinline__ void unit_mma(const StepIn<NG> &in, int j, const uint32_t (&b0)[16],
                                         const uint32_t (&b1)[16], float (&acc)[2][2][4]) {
  const int gi = NG == 2 ? j : 0;
  const uint32_t w0[4] = {in.w[0][j].x, in.w[0][j].y, in.w[0][j].z, in.w[0][j].w};
  const uint32_t w1[4] = {in.w[1][j].x, in.w[1][j].y, in.w[1][j].z, in.w[1][j].w};
  const cq_int4::Decoder16<BF16, U4> d0(in.s[0][gi], in.zp[0][gi]), d1(in.s[1][gi], in.zp[1][gi]);
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    const int w = t >> 1, i = 2 * (t & 1);
    uint32_t af[4];
    if (FAST) {
      af[0] = d0.pair(w0[w], i), af[2] = d0.pair(w0[w], i + 1);
      af[1] = d1.pair(w1[w], i), af[3] = d1.pair(w1[w], i + 1);
    } else {
      af[0] = cq_int4::pair32<BF16, U4>(w0[w], i, in.s[0][gi], in.zp[0][gi]);
      af[2] = cq_int4::pair32<BF16, U4>(w0[w], i + 1, in.s[0][gi], in.zp[0][gi]);
      af[1] = cq_int4::pair32<BF16, U4>(w1[w], i, in.s[1][gi], in.zp[1][gi]);
      af[3] = cq_int4::pair32<BF16, U4>(w1[w], i + 1, in.s[1][gi], in.zp[1][gi]);
    }
    cq_mma_16816_f32<BF16>(acc[t & 1][0], af, b0[2 * t], b0[2 * t + 1]);
    if (TWO) cq_mma_16816_f32<BF16>(acc[t & 1][1], af, b1[2 * t], b1[2 * t + 1]);
  }
}

/* TWO: x has more than 8 rows (a second n8 block of x rows). NG: groups a step's unit pair spans. */
template <bool BF16, bool U4, bool TWO, bool VEC, int NG, int DEPTH, int MAX_THREADS, int MIN_BLOCKS>
__global__ void __launch_bounds__(MAX_THREADS, MIN_BLOCKS) gemv4_mma_kernel(const Gemv4Args a) {
  typedef typename std::conditional<BF16, __nv_bfloat16, __half>::type T;
  __shared__ float partial[kWarps][8][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int64_t r0 = (int64_t)blockIdx.x * 16 + g;
  const uint16_t *x = static_cast<const uint16_t *>(a.x);
  const uint16_t *xr0 = g < a.m ? x + g * a.k : nullptr;
  const uint16_t *xr1 = g + 8 < a.m ? x + (g + 8) * a.k : nullptr;
  float acc[2][2][4] = {}; /* [k-tile parity: two independent mma chains][n8 block][element] */

  /* this warp's blocks: warp, warp + kw, ... (ns of them, ns >= 1 since kw <= blocks); step i
   * lands in pipe[i % kBufs], loaded DEPTH steps before it is used */
  const int ns = (a.blocks - warp + a.kw - 1) / a.kw;
  constexpr int kBufs = DEPTH + 1;
  const LaneRows<U4> lr(a, r0, c);
  StepIn<NG> pipe[kBufs];
#pragma unroll
  for (int d = 0; d < DEPTH; ++d)
    if (d < ns) load_step<U4, VEC, NG>(a, lr, warp + d * a.kw, c, pipe[d]);
  for (int i0 = 0; i0 < ns; i0 += kBufs) {
#pragma unroll
    for (int d = 0; d < kBufs; ++d) {
      const int i = i0 + d;
      if (i >= ns) break;
      if (i + DEPTH < ns) load_step<U4, VEC, NG>(a, lr, warp + (i + DEPTH) * a.kw, c, pipe[(d + DEPTH) % kBufs]);
      const StepIn<NG> &in = pipe[d];
      bool exact = true;
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int gi = 0; gi < NG; ++gi) exact = exact & cq_int4::exact16<BF16, U4>(in.s[h][gi], in.zp[h][gi]);
      /* one path for the whole warp: mma.sync is .aligned, every lane must issue the same one */
      const bool fast = __all_sync(0xffffffffu, exact);
      const int u0 = 8 * (warp + i * a.kw) + lane_unit(c, 0);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int u = u0 + 2 * j;
        const bool uok = u < a.units;
        uint32_t b0[16], b1[16];
        x_operands<VEC>(uok && xr0 ? xr0 + 32 * (int64_t)u : nullptr, a.x_vec, b0);
        if (TWO) x_operands<VEC>(uok && xr1 ? xr1 + 32 * (int64_t)u : nullptr, a.x_vec, b1);
        if (fast)
          unit_mma<BF16, U4, TWO, true, NG>(in, j, b0, b1, acc);
        else
          unit_mma<BF16, U4, TWO, false, NG>(in, j, b0, b1, acc);
      }
    }
  }

#pragma unroll
  for (int j = 0; j < 8; ++j) partial[warp][j][lane] = acc[0][j >> 2][j & 3] + acc[1][j >> 2][j & 3];
  __syncthreads();
  for (int v = threadIdx.x; v < 8 * 32; v += blockDim.x) {
    const int j = v >> 5, ln = v & 31;
    const int nb = j >> 2, i = j & 3; /* element i of n8 block nb, lane ln (see above) */
    const int64_t n = (int64_t)blockIdx.x * 16 + (ln >> 2) + ((i & 2) ? 8 : 0);
    const int64_t m = 8 * nb + 2 * (ln & 3) + (i & 1);
    if (n >= a.n || m >= a.m) continue;
    float sum = 0.0f;
    for (int s = 0; s < a.kw; ++s) sum += partial[s][j][ln];
    store_y<T>(a, m, n, sum);
  }
}

/* f32 x: one warp a weight row, lanes over units; sums of x w' in fp32 FMAs, then a warp sum. */
template <bool U4>
__global__ void __launch_bounds__(32 * kWarps) gemv4_f32_kernel(const Gemv4Args a) {
  const int lane = threadIdx.x & 31;
  const int64_t n = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (n >= a.n) return;
  const float *x = static_cast<const float *>(a.x);
  float acc[CQ_GEMV_MAX_M];
#pragma unroll
  for (int m = 0; m < CQ_GEMV_MAX_M; ++m) acc[m] = 0.0f;
  for (int u = lane; u < a.units; u += 32) {
    const uint4 wv = load_unit(a.w + n * a.ldw + 16 * (int64_t)u, true, a.w_vec);
    float s, zp;
    load_scale<U4>(a, n, u, true, s, zp);
    const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
    float wd[32];
#pragma unroll
    for (int i = 0; i < 32; ++i)
      wd[i] = __fmul_rn(cq_int4::nibble_value<U4>(words[i >> 3] >> (4 * (i & 7)), zp), s);
#pragma unroll
    for (int m = 0; m < CQ_GEMV_MAX_M; ++m) {
      if (m >= a.m) break;
      const float *xr = x + m * a.k + 32 * (int64_t)u;
      float sum = acc[m];
      if (a.x_vec) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float4 v = __ldg(reinterpret_cast<const float4 *>(xr) + i);
          sum = fmaf(v.x, wd[4 * i], sum), sum = fmaf(v.y, wd[4 * i + 1], sum);
          sum = fmaf(v.z, wd[4 * i + 2], sum), sum = fmaf(v.w, wd[4 * i + 3], sum);
        }
      } else {
#pragma unroll
        for (int i = 0; i < 32; ++i) sum = fmaf(__ldg(xr + i), wd[i], sum);
      }
      acc[m] = sum;
    }
  }
#pragma unroll
  for (int m = 0; m < CQ_GEMV_MAX_M; ++m) {
    if (m >= a.m) break;
    float v = acc[m];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) store_y<float>(a, m, n, v);
  }
}

/* Misaligned operands take the general loads, aligned ones the predicated loads. Registers are
 * capped where a CTA has at most four warps, so that enough CTAs share an SM to keep its loads in
 * flight (M > 8 at 128, kTwoCapBlocksPerSm). */
template <bool BF16, bool U4, bool TWO, int NG>
void launch_mma_ng(const Gemv4Args &a, int64_t grid, cudaStream_t s) {
  constexpr int kCapThreads = TWO ? 32 * kWarps : 128, kCapBlocks = TWO ? kTwoCapBlocksPerSm : kCapBlocksPerSm;
  const unsigned threads = 32 * a.kw;
  const bool vec = a.w_vec && a.x_vec && (a.s_vec || !U4);
  if (a.wide) /* vec, and at most three warps along K */
    gemv4_mma_kernel<BF16, U4, TWO, true, NG, 0, kCapThreads, TWO ? 1 : kWideCapBlocksPerSm>
        <<<(unsigned)grid, threads, 0, s>>>(a);
  else if (!vec)
    gemv4_mma_kernel<BF16, U4, TWO, false, NG, kDepth, 32 * kWarps, 1><<<(unsigned)grid, threads, 0, s>>>(a);
  else if (a.kw <= 4)
    gemv4_mma_kernel<BF16, U4, TWO, true, NG, kDepth, kCapThreads, kCapBlocks><<<(unsigned)grid, threads, 0, s>>>(a);
  else
    gemv4_mma_kernel<BF16, U4, TWO, true, NG, kDepth, 32 * kWarps, TWO ? kTwoCapBlocksPerSm : 1>
        <<<(unsigned)grid, threads, 0, s>>>(a);
}

/* A lane's two units of a step (u_c, u_c + 2) span two groups at group sizes 32 and 64. */
template <bool BF16, bool U4, bool TWO>
void launch_mma(const Gemv4Args &a, int64_t grid, cudaStream_t s) {
  if (a.unit_shift < 2) launch_mma_ng<BF16, U4, TWO, 2>(a, grid, s);
  else launch_mma_ng<BF16, U4, TWO, 1>(a, grid, s);
}

template <bool U4>
cq_status launch(const Gemv4Args &a, cq_dtype x_dtype, cudaStream_t s) {
  if (x_dtype == CQ_DTYPE_F32) {
    const int64_t grid = (a.n + kWarps - 1) / kWarps;
    if (grid > 0x7fffffffLL) return cq_fail(CQ_ERR_UNSUPPORTED, "gemv: N = %lld is too large", (long long)a.n);
    gemv4_f32_kernel<U4><<<(unsigned)grid, 32 * kWarps, 0, s>>>(a);
    CQ_LAUNCH_CHECK(gemv4_f32_kernel);
    return CQ_OK;
  }
  const int64_t grid = (a.n + 15) / 16;
  if (grid > 0x7fffffffLL) return cq_fail(CQ_ERR_UNSUPPORTED, "gemv: N = %lld is too large", (long long)a.n);
  const bool bf16 = x_dtype == CQ_DTYPE_BF16, two = a.m > 8;
  if (bf16 && two) launch_mma<true, U4, true>(a, grid, s);
  else if (bf16) launch_mma<true, U4, false>(a, grid, s);
  else if (two) launch_mma<false, U4, true>(a, grid, s);
  else launch_mma<false, U4, false>(a, grid, s);
  CQ_LAUNCH_CHECK(gemv4_mma_kernel);
  return CQ_OK;
}

}  // namespace

cq_status cq_gemv_group4_cuda(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale,
                              const cq_tensor *bias, const cq_linear_params *p, const cq_format_info *wf,
                              const cq_linear_out *out, void *stream) {
  const int64_t m = cq_rows(x), k = cq_cols(x), n = w->shape[0];
  if (wf->id != CQ_FORMAT_INT4 && wf->id != CQ_FORMAT_UINT4)
    return cq_fail(CQ_ERR_INTERNAL, "gemv_group4: format %s", wf->name);
  if (m > CQ_GEMV_MAX_M)
    return cq_fail(CQ_ERR_UNSUPPORTED, "gemv: x has %lld rows; the GEMV takes at most %d", (long long)m,
                   CQ_GEMV_MAX_M);
  const int64_t gs = p->weight_group_size;
  int shift = 0;
  while (shift < 6 && ((int64_t)32 << shift) < gs) ++shift;
  if (((int64_t)32 << shift) != gs || k % gs)
    return cq_fail(CQ_ERR_INVALID_ARG, "weight_group_size = %lld with K = %lld; expected a power of two in [%d, %d] "
                   "that divides K", (long long)gs, (long long)k, CQ_GROUP_SIZE_MIN, CQ_GROUP_SIZE_MAX);
  if (x->dtype != CQ_DTYPE_F32 && x->dtype != CQ_DTYPE_F16 && x->dtype != CQ_DTYPE_BF16)
    return cq_fail(CQ_ERR_TYPE, "gemv: x has dtype %s; expected float32, float16 or bfloat16", cq_dtype_name(x->dtype));
  if (out->y_dtype != x->dtype)
    return cq_fail(CQ_ERR_INTERNAL, "gemv: y dtype %s differs from x's", cq_dtype_name(out->y_dtype));
  CQ_TRY(cq_require_cc(x->device_id, CQ_MIN_CC_WEIGHT_ONLY, "the weight-only GEMV", NULL));
  cq_device_info dev;
  CQ_TRY(cq_device_info_get(x->device_id, &dev));
  if (m == 0 || n == 0) return CQ_OK;
  const int64_t units = k / 32, blocks = (units + 7) / 8;
  if (units > 0x3fffffffLL)
    return cq_fail(CQ_ERR_UNSUPPORTED, "gemv: rows of %lld codes are more than the kernel indexes", (long long)k);
  Gemv4Args a;
  a.x = x->data, a.w = static_cast<const uint8_t *>(w->data), a.sw = static_cast<const float *>(w_scale->data);
  a.bias = bias ? bias->data : nullptr, a.bias_dtype = bias ? bias->dtype : CQ_DTYPE_F32;
  a.activation = p->activation;
  a.m = m, a.n = n, a.k = k, a.ldw = cq_packed_row_bytes(wf, k), a.groups = k / gs;
  a.unit_shift = shift, a.units = (int)units, a.blocks = (int)blocks;
  /* k is a multiple of 32, so rows of x keep the alignment of its start */
  a.x_vec = (uintptr_t)x->data % 16 == 0;
  a.w_vec = (uintptr_t)w->data % 16 == 0 && a.ldw % 16 == 0;
  a.s_vec = (uintptr_t)w_scale->data % 8 == 0;
  const int64_t tiles = (n + 15) / 16, sms = dev.sms;
  a.wide = a.w_vec && a.x_vec && (a.s_vec || wf->id != CQ_FORMAT_UINT4) && tiles >= kWideTiles * sms;
  /* warps along K: enough for about kWarpsPerSm (kWideWarpsPerSm) warps an SM over the CTAs of
   * 16 rows, at most kWarps and one block of the row each (measured on an H200 at K = 3072:
   * N = 18432 best with 2 warps, 9216 with 3, 6144 with 4, 3072 with 8; wide: 3 at N = 18432,
   * never more) */
  const int64_t warps_per_sm = a.wide ? kWideWarpsPerSm : kWarpsPerSm;
  int64_t kw = (sms * warps_per_sm + tiles - 1) / tiles;
  if (kw > blocks) kw = blocks;
  a.kw = (int)(kw < 1 ? 1 : kw > kWarps ? kWarps : kw);
  a.out = *out;
  const cudaStream_t s = cq_stream(stream);
  return wf->id == CQ_FORMAT_UINT4 ? launch<true>(a, x->dtype, s) : launch<false>(a, x->dtype, s);
}
