#include <cuda_bf16.h>

#include <algorithm>

#include "common/error.h"
#include "cuda/bf16_gemm.h"
#include "cuda/moe_bf16.h"
#include "cuda/norm.h"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {

// Block a row, 16-byte chunks where H allows, else 2-byte values.
__global__ void gather_rows_kernel(const uint16_t* __restrict__ src, const int32_t* __restrict__ rows, int H,
                                   uint16_t* __restrict__ dst) {
  const uint16_t* s = src + size_t(rows[blockIdx.x]) * H;
  uint16_t* d = dst + size_t(blockIdx.x) * H;
  if (H % 8 == 0) {
    for (int c = threadIdx.x; c < H / 8; c += blockDim.x)
      reinterpret_cast<uint4*>(d)[c] = reinterpret_cast<const uint4*>(s)[c];
  } else {
    for (int c = threadIdx.x; c < H; c += blockDim.x) d[c] = s[c];
  }
}

// Block a token; the k experts summed in slot order.
__global__ void combine_kernel(const float* __restrict__ y, const int32_t* __restrict__ where,
                               const float* __restrict__ w, int k, int H, float* __restrict__ x) {
  const int t = blockIdx.x;
  for (int c = threadIdx.x; c < H; c += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < k; ++j) acc = fmaf(w[t * k + j], y[size_t(where[t * k + j]) * H + c], acc);
    x[size_t(t) * H + c] += acc;
  }
}

constexpr int kWarps = 8;  // warps a block in the few-slot kernels, one output row each

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// R bf16 rows of n values (n % 8 == 0, 16-byte aligned; null: skipped, 0)
// dotted with fp32 vectors in shared memory by one warp, every row's 16-byte
// loads in flight together (one row at a time leaves HBM idle between them).
template <int R>
__device__ __forceinline__ void rows_dot(const uint16_t* const (&w)[R], const float* const (&x)[R], int n, int lane,
                                         float (&out)[R]) {
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  for (int c = lane * 8; c < n; c += 256) {
    uint4 v[R];
#pragma unroll
    for (int r = 0; r < R; ++r) v[r] = w[r] ? __ldg(reinterpret_cast<const uint4*>(w[r] + c)) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float4 x0 = *reinterpret_cast<const float4*>(x[r] + c), x1 = *reinterpret_cast<const float4*>(x[r] + c + 4);
      acc[r] = fmaf(__uint_as_float(v[r].x << 16), x0.x, acc[r]);
      acc[r] = fmaf(__uint_as_float(v[r].x & 0xffff0000u), x0.y, acc[r]);
      acc[r] = fmaf(__uint_as_float(v[r].y << 16), x0.z, acc[r]);
      acc[r] = fmaf(__uint_as_float(v[r].y & 0xffff0000u), x0.w, acc[r]);
      acc[r] = fmaf(__uint_as_float(v[r].z << 16), x1.x, acc[r]);
      acc[r] = fmaf(__uint_as_float(v[r].z & 0xffff0000u), x1.y, acc[r]);
      acc[r] = fmaf(__uint_as_float(v[r].w << 16), x1.z, acc[r]);
      acc[r] = fmaf(__uint_as_float(v[r].w & 0xffff0000u), x1.w, acc[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) out[r] = warp_sum(acc[r]);
}

// n bf16 values (n % 8 == 0, 16-byte aligned) into fp32 shared memory by the
// block, 16-byte loads all issued before the first store (a load-store loop
// of 2-byte values waits out the memory latency once per iteration).
__device__ __forceinline__ void fill_f32(const uint16_t* __restrict__ src, int n, float* dst) {
  constexpr int kMax = 8;  // chunks a thread holds (n <= 8 * 8 * 256 values: the largest smem fill)
  uint4 v[kMax];
#pragma unroll
  for (int i = 0; i < kMax; ++i) {
    const int c = (threadIdx.x + i * kWarps * 32) * 8;
    if (c < n) v[i] = __ldg(reinterpret_cast<const uint4*>(src + c));
  }
#pragma unroll
  for (int i = 0; i < kMax; ++i) {
    const int c = (threadIdx.x + i * kWarps * 32) * 8;
    if (c >= n) continue;
    const uint32_t u[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
    float4* d = reinterpret_cast<float4*>(dst + c);
    d[0] = make_float4(__uint_as_float(u[0] << 16), __uint_as_float(u[0] & 0xffff0000u), __uint_as_float(u[1] << 16),
                       __uint_as_float(u[1] & 0xffff0000u));
    d[1] = make_float4(__uint_as_float(u[2] << 16), __uint_as_float(u[2] & 0xffff0000u), __uint_as_float(u[3] << 16),
                       __uint_as_float(u[3] & 0xffff0000u));
  }
  // Longer fills (past 16384 values) in further rounds.
  for (int c0 = kMax * kWarps * 32 * 8; c0 < n; c0 += kWarps * 32 * 8) {
    const int c = c0 + threadIdx.x * 8;
    if (c >= n) continue;
    const uint4 w = __ldg(reinterpret_cast<const uint4*>(src + c));
    const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
      dst[c + 2 * i] = __uint_as_float(u[i] << 16), dst[c + 2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
  __syncthreads();
}

constexpr int kGateRows = 2;  // gate_up: intermediate rows a warp (their gate and up rows: 4 loads in flight)
constexpr int kDownRows = 2;  // down: output rows a warp, each over kDownSlots slots at a time
constexpr int kDownSlots = 4;

// Block (8 warps x kGateRows rows j, slot s): act[s][j] = bf16(silu(gate_j . x)
// * (up_j . x)) of the slot's expert, x its token's input row (silu as silu_mul's).
__global__ void __launch_bounds__(kWarps * 32)
    few_gate_up_kernel(const uint16_t* __restrict__ xb, const int32_t* __restrict__ ids, int k, int H, int I,
                       const uint16_t* __restrict__ w13, float limit, uint16_t* __restrict__ act) {
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  const int s = blockIdx.y, t = s / k, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  fill_f32(xb + size_t(t) * H, H, xs);
  const int j0 = (blockIdx.x * kWarps + warp) * kGateRows;
  if (j0 >= I) return;
  const uint16_t* w = w13 + size_t(ids[s]) * 2 * I * H;
  const uint16_t* rows[2 * kGateRows];
  const float* xv[2 * kGateRows];
#pragma unroll
  for (int r = 0; r < kGateRows; ++r) {
    const bool ok = j0 + r < I;
    rows[2 * r] = ok ? w + size_t(j0 + r) * H : nullptr;
    rows[2 * r + 1] = ok ? w + size_t(I + j0 + r) * H : nullptr;
    xv[2 * r] = xv[2 * r + 1] = xs;
  }
  float d[2 * kGateRows];
  rows_dot(rows, xv, H, lane, d);
#pragma unroll
  for (int r = 0; r < kGateRows; ++r)
    if (lane == 0 && j0 + r < I) {
      float g = d[2 * r], u = d[2 * r + 1];
      if (limit > 0) g = fminf(g, limit), u = fminf(fmaxf(u, -limit), limit);
      const float sg = float(double(g) / (1.0 + exp(-double(g))));
      act[size_t(s) * I + j0 + r] = __bfloat16_as_ushort(__float2bfloat16_rn(sg * u));
    }
}

// Block (8 warps x kDownRows rows n, token t): x[t][n] += sum_j w[t k + j]
// (down_{e_j} row n . act[t k + j]), the slots kDownSlots at a time.
__global__ void __launch_bounds__(kWarps * 32)
    few_down_kernel(const uint16_t* __restrict__ act, const int32_t* __restrict__ ids, const float* __restrict__ gw,
                    int k, int H, int I, const uint16_t* __restrict__ w2, float* __restrict__ x) {
  extern __shared__ float4 smem4[];
  float* as = reinterpret_cast<float*>(smem4);  // [k][I]
  const int t = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  fill_f32(act + size_t(t) * k * I, k * I, as);
  const int n0 = (blockIdx.x * kWarps + warp) * kDownRows;
  if (n0 >= H) return;
  float y[kDownRows] = {};
  for (int j0 = 0; j0 < k; j0 += kDownSlots) {
    const uint16_t* rows[kDownRows * kDownSlots];
    const float* av[kDownRows * kDownSlots];
#pragma unroll
    for (int r = 0; r < kDownRows * kDownSlots; ++r) {
      const int n = n0 + r / kDownSlots, j = j0 + r % kDownSlots;
      const bool ok = n < H && j < k;
      rows[r] = ok ? w2 + (size_t(ids[t * k + j]) * H + n) * I : nullptr;
      av[r] = as + (ok ? j : 0) * I;
    }
    float d[kDownRows * kDownSlots];
    rows_dot(rows, av, I, lane, d);
#pragma unroll
    for (int r = 0; r < kDownRows * kDownSlots; ++r) {
      const int j = j0 + r % kDownSlots;
      if (j < k) y[r / kDownSlots] = fmaf(gw[t * k + j], d[r], y[r / kDownSlots]);
    }
  }
#pragma unroll
  for (int r = 0; r < kDownRows; ++r)
    if (lane == 0 && n0 + r < H) x[size_t(t) * H + n0 + r] += y[r];
}

}  // namespace

void gather_rows_bf16(const uint16_t* src, const int32_t* rows, int n, int H, uint16_t* dst, cudaStream_t s) {
  check(H > 0 && n >= 0, DZ_ERR_INVALID_ARGUMENT, "gather_rows_bf16: ", n, " rows of ", H);
  if (n == 0) return;
  gather_rows_kernel<<<unsigned(n), 128, 0, s>>>(src, rows, H, dst);
  DZ_CUDA_LAUNCH_CHECK();
}

void moe_combine(const float* y, const int32_t* where, const float* w, int T, int k, int H, float* x, cudaStream_t s) {
  check(H > 0 && T >= 0 && k > 0, DZ_ERR_INVALID_ARGUMENT, "moe_combine: ", T, " tokens, top-", k, ", ", H);
  if (T == 0) return;
  combine_kernel<<<unsigned(T), 256, 0, s>>>(y, where, w, k, H, x);
  DZ_CUDA_LAUNCH_CHECK();
}

Bf16Experts::Bf16Experts(Context& ctx, Bf16Gemm& gemm, int n_experts, int topk, int hidden, int inter)
    : ctx_(ctx), gemm_(gemm), E_(n_experts), k_(topk), H_(hidden), I_(inter), few_max_slots_(std::max(64, n_experts)) {
  check(E_ > 0 && k_ > 0 && k_ <= E_ && H_ > 0 && I_ > 0, DZ_ERR_INVALID_ARGUMENT, "BF16 experts: ", E_,
        " experts, top-", k_, ", hidden ", H_, ", intermediate ", I_);
}

template <typename T>
T* Bf16Experts::room(DeviceArray<T>& a, size_t n, const char* what) {
  if (a.size() < n) {
    a.reset();
    a = DeviceArray<T>(ctx_.pool(), n, what);
    ++gen_;
  }
  return a.get();
}

bool Bf16Experts::few_slots(int T) const {
  return H_ % 8 == 0 && I_ % 8 == 0 && size_t(k_) * I_ * 4 <= kFewMaxSmem && int64_t(T) * k_ <= few_max_slots_;
}

void Bf16Experts::forward(const Bf16ExpertWeights& w, const uint16_t* xb, const int32_t* ids, const float* weights,
                          int T, float* x, cudaStream_t s) {
  if (T <= 0) return;
  const size_t S = size_t(T) * size_t(k_);
  if (few_slots(T)) {  // each slot's expert rows streamed once, no host sync
    uint16_t* act = room(act_, S * size_t(I_), "BF16 experts: activations");
    const size_t xs = size_t(H_) * 4, as = size_t(k_) * I_ * 4;
    static const bool attr = [] {
      DZ_CUDA_CHECK(
          cudaFuncSetAttribute(few_gate_up_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kFewMaxSmem)));
      DZ_CUDA_CHECK(
          cudaFuncSetAttribute(few_down_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kFewMaxSmem)));
      return true;
    }();
    (void)attr;
    few_gate_up_kernel<<<dim3(unsigned((I_ + kWarps * kGateRows - 1) / (kWarps * kGateRows)), unsigned(S)), kWarps * 32,
                         xs, s>>>(xb, ids, k_, H_, I_, w.w13, limit_, act);
    DZ_CUDA_LAUNCH_CHECK();
    few_down_kernel<<<dim3(unsigned((H_ + kWarps * kDownRows - 1) / (kWarps * kDownRows)), unsigned(T)), kWarps * 32,
                      as, s>>>(act, ids, weights, k_, H_, I_, w.w2, x);
    DZ_CUDA_LAUNCH_CHECK();
    return;
  }
  ids_.resize(S);
  DZ_CUDA_CHECK(cudaMemcpyAsync(ids_.data(), ids, S * 4, cudaMemcpyDeviceToHost, s));
  DZ_CUDA_CHECK(cudaStreamSynchronize(s));
  // Counting sort of the slots by expert: meta = [token of each sorted slot | sorted position of each slot].
  count_.assign(size_t(E_) + 1, 0);
  for (size_t i = 0; i < S; ++i) {
    const int32_t e = ids_[i];
    check(e >= 0 && e < E_, DZ_ERR_INTERNAL, "BF16 experts: the router chose expert ", e, " of ", E_);
    ++count_[size_t(e) + 1];
  }
  for (int e = 0; e < E_; ++e) count_[size_t(e) + 1] += count_[size_t(e)];
  meta_.resize(2 * S);
  std::vector<int32_t> next(count_.begin(), count_.end() - 1);
  for (size_t i = 0; i < S; ++i) {
    const int32_t at = next[size_t(ids_[i])]++;
    meta_[size_t(at)] = int32_t(i / size_t(k_));
    meta_[S + i] = at;
  }
  int32_t* md = room(meta_d_, 2 * S, "BF16 experts: slot order");
  DZ_CUDA_CHECK(cudaMemcpyAsync(md, meta_.data(), 2 * S * 4, cudaMemcpyHostToDevice, s));
  uint16_t* xs = room(xs_, S * size_t(H_), "BF16 experts: inputs");
  float* h = room(h_, S * 2 * size_t(I_), "BF16 experts: gate_up");
  uint16_t* act = room(act_, S * size_t(I_), "BF16 experts: activations");
  float* y = room(y_, S * size_t(H_), "BF16 experts: outputs");
  gather_rows_bf16(xb, md, int(S), H_, xs, s);
  const size_t w13 = size_t(2) * I_ * H_, w2 = size_t(H_) * I_;
  for (int e = 0; e < E_; ++e) {
    const int n = count_[size_t(e) + 1] - count_[size_t(e)], r = count_[size_t(e)];
    if (n)
      gemm_.run(xs + size_t(r) * H_, w.w13 + size_t(e) * w13, nullptr, h + size_t(r) * 2 * I_, n, 2 * I_, H_, 0.f, s);
  }
  silu_mul(h, int(S), I_, int64_t(2) * I_, act, s, limit_);
  for (int e = 0; e < E_; ++e) {
    const int n = count_[size_t(e) + 1] - count_[size_t(e)], r = count_[size_t(e)];
    if (n) gemm_.run(act + size_t(r) * I_, w.w2 + size_t(e) * w2, nullptr, y + size_t(r) * H_, n, H_, I_, 0.f, s);
  }
  moe_combine(y, md + S, weights, T, k_, H_, x, s);
  // meta_ (pageable) was staged by the copy above before it returned; the
  // next call's host writes wait for its own sync.
}

}  // namespace dz::cuda
