/* TMA tensor maps (cuTensorMapEncodeTiled, found through the runtime so that libcquant needs no
 * link to the driver library), for the kernels that load tiles with the bulk tensor copy engine
 * (gemm_wgmma.cu, attention_sm90.cu). */
#ifndef CQ_KERNELS_TENSOR_MAP_CUH
#define CQ_KERNELS_TENSOR_MAP_CUH

#include <cuda.h>
#include <stdint.h>

#include "common.cuh"

/* A tiled tensor map of `rank` dims (dims[0] innermost and contiguous; strides in bytes of dims
 * 1..rank-1), read in boxes of `box` elements, no interleave, elements past the tensor read as
 * zeros, L2 promotion of 256 bytes. `what` names the operand in the error. */
cq_status cq_tensor_map(CUtensorMap *map, CUtensorMapDataType type, int rank, const void *data, const uint64_t *dims,
                        const uint64_t *strides, const uint32_t *box, CUtensorMapSwizzle swizzle, const char *what);

#endif /* CQ_KERNELS_TENSOR_MAP_CUH */
