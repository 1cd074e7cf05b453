// One token through gpt-oss's MXFP4 experts as a stream of their bytes
// (moe_one_token.h says how).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "common/error.h"
#include "cuda/moe_one_token.h"
#include "cuda/moe_w8.cuh"
#include "cuda/pdl.cuh"
#include "cuda/ptx.cuh"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {

constexpr int kMaxStages = 8;
constexpr int kMaxConsumerWarps = 16;
constexpr int kMaxTopk = 8;
constexpr int kImgSub = 64;  // bytes of a sub-block's activations: two terms x 32 E4M3

// Shared memory of a kernel: the ring of units (16 rows padded to row_stride
// bytes, then their 16 x nsub scale bytes), the activation images, the
// groups' partial sums (two buffers a group: a group's next unit may write
// while its first warp still reads), 16 floats for the input's maximum, and
// the ring's barriers.
struct Layout {
  int nsub, row_stride, stage_bytes, stages, img, red, misc, bar, total;
};

// stages: 0 as many as fit (up to kMaxStages).
Layout layout(int nsub, int img_bytes, int smem_limit, int consumer_warps, int stages) {
  Layout L{};
  L.nsub = nsub;
  L.row_stride = nsub * 16 + 16;
  L.stage_bytes = (16 * L.row_stride + 16 * nsub + 127) / 128 * 128;
  const int red_bytes = 2 * consumer_warps * 16 * 4;
  const int fixed = (img_bytes + 127) / 128 * 128 + red_bytes + 64 + 2 * kMaxStages * 8;
  L.stages = std::min(kMaxStages, (smem_limit - fixed) / L.stage_bytes);
  if (stages > 0 && stages < L.stages) L.stages = stages;
  int o = L.stages * L.stage_bytes;
  L.img = o, o += (img_bytes + 127) / 128 * 128;
  L.red = o, o += red_bytes;
  L.misc = o, o += 64;
  L.bar = o, o += 2 * L.stages * 8;
  L.total = o;
  return L;
}

struct Args {
  const uint8_t* blocks;  // [E][rows][nsub][16]
  const uint8_t* scales;  // [E][rows][nsub]
  const uint16_t* bias;   // bf16 [E][rows], or null
  int rows, n_experts, topk;
  const int* ids;     // [topk]
  const float* x;     // gate_up: the token [nsub * 32]
  uint8_t* img;       // down's images [topk][img_subs][kImgSub]: gate_up writes, down reads
  int img_subs;       // sub-blocks of down's K
  const float* gw;    // down: [topk]
  float* y;           // down: [topk][rows]
  int* counts;        // down: [rows / 16]
  float* out;         // down: [rows]
  int accumulate;
  int* err;
  Layout L;
};

// Element e (0..31) of a sub-block's image: term 0 at byte p, term 1 at 32 + p,
// where lane t of a quad finds its MMA fragment (b0: even elements 8t + 0, 2,
// 4, 6; b1: the odd ones) as 8 bytes at 8t.
__device__ __forceinline__ int img_pos(int e) {
  const int w = e & 7;
  return (e >> 3) * 8 + ((w & 1) ? 4 : 0) + (w >> 1);
}

// f (already scaled) as two E4M3 terms: hi, and the remainder times kW8DownLo.
__device__ __forceinline__ void img_put(uint8_t* sub, int e, float f) {
  const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3);
  const float r = (f - __half2float(__half(__nv_cvt_fp8_to_halfraw(q, __NV_E4M3)))) * kW8DownLo;
  const int p = img_pos(e);
  sub[p] = q;
  sub[32 + p] = __nv_cvt_float_to_fp8(r, __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ float bias_at(const uint16_t* b, int64_t i) {
  return b ? __uint_as_float(uint32_t(b[i]) << 16) : 0.f;
}

__device__ __forceinline__ int expert_of(const Args& a, int slot) {
  const int e = a.ids[slot];
  return e >= 0 && e < a.n_experts ? e : -1;
}

// kGroups groups of kWarps consumer warps take units in turn; a group's
// warps split each unit's K range.
template <bool kGateUp, int kGroups, int kWarps>
__global__ void __launch_bounds__(32 * (1 + kGroups * kWarps), 1) one_token_kernel(const Args a) {
  constexpr int kConsumers = 32 * kGroups * kWarps;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) uint8_t sm[];
  const Layout& L = a.L;
  const int warp = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31);
  const uint32_t bar0 = ptx::smem_u32(sm + L.bar);
  auto full = [&](int s) { return bar0 + 8u * uint32_t(s); };
  auto empty = [&](int s) { return bar0 + 8u * uint32_t(L.stages + s); };
  if (threadIdx.x == 0) {
    for (int s = 0; s < L.stages; ++s) ptx::mbar_init(full(s), 1), ptx::mbar_init(empty(s), kWarps);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int tiles = a.rows / 16, units = a.topk * tiles, G = int(gridDim.x);
  // gate_up reads the router's ids and the token; down's weights depend on
  // neither gate_up nor the kernel before it, only its activations do.
  if (kGateUp) pdl_wait(), pdl_trigger();
  if (warp == 0) {  // producer
    if (kGateUp && blockIdx.x == 0 && lane < a.topk && expert_of(a, lane) < 0) atomicOr(a.err, 1);
    const uint32_t row_bytes = uint32_t(L.nsub) * 16;
    const uint32_t ring = ptx::smem_u32(sm);
    for (int i = 0;; ++i) {
      const int u = int(blockIdx.x) + i * G;
      if (u >= units) break;
      const int st = i % L.stages, n = i / L.stages;
      if (n > 0) ptx::mbar_wait(empty(st), uint32_t(n - 1) & 1);
      const int slot = u / tiles, tile = u - slot * tiles;
      const int e = max(expert_of(a, slot), 0);  // an invalid slot streams expert 0, never summed
      const int64_t row0 = int64_t(e) * a.rows + 16 * tile;
      const uint32_t dst = ring + uint32_t(st * L.stage_bytes);
      if (lane == 0) ptx::mbar_arrive_expect_tx(full(st), 16 * row_bytes + 16 * uint32_t(L.nsub));
      __syncwarp();
      if (lane < 16)
        ptx::bulk_g2s(dst + uint32_t(lane * L.row_stride), a.blocks + (row0 + lane) * row_bytes, row_bytes, full(st));
      else if (lane == 16)
        ptx::bulk_g2s(dst + uint32_t(16 * L.row_stride), a.scales + row0 * L.nsub, 16 * uint32_t(L.nsub), full(st));
    }
    if (!kGateUp) pdl_wait(), pdl_trigger();
    return;
  }
  const int cw = warp - 1, grp = cw / kWarps, wq = cw % kWarps, g = lane >> 2, t = lane & 3;
  const int ct = int(threadIdx.x) - 32;
  uint8_t* img = sm + L.img;
  float* red = reinterpret_cast<float*>(sm + L.red);
  float* misc = reinterpret_cast<float*>(sm + L.misc);
  float post;  // what the MMA sums are multiplied by: E2M1's 2^-6 and the token's scale undone
  if (kGateUp) {
    // The token under one power-of-two scale, amax / scale in [224, 448).
    const int H = L.nsub * 32;
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
    int ex = 0;
    frexpf(amax / 448.f, &ex);
    const float sx = amax > 0.f ? ldexpf(1.f, ex) : 1.f, inv = 1.f / sx;
    for (int k = 4 * ct; k < H; k += 4 * kConsumers) {
      const float4 v = *reinterpret_cast<const float4*>(a.x + k);
      uint8_t* sub = img + (k >> 5) * kImgSub;
      img_put(sub, (k & 31) + 0, v.x * inv), img_put(sub, (k & 31) + 1, v.y * inv);
      img_put(sub, (k & 31) + 2, v.z * inv), img_put(sub, (k & 31) + 3, v.w * inv);
    }
    post = 64.f * sx;
  } else {
    pdl_wait(), pdl_trigger();
    const int n16 = a.topk * a.img_subs * kImgSub / 16;
    for (int q = ct; q < n16; q += kConsumers)
      reinterpret_cast<uint4*>(img)[q] = __ldcg(reinterpret_cast<const uint4*>(a.img) + q);
    post = 64.f / kW8DownInv;
  }
  ptx::named_sync(1, kConsumers);
  // This warp's share of the sub-blocks.
  const int per = (L.nsub + kWarps - 1) / kWarps, sb0 = min(L.nsub, wq * per), sb1 = min(L.nsub, sb0 + per);
  for (int i = grp, it = 0;; i += kGroups, ++it) {
    const int u = int(blockIdx.x) + i * G;
    if (u >= units) break;
    const int st = i % L.stages;
    ptx::mbar_wait(full(st), uint32_t(i / L.stages) & 1);
    const int slot = u / tiles, tile = u - slot * tiles;
    const uint8_t* stage = sm + st * L.stage_bytes;
    const uint8_t* wA = stage + g * L.row_stride + 4 * t;  // word t of each sub-block, rows g and g + 8
    const uint8_t* wB = wA + 8 * L.row_stride;
    const uint8_t* sA = stage + 16 * L.row_stride + g * L.nsub;
    const uint8_t* sB = sA + 8 * L.nsub;
    // Columns 0 / 1 (even / odd g) take the first / second term; the others are never read.
    const uint8_t* xi = img + (kGateUp ? 0 : slot * a.img_subs * kImgSub) + (g & 1) * 32 + t * 8;
    float accA = 0.f, accB = 0.f;
#pragma unroll 4
    for (int sb = sb0; sb < sb1; ++sb) {
      const uint32_t wa = *reinterpret_cast<const uint32_t*>(wA + 16 * sb);
      const uint32_t wb = *reinterpret_cast<const uint32_t*>(wB + 16 * sb);
      const uint2 xv = *reinterpret_cast<const uint2*>(xi + kImgSub * sb);
      float c[4] = {0.f, 0.f, 0.f, 0.f};
      ptx::mma_16832_e4m3(c, e2m1_even_to_e4m3(wa), e2m1_even_to_e4m3(wb), e2m1_odd_to_e4m3(wa),
                          e2m1_odd_to_e4m3(wb), xv.x, xv.y);
      // E8M0 byte s as 2^(s - 127) (s = 0, 2^-127, reads as 0).
      accA = fmaf(fmaf(c[1], 1.f / kW8DownLo, c[0]), __uint_as_float(uint32_t(sA[sb]) << 23), accA);
      accB = fmaf(fmaf(c[3], 1.f / kW8DownLo, c[2]), __uint_as_float(uint32_t(sB[sb]) << 23), accB);
    }
    __syncwarp();
    if (lane == 0) ptx::mbar_arrive(empty(st));
    float* rr = red + (grp * 2 + (it & 1)) * kWarps * 16;
    if (t == 0) rr[wq * 16 + g] = accA, rr[wq * 16 + g + 8] = accB;
    ptx::named_sync(2 + grp, 32 * kWarps);
    if (wq != 0) continue;
    const int e = expert_of(a, slot), eb = max(e, 0);
    auto row_sum = [&](int r) {  // the warps' parts in order
      float v = rr[r];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) v += rr[16 * w + r];
      return v * post;
    };
    const int64_t brow = int64_t(eb) * a.rows + 16 * tile;
    if (kGateUp) {
      if (lane < 8) {  // gate / up pairs: rows 2 lane and 2 lane + 1
        const float gate = row_sum(2 * lane) + bias_at(a.bias, brow + 2 * lane);
        const float up = row_sum(2 * lane + 1) + bias_at(a.bias, brow + 2 * lane + 1);
        const int o = 8 * tile + lane;
        img_put(a.img + (int64_t(slot) * a.img_subs + (o >> 5)) * kImgSub, o & 31, swiglu(gate, up) * kW8DownInv);
      }
    } else {
      const int r = 16 * tile + lane;
      if (lane < 16) a.y[int64_t(slot) * a.rows + r] = row_sum(lane) + bias_at(a.bias, brow + lane);
      __threadfence();  // this tile's outputs visible before it counts as done
      __syncwarp();
      int last = 0;
      if (lane == 0) last = atomicAdd(a.counts + tile, 1) == a.topk - 1;
      if (__shfl_sync(~0u, last, 0)) {  // every slot of this row tile done: sum them in slot order
        __threadfence();
        if (lane < 16) {
          float acc = 0.f;
          for (int k = 0; k < a.topk; ++k)
            if (expert_of(a, k) >= 0) acc += a.gw[k] * __ldcg(a.y + int64_t(k) * a.rows + r);
          if (a.accumulate) acc += a.out[r];
          a.out[r] = acc;
        }
        if (lane == 0) a.counts[tile] = 0;  // ready for the next call
      }
    }
  }
#endif
}

int smem_optin() {
  static const int v = [] {
    int dev = 0, optin = 0;
    DZ_CUDA_CHECK(cudaGetDevice(&dev));
    DZ_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    return optin;
  }();
  return v;
}

using Kernel = void (*)(Args);

// The kernel of a configuration (groups x warps a group), null if not built.
template <bool kGateUp>
Kernel kernel_for(int groups, int warps) {
#define DZ_OT_CONFIG(G, W) \
  if (groups == G && warps == W) return one_token_kernel<kGateUp, G, W>;
  DZ_OT_CONFIG(3, 4)
  DZ_OT_CONFIG(1, 12)
  DZ_OT_CONFIG(2, 6)
  DZ_OT_CONFIG(4, 4)
  DZ_OT_CONFIG(6, 2)
  DZ_OT_CONFIG(2, 8)
#undef DZ_OT_CONFIG
  return nullptr;
}

// Both kernels of a configuration with the shared-memory limit set (once each).
bool prepare(const OneTokenConfig& c) {
  Kernel g = kernel_for<true>(c.groups, c.group_warps), d = kernel_for<false>(c.groups, c.group_warps);
  if (!g || !d) return false;
  static bool done[2][kMaxConsumerWarps + 1][kMaxConsumerWarps + 1] = {};
  bool& f = done[0][c.groups][c.group_warps];
  if (!f) {
    for (Kernel k : {g, d})
      DZ_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin()));
    f = true;
  }
  return true;
}

Layout gate_up_layout(const MoeShape& s, const OneTokenConfig& c) {
  return layout(s.hidden / 32, (s.hidden / 32) * kImgSub, smem_optin(), c.groups * c.group_warps, c.stages);
}
Layout down_layout(const MoeShape& s, const OneTokenConfig& c) {
  return layout(s.intermediate / 32, int(one_token_img_bytes(s)), smem_optin(), c.groups * c.group_warps, c.stages);
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
  if (c.groups < 1 || c.group_warps < 1 || c.groups * c.group_warps > kMaxConsumerWarps || c.stages < 0) return false;
  if (gate_up_layout(s, c).stages < 2 || down_layout(s, c).stages < 2) return false;
  return prepare(c);
}

void one_token_moe(const MoeShape& s, const MoeWeights& w, const float* x, const int* ids, const float* gw,
                   float* out, bool accumulate, const OneTokenScratch& scr, int* err, int blocks, bool pdl,
                   cudaStream_t st, const OneTokenConfig& c) {
  check(one_token_moe_supported(s, w, c), DZ_ERR_UNSUPPORTED, "one-token MoE stream: not supported for this layer");
  const dim3 block(unsigned(32 * (1 + c.groups * c.group_warps)));
  Args a{};
  a.n_experts = s.n_experts, a.topk = s.topk, a.ids = ids, a.err = err, a.img = scr.img;
  a.img_subs = s.intermediate / 32;
  // gate_up + SwiGLU into down's images
  a.blocks = w.w1_blocks, a.scales = w.w1_scales, a.bias = w.b1, a.rows = 2 * s.intermediate, a.x = x;
  a.L = gate_up_layout(s, c);
  launch_maybe_pdl(pdl, kernel_for<true>(c.groups, c.group_warps), dim3(unsigned(blocks)), block, size_t(a.L.total),
                   st, a);
  // down + the weighted sum
  Args d = a;
  d.blocks = w.w2_blocks, d.scales = w.w2_scales, d.bias = w.b2, d.rows = s.hidden, d.x = nullptr;
  d.gw = gw, d.y = scr.y, d.counts = scr.counts, d.out = out, d.accumulate = accumulate ? 1 : 0;
  d.L = down_layout(s, c);
  launch_maybe_pdl(pdl, kernel_for<false>(c.groups, c.group_warps), dim3(unsigned(blocks)), block, size_t(d.L.total),
                   st, d);
}

}  // namespace dz::cuda
