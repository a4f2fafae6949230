/* Streaming loads of stored weight rows for the weight-only kernels
 * (gemv_wo.cuh): whole units of a row (WoUnit, wo_decode.cuh) for the GEMV and
 * 8-code octets for the row decoder. */
#ifndef CQ_KERNELS_WO_UNIT_CUH
#define CQ_KERNELS_WO_UNIT_CUH

#include "common.cuh"
#include "ptx.cuh"
#include "wo_decode.cuh"

/* Unit `unit` of a stored row of `row_bytes` bytes, as little-endian words.
 * Bytes past the row end read as zero (code 0 decodes to 0 in every format).
 * vec: the row starts on a 16-byte boundary and row_bytes is a multiple of 16.
 * Weight bytes are read once (cq_load_stream16/8, ptx.cuh). Units longer than one vector keep
 * their sectors in L1: a warp touches each 32-byte sector in several instructions there (lanes
 * 24..112 bytes apart); other loads keep the stream out of L1, where x lives. */
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
