/* Pieces shared by the attention kernels (attention_mma.cu, attention_sm90.cu,
 * attention_int8_*.cu) and their dispatch (attention_dispatch.cu): the params struct a launch
 * takes, the kernel switches, quad reductions and packing. PTX wrappers are in ptx.cuh. */
#ifndef CQ_KERNELS_ATTENTION_CUH
#define CQ_KERNELS_ATTENTION_CUH

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"
#include "ptx.cuh"

/* Everything a forward-attention kernel reads, by value (strides in elements). */
struct cq_attn_args {
  const void *q, *k, *v;   /* [B, S, H, D] inputs */
  void *out;               /* [B, Sq, H, D] output */
  float *lse;              /* [B, H, Sq] or NULL: element (b, h, i) at b * lse_sb + h * seq_q + i */
  int64_t lse_sb;          /* batch stride of lse (its heads and rows are dense) */
  int64_t q_sb, q_ss, q_sh; /* batch, sequence and head strides of q */
  int64_t k_sb, k_ss, k_sh;
  int64_t v_sb, v_ss, v_sh;
  int64_t o_sb, o_ss, o_sh;
  int batch, heads, seq_q, seq_kv, head_dim;
  float scale_log2;        /* softmax scale * log2(e) */
  /* The 8-bit mode's per-head fallback, or NULL: (b, h) at b * full_heads_sb + h is nonzero
   * where that head runs in full precision. The full-precision kernels then compute only
   * those heads, the 8-bit ones only the others. */
  const uint8_t *full_heads;
  int64_t full_heads_sb;
};

/* Whether head (b, h) is this launch's to compute (cq_attn_args.full_heads). */
__device__ __forceinline__ bool cq_attn_head_is_full(const cq_attn_args &a, int b, int h) {
  return a.full_heads == NULL || a.full_heads[(int64_t)b * a.full_heads_sb + h] != 0;
}

/* A compile-time bool as a value, to instantiate a generic lambda per case. */
template <bool B> struct cq_bool_tag { static constexpr bool value = B; };

/* Full-precision kernels raise a row's running max (and rescale O and l) only when a tile's
 * max passes it by more than this, in log2 units: probabilities then stay below 2^8. */
#define CQ_ATTN_RESCALE_SLACK 8.0f

#define CQ_LOG2E 1.4426950408889634f
#define CQ_LN2 0.6931471805599453f

/* Kernels switched off without a rebuild (CQUANT_ATTN_DISABLE, cq_settings): `kernel` is a
 * CQ_ATTN_KERNEL_* bit. */
static inline bool cq_attn_kernel_disabled(unsigned kernel) { return (cq_settings_now().attn_disabled & kernel) != 0; }

/* The sm_90a wgmma kernels run on compute capability 9.0 when this build holds them
 * (cq_cc_runs_sm90a): CQUANT_ATTN_SM90=1 forces them on, =0 off; unset, each kernel family takes
 * them where they measured faster than the mma.sync kernels (CQ_ATTN_SM90_AUTO: on an H200 both
 * families, at every head dim they have, on every shape of benchmarks/bench_attention.py:
 * benchmarks/results/attention_h200.md). "sm90" in CQUANT_ATTN_DISABLE turns them off as well.
 * Head dims they do not take run the mma.sync kernels. */
enum { CQ_ATTN_SM90_OFF = 0, CQ_ATTN_SM90_ON = 1, CQ_ATTN_SM90_AUTO = 2 };
static inline int cq_attn_sm90_mode(int cc) {
  if (!cq_cc_runs_sm90a(cc) || cq_attn_kernel_disabled(CQ_ATTN_KERNEL_SM90)) return CQ_ATTN_SM90_OFF;
  const int setting = cq_settings_now().attn_sm90;
  return setting == 1 ? CQ_ATTN_SM90_ON : setting == 0 ? CQ_ATTN_SM90_OFF : CQ_ATTN_SM90_AUTO;
}

/* Max and sum over the 4 lanes of a quad (the lanes holding one row of an mma tile). */
__device__ __forceinline__ float cq_quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float cq_quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

/* The kernels' launchers, for the dispatch (attention_dispatch.cu). */
cq_status cq_attention_mma_launch(const cq_attn_args &a, int is_bf16, cudaStream_t stream);   /* attention_mma.cu */
int cq_attention_sm90_applies(const cq_attn_args &a, int cc);                                   /* attention_sm90.cu */
cq_status cq_attention_sm90_launch(const cq_attn_args &a, int is_bf16, cudaStream_t stream);
cq_status cq_attention_int8_workspace(const cq_attention_params *p, const cq_attention_dims *n,
                                      size_t *bytes);                                        /* attention_int8_prep.cu */
cq_status cq_attention_int8_launch(const cq_attn_args &a, const cq_attention_params *p, void *workspace,
                                   size_t workspace_bytes, int cc, int dtype_is_bf16, cudaStream_t stream);

#endif /* CQ_KERNELS_ATTENTION_CUH */
