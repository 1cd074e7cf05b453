// Down's input in E4M3 under one fixed scale (1/8, gpt-oss's SwiGLU bound of
// 56: MoeOptions::fp8_whole_k_glu, the W4A8 kernels' down) against a scale of
// amax / 448 a row, in float64: the relative RMS error of each over rows of
// 2,880 SwiGLU outputs, gate and up drawn from N(0, sd).
//   g++ -O2 -std=c++17 tools/reference/e4m3_fixed_scale.cpp -o /tmp/e4m3 && /tmp/e4m3
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

// Round to E4M3 (nearest, ties to even; subnormals below 2^-6 in steps of
// 2^-9; saturating at 448 as the kernels' satfinite conversion).
static double e4m3(double x) {
  const double a = std::fabs(x);
  if (a >= 448) return std::copysign(448.0, x);
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  const double step = std::ldexp(1.0, std::max(e - 1, -6) - 3);
  return std::copysign(std::min(std::nearbyint(a / step) * step, 448.0), x);
}

// gpt-oss's clamped SwiGLU (limit 7, alpha 1.702).
static double swiglu(double g, double u) {
  g = std::min(g, 7.0), u = std::min(std::max(u, -7.0), 7.0);
  return (u + 1) * g / (1 + std::exp(-1.702 * g));
}

int main() {
  std::mt19937_64 rng(1);
  std::printf("%8s %14s %14s %18s\n", "sd", "fixed 1/8", "amax / 448", "values < 2^-9");
  for (double sd : {0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0}) {
    std::normal_distribution<double> nd(0, sd);
    double ef = 0, ea = 0, ss = 0, small = 0, n = 0;
    for (int row = 0; row < 200; ++row) {
      std::vector<double> v(2880);
      double amax = 0;
      for (auto& x : v) x = swiglu(nd(rng), nd(rng)), amax = std::max(amax, std::fabs(x));
      const double sa = amax > 0 ? amax / 448 : 1;
      for (double x : v) {
        const double f = e4m3(x * 8) / 8, a = e4m3(x / sa) * sa;
        ef += (f - x) * (f - x), ea += (a - x) * (a - x), ss += x * x;
        small += std::fabs(x) < 0x1p-9, n += 1;
      }
    }
    std::printf("%8.3f %14.4f %14.4f %17.1f%%\n", sd, std::sqrt(ef / ss), std::sqrt(ea / ss), 100 * small / n);
  }
}
