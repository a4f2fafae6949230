/* Stored weight rows of the weight-only formats, read in "units": the
 * shortest run of 16-byte vectors (8-byte for odd bit widths) that holds a
 * whole number of codes, a multiple of 16 (8-bit: 1 x 16 bytes = 16 codes,
 * 4-bit: 1 x 16 = 32, 6-bit: 3 x 16 = 64, 3/5/7-bit: 3/5/7 x 8 = 64). A unit
 * is decoded with compile-time bit positions, so no code straddles two
 * threads' data and no position is computed at run time. Rows are padded to
 * 16 bytes, so every vector of a unit is aligned. Shared by the GEMV and the
 * dequantize-rows kernels (gemv_wo.cu). */
#ifndef CQ_KERNELS_WO_UNIT_CUH
#define CQ_KERNELS_WO_UNIT_CUH

#include "common.cuh"

template <int BITS>
struct WoUnit {
  static_assert(BITS >= 1 && BITS <= 8, "codes of 1..8 bits");
  static constexpr int kVecBytes = (BITS % 2) ? 8 : 16;
  static constexpr int kVecs = (BITS % 2) ? BITS : (BITS == 6 ? 3 : 1);
  static constexpr int kBytes = kVecBytes * kVecs;
  static constexpr int kWords = kBytes / 4;
  static constexpr int kCodes = 8 * kBytes / BITS;
  /* Codes of up to 4 bits are looked up two at a time (a 6- or 8-bit index). */
  static constexpr bool kPairIndex = BITS <= 4;
  static constexpr int kIndexBits = kPairIndex ? 2 * BITS : BITS;
  static_assert(kCodes % 16 == 0, "a unit holds whole groups of 16 codes");
};

/* Weight bytes are read once: keep them out of L1. */
__device__ __forceinline__ uint4 cq_load_stream16(const void *p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint2 cq_load_stream8(const void *p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

/* Unit `unit` of a stored row of `row_bytes` bytes, as little-endian words.
 * Bytes past the row end read as zero (code 0 decodes to 0 in every format).
 * vec: the row starts on a 16-byte boundary and row_bytes is a multiple of 16. */
template <int BITS>
__device__ __forceinline__ void cq_load_unit(const uint8_t *row, int64_t unit, int64_t row_bytes, bool vec,
                                             uint32_t (&w)[WoUnit<BITS>::kWords]) {
  using U = WoUnit<BITS>;
  const int64_t first = unit * U::kBytes;
  if (vec) {
#pragma unroll
    for (int v = 0; v < U::kVecs; ++v) {
      const int64_t off = first + U::kVecBytes * v;
      if (U::kVecBytes == 16) {
        uint4 q = make_uint4(0u, 0u, 0u, 0u);
        if (row && off < row_bytes) q = cq_load_stream16(row + off);
        w[4 * v] = q.x, w[4 * v + 1] = q.y, w[4 * v + 2] = q.z, w[4 * v + 3] = q.w;
      } else {
        uint2 q = make_uint2(0u, 0u);
        if (row && off < row_bytes) q = cq_load_stream8(row + off);
        w[2 * v] = q.x, w[2 * v + 1] = q.y;
      }
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < U::kWords; ++i) {
    uint32_t word = 0;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const int64_t off = first + 4 * i + b;
      if (row && off < row_bytes) word |= (uint32_t)__ldg(row + off) << (8 * b);
    }
    w[i] = word;
  }
}

/* The `width`-bit field at bit `pos` of a unit, shifted left by `sh`. With
 * pos, width and sh compile-time constants (unrolled loops) this is one shift
 * or funnel shift and one mask. */
template <int NWORDS>
__device__ __forceinline__ uint32_t cq_unit_field(const uint32_t (&w)[NWORDS], int pos, int width, int sh) {
  const int i = pos >> 5, s = pos & 31;
  const uint32_t mask = ((1u << width) - 1u) << sh;
  if (s < sh) return (w[i] << (sh - s)) & mask; /* the field lies in word i */
  const uint32_t hi = i + 1 < NWORDS ? w[i + 1] : 0u;
  return __funnelshift_r(w[i], hi, s - sh) & mask;
}

#endif /* CQ_KERNELS_WO_UNIT_CUH */
