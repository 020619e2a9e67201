// A fixed pool of worker threads that runs index-parallel jobs.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace fastload {

class ThreadPool {
 public:
  explicit ThreadPool(unsigned num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  unsigned size() const { return static_cast<unsigned>(workers_.size()); }

  // Runs fn(i) for every i in [0, count) on the workers and the calling thread,
  // and returns once all calls have returned. fn must not throw. Safe to call
  // from several threads at once: jobs are served in arrival order.
  void parallel_for(std::size_t count, const std::function<void(std::size_t)>& fn);

 private:
  struct Job;
  void worker_loop();
  // Claims and runs indices of job until none are left.
  static void drain(Job& job);

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace fastload
