/* Every inline-PTX wrapper of the kernels, in one place, each with the clobbers its
 * instruction needs:
 *  - "memory" on whatever reads or writes memory behind the compiler's back (cp.async and its
 *    commit/wait, ldmatrix, mbarrier, TMA, wgmma fence/commit/wait, named barriers, fences),
 *    so ordinary loads and stores are not moved across them;
 *  - none on pure register operations (mma, ex2, register fences).
 * Wrappers of sm_90a-only instructions (wgmma, setmaxnreg, TMA, mbarrier waits and tx counts)
 * exist only in the sm_90a device pass (CQ_SM90A_DEVICE, arch.cuh): every other pass (sm_80,
 * sm_89, the portable compute_90 PTX, the host) never sees them, so the kernels that use them
 * must guard their bodies the same way. */
#ifndef CQ_KERNELS_PTX_CUH
#define CQ_KERNELS_PTX_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "arch.cuh"

/* ---------------------------------------------------------------- shared memory, cp.async */

__device__ __forceinline__ uint32_t cq_smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* Loads from a shared-memory address. Volatile, so they stay after the barrier wait that makes
 * the data valid; an address of a register plus a warp-uniform offset becomes one [R+UR] operand. */
__device__ __forceinline__ uint32_t cq_lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ uint2 cq_lds64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ float cq_ldsf(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void cq_sts128(uint32_t addr, float4 v) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}

/* Thread-block clusters (sm_90). cq_mapa: the address in the cluster's CTA `rank` of this CTA's
 * shared-memory address addr; cq_ld_cluster128 reads 16 bytes there. cq_cluster_sync: every
 * non-exited thread of the cluster arrives, then waits for the others (release / acquire: shared
 * memory written before it is seen after it, from any CTA of the cluster). */
__device__ __forceinline__ uint32_t cq_mapa(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ float4 cq_ld_cluster128(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ void cq_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

/* 16 bytes global -> shared (L2 only); with bytes = 0 the 16 bytes are zero-filled and nothing
 * is read (src must still be a valid address). */
__device__ __forceinline__ void cq_cp_async16_n(uint32_t dst, const void *src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cq_cp_async16(uint32_t dst, const void *src, bool valid) {
  cq_cp_async16_n(dst, src, valid ? 16 : 0);
}
__device__ __forceinline__ void cq_cp_async16(void *dst, const void *src, bool valid) {
  cq_cp_async16_n(cq_smem_addr(dst), src, valid ? 16 : 0);
}
/* The same with a hint to fetch whole 128-byte L2 lines (streams read once, in order). */
__device__ __forceinline__ void cq_cp_async16_l2_128(uint32_t dst, const void *src, bool valid) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
/* 4 bytes global -> shared (through L1), zero-filled when !valid (src must still be a valid address). */
__device__ __forceinline__ void cq_cp_async4(uint32_t dst, const void *src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0) : "memory");
}
__device__ __forceinline__ void cq_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
/* Wait until at most N of this thread's committed groups are pending (their bytes have landed). */
template <int N> __device__ __forceinline__ void cq_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* ---------------------------------------------------------------- global loads */

/* A load issued where it stands, a prefetch into registers a loop iteration ahead: ld.volatile,
 * which the compiler keeps in program order (an ld.global.nc is sunk next to its first use). It
 * reads through L2, not L1. */
__device__ __forceinline__ float cq_ldg_f32_here(const float *p) {
  float v;
  asm volatile("ld.volatile.global.f32 %0, [%1];\n" : "=f"(v) : "l"(p) : "memory");
  return v;
}

/* Streaming read-only loads, predicated (zeros when !pred) rather than branched around.
 * KEEP_L1: the sector is read by several instructions of a warp, keep it in L1; otherwise
 * keep the stream out of L1. */
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

/* ---------------------------------------------------------------- ldmatrix */

__device__ __forceinline__ void cq_ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void cq_ldsm_x4(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3, const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(cq_smem_addr(p))
               : "memory");
}
__device__ __forceinline__ void cq_ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

/* ---------------------------------------------------------------- mma.sync */

/* D += A B, m16n8k16, 16-bit A and B (bf16 when BF16, else fp16), fp32 D. */
template <bool BF16>
__device__ __forceinline__ void cq_mma_16816_f32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (BF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}
/* The same, the 16-bit type given as T (__nv_bfloat16 or __half). */
template <typename T>
__device__ __forceinline__ void cq_mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  cq_mma_16816_f32<std::is_same<T, __nv_bfloat16>::value>(d, a, b0, b1);
}

/* D += A B, m16n8k32, int8 A and B, int32 D (sm_80+). */
__device__ __forceinline__ void cq_mma_s8_16832(int32_t (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* D += A B, m16n8k32, u8 A and int8 B, int32 D (sm_80+). */
__device__ __forceinline__ void cq_mma_u8s8_16832(int32_t (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* D += A B, m16n8k32, fp8 A (e4m3 when A_E4M3, else e5m2) and B, fp32 D (sm_89+; launchers
 * check the capability, and passes for older arches trap). */
template <bool A_E4M3, bool B_E4M3>
__device__ __forceinline__ void cq_mma_f8_16832(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= CQ_CC_FP8_MMA * 10
#define CQ_MMA_F8(A, B)                                                                                          \
  asm("mma.sync.aligned.m16n8k32.row.col.f32." A "." B ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "      \
               "{%8, %9}, {%0, %1, %2, %3};\n"                                                                   \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                                  \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
  if constexpr (A_E4M3 && B_E4M3) CQ_MMA_F8("e4m3", "e4m3");
  else if constexpr (A_E4M3) CQ_MMA_F8("e4m3", "e5m2");
  else if constexpr (B_E4M3) CQ_MMA_F8("e5m2", "e4m3");
  else CQ_MMA_F8("e5m2", "e5m2");
#undef CQ_MMA_F8
#else
  (void)d, (void)a, (void)b0, (void)b1;
  __trap();
#endif
}

/* ---------------------------------------------------------------- special functions */

/* 2^x with the SFU (relative error ~2 ulp; 2^-inf = 0; subnormal results flush to 0). */
__device__ __forceinline__ float cq_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

/* ---------------------------------------------------------------- barriers */

/* Named barriers 1..15 over `threads` threads of the block (barrier 0 is __syncthreads). */
__device__ __forceinline__ void cq_bar_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
/* bar.sync that also returns whether v holds for every one of the `threads` threads. */
__device__ __forceinline__ bool cq_bar_sync_and(uint32_t id, uint32_t threads, bool v) {
  uint32_t r;
  asm volatile("{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.and.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}\n"
               : "=r"(r)
               : "r"((uint32_t)v), "r"(id), "r"(threads)
               : "memory");
  return r != 0;
}
__device__ __forceinline__ void cq_bar_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

/* A global word read with acquire semantics at GPU scope (a flag other CTAs release). */
__device__ __forceinline__ unsigned cq_ld_acquire_gpu(const unsigned *p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

/* Pin registers at this point of the instruction stream: their reads and writes may not move
 * across it (around asynchronous wgmma, which reads and writes them behind the compiler's back). */
template <int N> __device__ __forceinline__ void cq_fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N> __device__ __forceinline__ void cq_fence_regs(int32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
template <int N> __device__ __forceinline__ void cq_fence_regs(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
/* The same for one value (an address kept through a loop rather than rebuilt in each iteration). */
__device__ __forceinline__ void cq_fence_reg(uint32_t &r) { asm volatile("" : "+r"(r)::"memory"); }
__device__ __forceinline__ void cq_fence_reg(uint64_t &r) { asm volatile("" : "+l"(r)::"memory"); }

/* ---------------------------------------------------------------- sm_90a only */

#ifdef CQ_SM90A_DEVICE

/* mbarriers at a shared-memory address. Arrive has release, a completed wait acquire semantics
 * at CTA scope: writes before an arrive are visible after the phase's wait. */
__device__ __forceinline__ void cq_mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
/* Make the barriers' initialisation visible to the async proxy (TMA) and the cluster. */
__device__ __forceinline__ void cq_mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void cq_mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
/* Arrive and announce `bytes` of transactions (TMA completes them). */
__device__ __forceinline__ void cq_mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}
/* Wait until the phase of parity `parity` has completed (parity 1 of a fresh barrier counts
 * as completed, so a producer's first wait on an empty slot returns at once). */
__device__ __forceinline__ void cq_mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
  } while (!done);
}

/* Generic-proxy writes to shared memory (cp.async, st.shared) made visible to the async proxy
 * (wgmma, TMA) of this CTA. */
__device__ __forceinline__ void cq_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

/* TMA: the box at (inner coordinate c0, outer coordinate c1) of a tensor map into shared
 * memory at dst, completing `bar`'s transactions. */
__device__ __forceinline__ void cq_tma_load_2d(uint32_t dst, const void *map, uint32_t bar, int32_t c0, int32_t c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

/* TMA: the box at coordinates (c0 innermost, c1, c2) of a 3-d tensor map into shared memory at
 * dst, completing `bar`'s transactions. */
__device__ __forceinline__ void cq_tma_load_3d(uint32_t dst, const void *map, uint32_t bar, int32_t c0, int32_t c1,
                                               int32_t c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
/* TMA: the box at coordinates (c0 innermost .. c3) of a 4-d tensor map into shared memory at
 * dst, completing `bar`'s transactions. */
__device__ __forceinline__ void cq_tma_load_4d(uint32_t dst, const void *map, uint32_t bar, int32_t c0, int32_t c1,
                                               int32_t c2, int32_t c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
/* TMA store of the box at (c0 .. c3) from shared memory at src (elements past the tensor are
 * not written), in this thread's bulk group. */
__device__ __forceinline__ void cq_tma_store_4d(const void *map, uint32_t src, int32_t c0, int32_t c1, int32_t c2,
                                                int32_t c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}
/* TMA store of the box at (c0, c1) from shared memory at src (elements past the tensor are not
 * written), in this thread's bulk group. */
__device__ __forceinline__ void cq_tma_store_2d(const void *map, uint32_t src, int32_t c0, int32_t c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1)
               : "memory");
}
__device__ __forceinline__ void cq_bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
/* Wait until this thread's bulk stores have read their shared memory (it may then be reused or
 * the CTA end). */
__device__ __forceinline__ void cq_bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
/* The same for all but this thread's N most recent bulk groups. */
template <int N> __device__ __forceinline__ void cq_bulk_wait_read_but() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}

/* Four 8 x 8 matrices of 16-bit values, each in the mma fragment layout (register i of lane l:
 * row l / 4, columns 2 (l % 4) and + 1 of matrix i), stored transposed: lanes 8i .. 8i + 7 give
 * the addresses of matrix i's 8 stored rows (16 bytes each), stored row c holding its column c. */
__device__ __forceinline__ void cq_stmatrix_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

__device__ __forceinline__ void cq_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cq_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cq_wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/* Hand registers between warpgroups (every warp of a warpgroup executes these). */
template <int N> __device__ __forceinline__ void cq_setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void cq_setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

#endif /* CQ_SM90A_DEVICE */

#endif /* CQ_KERNELS_PTX_CUH */
