/* Q/K RMSNorm + rotary embedding + V copy between the QKV projections of an attention block
 * and its attention call (cq_qk_norm_rope).
 *
 * One group of lanes per (batch, token, head): the smallest power of two of lanes that covers
 * the head in chunks (one 16-byte vector each, or one pair of elements when D is not a whole
 * number of vectors or a layout is misaligned), so a head of 128 bf16 takes 16 lanes and a warp
 * does two heads at once. Each group loads its head of q, k and v at once, sums the squares for
 * the RMSNorm with a butterfly inside the group, and rotates the pairs (2i, 2i+1) it holds with
 * their row of cos / sin. Inputs and outputs are read and written through their own strides
 * (views of a fused projection output, transposed layouts); index math is 64-bit. The element
 * math uses non-contracting intrinsics, one for each operation of the C reference, so the paths
 * differ only in the order of the sum of squares. */
#include "act_encode.cuh"

namespace {

using cq_act::vec_traits;

constexpr int kThreads = 256;
#ifndef CQ_QK_NORM_ROPE_WIDE /* N > 0: the WIDE kernel, N chunks a lane, for vector layouts (H200: 2 is 1.10-1.30x of
                                one chunk a lane, 4 0.55-0.75x); 0: one chunk a lane */
#define CQ_QK_NORM_ROPE_WIDE 2
#endif
constexpr int64_t kMaxHeadDim = CQ_ATTENTION_MAX_HEAD_DIM; /* cquant.h: the CUDA limit of head dims */

/* q, k or v: input [B, S, H, D] and output [B, S_total, H, D] strides (elements), norm weight. */
struct qk_operand {
  const void *in;
  void *out;
  int64_t in_sb, in_ss, in_sh, out_sb, out_ss, out_sh;
  const void *w; /* [D], or NULL */
  cq_dtype w_dtype;
};

struct qk_args {
  qk_operand op[3];       /* q, k, v (v's in NULL: no v) */
  const float *cos, *sin; /* [S_total, D / 2], or NULL: no rotation */
  int tab_vec;            /* cos / sin 16-byte aligned: a chunk's pairs load as one vector */
  int64_t units, seq, heads, d, seq_offset;
  int rms_norm;
  float eps;
  int lanes;  /* lanes per head: a power of two <= 32 */
  int chunks; /* chunks per lane */
  int w_vec[2]; /* q's, k's norm weight 16-byte aligned (WIDE: a chunk's weights load as vectors) */
};

/* E consecutive elements of a head held by one lane (E even: whole pairs). VEC: one 16-byte
 * vector; else one pair, element by element (the second absent past an odd D). */
template <typename T, bool VEC> struct chunk;

template <typename T> struct chunk<T, true> {
  static constexpr int E = vec_traits<T>::kElems;
  uint4 raw;
  __device__ void load(const T *p, int64_t d0, int64_t) { raw = __ldg(reinterpret_cast<const uint4 *>(p + d0)); }
  __device__ void clear() { raw = make_uint4(0, 0, 0, 0); }
  __device__ void store_raw(T *p, int64_t d0, int64_t) const { *reinterpret_cast<uint4 *>(p + d0) = raw; }
  __device__ void to_float(float *f) const { vec_traits<T>::to_float(raw, f); }
  __device__ static void store(T *p, int64_t d0, int64_t, const float *f) {
    *reinterpret_cast<uint4 *>(p + d0) = vec_traits<T>::from_float(f);
  }
};

template <typename T> struct chunk<T, false> {
  static constexpr int E = 2;
  T raw[2];
  __device__ void load(const T *p, int64_t d0, int64_t d) {
    raw[0] = p[d0];
    raw[1] = d0 + 1 < d ? p[d0 + 1] : cq_from_float<T>(0.0f);
  }
  __device__ void clear() { raw[0] = raw[1] = cq_from_float<T>(0.0f); }
  __device__ void store_raw(T *p, int64_t d0, int64_t d) const {
    p[d0] = raw[0];
    if (d0 + 1 < d) p[d0 + 1] = raw[1];
  }
  __device__ void to_float(float *f) const { f[0] = cq_to_float(raw[0]), f[1] = cq_to_float(raw[1]); }
  __device__ static void store(T *p, int64_t d0, int64_t d, const float *f) {
    p[d0] = cq_from_float<T>(f[0]);
    if (d0 + 1 < d) p[d0 + 1] = cq_from_float<T>(f[1]);
  }
};

/* N consecutive entries of a cos / sin row (from entry `off`). */
template <int N>
__device__ __forceinline__ void load_table(const float *t, int64_t off, int vec, float *f) {
  if constexpr (N == 4) {
    if (vec) {
      const float4 v = __ldg(reinterpret_cast<const float4 *>(t + off));
      f[0] = v.x, f[1] = v.y, f[2] = v.z, f[3] = v.w;
      return;
    }
  } else if constexpr (N == 2) {
    if (vec) {
      const float2 v = __ldg(reinterpret_cast<const float2 *>(t + off));
      f[0] = v.x, f[1] = v.y;
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < N; ++i) f[i] = __ldg(t + off + i);
}

/* The E norm weights of a vector chunk from element d0 (a multiple of E) as floats: vector loads
 * where the weight is 16-byte aligned, element by element otherwise. */
template <int E>
__device__ __forceinline__ void load_weights(const void *w, cq_dtype t, int64_t d0, int vec, float *f) {
  if (vec && t == CQ_DTYPE_F32 && E % 4 == 0) {
#pragma unroll
    for (int i = 0; i < E / 4; ++i) {
      const float4 v = __ldg(reinterpret_cast<const float4 *>(static_cast<const float *>(w) + d0) + i);
      f[4 * i] = v.x, f[4 * i + 1] = v.y, f[4 * i + 2] = v.z, f[4 * i + 3] = v.w;
    }
    return;
  }
  if constexpr (E == 8) {
    if (vec && (t == CQ_DTYPE_BF16 || t == CQ_DTYPE_F16)) {
      const uint4 v = __ldg(reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(w) + d0));
      if (t == CQ_DTYPE_BF16) vec_traits<__nv_bfloat16>::to_float(v, f);
      else vec_traits<__half>::to_float(v, f);
      return;
    }
  }
#pragma unroll
  for (int e = 0; e < E; ++e) f[e] = cq_load_any(w, t, d0 + e);
}

__device__ __forceinline__ int64_t active_unit(int64_t u, int64_t units) { return u < units ? u : -1; }

/* (batch, token, head) of unit u = (b * seq + s) * heads + h; 32-bit division where the units
 * fit (64-bit division is a long software sequence, paid per head otherwise). */
__device__ __forceinline__ void split_unit(int64_t u, const qk_args &a, int64_t *b, int64_t *s, int64_t *h) {
  if (a.units <= 0xffffffffLL) {
    const uint32_t uu = (uint32_t)u, heads = (uint32_t)a.heads, seq = (uint32_t)a.seq;
    const uint32_t bs = uu / heads;
    *h = uu - bs * heads, *s = bs % seq, *b = bs / seq;
    return;
  }
  const int64_t bs = u / a.heads;
  *h = u - bs * a.heads, *s = bs % a.seq, *b = bs / a.seq;
}

/* WIDE (vector chunks only): a unit's cos / sin rows are read once for q and k, and the norm
 * weights of a chunk as vectors; the same operations on every element. */
template <typename T, bool VEC, int MAXC, bool WIDE>
__global__ void __launch_bounds__(kThreads) qk_norm_rope_kernel(qk_args a) {
  using C = chunk<T, VEC>;
  constexpr int E = C::E;
  const int lane = threadIdx.x & 31, L = a.lanes, sub = lane & (L - 1), per_warp = 32 / L;
  const int nops = a.op[2].in ? 3 : 2;
  const int64_t warp = ((int64_t)blockIdx.x * kThreads + threadIdx.x) >> 5;
  const int64_t warps = ((int64_t)gridDim.x * kThreads) >> 5;
  /* the loop is uniform over the warp (every lane takes part in the butterflies); groups past
   * the last unit compute on zeros and store nothing */
  for (int64_t base = warp * per_warp; base < a.units; base += warps * per_warp) {
    const int64_t u = active_unit(base + lane / L, a.units);
    const bool active = u >= 0;
    int64_t b = 0, s = 0, h = 0;
    if (active) split_unit(u, a, &b, &s, &h);
    const int64_t pos = a.seq_offset + s;
    bool valid[MAXC];
#pragma unroll
    for (int c = 0; c < MAXC; ++c) valid[c] = active && c < a.chunks && (int64_t)(sub + c * L) * E < a.d;

    C x[3][MAXC];
    float cs_u[WIDE ? MAXC : 1][E / 2], sn_u[WIDE ? MAXC : 1][E / 2]; /* WIDE: the unit's cos / sin */
    if constexpr (WIDE) {
      if (a.cos) {
#pragma unroll
        for (int c = 0; c < MAXC; ++c) {
          if (!valid[c]) continue;
          const int64_t t_off = pos * (a.d / 2) + (int64_t)(sub + c * L) * (E / 2);
          load_table<E / 2>(a.cos, t_off, a.tab_vec, cs_u[c]);
          load_table<E / 2>(a.sin, t_off, a.tab_vec, sn_u[c]);
        }
      }
    }
#pragma unroll
    for (int o = 0; o < 3; ++o) {
      if (o >= nops) break;
      const qk_operand &op = a.op[o];
      const T *in = static_cast<const T *>(op.in) + b * op.in_sb + s * op.in_ss + h * op.in_sh;
#pragma unroll
      for (int c = 0; c < MAXC; ++c) {
        if (valid[c]) x[o][c].load(in, (int64_t)(sub + c * L) * E, a.d);
        else x[o][c].clear();
      }
    }

#pragma unroll
    for (int o = 0; o < 3; ++o) {
      if (o >= nops) break;
      const qk_operand &op = a.op[o];
      T *out = static_cast<T *>(op.out) + b * op.out_sb + pos * op.out_ss + h * op.out_sh;
      if (o == 2) { /* v: copied bit for bit */
#pragma unroll
        for (int c = 0; c < MAXC; ++c)
          if (valid[c]) x[o][c].store_raw(out, (int64_t)(sub + c * L) * E, a.d);
        continue;
      }
      float f[MAXC][E];
#pragma unroll
      for (int c = 0; c < MAXC; ++c) x[o][c].to_float(f[c]);
      if (a.rms_norm) {
        float ss = 0.0f; /* cleared chunks add +0 */
#pragma unroll
        for (int c = 0; c < MAXC; ++c)
#pragma unroll
          for (int e = 0; e < E; ++e) ss = __fadd_rn(ss, __fmul_rn(f[c][e], f[c][e]));
        for (int off = L / 2; off > 0; off >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, off));
        const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)a.d), a.eps)));
#pragma unroll
        for (int c = 0; c < MAXC; ++c) {
          if constexpr (WIDE) { /* vector chunks: a valid chunk lies within D */
            float wv[E];
            if (op.w && valid[c]) load_weights<E>(op.w, op.w_dtype, (int64_t)(sub + c * L) * E, a.w_vec[o], wv);
#pragma unroll
            for (int e = 0; e < E; ++e) {
              f[c][e] = __fmul_rn(f[c][e], r);
              if (op.w && valid[c]) f[c][e] = __fmul_rn(f[c][e], wv[e]);
            }
            continue;
          }
#pragma unroll
          for (int e = 0; e < E; ++e) {
            const int64_t dd = (int64_t)(sub + c * L) * E + e;
            f[c][e] = __fmul_rn(f[c][e], r);
            if (op.w && valid[c] && dd < a.d) f[c][e] = __fmul_rn(f[c][e], cq_load_any(op.w, op.w_dtype, dd));
          }
        }
      }
      if (a.cos) {
#pragma unroll
        for (int c = 0; c < MAXC; ++c) {
          if (!valid[c]) continue;
          float cs[E / 2], sn[E / 2];
          if constexpr (WIDE) {
#pragma unroll
            for (int i = 0; i < E / 2; ++i) cs[i] = cs_u[c][i], sn[i] = sn_u[c][i];
          } else {
            const int64_t t_off = pos * (a.d / 2) + (int64_t)(sub + c * L) * (E / 2);
            load_table<E / 2>(a.cos, t_off, a.tab_vec, cs);
            load_table<E / 2>(a.sin, t_off, a.tab_vec, sn);
          }
#pragma unroll
          for (int i = 0; i < E / 2; ++i) {
            const float a0 = f[c][2 * i], a1 = f[c][2 * i + 1];
            f[c][2 * i] = __fsub_rn(__fmul_rn(a0, cs[i]), __fmul_rn(a1, sn[i]));
            f[c][2 * i + 1] = __fadd_rn(__fmul_rn(a0, sn[i]), __fmul_rn(a1, cs[i]));
          }
        }
      }
#pragma unroll
      for (int c = 0; c < MAXC; ++c)
        if (valid[c]) C::store(out, (int64_t)(sub + c * L) * E, a.d, f[c]);
    }
  }
}

/* WIDE: as few lanes a head as hold it in MAXC chunks each; else one chunk a lane where 32 lanes do */
template <typename T, bool VEC, int MAXC, bool WIDE = false>
cq_status launch(qk_args &a, cudaStream_t s) {
  static_assert(VEC || !WIDE, "WIDE takes vector chunks");
  constexpr int E = chunk<T, VEC>::E;
  const int64_t nch = (a.d + E - 1) / E;
  int lanes = 1;
  while (lanes < 32 && lanes * (WIDE ? MAXC : 1) < nch) lanes *= 2;
  a.lanes = lanes;
  a.chunks = (int)((nch + lanes - 1) / lanes);
  if (a.chunks > MAXC)
    return cq_fail(CQ_ERR_INTERNAL, "qk_norm_rope: head_dim %lld needs %d chunks a lane (kernel holds %d)",
                   (long long)a.d, a.chunks, MAXC);
  const int64_t warps = (a.units + 32 / lanes - 1) / (32 / lanes);
  int64_t blocks = (warps + kThreads / 32 - 1) / (kThreads / 32);
  if (blocks > (1 << 20)) blocks = 1 << 20; /* the kernel strides over the rest */
  qk_norm_rope_kernel<T, VEC, MAXC, WIDE><<<(unsigned)blocks, kThreads, 0, s>>>(a);
  CQ_LAUNCH_CHECK(qk_norm_rope_kernel);
  return CQ_OK;
}

/* A tensor whose heads start on 16-byte boundaries, E elements apart in every used dim. */
bool vector_layout(const cq_tensor *t, int64_t e) {
  if (!t) return true;
  if ((uintptr_t)t->data % 16) return false;
  for (int i = 0; i < 3; ++i)
    if (t->shape[i] > 1 && t->strides[i] % e) return false;
  return true;
}

void set_operand(qk_operand *op, const cq_tensor *in, const cq_tensor *w, cq_tensor *out) {
  op->in = in ? in->data : NULL;
  op->out = out ? out->data : NULL;
  if (in) op->in_sb = in->strides[0], op->in_ss = in->strides[1], op->in_sh = in->strides[2];
  if (out) op->out_sb = out->strides[0], op->out_ss = out->strides[1], op->out_sh = out->strides[2];
  op->w = w ? w->data : NULL;
  op->w_dtype = w ? w->dtype : CQ_DTYPE_F32;
}

}  // namespace

extern "C" cq_status cq_qk_norm_rope_cuda(const cq_tensor *q_in, const cq_tensor *k_in, const cq_tensor *v_in,
                                          const cq_tensor *q_weight, const cq_tensor *k_weight, const cq_tensor *cos,
                                          const cq_tensor *sin, const cq_qk_norm_rope_params *p,
                                          const cq_qk_norm_rope_dims *dims, cq_tensor *q_out, cq_tensor *k_out,
                                          cq_tensor *v_out, void *stream) {
  if (dims->head_dim > kMaxHeadDim)
    return cq_fail(CQ_ERR_UNSUPPORTED, "qk_norm_rope: head_dim %lld; the CUDA kernel takes head dims up to %lld",
                   (long long)dims->head_dim, (long long)kMaxHeadDim);
  qk_args a = {};
  set_operand(&a.op[0], q_in, q_weight, q_out);
  set_operand(&a.op[1], k_in, k_weight, k_out);
  set_operand(&a.op[2], v_in, NULL, v_out);
  a.cos = cos ? (const float *)cos->data : NULL, a.sin = sin ? (const float *)sin->data : NULL;
  a.tab_vec = cos && (uintptr_t)cos->data % 16 == 0 && (uintptr_t)sin->data % 16 == 0;
  a.w_vec[0] = q_weight && (uintptr_t)q_weight->data % 16 == 0, a.w_vec[1] = k_weight && (uintptr_t)k_weight->data % 16 == 0;
  a.units = dims->batch * dims->seq * dims->heads, a.seq = dims->seq, a.heads = dims->heads, a.d = dims->head_dim;
  a.seq_offset = p->seq_offset, a.rms_norm = p->rms_norm != 0, a.eps = p->eps;
  if (a.units == 0) return CQ_OK;
  const int64_t e = 16 / (int64_t)cq_dtype_size(q_in->dtype);
  const bool vec = a.d % e == 0 && vector_layout(q_in, e) && vector_layout(k_in, e) && vector_layout(v_in, e) &&
                   vector_layout(q_out, e) && vector_layout(k_out, e) && vector_layout(v_out, e);
  cudaStream_t s = cq_stream(stream);
  switch (q_in->dtype) {
#if CQ_QK_NORM_ROPE_WIDE > 0
    case CQ_DTYPE_BF16:
      return vec ? launch<__nv_bfloat16, true, CQ_QK_NORM_ROPE_WIDE, true>(a, s) : launch<__nv_bfloat16, false, 4>(a, s);
    case CQ_DTYPE_F16: return vec ? launch<__half, true, CQ_QK_NORM_ROPE_WIDE, true>(a, s) : launch<__half, false, 4>(a, s);
    case CQ_DTYPE_F32: return vec ? launch<float, true, CQ_QK_NORM_ROPE_WIDE, true>(a, s) : launch<float, false, 4>(a, s);
#else
    case CQ_DTYPE_BF16:
      return vec ? launch<__nv_bfloat16, true, 1>(a, s) : launch<__nv_bfloat16, false, 4>(a, s);
    case CQ_DTYPE_F16: return vec ? launch<__half, true, 1>(a, s) : launch<__half, false, 4>(a, s);
    case CQ_DTYPE_F32: return vec ? launch<float, true, 2>(a, s) : launch<float, false, 4>(a, s);
#endif
    default: break;
  }
  return cq_fail(CQ_ERR_INTERNAL, "qk_norm_rope: unexpected dtype %s", cq_dtype_name(q_in->dtype));
}
