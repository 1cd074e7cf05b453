// Device discovery for the CUDA backend. Never throws: a machine without a
// driver or GPU simply has zero devices and the CPU backend serves.
#include <cuda_runtime.h>

#include <string>

namespace dz {

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::string cuda_devices_summary() {
  const int n = cuda_device_count();
  if (n == 0) return "no device";
  std::string s;
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
    s += (s.empty() ? "" : ", ") + std::string(p.name) + " (sm_" + std::to_string(p.major) + std::to_string(p.minor) +
         ", " + std::to_string(p.totalGlobalMem >> 30) + " GiB)";
  }
  return s;
}

}  // namespace dz
