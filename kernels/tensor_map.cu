/* cuTensorMapEncodeTiled from the driver, found through the runtime (tensor_map.cuh). */
#include "tensor_map.cuh"

typedef CUresult (*encode_tiled_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                    const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                    CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static cq_status get_encode_fn(encode_tiled_fn *fn) {
  static encode_tiled_fn cached = nullptr;
  if (!cached) {
    void *f = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    CQ_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || !f)
      return cq_fail(CQ_ERR_UNSUPPORTED, "the CUDA driver has no cuTensorMapEncodeTiled (needs a CUDA 12+ driver)");
    cached = (encode_tiled_fn)f;
  }
  *fn = cached;
  return CQ_OK;
}

cq_status cq_tensor_map(CUtensorMap *map, CUtensorMapDataType type, int rank, const void *data, const uint64_t *dims,
                        const uint64_t *strides, const uint32_t *box, CUtensorMapSwizzle swizzle, const char *what) {
  encode_tiled_fn encode;
  CQ_TRY(get_encode_fn(&encode));
  cuuint64_t d[5], s[4];
  cuuint32_t b[5], e[5];
  for (int i = 0; i < rank; ++i) d[i] = dims[i], b[i] = box[i], e[i] = 1;
  for (int i = 0; i + 1 < rank; ++i) s[i] = strides[i];
  const CUresult r = encode(map, type, (cuuint32_t)rank, const_cast<void *>(data), d, s, b, e,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return cq_fail(CQ_ERR_CUDA, "cuTensorMapEncodeTiled(%s: %d dims, inner %llu x %llu, stride %llu) failed with "
                   "CUresult %d", what, rank, (unsigned long long)dims[0], (unsigned long long)dims[1],
                   (unsigned long long)strides[0], (int)r);
  return CQ_OK;
}
