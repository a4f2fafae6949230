/* GPU generations (compute capability x 10), what each can run, and one cached query of the
 * device's properties. The floor of each linear scheme is public (CQ_MIN_CC_* in cquant.h,
 * reported by cq_linear_min_compute_capability); the launchers check exactly those, and the
 * asserts below keep them in step with the instructions the kernels use. */
#ifndef CQ_KERNELS_ARCH_CUH
#define CQ_KERNELS_ARCH_CUH

#include "cquant-cuda.h"

#define CQ_CC_AMPERE 80 /* mma.sync (bf16, fp16, int8), cp.async, ldmatrix */
#define CQ_CC_ADA 89    /* fp8 mma.sync and fp8 conversions */
#define CQ_CC_HOPPER 90 /* wgmma, TMA, setmaxnreg: sm_90a code, which runs on compute capability 9.0 only */

/* Features, by the generation that brought them. */
#define CQ_CC_MMA CQ_CC_AMPERE        /* mma.sync bf16/fp16/int8: the GEMV, the int8 GEMM, attention */
#define CQ_CC_FP8_MMA CQ_CC_ADA       /* mma.sync e4m3/e5m2: fp8 GEMM fallback, 8-bit attention */
#define CQ_CC_FP8_CUBLASLT_ROW CQ_CC_HOPPER /* cuBLASLt's fp8 GEMM with per-row (outer vector) scales */
/* Every kernel needs mma.sync: the floor below which a device runs nothing of cquant's. */
#define CQ_CC_KERNELS CQ_CC_AMPERE

/* Each scheme's public floor is what its kernels need. */
static_assert(CQ_MIN_CC_WEIGHT_ONLY >= CQ_CC_MMA, "the weight-only GEMV uses bf16/fp16 mma.sync");
static_assert(CQ_MIN_CC_INT8_DYNAMIC >= CQ_CC_MMA, "the int8 GEMM uses int8 mma.sync");
static_assert(CQ_MIN_CC_FP8_DYNAMIC >= CQ_CC_FP8_MMA, "the fp8 GEMM fallback uses fp8 mma.sync");

/* This device pass is sm_90a's: wgmma, setmaxnreg and TMA may be used. Every other pass (other
 * arches, the portable compute_90 PTX, the host) compiles the kernels that need them with an
 * empty body, and the dispatch never selects them there (cq_cc_runs_sm90a). */
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CQ_SM90A_DEVICE 1
#endif

static inline bool cq_cc_has_mma(int cc) { return cc >= CQ_CC_MMA; }
static inline bool cq_cc_has_fp8_mma(int cc) { return cc >= CQ_CC_FP8_MMA; }

/* Whether the sm_90a kernels of this build run on a device: the build holds them
 * (CQ_BUILD_SM90A, set with the sm_90a target) and the device is compute capability 9.0
 * exactly (arch-specific code runs on its own arch only; a newer GPU runs the portable PTX,
 * whose sm_90a kernels are empty). */
static inline bool cq_cc_runs_sm90a(int cc) {
#ifdef CQ_BUILD_SM90A
  return cc == CQ_CC_HOPPER;
#else
  (void)cc;
  return false;
#endif
}

static_assert(CQ_MIN_CC_ATTENTION >= CQ_CC_MMA, "the attention kernels use mma.sync");
static_assert(CQ_MIN_CC_ATTENTION_INT8 >= CQ_CC_FP8_MMA, "the 8-bit attention uses fp8 mma.sync");

/* What the kernels ask of a device, queried once per device (kernels/device.cu). */
struct cq_device_info {
  int cc;         /* compute capability x 10 */
  int sms;        /* multiprocessors */
  int smem_optin; /* bytes of shared memory one block may opt in to */
};

/* The properties of `device`; CQ_ERR_CUDA (leaving no sticky error) if it cannot be asked. */
cq_status cq_device_info_get(int device, cq_device_info *out);

/* Whether a family of sm_90a wgmma kernels runs on `device` (the current device): the build holds
 * them and the device runs sm_90a code, `kernel` (one of the family) loads there as sm_90a machine
 * code, checked once per device into the family's `image_ok` (64 entries: 0 unknown, 1 yes, -1
 * no), and CQUANT_DISABLE_WGMMA does not turn them off. *sms: the device's multiprocessors. */
bool cq_wgmma_usable(int device, const void *kernel, signed char *image_ok, int *sms);

/* The device's compute capability, or CQ_ERR_UNSUPPORTED naming `what` when it is below
 * min_cc (a CQ_MIN_CC_* floor). */
cq_status cq_require_cc(int device, int min_cc, const char *what, int *cc);

#endif /* CQ_KERNELS_ARCH_CUH */
