// The order of MXFP4 expert blocks on the device. Checkpoints store each
// expert's blocks row after row ([rows][K/32][16]); the decode kernels read a
// 64-row tile a few K chunks at a time, so in that order every request is a
// short piece of many rows, and HBM serves it well below its streaming rate
// (H200, 8 tokens of gpt-oss-120b shapes: the W4A8 kernels' weight stream
// alone 132 us as 64-row x 144-byte pieces, 108 us as contiguous 8 KB ones).
// On the device each expert's blocks are therefore reordered once at load:
// the same bytes, still MXFP4, in pieces of one 64-row tile x 8 sub-blocks
// (a "stage", 128 bytes a row) that are contiguous in memory:
//   expert e: its R x S sub-blocks of 16 bytes, at e * R * S * 16 as before;
//   inside: 64-row tiles in order (the last may have h < 64 rows), inside a
//   tile its stages in K order (the last may have w < 8 sub-blocks), inside a
//   stage piece h rows of w * 16 bytes; in a full piece (w = 8) the 16-byte
//   units of row r are XOR-swizzled by r's Gray code (r ^ r >> 1) & 7, so 8
//   rows' loads of one unit (either row order of the kernels) hit distinct
//   shared-memory banks.
// Scales keep the checkpoint order ([rows][S]).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dz::cuda {

constexpr int kW4TileRows = 64;     // rows of a tile
constexpr int kW4StageSubs = 8;     // sub-blocks (32 elements, 16 bytes) of a full stage a row
constexpr int kW4StageBytes = 128;  // bytes of a full stage a row

// Byte offset of sub-block `sub` of row r within one expert's blocks (R rows, S sub-blocks a row).
__host__ __device__ inline int64_t w4_unit_offset(int r, int sub, int R, int S) {
  const int t0 = r & ~(kW4TileRows - 1), rr = r - t0;
  const int h = R - t0 < kW4TileRows ? R - t0 : kW4TileRows;
  const int st = sub / kW4StageSubs, su = sub % kW4StageSubs;
  const int w = S - st * kW4StageSubs < kW4StageSubs ? S - st * kW4StageSubs : kW4StageSubs;
  const int u = w == kW4StageSubs ? su ^ ((rr ^ (rr >> 1)) & 7) : su;
  return int64_t(t0) * S * 16 + int64_t(st) * h * kW4StageBytes + (int64_t(rr) * w + u) * 16;
}

// Byte offset and size of stage st of the 64-row tile starting at row t0 (a
// multiple of 64) within one expert's blocks.
__host__ __device__ inline int64_t w4_piece_offset(int t0, int st, int R, int S) {
  const int h = R - t0 < kW4TileRows ? R - t0 : kW4TileRows;
  return int64_t(t0) * S * 16 + int64_t(st) * h * kW4StageBytes;
}
__host__ __device__ inline int w4_piece_bytes(int t0, int st, int R, int S) {
  const int h = R - t0 < kW4TileRows ? R - t0 : kW4TileRows;
  const int w = S - st * kW4StageSubs < kW4StageSubs ? S - st * kW4StageSubs : kW4StageSubs;
  return h * w * 16;
}

// Sub-block addresses of one row: full stages swizzled, the partial last
// stage (S % 8 sub-blocks) not.
struct W4Row {
  const uint8_t* p;     // the row's bytes in stage 0
  int64_t stride;       // bytes from one stage piece to the next
  const uint8_t* tail;  // the row's bytes in the partial stage
  int swz, nfull;       // Gray swizzle; full stages
  __host__ __device__ const uint8_t* unit(int sub) const {
    const int st = sub / kW4StageSubs, u = sub % kW4StageSubs;
    return st < nfull ? p + st * stride + ((u ^ swz) << 4) : tail + (u << 4);
  }
};
// eb: one expert's blocks (device order), R x S sub-blocks.
__host__ __device__ inline W4Row w4_row(const uint8_t* eb, int r, int R, int S) {
  const int t0 = r & ~(kW4TileRows - 1), rr = r - t0;
  const int h = R - t0 < kW4TileRows ? R - t0 : kW4TileRows, nfull = S / kW4StageSubs;
  const uint8_t* tile = eb + int64_t(t0) * S * 16;
  return W4Row{tile + rr * kW4StageBytes, int64_t(h) * kW4StageBytes,
               tile + int64_t(nfull) * h * kW4StageBytes + rr * (S % kW4StageSubs) * 16, (rr ^ (rr >> 1)) & 7, nfull};
}

// Rewrites the blocks of n_experts stacked experts (R rows, K columns each:
// R * K / 2 bytes an expert, checkpoint order) into the device order above, in
// place (a temporary device buffer of at most 256 MiB). Load time only; the
// stream is synchronized before returning.
void mxfp4_to_device_order(uint8_t* blocks, int64_t n_experts, int R, int64_t K, cudaStream_t s);

}  // namespace dz::cuda
