/* The 8-bit wire on CUDA (cq_wire_encode / cq_wire_decode), bit-identical to the C reference
 * (csrc/wire.c): the same fp32 operations, each rounded once (no fused multiply-add).
 *
 * Rows of strided views: a row's offset in each argument comes from its 4 row indices and that
 * argument's strides. Fast path: TPR threads a row and 256 / TPR rows a block, 16-byte loads of
 * the values, the row held in registers between the max and the codes (x read once); the max
 * and the sum of squared codes reduced by warp shuffles. Other alignments and rows of more than
 * 128 vectors: a warp a row, scalar loads, the row read twice. */
#include "act_encode.cuh"
#include "common.cuh"
#include "cquant-cuda.h"

namespace {

using cq_act::vec_traits;

/* The views' geometry, by value (cq_wire_rows with pointers). */
struct wire_geom {
  int64_t shape[4], rows, cols;
  int64_t st[CQ_WIRE_ARGS][4];
};

__device__ __forceinline__ void row_index(const wire_geom &g, int64_t r, int64_t idx[4]) {
#pragma unroll
  for (int k = 3; k >= 0; --k) {
    idx[k] = r % g.shape[k];
    r /= g.shape[k];
  }
}

__device__ __forceinline__ int64_t offset(const wire_geom &g, int arg, const int64_t idx[4]) {
  return idx[0] * g.st[arg][0] + idx[1] * g.st[arg][1] + idx[2] * g.st[arg][2] + idx[3] * g.st[arg][3];
}

__device__ __forceinline__ float decoded_norm(float scale, int32_t sumsq) {
  return __fmul_rn(scale, __fsqrt_rn(__int2float_rn(sumsq)));
}

/* Encode, fast path: rows of at most TPR * VPT vectors of E values. */
template <typename T, int TPR, int VPT>
__global__ void __launch_bounds__(256) wire_encode_vec(const T *__restrict__ x, const float *__restrict__ mean,
                                                       int8_t *__restrict__ codes, float *__restrict__ scales,
                                                       float *__restrict__ norms, const wire_geom g) {
  constexpr int E = vec_traits<T>::kElems;
  const int lane = threadIdx.x % TPR;
  const int64_t r = (int64_t)blockIdx.x * (256 / TPR) + threadIdx.x / TPR;
  const bool live = r < g.rows; /* every lane takes part in the shuffles */
  const int nvec = (int)(g.cols / E);
  int64_t idx[4] = {0, 0, 0, 0};
  if (live) row_index(g, r, idx);
  const T *xr = x + offset(g, CQ_WIRE_VALUES, idx);
  const float *mr = mean ? mean + offset(g, CQ_WIRE_MEAN, idx) : nullptr;
  float f[VPT][E];
  uint32_t mb = 0;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int vi = lane + i * TPR;
    const bool in = live && vi < nvec;
    vec_traits<T>::to_float(in ? __ldg(reinterpret_cast<const uint4 *>(xr) + vi) : make_uint4(0, 0, 0, 0), f[i]);
    if (in && mr) {
#pragma unroll
      for (int q = 0; q < E / 4; ++q) {
        const float4 m = __ldg(reinterpret_cast<const float4 *>(mr + (int64_t)vi * E) + q);
        f[i][4 * q] = __fsub_rn(f[i][4 * q], m.x), f[i][4 * q + 1] = __fsub_rn(f[i][4 * q + 1], m.y);
        f[i][4 * q + 2] = __fsub_rn(f[i][4 * q + 2], m.z), f[i][4 * q + 3] = __fsub_rn(f[i][4 * q + 3], m.w);
      }
    }
#pragma unroll
    for (int e = 0; e < E; ++e) mb = max(mb, __float_as_uint(f[i][e]) & 0x7fffffffu); /* NaN sorts above Inf */
  }
#pragma unroll
  for (int o = TPR / 2; o > 0; o /= 2) mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, o));
  float s, inv;
  cq_scale_from_amax(__uint_as_float(mb), 127.0f, &s, &inv);
  int8_t *cr = codes + offset(g, CQ_WIRE_CODES, idx);
  int32_t sumsq = 0;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int vi = lane + i * TPR;
    if (!live || vi >= nvec) continue;
    uint32_t w[E / 4];
#pragma unroll
    for (int q = 0; q < E / 4; ++q) {
      uint32_t word = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int32_t c = inv == 0.0f ? 0 : cq_int8_encode(__fmul_rn(f[i][4 * q + e], inv));
        sumsq += c * c;
        word |= (uint32_t)(uint8_t)(int8_t)c << (8 * e);
      }
      w[q] = word;
    }
    if (E == 8) *reinterpret_cast<uint2 *>(cr + (int64_t)vi * E) = make_uint2(w[0], w[E / 4 - 1]);
    else *reinterpret_cast<uint32_t *>(cr + (int64_t)vi * E) = w[0];
  }
  if (norms) {
#pragma unroll
    for (int o = TPR / 2; o > 0; o /= 2) sumsq += __shfl_xor_sync(0xffffffffu, sumsq, o);
  }
  if (!live || lane != 0) return;
  scales[offset(g, CQ_WIRE_SCALES, idx)] = s;
  if (norms) norms[offset(g, CQ_WIRE_NORMS, idx)] = decoded_norm(s, sumsq);
}

/* Encode, any alignment and length: a warp a row, the row read twice (L1/L2-hot). */
template <typename T>
__global__ void __launch_bounds__(256) wire_encode_scalar(const T *__restrict__ x, const float *__restrict__ mean,
                                                          int8_t *__restrict__ codes, float *__restrict__ scales,
                                                          float *__restrict__ norms, const wire_geom g) {
  const int lane = threadIdx.x % 32;
  const int64_t r = (int64_t)blockIdx.x * 8 + threadIdx.x / 32;
  if (r >= g.rows) return; /* whole warps leave together */
  int64_t idx[4];
  row_index(g, r, idx);
  const T *xr = x + offset(g, CQ_WIRE_VALUES, idx);
  const float *mr = mean ? mean + offset(g, CQ_WIRE_MEAN, idx) : nullptr;
  uint32_t mb = 0;
  for (int64_t j = lane; j < g.cols; j += 32) {
    const float v = mr ? __fsub_rn(cq_to_float(xr[j]), mr[j]) : cq_to_float(xr[j]);
    mb = max(mb, __float_as_uint(v) & 0x7fffffffu);
  }
  for (int o = 16; o > 0; o /= 2) mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, o));
  float s, inv;
  cq_scale_from_amax(__uint_as_float(mb), 127.0f, &s, &inv);
  int8_t *cr = codes + offset(g, CQ_WIRE_CODES, idx);
  int32_t sumsq = 0;
  for (int64_t j = lane; j < g.cols; j += 32) {
    const float v = mr ? __fsub_rn(cq_to_float(xr[j]), mr[j]) : cq_to_float(xr[j]);
    const int32_t c = inv == 0.0f ? 0 : cq_int8_encode(__fmul_rn(v, inv));
    cr[j] = (int8_t)c;
    sumsq += c * c;
  }
  for (int o = 16; o > 0; o /= 2) sumsq += __shfl_xor_sync(0xffffffffu, sumsq, o);
  if (lane != 0) return;
  scales[offset(g, CQ_WIRE_SCALES, idx)] = s;
  if (norms) norms[offset(g, CQ_WIRE_NORMS, idx)] = decoded_norm(s, sumsq);
}

__device__ __forceinline__ float decode1(int8_t c, float s, const float *m, int64_t j) {
  const float v = __fmul_rn((float)c, s);
  return m ? __fadd_rn(v, m[j]) : v;
}

/* Decode, fast path: TPR threads a row, each VPT vectors of E values. */
template <typename T, int TPR, int VPT>
__global__ void __launch_bounds__(256) wire_decode_vec(const int8_t *__restrict__ codes,
                                                       const float *__restrict__ scales,
                                                       const float *__restrict__ mean, T *__restrict__ y,
                                                       const wire_geom g) {
  constexpr int E = vec_traits<T>::kElems;
  const int lane = threadIdx.x % TPR;
  const int64_t r = (int64_t)blockIdx.x * (256 / TPR) + threadIdx.x / TPR;
  if (r >= g.rows) return; /* no shuffles here */
  const int nvec = (int)(g.cols / E);
  int64_t idx[4];
  row_index(g, r, idx);
  const int8_t *cr = codes + offset(g, CQ_WIRE_CODES, idx);
  const float s = __ldg(scales + offset(g, CQ_WIRE_SCALES, idx));
  const float *mr = mean ? mean + offset(g, CQ_WIRE_MEAN, idx) : nullptr;
  T *yr = y + offset(g, CQ_WIRE_VALUES, idx);
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int vi = lane + i * TPR;
    if (vi >= nvec) break;
    uint32_t w[E / 4];
    if (E == 8) {
      const uint2 p = __ldg(reinterpret_cast<const uint2 *>(cr + (int64_t)vi * E));
      w[0] = p.x, w[E / 4 - 1] = p.y;
    } else {
      w[0] = __ldg(reinterpret_cast<const uint32_t *>(cr + (int64_t)vi * E));
    }
    float f[E];
#pragma unroll
    for (int e = 0; e < E; ++e) f[e] = __fmul_rn((float)(int8_t)(w[e / 4] >> (8 * (e % 4))), s);
    if (mr) {
#pragma unroll
      for (int q = 0; q < E / 4; ++q) {
        const float4 m = __ldg(reinterpret_cast<const float4 *>(mr + (int64_t)vi * E) + q);
        f[4 * q] = __fadd_rn(f[4 * q], m.x), f[4 * q + 1] = __fadd_rn(f[4 * q + 1], m.y);
        f[4 * q + 2] = __fadd_rn(f[4 * q + 2], m.z), f[4 * q + 3] = __fadd_rn(f[4 * q + 3], m.w);
      }
    }
    reinterpret_cast<uint4 *>(yr)[vi] = vec_traits<T>::from_float(f);
  }
}

/* Decode, any alignment and length: a warp a row. */
template <typename T>
__global__ void __launch_bounds__(256) wire_decode_scalar(const int8_t *__restrict__ codes,
                                                          const float *__restrict__ scales,
                                                          const float *__restrict__ mean, T *__restrict__ y,
                                                          const wire_geom g) {
  const int64_t r = (int64_t)blockIdx.x * 8 + threadIdx.x / 32;
  if (r >= g.rows) return;
  int64_t idx[4];
  row_index(g, r, idx);
  const int8_t *cr = codes + offset(g, CQ_WIRE_CODES, idx);
  const float s = scales[offset(g, CQ_WIRE_SCALES, idx)];
  const float *mr = mean ? mean + offset(g, CQ_WIRE_MEAN, idx) : nullptr;
  T *yr = y + offset(g, CQ_WIRE_VALUES, idx);
  for (int64_t j = threadIdx.x % 32; j < g.cols; j += 32) yr[j] = cq_from_float<T>(decode1(cr[j], s, mr, j));
}

wire_geom geom_of(const cq_wire_rows *w) {
  wire_geom g;
  for (int k = 0; k < 4; ++k) g.shape[k] = w->shape[k];
  g.rows = w->rows, g.cols = w->cols;
  for (int a = 0; a < CQ_WIRE_ARGS; ++a)
    for (int k = 0; k < 4; ++k) g.st[a][k] = w->strides[a][k];
  return g;
}

/* Whether an argument's rows start `bytes`-aligned: its address and the row strides (in bytes) of
 * the dims that step (a size-1 dim's stride is never used, and producers give it any value). */
bool rows_aligned(const void *p, const int64_t st[4], const int64_t shape[4], size_t esize, size_t bytes) {
  if ((uintptr_t)p % bytes) return false;
  for (int k = 0; k < 4; ++k)
    if (shape[k] > 1 && (st[k] * (int64_t)esize) % (int64_t)bytes) return false;
  return true;
}

/* Rows of the fast path: the values' 16-byte vectors, the codes' E-byte runs and the mean's
 * float4s all aligned, at most 128 vectors a row. Returns the vectors a row (0: the scalar path). */
template <typename T>
int vec_count(const cq_wire_rows *w, const void *values, const void *codes, const void *mean) {
  constexpr int E = vec_traits<T>::kElems;
  if (w->cols % E || w->cols / E > 128) return 0;
  if (!rows_aligned(values, w->strides[CQ_WIRE_VALUES], w->shape, sizeof(T), 16)) return 0;
  if (!rows_aligned(codes, w->strides[CQ_WIRE_CODES], w->shape, 1, E)) return 0;
  if (mean && !rows_aligned(mean, w->strides[CQ_WIRE_MEAN], w->shape, 4, 16)) return 0;
  return (int)(w->cols / E);
}

/* Blocks of 256 threads for rows of TPR threads each. */
unsigned blocks_for(int64_t rows, int tpr) { return (unsigned)((rows * tpr + 255) / 256); }

template <typename T>
cq_status encode_typed(const cq_tensor *x, const cq_tensor *mean, cq_tensor *codes, cq_tensor *scales,
                       cq_tensor *norms, const cq_wire_rows *w, cudaStream_t st) {
  const wire_geom g = geom_of(w);
  const T *xp = static_cast<const T *>(x->data);
  const float *mp = mean ? static_cast<const float *>(mean->data) : nullptr;
  int8_t *cp = static_cast<int8_t *>(codes->data);
  float *sp = static_cast<float *>(scales->data), *np = norms ? static_cast<float *>(norms->data) : nullptr;
  const int nvec = vec_count<T>(w, xp, cp, mp);
#define CQ_WIRE_ENCODE(TPR, VPT) \
  wire_encode_vec<T, TPR, VPT><<<blocks_for(g.rows, TPR), 256, 0, st>>>(xp, mp, cp, sp, np, g)
  if (nvec == 0) wire_encode_scalar<T><<<blocks_for(g.rows, 32), 256, 0, st>>>(xp, mp, cp, sp, np, g);
  else if (nvec <= 8) CQ_WIRE_ENCODE(8, 1);
  else if (nvec <= 16) CQ_WIRE_ENCODE(16, 1);
  else if (nvec <= 32) CQ_WIRE_ENCODE(32, 1);
  else if (nvec <= 64) CQ_WIRE_ENCODE(32, 2);
  else CQ_WIRE_ENCODE(32, 4);
#undef CQ_WIRE_ENCODE
  CQ_LAUNCH_CHECK(wire_encode);
  return CQ_OK;
}

template <typename T>
cq_status decode_typed(const cq_tensor *codes, const cq_tensor *scales, const cq_tensor *mean, cq_tensor *y,
                       const cq_wire_rows *w, cudaStream_t st) {
  const wire_geom g = geom_of(w);
  T *yp = static_cast<T *>(y->data);
  const float *mp = mean ? static_cast<const float *>(mean->data) : nullptr;
  const int8_t *cp = static_cast<const int8_t *>(codes->data);
  const float *sp = static_cast<const float *>(scales->data);
  const int nvec = vec_count<T>(w, yp, cp, mp);
#define CQ_WIRE_DECODE(TPR, VPT) \
  wire_decode_vec<T, TPR, VPT><<<blocks_for(g.rows, TPR), 256, 0, st>>>(cp, sp, mp, yp, g)
  if (nvec == 0) wire_decode_scalar<T><<<blocks_for(g.rows, 32), 256, 0, st>>>(cp, sp, mp, yp, g);
  else if (nvec <= 8) CQ_WIRE_DECODE(8, 1);
  else if (nvec <= 16) CQ_WIRE_DECODE(16, 1);
  else if (nvec <= 32) CQ_WIRE_DECODE(32, 1);
  else if (nvec <= 64) CQ_WIRE_DECODE(32, 2);
  else CQ_WIRE_DECODE(32, 4);
#undef CQ_WIRE_DECODE
  CQ_LAUNCH_CHECK(wire_decode);
  return CQ_OK;
}

cq_status check_grid(const cq_wire_rows *w, const char *op) {
  if (w->rows > ((int64_t)1 << 33)) /* the grid's x dimension: 8 rows a block at least */
    return cq_fail(CQ_ERR_UNSUPPORTED, "%s: %lld rows; the CUDA path takes at most 2^33", op, (long long)w->rows);
  return CQ_OK;
}

}  // namespace

extern "C" cq_status cq_wire_encode_cuda(const cq_tensor *x, const cq_tensor *mean, cq_tensor *codes,
                                         cq_tensor *scales, cq_tensor *norms, const cq_wire_rows *w, void *stream) {
  CQ_TRY(check_grid(w, "wire_encode"));
  const cudaStream_t st = cq_stream(stream);
  switch (x->dtype) {
    case CQ_DTYPE_F16: return encode_typed<__half>(x, mean, codes, scales, norms, w, st);
    case CQ_DTYPE_BF16: return encode_typed<__nv_bfloat16>(x, mean, codes, scales, norms, w, st);
    default: return encode_typed<float>(x, mean, codes, scales, norms, w, st);
  }
}

extern "C" cq_status cq_wire_decode_cuda(const cq_tensor *codes, const cq_tensor *scales, const cq_tensor *mean,
                                         cq_tensor *y, const cq_wire_rows *w, void *stream) {
  CQ_TRY(check_grid(w, "wire_decode"));
  const cudaStream_t st = cq_stream(stream);
  switch (y->dtype) {
    case CQ_DTYPE_F16: return decode_typed<__half>(codes, scales, mean, y, w, st);
    case CQ_DTYPE_BF16: return decode_typed<__nv_bfloat16>(codes, scales, mean, y, w, st);
    default: return decode_typed<float>(codes, scales, mean, y, w, st);
  }
}
