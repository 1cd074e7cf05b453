// MXFP4 (OCP microscaling, E2M1 elements + E8M0 scale per 32 along K) and its
// lossless folding into FP8 E4M3 with one fp32 scale per 1x128 block.
//
// Fold group = 4 consecutive 32-element sub-blocks of one row (K padded with
// zeros to a multiple of 128). s_max = largest scale byte among the group's
// sub-blocks that hold a nonzero value; block scale = 2^(s_max-127-6);
// element = E2M1 * 2^(6-(s_max-s_i)), rounded to nearest-even E4M3. Exact iff
// s_max-s_i <= 14 for every nonzero sub-block; groups past that are "lossy"
// (counted, never silently assumed exact). A group with no nonzero value gets
// scale 1. The sign of zero is kept (nibble 8 -> 0x80). Scale byte 0xFF (NaN)
// is an error. mxfp4_fold takes the same rule over groups of several rows (64 x
// 128 on the GPU where every such group is exact: one scale per 64 columns of a
// GEMM).
//
// This is the CPU reference; kernels/cuda/mxfp4_fold.cu must match it bit for bit.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "cpu/mxfp4.h"

namespace dz::cpu {

// kE2M1 (E2M1 code -> value) comes from cpu/mxfp4.h.

// Round-to-nearest-even to E4M3 (finite, saturating at +-448; NaN -> 0x7F).
uint8_t e4m3_from_double(double x);
double e4m3_to_double(uint8_t b);

// 2^(byte-127) for an E8M0 scale byte (byte 0 is 2^-127; 0xFF is NaN).
double e8m0_to_double(uint8_t s);

struct FoldStats {
  uint64_t groups = 0;        // fold groups examined (rows x Kpad/128)
  uint64_t lossy_groups = 0;  // groups with a nonzero sub-block more than 14 binades under s_max
  uint64_t zero_groups = 0;   // groups with no nonzero value
  int max_spread = 0;         // largest s_max - s_i over nonzero sub-blocks
  void merge(const FoldStats& o) {
    groups += o.groups;
    lossy_groups += o.lossy_groups;
    zero_groups += o.zero_groups;
    if (o.max_spread > max_spread) max_spread = o.max_spread;
  }
};

inline int64_t fold_kpad(int64_t k) { return (k + 127) / 128 * 128; }

// One MXFP4 matrix [rows, k] (k % 32 == 0) in the checkpoint layout:
// blocks [rows][k/32][16] (byte j: element 2j low nibble, 2j+1 high), scales [rows][k/32].
struct Mxfp4View {
  const uint8_t* blocks = nullptr;
  const uint8_t* scales = nullptr;
  int64_t rows = 0, k = 0;
  std::string name;  // for error messages
};

// Fold into fp8 [rows][kpad] and scales [kpad/128][rows] (row index fastest:
// the layout cuBLASLt's VEC128 scale mode reads). Throws DZ_ERR_FORMAT on a
// 0xFF scale. stats may be null.
void mxfp4_fold_1x128(const Mxfp4View& w, uint8_t* fp8, float* scales, FoldStats* stats);

// The same rule over fold groups of row_group rows x 128 (rows % row_group ==
// 0): s_max over all their nonzero sub-blocks, scales [kpad/128][rows /
// row_group]. row_group 1 is mxfp4_fold_1x128.
void mxfp4_fold(const Mxfp4View& w, int row_group, uint8_t* fp8, float* scales, FoldStats* stats);

// Spread check only (what a load reports): counts lossy groups of row_group
// rows x 128; throws on 0xFF. by_row (optional): the 1x128 check of the same
// rows merged into it, from the same read.
FoldStats mxfp4_fold_check(const Mxfp4View& w, int row_group = 1, FoldStats* by_row = nullptr);

// Exact value of element (row, col).
double mxfp4_value(const Mxfp4View& w, int64_t row, int64_t col);

}  // namespace dz::cpu
