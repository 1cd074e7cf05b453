// One token through gpt-oss's MXFP4 experts as a stream of their bytes
// (moe_one_token.h says how).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>

#include "common/error.h"
#include "cuda/moe_decode.cuh"
#include "cuda/moe_one_token.h"
#include "cuda/pdl.cuh"
#include "cuda/ptx.cuh"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {

constexpr int kMaxStages = 8;  // a block's ring, all groups
constexpr int kMaxConsumerWarps = 16;
constexpr int kMaxTopk = 8;
constexpr int kImgSub = 64;  // bytes of a sub-block's activations: 32 fp16 in the MMAs' order (img_pos)

// One projection's weights and its units' shape.
struct Proj {
  const uint8_t* blocks;  // [E][rows][nsub][16]
  const uint8_t* scales;  // [E][rows][nsub]
  const uint16_t* bias;   // bf16 [E][rows], or null
  int rows, nsub, row_stride;
};

// Shared memory of a launch: a ring of units for each group (stages a
// group: 16 rows padded to the projection's row_stride bytes, then their 16 x
// nsub scale bytes and 16 bf16 biases; a stage fits either projection), the
// token's image (gate_up), down's images of every slot (down: brought by the
// image warp once a slot's gate_up units are done), the groups' partial sums
// (two buffers a group: its next unit may write while its first warp still
// reads), each down tile's slot outputs and a count of them, the input's
// maximum a warp, the routed expert ids and weights, and the barriers (the
// rings', an image's). A ring a group, not one shared ring: a group waits for
// its own k-th unit, never a phase of a stage another group has not yet seen
// arrive (a parity wait cannot tell phase n - 1 from phase n + 1).
struct Layout {
  int stage_bytes, stages, ximg, simg, red, tiles, part, tcnt, misc, bar, total;
};

constexpr int stage_bytes_of(int nsub) { return (16 * (nsub * 16 + 16) + 16 * nsub + 32 + 127) / 128 * 128; }
constexpr int kMiscBytes = 4 * kMaxConsumerWarps + 8 * kMaxTopk;  // warps' maxima, the ids, the routing weights

// A launch over gate_up's units (gate_up), down's (down) or both on a grid
// of blocks; stages a group: 0 as many as fit (the block's up to kMaxStages).
Layout layout(const MoeShape& s, bool gate_up, bool down, int groups, int warps, int stages, int blocks,
              int smem_limit) {
  const int nh = s.hidden / 32, ni = s.intermediate / 32;
  Layout L{};
  L.stage_bytes = std::max(gate_up ? stage_bytes_of(nh) : 0, down ? stage_bytes_of(ni) : 0);
  L.tiles = down ? one_token_plan(s, blocks).max_down_tiles() : 0;
  const int ximg = gate_up ? nh * kImgSub : 0, simg = down ? s.topk * ni * kImgSub : 0;
  const int red = groups * 2 * warps * 16 * 4, part = L.tiles * s.topk * 16 * 4, tcnt = (L.tiles * 4 + 15) / 16 * 16;
  const int fixed = ximg + simg + red + part + tcnt + kMiscBytes + 2 * kMaxStages * 8 + kMaxTopk * 8;
  L.stages = std::min(kMaxStages, (smem_limit - fixed) / L.stage_bytes) / groups;
  if (stages > 0 && stages < L.stages) L.stages = stages;
  int o = groups * L.stages * L.stage_bytes;
  L.ximg = o, o += ximg;
  L.simg = o, o += simg;
  L.red = o, o += red;
  L.part = o, o += part;
  L.tcnt = o, o += tcnt;
  L.misc = o, o += kMiscBytes;
  L.bar = o, o += 2 * groups * L.stages * 8 + s.topk * 8;
  L.total = o;
  return L;
}

struct Args {
  Proj p[2];  // gate_up, down
  int n_experts, topk;
  const int* ids;   // [topk]
  const float* x;   // the token [hidden]
  uint8_t* img;     // down's activation images [topk][intermediate / 32][kImgSub]
  const float* gw;  // [topk]
  // [topk] gate_up units done a slot, [1] blocks whose images are in: zero
  // between calls (the last block to bring its images resets them).
  int *slot_done, *images_in;
  float* out;  // [hidden]
  int accumulate;
  int probe;         // OneTokenConfig::probe
  long long* trace;  // OneTokenConfig::trace
  int* err;
  bool gate_up, down;  // the projections this launch streams
  OneTokenPlan plan;
  Layout L;
};

// Element e (0..31) of a sub-block's image, as fp16: lane t of a quad takes
// word t of the sub-block's weights (elements 8t + j), decoded by w4_pairs
// into pairs (j, j + 4); its two MMAs h = 0, 1 take pairs 2h (k 2t, 2t + 1)
// and 2h + 1 (k 8 + 2t, ..), so the lane finds its B fragments for both as 16
// bytes at 16t: pair j at 4j, its element j + 4 in the high half.
__device__ __forceinline__ int img_pos(int e) { return (e >> 3) * 16 + (e & 3) * 4 + ((e >> 2) & 1) * 2; }

__device__ __forceinline__ void img_put(uint8_t* sub, int e, float f) {
  *reinterpret_cast<__half*>(sub + img_pos(e)) = __float2half_rn(f);
}

// Diagnostics (OneTokenConfig::trace): the time of event k of the block's unit i.
__device__ __forceinline__ void trace_at(const Args& a, int i, int k) {
  a.trace[(int64_t(blockIdx.x) * kOneTokenTraceUnits + i) * 3 + k] = (long long)ptx::globaltimer();
}

// This block's units in this launch: positions [i0, i1) of its plan (its
// gate_up units, then its down units).
struct Span {
  int i0, i1, ng;  // ng: its gate_up units
};
__device__ __forceinline__ Span span_of(const Args& a) {
  const int b = int(blockIdx.x), ng = a.plan.gate_up_units(b), nd = a.plan.down_tiles(b) * a.topk;
  return {a.gate_up ? 0 : ng, a.down ? ng + nd : ng, ng};
}

using Unit = OneTokenPlan::Unit;
__device__ __forceinline__ Unit unit_at(const Args& a, const Span& sp, int i) {
  return a.plan.unit(int(blockIdx.x), i, sp.ng);
}

// One warp's share [sb0, sb1) of a unit's sub-blocks: rows g and g + 8 of
// the stage (word t of each sub-block, E2M1 -> fp16 * 2^-14 exactly) against
// the token's fp16 image (xi: this lane's 16 bytes), in fp32 times each
// sub-block's scale. fp16 MMAs: Hopper runs mma.sync on E4M3 as two fp16
// MMAs after converting both operands. (Loading the image in MMA column 0's
// lanes only and two scale bytes at once was slower: run 30.)
__device__ __forceinline__ void unit_dot(const uint8_t* stage, int row_stride, int nsub, const uint8_t* xi, int sb0,
                                         int sb1, int g, int t, float& accA, float& accB) {
  const uint8_t* wA = stage + g * row_stride + 4 * t;
  const uint8_t* wB = wA + 8 * row_stride;
  const uint8_t* sA = stage + 16 * row_stride + g * nsub;
  const uint8_t* sB = sA + 8 * nsub;
#pragma unroll 4
  for (int sb = sb0; sb < sb1; ++sb) {
    const uint32_t wa = *reinterpret_cast<const uint32_t*>(wA + 16 * sb);
    const uint32_t wb = *reinterpret_cast<const uint32_t*>(wB + 16 * sb);
    const uint4 xv = *reinterpret_cast<const uint4*>(xi + kImgSub * sb);
    uint32_t pA[4], pB[4];
    w4_pairs(wa, pA), w4_pairs(wb, pB);
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    ptx::mma_16816(c, pA[0], pB[0], pA[1], pB[1], xv.x, xv.y);
    ptx::mma_16816(c, pA[2], pB[2], pA[3], pB[3], xv.z, xv.w);
    // Column 0 (lanes t = 0) is the token; E8M0 byte s as 2^(s - 127) (s = 0, 2^-127, reads as 0).
    accA = fmaf(c[0], __uint_as_float(uint32_t(sA[sb]) << 23), accA);
    accB = fmaf(c[2], __uint_as_float(uint32_t(sB[sb]) << 23), accB);
  }
}

// kGroups groups of kWarps consumer warps take the block's units in turn
// (the n-th to group n mod kGroups); a group's warps split each unit's K
// range. Warp 0 streams the units (the copy engine); warp 1 brings down's
// images, each slot's once its gate_up units are done (all blocks resident:
// one an SM). A launch over both projections streams down's units right
// after gate_up's, so the ring already holds them while the last gate_up
// units finish. Nothing on the producer's path reads global memory but the
// weights: under the stream's load a read takes microseconds (the router's
// ids, read a unit, held the ring well below HBM's rate: run 26 in
// bench/results/2026-12-06-h100-one-token-stream.md).
template <int kGroups, int kWarps>
__global__ void __launch_bounds__(32 * (2 + kGroups * kWarps), 1) one_token_kernel(const Args a) {
  constexpr int kConsumers = 32 * kGroups * kWarps;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) uint8_t sm[];
  const Layout& L = a.L;
  const int warp = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31);
  if (a.trace && threadIdx.x == 0) trace_at(a, kOneTokenTraceUnits - 1, 0);
  const uint32_t bar0 = ptx::smem_u32(sm + L.bar);
  const int n_stages = kGroups * L.stages;  // group q's stages: q * L.stages ..
  auto full = [&](int s) { return bar0 + 8u * uint32_t(s); };
  auto empty = [&](int s) { return bar0 + 8u * uint32_t(n_stages + s); };
  auto imaged = [&](int k) { return bar0 + 8u * uint32_t(2 * n_stages + k); };  // slot k's image in place
  float* misc = reinterpret_cast<float*>(sm + L.misc);
  int* ids = reinterpret_cast<int*>(sm + L.misc + 4 * kMaxConsumerWarps);  // valid expert or -1, a slot
  float* gws = misc + kMaxConsumerWarps + kMaxTopk;                        // the slots' routing weights
  int* tcnt = reinterpret_cast<int*>(sm + L.tcnt);                         // slots summed, a down tile
  float* part = reinterpret_cast<float*>(sm + L.part);                     // [tile][slot][16] down's outputs
  const int ni = a.p[1].nsub;
  if (threadIdx.x == 0) {
    for (int s = 0; s < n_stages; ++s) ptx::mbar_init(full(s), 1), ptx::mbar_init(empty(s), kWarps);
    for (int k = 0; k < a.topk; ++k) ptx::mbar_init(imaged(k), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (int(threadIdx.x) < L.tiles) tcnt[threadIdx.x] = 0;
  pdl_wait(), pdl_trigger();  // everything reads the router's ids
  if (int(threadIdx.x) < a.topk) {
    const int e = a.ids[threadIdx.x];
    ids[threadIdx.x] = e >= 0 && e < a.n_experts ? e : -1;
    gws[threadIdx.x] = a.gw[threadIdx.x];
  }
  __syncthreads();
  const Span sp = span_of(a);
  const int U1 = a.plan.U1;
  if (warp == 0) {  // producer
    if (a.gate_up && blockIdx.x == 0 && lane < a.topk && ids[lane] < 0) atomicOr(a.err, 1);
    const uint32_t ring = ptx::smem_u32(sm);
    for (int i = sp.i0; i < sp.i1; ++i) {
      const int n = i - sp.i0, k = n / kGroups, st = (n % kGroups) * L.stages + k % L.stages, m = k / L.stages;
      if (m > 0) ptx::mbar_wait(empty(st), uint32_t(m - 1) & 1);
      if (a.trace && n < kOneTokenTraceUnits - 1 && lane == 0) trace_at(a, n, 0);
      const Unit un = unit_at(a, sp, i);
      const Proj& P = a.p[un.proj];
      const int e = max(ids[un.slot], 0);  // an invalid slot streams expert 0, never summed
      const int64_t row0 = int64_t(e) * P.rows + 16 * un.tile;
      const uint32_t dst = ring + uint32_t(st * L.stage_bytes), row_bytes = uint32_t(P.nsub) * 16;
      const uint32_t sc_bytes = 16 * uint32_t(P.nsub), bias_bytes = P.bias ? 32 : 0;
      if (lane == 0) ptx::mbar_arrive_expect_tx(full(st), 16 * row_bytes + sc_bytes + bias_bytes);
      __syncwarp();
      if (lane < 16)
        ptx::bulk_g2s(dst + uint32_t(lane * P.row_stride), P.blocks + (row0 + lane) * row_bytes, row_bytes, full(st));
      if (lane == 16) ptx::bulk_g2s(dst + uint32_t(16 * P.row_stride), P.scales + row0 * P.nsub, sc_bytes, full(st));
      if (lane == 17 && bias_bytes)
        ptx::bulk_g2s(dst + uint32_t(16 * P.row_stride) + sc_bytes, P.bias + row0, bias_bytes, full(st));
    }
    return;
  }
  uint8_t* simg = sm + L.simg;
  if (warp == 1) {  // down's images: lane k brings slot k's (a down tile reads every slot)
    if (!a.down) return;
    if (lane < a.topk && sp.i1 > sp.ng) {
      const volatile int* done = a.slot_done + lane;
      const bool wait = !(a.probe & OneTokenConfig::kProbeNoWait);
      while (wait && *done < U1 / a.topk) __nanosleep(64);
      __threadfence();
      asm volatile("fence.proxy.async.global;" ::: "memory");  // the copy engine reads what the stores wrote
      const uint32_t bytes = uint32_t(ni * kImgSub);
      ptx::mbar_arrive_expect_tx(imaged(lane), bytes);
      ptx::bulk_g2s(ptx::smem_u32(simg) + uint32_t(lane) * bytes, a.img + int64_t(lane) * bytes, bytes, imaged(lane));
      while (!wait && *done < U1 / a.topk) __nanosleep(64);  // (the probe: the counts complete before the reset)
    }
    __syncwarp();
    // Every block past its waits: the last resets the counts for the next call.
    if (lane == 0 && atomicAdd(a.images_in, 1) == int(gridDim.x) - 1) {
      for (int k = 0; k < a.topk; ++k) a.slot_done[k] = 0;
      *a.images_in = 0;
    }
    return;
  }
  const int cw = warp - 2, grp = cw / kWarps, wq = cw % kWarps, g = lane >> 2, t = lane & 3;
  const int ct = int(threadIdx.x) - 64;
  uint8_t* ximg = sm + L.ximg;
  float* red = reinterpret_cast<float*>(sm + L.red);
  float post_gate_up = 0.f;  // what gate_up's MMA sums are multiplied by: E2M1's 2^-14 and the token's scale undone
  if (a.gate_up) {
    // The token in fp16 under one power-of-two scale, |x| / scale <= 1 (as the W4A16 kernels).
    const int H = a.p[0].nsub * 32;
    float amax = 0.f;
    for (int k = 4 * ct; k < H; k += 4 * kConsumers) {
      const float4 v = *reinterpret_cast<const float4*>(a.x + k);
      amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, o));
    if (lane == 0) misc[cw] = amax;
    ptx::named_sync(1, kConsumers);
    amax = 0.f;
    for (int w = 0; w < kGroups * kWarps; ++w) amax = fmaxf(amax, misc[w]);
    const float sx = pow2_scale(amax), inv = 1.f / sx;
    for (int k = 4 * ct; k < H; k += 4 * kConsumers) {
      const float4 v = *reinterpret_cast<const float4*>(a.x + k);
      uint8_t* sub = ximg + (k >> 5) * kImgSub;
      img_put(sub, (k & 31) + 0, v.x * inv), img_put(sub, (k & 31) + 1, v.y * inv);
      img_put(sub, (k & 31) + 2, v.z * inv), img_put(sub, (k & 31) + 3, v.w * inv);
    }
    post_gate_up = 16384.f * sx;
    ptx::named_sync(1, kConsumers);
  }
  const int gbar = 2 + grp, gthreads = 32 * kWarps;
  for (int i = sp.i0 + grp, it = 0; i < sp.i1; i += kGroups, ++it) {
    const int n = i - sp.i0;
    const Unit un = unit_at(a, sp, i);
    const Proj& P = a.p[un.proj];
    if (un.proj == 1) ptx::mbar_wait(imaged(un.slot), 0);  // the slot's activations (one phase a launch)
    const int k = n / kGroups, st = grp * L.stages + k % L.stages;
    ptx::mbar_wait(full(st), uint32_t(k / L.stages) & 1);
    if (a.trace && n < kOneTokenTraceUnits - 1 && wq == 0 && lane == 0) trace_at(a, n, 1);
    const uint8_t* xi = (un.proj ? simg + un.slot * ni * kImgSub : ximg) + t * 16;  // (column 0 read)
    const int per = (P.nsub + kWarps - 1) / kWarps, sb0 = min(P.nsub, wq * per), sb1 = min(P.nsub, sb0 + per);
    // This tile's biases (16 bf16 after the scale bytes), read before the stage is released.
    const uint16_t* sbias =
        reinterpret_cast<const uint16_t*>(sm + st * L.stage_bytes + 16 * P.row_stride + 16 * P.nsub);
    const float bias = P.bias && wq == 0 && lane < 16 ? bf16_to_float(sbias[lane]) : 0.f;
    float accA = 0.f, accB = 0.f;
    if (!(a.probe & OneTokenConfig::kProbeNoMath))
      unit_dot(sm + st * L.stage_bytes, P.row_stride, P.nsub, xi, sb0, sb1, g, t, accA, accB);
    __syncwarp();
    if (lane == 0) ptx::mbar_arrive(empty(st));
    if (a.trace && n < kOneTokenTraceUnits - 1 && wq == 0 && lane == 0) trace_at(a, n, 2);
    float* rr = red + (grp * 2 + (it & 1)) * kWarps * 16;
    if (t == 0) rr[wq * 16 + g] = accA, rr[wq * 16 + g + 8] = accB;
    ptx::named_sync(gbar, gthreads);
    if (wq != 0) continue;
    const float post = un.proj ? 16384.f : post_gate_up;
    auto row_sum = [&](int r) {  // the warps' parts in order
      float v = rr[r];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) v += rr[16 * w + r];
      return v * post;
    };
    if (un.proj == 0) {
      const float bg = __shfl_sync(~0u, bias, 2 * lane & 15), bu = __shfl_sync(~0u, bias, (2 * lane + 1) & 15);
      if (lane < 8) {  // gate / up pairs: rows 2 lane and 2 lane + 1
        const float gate = row_sum(2 * lane) + bg;
        const float up = row_sum(2 * lane + 1) + bu;
        const int o = 8 * un.tile + lane;
        img_put(a.img + (int64_t(un.slot) * ni + (o >> 5)) * kImgSub, o & 31, swiglu(gate, up));  // |a| <= 56
      }
      __threadfence();  // the images visible before the unit counts as done
      __syncwarp();
      if (lane == 0) atomicAdd(a.slot_done + un.slot, 1);
      continue;
    }
    // Down: this slot's 16 outputs beside the tile's other slots; the last of them sums the tile.
    const int tl = a.plan.down_local(int(blockIdx.x), i - sp.ng);  // the block's down tile
    if (lane < 16) part[(tl * a.topk + un.slot) * 16 + lane] = row_sum(lane) + bias;
    __threadfence_block();
    __syncwarp();
    int last = 0;
    if (lane == 0) last = atomicAdd(tcnt + tl, 1) == a.topk - 1;
    if (!__shfl_sync(~0u, last, 0)) continue;
    __threadfence_block();
    if (lane < 16) {  // the slots in slot order (the same bits whichever group is last)
      const int r = 16 * un.tile + lane;
      float acc = 0.f;
      for (int k = 0; k < a.topk; ++k)
        if (ids[k] >= 0) acc += gws[k] * part[(tl * a.topk + k) * 16 + lane];
      if (a.accumulate) acc += a.out[r];
      a.out[r] = acc;
    }
    if (a.trace && lane == 0) trace_at(a, kOneTokenTraceUnits - 1, 2);  // (the block's last tile sum)
  }
  if (a.trace && wq == 0 && lane == 0)  // the block's last group done
    atomicMax(reinterpret_cast<unsigned long long*>(a.trace) +
                  (int64_t(blockIdx.x) * kOneTokenTraceUnits + kOneTokenTraceUnits - 1) * 3 + 1,
              (unsigned long long)ptx::globaltimer());
#endif
}

// An attribute of the current device, read once a device.
template <cudaDeviceAttr kAttr>
int device_attr() {
  static std::atomic<int> cache[64];  // 0: not read yet (the attributes read here are positive)
  int dev = 0;
  DZ_CUDA_CHECK(cudaGetDevice(&dev));
  const bool cached = dev >= 0 && dev < 64;
  int v = cached ? cache[dev].load(std::memory_order_relaxed) : 0;
  if (v == 0) {
    DZ_CUDA_CHECK(cudaDeviceGetAttribute(&v, kAttr, dev));
    if (cached) cache[dev].store(v, std::memory_order_relaxed);
  }
  return v;
}
int smem_optin() { return device_attr<cudaDevAttrMaxSharedMemoryPerBlockOptin>(); }
int sm_count() { return device_attr<cudaDevAttrMultiProcessorCount>(); }

using Kernel = void (*)(Args);

// The kernel of a configuration (groups x warps a group), null if not built.
Kernel kernel_for(int groups, int warps) {
#define DZ_OT_CONFIG(G, W) \
  if (groups == G && warps == W) return one_token_kernel<G, W>;
  DZ_OT_CONFIG(3, 4)
  DZ_OT_CONFIG(1, 12)
  DZ_OT_CONFIG(2, 6)
  DZ_OT_CONFIG(4, 4)
  DZ_OT_CONFIG(6, 2)
  DZ_OT_CONFIG(2, 8)
  DZ_OT_CONFIG(8, 2)
  DZ_OT_CONFIG(4, 2)
  DZ_OT_CONFIG(8, 1)
#undef DZ_OT_CONFIG
  return nullptr;
}

// The configuration's kernel with its shared-memory limit set (once).
Kernel prepare(const OneTokenConfig& c) {
  const Kernel k = kernel_for(c.groups, c.group_warps);
  if (!k) return nullptr;
  static bool done[kMaxConsumerWarps + 1][kMaxConsumerWarps + 1] = {};
  if (!done[c.groups][c.group_warps]) {
    DZ_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin()));
    done[c.groups][c.group_warps] = true;
  }
  return k;
}

Layout layout_of(const MoeShape& s, const OneTokenConfig& c, bool gate_up, bool down, int blocks) {
  return layout(s, gate_up, down, c.groups, c.group_warps, c.stages, blocks, smem_optin());
}

// Stages a group in the launches configuration c makes on a grid of blocks (0: it does not fit).
int stages_of(const MoeShape& s, const OneTokenConfig& c, int blocks) {
  if (c.launches == 1) return layout_of(s, c, true, true, blocks).stages;
  if (c.launches == 2)
    return std::min(layout_of(s, c, true, false, blocks).stages, layout_of(s, c, false, true, blocks).stages);
  return 0;
}

}  // namespace

size_t one_token_img_bytes(const MoeShape& s) { return size_t(s.topk) * (s.intermediate / 32) * kImgSub; }

bool one_token_moe_supported(const MoeShape& s, const MoeWeights& w, const OneTokenConfig& c) {
  static const bool device_ok = [] {
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
    return major >= 9;
  }();
  auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  if (!device_ok || s.act != MoeActivation::kGptOss || s.topk < 1 || s.topk > kMaxTopk) return false;
  if (s.hidden % 32 || s.intermediate % 32) return false;
  if (!aligned(w.w1_blocks) || !aligned(w.w1_scales) || !aligned(w.w2_blocks) || !aligned(w.w2_scales)) return false;
  if (!aligned(w.b1) || !aligned(w.b2)) return false;  // (null, or bulk-copied with the rows)
  if (c.groups < 1 || c.group_warps < 1 || c.groups * c.group_warps > kMaxConsumerWarps || c.stages < 0) return false;
  if (c.cooperative && device_attr<cudaDevAttrCooperativeLaunch>() == 0) return false;
  return stages_of(s, c, sm_count()) >= 1 && prepare(c) != nullptr;  // a stage a group at least
}

void one_token_moe(const MoeShape& s, const MoeWeights& w, const float* x, const int* ids, const float* gw, float* out,
                   bool accumulate, const OneTokenScratch& scr, int* err, int blocks, bool pdl, cudaStream_t st,
                   const OneTokenConfig& c) {
  check(one_token_moe_supported(s, w, c) && blocks >= 1 && blocks <= sm_count() && stages_of(s, c, blocks) >= 1,
        DZ_ERR_UNSUPPORTED, "one-token MoE stream: not supported for this layer on ", blocks, " blocks");
  const Kernel k = prepare(c);
  const dim3 block(unsigned(32 * (2 + c.groups * c.group_warps)));
  Args a{};
  a.p[0] = Proj{w.w1_blocks, w.w1_scales, w.b1, 2 * s.intermediate, s.hidden / 32, s.hidden / 2 + 16};
  a.p[1] = Proj{w.w2_blocks, w.w2_scales, w.b2, s.hidden, s.intermediate / 32, s.intermediate / 2 + 16};
  a.n_experts = s.n_experts, a.topk = s.topk, a.ids = ids, a.x = x, a.img = scr.img, a.gw = gw;
  a.slot_done = scr.counts, a.images_in = scr.counts + s.topk;
  a.out = out, a.accumulate = accumulate ? 1 : 0, a.probe = c.probe, a.trace = c.trace, a.err = err;
  a.plan = one_token_plan(s, blocks);
  if (c.launches == 1) {  // both projections in one stream
    a.gate_up = a.down = true, a.L = layout_of(s, c, true, true, blocks);
    launch_ex(pdl, c.cooperative, k, dim3(unsigned(blocks)), block, size_t(a.L.total), st, a);
    return;
  }
  a.gate_up = true, a.down = false, a.L = layout_of(s, c, true, false, blocks);
  launch_ex(pdl, c.cooperative, k, dim3(unsigned(blocks)), block, size_t(a.L.total), st, a);
  a.gate_up = false, a.down = true, a.L = layout_of(s, c, false, true, blocks);
  launch_ex(pdl, c.cooperative, k, dim3(unsigned(blocks)), block, size_t(a.L.total), st, a);
}

}  // namespace dz::cuda
