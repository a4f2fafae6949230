/* Mixed-input GEMM on Hopper warpgroup tensor cores (sm_90a): 4-bit weights per group (int4,
 * uint4) times bf16/fp16 activations, the weights decoded in registers between the shared-memory
 * load and the MMA (cquant.h, "4-bit weights per group": w' = x' of the format, fp32, rounded to
 * the activations' type).
 *
 * wgmma takes only its A operand from registers, so the weights are A: each tile computes
 * D[128 weights x BN tokens] = W'[128, K] . X[BN, K]^T and the epilogue writes D transposed
 * into y [M, N]. Persistent and warp-specialized like gemm_wgmma.cu: warpgroup 0 is the producer
 * (one thread issues TMA loads of a BN x 64 activation tile, 128-byte swizzled, and of the
 * 128 x 32-byte packed weight tile into a ring of stages tracked by mbarriers); warpgroups 1
 * and 2 each own 64 weight rows: per stage they read their packed rows, decode them (fp32:
 * (code - zp) * scale, rounded to bf16/fp16) into the A fragments of four k16 steps, issue the
 * four wgmma and keep one stage in flight, so the decode of stage k+1 runs under the MMAs of
 * stage k (the fragments are double-buffered: wgmma reads its registers asynchronously).
 *
 * Stored nibbles are plain (code 2i in the low nibble of byte i): fragment register r of a
 * k16 step needs codes (2q, 2q+1) or (2q+8, 2q+9) of a row, q = lane % 4, i.e. byte q of the
 * step's two 4-byte words; one byte permute gathers both for a row. */
#include <cuda.h>

#include <atomic>

#include "gemm8_common.cuh"
#include "gemm_mixed_wgmma.cuh"
#include "tensor_map.cuh"

using namespace cq_gemm8;

namespace {

constexpr int BM = 128;          /* weight rows a tile: two consumer warpgroups of 64 */
constexpr int BK = 64;           /* codes of K a stage: one 128-byte swizzle row of 16-bit activations */
constexpr int kWRowBytes = BK / 2; /* packed bytes of one weight row a stage */
constexpr int THREADS = 384;

template <int BN> struct mx_config {
  static constexpr int kStages = BN == 256 ? 5 : 8;
  static constexpr int kTileX = BN * BK * 2;      /* 1024-byte multiple: stages stay swizzle-aligned */
  static constexpr int kTileW = BM * kWRowBytes;
  static constexpr int kStageBytes = kTileX + kTileW;
  static constexpr int kSmemBytes = kStages * kStageBytes + 1024; /* + slack to align to 1024 */
};

struct mx_params {
  int64_t m, n, k;
  int64_t tiles_m, tiles_n; /* token tiles (BN) and weight tiles (BM) */
  const float *sw;          /* [N, G] or [N, G, 2] */
  int64_t groups;           /* G */
  int group_shift;          /* log2(group_size) */
  float sym_zero;           /* 8: the zero point of int4's codes once flipped to code + 8. A kernel
                               argument, not a constant: with the exactness test of zero points
                               left in, the compiler decodes a whole stage before its wgmma
                               instead of interleaving (and serializing) them */
  epilogue e;               /* y [M, N]; sa, sb unused (1) */
};

#ifdef CQ_SM90A_DEVICE

__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

constexpr float kMagic = 8388608.0f; /* 2^23: 0x4B000000 | u is 2^23 + u exactly */

/* Scale and zero point of group gi of weight row n; groups or rows past the tensor get scale 0,
 * so the zero-filled tiles there add exact zeros. */
template <bool UINT4>
__device__ __forceinline__ float2 group_terms(const mx_params &p, int64_t n, int64_t gi) {
  if (n >= p.n || gi >= p.groups) return make_float2(0.0f, p.sym_zero);
  if constexpr (UINT4) return __ldg(reinterpret_cast<const float2 *>(p.sw) + n * p.groups + gi);
  return make_float2(__ldg(p.sw + n * p.groups + gi), p.sym_zero);
}

template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&v);
}

/* (u - zp) * s for the nibble of p at bit `shift`; zc = 2^23 + zp, exact (checked by the caller). */
__device__ __forceinline__ float nib_fast(uint32_t p, int shift, float zc, float s) {
  return __fmul_rn(__fsub_rn(__uint_as_float(0x4B000000u | ((p >> shift) & 0xFu)), zc), s);
}
/* The same for any zero point: u exact first, then u - zp rounded as fp32 rounds it. */
__device__ __forceinline__ float nib_exact(uint32_t p, int shift, float zp, float s) {
  return __fmul_rn(__fsub_rn(__fsub_rn(__uint_as_float(0x4B000000u | ((p >> shift) & 0xFu)), kMagic), zp), s);
}

/* A fragments of one k16 step from the gathered bytes of rows A (g) and B (g + 8):
 * pa = [A codes (2q, 2q+1), A codes (2q+8, 2q+9)], pb likewise; ta/tb = (scale, zp or zc). */
template <typename T, bool FAST>
__device__ __forceinline__ void decode_step(uint32_t pa, uint32_t pb, float2 ta, float2 tb, uint32_t (&a)[4]) {
  if constexpr (FAST) {
    a[0] = pack2<T>(nib_fast(pa, 0, ta.y, ta.x), nib_fast(pa, 4, ta.y, ta.x));
    a[1] = pack2<T>(nib_fast(pb, 0, tb.y, tb.x), nib_fast(pb, 4, tb.y, tb.x));
    a[2] = pack2<T>(nib_fast(pa, 8, ta.y, ta.x), nib_fast(pa, 12, ta.y, ta.x));
    a[3] = pack2<T>(nib_fast(pb, 8, tb.y, tb.x), nib_fast(pb, 12, tb.y, tb.x));
  } else {
    a[0] = pack2<T>(nib_exact(pa, 0, ta.y, ta.x), nib_exact(pa, 4, ta.y, ta.x));
    a[1] = pack2<T>(nib_exact(pb, 0, tb.y, tb.x), nib_exact(pb, 4, tb.y, tb.x));
    a[2] = pack2<T>(nib_exact(pa, 8, ta.y, ta.x), nib_exact(pa, 12, ta.y, ta.x));
    a[3] = pack2<T>(nib_exact(pb, 8, tb.y, tb.x), nib_exact(pb, 12, tb.y, tb.x));
  }
}

/* The four k16 steps of a stage. wa/wb: the 8 words of rows A and B; t[0..1] the terms of the
 * stage's first and second 32 codes (one group unless group_size is 32). */
template <typename T, bool UINT4, bool FAST>
__device__ __forceinline__ void decode_stage(const uint32_t (&wa)[8], const uint32_t (&wb)[8], uint32_t sel,
                                             const float2 (&ta)[2], const float2 (&tb)[2], uint32_t (&f)[4][4]) {
#pragma unroll
  for (int st = 0; st < 4; ++st) {
    uint32_t pa = __byte_perm(wa[2 * st], wa[2 * st + 1], sel), pb = __byte_perm(wb[2 * st], wb[2 * st + 1], sel);
    if constexpr (!UINT4) pa ^= 0x8888u, pb ^= 0x8888u; /* two's complement -> code + 8 */
    decode_step<T, FAST>(pa, pb, ta[st / 2], tb[st / 2], f[st]);
  }
}

/* zc = 2^23 + zp when that sum is exact (every zero point the quantizer writes), so that one
 * subtraction gives u - zp; *exact is cleared otherwise. */
__device__ __forceinline__ float2 fast_terms(float2 t, bool *exact) {
  const float zc = __fadd_rn(kMagic, t.y);
  if (!(__fsub_rn(zc, kMagic) == t.y)) *exact = false;
  return make_float2(t.x, zc);
}

/* One output of the tile: y[m, n] = act(acc + b[n]), gated where the layer is. */
template <typename OutT>
__device__ __forceinline__ void store_one(const epilogue &e, int64_t m, int64_t n, float acc, float b) {
  if (m >= e.m || n >= e.n) return;
  const float v = scale_value(acc, 1.0f, 1.0f, b, e.activation);
  static_cast<OutT *>(e.y)[m * e.ldy + n] = cq_from_float<OutT>(gated<OutT>(e, gate_row_of(e, m), n, v));
}

#endif /* CQ_SM90A_DEVICE */

template <int BN, typename T, bool UINT4>
__global__ void __launch_bounds__(THREADS, 1)
    gemm_mixed_kernel(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w,
                      const mx_params p) {
#ifdef CQ_SM90A_DEVICE
  typedef mx_config<BN> cfg;
  constexpr int S = cfg::kStages;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[S], empty_bar[S];

  const uint32_t raw = cq_smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u; /* swizzle atoms are 1024-byte aligned */
  uint8_t *const gbase = smem_raw + (base - raw);
  const int wg = threadIdx.x / 128, lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
  const int ktiles = (int)((p.k + BK - 1) / BK);
  const int64_t tiles = p.tiles_m * p.tiles_n;

  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      cq_mbar_init(cq_smem_addr(&full_bar[s]), 1);  /* the producer's expect_tx */
      cq_mbar_init(cq_smem_addr(&empty_bar[s]), 8); /* lane 0 of each consumer warp */
    }
    cq_mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
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
          const uint32_t sx = base + s * cfg::kStageBytes;
          cq_tma_load_2d(sx, &map_x, full, kt * BK, (int32_t)(tm * BN));
          cq_tma_load_2d(sx + cfg::kTileX, &map_w, full, kt * kWRowBytes, (int32_t)(tn * BM));
        }
      }
    }
    return;
  }

  cq_setmaxnreg_inc<232>();
  const int c = wg - 1, g = lane >> 2, q = lane & 3;
  const int row_a = c * 64 + warp * 16 + g; /* this thread's weight rows in the tile: row_a, row_a + 8 */
  const uint32_t sel = (uint32_t)q | ((uint32_t)(q + 4) << 4);
  float acc[BN / 2];
  uint32_t f0[4][4], f1[4][4];
  uint32_t it = 0;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    int64_t tm, tn;
    tile_of(tile, p.tiles_m, p.tiles_n, &tm, &tn);
    const int64_t na = tn * BM + row_a, nb = na + 8;
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
    cq_fence_regs(acc);
    uint32_t prev = 0;

    /* one stage: terms, wait, decode into f, four wgmma, release the stage before */
    auto stage = [&](int kt, uint32_t(&f)[4][4]) {
      const int64_t g0 = ((int64_t)kt * BK) >> p.group_shift, g1 = ((int64_t)kt * BK + 32) >> p.group_shift;
      bool exact = true;
      const float2 ta[2] = {fast_terms(group_terms<UINT4>(p, na, g0), &exact),
                            fast_terms(group_terms<UINT4>(p, na, g1), &exact)};
      const float2 tb[2] = {fast_terms(group_terms<UINT4>(p, nb, g0), &exact),
                            fast_terms(group_terms<UINT4>(p, nb, g1), &exact)};
      const uint32_t s = it % S, phase = (it / S) & 1u;
      cq_mbar_wait(cq_smem_addr(&full_bar[s]), phase);
      const uint8_t *wt = gbase + s * cfg::kStageBytes + cfg::kTileX;
      const uint4 a0 = *reinterpret_cast<const uint4 *>(wt + row_a * kWRowBytes);
      const uint4 a1 = *reinterpret_cast<const uint4 *>(wt + row_a * kWRowBytes + 16);
      const uint4 b0 = *reinterpret_cast<const uint4 *>(wt + (row_a + 8) * kWRowBytes);
      const uint4 b1 = *reinterpret_cast<const uint4 *>(wt + (row_a + 8) * kWRowBytes + 16);
      const uint32_t wa[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const uint32_t wb[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
      if (exact) {
        decode_stage<T, UINT4, true>(wa, wb, sel, ta, tb, f);
      } else { /* zero points whose 2^23 + zp rounds: undo the shortcut */
        const float2 ra[2] = {group_terms<UINT4>(p, na, g0), group_terms<UINT4>(p, na, g1)};
        const float2 rb[2] = {group_terms<UINT4>(p, nb, g0), group_terms<UINT4>(p, nb, g1)};
        decode_stage<T, UINT4, false>(wa, wb, sel, ra, rb, f);
      }
      const uint64_t dx = smem_desc(base + s * cfg::kStageBytes);
      /* a group per k16 step: a decode the compiler schedules between two steps then lies
       * outside every group, which keeps the wgmma of a stage from being serialized */
#pragma unroll
      for (int st = 0; st < 4; ++st) {
        cq_fence_regs(f[st]);
        cq_wgmma_fence();
        cq_mixed::wgmma_rs<BN, T>(acc, f[st], dx + 2 * st); /* +32 bytes of K */
        cq_wgmma_commit();
      }
      cq_wgmma_wait<4>(); /* the previous stage's wgmma are done: its tile and fragments are free */
      if (kt > 0 && lane == 0) cq_mbar_arrive(cq_smem_addr(&empty_bar[prev]));
      prev = s;
      ++it;
    };
    for (int kt = 0; kt < ktiles; kt += 2) {
      stage(kt, f0);
      if (kt + 1 < ktiles) stage(kt + 1, f1);
    }
    cq_wgmma_wait<0>();
    cq_fence_regs(acc);
    if (lane == 0) cq_mbar_arrive(cq_smem_addr(&empty_bar[prev]));

    /* accumulator 4j + i: weight row na (i < 2) or nb, token tm * BN + 8j + 2q + (i & 1) */
    const float bias_a = na < p.n && p.e.bias ? cq_load_any(p.e.bias, p.e.bias_dtype, na) : 0.0f;
    const float bias_b = nb < p.n && p.e.bias ? cq_load_any(p.e.bias, p.e.bias_dtype, nb) : 0.0f;
    const int64_t m0 = tm * BN + 2 * q;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      store_one<T>(p.e, m0 + 8 * j, na, acc[4 * j], bias_a);
      store_one<T>(p.e, m0 + 8 * j + 1, na, acc[4 * j + 1], bias_a);
      store_one<T>(p.e, m0 + 8 * j, nb, acc[4 * j + 2], bias_b);
      store_one<T>(p.e, m0 + 8 * j + 1, nb, acc[4 * j + 3], bias_b);
    }
  }
#else
  (void)map_x, (void)map_w, (void)p;
  __trap(); /* not built for sm_90a: the host never selects this kernel then */
#endif
}

template <int BN, typename T, bool UINT4>
cq_status launch(const cq_mixed_args *g, mx_params p, int sms, cudaStream_t s) {
  typedef mx_config<BN> cfg;
  p.tiles_m = (g->m + BN - 1) / BN;
  p.tiles_n = (g->n + BM - 1) / BM;
  CUtensorMap map_x, map_w;
  const uint64_t xdims[2] = {(uint64_t)g->k, (uint64_t)g->m}, xstrides[1] = {(uint64_t)g->lda * 2};
  const uint32_t xbox[2] = {(uint32_t)BK, (uint32_t)BN};
  CQ_TRY(cq_tensor_map(&map_x, g->a_dtype == CQ_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                       2, g->a, xdims, xstrides, xbox, CU_TENSOR_MAP_SWIZZLE_128B, "activations"));
  /* the codes of K only: bytes past them (row padding) read as zeros */
  const uint64_t wdims[2] = {(uint64_t)(g->k / 2), (uint64_t)g->n}, wstrides[1] = {(uint64_t)g->ldw};
  const uint32_t wbox[2] = {(uint32_t)kWRowBytes, (uint32_t)BM};
  CQ_TRY(cq_tensor_map(&map_w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, g->w, wdims, wstrides, wbox,
                       CU_TENSOR_MAP_SWIZZLE_NONE, "weight"));
  auto kernel = gemm_mixed_kernel<BN, T, UINT4>;
  CQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, cfg::kSmemBytes));
  const int64_t tiles = p.tiles_m * p.tiles_n;
  const unsigned grid = (unsigned)(tiles < sms ? tiles : sms);
  kernel<<<grid, THREADS, cfg::kSmemBytes, s>>>(map_x, map_w, p);
  CQ_LAUNCH_CHECK(gemm_mixed_kernel);
  return CQ_OK;
}

template <int BN, typename T>
cq_status launch_format(const cq_mixed_args *g, const mx_params &p, int sms, cudaStream_t s) {
  return g->w_format == CQ_FORMAT_UINT4 ? launch<BN, T, true>(g, p, sms, s) : launch<BN, T, false>(g, p, sms, s);
}

template <int BN>
cq_status launch_type(const cq_mixed_args *g, const mx_params &p, int sms, cudaStream_t s) {
  return g->a_dtype == CQ_DTYPE_BF16 ? launch_format<BN, __nv_bfloat16>(g, p, sms, s)
                                     : launch_format<BN, __half>(g, p, sms, s);
}

/* Whether this build holds the sm_90a kernel and the device runs it (its loaded image is the
 * sm_90a one, checked once per device), unless CQUANT_DISABLE_WGMMA turns it off. */
bool usable(int device, int *sms) {
  cq_device_info info;
  if (cq_settings_now().disable_wgmma || cq_device_info_get(device, &info) != CQ_OK || !cq_cc_runs_sm90a(info.cc))
    return false;
  static std::atomic<signed char> image_ok[64]; /* 0 unknown, 1 yes, -1 no */
  if (device < 0 || device >= 64) return false;
  signed char ok = image_ok[device].load(std::memory_order_relaxed);
  if (!ok) { /* the device is current (the dispatch made it so) */
    cudaFuncAttributes attr;
    ok = cudaFuncGetAttributes(&attr, gemm_mixed_kernel<128, __nv_bfloat16, false>) == cudaSuccess &&
                 attr.binaryVersion == 90
             ? 1
             : -1;
    cudaGetLastError(); /* a failed query leaves no sticky error behind */
    image_ok[device].store(ok, std::memory_order_relaxed);
  }
  *sms = info.sms;
  return ok > 0;
}

}  // namespace

cq_status cq_gemm_mixed_sm90_cuda(const cq_mixed_args *g, int device, cudaStream_t stream, int *launched) {
  *launched = 0;
  const bool grouped = g->w_format == CQ_FORMAT_INT4 || g->w_format == CQ_FORMAT_UINT4;
  if (g->a_format != CQ_FORMAT_NONE || !grouped || g->w_granularity != CQ_GRANULARITY_GROUP) return CQ_OK;
  if (g->a_dtype != CQ_DTYPE_BF16 && g->a_dtype != CQ_DTYPE_F16) return CQ_OK;
  if (g->out.y_dtype != g->a_dtype || g->m < 1 || g->n < 1) return CQ_OK;
  const int64_t gs = g->group_size;
  if (gs < 32 || (gs & (gs - 1)) || g->k % gs) return CQ_OK;
  /* TMA: 16-byte aligned bases and row strides, coordinates within int32 */
  if (((uintptr_t)g->a & 15) || ((uintptr_t)g->w & 15) || ((g->lda * 2) & 15) || (g->ldw & 15) ||
      g->m > 0x7fffffffLL || g->n > 0x7fffffffLL || g->k > 0x7fffffffLL)
    return CQ_OK;
  int sms = 0;
  if (!usable(device, &sms)) return CQ_OK;
  mx_params p = {};
  p.m = g->m, p.n = g->n, p.k = g->k;
  p.sw = g->sw;
  p.groups = g->k / gs;
  p.sym_zero = 8.0f;
  p.group_shift = 0;
  while ((int64_t)1 << p.group_shift < gs) ++p.group_shift;
  epilogue &e = p.e;
  e.sa = nullptr, e.sb = nullptr, e.sb_stride = 0;
  e.bias = g->bias, e.bias_dtype = g->bias_dtype;
  e.y = g->out.y, e.m = g->m, e.n = g->n, e.ldy = g->out.ldy;
  e.pair_ok = 0;
  e.activation = g->activation;
  e.gate = g->out.gate, e.gate_dtype = g->out.gate_dtype, e.ldg = g->out.ldg;
  e.rows_per_sample = g->out.rows_per_sample;
  e.residual = g->out.residual, e.ldr = g->out.ldr;
  /* The token-tile width whose last wave is fullest: time ~ waves x BN. */
  const int64_t wt = (g->n + BM - 1) / BM;
  const int64_t t256 = wt * ((g->m + 255) / 256), t128 = wt * ((g->m + 127) / 128);
  const int64_t cost256 = (t256 + sms - 1) / sms * 256, cost128 = (t128 + sms - 1) / sms * 128;
  CQ_TRY(cost256 < cost128 ? launch_type<256>(g, p, sms, stream) : launch_type<128>(g, p, sms, stream));
  *launched = 1;
  return CQ_OK;
}
