/* Pieces of the sm_90a mixed-input GEMMs (gemm_mixed_sm90.cu: 4-bit weights per group;
 * gemm_wo_sm90.cu: per-row 8-bit and fpX weights): the work of a persistent CTA (whole tiles, and
 * tiles split along K with their fixed-order fix-up), the ring of TMA stages a producer warpgroup
 * fills, the shared-memory descriptor of a 128-byte-swizzled activation tile, and the epilogues
 * that consumer warpgroups run on accumulators whose rows are weights and whose columns are tokens
 * (wgmma takes its register operand as A, so these GEMMs compute y^T). */
#ifndef CQ_KERNELS_GEMM_MIXED_SM90_CUH
#define CQ_KERNELS_GEMM_MIXED_SM90_CUH

#include <cuda.h>

#include <type_traits>

#include "gemm8_common.cuh"

namespace cq_mixed {

using cq_gemm8::epilogue;
using cq_gemm8::gate_row;
using cq_gemm8::gate_row_of;
using cq_gemm8::scale_value;
using cq_gemm8::tile_of;

#ifdef CQ_SM90A_DEVICE
/* GELU, tanh form, in these epilogues, which run while the tensor cores wait: 0.5 v (1 + tanh(t))
 * = v / (1 + 2^(-2 t log2 e)), t = sqrt(2/pi) (v + 0.044715 v^3), with one hardware exp2 and one
 * reciprocal (ex2.approx.ftz, rcp.approx.ftz: within 2 ulp each). That is cq_gelu_tanh's function
 * to a few ulp of |v| before y's 16-bit rounding (the bound of tests/tolerances.py), in a third of
 * tanhf's instructions. What the flush to zero changes lies far inside that bound: an exp2 under
 * 2^-126 is 0 beside the 1 it is added to, and for v below about -8.6 the result, under 2^-126 |v|,
 * becomes -0 (torch's fp32 tanh form gives -0 from about -5.2 on). +inf -> +inf, -inf and NaN -> NaN. */
__device__ __forceinline__ float gelu_tanh_fast(float v) {
  constexpr float k1 = -2.0f * 0.7978845608028654f * 1.4426950408889634f, k3 = k1 * 0.044715f;
  const float a = __fmul_rn(v, __fmaf_rn(k3, __fmul_rn(v, v), k1));
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(a));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(__fadd_rn(1.0f, e)));
  return __fmul_rn(v, r);
}
__device__ __forceinline__ float activate_fast(float v, int activation) {
  return activation == CQ_ACTIVATION_GELU_TANH ? gelu_tanh_fast(v) : v;
}
#endif

/* Epilogue staging: each consumer warpgroup's 64 tokens x 64 weights at a time in fp32, rows
 * padded to 68 words (the four token rows a warp writes at once fall in different banks). */
constexpr int kEpiRow = 68;
constexpr int kEpiWarpgroupBytes = 64 * kEpiRow * 4;

/* What a persistent CTA works on: the output tiles in tile_of's order, the first `whole` of them
 * over all of K, each of the rest cut into `splits` ranges along K: the first `rem` of `per` + 1
 * k-steps, the others of `per`, the last of what remains (the plan may leave it more); their
 * partial sums added in a fixed order by split_fixup. Units [0, whole) are whole tiles, then the
 * ranges of each split tile in turn. */
struct work_plan {
  int64_t tiles_m, tiles_n, whole;
  int ktiles, splits, per, rem;
};
struct work_unit {
  int64_t tm, tn;
  int kt0, kt1; /* the k-steps of this unit */
};

__host__ __device__ inline int64_t work_units(const work_plan &w) {
  return w.whole + (w.tiles_m * w.tiles_n - w.whole) * w.splits;
}
/* The plan without splits: every tile over all of K. */
__host__ __device__ inline work_plan whole_tiles(int64_t tiles_m, int64_t tiles_n, int ktiles) {
  return work_plan{tiles_m, tiles_n, tiles_m * tiles_n, ktiles, 1, ktiles, 0};
}

#ifdef CQ_SM90A_DEVICE

/* A K-major activation tile of 128-byte rows, 128-byte swizzled, as wgmma's B operand. */
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

/* The barriers of a ring of S stages: full[s] completes when the producer's TMA bytes land,
 * empty[s] when lane 0 of each of the `consumer_warps` has released the stage. */
template <int S>
__device__ __forceinline__ void init_ring(uint64_t (&full_bar)[S], uint64_t (&empty_bar)[S], uint32_t consumer_warps) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      cq_mbar_init(cq_smem_addr(&full_bar[s]), 1);
      cq_mbar_init(cq_smem_addr(&empty_bar[s]), consumer_warps);
    }
    cq_mbar_init_fence();
  }
  __syncthreads();
}

/* Unit u >= w.whole: its tile's index among the split tiles (slot) and its K range (split). */
__device__ __forceinline__ void split_of(const work_plan &w, int64_t u, int64_t *slot, int *split) {
  *slot = (u - w.whole) / w.splits;
  *split = (int)(u - w.whole - *slot * w.splits);
}

__device__ __forceinline__ work_unit unit_of(const work_plan &w, int64_t u) {
  work_unit r;
  int64_t tile = u;
  r.kt0 = 0, r.kt1 = w.ktiles;
  if (u >= w.whole) {
    int64_t slot;
    int split;
    split_of(w, u, &slot, &split);
    tile = w.whole + slot;
    r.kt0 = split * w.per + (split < w.rem ? split : w.rem);
    r.kt1 = split == w.splits - 1 ? w.ktiles : r.kt0 + w.per + (split < w.rem); /* the last: the rest */
  }
  tile_of(tile, w.tiles_m, w.tiles_n, &r.tm, &r.tn);
  return r;
}

/* The producer (thread 0 of warpgroup 0): for every unit of this CTA and each of its k-steps, wait
 * for the stage to be free, then load the activation tile (rows tm * x_rows, K from kt * x_k; XB
 * boxes of x_k / XB columns, tile_x_bytes / XB bytes each) and the packed weight tile (rows
 * tn * w_rows, bytes from kt * w_bytes rounded down to 16) into it by TMA. */
template <int S, int XB = 1>
__device__ __forceinline__ void produce_units(const CUtensorMap *map_x, const CUtensorMap *map_w, uint32_t base,
                                              uint64_t (&full_bar)[S], uint64_t (&empty_bar)[S], const work_plan &w,
                                              uint32_t stage_bytes, uint32_t tile_x_bytes, int x_k, int x_rows,
                                              int w_bytes, int w_rows) {
  uint32_t it = 0;
  const int64_t units = work_units(w);
  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    const work_unit wu = unit_of(w, u);
    for (int kt = wu.kt0; kt < wu.kt1; ++kt, ++it) {
      const uint32_t s = it % S, phase = (it / S) & 1u;
      cq_mbar_wait(cq_smem_addr(&empty_bar[s]), phase ^ 1u);
      const uint32_t full = cq_smem_addr(&full_bar[s]);
      cq_mbar_arrive_expect_tx(full, stage_bytes);
      const uint32_t sx = base + s * stage_bytes;
#pragma unroll
      for (int b = 0; b < XB; ++b)
        cq_tma_load_2d(sx + b * (tile_x_bytes / XB), map_x, full, kt * x_k + b * (x_k / XB), (int32_t)(wu.tm * x_rows));
      /* from the 16-byte unit holding the stage's first code byte (TMA boxes start on one) */
      cq_tma_load_2d(sx + tile_x_bytes, map_w, full, (kt * w_bytes) & ~15, (int32_t)(wu.tn * w_rows));
    }
  }
}

/* The same over whole tiles only. */
template <int S, int XB = 1>
__device__ __forceinline__ void produce(const CUtensorMap *map_x, const CUtensorMap *map_w, uint32_t base,
                                        uint64_t (&full_bar)[S], uint64_t (&empty_bar)[S], int64_t tiles_m,
                                        int64_t tiles_n, int ktiles, uint32_t stage_bytes, uint32_t tile_x_bytes,
                                        int x_k, int x_rows, int w_bytes, int w_rows) {
  produce_units<S, XB>(map_x, map_w, base, full_bar, empty_bar, whole_tiles(tiles_m, tiles_n, ktiles), stage_bytes,
                       tile_x_bytes, x_k, x_rows, w_bytes, w_rows);
}

/* The second range of a tile cut in two adds the first's partial sums p0 (v) to its own (a):
 * (0 + p0) + own, the order in which split_fixup adds every split tile's ranges. */
template <int N> __device__ __forceinline__ void add_first_of_pair(float *a, const float4 (&v)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j, a += 4) {
    a[0] = __fadd_rn(__fadd_rn(0.0f, v[j].x), a[0]), a[1] = __fadd_rn(__fadd_rn(0.0f, v[j].y), a[1]);
    a[2] = __fadd_rn(__fadd_rn(0.0f, v[j].z), a[2]), a[3] = __fadd_rn(__fadd_rn(0.0f, v[j].w), a[3]);
  }
}

/* Split K's fix-up, for one consumer warpgroup's accumulators of one K range of a split tile.
 * A range's partial sums go to part[split] (a warpgroup's 64 x BN floats, in fragment order:
 * float4 i of thread t at 4 (128 i + t)); the tile's counter (zeroed before the launch) counts the
 * ranges that arrived in its low 16 bits and those written in its high 16. The last range to
 * arrive adds all ranges in their order, ((0 + p0) + p1) + ..., into acc and returns true (the same
 * operations on the same operands whichever range arrives last); the others return false.
 * - Cut in two, the range that arrives last keeps its own sums in its registers, waits until the
 *   other's are written and reads only those: half the bytes of writing and reading back both.
 * - Cut in more, every range writes its sums before it arrives, and the last reads all back.
 * `bar_id`: a named barrier of this warpgroup's 128 threads. */
template <int BN>
__device__ __forceinline__ bool split_fixup(float (&acc)[BN / 2], float *part, int64_t split_floats, int split,
                                            int splits, unsigned *counter, uint32_t bar_id) {
  const int t = threadIdx.x & 127;
  const bool pair = splits == 2;
  auto write = [&]() { /* this thread's partial sums, visible before what it counts next */
    float4 *const mine = reinterpret_cast<float4 *>(part + split * split_floats);
#pragma unroll
    for (int i = 0; i < BN / 8; ++i)
      __stcg(mine + 128 * i + t, make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]));
    __threadfence();
  };
  if (!pair) write(), cq_bar_sync(bar_id, 128);
  unsigned arrived = 0;
  if (t == 0) arrived = atomicAdd(counter, pair ? 1u : 0x10001u) & 0xffffu;
  if (!cq_bar_sync_and(bar_id, 128, t != 0 || arrived == (unsigned)(splits - 1))) {
    if (pair) {
      write(), cq_bar_sync(bar_id, 128);
      if (t == 0) atomicAdd(counter, 0x10000u);
    }
    return false;
  }
  if (pair && t == 0)
    while ((cq_ld_acquire_gpu(counter) >> 16) == 0u) __nanosleep(64);
  cq_bar_sync(bar_id, 128);
  __threadfence(); /* the count before the other ranges' partial sums */
  /* kBatch float4 at a time, loads in flight (acc holds the rest of the registers) */
  constexpr int kBatch = 8;
  const float4 *const first = reinterpret_cast<const float4 *>(part) + t;
  auto load = [&](int r, int i0, float4 (&v)[kBatch]) {
#pragma unroll
    for (int j = 0; j < kBatch; ++j) v[j] = __ldcg(first + r * (split_floats / 4) + 128 * (i0 + j));
  };
#pragma unroll
  for (int i0 = 0; i0 < BN / 8; i0 += kBatch) {
    if (pair && split == 1) { /* (0 + p0) + own */
      float4 v[kBatch];
      load(0, i0, v);
      add_first_of_pair(acc + 4 * i0, v);
    } else { /* 0 + own; or 0, the ranges read back next */
#pragma unroll
      for (int j = 0; j < 4 * kBatch; ++j) acc[4 * i0 + j] = pair ? __fadd_rn(0.0f, acc[4 * i0 + j]) : 0.0f;
    }
    for (int r = pair ? split + 1 : 0; r < splits; ++r) {
      float4 v[kBatch];
      load(r, i0, v);
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        float *const a = acc + 4 * (i0 + j);
        a[0] = __fadd_rn(a[0], v[j].x), a[1] = __fadd_rn(a[1], v[j].y), a[2] = __fadd_rn(a[2], v[j].z),
        a[3] = __fadd_rn(a[3], v[j].w);
      }
    }
  }
  return true;
}

/* Split K's fix-up of a tile cut in two whose ranges run in one cluster of two CTAs, range r in
 * the CTA of rank r, for one consumer warpgroup's accumulators: range 0 writes its partial sums to
 * its own shared memory at buf (64 x BN values, 16 bytes i of thread t at 16 (128 i + t); nothing
 * of the ring is in use once both its warpgroups are past their last stage, barrier `ring_bar` of
 * the 256 consumer threads), range 1 reads them across the cluster and adds them to acc: fp32 as
 * (0 + p0) + p1, the order of split_fixup; int32 exactly. Returns true in range 1. Both CTAs take
 * part in both cluster barriers. */
template <int BN, typename Acc = float>
__device__ __forceinline__ bool cluster_pair_fixup(Acc (&acc)[BN / 2], uint32_t buf, int split, uint32_t ring_bar) {
  constexpr bool kInt = std::is_same<Acc, int32_t>::value;
  auto bits = [](Acc v) { if constexpr (kInt) return __int_as_float(v); else return v; };
  const int t = threadIdx.x & 127;
  if (split == 0) {
    cq_bar_sync(ring_bar, 256);
#pragma unroll
    for (int i = 0; i < BN / 8; ++i)
      cq_sts128(buf + 16u * (uint32_t)(128 * i + t),
                make_float4(bits(acc[4 * i]), bits(acc[4 * i + 1]), bits(acc[4 * i + 2]), bits(acc[4 * i + 3])));
  }
  cq_cluster_sync(); /* range 0's sums written */
  if (split == 1) {
    const uint32_t p0 = cq_mapa(buf, 0u);
    constexpr int kBatch = 8;
#pragma unroll
    for (int i0 = 0; i0 < BN / 8; i0 += kBatch) {
      float4 v[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) v[j] = cq_ld_cluster128(p0 + 16u * (uint32_t)(128 * (i0 + j) + t));
      if constexpr (kInt) {
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          Acc *const a = acc + 4 * (i0 + j);
          a[0] += __float_as_int(v[j].x), a[1] += __float_as_int(v[j].y), a[2] += __float_as_int(v[j].z),
              a[3] += __float_as_int(v[j].w);
        }
      } else {
        add_first_of_pair(acc + 4 * i0, v);
      }
    }
  }
  cq_cluster_sync(); /* ... and read: range 0's shared memory may go */
  return split == 1;
}

/* The epilogue of one consumer warpgroup: its 64 weight rows (n0 + [0, 64)) x BN tokens
 * (m0 + [0, BN)) of accumulators, y[m, n] = act(acc * sa[m] * sw[n] + b[n]) (sa NULL: 1; sw_a and
 * sw_b the scales of this thread's rows n0 + 16 warp + g and 8 further, 1 where the weights carry
 * their own), gated where the layer is, rounded once. 64 tokens at a time go through shared memory in fp32 (buf: this
 * warpgroup's 64 x kEpiRow floats), then out in rows of 8 neighbouring outputs: 16-byte stores
 * where y allows them (accumulator rows are weights, so the direct stores would be 2-byte ones
 * spread over 8 rows of y). */
/* residual + gate * v for a gated layer (the residual in y's dtype, t), else v. */
__device__ __forceinline__ float gated_as(const epilogue &e, cq_dtype t, const gate_row &gr, int64_t col, float v) {
  if (!e.gate) return v;
  return cq_gate_residual(v, cq_load_any(e.gate, e.gate_dtype, gr.g + col), cq_load_any(e.residual, t, gr.r + col));
}

template <typename OutT>
__device__ __forceinline__ void write_rows(const epilogue &e, cq_dtype y_dtype, const float *buf, int64_t m0, int64_t n0,
                                           int t) {
  constexpr int kPer = 16 / sizeof(OutT) < 8 ? 16 / sizeof(OutT) : 8; /* outputs a store: 8 (16-bit) or 4 (f32) */
  constexpr int kChunks = 64 / kPer;                                   /* per token row */
  const bool vec = e.pair_ok; /* here: y rows and base allow 16-byte stores */
  for (int i = t; i < 64 * kChunks; i += 128) {
    const int r = i / kChunks, col = (i % kChunks) * kPer;
    const int64_t m = m0 + r, n = n0 + col;
    if (m >= e.m || n >= e.n) continue;
    const float *src = buf + r * kEpiRow + col;
    OutT *dst = static_cast<OutT *>(e.y) + m * e.ldy + n;
    if (vec && !e.gate && n + kPer <= e.n) {
      union {
        uint4 u;
        OutT v[kPer];
      } pk;
#pragma unroll
      for (int l = 0; l < kPer; ++l) pk.v[l] = cq_from_float<OutT>(src[l]);
      *reinterpret_cast<uint4 *>(dst) = pk.u;
    } else {
      const gate_row gr = gate_row_of(e, m);
      for (int l = 0; l < kPer && n + l < e.n; ++l) dst[l] = cq_from_float<OutT>(gated_as(e, y_dtype, gr, n + l, src[l]));
    }
  }
}

template <int BN, typename Acc = float>
__device__ __forceinline__ void store_tile(const epilogue &e, cq_dtype y_dtype, const Acc (&acc)[BN / 2],
                                           const float *sa, float sw_a, float sw_b, int64_t m0, int64_t n0, float *buf,
                                           int bar_id) {
  const int t = threadIdx.x & 127, warp = t >> 5, lane = t & 31, g = lane >> 2, q = lane & 3;
  const int64_t na = n0 + warp * 16 + g, nb = na + 8;
  const float bias_a = na < e.n && e.bias ? cq_load_any(e.bias, e.bias_dtype, na) : 0.0f;
  const float bias_b = nb < e.n && e.bias ? cq_load_any(e.bias, e.bias_dtype, nb) : 0.0f;
#pragma unroll
  for (int pass = 0; pass < BN / 64; ++pass) {
    cq_bar_sync(bar_id, 128); /* the previous pass (or tile) has read the buffer */
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int jj = pass * 8 + j, r = 8 * j + 2 * q, col = warp * 16 + g;
      const int64_t m = m0 + 8 * jj + 2 * q;
      const float s0 = sa ? (m < e.m ? sa[m] : 0.0f) : 1.0f, s1 = sa ? (m + 1 < e.m ? sa[m + 1] : 0.0f) : 1.0f;
      buf[r * kEpiRow + col] = activate_fast(scale_value((float)acc[4 * jj], s0, sw_a, bias_a, 0), e.activation);
      buf[(r + 1) * kEpiRow + col] = activate_fast(scale_value((float)acc[4 * jj + 1], s1, sw_a, bias_a, 0), e.activation);
      buf[r * kEpiRow + col + 8] = activate_fast(scale_value((float)acc[4 * jj + 2], s0, sw_b, bias_b, 0), e.activation);
      buf[(r + 1) * kEpiRow + col + 8] = activate_fast(scale_value((float)acc[4 * jj + 3], s1, sw_b, bias_b, 0), e.activation);
    }
    cq_bar_sync(bar_id, 128);
    switch (y_dtype) { /* the output dtype is a run-time choice: only these stores are per dtype */
      case CQ_DTYPE_F16: write_rows<__half>(e, y_dtype, buf, m0 + pass * 64, n0, t); break;
      case CQ_DTYPE_BF16: write_rows<__nv_bfloat16>(e, y_dtype, buf, m0 + pass * 64, n0, t); break;
      default: write_rows<float>(e, y_dtype, buf, m0 + pass * 64, n0, t); break;
    }
  }
}

/* The gated residual of a tile in store_tile_tma: y = residual + gate * v, the residual loaded by
 * TMA (map: boxes like y's) into the pass's buffer and read back with ldmatrix.trans, which hands
 * each lane the residual of its own accumulators (the inverse of the stmatrix.trans that stores
 * them). The tile's tokens all belong to one sample, whose gate for this lane's rows is gate_a,
 * gate_b. bars: this warp's two mbarriers (8 bytes apart), one per buffer; loads: the residual
 * loads this warp has issued (their phases). */
struct tma_gate {
  const CUtensorMap *map;
  float gate_a, gate_b;
  uint32_t bars;
  uint32_t *loads;
};

/* The epilogue of a plain or gated layer with a 16-bit y (and residual) whose base and rows are
 * 16-byte aligned, through TMA stores: y[m, n] = act(acc * sw[n] + b[n]) (int32 acc: act(acc *
 * sa[m] * sw[n] + b[n]), sa the tile's token scales in shared memory at sa), for a gated layer
 * residual[m, n] + gate[n] * that, rounded once. Each warp rounds its 16 weight rows x 64 tokens
 * a pass to pairs and writes them with stmatrix, transposed (token rows of 16 weights, 32 bytes,
 * 32-byte swizzled: a warp's stores fall in distinct banks), then one lane stores the box by TMA
 * (map_y: boxes of 16 weights x 64 tokens; TMA leaves out what lies past y). BUFS 2 KB buffers a
 * warp at buf (256-byte aligned), used in turn: a pass's store drains while the next BUFS - 1
 * passes are rounded (a gated tile's residual loads take two). No barrier beyond the warp's.
 * sw_a, b_a and sw_b, b_b: the scale and bias of this lane's rows n0 + 16 warp + g and 8 further. */
template <int BN, typename OutT, bool GELU, bool GATED = false, int BUFS = 2, typename Acc = float>
__device__ __forceinline__ void store_tile_tma(const CUtensorMap *map_y, const Acc (&acc)[BN / 2], float sw_a,
                                               float sw_b, float b_a, float b_b, int64_t m0, int64_t n0, uint32_t buf,
                                               const tma_gate &gt = tma_gate{}, const float *sa = nullptr) {
  static_assert(BUFS >= 2 && (!GATED || BUFS == 2), "two buffers or more; a gated tile's residual barriers are two");
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  const int t = 8 * (lane >> 4) + (lane & 7), half = (lane >> 3) & 1; /* the stored row this lane addresses */
  const uint32_t row_at = (uint32_t)(t * 32 + ((half ^ ((t >> 2) & 1)) << 4));
  auto value = [&](float a, int h) {
    const float v = __fadd_rn(__fmul_rn(a, h ? sw_b : sw_a), h ? b_b : b_a);
    return GELU ? gelu_tanh_fast(v) : v;
  };
#pragma unroll
  for (int pass = 0; pass < BN / 64; ++pass) {
    const uint32_t dst = buf + (uint32_t)(pass % BUFS) * 2048u;
    if (lane == 0) cq_bulk_wait_read_but<BUFS - 1>(); /* the store of BUFS passes back has read dst */
    __syncwarp();
    uint32_t res[4][4];
    if constexpr (GATED) { /* the residual's box into dst, then into this lane's pairs */
      const uint32_t n = (*gt.loads)++, bar = gt.bars + (n & 1u) * 8u;
      if (lane == 0) {
        cq_mbar_arrive_expect_tx(bar, 2048u);
        cq_tma_load_2d(dst, gt.map, bar, (int32_t)(n0 + warp * 16), (int32_t)(m0 + pass * 64));
      }
      cq_mbar_wait(bar, (n >> 1) & 1u);
#pragma unroll
      for (int x = 0; x < 4; ++x) cq_ldsm_x4_trans(res[x], dst + (uint32_t)(x * 16 * 32) + row_at);
    }
#pragma unroll
    for (int x = 0; x < 4; ++x) { /* tokens 16 x + [0, 16) of the pass: matrix i = (8 tokens i / 2, rows i % 2) */
      uint32_t r[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int jj = pass * 8 + 2 * x + (i >> 1), h = i & 1;
        float lo, hi;
        if constexpr (std::is_same<Acc, int32_t>::value) { /* tokens 8 jj + 2 q, + 1 */
          const float2 sp = *reinterpret_cast<const float2 *>(sa + 8 * jj + 2 * (lane & 3));
          lo = value(__fmul_rn((float)acc[4 * jj + 2 * h], sp.x), h), hi = value(__fmul_rn((float)acc[4 * jj + 2 * h + 1], sp.y), h);
        } else {
          lo = value(acc[4 * jj + 2 * h], h), hi = value(acc[4 * jj + 2 * h + 1], h);
        }
        if constexpr (GATED) {
          const float2 rv = cq_unpack2<OutT>(res[x][i]);
          const float g = h ? gt.gate_b : gt.gate_a;
          lo = cq_gate_residual(lo, g, rv.x), hi = cq_gate_residual(hi, g, rv.y);
        }
        r[i] = cq_pack2<OutT>(lo, hi);
      }
      cq_stmatrix_x4_trans(dst + (uint32_t)(x * 16 * 32) + row_at, r);
    }
    cq_fence_proxy_async(); /* stmatrix's writes, then the TMA's reads */
    __syncwarp();
    if (lane == 0) {
      cq_tma_store_2d(map_y, dst, (int32_t)(n0 + warp * 16), (int32_t)(m0 + pass * 64));
      cq_bulk_commit();
    }
  }
}

#endif /* CQ_SM90A_DEVICE */

/* The epilogue of the arguments: y, bias, activation and gate (the scales are the kernels'). */
inline epilogue epilogue_of(const cq_mixed_args *g) {
  epilogue e = {};
  e.bias = g->bias, e.bias_dtype = g->bias_dtype;
  e.y = g->out.y, e.m = g->m, e.n = g->n, e.ldy = g->out.ldy;
  const size_t ys = cq_dtype_size(g->out.y_dtype);
  e.pair_ok = (uintptr_t)g->out.y % 16 == 0 && (g->out.ldy * ys) % 16 == 0; /* 16-byte stores of y */
  e.activation = g->activation;
  e.gate = g->out.gate, e.gate_dtype = g->out.gate_dtype, e.ldg = g->out.ldg;
  e.rows_per_sample = g->out.rows_per_sample;
  e.residual = g->out.residual, e.ldr = g->out.ldr;
  return e;
}
}  // namespace cq_mixed

#endif /* CQ_KERNELS_GEMM_MIXED_SM90_CUH */
