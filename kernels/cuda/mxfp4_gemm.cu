#include <cuda.h>  // CUtensorMap and its enums only (the encoder: encode_tensor_map)
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "cuda/fp8_grouped_gemm.h"  // encode_tensor_map
#include "cuda/moe_decode.cuh"      // swiglu: gpt-oss's activation in the epilogue
#include "cuda/mxfp4_fold.cuh"
#include "cuda/mxfp4_gemm.h"
#include "cuda/ptx.cuh"
#include "runtime/cuda/cuda_check.h"

// wgmma and setmaxnreg exist only in the sm_90a target; elsewhere the kernel
// body traps and the host refuses to launch it (Mxfp4Gemm::supported).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DZ_MG_SM90A 1
#endif

namespace dz::cuda {
namespace {

constexpr int kRows = 128;         // weight rows a block tile: two consumer warpgroups of 64
constexpr int kBK = 128;           // K a stage: one scale block, four MXFP4 sub-blocks
constexpr int kThreads = 384;      // a producer warpgroup (one thread issues the copies), two consumers
constexpr int kWBox = 64 * 64;     // a consumer's MXFP4 stage: 64 rows x 64 bytes
constexpr int kMaxGroups = 128;    // per launch; more groups are split over launches
constexpr int kEmptyArrivals = 8;  // one per consumer warp
constexpr int kScaleWarps = 3;     // the producer warpgroup's warps 1..3 (scale products)
constexpr int kExtra = 64;         // whole-K: tokens an expert's last tile takes past its 256 (one decode for both)

// Token tiles of a group of m tokens: ceil(m / bn), but with ride-along
// tokens a last tile of at most kExtra tokens rides on the tile before it.
__host__ __device__ constexpr int token_tiles(int m, int bn, bool ride) {
  const int n = (m + bn - 1) / bn;
  return ride && n >= 2 && m - (n - 1) * bn <= kExtra ? n - 1 : n;
}
// The tokens of token tile tt of such a group: bn, but the last tile's rest
// (up to bn + kExtra with ride-along tokens).
__host__ __device__ constexpr int tile_tokens_of(int m, int bn, bool ride, int tt) {
  return tt == token_tiles(m, bn, ride) - 1 ? m - tt * bn : bn;
}

// Shared memory of a kernel with BN tokens a tile: per stage the X tile (BN
// rows x 128 bytes, 128-byte swizzle), both consumers' MXFP4 boxes (64-byte
// swizzle), and with scales by K block the X scales (BN floats) and each
// consumer's products of its weight group's scale and the X scales (2 x BN
// floats); with whole-K scales S + 1 buffers of a tile's token scales (up to
// BN + kExtra floats, brought with its first stage); then the barriers (full,
// empty, products ready). As many stages as fit in ~210 KB, at most 8.
template <int BN, bool kWhole, bool kRide, bool kStageQ = false>
struct Smem {
  static constexpr int xBytes = BN * kBK, x2Bytes = kRide ? kExtra * kBK : 0;  // x2: the ride-along tokens
  static constexpr int stageBytes = xBytes + x2Bytes + 2 * kWBox + (kWhole ? 0 : 3 * BN * 4);
  static constexpr int S = std::min(8, 210 * 1024 / stageBytes);
  static constexpr int offW = S * xBytes, offX2 = offW + S * 2 * kWBox, offXs = offX2 + S * x2Bytes;
  static constexpr int xsBytes = kWhole ? 0 : BN * 4;  // per stage: X scales, then 2 x products
  static constexpr int offC = offXs + S * xsBytes;
  static constexpr int tokMax = BN + kExtra, offTok = (offC + S * 2 * xsBytes + 127) / 128 * 128;
  // kStageQ: each consumer's staging of the activation's E4M3 outputs (a tile's
  // tokens x its 32 output bytes) for row-contiguous stores.
  static constexpr int offStg = offTok + (kWhole ? (S + 1) * tokMax * 4 : 0), stgBytes = (kRide ? tokMax : BN) * 32;
  static constexpr int offBar = offStg + (kStageQ ? 2 * stgBytes : 0);
  static constexpr int bytes = offBar + 3 * S * 8 + 1024;  // +1024: base aligned up
  static_assert(xBytes % 1024 == 0 && offW % 1024 == 0 && kWBox % 1024 == 0 && offXs % 16 == 0, "alignment");
  static_assert(bytes <= 227 * 1024, "shared memory of one sm_90 block");
};

struct Params {
  CUtensorMap xmap;   // X [rows_total][k] u8, box BN x 128, 128B swizzle
  CUtensorMap xsmap;  // xs [nkb][xs_ld] f32, box 1 x BN; whole-K: xs [rows_total] f32, box 64
  CUtensorMap wmap;   // MXFP4 blocks [E * n][K / 2] u8, box 64 x 64, 64B swizzle
  CUtensorMap xmap2;  // whole-K: X again, box kExtra x 128 (the ride-along tokens)
  __nv_bfloat16* d;
  const uint8_t* scales;  // E8M0 [E * n][nsub]
  const uint8_t* gmax;    // group table [E][n / 64][nkb]
  const uint8_t* gk;      // whole-K scales: W's group table [E][n / 64]
  uint8_t* q;             // the activation in the epilogue: E4M3 [rows_total][q_ld]
  const uint16_t* bias;   // its bias, bf16 [E][n] (null: none)
  int64_t q_ld;
  float xconst;  // whole-K: > 0, every row's X scale (xsmap not read)
  int n, nkb, nsub, groups, tiles_total;
  int probe;  // Mxfp4GemmArgs::probe (timings only)
  int expert[kMaxGroups];
  int off[kMaxGroups];
  int m[kMaxGroups];
  int tile_start[kMaxGroups + 1];  // prefix sums of ceil(n / kRows) * token_tiles(m, BN, ride)
};
static_assert(sizeof(Params) <= 4096, "kernel parameters");

#ifdef DZ_MG_SM90A
// Tile t -> group, row tile, token tile; a group's token tiles of one row tile
// are consecutive (blocks side by side share the weight rows through L2).
template <int BN, bool kRide>
__device__ __forceinline__ void find_tile(const Params& p, int t, int& g, int& rt, int& tt) {
  g = ptx::segment_of(p.tile_start, p.groups, t);
  const int local = t - p.tile_start[g], ttiles = token_tiles(p.m[g], BN, kRide);
  rt = local / ttiles;
  tt = local - rt * ttiles;
}

// d (64 x N fp32, wgmma layout) = [d +] A(64 x 32, registers) B(N x 32, shared)^T, E4M3; N = 64, 128, 160.
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t db, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {" DZ_WGMMA_R32
      "}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : DZ_WGMMA_ACC32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t db, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" DZ_WGMMA_R64
      "}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : DZ_WGMMA_ACC64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[80], const uint32_t (&a)[4], uint64_t db, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %85, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n160k32.f32.e4m3.e4m3 {" DZ_WGMMA_R64 ", " DZ_WGMMA_R64_79
      "}, {%80, %81, %82, %83}, %84, p, 1, 1;\n}\n"
      : DZ_WGMMA_ACC64(d), DZ_WGMMA_ACC8(d, 64), DZ_WGMMA_ACC8(d, 72)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}
// The same, N columns wide on the first N / 2 of d's accumulators (the
// whole-K tiles: one accumulator array for every width).
template <int N, int R>
__device__ __forceinline__ void wgmma_rs_n(float (&d)[R], const uint32_t (&a)[4], uint64_t db) {
  static_assert(N / 2 <= R, "accumulators");
  if constexpr (N == 64) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {" DZ_WGMMA_R32
                 "}, {%32, %33, %34, %35}, %36, 1, 1, 1;\n"
                 : DZ_WGMMA_ACC32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
  } else if constexpr (N == 96) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n96k32.f32.e4m3.e4m3 {" DZ_WGMMA_R32 ", " DZ_WGMMA_R32_47
                 "}, {%48, %49, %50, %51}, %52, 1, 1, 1;\n"
                 : DZ_WGMMA_ACC32(d), DZ_WGMMA_ACC8(d, 32), DZ_WGMMA_ACC8(d, 40)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
  } else if constexpr (N == 160) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n160k32.f32.e4m3.e4m3 {" DZ_WGMMA_R64 ", " DZ_WGMMA_R64_79
                 "}, {%80, %81, %82, %83}, %84, 1, 1, 1;\n"
                 : DZ_WGMMA_ACC64(d), DZ_WGMMA_ACC8(d, 64), DZ_WGMMA_ACC8(d, 72)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
  } else if constexpr (N == 224) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n224k32.f32.e4m3.e4m3 {" DZ_WGMMA_R64 ", " DZ_WGMMA_R64_95
                 ", " DZ_WGMMA_R96_111 "}, {%112, %113, %114, %115}, %116, 1, 1, 1;\n"
                 : DZ_WGMMA_ACC64(d), DZ_WGMMA_ACC32_AT(d, 64), DZ_WGMMA_ACC8(d, 96), DZ_WGMMA_ACC8(d, 104)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
  } else if constexpr (N == 128) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" DZ_WGMMA_R64
                 "}, {%64, %65, %66, %67}, %68, 1, 1, 1;\n"
                 : DZ_WGMMA_ACC64(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
  } else if constexpr (N == 192) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 {" DZ_WGMMA_R64 ", " DZ_WGMMA_R64_95
                 "}, {%96, %97, %98, %99}, %100, 1, 1, 1;\n"
                 : DZ_WGMMA_ACC64(d), DZ_WGMMA_ACC32_AT(d, 64)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
  } else {
    static_assert(N == 256, "a multiple of 32 from 64 to 256 columns");
    asm volatile("wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {" DZ_WGMMA_R64 ", " DZ_WGMMA_R64_127
                 "}, {%128, %129, %130, %131}, %132, 1, 1, 1;\n"
                 : DZ_WGMMA_ACC64(d), DZ_WGMMA_ACC32_AT(d, 64), DZ_WGMMA_ACC32_AT(d, 96)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
  }
}
#endif  // DZ_MG_SM90A

// The kernel: persistent, block b takes tiles b, b + grid, ... Warpgroup 0
// is the producer (one thread issues each stage's copies: the X tile, its
// scales, both consumers' MXFP4 boxes; warps 1..3 multiply the X scales by
// each consumer's weight group scale); warpgroups 1 and 2 each own 64
// weight rows of the tile. A consumer thread holds rows g and g + 8 of its
// warp's 16 (g = lane / 4) and word t = lane % 4 of each sub-block: it folds
// those words to E4M3 under the 64-row group's scale byte (fold_word: the
// folding kernel's bytes) straight into its A fragments, whose k order is the
// one X is stored in. Each K block's four MMAs go into part, which is then
// added to acc times those products (one FFMA an accumulator).
// kWhole (scales over all of K: X's by row, W's by 64-row group): the MMAs
// of every K block accumulate in acc itself, one K block's group in flight
// while the next is decoded, and the epilogue applies both scales once; no
// promotion, no products, no X scale copies.
// kGlu (whole-K): the epilogue writes gpt-oss's SwiGLU of each gate / up row
// pair as E4M3 (Mxfp4GemmArgs::q) instead of D.
template <int BN, bool kWhole, bool kRide, bool kGlu, bool kStageQ = false>
__global__ void __launch_bounds__(kThreads, 1) mxfp4_gemm_kernel(const __grid_constant__ Params p) {
#ifdef DZ_MG_SM90A
  static_assert(kWhole || !kRide, "ride-along tokens need whole-K scales");
  static_assert(kWhole || !kGlu, "the activation in the epilogue needs whole-K scales");
  static_assert(kGlu || !kStageQ, "staged outputs are the activation's");
  using L = Smem<BN, kWhole, kRide, kStageQ>;
  constexpr int kS = L::S;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = ptx::smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* const gbase = smem_raw + (base - raw);
  const uint32_t sX = base, sW = base + L::offW, sXs = base + L::offXs, bars = base + L::offBar;
  auto full = [&](int s) { return bars + 8u * uint32_t(s); };
  auto empty = [&](int s) { return bars + 8u * uint32_t(kS + s); };
  auto cready = [&](int s) { return bars + 8u * uint32_t(2 * kS + s); };
  // Whole-K: the token scales of a block's tile number tb (0, 1, ... in the
  // block's order, kept modulo kS + 1). They come with the tile's first stage;
  // when that stage is issued, the consumers have released the stage kS before
  // it, so the block's tiles kS or more back are done (epilogues included) and
  // kS + 1 buffers never overwrite one still to be read.
  auto tok_buf = [&](int tb) { return L::offTok + tb * L::tokMax * 4; };
  auto wait = [](uint32_t bar, uint32_t parity) { ptx::mbar_wait(bar, parity); };
  const bool tok_copy = kWhole && p.xconst <= 0.f;  // the token scales come by copy (not one for every row)

  if (threadIdx.x == 0) {
    for (int s = 0; s < kS; ++s) {
      ptx::mbar_init(full(s), 1);  // the producer's arrive.expect_tx; the copies complete the bytes
      ptx::mbar_init(empty(s), kEmptyArrivals);
      ptx::mbar_init(cready(s), kScaleWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();

  // Registers: 384 threads enter with the launch-bounds cap of 168; the
  // producer gives back down to 40 and the consumers take 232: the same total.
  // With ride-along tokens (whole-K: the producer warpgroup only issues
  // copies) 24 and 240, for their accumulators (ptxas: spill stores 72 / 96 ->
  // 44 / 52 bytes; the layer on an H100 2.1% faster at 16384 tokens). The
  // other whole-K kernels keep 40 / 232, spilling 8-28 bytes: 24 / 240 there
  // cost the layer 1.4% at 4096 tokens (where none ride) on an H100.
  constexpr int kProducerRegs = kRide ? 24 : 40, kConsumerRegs = kRide ? 240 : 232;
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs == kThreads * 168, "the launch's registers, redistributed");
  const int wg = int(threadIdx.x) / 128;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs) : "memory");
    if (threadIdx.x == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&p.xmap)) : "memory");
      if (!kWhole || tok_copy)
        asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&p.xsmap)) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&p.wmap)) : "memory");
      if (kRide) asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&p.xmap2)) : "memory");
      int stage = 0;
      uint32_t phase = 0;
      int tb = 0;
      for (int t = int(blockIdx.x); t < p.tiles_total; t += int(gridDim.x), tb = tb == kS ? 0 : tb + 1) {
        int g, rt, tt;
        find_tile<BN, kRide>(p, t, g, rt, tt);
        const int xrow = p.off[g] + tt * BN, wrow = p.expert[g] * p.n + rt * kRows;
        const bool live1 = rt * kRows + 64 < p.n;                                // the second consumer's rows exist
        const bool extra = kRide && tile_tokens_of(p.m[g], BN, kRide, tt) > BN;  // ride-along tokens
        // Whole-K: the tile's token scales for its epilogue ride with its first
        // stage (read from global memory at the epilogue, under the copies'
        // load, they cost 22% of the GEMM at 16 x 512 on an H100).
        const int ntok = tok_copy ? (extra ? BN + kExtra : BN) : 0;
        const uint32_t tx =
            uint32_t(BN * kBK + (extra ? kExtra * kBK : 0) + (kWhole ? 0 : BN * 4) + (live1 ? 2 : 1) * kWBox);
        for (int kb = 0; kb < p.nkb; ++kb) {
          wait(empty(stage), phase ^ 1u);  // a fresh barrier passes parity 1
          ptx::mbar_arrive_expect_tx(full(stage), tx + (kb == 0 ? uint32_t(ntok * 4) : 0u));
          if (kb == 0)
            for (int c = 0; c < ntok; c += 64)
              ptx::tma_1d(base + uint32_t(tok_buf(tb) + c * 4), &p.xsmap, full(stage), xrow + c);
          ptx::tma_2d(sX + uint32_t(stage * L::xBytes), &p.xmap, full(stage), kb * kBK, xrow);
          if (!kWhole) ptx::tma_2d(sXs + uint32_t(stage * BN * 4), &p.xsmap, full(stage), xrow, kb);
          const uint32_t w0 = sW + uint32_t(stage * 2 * kWBox);
          ptx::tma_2d(w0, &p.wmap, full(stage), kb * 64, wrow);
          if (live1) ptx::tma_2d(w0 + kWBox, &p.wmap, full(stage), kb * 64, wrow + 64);
          if (extra)
            ptx::tma_2d(base + uint32_t(L::offX2 + stage * L::x2Bytes), &p.xmap2, full(stage), kb * kBK, xrow + BN);
          if (++stage == kS) stage = 0, phase ^= 1u;
        }
      }
    } else if (!kWhole && threadIdx.x >= 32) {
      // Warps 1..3: once a stage's X scales land, each consumer's products c =
      // ws * xs of its 64-row group's scale (2^(byte - 133)) and every token's
      // scale, so the consumers' promotion is one FFMA an accumulator.
      const int i = int(threadIdx.x) - 32;
      int stage = 0;
      uint32_t phase = 0;
      for (int t = int(blockIdx.x); t < p.tiles_total; t += int(gridDim.x)) {
        int g, rt, tt;
        find_tile<BN, kRide>(p, t, g, rt, tt);
        const int live = rt * kRows + 64 < p.n ? 2 : 1;
        const uint8_t* gm = p.gmax + (int64_t(p.expert[g]) * (p.n / 64) + rt * 2) * p.nkb;
        for (int kb = 0; kb < p.nkb; ++kb) {
          wait(full(stage), phase);
          const float* xs = reinterpret_cast<const float*>(gbase + L::offXs + stage * BN * 4);
          float* c = reinterpret_cast<float*>(gbase + L::offC + stage * 2 * BN * 4);
          for (int w = 0; w < live; ++w) {
            const int gx = gm[w * p.nkb + kb];
            const float ws = gx >= 7 ? __int_as_float((gx - 6) << 23) : ldexpf(1.f, gx - 133);
            for (int j = i; j < BN; j += 32 * kScaleWarps) c[w * BN + j] = ws * xs[j];
          }
          __syncwarp();
          if ((i & 31) == 0) ptx::mbar_arrive(cready(stage));
          if (++stage == kS) stage = 0, phase ^= 1u;
        }
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs) : "memory");
  const int ct = int(threadIdx.x) - 128;
  // The consumer warpgroup as a value the compiler knows is the same in every
  // lane: the descriptors derived from it stay in uniform registers.
  const int cw = __shfl_sync(0xffffffffu, ct >> 7, 0), warp = (ct >> 5) & 3, lane = ct & 31;
  const int g = lane >> 2, t = lane & 3;
  const int rA = warp * 16 + g, swz = (rA >> 1) & 3;  // local row (and rA + 8), its 64-byte swizzle
  constexpr int NR = BN / 2;                          // accumulators a thread
  float acc[NR], part[kWhole ? 1 : NR], acc2[kRide ? kExtra / 2 : 1];
  if constexpr (!kWhole) {
#pragma unroll
    for (int i = 0; i < NR; ++i) part[i] = 0.f;
  }
  int stage = 0;
  uint32_t phase = 0;
  for (int tile = int(blockIdx.x); tile < p.tiles_total; tile += int(gridDim.x)) {
    int gi, rt, tt;
    find_tile<BN, kRide>(p, tile, gi, rt, tt);
    const int m = p.m[gi], off = p.off[gi], e = p.expert[gi];
    const int wr0 = rt * kRows + cw * 64;  // this warpgroup's first weight row
    if (wr0 >= p.n) {                      // past the last row: keep the ring's count only
      for (int kb = 0; kb < p.nkb; ++kb) {
        wait(full(stage), phase);
        __syncwarp();
        if (lane == 0) ptx::mbar_arrive(empty(stage));
        if (++stage == kS) stage = 0, phase ^= 1u;
      }
      continue;
    }
    const int64_t rowA = int64_t(e) * p.n + wr0 + rA;
    // E8M0 scales as 16-bit pairs (nsub is even): rows A and B, sub-blocks
    // 4kb..4kb+3. A last K block's pair past nsub reads the one before it: its
    // words came as zeros (the copy's bounds), which fold to zero under any scale.
    const uint16_t* scA = reinterpret_cast<const uint16_t*>(p.scales + rowA * p.nsub);
    const uint16_t* scB = scA + 4 * p.nsub;
    const uint8_t* gm = p.gmax + (int64_t(e) * (p.n / 64) + wr0 / 64) * p.nkb;
    const int last_pair = p.nsub / 2 - 1;
    const int gw = kWhole ? int(__ldg(p.gk + int64_t(e) * (p.n / 64) + wr0 / 64)) : 0;  // W's whole-K group byte
    // Loaded a K block ahead of the decoding that uses them, combined only there.
    struct Raw {
      uint32_t a0, a1, b0, b1;
      int g;
    };
    auto load_raw = [&](int kb, Raw& r) {
      const int i0 = 2 * kb, i1 = min(2 * kb + 1, last_pair);
      if (!kRide && (p.probe & 8)) {  // probe: scale bytes without loads
        r.a0 = r.a1 = r.b0 = r.b1 = 0x78787878u + uint32_t(kb & 1);
      } else {
        r.a0 = __ldg(scA + i0), r.a1 = __ldg(scA + i1), r.b0 = __ldg(scB + i0), r.b1 = __ldg(scB + i1);
      }
      r.g = kWhole ? gw : int(__ldg(gm + kb));
    };
    // Stage st's words of this thread folded into A fragments: each sub-block
    // s is one k32 MMA (rows A and B, k 4t.. from the word's first four
    // elements, 16 + 4t.. from its last four).
    auto decode = [&](int st, const Raw& r, uint32_t(&a)[4][4]) {
      const uint8_t* wt = gbase + L::offW + st * 2 * kWBox + cw * kWBox;
      uint32_t wa[4], wb[4];
      int da[4], db[4], dmax = 0;
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const int o = rA * 64 + ((s ^ swz) << 4) + 4 * t;
        wa[s] = *reinterpret_cast<const uint32_t*>(wt + o);
        wb[s] = *reinterpret_cast<const uint32_t*>(wt + o + 8 * 64);
        const uint32_t sa = s < 2 ? r.a0 >> (8 * s) : r.a1 >> (8 * (s - 2));
        const uint32_t sb = s < 2 ? r.b0 >> (8 * s) : r.b1 >> (8 * (s - 2));
        da[s] = min(max(r.g - int(sa & 0xFFu), 0), 31), db[s] = min(max(r.g - int(sb & 0xFFu), 0), 31);
        dmax = max(dmax, max(da[s], db[s]));
      }
      if (!kRide && (p.probe & 2)) {  // probe: the MXFP4 words as they came, no folding
#pragma unroll
        for (int s = 0; s < 4; ++s) a[s][0] = wa[s], a[s][1] = wb[s], a[s][2] = wa[s] >> 4, a[s][3] = wb[s] >> 4;
      } else if (dmax <= kFoldLutNormal) {  // the usual case: every table by exponent arithmetic
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          uint32_t lo, hi;
          fold_lut_normal(da[s], lo, hi);
          const uint2 fa = fold_word(wa[s], lo, hi);
          fold_lut_normal(db[s], lo, hi);
          const uint2 fb = fold_word(wb[s], lo, hi);
          a[s][0] = fa.x, a[s][1] = fb.x, a[s][2] = fa.y, a[s][3] = fb.y;
        }
      } else {
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          uint32_t lo, hi;
          fold_lut(da[s], lo, hi);
          const uint2 fa = fold_word(wa[s], lo, hi);
          fold_lut(db[s], lo, hi);
          const uint2 fb = fold_word(wb[s], lo, hi);
          a[s][0] = fa.x, a[s][1] = fb.x, a[s][2] = fa.y, a[s][3] = fb.y;
        }
      }
    };
    uint32_t a0[4][4], a1[4][4];
    Raw rn, rs;
    load_raw(0, rs);
    if (p.nkb > 1) load_raw(1, rn);
    wait(full(stage), phase);
    __syncwarp();
    decode(stage, rs, a0);
    // On to the next stage; while K block kb's MMAs run, K block kb + 1's
    // words into an (the scales of kb + 2 loaded behind them).
    auto next_stage = [&](int kb, uint32_t(&an)[4][4]) {
      if (++stage == kS) stage = 0, phase ^= 1u;
      if (kb + 1 < p.nkb) {
        wait(full(stage), phase);
        __syncwarp();
        decode(stage, rn, an);
        if (kb + 2 < p.nkb) load_raw(kb + 2, rn);
      }
    };
    if constexpr (kWhole) {
      // A tile's MMAs are N columns wide, the fewest multiple of 32 (at least
      // 64) that holds its tokens (an expert's last tile is mostly short), on
      // the first N / 2 accumulators.
      // The accumulators are zeroed before the K loop rather than by the first
      // MMA's scale-d predicate: with the predicate ptxas serializes the MMAs
      // at N < 256 (warning C7514).
      auto whole_tile = [&]<int N, bool kX>() {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
        ptx::fence_regs(acc);
        if constexpr (kX) {
#pragma unroll
          for (int i = 0; i < kExtra / 2; ++i) acc2[i] = 0.f;
          ptx::fence_regs(acc2);
        }
        // K block kb: its MMAs on a into acc, then (one group left in flight)
        // kb - 1's stage released and its fragments, an, refilled with kb + 1's.
        auto step = [&](int kb, uint32_t(&a)[4][4], uint32_t(&an)[4][4]) {
          const uint32_t dsc = ptx::sw128_desc_lo(sX + uint32_t(stage * L::xBytes));
          const uint32_t dsc2 = ptx::sw128_desc_lo(base + uint32_t(L::offX2 + stage * L::x2Bytes));
          // No fence on acc here: an instruction reading it while a group is in
          // flight would serialize the MMAs; only the MMAs touch it until wait0.
          // No branch either (there was a probe without MMAs): any branch between
          // the fence and the MMAs makes ptxas inject a warpgroup.arrive (C7519).
          ptx::fence_regs(a);
          ptx::wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) {
            wgmma_rs_n<N>(acc, a[kk], ptx::sw128_desc(dsc + 2 * kk));
            if constexpr (kX) wgmma_rs_n<kExtra>(acc2, a[kk], ptx::sw128_desc(dsc2 + 2 * kk));
          }
          ptx::wgmma_commit();
          ptx::wgmma_wait<1>();
          ptx::fence_regs(an);  // kb - 1's MMAs read an until here
          const int prev = stage == 0 ? kS - 1 : stage - 1;
          __syncwarp();
          if (kb > 0 && lane == 0) ptx::mbar_arrive(empty(prev));
          next_stage(kb, an);
        };
        int kb = 0;
        for (; kb + 1 < p.nkb; kb += 2) step(kb, a0, a1), step(kb + 1, a1, a0);
        if (kb < p.nkb) step(kb, a0, a1);
        ptx::wgmma_wait0();
        ptx::fence_regs(acc);
        if constexpr (kX) {
          ptx::fence_regs(acc2);
        } else if constexpr (kRide) {
          // acc2 is stored after every variant (when a tile has ride-along
          // tokens): defined here, its last tile's values are not live through
          // this K loop (ptxas: spills 104 / 108 -> 84 / 96 bytes, loads 144 /
          // 124 -> 36 / 52, with acc2 stored first).
#pragma unroll
          for (int i = 0; i < kExtra / 2; ++i) acc2[i] = 0.f;
        }
        __syncwarp();
        if (lane == 0) ptx::mbar_arrive(empty(stage == 0 ? kS - 1 : stage - 1));
        // Both scales: W's group (2^(byte - 133)) and each token's, from the
        // tile's token-scale buffer (the producer's copy with its first
        // stage), or one scale for every row (x_scale; uniform).
        const float ws = ldexpf(1.f, gw - 133);
        const int left = m - tt * BN - 2 * t;
        // (The K loop's barrier waits clobber memory: these loads stay below it.)
        const float2* xr = reinterpret_cast<const float2*>(gbase + tok_buf(tile / int(gridDim.x) % (kS + 1)) + 8 * t);
        const bool ld = p.xconst <= 0.f;
        const float xk = p.xconst;
        auto xs2 = [&](int i) { return ld ? xr[i] : make_float2(xk, xk); };
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
          const float2 xv = xs2(4 * j);
          const float x0 = 8 * j < left ? ws * xv.x : 0.f, x1 = 8 * j + 1 < left ? ws * xv.y : 0.f;
          acc[4 * j + 0] *= x0, acc[4 * j + 1] *= x1, acc[4 * j + 2] *= x0, acc[4 * j + 3] *= x1;
        }
        if constexpr (kX) {
#pragma unroll
          for (int j = 0; j < kExtra / 8; ++j) {
            const float2 xv = xs2((BN + 8 * j) / 2);
            const float x0 = BN + 8 * j < left ? ws * xv.x : 0.f, x1 = BN + 8 * j + 1 < left ? ws * xv.y : 0.f;
            acc2[4 * j + 0] *= x0, acc2[4 * j + 1] *= x1, acc2[4 * j + 2] *= x0, acc2[4 * j + 3] *= x1;
          }
        }
      };
      static_assert(!kWhole || BN == 256, "whole-K tiles are 256 tokens (narrower MMAs for short ones)");
      const int rows_here = tile_tokens_of(m, BN, kRide, tt);  // up to BN + kExtra in a last tile with kRide
      // (Steps of 32 columns rather than 64: ~10% less MMA work at 4096 tokens'
      // routing, where an expert's one tile holds ~128 tokens, ~3% at 16384's;
      // the layer took 1.2% less at 4096 tokens on an H100, the same at 16384.)
      if (kRide && rows_here > BN)
        whole_tile.template operator()<256, kRide>();
      else if (rows_here > 224)
        whole_tile.template operator()<256, false>();
      else if (rows_here > 192)
        whole_tile.template operator()<224, false>();
      else if (rows_here > 160)
        whole_tile.template operator()<192, false>();
      else if (rows_here > 128)
        whole_tile.template operator()<160, false>();
      else if (rows_here > 96)
        whole_tile.template operator()<128, false>();
      else if (rows_here > 64)
        whole_tile.template operator()<96, false>();
      else
        whole_tile.template operator()<64, false>();
    } else {
#pragma unroll
      for (int i = 0; i < NR; ++i) acc[i] = 0.f;
      // One K block: its MMAs on a (decoded), then, while they run, the next
      // stage's words into an (the next scales' loads go out behind them); then
      // the promotion and the stage's release.
      auto step = [&](int kb, uint32_t(&a)[4][4], uint32_t(&an)[4][4]) {
        const uint32_t dsc = ptx::sw128_desc_lo(sX + uint32_t(stage * L::xBytes));
        ptx::fence_regs(a);
        ptx::wgmma_fence();
        ptx::fence_regs(part);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_rs(part, a[kk], ptx::sw128_desc(dsc + 2 * kk), kk);
        ptx::wgmma_commit();
        const int st = stage;
        const uint32_t cphase = phase;
        next_stage(kb, an);
        ptx::wgmma_wait0();
        ptx::fence_regs(part);
        ptx::fence_regs(a);  // the MMAs read a until here: the next stage's decoding went elsewhere
        // Promotion: acc += part * c[token] (c = ws * xs, the scale warps'). Columns
        // of register quad j: tokens 8j + 2t + {0, 1}; registers 4j+2, 4j+3 are row + 8.
        wait(cready(st), cphase);
        const float2* cv = reinterpret_cast<const float2*>(gbase + L::offC + (st * 2 + cw) * BN * 4);
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          const float2 c = cv[4 * j + t];
          acc[4 * j + 0] = fmaf(part[4 * j + 0], c.x, acc[4 * j + 0]);
          acc[4 * j + 1] = fmaf(part[4 * j + 1], c.y, acc[4 * j + 1]);
          acc[4 * j + 2] = fmaf(part[4 * j + 2], c.x, acc[4 * j + 2]);
          acc[4 * j + 3] = fmaf(part[4 * j + 3], c.y, acc[4 * j + 3]);
        }
        __syncwarp();
        if (lane == 0) ptx::mbar_arrive(empty(st));
      };
      for (int kb = 0; kb < p.nkb; kb += 2) {  // two steps a turn: the fragment arrays stay in registers
        step(kb, a0, a1);
        if (kb + 1 < p.nkb) step(kb + 1, a1, a0);
      }
    }
    // Epilogue: D rows are tokens, columns weight rows. Lanes g and g ^ 1 hold
    // neighbouring weight rows: an even g stores both rows' values of its
    // first token as one bf16 pair, an odd g those of its second.
    const bool odd = g & 1;
    const int col = wr0 + rA - (odd ? 1 : 0);
    uint8_t* const stg = gbase + L::offStg + cw * L::stgBytes;  // with kStageQ
    auto store = [&]<int J>(float(&v)[J * 4], int tok0) {
      if constexpr (kGlu) {
        // The same exchange gives an even g gate (its row) and up (g + 1's) of
        // its first token, an odd g those of its second; rows + 8 are the
        // pair 4 columns on. Column c0's element group is even, so c0 + 4's
        // word is 4 words on in X's register order.
        const int c0 = col >> 1;
        const int at = mxfp4_gemm_x_byte(c0);
        float bg0 = 0.f, bu0 = 0.f, bg1 = 0.f, bu1 = 0.f;
        if (p.bias) {
          const uint16_t* b = p.bias + int64_t(e) * p.n + col;
          bg0 = bf16_to_float(__ldg(b)), bu0 = bf16_to_float(__ldg(b + 1));
          bg1 = bf16_to_float(__ldg(b + 8)), bu1 = bf16_to_float(__ldg(b + 9));
        }
#pragma unroll
        for (int j = 0; j < J; ++j) {
          const float s0 = odd ? v[4 * j + 0] : v[4 * j + 1];
          const float s1 = odd ? v[4 * j + 2] : v[4 * j + 3];
          const float r0 = __shfl_xor_sync(0xffffffffu, s0, 4), r1 = __shfl_xor_sync(0xffffffffu, s1, 4);
          const float g0 = odd ? r0 : v[4 * j + 0], u0 = odd ? v[4 * j + 1] : r0;
          const float g1 = odd ? r1 : v[4 * j + 2], u1 = odd ? v[4 * j + 3] : r1;
          const float o0 = swiglu(g0 + bg0, u0 + bu0) * kGluInv, o1 = swiglu(g1 + bg1, u1 + bu1) * kGluInv;
          const int tok = tok0 + 8 * j + 2 * t + (odd ? 1 : 0);
          if (tok < m) {
            const uint32_t b2 = __nv_cvt_float2_to_fp8x2(make_float2(o0, o1), __NV_SATFINITE, __NV_E4M3);
            uint8_t* row = kStageQ ? stg + (tok - tt * BN) * 32 + (at & 31) : p.q + (int64_t(off) + tok) * p.q_ld + at;
            row[0] = uint8_t(b2), row[16] = uint8_t(b2 >> 8);
          }
        }
        return;
      }
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const float s0 = odd ? v[4 * j + 0] : v[4 * j + 1];
        const float s1 = odd ? v[4 * j + 2] : v[4 * j + 3];
        const float r0 = __shfl_xor_sync(0xffffffffu, s0, 4), r1 = __shfl_xor_sync(0xffffffffu, s1, 4);
        const int tok = tok0 + 8 * j + 2 * t + (odd ? 1 : 0);
        if (tok < m) {
          __nv_bfloat16* row = p.d + (int64_t(off) + tok) * p.n + col;
          *reinterpret_cast<__nv_bfloat162*>(row) =
              odd ? __floats2bfloat162_rn(r0, v[4 * j + 1]) : __floats2bfloat162_rn(v[4 * j + 0], r0);
          *reinterpret_cast<__nv_bfloat162*>(row + 8) =
              odd ? __floats2bfloat162_rn(r1, v[4 * j + 3]) : __floats2bfloat162_rn(v[4 * j + 2], r1);
        }
      }
    };
    if (!kRide && (p.probe & 1)) continue;  // probe: no stores
    // Staged (the activation's outputs): each warp's bytes of a token are 8
    // of the warpgroup's 32, so stored directly a warp's store touches 8 rows'
    // sectors for 32 bytes; through shared memory a row's 32 bytes go as two
    // 16-byte stores. The warpgroup's named barrier (2 + cw) orders the
    // buffer's reuse and its reads.
    const int rows_here = tile_tokens_of(m, BN, kRide, tt);  // (again: not held through the K loop)
    if constexpr (kStageQ) ptx::named_sync(2 + cw, 128);
    if constexpr (kRide)  // first: acc2 is dead while acc is stored
      if (rows_here > BN) store.template operator()<kExtra / 8>(acc2, tt * BN + BN);
    store.template operator()<BN / 8>(acc, tt * BN);
    if constexpr (kStageQ) {
      ptx::named_sync(2 + cw, 128);
      uint8_t* const q0 = p.q + (int64_t(off) + tt * BN) * p.q_ld + wr0 / 2;
      // Not unrolled: unrolled, ptxas spills 232 bytes in the ride-along kernel
      // (72 rolled, fewer than the unstaged kernel's 84).
#pragma unroll 1
      for (int i = ct & 127; i < 2 * rows_here; i += 128)
        *reinterpret_cast<uint4*>(q0 + int64_t(i >> 1) * p.q_ld + (i & 1) * 16) =
            *reinterpret_cast<const uint4*>(stg + i * 16);
    }
  }
#else
  if (threadIdx.x == 0 && blockIdx.x == 0) printf("mxfp4_gemm: kernel built without sm_90a\n");
  __trap();
#endif
}

// The tile sizes and their instantiations: scales by K block, then whole-K
// scales (one tile of 256 tokens, its MMAs as wide as a tile's tokens need;
// without and with ride-along tokens), then the same with the activation in
// the epilogue, then that with its outputs staged in shared memory.
constexpr int kTileTokens[4][3] = {{64, 128, 160}, {256, 256, 0}, {256, 256, 0}, {256, 256, 0}};
void (*const kKernels[4][3])(Params) = {
    {mxfp4_gemm_kernel<64, false, false, false>, mxfp4_gemm_kernel<128, false, false, false>,
     mxfp4_gemm_kernel<160, false, false, false>},
    {mxfp4_gemm_kernel<256, true, false, false>, mxfp4_gemm_kernel<256, true, true, false>, nullptr},
    {mxfp4_gemm_kernel<256, true, false, true>, mxfp4_gemm_kernel<256, true, true, true>, nullptr},
    {mxfp4_gemm_kernel<256, true, false, true, true>, mxfp4_gemm_kernel<256, true, true, true, true>, nullptr}};
constexpr int kSmemBytes[4][3] = {
    {Smem<64, false, false>::bytes, Smem<128, false, false>::bytes, Smem<160, false, false>::bytes},
    {Smem<256, true, false>::bytes, Smem<256, true, true>::bytes, 0},
    {Smem<256, true, false>::bytes, Smem<256, true, true>::bytes, 0},
    {Smem<256, true, false, true>::bytes, Smem<256, true, true, true>::bytes, 0}};

// Whether whole-K tiles of bn tokens take ride-along tokens: the ride-along
// buffer costs a stage of the ring (5 -> 4: 16 x 512 tokens 1089 -> 962
// TFLOP/s on an H100), so only where it saves more than a tenth of the tiles.
bool ride_pays(const int* counts, int groups, int bn) {
  int64_t plain = 0, ride = 0;
  for (int gi = 0; gi < groups; ++gi)
    plain += token_tiles(counts[gi], bn, false), ride += token_tiles(counts[gi], bn, true);
  return ride * 10 < plain * 9;
}

bool aligned(const void* q, uintptr_t a) { return (reinterpret_cast<uintptr_t>(q) & (a - 1)) == 0; }

}  // namespace

// The same build and device test as the grouped FP8 GEMM's: both kernels come
// from one compilation for sm_90a and need an sm_90 device.
bool Mxfp4Gemm::supported() { return Fp8GroupedGemm::supported(); }

// The tile whose padded work is least: each group's token tiles, each costing
// its tokens plus a fixed share (the weight decoding and the K loop's own
// work, as many tokens' MMAs: kTileFixed). H200, 16 experts x 64 tokens in
// tiles of 64: 0.111 ms; x 128 in tiles of 128 / 160: 0.139 / 0.155 ms: ~194
// tokens' worth a tile plus one per token (2026-12-04-h200-run218.md).
int Mxfp4Gemm::pick_tile_tokens(const int* counts, int groups, bool whole_k) {
  constexpr int64_t kTileFixed = 192;
  int best = kTileTokens[whole_k][0];
  int64_t best_cost = -1;
  for (int i = 0; i < (whole_k ? 1 : 3); ++i) {
    const int bn = kTileTokens[whole_k][i];
    int64_t cost = 0;
    for (int gi = 0; gi < groups; ++gi) cost += (int64_t(counts[gi]) + bn - 1) / bn * (bn + kTileFixed);
    if (best_cost < 0 || cost < best_cost) best = bn, best_cost = cost;
  }
  return best;
}

Mxfp4Gemm::Mxfp4Gemm() {
  debug_ = grouped_gemm_debug();
  if (!supported()) return;  // run() says why
  n_sm_ = current_device_sms();
  if (const char* v = std::getenv("DZ_MXFP4_GEMM_STAGE_Q")) stage_q_default_ = std::atoi(v) != 0;
  for (int w = 0; w < 4; ++w)
    for (int i = 0; i < 3; ++i)
      if (kKernels[w][i])
        DZ_CUDA_CHECK(
            cudaFuncSetAttribute(kKernels[w][i], cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes[w][i]));
}

void Mxfp4Gemm::run(const Mxfp4GemmArgs& a, cudaStream_t s) {
  check(supported(), DZ_ERR_UNSUPPORTED, "mxfp4_gemm needs an sm_90 device and a build with sm_90a");
  check(a.n > 0 && a.n % 64 == 0 && a.k > 0 && a.k % kBK == 0, DZ_ERR_INVALID_ARGUMENT, "mxfp4_gemm: n=", a.n,
        " k=", a.k, " (n must be a multiple of 64, k of 128)");
  check(a.groups >= 0 && (a.groups == 0 || (a.offsets && a.counts && a.experts)) && a.rows_total >= 0 &&
            a.rows_total < (int64_t(1) << 31),
        DZ_ERR_INVALID_ARGUMENT, "mxfp4_gemm: groups=", a.groups, " rows_total=", a.rows_total);
  const bool whole = a.gk != nullptr;
  check(a.w.blocks && a.w.scales && (whole || a.w.gmax), DZ_ERR_INVALID_ARGUMENT,
        "mxfp4_gemm: the MXFP4 stack needs blocks, scales and a group table (gmax, or gk for whole-K scales)");
  check(a.w.rows == a.n && a.w.k % 64 == 0 && a.w.k > a.k - kBK && a.w.k <= a.k, DZ_ERR_INVALID_ARGUMENT,
        "mxfp4_gemm: MXFP4 weights of ", a.w.rows, " x ", a.w.k, " for n=", a.n, " k=", a.k,
        " (rows must equal n, K a multiple of 64 that pads to k)");
  check(a.w_experts > 0, DZ_ERR_INVALID_ARGUMENT, "mxfp4_gemm: w_experts=", a.w_experts);
  for (int gi = 0; gi < a.groups; ++gi) {
    check(a.counts[gi] >= 0 && a.offsets[gi] >= 0 && int64_t(a.offsets[gi]) + a.counts[gi] <= a.rows_total,
          DZ_ERR_INVALID_ARGUMENT, "mxfp4_gemm: group ", gi, " rows [", a.offsets[gi], ", ",
          int64_t(a.offsets[gi]) + a.counts[gi], ") outside the ", a.rows_total, " rows of X and D");
    check(a.experts[gi] >= 0 && a.experts[gi] < a.w_experts, DZ_ERR_INVALID_ARGUMENT, "mxfp4_gemm: group ", gi,
          " names expert ", a.experts[gi], " of ", a.w_experts);
    // A tile's X scales come by tensor copy, whose first element must be 16-byte aligned.
    check(a.counts[gi] == 0 || a.offsets[gi] % 4 == 0, DZ_ERR_INVALID_ARGUMENT, "mxfp4_gemm: group ", gi,
          " starts at row ", a.offsets[gi], " (groups must start at a multiple of 4 rows)");
  }
  int64_t rows_used = 0;
  for (int gi = 0; gi < a.groups; ++gi) rows_used += a.counts[gi];
  if (rows_used == 0) return;
  const bool glu = a.q != nullptr, fixed = whole && a.x_scale > 0.f;
  check(a.x && (a.xs || fixed) && (glu ? !a.d : a.d != nullptr), DZ_ERR_INVALID_ARGUMENT,
        "mxfp4_gemm: null pointer (X, its scales or x_scale with whole-K scales, and one of D or q)");
  check(!glu || (whole && a.q_ld >= a.n / 2), DZ_ERR_INVALID_ARGUMENT,
        "mxfp4_gemm: the activation in the epilogue (q) needs whole-K scales and q_ld >= n / 2 (q_ld=", a.q_ld,
        ", n=", a.n, ")");
  check(whole || (a.xs_ld >= a.rows_total && a.xs_ld % 4 == 0), DZ_ERR_INVALID_ARGUMENT, "mxfp4_gemm: xs_ld=", a.xs_ld,
        " (at least rows_total ", a.rows_total, ", a multiple of 4)");
  check(aligned(a.x, 16) && aligned(a.xs, 16) && aligned(a.d, 4) && aligned(a.w.blocks, 16) && aligned(a.w.scales, 2) &&
            aligned(a.bias, 2),
        DZ_ERR_INVALID_ARGUMENT,
        "mxfp4_gemm: X, its scales and the MXFP4 blocks must be 16-byte aligned, D 4-byte, the E8M0 scales 2-byte");
  const int bn = a.tile_tokens ? a.tile_tokens : pick_tile_tokens(a.counts, a.groups, whole);
  int ti = -1;
  for (int i = 0; i < (whole ? 1 : 3); ++i)
    if (kTileTokens[whole][i] == bn) ti = i;
  const bool ride = whole && ti >= 0 && (a.ride_along > 0 || (a.ride_along == 0 && ride_pays(a.counts, a.groups, bn)));
  if (ride) ti = 1;
  last_ride_ = ride;
  check(ti >= 0, DZ_ERR_INVALID_ARGUMENT, "mxfp4_gemm: tile_tokens=", a.tile_tokens,
        whole ? " (0 or 256 with whole-K scales)" : " (0, 64, 128 or 160)");
  last_bn_ = bn;
  const int nkb = a.k / kBK;

  Params p{};
  {
    const cuuint64_t dims[2] = {cuuint64_t(a.k), cuuint64_t(a.rows_total)}, strides[1] = {cuuint64_t(a.k)};
    const cuuint32_t box[2] = {kBK, cuuint32_t(bn)};
    encode_tensor_map(&p.xmap, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, a.x, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B,
                      "X");
    if (ride) {
      const cuuint32_t box2[2] = {kBK, cuuint32_t(kExtra)};
      encode_tensor_map(&p.xmap2, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, a.x, dims, strides, box2,
                        CU_TENSOR_MAP_SWIZZLE_128B, "X (ride-along tokens)");
    }
  }
  if (!whole) {
    const cuuint64_t dims[2] = {cuuint64_t(a.xs_ld), cuuint64_t(nkb)}, strides[1] = {cuuint64_t(a.xs_ld) * 4};
    const cuuint32_t box[2] = {cuuint32_t(bn), 1};
    encode_tensor_map(&p.xsmap, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, a.xs, dims, strides, box,
                      CU_TENSOR_MAP_SWIZZLE_NONE, "X scales");
  } else if (!fixed) {  // a tile's token scales, 64 a copy
    const cuuint64_t dims[1] = {cuuint64_t(a.rows_total)}, unused[1] = {(cuuint64_t(a.rows_total) * 4 + 15) / 16 * 16};
    const cuuint32_t box[1] = {64};
    encode_tensor_map(&p.xsmap, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 1, a.xs, dims, unused, box, CU_TENSOR_MAP_SWIZZLE_NONE,
                      "X row scales");
  }
  {
    const cuuint64_t row_bytes = cuuint64_t(a.w.k / 2);
    const cuuint64_t dims[2] = {row_bytes, cuuint64_t(a.w_experts) * cuuint64_t(a.n)}, strides[1] = {row_bytes};
    const cuuint32_t box[2] = {64, 64};
    encode_tensor_map(&p.wmap, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, a.w.blocks, dims, strides, box,
                      CU_TENSOR_MAP_SWIZZLE_64B, "MXFP4 blocks");
  }
  p.d = static_cast<__nv_bfloat16*>(a.d);
  p.scales = a.w.scales, p.gmax = a.w.gmax;
  p.gk = a.gk;
  p.xconst = fixed ? a.x_scale : 0.f;
  p.q = a.q, p.bias = glu ? a.bias : nullptr, p.q_ld = a.q_ld;
  p.n = a.n, p.nkb = nkb, p.nsub = int(a.w.k / 32), p.probe = a.probe;
  // (Staged stores are 16 bytes: a q or q_ld not aligned to them stores bytes.)
  const bool stage_q =
      glu && (a.stage_q >= 0 ? a.stage_q != 0 : stage_q_default_) && aligned(a.q, 16) && a.q_ld % 16 == 0;
  const int row_tiles = (a.n + kRows - 1) / kRows;
  for (int g0 = 0; g0 < a.groups; g0 += kMaxGroups) {
    const int G = std::min(kMaxGroups, a.groups - g0);
    p.groups = G;
    int tiles = 0;
    for (int gi = 0; gi < G; ++gi) {
      p.off[gi] = a.offsets[g0 + gi];
      p.expert[gi] = a.experts[g0 + gi];
      p.m[gi] = a.counts[g0 + gi];
      p.tile_start[gi] = tiles;
      tiles += token_tiles(p.m[gi], bn, ride) * row_tiles;
    }
    p.tile_start[G] = tiles;
    p.tiles_total = tiles;
    if (tiles == 0) continue;
    const int blocks = a.max_blocks > 0 ? std::min(a.max_blocks, n_sm_) : n_sm_;
    const int kind = glu ? (stage_q ? 3 : 2) : whole ? 1 : 0;
    kKernels[kind][ti]<<<dim3(unsigned(std::min(tiles, blocks))), dim3(kThreads), kSmemBytes[kind][ti], s>>>(p);
    DZ_CUDA_LAUNCH_CHECK();
    if (debug_) grouped_gemm_sync(s);
  }
}

}  // namespace dz::cuda
