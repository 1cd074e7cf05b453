// The order of an MXFP4 expert stack's blocks on the device ("tile order").
// The checkpoint stores each expert's [rows][nsub][16] row by row; the device
// copy keeps each 64-row tile's bytes where they were but orders them by K:
// first the tile's full 128-byte stages (8 sub-blocks = 256 values), each as
// its rows' 128 bytes one after another, then the rows' tails (the nsub % 8
// sub-blocks past the last full stage), row after row. A stage of a tile is
// then one contiguous piece (8 KB for 64 rows), which HBM serves ~9% faster
// than the same bytes as 64 pieces of 128 bytes one row pitch apart (H200,
// tools/bench/dram_pattern.cu: 3.67 vs 3.37 TB/s at 8 tokens' gate_up). A
// tile's bytes stay in the same range as in the checkpoint, so the copy is
// reordered in place, tile by tile, after its upload (mxfp4_to_tile_order).
// Every device reader of expert blocks reads this order; scales keep theirs.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define DZ_HD __host__ __device__
#else
#define DZ_HD
#endif

namespace dz::cuda {

constexpr int kMx4TileRows = 64;
constexpr int kMx4StageSubs = 8;  // sub-blocks of 16 bytes a stage: 128 bytes a row

// Where one row's bytes lie inside its expert's tile-ordered blocks: sub-block
// sb of the row at sub(sb). rows: the expert's rows (the last tile may be short).
struct Mx4Row {
  int64_t full = 0;  // offset of the row's 128 bytes in the tile's first stage
  int64_t tail = 0;  // offset of the row's tail
  int stage = 0;     // bytes from one stage of the tile to the next (its rows x 128)
  int nfull = 0;     // sub-blocks in full stages (a multiple of 8)
  DZ_HD int64_t sub(int sb) const {
    return sb < nfull ? full + int64_t(sb >> 3) * stage + (sb & 7) * 16 : tail + int64_t(sb - nfull) * 16;
  }
};

DZ_HD inline Mx4Row mx4_row(int64_t r, int64_t rows, int nsub) {
  const int64_t t0 = r / kMx4TileRows * kMx4TileRows;
  const int rt = int(rows - t0 < kMx4TileRows ? rows - t0 : kMx4TileRows), ri = int(r - t0);
  Mx4Row w;
  w.nfull = nsub / kMx4StageSubs * kMx4StageSubs;
  w.stage = rt * 128;
  const int64_t tile = t0 * nsub * 16;
  w.full = tile + ri * 128;
  w.tail = tile + int64_t(w.nfull / kMx4StageSubs) * w.stage + int64_t(ri) * (nsub - w.nfull) * 16;
  return w;
}

// Byte offset of row r's sub-block sb in expert e of a tile-ordered stack.
DZ_HD inline int64_t mx4_offset(int64_t e, int64_t r, int sb, int64_t rows, int nsub) {
  return e * rows * nsub * 16 + mx4_row(r, rows, nsub).sub(sb);
}

}  // namespace dz::cuda
