/* CUDA runtime helpers of the dispatch layer: device guard and capability. */
#include <cuda_runtime.h>

#include "cuda_ops.h"

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

cq_status cq_cuda_compute_capability(int device_id, int *cc) {
  int major = 0, minor = 0;
  cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_id);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_id);
  if (e != cudaSuccess) {
    cudaGetLastError(); /* clear the sticky-free error so later calls start clean */
    return cq_fail(CQ_ERR_CUDA, "no usable CUDA device %d: %s", device_id, cudaGetErrorString(e));
  }
  *cc = major * 10 + minor;
  return CQ_OK;
}
