/* Pieces shared by the attention kernels: the params struct a launch takes, cp.async,
 * ldmatrix and mma.sync wrappers, fast exp2, kernel switches. */
#ifndef CQ_ATTENTION_COMMON_CUH
#define CQ_ATTENTION_COMMON_CUH

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"

/* Everything a forward-attention kernel reads, by value (strides in elements). */
struct cq_attn_args {
  const void *q, *k, *v;   /* [B, S, H, D] inputs */
  void *out;               /* [B, Sq, H, D] output */
  float *lse;              /* [B, H, Sq] or NULL */
  int64_t q_sb, q_ss, q_sh; /* batch, sequence and head strides of q */
  int64_t k_sb, k_ss, k_sh;
  int64_t v_sb, v_ss, v_sh;
  int64_t o_sb, o_ss, o_sh;
  int batch, heads, seq_q, seq_kv, head_dim;
  float scale_log2;        /* softmax scale * log2(e) */
};

/* A compile-time bool as a value, to instantiate a generic lambda per case. */
template <bool B> struct cq_bool_tag { static constexpr bool value = B; };

/* Full-precision kernels raise a row's running max (and rescale O and l) only when a tile's
 * max passes it by more than this, in log2 units: probabilities then stay below 2^8. */
#define CQ_ATTN_RESCALE_SLACK 8.0f

#define CQ_LOG2E 1.4426950408889634f
#define CQ_LN2 0.6931471805599453f

/* Kernels can be switched off without a rebuild: CQUANT_ATTN_DISABLE holds a comma-separated
 * list of "mma" (bf16/fp16 mma.sync kernel), "sm90" (the bf16/fp16 and 8-bit wgmma kernels; see
 * cq_attn_sm90_mode), "int8" (8-bit kernels), or "all". */
static inline int cq_attn_kernel_disabled(const char *name) {
  const char *env = getenv("CQUANT_ATTN_DISABLE");
  if (!env || !*env) return 0;
  size_t n = strlen(name);
  for (const char *p = env; *p;) {
    const char *end = strchr(p, ',');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    while (len && *p == ' ') ++p, --len;
    while (len && p[len - 1] == ' ') --len;
    if ((len == n && strncmp(p, name, n) == 0) || (len == 3 && strncmp(p, "all", 3) == 0)) return 1;
    if (!end) break;
    p = end + 1;
  }
  return 0;
}

/* The sm_90a wgmma kernels run on compute capability 9.0 when this build holds them
 * (CQ_BUILD_SM90A): CQUANT_ATTN_SM90=1 forces them on, =0 off; unset, each kernel family takes
 * them where they measured faster than the mma.sync kernels on an H100 (CQ_ATTN_SM90_AUTO:
 * benchmarks/results/attention_h100.md). "sm90" in CQUANT_ATTN_DISABLE turns them off as well.
 * Head dims they do not take run the mma.sync kernels. */
enum { CQ_ATTN_SM90_OFF = 0, CQ_ATTN_SM90_ON = 1, CQ_ATTN_SM90_AUTO = 2 };
static inline int cq_attn_sm90_mode(int cc) {
#ifdef CQ_BUILD_SM90A
  if (cc != 90 || cq_attn_kernel_disabled("sm90")) return CQ_ATTN_SM90_OFF;
  const char *on = getenv("CQUANT_ATTN_SM90");
  if (on && strcmp(on, "1") == 0) return CQ_ATTN_SM90_ON;
  if (on && strcmp(on, "0") == 0) return CQ_ATTN_SM90_OFF;
  return CQ_ATTN_SM90_AUTO;
#else
  (void)cc;
  return CQ_ATTN_SM90_OFF;
#endif
}

__device__ __forceinline__ uint32_t cq_smem_addr(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16-byte global -> shared copy; when !valid the 16 bytes are zero-filled (nothing is read). */
__device__ __forceinline__ void cq_cp_async16(void *smem, const void *gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(cq_smem_addr(smem)), "l"(gmem),
               "r"(valid ? 16 : 0));
}
/* The same with a shared-memory address and a byte count in a register (16, or 0 to zero-fill). */
__device__ __forceinline__ void cq_cp_async16_n(uint32_t smem, const void *gmem, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cq_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cq_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void cq_ldsm_x4(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3, const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(cq_smem_addr(p)));
}
__device__ __forceinline__ void cq_ldsm_x4_trans(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3,
                                                 const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(cq_smem_addr(p)));
}

__device__ __forceinline__ void cq_ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void cq_ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

/* D += A B for m16n8k16 with 16-bit A, B (bf16 or fp16) and fp32 D. */
template <typename T>
__device__ __forceinline__ void cq_mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void cq_mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                            uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void cq_mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Two fp32 as one register of two 16-bit values (lo in the low half). */
template <typename T> __device__ __forceinline__ uint32_t cq_pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t cq_pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&v);
}
template <> __device__ __forceinline__ uint32_t cq_pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&v);
}

/* 2^x with the SFU (relative error ~2 ulp; 2^-inf = 0). */
__device__ __forceinline__ float cq_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
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

#endif /* CQ_ATTENTION_COMMON_CUH */
