/* The output activation of a linear layer as a pass of its own, in place, for
 * the paths whose GEMM does not apply it (the weight-only GEMV, whose output is
 * at most CQ_GEMV_MAX_M rows, and cuBLASLt problems without a GELU epilogue). */
#include "linear_impl.cuh"

namespace {

template <typename T>
__global__ void activation_kernel(T *__restrict__ y, int64_t rows, int64_t cols, int64_t ld, int activation) {
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / cols, c = i - r * cols;
    T *p = y + r * ld + c;
    *p = cq_from_float<T>(cq_activate(cq_to_float(*p), activation));
  }
}

}  // namespace

cq_status cq_activation_cuda(void *y, cq_dtype dtype, int64_t rows, int64_t cols, int64_t ld, int activation,
                             cudaStream_t stream) {
  if (activation == CQ_ACTIVATION_NONE || rows < 1 || cols < 1) return CQ_OK;
  const int64_t blocks = (rows * cols + 255) / 256;
  const unsigned grid = (unsigned)(blocks > 8192 ? 8192 : blocks);
  CQ_DISPATCH_FLOAT(dtype, T, activation_kernel<T><<<grid, 256, 0, stream>>>((T *)y, rows, cols, ld, activation));
  CQ_LAUNCH_CHECK(activation_kernel);
  return CQ_OK;
}
