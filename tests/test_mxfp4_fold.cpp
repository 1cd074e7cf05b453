// CPU reference of the MXFP4 -> FP8 E4M3 1x128 folding: E4M3 rounding,
// exactness when the scale spread is <= 14, lossy groups counted past it,
// padding of K to 128, and NaN scales refused.
#include <catch2/catch.hpp>
#include <cmath>
#include <random>
#include <vector>

#include "common/error.h"
#include "cpu/mxfp4_fold.h"

using namespace dz;
using namespace dz::cpu;

namespace {
struct Mat {
  std::vector<uint8_t> blocks, scales;
  int64_t rows, k;
  Mxfp4View view() const { return {blocks.data(), scales.data(), rows, k, "test"}; }
};
Mat random_mat(int64_t rows, int64_t k, std::mt19937& rng, int s_lo, int s_hi) {
  Mat m{std::vector<uint8_t>(size_t(rows * k / 2)), std::vector<uint8_t>(size_t(rows * k / 32)), rows, k};
  std::uniform_int_distribution<int> byte(0, 255), sc(s_lo, s_hi);
  for (auto& b : m.blocks) b = uint8_t(byte(rng));
  for (auto& s : m.scales) s = uint8_t(sc(rng));
  return m;
}
}  // namespace

TEST_CASE("E4M3 rounding: known encodings, nearest-even, saturation", "[mxfp4]") {
  CHECK(e4m3_from_double(1.0) == 0x38);
  CHECK(e4m3_from_double(448.0) == 0x7E);
  CHECK(e4m3_from_double(1e9) == 0x7E);
  CHECK(e4m3_from_double(-448.0) == 0xFE);
  CHECK(e4m3_from_double(std::ldexp(1.0, -9)) == 0x01);   // smallest subnormal
  CHECK(e4m3_from_double(std::ldexp(1.0, -10)) == 0x00);  // tie -> even (0)
  CHECK(e4m3_from_double(std::ldexp(3.0, -10)) == 0x02);  // 1.5 ulp -> 2 (even)
  CHECK(e4m3_from_double(-0.0) == 0x80);
  CHECK(e4m3_from_double(1.0625) == 0x38);  // halfway 1 .. 1.125 -> even mantissa
  CHECK(e4m3_from_double(1.1875) == 0x3A);  // halfway 1.125 .. 1.25 -> even (1.25)
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7F) == 0x7F) continue;  // NaN
    CHECK(e4m3_from_double(e4m3_to_double(uint8_t(b))) == uint8_t(b));
  }
}

TEST_CASE("MXFP4 fold is exact when the spread is at most 14 and counts lossy groups past it", "[mxfp4]") {
  std::mt19937 rng(7);
  for (int spread : {0, 6, 14, 15, 20, 60}) {
    INFO("scale spread " << spread);
    // K = 320 (not a multiple of 128): pads to 384, the last group has 2 sub-blocks.
    Mat m = random_mat(24, 320, rng, 100, 100 + spread);
    // A zero sub-block with a huge scale must not become s_max.
    for (int i = 0; i < 16; ++i) m.blocks[16 * 3 + i] = (i & 1) ? 0x80 : 0x08;  // -0 nibbles only
    m.scales[3] = 250;
    const int64_t kpad = fold_kpad(m.k);
    REQUIRE(kpad == 384);
    std::vector<uint8_t> q(size_t(m.rows * kpad));
    std::vector<float> sc(size_t(m.rows * kpad / 128));
    FoldStats st;
    mxfp4_fold_1x128(m.view(), q.data(), sc.data(), &st);
    CHECK(st.groups == uint64_t(m.rows * 3));
    size_t inexact = 0;
    for (int64_t r = 0; r < m.rows; ++r)
      for (int64_t c = 0; c < kpad; ++c) {
        const double got = e4m3_to_double(q[size_t(r * kpad + c)]) * sc[size_t((c / 128) * m.rows + r)];
        const double want = c < m.k ? mxfp4_value(m.view(), r, c) : 0.0;
        inexact += got != want;
      }
    const FoldStats chk = mxfp4_fold_check(m.view());
    CHECK(chk.lossy_groups == st.lossy_groups);
    CHECK(chk.max_spread == st.max_spread);
    CHECK(st.max_spread <= spread);
    if (spread <= 14) {
      CHECK(inexact == 0);
      CHECK(st.lossy_groups == 0);
    } else {
      CHECK(st.lossy_groups > 0);
      if (spread >= 20) CHECK(inexact > 0);
    }
  }
}

TEST_CASE("MXFP4 fold by 64-row groups: exact within a spread of 14 over the group, lossy groups counted", "[mxfp4]") {
  std::mt19937 rng(11);
  for (int spread : {0, 9, 14, 15, 24}) {
    INFO("scale spread " << spread);
    Mat m = random_mat(128, 320, rng, 100, 100 + spread);
    for (int i = 0; i < 16; ++i) m.blocks[16 * 7 + i] = (i & 1) ? 0x80 : 0x08;  // a -0 sub-block with a huge scale
    m.scales[7] = 250;
    const int64_t kpad = fold_kpad(m.k), rg = m.rows / 64;
    std::vector<uint8_t> q(size_t(m.rows * kpad)), q1(q.size());
    std::vector<float> sc(size_t(rg * kpad / 128)), sc1(size_t(m.rows * kpad / 128));
    FoldStats st, st1;
    mxfp4_fold(m.view(), 64, q.data(), sc.data(), &st);
    mxfp4_fold_1x128(m.view(), q1.data(), sc1.data(), &st1);
    CHECK(st.groups == uint64_t(rg * 3));
    size_t inexact = 0, pow2 = 0;
    for (int64_t r = 0; r < m.rows; ++r)
      for (int64_t c = 0; c < kpad; ++c) {
        const double v = e4m3_to_double(q[size_t(r * kpad + c)]);
        const double got = v * sc[size_t((c / 128) * rg + r / 64)];
        const double want = c < m.k ? mxfp4_value(m.view(), r, c) : 0.0;
        inexact += got != want;
        // Each row's group-folded value is its 1x128 value times a power of two of the row's group.
        const double v1 = e4m3_to_double(q1[size_t(r * kpad + c)]);
        const double ratio = double(sc1[size_t((c / 128) * m.rows + r)]) / sc[size_t((c / 128) * rg + r / 64)];
        pow2 += v1 != 0 && v * 1.0 != v1 * ratio;
      }
    FoldStats rows;
    const FoldStats chk = mxfp4_fold_check(m.view(), 64, &rows);
    CHECK(chk.lossy_groups == st.lossy_groups);
    CHECK(chk.max_spread == st.max_spread);
    // The 1x128 check from the same read equals the 1x128 fold's own.
    CHECK(rows.groups == st1.groups);
    CHECK(rows.lossy_groups == st1.lossy_groups);
    CHECK(rows.zero_groups == st1.zero_groups);
    CHECK(rows.max_spread == st1.max_spread);
    CHECK(st.max_spread >= st1.max_spread);
    if (spread <= 14) {
      CHECK(inexact == 0);
      CHECK(pow2 == 0);
      CHECK(st.lossy_groups == 0);
    } else {
      CHECK(st.lossy_groups > 0);
      CHECK(inexact > 0);
    }
  }
  Mat m = random_mat(96, 128, rng, 120, 121);
  std::vector<uint8_t> q(size_t(96 * 128));
  std::vector<float> sc(2);
  CHECK_THROWS_AS(mxfp4_fold(m.view(), 64, q.data(), sc.data(), nullptr), Error);  // 96 rows: not whole groups
}

TEST_CASE("MXFP4 fold: zero groups get scale 1, scale byte 0 is 2^-127, 0xFF is refused", "[mxfp4]") {
  Mat m{std::vector<uint8_t>(2 * 64 / 2, 0), std::vector<uint8_t>(2 * 2, 0), 2, 64};
  m.blocks[0] = 0x21;  // row 0, sub-block 0: elements 0.5 and 1.0 at scale byte 0
  std::vector<uint8_t> q(2 * 128);
  std::vector<float> sc(2);
  FoldStats st;
  mxfp4_fold_1x128(m.view(), q.data(), sc.data(), &st);
  CHECK(st.zero_groups == 1);
  CHECK(sc[1] == 1.0f);
  CHECK(double(sc[0]) == std::ldexp(1.0, -133));
  CHECK(e4m3_to_double(q[0]) * sc[0] == std::ldexp(0.5, -127));
  CHECK(e4m3_to_double(q[1]) * sc[0] == std::ldexp(1.0, -127));
  m.scales[3] = 0xFF;
  try {
    mxfp4_fold_1x128(m.view(), q.data(), sc.data(), nullptr);
    FAIL("accepted a NaN scale");
  } catch (const Error& e) {
    CHECK(e.status() == DZ_ERR_FORMAT);
    CHECK_THAT(e.what(), Catch::Contains("0xFF") && Catch::Contains("test") && Catch::Contains("row 1"));
  }
}
