/* Fused LayerNorm / RMSNorm + adaLN modulation of the rows of x [B * S, D] (cq_norm_modulate):
 * the modulated values t are written in x's dtype or, for a quantized consumer, as their int8 /
 * fp8 e4m3 codes and per-row scales, exactly as cq_quantize would encode t.
 *
 * Fast path: one warp per row (four rows a block) up to 128 vectors a row, else a block of 2-16
 * warps per row; 16-byte loads, and the row stays in registers from its load to its store, so
 * x is read once and out written once. Sums run in fp32: each thread adds its elements in
 * order, a butterfly adds over the warp and the warps' partials are added in warp order, so
 * every thread of a row holds the same mean and rstd. The element math uses non-contracting
 * intrinsics, one for each operation of the C reference: the two paths differ only in the order
 * of the row sums. Codes come from the activation quantizer's encoder (act_encode.cuh) applied
 * to the rounded vector of t, as act_quant.cu applies it to x.
 *
 * Rows that are not whole vectors (D not a multiple of 16 bytes), misaligned buffers and rows
 * of more than 2048 vectors take a block-per-row loop that reads the row once per pass (from
 * L1/L2 after the first) and recomputes t identically in each pass. */
#include "act_encode.cuh"

namespace {

using cq_act::encode1;
using cq_act::encode_store;
using cq_act::vec_traits;

constexpr int kLoopThreads = 256;

struct nm_args {
  const void *x;             /* [rows, d] */
  void *out;                 /* [rows, d]: x's dtype, or one code byte per element */
  float *out_scale;          /* [rows] when quantized */
  const void *scale, *shift; /* [B, d] rows (row strides scale_ld, shift_ld), or NULL */
  int64_t scale_ld, shift_ld;
  cq_dtype scale_dtype, shift_dtype;
  int scale_vec, shift_vec; /* 16-byte aligned rows: a vector's worth of them loads at once */
  int64_t rows, seq, d;     /* row r belongs to sample r / seq */
  int layer;                /* LayerNorm (subtract the mean) or RMSNorm */
  float eps, max_value;
};

/* E consecutive modulation values (from element `off`) as fp32; a missing vector is 0. */
template <int E>
__device__ __forceinline__ void load_mod(const void *p, cq_dtype t, int vec, int64_t off, float *f) {
  if (!p) {
#pragma unroll
    for (int e = 0; e < E; ++e) f[e] = 0.0f;
    return;
  }
  if (vec && t == CQ_DTYPE_F32) {
    const float4 *q = reinterpret_cast<const float4 *>(static_cast<const float *>(p) + off);
#pragma unroll
    for (int i = 0; i < E / 4; ++i) {
      const float4 v = __ldg(q + i);
      f[4 * i] = v.x, f[4 * i + 1] = v.y, f[4 * i + 2] = v.z, f[4 * i + 3] = v.w;
    }
    return;
  }
  if (vec) {
    const uint16_t *h = static_cast<const uint16_t *>(p) + off;
    uint32_t w[E / 2];
    if constexpr (E == 8) {
      const uint4 v = __ldg(reinterpret_cast<const uint4 *>(h));
      w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else {
      const uint2 v = __ldg(reinterpret_cast<const uint2 *>(h));
      w[0] = v.x, w[1] = v.y;
    }
#pragma unroll
    for (int i = 0; i < E / 2; ++i) {
      const uint16_t lo = (uint16_t)(w[i] & 0xffffu), hi = (uint16_t)(w[i] >> 16);
      f[2 * i] = t == CQ_DTYPE_BF16 ? cq_bf16_to_f32(lo) : __half2float(__ushort_as_half(lo));
      f[2 * i + 1] = t == CQ_DTYPE_BF16 ? cq_bf16_to_f32(hi) : __half2float(__ushort_as_half(hi));
    }
    return;
  }
#pragma unroll
  for (int e = 0; e < E; ++e) f[e] = cq_load_any(p, t, off + e);
}

/* v = (x - mu) * rstd * (1 + scale) + shift, rounded as the C reference rounds each step. */
__device__ __forceinline__ float modulate(float x, float mu, float rstd, float sc, float sh) {
  const float n = __fmul_rn(__fsub_rn(x, mu), rstd);
  return __fadd_rn(__fmul_rn(n, __fadd_rn(1.0f, sc)), sh);
}

/* Sum over the row_warps warps of one row (a block of its own when row_warps > 1): every thread
 * gets the same bits. `red` holds row_warps floats. */
__device__ __forceinline__ float row_sum(float v, float *red, int row_warps) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (row_warps == 1) return v;
  __syncthreads(); /* the previous reduction may still be reading red */
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = red[0];
  for (int w = 1; w < row_warps; ++w) s = __fadd_rn(s, red[w]);
  return s;
}

__device__ __forceinline__ uint32_t row_max(uint32_t v, uint32_t *red, int row_warps) {
  v = cq_warp_max_u32(v);
  if (row_warps == 1) return v;
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  uint32_t m = red[0];
  for (int w = 1; w < row_warps; ++w) m = max(m, red[w]);
  return m;
}

/* x rows of whole 16-byte vectors, 16-byte aligned; VPT vectors a thread. ROWS > 1: ROWS rows a
 * block, one warp each (they never synchronize); ROWS = 1: one row a block of up to
 * kMaxRowWarps warps (the block's size, a run-time choice: only the reductions loop over them). */
constexpr int kMaxRowWarps = 16;

template <typename T, int FMT, int ROWS, int VPT>
__global__ void __launch_bounds__(ROWS == 1 ? 32 * kMaxRowWarps : 32 * ROWS) norm_modulate_vec(nm_args a) {
  constexpr int E = vec_traits<T>::kElems;
  const int row_warps = ROWS == 1 ? (int)(blockDim.x >> 5) : 1, TPR = 32 * row_warps;
  __shared__ float red_f[kMaxRowWarps];
  __shared__ uint32_t red_u[kMaxRowWarps];
  const int64_t r = (int64_t)blockIdx.x * ROWS + threadIdx.x / TPR;
  if (r >= a.rows) return; /* a whole warp (ROWS > 1) or the whole block */
  const int tid = (int)(threadIdx.x % TPR);
  const int64_t nvec = a.d / E;
  const uint4 *xr = reinterpret_cast<const uint4 *>(static_cast<const T *>(a.x) + r * a.d);
  uint4 v[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int64_t idx = tid + (int64_t)i * TPR;
    v[i] = idx < nvec ? __ldg(xr + idx) : make_uint4(0, 0, 0, 0);
  }

  float s = 0.0f; /* sum of x (LayerNorm) or of x^2 (RMSNorm) */
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    if (tid + (int64_t)i * TPR >= nvec) continue;
    float f[E];
    vec_traits<T>::to_float(v[i], f);
#pragma unroll
    for (int e = 0; e < E; ++e) s = a.layer ? __fadd_rn(s, f[e]) : __fadd_rn(s, __fmul_rn(f[e], f[e]));
  }
  s = row_sum(s, red_f, row_warps);
  const float dn = (float)a.d;
  float mu = 0.0f;
  if (a.layer) {
    mu = __fdiv_rn(s, dn);
    s = 0.0f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if (tid + (int64_t)i * TPR >= nvec) continue;
      float f[E];
      vec_traits<T>::to_float(v[i], f);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float c = __fsub_rn(f[e], mu);
        s = __fadd_rn(s, __fmul_rn(c, c));
      }
    }
    s = row_sum(s, red_f, row_warps);
  }
  const float rstd = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(s, dn), a.eps)));

  const int64_t b = r / a.seq;
  uint32_t m = 0; /* |t| maxima, as act_quant reduces them */
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int64_t idx = tid + (int64_t)i * TPR;
    if (idx >= nvec) continue;
    float f[E], sc[E], sh[E];
    vec_traits<T>::to_float(v[i], f);
    load_mod<E>(a.scale, a.scale_dtype, a.scale_vec, b * a.scale_ld + idx * E, sc);
    load_mod<E>(a.shift, a.shift_dtype, a.shift_vec, b * a.shift_ld + idx * E, sh);
#pragma unroll
    for (int e = 0; e < E; ++e) f[e] = modulate(f[e], mu, rstd, sc[e], sh[e]);
    v[i] = vec_traits<T>::from_float(f); /* t: rounded to x's dtype */
    if (FMT != CQ_FORMAT_NONE) m = vec_traits<T>::absmax(v[i], m);
  }

  if (FMT == CQ_FORMAT_NONE) {
    uint4 *o = reinterpret_cast<uint4 *>(static_cast<T *>(a.out) + r * a.d);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int64_t idx = tid + (int64_t)i * TPR;
      if (idx < nvec) o[idx] = v[i];
    }
    return;
  }
  const float amax = __uint_as_float(row_max(__float_as_uint(vec_traits<T>::amax_value(m)), red_u, row_warps));
  float sx, inv;
  cq_scale_from_amax(amax, a.max_value, &sx, &inv);
  if (tid == 0) a.out_scale[r] = sx;
  uint8_t *q = static_cast<uint8_t *>(a.out) + r * a.d;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int64_t idx = tid + (int64_t)i * TPR;
    if (idx < nvec) encode_store<T, FMT>(v[i], inv, q + idx * E);
  }
}

/* Element j of row r of t (sample b), recomputed identically in every pass of the loop kernel. */
template <typename T>
__device__ __forceinline__ T t_at(const nm_args &a, const T *xr, int64_t b, int64_t j, float mu, float rstd) {
  const float sc = a.scale ? cq_load_any(a.scale, a.scale_dtype, b * a.scale_ld + j) : 0.0f;
  const float sh = a.shift ? cq_load_any(a.shift, a.shift_dtype, b * a.shift_ld + j) : 0.0f;
  return cq_from_float<T>(modulate(cq_to_float(xr[j]), mu, rstd, sc, sh));
}

/* Any D and alignment: a block per row, the row read once per pass. */
template <typename T, int FMT>
__global__ void __launch_bounds__(kLoopThreads) norm_modulate_loop(nm_args a) {
  constexpr int W = kLoopThreads / 32;
  __shared__ float red_f[W];
  __shared__ uint32_t red_u[32];
  const float dn = (float)a.d;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const T *xr = static_cast<const T *>(a.x) + r * a.d;
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < a.d; j += kLoopThreads) {
      const float f = cq_to_float(xr[j]);
      s = a.layer ? __fadd_rn(s, f) : __fadd_rn(s, __fmul_rn(f, f));
    }
    s = row_sum(s, red_f, W);
    float mu = 0.0f;
    if (a.layer) {
      mu = __fdiv_rn(s, dn);
      s = 0.0f;
      for (int64_t j = threadIdx.x; j < a.d; j += kLoopThreads) {
        const float c = __fsub_rn(cq_to_float(xr[j]), mu);
        s = __fadd_rn(s, __fmul_rn(c, c));
      }
      s = row_sum(s, red_f, W);
    }
    const float rstd = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(s, dn), a.eps)));
    const int64_t b = r / a.seq;
    if (FMT == CQ_FORMAT_NONE) {
      T *o = static_cast<T *>(a.out) + r * a.d;
      for (int64_t j = threadIdx.x; j < a.d; j += kLoopThreads) o[j] = t_at(a, xr, b, j, mu, rstd);
      continue;
    }
    uint32_t m = 0;
    for (int64_t j = threadIdx.x; j < a.d; j += kLoopThreads)
      m = max(m, cq_abs_bits(cq_to_float(t_at(a, xr, b, j, mu, rstd))));
    float sx, inv;
    cq_scale_from_amax(cq_amax_from_bits(cq_block_max_u32(m, red_u)), a.max_value, &sx, &inv);
    if (threadIdx.x == 0) a.out_scale[r] = sx;
    uint8_t *q = static_cast<uint8_t *>(a.out) + r * a.d;
    for (int64_t j = threadIdx.x; j < a.d; j += kLoopThreads)
      q[j] = inv != 0.0f ? (uint8_t)encode1<FMT>(cq_to_float(t_at(a, xr, b, j, mu, rstd)) * inv) : (uint8_t)0;
  }
}

template <typename T, int FMT, int ROWS, int VPT>
cq_status launch_vec(const nm_args &a, int row_warps, cudaStream_t s) {
  const int64_t blocks = (a.rows + ROWS - 1) / ROWS;
  norm_modulate_vec<T, FMT, ROWS, VPT><<<(unsigned)blocks, 32 * row_warps * ROWS, 0, s>>>(a);
  CQ_LAUNCH_CHECK(norm_modulate_vec);
  return CQ_OK;
}

template <typename T, int FMT>
cq_status launch(const nm_args &a, bool vec_ok, cudaStream_t s) {
  const int64_t nvec = a.d / vec_traits<T>::kElems;
  if (vec_ok) {
    if (nvec <= 32) return launch_vec<T, FMT, 4, 1>(a, 1, s);
    if (nvec <= 64) return launch_vec<T, FMT, 4, 2>(a, 1, s);
    if (nvec <= 128) return launch_vec<T, FMT, 4, 4>(a, 1, s);
    if (nvec <= 256) return launch_vec<T, FMT, 1, 4>(a, 2, s);
    if (nvec <= 384) return launch_vec<T, FMT, 1, 3>(a, 4, s); /* Flux: D = 3072 bf16 */
    if (nvec <= 512) return launch_vec<T, FMT, 1, 4>(a, 4, s);
    if (nvec <= 768) return launch_vec<T, FMT, 1, 3>(a, 8, s); /* D = 3072 fp32 */
    if (nvec <= 1024) return launch_vec<T, FMT, 1, 4>(a, 8, s);
    if (nvec <= 2048) return launch_vec<T, FMT, 1, 4>(a, kMaxRowWarps, s);
  }
  const int64_t grid = a.rows < (1 << 20) ? a.rows : (1 << 20);
  norm_modulate_loop<T, FMT><<<(unsigned)grid, kLoopThreads, 0, s>>>(a);
  CQ_LAUNCH_CHECK(norm_modulate_loop);
  return CQ_OK;
}

template <typename T>
cq_status launch_format(const nm_args &a, int format, cudaStream_t s) {
  constexpr int E = vec_traits<T>::kElems;
  /* NONE stores vectors of T; codes go out E bytes at a time (uint2 for 8, uint32 for 4) */
  const uintptr_t out_align = format == CQ_FORMAT_NONE ? 16 : E;
  const bool vec_ok = a.d % E == 0 && (uintptr_t)a.x % 16 == 0 && (uintptr_t)a.out % out_align == 0;
  switch (format) {
    case CQ_FORMAT_NONE: return launch<T, CQ_FORMAT_NONE>(a, vec_ok, s);
    case CQ_FORMAT_INT8: return launch<T, CQ_FORMAT_INT8>(a, vec_ok, s);
    case CQ_FORMAT_FP8_E4M3: return launch<T, CQ_FORMAT_FP8_E4M3>(a, vec_ok, s);
    default: break;
  }
  return cq_fail(CQ_ERR_INTERNAL, "norm_modulate: out_format %d is not none, int8 or fp8_e4m3", format);
}

/* Whether a modulation tensor's rows allow the vector loads of load_mod (16-byte aligned). */
int mod_vec_ok(const cq_tensor *t) {
  if (!t) return 0;
  const int64_t row_bytes = t->strides[0] * (int64_t)cq_dtype_size(t->dtype);
  return (uintptr_t)t->data % 16 == 0 && (t->shape[0] == 1 || row_bytes % 16 == 0);
}

}  // namespace

extern "C" cq_status cq_norm_modulate_cuda(const cq_tensor *x, const cq_tensor *scale, const cq_tensor *shift,
                                           const cq_norm_modulate_params *p, const cq_format_info *f, cq_tensor *out,
                                           cq_tensor *out_scale, void *stream) {
  nm_args a = {};
  a.x = x->data, a.out = out->data, a.out_scale = out_scale ? (float *)out_scale->data : NULL;
  a.scale = scale ? scale->data : NULL, a.shift = shift ? shift->data : NULL;
  a.scale_ld = scale ? scale->strides[0] : 0, a.shift_ld = shift ? shift->strides[0] : 0;
  a.scale_dtype = scale ? scale->dtype : CQ_DTYPE_F32, a.shift_dtype = shift ? shift->dtype : CQ_DTYPE_F32;
  a.scale_vec = mod_vec_ok(scale), a.shift_vec = mod_vec_ok(shift);
  a.rows = x->shape[0] * x->shape[1], a.seq = x->shape[1], a.d = x->shape[2];
  a.layer = p->norm == CQ_NORM_LAYER, a.eps = p->eps, a.max_value = f ? f->max_value : 0.0f;
  if (a.rows > 0x7fffffffLL)
    return cq_fail(CQ_ERR_UNSUPPORTED, "norm_modulate: %lld rows is more than the 2^31 - 1 a grid holds",
                   (long long)a.rows);
  const int format = f ? (int)f->id : CQ_FORMAT_NONE;
  CQ_DISPATCH_FLOAT(x->dtype, T, return launch_format<T>(a, format, cq_stream(stream)));
  return CQ_OK;
}
