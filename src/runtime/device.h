// What compute devices this build and machine offer.
#pragma once
#include <cstdint>
#include <string>

namespace dz {
bool cuda_compiled();     // the CUDA backend is in this build
int cuda_device_count();  // 0 when no driver/GPU (never throws)
// Throws, naming `who` (a family), where DZ_DEVICE_CUDA cannot be served: DZ_ERR_UNSUPPORTED in a build without
// the CUDA backend, DZ_ERR_DEVICE on a machine without a CUDA device.
void require_cuda_device(const char* who);
std::string runtime_devices_summary();  // "cpu; cuda: 1 x NVIDIA H200 (sm_90)"
// Decode steps run as CUDA graph replays so far in this process, all models together (tests check that the graph
// path was taken; 0 without CUDA). Graphs are on unless the environment has DZ_CUDA_GRAPHS=0 (read at each step).
uint64_t cuda_graph_replays();
void note_cuda_graph_replay();  // cuda::GraphCache, at each replay
}  // namespace dz
