// Decode steps as CUDA graphs, for every CUDA family. A step's launches depend
// on the host only through a few values (rows, grid buckets, the addresses of
// its buffers): those make its key. The data under the launches (tokens,
// positions, page tables) is uploaded before each step, so one key's graph
// serves many steps.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace dz::cuda {

// The smallest power of two >= n (1 for n <= 1): buckets of the sizes a graph's grids are cut for.
inline int64_t pow2_at_least(int64_t n) {
  int64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

class GraphCache {
 public:
  using Key = std::vector<int64_t>;
  // `family` names the model in the warning a failed capture logs.
  GraphCache(const char* family, size_t max_graphs);
  ~GraphCache();
  GraphCache(const GraphCache&) = delete;
  GraphCache& operator=(const GraphCache&) = delete;

  // Graphs are on unless the environment has DZ_CUDA_GRAPHS=0 (read at each
  // call) or a capture failed in this cache.
  bool enabled() const;
  // Runs one step on s through enqueue(capturing). A key's first step runs
  // eagerly (cuBLASLt plans, kernel attributes and scratch are set up outside
  // any capture), its second is captured and replayed, later ones replayed;
  // with graphs off, every step is eager. `enqueue` must not synchronise the
  // stream while capturing. A failed capture logs a warning, drops every graph
  // and runs the step eagerly, as every later one.
  void run(const Key& key, cudaStream_t s, const std::function<void(bool capturing)>& enqueue);
  // Drops every graph (a buffer they read was freed).
  void clear();

 private:
  struct Graph {
    Key key;
    cudaGraphExec_t exec = nullptr;  // null: seen once, captured at its next step
    uint64_t used = 0;
  };
  const char* family_;
  size_t max_;
  std::vector<Graph> graphs_;
  uint64_t tick_ = 0;
  bool broken_ = false;
};

}  // namespace dz::cuda
