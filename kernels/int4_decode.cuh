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

/* ---- The 16-bit path: the same w', computed in x's 16-bit type ----
 * When a group's scale is exactly representable in the 16-bit type (the quantizer stores scales
 * of 8 significant bits, cquant.h) and its zero point is a small integer, (code - zp) * scale is
 * exact in fp32, so rounding it once to the 16-bit type is what one packed 16-bit fma of the
 * exact operands gives: w' below is bit for bit the fp32 math of cquant.h, at about one packed
 * instruction a weight instead of three scalar ones. The 16-bit value of a nibble n is the magic
 * number 128 + n (bf16 0x4300 | n) or 1024 + n (f16 0x6400 | n); int4 flips the sign bit first,
 * giving base + 8 + code. */

/* a * b + c on two 16-bit lanes, rounded once (sm_80+ for bf16). */
template <bool BF16>
__device__ __forceinline__ uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  if constexpr (BF16)
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  else
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

/* v (exact in the 16-bit type) in both halves of a word. */
template <bool BF16>
__device__ __forceinline__ uint32_t splat2(float v) {
  uint32_t h;
  if constexpr (BF16) {
    h = __float_as_uint(v) >> 16;
  } else {
    const __half x = __float2half_rn(v);
    h = (uint32_t)*reinterpret_cast<const unsigned short *>(&x);
  }
  return h | (h << 16);
}

/* Whether the group (scale s, zero point zp) takes the 16-bit path exactly: s is 0 or a normal
 * number of the 16-bit type with no bits below its mantissa (so no product underflows), and zp
 * (uint4) an integer in [-128, 127] (so base + zp and code - zp are exact). NaN and inf fail. */
template <bool BF16, bool U4>
__device__ __forceinline__ bool exact16(float s, float zp) {
  /* & rather than &&: no branches on the decode's path */
  const uint32_t u = __float_as_uint(s) & 0x7fffffffu;
  bool ok;
  if constexpr (BF16) /* bf16 normals: biased exponent 1..254, no bits below the 8th */
    ok = (u == 0u) | (((u & 0xffffu) == 0u) & (u - 0x00800000u < 0x7f000000u));
  else /* f16 normals: [2^-14, 65504], 11 significant bits */
    ok = (u == 0u) | ((u - 0x38800000u <= 0x477fe000u - 0x38800000u) & ((u & 0x1fffu) == 0u));
  if constexpr (U4) ok = ok & (zp == rintf(zp)) & (zp >= -128.0f) & (zp <= 127.0f);
  return ok;
}

/* Decoder of one group on the 16-bit path: at(v) is w' of the nibbles in bits [0, 4) (low half)
 * and [16, 20) (high half) of v, pair(w, i) that of nibbles i and i + 4 of word w, i = 0..3. */
template <bool BF16, bool U4>
struct Decoder16 {
  uint32_t neg_base, scale2;
  __device__ __forceinline__ Decoder16(float s, float zp) {
    const float base = BF16 ? 128.0f : 1024.0f;
    neg_base = splat2<BF16>(U4 ? -(base + zp) : -(base + 8.0f));
    scale2 = splat2<BF16>(s);
  }
  __device__ __forceinline__ uint32_t pair(uint32_t w, int i) const { return at(w >> (4 * i)); }
  __device__ __forceinline__ uint32_t at(uint32_t v) const {
    const uint32_t magic = BF16 ? 0x43004300u : 0x64006400u;
    uint32_t bits;
    if (U4) /* (v & 0x000f000f) | magic */
      asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(bits) : "r"(v), "r"(0x000f000fu), "r"(magic));
    else /* ... ^ (magic | 8): base + (n ^ 8) */
      asm("lop3.b32 %0, %1, %2, %3, 0x6A;\n" : "=r"(bits) : "r"(v), "r"(0x000f000fu), "r"(magic | 0x00080008u));
    const uint32_t one2 = BF16 ? 0x3f803f80u : 0x3c003c00u;
    const uint32_t code = fma2<BF16>(bits, one2, neg_base);  /* code - zp, exact */
    return fma2<BF16>(code, scale2, 0x80008000u);            /* * scale + (-0), rounded once */
  }
};

/* The same pair on the fp32 path, for any group (cquant.h's math written out). */
template <bool BF16, bool U4>
__device__ __forceinline__ uint32_t pair32(uint32_t w, int i, float s, float zp) {
  const float lo = __fmul_rn(nibble_value<U4>(w >> (4 * i), zp), s);
  const float hi = __fmul_rn(nibble_value<U4>(w >> (4 * i + 16), zp), s);
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
