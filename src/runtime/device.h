// What compute devices this build and machine offer.
#pragma once
#include <string>

namespace dz {
bool cuda_compiled();                   // the CUDA backend is in this build
int cuda_device_count();                // 0 when no driver/GPU (never throws)
std::string runtime_devices_summary();  // "cpu; cuda: 1 x NVIDIA H200 (sm_90)"
}  // namespace dz
