// How fast HBM serves the MoE decode kernels' access pattern: an expert's
// MXFP4 rows (1440 bytes at gpt-oss shapes) streamed as 64-row tiles, each
// tile as boxes of 64 rows x 128 bytes (2D tensor copies, what the W4A8
// kernels do), against the same tiles read as contiguous 8 KB pieces (1D bulk
// copies of a tile-major layout), the tile-major layout's stages as 4D
// tensor-copy boxes (the same swizzled shared-memory image as the 2D boxes),
// and a plain vectorized read of the buffer. Every variant has the same grid,
// ring depth and bytes; only the addresses of a stage differ. row_pitch pads
// the 2D variant's rows (the same bytes read, rows further apart).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Ikernels tools/bench/dram_pattern.cu -lcuda -o
//   dram_pattern
//   ./dram_pattern [experts=30] [rows=5760] [row_bytes=1440] [stages=4] [row_pitch=row_bytes]
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/ptx.cuh"
#include "probe.cuh"

constexpr int kStageBytes = 64 * 128;
constexpr int kMaxStages = 8;

using namespace dz::cuda::ptx;

// Grid (tiles of 64 rows per block / 2, experts); two rings a block, a
// producer warp each (lane 0 issues), 128 consumer threads each.
// mode 0: 2D boxes 64 rows x 128 B of a row-major [E*R][RB] matrix;
// mode 1: 1D 8 KB pieces of the tile's contiguous bytes (same bytes a tile).
// mode 2: boxes 64 rows x 128 B of a tile-major layout (each tile's full
// stages of 64 rows x 128 B one after another, then its rows' tails), through
// a 4D map (map) and a 3D map of the tails (tail, box past the tail: zeros).
template <int kMode>
__global__ void __launch_bounds__(320, 2)
    ring_kernel(const __grid_constant__ CUtensorMap map, const __grid_constant__ CUtensorMap tail, const uint8_t* buf,
                int R, int RB, int stages, unsigned long long* sink) {
  extern __shared__ __align__(1024) unsigned char raw[];
  unsigned char* sm = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  __shared__ __align__(8) uint64_t full[2][kMaxStages], empty[2][kMaxStages];
  const int tid = threadIdx.x, wg = tid >> 7;
  if (tid == 0) {
    for (int w = 0; w < 2; ++w)
      for (int s = 0; s < stages; ++s) mbar_init(smem_u32(&full[w][s]), 1), mbar_init(smem_u32(&empty[w][s]), 4);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int e = blockIdx.y, tile = blockIdx.x * 2;
  const int nst = kMode != 1 ? (RB + 127) / 128 : (64 * RB + kStageBytes - 1) / kStageBytes;
  if (wg == 2) {
    const int w = (tid >> 5) & 1;
    if ((tid & 31) == 0 && (tile + w) * 64 < R) {
      const int row0 = e * R + (tile + w) * 64;
      for (int n = 0; n < nst; ++n) {
        const int s = n % stages, ph = (n / stages) & 1;
        mbar_wait(smem_u32(&empty[w][s]), ph ^ 1);
        const uint32_t dst = smem_u32(sm + (w * stages + s) * kStageBytes), fb = smem_u32(&full[w][s]);
        if (kMode == 0) {
          mbar_arrive_expect_tx(fb, kStageBytes);
          tma_2d(dst, &map, fb, n * 128, row0);
        } else if (kMode == 2) {
          mbar_arrive_expect_tx(fb, kStageBytes);
          if (n < RB / 128)
            tma_4d(dst, &map, fb, 0, 0, n, row0 / 64);
          else
            tma_3d(dst, &tail, fb, 0, 0, row0 / 64);
        } else {
          const int64_t off = int64_t(row0) * RB + int64_t(n) * kStageBytes;
          const int bytes = min(kStageBytes, 64 * RB - n * kStageBytes);
          mbar_arrive_expect_tx(fb, uint32_t(bytes));
          bulk_g2s(dst, buf + off, uint32_t(bytes), fb);
        }
      }
    }
    return;
  }
  if ((tile + wg) * 64 >= R) return;
  unsigned long long acc = 0;
  for (int n = 0; n < nst; ++n) {
    const int s = n % stages, ph = (n / stages) & 1;
    mbar_wait(smem_u32(&full[wg][s]), ph);
    const uint4 v = *reinterpret_cast<const uint4*>(sm + (wg * stages + s) * kStageBytes + (tid & 127) * 16);
    acc += v.x ^ v.y ^ v.z ^ v.w;
    __syncwarp();
    if ((tid & 31) == 0) mbar_arrive(smem_u32(&empty[wg][s]));
  }
  if (acc == 0x123456789ull) *sink = acc;
}

__global__ void plain_kernel(const uint4* p, size_t n, unsigned long long* sink) {
  unsigned long long acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p + i));
    acc += v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x123456789ull) *sink = acc;
}

int main(int argc, char** argv) {
  const int E = argc > 1 ? std::atoi(argv[1]) : 30, R = argc > 2 ? std::atoi(argv[2]) : 5760;
  const int RB = argc > 3 ? std::atoi(argv[3]) : 1440, stages = argc > 4 ? std::atoi(argv[4]) : 4;
  // Row pitch of mode 0's row-major matrix (RB: packed rows; more: padded rows, the same bytes read).
  const int pitch = argc > 5 ? std::atoi(argv[5]) : RB;
  const size_t bytes = size_t(E) * R * RB, alloc = size_t(E) * R * (pitch > RB ? pitch : RB);
  uint8_t* buf;
  unsigned long long* sink;
  CK(cudaMalloc(&buf, alloc + 65536));
  CK(cudaMalloc(&sink, 8));
  std::vector<uint8_t> h(alloc);
  uint32_t x = 12345;
  for (auto& b : h) x = x * 1664525u + 1013904223u, b = uint8_t(x >> 24);
  CK(cudaMemcpy(buf, h.data(), alloc, cudaMemcpyHostToDevice));
  uint8_t* flush;  // evict the buffer from L2 between runs
  CK(cudaMalloc(&flush, size_t(256) << 20));

  CUtensorMap map;
  const cuuint64_t dims[2] = {cuuint64_t(RB), cuuint64_t(E) * R}, strides[1] = {cuuint64_t(pitch)};
  const cuuint32_t box[2] = {128, 64}, es[2] = {1, 1};
  if (cuTensorMapEncodeTiled(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, buf, dims, strides, box, es,
                             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
    std::fprintf(stderr, "tensor map encode failed\n");
    return 1;
  }
  // The same bytes as a tile-major layout (what mode 2 reads).
  CUtensorMap map4, tail;
  {
    const int nfull = RB / 128, tb = RB % 128;
    const cuuint64_t tile = cuuint64_t(64) * RB, ntiles = cuuint64_t(E) * R / 64;
    const cuuint64_t d4[4] = {128, 64, cuuint64_t(nfull), ntiles}, s4[3] = {128, 8192, tile};
    const cuuint32_t b4[4] = {128, 64, 1, 1}, e4[4] = {1, 1, 1, 1};
    const cuuint64_t d3[3] = {cuuint64_t(tb ? tb : 16), 64, ntiles}, s3[2] = {cuuint64_t(tb ? tb : 16), tile};
    const cuuint32_t b3[3] = {128, 64, 1};
    CUresult r1 = cuTensorMapEncodeTiled(&map4, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, buf, d4, s4, b4, e4,
                                         CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                         CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    CUresult r2 = cuTensorMapEncodeTiled(&tail, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, buf + size_t(nfull) * 8192, d3, s3,
                                         b3, e4, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                         CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r1 != CUDA_SUCCESS || r2 != CUDA_SUCCESS) {
      std::fprintf(stderr, "tile-major tensor map encode failed (%d, %d)\n", int(r1), int(r2));
      return 1;
    }
  }
  const size_t smem = size_t(2) * stages * kStageBytes + 1024;
  CK(cudaFuncSetAttribute(ring_kernel<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  CK(cudaFuncSetAttribute(ring_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  CK(cudaFuncSetAttribute(ring_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const dim3 grid(unsigned((R / 64 + 1) / 2), unsigned(E));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  auto time = [&](auto launch) {
    float best = 1e30f, sum = 0;
    const int reps = 20;
    for (int i = 0; i < reps + 2; ++i) {
      CK(cudaMemsetAsync(flush, i, size_t(256) << 20));
      CK(cudaEventRecord(a));
      launch();
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      float ms;
      CK(cudaEventElapsedTime(&ms, a, b));
      if (i >= 2) best = ms < best ? ms : best, sum += ms;
    }
    CK(cudaGetLastError());
    return std::make_pair(best, sum / reps);
  };
  auto report = [&](const char* name, std::pair<float, float> t) {
    std::printf("{\"variant\": \"%s\", \"bytes\": %zu, \"best_us\": %.2f, \"mean_us\": %.2f, \"best_TBps\": %.3f}\n",
                name, bytes, t.first * 1e3, t.second * 1e3, bytes / (t.first * 1e-3) / 1e12);
  };
  report("plain_read",
         time([&] { plain_kernel<<<sms * 8, 512>>>(reinterpret_cast<const uint4*>(buf), bytes / 16, sink); }));
  report("tma2d_64x128_boxes", time([&] { ring_kernel<0><<<grid, 320, smem>>>(map, map, buf, R, RB, stages, sink); }));
  report("bulk1d_8k_contiguous",
         time([&] { ring_kernel<1><<<grid, 320, smem>>>(map, map, buf, R, RB, stages, sink); }));
  report("tma4d_tile_major_boxes",
         time([&] { ring_kernel<2><<<grid, 320, smem>>>(map4, tail, buf, R, RB, stages, sink); }));
  std::printf(
      "{\"experts\": %d, \"rows\": %d, \"row_bytes\": %d, \"row_pitch\": %d, \"stages\": %d, \"blocks\": %u, \"sms\": "
      "%d}\n",
      E, R, RB, pitch, stages, grid.x * grid.y, sms);
  return 0;
}
