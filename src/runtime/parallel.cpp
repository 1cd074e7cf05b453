#include "runtime/parallel.h"

#include <algorithm>

namespace dz {

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = int(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < n_threads; ++i) workers_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

// Claim chunks until none is left; record the first exception.
void ThreadPool::run_chunks() {
  for (;;) {
    size_t b;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (next_ >= n_ || error_) return;
      b = next_;
      next_ = std::min(n_, next_ + chunk_);
    }
    try {
      (*fn_)(b, std::min(n_, b + chunk_));
    } catch (...) {
      std::lock_guard<std::mutex> lk(mu_);
      if (!error_) error_ = std::current_exception();
    }
  }
}

void ThreadPool::worker(int) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      wake_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    run_chunks();
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (--pending_ == 0) done_.notify_all();
    }
  }
}

void ThreadPool::parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn) {
  if (n == 0) return;
  grain = std::max<size_t>(grain, 1);
  const size_t threads = workers_.size() + 1;
  if (workers_.empty() || n <= grain) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> call(call_mu_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    fn_ = &fn;
    n_ = n;
    next_ = 0;
    // A few chunks per thread balances uneven work without much locking.
    chunk_ = std::max(grain, (n + threads * 4 - 1) / (threads * 4));
    error_ = nullptr;
    pending_ = int(workers_.size());
    ++generation_;
  }
  wake_.notify_all();
  run_chunks();
  std::exception_ptr err;
  {
    std::unique_lock<std::mutex> lk(mu_);
    done_.wait(lk, [&] { return pending_ == 0; });
    err = error_;
    fn_ = nullptr;
  }
  if (err) std::rethrow_exception(err);
}

}  // namespace dz
