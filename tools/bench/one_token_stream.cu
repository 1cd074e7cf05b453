// How fast one token's expert bytes can stream through two dependent launches
// (gate_up, then down as its programmatic dependent, in a CUDA graph: the shape
// of the one-token MoE kernels), with no arithmetic at all. gpt-oss-120b: 4
// experts x (gate_up 5760 rows + down 2880 rows) x 1440 bytes, 53 MB a token.
//   plain        grid-stride 16-byte loads in both launches (dz bench moe's plain read), in one launch for
//                all the bytes, or in one launch with a grid-wide barrier between the projections
//   ring S x C   gate_up: one block an SM, a producer thread bulk-copying the block's contiguous share in
//                chunks of C bytes into a ring of S stages, 8 consumer warps touching each chunk and releasing it;
//                down: one block an SM beside it, bulk-copying its whole slice (1/SMs of down's bytes) into
//                shared memory before it waits for gate_up (griddepcontrol.wait), then touching it
//   ring S x C, down after   the same with down's copy issued only after its wait
//   one launch   both projections in one kernel, a grid-wide barrier between them (fused_kernel); down's
//                chunks through the ring after gate_up's, or down's slice copied whole at the start
//   plain, clusters of C   one launch with no grid-wide barrier: the GPU cut into clusters of C blocks (one an
//                SM), each cluster a slot's share of the intermediate: plain loads of its gate_up rows (gate and up
//                rows of its intermediate range, contiguous), a cluster barrier (down's activations would pass
//                through distributed shared memory), then plain loads of its K range of every down row; each block
//                then writes its rows' partial sums and the last of a row range's blocks (a ticket) adds them up in
//                a fixed order. "no barrier" drops the cluster barrier: the same bytes with no dependency.
// The sets of bytes rotate so that a call does not find the last one's in L2.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Ikernels tools/bench/one_token_stream.cu -o
//   one_token_stream
//   ./one_token_stream [reps=200]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/ptx.cuh"
#include "probe.cuh"

using namespace dz::cuda::ptx;

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

__global__ void plain_kernel(const uint4* p, size_t n, unsigned* sink) {
  pdl_wait(), pdl_trigger();
  unsigned acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = ldg_nc_v4(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u) *sink = acc;  // (keeps the loads)
}

// One thread a block at a grid-wide barrier (every block resident): sync = {arrivals, generation}; the last
// to arrive zeroes the arrivals and moves the generation on, the others wait for it to move past gen0.
__device__ __forceinline__ void grid_arrive_wait(unsigned* sync, unsigned gen0) {
  __threadfence();
  if (atomicAdd(sync, 1u) == gridDim.x - 1) {
    sync[0] = 0;
    __threadfence();
    atomicAdd(sync + 1, 1u);
  } else {
    while (*reinterpret_cast<volatile unsigned*>(sync + 1) == gen0) __nanosleep(32);
  }
}

// Both projections' bytes in one launch of plain loads, a grid-wide barrier between them (every block
// resident: 8 blocks of 256 threads an SM). sync: {arrivals, generation}, zero before the first launch.
__global__ void __launch_bounds__(256) plain_barrier_kernel(const uint4* up, size_t n_up, const uint4* down,
                                                            size_t n_down, unsigned* sync, unsigned* sink) {
  pdl_wait(), pdl_trigger();
  __shared__ unsigned gen0;
  if (threadIdx.x == 0) gen0 = *reinterpret_cast<volatile unsigned*>(sync + 1);
  unsigned acc = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n_up; i += stride) {
    const uint4 v = ldg_nc_v4(up + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  __syncthreads();
  if (threadIdx.x == 0) grid_arrive_wait(sync, gen0);
  __syncthreads();
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n_down; i += stride) {
    const uint4 v = ldg_nc_v4(down + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u) *sink = acc;
}

constexpr int kConsumers = 8, kRingThreads = 32 * (kConsumers + 1);

// This block's contiguous share [b0, b1) of bytes (16-byte aligned).
__device__ __forceinline__ void share(size_t bytes, size_t& b0, size_t& b1) {
  const size_t units = bytes / 16;
  b0 = units * blockIdx.x / gridDim.x * 16, b1 = units * (blockIdx.x + 1) / gridDim.x * 16;
}

// A consumer warp's turn at ring chunk i: wait for it, touch a word a lane, release it.
__device__ __forceinline__ unsigned consume(const uint8_t* smem, uint32_t full0, uint32_t empty0, int stages, int chunk,
                                            int i) {
  const int s = i % stages, lane = threadIdx.x % 32;
  mbar_wait(full0 + 8 * s, uint32_t(i / stages) & 1u);
  const unsigned v = reinterpret_cast<const unsigned*>(smem + size_t(s) * chunk)[threadIdx.x * 4];
  __syncwarp();
  if (lane == 0) mbar_arrive(empty0 + 8 * s);
  return v;
}

__global__ void __launch_bounds__(kRingThreads, 1)
    ring_kernel(const uint8_t* base, size_t bytes, int stages, int chunk, int interleave, unsigned* sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t bars[16];
  pdl_wait(), pdl_trigger();
  size_t b0, b1;
  share(bytes, b0, b1);
  // interleave: chunk i of block b is the buffer's chunk i * blocks + b (the blocks' copies in flight at one
  // time lie side by side, as a grid-stride read's do), else the block's contiguous share.
  const size_t all_chunks = (bytes + chunk - 1) / chunk;
  const int n_chunks =
      interleave ? int((all_chunks - blockIdx.x + gridDim.x - 1) / gridDim.x) : int((b1 - b0 + chunk - 1) / chunk);
  auto chunk_at = [&](int i, uint32_t& n) {
    const size_t o = interleave ? (size_t(i) * gridDim.x + blockIdx.x) * chunk : b0 + size_t(i) * chunk;
    const size_t end = interleave ? bytes : b1;
    n = uint32_t(end - o < size_t(chunk) ? end - o : size_t(chunk));
    return o;
  };
  const uint32_t full0 = smem_u32(bars), empty0 = full0 + 8 * stages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) mbar_init(full0 + 8 * s, 1), mbar_init(empty0 + 8 * s, kConsumers);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp == kConsumers) {
    if (lane == 0)
      for (int i = 0; i < n_chunks; ++i) {
        const int s = i % stages;
        const uint32_t ph = uint32_t(i / stages) & 1u;
        mbar_wait(empty0 + 8 * s, ph ^ 1u);
        uint32_t n;
        const size_t o = chunk_at(i, n);
        mbar_arrive_expect_tx(full0 + 8 * s, n);
        bulk_g2s(smem_u32(smem + size_t(s) * chunk), base + o, n, full0 + 8 * s);
      }
    return;
  }
  unsigned acc = 0;
  for (int i = 0; i < n_chunks; ++i) acc ^= consume(smem, full0, empty0, stages, chunk, i);
  if (acc == 0x9E3779B9u) *sink = acc;
}

// Both projections in one launch (one block an SM): gate_up's chunks dealt round the blocks through the
// ring, then down's the same way; the consumers wait at a grid-wide barrier (every block done with gate_up,
// as down's activations would need) before their first down chunk, while the producer keeps filling the ring
// with down's chunks. sync: {arrivals, generation}, zero before the first launch.
__global__ void __launch_bounds__(kRingThreads, 1)
    fused_kernel(const uint8_t* up, size_t up_bytes, const uint8_t* down, size_t down_bytes, int stages, int chunk,
                 int slice, unsigned* sync, unsigned* sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t bars[16];
  pdl_wait(), pdl_trigger();
  const size_t up_chunks = (up_bytes + chunk - 1) / chunk, down_chunks = (down_bytes + chunk - 1) / chunk;
  const int n_up = int((up_chunks - blockIdx.x + gridDim.x - 1) / gridDim.x);
  // slice: down's contiguous share bulk-copied whole into shared memory behind the ring at the start
  // (read after the barrier), instead of down's chunks through the ring.
  const int n_down = slice ? 0 : int((down_chunks - blockIdx.x + gridDim.x - 1) / gridDim.x);
  size_t d0, d1;
  share(down_bytes, d0, d1);
  __shared__ __align__(8) uint64_t sbar;
  const uint32_t full0 = smem_u32(bars), empty0 = full0 + 8 * stages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) mbar_init(full0 + 8 * s, 1), mbar_init(empty0 + 8 * s, kConsumers);
    mbar_init(smem_u32(&sbar), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __shared__ unsigned gen0;
  if (threadIdx.x == 32) gen0 = *reinterpret_cast<volatile unsigned*>(sync + 1);
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint8_t* const sl = smem + size_t(stages) * chunk;
  if (warp == kConsumers) {
    if (lane == 0 && slice) {
      mbar_arrive_expect_tx(smem_u32(&sbar), uint32_t(d1 - d0));
      for (size_t o = 0; o < d1 - d0; o += 65536)
        bulk_g2s(smem_u32(sl + o), down + d0 + o, uint32_t(d1 - d0 - o < 65536 ? d1 - d0 - o : 65536), smem_u32(&sbar));
    }
    if (lane == 0)
      for (int i = 0; i < n_up + n_down; ++i) {
        const int s = i % stages;
        mbar_wait(empty0 + 8 * s, (uint32_t(i / stages) & 1u) ^ 1u);
        const bool u = i < n_up;
        const size_t total = u ? up_bytes : down_bytes, o = (size_t(u ? i : i - n_up) * gridDim.x + blockIdx.x) * chunk;
        const uint32_t n = uint32_t(total - o < size_t(chunk) ? total - o : size_t(chunk));
        mbar_arrive_expect_tx(full0 + 8 * s, n);
        bulk_g2s(smem_u32(smem + size_t(s) * chunk), (u ? up : down) + o, n, full0 + 8 * s);
      }
    return;
  }
  unsigned acc = 0;
  for (int i = 0; i <= n_up + n_down; ++i) {
    if (i == n_up) {  // gate_up done here: the grid-wide barrier before down
      asm volatile("bar.sync 1, %0;" ::"r"(32 * kConsumers) : "memory");
      if (threadIdx.x == 0) grid_arrive_wait(sync, gen0);
      asm volatile("bar.sync 1, %0;" ::"r"(32 * kConsumers) : "memory");
      if (slice) {
        mbar_wait(smem_u32(&sbar), 0);
        for (size_t o = (warp * 32 + lane) * 16; o < d1 - d0; o += 32 * kConsumers * 16)
          acc ^= *reinterpret_cast<const unsigned*>(sl + o);
      }
    }
    if (i == n_up + n_down) break;
    acc ^= consume(smem, full0, empty0, stages, chunk, i);
  }
  if (acc == 0x9E3779B9u) *sink = acc;
}

// down's slice into shared memory in pieces of up to 64 KB, before (or after) its wait for gate_up.
__global__ void __launch_bounds__(256, 1) slice_kernel(const uint8_t* base, size_t bytes, int after, unsigned* sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t bar;
  size_t b0, b1;
  share(bytes, b0, b1);
  const uint32_t b = smem_u32(&bar);
  if (threadIdx.x == 0) {
    mbar_init(b, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&] {
    if (threadIdx.x != 0) return;
    mbar_arrive_expect_tx(b, uint32_t(b1 - b0));
    for (size_t o = 0; o < b1 - b0; o += 65536)
      bulk_g2s(smem_u32(smem + o), base + b0 + o, uint32_t(b1 - b0 - o < 65536 ? b1 - b0 - o : 65536), b);
  };
  if (!after) issue();
  pdl_wait(), pdl_trigger();
  if (after) issue();
  mbar_wait(b, 0);
  unsigned acc = 0;
  for (size_t o = threadIdx.x * 16; o < b1 - b0; o += 256 * 16) acc ^= *reinterpret_cast<const unsigned*>(smem + o);
  if (acc == 0x9E3779B9u) *sink = acc;
}

// One token's bytes in clusters (see the file comment): cluster c of the grid's clusters takes slot c % topk
// and the c / topk-th of the slot's clusters' shares of the intermediate (in 32-element sub-blocks); a block
// takes 1/C of its cluster's gate_up rows and of down's rows. part: [clusters][down_rows] floats; tickets:
// [C] counters, zero before the first launch (the last arriver zeroes its own).
constexpr int kClusterThreads = 1024;
__global__ void __launch_bounds__(kClusterThreads, 1)
    plain_cluster_kernel(const uint8_t* up, const uint8_t* down, int topk, int up_rows, int down_rows, int row_bytes,
                         int barrier, float* part, unsigned* tickets, float* out, unsigned* sink) {
  pdl_wait(), pdl_trigger();
  unsigned C, rank;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(C));
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  const int clusters = int(gridDim.x / C), c = int(blockIdx.x / C), slot = c % topk, per_slot = clusters / topk;
  const int q = c / topk, nsub = row_bytes / 16;
  if (q >= per_slot) return;  // the clusters past a whole number a slot stay idle
  const int s0 = nsub * q / per_slot, s1 = nsub * (q + 1) / per_slot;  // this cluster's sub-blocks of K
  const int inter = up_rows / 2, i0 = inter * s0 / nsub, i1 = inter * s1 / nsub;
  unsigned acc = 0;
  {  // gate_up rows [2 i0, 2 i1): contiguous; the block's 1/C of their 16-byte words
    const uint4* p = reinterpret_cast<const uint4*>(up + (size_t(slot) * up_rows + 2 * size_t(i0)) * row_bytes);
    const size_t n = size_t(2) * (i1 - i0) * row_bytes / 16, w0 = n * rank / C, w1 = n * (rank + 1) / C;
    for (size_t i = w0 + threadIdx.x; i < w1; i += 4 * kClusterThreads) {
      uint4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u)
        v[u] = i + u * kClusterThreads < w1 ? ldg_nc_v4(p + i + u * kClusterThreads) : uint4{};
#pragma unroll
      for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
  }
  if (barrier)
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
  // down: the block's rows [r0, r1), each row's sub-blocks [s0, s1).
  const int r0 = down_rows * int(rank) / int(C), r1 = down_rows * int(rank + 1) / int(C), ns = s1 - s0;
  const uint8_t* d = down + size_t(slot) * down_rows * row_bytes + size_t(s0) * 16;
  const int n = (r1 - r0) * ns;
  for (int i = threadIdx.x; i < n; i += 4 * kClusterThreads) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int k = i + u * kClusterThreads;
      v[u] = k < n ? ldg_nc_v4(d + size_t(r0 + k / ns) * row_bytes + size_t(k % ns) * 16) : uint4{};
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  __syncthreads();  // (the block's partial sums would be complete here)
  // The rows' partial sums out; the last of the clusters to finish this row range adds them up in cluster order.
  float* mine = part + size_t(c) * down_rows;
  for (int r = threadIdx.x; r < r1 - r0; r += kClusterThreads) mine[r0 + r] = float(acc & 0xFF) + float(r);
  __shared__ unsigned last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned t = atomicAdd(tickets + rank, 1u);
    last = t == unsigned(per_slot * topk - 1);
    if (last) tickets[rank] = 0;
  }
  __syncthreads();
  if (last) {
    __threadfence();
    for (int r = r0 + threadIdx.x; r < r1; r += kClusterThreads) {
      float t = 0;
      for (int k = 0; k < per_slot * topk; ++k) t += __ldcg(part + size_t(k) * down_rows + r);
      out[r] = t;
    }
  }
  if (acc == 0x9E3779B9u) *sink = acc;
}

template <typename... P, typename... A>
void launch(void (*k)(P...), int grid, int block, size_t smem, cudaStream_t s, A... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid), cfg.blockDim = dim3(block), cfg.dynamicSmemBytes = smem, cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr, cfg.numAttrs = 1;
  CK(cudaLaunchKernelEx(&cfg, k, P(args)...));
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 200;
  constexpr int kSets = 6, kTopk = 4, kRowBytes = 1440, kUpRows = 5760, kDownRows = 2880;
  const size_t up = size_t(kTopk) * kUpRows * kRowBytes, down = size_t(kTopk) * kDownRows * kRowBytes;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::vector<uint8_t*> ups(kSets), downs(kSets);
  for (int i = 0; i < kSets; ++i) {  // a set: gate_up's bytes, then down's
    CK(cudaMalloc(&ups[i], up + down));
    CK(cudaMemset(ups[i], i + 1, up + down));
    downs[i] = ups[i] + up;
  }
  unsigned* sink;
  CK(cudaMalloc(&sink, 4));
  const size_t slice = (down / 16 + sms - 1) / sms * 16;
  CK(cudaFuncSetAttribute(slice_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(slice)));
  CK(cudaFuncSetAttribute(ring_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 << 10));
  CK(cudaFuncSetAttribute(ring_kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto time = [&](const char* name, auto body) {
    std::vector<cudaGraphExec_t> g(kSets);
    for (int i = 0; i < kSets; ++i) {
      cudaGraph_t gr;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      body(i);
      CK(cudaStreamEndCapture(st, &gr));
      CK(cudaGraphInstantiate(&g[i], gr, 0));
      CK(cudaGraphDestroy(gr));
    }
    for (int i = 0; i < 2 * kSets; ++i) CK(cudaGraphLaunch(g[i % kSets], st));
    CK(cudaEventRecord(e0, st));
    for (int i = 0; i < reps; ++i) CK(cudaGraphLaunch(g[i % kSets], st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    const double us = 1e3 * ms / reps;
    std::printf("%-44s %7.2f us  %5.1f%% of 4.27 TB/s on %.1f MB\n", name, us,
                100.0 * (up + down) / (us * 1e-6) / 4.27e12, (up + down) / 1e6);
    for (auto x : g) CK(cudaGraphExecDestroy(x));
  };
  time("plain, one launch", [&](int i) {
    launch(plain_kernel, 2112, 256, 0, st, reinterpret_cast<const uint4*>(ups[i]), (up + down) / 16, sink);
  });
  time("plain, gate_up then down", [&](int i) {
    launch(plain_kernel, 2112, 256, 0, st, reinterpret_cast<const uint4*>(ups[i]), up / 16, sink);
    launch(plain_kernel, 2112, 256, 0, st, reinterpret_cast<const uint4*>(downs[i]), down / 16, sink);
  });
  // Down's slices in more, smaller blocks (residency beside gate_up's ring blocks).
  for (int per_sm : {2, 4}) {
    const int grid = per_sm * sms;
    const size_t sl = (down / 16 + grid - 1) / grid * 16;
    for (int after : {0, 1}) {
      char name[96];
      std::snprintf(name, sizeof name, "ring 3 x 16 KB, down in %d blocks of %zu KB %s", grid, sl / 1024,
                    after ? "after" : "before");
      time(name, [&](int i) {
        launch(ring_kernel, sms, kRingThreads, size_t(3 * 16384), st, (const uint8_t*)ups[i], up, 3, 16384, 0, sink);
        launch(slice_kernel, grid, 256, sl, st, (const uint8_t*)downs[i], down, after, sink);
      });
    }
  }
  const int rings[][2] = {{2, 32768}, {4, 16384}, {6, 12288}, {3, 16384}};
  for (auto r : rings) {
    const size_t ring = size_t(r[0]) * r[1];
    for (int after : {0, 1}) {
      char name[96];
      std::snprintf(name, sizeof name, "ring %d x %d KB, down's slice %s", r[0], r[1] / 1024,
                    after ? "after its wait" : "before its wait");
      time(name, [&](int i) {
        launch(ring_kernel, sms, kRingThreads, ring, st, (const uint8_t*)ups[i], up, r[0], r[1], 0, sink);
        launch(slice_kernel, sms, 256, slice, st, (const uint8_t*)downs[i], down, after, sink);
      });
    }
    char name[96];
    std::snprintf(name, sizeof name, "ring %d x %d KB, gate_up alone", r[0], r[1] / 1024);
    time(name, [&](int i) {
      launch(ring_kernel, sms, kRingThreads, ring, st, (const uint8_t*)ups[i], up, r[0], r[1], 0, sink);
    });
  }
  for (int chunk : {4096, 8192, 16384})
    for (int stages : {4, 8}) {
      char name[96];
      std::snprintf(name, sizeof name, "ring %d x %d KB interleaved, gate_up alone", stages, chunk / 1024);
      time(name, [&](int i) {
        launch(ring_kernel, sms, kRingThreads, size_t(stages) * chunk, st, (const uint8_t*)ups[i], up, stages, chunk, 1,
               sink);
      });
      std::snprintf(name, sizeof name, "ring %d x %d KB interleaved, then down", stages, chunk / 1024);
      time(name, [&](int i) {
        launch(ring_kernel, sms, kRingThreads, size_t(stages) * chunk, st, (const uint8_t*)ups[i], up, stages, chunk, 1,
               sink);
        launch(slice_kernel, sms, 256, slice, st, (const uint8_t*)downs[i], down, 0, sink);
      });
    }
  unsigned* sync;
  CK(cudaMalloc(&sync, 8));
  CK(cudaMemset(sync, 0, 8));
  CK(cudaFuncSetAttribute(fused_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 << 10));
  for (int chunk : {8192, 16384, 32768})
    for (int stages : {4, 8}) {
      if (size_t(stages) * chunk > (200u << 10)) continue;
      char name[96];
      std::snprintf(name, sizeof name, "one launch, ring %d x %d KB, barrier before down", stages, chunk / 1024);
      time(name, [&](int i) {
        launch(fused_kernel, sms, kRingThreads, size_t(stages) * chunk, st, (const uint8_t*)ups[i], up,
               (const uint8_t*)downs[i], down, stages, chunk, 0, sync, sink);
      });
    }
  unsigned* sync2;
  CK(cudaMalloc(&sync2, 8));
  CK(cudaMemset(sync2, 0, 8));
  time("plain, one launch, grid-wide barrier between", [&](int i) {
    launch(plain_barrier_kernel, 8 * sms, 256, 0, st, reinterpret_cast<const uint4*>(ups[i]), up / 16,
           reinterpret_cast<const uint4*>(downs[i]), down / 16, sync2, sink);
  });
  for (int chunk : {8192, 16384}) {  // down's slice (122 KB) beside a ring of 4
    char name[96];
    std::snprintf(name, sizeof name, "one launch, ring 4 x %d KB, down's slice copied at the start", chunk / 1024);
    time(name, [&](int i) {
      launch(fused_kernel, sms, kRingThreads, size_t(4) * chunk + slice, st, (const uint8_t*)ups[i], up,
             (const uint8_t*)downs[i], down, 4, chunk, 1, sync, sink);
    });
  }
  // Clusters of C blocks: as many clusters as fit at once, a whole number a slot.
  float *part, *out;
  unsigned* tickets;
  CK(cudaMalloc(&part, size_t(sms) * kDownRows * 4));
  CK(cudaMalloc(&out, size_t(kDownRows) * 4));
  CK(cudaMalloc(&tickets, 64 * 4));
  CK(cudaMemset(tickets, 0, 64 * 4));
  CK(cudaFuncSetAttribute(plain_cluster_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  CK(cudaFuncSetAttribute(plain_cluster_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 120 << 10));
  for (int C : {4, 8, 16}) {
    cudaLaunchConfig_t cfg{};
    cfg.blockDim = dim3(kClusterThreads), cfg.dynamicSmemBytes = 120 << 10, cfg.stream = st;
    cudaLaunchAttribute at[2];
    at[0].id = cudaLaunchAttributeClusterDimension, at[0].val.clusterDim.x = C, at[0].val.clusterDim.y = 1;
    at[0].val.clusterDim.z = 1;
    at[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[1].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at, cfg.numAttrs = 2;
    cfg.gridDim = dim3(C);
    int fit = 0;
    if (cudaOccupancyMaxActiveClusters(&fit, plain_cluster_kernel, &cfg) != cudaSuccess || fit < kTopk) {
      cudaGetLastError();
      std::printf("clusters of %d: %d fit at once, skipped\n", C, fit);
      continue;
    }
    const int clusters = fit / kTopk * kTopk;
    cfg.gridDim = dim3(unsigned(clusters * C));
    for (int barrier : {1, 0}) {
      char name[96];
      std::snprintf(name, sizeof name, "plain, %d clusters of %d, %s", clusters, C,
                    barrier ? "cluster barrier, ticket sum" : "no barrier, ticket sum");
      time(name, [&](int i) {
        CK(cudaLaunchKernelEx(&cfg, plain_cluster_kernel, (const uint8_t*)ups[i], (const uint8_t*)downs[i], kTopk,
                              kUpRows, kDownRows, kRowBytes, barrier, part, tickets, out, sink));
      });
    }
  }
  time("down's slices alone",
       [&](int i) { launch(slice_kernel, sms, 256, slice, st, (const uint8_t*)downs[i], down, 0, sink); });
  std::printf("(down's slice: %zu KB a block; %d SMs)\n", slice / 1024, sms);
  return 0;
}
