/* Register decoders of packed 4-bit weights (cquant.h, "4-bit integer formats"): nibbles to the
 * operands of the tensor cores, exactly as the C reference computes them.
 *
 *   weight-only: w' = x' rounded to the 16-bit type, x' = code * scale (int4) or
 *                (code - zp) * scale (uint4), in fp32, products and differences rounded once
 *   dynamic:     int4 codes as int8 or fp8 e4m3 bytes (exact: |code| <= 8)
 *
 * A nibble becomes an fp32 value with the magic-number trick: 0x4B000000 | n is the float
 * 2^23 + n, so one subtraction gives n (uint4) or, with the sign bit flipped first
 * ((n ^ 8) - 8), the two's-complement value (int4), exactly. */
#ifndef CQ_KERNELS_INT4_DECODE_CUH
#define CQ_KERNELS_INT4_DECODE_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace cq_int4 {

/* fp32 value of a nibble held in bits [0, 4) of v (other bits ignored), before the scale. */
template <bool U4>
__device__ __forceinline__ float nibble_value(uint32_t v, float zp) {
  if constexpr (U4) {
    const float f = __uint_as_float((v & 0xFu) | 0x4B000000u);
    return __fsub_rn(__fsub_rn(f, 8388608.0f), zp); /* code exact, then code - zp rounded once */
  } else {
    const float f = __uint_as_float((v & 0xFu) ^ 0x4B000008u);
    return __fsub_rn(f, 8388616.0f); /* 2^23 + (n ^ 8) - (2^23 + 8): the signed code, exact */
  }
}

/* Two fp32 values as the low (lo) and high (hi) halves of a bf16x2 or f16x2 word, each rounded
 * to nearest even (overflow to +-inf in f16, as cquant.h says). */
template <bool BF16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (BF16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
  }
}

/* w' of the two codes in bits [0, 8) of v (low nibble: the lower k) as one 16-bit pair. */
template <bool BF16, bool U4>
__device__ __forceinline__ uint32_t byte_to_pair(uint32_t v, float s, float zp) {
  const float lo = __fmul_rn(nibble_value<U4>(v, zp), s);
  const float hi = __fmul_rn(nibble_value<U4>(v >> 4, zp), s);
  return pack2<BF16>(lo, hi);
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

/* The four int4 codes in bits [0, 16) of v (code i in nibble i) as int8 bytes (byte i = code i).
 * (n ^ 8) is the code + 8 in [0, 15]; adding 0x78 and flipping bit 7 subtracts 8 in each byte
 * without borrows between bytes. */
__device__ __forceinline__ uint32_t int4x4_to_s8(uint32_t v) {
  const uint32_t lo = (v & 0x0F0Fu) ^ 0x0808u;        /* codes 0, 2 in bytes 0, 1 */
  const uint32_t hi = ((v >> 4) & 0x0F0Fu) ^ 0x0808u; /* codes 1, 3 */
  const uint32_t b = prmt(lo, hi, 0x5140u);           /* bytes: lo.0, hi.0, lo.1, hi.1 */
  return (b + 0x78787878u) ^ 0x80808080u;
}

/* The same four codes as fp8 e4m3 bytes (every int4 value is exact in e4m3). prmt's selector
 * nibbles are the codes themselves: a nibble with bit 3 clear picks table byte n, one with bit 3
 * set replicates the sign of byte n & 7. So a table of e4m3(0..7) (sign bits clear) gives the
 * non-negative codes and 0 for the negative ones; flipping bit 3 of each selector, a table of
 * |e4m3(n - 16)| = e4m3(8 - (n & 7)) gives the negative codes' magnitudes and 0 for the others;
 * a table of 0x80 bytes gives 0x80 (code >= 0) or 0xFF (code < 0), whose bit 6 is the sign. */
__device__ __forceinline__ uint32_t int4x4_to_e4m3(uint32_t v) {
  const uint32_t pos = prmt(0x44403800u, 0x4E4C4A48u, v);          /* 0, 1, 2, 3 | 4, 5, 6, 7 */
  const uint32_t neg = prmt(0x4A4C4E50u, 0x38404448u, v ^ 0x8888u); /* 8, 7, 6, 5 | 4, 3, 2, 1 */
  const uint32_t sgn = prmt(0x80808080u, 0x80808080u, v);
  return pos | neg | ((sgn << 1) & 0x80808080u);
}

}  // namespace cq_int4

#endif /* CQ_KERNELS_INT4_DECODE_CUH */
