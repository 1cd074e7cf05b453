// A tile order of an MXFP4 projection's blocks on the device: the fused
// kernels read an expert 64 rows at a time, 128 bytes of each row a stage
// (256 elements), so the rows' bytes are stored stage by stage: every stage of
// a 64-row tile is one contiguous 8 KB piece, which HBM serves faster than 64
// row pieces 1440 bytes apart (H200, tools/bench/dram_pattern.cu: 3.74 vs 3.36
// TB/s for 8 tokens' gate_up bytes). A row's bytes past its last whole 128
// (32 at gpt-oss shapes) go to a tail region after every tile's full stages,
// 64 rows x tail bytes a tile, so no byte is padded.
//
// Layer layout, T = rows / 64 tiles an expert, gt = e * T + n / 64:
//   full stage s of tile gt: ((gt * nfull + s) * 64 + n % 64) * 128 + b % 128
//   tail of tile gt:         E * T * nfull * 8192 + (gt * 64 + n % 64) * tailw + b - 128 * nfull
// The same bytes as the checkpoint's [E][rows][nsub][16], moved.
#pragma once
#include <cstdint>

namespace dz::cuda {

struct Mxfp4Tiles {
  int rows = 0, nsub = 0;  // a projection's rows (a multiple of 64) and 32-element sub-blocks a row
  int n_experts = 0;
  __host__ __device__ int row_bytes() const { return nsub * 16; }
  __host__ __device__ int nfull() const { return row_bytes() / 128; }  // whole 128-byte stages a row
  __host__ __device__ int tailw() const { return row_bytes() % 128; }  // bytes of the tail stage (0: none)
  __host__ __device__ int tiles() const { return rows / 64; }          // tiles an expert
  __host__ __device__ int64_t tail_offset() const { return int64_t(n_experts) * tiles() * nfull() * 8192; }
  // Byte b of expert e's row n.
  __host__ __device__ int64_t offset(int64_t e, int n, int b) const {
    const int64_t gt = e * tiles() + n / 64;
    const int s = b / 128;
    if (s < nfull()) return ((gt * nfull() + s) * 64 + n % 64) * 128 + b % 128;
    return tail_offset() + (gt * 64 + n % 64) * tailw() + (b - 128 * nfull());
  }
};

}  // namespace dz::cuda
