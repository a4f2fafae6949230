/* The persistent weight-only GEMV (gemv_wo.cuh).
 *
 * One CTA per SM runs until the weight is read. Its warps form groups of kw
 * warps (kw = min(16, quads)); a group owns row tiles gid, gid + groups, ...
 * and walks the (tile, quad) items of its tiles in order, warp w of the group
 * taking items w, w + kw, ... (kw <= quads, so every warp has an item in every
 * tile and the quads of a tile differ by at most one between warps). A warp
 * copies each item -- 16 rows x one quad, 64-224 contiguous bytes a row --
 * into its own shared-memory ring with 16-byte cp.async, kStages - 1 items
 * ahead of the one it decodes, across tile boundaries: the loads hold no
 * registers and keep streaming through the per-tile reduction. A tile's
 * partial sums meet in shared memory (double buffered, one group barrier a
 * tile) and are added in warp order, as in the per-tile kernel.
 *
 * It is built for the sm_90a pass only (the device where it was measured to win; every other pass
 * compiles an empty body that the dispatch never selects), for bf16 and f16 x (split x takes the
 * per-tile kernel) and for every decoder but fp4's (which the per-tile kernel serves faster). */
#include "gemv_wo.cuh"

namespace cq_wo {
namespace {

constexpr int kStreamThreads = 32 * kStreamWarps;
constexpr int kStreamLaneBytes = 128; /* weight bytes a lane keeps in flight, at least */
constexpr int kStreamPerWarp = 8 * 32; /* accumulator floats of a warp */

template <int BITS>
struct StreamItem {
  using U = WoUnit<BITS>;
  static constexpr int kSegBytes = 4 * U::kBytes;      /* one row's bytes of an item */
  static constexpr int kSegVecs = kSegBytes / 16;
  static constexpr int kBytes = 16 * kSegBytes;        /* a ring slot: 16 rows, kSegBytes apart */
  static constexpr int kVecsPerLane = kBytes / 16 / 32;
  static constexpr int kStages = 1 + (kStreamLaneBytes + 2 * U::kBytes - 1) / (2 * U::kBytes);
  static_assert(kSegBytes % 16 == 0 && kVecsPerLane * 32 * 16 == kBytes, "items are whole 16-byte vectors per lane");
};

/* Shared memory of the persistent kernel: the rings, then (kw > 1) the
 * partial sums and NaN marks, two buffers each. */
template <int BITS>
constexpr size_t stream_smem_bytes(int warps, int kw) {
  return (size_t)warps * StreamItem<BITS>::kStages * StreamItem<BITS>::kBytes +
         (kw > 1 ? (size_t)2 * warps * (kStreamPerWarp + 16) * 4 : 0);
}


/* Unit c of slot row `row` (see StreamItem) as words. The rows of a slot are
 * 4 units apart: 64 or 192 bytes (even widths, 16-byte reads by quarter warps)
 * and 32 * BITS bytes (odd widths, 8-byte reads by half warps) put the lanes
 * of one read on distinct banks. */
template <int BITS>
__device__ __forceinline__ void ring_unit(const unsigned char *slot, int row, int c,
                                          uint32_t (&w)[WoUnit<BITS>::kWords]) {
  using U = WoUnit<BITS>;
  const unsigned char *p = slot + row * (4 * U::kBytes) + c * U::kBytes;
#pragma unroll
  for (int v = 0; v < U::kVecs; ++v) {
    if (U::kVecBytes == 16) {
      const uint4 q = *reinterpret_cast<const uint4 *>(p + 16 * v);
      w[4 * v] = q.x, w[4 * v + 1] = q.y, w[4 * v + 2] = q.z, w[4 * v + 3] = q.w;
    } else {
      const uint2 q = *reinterpret_cast<const uint2 *>(p + 8 * v);
      w[2 * v] = q.x, w[2 * v + 1] = q.y;
    }
  }
}

template <class Codec, int XM>
__global__ void __launch_bounds__(kStreamThreads, 1) gemv_wo_stream_kernel(const GemvWoArgs a) {
#ifdef CQ_SM90A_DEVICE
  using U = WoUnit<Codec::kBits>;
  using I = StreamItem<Codec::kBits>;
  constexpr int S = I::kStages;
  extern __shared__ __align__(16) unsigned char gemv_smem[];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int kw = a.kw, grp = warp / kw, wg = warp - grp * kw;
  const int64_t ngroups = (int64_t)gridDim.x * a.groups, gid = (int64_t)blockIdx.x * a.groups + grp;
  const int64_t tiles = (a.n + 15) / 16;
  const int64_t my_tiles = gid < tiles ? (tiles - 1 - gid) / ngroups + 1 : 0;
  const int64_t group_items = my_tiles * a.quads;
  const int64_t my_items = group_items > wg ? (group_items - 1 - wg) / kw + 1 : 0;

  unsigned char *ring = gemv_smem + (size_t)warp * S * I::kBytes;
  const uint32_t ring_s = (uint32_t)__cvta_generic_to_shared(ring);
  float *partial = reinterpret_cast<float *>(gemv_smem + (size_t)warps * S * I::kBytes); /* [2][warps][256] */
  uint32_t *nan_rows = reinterpret_cast<uint32_t *>(partial + 2 * warps * kStreamPerWarp); /* [2][warps][16] */

  const GemvLane L = gemv_lane(a, g);
  const typename Codec::Consts cc(a.fmt.ebits, a.fmt.bias, XTraits<XM>::kBf16);
  float acc[2][4];
#pragma unroll
  for (int nb = 0; nb < 2; ++nb) acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.0f;
  uint32_t nan_marks[2] = {0u, 0u};

  /* the next item of this warp: tile j of the group, quad seg */
  auto advance = [&](int64_t &j, int &seg) {
    seg += kw;
    if (seg >= a.quads) seg -= a.quads, ++j;
  };
  /* copy item (j, seg) into ring slot `slot`; an empty group when !valid keeps the count */
  auto issue = [&](int slot, bool valid, int64_t j, int seg) {
    if (valid) {
      const int64_t n0 = (gid + j * ngroups) * 16;
      const int64_t seg0 = (int64_t)seg * I::kSegBytes;
#pragma unroll
      for (int v = 0; v < I::kVecsPerLane; ++v) {
        const int vi = lane + 32 * v;
        const int r = vi / I::kSegVecs, col = vi - r * I::kSegVecs;
        const int64_t row = n0 + r, off = seg0 + 16 * col;
        const bool ok = row < a.n && off < a.row_bytes;
        cq_cp_async16_l2_128(ring_s + (uint32_t)(slot * I::kBytes + 16 * vi), ok ? a.w + row * a.row_bytes + off : a.w, ok);
      }
    }
    cq_cp_async_commit();
  };
  /* tile j of the group is complete in every warp: add the warps' sums in order and store */
  auto flush = [&](int64_t j) {
    const int64_t n0 = (gid + j * ngroups) * 16;
    uint32_t m0 = 0u, m1 = 0u;
    if (Codec::kNanCodes) {
      m0 = nan_marks[0] & 0x80808080u, m1 = nan_marks[1] & 0x80808080u;
#pragma unroll
      for (int o = 1; o < 4; o <<= 1) {
        m0 |= __shfl_xor_sync(0xffffffffu, m0, o);
        m1 |= __shfl_xor_sync(0xffffffffu, m1, o);
      }
    }
    if (kw == 1) {
      /* accumulator element i of tile nb: row g (+8 for i >= 2), x row 8nb + 2c + (i & 1) */
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int nb = e >> 2, i = e & 3;
        const int64_t n = n0 + g + ((i & 2) ? 8 : 0), m = 8 * nb + 2 * c + (i & 1);
        if (n >= a.n || m >= a.m) continue;
        float sum = 0.0f + acc[nb][i];
        if (Codec::kNanCodes && ((i & 2) ? m1 : m0)) sum = __uint_as_float(0x7fc00000u);
        gemv_store(a, m, n, sum);
      }
    } else {
      const int buf = (int)(j & 1);
      float *mine = partial + ((size_t)buf * warps + warp) * kStreamPerWarp;
#pragma unroll
      for (int e = 0; e < 8; ++e) mine[e * 32 + lane] = acc[e >> 2][e & 3];
      if (Codec::kNanCodes && c == 0)
        nan_rows[(buf * warps + warp) * 16 + g] = m0, nan_rows[(buf * warps + warp) * 16 + g + 8] = m1;
      /* the group's warps only (barrier 0 is __syncthreads) */
      cq_bar_sync(1 + grp, 32 * kw);
      const float *part0 = partial + ((size_t)buf * warps + grp * kw) * kStreamPerWarp;
      const uint32_t *nan0 = nan_rows + (buf * warps + grp * kw) * 16;
      const int entries = L.two ? kStreamPerWarp : kStreamPerWarp / 2;
      for (int v = wg * 32 + lane; v < entries; v += 32 * kw) {
        const int e = v >> 5, ln = v & 31, nb = e >> 2, i = e & 3;
        const int r16 = (ln >> 2) + ((i & 2) ? 8 : 0);
        const int64_t n = n0 + r16, m = 8 * nb + 2 * (ln & 3) + (i & 1);
        if (n >= a.n || m >= a.m) continue;
        float sum = 0.0f;
#pragma unroll
        for (int s = 0; s < kStreamWarps; ++s)
          if (s < kw) sum += part0[s * kStreamPerWarp + v];
        if (Codec::kNanCodes) {
          uint32_t any = 0u;
#pragma unroll
          for (int s = 0; s < kStreamWarps; ++s)
            if (s < kw) any |= nan0[s * 16 + r16];
          if (any) sum = __uint_as_float(0x7fc00000u); /* decode(NaN code) * x is NaN for every x */
        }
        gemv_store(a, m, n, sum);
      }
    }
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.0f;
    nan_marks[0] = nan_marks[1] = 0u;
  };

  int64_t ld_i = 0, ld_j = 0;
  int ld_seg = wg;
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    issue(s, ld_i < my_items, ld_j, ld_seg);
    advance(ld_j, ld_seg), ++ld_i;
  }
  int64_t cj = 0;
  int cseg = wg, slot = 0;
  for (int64_t i = 0; i < my_items; ++i) {
    cq_cp_async_wait<S - 2>(); /* this lane's copies of item i have landed */
    __syncwarp();           /* ... and every lane's; the slot refilled below was read by all */
    uint32_t w0[U::kWords], w1[U::kWords];
    ring_unit<Codec::kBits>(ring + slot * I::kBytes, g, c, w0);
    ring_unit<Codec::kBits>(ring + slot * I::kBytes, g + 8, c, w1);
    issue(slot == 0 ? S - 1 : slot - 1, ld_i < my_items, ld_j, ld_seg);
    advance(ld_j, ld_seg), ++ld_i;
    gemv_unit<Codec, XM>(w0, w1, a, L, cc, c, cseg, acc, nan_marks);
    int64_t nj = cj;
    advance(nj, cseg);
    const int64_t next_tile = i + 1 < my_items ? nj : my_tiles;
    while (cj < next_tile) flush(cj++);
    slot = slot + 1 == S ? 0 : slot + 1;
  }
  while (cj < my_tiles) flush(cj++); /* (no warp gets here with tiles left: each has an item in every tile) */
  cq_cp_async_wait<0>();
#else
  (void)a;
  __trap(); /* not built for sm_90a: the dispatch never selects this kernel then */
#endif
}

template <class Codec, int XM>
cq_status launch_gemv_stream(const GemvWoArgs &a, unsigned grid, cudaStream_t s) {
  const int warps = a.kw * a.groups;
  const size_t smem = stream_smem_bytes<Codec::kBits>(warps, a.kw);
  auto kernel = gemv_wo_stream_kernel<Codec, XM>;
  CQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  kernel<<<grid, 32 * warps, smem, s>>>(a);
  CQ_LAUNCH_CHECK(gemv_wo_stream_kernel);
  return CQ_OK;
}


/* [decoder][x mode], bf16 and f16 x; none for fp4 */
#define CQ_GEMV_CODEC(C) { launch_gemv_stream<C, kXBf16>, launch_gemv_stream<C, kXF16> }
const GemvLauncher kLaunchers[kCodecs][2] = {
    CQ_GEMV_CODEC(CodecInt8), CQ_GEMV_CODEC(CodecE4M3), CQ_GEMV_CODEC(CodecE5M2), CQ_GEMV_CODEC(CodecFp3),
    {nullptr, nullptr},       CQ_GEMV_CODEC(CodecFp5),  CQ_GEMV_CODEC(CodecFp6),  CQ_GEMV_CODEC(CodecFp7),
};
#undef CQ_GEMV_CODEC

}  // namespace

bool gemv_persistent_built(int codec, int xmode) {
  return (xmode == kXBf16 || xmode == kXF16) && codec >= 0 && codec < kCodecs && kLaunchers[codec][xmode] != nullptr;
}

cq_status gemv_persistent_launch(int codec, int xmode, const GemvWoArgs &a, unsigned grid, cudaStream_t s) {
  if (!gemv_persistent_built(codec, xmode))
    return cq_fail(CQ_ERR_INTERNAL, "gemv: no persistent kernel for decoder %d, x mode %d", codec, xmode);
  return kLaunchers[codec][xmode](a, grid, s);
}

size_t gemv_persistent_smem(int bits, int warps, int kw) {
  switch (bits) {
    case 3: return stream_smem_bytes<3>(warps, kw);
    case 4: return stream_smem_bytes<4>(warps, kw);
    case 5: return stream_smem_bytes<5>(warps, kw);
    case 6: return stream_smem_bytes<6>(warps, kw);
    case 7: return stream_smem_bytes<7>(warps, kw);
    default: return stream_smem_bytes<8>(warps, kw);
  }
}

}  // namespace cq_wo
