// What the standalone HBM probes of tools/bench share (they build with nvcc alone, without the library).
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

// A CUDA runtime call that must succeed: the call, file, line and CUDA's message on stderr, then exit 1.
#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)
