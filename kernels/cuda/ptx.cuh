// Small inline-PTX helpers shared by the CUDA kernels (device code only).
#pragma once
#include <cstdint>
#include <cstdio>

namespace dz::cuda::ptx {

// prmt.b32 in its default mode: selector bit 3 of a nibble replicates the sign
// (bit 7) of the selected byte; CUDA's __byte_perm documents only 3 bits.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// 2^x as one MUFU.EX2: subnormal results flush to zero (exp2f's
// ex2.approx.f32 keeps them, with more instructions around the MUFU).
__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// A float as an unsigned integer of the same order (larger floats larger
// keys), +0 and -0 one value: radix selections compare these. NaN maps
// somewhere; callers that meet NaN deal with it first.
__device__ __forceinline__ uint32_t float_order(float x) {
  const uint32_t b = __float_as_uint(x == 0.f ? 0.f : x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ uint4 ldg_nc_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// D = A(16x16, row) * B(16x8, col) + C, fp32 accumulators; fp16 inputs, or
// bf16 with kBf16. Not volatile: pure register arithmetic the compiler may
// schedule among the loads.
#define DZ_MMA_16816(T)                                \
  asm("mma.sync.aligned.m16n8k16.row.col.f32." T "." T \
      ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "   \
      "{%0,%1,%2,%3};"                                 \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))
template <bool kBf16 = false>
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  if constexpr (kBf16)
    DZ_MMA_16816("bf16");
  else
    DZ_MMA_16816("f16");
}
#undef DZ_MMA_16816

// 16-byte asynchronous copy global -> shared (L2 only): src_bytes (0 or 16)
// read and the rest zero-filled.
__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Wait until at most n of this thread's committed groups are pending.
template <int n>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(n) : "memory");
}

// Four 8x8 b16 matrices from shared memory (lane l addresses row l % 8 of
// matrix l / 8); lane l receives row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1
// of each, or with trans of each matrix's transpose.
template <bool kTrans = false>
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  if constexpr (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Shared-memory address of a generic pointer to shared memory.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// mbarrier (sm_90) in this CTA's shared memory; bar is a smem_u32 address.
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Expect bytes of transactions on the current phase without arriving.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Arrive and expect bytes of transactions in one step.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(ok)
               : "r"(bar), "r"(parity)
               : "memory");
  return ok != 0;
}

// Spin until the phase of the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

// The GPU's nanosecond clock (the same on every SM, unlike clock64).
__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Wait for the phase of the given parity; the checking form (kDebug) gives up
// after 10 s with a message naming the kernel, barrier and stage, and traps (a
// wrong transaction count or a lost arrival would otherwise hang).
template <bool kDebug>
__device__ __forceinline__ void mbar_wait_checked(uint32_t bar, uint32_t parity, const char* what, int stage,
                                                  const char* kernel = "fp8_grouped_gemm") {
  if constexpr (!kDebug) {
    mbar_wait(bar, parity);
  } else {
    auto now = [] { return globaltimer(); };
    const uint64_t t0 = now();
    while (!mbar_try_wait(bar, parity)) {
      if (now() - t0 > 10000000000ull) {
        printf("%s: block %d thread %d timed out on the %s barrier of stage %d (parity %u)\n", kernel, int(blockIdx.x),
               int(threadIdx.x), what, stage, parity);
        __trap();
      }
    }
  }
}

// Keeps the compiler from moving accesses of wgmma operands held in registers
// across an asynchronous MMA's issue or its wait: accumulators, and A
// fragments (computed before wgmma.fence, none of it sunk past it).
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(uint32_t (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
}

// wgmma shared-memory descriptor of a K-major tile stored with the 128-byte
// swizzle (rows of 128 bytes, 8-row groups 1024 bytes apart: the stride
// byte offset; base 1024-aligned, so the base-offset field stays 0; leading
// byte offset 1 by convention; swizzle mode 1 in bits 62-63), as its low word
// (start address in 16-byte units | LBO) and whole. Steps inside a tile add
// to the low word's 14-bit address field, which never carries (shared memory
// is under 256 KB): 32-bit adds, where 64-bit ones cost a carry chain and
// moves before each MMA.
// Byte b (< 128) of row r in such a tile: the 16-byte chunk b / 16 XOR-ed with r % 8.
__host__ __device__ constexpr int sw128_offset(int r, int b) {
  return r * 128 + (((b >> 4) ^ (r & 7)) << 4) + (b & 15);
}
__device__ __forceinline__ uint32_t sw128_desc_lo(uint32_t addr) { return ((addr & 0x3FFFF) >> 4) | (1u << 16); }
__device__ __forceinline__ uint64_t sw128_desc(uint32_t lo) {
  return uint64_t(lo) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// wgmma accumulator operands: registers %0..%31 / %0..%63 / %32..%47 / %64..%79
// (..%95, ..%127) / %96..%111 in an asm string, and d[b..b+7] as eight of its in/out operands.
#define DZ_WGMMA_R32                                                                                          \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31"
#define DZ_WGMMA_R64                                                                             \
  DZ_WGMMA_R32                                                                                   \
  ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, " \
  "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define DZ_WGMMA_R32_47 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define DZ_WGMMA_R96_111 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111"
#define DZ_WGMMA_R64_79 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define DZ_WGMMA_R64_95 \
  DZ_WGMMA_R64_79 ", %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define DZ_WGMMA_R64_127                                                                                             \
  DZ_WGMMA_R64_95                                                                                                    \
  ", %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, " \
  "%115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define DZ_WGMMA_ACC8(d, b)                                                                                   \
  "+f"(d[b]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), "+f"(d[b + 5]), "+f"(d[b + 6]), \
      "+f"(d[b + 7])
#define DZ_WGMMA_ACC32(d) DZ_WGMMA_ACC8(d, 0), DZ_WGMMA_ACC8(d, 8), DZ_WGMMA_ACC8(d, 16), DZ_WGMMA_ACC8(d, 24)
#define DZ_WGMMA_ACC64(d) \
  DZ_WGMMA_ACC32(d), DZ_WGMMA_ACC8(d, 32), DZ_WGMMA_ACC8(d, 40), DZ_WGMMA_ACC8(d, 48), DZ_WGMMA_ACC8(d, 56)
#define DZ_WGMMA_ACC32_AT(d, b) \
  DZ_WGMMA_ACC8(d, b), DZ_WGMMA_ACC8(d, b + 8), DZ_WGMMA_ACC8(d, b + 16), DZ_WGMMA_ACC8(d, b + 24)

// The segment holding x: the last i with starts[i] <= x, for n segments with
// non-decreasing starts (empty segments share their successor's start and
// are skipped). Grouped kernels' tiles by group, sorted rows by expert.
__device__ __forceinline__ int segment_of(const int* starts, int n, int x) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (starts[mid] <= x)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// wgmma (sm_90a): order register/shared writes before the next MMAs, close a
// group of issued MMAs, wait until none is in flight.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// ... until at most N groups are in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Tensor copy (TMA) of a 2D box at coordinates (c0, c1) into this CTA's shared
// memory, completing on an mbarrier (map: a __grid_constant__ parameter or global).
__device__ __forceinline__ void tma_2d(uint32_t dst, const void* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}
// The same for a 1D box.
__device__ __forceinline__ void tma_1d(uint32_t dst, const void* map, uint32_t bar, int c0) {
  asm volatile(
      "cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3}], [%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0)
      : "memory");
}
// The same for a 3D / 4D box (a tile-major layout's stage: coordinates inside
// the tile, the stage, the tile).
__device__ __forceinline__ void tma_3d(uint32_t dst, const void* map, uint32_t bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void tma_4d(uint32_t dst, const void* map, uint32_t bar, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// Bulk copy of bytes (a multiple of 16; both addresses 16-byte aligned) global -> shared, completing on an mbarrier.
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// Named barrier id over n threads (a multiple of 32; id 0 is __syncthreads).
__device__ __forceinline__ void named_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
// Arrive on named barrier id over n threads without waiting (the waiters use named_sync).
__device__ __forceinline__ void named_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}

}  // namespace dz::cuda::ptx
