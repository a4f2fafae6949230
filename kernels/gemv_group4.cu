/* Weight-only GEMV for 4-bit weights per group (int4, uint4) and M <= CQ_GEMV_MAX_M rows of x:
 * the packed weight is read once with 16-byte loads and decoded in registers.
 *
 * bf16 / f16 x: the decoded weights w' (x' of the format rounded to x's type, cquant.h) are the
 * A operand of mma.m16n8k16 and x^T its B operand (fp32 accumulation). A CTA owns 16 weight rows;
 * its kw warps split K in quads of 4 units, a unit being 32 codes (16 bytes) of a row. Lane
 * (g, c) = (lane / 4, lane % 4) decodes unit 4q + c of rows g and g + 8 and loads the same 32
 * values of x rows g (and g + 8 when M > 8). mma only needs A and B to agree on the order of k, so
 * k-tile t (0..7) of a quad takes codes 4t..4t+3 of each lane's unit:
 *   a0 = row g, codes 4t, 4t+1    a1 = row g+8, codes 4t, 4t+1   (k-slots 2c, 2c+1)
 *   a2 = row g, codes 4t+2, 4t+3  a3 = row g+8, codes 4t+2, 4t+3 (k-slots 2c+8, 2c+9)
 *   b0 = x[g][k of codes 4t, 4t+1]  b1 = x[g][k of codes 4t+2, 4t+3]
 * and the accumulator holds c0 = y[2c][g], c1 = y[2c+1][g], c2 = y[2c][g+8], c3 = y[2c+1][g+8]
 * (x rows 8.. in the second n8 block). Each lane streams its units through a cp.async ring in
 * shared memory, three quads ahead (GemvRing). The warps' partial sums meet in shared memory in
 * a fixed order; bias, activation and gated residual follow in fp32, rounded once.
 *
 * Decoding uses the magic-number trick at four bit positions p = 0, 4, 8, 12 of a word without
 * shifting each nibble down: 0x4B000000 | (n << p) is 2^23 + n 2^p, so one subtraction gives
 * n 2^p exactly and a multiply by scale 2^-p gives fp32(n * scale), the same real product
 * rounded once. That needs scale 2^-12 exact (|scale| >= 2^-114, or 0, inf, NaN) and, for uint4,
 * an integer zero point below 2048 in magnitude (2^23 + zp 2^p exact); other groups take the
 * plain per-nibble decode.
 *
 * f32 x: w' is not rounded, so no 16-bit mma takes it; a warp per weight row decodes units and
 * accumulates x w' in fp32 FMAs (x f32 is rare at these sizes; memory is not its limit). */
#include "int4_decode.cuh"
#include "linear_impl.cuh"
#include "ptx.cuh"

namespace {

constexpr int kWarps = 8;

struct Gemv4Args {
  const void *x;        /* [m, k] contiguous */
  const uint8_t *w;     /* [n, ldw] packed */
  const float *sw;      /* [n, groups, E] */
  const void *bias;     /* [n] or NULL */
  cq_dtype bias_dtype;
  int activation;
  int64_t m, n, k, ldw, groups;
  int unit_shift;       /* log2(group_size / 32): unit u lies in group u >> unit_shift */
  int units, quads, kw;
  int x_vec, w_vec;     /* 16-byte loads of x / of weight rows allowed */
  cq_linear_out out;
};

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

/* How a lane decodes one unit of one row: scale and zero point, and the fast-path constants. */
template <bool U4>
struct UnitDecoder {
  float s, zp;
  float sp[4], off[4];
  bool fast;

  __device__ __forceinline__ UnitDecoder(float scale, float zero) : s(scale), zp(zero) {
    const float as = fabsf(scale);
    fast = !(as < 0x1p-114f) || as == 0.0f;
    if (U4) fast = fast && zero == truncf(zero) && fabsf(zero) < 2048.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float pw = (float)(1 << (4 * i));
      sp[i] = __fmul_rn(scale, 1.0f / pw);
      off[i] = U4 ? __fadd_rn(8388608.0f, __fmul_rn(zero, pw)) : __fadd_rn(8388608.0f, 8.0f * pw);
    }
  }

  /* w' of the nibble at bit 4i of v (i = 0..3), the fast way. The mask and the magic bits go in
   * one lop3 ((v & mask) | magic, or ^ magic for int4's sign flip) with both constants in
   * registers: the compiler's form took two logic instructions a code. */
  __device__ __forceinline__ float at(uint32_t v, int i) const {
    const uint32_t mask = 0xFu << (4 * i), magic = U4 ? 0x4B000000u : 0x4B000000u | (8u << (4 * i));
    uint32_t bits;
    if (U4)
      asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(bits) : "r"(v), "r"(mask), "r"(magic)); /* (a & b) | c */
    else
      asm("lop3.b32 %0, %1, %2, %3, 0x6A;\n" : "=r"(bits) : "r"(v), "r"(mask), "r"(magic)); /* (a & b) ^ c */
    return __fmul_rn(__fsub_rn(__uint_as_float(bits), off[i]), sp[i]);
  }

  /* Codes 4h..4h+3 of word v (h = 0, 1) as two 16-bit pairs: (4h, 4h+1) and (4h+2, 4h+3). */
  template <bool BF16>
  __device__ __forceinline__ void quad(uint32_t v, int h, uint32_t &p01, uint32_t &p23) const {
    const uint32_t u = h ? v >> 16 : v;
    if (fast) {
      p01 = cq_int4::pack2<BF16>(at(u, 0), at(u, 1));
      p23 = cq_int4::pack2<BF16>(at(u, 2), at(u, 3));
    } else {
      p01 = cq_int4::byte_to_pair<BF16, U4>(u, s, zp);
      p23 = cq_int4::byte_to_pair<BF16, U4>(u >> 8, s, zp);
    }
  }
};

template <typename T>
__device__ __forceinline__ void store_y(const Gemv4Args &a, int64_t m, int64_t n, float sum) {
  const float b = a.bias ? cq_load_any(a.bias, a.bias_dtype, n) : 0.0f;
  const float v = cq_out_value<T>(a.out, m, n, cq_activate(__fadd_rn(sum, b), a.activation));
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

/* The ring of the mma GEMV: each lane streams its own units (rows g and g + 8) and their scales
 * through kStages slots of shared memory with cp.async, kStages - 1 quads ahead of the one it
 * decodes, so in-flight bytes cost no registers. A lane reads back only what it wrote itself:
 * its cp.async.wait_group makes that visible, no barrier needed. [stage][row][thread] keeps
 * the 16-byte reads of 8 neighbouring lanes on distinct banks. */
constexpr int kStages = 4;
struct GemvRing {
  uint4 w[kStages][2][32 * kWarps];
  float s[kStages][4][32 * kWarps]; /* row g: scale, zp; row g + 8: scale, zp */
};

__device__ __forceinline__ void cp_async4(void *dst, const void *src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(cq_smem_addr(dst)), "l"(src),
               "r"(valid ? 4 : 0)
               : "memory");
}

/* Request quad q's units of rows r0, r0 + 8 and their scales into slot st (zeros where a unit or
 * row does not exist: such weights decode to 0 * 0). */
template <bool U4>
__device__ __forceinline__ void ring_issue(GemvRing &R, int st, const Gemv4Args &a, int q, int c, int64_t r0) {
  const int tid = threadIdx.x, u = 4 * q + c;
  const bool uok = u < a.units;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = r0 + 8 * h;
    const bool ok = uok && row < a.n;
    const uint8_t *src = ok ? a.w + row * a.ldw + 16 * (int64_t)u : a.w;
    if (a.w_vec) {
      cq_cp_async16(&R.w[st][h][tid], src, ok);
    } else {
      R.w[st][h][tid] = load_unit(src, ok, false);
    }
    const float *sp = ok ? a.sw + (row * a.groups + (u >> a.unit_shift)) * (U4 ? 2 : 1) : a.sw;
    cp_async4(&R.s[st][2 * h][tid], sp, ok);
    if (U4) cp_async4(&R.s[st][2 * h + 1][tid], sp + (ok ? 1 : 0), ok);
  }
}

/* Quad q (slot st) into acc: x rows g (and g + 8) of the lane's unit are loaded here. */
template <bool BF16, bool U4, bool TWO>
__device__ __forceinline__ void ring_compute(const GemvRing &R, int st, const Gemv4Args &a, int q, int c,
                                             const uint16_t *xr0, const uint16_t *xr1, float (&acc)[2][4]) {
  const int tid = threadIdx.x, u = 4 * q + c;
  const bool uok = u < a.units;
  uint32_t x0[16], x1[16];
  load_x32(uok && xr0 ? xr0 + 32 * (int64_t)u : nullptr, a.x_vec, x0);
  if (TWO) load_x32(uok && xr1 ? xr1 + 32 * (int64_t)u : nullptr, a.x_vec, x1);
  const uint4 wa = R.w[st][0][tid], wb = R.w[st][1][tid];
  const UnitDecoder<U4> d0(R.s[st][0][tid], U4 ? R.s[st][1][tid] : 0.0f);
  const UnitDecoder<U4> d1(R.s[st][2][tid], U4 ? R.s[st][3][tid] : 0.0f);
  const uint32_t w0[4] = {wa.x, wa.y, wa.z, wa.w}, w1[4] = {wb.x, wb.y, wb.z, wb.w};
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    uint32_t af[4];
    d0.template quad<BF16>(w0[t >> 1], t & 1, af[0], af[2]);
    d1.template quad<BF16>(w1[t >> 1], t & 1, af[1], af[3]);
    cq_mma_16816_f32<BF16>(acc[0], af, x0[2 * t], x0[2 * t + 1]);
    if (TWO) cq_mma_16816_f32<BF16>(acc[1], af, x1[2 * t], x1[2 * t + 1]);
  }
}

/* TWO: x has more than 8 rows (a second n8 block of x rows). */
template <bool BF16, bool U4, bool TWO>
__global__ void __launch_bounds__(32 * kWarps) gemv4_mma_kernel(const Gemv4Args a) {
  typedef typename std::conditional<BF16, __nv_bfloat16, __half>::type T;
  __shared__ __align__(16) GemvRing ring;
  static_assert(sizeof(float) * kWarps * 8 * 32 <= sizeof(ring.w), "partial sums reuse the ring");
  float(*partial)[8][32] = reinterpret_cast<float(*)[8][32]>(&ring.w[0][0][0]);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int64_t r0 = (int64_t)blockIdx.x * 16 + g;
  const uint16_t *x = static_cast<const uint16_t *>(a.x);
  const uint16_t *xr0 = g < a.m ? x + g * a.k : nullptr;
  const uint16_t *xr1 = g + 8 < a.m ? x + (g + 8) * a.k : nullptr;
  float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};

  /* this warp's quads: warp, warp + kw, ... (nq of them, nq >= 1 since kw <= quads) */
  const int nq = (a.quads - warp + a.kw - 1) / a.kw;
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < nq) ring_issue<U4>(ring, i, a, warp + i * a.kw, c, r0);
    cq_cp_async_commit();
  }
  for (int i = 0; i < nq; ++i) {
    cq_cp_async_wait<kStages - 2>(); /* quad i has landed */
    /* refill the slot quad i - 1 used (this lane's reads of it are done) */
    const int ni = i + kStages - 1;
    if (ni < nq) ring_issue<U4>(ring, ni % kStages, a, warp + ni * a.kw, c, r0);
    cq_cp_async_commit();
    ring_compute<BF16, U4, TWO>(ring, i % kStages, a, warp + i * a.kw, c, xr0, xr1, acc);
  }
  cq_cp_async_wait<0>();
  __syncthreads(); /* every warp is done with the ring before the partial sums overwrite it */

#pragma unroll
  for (int j = 0; j < 8; ++j) partial[warp][j][lane] = acc[j >> 2][j & 3];
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
  const unsigned threads = 32 * a.kw;
  const bool bf16 = x_dtype == CQ_DTYPE_BF16, two = a.m > 8;
  if (bf16 && two) gemv4_mma_kernel<true, U4, true><<<(unsigned)grid, threads, 0, s>>>(a);
  else if (bf16) gemv4_mma_kernel<true, U4, false><<<(unsigned)grid, threads, 0, s>>>(a);
  else if (two) gemv4_mma_kernel<false, U4, true><<<(unsigned)grid, threads, 0, s>>>(a);
  else gemv4_mma_kernel<false, U4, false><<<(unsigned)grid, threads, 0, s>>>(a);
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
  if (m == 0 || n == 0) return CQ_OK;
  const int64_t units = k / 32, quads = (units + 3) / 4;
  if (units > 0x3fffffffLL)
    return cq_fail(CQ_ERR_UNSUPPORTED, "gemv: rows of %lld codes are more than the kernel indexes", (long long)k);
  Gemv4Args a;
  a.x = x->data, a.w = static_cast<const uint8_t *>(w->data), a.sw = static_cast<const float *>(w_scale->data);
  a.bias = bias ? bias->data : nullptr, a.bias_dtype = bias ? bias->dtype : CQ_DTYPE_F32;
  a.activation = p->activation;
  a.m = m, a.n = n, a.k = k, a.ldw = cq_packed_row_bytes(wf, k), a.groups = k / gs;
  a.unit_shift = shift, a.units = (int)units, a.quads = (int)quads;
  a.kw = (int)(quads < kWarps ? quads : kWarps);
  /* k is a multiple of 32, so rows of x keep the alignment of its start */
  a.x_vec = (uintptr_t)x->data % 16 == 0;
  a.w_vec = (uintptr_t)w->data % 16 == 0 && a.ldw % 16 == 0;
  a.out = *out;
  const cudaStream_t s = cq_stream(stream);
  return wf->id == CQ_FORMAT_UINT4 ? launch<true>(a, x->dtype, s) : launch<false>(a, x->dtype, s);
}
