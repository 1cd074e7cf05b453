// GPU test of the weights' pipelined upload (runtime/cuda/upload.h): random
// bytes of many sizes, through staging buffers small enough that pieces cross
// them, at unaligned device offsets, with the host source overwritten as soon
// as each copy returns; progress reports and cancellation. Through the API:
// opening the gpt-oss fixture on the GPU reports "upload weights" and stops on
// request ([cuda]; skips with a message where no CUDA device is present).
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "dayzero.h"

#ifdef DZ_WITH_CUDA
#include "runtime/cuda/upload.h"
#include "support/device_buffer.h"
#endif

#include "support/gpu.h"

TEST_CASE("CUDA weight upload: bytes land exactly, progress adds up, cancel stops", "[cuda]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  std::mt19937_64 rng(11);
  // Sizes around the 1 MiB staging buffers and the 1 MiB host slices.
  const std::vector<size_t> sizes = {1,
                                     3,
                                     4095,
                                     size_t(1) << 20,
                                     (size_t(1) << 20) + 17,
                                     777,
                                     65536,
                                     (5u << 20) + 3,
                                     12345,
                                     (size_t(3) << 20) - 1,
                                     (1u << 20) - 5};
  size_t total = 0;
  for (size_t n : sizes) total += n + 7;  // 7: the gap that leaves each destination unaligned
  std::vector<uint8_t> want(total);
  for (auto& b : want) b = uint8_t(rng());
  dz::test::DeviceBuffer<uint8_t> dev(total);
  DZ_CUDA_CHECK(cudaMemset(dev.p, 0, total));

  std::vector<uint64_t> seen;
  {
    dz::cuda::Uploader up(
        total,
        [&](uint64_t done, uint64_t t) {
          CHECK(t == total);
          seen.push_back(done);
          return false;
        },
        3, size_t(1) << 20);
    size_t off = 0;
    std::vector<uint8_t> src;
    for (size_t n : sizes) {
      off += 7;
      src.assign(want.begin() + long(off - 7), want.begin() + long(off + n));
      // Bytes 7.. of the source go to off (the first 7 stay zero on the device).
      up.copy(dev.p + off, src.data() + 7, n);
      std::fill(src.begin(), src.end(), uint8_t(0xA5));  // released: the copy must not read it again
      for (size_t i = 0; i < 7; ++i) want[off - 7 + i] = 0;
      off += n;
    }
    up.finish();
    CHECK(up.done() == total - 7 * sizes.size());
  }
  const std::vector<uint8_t> got = dev.get();
  size_t bad = 0;
  for (size_t i = 0; i < total; ++i) bad += got[i] != want[i];
  CHECK(bad == 0);
  REQUIRE(!seen.empty());
  for (size_t i = 1; i < seen.size(); ++i) CHECK(seen[i] > seen[i - 1]);
  CHECK(seen.back() == total - 7 * sizes.size());

  // Cancelled once 2 MiB are staged: the copy throws DZ_ERR_CANCELLED; the
  // uploader is destroyed cleanly, and a new one works.
  {
    dz::cuda::Uploader up(
        total, [](uint64_t done, uint64_t) { return done > (size_t(2) << 20); }, 2, size_t(1) << 20);
    try {
      up.copy(dev.p, want.data(), size_t(5) << 20);
      FAIL("no cancellation");
    } catch (const dz::Error& e) {
      CHECK(e.status() == DZ_ERR_CANCELLED);
      CHECK(std::string(e.what()).find("progress callback") != std::string::npos);
    }
  }
  {
    dz::cuda::Uploader up(16);
    const uint8_t b[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
    up.copy(dev.p + 1, b, 16);
    up.finish();
    const std::vector<uint8_t> g = dev.get();
    CHECK(std::memcmp(g.data() + 1, b, 16) == 0);
  }
#endif
}

namespace {
struct Seen {
  std::vector<std::string> stages;
  std::vector<uint64_t> done, total;
  bool cancel_upload = false;
};
int record(const char* stage, uint64_t done, uint64_t total, void* user) {
  auto* s = static_cast<Seen*>(user);
  s->stages.emplace_back(stage), s->done.push_back(done), s->total.push_back(total);
  return s->cancel_upload && std::string(stage) == "upload weights";
}
}  // namespace

TEST_CASE("gpt-oss on the GPU: dz_model_open reports the weight upload and stops when asked", "[cuda]") {
  if (!dz::test::have_gpu()) return;
  const std::string dir = std::string(DZ_TEST_DATA) + "/gpt_oss_tiny";
  for (const bool cancel : {false, true}) {
    INFO("cancel " << cancel);
    Seen seen;
    seen.cancel_upload = cancel;
    dz_model_params mp;
    dz_model_params_init(&mp);
    mp.device = DZ_DEVICE_CUDA;
    mp.progress = record;
    mp.progress_user = &seen;
    dz_model* m = nullptr;
    const dz_status st = dz_model_open(dir.c_str(), &mp, &m);
    REQUIRE(!seen.stages.empty());
    CHECK(seen.stages.front() == "validate shards");
    CHECK(seen.stages.back() == "upload weights");
    if (cancel) {
      CHECK(st == DZ_ERR_CANCELLED);
      CHECK(m == nullptr);
      CHECK(std::string(dz_last_error()).find("progress callback") != std::string::npos);
      CHECK(std::count(seen.stages.begin(), seen.stages.end(), "upload weights") == 1);
    } else {
      REQUIRE(st == DZ_OK);
      CHECK(seen.done.back() == seen.total.back());
      uint64_t prev = 0;
      int ends = 0;  // reports of the whole upload: the last one only
      for (size_t i = 0; i < seen.stages.size(); ++i)
        if (seen.stages[i] == "upload weights") {
          CHECK(seen.done[i] >= prev);
          prev = seen.done[i];
          ends += seen.done[i] == seen.total[i];
        }
      CHECK(ends == 1);
      dz_model_free(m);
    }
  }
}
