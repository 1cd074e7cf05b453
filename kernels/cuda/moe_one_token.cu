#include <cuda_fp16.h>

#include <algorithm>
#include <cstdlib>
#include <type_traits>

#include "cuda/fp8_grouped_gemm.h"
#include "cuda/moe_one_token.h"
#include "cuda/moe_w4.cuh"
#include "cuda/pdl.cuh"
#include "cuda/ptx.cuh"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {

constexpr int kMaxSub = 96;  // 32-element sub-blocks a row: 3 a lane (H, I <= 3072)
constexpr int kMaxTopk = 8;
static_assert(kMoeOneTokenSync == kMaxTopk + 1, "a count a slot and the blocks past their waits");
// A gate_up block and a down block fit one SM together: 384 x 128 + 256 x 64
// registers of 65,536, 6.5 KB + down's slice (up to kDownSmemMax) of shared memory.
constexpr int kUpThreads = 384, kUpRegs = 128;
constexpr int kDownThreads = 256, kDownRegs = 64;
constexpr int kDepth = 2;  // gate_up: row pairs of loads in flight a warp
constexpr int kDownSmemMax = 200 << 10;

__host__ __device__ constexpr int align16(int n) { return (n + 15) & ~15; }

// The down kernel's shared memory: its slice of every slot's weights (rc rows
// of nsub 16-byte sub-blocks), the slots' staged activations, the slice's
// scale bytes by slot, the activations' sub-block factors, the rows' results,
// one mbarrier.
struct DownSmem {
  int w, x, sc, sc_slot, xf, ys, bar, total;
  __host__ __device__ DownSmem(int topk, int rc, int nsub) {
    w = 0;
    x = w + topk * rc * nsub * 16;
    sc = x + topk * 4 * nsub * 16;
    sc_slot = align16(rc * nsub) + 16;  // a slot's scale bytes with the 16-byte aligned span around them
    xf = sc + topk * sc_slot;
    ys = xf + topk * nsub * 4;
    bar = align16(ys + topk * rc * 4);
    total = bar + 16;
  }
};

// One 32-element sub-block of an activation row into shared memory: fp16 pairs
// in the order w4_pairs decodes a weight word, (v0, v4), (v1, v5), (v2, v6),
// (v3, v7) of each 8 elements, word i's pairs at xs[i * stride]; scaled by
// 2^k so that the sub-block's largest magnitude lands in [2^14, 2^15) (the
// products of the weights' 2^-14-scaled codes then stay in fp16's normal
// range); xf = 2^(14 - k) undoes both.
template <typename T>
__device__ __forceinline__ void stage_sub(const T* src, uint4* xs, int stride, float* xf) {
  float v[32];
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const float4 f = reinterpret_cast<const float4*>(src)[q];
      v[4 * q] = f.x, v[4 * q + 1] = f.y, v[4 * q + 2] = f.z, v[4 * q + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint4 u = reinterpret_cast<const uint4*>(src)[q];
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[m]));
        v[8 * q + 2 * m] = f.x, v[8 * q + 2 * m + 1] = f.y;
      }
    }
  }
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(v[i]));
  // amax in [2^(ex-1), 2^ex) for a normal amax; zero or subnormal: the largest factor.
  const int ex = int((__float_as_uint(amax) >> 23) & 0xFF) - 126;
  const int k = min(max(15 - ex, -113), 127);
  const float f = __uint_as_float(uint32_t(k + 127) << 23);
  *xf = __uint_as_float(uint32_t(14 - k + 127) << 23);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t q[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const __half2 h = __floats2half2_rn(v[8 * i + m] * f, v[8 * i + m + 4] * f);
      q[m] = *reinterpret_cast<const uint32_t*>(&h);
    }
    xs[i * stride] = make_uint4(q[0], q[1], q[2], q[3]);
  }
}

// A weight sub-block (16 bytes, 32 E2M1 codes) against its staged activations:
// the fp16 sum of the 32 products (2^-14 * the codes * the scaled inputs).
__device__ __forceinline__ float sub_dot(const uint4 w, const uint4* xs, int stride) {
  const uint32_t wd[4] = {w.x, w.y, w.z, w.w};
  uint32_t h = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint4 xv = xs[i * stride];
    uint32_t p[4];
    w4_pairs(wd[i], p);
    h = hfma2(p[0], xv.x, h);
    h = hfma2(p[1], xv.y, h);
    h = hfma2(p[2], xv.z, h);
    h = hfma2(p[3], xv.w, h);
  }
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  return f.x + f.y;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(~0u, v, o);
  return v;
}

// Slot readiness between the kernels: gate_up's warps count each slot done
// (release), down's blocks wait for a slot's count (acquire) and the last of
// them to get past every wait zeroes the counts for the next call.
__device__ __forceinline__ void signal_slot(int* ready) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(ready) : "memory");
}
__device__ __forceinline__ void wait_slot(const int* ready, int target) {
  int v;
  for (;;) {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(ready) : "memory");
    if (v >= target) break;
    __nanosleep(32);
  }
}

// gate_up + SwiGLU (header). kNJ: sub-blocks a lane (ceil(H / 32 / 32)).
// Block c takes row pairs [I * c / G, I * (c + 1) / G) of every slot, slot by
// slot (warp w the w-th, (w + nw)-th, ... of that list), and each warp counts
// every slot done once past it: down starts on the first slots while gate_up
// streams the last.
template <int kNJ, bool kPdl>
__global__ void __maxnreg__(kUpRegs) one_up_kernel(MoeOneTokenArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ uint4 xs[4 * kMaxSub];
  __shared__ float xf[kMaxSub];
  __shared__ int sid[kMaxTopk];
  if (kPdl) pdl_wait(), pdl_trigger();  // the router's ids and the input; down may now become resident
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int I = a.intermediate, nsub = a.hidden / 32, topk = a.topk;
  if (threadIdx.x < topk) {
    const int e = a.ids[threadIdx.x];
    const bool ok = e >= 0 && e < a.n_experts;
    sid[threadIdx.x] = ok ? e : -1;
    if (!ok && blockIdx.x == 0) atomicOr(a.err, 1);
  }
  __syncthreads();
  const int j0 = int(int64_t(I) * blockIdx.x / gridDim.x), q = int(int64_t(I) * (blockIdx.x + 1) / gridDim.x) - j0;
  // A position in the block's list: slot k, its r-th pair (k == topk: past the end).
  auto advance = [&](int& k, int& r, int by) {
    r += by;
    while (k < topk && r >= q) r -= q, ++k;
  };
  uint4 wv[kDepth][2][kNJ];
  int sv[kDepth][2][kNJ];
  uint32_t bv[kDepth];
  auto load = [&](int k, int r, int d) {
    const int e = k < topk ? sid[k] : -1;
    const int64_t row = int64_t(e) * 2 * I + 2 * (j0 + r);
    const uint8_t* bA = a.w1_blocks + row * nsub * 16;
    const uint8_t* sA = a.w1_scales + row * nsub;
#pragma unroll
    for (int jj = 0; jj < kNJ; ++jj) {
      const int sb = lane + 32 * jj;
      const bool in = e >= 0 && sb < nsub;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        wv[d][h][jj] = in ? ptx::ldg_nc_v4(bA + (h * nsub + sb) * 16) : make_uint4(0, 0, 0, 0);
        sv[d][h][jj] = in ? sA[h * nsub + sb] : 0;
      }
    }
    bv[d] = e >= 0 ? uint32_t(a.b1[row]) | uint32_t(a.b1[row + 1]) << 16 : 0u;
  };
  int kc = 0, rc = 0;  // the next pair to compute
  advance(kc, rc, warp);
  int kl = kc, rl = rc;  // the next pair to load
  // The first loads go out before the input is staged.
#pragma unroll
  for (int d = 0; d < kDepth; ++d) load(kl, rl, d), advance(kl, rl, nw);
  for (int sb = threadIdx.x; sb < nsub; sb += blockDim.x) stage_sub(a.x + sb * 32, xs + sb, nsub, xf + sb);
  __syncthreads();
  float xfr[kNJ];
#pragma unroll
  for (int jj = 0; jj < kNJ; ++jj) xfr[jj] = lane + 32 * jj < nsub ? xf[lane + 32 * jj] : 0.f;

  int signalled = 0;  // slots this warp has counted done
  auto signal_upto = [&](int k) {
    __syncwarp();
    for (; signalled < k; ++signalled)
      if (lane == 0) signal_slot(a.sync + signalled);  // (lane 0 made the stores)
  };
  while (kc < topk) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      if (kc >= topk) break;
      float acc[2] = {0.f, 0.f};
#pragma unroll
      for (int jj = 0; jj < kNJ; ++jj) {
        const int sb = lane + 32 * jj;
        if (sb < nsub)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            acc[h] =
                a.probe ? acc[h] + __uint_as_float((wv[d][h][jj].x ^ wv[d][h][jj].w) & 0x3FFFFFFF) * float(sv[d][h][jj])
                        : fmaf(sub_dot(wv[d][h][jj], xs + sb, nsub), e8m0_to_float(sv[d][h][jj]) * xfr[jj], acc[h]);
      }
      const uint32_t bias = bv[d];
      load(kl, rl, d), advance(kl, rl, nw);  // consumed: refill the slot
      acc[0] = warp_sum(acc[0]), acc[1] = warp_sum(acc[1]);
      if (lane == 0 && sid[kc] >= 0)
        a.act[int64_t(kc) * a.act_ld + j0 + rc] = __float2half_rn(
            swiglu(acc[0] + bf16_to_float(uint16_t(bias)), acc[1] + bf16_to_float(uint16_t(bias >> 16))));
      advance(kc, rc, nw);
      signal_upto(kc);
    }
  }
  signal_upto(topk);
#endif
}

// down + the weighted sum of the slots + the residual (header): block b owns
// hidden rows [b * rc, b * rc + rc).
template <int kNJ, bool kPdl>
__global__ void __maxnreg__(kDownRegs) one_down_kernel(MoeOneTokenArgs a, int rc) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int sid[kMaxTopk];
  __shared__ float sgw[kMaxTopk];
  __shared__ int s_off[kMaxTopk];  // where each slot's scale bytes start in its region
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int H = a.hidden, nsub = a.intermediate / 32, topk = a.topk;
  const DownSmem L(topk, rc, nsub);
  const int h0 = blockIdx.x * rc, rcb = min(rc, H - h0), row_bytes = nsub * 16, sc_len = rcb * nsub;
  const uint32_t bar = ptx::smem_u32(smem + L.bar);
  // The router's outputs: complete before the gate_up kernel let this one launch.
  if (threadIdx.x < topk) {
    const int e = a.ids[threadIdx.x];
    sid[threadIdx.x] = e >= 0 && e < a.n_experts ? e : -1;
    sgw[threadIdx.x] = a.gw[threadIdx.x];
  }
  if (threadIdx.x == 0) {
    ptx::mbar_init(bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();
  // While gate_up runs: the slice of every slot's weights and scale bytes (the
  // 16-byte aligned span around them, unless it passes the end of the array).
  const int64_t sc_total = int64_t(a.n_experts) * H * nsub;
  if (threadIdx.x == 0) {
    uint32_t bytes = 0;
    for (int k = 0; k < topk; ++k) {
      s_off[k] = -1;
      if (sid[k] < 0) continue;
      const int64_t s0 = (int64_t(sid[k]) * H + h0) * nsub, a0 = s0 & ~int64_t(15),
                    a1 = (s0 + sc_len + 15) & ~int64_t(15);
      ptx::bulk_g2s(ptx::smem_u32(smem + L.w + k * rc * row_bytes),
                    a.w2_blocks + (int64_t(sid[k]) * H + h0) * row_bytes, uint32_t(rcb * row_bytes), bar);
      bytes += uint32_t(rcb * row_bytes);
      if (a1 <= sc_total) {
        ptx::bulk_g2s(ptx::smem_u32(smem + L.sc + k * L.sc_slot), a.w2_scales + a0, uint32_t(a1 - a0), bar);
        bytes += uint32_t(a1 - a0);
        s_off[k] = int(s0 - a0);
      }
    }
    ptx::mbar_expect_tx(bar, bytes);
    ptx::mbar_arrive(bar);
  }
  __syncthreads();
  for (int k = 0; k < topk; ++k)  // the rare span past the end: byte by byte
    if (sid[k] >= 0 && s_off[k] < 0)
      for (int i = threadIdx.x; i < sc_len; i += blockDim.x)
        smem[L.sc + k * L.sc_slot + i] = a.w2_scales[(int64_t(sid[k]) * H + h0) * nsub + i];
  // The combine's operands, for its thread's row.
  float bias[kMaxTopk];
#pragma unroll
  for (int k = 0; k < kMaxTopk; ++k)
    bias[k] = k < topk && int(threadIdx.x) < rcb && sid[k] >= 0
                  ? bf16_to_float(a.b2[int64_t(sid[k]) * H + h0 + int(threadIdx.x)])
                  : 0.f;
  __syncthreads();  // (the byte-wise scales)
  if (threadIdx.x < topk && s_off[threadIdx.x] < 0) s_off[threadIdx.x] = 0;
  uint4* xs = reinterpret_cast<uint4*>(smem + L.x);
  float* xf = reinterpret_cast<float*>(smem + L.xf);
  float* ys = reinterpret_cast<float*>(smem + L.ys);
  const int target = a.up_signals;
  bool landed = false;
  for (int k = 0; k < topk; ++k) {
    if (sid[k] < 0) continue;
    if (threadIdx.x == 0) wait_slot(a.sync + k, target);
    __syncthreads();  // (thread 0's acquire, then the barrier: gate_up's stores of slot k are visible)
    for (int sb = threadIdx.x; sb < nsub; sb += blockDim.x)
      stage_sub(a.act + int64_t(k) * a.act_ld + sb * 32, xs + k * 4 * nsub + sb, nsub, xf + k * nsub + sb);
    __syncthreads();
    if (!landed) ptx::mbar_wait(bar, 0), landed = true;
    const uint4* xk = xs + k * 4 * nsub;
    const float* fk = xf + k * nsub;
    const uint8_t* sk = smem + L.sc + k * L.sc_slot + s_off[k];
    auto dot = [&](int r) {
      const uint4* w = reinterpret_cast<const uint4*>(smem + L.w + (k * rc + r) * row_bytes);
      const uint8_t* s = sk + r * nsub;
      float acc = 0.f;
#pragma unroll
      for (int jj = 0; jj < kNJ; ++jj) {
        const int sb = lane + 32 * jj;
        if (sb < nsub)
          acc = a.probe ? acc + __uint_as_float((w[sb].x ^ w[sb].w) & 0x3FFFFFFF) * float(s[sb])
                        : fmaf(sub_dot(w[sb], xk + sb, nsub), e8m0_to_float(s[sb]) * fk[sb], acc);
      }
      return acc;
    };
    for (int r = warp; r < rcb; r += 2 * nw) {  // two rows a warp at a time (independent chains)
      const int r2 = r + nw;
      float d1 = dot(r), d2 = r2 < rcb ? dot(r2) : 0.f;
      d1 = warp_sum(d1), d2 = warp_sum(d2);
      if (lane == 0) {
        ys[k * rcb + r] = d1;
        if (r2 < rcb) ys[k * rcb + r2] = d2;
      }
    }
  }
  if (kPdl) pdl_trigger();  // gate_up is done with every slot
  if (threadIdx.x == 0 && atomicAdd(a.sync + kMaxTopk, 1) == int(gridDim.x) - 1) {
    for (int k = 0; k < topk; ++k) a.sync[k] = 0;  // every block is past its waits: zero for the next call
    a.sync[kMaxTopk] = 0;
  }
  __syncthreads();
  if (int(threadIdx.x) < rcb) {
    const int t = threadIdx.x;
    float o = 0.f;
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k)  // fixed order: deterministic
      if (k < topk && sid[k] >= 0) o += sgw[k] * (ys[k * rcb + t] + bias[k]);
    float* dst = a.out + h0 + t;
    *dst = a.accumulate ? *dst + o : o;
  }
#endif
}

using Fn = void (*)(MoeOneTokenArgs);
using DownFn = void (*)(MoeOneTokenArgs, int);

template <bool kPdl>
Fn up_fn(int nj) {
  return nj == 1 ? one_up_kernel<1, kPdl> : nj == 2 ? one_up_kernel<2, kPdl> : one_up_kernel<3, kPdl>;
}
template <bool kPdl>
DownFn down_fn(int nj) {
  return nj == 1 ? one_down_kernel<1, kPdl> : nj == 2 ? one_down_kernel<2, kPdl> : one_down_kernel<3, kPdl>;
}

struct Device {
  bool ok = false;
  int sms = 0, smem_max = 0;
};

// Once per process (one GPU per process here): the device, and every kernel's attributes.
const Device& device() {
  static const Device d = [] {
    Device r;
    if (!Fp8GroupedGemm::supported()) return r;  // sm_90 device and an sm_90a build
    r.sms = current_device_sms();
    int dev = 0, optin = 0;
    DZ_CUDA_CHECK(cudaGetDevice(&dev));
    DZ_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    r.smem_max = std::min(optin, kDownSmemMax);
    for (int nj = 1; nj <= 3; ++nj) {
      for (Fn f : {up_fn<false>(nj), up_fn<true>(nj)})  // the SM's whole carveout as shared memory: down fits beside
        DZ_CUDA_CHECK(cudaFuncSetAttribute(f, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
      for (DownFn f : {down_fn<false>(nj), down_fn<true>(nj)})
        DZ_CUDA_CHECK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, r.smem_max));
    }
    r.ok = true;
    return r;
  }();
  return d;
}

// Hidden rows a down block: an equal share for one block an SM, fewer where
// shared memory does not hold that many (more blocks).
int down_rows(int topk, int H, int nsub) {
  const Device& d = device();
  int rc = std::min((H + d.sms - 1) / d.sms, kDownThreads);  // (a combine thread a row)
  while (rc > 1 && DownSmem(topk, rc, nsub).total > d.smem_max) --rc;
  return rc;
}

}  // namespace

bool moe_one_token_fits(int topk, int hidden, int intermediate) {
  if (topk < 1 || topk > kMaxTopk || hidden % 32 || intermediate % 32 || hidden <= 0 || intermediate <= 0 ||
      hidden / 32 > kMaxSub || intermediate / 32 > kMaxSub)
    return false;
  const Device& d = device();
  return d.ok && DownSmem(topk, down_rows(topk, hidden, intermediate / 32), intermediate / 32).total <= d.smem_max;
}

void moe_one_token(const MoeOneTokenArgs& a, cudaStream_t s, bool pdl) {
  check(moe_one_token_fits(a.topk, a.hidden, a.intermediate), DZ_ERR_UNSUPPORTED,
        "moe_one_token: shape not supported here (topk ", a.topk, ", H ", a.hidden, ", I ", a.intermediate, ")");
  const int n1 = a.hidden / 32, n2 = a.intermediate / 32;
  const int rc = down_rows(a.topk, a.hidden, n2);
  const int nj1 = (n1 + 31) / 32, nj2 = (n2 + 31) / 32;
  MoeOneTokenArgs b = a;
  b.up_signals = device().sms * (kUpThreads / 32);
  static const bool probe = std::getenv("DZ_ONE_PROBE") != nullptr;
  b.probe = probe;
  launch_maybe_pdl(pdl, pdl ? up_fn<true>(nj1) : up_fn<false>(nj1), dim3(unsigned(device().sms)), dim3(kUpThreads), 0,
                   s, b);
  launch_maybe_pdl(pdl, pdl ? down_fn<true>(nj2) : down_fn<false>(nj2), dim3(unsigned((a.hidden + rc - 1) / rc)),
                   dim3(kDownThreads), size_t(DownSmem(a.topk, rc, n2).total), s, b, rc);
}

}  // namespace dz::cuda
