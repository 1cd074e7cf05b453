#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <vector>

#include "cpu/mxfp4_fold.h"
#include "cuda/moe.h"
#include "cuda/mxfp4_fold.h"
#include "cuda/ptx.cuh"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {

constexpr int kPadRows = 16;      // expert segments padded to 16 rows (aligned scale vectors, few GEMM shapes)
constexpr int kRouteThreads = 1024;
// Fused kernel block: 8 warps = (8 / KS) row tiles of 16 rows x KS slices of K
// (split K keeps each warp's dependent chain short when few experts are
// active; partial sums meet in shared memory in a fixed order).
constexpr int kW4Threads = 256;
constexpr int kW4Tokens = 8;  // tokens per MMA pass (n = 8)
constexpr int kRouteConvertsX = 16;  // the routing block converts the input up to this many tokens

__device__ __forceinline__ float bf16_to_float(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }

// 2^(s-127) for an E8M0 byte s in 0..254 (s = 0 is the fp32 subnormal 2^-127).
__device__ __forceinline__ float e8m0_to_float(int s) {
  return s == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(uint32_t(s) << 23);
}

__device__ __forceinline__ float swiglu(float gate, float up) {
  gate = fminf(gate, 7.f);
  up = fminf(fmaxf(up, -7.f), 7.f);
  return (up + 1.f) * (gate / (1.f + __expf(-1.702f * gate)));
}

// ------------------------------------------------------------------ routing
// One block: counting sort of the T*topk slots by expert. Segment e spans rows
// [offsets[e], offsets[e+1]) (count rounded up to kPadRows; pad rows hold -1).
// Order inside a segment is arbitrary; every row is computed independently.
__device__ void x_to_half_row(const float* row, int H, int kpad, __half* out, float* scale_out, float* red);

__global__ void __launch_bounds__(kRouteThreads) route_kernel(const int* ids, int n_slots, int E, int* counts,
                                                               int* offsets, int* sorted, int* row_expert, int* inv,
                                                               int* active, int* n_active, int* err, const float* x,
                                                               int T, int H, int kpad, __half* xh, float* xs) {
  extern __shared__ int sm[];
  int* cnt = sm;
  int* cur = sm + E;
  int* off = sm + 2 * E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = cur[e] = 0;
  __syncthreads();
  for (int s = threadIdx.x; s < n_slots; s += blockDim.x) {
    const int e = ids[s];
    if (e < 0 || e >= E)
      atomicOr(err, 1);
    else
      atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  if (threadIdx.x < 32) {  // warp 0: exclusive scans of padded counts and of active flags
    const int lane = threadIdx.x, per = (E + 31) / 32, e0 = min(E, lane * per), e1 = min(E, e0 + per);
    int rows = 0, act = 0;
    for (int e = e0; e < e1; ++e) rows += (cnt[e] + kPadRows - 1) / kPadRows * kPadRows, act += cnt[e] > 0;
    int rs = rows, as = act;
    for (int o = 1; o < 32; o <<= 1) {
      const int r2 = __shfl_up_sync(~0u, rs, o), a2 = __shfl_up_sync(~0u, as, o);
      if (lane >= o) rs += r2, as += a2;
    }
    rs -= rows, as -= act;
    for (int e = e0; e < e1; ++e) {
      off[e] = rs;
      rs += (cnt[e] + kPadRows - 1) / kPadRows * kPadRows;
      if (cnt[e]) active[as++] = e;
    }
    if (lane == 31) off[E] = rs, *n_active = as;
  }
  __syncthreads();
  for (int e = threadIdx.x; e <= E; e += blockDim.x) {
    offsets[e] = off[e];
    if (e < E) counts[e] = cnt[e];
  }
  for (int r = threadIdx.x; r < off[E]; r += blockDim.x) {  // expert of each row (binary search); pad rows -> -1
    int lo = 0, hi = E - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (off[mid] <= r) lo = mid;
      else hi = mid - 1;
    }
    row_expert[r] = lo;
    if (r - off[lo] >= cnt[lo]) sorted[r] = -1;
  }
  for (int s = threadIdx.x; s < n_slots; s += blockDim.x) {
    const int e = ids[s];
    if (e < 0 || e >= E) {
      inv[s] = -1;
      continue;
    }
    const int pos = off[e] + atomicAdd(&cur[e], 1);
    sorted[pos] = s;
    inv[s] = pos;
  }
  // Small batches: the fused path's fp16 input conversion rides along (one launch less).
  if (x) {
    __shared__ float red[32];
    for (int t = 0; t < T; ++t) x_to_half_row(x + int64_t(t) * H, H, kpad, xh + int64_t(t) * kpad, xs + t, red);
  }
}

// One token row (whole block): fp32 -> fp16 [kpad] scaled by a power of two
// (x / scale in [-1, 1]), zero padded; the scale goes to *scale_out.
__device__ void x_to_half_row(const float* row, int H, int kpad, __half* out, float* scale_out, float* red) {
  float amax = 0.f;
  for (int k = threadIdx.x; k < H; k += blockDim.x) amax = fmaxf(amax, fabsf(row[k]));
  for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, o));
  __syncthreads();  // red reused across rows
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
  __syncthreads();
  amax = 0.f;
  for (int i = 0; i < int(blockDim.x >> 5); ++i) amax = fmaxf(amax, red[i]);
  int ex = 0;
  frexpf(amax, &ex);  // amax = m * 2^ex, m in [0.5, 1)
  const float scale = amax > 0.f ? ldexpf(1.f, ex) : 1.f;
  const float inv = 1.f / scale;
  for (int k = threadIdx.x; k < kpad; k += blockDim.x) out[k] = __float2half_rn(k < H ? row[k] * inv : 0.f);
  if (threadIdx.x == 0) *scale_out = scale;
}

__global__ void __launch_bounds__(256) x_to_half_kernel(const float* x, int H, int kpad, __half* xh, float* xs) {
  __shared__ float red[32];
  const int t = blockIdx.x;
  x_to_half_row(x + int64_t(t) * H, H, kpad, xh + int64_t(t) * kpad, xs + t, red);
}

// ------------------------------------------------------- fused W4A16 path
struct W4Args {
  const uint8_t* blocks;  // expert 0, [E][rows][nsub][16]
  const uint8_t* scales;  // [E][rows][nsub]
  const uint16_t* bias;   // bf16 [E][rows]
  const __half* act;      // gate_up: xh [T][kpad] (by token); down: act [rows_cap][kpad] (by sorted row)
  const float* act_scale; // gate_up: per-token scale; down: unused
  const int *sorted, *offsets, *counts, *active, *n_active;
  int topk, rows, nsub, kpad;
  __half* out_act;  // gate_up: SwiGLU output [rows_cap][out_ld]
  int out_ld;
  float* out_y;  // down: [rows_cap][rows], bias added
};

// Hi bytes of fp16(E2M1 code * 2^-d) for codes 0..7 (low bytes are zero).
__device__ __forceinline__ void w4_lut(int d, uint32_t& l0, uint32_t& l1) {
  if (d <= 13) {  // exponent stays normal: subtract d from each nonzero entry's exponent
    l0 = 0x3E3C3800u - uint32_t(d * 4) * 0x01010100u;
    l1 = 0x46444240u - uint32_t(d * 4) * 0x01010101u;
  } else {  // rare: far below the group's largest scale (fp16 subnormals, rounded)
    const float f = ldexpf(1.f, -d);
    auto hb = [&](float v) { return uint32_t(__half_as_ushort(__float2half_rn(v * f)) >> 8); };
    l0 = (hb(0.5f) << 8) | (hb(1.f) << 16) | (hb(1.5f) << 24);
    l1 = hb(2.f) | (hb(3.f) << 8) | (hb(4.f) << 16) | (hb(6.f) << 24);
  }
}

// 4 nibbles (low 16 bits of w) -> hi bytes of 4 fp16 values, sign included.
__device__ __forceinline__ uint32_t w4_decode(uint32_t w, uint32_t l0, uint32_t l1) {
  const uint32_t sg = ptx::prmt(0x80808080u, 0x80808080u, w);
  return ptx::prmt(l0, l1, w & 0x7777u) | ((sg & 0x40404040u) << 1);
}

// The k order inside a 128-wide chunk is permuted identically for both
// operands: lane (g, t) owns sub-block t (32 elements) of the chunk; MMA step s
// takes elements 4s..4s+3 of it. Each row's 4 sub-block scales are folded into
// the fp16 weights relative to the chunk's largest one; that one multiplies the
// fp32 partial sums.
__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void griddep_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// kKS: K split over warps (more warps per row for small batches, where few
// experts leave the grid short); kRing: K chunks in flight per warp. kPdl: the
// kernel was launched as a programmatic dependent of the previous one; down
// projections issue their first weight loads before waiting for it.
template <bool kGateUp, int kKS, bool kPdl>
__global__ void __launch_bounds__(kW4Threads, kKS == 1 ? 3 : 2) w4_kernel(W4Args a) {
  constexpr int kRT = 8 / kKS, kRows = 16 * kRT, kRing = kKS == 1 ? 2 : 3;
  extern __shared__ uint4 xs4[];  // [chunk][i][token][t] 16-byte pieces
  __shared__ float4 red[kKS > 1 ? kKS - 1 : 1][kRT][32];
  if (kPdl && kGateUp) griddep_wait();  // routing outputs
  if (blockIdx.y >= unsigned(*a.n_active)) {
    if (kPdl) griddep_launch();
    return;
  }
  const int e = a.active[blockIdx.y];
  const int seg = a.offsets[e], cnt = a.counts[e];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int rt = warp % kRT, ks = warp / kRT;
  const int R0 = blockIdx.x * kRows + rt * 16;
  const bool wactive = R0 < a.rows;
  const int rA = kGateUp ? R0 + 2 * g : R0 + g;
  const int rB = kGateUp ? R0 + 2 * g + 1 : R0 + g + 8;
  const int64_t rowA = int64_t(e) * a.rows + rA, rowB = int64_t(e) * a.rows + rB;
  const uint8_t* bA = a.blocks + rowA * a.nsub * 16;
  const uint8_t* bB = a.blocks + rowB * a.nsub * 16;
  const uint8_t* sA = a.scales + rowA * a.nsub;
  const uint8_t* sB = a.scales + rowB * a.nsub;
  const int nchunk = a.kpad / 128, k8 = a.kpad / 8;
  const int per = (nchunk + kKS - 1) / kKS;
  const int c_begin = min(nchunk, ks * per), c_end = min(nchunk, c_begin + per);
  const bool has_work = wactive && c_begin < c_end;

  auto load = [&](int c, uint4& wa, uint4& wb, int& sa, int& sb) {
    const int sub = c * 4 + t;
    if (sub < a.nsub) {
      wa = ptx::ldg_nc_v4(bA + sub * 16);
      wb = ptx::ldg_nc_v4(bB + sub * 16);
      sa = sA[sub];
      sb = sB[sub];
    } else {
      wa = wb = make_uint4(0, 0, 0, 0);
      sa = sb = 0;
    }
  };
  uint4 ra[kRing], rb[kRing];
  int sa[kRing], sb[kRing];
  auto prefetch = [&] {
#pragma unroll
    for (int p = 0; p < kRing; ++p)
      if (c_begin + p < c_end) load(c_begin + p, ra[p], rb[p], sa[p], sb[p]);
  };
  // The first weight loads go out before the activations are staged (and, for
  // a dependent down projection, before waiting for the gate_up kernel).
  if (has_work) prefetch();
  bool ready = true;
  if (kPdl && !kGateUp) griddep_wait();

  for (int base = 0; base < cnt; base += kW4Tokens) {
    const int m = min(kW4Tokens, cnt - base);
    __syncthreads();
    for (int idx = threadIdx.x; idx < m * k8; idx += blockDim.x) {
      const int gi = idx / k8, q8 = idx % k8;
      const __half* src;
      if (kGateUp) {
        const int token = a.sorted[seg + base + gi] / a.topk;
        src = a.act + int64_t(token) * a.kpad;
      } else {
        src = a.act + int64_t(seg + base + gi) * a.kpad;
      }
      const int c = q8 >> 4, tt = (q8 >> 2) & 3, ii = q8 & 3;
      xs4[((c * 4 + ii) * 8 + gi) * 4 + tt] = *reinterpret_cast<const uint4*>(src + q8 * 8);
    }
    __syncthreads();

    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (has_work) {
      if (!ready) prefetch();
      ready = false;
      for (int c0 = c_begin; c0 < c_end; c0 += kRing) {
#pragma unroll
        for (int p = 0; p < kRing; ++p) {
          const int c = c0 + p;
          if (c >= c_end) break;
          const uint4 wa = ra[p], wb = rb[p];
          const int s_a = sa[p], s_b = sb[p];
          if (c + kRing < c_end) load(c + kRing, ra[p], rb[p], sa[p], sb[p]);
          // Largest scale among the row's nonzero sub-blocks of this chunk (4 lanes t).
          int mA = ((wa.x | wa.y | wa.z | wa.w) & 0x77777777u) ? s_a : -1;
          int mB = ((wb.x | wb.y | wb.z | wb.w) & 0x77777777u) ? s_b : -1;
          mA = max(mA, __shfl_xor_sync(~0u, mA, 1));
          mB = max(mB, __shfl_xor_sync(~0u, mB, 1));
          mA = max(mA, __shfl_xor_sync(~0u, mA, 2));
          mB = max(mB, __shfl_xor_sync(~0u, mB, 2));
          uint32_t la0, la1, lb0, lb1;
          w4_lut(max(mA - s_a, 0), la0, la1);
          w4_lut(max(mB - s_b, 0), lb0, lb1);
          const float fA = mA < 0 ? 0.f : e8m0_to_float(mA);
          const float fB = mB < 0 ? 0.f : e8m0_to_float(mB);
          float q[4] = {0.f, 0.f, 0.f, 0.f};
          const uint32_t wA[4] = {wa.x, wa.y, wa.z, wa.w}, wB[4] = {wb.x, wb.y, wb.z, wb.w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const uint4 bv = xs4[((c * 4 + i) * 8 + g) * 4 + t];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const uint32_t HA = w4_decode(wA[i] >> (16 * h), la0, la1);
              const uint32_t HB = w4_decode(wB[i] >> (16 * h), lb0, lb1);
              ptx::mma_16816(q, ptx::prmt(HA, 0, 0x1404), ptx::prmt(HB, 0, 0x1404), ptx::prmt(HA, 0, 0x3424),
                             ptx::prmt(HB, 0, 0x3424), h ? bv.z : bv.x, h ? bv.w : bv.y);
            }
          }
          acc[0] += q[0] * fA;
          acc[1] += q[1] * fA;
          acc[2] += q[2] * fB;
          acc[3] += q[3] * fB;
        }
      }
    }
    if (kKS > 1) {
      if (ks > 0) red[ks - 1][rt][lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      __syncthreads();
      if (ks != 0) continue;
#pragma unroll
      for (int j = 0; j < kKS - 1; ++j) {  // fixed order: deterministic
        const float4 v = red[j][rt][lane];
        acc[0] += v.x, acc[1] += v.y, acc[2] += v.z, acc[3] += v.w;
      }
    }
    if (!wactive) continue;
    const float biasA = bf16_to_float(a.bias[rowA]), biasB = bf16_to_float(a.bias[rowB]);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int tok = 2 * t + j;
      if (tok >= m) continue;
      const int row = seg + base + tok;
      if (kGateUp) {
        const float xsc = a.act_scale[a.sorted[row] / a.topk];
        const float v = swiglu(acc[j] * xsc + biasA, acc[2 + j] * xsc + biasB);
        a.out_act[int64_t(row) * a.out_ld + (rA >> 1)] = __float2half_rn(v);
      } else {
        a.out_y[int64_t(row) * a.rows + rA] = acc[j] + biasA;
        a.out_y[int64_t(row) * a.rows + rB] = acc[2 + j] + biasB;
      }
    }
  }
  if (kPdl) griddep_launch();  // after this block's results are written
}

// ---------------------------------------------------------------- FP8 path
// One warp per (sorted row, 128-column block): gather the token's input row,
// quantize 1x128; scales of expert e's segment packed as [kb][rows of e].
__global__ void gather_quant_kernel(const float* x, int H, int nkb, int topk, const int* sorted,
                                    const int* row_expert, const int* offsets, int rows_total, uint8_t* q,
                                    float* qs) {
  const int warp = int((int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5), lane = threadIdx.x & 31;
  if (warp >= rows_total * nkb) return;
  const int r = warp % rows_total, kb = warp / rows_total;
  const int slot = sorted[r], e = row_expert[r];
  const int off = offsets[e], mp = offsets[e + 1] - off;
  float v[4] = {0.f, 0.f, 0.f, 0.f};
  const int c = kb * 128 + lane * 4;
  if (slot >= 0) {
    const float* row = x + int64_t(slot / topk) * H;
    if (c + 3 < H) {
      const float4 f = *reinterpret_cast<const float4*>(row + c);
      v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    } else {
      for (int i = 0; i < 4; ++i) v[i] = c + i < H ? row[c + i] : 0.f;
    }
  }
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, o));
  const float sc = amax > 0.f ? amax / 448.f : 1.f, inv = 1.f / sc;
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(v[0] * inv, v[1] * inv), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(v[2] * inv, v[3] * inv), __NV_SATFINITE, __NV_E4M3);
  reinterpret_cast<uint32_t*>(q + int64_t(r) * nkb * 128)[kb * 32 + lane] = lo | (hi << 16);
  if (lane == 0) qs[int64_t(nkb) * off + int64_t(kb) * mp + (r - off)] = sc;
}

// D1 [rows][2I] bf16 (interleaved gate/up) + bias -> SwiGLU -> fp8 1x128 [rows][kpad_i].
__global__ void swiglu_quant_kernel(const __nv_bfloat16* d1, int I, int nkb, const uint16_t* b1, const int* sorted,
                                    const int* row_expert, const int* offsets, int r0, int nrows, uint8_t* q,
                                    float* qs) {
  const int warp = int((int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5), lane = threadIdx.x & 31;
  if (warp >= nrows * nkb) return;
  const int r = r0 + warp % nrows, kb = warp / nrows;
  const int e = row_expert[r];
  const int off = offsets[e], mp = offsets[e + 1] - off;
  const int j0 = kb * 128 + lane * 4;
  float v[4] = {0.f, 0.f, 0.f, 0.f};
  if (sorted[r] >= 0 && j0 < I) {  // I % 4 == 0: a lane's 4 columns are all in range or all out
    const uint4 raw = *reinterpret_cast<const uint4*>(d1 + int64_t(r) * 2 * I + 2 * j0);
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
    const uint16_t* bias = b1 + int64_t(e) * 2 * I + 2 * j0;
    for (int i = 0; i < 4; ++i) {
      const float gate = bf16_to_float(uint16_t(w[i] & 0xFFFF)) + bf16_to_float(bias[2 * i]);
      const float up = bf16_to_float(uint16_t(w[i] >> 16)) + bf16_to_float(bias[2 * i + 1]);
      v[i] = swiglu(gate, up);
    }
  }
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, o));
  const float sc = amax > 0.f ? amax / 448.f : 1.f, inv = 1.f / sc;
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(v[0] * inv, v[1] * inv), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(v[2] * inv, v[3] * inv), __NV_SATFINITE, __NV_E4M3);
  reinterpret_cast<uint32_t*>(q + int64_t(r) * nkb * 128)[kb * 32 + lane] = lo | (hi << 16);
  if (lane == 0) qs[int64_t(nkb) * off + int64_t(kb) * mp + (r - off)] = sc;
}

// out[t] (+)= sum_k w[t][k] * (y[inv[t,k]] (+ bias[e_k])), fixed order: deterministic.
template <typename T, bool kBias, bool kPdl = false>
__global__ void combine_kernel(const T* y, const int* inv, const int* ids, const float* gw, int topk,
                               const uint16_t* bias, int H, float* out, int accumulate) {
  if (kPdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  const int t = blockIdx.x;
  for (int n = threadIdx.x; n < H; n += blockDim.x) {
    float acc = 0.f;
    for (int k = 0; k < topk; ++k) {
      const int pos = inv[t * topk + k];
      if (pos < 0) continue;
      float v = float(y[int64_t(pos) * H + n]);
      if (kBias) v += bf16_to_float(bias[int64_t(ids[t * topk + k]) * H + n]);
      acc += gw[t * topk + k] * v;
    }
    out[int64_t(t) * H + n] = accumulate ? out[int64_t(t) * H + n] + acc : acc;
  }
}

int64_t kpad_of(int k) { return cpu::fold_kpad(k); }

}  // namespace

struct MoeLayer::Impl {
  Context& ctx;
  MoeShape s;
  MoeOptions opt;
  int max_tokens;
  int64_t kph, kpi, rows_cap;
  // FP8 path: experts of a tile spread over gemm_streams streams, each with
  // its own cuBLASLt workspace and plans.
  std::vector<cudaStream_t> gs;
  Fp8Gemm gemm;  // one plan cache; a workspace slice per stream
  DeviceArray<uint8_t> gemm_ws;
  static constexpr size_t kGemmWs = size_t(32) << 20;
  cudaEvent_t ev_fork{};
  std::vector<cudaEvent_t> ev_join;
  // routing
  DeviceArray<int> counts, offsets, sorted, row_expert, inv, active, n_active, err;
  // fused path
  DeviceArray<__half> xh, act16;
  DeviceArray<float> xs, y32;
  // FP8 path
  DeviceArray<uint8_t> a1, a2;
  DeviceArray<float> a1s, a2s;
  DeviceArray<__nv_bfloat16> d1, d2;
  // the FP8 expert workspace: 2 tiles x tile_experts x (w1 + w2)
  DeviceArray<uint8_t> ws_fp8;
  DeviceArray<float> ws_scales;
  int* h_counts = nullptr;  // pinned: counts[E], offsets[E+1]
  cudaEvent_t ev_ready[2]{}, ev_free[2]{};

  Impl(Context& c, const MoeShape& sh, int maxT, const MoeOptions& o)
      : ctx(c), s(sh), opt(o), max_tokens(maxT), gemm(c) {
    check(s.n_experts > 0 && s.topk > 0 && s.topk <= s.n_experts && s.hidden % 32 == 0 && s.hidden % 16 == 0 &&
              s.intermediate % 32 == 0 && s.intermediate > 0 && s.hidden > 0 && maxT > 0,
          DZ_ERR_INVALID_ARGUMENT, "MoeLayer: unsupported shape E=", s.n_experts, " topk=", s.topk, " H=", s.hidden,
          " I=", s.intermediate);
    check(opt.tile_experts >= 1 && opt.tile_experts <= 32, DZ_ERR_INVALID_ARGUMENT, "tile_experts must be 1..32");
    check(opt.gemm_streams >= 1 && opt.gemm_streams <= 16, DZ_ERR_INVALID_ARGUMENT, "gemm_streams must be 1..16");
    kph = kpad_of(s.hidden);
    kpi = kpad_of(s.intermediate);
    const int64_t slots = int64_t(maxT) * s.topk;
    rows_cap = slots + int64_t(s.n_experts) * (kPadRows - 1);
    DevicePool& P = ctx.pool();
    const int E = s.n_experts, H = s.hidden, I = s.intermediate;
    counts = DeviceArray<int>(P, E, "moe counts");
    offsets = DeviceArray<int>(P, E + 1, "moe offsets");
    sorted = DeviceArray<int>(P, rows_cap, "moe sorted slots");
    row_expert = DeviceArray<int>(P, rows_cap, "moe row experts");
    inv = DeviceArray<int>(P, slots, "moe slot rows");
    active = DeviceArray<int>(P, E, "moe active experts");
    n_active = DeviceArray<int>(P, 1, "moe active count");
    err = DeviceArray<int>(P, 1, "moe error flag");
    xh = DeviceArray<__half>(P, size_t(maxT) * kph, "moe fp16 input");
    xs = DeviceArray<float>(P, maxT, "moe input scales");
    act16 = DeviceArray<__half>(P, size_t(rows_cap) * kpi, "moe fp16 activations");
    y32 = DeviceArray<float>(P, size_t(rows_cap) * H, "moe expert outputs");
    a1 = DeviceArray<uint8_t>(P, size_t(rows_cap) * kph, "moe fp8 input");
    a1s = DeviceArray<float>(P, size_t(rows_cap) * (kph / 128), "moe fp8 input scales");
    a2 = DeviceArray<uint8_t>(P, size_t(rows_cap) * kpi, "moe fp8 activations");
    a2s = DeviceArray<float>(P, size_t(rows_cap) * (kpi / 128), "moe fp8 activation scales");
    d1 = DeviceArray<__nv_bfloat16>(P, size_t(rows_cap) * 2 * I, "moe gate_up output");
    d2 = DeviceArray<__nv_bfloat16>(P, size_t(rows_cap) * H, "moe down output");
    const size_t per_expert_fp8 = size_t(2 * I) * kph + size_t(H) * kpi;
    const size_t per_expert_sc = size_t(2 * I) * (kph / 128) + size_t(H) * (kpi / 128);
    ws_fp8 = DeviceArray<uint8_t>(P, 2 * opt.tile_experts * per_expert_fp8, "FP8 expert workspace");
    ws_scales = DeviceArray<float>(P, 2 * opt.tile_experts * per_expert_sc, "FP8 expert workspace scales");
    DZ_CUDA_CHECK(cudaMemsetAsync(err.get(), 0, sizeof(int), ctx.stream()));
    // Padding columns of the fp16 activations are never written by the kernels.
    DZ_CUDA_CHECK(cudaMemsetAsync(act16.get(), 0, act16.bytes(), ctx.stream()));
    DZ_CUDA_CHECK(cudaMallocHost(&h_counts, sizeof(int) * (2 * E + 1)));
    gemm_ws = DeviceArray<uint8_t>(P, kGemmWs * opt.gemm_streams, "cuBLASLt workspaces");
    DZ_CUDA_CHECK(cudaEventCreateWithFlags(&ev_fork, cudaEventDisableTiming));
    for (int i = 0; i < opt.gemm_streams; ++i) {
      cudaStream_t q;
      DZ_CUDA_CHECK(cudaStreamCreateWithFlags(&q, cudaStreamNonBlocking));
      gs.push_back(q);
      cudaEvent_t ev;
      DZ_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
      ev_join.push_back(ev);
    }
    for (int i = 0; i < 2; ++i) {
      DZ_CUDA_CHECK(cudaEventCreateWithFlags(&ev_ready[i], cudaEventDisableTiming));
      DZ_CUDA_CHECK(cudaEventCreateWithFlags(&ev_free[i], cudaEventDisableTiming));
    }
    const int smem = int(kW4Tokens * std::max(kph, kpi) * 2);
    for (auto k : {w4_kernel<true, 1, false>, w4_kernel<true, 1, true>, w4_kernel<true, 4, false>,
                   w4_kernel<true, 4, true>, w4_kernel<false, 1, false>, w4_kernel<false, 1, true>,
                   w4_kernel<false, 4, false>, w4_kernel<false, 4, true>})
      DZ_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    DZ_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
  }

  ~Impl() {
    for (auto q : gs) cudaStreamSynchronize(q), cudaStreamDestroy(q);
    for (auto ev : ev_join) cudaEventDestroy(ev);
    if (ev_fork) cudaEventDestroy(ev_fork);
    for (int i = 0; i < 2; ++i) {
      if (ev_ready[i]) cudaEventDestroy(ev_ready[i]);
      if (ev_free[i]) cudaEventDestroy(ev_free[i]);
    }
    if (h_counts) cudaFreeHost(h_counts);
  }

  // with_x: also convert x to the fused path's fp16 input (small T only).
  void route(const int* ids, int T, const float* x_small) {
    const int E = s.n_experts;
    route_kernel<<<1, kRouteThreads, sizeof(int) * (3 * E + 1), ctx.stream()>>>(
        ids, T * s.topk, E, counts.get(), offsets.get(), sorted.get(), row_expert.get(), inv.get(), active.get(),
        n_active.get(), err.get(), x_small, T, s.hidden, int(kph), xh.get(), xs.get());
    DZ_CUDA_LAUNCH_CHECK();
  }

  void fused(const MoeWeights& w, const float* x, const int* ids, const float* gw, int T, float* out, int accumulate) {
    cudaStream_t st = ctx.stream();
    const int E = s.n_experts, H = s.hidden, I = s.intermediate;
    if (T > kRouteConvertsX) {
      x_to_half_kernel<<<T, 256, 0, st>>>(x, H, int(kph), xh.get(), xs.get());
      DZ_CUDA_LAUNCH_CHECK();
    }
    const unsigned max_active = unsigned(std::min<int64_t>(E, int64_t(T) * s.topk));
    W4Args a{};
    a.sorted = sorted.get(), a.offsets = offsets.get(), a.counts = counts.get(), a.active = active.get();
    a.n_active = n_active.get();
    a.topk = s.topk;
    // gate_up + SwiGLU
    a.blocks = w.w1_blocks, a.scales = w.w1_scales, a.bias = w.b1;
    a.act = xh.get(), a.act_scale = xs.get();
    a.rows = 2 * I, a.nsub = H / 32, a.kpad = int(kph);
    a.out_act = act16.get(), a.out_ld = int(kpi);
    const int ks = opt.fused_k_split ? opt.fused_k_split : (int64_t(T) * s.topk <= 8 ? 4 : 1);
    const bool pdl = opt.pdl;
    launch_w4<true>(ks, pdl, 2 * I, max_active, kW4Tokens * kph * 2, st, a);
    // down
    a.blocks = w.w2_blocks, a.scales = w.w2_scales, a.bias = w.b2;
    a.act = act16.get(), a.act_scale = nullptr;
    a.rows = H, a.nsub = I / 32, a.kpad = int(kpi);
    a.out_y = y32.get();
    launch_w4<false>(ks, pdl, H, max_active, kW4Tokens * kpi * 2, st, a);
    if (pdl)
      launch(combine_kernel<float, false, true>, dim3(T), dim3(256), 0, st, true, (const float*)y32.get(),
             (const int*)inv.get(), ids, gw, s.topk, (const uint16_t*)nullptr, H, out, accumulate);
    else
      launch(combine_kernel<float, false, false>, dim3(T), dim3(256), 0, st, false, (const float*)y32.get(),
             (const int*)inv.get(), ids, gw, s.topk, (const uint16_t*)nullptr, H, out, accumulate);
  }

  template <bool G>
  void launch_w4(int ks, bool pdl, int rows, unsigned max_active, size_t smem, cudaStream_t st, const W4Args& a) {
    check(ks == 1 || ks == 4, DZ_ERR_INVALID_ARGUMENT, "fused_k_split must be 0 (auto), 1 or 4");
    const int per_block = 16 * (8 / ks);
    const dim3 grid(unsigned((rows + per_block - 1) / per_block), max_active);
    if (ks == 1)
      launch(pdl ? w4_kernel<G, 1, true> : w4_kernel<G, 1, false>, grid, dim3(kW4Threads), smem, st, pdl, a);
    else
      launch(pdl ? w4_kernel<G, 4, true> : w4_kernel<G, 4, false>, grid, dim3(kW4Threads), smem, st, pdl, a);
  }

  // Launch, optionally as a programmatic dependent of the previous kernel in the stream.
  template <typename... P, typename... A>
  static void launch(void (*k)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, bool pdl, A... args) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    DZ_CUDA_CHECK(cudaLaunchKernelEx(&cfg, k, args...));
  }

  void fp8(const MoeWeights& w, const float* x, const int* ids, const float* gw, int T, float* out, int accumulate) {
    cudaStream_t st = ctx.stream(), aux = ctx.aux_stream();
    const int E = s.n_experts, H = s.hidden, I = s.intermediate;
    DZ_CUDA_CHECK(cudaMemcpyAsync(h_counts, counts.get(), sizeof(int) * E, cudaMemcpyDeviceToHost, st));
    DZ_CUDA_CHECK(cudaMemcpyAsync(h_counts + E, offsets.get(), sizeof(int) * (E + 1), cudaMemcpyDeviceToHost, st));
    for (int i = 0; i < 2; ++i) DZ_CUDA_CHECK(cudaEventRecord(ev_free[i], st));
    DZ_CUDA_CHECK(cudaStreamSynchronize(st));
    const int* hc = h_counts;
    const int* ho = h_counts + E;
    const int rows_total = ho[E];
    const int nkb_h = int(kph / 128), nkb_i = int(kpi / 128);
    {
      const int64_t threads = int64_t(rows_total) * nkb_h * 32;
      gather_quant_kernel<<<unsigned((threads + 255) / 256), 256, 0, st>>>(
          x, H, nkb_h, s.topk, sorted.get(), row_expert.get(), offsets.get(), rows_total, a1.get(), a1s.get());
      DZ_CUDA_LAUNCH_CHECK();
    }
    std::vector<int> act_e;
    for (int e = 0; e < E; ++e)
      if (hc[e]) act_e.push_back(e);
    const size_t w1_fp8 = size_t(2 * I) * kph, w2_fp8 = size_t(H) * kpi;
    const size_t w1_sc = size_t(2 * I) * (kph / 128), w2_sc = size_t(H) * (kpi / 128);
    const int tile = opt.tile_experts;
    const Mxfp4Stack W1{w.w1_blocks, w.w1_scales, 2 * I, H}, W2{w.w2_blocks, w.w2_scales, H, I};
    for (size_t t0 = 0, ti = 0; t0 < act_e.size(); t0 += tile, ++ti) {
      const int n = int(std::min<size_t>(tile, act_e.size() - t0));
      const int buf = int(ti % 2);
      uint8_t* f1 = ws_fp8.get() + size_t(buf) * tile * (w1_fp8 + w2_fp8);
      uint8_t* f2 = f1 + size_t(tile) * w1_fp8;
      float* s1 = ws_scales.get() + size_t(buf) * tile * (w1_sc + w2_sc);
      float* s2 = s1 + size_t(tile) * w1_sc;
      DZ_CUDA_CHECK(cudaStreamWaitEvent(aux, ev_free[buf], 0));
      mxfp4_fold_experts(W1, act_e.data() + t0, n, Fp8Slots{f1, s1}, aux);
      mxfp4_fold_experts(W2, act_e.data() + t0, n, Fp8Slots{f2, s2}, aux);
      DZ_CUDA_CHECK(cudaEventRecord(ev_ready[buf], aux));
      DZ_CUDA_CHECK(cudaStreamWaitEvent(st, ev_ready[buf], 0));
      // Each expert: GEMM1 -> SwiGLU + 1x128 quantization -> GEMM2, on one of gs.
      const int S = int(gs.size());
      DZ_CUDA_CHECK(cudaEventRecord(ev_fork, st));
      for (int q = 0; q < std::min(S, n); ++q) DZ_CUDA_CHECK(cudaStreamWaitEvent(gs[size_t(q)], ev_fork, 0));
      for (int i = 0; i < n; ++i) {
        const int e = act_e[t0 + i];
        const int off = ho[e], mp = ho[e + 1] - ho[e];
        cudaStream_t q = gs[size_t(i % S)];
        uint8_t* wsp = gemm_ws.get() + size_t(i % S) * kGemmWs;
        gemm.run(a1.get() + size_t(off) * kph, a1s.get() + size_t(nkb_h) * off, f1 + i * w1_fp8, s1 + i * w1_sc,
                 d1.get() + size_t(off) * 2 * I, mp, 2 * I, int(kph), q, wsp, kGemmWs);
        const int64_t threads = int64_t(mp) * nkb_i * 32;
        swiglu_quant_kernel<<<unsigned((threads + 255) / 256), 256, 0, q>>>(
            d1.get(), I, nkb_i, w.b1, sorted.get(), row_expert.get(), offsets.get(), off, mp, a2.get(), a2s.get());
        DZ_CUDA_LAUNCH_CHECK();
        gemm.run(a2.get() + size_t(off) * kpi, a2s.get() + size_t(nkb_i) * off, f2 + i * w2_fp8, s2 + i * w2_sc,
                 d2.get() + size_t(off) * H, mp, H, int(kpi), q, wsp, kGemmWs);
      }
      for (int q = 0; q < std::min(S, n); ++q) {
        DZ_CUDA_CHECK(cudaEventRecord(ev_join[size_t(q)], gs[size_t(q)]));
        DZ_CUDA_CHECK(cudaStreamWaitEvent(st, ev_join[size_t(q)], 0));
      }
      DZ_CUDA_CHECK(cudaEventRecord(ev_free[buf], st));
    }
    combine_kernel<__nv_bfloat16, true><<<T, 256, 0, st>>>(d2.get(), inv.get(), ids, gw, s.topk, w.b2, H, out,
                                                           accumulate);
    DZ_CUDA_LAUNCH_CHECK();
    // Later calls must not refold into a buffer the aux stream may still be writing.
    DZ_CUDA_CHECK(cudaStreamWaitEvent(aux, ev_free[0], 0));
    DZ_CUDA_CHECK(cudaStreamWaitEvent(aux, ev_free[1], 0));
  }
};

MoeLayer::MoeLayer(Context& ctx, const MoeShape& shape, int max_tokens, const MoeOptions& opt)
    : p_(std::make_unique<Impl>(ctx, shape, max_tokens, opt)), shape_(shape) {}

MoeLayer::~MoeLayer() = default;

MoeOptions& MoeLayer::options() { return p_->opt; }

MoePath MoeLayer::choose(int T) const {
  const double per_expert = double(T) * shape_.topk / shape_.n_experts;
  return per_expert <= p_->opt.fused_max_tokens_per_expert ? MoePath::kFused : MoePath::kFp8;
}

void MoeLayer::forward(const MoeWeights& w, const float* x, const int* ids, const float* gw, int T, float* out,
                       MoePath path, bool accumulate) {
  check(T >= 1 && T <= p_->max_tokens, DZ_ERR_INVALID_ARGUMENT, "MoeLayer::forward: ", T,
        " tokens (scratch sized for ", p_->max_tokens, ")");
  check(x && ids && gw && out && w.w1_blocks && w.w1_scales && w.b1 && w.w2_blocks && w.w2_scales && w.b2,
        DZ_ERR_INVALID_ARGUMENT, "MoeLayer::forward: null pointer");
  if (path == MoePath::kAuto) path = choose(T);
  p_->route(ids, T, path == MoePath::kFused && T <= kRouteConvertsX ? x : nullptr);
  if (path == MoePath::kFused)
    p_->fused(w, x, ids, gw, T, out, accumulate ? 1 : 0);
  else
    p_->fp8(w, x, ids, gw, T, out, accumulate ? 1 : 0);
}

size_t MoeLayer::fp8_workspace_bytes() const { return p_->ws_fp8.bytes() + p_->ws_scales.bytes(); }

size_t MoeLayer::scratch_bytes() const {
  const Impl& q = *p_;
  return q.counts.bytes() + q.offsets.bytes() + q.sorted.bytes() + q.row_expert.bytes() + q.inv.bytes() +
         q.active.bytes() + q.xh.bytes() + q.xs.bytes() + q.act16.bytes() + q.y32.bytes() + q.a1.bytes() +
         q.a1s.bytes() + q.a2.bytes() + q.a2s.bytes() + q.d1.bytes() + q.d2.bytes();
}

int* MoeLayer::error_flag() { return p_->err.get(); }

int MoeLayer::take_error() {
  int h = 0;
  DZ_CUDA_CHECK(cudaMemcpyAsync(&h, p_->err.get(), sizeof h, cudaMemcpyDeviceToHost, p_->ctx.stream()));
  DZ_CUDA_CHECK(cudaMemsetAsync(p_->err.get(), 0, sizeof(int), p_->ctx.stream()));
  DZ_CUDA_CHECK(cudaStreamSynchronize(p_->ctx.stream()));
  return h;
}

}  // namespace dz::cuda
