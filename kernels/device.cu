/* Devices: the current-device guard of the dispatch, the cached per-device properties
 * (arch.cuh), and the public queries of the CUDA build (cq_cuda_compute_capability,
 * cq_cuda_device_supported, and the runtime and device reports of cq_build_info.c). */
#include <cuda_runtime.h>

#include <mutex>
#include <stdio.h>
#include <string.h>

#include "arch.cuh"
#include "cublaslt.h"

cq_status cq_cuda_enter_device(int device_id, int *prev) {
  cudaError_t e = cudaGetDevice(prev);
  if (e != cudaSuccess)
    return cq_fail(CQ_ERR_CUDA, "cudaGetDevice failed: %s (is a CUDA driver installed?)", cudaGetErrorString(e));
  if (*prev != device_id) {
    e = cudaSetDevice(device_id);
    if (e != cudaSuccess) return cq_fail(CQ_ERR_CUDA, "cudaSetDevice(%d) failed: %s", device_id, cudaGetErrorString(e));
  }
  return CQ_OK;
}

void cq_cuda_restore_device(int prev) {
  int cur = -1;
  if (cudaGetDevice(&cur) == cudaSuccess && cur != prev) cudaSetDevice(prev);
}

namespace {

constexpr int kCachedDevices = 64;
std::mutex cache_mutex;
cq_device_info cache[kCachedDevices];
bool cached[kCachedDevices];

cq_status query(int device, cq_device_info *out) {
  int major = 0, minor = 0, sms = 0, smem = 0;
  cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (e != cudaSuccess) {
    cudaGetLastError(); /* a failed query leaves no error behind for the next call */
    return cq_fail(CQ_ERR_CUDA, "no usable CUDA device %d: %s", device, cudaGetErrorString(e));
  }
  out->cc = major * 10 + minor, out->sms = sms, out->smem_optin = smem;
  return CQ_OK;
}

/* The smallest kernel of the build: whether its image loads on a device tells whether the
 * build has code (SASS or PTX) for it, as every kernel is built for the same targets. */
__global__ void probe_kernel(int *p) {
  if (p) *p = 0;
}

}  // namespace

cq_status cq_device_info_get(int device, cq_device_info *out) {
  if (device < 0 || device >= kCachedDevices) return query(device, out);
  std::lock_guard<std::mutex> lock(cache_mutex);
  if (!cached[device]) {
    CQ_TRY(query(device, &cache[device]));
    cached[device] = true;
  }
  *out = cache[device];
  return CQ_OK;
}

cq_status cq_require_cc(int device, int min_cc, const char *what, int *cc) {
  cq_device_info info;
  CQ_TRY(cq_device_info_get(device, &info));
  if (info.cc < min_cc)
    return cq_fail(CQ_ERR_UNSUPPORTED, "%s needs a GPU of compute capability %d.%d (sm_%d) or newer; device %d is "
                   "%d.%d", what, min_cc / 10, min_cc % 10, min_cc, device, info.cc / 10, info.cc % 10);
  if (cc) *cc = info.cc;
  return CQ_OK;
}

extern "C" cq_status cq_cuda_compute_capability(int device_id, int *cc) {
  if (!cc) return cq_fail(CQ_ERR_INVALID_ARG, "cc is required");
  cq_device_info info;
  CQ_TRY(cq_device_info_get(device_id, &info));
  *cc = info.cc;
  return CQ_OK;
}

extern "C" cq_status cq_cuda_device_supported(int device_id) {
  cq_device_info info;
  CQ_TRY(cq_device_info_get(device_id, &info));
  if (info.cc < CQ_CC_KERNELS)
    return cq_fail(CQ_ERR_UNSUPPORTED, "CUDA device %d is compute capability %d.%d; cquant's kernels need %d.%d or "
                   "newer", device_id, info.cc / 10, info.cc % 10, CQ_CC_KERNELS / 10, CQ_CC_KERNELS % 10);
  int prev = 0;
  CQ_TRY(cq_cuda_enter_device(device_id, &prev));
  cudaFuncAttributes attr;
  const cudaError_t e = cudaFuncGetAttributes(&attr, probe_kernel);
  cq_cuda_restore_device(prev);
  if (e == cudaSuccess) return CQ_OK;
  cudaGetLastError();
  if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidKernelImage || e == cudaErrorInvalidDeviceFunction ||
      e == cudaErrorUnsupportedPtxVersion)
    return cq_fail(CQ_ERR_UNSUPPORTED, "this cquant build has no kernel image for CUDA device %d (compute capability "
                   "%d.%d): it holds neither its machine code nor PTX the driver can compile for it (%s); rebuild "
                   "cquant on a machine with this GPU, or with CQUANT_CUDA_ARCHS naming its arch",
                   device_id, info.cc / 10, info.cc % 10, cudaGetErrorString(e));
  return cq_fail(CQ_ERR_CUDA, "loading cquant's kernels on CUDA device %d failed: %s", device_id,
                 cudaGetErrorString(e));
}

bool cq_wgmma_usable(int device, const void *kernel, signed char *image_ok, int *sms) {
  cq_device_info info;
  if (cq_settings_now().disable_wgmma || cq_device_info_get(device, &info) != CQ_OK || !cq_cc_runs_sm90a(info.cc))
    return false;
  if (device < 0 || device >= 64) return false;
  signed char ok = __atomic_load_n(&image_ok[device], __ATOMIC_RELAXED);
  if (!ok) {
    cudaFuncAttributes attr;
    ok = cudaFuncGetAttributes(&attr, kernel) == cudaSuccess && attr.binaryVersion == 90 ? 1 : -1;
    cudaGetLastError(); /* a failed query leaves no sticky error behind */
    __atomic_store_n(&image_ok[device], ok, __ATOMIC_RELAXED);
  }
  *sms = info.sms;
  return ok > 0;
}

int cq_cuda_toolkit_version(void) { return CUDART_VERSION; }

cq_status cq_cuda_query_runtime(cq_cuda_runtime_info *out) {
  cudaRuntimeGetVersion(&out->runtime_version);
  if (cudaDriverGetVersion(&out->driver_version) != cudaSuccess) out->driver_version = 0;
  if (cudaGetDeviceCount(&out->device_count) != cudaSuccess) out->device_count = 0;
  cudaGetLastError(); /* no driver or no device: an answer, not an error left behind */
  return cq_lt_describe(&out->cublaslt_version, out->cublaslt_path, sizeof out->cublaslt_path, out->cublaslt_error,
                        sizeof out->cublaslt_error);
}

cq_status cq_cuda_query_device(int device_id, cq_cuda_device *out) {
  cq_device_info info;
  CQ_TRY(cq_device_info_get(device_id, &info));
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device_id) == cudaSuccess) {
    snprintf(out->name, sizeof out->name, "%s", prop.name);
    out->total_memory = prop.totalGlobalMem;
  }
  cudaGetLastError();
  out->cc = info.cc, out->sms = info.sms;
  if (cq_cuda_device_supported(device_id) != CQ_OK) {
    snprintf(out->why_not, sizeof out->why_not, "%s", cq_last_error());
    return CQ_OK;
  }
  out->kernels = 1;
  if (cq_cc_runs_sm90a(info.cc)) { /* the loaded image is the sm_90a one (not PTX compiled for 9.0) */
    int prev = 0;
    CQ_TRY(cq_cuda_enter_device(device_id, &prev));
    cudaFuncAttributes attr;
    out->sm90a = cudaFuncGetAttributes(&attr, probe_kernel) == cudaSuccess && attr.binaryVersion == 90;
    cudaGetLastError();
    cq_cuda_restore_device(prev);
  }
  return CQ_OK;
}
