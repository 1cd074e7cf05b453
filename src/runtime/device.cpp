#include "runtime/device.h"

#include <atomic>
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

void require_cuda_device(const char* who) {
  check(cuda_compiled(), DZ_ERR_UNSUPPORTED, who,
        ": this build has no CUDA backend (configure with DZ_CUDA=ON); use DZ_DEVICE_CPU");
  check(cuda_device_count() > 0, DZ_ERR_DEVICE, who,
        ": DZ_DEVICE_CUDA requested but no CUDA device is present (driver or GPU missing); use DZ_DEVICE_CPU or "
        "DZ_DEVICE_AUTO");
}

static std::atomic<uint64_t> g_graph_replays{0};
uint64_t cuda_graph_replays() { return g_graph_replays.load(std::memory_order_relaxed); }
void note_cuda_graph_replay() { g_graph_replays.fetch_add(1, std::memory_order_relaxed); }

std::string runtime_devices_summary() {
  return cat("cpu (", std::thread::hardware_concurrency(), " threads); cuda: ", cuda_devices_summary());
}

}  // namespace dz
