// Built with the CUDA backend only.
#ifdef DZ_WITH_CUDA

#include "runtime/cuda/graph_cache.h"

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <string>

#include "common/log.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/device.h"

namespace dz::cuda {

GraphCache::GraphCache(const char* family, size_t max_graphs)
    : family_(family), max_(std::max<size_t>(1, max_graphs)) {}

GraphCache::~GraphCache() { clear(); }

bool GraphCache::enabled() const {
  const char* e = std::getenv("DZ_CUDA_GRAPHS");
  return !broken_ && !(e && e[0] == '0' && e[1] == 0);
}

void GraphCache::clear() {
  for (Graph& g : graphs_)
    if (g.exec) cudaGraphExecDestroy(g.exec);
  graphs_.clear();
}

void GraphCache::run(const Key& key, cudaStream_t s, const std::function<void(bool)>& enqueue) {
  if (!enabled()) return enqueue(false);
  auto it = std::find_if(graphs_.begin(), graphs_.end(), [&](const Graph& g) { return g.key == key; });
  if (it == graphs_.end()) {
    if (graphs_.size() >= max_) {
      auto lru = std::min_element(graphs_.begin(), graphs_.end(),
                                  [](const Graph& a, const Graph& b) { return a.used < b.used; });
      if (lru->exec) DZ_CUDA_CHECK(cudaGraphExecDestroy(lru->exec));
      graphs_.erase(lru);
    }
    graphs_.push_back({key, nullptr, ++tick_});
    return enqueue(false);
  }
  it->used = ++tick_;
  if (!it->exec) {
    // Thread-local mode: other threads' CUDA calls are not affected.
    DZ_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    cudaGraph_t g = nullptr;
    std::string err;
    try {
      enqueue(true);
    } catch (const std::exception& e) {
      err = e.what();
    }
    const cudaError_t ec = cudaStreamEndCapture(s, &g);
    if (err.empty() && ec != cudaSuccess) err = cat("cudaStreamEndCapture: ", cudaGetErrorString(ec));
    cudaGraphExec_t exec = nullptr;
    if (err.empty()) {
      const cudaError_t ei = cudaGraphInstantiate(&exec, g, 0);
      if (ei != cudaSuccess) err = cat("cudaGraphInstantiate: ", cudaGetErrorString(ei)), exec = nullptr;
    }
    if (g) cudaGraphDestroy(g);
    if (!err.empty()) {
      cudaGetLastError();
      broken_ = true;
      clear();
      log_warn(family_, " CUDA: capturing a decode step as a CUDA graph failed (", err,
               "); decoding without graphs from now on");
      return enqueue(false);
    }
    it->exec = exec;
  }
  DZ_CUDA_CHECK(cudaGraphLaunch(it->exec, s));
  note_cuda_graph_replay();
}

}  // namespace dz::cuda

#endif  // DZ_WITH_CUDA
