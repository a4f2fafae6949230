/* The 4-bit formats per group on the GPU (quantize_group.cu): quantize, and the dequantized rows
 * that cq_dequantize and the large-batch weight-only GEMM read. Bit-identical to the C reference
 * (the scalar math is cq_numerics.h's). */
#ifndef CQ_KERNELS_QUANTIZE_GROUP_CUH
#define CQ_KERNELS_QUANTIZE_GROUP_CUH

#include "common.cuh"

/* cq_quantize with CQ_GRANULARITY_GROUP or TWO_LEVEL (arguments checked): codes of x [rows, cols]
 * into q (packed nibbles, row_bytes a row), scales [rows, G] (int4), [rows, G, 2] (uint4) or
 * [rows, 1 + G] (two-level int4). */
cq_status cq_quantize_group_cuda(const cq_tensor *x, const cq_quant_params *p, const cq_format_info *f, cq_tensor *q,
                                 cq_tensor *scale, cudaStream_t stream);

/* x' of stored rows [row0, row0 + rows) of a 4-bit weight w (row_bytes a row, k codes, groups of
 * group_size, scales as above for all of w's rows) into out, dense [rows, k] of out_dtype (f32, or
 * f16 / bf16: x' rounded once, with the C reference's NaN bits). */
cq_status cq_dequant_group_rows_cuda(const uint8_t *w, int64_t row_bytes, const float *scale, const cq_format_info *f,
                                     int64_t group_size, int64_t row0, int64_t rows, int64_t k, cq_dtype out_dtype,
                                     void *out, cudaStream_t stream);

/* cq_dequantize of two-level int4 rows (row_bytes a row, k codes, scales [rows, 1 + G]) into
 * out, dense [rows, k] of out_dtype, as the C reference rounds it. */
cq_status cq_dequant_two_level_cuda(const uint8_t *w, int64_t row_bytes, const float *scale, int64_t group_size,
                                    int64_t rows, int64_t k, cq_dtype out_dtype, void *out, cudaStream_t stream);

/* The int8 GEMM's operands of two-level rows [row0, row0 + rows): q8 = s2 * code into q8 [rows, ldq]
 * (columns [k, ldq) untouched) and s1 [rows], NaN for a row with an s2 that is not an integer in
 * [0, 16] (cquant.h: that row's outputs are NaN). */
cq_status cq_two_level_q8_rows_cuda(const uint8_t *w, int64_t row_bytes, const float *scale, int64_t group_size,
                                    int64_t row0, int64_t rows, int64_t k, int64_t ldq, int8_t *q8, float *s1,
                                    cudaStream_t stream);

#endif /* CQ_KERNELS_QUANTIZE_GROUP_CUH */
