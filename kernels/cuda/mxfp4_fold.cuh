// MXFP4 -> FP8 E4M3 folding of one 128-wide group of one row (rule:
// kernels/cpu/mxfp4_fold.h), shared by the folding kernel and the grouped FP8
// GEMM's weight producer so both write the same bytes. Device code only.
#pragma once
#include <cuda_fp8.h>

#include <cstdint>

#include "cuda/ptx.cuh"

namespace dz::cuda {

// Magnitude bytes of E2M1 codes 0..7 times 2^(6-d) as E4M3 (hardware RNE
// conversion; the CPU reference builds its table in double precision).
// d <= 11 (kFoldLutNormal): every nonzero entry stays an E4M3 normal, so
// subtracting d from its exponent is exact, as the conversion.
constexpr int kFoldLutNormal = 11;
__device__ __forceinline__ void fold_lut_normal(int d, uint32_t& lo, uint32_t& hi) {
  lo = 0x6C686000u - uint32_t(d * 8) * 0x01010100u;
  hi = 0x7C787470u - uint32_t(d * 8) * 0x01010101u;
}
__device__ __forceinline__ void fold_lut(int d, uint32_t& lo, uint32_t& hi) {
  if (d <= kFoldLutNormal) {
    fold_lut_normal(d, lo, hi);
    return;
  }
  const float f = ldexpf(1.f, 6 - d);
  auto cv = [](float a, float b) -> uint32_t {
    return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  };
  lo = cv(0.f, 0.5f * f) | (cv(1.f * f, 1.5f * f) << 16);
  hi = cv(2.f * f, 3.f * f) | (cv(4.f * f, 6.f * f) << 16);
}

// 8 nibbles (elements in order) -> 8 E4M3 bytes, sign kept. The signs: nibble
// 2j + 1's is the top bit of byte j of w, nibble 2j's that of byte j of w << 4,
// and prmt's sign-replicating selectors (bit 3) pick those bytes in output
// order as 0xFF / 0x00, so one AND-OR (a lop3) sets each E4M3 sign.
__device__ __forceinline__ uint2 fold_word(uint32_t w, uint32_t lo, uint32_t hi) {
  const uint32_t m = w & 0x77777777u, w4 = w << 4;
  const uint32_t sl = ptx::prmt(w4, w, 0xD9C8u);  // nibbles 0..3: bytes 0, 4, 1, 5 of (w4, w), sign-replicated
  const uint32_t sh = ptx::prmt(w4, w, 0xFBEAu);  // nibbles 4..7: bytes 2, 6, 3, 7
  uint2 r;
  r.x = ptx::prmt(lo, hi, m) | (sl & 0x80808080u);
  r.y = ptx::prmt(lo, hi, m >> 16) | (sh & 0x80808080u);
  return r;
}

// The 4 sub-blocks (32 elements each) of one group and their E8M0 scales;
// sub-blocks past the row's end read as zero.
struct GroupIn {
  uint4 w[4];
  int s[4];
};

// Loads only: the caller may issue them early and fold later.
__device__ __forceinline__ GroupIn load_group(const uint8_t* bl, const uint8_t* sc, int g, int nsub) {
  GroupIn G;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int sb = g * 4 + j;
    if (sb < nsub) {
      G.w[j] = __ldg(reinterpret_cast<const uint4*>(bl + sb * 16));  // L1 keeps the sector's other half
      G.s[j] = sc[sb];
    } else {
      G.w[j] = make_uint4(0, 0, 0, 0);
      G.s[j] = 0;
    }
  }
  return G;
}

__device__ __forceinline__ bool sub_nonzero(const uint4& w) { return ((w.x | w.y | w.z | w.w) & 0x77777777u) != 0; }

// The largest scale among the nonzero sub-blocks; -1 when all are zero.
__device__ __forceinline__ int group_smax(const GroupIn& G) {
  int smax = -1;
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if (sub_nonzero(G.w[j]) && G.s[j] > smax) smax = G.s[j];
  return smax;
}

// The scale byte a fold group is placed under: its largest nonzero
// sub-block's, or 133 (block scale 1) when every sub-block is zero.
__device__ __forceinline__ int fold_smax(int m) { return m < 0 ? 133 : m; }

// Fold G under the scale byte smax (>= every nonzero sub-block's: a row's own
// fold_smax, or its 64-row group's from mxfp4_group_table): its 128 E4M3
// bytes go to dst as 8 16-byte pieces, piece c at dst[c ^ sw] (sw: this row's
// 128-byte swizzle, 0 for none); returns the FP8 block scale (NaN for a 0xFF
// scale byte).
__device__ __forceinline__ float fold_group_at(const GroupIn& G, int smax, uint4* dst, int sw) {
  bool nan = false;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    nan |= G.s[j] == 255;
    const int d = min(max(smax - G.s[j], 0), 31);
    uint32_t lo, hi;
    fold_lut(d, lo, hi);
    const uint2 p0 = fold_word(G.w[j].x, lo, hi), p1 = fold_word(G.w[j].y, lo, hi);
    const uint2 p2 = fold_word(G.w[j].z, lo, hi), p3 = fold_word(G.w[j].w, lo, hi);
    dst[(j * 2) ^ sw] = make_uint4(p0.x, p0.y, p1.x, p1.y);
    dst[(j * 2 + 1) ^ sw] = make_uint4(p2.x, p2.y, p3.x, p3.y);
  }
  return nan ? __int_as_float(0x7fc00000) : ldexpf(1.f, smax - 133);
}

// Fold G under its own largest scale (the 1x128 rule).
__device__ __forceinline__ float fold_group(const GroupIn& G, uint4* dst, int sw) {
  return fold_group_at(G, fold_smax(group_smax(G)), dst, sw);
}

}  // namespace dz::cuda
