// GPU test of the decode step's logits output (cuda/logits.h): each row's
// argmax against the CPU backend's cpu::argmax (ties, -inf, NaN, all-NaN
// rows) and the rows copied bit for bit to scattered destinations ([cuda];
// skips with a message where no CUDA device is present).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/sampling.h"

#ifdef DZ_WITH_CUDA
#include "cuda/logits.h"
#include "runtime/cuda/context.h"
#include "support/device_buffer.h"
#endif

#include "support/gpu.h"

TEST_CASE("CUDA logits argmax and row copies match cpu::argmax bit for bit", "[cuda]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  dz::cuda::Context ctx(dz::test::pool_options(size_t(64) << 20));
  std::mt19937 rng(7);
  // Vector path (V % 4 == 0) and the scalar one; 19 rows, and 1 and 2 (each
  // row's slices spread over a cluster of blocks either way).
  for (const int V : {201088, 1000, 7, 4099})
    for (const int rows : {19, 1, 2}) {
      INFO("V " << V << " rows " << rows);
      std::vector<float> logits(size_t(rows) * size_t(V));
      std::normal_distribution<float> nd(0.f, 3.f);
      std::uniform_int_distribution<int> kind(0, 63), grid(-6, 6);
      for (int r = 0; r < rows; ++r) {
        float* row = logits.data() + size_t(r) * size_t(V);
        for (int i = 0; i < V; ++i) {
          // Rows 0-5 on a coarse grid (many exact ties, +-0), the rest Gaussian
          // with some NaN and -inf entries.
          const int k = kind(rng);
          row[i] = r < 6 ? 0.5f * float(grid(rng)) : k == 0 ? NAN : k == 1 ? -INFINITY : nd(rng);
          if (r < 6 && row[i] == 0.f && k < 32) row[i] = -0.f;
        }
        if (r == 6) std::fill(row, row + V, NAN);                        // no number: -1
        if (r == 7) std::fill(row, row + V, -INFINITY);                  // all equal: index 0
        if (r == 8) row[V - 1] = 1e30f;                                  // the last element
        if (r == 9) std::fill(row, row + V / 2, NAN), row[V - 1] = NAN;  // leading NaNs
      }
      dz::test::DeviceBuffer<float> dl(logits), dout(size_t(rows) * size_t(V));
      DZ_CUDA_CHECK(cudaMemset(dout.p, 0xff, dout.n * 4));
      // Every other row copied, in reverse order; the others not copied.
      std::vector<float*> dst(static_cast<size_t>(rows), nullptr);
      for (int r = 0; r < rows; r += 2) dst[size_t(r)] = dout.p + size_t(rows - 1 - r) * size_t(V);
      dz::test::DeviceBuffer<float*> dd(dst);
      dz::test::DeviceBuffer<int32_t> da(static_cast<size_t>(rows));
      dz::cuda::logits_argmax_copy(dl.p, rows, V, dd.p, da.p, ctx.stream());
      ctx.sync();
      const auto am = da.get();
      const auto out = dout.get();
      for (int r = 0; r < rows; ++r) {
        INFO("row " << r);
        const float* row = logits.data() + size_t(r) * size_t(V);
        CHECK(am[size_t(r)] == dz::cpu::argmax(row, V));
        const float* o = out.data() + size_t(rows - 1 - r) * size_t(V);
        if (r % 2 == 0)
          CHECK(std::memcmp(o, row, size_t(V) * 4) == 0);
        else
          CHECK(std::all_of(o, o + V, [](float x) { return std::isnan(x); }));  // untouched (0xff bytes)
      }
      if (rows > 8) {
        CHECK(am[6] == -1);
        CHECK(am[7] == 0);
        CHECK(am[8] == V - 1);
      }
      // No copies at all: argmax only.
      dz::test::DeviceBuffer<int32_t> db(static_cast<size_t>(rows));
      dz::cuda::logits_argmax_copy(dl.p, rows, V, nullptr, db.p, ctx.stream());
      ctx.sync();
      CHECK(db.get() == am);
    }
#endif
}
