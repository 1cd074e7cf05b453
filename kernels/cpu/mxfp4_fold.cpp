#include "cpu/mxfp4_fold.h"

#include <cmath>
#include <vector>

#include "common/error.h"

namespace dz::cpu {

uint8_t e4m3_from_double(double x) {
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  double a = std::fabs(x);
  if (a >= 448.0) return sign | 0x7E;            // satfinite (values in (448, 464) round to 448 too)
  if (a < std::ldexp(1.0, -6)) {                 // subnormal: k * 2^-9, k in 0..8 (8 = smallest normal)
    const double q = std::nearbyint(a * 512.0);  // default rounding mode: nearest-even
    return sign | uint8_t(q);
  }
  int e = std::ilogb(a);                               // a = m * 2^e, m in [1, 2)
  double q = std::nearbyint(std::ldexp(a, -e) * 8.0);  // 8..16
  if (q == 16.0) {
    q = 8.0;
    ++e;
  }
  const int field = e + 7;
  const int mant = int(q) - 8;
  if (field > 15 || (field == 15 && mant == 7)) return sign | 0x7E;
  return sign | uint8_t(field << 3) | uint8_t(mant);
}

double e4m3_to_double(uint8_t b) {
  const double s = (b & 0x80) ? -1.0 : 1.0;
  const int field = (b >> 3) & 15, mant = b & 7;
  if (field == 15 && mant == 7) return NAN;
  if (field == 0) return s * std::ldexp(double(mant), -9);
  return s * std::ldexp(1.0 + mant / 8.0, field - 7);
}

double e8m0_to_double(uint8_t s) { return s == 0xFF ? NAN : std::ldexp(1.0, int(s) - 127); }

namespace {

void check_shape(const Mxfp4View& w) {
  check(w.k > 0 && w.k % 32 == 0 && w.rows > 0, DZ_ERR_INVALID_ARGUMENT, "MXFP4 tensor ", w.name, ": K = ", w.k,
        " must be a positive multiple of 32");
}

// Scale bytes and nonzero flags of fold group g of row r (padding sub-blocks: zero, scale 0).
struct Group {
  int s[4];
  bool nz[4];
  int smax;
  bool any;
};

Group read_group(const Mxfp4View& w, int64_t r, int64_t g) {
  const int64_t nsub = w.k / 32;
  Group G{};
  G.smax = -1;
  for (int j = 0; j < 4; ++j) {
    const int64_t sb = g * 4 + j;
    if (sb >= nsub) {
      G.s[j] = 0;
      G.nz[j] = false;
      continue;
    }
    const uint8_t s = w.scales[r * nsub + sb];
    if (s == 0xFF) fail(DZ_ERR_FORMAT, "MXFP4 tensor ", w.name, ": scale byte 0xFF (NaN) at row ", r, ", block ", sb);
    G.s[j] = s;
    const uint8_t* b = w.blocks + (r * nsub + sb) * 16;
    bool nz = false;
    for (int i = 0; i < 16; ++i) nz |= (b[i] & 0x77) != 0;
    G.nz[j] = nz;
    if (nz && s > G.smax) G.smax = s;
  }
  G.any = G.smax >= 0;
  if (!G.any) G.smax = 133;  // no nonzero value: scale 2^0
  return G;
}

// The fold group of rows [r0, r0 + n) and K group g: its rows' groups and
// the largest scale among all their nonzero sub-blocks (R is reused from
// group to group: no allocation once its rows have grown).
struct RowsGroup {
  std::vector<Group> rows;
  int smax = 133;
  bool any = false;
};

void read_rows_group(const Mxfp4View& w, int64_t r0, int n, int64_t g, RowsGroup& R) {
  R.rows.clear();
  int m = -1;
  for (int i = 0; i < n; ++i) {
    R.rows.push_back(read_group(w, r0 + i, g));
    if (R.rows.back().any && R.rows.back().smax > m) m = R.rows.back().smax;
  }
  R.any = m >= 0;
  R.smax = R.any ? m : 133;
}

// One fold group of n rows' groups under scale byte smax (any: a nonzero value in them).
void account(const Group* rows, int n, int smax, bool any, FoldStats& st) {
  ++st.groups;
  if (!any) {
    ++st.zero_groups;
    return;
  }
  int spread = 0;
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < 4; ++j)
      if (rows[i].nz[j] && smax - rows[i].s[j] > spread) spread = smax - rows[i].s[j];
  if (spread > st.max_spread) st.max_spread = spread;
  if (spread > 14) ++st.lossy_groups;
}
void account(const RowsGroup& R, FoldStats& st) { account(R.rows.data(), int(R.rows.size()), R.smax, R.any, st); }

void check_row_group(const Mxfp4View& w, int row_group) {
  check(row_group >= 1 && w.rows % row_group == 0, DZ_ERR_INVALID_ARGUMENT, "MXFP4 tensor ", w.name, ": ", w.rows,
        " rows do not split into fold groups of ", row_group);
}

}  // namespace

void mxfp4_fold(const Mxfp4View& w, int row_group, uint8_t* fp8, float* scales, FoldStats* stats) {
  check_shape(w);
  check_row_group(w, row_group);
  const int64_t nsub = w.k / 32, kpad = fold_kpad(w.k), ng = kpad / 128, nrg = w.rows / row_group;
  // table[d][code]: E2M1 * 2^(6-d) as E4M3, d = 0..31 (d >= 20 is all zeros).
  uint8_t table[32][16];
  for (int d = 0; d < 32; ++d)
    for (int c = 0; c < 16; ++c) table[d][c] = e4m3_from_double(double(kE2M1[c]) * std::ldexp(1.0, 6 - d));
  FoldStats st;
  RowsGroup R;
  for (int64_t rg = 0; rg < nrg; ++rg) {
    for (int64_t g = 0; g < ng; ++g) {
      read_rows_group(w, rg * row_group, row_group, g, R);
      account(R, st);
      scales[g * nrg + rg] = float(std::ldexp(1.0, R.smax - 133));
      for (int i = 0; i < row_group; ++i) {
        const int64_t r = rg * row_group + i;
        const Group& G = R.rows[size_t(i)];
        uint8_t* out = fp8 + r * kpad + g * 128;
        for (int j = 0; j < 4; ++j) {
          const int64_t sb = g * 4 + j;
          if (sb >= nsub) {
            for (int q = 0; q < 32; ++q) out[j * 32 + q] = 0;
            continue;
          }
          int d = R.smax - G.s[j];
          d = d < 0 ? 0 : (d > 31 ? 31 : d);  // d < 0 only for all-zero sub-blocks
          const uint8_t* b = w.blocks + (r * nsub + sb) * 16;
          for (int q = 0; q < 16; ++q) {
            out[j * 32 + 2 * q] = table[d][b[q] & 15];
            out[j * 32 + 2 * q + 1] = table[d][b[q] >> 4];
          }
        }
      }
    }
  }
  if (stats) stats->merge(st);
}

void mxfp4_fold_1x128(const Mxfp4View& w, uint8_t* fp8, float* scales, FoldStats* stats) {
  mxfp4_fold(w, 1, fp8, scales, stats);
}

FoldStats mxfp4_fold_check(const Mxfp4View& w, int row_group, FoldStats* by_row) {
  check_shape(w);
  check_row_group(w, row_group);
  const int64_t ng = fold_kpad(w.k) / 128;
  FoldStats st, rows;
  RowsGroup R;
  for (int64_t r = 0; r < w.rows; r += row_group)
    for (int64_t g = 0; g < ng; ++g) {
      read_rows_group(w, r, row_group, g, R);
      account(R, st);
      if (by_row)
        for (const Group& G : R.rows) account(&G, 1, G.smax, G.any, rows);
    }
  if (by_row) by_row->merge(rows);
  return st;
}

double mxfp4_value(const Mxfp4View& w, int64_t row, int64_t col) {
  const int64_t nsub = w.k / 32, sb = col / 32, i = col % 32;
  const uint8_t byte = w.blocks[(row * nsub + sb) * 16 + i / 2];
  const uint8_t code = (i & 1) ? (byte >> 4) : (byte & 15);
  return double(kE2M1[code]) * e8m0_to_double(w.scales[row * nsub + sb]);
}

}  // namespace dz::cpu
