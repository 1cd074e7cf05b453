// A small fixed thread pool with a blocking parallel_for. One pool per model;
// calls from different threads are serialised (a model may be shared across
// threads; its forward passes then take turns on the pool).
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace dz {

class ThreadPool {
 public:
  // n_threads <= 0: std::thread::hardware_concurrency().
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }  // workers + the calling thread
  // Run fn(begin, end) over [0, n) split into contiguous ranges of at least
  // `grain` items, on every thread including the caller. Blocks until done;
  // the first exception thrown by fn is rethrown here.
  void parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn);

 private:
  void worker(int index);
  void run_chunks();

  std::vector<std::thread> workers_;
  std::mutex call_mu_;  // one parallel_for at a time
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(size_t, size_t)>* fn_ = nullptr;
  size_t n_ = 0, chunk_ = 1, next_ = 0;
  int pending_ = 0;          // workers still busy with the current job
  uint64_t generation_ = 0;  // bumps per job
  bool stop_ = false;
  std::exception_ptr error_;
};

// Threads of a helper pool beside the compute (host copies of logits rows,
// sampling a batch's sessions): half the cores, 1 to 8.
inline int helper_threads() { return int(std::clamp(std::thread::hardware_concurrency() / 2, 1u, 8u)); }

// parallel_for on pool, or inline when pool is null.
inline void parallel_for(ThreadPool* pool, size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn) {
  if (pool)
    pool->parallel_for(n, grain, fn);
  else if (n)
    fn(0, n);
}

}  // namespace dz
