/* Status codes and the thread-local last-error message. */
#include <stdarg.h>
#include <stdio.h>

#include "cquant-impl.h"

static _Thread_local char last_error[1024];

const char *cq_last_error(void) { return last_error; }

cq_status cq_fail(cq_status status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return status;
}

const char *cq_status_name(cq_status status) {
  switch (status) {
    case CQ_OK: return "CQ_OK";
    case CQ_ERR_INVALID_ARG: return "CQ_ERR_INVALID_ARG";
    case CQ_ERR_TYPE: return "CQ_ERR_TYPE";
    case CQ_ERR_UNSUPPORTED: return "CQ_ERR_UNSUPPORTED";
    case CQ_ERR_DLPACK: return "CQ_ERR_DLPACK";
    case CQ_ERR_CUDA: return "CQ_ERR_CUDA";
    case CQ_ERR_CUBLAS: return "CQ_ERR_CUBLAS";
    case CQ_ERR_OOM: return "CQ_ERR_OOM";
    case CQ_ERR_INTERNAL: return "CQ_ERR_INTERNAL";
  }
  return "CQ_ERR_UNKNOWN";
}
