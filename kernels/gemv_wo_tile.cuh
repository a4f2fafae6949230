/* The weight-only GEMV with one CTA per tile of 16 weight rows, its warps splitting K
 * (gemv_wo.cuh). The units of the next step are requested before the current ones are decoded
 * (two register buffers), so every lane keeps 64-112 bytes (two rows) in flight. Instantiated
 * per decoder family in gemv_wo_tile_8bit.cu, _fp46.cu and _fp357.cu (each a TU of its own:
 * one TU of every instantiation took minutes to compile). */
#ifndef CQ_KERNELS_GEMV_WO_TILE_CUH
#define CQ_KERNELS_GEMV_WO_TILE_CUH

#include "gemv_wo.cuh"

namespace cq_wo {

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

/* The launchers of one decoder: [x mode]. */
#define CQ_GEMV_TILE_MODES(C) { launch_gemv<C, kXBf16>, launch_gemv<C, kXF16>, launch_gemv<C, kXSplit> }

}  // namespace cq_wo

#endif /* CQ_KERNELS_GEMV_WO_TILE_CUH */
