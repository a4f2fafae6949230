/* What the library was built with (cq_build_info_get), and the CUDA queries' answers in a CPU-only
 * build. The build's facts come from setup.py as CQ_BUILD_* definitions. */
#include <string.h>

#include "cquant-impl.h"
#ifdef CQ_WITH_CUDA
#include "cquant-cuda.h"
#endif

#ifndef CQ_VERSION
#define CQ_VERSION "unknown"
#endif
#ifndef CQ_BUILD_ARCHS
#define CQ_BUILD_ARCHS ""
#endif
#ifndef CQ_BUILD_PTX
#define CQ_BUILD_PTX ""
#endif

/* Check an out-struct argument whose size the caller's cquant.h gives (fields appended later are
 * not written for an older caller). */
static cq_status check_size(const void *out, size_t size, size_t full, const char *type) {
  if (!out) return cq_fail(CQ_ERR_INVALID_ARG, "out is required");
  if (size == 0 || size > full)
    return cq_fail(CQ_ERR_INVALID_ARG, "size = %zu; expected sizeof(%s) of the caller's cquant.h (at most %zu)", size,
                   type, full);
  return CQ_OK;
}

int cq_built_with_cuda(void) {
#ifdef CQ_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

cq_status cq_build_info_get(cq_build_info *out, size_t size) {
  CQ_TRY(check_size(out, size, sizeof(cq_build_info), "cq_build_info"));
  cq_build_info b;
  memset(&b, 0, sizeof b);
  b.version = CQ_VERSION;
  b.cuda = cq_built_with_cuda();
  b.archs = b.cuda ? CQ_BUILD_ARCHS : "";
  b.ptx = b.cuda ? CQ_BUILD_PTX : "";
#ifdef CQ_WITH_CUDA
  b.cuda_version = cq_cuda_toolkit_version();
#endif
  memcpy(out, &b, size);
  return CQ_OK;
}

#ifdef CQ_WITH_CUDA
cq_status cq_cuda_runtime_info_get(cq_cuda_runtime_info *out, size_t size) {
  CQ_TRY(check_size(out, size, sizeof(cq_cuda_runtime_info), "cq_cuda_runtime_info"));
  cq_cuda_runtime_info r;
  memset(&r, 0, sizeof r);
  CQ_TRY(cq_cuda_query_runtime(&r));
  memcpy(out, &r, size);
  return CQ_OK;
}

cq_status cq_cuda_device_get(int device_id, cq_cuda_device *out, size_t size) {
  CQ_TRY(check_size(out, size, sizeof(cq_cuda_device), "cq_cuda_device"));
  cq_cuda_device d;
  memset(&d, 0, sizeof d);
  CQ_TRY(cq_cuda_query_device(device_id, &d));
  memcpy(out, &d, size);
  return CQ_OK;
}
#else
#define CPU_ONLY "this cquant build is CPU-only (built without CUDA)"

cq_status cq_cuda_compute_capability(int device_id, int *cc) {
  (void)device_id;
  if (cc) *cc = 0;
  return cq_fail(CQ_ERR_UNSUPPORTED, CPU_ONLY);
}

cq_status cq_cuda_device_supported(int device_id) {
  (void)device_id;
  return cq_fail(CQ_ERR_UNSUPPORTED, CPU_ONLY);
}

cq_status cq_cuda_runtime_info_get(cq_cuda_runtime_info *out, size_t size) {
  CQ_TRY(check_size(out, size, sizeof(cq_cuda_runtime_info), "cq_cuda_runtime_info"));
  return cq_fail(CQ_ERR_UNSUPPORTED, CPU_ONLY);
}

cq_status cq_cuda_device_get(int device_id, cq_cuda_device *out, size_t size) {
  (void)device_id;
  CQ_TRY(check_size(out, size, sizeof(cq_cuda_device), "cq_cuda_device"));
  return cq_fail(CQ_ERR_UNSUPPORTED, CPU_ONLY);
}
#endif
