/* Streaming loads of stored weight rows for the weight-only kernels
 * (gemv_wo.cu): whole units of a row (WoUnit, wo_decode.cuh) for the GEMV and
 * 8-code octets for the row decoder. */
#ifndef CQ_KERNELS_WO_UNIT_CUH
#define CQ_KERNELS_WO_UNIT_CUH

#include "common.cuh"
#include "wo_decode.cuh"

/* Weight bytes are read once. KEEP_L1: the loads of one warp touch each 32-byte
 * sector in several instructions (units longer than one vector, whose lanes
 * sit 24..112 bytes apart), so the sector should stay in L1 between them;
 * otherwise keep the stream out of L1 (x lives there). The loads are
 * predicated (zeros when `pred` is false) rather than branched around. */
template <bool KEEP_L1>
__device__ __forceinline__ uint4 cq_load_stream16(const void *p, bool pred) {
  uint4 v;
  if (KEEP_L1)
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n"
        " mov.b32 %3, 0;\n @p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n}"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "r"((int)pred));
  else
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n"
        " mov.b32 %3, 0;\n @p ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n}"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "r"((int)pred));
  return v;
}

template <bool KEEP_L1>
__device__ __forceinline__ uint2 cq_load_stream8(const void *p, bool pred) {
  uint2 v;
  if (KEEP_L1)
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %3, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n"
        " @p ld.global.nc.v2.u32 {%0, %1}, [%2];\n}"
        : "=r"(v.x), "=r"(v.y)
        : "l"(p), "r"((int)pred));
  else
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %3, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n"
        " @p ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];\n}"
        : "=r"(v.x), "=r"(v.y)
        : "l"(p), "r"((int)pred));
  return v;
}

/* Unit `unit` of a stored row of `row_bytes` bytes, as little-endian words.
 * Bytes past the row end read as zero (code 0 decodes to 0 in every format).
 * vec: the row starts on a 16-byte boundary and row_bytes is a multiple of 16. */
template <int BITS>
__device__ __forceinline__ void cq_load_unit(const uint8_t *row, int64_t unit, int64_t row_bytes, bool vec,
                                             uint32_t (&w)[WoUnit<BITS>::kWords]) {
  using U = WoUnit<BITS>;
  constexpr bool kKeepL1 = U::kVecs > 1;
  const int64_t first = unit * U::kBytes, rem64 = row ? row_bytes - first : 0;
  const int rem = rem64 < 0 ? 0 : rem64 > U::kBytes ? U::kBytes : (int)rem64; /* bytes of the unit in the row */
  if (vec) {
#pragma unroll
    for (int v = 0; v < U::kVecs; ++v) {
      const int64_t off = first + U::kVecBytes * v;
      const bool in_row = U::kVecBytes * v < rem;
      if (U::kVecBytes == 16) {
        const uint4 q = cq_load_stream16<kKeepL1>(row + off, in_row);
        w[4 * v] = q.x, w[4 * v + 1] = q.y, w[4 * v + 2] = q.z, w[4 * v + 3] = q.w;
      } else {
        const uint2 q = cq_load_stream8<kKeepL1>(row + off, in_row);
        w[2 * v] = q.x, w[2 * v + 1] = q.y;
      }
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < U::kWords; ++i) {
    uint32_t word = 0;
#pragma unroll
    for (int b = 0; b < 4; ++b)
      if (4 * i + b < rem) word |= (uint32_t)__ldg(row + first + 4 * i + b) << (8 * b);
    w[i] = word;
  }
}

/* Octet o of a stored row (codes 8o .. 8o+7: BITS bytes from byte BITS*o) in
 * the low bytes of w; bytes past the octet are junk, bytes past the row zero.
 * vec8: the row starts on an 8-byte boundary and row_bytes is a multiple of 8.
 * Neighbouring lanes read overlapping 8-byte words, so the words stay in L1. */
template <int BITS>
__device__ __forceinline__ void cq_load_octet(const uint8_t *row, int64_t o, int64_t row_bytes, bool vec8,
                                              uint32_t (&w)[2]) {
  const int64_t first = (int64_t)BITS * o;
  if (vec8) {
    if (BITS == 8) { /* whole aligned words */
      const uint2 q = cq_load_stream8<true>(row + first, true);
      w[0] = q.x, w[1] = q.y;
    } else if (BITS == 4) {
      w[0] = __ldg(reinterpret_cast<const unsigned int *>(row + first)), w[1] = 0u;
    } else {
      const int64_t base = first & ~(int64_t)7;
      const int d = (int)(first & 7);
      uint2 lo = cq_load_stream8<true>(row + base, true);
      uint2 hi = cq_load_stream8<true>(row + base + 8, d + BITS > 8 && base + 8 < row_bytes);
      if (d >= 4) lo.x = lo.y, lo.y = hi.x, hi.x = hi.y;
      const int s = 8 * (d & 3);
      w[0] = __funnelshift_r(lo.x, lo.y, s), w[1] = __funnelshift_r(lo.y, hi.x, s);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    uint32_t word = 0;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const int64_t off = first + 4 * i + b;
      if (4 * i + b < BITS && off < row_bytes) word |= (uint32_t)__ldg(row + off) << (8 * b);
    }
    w[i] = word;
  }
}

/* The `width`-bit field at bit `pos` of a unit. With pos and width
 * compile-time constants (unrolled loops) this is one shift or funnel shift
 * and one mask. */
template <int NWORDS>
__device__ __forceinline__ uint32_t cq_unit_field(const uint32_t (&w)[NWORDS], int pos, int width) {
  const int i = pos >> 5, s = pos & 31;
  const uint32_t hi = i + 1 < NWORDS ? w[i + 1] : 0u;
  return __funnelshift_r(w[i], hi, s) & ((1u << width) - 1u);
}

#endif /* CQ_KERNELS_WO_UNIT_CUH */
