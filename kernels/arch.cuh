/* What each GPU generation can run, and one cached query of the device's properties. The
 * generation numbers themselves (CQ_CC_*) are in cquant-cuda.h, where the core reads them too. */
#ifndef CQ_KERNELS_ARCH_CUH
#define CQ_KERNELS_ARCH_CUH

#include "cquant-cuda.h"

/* Features, by the generation that brought them. */
#define CQ_CC_MMA CQ_CC_AMPERE      /* mma.sync bf16/fp16/int8: the GEMV, the int8 GEMM, attention */
#define CQ_CC_FP8_MMA CQ_CC_ADA     /* mma.sync e4m3/e5m2: fp8 GEMM fallback, 8-bit attention */
#define CQ_CC_FP8_CUBLASLT_ROW 90   /* cuBLASLt's fp8 GEMM with per-row (outer vector) scales */

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

/* What the kernels ask of a device, queried once per device (kernels/device.cu). */
struct cq_device_info {
  int cc;         /* compute capability x 10 */
  int sms;        /* multiprocessors */
  int smem_optin; /* bytes of shared memory one block may opt in to */
};

/* The properties of `device`; CQ_ERR_CUDA (leaving no sticky error) if it cannot be asked. */
cq_status cq_device_info_get(int device, cq_device_info *out);

#endif /* CQ_KERNELS_ARCH_CUH */
