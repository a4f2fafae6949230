/* cq_copy_rows on CUDA: the copy engines, one cudaMemcpy2DAsync per index of the outer dims. */
#include "common.cuh"
#include "cquant-cuda.h"

extern "C" cq_status cq_copy_rows_cuda(const cq_tensor *src, cq_tensor *dst, void *stream) {
  const int nd = src->ndim;
  const size_t esize = cq_dtype_size(src->dtype);
  const size_t width = (size_t)src->shape[nd - 1] * esize;
  const int64_t height = nd >= 2 ? src->shape[nd - 2] : 1;
  /* a single row's pitch is its width (cudaMemcpy2D wants pitch >= width) */
  const size_t spitch = nd >= 2 && height > 1 ? (size_t)src->strides[nd - 2] * esize : width;
  const size_t dpitch = nd >= 2 && height > 1 ? (size_t)dst->strides[nd - 2] * esize : width;
  const int64_t outer0 = nd >= 4 ? src->shape[0] : 1, outer1 = nd >= 3 ? src->shape[nd - 3] : 1;
  for (int64_t i = 0; i < outer0; ++i)
    for (int64_t j = 0; j < outer1; ++j) {
      int64_t s = 0, d = 0;
      if (nd >= 4) s += i * src->strides[0], d += i * dst->strides[0];
      if (nd >= 3) s += j * src->strides[nd - 3], d += j * dst->strides[nd - 3];
      CQ_CUDA_CHECK(cudaMemcpy2DAsync((char *)dst->data + d * (int64_t)esize, dpitch,
                                      (const char *)src->data + s * (int64_t)esize, spitch, width, (size_t)height,
                                      cudaMemcpyDefault, cq_stream(stream)));
    }
  return CQ_OK;
}
