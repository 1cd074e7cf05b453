// GPU tests run only where a CUDA device is present; elsewhere they say why
// they skipped (a WARN in the test output) and pass.
#pragma once

#include <catch2/catch.hpp>

#include "runtime/device.h"

namespace dz::test {

inline bool have_gpu() {
  if (!dz::cuda_compiled()) {
    WARN("CUDA backend not compiled in: skipped");
    return false;
  }
  if (dz::cuda_device_count() == 0) {
    WARN("no CUDA device present: skipped");
    return false;
  }
  return true;
}

}  // namespace dz::test
