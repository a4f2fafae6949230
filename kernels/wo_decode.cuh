/* Stored weight codes to f16/bf16 with a few integer and half2 operations per
 * pair of codes, and no tables (the weight-only GEMV and the row decoder in
 * gemv_wo.cuh and wo_dequant_rows.cu use these).
 *
 * Every decoder returns two codes as one 32-bit register of two 16-bit floats
 * ("a pair", the first code in the low half), the operand format of mma.sync:
 *
 *  int8   f16: code + 128 is placed in the mantissa of the magic number 0x6400
 *         = 1024, then one subtraction. bf16, whose 8 significant bits do not
 *         hold an integer of 8 bits plus an offset: the code's low 7 bits go
 *         into the mantissa under exponent 7 (128 + low), its sign bit into the
 *         exponent's lowest bit of 128 (256 where set), and one subtraction of
 *         the second from the first leaves the code (from_bytes02).
 *  fpX, e4m3, e4m3's NaN codes aside:
 *         both codes are moved so their sign bits sit at bits 15 and 31 (one
 *         shift or byte-permute, see wo_gather_top), the magnitude bits
 *         (exponent and mantissa) are shifted right so the exponent sits at the
 *         bottom of the f16/bf16 exponent field, and one half2 multiply by
 *         2^(bias16 - bias) fixes the exponent bias. Codes with exponent 0
 *         become f16/bf16 subnormals of the same significand, which the
 *         multiply scales exactly like the normal ones, so every value comes out
 *         exact (the 16-bit type must hold the format: f16 for E <= 4, bf16 for
 *         all). e4m3's NaN codes decode to 480 here; callers mark their rows with
 *         wo_e4m3_nan_marks instead.
 *  e5m2   is the top byte of an f16 (inf and NaN included); for bf16 the f16 is
 *         widened to f32 and its top half taken, all exact.
 *
 * Code positions inside a unit (wo_unit.cuh) are compile-time constants after
 * the callers' loops unroll, so each helper folds into one to four
 * instructions. The primitives below are device intrinsics in CUDA code and
 * plain C++ on the host, where tests/wo_decode_check.cpp compares every code
 * of every format against the C reference. */
#ifndef CQ_KERNELS_WO_DECODE_CUH
#define CQ_KERNELS_WO_DECODE_CUH

#include <stdint.h>
#include <string.h>

#include "cq_numerics.h"

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define WO_HD __host__ __device__ __forceinline__
#else
#define WO_HD inline
#endif

/* ---------------------------------------------------------------- units */

/* Stored weight rows are read in "units": the shortest run of 16-byte vectors
 * (8-byte for odd bit widths) that holds a whole number of codes, a multiple
 * of 16 (8-bit: 1 x 16 bytes = 16 codes, 4-bit: 1 x 16 = 32, 6-bit: 3 x 16 =
 * 64, 3/5/7-bit: 3/5/7 x 8 = 64). A GEMV lane decodes whole units, so no code
 * straddles two lanes' data and every position is a compile-time constant.
 * Rows are padded to 16 bytes, so every vector of a unit is aligned. */
template <int BITS>
struct WoUnit {
  static_assert(BITS >= 1 && BITS <= 8, "codes of 1..8 bits");
  static constexpr int kVecBytes = (BITS % 2) ? 8 : 16;
  static constexpr int kVecs = (BITS % 2) ? BITS : (BITS == 6 ? 3 : 1);
  static constexpr int kBytes = kVecBytes * kVecs;
  static constexpr int kWords = kBytes / 4;
  static constexpr int kCodes = 8 * kBytes / BITS;
  static_assert(kCodes % 16 == 0, "a unit holds whole groups of 16 codes");
};

/* ---------------------------------------------------------------- primitives */

/* __byte_perm: byte i of the result is byte (sel >> 4i) & 7 of {b, a} (a is
 * bytes 0-3, b bytes 4-7). Selector nibbles are always 0..7 here. */
WO_HD uint32_t wo_prmt(uint32_t a, uint32_t b, uint32_t sel) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, sel);
#else
  const uint64_t v = ((uint64_t)b << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= (uint32_t)((v >> (8 * ((sel >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
  return r;
#endif
}

/* The low word of {hi, lo} >> s, 0 <= s < 32 (__funnelshift_r). */
WO_HD uint32_t wo_funnel(uint32_t lo, uint32_t hi, int s) {
#ifdef __CUDA_ARCH__
  return __funnelshift_r(lo, hi, s);
#else
  return (uint32_t)((((uint64_t)hi << 32) | lo) >> s);
#endif
}

WO_HD float wo_f16_bits_to_float(uint32_t h) {
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half((unsigned short)h));
#else
  return cq_f16_to_f32((uint16_t)h);
#endif
}

#ifdef __CUDA_ARCH__
/* The device's half2 arithmetic on packed words: op on V (__half2 or __nv_bfloat162) views of a, b. */
template <class V, class Op>
__device__ __forceinline__ uint32_t wo_device_halves(uint32_t a, uint32_t b, Op op) {
  V x, y;
  memcpy(&x, &a, 4), memcpy(&y, &b, 4);
  const V z = op(x, y);
  uint32_t r;
  memcpy(&r, &z, 4);
  return r;
}
#else
/* The host's half2 arithmetic: op on both halves in fp32, each result rounded
 * to f16 / bf16 (the device's rounding wherever op's result is exact). */
template <bool BF16, class Op>
inline uint32_t wo_host_halves(uint32_t a, uint32_t b, Op op) {
  uint32_t r = 0;
  for (int i = 0; i < 2; ++i) {
    const uint16_t ha = (uint16_t)(a >> (16 * i)), hb = (uint16_t)(b >> (16 * i));
    const float v = BF16 ? op(cq_bf16_to_f32(ha), cq_bf16_to_f32(hb)) : op(cq_f16_to_f32(ha), cq_f16_to_f32(hb));
    r |= (uint32_t)(BF16 ? cq_f32_to_bf16(v) : cq_f32_to_f16(v)) << (16 * i);
  }
  return r;
}
#endif

/* Both halves of a times both halves of b, as f16 or bf16. Used only where the
 * products are exact (b a power of two), so the host version rounds the same. */
template <bool BF16>
WO_HD uint32_t wo_hmul2(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
  if (BF16) return wo_device_halves<__nv_bfloat162>(a, b, [](__nv_bfloat162 x, __nv_bfloat162 y) { return __hmul2(x, y); });
  return wo_device_halves<__half2>(a, b, [](__half2 x, __half2 y) { return __hmul2(x, y); });
#else
  return wo_host_halves<BF16>(a, b, [](float x, float y) { return x * y; });
#endif
}

/* f16 a + b on both halves (exact where used). */
WO_HD uint32_t wo_hadd2_f16(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
  return wo_device_halves<__half2>(a, b, [](__half2 x, __half2 y) { return __hadd2(x, y); });
#else
  return wo_host_halves<false>(a, b, [](float x, float y) { return x + y; });
#endif
}

/* bf16 a - b on both halves (exact where used). */
WO_HD uint32_t wo_hsub2_bf16(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
  return wo_device_halves<__nv_bfloat162>(a, b, [](__nv_bfloat162 x, __nv_bfloat162 y) { return __hsub2(x, y); });
#else
  return wo_host_halves<true>(a, b, [](float x, float y) { return x - y; });
#endif
}

/* Any bitwise function of three words in one LOP3, LUT its truth table (bit 4a + 2b + c of LUT is
 * the result for bits a, b, c). The same function written in C with two constants becomes two
 * instructions, one per immediate (LOP3 takes one). */
template <uint32_t LUT>
WO_HD uint32_t wo_lop3(uint32_t a, uint32_t b, uint32_t c) {
#ifdef __CUDA_ARCH__
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, %4;" : "=r"(r) : "r"(a), "r"(b), "r"(c), "n"(LUT));
  return r;
#else
  uint32_t r = 0;
  for (int i = 0; i < 8; ++i)
    if ((LUT >> i) & 1u) r |= ((i & 4) ? a : ~a) & ((i & 2) ? b : ~b) & ((i & 1) ? c : ~c);
  return r;
#endif
}
constexpr uint32_t kWoAndOr = 0xeau;  /* (a & b) | c */
constexpr uint32_t kWoAndXor = 0x6au; /* (a & b) ^ c */

WO_HD float wo_fsub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

/* ---------------------------------------------------------------- 16-bit targets */

/* Field widths of the 16-bit float the codes decode into. */
template <bool BF16>
struct WoHalf {
  static constexpr int kExpBits = BF16 ? 8 : 5;
  static constexpr int kBias = BF16 ? 127 : 15;
  /* 2^e (a normal number) in both halves */
  static WO_HD uint32_t pow2x2(int e) {
    const uint32_t h = (uint32_t)(e + kBias) << (15 - kExpBits);
    return h | (h << 16);
  }
};

/* Two codes with their sign bits at bits 15 and 31 (junk below each code) as
 * two 16-bit floats: the sign stays, the magnitude bits (`magtop`: the BITS-1
 * bits under each sign) move right by rs = (16-bit exponent width - E), which
 * puts the code's exponent at the bottom of the exponent field and its
 * mantissa at the top of the mantissa field. The result is the code's value
 * times 2^(bias - bias16). */
WO_HD uint32_t wo_place(uint32_t t, uint32_t magtop, uint32_t rs) {
  return (t & 0x80008000u) | ((t & magtop) >> rs);
}

template <int BITS>
struct WoMagTop {
  static constexpr uint32_t kHalf = ((1u << (BITS - 1)) - 1u) << (16 - BITS);
  static constexpr uint32_t kValue = kHalf | (kHalf << 16);
};

/* ---------------------------------------------------------------- code gathering */

/* A word whose bit `at` is bit `top` of the unit's bit stream w (LSB first),
 * with the `width` bits below it (one code) intact; other bits are junk. */
template <int NW>
WO_HD uint32_t wo_code_at(const uint32_t (&w)[NW], int top, int width, int at) {
  const int lo = top - (width - 1), i = lo / 32;
  if (i == top / 32) {
    const int s = at - top % 32;
    return s >= 0 ? w[i] << s : w[i] >> -s;
  }
  /* the code straddles words i and i + 1: window [top - at, top - at + 32) */
  return wo_funnel(w[i], w[i + 1], top - at - 32 * i);
}

/* Bytes b0, b1 of the stream as bytes 0, 1 of a word (other bytes junk). */
template <int NW>
WO_HD uint32_t wo_byte_pair(const uint32_t (&w)[NW], int b0, int b1) {
  if (b0 / 4 == b1 / 4) return wo_prmt(w[b0 / 4], 0u, (uint32_t)(b0 % 4) | ((uint32_t)(b1 % 4) << 4));
  return wo_funnel(w[b0 / 4], w[b1 / 4], 8 * (b0 % 4)); /* b0 is byte 3 of its word, b1 byte 0 of the next */
}

/* Stream bytes b[0..3] as bytes 0..3 of a word: one byte-permute when they
 * come from at most two words. */
template <int NW>
WO_HD uint32_t wo_bytes4(const uint32_t (&w)[NW], int b0, int b1, int b2, int b3) {
  const int b[4] = {b0, b1, b2, b3};
  const int wa = b0 / 4;
  int wb = wa;
  bool two = true;
  for (int i = 1; i < 4; ++i) {
    const int wi = b[i] / 4;
    if (wi == wa || wi == wb) continue;
    if (wb == wa) wb = wi;
    else two = false;
  }
  if (two) {
    uint32_t sel = 0;
    for (int i = 0; i < 4; ++i) sel |= (uint32_t)((b[i] / 4 == wa ? 0 : 4) + b[i] % 4) << (4 * i);
    return wo_prmt(w[wa], w[wb], sel);
  }
  /* three or four words: each byte pair into one word first */
  return wo_prmt(wo_byte_pair(w, b0, b1), wo_byte_pair(w, b2, b3), 0x5410u);
}

/* Codes ja and jb of a unit of BITS-bit codes (stream w) as one word with the
 * sign of code ja at bit 15 and that of code jb at bit 31; bits below each
 * code are junk. Positions are compile-time constants in unrolled callers, so
 * one of the three ways below is chosen at compile time:
 *   1. both codes in one word, 16 bits apart: one shift (or none);
 *   2. same bit offset inside their bytes: one byte-permute gathers the byte
 *      holding each code's sign and the byte under it, then one shift;
 *   3. otherwise two shifted windows merged by halves. */
template <int BITS, int NW>
WO_HD uint32_t wo_gather_top(const uint32_t (&w)[NW], int ja, int jb) {
  const int pa = ja * BITS, pb = jb * BITS;
  const int ta = pa + BITS - 1, tb = pb + BITS - 1;
  if (pb - pa == 16 && pa / 32 == tb / 32) return w[pa / 32] << (15 - ta % 32);
  if ((pb - pa) % 8 == 0) {
    const int ha = ta / 8, hb = tb / 8;
    const int la = pa / 8 < ha ? ha - 1 : ha, lb = pb / 8 < hb ? hb - 1 : hb;
    const uint32_t t = wo_bytes4(w, la, ha, lb, hb);
    return t << (7 - ta % 8);
  }
  return wo_prmt(wo_code_at(w, ta, BITS, 15), wo_code_at(w, tb, BITS, 31), 0x7610u);
}

/* ---------------------------------------------------------------- codecs */

enum WoCodecKind { kWoInt8 = 0, kWoE4M3 = 1, kWoE5M2 = 2, kWoFpX = 3 };

template <bool BF16>
WO_HD float wo_half_to_float(uint32_t h) {
  if (BF16) return cq_bf16_to_f32((uint16_t)h);
  return wo_f16_bits_to_float(h);
}

/* Codes 0..7 of an octet (8 codes in w) as floats, through the pairs (j, j + D)
 * a codec decodes in fewest instructions (D = 2 for bytes, 4 otherwise). */
template <class Codec, bool BF16>
WO_HD void wo_values8_by_pairs(const uint32_t (&w)[2], const typename Codec::Consts &c, float (&v)[8]) {
  constexpr int D = Codec::kBits == 8 ? 2 : 4;
  for (int j = 0; j < 8; ++j) {
    if ((j / D) % 2) continue;
    const uint32_t h = Codec::template pair<BF16>(w, j, j + D, c);
    v[j] = wo_half_to_float<BF16>(h & 0xffffu);
    v[j + D] = wo_half_to_float<BF16>(h >> 16);
  }
}

/* WoCodec<KIND, BITS>:
 *   kBits       bits per code
 *   kPair       P: the GEMV pairs code j with code j + P (the pairing the
 *               gather does in fewest instructions; x is permuted to match)
 *   kNanCodes   some codes are NaN (e4m3): rows holding them are marked
 *   kInfNanCodes  some codes are inf or NaN and decode exactly (e5m2)
 *   Consts      per-format constants, built once per thread
 *   pair<BF16>(w, ja, jb, c)   codes ja (low half) and jb (high half) of the
 *               stream w as f16 (BF16 false) or bf16
 *   values8(w, c, v)           the 8 codes of w[0..1] as exact floats (the row
 *               decoder; bf16 holds every format, e5m2 goes through f16) */
template <int KIND, int BITS>
struct WoCodec;

struct WoNoConsts {
  WO_HD WoNoConsts(int ebits, int bias, bool bf16) { (void)ebits, (void)bias, (void)bf16; }
};

template <>
struct WoCodec<kWoInt8, 8> {
  static constexpr int kBits = 8, kPair = 1;
  static constexpr bool kNanCodes = false, kInfNanCodes = false;
  typedef WoNoConsts Consts;

  /* u = code + 128 = code ^ 0x80 as an unsigned byte; f32 2^23 + u, the code
   * after subtracting 2^23 + 128 (exact), whose top half is its bf16. */
  template <int NW>
  static WO_HD float to_float(const uint32_t (&w)[NW], int j) {
    const uint32_t f = wo_prmt(w[j / 4] ^ 0x80808080u, 0x4b000000u, 0x7650u | (uint32_t)(j % 4));
    float v;
    memcpy(&v, &f, 4);
    return wo_fsub(v, 8388736.0f);
  }

  /* The codes at bytes 0 and 2 of s (bytes 1 and 3 unused) as a pair. bf16: (0x4300 | low 7 bits)
   * = 128 + low minus (0x4300 | sign bit at bit 7) = 128 or 256, both exact: three operations, where
   * two codes through the f32 magic number 2^23 + code + 128 take five. f16: 0x6400 | (code ^ 0x80)
   * = 1024 + code + 128, minus 1152. */
  template <bool BF16>
  static WO_HD uint32_t from_bytes02(uint32_t s) {
    if (BF16)
      return wo_hsub2_bf16(wo_lop3<kWoAndOr>(s, 0x007f007fu, 0x43004300u), wo_lop3<kWoAndOr>(s, 0x00800080u, 0x43004300u));
    return wo_hadd2_f16(wo_lop3<kWoAndXor>(s, 0x00ff00ffu, 0x64806480u), 0xe480e480u);
  }

  template <bool BF16, int NW>
  static WO_HD uint32_t pair(const uint32_t (&w)[NW], int ja, int jb, const Consts &) {
    if (BF16) return from_bytes02<true>(wo_prmt(w[ja / 4], w[jb / 4], (uint32_t)(ja % 4) | ((uint32_t)(4 + jb % 4) << 8)));
    /* f16 0x6400 | u = 1024 + u (exact up to 2047), minus 1152 (0xe480) */
    uint32_t h;
    if (ja / 4 == jb / 4)
      h = wo_prmt(w[ja / 4] ^ 0x80808080u, 0x64646464u, 0x4040u | (uint32_t)(ja % 4) | ((uint32_t)(jb % 4) << 8));
    else
      h = (wo_prmt(w[ja / 4], w[jb / 4], (uint32_t)(ja % 4) | ((uint32_t)(4 + jb % 4) << 8)) & 0x00ff00ffu) ^
          0x64806480u;
    return wo_hadd2_f16(h, 0xe480e480u);
  }

  static WO_HD void values8(const uint32_t (&w)[2], const Consts &, float (&v)[8]) {
    for (int j = 0; j < 8; ++j) v[j] = to_float(w, j);
  }
};

/* Marks of NaN codes of e4m3 in a word of 4 codes: bit 7 of a byte is set iff
 * that code's magnitude bits are all ones (S.1111.111). OR the marks of many
 * words and test the result with 0x80808080. */
WO_HD uint32_t wo_e4m3_nan_marks(uint32_t word) { return (word & 0x7f7f7f7fu) + 0x01010101u; }

/* Marks of e5m2 codes with the all-ones exponent (inf, NaN), as above. */
WO_HD uint32_t wo_e5m2_special_marks(uint32_t word) { return (word & 0x7c7c7c7cu) + 0x04040404u; }

template <>
struct WoCodec<kWoE4M3, 8> {
  static constexpr int kBits = 8, kPair = 2;
  static constexpr bool kNanCodes = true, kInfNanCodes = false;
  typedef WoNoConsts Consts;

  template <bool BF16, int NW>
  static WO_HD uint32_t pair(const uint32_t (&w)[NW], int ja, int jb, const Consts &) {
    const uint32_t h = wo_place(wo_gather_top<8>(w, ja, jb), WoMagTop<8>::kValue, WoHalf<BF16>::kExpBits - 4);
    return wo_hmul2<BF16>(h, WoHalf<BF16>::pow2x2(WoHalf<BF16>::kBias - 7));
  }

  static WO_HD void values8(const uint32_t (&w)[2], const Consts &c, float (&v)[8]) {
    wo_values8_by_pairs<WoCodec, true>(w, c, v);
  }
};

template <>
struct WoCodec<kWoE5M2, 8> {
  static constexpr int kBits = 8, kPair = 2;
  static constexpr bool kNanCodes = false, kInfNanCodes = true;
  typedef WoNoConsts Consts;

  template <bool BF16, int NW>
  static WO_HD uint32_t pair(const uint32_t (&w)[NW], int ja, int jb, const Consts &) {
    const uint32_t h = wo_gather_top<8>(w, ja, jb) & 0xff00ff00u;
    if (!BF16) return h;
    const float lo = wo_f16_bits_to_float(h & 0xffffu), hi = wo_f16_bits_to_float(h >> 16);
    uint32_t ul, uh;
    memcpy(&ul, &lo, 4), memcpy(&uh, &hi, 4);
    return wo_prmt(ul, uh, 0x7632u);
  }

  static WO_HD void values8(const uint32_t (&w)[2], const Consts &c, float (&v)[8]) {
    wo_values8_by_pairs<WoCodec, false>(w, c, v);
  }
};

/* fpX with 3..7 bits, E and M known at run time. */
template <int BITS>
struct WoCodec<kWoFpX, BITS> {
  static_assert(BITS >= 3 && BITS <= 7, "fpX codes have 3..7 bits");
  static constexpr int kBits = BITS;
  /* 4-bit: codes j and j+4 share a word 16 bits apart (one shift); 6-bit: 24
   * bits apart, same offset in their bytes (byte-permute and shift); odd
   * widths: two windows merged (pairing 8 codes apart, whole bytes, would
   * save one instruction a pair but needs 16 x values per block, and the
   * registers for them push these kernels into spilling) */
  static constexpr int kPair = 4;
  static constexpr bool kNanCodes = false, kInfNanCodes = false;

  struct Consts {
    uint32_t rs;    /* right shift of the magnitude bits */
    uint32_t scale; /* 2^(bias16 - bias) in both halves */
    WO_HD Consts(int ebits, int bias, bool bf16) {
      rs = (uint32_t)((bf16 ? WoHalf<true>::kExpBits : WoHalf<false>::kExpBits) - ebits);
      scale = bf16 ? WoHalf<true>::pow2x2(WoHalf<true>::kBias - bias) : WoHalf<false>::pow2x2(WoHalf<false>::kBias - bias);
    }
  };

  template <bool BF16, int NW>
  static WO_HD uint32_t pair(const uint32_t (&w)[NW], int ja, int jb, const Consts &c) {
    return from_tops<BF16>(wo_gather_top<BITS>(w, ja, jb), c);
  }

  /* the pair of a word holding two codes with their sign bits at bits 15 and 31 */
  template <bool BF16>
  static WO_HD uint32_t from_tops(uint32_t t, const Consts &c) {
    return wo_hmul2<BF16>(wo_place(t, WoMagTop<BITS>::kValue, c.rs), c.scale);
  }

  static WO_HD void values8(const uint32_t (&w)[2], const Consts &c, float (&v)[8]) {
    wo_values8_by_pairs<WoCodec, true>(w, c, v);
  }
};

/* ---------------------------------------------------------------- f16 operands */

/* f16 operands of the large-batch weight-only GEMM (wo_gemm.cu) hold decoded codes exactly, so
 * the scale stays out of the rounded weight. Some formats span more than f16: the power of two
 * 2^shift that makes every value exact in f16 (value * 2^shift is an f16) is found here, and the
 * fp32 epilogue multiplies by 2^-shift before the scale (exact: a power of two). shift = 0 for
 * formats f16 holds (int8, fp8, fpX with E <= 4); -1 for fp6_e5m0 and fp7_e5m1, whose values
 * reach 2^16 (f16 stops at 65504); none for E = 6 (fp7_e6m0 spans 2^-30 .. 2^32, wider
 * than f16's 2^-24 .. 2^15), which then takes an fp32 GEMM. Searched over |shift| <= 40, the
 * one nearest 0 first. is_int: int8 codes, else sign/exponent/mantissa codes. */
inline bool wo_f16_shift(bool is_int, int bits, int ebits, int mbits, int bias, int specials, int *shift) {
  for (int i = 0; i <= 80; ++i) {
    const int s = (i % 2 ? 1 : -1) * ((i + 1) / 2); /* 0, -1, 1, -2, 2, ... */
    bool exact = true;
    for (uint32_t code = 0; code < (1u << bits) && exact; ++code) {
      const float v = is_int ? (float)(int8_t)(uint8_t)code : cq_float_decode(code, ebits, mbits, bias, specials);
      if (v != v) continue; /* NaN stays NaN */
      const float t = v * cq_exp2i(s); /* exact: |s| <= 40 keeps every value normal in fp32 */
      exact = cq_f16_to_f32(cq_f32_to_f16(t)) == t;
    }
    if (exact) {
      *shift = s;
      return true;
    }
  }
  return false;
}

/* ---------------------------------------------------------------- mma k-tiles */

/* The GEMV feeds mma.m16n8k16 four codes of a unit per lane and k-tile: the A
 * registers a0/a2 (and a1/a3 for the second row) hold codes (k0, k0 + P) and
 * (k2, k2 + P) of tile v, the B registers x at the same codes. mma only needs A
 * and B to agree on the order of k. Tiles of P = 1 take codes 4v .. 4v+3;
 * otherwise blocks of 2P codes are split into P/2 tiles, tile v of a block
 * taking codes 2v, 2v+1 and the same P further on. */
template <int P>
struct WoTile {
  static constexpr int kHalfP = P > 1 ? P / 2 : 1;
  static WO_HD int k0(int v) { return P == 1 ? 4 * v : 2 * P * (v / kHalfP) + 2 * (v % kHalfP); }
  static WO_HD int k2(int v) { return k0(v) + (P == 1 ? 2 : 1); }
};

/* Entries ka and kb of a run of 16-bit values stored two per word (the lower
 * index in the low half) as one word, ka in the low half. */
template <int N>
WO_HD uint32_t wo_pick2(const uint32_t (&x)[N], int ka, int kb) {
  if (ka % 2 == 0 && kb == ka + 1) return x[ka / 2];
  return wo_prmt(x[ka / 2], x[kb / 2], (ka % 2 ? 0x32u : 0x10u) | ((kb % 2 ? 0x76u : 0x54u) << 8));
}

#endif /* CQ_KERNELS_WO_DECODE_CUH */
