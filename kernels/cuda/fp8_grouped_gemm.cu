#include <cuda.h>  // CUtensorMap and its enums only: the encoder comes through the runtime's entry-point query
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "cuda/fp8_grouped_gemm.h"
#include "cuda/mxfp4_fold.cuh"
#include "cuda/ptx.cuh"
#include "runtime/cuda/cuda_check.h"

// wgmma and setmaxnreg exist only in the sm_90a target; elsewhere the kernel
// body is empty and the host refuses to launch it (Fp8GroupedGemm::supported).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DZ_GG_SM90A 1
#endif

namespace dz::cuda {
namespace {

constexpr int kBM = 128;  // rows of a block tile: two consumer warpgroups of 64
constexpr int kBK = 128;  // K per stage: one scale block, one 128-byte swizzle row per tile row
// Columns of a block tile (the wgmma n): 192 with FP8 weights (gpt-oss's 5760
// and 2880 are 30 and 15 of them; a K block's fixed cost in a consumer, its
// barrier, descriptors and scale loads, serves 1.5x the MMAs of n128), 128 with
// MXFP4 weights (one producer thread folds each W tile row) and in the FP8
// kernel's narrow form (kN128: 128 registers a thread at launch and 164 KB of
// shared memory, so that a block of the folding kernel fits on each SM beside
// it and the next workspace tile is folded while this one's GEMMs run).
template <bool kW4, bool kN128 = false>
constexpr int kBN = kW4 || kN128 ? 128 : 192;
constexpr int kStages = 5;  // FP8 weights: stages of the copy-engine ring
constexpr int kConsumers = 2;
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kABytes = kBM * kBK;
template <bool kW4, bool kN128 = false>
constexpr int kBBytes = kBN<kW4, kN128>* kBK;
template <bool kW4, bool kN128 = false>
constexpr int kSBytes = kBN<kW4, kN128> * 4;
template <bool kN128>
constexpr int kTxBytes = kABytes + kBBytes<false, kN128> +
                         kSBytes<false, kN128>;  // full boxes: the copy engine counts zero-filled bytes too
// The narrow form's registers: launch bounds of 512 threads cap them at 128
// (ptxas gave 128 under a cap of 136 too); the producer gives back down to 40
// and the consumers take 168 (64 accumulators and 64 partial sums: no spills),
// the same total. Beside it: 65536 - 384 x 128 = 16,384 registers, more than
// a folding block's 256 x 48.
constexpr int kNarrowBound = 512, kNarrowLaunchRegs = 128, kNarrowConsumerRegs = 168;
static_assert((65536 / kNarrowBound) / 8 * 8 == kNarrowLaunchRegs, "narrow launch registers");
static_assert(128 * 40 + 128 * kConsumers * kNarrowConsumerRegs <= kThreads * kNarrowLaunchRegs,
              "setmaxnreg budget (narrow)");
// Two producer warpgroups take turns by stage (one warp per scheduler cannot
// fold a stage in the time the tensor cores take for it).
constexpr int kW4Producers = 2, kThreadsW4 = 128 * (kW4Producers + kConsumers);
constexpr int kW4ProducerRegs = 72, kW4ConsumerRegs = 184;
// setmaxnreg moves registers between the warpgroups of a block; the total stays
// what the launch allocated (the launch-bounds cap per thread). With 3 producer
// warpgroups that cap is 96 and the consumers could get 144 at most (measured:
// the kernel then waits forever in setmaxnreg.inc when asked for more).
constexpr int kW4LaunchRegs = (65536 / kThreadsW4) / 8 * 8;
static_assert(128 * kW4Producers * kW4ProducerRegs + 128 * kConsumers * kW4ConsumerRegs <= kThreadsW4 * kW4LaunchRegs,
              "setmaxnreg budget");
// kW4: each producer warpgroup keeps kW4Bufs MXFP4 W tiles (64 bytes a row)
// in flight by asynchronous copy, its own next stages', while it folds. One
// is enough: four (with an FP8 ring of 4 stages to make room) measured the
// same at 16-128 tokens an expert (H200, 2026-12-02-h200-run36.md), where the
// FP4 stream runs at ~1.1 TB/s: the producers' folding bounds it, not bytes
// in flight.
constexpr int kW4Stages = 6, kW4Bufs = 1;
constexpr int kW4TileBytes = kBN<true> * 64;

// Shared memory of a kernel with S stages: X tiles, W tiles, W scales, the
// full and empty barriers, each stage's tile (FP8 weights), then (kW4) the
// MXFP4 tiles.
template <bool kW4, bool kN128 = false>
struct Smem {
  static constexpr int S = kW4 ? kW4Stages : kStages;
  static constexpr int offB = S * kABytes, offS = offB + S * kBBytes<kW4, kN128>,
                       offBar = offS + S * kSBytes<kW4, kN128>;
  static constexpr int offTile = offBar + 2 * S * 8, offW4 = (offTile + 4 * S + 127) / 128 * 128;
  static constexpr int bytes =
      (kW4 ? offW4 + kW4Producers * kW4Bufs * kW4TileBytes : offTile + 4 * S) + 1024;  // +1024: base aligned up
  static_assert(offS % 128 == 0 && kSBytes<kW4, kN128> % 128 == 0, "bulk copy destinations");
  static_assert(bytes <= 227 * 1024, "shared memory of one sm_90 block");
};
constexpr int kMaxGroups = 128;                                  // per launch; more groups are split over launches
[[maybe_unused]] constexpr int kEmptyArrivals = kConsumers * 4;  // one per consumer warp

static_assert(kBK == 128, "one 1x128 scale block per stage, one 128-byte swizzle row per tile row");
static_assert(kABytes % 1024 == 0 && kBBytes<false> % 1024 == 0 && kBBytes<true> % 1024 == 0,
              "stages keep the 1024-byte period of the 128B swizzle");
static_assert(kBM == 64 * kConsumers, "each consumer warpgroup owns 64 rows (wgmma m64)");
static_assert(128 * 40 + 128 * kConsumers * 232 <= kThreads * 168, "setmaxnreg budget (see the kernel)");
[[maybe_unused]] constexpr int kW4FullArrivals = 128;  // every producer thread, after its row of the W tile

struct Params {
  CUtensorMap xmap;  // X  [rows_total][k] u8, box 128 x 128, 128B swizzle
  CUtensorMap wmap;  // W  [G][n][k] u8, box 1 x 128 x 128, 128B swizzle (FP8 weights)
  CUtensorMap smap;  // ws [G][k/128][n] f32, box 1 x 1 x 128 (FP8 weights)
  const float* xs;
  __nv_bfloat16* d;
  int n, nkb, groups, tiles_total;
  int* sched;  // FP8 weights: [next tile, blocks done], zero at launch and again when the last block is done
  const uint8_t *w4_blocks, *w4_scales;  // MXFP4 weights: stacks [E][n][nsub][16], [E][n][nsub]
  int nsub;
  // Weight scales of 64-row groups (kG): FP8 weights' wsg_g [k/128][n/64] at
  // wsg + g * wsg_stride (floats); MXFP4 weights' group table [E][n/64][k/128].
  const float* wsg;
  int64_t wsg_stride;
  const uint8_t* w4_gmax;
  int expert[kMaxGroups];  // MXFP4 weights: group -> index in the stacks
  int off[kMaxGroups];
  int m[kMaxGroups];
  int tile_start[kMaxGroups + 1];  // prefix sums of ceil(m/kBM) * ceil(n/kBN)
};
static_assert(sizeof(Params) <= 4096, "kernel parameters");

#ifdef DZ_GG_SM90A
// Tile t -> group, m tile, n tile. Within a group the m tiles of one n tile are
// consecutive, so blocks running side by side share W tiles through L2.
__device__ __forceinline__ void find_tile(const Params& p, int t, int& g, int& mt, int& nt) {
  g = ptx::segment_of(p.tile_start, p.groups, t);
  const int local = t - p.tile_start[g], mtiles = (p.m[g] + kBM - 1) / kBM;
  nt = local / mtiles;
  mt = local - nt * mtiles;
}

using ptx::mbar_arrive;
using ptx::mbar_arrive_expect_tx;
using ptx::mbar_init;
using ptx::mbar_try_wait;
using ptx::smem_u32;

using ptx::mbar_wait_checked;

using ptx::tma_2d;
__device__ __forceinline__ void tma_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Operand tiles written by the copy engine with the 128-byte swizzle:
// ptx::sw128_desc; a K step of 32 bytes inside the swizzle row adds 2 to the
// start address (16-byte units).

using ptx::wgmma_commit;
using ptx::wgmma_fence;
using ptx::wgmma_wait0;

using ptx::fence_regs;

// d (64 x 128 fp32, wgmma register layout) = [d +] A(64 x 32) B(128 x 32)^T, both e4m3 from shared memory.
__device__ __forceinline__ void wgmma_tile(float (&d)[64], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" DZ_WGMMA_R64 "}, %64, %65, p, 1, 1;\n}\n"
      : DZ_WGMMA_ACC8(d, 0), DZ_WGMMA_ACC8(d, 8), DZ_WGMMA_ACC8(d, 16), DZ_WGMMA_ACC8(d, 24), DZ_WGMMA_ACC8(d, 32),
        DZ_WGMMA_ACC8(d, 40), DZ_WGMMA_ACC8(d, 48), DZ_WGMMA_ACC8(d, 56)
      : "l"(da), "l"(db), "r"(accumulate));
}

// d (64 x 192 fp32, wgmma register layout) = [d +] A(64 x 32) B(192 x 32)^T, both e4m3 from shared memory.
__device__ __forceinline__ void wgmma_tile(float (&d)[96], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %98, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 {" DZ_WGMMA_R64
      ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, %96, %97, p, 1, 1;\n}\n"
      : DZ_WGMMA_ACC8(d, 0), DZ_WGMMA_ACC8(d, 8), DZ_WGMMA_ACC8(d, 16), DZ_WGMMA_ACC8(d, 24), DZ_WGMMA_ACC8(d, 32),
        DZ_WGMMA_ACC8(d, 40), DZ_WGMMA_ACC8(d, 48), DZ_WGMMA_ACC8(d, 56), DZ_WGMMA_ACC8(d, 64), DZ_WGMMA_ACC8(d, 72),
        DZ_WGMMA_ACC8(d, 80), DZ_WGMMA_ACC8(d, 88)
      : "l"(da), "l"(db), "r"(accumulate));
}
#endif  // DZ_GG_SM90A

// Persistent: with FP8 weights blocks take tiles in order from p.sched, with
// MXFP4 weights block b takes tiles b, b + grid, ... Warpgroup 0 is the
// producer (one thread issues the bulk tensor copies of each stage: X tile,
// W tile, W scales); warpgroups 1 and 2 each multiply 64 rows of the tile.
// kW4: the weights are MXFP4; two producer warpgroups take turns by stage,
// each thread folding one W tile row into the stage (the folding kernel's
// bytes, written in the copy engine's 128B swizzle) and its block scale, its
// next stage's row arriving meanwhile by asynchronous copy; X still comes by
// bulk tensor copy. Consumers are warpgroups 2 and 3 then.
// kG: one weight scale per 64 columns and K block (fold groups of 64 rows):
// the promotion multiplies each accumulator by a row scale times its
// column group's scale, formed once per group instead of once per column.
template <bool kDebug, bool kW4, bool kG, bool kN128>
__global__ void __launch_bounds__(kW4     ? kThreadsW4
                                  : kN128 ? kNarrowBound
                                          : kThreads,
                                  1) fp8_grouped_kernel(const __grid_constant__ Params p) {
#ifdef DZ_GG_SM90A
  static_assert(!(kW4 && kN128), "MXFP4 weights: 128 columns already");
  using L = Smem<kW4, kN128>;
  constexpr int kS = L::S;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  const float* s_scales = reinterpret_cast<const float*>(smem_raw + (base - raw) + L::offS);
  const uint32_t sA = base, sB = base + L::offB, sS = base + L::offS, bars = base + L::offBar;
  volatile int* const s_tile = reinterpret_cast<int*>(smem_raw + (base - raw) + L::offTile);
  auto full = [&](int s) { return bars + 8u * uint32_t(s); };
  auto empty = [&](int s) { return bars + 8u * uint32_t(kS + s); };

  if (threadIdx.x == 0) {
    for (int s = 0; s < kS; ++s) {
      // The producer's arrive.expect_tx (the copies complete the bytes), or with
      // kW4 the producer threads' arrivals after their rows (plus X's bytes).
      mbar_init(full(s), kW4 ? kW4FullArrivals : 1);
      mbar_init(empty(s), kEmptyArrivals);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();

  // Registers: 384 threads enter with the launch-bounds cap of 168; the
  // producer gives back down to 40 and the consumers take up to 232, which
  // is the same total (128 x 40 + 256 x 232 = 384 x 168), so the increase
  // never waits on registers that are not there. kW4: 512 threads enter with
  // 128; the two producer warpgroups go down to 72 and the consumers up to 184,
  // the same total again (see kW4LaunchRegs).
  const int wg = int(threadIdx.x) / 128;
  constexpr int kProducerWgs = kW4 ? kW4Producers : 1;
  if (kW4 && wg < kProducerWgs) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kW4ProducerRegs) : "memory");
    const int tid = int(threadIdx.x) & 127, pw = wg;  // the W tile row this thread folds; its warpgroup
    if (tid == 0 && pw == 0) prefetch_map(&p.xmap);
    uint8_t* const sBp = smem_raw + (base - raw) + L::offB;
    float* const sSp = reinterpret_cast<float*>(smem_raw + (base - raw) + L::offS);
    const uint8_t* const w4t = smem_raw + (base - raw) + L::offW4 + pw * kW4Bufs * kW4TileBytes;
    // This row's piece j of a copied tile (XOR-swizzled by row pair: conflict-free 16-byte accesses).
    auto piece = [&](int j) { return tid * 64 + ((j ^ ((tid >> 1) & 3)) << 4); };
    // Stages are counted over this block's tiles (gs = its j-th tile * nkb +
    // kb); warpgroup pw owns those with gs % 2 == pw, its i-th being gs = pw +
    // 2i, whose MXFP4 tile lives in buffer i % kW4Bufs. Two cursors walk them
    // (32-bit counters, no division): the copies' kW4Bufs own stages ahead of
    // the folding's.
    const int my_tiles = (p.tiles_total - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x);
    const int total = my_tiles * p.nkb;
    struct Cursor {
      int gs, j, kb;  // stage, this block's tile, K block
      int jl = -1;    // the tile of the fields below
    };
    auto start = [&](Cursor& c, int gs) { c.gs = gs, c.j = gs / p.nkb, c.kb = gs - c.j * p.nkb; };
    auto next = [&](Cursor& c) {
      c.gs += kW4Producers, c.kb += kW4Producers;
      if (c.kb >= p.nkb) c.kb -= p.nkb, ++c.j;
    };
    // Whether c moved to another tile since the last call; g, mt, nt: that tile.
    auto moved = [&](Cursor& c, int& g, int& mt, int& nt) {
      if (c.jl == c.j) return false;
      c.jl = c.j;
      find_tile(p, int(blockIdx.x) + c.j * int(gridDim.x), g, mt, nt);
      return true;
    };
    Cursor ci, cc;                               // the copies', the folding's
    const uint8_t *bl = nullptr, *sc = nullptr;  // the copies' row of W (blocks, scales)
    const uint8_t* gm = nullptr;                 // kG: its row group's line of the group table
    bool rok = false;
    int row = 0;  // the folding's first X row
    start(ci, pw);
    start(cc, pw);
    // The copy's own stage (one group, empty past the end) and its scale bytes
    // (plain loads into a register ring, first used kW4Bufs own stages later).
    auto issue = [&](int buf, uint32_t& scv, int& gmv) {
      scv = 0;
      gmv = 133;
      if (ci.gs < total) {
        int g, mt, nt;
        if (moved(ci, g, mt, nt)) {
          const int wr = nt * kBN<true> + tid;
          rok = wr < p.n;
          const int64_t er = int64_t(p.expert[g]) * p.n + (rok ? wr : 0);
          bl = p.w4_blocks + er * p.nsub * 16;
          sc = p.w4_scales + er * p.nsub;
          if constexpr (kG) gm = p.w4_gmax + (er / kFoldRowGroup) * p.nkb;  // n % 64 == 0: er / 64 is the row group
        }
        if constexpr (kG)
          if (rok) gmv = gm[ci.kb];
        const uint8_t* dst = w4t + buf * kW4TileBytes;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int sb = ci.kb * 4 + q;
          const bool ok = rok && sb < p.nsub;
          ptx::cp_async16_zfill(smem_u32(dst + piece(q)), ok ? bl + sb * 16 : bl, ok ? 16u : 0u);
          if (ok) scv |= uint32_t(sc[sb]) << (8 * q);
        }
      }
      ptx::cp_async_commit();
      next(ci);
    };
    uint32_t scr[kW4Bufs];
    int gmr[kW4Bufs];
#pragma unroll
    for (int r = 0; r < kW4Bufs; ++r) issue(r, scr[r], gmr[r]);
    while (cc.gs < total) {
#pragma unroll
      for (int r = 0; r < kW4Bufs; ++r) {
        if (cc.gs >= total) break;
        int g, mt, nt;
        if (moved(cc, g, mt, nt)) row = p.off[g] + mt * kBM;
        ptx::cp_async_wait<kW4Bufs - 1>();  // this own stage's copies have landed (later ones may not)
        const uint8_t* buf = w4t + r * kW4TileBytes;
        GroupIn G;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          G.w[q] = *reinterpret_cast<const uint4*>(buf + piece(q));
          G.s[q] = int((scr[r] >> (8 * q)) & 0xFFu);
        }
        const int smax = kG ? gmr[r] : fold_smax(group_smax(G));
        // The next copies overwrite the buffer: their addresses take a data
        // dependency on what was just read, so they issue after the reads land.
        int bi = r;
        asm volatile("" : "+r"(bi) : "r"(G.w[0].x ^ G.w[1].y ^ G.w[2].z ^ G.w[3].w));
        issue(bi, scr[r], gmr[r]);
        const int stage = cc.gs % kS;
        const uint32_t phase = uint32_t(cc.gs / kS) & 1u;
        mbar_wait_checked<kDebug>(empty(stage), phase ^ 1u, "empty", stage);
        if (tid == 0) {
          ptx::mbar_expect_tx(full(stage), kABytes);
          tma_2d(sA + uint32_t(stage * kABytes), &p.xmap, full(stage), cc.kb * kBK, row);
        }
        sSp[stage * kBN<true> + tid] =
            fold_group_at(G, smax, reinterpret_cast<uint4*>(sBp + stage * kBBytes<true> + tid * kBK), tid & 7);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic writes -> wgmma's reads
        mbar_arrive(full(stage));
        next(cc);
      }
    }
    ptx::cp_async_wait<0>();
  } else if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (threadIdx.x == 0) {
      prefetch_map(&p.xmap);
      prefetch_map(&p.wmap);
      if constexpr (!kG) prefetch_map(&p.smap);
      int stage = 0;
      uint32_t phase = 0;
      // Tiles in order from a global counter (a block that starts late, behind
      // another kernel's blocks, takes fewer); each tile's first stage carries
      // its index for the consumers, and -1 in the next stage ends the block.
      for (;;) {
        int t = atomicAdd(p.sched, 1);
        if (t >= p.tiles_total) t = -1;
        mbar_wait_checked<kDebug>(empty(stage), phase ^ 1u, "empty", stage);  // a fresh barrier passes parity 1
        s_tile[stage] = t;
        if (t < 0) {
          mbar_arrive(full(stage));
          break;
        }
        int g, mt, nt;
        find_tile(p, t, g, mt, nt);
        const int row = p.off[g] + mt * kBM, n0 = nt * kBN<false, kN128>;
        for (int kb = 0; kb < p.nkb; ++kb) {
          if (kb > 0) mbar_wait_checked<kDebug>(empty(stage), phase ^ 1u, "empty", stage);
          mbar_arrive_expect_tx(full(stage), kG ? kTxBytes<kN128> - kSBytes<false, kN128> : kTxBytes<kN128>);
          tma_2d(sA + uint32_t(stage * kABytes), &p.xmap, full(stage), kb * kBK, row);
          tma_3d(sB + uint32_t(stage * kBBytes<false, kN128>), &p.wmap, full(stage), kb * kBK, n0, g);
          if constexpr (!kG) tma_3d(sS + uint32_t(stage * kSBytes<false, kN128>), &p.smap, full(stage), n0, kb, g);
          if (++stage == kS) stage = 0, phase ^= 1u;
        }
      }
      // The last block done resets the counter for the next launch (every
      // block's last increment of it comes before its increment here).
      __threadfence();
      if (atomicAdd(p.sched + 1, 1) == int(gridDim.x) - 1) {
        p.sched[0] = 0;
        p.sched[1] = 0;
        __threadfence();
      }
    }
  } else {
    if constexpr (kW4)
      asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kW4ConsumerRegs) : "memory");
    else if constexpr (kN128)
      asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kNarrowConsumerRegs) : "memory");
    else
      asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int ct = int(threadIdx.x) - 128 * kProducerWgs;
    // The consumer warpgroup as a value the compiler knows is the same in
    // every lane: the descriptors derived from it stay in uniform registers.
    const int cw = __shfl_sync(0xffffffffu, ct >> 7, 0), warp = (ct >> 5) & 3, lane = ct & 31;
    constexpr int BN = kBN<kW4, kN128>, NR = BN / 2;  // tile columns, accumulators a thread
    float acc[NR], part[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) part[i] = 0.f;
    int stage = 0;
    uint32_t phase = 0;
    // The next tile: this block's next in turn (kW4), or the one the producer
    // put in the ring's next stage (-1: none left).
    auto next_tile = [&](int t) {
      if constexpr (kW4) return t + int(gridDim.x) < p.tiles_total ? t + int(gridDim.x) : -1;
      mbar_wait_checked<kDebug>(full(stage), phase, "full", stage);
      return int(s_tile[stage]);
    };
    for (int t = kW4 ? (int(blockIdx.x) < p.tiles_total ? int(blockIdx.x) : -1) : next_tile(0); t >= 0;
         t = next_tile(t)) {
      int g, mt, nt;
      find_tile(p, t, g, mt, nt);
      const int m = p.m[g], off = p.off[g], n0 = nt * BN;
      // This thread's rows in the group (wgmma layout: warp w of the
      // warpgroup holds rows 16w..16w+15, lane/4 and lane/4 + 8).
      const int r0 = mt * kBM + cw * 64 + warp * 16 + (lane >> 2), r1 = r0 + 8;
      const float* xsg = p.xs + int64_t(p.nkb) * off;
      constexpr int NG = BN / kFoldRowGroup;  // kG: column groups of the tile
      const int ngc = p.n / kFoldRowGroup;
      const float* wsg = kW4 ? nullptr : p.wsg + g * p.wsg_stride + n0 / kFoldRowGroup;
#pragma unroll
      for (int i = 0; i < NR; ++i) acc[i] = 0.f;
      // A warpgroup whose 64 rows all lie past the group (a group's last m
      // tile, or groups of at most 64 rows) only keeps the ring's count: it
      // waits for each stage, so its arrival is for that stage's phase.
      if (mt * kBM + cw * 64 >= m) {
        for (int kb = 0; kb < p.nkb; ++kb) {
          mbar_wait_checked<kDebug>(full(stage), phase, "full", stage);
          __syncwarp();
          if (lane == 0) mbar_arrive(empty(stage));
          if (++stage == kS) stage = 0, phase ^= 1u;
        }
        continue;
      }
      // Warps whose 16 rows all lie past the group skip the promotion.
      const bool wlive = mt * kBM + cw * 64 + warp * 16 < m;
      for (int kb = 0; kb < p.nkb; ++kb) {
        // Row scales straight from global memory, issued before the wait so
        // the MMA hides their latency; rows past the group read nothing.
        const float x0 = r0 < m ? __ldg(xsg + int64_t(kb) * m + r0) : 0.f;
        const float x1 = r1 < m ? __ldg(xsg + int64_t(kb) * m + r1) : 0.f;
        float wq[kG ? NG : 1];
        if constexpr (kG && !kW4) {
#pragma unroll
          for (int q = 0; q < NG; ++q)  // a partial last n tile: its groups past n repeat the last
            wq[q] = __ldg(wsg + int64_t(kb) * ngc + min(q, ngc - 1 - n0 / kFoldRowGroup));
        }
        mbar_wait_checked<kDebug>(full(stage), phase, "full", stage);
        __syncwarp();  // the warp leaves the spin together: wgmma is .aligned
        const uint32_t da = ptx::sw128_desc_lo(sA + uint32_t(stage * kABytes + cw * 64 * kBK));
        const uint32_t db = ptx::sw128_desc_lo(sB + uint32_t(stage * kBBytes<kW4, kN128>));
        wgmma_fence();
        fence_regs(part);
#pragma unroll
        for (int kk = 0; kk < kBK / 32; ++kk)
          wgmma_tile(part, ptx::sw128_desc(da + 2 * kk), ptx::sw128_desc(db + 2 * kk), kk);
        wgmma_commit();
        fence_regs(part);
        wgmma_wait0();
        fence_regs(part);
        // Promotion: acc += part * xs[row] * ws[col]. Columns of register
        // quad j: 8j + 2 (lane % 4) + {0, 1}; registers 4j+2, 4j+3 are row + 8.
        if (kG && wlive) {
#pragma unroll
          for (int q = 0; q < NG; ++q) {
            // MXFP4 weights: every row of a group got the group's scale from its producer thread.
            const float w = kW4 ? s_scales[stage * BN + q * kFoldRowGroup] : wq[q];
            const float s0 = x0 * w, s1 = x1 * w;
#pragma unroll
            for (int j = q * 8; j < q * 8 + 8; ++j) {  // register quad j: columns 8j..8j+7
              acc[4 * j + 0] = fmaf(part[4 * j + 0], s0, acc[4 * j + 0]);
              acc[4 * j + 1] = fmaf(part[4 * j + 1], s0, acc[4 * j + 1]);
              acc[4 * j + 2] = fmaf(part[4 * j + 2], s1, acc[4 * j + 2]);
              acc[4 * j + 3] = fmaf(part[4 * j + 3], s1, acc[4 * j + 3]);
            }
          }
        } else if (wlive) {
          const float2* sc = reinterpret_cast<const float2*>(s_scales + stage * BN);
#pragma unroll
          for (int j = 0; j < BN / 8; ++j) {
            const float2 w = sc[j * 4 + (lane & 3)];
            acc[4 * j + 0] = fmaf(part[4 * j + 0], x0 * w.x, acc[4 * j + 0]);
            acc[4 * j + 1] = fmaf(part[4 * j + 1], x0 * w.y, acc[4 * j + 1]);
            acc[4 * j + 2] = fmaf(part[4 * j + 2], x1 * w.x, acc[4 * j + 2]);
            acc[4 * j + 3] = fmaf(part[4 * j + 3], x1 * w.y, acc[4 * j + 3]);
          }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(empty(stage));
        if (++stage == kS) stage = 0, phase ^= 1u;
      }
      // Epilogue: rows of this group only; columns < n (n % 16 == 0, so a pair is all in or all out).
      const int cbase = n0 + 2 * (lane & 3);
      if (r0 < m) {
        __nv_bfloat16* row = p.d + (int64_t(off) + r0) * p.n;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
          if (cbase + 8 * j < p.n)
            *reinterpret_cast<__nv_bfloat162*>(row + cbase + 8 * j) =
                __floats2bfloat162_rn(acc[4 * j + 0], acc[4 * j + 1]);
      }
      if (r1 < m) {
        __nv_bfloat16* row = p.d + (int64_t(off) + r1) * p.n;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
          if (cbase + 8 * j < p.n)
            *reinterpret_cast<__nv_bfloat162*>(row + cbase + 8 * j) =
                __floats2bfloat162_rn(acc[4 * j + 2], acc[4 * j + 3]);
      }
    }
  }
#else
  if (threadIdx.x == 0 && blockIdx.x == 0) printf("fp8_grouped_gemm: kernel built without sm_90a\n");
  __trap();
#endif
}

// Every instantiation: [checking][64-row weight scales][kind], the kinds FP8
// weights (192 columns), MXFP4 weights, FP8 weights narrow (128 columns).
#define DZ_GG_KINDS(d, g) \
  fp8_grouped_kernel<d, false, g, false>, fp8_grouped_kernel<d, true, g, false>, fp8_grouped_kernel<d, false, g, true>
void (*const kKernels[2][2][3])(Params) = {{{DZ_GG_KINDS(false, false)}, {DZ_GG_KINDS(false, true)}},
                                           {{DZ_GG_KINDS(true, false)}, {DZ_GG_KINDS(true, true)}}};
#undef DZ_GG_KINDS
const int kKindThreads[3] = {kThreads, kThreadsW4, kThreads};
const int kKindSmem[3] = {Smem<false>::bytes, Smem<true>::bytes, Smem<false, true>::bytes};

// Whether the kernels of this build carry the sm_90a body (read on the device:
// a build for another target runs there through its PTX without it).
__global__ void probe_kernel(int* out) {
#ifdef DZ_GG_SM90A
  *out = 1;
#else
  *out = 0;
#endif
}

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's tensor-map encoder through the runtime (no link against libcuda).
EncodeTiled encoder() {
  static const EncodeTiled fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q);
    return e == cudaSuccess && q == cudaDriverEntryPointSuccess ? reinterpret_cast<EncodeTiled>(f) : nullptr;
  }();
  check(fn != nullptr, DZ_ERR_UNSUPPORTED, "the driver has no cuTensorMapEncodeTiled");
  return fn;
}

bool aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0; }

int device_sm90a() {
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess || major != 9) return 0;
  int* d = nullptr;
  int h = 0;
  if (cudaMalloc(&d, sizeof(int)) != cudaSuccess) return 0;
  probe_kernel<<<1, 1>>>(d);
  const bool ok =
      cudaGetLastError() == cudaSuccess && cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost) == cudaSuccess;
  cudaFree(d);
  return ok ? h : 0;
}

}  // namespace

void encode_tensor_map(CUtensorMap* map, CUtensorMapDataType type, int rank, const void* base, const cuuint64_t* dims,
                       const cuuint64_t* strides, const cuuint32_t* box, CUtensorMapSwizzle swz, const char* what) {
  const cuuint32_t one[3] = {1, 1, 1};
  const CUresult r = encoder()(map, type, cuuint32_t(rank), const_cast<void*>(base), dims, strides, box, one,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, swz, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);  // out-of-bounds elements read as zero
  check(r == CUDA_SUCCESS, DZ_ERR_INVALID_ARGUMENT, "cuTensorMapEncodeTiled failed for ", what, " (CUresult ", int(r),
        ")");
}

bool Fp8GroupedGemm::supported() {
  static const bool ok = device_sm90a() == 1;  // the first device asked about (one GPU per process here)
  return ok;
}

bool Fp8GroupedGemm::narrow_leaves_room_for_fold() {
  if (!supported()) return false;
  cudaFuncAttributes ga{};
  DZ_CUDA_CHECK(cudaFuncGetAttributes(&ga, kKernels[0][1][2]));  // the narrow form, 64-row scales (the MoE layer's)
  const FoldBlockResources f = mxfp4_fold_block_resources();
  int dev = 0, regs = 0, smem = 0, reserved = 0, threads = 0;
  DZ_CUDA_CHECK(cudaGetDevice(&dev));
  DZ_CUDA_CHECK(cudaDeviceGetAttribute(&regs, cudaDevAttrMaxRegistersPerMultiprocessor, dev));
  DZ_CUDA_CHECK(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  DZ_CUDA_CHECK(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev));
  DZ_CUDA_CHECK(cudaDeviceGetAttribute(&threads, cudaDevAttrMaxThreadsPerMultiProcessor, dev));
  auto warp_regs = [](int per_thread) { return int64_t(per_thread * 32 + 255) / 256 * 256; };  // 256-register units
  const int64_t need_regs = kThreads / 32 * warp_regs(ga.numRegs) + f.threads / 32 * warp_regs(f.regs_per_thread);
  const int64_t need_smem = int64_t(kKindSmem[2]) + int64_t(ga.sharedSizeBytes) + int64_t(f.static_smem) + 2 * reserved;
  return need_regs <= regs && need_smem <= smem && kThreads + f.threads <= threads;
}

bool grouped_gemm_debug() {
  const char* e = std::getenv("DZ_FP8_GROUPED_DEBUG");
  return e && e[0] == '1';
}

void grouped_gemm_sync(cudaStream_t s) {
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  DZ_CUDA_CHECK(cudaStreamIsCapturing(s, &cap));
  if (cap == cudaStreamCaptureStatusNone) DZ_CUDA_CHECK(cudaStreamSynchronize(s));
}

int current_device_sms() {
  int dev = 0, n = 0;
  DZ_CUDA_CHECK(cudaGetDevice(&dev));
  DZ_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

Fp8GroupedGemm::Fp8GroupedGemm() {
  debug_ = grouped_gemm_debug();
  if (!supported()) return;  // run() says why
  n_sm_ = current_device_sms();
  for (int d = 0; d < 2; ++d)
    for (int g = 0; g < 2; ++g)
      for (int kind = 0; kind < 3; ++kind) {
        DZ_CUDA_CHECK(
            cudaFuncSetAttribute(kKernels[d][g][kind], cudaFuncAttributeMaxDynamicSharedMemorySize, kKindSmem[kind]));
        // The narrow form asks for all of an SM's shared memory as such (not
        // the next carveout above its own 164 KB, 196 KB, which would leave too
        // little for the folding block beside it).
        if (kind == 2)
          DZ_CUDA_CHECK(cudaFuncSetAttribute(kKernels[d][g][kind], cudaFuncAttributePreferredSharedMemoryCarveout,
                                             cudaSharedmemCarveoutMaxShared));
      }
  DZ_CUDA_CHECK(cudaMalloc(&sched_, 2 * sizeof(int)));
  DZ_CUDA_CHECK(cudaMemset(sched_, 0, 2 * sizeof(int)));
}

Fp8GroupedGemm::~Fp8GroupedGemm() {
  if (sched_) cudaFree(sched_);
}

void Fp8GroupedGemm::run(const Fp8GroupedArgs& a, cudaStream_t s) {
  check(supported(), DZ_ERR_UNSUPPORTED, "fp8_grouped_gemm needs an sm_90 device and a build with sm_90a");
  check(a.n > 0 && a.n % 16 == 0 && a.k > 0 && a.k % kBK == 0, DZ_ERR_INVALID_ARGUMENT, "fp8_grouped_gemm: n=", a.n,
        " k=", a.k, " (n must be a multiple of 16, k of 128)");
  check(a.groups >= 0 && (a.groups == 0 || (a.offsets && a.counts)) && a.rows_total >= 0 &&
            a.rows_total < (int64_t(1) << 31),
        DZ_ERR_INVALID_ARGUMENT, "fp8_grouped_gemm: groups=", a.groups, " rows_total=", a.rows_total);
  const bool w4 = a.w4.blocks != nullptr;
  const bool grp = w4 ? a.w4.gmax != nullptr : a.ws_row_group == kFoldRowGroup;
  check(w4 || a.ws_row_group == 1 || a.ws_row_group == kFoldRowGroup, DZ_ERR_INVALID_ARGUMENT,
        "fp8_grouped_gemm: ws_row_group ", a.ws_row_group, " (1 or 64)");
  check(!grp || a.n % kFoldRowGroup == 0, DZ_ERR_INVALID_ARGUMENT, "fp8_grouped_gemm: n=", a.n,
        " with weight scales of 64-row groups (n must be a multiple of 64)");
  check(w4 || a.tile_n == 192 || a.tile_n == 128, DZ_ERR_INVALID_ARGUMENT, "fp8_grouped_gemm: tile_n ", a.tile_n,
        " (192 or 128)");
  const int kind = w4 ? 1 : a.tile_n == 128 ? 2 : 0;
  const int bn = kind == 0 ? kBN<false> : 128, nkb = a.k / kBK, ntiles = (a.n + bn - 1) / bn;
  for (int g = 0; g < a.groups; ++g)
    check(a.counts[g] >= 0 && a.offsets[g] >= 0 && int64_t(a.offsets[g]) + a.counts[g] <= a.rows_total,
          DZ_ERR_INVALID_ARGUMENT, "fp8_grouped_gemm: group ", g, " rows [", a.offsets[g], ", ",
          int64_t(a.offsets[g]) + a.counts[g], ") outside the ", a.rows_total, " rows of X and D");
  int64_t rows_used = 0;
  for (int g = 0; g < a.groups; ++g) rows_used += a.counts[g];
  if (rows_used == 0) return;
  check(a.x && a.xs && a.d && (w4 ? a.w4.scales != nullptr : a.w && a.ws), DZ_ERR_INVALID_ARGUMENT,
        "fp8_grouped_gemm: null pointer");
  // W scales of 64-row groups are plain loads (4-byte aligned); 1x128 ones come by tensor copy.
  check(aligned(a.x, 16) && aligned(a.d, 16) && aligned(a.xs, 4) &&
            (w4 || (aligned(a.w, 16) && aligned(a.ws, grp ? 4 : 16))),
        DZ_ERR_INVALID_ARGUMENT,
        "fp8_grouped_gemm: X, W, W scales (1x128) and D must be 16-byte aligned, X scales 4-byte");
  const int64_t w_bytes = int64_t(a.n) * a.k, ws_floats = int64_t(nkb) * (grp ? a.n / kFoldRowGroup : a.n);
  const int64_t w_stride = a.groups > 1 ? a.w_stride : w_bytes, ws_stride = a.groups > 1 ? a.ws_stride : ws_floats;
  if (w4) {
    check(aligned(a.w4.blocks, 16) && a.w4.rows == a.n && a.w4.k % 32 == 0 && a.w4.k > a.k - kBK && a.w4.k <= a.k &&
              a.experts != nullptr,
          DZ_ERR_INVALID_ARGUMENT, "fp8_grouped_gemm: MXFP4 weights of ", a.w4.rows, " x ", a.w4.k, " for n=", a.n,
          " k=", a.k, " (rows must equal n, K a multiple of 32 that pads to k; blocks 16-byte aligned; experts given)");
    for (int g = 0; g < a.groups; ++g)
      check(a.experts[g] >= 0 && a.experts[g] < a.w4_experts, DZ_ERR_INVALID_ARGUMENT, "fp8_grouped_gemm: group ", g,
            " names expert ", a.experts[g], " of ", a.w4_experts);
  } else {
    check(w_stride >= w_bytes && w_stride % 16 == 0 && ws_stride >= ws_floats && (grp || ws_stride % 4 == 0),
          DZ_ERR_INVALID_ARGUMENT, "fp8_grouped_gemm: group strides w=", a.w_stride,
          " bytes (>= n*k, multiple of 16), ws=", a.ws_stride,
          grp ? " floats (>= k/128*n/64)" : " floats (>= k/128*n, multiple of 4)");
  }

  Params p{};
  {
    const cuuint64_t dims[2] = {cuuint64_t(a.k), cuuint64_t(a.rows_total)}, strides[1] = {cuuint64_t(a.k)};
    const cuuint32_t box[2] = {kBK, kBM};
    encode_tensor_map(&p.xmap, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, a.x, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B,
                      "X");
  }
  p.xs = a.xs;
  p.sched = sched_;
  p.d = static_cast<__nv_bfloat16*>(a.d);
  p.n = a.n;
  p.nkb = nkb;
  p.w4_blocks = a.w4.blocks, p.w4_scales = a.w4.scales, p.nsub = int(a.w4.k / 32);
  p.w4_gmax = a.w4.gmax;
  p.wsg_stride = ws_stride;
  for (int g0 = 0; g0 < a.groups; g0 += kMaxGroups) {
    const int G = std::min(kMaxGroups, a.groups - g0);
    if (!w4) {
      const cuuint64_t dims[3] = {cuuint64_t(a.k), cuuint64_t(a.n), cuuint64_t(G)};
      const cuuint64_t strides[2] = {cuuint64_t(a.k), cuuint64_t(w_stride)};
      const cuuint32_t box[3] = {kBK, cuuint32_t(bn), 1};
      encode_tensor_map(&p.wmap, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, a.w + w_stride * g0, dims, strides, box,
                        CU_TENSOR_MAP_SWIZZLE_128B, "W");
    }
    if (!w4 && grp) p.wsg = a.ws + ws_stride * g0;
    if (!w4 && !grp) {
      const cuuint64_t dims[3] = {cuuint64_t(a.n), cuuint64_t(nkb), cuuint64_t(G)};
      const cuuint64_t strides[2] = {cuuint64_t(a.n) * 4, cuuint64_t(ws_stride) * 4};
      const cuuint32_t box[3] = {cuuint32_t(bn), 1, 1};
      encode_tensor_map(&p.smap, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, a.ws + ws_stride * g0, dims, strides, box,
                        CU_TENSOR_MAP_SWIZZLE_NONE, "W scales");
    }
    p.groups = G;
    int tiles = 0;
    for (int g = 0; g < G; ++g) {
      p.off[g] = a.offsets[g0 + g];
      p.expert[g] = w4 ? a.experts[g0 + g] : 0;
      p.m[g] = a.counts[g0 + g];
      p.tile_start[g] = tiles;
      tiles += (p.m[g] + kBM - 1) / kBM * ntiles;
    }
    p.tile_start[G] = tiles;
    p.tiles_total = tiles;
    if (tiles == 0) continue;
    const int blocks = a.max_blocks > 0 ? std::min(a.max_blocks, n_sm_) : n_sm_;
    const dim3 grid(unsigned(std::min(tiles, blocks))), block{unsigned(kKindThreads[kind])};
    kKernels[debug_][grp][kind]<<<grid, block, kKindSmem[kind], s>>>(p);
    DZ_CUDA_LAUNCH_CHECK();
    if (debug_) grouped_gemm_sync(s);
  }
}

}  // namespace dz::cuda
