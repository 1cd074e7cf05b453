// Programmatic dependent launch (sm_90) for the small per-layer kernels of the
// decode path: the next kernel's launch overlaps the tail of the previous one
// (in streams and in CUDA graphs). A kernel launched this way must call
// pdl_wait() before it touches global memory: it returns once the previous
// kernel in the stream has completed and its writes are visible.
// DZ_CUDA_PDL=0 in the environment launches them plainly (debugging).
#pragma once
#include <cuda_runtime.h>

#include <cstdlib>

#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
// Lets the next kernel launch before this one ends: once every block of this
// grid has called it (or exited), the next grid's blocks may become resident and
// issue what does not depend on this kernel (weight loads) while it runs; their
// pdl_wait() still waits for this kernel's completion. Called right after
// pdl_wait(): one kernel of look-ahead, no chain of waiting grids.
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

inline bool pdl_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("DZ_CUDA_PDL");
    return !(e && e[0] == '0' && e[1] == 0);
  }();
  return on;
}

// Launch k, as a programmatic dependent of the previous kernel in s when pdl;
// cooperative: all of its blocks resident at once or none (a grid whose
// blocks wait for each other; at most the blocks that fit the device at once).
template <typename... P, typename... A>
void launch_ex(bool pdl, bool cooperative, void (*k)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
               A... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cooperative) {
    attr[n].id = cudaLaunchAttributeCooperative;
    attr[n++].val.cooperative = 1;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  DZ_CUDA_CHECK(cudaLaunchKernelEx(&cfg, k, P(args)...));
}

template <typename... P, typename... A>
void launch_maybe_pdl(bool pdl, void (*k)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, A... args) {
  launch_ex(pdl, false, k, grid, block, smem, s, args...);
}

template <typename... P, typename... A>
void launch_pdl(void (*k)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, A... args) {
  launch_maybe_pdl(pdl_enabled(), k, grid, block, smem, s, args...);
}

}  // namespace dz::cuda
