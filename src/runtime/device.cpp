#include "runtime/device.h"

#include <thread>

#include "common/error.h"

namespace dz {

#ifdef DZ_WITH_CUDA
std::string cuda_devices_summary();  // kernels/cuda/device.cu
bool cuda_compiled() { return true; }
#else
bool cuda_compiled() { return false; }
int cuda_device_count() { return 0; }
static std::string cuda_devices_summary() { return "not compiled in"; }
#endif

std::string runtime_devices_summary() {
  return cat("cpu (", std::thread::hardware_concurrency(), " threads); cuda: ", cuda_devices_summary());
}

}  // namespace dz
