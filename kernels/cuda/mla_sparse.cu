#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "cuda/mla_sparse.h"
#include "cuda/ptx.cuh"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {

constexpr int kD = kMlaRank + kMlaRope;  // 576: a key's width
constexpr int kRow = kD + 8;             // a shared-memory row (bf16): 1168 bytes, so ldmatrix's 8 rows hit 8 banks
constexpr int kHeads = 64;               // heads a block: 4 groups of 16 (the MMA rows)
constexpr int kStep = 64;                // selected positions a step
constexpr int kPRow = kStep + 8;         // probabilities' row (bf16)
constexpr int kWarps = 16;               // warp (group, quarter): S for 16 positions, then O for 128 dims
constexpr int kThreads = kWarps * 32;
constexpr int kChunks = kD / 8;  // 16-byte pieces of a row
constexpr size_t kSmem =
    size_t(kHeads + kStep) * kRow * 2 + size_t(kHeads) * kPRow * 2 + size_t(kHeads) * 4 * 4 * 2 + size_t(kStep) * 4;
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

struct Partials {
  float* o;  // [batch, heads, splits, kMlaRank]: unnormalised sums
  float* m;  // [batch, heads, splits]: running max (log2 units)
  float* l;  // [batch, heads, splits]: sum of probabilities under that max
};

// Block (split, head block, batch row): steps [st0, st1) of 64 selected
// positions each; positions gathered by cp.async into shared memory, S = Q K^T
// by warp (group, 16 positions), the step's row max and sums shared through
// shared memory, P (bf16) V by warp (group, 128 dims), online softmax across
// steps.
__global__ void __launch_bounds__(kThreads, 1)
    sparse_mla_kernel(const SparseMlaDecode a, int steps_per_split, Partials out) {
  extern __shared__ __align__(16) unsigned char sm_raw[];
  uint16_t* const Qs = reinterpret_cast<uint16_t*>(sm_raw);
  uint16_t* const Ks = Qs + kHeads * kRow;
  uint16_t* const Ps = Ks + kStep * kRow;
  float* const smax = reinterpret_cast<float*>(Ps + kHeads * kPRow);  // [head][quarter]
  float* const ssum = smax + kHeads * 4;
  int* const valid = reinterpret_cast<int*>(ssum + kHeads * 4);
  const int sp = blockIdx.x, b = blockIdx.z, h0 = blockIdx.y * kHeads;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int hg = warp >> 2, wq = warp & 3;
  const int H = a.n_heads;

  // The block's queries; heads past H read as zeros.
  for (int i = tid; i < kHeads * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const bool ok = h0 + r < H;
    const uint16_t* src = a.q + ((int64_t(b) * H + (ok ? h0 + r : 0)) * kD + c * 8);
    ptx::cp_async16_zfill(ptx::smem_u32(Qs + r * kRow + c * 8), src, ok ? 16u : 0u);
  }
  ptx::cp_async_commit();

  const uint8_t* const* const pages = a.pages[b];
  const int32_t* const sel = a.sel ? a.sel + int64_t(b) * a.topk : nullptr;
  // Dense causal mode: the row's own count bounds the steps (uniform in the block).
  const int count = sel ? a.topk : int(a.n_visible[b] < a.topk ? a.n_visible[b] : a.topk);
  const int n_steps = (count + kStep - 1) / kStep;
  const int st0 = sp * steps_per_split, st1 = min(st0 + steps_per_split, n_steps);
  const float sl2 = a.scale * kLog2e;
  float o[16][4];
#pragma unroll
  for (int n = 0; n < 16; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  const int row0 = hg * 16 + g;  // this thread's rows: row0 and row0 + 8 of the block

  for (int st = st0; st < st1; ++st) {
    // Gather the step's selected rows; unselected slots are zeros (P is 0 there, and 0 x 0 stays 0).
    for (int i = tid; i < kStep * kChunks; i += kThreads) {
      const int r = i / kChunks, c = i % kChunks;
      const int j = st * kStep + r;
      const int p = j < count ? (sel ? sel[j] : j) : -1;
      const uint8_t* src = reinterpret_cast<const uint8_t*>(a.q);  // any valid address when nothing is read
      if (p >= 0) src = pages[p / a.page_tokens] + size_t(p % a.page_tokens) * a.stride + a.offset + c * 16;
      ptx::cp_async16_zfill(ptx::smem_u32(Ks + r * kRow + c * 8), src, p >= 0 ? 16u : 0u);
      if (c == 0) valid[r] = p >= 0;
    }
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
    __syncthreads();

    // S for this warp's 16 heads x 16 positions.
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    {
      const uint32_t qa = ptx::smem_u32(Qs + (hg * 16 + (lane & 15)) * kRow + (lane >> 4) * 8);
      const uint32_t kb =
          ptx::smem_u32(Ks + (wq * 16 + (lane & 7) + ((lane >> 4) << 3)) * kRow + ((lane >> 3) & 1) * 8);
#pragma unroll 4
      for (int k0 = 0; k0 < kD; k0 += 16) {
        uint32_t af[4], bf[4];
        ptx::ldsm_x4(af, qa + k0 * 2);
        ptx::ldsm_x4(bf, kb + k0 * 2);
        ptx::mma_16816<true>(s[0], af[0], af[1], af[2], af[3], bf[0], bf[1]);
        ptx::mma_16816<true>(s[1], af[0], af[1], af[2], af[3], bf[2], bf[3]);
      }
    }
    // Scale (log2 units), mask, this quarter's row maxima.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int pos = wq * 16 + n * 8 + 2 * t + (e & 1);
        s[n][e] = valid[pos] ? s[n][e] * sl2 : -INFINITY;
        mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    }
    if (t == 0) smax[row0 * 4 + wq] = mx[0], smax[(row0 + 8) * 4 + wq] = mx[1];
    __syncthreads();
    float mu[2], alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float* m4 = smax + (row0 + 8 * r) * 4;
      const float m_new = fmaxf(m_run[r], fmaxf(fmaxf(m4[0], m4[1]), fmaxf(m4[2], m4[3])));
      mu[r] = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing selected yet stays at zero
      alpha[r] = exp2f(m_run[r] - mu[r]);
      m_run[r] = m_new;
    }
    // Probabilities: bf16 into shared memory for the value product, fp32 row sums.
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      float p[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) p[e] = exp2f(s[n][e] - mu[e >> 1]), sum[e >> 1] += p[e];
      const int col = wq * 16 + n * 8 + 2 * t;
      *reinterpret_cast<uint32_t*>(Ps + row0 * kPRow + col) = pack_bf16(p[0], p[1]);
      *reinterpret_cast<uint32_t*>(Ps + (row0 + 8) * kPRow + col) = pack_bf16(p[2], p[3]);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
      sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
    }
    if (t == 0) ssum[row0 * 4 + wq] = sum[0], ssum[(row0 + 8) * 4 + wq] = sum[1];
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float* s4 = ssum + (row0 + 8 * r) * 4;
      l_run[r] = l_run[r] * alpha[r] + ((s4[0] + s4[1]) + (s4[2] + s4[3]));
    }
#pragma unroll
    for (int n = 0; n < 16; ++n) o[n][0] *= alpha[0], o[n][1] *= alpha[0], o[n][2] *= alpha[1], o[n][3] *= alpha[1];
    // O (16 heads x this warp's 128 dims of c_kv) += P V.
    {
      const uint32_t pa = ptx::smem_u32(Ps + (hg * 16 + (lane & 15)) * kPRow + (lane >> 4) * 8);
      const uint32_t vb = ptx::smem_u32(Ks + ((lane & 7) + ((lane >> 3) & 1) * 8) * kRow + wq * 128 + (lane >> 4) * 8);
#pragma unroll
      for (int k0 = 0; k0 < kStep; k0 += 16) {
        uint32_t af[4];
        ptx::ldsm_x4(af, pa + k0 * 2);
#pragma unroll
        for (int n2 = 0; n2 < 8; ++n2) {
          uint32_t bf[4];
          ptx::ldsm_x4<true>(bf, vb + (k0 * kRow + n2 * 16) * 2);
          ptx::mma_16816<true>(o[2 * n2], af[0], af[1], af[2], af[3], bf[0], bf[1]);
          ptx::mma_16816<true>(o[2 * n2 + 1], af[0], af[1], af[2], af[3], bf[2], bf[3]);
        }
      }
    }
    __syncthreads();  // the next step rewrites K, P and the row statistics
  }

  // This split's partial sums.
  const int splits = gridDim.x;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = h0 + row0 + 8 * r;
    if (h >= H) continue;
    const int64_t bh = (int64_t(b) * H + h) * splits + sp;
    float* po = out.o + bh * kMlaRank + wq * 128;
#pragma unroll
    for (int n = 0; n < 16; ++n)
      *reinterpret_cast<float2*>(po + n * 8 + 2 * t) = make_float2(o[n][2 * r], o[n][2 * r + 1]);
    if (wq == 0 && t == 0) out.m[bh] = m_run[r], out.l[bh] = l_run[r];
  }
}

// Block (batch row, head): the splits merged, 4 dims a thread.
__global__ void sparse_mla_combine_kernel(Partials in, int splits, float* out) {
  const int64_t bh = blockIdx.x;
  const float* m = in.m + bh * splits;
  const float* l = in.l + bh * splits;
  float M = -INFINITY;
  for (int s = 0; s < splits; ++s) M = fmaxf(M, m[s]);
  float L = 0.f;
  for (int s = 0; s < splits; ++s)
    if (m[s] != -INFINITY) L += l[s] * exp2f(m[s] - M);
  const float inv = L > 0.f ? 1.f / L : 0.f;
  for (int d = threadIdx.x * 4; d < kMlaRank; d += blockDim.x * 4) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < splits; ++s) {
      if (m[s] == -INFINITY) continue;
      const float w = exp2f(m[s] - M);
      const float4 v = *reinterpret_cast<const float4*>(in.o + (bh * splits + s) * kMlaRank + d);
      acc.x += w * v.x, acc.y += w * v.y, acc.z += w * v.z, acc.w += w * v.w;
    }
    *reinterpret_cast<float4*>(out + bh * kMlaRank + d) =
        make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
  }
}

size_t align256(size_t b) { return (b + 255) / 256 * 256; }

Partials carve(const SparseMlaDecode& a, int splits, void* base) {
  const size_t n = size_t(a.batch) * a.n_heads * splits;
  uint8_t* p = static_cast<uint8_t*>(base);
  Partials q{};
  q.o = reinterpret_cast<float*>(p), p += align256(n * kMlaRank * 4);
  q.m = reinterpret_cast<float*>(p), p += align256(n * 4);
  q.l = reinterpret_cast<float*>(p);
  return q;
}

int steps_of(const SparseMlaDecode& a) { return (a.topk + kStep - 1) / kStep; }

constexpr int kGenWarps = 4;
constexpr int kGenPer = kMlaGenericMaxRank / 32;  // latent values a lane holds
constexpr int kGenRopePer = kMlaGenericMaxRope / 32;

__device__ __forceinline__ float bf16_at(const __nv_bfloat16* p, int i) { return __bfloat162float(p[i]); }

// Block (head, query): warp w takes selected positions w, w + 4, ...; a lane
// holds latent columns lane + 32 i. Scores and sums in fp32.
__global__ void __launch_bounds__(kGenWarps * 32) sparse_mla_generic_kernel(SparseMlaGeneric a) {
  const int h = blockIdx.x, qi = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __shared__ float qs[kMlaGenericMaxRank + kMlaGenericMaxRope];
  __shared__ float ms[kGenWarps], ls[kGenWarps];
  __shared__ float os[kGenWarps][kMlaGenericMaxRank];
  const int qd = a.rank + a.rope;
  const float* q = a.q + (size_t(qi) * a.n_heads + h) * qd;
  for (int c = threadIdx.x; c < qd; c += blockDim.x) qs[c] = q[c];
  __syncthreads();
  const uint8_t* const* pages = a.pages[qi];
  const int32_t* sel = a.sel ? a.sel + size_t(qi) * a.topk : nullptr;
  const int count = sel ? a.topk : int(a.n_visible[qi] < a.topk ? a.n_visible[qi] : a.topk);
  float m = -INFINITY, l = 0.f, o[kGenPer];
#pragma unroll
  for (int i = 0; i < kGenPer; ++i) o[i] = 0.f;
  for (int j = warp; j < count; j += kGenWarps) {
    const int p = sel ? sel[j] : j;
    if (p < 0) continue;
    const __nv_bfloat16* rec = reinterpret_cast<const __nv_bfloat16*>(pages[p / a.page_tokens] +
                                                                      size_t(p % a.page_tokens) * a.stride + a.offset);
    float lat[kGenPer], dot = 0.f;
#pragma unroll
    for (int i = 0; i < kGenPer; ++i) {
      const int c = lane + 32 * i;
      lat[i] = c < a.rank ? bf16_at(rec, c) : 0.f;
      if (c < a.rank) dot += qs[c] * lat[i];
    }
#pragma unroll
    for (int i = 0; i < kGenRopePer; ++i) {
      const int c = lane + 32 * i;
      if (c < a.rope) dot += qs[a.rank + c] * bf16_at(rec, a.rank + c);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    const float sc = dot * a.scale, mn = fmaxf(m, sc);
    const float alpha = expf(m - mn), pe = expf(sc - mn);  // m = -inf first: alpha = 0
    l = l * alpha + pe;
#pragma unroll
    for (int i = 0; i < kGenPer; ++i) o[i] = o[i] * alpha + pe * lat[i];
    m = mn;
  }
  if (lane == 0) ms[warp] = m, ls[warp] = l;
#pragma unroll
  for (int i = 0; i < kGenPer; ++i)
    if (lane + 32 * i < a.rank) os[warp][lane + 32 * i] = o[i];
  __syncthreads();
  float mx = -INFINITY;
#pragma unroll
  for (int w = 0; w < kGenWarps; ++w) mx = fmaxf(mx, ms[w]);
  float wt[kGenWarps], sum = 0.f;
#pragma unroll
  for (int w = 0; w < kGenWarps; ++w) sum += (wt[w] = ls[w] > 0.f ? expf(ms[w] - mx) : 0.f) * ls[w];
  float* out = a.out + (size_t(qi) * a.n_heads + h) * a.rank;
  for (int c = threadIdx.x; c < a.rank; c += blockDim.x) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kGenWarps; ++w) v += wt[w] * os[w][c];
    out[c] = sum > 0.f ? v / sum : 0.f;
  }
}

}  // namespace

void sparse_mla_generic(const SparseMlaGeneric& a, cudaStream_t s) {
  check(a.rank > 0 && a.rank <= kMlaGenericMaxRank && a.rope >= 0 && a.rope <= kMlaGenericMaxRope, DZ_ERR_UNSUPPORTED,
        "CUDA sparse MLA: kv_lora_rank ", a.rank, " and qk_rope_head_dim ", a.rope, " (at most ", kMlaGenericMaxRank,
        " and ", kMlaGenericMaxRope, ")");
  check(
      a.page_tokens > 0 && a.stride % 2 == 0 && a.offset % 2 == 0 && a.offset + size_t(a.rank + a.rope) * 2 <= a.stride,
      DZ_ERR_INVALID_ARGUMENT, "CUDA sparse MLA: latent records of ", a.stride, " bytes, latent at ", a.offset);
  check(a.topk > 0 && a.n_heads > 0 && std::isfinite(a.scale), DZ_ERR_INVALID_ARGUMENT, "CUDA sparse MLA: top-k ",
        a.topk, ", ", a.n_heads, " heads, scale ", a.scale);
  check(a.sel || a.n_visible, DZ_ERR_INVALID_ARGUMENT, "CUDA sparse MLA: neither a selection nor visible counts");
  if (a.n_q <= 0) return;
  sparse_mla_generic_kernel<<<dim3(unsigned(a.n_heads), unsigned(a.n_q)), kGenWarps * 32, 0, s>>>(a);
  DZ_CUDA_LAUNCH_CHECK();
}

void sparse_mla_validate(const SparseMlaDecode& a) {
  check(a.batch >= 0 && a.n_heads > 0 && a.n_heads % 16 == 0, DZ_ERR_UNSUPPORTED, "CUDA sparse MLA: ", a.n_heads,
        " heads (a multiple of 16)");
  check(a.topk > 0, DZ_ERR_INVALID_ARGUMENT, "CUDA sparse MLA: top-k ", a.topk);
  check(a.page_tokens > 0 && a.stride % 16 == 0 && a.offset % 16 == 0, DZ_ERR_INVALID_ARGUMENT,
        "CUDA sparse MLA: latent records need 16-byte alignment (stride ", a.stride, ", offset ", a.offset, ")");
  check(a.offset + size_t(kD) * 2 <= a.stride, DZ_ERR_INVALID_ARGUMENT, "CUDA sparse MLA: a latent (", kD * 2,
        " bytes at ", a.offset, ") overruns its ", a.stride, "-byte record");
  check(std::isfinite(a.scale) && a.scale > 0, DZ_ERR_INVALID_ARGUMENT, "CUDA sparse MLA: softmax scale ", a.scale);
}

int sparse_mla_splits(const SparseMlaDecode& a, int sm_count) {
  const int blocks = std::max(1, a.batch * ((a.n_heads + kHeads - 1) / kHeads));
  const int want = std::max(1, std::min(steps_of(a), sm_count / blocks));
  const int per = (steps_of(a) + want - 1) / want;
  return (steps_of(a) + per - 1) / per;  // no empty split
}

size_t sparse_mla_scratch_bytes(const SparseMlaDecode& a, int splits) {
  const size_t n = size_t(a.batch) * a.n_heads * size_t(std::max(1, splits));
  return align256(n * kMlaRank * 4) + 2 * align256(n * 4);
}

void sparse_mla_decode(const SparseMlaDecode& a, int splits, void* scratch, size_t scratch_bytes, cudaStream_t st) {
  sparse_mla_validate(a);
  check(a.sel || a.n_visible, DZ_ERR_INVALID_ARGUMENT, "CUDA sparse MLA: neither a selection nor visible counts");
  check(splits >= 1 && splits <= steps_of(a), DZ_ERR_INVALID_ARGUMENT, "CUDA sparse MLA: ", splits, " splits of ",
        steps_of(a), " steps");
  check(scratch_bytes >= sparse_mla_scratch_bytes(a, splits), DZ_ERR_INVALID_ARGUMENT, "CUDA sparse MLA: scratch of ",
        scratch_bytes, " bytes, needs ", sparse_mla_scratch_bytes(a, splits));
  if (a.batch == 0) return;
  static const bool attr = [] {
    DZ_CUDA_CHECK(cudaFuncSetAttribute(sparse_mla_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)));
    return true;
  }();
  (void)attr;
  const int per = (steps_of(a) + splits - 1) / splits;
  const int used = (steps_of(a) + per - 1) / per;  // splits that hold a step
  const Partials p = carve(a, used, scratch);
  const dim3 grid(unsigned(used), unsigned((a.n_heads + kHeads - 1) / kHeads), unsigned(a.batch));
  sparse_mla_kernel<<<grid, kThreads, kSmem, st>>>(a, per, p);
  DZ_CUDA_LAUNCH_CHECK();
  sparse_mla_combine_kernel<<<unsigned(a.batch * a.n_heads), 128, 0, st>>>(p, used, a.out);
  DZ_CUDA_LAUNCH_CHECK();
}

}  // namespace dz::cuda
