/*
 * DLPack ABI as cquant consumes it (DLPack 1.x, https://dmlc.github.io/dlpack).
 *
 * Declared here from the published ABI so that neither a system dlpack.h nor
 * torch's copy is a build dependency. Only the parts cquant reads are declared;
 * the layouts are fixed by the ABI and must not be edited.
 */
#ifndef CQUANT_DLPACK_H
#define CQUANT_DLPACK_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The newest DLPack version cquant understands; a major above it is refused. */
#define CQ_DLPACK_MAJOR_VERSION 1
#define CQ_DLPACK_MINOR_VERSION 1

typedef struct {
  uint32_t major; /* a different major means a different struct layout */
  uint32_t minor; /* minor bumps only add enum values */
} DLPackVersion;

typedef enum {
  kDLCPU = 1,
  kDLCUDA = 2,
  kDLCUDAHost = 3,
  kDLOpenCL = 4,
  kDLVulkan = 7,
  kDLMetal = 8,
  kDLVPI = 9,
  kDLROCM = 10,
  kDLROCMHost = 11,
  kDLExtDev = 12,
  kDLCUDAManaged = 13,
  kDLOneAPI = 14,
} DLDeviceType;

typedef struct {
  DLDeviceType device_type; /* where the data lives */
  int32_t device_id;        /* ordinal among devices of that type */
} DLDevice;

typedef enum {
  kDLInt = 0U,
  kDLUInt = 1U,
  kDLFloat = 2U,
  kDLOpaqueHandle = 3U,
  kDLBfloat = 4U,
  kDLComplex = 5U,
  kDLBool = 6U,
  kDLFloat8_e3m4 = 7U,
  kDLFloat8_e4m3 = 8U,
  kDLFloat8_e4m3b11fnuz = 9U,
  kDLFloat8_e4m3fn = 10U,
  kDLFloat8_e4m3fnuz = 11U,
  kDLFloat8_e5m2 = 12U,
  kDLFloat8_e5m2fnuz = 13U,
  kDLFloat8_e8m0fnu = 14U,
  kDLFloat6_e2m3fn = 15U,
  kDLFloat6_e3m2fn = 16U,
  kDLFloat4_e2m1fn = 17U,
} DLDataTypeCode;

typedef struct {
  uint8_t code;   /* a DLDataTypeCode */
  uint8_t bits;   /* bits per lane */
  uint16_t lanes; /* vector lanes; cquant takes 1 only */
} DLDataType;

typedef struct DLTensor {
  void *data;           /* base pointer; element 0 is at data + byte_offset */
  DLDevice device;      /* where data lives */
  int32_t ndim;         /* number of dimensions */
  DLDataType dtype;     /* element type */
  int64_t *shape;       /* ndim extents */
  int64_t *strides;     /* ndim strides in elements, or NULL for row-major */
  uint64_t byte_offset; /* offset of element 0 from data, in bytes */
} DLTensor;

typedef struct DLManagedTensor {
  DLTensor dl_tensor;                           /* the tensor */
  void *manager_ctx;                            /* producer's context */
  void (*deleter)(struct DLManagedTensor *self); /* called once by the owner */
} DLManagedTensor;

#define DLPACK_FLAG_BITMASK_READ_ONLY (1ULL << 0)
#define DLPACK_FLAG_BITMASK_IS_COPIED (1ULL << 1)

typedef struct DLManagedTensorVersioned {
  DLPackVersion version;                                  /* ABI version */
  void *manager_ctx;                                      /* producer's context */
  void (*deleter)(struct DLManagedTensorVersioned *self); /* called once by the owner */
  uint64_t flags;                                         /* DLPACK_FLAG_BITMASK_* */
  DLTensor dl_tensor;                                     /* the tensor */
} DLManagedTensorVersioned;

/* The C exchange API (DLPack 1.3): a producer type may carry a capsule
 * "dlpack_exchange_api" as its __dlpack_c_exchange_api__ attribute, giving C
 * functions that export a tensor and report the framework's current stream
 * with no Python call. Only the members cquant calls are typed. */
typedef struct DLPackExchangeAPIHeader {
  DLPackVersion version;                    /* ABI version of the table */
  struct DLPackExchangeAPIHeader *prev_api; /* older table, or NULL */
} DLPackExchangeAPIHeader;

typedef struct DLPackExchangeAPI {
  DLPackExchangeAPIHeader header; /* version first: check it before anything else */
  void *managed_tensor_allocator; /* unused by cquant */
  /* Export py_object as an owned tensor, without stream synchronisation;
   * 0 on success, -1 with a Python exception set. */
  int (*managed_tensor_from_py_object_no_sync)(void *py_object, DLManagedTensorVersioned **out);
  void *managed_tensor_to_py_object_no_sync; /* unused by cquant */
  void *dltensor_from_py_object_no_sync;     /* unused by cquant */
  /* The framework's current stream on a device; 0 or -1 with an exception. */
  int (*current_work_stream)(DLDeviceType device_type, int32_t device_id, void **out_stream);
} DLPackExchangeAPI;

#ifdef __cplusplus
}
#endif

#endif /* CQUANT_DLPACK_H */
