// Deterministic pseudo-random device fills (counter-based hash of seed and
// index) for benchmarks and tests: the same seed gives the same bytes anywhere.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace dz::cuda {

void fill_random_u8(uint8_t* p, size_t n, uint64_t seed, int lo, int hi, cudaStream_t s);  // uniform in [lo, hi]
void fill_random_bf16(uint16_t* p, size_t n, uint64_t seed, float scale, cudaStream_t s);  // ~ N(0, scale^2)
void fill_random_f32(float* p, size_t n, uint64_t seed, float scale, cudaStream_t s);      // ~ N(0, scale^2)

// Evict the L2 by reading bytes (clean lines: no write-back charged to the next
// kernel, unlike a memset flush); sink receives a value so the reads stay.
void l2_flush_read(const void* buf, size_t bytes, float* sink, cudaStream_t s);

// A plain streaming read of bytes (bytes % 16 == 0, 16-byte aligned), tuned for
// tens of megabytes: what reading a small batch's expert bytes can take at
// best, ramp-up and tail included (benchmark reference, not a kernel of the model).
void stream_read(const void* buf, size_t bytes, float* sink, cudaStream_t s);

}  // namespace dz::cuda
