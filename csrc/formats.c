/* The format table: every quantization format cquant stores, as data. */
#include "cq_numerics.h"
#include "cquant-impl.h"

static uint32_t encode_int8(const cq_format_info *f, float v) {
  (void)f;
  return (uint32_t)(uint8_t)(int8_t)cq_int8_encode(v);
}

static float decode_int8(const cq_format_info *f, uint32_t code) {
  (void)f;
  return (float)(int8_t)(uint8_t)code;
}

/* int4: RNE, saturated at +-7, as a two's complement nibble. */
static uint32_t encode_int4(const cq_format_info *f, float v) {
  (void)f;
  return cq_int4_encode(v);
}

static float decode_int4(const cq_format_info *f, uint32_t code) {
  (void)f;
  return cq_int4_decode(code);
}

/* uint4: the code itself (the zero point is the group's, applied by the callers). */
static uint32_t encode_uint4(const cq_format_info *f, float v) {
  (void)f;
  int32_t c = cq_int8_encode(v);
  return (uint32_t)(c < 0 ? 0 : c > 15 ? 15 : c);
}

static float decode_uint4(const cq_format_info *f, uint32_t code) {
  (void)f;
  return (float)(code & 0xfu);
}

static uint32_t encode_float(const cq_format_info *f, float v) {
  return cq_float_encode(v, f->ebits, f->mbits, f->bias, f->max_value, f->max_code);
}

static float decode_float(const cq_format_info *f, uint32_t code) {
  return cq_float_decode(code, f->ebits, f->mbits, f->bias, (int)f->specials);
}

/* Largest finite fpX value: all-ones exponent and mantissa (no inf/NaN codes). */
#define FPX_BIAS(E) ((1 << ((E)-1)) - 1)
#define FPX_MAX(E, M) ((float)(1ull << ((1 << (E)) - 1 - FPX_BIAS(E))) * (2.0f - 1.0f / (float)(1 << (M))))

#define FPX(E, M, NAME)                                                                    \
  {                                                                                        \
    .id = (cq_format)CQ_FORMAT_FPX(E, M), .name = NAME, .kind = CQ_KIND_FLOAT,             \
    .bits = 1 + (E) + (M), .ebits = (E), .mbits = (M), .bias = FPX_BIAS(E),                \
    .specials = CQ_SPECIALS_NONE, .max_value = FPX_MAX(E, M),                              \
    .max_code = (1u << ((E) + (M))) - 1u, .packed = 1, .code_dtype = CQ_DTYPE_U8,          \
    .encode = encode_float, .decode = decode_float,                                        \
  }

static const cq_format_info format_table[] = {
    {
        .id = CQ_FORMAT_INT8, .name = "int8", .kind = CQ_KIND_INT, .bits = 8, .ebits = 0,
        .mbits = 7, .bias = 0, .specials = CQ_SPECIALS_NONE, .max_value = 127.0f,
        .max_code = 127u, .packed = 0, .code_dtype = CQ_DTYPE_I8,
        .encode = encode_int8, .decode = decode_int8,
    },
    {
        /* OCP e4m3fn: S.1111.111 is NaN, so the top finite code is S.1111.110 = 448 */
        .id = CQ_FORMAT_FP8_E4M3, .name = "fp8_e4m3", .kind = CQ_KIND_FLOAT, .bits = 8,
        .ebits = 4, .mbits = 3, .bias = 7, .specials = CQ_SPECIALS_NAN_ONLY,
        .max_value = 448.0f, .max_code = 0x7eu, .packed = 0, .code_dtype = CQ_DTYPE_F8_E4M3FN,
        .encode = encode_float, .decode = decode_float,
    },
    {
        /* OCP e5m2: IEEE-like, exponent 11111 is inf/NaN; top finite is S.11110.11 = 57344 */
        .id = CQ_FORMAT_FP8_E5M2, .name = "fp8_e5m2", .kind = CQ_KIND_FLOAT, .bits = 8,
        .ebits = 5, .mbits = 2, .bias = 15, .specials = CQ_SPECIALS_IEEE,
        .max_value = 57344.0f, .max_code = 0x7bu, .packed = 0, .code_dtype = CQ_DTYPE_F8_E5M2,
        .encode = encode_float, .decode = decode_float,
    },
    {
        /* two codes a byte, low nibble first; one scale per group of a row */
        .id = CQ_FORMAT_INT4, .name = "int4", .kind = CQ_KIND_INT, .bits = 4, .ebits = 0,
        .mbits = 3, .bias = 0, .specials = CQ_SPECIALS_NONE, .max_value = 7.0f,
        .max_code = 7u, .packed = 1, .code_dtype = CQ_DTYPE_U8,
        .encode = encode_int4, .decode = decode_int4,
    },
    {
        /* codes 0..15 and a zero point per group: (code - zp) * scale */
        .id = CQ_FORMAT_UINT4, .name = "uint4", .kind = CQ_KIND_UINT, .bits = 4, .ebits = 0,
        .mbits = 4, .bias = 0, .specials = CQ_SPECIALS_NONE, .max_value = 15.0f,
        .max_code = 15u, .packed = 1, .code_dtype = CQ_DTYPE_U8,
        .encode = encode_uint4, .decode = decode_uint4,
    },
    FPX(1, 1, "fp3_e1m1"), FPX(1, 2, "fp4_e1m2"), FPX(1, 3, "fp5_e1m3"),
    FPX(1, 4, "fp6_e1m4"), FPX(1, 5, "fp7_e1m5"),
    FPX(2, 0, "fp3_e2m0"), FPX(2, 1, "fp4_e2m1"), FPX(2, 2, "fp5_e2m2"),
    FPX(2, 3, "fp6_e2m3"), FPX(2, 4, "fp7_e2m4"),
    FPX(3, 0, "fp4_e3m0"), FPX(3, 1, "fp5_e3m1"), FPX(3, 2, "fp6_e3m2"),
    FPX(3, 3, "fp7_e3m3"),
    FPX(4, 0, "fp5_e4m0"), FPX(4, 1, "fp6_e4m1"), FPX(4, 2, "fp7_e4m2"),
    FPX(5, 0, "fp6_e5m0"), FPX(5, 1, "fp7_e5m1"),
    FPX(6, 0, "fp7_e6m0"),
};

#define FORMAT_COUNT ((int)(sizeof format_table / sizeof format_table[0]))

int cq_format_count(void) { return FORMAT_COUNT; }

const cq_format_info *cq_format_at(int index) {
  return index >= 0 && index < FORMAT_COUNT ? &format_table[index] : NULL;
}

const cq_format_info *cq_format_get(int id) {
  for (int i = 0; i < FORMAT_COUNT; ++i)
    if ((int)format_table[i].id == id) return &format_table[i];
  cq_fail(CQ_ERR_INVALID_ARG,
          "format %d is not a cquant format (int8, fp8_e4m3, fp8_e5m2, int4, uint4 or fpX with 1 sign, "
          "E >= 1 exponent and M mantissa bits, 3 <= 1+E+M <= 7)",
          id);
  return NULL;
}

int64_t cq_pack_row_bytes_bits(int bits, int64_t cols) {
  /* cols * bits + 7 + 8 * (CQ_PACK_ROW_ALIGN - 1) must fit int64 */
  if (cols < 0 || bits < 1 || cols > (INT64_MAX - 8 * CQ_PACK_ROW_ALIGN) / bits) return -1;
  int64_t bytes = (cols * bits + 7) / 8;
  return (bytes + CQ_PACK_ROW_ALIGN - 1) / CQ_PACK_ROW_ALIGN * CQ_PACK_ROW_ALIGN;
}

int64_t cq_packed_row_bytes(const cq_format_info *f, int64_t cols) {
  if (!f || cols < 0) return -1;
  return f->packed ? cq_pack_row_bytes_bits(f->bits, cols) : cols;
}

void cq_store_bits(uint8_t *row, int64_t j, int bits, uint32_t code) {
  /* LSB-first bit stream; the row was zeroed before the first store */
  int64_t bit = j * bits;
  int shift = (int)(bit & 7);
  uint32_t c = code & ((1u << bits) - 1u);
  row[bit >> 3] |= (uint8_t)(c << shift);
  if (shift + bits > 8) row[(bit >> 3) + 1] |= (uint8_t)(c >> (8 - shift));
}

uint32_t cq_load_bits(const uint8_t *row, int64_t j, int bits) {
  int64_t bit = j * bits;
  int shift = (int)(bit & 7);
  uint32_t v = row[bit >> 3];
  if (shift + bits > 8) v |= (uint32_t)row[(bit >> 3) + 1] << 8;
  return (v >> shift) & ((1u << bits) - 1u);
}

void cq_store_code(const cq_format_info *f, void *row, int64_t j, uint32_t code) {
  if (f->packed)
    cq_store_bits((uint8_t *)row, j, f->bits, code);
  else
    ((uint8_t *)row)[j] = (uint8_t)code;
}

uint32_t cq_load_code(const cq_format_info *f, const void *row, int64_t j) {
  return f->packed ? cq_load_bits((const uint8_t *)row, j, f->bits) : ((const uint8_t *)row)[j];
}
