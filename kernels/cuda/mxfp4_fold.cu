#include <cuda_fp8.h>

#include <algorithm>

#include "cuda/mxfp4_fold.cuh"
#include "cuda/mxfp4_fold.h"
#include "cuda/ptx.cuh"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {

constexpr int kMaxIds = 32;

struct FoldArgs {
  const uint8_t* blocks;
  const uint8_t* scales;
  uint8_t* out;
  float* out_scales;
  const uint8_t* gmax;  // group table or null (by rows)
  int rows, nsub, ngroups;
  int ids[kMaxIds];
};

// One thread per (row, fold group), group fastest: 64 B in, 128 B + 4 B out.
// A block's 256 outputs are one contiguous 32 KiB range of the slot: they go
// through shared memory (XOR-swizzled 16-byte pieces) and leave coalesced.
constexpr int kFoldThreads = 256;

__global__ void __launch_bounds__(kFoldThreads) fold_kernel(FoldArgs a) {
  __shared__ uint4 stage[kFoldThreads * 8];
  const int slot = blockIdx.y;
  const int64_t total = int64_t(a.rows) * a.ngroups;
  const int64_t idx0 = int64_t(blockIdx.x) * kFoldThreads, idx = idx0 + threadIdx.x;
  const int64_t kpad = int64_t(a.ngroups) * 128;
  uint8_t* out = a.out + int64_t(slot) * a.rows * kpad;
  if (idx < total) {
    const int r = int(idx / a.ngroups), g = int(idx % a.ngroups);
    const int64_t e = a.ids[slot];
    const uint8_t* bl = a.blocks + (e * a.rows + r) * int64_t(a.nsub) * 16;
    const uint8_t* sc = a.scales + (e * a.rows + r) * int64_t(a.nsub);
    const GroupIn G = load_group(bl, sc, g, a.nsub);
    if (a.gmax) {
      const int rg = a.rows / kFoldRowGroup;
      const int smax = a.gmax[(e * rg + r / kFoldRowGroup) * a.ngroups + g];
      const float bs = fold_group_at(G, smax, stage + threadIdx.x * 8, threadIdx.x & 7);
      if (r % kFoldRowGroup == 0) a.out_scales[(int64_t(slot) * a.ngroups + g) * rg + r / kFoldRowGroup] = bs;
    } else {
      a.out_scales[int64_t(slot) * total + int64_t(g) * a.rows + r] =
          fold_group(G, stage + threadIdx.x * 8, threadIdx.x & 7);
    }
  }
  __syncthreads();
  const int64_t n16 = (total - idx0 < kFoldThreads ? total - idx0 : int64_t(kFoldThreads)) * 8;
  uint4* dst = reinterpret_cast<uint4*>(out + idx0 * 128);
  for (int q = threadIdx.x; q < n16; q += kFoldThreads) {
    const int th = q >> 3, j = q & 7;
    dst[q] = stage[th * 8 + (j ^ (th & 7))];
  }
}

// stats: [groups, lossy, zero, max_spread, nan_scales]
__global__ void __launch_bounds__(256) fold_check_kernel(const uint8_t* blocks, const uint8_t* scales, int64_t rows,
                                                         int nsub, int ngroups, unsigned long long* stats) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  unsigned long long lossy = 0, zero = 0, nan = 0, groups = 0;
  int spread = 0;
  if (idx < rows * ngroups) {
    const int64_t r = idx % rows;
    const int g = int(idx / rows);
    const GroupIn G = load_group(blocks + r * nsub * 16, scales + r * nsub, g, nsub);
    const int smax = group_smax(G);
    groups = 1;
    if (smax < 0) zero = 1;
    for (int j = 0; j < 4; ++j)
      if (sub_nonzero(G.w[j])) spread = max(spread, smax - G.s[j]);
    lossy = spread > 14;
    for (int j = 0; j < 4; ++j) nan += (g * 4 + j < nsub) && G.s[j] == 255;
  }
  for (int o = 16; o; o >>= 1) {
    groups += __shfl_xor_sync(~0u, groups, o);
    lossy += __shfl_xor_sync(~0u, lossy, o);
    zero += __shfl_xor_sync(~0u, zero, o);
    nan += __shfl_xor_sync(~0u, nan, o);
    spread = max(spread, __shfl_xor_sync(~0u, spread, o));
  }
  if ((threadIdx.x & 31) == 0 && groups) {
    atomicAdd(&stats[0], groups);
    if (lossy) atomicAdd(&stats[1], lossy);
    if (zero) atomicAdd(&stats[2], zero);
    atomicMax(&stats[3], (unsigned long long)spread);
    if (nan) atomicAdd(&stats[4], nan);
  }
}

// The largest v of a block of kFoldRowGroup threads (part: the block's
// kFoldRowGroup / 32 shared ints).
__device__ __forceinline__ int row_group_max(int v, int* part) {
  for (int o = 16; o; o >>= 1) v = max(v, __shfl_xor_sync(~0u, v, o));
  __syncthreads();  // part[] is free again
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  v = part[0];
  for (int w = 1; w < kFoldRowGroup / 32; ++w) v = max(v, part[w]);
  return v;
}

// A group's table byte (its largest nonzero sub-block's scale byte m, 133
// where none) to *out and its spread to the counters (thread 0).
__device__ __forceinline__ void record_group(int m, int spread, uint8_t* out, unsigned long long* stats) {
  if (threadIdx.x != 0) return;
  *out = uint8_t(fold_smax(m));
  if (spread > 14) atomicAdd(&stats[1], 1ull);
  if (m < 0) atomicAdd(&stats[2], 1ull);
  if (unsigned(spread) > *reinterpret_cast<volatile unsigned long long*>(&stats[3]))
    atomicMax(&stats[3], (unsigned long long)spread);
}

// One block per 64-row x 128 fold group (grid: K groups x row groups of all
// experts), a thread per row. stats as fold_check_kernel's (groups counted on the host).
__global__ void __launch_bounds__(kFoldRowGroup)
    group_table_kernel(const uint8_t* blocks, const uint8_t* scales, int nsub, uint8_t* gmax,
                       unsigned long long* stats) {
  __shared__ int part[kFoldRowGroup / 32];
  const int g = int(blockIdx.x);
  const int64_t r = int64_t(blockIdx.y) * kFoldRowGroup + threadIdx.x;
  const GroupIn G = load_group(blocks + r * nsub * 16, scales + r * nsub, g, nsub);
  const int m = row_group_max(group_smax(G), part);
  int spread = 0;
  for (int j = 0; j < 4; ++j)
    if (sub_nonzero(G.w[j])) spread = max(spread, m - G.s[j]);
  record_group(m, row_group_max(spread, part), gmax + int64_t(blockIdx.y) * gridDim.x + g, stats);
}

// Whole-K groups: one block per 64-row group of all experts, a thread per
// row walking its K groups once; the largest nonzero sub-block's scale byte of the
// group (133 where all are zero) into gk, its spread counted as above.
__global__ void __launch_bounds__(kFoldRowGroup)
    whole_k_table_kernel(const uint8_t* blocks, const uint8_t* scales, int nsub, int ngroups, uint8_t* gk,
                         unsigned long long* stats) {
  __shared__ int part[kFoldRowGroup / 32];
  const int64_t r = int64_t(blockIdx.x) * kFoldRowGroup + threadIdx.x;
  const uint8_t* bl = blocks + r * nsub * 16;
  const uint8_t* sc = scales + r * nsub;
  // One pass over the row: the largest and smallest scale byte of its nonzero
  // sub-blocks (the spread is the group's largest less its smallest).
  int hi = -1, lo = 256;
  for (int g = 0; g < ngroups; ++g) {
    const GroupIn G = load_group(bl, sc, g, nsub);
    for (int j = 0; j < 4; ++j)
      if (sub_nonzero(G.w[j])) hi = max(hi, int(G.s[j])), lo = min(lo, int(G.s[j]));
  }
  const int m = row_group_max(hi, part), least = -row_group_max(-lo, part);
  record_group(m, m < 0 ? 0 : m - least, gk + blockIdx.x, stats);
}

// A load-time check's counters [groups, lossy, zero, max_spread, nan_scales]:
// zeroed on the device, filled by launch(counters) on s, read back (synchronizes).
template <typename Launch>
cpu::FoldStats run_check(cudaStream_t s, uint64_t* nan_scales, Launch launch) {
  unsigned long long* d = nullptr;
  DZ_CUDA_CHECK(cudaMallocAsync(&d, 5 * sizeof(unsigned long long), s));  // load time only
  DZ_CUDA_CHECK(cudaMemsetAsync(d, 0, 5 * sizeof(unsigned long long), s));
  launch(d);
  DZ_CUDA_LAUNCH_CHECK();
  unsigned long long h[5];
  DZ_CUDA_CHECK(cudaMemcpyAsync(h, d, sizeof h, cudaMemcpyDeviceToHost, s));
  DZ_CUDA_CHECK(cudaFreeAsync(d, s));
  DZ_CUDA_CHECK(cudaStreamSynchronize(s));
  cpu::FoldStats st;
  st.groups = h[0];
  st.lossy_groups = h[1];
  st.zero_groups = h[2];
  st.max_spread = int(h[3]);
  if (nan_scales) *nan_scales = h[4];
  return st;
}

}  // namespace

FoldBlockResources mxfp4_fold_block_resources() {
  cudaFuncAttributes fa{};
  DZ_CUDA_CHECK(cudaFuncGetAttributes(&fa, fold_kernel));
  FoldBlockResources r;
  r.threads = kFoldThreads, r.regs_per_thread = fa.numRegs, r.static_smem = fa.sharedSizeBytes;
  return r;
}

int64_t fold_scale_count(const Mxfp4Stack& w) {
  return (w.gmax ? w.rows / kFoldRowGroup : w.rows) * (cpu::fold_kpad(w.k) / 128);
}

void mxfp4_fold_experts(const Mxfp4Stack& w, const int* ids, int n, const Fp8Slots& out, cudaStream_t s) {
  check(w.k % 32 == 0 && w.rows > 0 && (!w.gmax || w.rows % kFoldRowGroup == 0), DZ_ERR_INVALID_ARGUMENT,
        "mxfp4_fold_experts: bad shape ", w.rows, " x ", w.k, w.gmax ? " (groups of 64 rows)" : "");
  const int nsub = int(w.k / 32), ngroups = int(cpu::fold_kpad(w.k) / 128);
  // The whole carveout as shared memory, as the grouped GEMM's narrow form
  // asks: an SM configured for one can take the other's blocks beside it.
  static const cudaError_t carveout =
      cudaFuncSetAttribute(fold_kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  DZ_CUDA_CHECK(carveout);
  for (int base = 0; base < n; base += kMaxIds) {
    FoldArgs a{};
    const int cnt = std::min(kMaxIds, n - base);
    a.blocks = w.blocks;
    a.scales = w.scales;
    a.out = out.fp8 + int64_t(base) * w.rows * ngroups * 128;
    a.out_scales = out.scales + int64_t(base) * fold_scale_count(w);
    a.gmax = w.gmax;
    a.rows = int(w.rows);
    a.nsub = nsub;
    a.ngroups = ngroups;
    for (int i = 0; i < cnt; ++i) a.ids[i] = ids[base + i];
    const int64_t work = w.rows * ngroups;
    dim3 grid(unsigned((work + kFoldThreads - 1) / kFoldThreads), unsigned(cnt));
    fold_kernel<<<grid, kFoldThreads, 0, s>>>(a);
    DZ_CUDA_LAUNCH_CHECK();
  }
}

cpu::FoldStats mxfp4_fold_check_device(const Mxfp4Stack& w, int n_experts, uint64_t* nan_scales, cudaStream_t s) {
  const int nsub = int(w.k / 32), ngroups = int(cpu::fold_kpad(w.k) / 128);
  const int64_t rows = w.rows * n_experts;  // experts are consecutive rows
  const int64_t work = rows * ngroups;
  return run_check(s, nan_scales, [&](unsigned long long* d) {
    fold_check_kernel<<<unsigned((work + 255) / 256), 256, 0, s>>>(w.blocks, w.scales, rows, nsub, ngroups, d);
  });
}

// Row groups of n_experts experts the table kernel covers (one grid row each).
constexpr int64_t kMaxRowGroups = 65535;

cpu::FoldStats mxfp4_group_table(const Mxfp4Stack& w, int n_experts, uint8_t* gmax, cudaStream_t s) {
  check(w.k % 32 == 0 && w.rows > 0 && w.rows % kFoldRowGroup == 0 && n_experts > 0 && gmax, DZ_ERR_INVALID_ARGUMENT,
        "mxfp4_group_table: ", w.rows, " rows x ", w.k, " (rows must be a multiple of 64), ", n_experts, " experts");
  const int nsub = int(w.k / 32), ngroups = int(cpu::fold_kpad(w.k) / 128);
  const int64_t rgroups = w.rows / kFoldRowGroup * n_experts;
  check(rgroups <= kMaxRowGroups, DZ_ERR_INVALID_ARGUMENT, "mxfp4_group_table: ", rgroups, " row groups (at most ",
        kMaxRowGroups, ")");
  cpu::FoldStats st = run_check(s, nullptr, [&](unsigned long long* d) {
    group_table_kernel<<<dim3(unsigned(ngroups), unsigned(rgroups)), kFoldRowGroup, 0, s>>>(w.blocks, w.scales, nsub,
                                                                                            gmax, d);
  });
  st.groups = uint64_t(rgroups) * ngroups;
  return st;
}

cpu::FoldStats mxfp4_whole_k_table(const Mxfp4Stack& w, int n_experts, uint8_t* gk, cudaStream_t s) {
  check(w.k % 32 == 0 && w.rows > 0 && w.rows % kFoldRowGroup == 0 && n_experts > 0 && gk, DZ_ERR_INVALID_ARGUMENT,
        "mxfp4_whole_k_table: ", w.rows, " rows x ", w.k, " (rows must be a multiple of 64), ", n_experts, " experts");
  const int nsub = int(w.k / 32), ngroups = int(cpu::fold_kpad(w.k) / 128);
  const int64_t rgroups = w.rows / kFoldRowGroup * n_experts;
  cpu::FoldStats st = run_check(s, nullptr, [&](unsigned long long* d) {
    whole_k_table_kernel<<<unsigned(rgroups), kFoldRowGroup, 0, s>>>(w.blocks, w.scales, nsub, ngroups, gk, d);
  });
  st.groups = uint64_t(rgroups);
  return st;
}

DeviceArray<uint8_t> mxfp4_exact_whole_k_table(DevicePool& pool, const Mxfp4Stack& w, int n_experts,
                                               cpu::FoldStats* stats, cudaStream_t s) {
  if (w.rows % kFoldRowGroup != 0) return {};
  DeviceArray<uint8_t> t(pool, size_t(w.rows / kFoldRowGroup * n_experts), "whole-K fold group table");
  const cpu::FoldStats g = mxfp4_whole_k_table(w, n_experts, t.get(), s);
  if (stats) stats->merge(g);
  if (g.lossy_groups != 0) return {};
  return t;
}

DeviceArray<uint8_t> mxfp4_exact_group_table(DevicePool& pool, const Mxfp4Stack& w, int n_experts,
                                             cpu::FoldStats* stats, cudaStream_t s) {
  if (w.rows % kFoldRowGroup != 0 || w.rows / kFoldRowGroup * n_experts > kMaxRowGroups) return {};
  DeviceArray<uint8_t> t(pool, size_t(w.rows / kFoldRowGroup * n_experts * (cpu::fold_kpad(w.k) / 128)),
                         "fold group table");
  const cpu::FoldStats g = mxfp4_group_table(w, n_experts, t.get(), s);
  if (stats) stats->merge(g);
  if (g.lossy_groups != 0) return {};
  return t;
}

}  // namespace dz::cuda
