/* Pieces shared by the 8-bit GEMM kernels: the swizzled shared-memory tile
 * layout and the scale/bias epilogue (the PTX wrappers are in ptx.cuh). */
#ifndef CQ_KERNELS_GEMM8_COMMON_CUH
#define CQ_KERNELS_GEMM8_COMMON_CUH

#include "linear_impl.cuh"
#include "ptx.cuh"

namespace cq_gemm8 {

/* A tile row holds 128 bytes of K (8 chunks of 16 B). Chunk c of row r sits at
 * chunk c ^ (r & 7): the 128-byte swizzle of TMA and wgmma, which also keeps
 * ldmatrix (8 rows, one chunk) free of bank conflicts. */
constexpr int kRowBytes = 128;

__device__ __forceinline__ uint32_t swizzle(int row, int chunk) {
  return (uint32_t)(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
}

/* Epilogue arguments, by value. */
struct epilogue {
  const float *sa, *sb;
  int sb_stride;
  const void *bias;
  cq_dtype bias_dtype;
  void *y;
  int64_t m, n, ldy; /* y [m, n], row stride ldy */
  int pair_ok;    /* y rows allow 2-element stores (ldy even, y aligned) */
  int activation; /* a cq_activation */
  const void *gate; /* gated residual (cq_gemm8_args), or NULL */
  cq_dtype gate_dtype;
  int64_t ldg, rows_per_sample;
  const void *residual; /* y's element type, row stride ldr */
  int64_t ldr;
};

/* The epilogue of a GEMM's arguments (host side). */
inline epilogue epilogue_of(const cq_gemm8_args *g) {
  epilogue e;
  e.sa = g->sa, e.sb = g->sb, e.sb_stride = g->sb_stride, e.bias = g->bias, e.bias_dtype = g->bias_dtype;
  e.y = g->y, e.m = g->m, e.n = g->n, e.ldy = g->ldy;
  e.pair_ok = g->ldy % 2 == 0 && ((uintptr_t)g->y % (2 * cq_dtype_size(g->y_dtype))) == 0;
  e.activation = g->activation;
  e.gate = g->gate, e.gate_dtype = g->gate_dtype, e.ldg = g->ldg, e.rows_per_sample = g->rows_per_sample;
  e.residual = g->residual, e.ldr = g->ldr;
  return e;
}

/* Where row `row` of a gated layer reads its gate and residual: element offsets of the row. */
struct gate_row {
  int64_t g, r;
};

__device__ __forceinline__ gate_row gate_row_of(const epilogue &e, int64_t row) {
  gate_row gr;
  gr.g = e.gate ? (row / e.rows_per_sample) * e.ldg : 0;
  gr.r = row * e.ldr;
  return gr;
}

/* The stored value of column col of a row: v, or residual + gate * v for a gated layer. */
template <typename OutT>
__device__ __forceinline__ float gated(const epilogue &e, const gate_row &gr, int64_t col, float v) {
  if (!e.gate) return v;
  return cq_gate_residual(v, cq_load_any(e.gate, e.gate_dtype, gr.g + col),
                          cq_to_float(static_cast<const OutT *>(e.residual)[gr.r + col]));
}

__device__ __forceinline__ uint16_t bits16(__half h) { return __half_as_ushort(h); }
__device__ __forceinline__ uint16_t bits16(__nv_bfloat16 h) { return __bfloat16_as_ushort(h); }

/* y = act(acc * sa[row] * sb[col] + bias[col]), in that order, no contraction. */
__device__ __forceinline__ float scale_value(float acc, float sa, float sb, float b, int activation) {
  return cq_activate(__fadd_rn(__fmul_rn(__fmul_rn(acc, sa), sb), b), activation);
}

/* Two neighbouring outputs (row, col) and (row, col + 1) of the accumulator, gated where the
 * layer is. col is even; either may lie outside [m, n). */
template <typename OutT>
__device__ __forceinline__ void store_pair(const epilogue &e, int64_t row, int64_t col, float v0, float v1, float sa,
                                           float sb0, float sb1, float b0, float b1) {
  if (row >= e.m || col >= e.n) return;
  OutT *y = static_cast<OutT *>(e.y) + row * e.ldy + col;
  const gate_row gr = gate_row_of(e, row);
  float r0 = gated<OutT>(e, gr, col, scale_value(v0, sa, sb0, b0, e.activation));
  if (col + 1 < e.n) {
    float r1 = gated<OutT>(e, gr, col + 1, scale_value(v1, sa, sb1, b1, e.activation));
    if (e.pair_ok) {
      if constexpr (sizeof(OutT) == 2) {
        *reinterpret_cast<uint32_t *>(y) = (uint32_t)bits16(cq_from_float<OutT>(r0)) |
                                           ((uint32_t)bits16(cq_from_float<OutT>(r1)) << 16);
      } else {
        *reinterpret_cast<float2 *>(y) = make_float2(r0, r1);
      }
      return;
    }
    y[1] = cq_from_float<OutT>(r1);
  }
  y[0] = cq_from_float<OutT>(r0);
}

/* Two outputs at an aligned address, no checks (interior tiles). */
template <typename OutT>
__device__ __forceinline__ void store2(OutT *y, float r0, float r1) {
  if constexpr (sizeof(OutT) == 2) {
    *reinterpret_cast<uint32_t *>(y) =
        (uint32_t)bits16(cq_from_float<OutT>(r0)) | ((uint32_t)bits16(cq_from_float<OutT>(r1)) << 16);
  } else {
    *reinterpret_cast<float2 *>(y) = make_float2(r0, r1);
  }
}

/* store_pair for edge tiles, out of line so the unrolled epilogues stay small. */
template <typename OutT>
__device__ __noinline__ void store_pair_edge(epilogue e, int64_t row, int64_t col, float v0, float v1, float sa,
                                             float sb0, float sb1, float b0, float b1) {
  store_pair<OutT>(e, row, col, v0, v1, sa, sb0, sb1, b0, b1);
}

/* Scale and bias of column col (zero past n). */
__device__ __forceinline__ void column_terms(const epilogue &e, int64_t col, float *sb, float *b) {
  if (col < e.n) {
    *sb = e.sb[col * e.sb_stride];
    *b = e.bias ? cq_load_any(e.bias, e.bias_dtype, col) : 0.0f;
  } else {
    *sb = 0.0f, *b = 0.0f;
  }
}

/* Tile (tm, tn) of tile `pid`, walking groups of 8 tile rows so that blocks
 * running together share A rows and B columns in L2. */
__device__ __forceinline__ void tile_of(int64_t pid, int64_t tiles_m, int64_t tiles_n, int64_t *tm, int64_t *tn) {
  const int64_t group = 8 * tiles_n;
  const int64_t first_m = (pid / group) * 8;
  const int64_t gm = tiles_m - first_m < 8 ? tiles_m - first_m : 8;
  *tm = first_m + (pid % group) % gm;
  *tn = (pid % group) / gm;
}

}  // namespace cq_gemm8

#endif /* CQ_KERNELS_GEMM8_COMMON_CUH */
