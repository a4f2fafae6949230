/*
 * cquant: 8-bit and low-bit quantized linear layers for diffusion transformers.
 *
 * The one public header of libcquant. Conventions:
 *  - every fallible function returns cq_status; cq_last_error() (thread-local)
 *    holds a sentence naming the argument and what was expected;
 *  - tensors are described by cq_tensor, usually built from a DLPack DLTensor;
 *  - outputs and workspaces are allocated by the caller, GPU work is enqueued
 *    on the caller's stream (a cudaStream_t passed as void *), nothing
 *    synchronizes and nothing allocates device memory;
 *  - each op has a plain C reference cq_<op>_ref with the same arguments (CPU
 *    tensors only) that defines its math; cq_<op> dispatches on the device.
 *
 * Quantization math, shared by every scheme (one "group" is one row for
 * CQ_GRANULARITY_ROW and the whole tensor for CQ_GRANULARITY_TENSOR):
 *
 *   amax  = max |x| over the group, in fp32
 *   if amax is finite:
 *     a     = max(amax, CQ_AMAX_FLOOR)          (an all-zero group is not 0/0)
 *     scale = a / max_value                     (fp32, correctly rounded)
 *     inv   = max_value / a                     (fp32, correctly rounded)
 *     code  = encode(x * inv)                   (fp32 product, then the format's
 *                                                rounding: round-to-nearest-even,
 *                                                saturating at +-max_value)
 *   else (the group holds NaN or +-Inf):
 *     scale = NaN, every code = 0, so the group dequantizes to NaN and every
 *     output computed from it is NaN: bad inputs stay visible.
 *   static scale (given by the caller): inv = 1 / scale (fp32); a given scale
 *     that is not finite and > 0 stores all-zero codes for its group; with a
 *     valid given scale, NaN elements encode to 0 and +-Inf saturate (a valid
 *     scale below 2^-128 has inv = +inf: nonzero elements saturate, zeros give
 *     0 * inf = NaN and so code 0).
 *   dequantize: x' = decode(code) * scale       (fp32, then rounded to the output dtype)
 *
 * Formats: int8 is symmetric, codes in [-127, 127] (a byte of -128, which
 * cq_quantize never writes, decodes to -128 on every path). fp8 e4m3fn (bias 7, max
 * 448, no inf) and e5m2 (bias 15, max 57344) follow the OCP 8-bit float spec.
 * fpX formats have 1 sign, E exponent and M mantissa bits (3 <= 1+E+M <= 7,
 * E >= 1), bias 2^(E-1)-1, subnormals, no inf and no NaN: every code is a
 * finite number and the all-ones code is the largest one. fpX codes are
 * bit-packed along each row, LSB first: code j of a row occupies bits
 * [j*bits, (j+1)*bits) of the row's byte string, and each packed row is padded
 * to a multiple of CQ_PACK_ROW_ALIGN bytes (see cq_packed_row_bytes); quantize
 * and pack write every bit past a row's last code as zero.
 *
 * 4-bit integer formats (int4, uint4) are packed the same way (two codes a
 * byte, code 2i in the low nibble of byte i) and take one scale per group of
 * group_size consecutive columns of a row (CQ_GRANULARITY_GROUP; int4 also
 * takes the two-level scales below; group_size a power of two from 32 to 1024
 * that divides cols: group tails are refused). G = cols / group_size groups a row.
 *
 *   Scales of both are rounded to 8 significant bits: RN_bf16(v) is the fp32
 *   value v rounded to nearest-even to the nearest bfloat16 value, kept as
 *   f32 (on the bit pattern u: u + 0x7FFF + ((u >> 16) & 1), low 16 bits
 *   cleared; v here is finite, normal and far below bf16's max, so it neither
 *   overflows nor underflows). With such a scale, (code - zp) * scale is exact
 *   in fp32 and equals the same product computed in bf16 arithmetic rounded
 *   once (and in fp16 when the scale lies in fp16's normal range), so kernels
 *   may decode weights with packed 16-bit instructions and still compute
 *   exactly the math below. Dequantize and linear use any stored scale as the
 *   math says (older checkpoints hold arbitrary fp32 scales).
 *
 *   int4 (symmetric, codes [-7, 7] as two's complement nibbles; the nibble 0x8,
 *     which cq_quantize never writes, decodes to -8 on every path): amax of the
 *     group as in the shared math above, then
 *       if amax is finite:
 *         a     = max(amax, CQ_AMAX_FLOOR)
 *         scale = RN_bf16(a / 7)             (a / 7 in fp32, then rounded)
 *         inv   = 1 / scale                  (fp32, correctly rounded)
 *         code  = RNE(x * inv) saturated at +-7
 *       else: scale = NaN, every code 0.
 *       x' = code * scale.
 *     The scale tensor is f32 [rows, G].
 *   uint4 (asymmetric, codes [0, 15] with an integer zero point per group, as
 *     torchao's int4 weight-only with zero points in the integer domain):
 *       lo = min(0, min x), hi = max(0, max x)      over the group (0 is exact)
 *       r  = max(hi - lo, CQ_AMAX_FLOOR)           (fp32)
 *       if r is finite: scale = RN_bf16(r / 15)  (r / 15 in fp32, then rounded)
 *         inv  = 1 / scale                         (fp32, correctly rounded)
 *         zp   = RNE(-lo * inv), clamped to [0, 15]
 *         code = min(max(RNE(x * inv) + zp, 0), 15)
 *       else (NaN or +-Inf in the group, or hi - lo overflows fp32):
 *         scale = NaN, zp = 0, every code 0: the group dequantizes to NaN.
 *       x' = (code - zp) * scale                    (fp32: code - zp, then * scale)
 *     The scale tensor is f32 [rows, G, 2]: (scale, zp) of each group, zp
 *     stored as an fp32 value (the quantizer writes integers in [0, 15]; any
 *     stored value is used as the math says).
 *
 * Two-level int4 (CQ_FORMAT_INT4 with CQ_GRANULARITY_TWO_LEVEL): int4's codes
 * and packing, group_size and G as above, but a row scale s1 and a small
 * integer multiplier s2[g] per group, so that s2 * code is an int8 value and
 * a layer with int8 activations is an int8 x int8 GEMM (see cq_linear):
 *
 *   amax = max |x| over the row (NaN-propagating, as above)
 *   if amax is finite:
 *     a  = max(amax, CQ_AMAX_FLOOR)
 *     s1 = a / 112                          (fp32; 112 = 7 * 16)
 *     for each group g, with ag = max |x| over the group:
 *       t     = ag / (7 * s1)               (fp32: 7 * s1 rounded, then the quotient)
 *       s2[g] = min(max(ceil(t), 1), 16)
 *       d     = s1 * s2[g],  inv = 1 / d    (fp32, each rounded)
 *       code  = RNE(x * inv) saturated at +-7 (NaN: 0)
 *   else: s1 = NaN, every s2 = 1, every code 0.
 *   x' = (float)(s2 * code) * s1            (s2 * code an exact integer, one
 *                                            fp32 rounding); a group whose stored
 *                                            s2 is not an integer in [0, 16]
 *                                            (NaN, +-Inf, 2.5, 17, -1) gives NaN.
 *   The scale tensor is f32 [rows, 1 + G]: column 0 holds s1, columns 1..G the
 *   s2 of each group as fp32 values (the quantizer writes integers in [1, 16]).
 */
#ifndef CQUANT_H
#define CQUANT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Marks the functions libcquant exports: it is built with hidden visibility, so
 * its ABI is exactly what this header declares. */
#if defined(__GNUC__)
#define CQ_API __attribute__((visibility("default")))
#else
#define CQ_API
#endif

#define CQ_VERSION_MAJOR 0
#define CQ_VERSION_MINOR 1
#define CQ_VERSION_PATCH 0

/* Version of every stored layout (codes, packing, scales). Saved checkpoints
 * record it; bump it on any change of a stored layout. */
#define CQ_FORMAT_VERSION 3

/* Smallest amax a scale is computed from: keeps scale and 1/scale finite and
 * normal in fp32 for every format (max_value is at most 2^32, fp7_e6m0). */
#define CQ_AMAX_FLOOR 0x1p-90f

/* Group sizes the 4-bit formats take: powers of two in [MIN, MAX]. */
#define CQ_GROUP_SIZE_MIN 32
#define CQ_GROUP_SIZE_MAX 1024
#define CQ_GROUP_SIZE_DEFAULT 128

/* Packed fpX rows start on this byte boundary (16-byte vector loads). */
#define CQ_PACK_ROW_ALIGN 16

#define CQ_MAX_DIMS 8

/* ---------------------------------------------------------------- status */

typedef enum cq_status {
  CQ_OK = 0,
  CQ_ERR_INVALID_ARG = 1, /* a value, shape or layout is wrong (ValueError) */
  CQ_ERR_TYPE = 2,        /* an argument has the wrong dtype (TypeError) */
  CQ_ERR_UNSUPPORTED = 3, /* valid, but not available for this dtype, device or arch */
  CQ_ERR_DLPACK = 4,      /* a DLPack tensor cquant cannot take (BufferError) */
  CQ_ERR_CUDA = 5,        /* a CUDA runtime call failed */
  CQ_ERR_CUBLAS = 6,      /* a cuBLASLt call failed */
  CQ_ERR_OOM = 7,         /* host memory for a CPU temporary could not be had */
  CQ_ERR_INTERNAL = 8,    /* a bug in cquant */
} cq_status;

/* Detail of the last failure on this thread ("" after success is not
 * guaranteed: read it only after a call returned an error). */
CQ_API const char *cq_last_error(void);
/* "CQ_ERR_INVALID_ARG" etc. */
CQ_API const char *cq_status_name(cq_status status);

/* ---------------------------------------------------------------- tensors */

typedef enum cq_dtype {
  CQ_DTYPE_INVALID = 0,
  CQ_DTYPE_F32 = 1,
  CQ_DTYPE_F16 = 2,
  CQ_DTYPE_BF16 = 3,
  CQ_DTYPE_F64 = 4,
  CQ_DTYPE_I8 = 5,
  CQ_DTYPE_U8 = 6,
  CQ_DTYPE_I32 = 7,
  CQ_DTYPE_F8_E4M3FN = 8,
  CQ_DTYPE_F8_E5M2 = 9,
} cq_dtype;

typedef enum cq_device_type {
  CQ_DEVICE_CPU = 1,
  CQ_DEVICE_CUDA = 2,
} cq_device_type;

typedef struct cq_tensor {
  void *data;                   /* address of element 0 (DLPack byte_offset applied) */
  cq_dtype dtype;               /* element type */
  int32_t ndim;                 /* number of dimensions, 0..CQ_MAX_DIMS */
  int64_t shape[CQ_MAX_DIMS];   /* extent of each dimension */
  int64_t strides[CQ_MAX_DIMS]; /* stride of each dimension in elements */
  cq_device_type device_type;   /* CPU or CUDA */
  int32_t device_id;            /* device ordinal (0 for CPU) */
  int32_t readonly;             /* nonzero: the producer forbids writes */
} cq_tensor;

struct DLTensor;

/* Describe a DLPack tensor. Fails (CQ_ERR_DLPACK) on lanes != 1, unknown
 * dtypes, devices other than CPU/CUDA, ndim > CQ_MAX_DIMS or negative shapes.
 * NULL strides become row-major strides. */
CQ_API cq_status cq_tensor_from_dlpack(const struct DLTensor *t, int readonly, cq_tensor *out);

/* Elements of t: the product of its shape (0 when a dim is 0; -1 if it overflows
 * int64, which no descriptor from cq_tensor_from_dlpack does). */
CQ_API int64_t cq_tensor_numel(const cq_tensor *t);
/* Bytes per element of a dtype (0 for CQ_DTYPE_INVALID). */
CQ_API size_t cq_dtype_size(cq_dtype dtype);
/* "float32", "bfloat16", "float8_e4m3fn", ... */
CQ_API const char *cq_dtype_name(cq_dtype dtype);

/* ---------------------------------------------------------------- formats */

/* Stable format numbers: append-only, stored in checkpoints. */
#define CQ_FORMAT_FPX(ebits, mbits) (0x100 + 0x10 * (ebits) + (mbits))

typedef enum cq_format {
  CQ_FORMAT_NONE = 0, /* not quantized (activations of weight-only schemes) */
  CQ_FORMAT_INT8 = 1,
  CQ_FORMAT_FP8_E4M3 = 2,
  CQ_FORMAT_FP8_E5M2 = 3,
  CQ_FORMAT_INT4 = 4,  /* symmetric 4-bit integers, packed, scale per group */
  CQ_FORMAT_UINT4 = 5, /* asymmetric 4-bit integers with a zero point per group, packed */
  CQ_FORMAT_FP6_E3M2 = CQ_FORMAT_FPX(3, 2),
  CQ_FORMAT_FP6_E2M3 = CQ_FORMAT_FPX(2, 3),
  CQ_FORMAT_FP5_E2M2 = CQ_FORMAT_FPX(2, 2),
  CQ_FORMAT_FP4_E2M1 = CQ_FORMAT_FPX(2, 1),
  /* any other 1 <= E, 0 <= M, 3 <= 1+E+M <= 7: CQ_FORMAT_FPX(E, M) */
} cq_format;

typedef enum cq_format_kind {
  CQ_KIND_INT = 1,   /* symmetric integer codes */
  CQ_KIND_FLOAT = 2, /* sign / exponent / mantissa codes */
  CQ_KIND_UINT = 3,  /* unsigned integer codes with a zero point per group (asymmetric) */
} cq_format_kind;

/* What a float format does with its top codes. */
typedef enum cq_special_values {
  CQ_SPECIALS_NONE = 0,      /* every code is finite (fpX) */
  CQ_SPECIALS_NAN_ONLY = 1,  /* S.1111.111 is NaN, no inf (e4m3fn) */
  CQ_SPECIALS_IEEE = 2,      /* top exponent is inf (mantissa 0) or NaN (e5m2) */
} cq_special_values;

typedef enum cq_granularity {
  CQ_GRANULARITY_ROW = 1,    /* one fp32 scale per row (per output channel / token) */
  CQ_GRANULARITY_TENSOR = 2, /* one fp32 scale for the whole tensor */
  CQ_GRANULARITY_GROUP = 3,  /* one scale (uint4: scale and zero point) per group of
                                group_size columns of a row (4-bit formats only) */
  CQ_GRANULARITY_TWO_LEVEL = 4, /* int4 only: a row scale s1 and an integer multiplier s2
                                   per group of group_size columns ([rows, 1 + G]) */
} cq_granularity;

typedef struct cq_format_info cq_format_info;

struct cq_format_info {
  cq_format id;              /* stable number (CQ_FORMAT_*) */
  const char *name;          /* "int8", "fp8_e4m3", "fp6_e3m2", ... */
  cq_format_kind kind;       /* integer or floating-point codes */
  int bits;                  /* bits per code, sign included */
  int ebits;                 /* exponent bits (0 for int) */
  int mbits;                 /* mantissa bits (bits - 1 for int) */
  int bias;                  /* exponent bias (0 for int) */
  cq_special_values specials; /* meaning of the top codes */
  float max_value;           /* largest finite magnitude: saturation bound, scale target */
  uint32_t max_code;         /* code of +max_value */
  int packed;                /* nonzero: codes bit-packed along rows (fpX) */
  cq_dtype code_dtype;       /* dtype of an unpacked code tensor */
  /* Code of fp32 v: round to nearest even, saturate at +-max_value. */
  uint32_t (*encode)(const cq_format_info *f, float v);
  /* Value of a code (the low `bits` bits of code are read). */
  float (*decode)(const cq_format_info *f, uint32_t code);
};

/* The table entry of a format, or NULL (with cq_last_error set) if unknown. */
CQ_API const cq_format_info *cq_format_get(int id);
/* Formats in the table, in id order: cq_format_at(0 .. cq_format_count()-1). */
CQ_API int cq_format_count(void);
CQ_API const cq_format_info *cq_format_at(int index);
/* Bytes of one stored row of `cols` codes (packed and padded for fpX), or -1
 * when cols is negative or the row's bytes would not fit int64. */
CQ_API int64_t cq_packed_row_bytes(const cq_format_info *f, int64_t cols);

/* ---------------------------------------------------------------- ops */

/* Quantization of a 2-D view [rows, cols] of x (leading dims are rows). */
typedef struct cq_quant_params {
  int format;                 /* a cq_format */
  cq_granularity granularity; /* per row or per tensor */
  int static_scale;           /* nonzero: scale is read (given), not computed (not with GROUP
                                 or TWO_LEVEL) */
  int64_t group_size;         /* CQ_GRANULARITY_GROUP / TWO_LEVEL: columns per group; else 0 */
} cq_quant_params;

/*
 * x      [..., cols] f32/f16/bf16, contiguous
 * q      codes: [rows, cols] (int8 for int8, float8/uint8 for fp8) or, for
 *        packed formats, uint8 [rows, cq_packed_row_bytes(cols)]
 * scale  f32, rows elements (row) or 1 element (tensor); written, or read
 *        when params->static_scale; group: [rows, G] (int4) or [rows, G, 2] (uint4);
 *        two-level: [rows, 1 + G]
 */
CQ_API cq_status cq_quantize(const cq_tensor *x, const cq_quant_params *params, cq_tensor *q,
                             cq_tensor *scale, void *stream);
CQ_API cq_status cq_quantize_ref(const cq_tensor *x, const cq_quant_params *params, cq_tensor *q,
                                 cq_tensor *scale);

/* y [rows, cols] f32/f16/bf16 = decode(q) * scale; q and scale as above. */
CQ_API cq_status cq_dequantize(const cq_tensor *q, const cq_tensor *scale, const cq_quant_params *params,
                               cq_tensor *y, void *stream);
CQ_API cq_status cq_dequantize_ref(const cq_tensor *q, const cq_tensor *scale,
                                   const cq_quant_params *params, cq_tensor *y);

/* codes uint8 [rows, cols] (low `bits` bits used) <-> packed uint8
 * [rows, cq_packed_row_bytes(cols)] with bits in 1..8; pad bits are zero. */
CQ_API cq_status cq_pack(const cq_tensor *codes, int bits, cq_tensor *packed, void *stream);
CQ_API cq_status cq_pack_ref(const cq_tensor *codes, int bits, cq_tensor *packed);
CQ_API cq_status cq_unpack(const cq_tensor *packed, int bits, cq_tensor *codes, void *stream);
CQ_API cq_status cq_unpack_ref(const cq_tensor *packed, int bits, cq_tensor *codes);

/* dst = src, byte for byte: two views of one shape (1 to 4 dims, no zero-size dim) and dtype
 * whose last dimension is contiguous, dst's elements apart from each other and from src's.
 * On CUDA the copy engines carry it (cudaMemcpy2DAsync: the last two dims as rows, each index
 * of the outer dims one call), so it runs beside kernels without taking SMs, and either view may
 * be a peer GPU's memory mapped into this process (torch's symmetric memory, CUDA IPC): the
 * bytes then travel over NVLink or PCIe. Captured into CUDA graphs as memcpy nodes. */
CQ_API cq_status cq_copy_rows(const cq_tensor *src, cq_tensor *dst, void *stream);
CQ_API cq_status cq_copy_rows_ref(const cq_tensor *src, cq_tensor *dst);

/* Rows of activations in 8 bits, for links slower than memory (the 8-bit wire of cquant's
 * Ulysses exchange): packing and unpacking fused with the quantization, so the rows go straight
 * between a model's layout and the send buffer.
 *
 * Views: values (x or y), mean and codes [R0, .., Rk, cols] of one shape, 2 to 5 dims; scales and
 * norms [R0, .., Rk]. Any non-negative strides, the last dim of values, mean and codes contiguous
 * (stride 1); strides 0 broadcast mean. values f32/f16/bf16, mean f32, codes int8, scales and
 * norms f32; 1 <= cols <= 65536, no zero-size dim. Outputs span memory apart from each other and
 * from the inputs.
 *
 * cq_wire_encode: v = x - mean in fp32 (x where mean is NULL); each row's scale and codes are
 *   cq_quantize's int8 row math on v (scale and inverse from the row's max |v|, code = the round
 *   to nearest even of v * inverse, saturated at +-127); a row holding NaN or Inf gets scale NaN
 *   and codes 0. norms (NULL: not written): each decoded row's norm, scale * sqrt(sum code^2),
 *   the sum an exact integer, converted to fp32, the square root and product each rounded once.
 * cq_wire_decode: y = code * scale, plus mean where given, in fp32 with each operation rounded
 *   (no fused multiply-add), then to y's dtype (round to nearest even). */
CQ_API cq_status cq_wire_encode(const cq_tensor *x, const cq_tensor *mean, cq_tensor *codes, cq_tensor *scales,
                                cq_tensor *norms, void *stream);
CQ_API cq_status cq_wire_encode_ref(const cq_tensor *x, const cq_tensor *mean, cq_tensor *codes, cq_tensor *scales,
                                    cq_tensor *norms);
CQ_API cq_status cq_wire_decode(const cq_tensor *codes, const cq_tensor *scales, const cq_tensor *mean, cq_tensor *y,
                                void *stream);
CQ_API cq_status cq_wire_decode_ref(const cq_tensor *codes, const cq_tensor *scales, const cq_tensor *mean,
                                    cq_tensor *y);

/*
 * Quantized linear layer y = x W^T + b.
 *
 * The weight W [N, K] is stored quantized per output channel (row) or per
 * tensor; activations are either used as they are (weight-only schemes:
 * act_format = CQ_FORMAT_NONE) or quantized on the fly with the same math as
 * cq_quantize (dynamic schemes). With codes qx, qw and scales sx, sw:
 *
 *   acc[m, n] = sum_k a[m, k] * decode(qw[n, k])   (fp32; int32 when both int8)
 *   y[m, n]   = acc[m, n] * sx[m] * sw[n] + b[n]   (fp32, left to right, then
 *                                                 rounded to y's dtype)
 *
 * so where acc * sx passes fp32's range (activations within about 1e3 of its largest value),
 * y is +-inf even if the exact product with sw would be finite.
 * where a = x (weight-only, sx = 1) or decode(qx) (dynamic). With an
 * activation, y[m, n] = act(acc[m, n] * sx[m] * sw[n] + b[n]), act applied in
 * fp32 before the rounding (so a GELU that follows the layer needs no pass of
 * its own over y):
 *
 *   CQ_ACTIVATION_GELU_TANH  act(v) = 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3)))
 *                            (torch's gelu(approximate="tanh")); the sm_90a GEMMs
 *                            evaluate it as v / (1 + exp(-2 sqrt(2/pi) (v + 0.044715 v^3)))
 *                            with the hardware's exp2 and reciprocal, within a few fp32
 *                            ulp of |v| (results under 2^-126 |v| flush to -0)
 *
 * With int8 activations and int8 weights, acc is an exact int32 sum: |acc| <=
 * K * 128 * 128 for any codes (-128 included: a caller's codes or a checkpoint's
 * bytes may hold it), so K is at most CQ_LINEAR_INT8_MAX_K = floor((2^31 - 1) /
 * 128^2) (larger K is refused with CQ_ERR_UNSUPPORTED, on every device).
 *
 * Schemes (weight format / act format): int8wo INT8/NONE, int8dq INT8/INT8,
 * fp8dqrow FP8_E4M3/FP8_E4M3 per row, fp8dq per tensor FP8_E4M3/FP8_E4M3 per
 * tensor, fp8wo FP8_E4M3(or E5M2)/NONE, fpX wo FPX(E,M)/NONE, and with 4-bit
 * weights per group (weight_granularity CQ_GRANULARITY_GROUP): int4wo INT4 or
 * UINT4/NONE, int4dq INT4/INT8 per row, fp8da_int4w INT4/FP8_E4M3 per row.
 *
 * 4-bit weights per group. Weight-only (int4wo): each weight is dequantized
 * (x' of the format, fp32) and rounded to x's dtype (bf16 or f16; f32 x: not
 * rounded), as the tensor cores take it, then
 *   acc[m, n] = sum_k x[m, k] * w'[n, k]   (fp32),   y[m, n] = act(acc[m, n] + b[n])
 * (sx = sw = 1: the scales are inside w'; the sum runs in the order of each
 * path's choosing). With f16 x, a weight beyond f16's range becomes +-inf.
 * Dynamic (int4dq, fp8da_int4w: int4 weights only), with group
 * g of G and its scale sw[n, g]:
 *   acc_g[m, n] = sum_{k in group g} a[m, k] * code[n, k]   (int32 for int8
 *                 activations: exact; fp32 for fp8 ones: products exact)
 *   y[m, n] = act((sum_g acc_g[m, n] * sw[n, g]) * sx[m] + b[n])
 * the sum over groups in fp32, in group order in the C reference (other paths
 * may sum in another order: they agree within G fp32 roundings of the sum).
 *
 * Two-level int4 weights (int4dq_2l: weight_granularity CQ_GRANULARITY_TWO_LEVEL)
 * take only int8 activations per row (any other act_format, weight-only
 * included, is CQ_ERR_UNSUPPORTED). With s1[n] and s2[n, g] of the weight row:
 *   q8[n, k]  = s2[n, g(k)] * code[n, k]          (an integer in [-128, 112])
 *   acc[m, n] = sum_k a[m, k] * q8[n, k]           (exact int32; K <= CQ_LINEAR_INT8_MAX_K)
 *   y[m, n]   = act(acc[m, n] * sx[m] * s1[n] + b[n])
 * which is int8dq's math with weight row q8 and sw = s1, on every path: a row
 * with any s2 that is not an integer in [0, 16] has sw = NaN, so y[:, n] is NaN.
 */
typedef enum cq_activation {
  CQ_ACTIVATION_NONE = 0,
  CQ_ACTIVATION_GELU_TANH = 1,
} cq_activation;

/* Largest K of int8 x int8 layers: their int32 sums cannot overflow (see above). */
#define CQ_LINEAR_INT8_MAX_K 131071

typedef struct cq_linear_params {
  int weight_format;                 /* a cq_format */
  cq_granularity weight_granularity; /* scale per output channel or per tensor */
  int act_format;                    /* CQ_FORMAT_NONE, CQ_FORMAT_INT8 or CQ_FORMAT_FP8_E4M3 */
  cq_granularity act_granularity;    /* per token (row) or per tensor */
  int64_t in_features;               /* K (packed weights do not show it) */
  int activation;                    /* a cq_activation applied to the output (0: none) */
  int64_t weight_group_size;         /* CQ_GRANULARITY_GROUP / TWO_LEVEL: columns per weight group;
                                        else 0 */
} cq_linear_params;

/* Oldest CUDA compute capability (major * 10 + minor, e.g. 89) whose kernels
 * run the scheme of `params`: CQ_MIN_CC_WEIGHT_ONLY for weight-only schemes,
 * CQ_MIN_CC_INT8_DYNAMIC for int8 activations, CQ_MIN_CC_FP8_DYNAMIC for fp8
 * activations (fp8 tensor cores). Fails on params that are not a scheme. */
#define CQ_MIN_CC_WEIGHT_ONLY 80
#define CQ_MIN_CC_INT8_DYNAMIC 80
#define CQ_MIN_CC_FP8_DYNAMIC 89
CQ_API cq_status cq_linear_min_compute_capability(const cq_linear_params *params, int *cc);

/* Bytes of device workspace cq_linear, cq_linear_quantized and cq_linear_gated
 * need for m rows of x and n outputs (0 on the CPU): one size serves all three. */
CQ_API cq_status cq_linear_workspace_size(const cq_linear_params *params, int64_t m, int64_t n,
                                          cq_device_type device, size_t *bytes);

/*
 * x         [..., K] f32/f16/bf16, contiguous
 * w         codes [N, K] or packed uint8 [N, cq_packed_row_bytes(K)]
 * w_scale   f32, N elements (row) or 1 (tensor); group: [N, G] (int4) or [N, G, 2] (uint4);
 *           two-level: [N, 1 + G]; contiguous
 * bias      [N] in x's dtype or f32, or NULL
 * workspace uint8, at least cq_linear_workspace_size bytes, or NULL when 0
 * y         [..., N] in x's dtype, last dim contiguous; rows may lie further apart than N
 *           (one row stride over the flattened rows: a column slice of a wider tensor,
 *           so two layers can write side by side into one buffer)
 */
CQ_API cq_status cq_linear(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale,
                           const cq_tensor *bias, const cq_linear_params *params, cq_tensor *workspace,
                           cq_tensor *y, void *stream);
CQ_API cq_status cq_linear_ref(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale,
                               const cq_tensor *bias, const cq_linear_params *params, cq_tensor *y);

/* ---------------------------------------------------------------- attention */

/*
 * Fused forward attention (non-causal, no mask), in diffusers' layout:
 *
 *   q [B, Sq, H, D], k and v [B, Skv, H, D], out [B, Sq, H, D]   (any strides
 *   for B, S and H, last dim contiguous), lse [B, H, Sq] fp32 (optional)
 *
 *   out[b, i, h, :] = sum_j softmax_j(scale * q[b, i, h, :] . k[b, j, h, :]) v[b, j, h, :]
 *   lse[b, h, i]    = log sum_j exp(scale * q[b, i, h, :] . k[b, j, h, :])   (natural log)
 *
 * D is any multiple of 8 up to 256 (any D >= 1 on the CPU). Sq and Skv are
 * independent (self and cross attention). B, Sq, H and Skv may be 0: with B, Sq
 * or H = 0 there is nothing to compute (out and lse are empty); with Skv = 0
 * the sums over keys are empty, so out = 0 (the empty sum of values) and
 * lse = log 0 = -inf, in both modes.
 *
 * CQ_ATTENTION_FULL: q, k, v and out in one dtype (bf16 or fp16; fp32 too on
 * the CPU), products in that precision, fp32 accumulation and softmax.
 *
 * CQ_ATTENTION_INT8 (q, k, v bf16/fp16/fp32, out in q's dtype). For each (b, h),
 * with L = log2(e) and every step in fp32:
 *
 *   kmean[d] = mean_j k[j, d]                        (K smoothing: softmax is
 *   ks[j, d] = k[j, d] - kmean[d]                     shift-invariant along keys)
 *   q'[i, d] = q[i, d] * (scale * L)
 *   Q codes: int8 per block of q_block query rows, K codes: int8 per block of
 *     k_block keys, both with the math of cq_quantize (amax of the block, scale
 *     = amax / 127, code = RNE(x * 127 / amax)); sq, sk their scales
 *   V codes: int8 per channel over all keys with the same math,
 *     sv[d] = max(amax_j |v[j, d]|, CQ_AMAX_FLOOR) / 127 (a channel whose amax is
 *     not finite: all-zero codes, sv NaN)
 *   s[i, j]  = (float)(sum_d Qcode[i, d] * Kcode[j, d]) * (sq[i] * sk[j])   (the exact
 *              integer dot, rounded once to fp32)
 *   Online softmax over consecutive tiles of k_block keys, starting with
 *   m = -inf, l = 0, acc = 0; for each tile:
 *     mt = max_j s[i, j] over the tile;  m' = max(m, mt)
 *     alpha = exp2(m - m');  beta = exp2(mt - m')          (alpha = 0 at the first tile)
 *     pc[i, j] = RNE(exp2(s[i, j] - mt) * 255)             (u8 codes of P at the tile's own max)
 *     A[i, d] = sum_j pc[i, j] * Vcode[j, d],  ls[i] = sum_j pc[i, j]   (exact integers)
 *     l = fmaf(beta, (float)ls[i], l * alpha)
 *     acc[i, d] = fmaf(beta, (float)A[i, d], acc[i, d] * alpha)
 *     m = m'
 *   out[i, d] = acc[i, d] / l * sv[d]
 *   lse[i]    = (m + log2(l) - log2(255) + q'[i, :] . kmean) / L   (the smoothing undone)
 *
 * where RNE rounds to the nearest integer, ties to even, and fmaf(a, b, c) = a * b + c rounded
 * once. The CUDA kernel may run a row's tiles in two halves (tiles [0, h) and [h, n), h = ceil(n / 2),
 * each as above from m = -inf, l = 0, acc = 0) and merge them: m = max(m0, m1),
 * acc = fmaf(acc1, 2^(m1 - m), acc0 * 2^(m0 - m)), l likewise: the same P codes and integer sums,
 * the fp32 folds in another order. P is quantized at each tile's own max, so every tile's largest weight gets code 255
 * and the rounding error stays 1/510 of it however far the tile lies below the running max.
 * l sums the rounded weights that acc uses, so each output is a weighted mean of
 * the value codes: rounding P moves it less than when the unrounded p normalise
 * (the common part of the rounding errors cancels), and the same integer product that forms
 * A forms ls. u8 P x s8 V sums are exact in int32 tensor-core accumulators (a 128-key tile
 * peaks at 128 * 255 * 127 < 2^22, exact in fp32 too), at the fp8 rate on sm_89 and sm_90.
 * The kernels need an int8 workspace (cq_attention_workspace_size); the
 * CUDA kernel of this mode needs sm_89 or newer and k_block = 128.
 *
 * Accuracy bound and per-head fallback of the 8-bit mode. Write q'[i] = sq_i (Qcode_i + eq_i)
 * and ks[j] = sk_j (Kcode_j + ek_j), sq_i and sk_j the scales of the blocks of row i and key j,
 * eq and ek the int8 rounding errors (each in [-1/2, 1/2]; codes never saturate). The score
 * s[i, j] then misses the exact q'[i] . ks[j] (log2 units; the smoothing only shifts each
 * row, which the softmax ignores) by
 *   delta[i, j] = -sq_i sk_j (Qcode_i . ek_j + eq_i . Kcode_j + eq_i . ek_j).
 * Modelling the rounding errors as independent and uniform (round-to-nearest of continuous
 * data), delta[i, j] has mean 0 and variance sq_i^2 sk_j^2 (|Qcode_i|^2 + |Kcode_j|^2 + D/12) / 12
 * (|.| the L2 norm of a row of codes), at most E^2 for every (i, j) of the head, with
 *   A  = max_i sq_i,  Bq = max_i sq_i |Qcode_i|,  C = max_j sk_j,  Bk = max_j sk_j |Kcode_j|
 *   E  = sqrt(((C Bq)^2 + (A Bk)^2) / 12 + D (A C)^2 / 144)       (fp32: cq_attn8_logit_error)
 * E is a statistical estimate (it bounds the standard deviation of every delta of the head),
 * not a worst case: the worst case, sq sk (|Qcode|_1 + |Kcode|_1 + D/2) / 2, needs all D errors
 * aligned with the other operand's signs, never happens, and is about 2 D^(1/2) times E for
 * Gaussian-like codes (16x at D = 64), which would send ordinary heads to the fallback. delta
 * sums D independent bounded terms, so it is close to normal; Hoeffding gives the
 * distribution-free tail P(|delta[i, j]| > t) <= 2 exp(-t^2 / (36 E^2)).
 * To first order the output of row i moves by ln2 sum_j w_j delta[i, j] (v_j - out_i), w the
 * softmax weights; by Cauchy-Schwarz its rms relative error is at most ln2 E rho_i, rho_i =
 * (sum_j w_j |v_j - out_i|^2)^(1/2) / |out_i| the spread of the values under the softmax
 * relative to the output (about 1 for values with channel means as large as their spread, as
 * diffusion transformers have; small for a peaked softmax); the errors of different keys
 * partly cancel, so measured errors are several times lower. A peaked softmax has large logits,
 * so large sq and sk, and E grows with them. P and V add errors of their own, which do not
 * grow with the logits or offsets: each P code is off by at most 1/510 of its tile's largest
 * weight, each V code by at most amax / 254 of its channel. The whole 8-bit math measured
 * (relative L2 against float64; scripts/attention_pv_format_study.py and the C reference; D = 8
 * to 256, 77 to 16384 keys; randn or DiT-like q and k, E about half the threshold below):
 * 0.01-0.3% on values with channel means or offsets, 1.3-1.7% under a peaked softmax (DiT-like
 * q x 4), 1.3-1.8% with cosine >= 0.9998 on i.i.d. zero-mean values (the worst case: each output
 * an incoherent average, so the roundings survive). fp8 e4m3 P and V (3 mantissa bits each), the
 * mode's former format, measured 3.7-4.1% there.
 *
 * A head (b, h) with E > CQ_ATTENTION_INT8_MAX_LOGIT_ERROR (or E NaN: non-finite inputs) is
 * computed with the CQ_ATTENTION_FULL math instead, out and lse, in the inputs' dtype; the
 * others with the 8-bit math above. The threshold comes from scripts/attention_int8_bound_study.py
 * (seeds 1-3, 1800 random heads: D = 64 and 128, 256 to 1024 keys, DiT-like q and k, i.e.
 * RMS-normalized rows times channel weights with 0-4 outlier channels, scaled 1-8x; key offsets
 * up to 100 and two key groups with different offsets; value offsets up to 100), evaluating the
 * 8-bit math alone against float64: every head with E <= 0.06 met cosine >= 0.999 and relative
 * L2 <= 1.1% on values with channel means or offsets (target 3%; the first head over it had
 * E = 0.249), and cosine >= 0.9995, relative L2 <= 3.2% on i.i.d. zero-mean values (5 of the 62
 * heads with E <= 0.06 measured 3.0-3.2%, at E >= 0.052: the Q/K rounding adds to that of P and V;
 * E <= 0.05 kept them within 3.0%). Typical inputs have E = 0.4-0.6 of the threshold: randn q and
 * k with any common key offset, RMSNorm or LayerNorm q and k with weights near 1. Fallen-back heads
 * cost one more kernel launch per call, whose CTAs for the other heads exit at once.
 * cq_attention_int8_logit_error_ref gives E per head.
 */
typedef enum cq_attention_mode {
  CQ_ATTENTION_FULL = 0, /* products in the input precision (bf16/fp16/fp32) */
  CQ_ATTENTION_INT8 = 1, /* Q, K int8 per block (K smoothed), P u8, V int8 */
} cq_attention_mode;

/* Defaults of the 8-bit mode's block sizes (a 0 in the params selects them). */
#define CQ_ATTENTION_Q_BLOCK 32
#define CQ_ATTENTION_K_BLOCK 128
/* Largest head dim the CUDA kernels take. */
#define CQ_ATTENTION_MAX_HEAD_DIM 256
/* The compute capability (x 10) the CUDA kernels of each mode need: mma.sync for the full
 * precision; the 8-bit mode's kernels are built for sm_89 and newer. */
#define CQ_MIN_CC_ATTENTION 80
#define CQ_MIN_CC_ATTENTION_INT8 89
/* The 8-bit mode computes heads whose logit-error estimate E (log2 units, see above) exceeds
 * this in full precision. */
#define CQ_ATTENTION_INT8_MAX_LOGIT_ERROR 0.06f

typedef struct cq_attention_params {
  cq_attention_mode mode; /* full precision or 8-bit */
  float scale;            /* softmax scale (usually 1/sqrt(D)); finite */
  int32_t q_block;        /* 8-bit: query rows per int8 scale (0: CQ_ATTENTION_Q_BLOCK) */
  int32_t k_block;        /* 8-bit: keys per int8 scale and per softmax tile (0: CQ_ATTENTION_K_BLOCK) */
} cq_attention_params;

/* Bytes of workspace cq_attention needs for these sizes on `device` (0 for the
 * full-precision mode and on the CPU). */
CQ_API cq_status cq_attention_workspace_size(const cq_attention_params *params, int64_t batch, int64_t heads,
                                             int64_t seq_q, int64_t seq_kv, int64_t head_dim, cq_device_type device,
                                             size_t *bytes);

/*
 * q          [B, Sq, H, D], k and v [B, Skv, H, D]: one float dtype, last dim contiguous
 * workspace  uint8, at least cq_attention_workspace_size bytes, or NULL when 0
 * out        [B, Sq, H, D] in q's dtype, last dim contiguous, its elements apart
 *            (no zero or overlapping strides), not overlapping q, k, v
 * lse        fp32 [B, H, Sq] contiguous, or NULL
 */
CQ_API cq_status cq_attention(const cq_tensor *q, const cq_tensor *k, const cq_tensor *v,
                              const cq_attention_params *params, cq_tensor *workspace, cq_tensor *out,
                              cq_tensor *lse, void *stream);
CQ_API cq_status cq_attention_ref(const cq_tensor *q, const cq_tensor *k, const cq_tensor *v,
                                  const cq_attention_params *params, cq_tensor *out, cq_tensor *lse);

/*
 * The 8-bit mode's logit-error estimate E of every head (the accuracy bound above), computed
 * as the mode's pre-pass computes it, on CPU tensors: which heads that mode would compute in
 * full precision (E > CQ_ATTENTION_INT8_MAX_LOGIT_ERROR), for diagnostics and tests.
 *
 * q, k    as for cq_attention (CPU)
 * params  mode CQ_ATTENTION_INT8; scale, q_block and k_block as for cq_attention
 * bound   fp32 [B, H] contiguous (CPU): E of head (b, h); 0 where Sq or Skv is 0
 */
CQ_API cq_status cq_attention_int8_logit_error_ref(const cq_tensor *q, const cq_tensor *k,
                                                   const cq_attention_params *params, cq_tensor *bound);

/*
 * The same layer for a dynamic scheme whose activations are already quantized
 * (by cq_quantize with params->act_format and params->act_granularity): one
 * input read by several layers (the q, k and v projections of an attention
 * block) is then quantized once. Same math as cq_linear.
 *
 * x_codes   [..., K] codes of act_format (int8, or float8/uint8 for fp8), contiguous
 * x_scale   f32, one per row of x_codes (row) or 1 (tensor)
 * y         [..., N] f32/f16/bf16: its dtype is the output type; rows one stride apart
 *           as for cq_linear (a column slice of a wider tensor)
 * w, w_scale, bias, workspace as for cq_linear (bias in y's dtype or f32)
 */
CQ_API cq_status cq_linear_quantized(const cq_tensor *x_codes, const cq_tensor *x_scale, const cq_tensor *w,
                                     const cq_tensor *w_scale, const cq_tensor *bias, const cq_linear_params *params,
                                     cq_tensor *workspace, cq_tensor *y, void *stream);
CQ_API cq_status cq_linear_quantized_ref(const cq_tensor *x_codes, const cq_tensor *x_scale, const cq_tensor *w,
                                         const cq_tensor *w_scale, const cq_tensor *bias, const cq_linear_params *params,
                                         cq_tensor *y);

/* ---------------------------------------------------------------- fused DiT block ops */

/*
 * The element-wise work of a diffusion transformer block (adaLN-Zero, Q/K norm, rotary
 * embedding, gated residuals), fused into the passes that have to read the data anyway.
 *
 * cq_norm_modulate: normalization + adaLN modulation of hidden states x [B, S, D], one pass
 * per row, writing either the modulated activations or, for a quantized consumer, their
 * dynamic codes and per-row scales (the consumer then runs cq_linear_quantized and skips
 * its own activation-quantization pass). Rows of sample b take scale[b, :] and shift[b, :].
 * For each row, in fp32:
 *
 *   CQ_NORM_LAYER  mu = sum_d x[d] / D;  var = sum_d (x[d] - mu)^2 / D
 *                  n[d] = (x[d] - mu) * rstd,   rstd = 1 / sqrtf(var + eps)
 *                  (torch's LayerNorm without affine parameters)
 *   CQ_NORM_RMS    n[d] = x[d] * rstd,          rstd = 1 / sqrtf(sum_d x[d]^2 / D + eps)
 *   v[d] = n[d] * (1 + scale[b, d]) + shift[b, d]     (a missing scale or shift is 0)
 *   t[d] = v[d] rounded to x's dtype                  (what an unfused block hands its layer)
 *
 * out_format CQ_FORMAT_NONE: out = t, in x's dtype. CQ_FORMAT_INT8 / CQ_FORMAT_FP8_E4M3:
 * out and out_scale are the codes and per-row scales cq_quantize (CQ_GRANULARITY_ROW)
 * computes from t. The sums run in fp32 in an order of each path's choosing (the C
 * reference: index order), so paths agree within the fp32 rounding of the sums: an element
 * of t may differ by one unit in the last place of x's dtype, a code by one step.
 */
typedef enum cq_norm_kind {
  CQ_NORM_LAYER = 1, /* subtract the mean, divide by the standard deviation */
  CQ_NORM_RMS = 2,   /* divide by the root mean square */
} cq_norm_kind;

typedef struct cq_norm_modulate_params {
  cq_norm_kind norm; /* LayerNorm or RMSNorm, no affine parameters */
  float eps;         /* added to the variance (mean square); finite and >= 0 */
  int out_format;    /* CQ_FORMAT_NONE, CQ_FORMAT_INT8 or CQ_FORMAT_FP8_E4M3 */
} cq_norm_modulate_params;

/*
 * x          [B, S, D] f32/f16/bf16, contiguous
 * scale      [B, D] f32/f16/bf16, last dim contiguous (any row stride: a chunk of the
 *            modulation vector), or NULL
 * shift      [B, D] like scale, or NULL
 * out        [B, S, D] contiguous: x's dtype (CQ_FORMAT_NONE), int8 (INT8) or
 *            float8_e4m3fn / uint8 (FP8_E4M3); not overlapping x
 * out_scale  f32 [B * S] for a quantized out_format, else NULL
 */
CQ_API cq_status cq_norm_modulate(const cq_tensor *x, const cq_tensor *scale, const cq_tensor *shift,
                                  const cq_norm_modulate_params *params, cq_tensor *out, cq_tensor *out_scale,
                                  void *stream);
CQ_API cq_status cq_norm_modulate_ref(const cq_tensor *x, const cq_tensor *scale, const cq_tensor *shift,
                                      const cq_norm_modulate_params *params, cq_tensor *out, cq_tensor *out_scale);

/*
 * cq_qk_norm_rope: the step between an attention block's Q/K/V projections and its
 * attention call. Per token and head it normalizes q and k over the head dim (diffusers'
 * norm_q / norm_k, RMSNorm) and rotates them (rotary position embedding, interleaved pairs
 * as in Flux and Qwen-Image), copies v, and writes all three into the [B, S_total, H, D]
 * tensors the attention reads, starting at row seq_offset. The text and image streams of a
 * joint block go into one buffer by two calls (each with its own norm weights and offset),
 * so no concatenation is needed. For q (k likewise, with k_weight) at batch b, token s,
 * head h, with p = seq_offset + s, in fp32:
 *
 *   a[d] = q_in[b, s, h, d]
 *   rms_norm:  r = 1 / sqrtf(sum_d a[d]^2 / D + eps);  a[d] = a[d] * r * w[d]
 *              (w = q_weight, or 1 when q_weight is NULL)
 *   cos, sin:  for each pair i < D / 2, with c = cos[p, i], z = sin[p, i]:
 *              a'[2i] = a[2i] * c - a[2i+1] * z;  a'[2i+1] = a[2i] * z + a[2i+1] * c
 *   q_out[b, p, h, d] = a'[d] rounded to the output dtype
 *
 * The CUDA kernels may contract the products and sums into fused multiply-adds and sum
 * squares in another order: paths agree within a few fp32 roundings before the last one.
 * They take D up to CQ_ATTENTION_MAX_HEAD_DIM (the CPU any D).
 */
typedef struct cq_qk_norm_rope_params {
  int rms_norm;       /* nonzero: RMSNorm each head of q and k before the rotation */
  float eps;          /* RMSNorm's eps; finite and >= 0 */
  int64_t seq_offset; /* row of the outputs (and of cos / sin) that token 0 of the inputs goes to */
} cq_qk_norm_rope_params;

/*
 * q_in, k_in  [B, S, H, D] f32/f16/bf16, one dtype, last dim contiguous, any other strides
 *             (views of one fused QKV projection output are fine)
 * v_in        [B, S, H, D] like q_in, or NULL (then v_out is NULL too)
 * q_weight, k_weight  [D] f32/f16/bf16 contiguous, or NULL
 * cos, sin    f32 [S_total, D / 2] contiguous (D even), or both NULL: no rotation
 * q_out, k_out, v_out  [B, S_total, H, D] in q_in's dtype, last dim contiguous, any other
 *             strides that keep elements apart; seq_offset + S <= S_total; rows outside
 *             [seq_offset, seq_offset + S) are not touched; no output overlaps an input
 */
CQ_API cq_status cq_qk_norm_rope(const cq_tensor *q_in, const cq_tensor *k_in, const cq_tensor *v_in,
                                 const cq_tensor *q_weight, const cq_tensor *k_weight, const cq_tensor *cos,
                                 const cq_tensor *sin, const cq_qk_norm_rope_params *params, cq_tensor *q_out,
                                 cq_tensor *k_out, cq_tensor *v_out, void *stream);
CQ_API cq_status cq_qk_norm_rope_ref(const cq_tensor *q_in, const cq_tensor *k_in, const cq_tensor *v_in,
                                     const cq_tensor *q_weight, const cq_tensor *k_weight, const cq_tensor *cos,
                                     const cq_tensor *sin, const cq_qk_norm_rope_params *params, cq_tensor *q_out,
                                     cq_tensor *k_out, cq_tensor *v_out);

/*
 * cq_linear_gated: cq_linear with adaLN-Zero's gated residual in its epilogue, for the
 * output projections of a block's attention and MLP (`residual + gate * layer(x)`):
 *
 *   y[m, n] = residual[m, n] + gate[g(m), n] * v[m, n]     (fp32, rounded once to y's dtype)
 *
 * where v[m, n] = act(acc[m, n] * sx[m] * sw[n] + b[n]) is cq_linear's fp32 value before
 * its rounding, and g(m) = m / (M / G): x's M rows hold G samples of M / G consecutive rows
 * each (G = gate.shape[0], which must divide M), and every sample has its own gate. Paths
 * that fold the gate into the weight scales (sw[n] * gate[g, n]) and bias (b[n] * gate[g, n],
 * rounded to y's dtype where the GEMM reads its bias in that type) agree with this within
 * one rounding of y's dtype on the gated term.
 *
 * gate      [G, N] f32/f16/bf16, last dim contiguous (any row stride: a chunk of the
 *           modulation vector)
 * residual  [..., N] in y's dtype, y's shape; either y itself (same address and strides:
 *           the residual is updated in place) or apart from it
 * x, w, w_scale, bias, params, workspace (cq_linear_workspace_size), y as for cq_linear
 */
CQ_API cq_status cq_linear_gated(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale,
                                 const cq_tensor *bias, const cq_tensor *gate, const cq_tensor *residual,
                                 const cq_linear_params *params, cq_tensor *workspace, cq_tensor *y, void *stream);
CQ_API cq_status cq_linear_gated_ref(const cq_tensor *x, const cq_tensor *w, const cq_tensor *w_scale,
                                     const cq_tensor *bias, const cq_tensor *gate, const cq_tensor *residual,
                                     const cq_linear_params *params, cq_tensor *y);

/* ---------------------------------------------------------------- run-time switches */

/* The CQUANT_* environment variables libcquant reads, parsed (the table of
 * variables and values is in csrc/settings.c and the README). They are read
 * once, at the first call that needs one; cq_settings_reload reads them again.
 * Fields are only ever appended. */
#define CQ_ATTN_KERNEL_MMA 1u  /* the mma.sync attention kernels (bf16/fp16) */
#define CQ_ATTN_KERNEL_SM90 2u /* the sm_90a wgmma attention kernels (both modes) */
#define CQ_ATTN_KERNEL_INT8 4u /* the 8-bit attention kernels */

typedef struct cq_settings {
  int disable_wgmma;        /* CQUANT_DISABLE_WGMMA: int8 GEMMs avoid the sm_90a wgmma kernel */
  int disable_cublaslt_fp8; /* CQUANT_DISABLE_CUBLASLT_FP8: fp8 GEMMs avoid cuBLASLt */
  int64_t wo_chunk_mib;     /* CQUANT_WO_CHUNK_MB: MiB of dequantized weight per weight-only GEMM chunk */
  int gemv_persistent;      /* CQUANT_GEMV_PERSISTENT: -1 measured choice, 0 never, 1 whenever possible */
  int attn_sm90;            /* CQUANT_ATTN_SM90: -1 measured choice, 0 off, 1 on (sm_90a builds, 9.0 devices) */
  unsigned attn_disabled;   /* CQUANT_ATTN_DISABLE: CQ_ATTN_KERNEL_* bits of kernels switched off */
  char cublaslt_path[4096]; /* CQUANT_CUBLASLT_PATH: where to look for libcublasLt ("" when unset) */
  int share_activations;    /* CQUANT_SHARE_ACTIVATIONS: 0 makes every quantized layer of the Python package
                               quantize its own input (default 1: layers reading one input share its codes) */
  int64_t group4_decode_min_m; /* CQUANT_GROUP4_DECODE_M: 4-bit weight-only layers with bf16 / f16 x and at least
                                  this many rows of x (more than 16) decode w' and run cuBLASLt instead of the
                                  mixed-input GEMM (-1: the measured choice, by rows and shape) */
  int64_t wo_decode_min_m; /* CQUANT_WO_DECODE_M: weight-only layers with per-row or per-tensor scales, bf16 / f16 x
                              and at least this many rows of x (more than 16) decode the weight and run cuBLASLt,
                              fewer rows run the sm_90a mixed-input GEMM wherever it takes the layer (-1: the
                              measured choice, by shape and format) */
  int wo_split_k;          /* CQUANT_WO_SPLIT_K: 0 keeps the sm_90a weight-only GEMM from splitting K (with
                              CQUANT_WO_DECODE_M above every batch, a row's result then does not depend on the
                              batch); default 1: the tiles of a last wave that would leave SMs idle are cut
                              into K ranges, added in a fixed order */
  int wo_cluster_pairs;    /* CQUANT_WO_CLUSTER_PAIRS: 0 makes the sm_90a weight-only GEMM add a tile cut in two
                              along K through the workspace; default 1: in a cluster of two CTAs, through
                              distributed shared memory, where the grid allows */
} cq_settings;

/* Copy the settings in effect into *out. size is sizeof(cq_settings) as the
 * caller's cquant.h has it: fields past it (appended later) are not written. */
CQ_API cq_status cq_settings_get(cq_settings *out, size_t size);
/* Read the environment again: for programs (and tests) that change CQUANT_*
 * variables while running. Takes effect for calls that start after it;
 * CQUANT_CUBLASLT_PATH only matters until cuBLASLt is first opened, and a
 * changed CQUANT_WO_CHUNK_MB changes cq_linear_workspace_size. */
CQ_API void cq_settings_reload(void);

/* ---------------------------------------------------------------- build info */

/* Nonzero when libcquant was compiled with its CUDA kernels. */
CQ_API int cq_built_with_cuda(void);

/* What this library was built with. */
typedef struct cq_build_info {
  const char *version; /* cquant's version, e.g. "0.1.0" */
  int cuda;            /* nonzero when the CUDA kernels are built in */
  const char *archs;   /* arches of the machine code, ';'-separated ("80;89;90a"); "" in a CPU-only build */
  const char *ptx;     /* arch of the embedded PTX the driver compiles for newer GPUs ("90"); "" for none */
  int cuda_version;    /* CUDA the kernels were compiled with, 1000 * major + 10 * minor (13000); 0 CPU-only */
} cq_build_info;

/* Fill *out; size is sizeof(cq_build_info) as the caller's cquant.h has it. */
CQ_API cq_status cq_build_info_get(cq_build_info *out, size_t size);

/* What the CUDA installation gives this process: queried when asked, not built in. */
typedef struct cq_cuda_runtime_info {
  int runtime_version;      /* the CUDA runtime inside libcquant (cudaRuntimeGetVersion) */
  int driver_version;       /* the newest CUDA the driver supports (cudaDriverGetVersion); 0: no driver */
  int device_count;         /* CUDA devices visible to this process (0 without a driver or GPU) */
  size_t cublaslt_version;  /* cublasLtGetVersion of the cuBLASLt libcquant opens (e.g. 130100); 0: none */
  char cublaslt_path[1024]; /* the file it was opened from; "" when none was */
  char cublaslt_error[512]; /* why none could be opened; "" when one was */
} cq_cuda_runtime_info;

/* Fill *out (opening cuBLASLt if it was not yet); CQ_ERR_UNSUPPORTED in a CPU-only build. */
CQ_API cq_status cq_cuda_runtime_info_get(cq_cuda_runtime_info *out, size_t size);

/* One CUDA device as cquant sees it. */
typedef struct cq_cuda_device {
  char name[256];       /* as the driver names it */
  int cc;               /* compute capability x 10 */
  int sms;              /* multiprocessors */
  size_t total_memory;  /* bytes */
  int kernels;          /* nonzero when cquant's kernels run on it (cq_cuda_device_supported) */
  int sm90a;            /* nonzero when this build's sm_90a kernels (wgmma GEMMs and attention, the
                           persistent GEMV) run on it: compute capability 9.0 and sm_90a code built in */
  char why_not[512];    /* when kernels is 0: why not */
} cq_cuda_device;

/* Fill *out for device_id; CQ_ERR_CUDA when it cannot be asked, CQ_ERR_UNSUPPORTED in a
 * CPU-only build. */
CQ_API cq_status cq_cuda_device_get(int device_id, cq_cuda_device *out, size_t size);
/* Compute capability (e.g. 90) of a CUDA device, or an error if CUDA or the
 * device is unavailable. */
CQ_API cq_status cq_cuda_compute_capability(int device_id, int *cc);
/* Whether cquant's CUDA kernels run on a device: CQ_OK when the device is one
 * they are written for (compute capability 8.0 or newer) and this build holds
 * code the device can load (its machine code, or PTX the driver compiles for
 * it); else CQ_ERR_UNSUPPORTED with the reason in cq_last_error() (also in a
 * CPU-only build), or CQ_ERR_CUDA when the device cannot be asked. Ops on a
 * device that fails this fail too; the schemes' own floors are on top of it. */
CQ_API cq_status cq_cuda_device_supported(int device_id);

#ifdef __cplusplus
}
#endif

#endif /* CQUANT_H */
