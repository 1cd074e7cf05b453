// KV arenas in device memory: the kv::Storage a CUDA family returns from
// Family::kv_storage(), one cudaMalloc per arena (zero-filled), on the device
// the model was opened on.
#pragma once

#include <memory>

#include "kv/arena.h"

namespace dz::cuda {

using KvStorageFn = std::unique_ptr<kv::Storage> (*)(size_t);
constexpr int kMaxKvDevices = 8;  // device ordinals 0..7 (the arena takes a plain function pointer)

// The factory for device ordinal dev; throws DZ_ERR_INVALID_ARGUMENT outside 0..kMaxKvDevices-1.
KvStorageFn device_kv_storage(int dev);

}  // namespace dz::cuda
